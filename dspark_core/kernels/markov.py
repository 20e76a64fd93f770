"""Triton kernels of the draft's Markov slot, greedy and sampled (``dspark_core.decoding.static_draft``,
CUDA graphs).

Slot i of a DSpark proposal picks ``t_i = argmax(base_i + W2 W1[t_{i-1}])``: the LM-head logits of the slot
plus the Markov bias of the previous token. The slots are sequential (each reads the token the previous one
chose), so at batch 1 a slot is latency-bound: in plain torch it is 4-5 kernels (gather, GEMV, cast, add,
argmax). Here it is one launch: programs over row tiles of W2 compute their rows' biased logits and a partial
(max, first argmax) each and write it to a workspace; then each bumps an arrival counter (acq_rel atomic, gpu
scope), and the last program to arrive reduces all the partials, writes the token where the next slot reads
it, and resets the counter to 0 for the next launch (the next slot, or a CUDA graph replay). The pattern is
``_gemm_small``'s split-K in ``dspark_core.kernels.gemm``. The previous token is read on the device, so no
host sync is needed between slots.

``MarkovArgmax.rows`` runs several such picks of one slot in one launch (grid: tiles x rows, a counter per row):
a draft tree's main chain and branches at one depth, reading and writing a token buffer by index; a row may also
ask for the second best (the argmax with its top token excluded: the tile holding the top offers its second,
every other tile its first).

``MarkovSampler.sample`` is the sampled slot at a plain temperature, in the same one-launch pattern: each program
draws its tile's exponential-race winner (``argmax(l - log E)``, E = -log U, l = logits / T: the race of
``sampling.race_sample`` without the normalisation it does not need) and its tile's (max, sum exp) of l; the last
program picks the token and the slot's (max, mass); ``MarkovSampler.normalize`` then turns the S slots' stored
logits into their distributions q in one launch (the rejection step needs q).

Deterministic: whichever program arrives last, it reduces the same partials the same way (a max, then the
lowest token id among the partials equal to it), and max / min are exact, so the token does not depend on
the order in which programs finish. Launches of one object must be stream-ordered (they share the workspace
and the counter); the slots are, and the reset is done before the kernel ends.

Rounding follows the torch path (``markov_slot_reference``): the bias is rounded to W2's dtype (what
``nn.Linear`` returns) before it is added to the float32 base logits; ties go to the lowest token id, as
``torch.argmax`` does. (Under ``TRITON_INTERPRET=1`` the float32 -> bfloat16 cast truncates where a GPU rounds
to nearest even, so there a bfloat16 bias can be one ulp off the torch path.)

A reduced draft vocabulary (``draft.vocab_size``): W2 and the base logits have Vd rows (the draft's tokens), W1 keeps
one row per target token (it is read at the previous token, a target id). Given ``d2t`` [Vd] (the target id of
each draft id, ascending) the kernels pick in draft ids and write the token as ``d2t[pick]``, where the next slot
reads it; ties still go to the lowest target id (ascending map). The sampled slot reads its U draw at
``race[d2t[row]]`` (the draw the torch path's race over the target vocabulary gives that token), and
``MarkovSampler.normalize`` scatters the Vd probabilities into q over the target vocabulary through ``t2d``,
zero on every other token.

Other Markov head types (gated, rnn): their W2 input u_i is not a row of W1 but a vector the torch path computes
from the previous token, the slot's draft state and the head's state; ``features=u`` [r] (W2's dtype) makes the
kernels read u in place of ``W1[prev]`` (the same bias ``W2 u``, rounded as ``nn.Linear``).

Shape legend: V vocab (Vd with a reduced draft vocabulary, Vt the target's), r Markov rank, P partial programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_core.kernels.pdl import _LAUNCH, PDL, gdc_launch_dependents, gdc_wait

BLOCK_V = 128


@triton.jit
def _markov_logits(BASE, W1, W2, PREV, V, R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [pid * BLOCK_V, +BLOCK_V) of ``base + W2 @ W1[prev]`` (float32, -inf past V) and their ids."""
    pid = tl.program_id(0)
    prev = tl.load(PREV).to(tl.int64)
    rows = pid * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    rmask = rows < V
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)  # [BLOCK_V] float32 W2 @ W1[prev]
    for r0 in range(0, R, BLOCK_R):
        cols = r0 + tl.arange(0, BLOCK_R)
        cmask = cols < R
        m = tl.load(W1 + prev * R + cols, mask=cmask, other=0.0).to(tl.float32)  # [BLOCK_R]
        w = tl.load(W2 + rows[:, None].to(tl.int64) * R + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_R]
        acc += tl.sum(w * m[None, :], axis=1)
    bias = acc.to(W2.dtype.element_ty).to(tl.float32)  # nn.Linear's output dtype, as the torch path
    logits = tl.load(BASE + rows, mask=rmask, other=float("-inf")).to(tl.float32) + bias  # [BLOCK_V]
    return tl.where(rmask, logits, float("-inf")), rows


