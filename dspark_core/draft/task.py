"""DSpark as a :class:`~dspark_core.train.task.TrainTask` for the shared trainer.

Shape legend: B batch, L tokens, A anchors, S slots, K aux layers, Ht target hidden, V vocab.

- ``collate``: pad cache items (``CacheCollator``), then sample each sample's anchors with its own
  generator and derive the slot supervision (``anchors.add_anchor_fields``). Online (``train.hidden_states:
  online``) the items carry tokens only, and the batch a host-side plan of its target forwards.
- ``prepare_step``: online, the frozen target's hidden states of each micro-batch (``cache/online.py``: the bits
  the cache would hold), then the draft's ``prepare_batch``.
- ``denominators``: ``weight`` (sum of ``exp(-j/gamma)`` over valid slots, the loss terms'), ``blocks``
  (valid blocks, tau_prob's) and ``tokens@i`` (valid tokens of slot i, accept_rate@i's).
- ``forward_sums``: ``model(batch)`` -- the model is a :class:`DSparkTrainModel` (draft + loss), so DDP
  sees one forward -- returning ``distill``, ``confidence`` (loss terms) and ``ce``, ``l1``, ``conf``,
  ``tau_prob``, ``accept_rate@i`` (metrics).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.draft.packing import collate_packed, sample_places
from dspark_core.draft.loss import dspark_sums, slot_weights
from dspark_core.draft.model import DSparkDraft, build_draft, draft_class
from dspark_core.draft.vocab import RANKING_PATH, load_ranked_vocab
from dspark_core.errors import UserError
from dspark_core.metrics import block_counts
from dspark_core.train.task import TermSpec

BATCH_TENSORS = ("input_ids", "aux_hidden", "last_hidden", "anchors", "anchor_valid", "targets", "prev_tokens",
                 "slot_valid")


class DSparkTrainModel(nn.Module):
    """The trained module: the draft plus its loss, ``forward(batch) -> sums`` (one call, DDP-friendly)."""

    def __init__(self, draft: DSparkDraft, loss_cfg: LossConfig) -> None:
        super().__init__()
        self.draft = draft
        self.loss_cfg = loss_cfg

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [k for k in BATCH_TENSORS if k not in batch]
        if missing:
            raise UserError(f"DSpark batch lacks {missing} (was it made by DSparkTask.collate?)")
        hidden = self.draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"],
                                          batch["anchor_valid"], extras=batch)  # [B, A, S, H]
        return dspark_sums(self.draft, hidden, batch, self.loss_cfg, extras=batch)


def load_warm_start(model: nn.Module, ckpt_dir: Path, target_fingerprint: str | None = None) -> None:
    """Copy a trainer checkpoint (``ckpt_dir/model.safetensors``: the trainable weights of another variant's
    ``DSparkTrainModel``), or a saved draft (``save_draft``: ``config.json`` beside it, the draft's own weights,
    made on the target of ``target_fingerprint``; or a DeepSpec- / speculators-layout draft, checked by vocabulary,
    width, layer ids and block size instead), into ``model``. Each of its weights must exist here with the
    same shape; weights it lacks (a variant's own new modules) keep their initialisation."""
    from dspark_core.checkpoint import load_checked_weights

    path = ckpt_dir / "model.safetensors"
    if not path.is_file():
        raise UserError(f"warm start: {path} not found (is the step among the run's kept checkpoints?)")
    if (ckpt_dir / "config.json").is_file():  # a saved draft: its names are the draft's, the trainer's say draft.*
        from dspark_core.export import detect_layout, foreign_warm_start

        if detect_layout(ckpt_dir) is not None:  # DeepSpec / speculators layout: checked by shapes and layer ids
            weights = foreign_warm_start(ckpt_dir, model.draft)
        else:
            _check_saved_fingerprint(ckpt_dir, target_fingerprint)
            weights = load_checked_weights(ckpt_dir, f"retrain the warm start's source run or restore {ckpt_dir}")
        weights = {f"draft.{k}": v for k, v in weights.items()}
    else:
        weights = load_checked_weights(ckpt_dir, f"retrain the warm start's source run or restore {ckpt_dir}")
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}  # buffers: a draft vocabulary's maps
    bad = [k for k, v in weights.items() if k not in params or tuple(params[k].shape) != tuple(v.shape)]
    if bad:
        raise UserError(f"warm start: {path} does not fit this draft ({bad[:3]} unknown or of another shape)")
    with torch.no_grad():
        for k, v in weights.items():
            params[k].copy_(v)


