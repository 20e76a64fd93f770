"""Anchor sampling and per-slot supervision of a DSpark training batch.

Shape legend: B batch, L tokens (padded), A anchors per sample, S slots of a block.

- An anchor is a response position ``p`` whose next token is a response token too
  (``loss_mask[p] and loss_mask[p + 1]``). Each sample gets at most ``num_anchors`` of them, drawn
  without replacement with the sample's own generator, sorted ascending (contiguous query tiles see
  similar context lengths, which keeps the flex block mask sparse); the rest are dummy anchors at
  position 0 with ``anchor_valid = False``.
- Slot ``j`` of anchor ``p`` predicts the token at ``p + j + 1`` (next-token aligned); its teacher
  distribution is the target's at position ``p + j``. The slot is valid while ``p + j + 1 < L``, that
  token is a response token, and every earlier slot of the block is valid: a contiguous valid prefix
  (seed 000: the overlap a_i of an invalid slot counts as 0).
- ``anchor_slots: compact`` (the default): a batch row gets as many anchor slots as the most valid anchors any
  row has, rounded up to a multiple of ``num_anchors / 8`` (:func:`compact_width`: a handful of shapes for the
  compiled layers), instead of ``num_anchors`` per sample. A sample with fewer anchor positions than
  ``num_anchors`` (a short answer) would otherwise carry dummy blocks through every draft layer; the valid
  slots, and so the loss and its gradients, are the same.
- Overlapping blocks share teacher positions (anchors p and p + 2 both need the target at p + 2 .. p + 6):
  :func:`teacher_fields` lists each position once (``teacher_rows``), so the loss runs the frozen LM head's
  teacher GEMM over U unique positions instead of N slots (U ~ N / 2 when anchors are dense).
"""

from __future__ import annotations

from typing import Sequence

import torch