@triton.jit
def _markov_tile(BASE, W1, W2, PREV, V, R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [pid * BLOCK_V, +BLOCK_V) of ``base + W2 @ W1[prev]``: (their max, the first row holding it)."""
    logits, rows = _markov_logits(BASE, W1, W2, PREV, V, R, BLOCK_V, BLOCK_R)
    best = tl.max(logits, axis=0)
    idx = tl.min(tl.where(logits == best, rows, 2147483647), axis=0)
    return best, idx


@triton.jit
def _markov_tile2(BASE, W1, W2, PREV, V, R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """``_markov_tile`` and the same pair for the tile's rows without its argmax (the second best)."""
    logits, rows = _markov_logits(BASE, W1, W2, PREV, V, R, BLOCK_V, BLOCK_R)
    best = tl.max(logits, axis=0)
    idx = tl.min(tl.where(logits == best, rows, 2147483647), axis=0)
    rest = tl.where(rows == idx, float("-inf"), logits)
    best2 = tl.max(rest, axis=0)
    idx2 = tl.min(tl.where((rows < V) & (rows != idx) & (rest == best2), rows, 2147483647), axis=0)
    return best, idx, best2, idx2


@triton.jit
def _markov_slot(BASE, W1, W2, PREV, PV, PI, LOCK, OUT, D2T, V, R: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_R: tl.constexpr, NP_P: tl.constexpr, MAP: tl.constexpr, PDL_ON: tl.constexpr):
    """Program p: the partial of tile p -> PV[p], PI[p]; the last program to arrive (counter LOCK) reduces
    the P partials -> OUT (int64: the max, the lowest token id among the tied ones; ``D2T[tok]`` with MAP) and
    resets LOCK to 0."""
    if PDL_ON:
        gdc_wait()  # the previous kernel's outputs (base, prev) are complete and visible after this
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    best, idx = _markov_tile(BASE, W1, W2, PREV, V, R, BLOCK_V, BLOCK_R)
    if PDL_ON:
        gdc_launch_dependents()  # let the next kernel launch (it waits for this one to end before reading)
    tl.store(PV + pid, best)
    tl.store(PI + pid, idx)
    tl.debug_barrier()  # every thread's partial stores are issued before the release below
    arrived = tl.atomic_add(LOCK, 1, sem="acq_rel", scope="gpu")  # programs arrived before this one
    if arrived == n_prog - 1:  # the last one: every partial is written (acquire), reduce them in tile order
        offs = tl.arange(0, NP_P)  # [NP_P]
        mask = offs < n_prog
        v = tl.load(PV + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")  # [NP_P] bypass L1
        i = tl.load(PI + offs, mask=mask, other=2147483647, cache_modifier=".cg")  # [NP_P]
        top = tl.max(v, axis=0)
        tok = tl.min(tl.where(v == top, i, 2147483647), axis=0).to(tl.int64)  # ties -> lowest id, as torch.argmax
        if MAP:
            tok = tl.load(D2T + tok)  # draft id -> target id
        tl.store(OUT, tok)
        tl.atomic_xchg(LOCK, 0)  # zero for the next launch (stream-ordered after this kernel's end)


@triton.jit
def _markov_rows(BASE, W1, W2, TOK, TABLE, PV, PI, LOCK, D2T, V, R: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_R: tl.constexpr, NP_P: tl.constexpr, MAP: tl.constexpr, PDL_ON: tl.constexpr):
    """Program (p, row): ``_markov_slot`` for several (prev, out, out2) rows of one slot at once (a draft tree's
    main chain and its branches at one depth, ``dspark_core.decoding.tree``): TABLE[row] = indices into the token
    buffer TOK of the previous token, the output and the second-best output (-1: none). Each row has its own
    partials (PV / PI + row * 2 * NP_P) and arrival counter (LOCK + row). MAP: both picks written as D2T[pick]."""
    if PDL_ON:
        gdc_wait()
    pid = tl.program_id(0)
    row = tl.program_id(1)
    n_prog = tl.num_programs(0)
    prev_i = tl.load(TABLE + row * 3)
    best, idx, best2, idx2 = _markov_tile2(BASE, W1, W2, TOK + prev_i, V, R, BLOCK_V, BLOCK_R)
    if PDL_ON:
        gdc_launch_dependents()
    pv = PV + row * 2 * NP_P
    pi = PI + row * 2 * NP_P
    tl.store(pv + pid, best)
    tl.store(pi + pid, idx)
    tl.store(pv + NP_P + pid, best2)
    tl.store(pi + NP_P + pid, idx2)
    tl.debug_barrier()
    arrived = tl.atomic_add(LOCK + row, 1, sem="acq_rel", scope="gpu")
    if arrived == n_prog - 1:
        offs = tl.arange(0, NP_P)
        mask = offs < n_prog
        v = tl.load(pv + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
        i = tl.load(pi + offs, mask=mask, other=2147483647, cache_modifier=".cg")
        top = tl.max(v, axis=0)
        tok = tl.min(tl.where(v == top, i, 2147483647), axis=0)
        first = tok.to(tl.int64)
        if MAP:
            first = tl.load(D2T + first)
        tl.store(TOK + tl.load(TABLE + row * 3 + 1), first)
        out2_i = tl.load(TABLE + row * 3 + 2)
        if out2_i >= 0:
            v2 = tl.load(pv + NP_P + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            i2 = tl.load(pi + NP_P + offs, mask=mask, other=2147483647, cache_modifier=".cg")
            own = offs == tok // BLOCK_V
            cv = tl.where(own, v2, v)
            ci = tl.where(own, i2, i)
            top2 = tl.max(cv, axis=0)
            tok2 = tl.min(tl.where(mask & (cv == top2), ci, 2147483647), axis=0)
            second = tl.minimum(tok2, V - 1).to(tl.int64)
            if MAP:
                second = tl.load(D2T + second)
            tl.store(TOK + out2_i, second)
        tl.atomic_xchg(LOCK + row, 0)


@triton.jit
def _markov_sample(BASE, W1, W2, PREV, RACE, Q, PART, PI, LOCK, OUT, STATS, D2T, V, temperature, R: tl.constexpr,
                   BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, NP_P: tl.constexpr, MAP: tl.constexpr,
                   PDL_ON: tl.constexpr):
    """A sampled slot at temperature T (no top-k / top-p). Program p: its tile's l = (base + bias) / T -> Q (raw;
    ``_normalize_q`` turns it into probabilities once the slot's max and mass are known) and three partials: the
    race winner (max of ``l - log E``, E = -log U, lowest row on ties), max(l) and sum(exp(l - max)). The last
    program to arrive: the token -> OUT, (M, Z) -> STATS, counter reset. ``argmax(l - log E) = argmax(softmax(l) /
    E)``: the exponential race of ``race_sample``, without the normalisation it does not need. MAP (a reduced draft
    vocabulary): row d's draw is RACE[D2T[d]] and the token D2T[winner]."""
    if PDL_ON:
        gdc_wait()
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    logits, rows = _markov_logits(BASE, W1, W2, PREV, V, R, BLOCK_V, BLOCK_R)
    if PDL_ON:
        gdc_launch_dependents()
    rmask = rows < V
    lt = logits / temperature  # [BLOCK_V] -inf past V
    tl.store(Q + rows, lt, mask=rmask)
    if MAP:
        u = tl.load(RACE + tl.load(D2T + rows, mask=rmask, other=0), mask=rmask, other=0.5)  # [BLOCK_V] U[0, 1)
    else:
        u = tl.load(RACE + rows, mask=rmask, other=0.5)  # [BLOCK_V] U[0, 1)
    g = tl.where(rmask, lt - tl.log(-tl.log(tl.maximum(u, 1e-30))), float("-inf"))  # [BLOCK_V]
    g_best = tl.max(g, axis=0)
    g_idx = tl.min(tl.where(g == g_best, rows, 2147483647), axis=0)
    m = tl.max(lt, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(tl.where(rmask, tl.exp(lt - m_safe), 0.0), axis=0)
    tl.store(PART + pid, g_best)
    tl.store(PART + NP_P + pid, m)
    tl.store(PART + 2 * NP_P + pid, z)
    tl.store(PI + pid, g_idx)
    tl.debug_barrier()
    arrived = tl.atomic_add(LOCK, 1, sem="acq_rel", scope="gpu")
    if arrived == n_prog - 1:
        offs = tl.arange(0, NP_P)  # [NP_P]
        mask = offs < n_prog
        gv = tl.load(PART + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")  # [NP_P]
        gi = tl.load(PI + offs, mask=mask, other=2147483647, cache_modifier=".cg")  # [NP_P]
        mv = tl.load(PART + NP_P + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")  # [NP_P]
        zv = tl.load(PART + 2 * NP_P + offs, mask=mask, other=0.0, cache_modifier=".cg")  # [NP_P]
        top = tl.max(gv, axis=0)
        tok = tl.min(tl.where(gv == top, gi, 2147483647), axis=0).to(tl.int64)
        if MAP:
            tok = tl.load(D2T + tok)
        tl.store(OUT, tok)
        big = tl.max(mv, axis=0)
        tl.store(STATS, big)
        tl.store(STATS + 1, tl.sum(tl.where(mask, zv * tl.exp(mv - big), 0.0), axis=0))
        tl.atomic_xchg(LOCK, 0)


@triton.jit
def _normalize_q(Q, STATS, V, BLOCK: tl.constexpr, PDL_ON: tl.constexpr):
    """Row r of Q [S, V] (scaled logits l): ``exp(l - M_r) / Z_r`` in place, (M_r, Z_r) = STATS[r]."""
    if PDL_ON:
        gdc_wait()
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < V
    big = tl.load(STATS + 2 * row)
    mass = tl.load(STATS + 2 * row + 1)
    lt = tl.load(Q + row * V + offs, mask=mask, other=float("-inf"))
    if PDL_ON:
        gdc_launch_dependents()
    tl.store(Q + row * V + offs, tl.exp(lt - big) / mass, mask=mask)


@triton.jit
def _expand_q(Q, SRC, STATS, T2D, VT, VD, BLOCK: tl.constexpr, PDL_ON: tl.constexpr):
    """Row r of Q [S, Vt]: ``exp(l - M_r) / Z_r`` at each target token t of the draft vocabulary, l = SRC[r, T2D[t]]
    (the slot's scaled logits over the Vd draft tokens), 0 at every other token (T2D[t] < 0)."""
    if PDL_ON:
        gdc_wait()
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] target ids
    mask = offs < VT
    d = tl.load(T2D + offs, mask=mask, other=-1)  # [BLOCK] draft ids, -1 outside
    kept = d >= 0
    big = tl.load(STATS + 2 * row)
    mass = tl.load(STATS + 2 * row + 1)
    lt = tl.load(SRC + row * VD + d, mask=mask & kept, other=float("-inf"))
    if PDL_ON:
        gdc_launch_dependents()
    tl.store(Q + row * VT + offs, tl.where(kept, tl.exp(lt - big) / mass, 0.0), mask=mask)


class MarkovArgmax:
    """Greedy Markov slots for one (W1 [Vt, r], W2 [V, r]) pair, with preallocated partial buffers and an
    arrival counter (made here, so before any CUDA graph capture). ``d2t`` [V] int64 (a reduced draft vocabulary:
    V = Vd < Vt, the target id of each W2 row, ascending): tokens are written as target ids."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, d2t: torch.Tensor | None = None) -> None:
        if w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != w2.shape[1]:
            raise ValueError(f"MarkovArgmax: W1 {tuple(w1.shape)} and W2 {tuple(w2.shape)} must be [Vt, r] and [V, r]")
        if d2t is None and w1.shape[0] != w2.shape[0]:
            raise ValueError(f"MarkovArgmax: W2 has {w2.shape[0]} rows, W1 {w1.shape[0]}: give d2t, the target id of "
                             "each W2 row (a reduced draft vocabulary)")
        if d2t is not None and (d2t.shape != (w2.shape[0],) or d2t.dtype != torch.int64):
            raise ValueError(f"MarkovArgmax: d2t must be int64 [{w2.shape[0]}]; got {d2t.dtype} {list(d2t.shape)}")
        self.w1, self.w2 = w1.contiguous(), w2.contiguous()
        self.vocab, self.rank = w2.shape
        self.mapped = d2t is not None
        self.d2t = d2t.contiguous() if d2t is not None else torch.zeros(1, device=w1.device, dtype=torch.int64)
        self.zero = torch.zeros(1, device=w1.device, dtype=torch.int64)  # [1] the row index of ``features``
        self.parts = triton.cdiv(self.vocab, BLOCK_V)
        self.pv = torch.empty(self.parts, device=w1.device, dtype=torch.float32)  # [P] partial maxima
        self.pi = torch.empty(self.parts, device=w1.device, dtype=torch.int32)  # [P] their first token ids
        self.arrived = torch.zeros(1, device=w1.device, dtype=torch.int32)  # [1] zero between launches
        self.block_r = min(64, triton.next_power_of_2(self.rank))
        self._row_buffers: tuple[torch.Tensor, ...] | None = None  # partials / counters of ``rows``

    def _input(self, prev: torch.Tensor, features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the matrix, the row index) the kernels read W2's input from: (W1, prev), or (u [r], 0)."""
        if features is None:
            return self.w1, prev
        if features.numel() != self.rank or features.dtype != self.w2.dtype or not features.is_contiguous():
            raise ValueError(f"MarkovArgmax: features must be contiguous {self.w2.dtype} [{self.rank}]; got "
                             f"{features.dtype} {list(features.shape)}")
        return features, self.zero

    def __call__(self, base: torch.Tensor, prev: torch.Tensor, out: torch.Tensor,
                 features: torch.Tensor | None = None) -> None:
        """``out[0] = argmax(base + W2 W1[prev[0]])`` for base [V] (float32), prev / out 1-element int64 views
        (``features`` u [r]: ``W2 u`` in place of ``W2 W1[prev]``; the pick as a target id with ``d2t``)."""
        w1, prev = self._input(prev, features)
        _markov_slot[(self.parts,)](base, w1, self.w2, prev, self.pv, self.pi, self.arrived, out, self.d2t,
                                    self.vocab, R=self.rank, BLOCK_V=BLOCK_V, BLOCK_R=self.block_r,
                                    NP_P=triton.next_power_of_2(self.parts), MAP=self.mapped, PDL_ON=PDL, num_warps=4,
                                    **_LAUNCH)


    def rows(self, base: torch.Tensor, tok: torch.Tensor, table: torch.Tensor, max_rows: int = 16) -> None:
        """Several rows of one slot in one launch: for each ``table`` row (prev, out, out2) int32 indices into
        ``tok`` (int64), ``tok[out] = argmax(base + W2 W1[tok[prev]])`` and, where out2 >= 0, ``tok[out2]`` = the
        second best. Buffers for up to ``max_rows`` rows are made on first use (before any CUDA-graph capture)."""
        _rows_check(tok, table)
        n = table.shape[0]
        np_p = triton.next_power_of_2(self.parts)
        if self._row_buffers is None or self._row_buffers[2].numel() < n:
            dev = self.w1.device
            size = max(n, max_rows)
            self._row_buffers = (torch.empty(size * 2 * np_p, device=dev, dtype=torch.float32),
                                 torch.empty(size * 2 * np_p, device=dev, dtype=torch.int32),
                                 torch.zeros(size, device=dev, dtype=torch.int32))
        pv, pi, lock = self._row_buffers
        _markov_rows[(self.parts, n)](base, self.w1, self.w2, tok, table, pv, pi, lock, self.d2t, self.vocab,
                                      R=self.rank, BLOCK_V=BLOCK_V, BLOCK_R=self.block_r, NP_P=np_p, MAP=self.mapped,
                                      PDL_ON=PDL, num_warps=4, **_LAUNCH)


class MarkovSampler(MarkovArgmax):
    """Sampled Markov slots at a temperature (no top-k / top-p): one launch per slot (``_markov_sample``), drawing
    the token by the exponential race on given U[0, 1) draws and leaving the slot's scaled logits and (max, mass)
    behind; then one launch (``normalize``) turns all the slots' rows into their distributions q. The torch path
    (``StaticDraft.propose_sampled`` without kernels) is ~35 kernels a slot: softmax, the race, the Markov bias."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, d2t: torch.Tensor | None = None) -> None:
        super().__init__(w1, w2, d2t)
        self.t2d = None  # [Vt] int32 draft id of each target token (-1 outside), with d2t
        if d2t is not None:
            self.t2d = torch.full((w1.shape[0],), -1, device=w1.device, dtype=torch.int32)
            self.t2d[d2t] = torch.arange(d2t.shape[0], device=w1.device, dtype=torch.int32)
        self.np_p = triton.next_power_of_2(self.parts)
        self.part = torch.empty(3 * self.np_p, device=w1.device, dtype=torch.float32)  # [3 P'] race best, max, mass
        self.sample_lock = torch.zeros(1, device=w1.device, dtype=torch.int32)  # [1] zero between launches

    def sample(self, base: torch.Tensor, prev: torch.Tensor, race: torch.Tensor, q_row: torch.Tensor,
               out: torch.Tensor, stats: torch.Tensor, temperature: float, features: torch.Tensor | None = None
               ) -> None:
        """``out[0]`` ~ softmax((base + W2 W1[prev[0]]) / T), drawn by the race on ``race [Vt]``; ``q_row [V]`` gets
        the scaled logits and ``stats [2]`` their (max, sum of exp(l - max)) until ``normalize`` (``features``: as
        ``__call__``)."""
        if not temperature > 0:
            raise ValueError(f"MarkovSampler.sample: temperature must be > 0; got {temperature!r}")
        w1, prev = self._input(prev, features)
        _markov_sample[(self.parts,)](base, w1, self.w2, prev, race, q_row, self.part, self.pi, self.sample_lock,
                                      out, stats, self.d2t, self.vocab, float(temperature), R=self.rank,
                                      BLOCK_V=BLOCK_V, BLOCK_R=self.block_r, NP_P=self.np_p, MAP=self.mapped,
                                      PDL_ON=PDL, num_warps=4, **_LAUNCH)

    def normalize(self, q: torch.Tensor, stats: torch.Tensor, src: torch.Tensor | None = None) -> None:
        """q [S, V] scaled logits -> probabilities, row r with ``stats[r] = (max, mass)``. With ``d2t``: ``src``
        [S, Vd] holds the scaled logits (``sample``'s q_row) and q [S, Vt] gets the probabilities, 0 outside."""
        block = 1024
        if self.t2d is None:
            _normalize_q[(triton.cdiv(self.vocab, block), q.shape[0])](q, stats, self.vocab, BLOCK=block, PDL_ON=PDL,
                                                                        num_warps=4, **_LAUNCH)
            return
        vt = self.t2d.shape[0]
        if src is None or tuple(src.shape) != (q.shape[0], self.vocab) or tuple(q.shape[1:]) != (vt,):
            raise ValueError(f"MarkovSampler.normalize: a reduced vocabulary needs src [S, {self.vocab}] and q "
                             f"[S, {vt}]; got src {None if src is None else list(src.shape)}, q {list(q.shape)}")
        _expand_q[(triton.cdiv(vt, block), q.shape[0])](q, src, stats, self.t2d, vt, self.vocab, BLOCK=block,
                                                         PDL_ON=PDL, num_warps=4, **_LAUNCH)


def _rows_check(tok: torch.Tensor, table: torch.Tensor) -> None:
    if tok.dtype != torch.int64 or tok.dim() != 1 or not tok.is_contiguous():
        raise ValueError(f"MarkovArgmax.rows: tok must be a contiguous int64 vector; got {tok.dtype} {list(tok.shape)}")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[1] != 3 or not table.is_contiguous():
        raise ValueError(f"MarkovArgmax.rows: table must be contiguous int32 [rows, 3]; got {table.dtype} "
                         f"{list(table.shape)}")


def markov_slot_reference(base: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The torch path: ``argmax(base + float(W2 W1[prev]))`` -> [1] int64."""
    m = torch.nn.functional.embedding(prev.view(1), w1)  # [1, r]
    return (base.view(1, -1) + torch.nn.functional.linear(m, w2).float()).argmax(dim=-1)  # [1]