def _check_saved_fingerprint(ckpt_dir: Path, target_fingerprint: str | None) -> None:
    from dspark_core.checkpoint import read_draft_config

    saved = read_draft_config(ckpt_dir)["target"].get("fingerprint")
    if target_fingerprint is not None and saved not in (None, target_fingerprint):
        raise UserError(f"warm start: {ckpt_dir / 'config.json'}: draft trained on target fingerprint {saved}, "
                        f"this target's is {target_fingerprint}")


def freeze_all_but_variant(model: nn.Module) -> None:
    """Only the variant's own parameters (``draft.variant_params()``) stay trainable."""
    draft = getattr(model, "draft", model)
    own = {id(p) for p in getattr(draft, "variant_params", dict)().values()}
    if not own:
        raise UserError(f"warm_start.freeze_base: draft.kind {draft.cfg.kind!r} has no parameters of its own")
    for p in model.parameters():
        if id(p) not in own:
            p.requires_grad_(False)


def draft_denominators(slot_valid: torch.Tensor, gamma: float) -> dict[str, torch.Tensor]:
    """Data-only denominators of one micro-batch from slot_valid [B, A, S]."""
    blocks, tokens = block_counts(slot_valid)
    dens = {"weight": slot_weights(slot_valid, gamma).sum(), "blocks": blocks.float()}
    for i in range(tokens.shape[0]):
        dens[f"tokens@{i}"] = tokens[i].float()
    return dens


# draft.kind -> its training task, for the kinds with loss terms of their own (the rest train DSparkTask)
TASK_CLASSES: dict[str, type["DSparkTask"]] = {}


def task_class(kind: str) -> type["DSparkTask"]:
    """The training task of ``draft.kind``: ``DSparkTask``, or a variant's subclass adding its loss terms."""
    draft_class(kind)  # an unknown kind is refused here, by name
    return TASK_CLASSES.get(kind, DSparkTask)


