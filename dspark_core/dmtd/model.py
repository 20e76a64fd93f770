"""Parallel DMTD over a Hugging Face ``*ForCausalLM`` (seed 001 section 一): the teacher-forced forward.

The target itself is fine-tuned. Layers ``[0, P)`` (parallel) run on a P-stream of slots; layers
``[P, L)`` (sequential) run per real token on ``embed(x_i) + shadow_hidden_i``; then the final norm and
the LM head; the loss is plain next-token CE. One code path serves the four variants:

- norefresh P-stream: ``[shadow main (L) ; cycle tails (E)]``
- refresh   P-stream: ``[real (L) ; shadow main (L) ; cycle tails (E)]`` -- both branches in one forward
  with shared weights; the real branch only supplies K/V to later cycles' shadow queries.

The shadow slot at position i holds the real token when ``i % tau == 0`` (cycle head), else MASK, at
RoPE position i. Cycle tails complete each document's last cycle with MASK slots (positions past the
document end), so a bidirectional block always has ``tau`` slots, exactly as at inference time; causal
variants never see them and skip them. Who sees whom is decided by ``masks.visible`` on slot attributes
(position, cycle, document, kind), so packing with per-document position ids needs nothing more.

``PlainModel`` runs the unmodified target through the same layer code (all layers, causal, real tokens).

Shape legend: B batch, L tokens of a row, N P-stream slots, E tail slots, H hidden, V vocab, T supervised
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspark_core.dmtd.config import DMTDConfig, VariantRule, parse_variant
from dspark_core.dmtd.layers import KVSink, check_supported, rope, run_layers
from dspark_core.dmtd.masks import CAUSAL, Slots, dense_mask, flex_block_mask
from dspark_core.errors import UserError
from dspark_core.io import read_json

IGNORE = -100  # label of an unsupervised position


@dataclass(frozen=True)
class Layout:
    """The P-stream of one batch: token ids and slot attributes; shadow main slots are
    ``[shadow_start, shadow_start + L)`` and line up with the real positions of the input."""

    ids: torch.Tensor  # [B, N]
    slots: Slots       # [B, N]
    shadow_start: int
    length: int        # L


def default_positions(input_ids: torch.Tensor, position_ids, doc_ids):
    """Fill missing ``position_ids`` (0..L-1) and ``doc_ids`` (one document per row): ``[B, L]`` long each."""
    b, n = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(n, device=input_ids.device).expand(b, n)
    if doc_ids is None:
        doc_ids = torch.zeros(b, n, dtype=torch.long, device=input_ids.device)
    return position_ids.long(), doc_ids.long()


def shadow_token_ids(input_ids: torch.Tensor, pos: torch.Tensor, tau: int, mask_token_id: int) -> torch.Tensor:
    """``[B, L]``: the real token at cycle heads (``pos % tau == 0``), MASK elsewhere."""
    return torch.where(pos % tau == 0, input_ids, torch.full_like(input_ids, mask_token_id))


def cycle_tails(pos: torch.Tensor, doc: torch.Tensor, tau: int, multiple: int = 1):
    """Positions and documents ``[B, E]`` of the MASK slots that complete each document's last cycle.

    A document ending at position p gets ``tau - 1 - p % tau`` tail slots at ``p+1 ..``. Rows are padded
    to E (a multiple of ``multiple``) with slots of document -1, which only see each other."""
    b, n = pos.shape
    is_last = torch.ones_like(doc, dtype=torch.bool)
    is_last[:, :-1] = doc[:, 1:] != doc[:, :-1]
    need = torch.where(is_last, tau - 1 - pos % tau, torch.zeros_like(pos))  # [B, L]
    cum = need.cumsum(1)  # [B, L]
    count = cum[:, -1]  # [B]
    e = int(count.max()) if n else 0
    e = -(-e // multiple) * multiple
    idx = torch.arange(e, device=pos.device).expand(b, e)  # [B, E]
    owner = torch.searchsorted(cum, idx.contiguous(), right=True).clamp(max=n - 1)  # [B, E]
    first = cum.gather(1, owner) - need.gather(1, owner)  # [B, E] index of the owner's first tail
    valid = idx < count[:, None]
    tail_pos = torch.where(valid, pos.gather(1, owner) + 1 + idx - first, torch.zeros_like(idx))
    tail_doc = torch.where(valid, doc.gather(1, owner), torch.full_like(idx, -1))
    return tail_pos, tail_doc


class StackModel(nn.Module):
    """Shared parts: the wrapped LM, mask backend, chunked next-token CE sums."""

    def __init__(self, lm: nn.Module, attn_backend: str = "auto", ce_chunk_tokens: int = 1024,
                 grad_checkpoint: bool = False):
        super().__init__()
        check_supported(lm.config)
        self.lm = lm
        self.attn_backend = attn_backend
        self.ce_chunk_tokens = ce_chunk_tokens
        self.grad_checkpoint = grad_checkpoint

    @property
    def config(self):
        return self.lm.config

    @property
    def layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm.model.embed_tokens(ids)

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM-head logits of pre-norm hidden states ``h [..., H]``."""
        return self.lm.lm_head(self.lm.model.norm(h))

    def _uses_flex(self, device: torch.device, backend: str | None = None) -> bool:
        backend = backend or self.attn_backend
        return backend == "flex" or (backend == "auto" and device.type == "cuda")

    def make_mask(self, q: Slots, k: Slots, rule: VariantRule, backend: str | None = None):
        """flex BlockMask or dense boolean mask of the predicate; ``backend`` overrides ``attn_backend``."""
        use_flex = self._uses_flex(q.pos.device, backend)
        return flex_block_mask(q, k, rule) if use_flex else dense_mask(q, k, rule)

    def run(self, layers, x: torch.Tensor, slots: Slots, rule: VariantRule, kv_sink: KVSink | None = None,
            backend: str | None = None):
        """Self-attention of ``layers`` over slots ``x [B, N, H]`` with attributes ``slots``."""
        cos, sin = rope(self.lm.model.rotary_emb, x, slots.pos)
        mask = self.make_mask(slots, slots, rule, backend)
        return run_layers(layers, x, cos, sin, mask, kv_sink=kv_sink, checkpoint=self.grad_checkpoint)

    def hidden(self, input_ids, position_ids=None, doc_ids=None) -> torch.Tensor:
        """Pre-norm hidden states ``[B, L, H]`` of the last decoder layer."""
        raise NotImplementedError

    def logits(self, input_ids, position_ids=None, doc_ids=None) -> torch.Tensor:
        """Next-token logits ``[B, L, V]``."""
        return self.final_logits(self.hidden(input_ids, position_ids, doc_ids))

    def forward(self, input_ids, labels, position_ids=None, doc_ids=None) -> dict[str, torch.Tensor]:
        """Loss numerators: ``ce`` (sum of next-token CE over labels != -100) and ``token_acc``
        (count of argmax hits). ``labels [B, L]`` holds the token each position predicts."""
        return self.ce_sums(self.hidden(input_ids, position_ids, doc_ids), labels)

    def ce_sums(self, h: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        sel = labels != IGNORE  # [B, L]
        hs, ys = h[sel], labels[sel]  # [T, H], [T]
        ce = h.sum() * 0.0  # keeps the graph connected when no token is supervised
        hits = torch.zeros((), device=h.device)
        chunked = ys.numel() > self.ce_chunk_tokens  # recompute each chunk's logits in backward
        for s in range(0, ys.numel(), self.ce_chunk_tokens):
            hc, yc = hs[s: s + self.ce_chunk_tokens], ys[s: s + self.ce_chunk_tokens]
            if chunked and torch.is_grad_enabled():
                c, a = torch.utils.checkpoint.checkpoint(self._chunk_sums, hc, yc, use_reentrant=False)
            else:
                c, a = self._chunk_sums(hc, yc)
            ce, hits = ce + c, hits + a
        return {"ce": ce, "token_acc": hits}

    def _chunk_sums(self, h: torch.Tensor, y: torch.Tensor):
        logits = self.final_logits(h).float()  # [T, V]
        return F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(-1) == y).sum().float()