TEACHER_KEYS = ("teacher_rows", "teacher_index", "teacher_plan")  # dropped by whatever moves anchors


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [..., L] bool -> [..., L] bool: positions that may be anchors."""
    cand = torch.zeros_like(loss_mask, dtype=torch.bool)
    cand[..., :-1] = loss_mask[..., :-1].bool() & loss_mask[..., 1:].bool()
    return cand


def _generators(generator: torch.Generator | Sequence[torch.Generator], batch: int) -> list[torch.Generator]:
    if isinstance(generator, torch.Generator):
        return [generator] * batch
    gens = list(generator)
    if len(gens) != batch:
        raise ValueError(f"got {len(gens)} generators for a batch of {batch} samples")
    return gens


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask [B, L] -> anchors [B, A] long (sorted, dummies = 0 at the end), anchor_valid [B, A] bool.

    ``generator``: one per sample (so a sample's anchors do not depend on how the batch is split), or one
    shared by all samples (drawn in order).
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1; got {num_anchors}")
    batch = loss_mask.shape[0]
    gens = _generators(generator, batch)
    cand = anchor_candidates(loss_mask.cpu())  # [B, L]
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long)  # [B, A]
    valid = torch.zeros(batch, num_anchors, dtype=torch.bool)  # [B, A]
    for b in range(batch):
        pos = cand[b].nonzero().squeeze(1)  # [n_b]
        k = min(num_anchors, pos.numel())
        pick = pos[torch.randperm(pos.numel(), generator=gens[b])[:k]].sort().values  # [k]
        anchors[b, :k] = pick
        valid[b, :k] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def compact_width(most_valid: int, num_anchors: int, cap: int) -> int:
    """Anchor slots of a batch row under ``anchor_slots: compact``: ``most_valid`` (the most valid anchors of any
    row) rounded up to a multiple of ceil(num_anchors / 8) -- up to 16 such steps; beyond (packed rows of several
    samples) to 8 widths per doubling -- at least one step, at most ``cap``: few distinct shapes to compile, at
    most 1/8 of a padded row's slots (1/16 of a longer row's) wasted on rounding."""
    step = -(-num_anchors // 8)
    units, grain = max(1, -(-most_valid // step)), 1
    while units > 16 * grain:
        grain *= 2
    return min(cap, -(-units // grain) * grain * step)


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                  anchor_valid: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """Supervision of every slot.

    Returns ``targets [B, A, S]`` (token at p+j+1), ``prev_tokens [B, A, S]`` (t_{j}: the anchor, then
    the reference tokens; the Markov head's input) and ``slot_valid [B, A, S]`` (contiguous prefix).
    """
    batch, length = input_ids.shape
    offs = torch.arange(1, block_size + 1, device=input_ids.device)  # [S]
    pos = anchors.unsqueeze(-1) + offs  # [B, A, S] positions of the predicted tokens
    safe = pos.clamp(max=length - 1).view(batch, -1)  # [B, A*S]
    ok = (pos < length) & loss_mask.bool().gather(1, safe).view_as(pos) & anchor_valid.unsqueeze(-1)
    slot_valid = ok.long().cumprod(dim=-1).bool()  # [B, A, S]
    targets = input_ids.gather(1, safe).view_as(pos)  # [B, A, S]
    anchor_tok = input_ids.gather(1, anchors)  # [B, A]
    prev_tokens = torch.cat([anchor_tok.unsqueeze(-1), targets[..., :-1]], dim=-1)  # [B, A, S]
    return {"targets": targets, "prev_tokens": prev_tokens, "slot_valid": slot_valid}


def add_anchor_fields(batch: dict[str, torch.Tensor], num_anchors: int, block_size: int,
                      generator: torch.Generator | Sequence[torch.Generator], compact: bool = False
                      ) -> dict[str, torch.Tensor]:
    """A collated cache batch plus ``anchors, anchor_valid, targets, prev_tokens, slot_valid`` and ``slot_index``
    [3, N] (batch, anchor, slot of every valid slot, computed here on the CPU so the loss needs no device sync).
    ``compact``: A = :func:`compact_width` of the rows' valid anchors instead of ``num_anchors`` (the same draws)."""
    for key in ("input_ids", "loss_mask"):
        if key not in batch:
            raise ValueError(f"batch lacks '{key}' (have: {', '.join(sorted(batch))})")
    anchors, anchor_valid = sample_anchors(batch["loss_mask"], num_anchors, generator)  # [B, A], valid ones first
    if compact:
        width = compact_width(int(anchor_valid.sum(1).max()), num_anchors, num_anchors)
        anchors, anchor_valid = anchors[:, :width].contiguous(), anchor_valid[:, :width].contiguous()
    out = dict(batch)
    out.update(anchors=anchors, anchor_valid=anchor_valid)
    out.update(block_targets(batch["input_ids"], batch["loss_mask"], anchors, anchor_valid, block_size))
    out["slot_index"] = out["slot_valid"].nonzero().t().contiguous()  # [3, N]
    out.update(teacher_fields(out["slot_index"], anchors, batch["input_ids"].shape[1]))
    return out


class TeacherPlan:
    """Which teacher rows a run of valid slots reads, on the host (the loss's chunk loop needs no device read).

    ``low`` / ``high`` [N] (CPU): over slots ``i..`` the smallest, over slots ``..i`` the largest
    ``teacher_index``; slots [s, e) therefore read rows within ``rows(s, e)``. A plain object, not a tensor
    or dataclass: batch movers, pinning and DDP's input scatter leave it on the host as it is.
    """

    __slots__ = ("low", "high")

    def __init__(self, index: torch.Tensor) -> None:
        index = index.cpu()
        self.low = index.flip(0).cummin(0).values.flip(0) if index.numel() else index  # [N] suffix minimum
        self.high = index.cummax(0).values if index.numel() else index  # [N] prefix maximum

    def __len__(self) -> int:
        return int(self.low.shape[0])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TeacherPlan) and torch.equal(self.low, other.low)
                and torch.equal(self.high, other.high))

    def rows(self, start: int, stop: int) -> tuple[int, int]:
        """[lo, hi): the teacher rows slots ``start .. stop - 1`` read."""
        return int(self.low[start]), int(self.high[stop - 1]) + 1


def teacher_fields(slot_index: torch.Tensor, anchors: torch.Tensor, length: int) -> dict:
    """The valid slots' teacher positions, each once: ``teacher_rows`` [2, U] (batch row, position; sorted),
    ``teacher_index`` [N] (a slot's row there) and their :class:`TeacherPlan`. slot_index [3, N] (b, a, j)."""
    b, a, j = slot_index.cpu()
    key = b * length + anchors.cpu()[b, a] + j  # [N] a slot's teacher position p + j, as one id per batch row
    uniq, index = torch.unique(key, sorted=True, return_inverse=True)  # [U], [N]
    rows = torch.stack([uniq // length, uniq % length])  # [2, U]
    return {"teacher_rows": rows, "teacher_index": index, "teacher_plan": TeacherPlan(index)}
