"""Draft Memory (seed 000 "Draft Memory"): the previous block's draft states as extra K/V of the next block.

Shape legend: B batch, L tokens, A anchors, S slots (block_size), M = S - 1 memory entries of a block,
H draft hidden, V vocab, N valid slots.

Slots are 0-based here (j = 0 .. S-1); the seed's 1-based ``h_i`` is slot ``j = i - 1``: its query position
is ``a + j``, it predicts the token at ``a + j + 1``.

Training (two forward passes sharing the weights; gradients only through the second):

- Stage 1 (:meth:`DraftMemory.prepare_batch`, hook 5, no grad, no memory): the baseline forward at the sampled
  anchors, greedy tokens ``argmax(lm_head(h_j) + W2 W1[t_{j-1}])`` under the *reference* predecessors
  (teacher forcing: up to the first error they equal the draft's own choices, so this finds the first error of
  greedy generation), ``m`` = number of leading matches with the reference (0 .. S, valid slots only).
- Transition: new anchor ``a' = a + m + 1`` (m = S: the bonus position, empty memory). A transition whose new
  anchor is not an anchor candidate (past the sequence, a non-response token, or no supervised next token) is
  dropped (the block becomes invalid). Kept memory: slots ``j = m+1 .. S-1`` of the old block that were valid
  (the seed's ``I = {m+2..B}``), at RoPE position ``a + j + 1`` (the predicted position: the first kept entry
  aligns with ``a' + 1``).
- Stage 2 (the ordinary training forward + loss): targets / prev_tokens / slot_valid recomputed at ``a'``;
  :meth:`DraftMemory.extra_kv` (hook 3) turns the stored states into ``M_j = RMSNorm_gamma(P stopgrad(h_j))``
  once per forward, every layer reads them through its own k_proj / v_proj in the one attention over
  ``[context < a' ; memory of this block ; block]`` (``draft/attention.py`` masks other blocks' memory).

The batch keys stage 1 adds: ``memory_hidden [B, A, M, H]`` (old slots 1..S-1, detached), ``memory_positions
[B, A, M]``, ``memory_valid [B, A, M]``, ``stage1_anchors [B, A]`` (the old anchors),
``stage1_matches [B, A]`` (m, -1 for an invalid old block) and ``stage1_kept [B, A]`` (the transition was
kept). Blocks are re-sorted by new anchor (dropped ones last). eval_offline measures this variant twice
(``offline_anchor_sets``): at the random anchors without memory (the plain keys, like every other draft) and through
this hook at the new anchors right after a draft error, with memory (``post_error/tau_prob``, ...), beside the
baseline draft at exactly those anchors (``post_error/baseline/tau_prob``, ...): the like-for-like memory comparison.

Online (reference engine): the draft's context cache (:class:`MemoryCache`, one per ``generate``) keeps the last
proposal's states and its anchor position ``a``; at the next ``propose`` (anchor ``p' = cache.length = a + acc
+ 1``) the states that predicted positions ``<= p'`` (accepted and first rejected) are dropped and the rest fed
as memory at their predicted positions. ``memory.online``: ``chained`` stores the proposal's own states (they
were computed with the previous memory), ``first_stage`` recomputes the block without memory and stores those
(training's distribution; one more block forward per cycle). The static CUDA-graph engine refuses the
overridden ``extra_kv`` hook; bench_online falls back to the reference engine and records why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from dspark_core.draft import inference
from dspark_core.draft.anchors import TEACHER_KEYS, anchor_candidates, block_targets
from dspark_core.draft.config import MEMORY_ONLINE, DraftConfig
from dspark_core.draft.model import DSparkDraft, ExtraKV
from dspark_core.ops import RMSNorm

PREDICT_CHUNK = 512  # stage 1: slots whose full-vocabulary logits exist at once
MEMORY_KEYS = ("memory_hidden", "memory_positions", "memory_valid")
STAGE1_KEYS = ("stage1_anchors", "stage1_matches", "stage1_kept")
POST_ERROR = "post_error"  # eval_offline's name of the anchor set right after a draft error (metric key prefix)


# -- stage 1 and the transition (pure functions, tested against hand-worked examples) ---------------------------
def first_mismatch(pred: torch.Tensor, targets: torch.Tensor, slot_valid: torch.Tensor) -> torch.Tensor:
    """pred, targets, slot_valid [B, A, S] -> m [B, A]: leading slots whose prediction matches (valid ones only)."""
    match = (pred == targets) & slot_valid.bool()
    return match.long().cumprod(dim=-1).sum(dim=-1)


def transition(anchors: torch.Tensor, anchor_valid: torch.Tensor, m: torch.Tensor,
               loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New anchors ``a + m + 1`` [B, A] (0 where dropped) and kept [B, A]: the old block is valid and the new
    anchor is an anchor candidate (inside the sequence, a response token followed by one)."""
    length = loss_mask.shape[1]
    new = anchors + m + 1  # [B, A]
    cand = anchor_candidates(loss_mask).gather(1, new.clamp(max=length - 1))  # [B, A]
    kept = anchor_valid.bool() & (new < length) & cand
    return torch.where(kept, new, torch.zeros_like(new)), kept