def causal_hidden(model: StackModel, layers, input_ids, pos, doc, extra: torch.Tensor | None = None,
                  kv_sink: KVSink | None = None, backend: str | None = None) -> torch.Tensor:
    """``layers`` causal over the real tokens ``input_ids [B, L]`` (inputs ``embed + extra``) -> ``[B, L, H]``."""
    x = model.embed(input_ids)
    if extra is not None:
        x = x + extra
    return model.run(layers, x, Slots.make(pos, doc, False, tau=1), CAUSAL, kv_sink, backend)


class PlainModel(StackModel):
    """The unmodified target through the same layer code: every layer causal on real tokens."""

    def hidden(self, input_ids, position_ids=None, doc_ids=None) -> torch.Tensor:
        pos, doc = default_positions(input_ids, position_ids, doc_ids)
        return causal_hidden(self, self.layers, input_ids, pos, doc)


class DMTDModel(StackModel):
    """Parallel DMTD: first ``num_parallel_layers`` layers per cycle on the shadow block, the rest per token."""

    def __init__(self, lm: nn.Module, num_parallel_layers: int, tau: int, mask_token_id: int, variant: str,
                 attn_backend: str = "auto", ce_chunk_tokens: int = 1024, grad_checkpoint: bool = False,
                 tail_multiple: int | None = None):
        super().__init__(lm, attn_backend, ce_chunk_tokens, grad_checkpoint)
        n_layers = lm.config.num_hidden_layers
        if not 1 <= num_parallel_layers < n_layers:
            raise ValueError(f"num_parallel_layers={num_parallel_layers} must be in [1, {n_layers - 1}]")
        if tau < 2:
            raise ValueError(f"tau must be >= 2; got {tau}")
        if not 0 <= mask_token_id < lm.config.vocab_size:
            raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary (size {lm.config.vocab_size})")
        self.num_parallel_layers = num_parallel_layers
        self.tau = tau
        self.mask_token_id = mask_token_id
        self.variant = variant
        self.rule = parse_variant(variant)
        self.tail_multiple = tail_multiple

    @classmethod
    def from_config(cls, lm: nn.Module, cfg: DMTDConfig, variant: str) -> "DMTDModel":
        cfg.check_target(lm.config)
        return cls(lm, cfg.num_parallel_layers, cfg.tau, cfg.mask_token_id, variant, attn_backend=cfg.attn_backend,
                   ce_chunk_tokens=cfg.ce_chunk_tokens, grad_checkpoint=cfg.grad_checkpoint)

    @property
    def parallel_layers(self) -> nn.ModuleList:
        return self.layers[: self.num_parallel_layers]

    @property
    def sequential_layers(self) -> nn.ModuleList:
        return self.layers[self.num_parallel_layers:]

    # -- the P-stream ---------------------------------------------------------------------------
    def layout(self, input_ids: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor,
               complete_cycles: bool | None = None, tail_multiple: int | None = None) -> Layout:
        """P-stream of a batch ``input_ids [B, L]`` (positions/documents ``[B, L]``). Cycle tails are
        added when ``complete_cycles`` (default: only for bidirectional variants, the ones that see them),
        padded to a multiple of ``tail_multiple`` (default: 128 = one flex block under flex, so compiled
        flex sees few distinct lengths; 8 on the dense path)."""
        tau, n = self.tau, input_ids.shape[1]
        if tail_multiple is None:
            tail_multiple = self.tail_multiple or (128 if self._uses_flex(input_ids.device) else 8)
        shadow = [Slots.make(pos, doc, True, tau)]
        ids = [shadow_token_ids(input_ids, pos, tau, self.mask_token_id)]
        if self.rule.bidirectional if complete_cycles is None else complete_cycles:
            tail_pos, tail_doc = cycle_tails(pos, doc, tau, tail_multiple)
            shadow.append(Slots.make(tail_pos, tail_doc, True, tau))
            ids.append(torch.full_like(tail_pos, self.mask_token_id))
        if self.rule.refresh:
            shadow.insert(0, Slots.make(pos, doc, False, tau))
            ids.insert(0, input_ids)
        return Layout(ids=torch.cat(ids, 1), slots=Slots.cat(shadow), shadow_start=n if self.rule.refresh else 0,
                      length=n)

    def parallel_hidden(self, layout: Layout, kv_sink: KVSink | None = None, backend: str | None = None
                        ) -> torch.Tensor:
        """Output ``[B, N, H]`` of the P layers on the whole P-stream."""
        return self.run(self.parallel_layers, self.embed(layout.ids), layout.slots, self.rule, kv_sink, backend)

    def sequential_hidden(self, input_ids, pos, doc, shadow_h: torch.Tensor, kv_sink: KVSink | None = None,
                          backend: str | None = None) -> torch.Tensor:
        """Output ``[B, L, H]`` of the S layers on ``embed(x_i) + shadow_h_i`` (causal over real tokens)."""
        return causal_hidden(self, self.sequential_layers, input_ids, pos, doc, shadow_h, kv_sink, backend)

    def hidden(self, input_ids, position_ids=None, doc_ids=None) -> torch.Tensor:
        pos, doc = default_positions(input_ids, position_ids, doc_ids)
        lay = self.layout(input_ids, pos, doc)
        p_out = self.parallel_hidden(lay)  # [B, N, H]
        shadow_h = p_out[:, lay.shadow_start: lay.shadow_start + lay.length]  # [B, L, H]
        return self.sequential_hidden(input_ids, pos, doc, shadow_h)