class DSparkTask:
    """The DSpark baseline training task.

    ``target_config`` + ``embed_weight`` / ``lm_head_weight`` [V, Ht] come from the target (the rest of
    the target is not needed); ``train_data`` is indexable (``CacheDataset`` items). ``collator`` pads
    a list of items (default ``CacheCollator(pad_id)``). ``online_target(device)``: makes the frozen target
    (``cache.online.OnlineTarget``) that fills each micro-batch's hidden states on the training device (called by
    ``build_model``, so each process holds its own); the items are then ``CacheDataset(hidden_states="online")``'s.
    """

    name = "dspark"
    vocab_ranking_path = RANKING_PATH  # the draft_vocab stage's output (read when draft.vocab_size is set)

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        """``class MyTask(DSparkTask, kind="my_kind")``: the training task of ``draft.kind: my_kind``."""
        super().__init_subclass__(**kwargs)
        if kind is not None:
            old = TASK_CLASSES.get(kind)
            if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"draft.kind {kind!r} has two tasks: {old.__qualname__} and {cls.__qualname__}")
            TASK_CLASSES[kind] = cls

    def __init__(self, draft_cfg: DraftConfig, loss_cfg: LossConfig, *, target_config: Any,
                 embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, aux_layer_ids: Sequence[int],
                 train_data: Sequence[Any], pad_id: int = 0, target_fingerprint: str | None = None,
                 collator: Callable[[list[Any]], dict[str, torch.Tensor]] | None = None,
                 attention_backend: str = "auto", gradient_checkpointing: bool = False,
                 init_checkpoint: str | Path | None = None, freeze_base: bool = False,
                 online_target: Callable[[torch.device], Any] | None = None) -> None:
        self.draft_cfg, self.loss_cfg = draft_cfg, loss_cfg
        self.online_target, self.target = online_target, None  # the target: built with the model
        self.init_checkpoint, self.freeze_base = init_checkpoint, freeze_base
        self.target_config = target_config
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.data = train_data
        self.pad_id = pad_id
        self.target_fingerprint = target_fingerprint
        self.collator = collator
        self.attention_backend = attention_backend
        self.gradient_checkpointing = gradient_checkpointing
        self.terms = {"distill": TermSpec(1.0, "weight")}
        if draft_cfg.confidence_head:
            self.terms["confidence"] = TermSpec(loss_cfg.conf_alpha, "weight")
        self.metric_denominators = {"ce": "weight", "l1": "weight", "tau_prob": "blocks"}
        if draft_cfg.confidence_head:
            self.metric_denominators["conf"] = "weight"
        for i in range(draft_cfg.block_size):
            self.metric_denominators[f"accept_rate@{i}"] = f"tokens@{i}"

    @classmethod
    def from_paths(cls, draft_cfg: DraftConfig, loss_cfg: LossConfig, target_dir: str | Path,
                   cache_path: str | Path, max_length: int | None = None, hidden_states: str = "cache",
                   target_compile: bool = True, **kwargs: Any) -> "DSparkTask":
        """The task on a target HF dir and a cache store (checked against the target's fingerprint).
        ``hidden_states: online``: the store's tokens only, the target run on each micro-batch (the store's compute
        dtype; its states as the store's reader gives them, bf16; ``target_compile``: its layers compiled on a GPU,
        ``OnlineTarget``)."""
        from dspark_core.cache.dataset import CacheDataset
        from dspark_core.frozen_target import load_frozen_target
        from dspark_core.target import read_fingerprint

        model, pad_id = load_frozen_target(target_dir)  # config, embedding, LM head: no target layers
        fingerprint = read_fingerprint(target_dir)["fingerprint"]
        data = CacheDataset(cache_path, expected_fingerprint=fingerprint, max_length=max_length,
                            dtype=torch.bfloat16, hidden_states=hidden_states)
        if hidden_states == "online":
            from dspark_core.cache.online import OnlineTarget

            kwargs["online_target"] = functools.partial(OnlineTarget.load, target_dir, data.manifest,
                                                        dtype=data.dtype, compiled=target_compile)
        pad_id = pad_id if pad_id is not None else 0
        return cls(draft_cfg, loss_cfg, target_config=model.config,
                   embed_weight=model.get_input_embeddings().weight.detach(),
                   lm_head_weight=model.get_output_embeddings().weight.detach(), aux_layer_ids=data.layer_ids,
                   train_data=data, pad_id=pad_id, target_fingerprint=fingerprint, **kwargs)

    # -- TrainTask -------------------------------------------------------------------------------------
    def build_model(self, device: torch.device, dtype: torch.dtype) -> DSparkTrainModel:
        """Draft + loss on ``device``, trainable weights in ``dtype``. On GPU the frozen embedding / LM head
        are kept in bf16: the trainer computes in bf16 autocast there, and the LM-head matmuls dominate."""
        draft = build_draft(self.draft_cfg, self.target_config, self.embed_weight, self.lm_head_weight,
                            aux_layer_ids=self.aux_layer_ids, target_fingerprint=self.target_fingerprint)
        if hasattr(draft, "load_frozen_sources"):  # e.g. a frozen Engram table built by the engram_build stage
            draft.load_frozen_sources()
        if draft.draft_vocab is not None:  # draft.vocab_size: the first N tokens of the draft_vocab stage's ranking
            share = load_ranked_vocab(draft.draft_vocab, self.vocab_ranking_path, self.target_fingerprint)
            print(f"draft vocabulary: the {draft.draft_vocab.size:,} most frequent of {draft.vocab_size:,} tokens, "
                  f"{share:.2%} of the train answer tokens")
        draft.attention_backend = self.attention_backend
        draft.gradient_checkpointing = self.gradient_checkpointing
        draft = draft.to(device=device, dtype=dtype)
        if torch.device(device).type == "cuda":
            draft.set_frozen_dtype(torch.bfloat16)
        model = DSparkTrainModel(draft, self.loss_cfg)
        if self.init_checkpoint is not None:
            load_warm_start(model, Path(self.init_checkpoint), self.target_fingerprint)
        if self.freeze_base:
            freeze_all_but_variant(model)
        if self.online_target is not None:  # not a part of the model: no optimiser, DDP or checkpoint sees it
            self.target = self.online_target(torch.device(device))
        return model

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """One group for the draft; a trainable Engram table gets its own (``draft.engram.lr``, ``sparse``)."""
        table = getattr(getattr(model, "draft", model), "engram_table", None)
        table_ids = {id(p) for p in table.parameters()} if table is not None else set()
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in table_ids]
        groups: list[dict[str, Any]] = [{"params": rest}]
        if table is not None:
            eng = self.draft_cfg.engram
            groups.append({"params": [p for p in table.parameters() if p.requires_grad], "lr": eng.lr,
                           "sparse": eng.sparse})
        return groups

    def train_dataset(self) -> Sequence[Any]:
        return self.data

    def collate(self, items: list[Any],
                generator: torch.Generator | Sequence[torch.Generator]) -> dict[str, torch.Tensor]:
        """Pad ``items`` and add anchors / slot supervision; ``generator``: one per item (or one shared). With
        ``draft.packed_length``, pack them into rows instead (``draft/packing.py``: the same anchors and loss)."""
        cfg = self.draft_cfg
        compact = cfg.anchor_slots == "compact"
        if cfg.packed_length is not None:
            batch = collate_packed(items, cfg.num_anchors, cfg.block_size, cfg.packed_length, generator, self.pad_id,
                                   compact)
            places = sample_places([len(it["input_ids"]) for it in items], cfg.packed_length)
        else:
            if self.collator is None:
                from dspark_core.cache.dataset import CacheCollator

                self.collator = CacheCollator(self.pad_id)
            batch = add_anchor_fields(self.collator(items), cfg.num_anchors, cfg.block_size, generator, compact)
            places = [(i, 0) for i in range(len(items))]
        if self.online_target is not None:  # the target forwards that fill the batch in prepare_step (host side)
            from dspark_core.cache.online import PLAN_KEY, target_forwards

            batch[PLAN_KEY] = target_forwards(items, places)
        return batch

    def prepare_step(self, model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Online, the target's hidden states of each micro-batch (``OnlineTarget.fill``: autocast off, no host
        read); then the draft's ``prepare_batch`` hook on each (no_grad; the trainer calls it before the
        denominators). The baseline's hook is the identity."""
        if self.online_target is not None:
            if self.target is None:
                raise RuntimeError("DSparkTask: online hidden states, but build_model has not made the target")
            batches = [self.target.fill(b) for b in batches]
        draft = getattr(model, "draft", model)
        return [draft.prepare_batch(b) for b in batches]

    def denominators(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return draft_denominators(batch["slot_valid"], self.loss_cfg.decay_gamma)

    def forward_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = next(p.device for p in model.parameters())
        batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        return model(batch)

    def export(self, model: nn.Module, out_dir: str | Path) -> Path:
        """Save the trained draft (``save_draft``) from the trainer's model (plain or DDP-wrapped)."""
        from dspark_core.checkpoint import save_draft

        inner = getattr(model, "module", model)
        return save_draft(out_dir, inner.draft, self.draft_cfg)
