"""Seed 001's visibility rules as ONE predicate over slot attributes.

Every attention in Parallel DMTD (the P layers' shadow and real streams in training, the S layers,
the cached inference steps, the plain AR baseline) is described by the attributes of its query and key
slots, never by slot order:

- ``pos``    position id inside the document (RoPE position too); a shadow slot at position i uses i
- ``cycle``  ``pos // tau``; a slot is a cycle head iff ``pos % tau == 0``
- ``doc``    document id; attention never crosses documents. ``-1`` marks an empty cache slot (no query
             ever has doc -1 *and* a real key, so those slots are never visible)
- ``shadow`` True for a shadow slot (``[head, MASK, ...]`` stream), False for a real-token slot

Rules (q = query slot, k = key slot, all require ``q.doc == k.doc``):

- real query (refresh branch, S layers, AR):    real key with ``k.pos <= q.pos``        (causal)
- shadow query, refresh:   real key of a strictly earlier cycle  ``k.cycle < q.cycle``
                           or shadow key of the same cycle       (``k.pos <= q.pos`` when causal)
- shadow query, norefresh: shadow key with ``k.pos <= q.pos``    (history = shadow K/V)
                           or, bidirectional, a shadow key of the same cycle

``dense_mask`` evaluates the predicate on broadcast attribute tensors (the SDPA path, and every cached
step); ``flex_block_mask`` wraps the same function as a flex_attention ``mask_mod``.

Shape legend: B batch, Nq query slots, Nk key slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_core.dmtd.config import VariantRule

CAUSAL = VariantRule(bidirectional=False, refresh=False)  # any rule: real queries only use the causal part


@dataclass(frozen=True)
class Slots:
    """Attributes of a set of attention slots, each ``[B, N]`` (B may be 1 to broadcast)."""

    pos: torch.Tensor     # [B, N] long
    cycle: torch.Tensor   # [B, N] long
    doc: torch.Tensor     # [B, N] long
    shadow: torch.Tensor  # [B, N] bool

    @staticmethod
    def make(pos: torch.Tensor, doc: torch.Tensor, shadow: bool | torch.Tensor, tau: int) -> "Slots":
        """Slots at positions ``pos [B, N]`` of documents ``doc [B, N]``; ``shadow`` a bool or ``[B, N]``."""
        if isinstance(shadow, bool):
            shadow = torch.full(pos.shape, shadow, dtype=torch.bool, device=pos.device)
        return Slots(pos=pos, cycle=torch.div(pos, tau, rounding_mode="floor"), doc=doc, shadow=shadow)

    @staticmethod
    def cat(parts: list["Slots"]) -> "Slots":
        return Slots(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("pos", "cycle", "doc", "shadow")))

    def select(self, index: torch.Tensor) -> "Slots":
        """The slots at ``index [N']`` (same for every row)."""
        return Slots(self.pos[:, index], self.cycle[:, index], self.doc[:, index], self.shadow[:, index])

    @property
    def size(self) -> int:
        return self.pos.shape[1]


def visible(q_pos, q_cycle, q_doc, q_shadow, k_pos, k_cycle, k_doc, k_shadow, rule: VariantRule):
    """Seed 001 sections 1.1-5 / 7.3 as a boolean of broadcastable tensors (or 0-d tensors in flex)."""
    causal = k_pos <= q_pos
    same_cycle = k_cycle == q_cycle
    real_query = ~q_shadow & ~k_shadow & causal
    if rule.refresh:
        history = ~k_shadow & (k_cycle < q_cycle)
        local = k_shadow & same_cycle
        if not rule.bidirectional:
            local = local & causal
    else:
        history = k_shadow & causal
        local = k_shadow & same_cycle if rule.bidirectional else history
    return (q_doc == k_doc) & (real_query | (q_shadow & (history | local)))


def dense_mask(q: Slots, k: Slots, rule: VariantRule) -> torch.Tensor:
    """Boolean mask ``[B, 1, Nq, Nk]`` (True = attend) for SDPA."""
    m = visible(q.pos[:, :, None], q.cycle[:, :, None], q.doc[:, :, None], q.shadow[:, :, None],
                k.pos[:, None, :], k.cycle[:, None, :], k.doc[:, None, :], k.shadow[:, None, :], rule)
    return m[:, None]  # [B, 1, Nq, Nk]


def mask_mod(q: Slots, k: Slots, rule: VariantRule):
    """The same predicate as a flex_attention ``mask_mod(b, h, q_idx, kv_idx)``."""

    def fn(b, h, q_idx, kv_idx):
        return visible(q.pos[b, q_idx], q.cycle[b, q_idx], q.doc[b, q_idx], q.shadow[b, q_idx],
                       k.pos[b, kv_idx], k.cycle[b, kv_idx], k.doc[b, kv_idx], k.shadow[b, kv_idx], rule)

    return fn


def flex_block_mask(q: Slots, k: Slots, rule: VariantRule):
    """A flex_attention ``BlockMask`` of the predicate (rows of ``q`` and ``k`` must have the same B)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch = max(q.pos.shape[0], k.pos.shape[0])
    if q.pos.shape[0] != batch:
        q = Slots(*(t.expand(batch, -1) for t in (q.pos, q.cycle, q.doc, q.shadow)))
    if k.pos.shape[0] != batch:
        k = Slots(*(t.expand(batch, -1) for t in (k.pos, k.cycle, k.doc, k.shadow)))
    return create_block_mask(mask_mod(q, k, rule), batch, None, q.size, k.size, device=q.pos.device)
