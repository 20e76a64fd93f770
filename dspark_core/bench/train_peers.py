"""The training-step peer of ``benchmarks/bench_train_step.py --peers``: ``speculators``' own DSpark draft model and
loss, stepped in the numerics its trainer uses by default, in the same process as dspark's rows and on the same
random samples, so both are timed side by side on one device.

Its default numerics (``speculators.train``: the model built in float32, ``torch.autocast`` to bf16 around the
forward and loss, ``torch.optim.AdamW`` over the float32 weights, ``clip_grad_norm_`` at 1.0 before the step):
float32 weights and AdamW state, bf16 compute. The model is built as its trainer builds it
(``DSparkDraftModel.from_training_args``) against a stand-in verifier folder written here (the target's
``config.json`` and its tied embedding / LM head, random; nothing is downloaded). At a reduced draft vocabulary its
maps are the first N target ids (``t2d`` / ``d2t``, the ids the benchmark draws tokens from), so its teacher is
the verifier head over those N, as its trainer computes it. Loss: ``{"ce": 0.1, "tv": 0.9}`` plus the confidence
head (alpha 1.0), decay gamma 4, the benchmark's anchors; its forward is compiled by its own
``conditional_torch_compile`` on CUDA. ``loss_implementation``: its ``eager`` loss (how the reference rows of
``--reference`` were measured) or ``fused`` (its Triton loss).

Shape legend: L tokens of the sample, K aux layers, H target hidden size.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import torch

SPECULATORS_LOSS = '{"ce": 0.1, "tv": 0.9}'  # its --loss-fn, as the reference rows were measured


def speculators_available() -> bool:
    """Whether ``speculators`` (with its DSpark model) can be imported here."""
    import importlib.util

    return importlib.util.find_spec("speculators") is not None


def write_verifier(folder: Path, target_config: Any, lm: torch.Tensor) -> Path:
    """A stand-in verifier folder for ``from_training_args``: ``config.json`` of ``target_config`` and a
    ``model.safetensors`` with its tied embedding ``lm`` [V, H] and final norm (ones)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    target_config.save_pretrained(folder)
    save_file({"model.embed_tokens.weight": lm.detach().to("cpu", torch.bfloat16).contiguous(),
               "model.norm.weight": torch.ones(lm.shape[1], dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    return folder


class SpeculatorsStep:
    """``speculators``' DSpark draft and its training step in its default numerics on ``device``.

    ``target_config``: the target's (Qwen3) config; ``aux_layer_ids``: dspark's zero-based aux layers (passed to
    speculators as its hidden-state indices, one more each); ``draft_vocab_size``: None for the full vocabulary.
    ``attention``: its draft attention implementation (``simple_flex_attention``, its default, on CUDA; ``eager``
    where flex cannot train, e.g. a CPU smoke run)."""

    def __init__(self, target_config: Any, aux_layer_ids: tuple[int, ...], *, num_layers: int, block_size: int,
                 anchors: int, markov_rank: int, draft_vocab_size: int | None, mask_token_id: int,
                 device: torch.device, loss_implementation: str = "eager", attention: str = "simple_flex_attention",
                 lr: float = 1e-4, seed: int = 0) -> None:
        from speculators.models.dspark import DSparkDraftModel

        self.device = torch.device(device)
        vocab = target_config.vocab_size
        n = draft_vocab_size or vocab
        g = torch.Generator().manual_seed(seed)
        lm = torch.randn(vocab, target_config.hidden_size, generator=g).mul_(0.02)  # tied embedding / LM head
        t2d = d2t = None
        if n != vocab:  # draft id i is target id i (d2t offsets 0), the first n target ids kept
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[:n] = True
            d2t = torch.zeros(n, dtype=torch.long)
        layer_cfg = copy.deepcopy(target_config)  # the draft decoder's config: the target's, num_layers deep
        layer_cfg.num_hidden_layers = num_layers
        if getattr(layer_cfg, "layer_types", None):
            layer_cfg.layer_types = ["full_attention"] * num_layers
        torch.manual_seed(seed)
        with tempfile.TemporaryDirectory() as tmp:
            verifier = write_verifier(Path(tmp) / "verifier", target_config, lm)
            model = DSparkDraftModel.from_training_args(
                layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=str(verifier), draft_vocab_size=n,
                block_size=block_size, target_layer_ids=[a + 1 for a in aux_layer_ids], mask_token_id=mask_token_id,
                markov_rank=markov_rank, markov_head_type="vanilla", enable_confidence_head=True,
                confidence_head_with_markov=True, draft_attn_impl=attention)
        self.model = model.to(self.device).train()  # float32: its trainer's default
        self.kwargs, _ = DSparkDraftModel.get_trainer_kwargs(
            loss_fn=SPECULATORS_LOSS, loss_implementation=loss_implementation, max_anchors=anchors,
            confidence_head_alpha=1.0, dflash_decay_gamma=4.0)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)  # its build_optimizers("adamw")
        self.autocast = self.device.type == "cuda"  # bf16 autocast as its trainer; a CPU smoke run in float32

    @property
    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def inputs(self, item: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A benchmark sample (``input_ids [L]``, ``loss_mask [L]``, ``aux_hidden [L, K, H]``, ``last_hidden
        [L, H]``) as its forward's batch of one packed row (one document)."""
        length = item["input_ids"].shape[0]
        dtype = torch.bfloat16 if self.autocast else torch.float32  # its data's hidden states are bf16
        return {"hidden_states": item["aux_hidden"].reshape(1, length, -1).to(self.device, dtype),  # [1, L, K*H]
                "input_ids": item["input_ids"][None].to(self.device),  # [1, L]
                "loss_mask": item["loss_mask"][None].long().to(self.device),  # [1, L]
                "verifier_last_hidden_states": item["last_hidden"][None].to(self.device, dtype),  # [1, L, H]
                "document_ids": torch.zeros(1, length, dtype=torch.long, device=self.device)}  # [1, L]

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step as its trainer runs it (grads cleared, forward + loss in autocast, backward, clip, AdamW);
        returns the loss without synchronising."""
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            _, loss, _ = self.model(**batch, **self.kwargs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.detach()