def memory_slots(anchors: torch.Tensor, m: torch.Tensor, kept: torch.Tensor,
                 slot_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Old anchors [B, A], m, kept [B, A], old slot_valid [B, A, S] -> positions, valid [B, A, S-1] of the old
    slots 1..S-1: slot j is kept when j > m (the seed's I = {m+2..S}) and it was valid; RoPE position a + j + 1."""
    j = torch.arange(1, slot_valid.shape[-1], device=anchors.device)  # [S-1]
    valid = (j > m.unsqueeze(-1)) & slot_valid[..., 1:].bool() & kept.unsqueeze(-1)  # [B, A, S-1]
    return anchors.unsqueeze(-1) + j + 1, valid


def _reorder(batch: dict[str, torch.Tensor], keys: tuple[str, ...], order: torch.Tensor) -> None:
    """Gather the anchor axis (dim 1) of ``batch[keys]`` by order [B, A], in place."""
    for k in keys:
        t = batch[k]
        idx = order.view(*order.shape, *([1] * (t.dim() - 2))).expand(*order.shape, *t.shape[2:])
        batch[k] = t.gather(1, idx)


# -- online: the per-request state ---------------------------------------------------------------------------
@dataclass
class MemoryCache(inference.ContextCache):
    """The context cache plus the last proposal's states ``hidden [B, S, H]`` and its anchor position."""

    hidden: torch.Tensor | None = None
    hidden_anchor: int = -1

    def carried(self) -> dict[str, torch.Tensor] | None:
        """The memory of a block at anchor ``length``: the stored states that predicted positions > length, as
        ``memory_hidden [B, 1, n, H]``, ``memory_positions [B, 1, n]``, ``memory_valid`` (None: nothing left)."""
        if self.hidden is None:
            return None
        drop = self.length - self.hidden_anchor  # accepted + the first rejected (or the bonus position)
        slots = self.hidden.shape[1]
        if not 1 <= drop < slots:
            return None
        kept = self.hidden[:, drop:].unsqueeze(1)  # [B, 1, n, H]
        pos = self.hidden_anchor + torch.arange(drop + 1, slots + 1, device=kept.device)  # [n]
        pos = pos.expand(kept.shape[0], 1, -1)
        return {"memory_hidden": kept, "memory_positions": pos,
                "memory_valid": torch.ones(pos.shape, dtype=torch.bool, device=kept.device)}


class DraftMemory(DSparkDraft, kind="draft_memory"):
    """The baseline plus the memory adapter ``RMSNorm_gamma(P .)`` (hooks 3 and 5; see the module docstring)."""

    def __init__(self, cfg: DraftConfig, target_config: Any, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(cfg, target_config, embed_weight, lm_head_weight, **kwargs)
        self.memory_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)  # P [H, H]
        self.memory_norm = RMSNorm(self.hidden_size, eps=self.hf_config.rms_norm_eps)  # gamma [H], ones
        nn.init.normal_(self.memory_proj.weight, 0.0, float(getattr(target_config, "initializer_range", 0.02)))
        self.online_mode = cfg.memory.online

    def variant_params(self) -> dict[str, nn.Parameter]:
        return {k: p for k, p in self.named_parameters() if k.startswith("memory_")}

    # -- hook 3: memory as extra K/V ------------------------------------------------------------------------
    def memory_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """Old draft states [..., H] -> memory M = RMSNorm_gamma(P stopgrad(h)) [..., H]."""
        return self.memory_norm(self.memory_proj(hidden.detach().to(self.compute_dtype)))

    def extra_kv(self, extras: Mapping[str, Any] | None, anchors: torch.Tensor,
                 anchor_valid: torch.Tensor) -> ExtraKV | None:
        """``extras['memory_*']`` [B, A, M, ...] -> M entries per block, owned by their block (invalid: owner -1).
        At inference (one block, no mask) pass valid entries only."""
        if extras is None or "memory_hidden" not in extras or extras["memory_hidden"].shape[2] == 0:
            return None
        hid = extras["memory_hidden"]  # [B, A, M, H]
        batch, blocks, m = hid.shape[:3]
        if (batch, blocks) != tuple(anchors.shape):
            raise ValueError(f"memory_hidden {tuple(hid.shape)} does not match the anchors {tuple(anchors.shape)}")
        valid = extras["memory_valid"].to(anchors.device) & anchor_valid.bool().unsqueeze(-1)  # [B, A, M]
        owner = torch.arange(blocks, device=anchors.device).view(1, blocks, 1).expand(batch, blocks, m)
        owner = torch.where(valid, owner, torch.full_like(owner, -1))
        return ExtraKV(states=self.memory_states(hid).reshape(batch, blocks * m, -1),
                       positions=extras["memory_positions"].to(anchors.device).reshape(batch, -1),
                       owner=owner.reshape(batch, -1))

    # -- hook 5: stage 1 ------------------------------------------------------------------------------------
    def greedy_tokens(self, hidden: torch.Tensor, prev_tokens: torch.Tensor, slot_valid: torch.Tensor) -> torch.Tensor:
        """argmax of ``lm_head(h) + W2 W1[prev]`` on the valid slots [B, A, S] (-1 elsewhere), in chunks."""
        pred = torch.full(prev_tokens.shape, -1, dtype=torch.long, device=prev_tokens.device)
        sel = slot_valid.bool()
        h, prev = hidden[sel], prev_tokens[sel]  # [N, H], [N]
        out = []
        for s in range(0, h.shape[0], PREDICT_CHUNK):
            logits = self.slot_logits(h[s:s + PREDICT_CHUNK])  # [n, V]
            mk = self.markov_features(prev[s:s + PREDICT_CHUNK], h[s:s + PREDICT_CHUNK], None)
            if mk is not None:
                logits = logits + self.markov_bias(mk).float()
            out.append(logits.argmax(dim=-1))
        if out:
            pred[sel] = torch.cat(out)
        return pred

    @torch.no_grad()
    def prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage 1 and the transition (module docstring); a batch that already has memory is returned as is."""
        if "memory_hidden" in batch:
            return batch
        anchors, valid, slot_valid = batch["anchors"], batch["anchor_valid"], batch["slot_valid"]
        hidden = self.forward_train(batch["input_ids"], batch["aux_hidden"], anchors, valid, extras=batch)
        pred = self.greedy_tokens(hidden, batch["prev_tokens"], slot_valid)
        m = first_mismatch(pred, batch["targets"], slot_valid)  # [B, A]
        new, kept = transition(anchors, valid, m, batch["loss_mask"])
        pos, mem_valid = memory_slots(anchors, m, kept, slot_valid)
        out = dict(batch)
        out.update(anchors=new, anchor_valid=kept, memory_hidden=hidden[:, :, 1:].detach(), memory_positions=pos,
                   memory_valid=mem_valid, stage1_anchors=anchors, stage1_kept=kept,
                   stage1_matches=torch.where(valid.bool(), m, torch.full_like(m, -1)))
        big = batch["input_ids"].shape[1]
        order = torch.where(kept, new, torch.full_like(new, big)).argsort(dim=1, stable=True)  # dropped last
        _reorder(out, ("anchors", "anchor_valid") + STAGE1_KEYS + MEMORY_KEYS, order)
        out.update(block_targets(batch["input_ids"], batch["loss_mask"], out["anchors"], out["anchor_valid"],
                                 self.block_size))
        out["slot_index"] = out["slot_valid"].nonzero().t().contiguous()  # [3, N]
        for key in TEACHER_KEYS:  # the collate's teacher rows were for the stage-1 anchors
            out.pop(key, None)
        return out

    offline_anchor_set_names = ("", POST_ERROR)

    def offline_anchor_sets(self, batch: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The random anchors as given (no previous block there, so no memory: the draft's first cycle, comparable
        with every other draft) and ``post_error``: stage 1's new anchors right after the first draft error, with
        the kept memory. eval_offline also runs a reference draft (the baseline) on the ``post_error`` batch."""
        return {"": batch, POST_ERROR: self.prepare_batch(batch)}

    # -- online ---------------------------------------------------------------------------------------------
    def online_modes(self) -> tuple[str, ...]:
        return MEMORY_ONLINE

    def set_online_mode(self, mode: str) -> None:
        if mode not in MEMORY_ONLINE:
            raise ValueError(f"memory online mode must be one of {', '.join(MEMORY_ONLINE)}; got {mode!r}")
        self.online_mode = mode

    def rows_state(self, rows: int, device: Any) -> dict[str, torch.Tensor]:
        """Per request row: the last block's states and its anchor position (-1: none yet)."""
        return {"hidden": torch.zeros(rows, self.block_size, self.hidden_size, device=device,
                                      dtype=self.compute_dtype),  # [R, S, H]
                "anchor": torch.full((rows,), -1, dtype=torch.long, device=device)}  # [R]

    def rows_extras(self, state: dict[str, torch.Tensor], seq: torch.Tensor | None, p: torch.Tensor
                    ) -> dict[str, torch.Tensor]:
        """Each row's memory as in ``MemoryCache.carried``, in static shapes: all S stored states at positions
        ``anchor + j + 1``, valid where they predicted a position beyond the new anchor ``p`` (j >= p - anchor)."""
        extras = dict(super().rows_extras(state, seq, p) or {})
        old = state["anchor"]  # [R]
        drop = (p - old).view(-1, 1)  # [R, 1] accepted + the first rejected (or the bonus position)
        slots = torch.arange(self.block_size, device=p.device)  # [S]
        valid = (slots >= drop) & (drop >= 1) & (drop < self.block_size) & (old >= 0).view(-1, 1)  # [R, S]
        extras.update(memory_hidden=state["hidden"].unsqueeze(1), memory_valid=valid.unsqueeze(1),
                      memory_positions=(old.view(-1, 1) + slots + 1).unsqueeze(1))  # [R, 1, S, ...]
        return extras

    def rows_record(self, state: dict[str, torch.Tensor], p: torch.Tensor, hidden: torch.Tensor,
                    extras: Mapping[str, Any] | None, block: Any) -> None:
        """Keep this block's states (``first_stage``: recomputed without memory, as in training) and its anchor."""
        if self.online_mode == "first_stage":
            plain = {k: v for k, v in (extras or {}).items() if not k.startswith("memory_")}
            hidden = block(plain or None)
        state["hidden"].copy_(hidden)
        state["anchor"].copy_(p)

    def rows_reset(self, state: dict[str, torch.Tensor], row: int) -> None:
        state["anchor"][row] = -1

    def new_context_cache(self, batch: int = 1, max_len: int = 4096, device: Any = None,
                          dtype: torch.dtype | None = None) -> MemoryCache:
        c = inference.new_context_cache(self, batch, max_len, device, dtype)
        return MemoryCache(k=c.k, v=c.v)

    def propose(self, cache: inference.ContextCache, anchor_token: torch.Tensor, sample_fn: inference.SampleFn,
                confidence_threshold: float = 0.0, extras: Mapping[str, Any] | None = None) -> inference.DraftProposal:
        """The baseline proposal with the carried memory; stores this block's states for the next cycle."""
        if not isinstance(cache, MemoryCache):
            raise ValueError("DraftMemory.propose needs the cache of its own new_context_cache (a MemoryCache)")
        memory = cache.carried()
        with_memory = {**(extras or {}), **memory} if memory is not None else extras
        proposal = inference.propose(self, cache, anchor_token, sample_fn, confidence_threshold, with_memory)
        source = proposal.hidden
        if memory is not None and self.online_mode == "first_stage":  # training's memory: computed without memory
            source = self.forward_block(cache, anchor_token.reshape(-1).to(cache.k.device), extras)
        cache.hidden, cache.hidden_anchor = source, cache.length
        return proposal
