"""Triton kernel of the draft's greedy Markov slot (``dspark_core.spec.static_draft``, CUDA graphs).

Slot i of a DSpark proposal picks ``t_i = argmax(base_i + W2 W1[t_{i-1}])``: the LM-head logits of the slot
plus the Markov bias of the previous token. The slots are sequential (each reads the token the previous one
chose), so at batch 1 a slot is latency-bound: in plain torch it is 4-5 kernels (gather, GEMV, cast, add,
argmax). Here it is two: programs over row tiles of W2 compute their rows' biased logits and a partial
(max, first argmax) each, and one program reduces the partials and writes the token where the next slot
reads it. The previous token is read on the device, so no host sync is needed between slots.

Rounding follows the torch path (``markov_slot_reference``): the bias is rounded to W2's dtype (what
``nn.Linear`` returns) before it is added to the float32 base logits; ties go to the lowest token id, as
``torch.argmax`` does.

Shape legend: V vocab, r Markov rank, P partial programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_core.kernels.decode import _LAUNCH, PDL, gdc_wait

BLOCK_V = 128


@triton.jit
def _markov_partial(BASE, W1, W2, PREV, PV, PI, V, R: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_R: tl.constexpr, PDL_ON: tl.constexpr):
    """Program p: rows [p * BLOCK_V, +BLOCK_V) of ``base + W2 @ W1[prev]``, their max and its first index."""
    if PDL_ON:
        gdc_wait()
    pid = tl.program_id(0)
    prev = tl.load(PREV).to(tl.int64)
    rows = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < V
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        cols = r0 + tl.arange(0, BLOCK_R)
        cmask = cols < R
        m = tl.load(W1 + prev * R + cols, mask=cmask, other=0.0).to(tl.float32)  # [BLOCK_R]
        w = tl.load(W2 + rows[:, None].to(tl.int64) * R + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_R]
        acc += tl.sum(w * m[None, :], axis=1)
    bias = acc.to(W2.dtype.element_ty).to(tl.float32)  # nn.Linear's output dtype, as the torch path
    logits = tl.load(BASE + rows, mask=rmask, other=float("-inf")).to(tl.float32) + bias
    logits = tl.where(rmask, logits, float("-inf"))
    best = tl.max(logits, axis=0)
    idx = tl.min(tl.where(logits == best, rows, 2147483647), axis=0)
    tl.store(PV + pid, best)
    tl.store(PI + pid, idx)


@triton.jit
def _markov_final(PV, PI, NP, OUT, NP_P: tl.constexpr, PDL_ON: tl.constexpr):
    """One program: the max over the partials, the lowest token id among the tied ones -> OUT (int64)."""
    if PDL_ON:
        gdc_wait()
    offs = tl.arange(0, NP_P)
    mask = offs < NP
    v = tl.load(PV + offs, mask=mask, other=float("-inf"))
    i = tl.load(PI + offs, mask=mask, other=2147483647)
    best = tl.max(v, axis=0)
    tok = tl.min(tl.where(v == best, i, 2147483647), axis=0)
    tl.store(OUT, tok.to(tl.int64))


class MarkovArgmax:
    """Greedy Markov slots for one (W1 [V, r], W2 [V, r]) pair, with preallocated partial buffers."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        if w1.shape != w2.shape or w1.dim() != 2:
            raise ValueError(f"MarkovArgmax: W1 {tuple(w1.shape)} and W2 {tuple(w2.shape)} must both be [V, r]")
        self.w1, self.w2 = w1.contiguous(), w2.contiguous()
        self.vocab, self.rank = w1.shape
        self.parts = triton.cdiv(self.vocab, BLOCK_V)
        self.pv = torch.empty(self.parts, device=w1.device, dtype=torch.float32)
        self.pi = torch.empty(self.parts, device=w1.device, dtype=torch.int32)
        self.block_r = min(64, triton.next_power_of_2(self.rank))

    def __call__(self, base: torch.Tensor, prev: torch.Tensor, out: torch.Tensor) -> None:
        """``out[0] = argmax(base + W2 W1[prev[0]])`` for base [V] (float32), prev / out 1-element int64 views."""
        _markov_partial[(self.parts,)](base, self.w1, self.w2, prev, self.pv, self.pi, self.vocab, R=self.rank,
                                       BLOCK_V=BLOCK_V, BLOCK_R=self.block_r, PDL_ON=PDL, num_warps=4, **_LAUNCH)
        _markov_final[(1,)](self.pv, self.pi, self.parts, out, NP_P=triton.next_power_of_2(self.parts), PDL_ON=PDL,
                            num_warps=4, **_LAUNCH)


def markov_slot_reference(base: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The torch path: ``argmax(base + float(W2 W1[prev]))`` -> [1] int64."""
    m = torch.nn.functional.embedding(prev.view(1), w1)  # [1, r]
    return (base.view(1, -1) + torch.nn.functional.linear(m, w2).float()).argmax(dim=-1)  # [1]