def load_dmtd(target_dir, cfg: DMTDConfig, variant: str, checkpoint_dir=None, device="cpu",
              dtype: torch.dtype = torch.float32) -> DMTDModel:
    """The target in ``target_dir`` wrapped as a DMTD model; weights of a training checkpoint
    (``model.safetensors`` with the trainer's parameter names, see ``resolve_checkpoint``) replace the
    target's where given (parameters the checkpoint lacks, e.g. frozen embeddings, stay the target's)."""
    from dspark_core.target import load_target

    lm, _ = load_target(target_dir, dtype=dtype, device=device)
    model = DMTDModel.from_config(lm, cfg, variant)
    if checkpoint_dir is not None:
        load_weights(model, checkpoint_dir)
    return model.eval()


def resolve_checkpoint(path) -> Path:
    """The step folder holding ``model.safetensors``: ``path`` itself, or the one named by ``latest.json`` in
    ``path`` or ``path/checkpoints`` (the shared trainer's layout: pass its ``out_dir``)."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    for root in (path, path / "checkpoints"):
        if (root / "latest.json").is_file():
            return root / read_json(root / "latest.json")["dir"]
    raise UserError(f"{path}: no trained DMTD checkpoint (no model.safetensors, no latest.json); train it first "
                    f"(`dvc repro dmtd_train@<variant>`)")


def load_weights(model: nn.Module, checkpoint) -> None:
    """Copy the tensors of a checkpoint's ``model.safetensors`` (see ``resolve_checkpoint``) into ``model``."""
    from dspark_core.checkpoint import load_checked_weights

    folder = resolve_checkpoint(checkpoint)
    path = folder / "model.safetensors"
    weights = load_checked_weights(folder, f"retrain the DMTD variant or restore {folder} (`dvc checkout`)")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            if name not in params or params[name].shape != value.shape:
                raise ValueError(f"{path}: tensor {name!r} {tuple(value.shape)} does not match the DMTD model "
                                 "(another target or config?)")
            params[name].copy_(value)
