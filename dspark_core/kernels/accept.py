"""The greedy accept step of the static speculative engine in one Triton kernel launch.

After the target's verify forward, ``StaticSpeculativeDecoder._verify_update`` needs the row argmaxes of the
logits, the accepted prefix length, the bonus token and the update of the anchor position / token; as torch
ops that is about a dozen kernels (a few microseconds each even inside a CUDA graph). ``GreedyAccept`` does
it in one launch, with exactly the semantics of :func:`greedy_accept_reference`::

    out = [a, cap, t_1..t_S, bonus]         int64 [S+3], t = the draft's tokens, cap = slots allowed
    best = argmax(logits, -1)               [R]   (first maximum, as torch.argmax)
    a = length of the prefix j < S with best[j] == t_{j+1} and j < cap
    bonus = best[a];  out[0] = a;  out[2+S] = bonus;  p += a + 1;  anchor = bonus

B requests at once (``batch``): logits [B*R, V] row-major by request, out [B, S+3], p / anchor [B]; each request
is decided exactly as it would be alone, in the same single launch.

Grid (B*R, T): program (r, t) loads tile t (BLOCK_V columns) of logits row r (request b = r // R), and writes
that tile's maximum (compared in float32: exact for float16 / bfloat16 / float32 logits) and its lowest index
holding the maximum to a float32 / int32 workspace [B*R, T]. It then increments request b's arrival counter
(``tl.atomic_add``, acq_rel, gpu scope, after a ``debug_barrier`` so that every thread's partial stores are
issued before the release): the program that sees ``old == R*T - 1`` arrived last among request b's, so every
partial of b is visible to it (the acquire half; it reads them with ``.cg`` loads, past L1). That program
reduces each of b's rows' T partials -- the row maximum, then the lowest tile argmax among the tiles holding it,
which is the row's lowest index holding the maximum, i.e. exactly ``torch.argmax``'s tie rule -- computes a and
the bonus, writes b's ``out`` / ``p`` / ``anchor``, and resets b's counter to 0 (``atomic_xchg``) so that the
next launch, a CUDA-graph replay included, starts from zero.

Deterministic: a maximum and a minimum index are exact whatever order the partials arrive in (no rounding),
and the reduction reads them in a fixed order anyway; the same logits give the same bits as torch.

NaN logits are not handled like torch (which treats NaN as the maximum): with a NaN in a row the row's
result is unspecified, but always a valid token id in [0, V).

Same pattern as ``dspark_core.kernels.gemm._gemm_small``'s split-K (last-arriving program reduces) and its
programmatic-dependent-launch convention (``gdc_wait`` first thing when ``PDL``).

Shape legend: B requests, R rows = S+1 (verify positions of one request), S block size (draft tokens), V vocab,
T = cdiv(V, BLOCK_V) vocab tiles, R_P / T_P their next powers of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_core.kernels.pdl import _LAUNCH, PDL, gdc_launch_dependents, gdc_wait

MAX_ROWS = 16  # R = S+1 <= 16 (the widest verify step of the decode kernels)
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # exact in the kernel's float32 compare


@triton.jit
def _tile_argmax(LOGITS, row, tile, stride_row, V, BLOCK_V: tl.constexpr):
    """Max (float32) and lowest index holding it of columns [tile * BLOCK_V, +BLOCK_V) of one row."""
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    cmask = cols < V
    x = tl.load(LOGITS + row.to(tl.int64) * stride_row + cols, mask=cmask, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    idx = tl.min(tl.where(cmask & (x == m), cols, V), 0)  # V only if no column equals m (NaN)
    return m, tl.minimum(idx, V - 1)


@triton.jit
def _row_argmax(WS_MAX, WS_IDX, R, T, V, R_P: tl.constexpr, T_P: tl.constexpr):
    """Each row's argmax from its T tile partials [R, T] (ties: the lowest index). Returns int64 [R_P]."""
    r = tl.arange(0, R_P)
    t = tl.arange(0, T_P)
    offs = r[:, None] * T + t[None, :]  # [R_P, T_P]
    valid = (r[:, None] < R) & (t[None, :] < T)
    pm = tl.load(WS_MAX + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")  # [R_P, T_P]
    pi = tl.load(WS_IDX + offs, mask=valid, other=V, cache_modifier=".cg")  # [R_P, T_P]
    m = tl.max(pm, 1)  # [R_P]
    best = tl.min(tl.where(valid & (pm == m[:, None]), pi, V), 1)  # [R_P]
    return tl.minimum(best, V - 1).to(tl.int64)


@triton.jit
def _accept(best, OUT, P, ANCHOR, S, R_P: tl.constexpr):
    """Accepted prefix a and bonus best[a] from the row argmaxes best [R_P]; writes out[0], out[2+S], p, anchor."""
    j = tl.arange(0, R_P)  # [R_P] draft slot
    slot = j < S
    tokens = tl.load(OUT + 2 + j, mask=slot, other=-1)  # [R_P] t_{j+1}
    cap = tl.load(OUT + 1)
    match = (best == tokens) & (j < cap)
    a = tl.min(tl.where(slot & ~match, j, S), 0)  # the first mismatch, or S: cumprod(match).sum()
    bonus = tl.sum(tl.where(j == a, best, 0), 0)
    tl.store(OUT, a.to(tl.int64))
    tl.store(OUT + 2 + S, bonus)
    tl.store(P, tl.load(P) + a + 1)
    tl.store(ANCHOR, bonus)


@triton.jit
def _publish(WS_A, WS_B, slot, a, b, LOCK):
    """Store this program's two partials at ``slot`` of the workspaces and count in on the arrival counter: returns
    how many programs arrived before this one (the last one sees every partial: acquire)."""
    tl.store(WS_A + slot, a)
    tl.store(WS_B + slot, b)
    tl.debug_barrier()  # every thread's partial stores are issued before the release below
    return tl.atomic_add(LOCK, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _greedy_accept(LOGITS, OUT, P, ANCHOR, WS_MAX, WS_IDX, LOCK, stride_row, R, T, V,
                   BLOCK_V: tl.constexpr, R_P: tl.constexpr, T_P: tl.constexpr, PDL_ON: tl.constexpr):
    """Program (row, tile): the tile's partial argmax; the last program of the row's request to arrive does the
    rest for that request (module doc)."""
    if PDL_ON:
        gdc_wait()  # the previous kernel's outputs (the logits, out) are complete and visible after this
    row = tl.program_id(0)
    tile = tl.program_id(1)
    b = row // R  # the request
    m, idx = _tile_argmax(LOGITS, row, tile, stride_row, V, BLOCK_V)
    if PDL_ON:
        gdc_launch_dependents()  # let the next kernel launch while this one finishes
    arrived = _publish(WS_MAX, WS_IDX, row * T + tile, m, idx, LOCK + b)
    if arrived == R * T - 1:  # the request's last program: every partial of it is written and visible
        best = _row_argmax(WS_MAX + b * R * T, WS_IDX + b * R * T, R, T, V, R_P, T_P)  # [R_P]
        _accept(best, OUT + b * (R + 2), P + b, ANCHOR + b, R - 1, R_P)
        tl.atomic_xchg(LOCK + b, 0)  # ready for the next launch / graph replay


@triton.jit
def _gather(values, idx, r):
    """values[idx] for register vectors ``values`` [R_P] (indexed by r = arange(R_P)) and idx [X]."""
    return tl.sum(tl.where(idx[:, None] == r[None, :], values[None, :], 0), 1)


@triton.jit
def _gather2(values, idx, r):
    """values[idx] for ``values`` [R_P] (indexed by r) and idx [X, Y]."""
    return tl.sum(tl.where(idx[:, :, None] == r[None, None, :], values[None, None, :], 0), 2)


@triton.jit
def _move_slots(KC, VC, path, e, S, p_old, LH, M_ALLOC, D: tl.constexpr, LH_BLOCK: tl.constexpr):
    """K/V of the path's branch nodes (caches [LH = layers x kv heads, M_ALLOC, D]) from slot p + row to p + depth."""
    lh = tl.arange(0, LH_BLOCK)
    d = tl.arange(0, D)
    for j in range(1, S + 1):  # main-chain rows are already in place
        row = tl.sum(tl.where(e == j, path, 0), 0)
        if row != j:
            src = (p_old + row) * D
            dst = (p_old + j) * D
            for lh0 in range(0, LH, LH_BLOCK):
                heads = lh0 + lh
                hmask = (heads < LH)[:, None]
                offs = heads.to(tl.int64)[:, None] * M_ALLOC * D + d[None, :]
                tl.store(KC + offs + dst, tl.load(KC + offs + src, mask=hmask), mask=hmask)
                tl.store(VC + offs + dst, tl.load(VC + offs + src, mask=hmask), mask=hmask)


@triton.jit
def _accept_tree(best, OUT, P, ANCHOR, PARENT, DEPTH, ANC, PATH, KC, VC, DKC, DVC, S, R, LH, M_ALLOC, DLH, DM_ALLOC,
                 R_P: tl.constexpr, S_P: tl.constexpr, D: tl.constexpr, DD: tl.constexpr, LH_BLOCK: tl.constexpr,
                 DLH_BLOCK: tl.constexpr):
    """Greedy tree acceptance (``dspark_core.decoding.tree.tree_accept_reference``) from the row argmaxes best [R_P].

    out = [a, cap, path tokens t_1..t_S, bonus, node tokens (R - 1)]: writes a, the path tokens and the bonus;
    PATH [3, S+1] = the path's rows, their cache slots (p + row) and the slots they move to (p + depth);
    then p += a + 1, anchor = bonus. Moves the accepted branch nodes' K/V from slot p + row to p + depth in the
    target's caches (KC / VC [LH, M_ALLOC, D]) and the draft's context caches (DKC / DVC [DLH, DM_ALLOC, DD]):
    only on cycles a branch won, a few slots."""
    r = tl.arange(0, R_P)  # [R_P] verify row
    valid = (r >= 1) & (r < R)
    par = tl.load(PARENT + r, mask=valid, other=0).to(tl.int32)  # [R_P]
    tok = tl.load(OUT + 3 + S + (r - 1), mask=valid, other=-1)  # [R_P] node tokens (row r = node r - 1)
    ok = (_gather(best, par, r) == tok) & valid  # [R_P] the node matches its parent's argmax
    e = tl.arange(0, S_P)  # [S_P] depth
    emask = e <= S
    dep = tl.load(DEPTH + r, mask=r < R, other=0).to(tl.int32)  # [R_P]
    amask = (r[:, None] < R) & emask[None, :]
    anc = tl.load(ANC + r[:, None] * (S + 1) + e[None, :], mask=amask, other=0).to(tl.int32)  # [R_P, S_P]
    anc_ok = _gather2(ok.to(tl.int32), anc, r)  # [R_P, S_P]
    need = (e[None, :] >= 1) & (e[None, :] <= dep[:, None])
    accepted = tl.sum(tl.where(need & (anc_ok == 0), 1, 0), 1) == 0  # [R_P] every ancestor holds
    score = tl.where(accepted & (r < R), dep, -1)
    a = tl.max(score, 0)
    w = tl.min(tl.where(score == a, r, R_P), 0)  # the deepest accepted row (the anchor when none)
    path = tl.load(ANC + w * (S + 1) + e, mask=emask, other=0).to(tl.int32)  # [S_P] rows at depths 0..S
    bonus = tl.sum(tl.where(r == w, best, 0), 0)
    p_old = tl.load(P)
    tl.store(OUT + 2 + (e - 1), _gather(tok, path, r), mask=(e >= 1) & emask)
    tl.store(OUT, a.to(tl.int64))
    tl.store(OUT + 2 + S, bonus)
    tl.store(PATH + e, path.to(tl.int64), mask=emask)
    tl.store(PATH + (S + 1) + e, p_old + path, mask=emask)
    tl.store(PATH + 2 * (S + 1) + e, p_old + e, mask=emask)
    tl.store(P, p_old + a + 1)
    tl.store(ANCHOR, bonus)
    if w > S:  # a branch won: move its nodes' K/V into place
        _move_slots(KC, VC, path, e, S, p_old, LH, M_ALLOC, D, LH_BLOCK)
        _move_slots(DKC, DVC, path, e, S, p_old, DLH, DM_ALLOC, DD, DLH_BLOCK)


@triton.jit
def _greedy_accept_tree(LOGITS, OUT, P, ANCHOR, WS_MAX, WS_IDX, LOCK, PARENT, DEPTH, ANC, PATH, KC, VC, DKC, DVC,
                        stride_row, R, T, V, S, LH, M_ALLOC, DLH, DM_ALLOC, BLOCK_V: tl.constexpr, R_P: tl.constexpr,
                        T_P: tl.constexpr, S_P: tl.constexpr, D: tl.constexpr, DD: tl.constexpr,
                        LH_BLOCK: tl.constexpr, DLH_BLOCK: tl.constexpr, PDL_ON: tl.constexpr):
    """``_greedy_accept`` for a draft tree: the same partial argmaxes, then ``_accept_tree``."""
    if PDL_ON:
        gdc_wait()
    row = tl.program_id(0)
    tile = tl.program_id(1)
    m, idx = _tile_argmax(LOGITS, row, tile, stride_row, V, BLOCK_V)
    if PDL_ON:
        gdc_launch_dependents()
    arrived = _publish(WS_MAX, WS_IDX, row * T + tile, m, idx, LOCK)
    if arrived == R * T - 1:
        best = _row_argmax(WS_MAX, WS_IDX, R, T, V, R_P, T_P)  # [R_P]
        _accept_tree(best, OUT, P, ANCHOR, PARENT, DEPTH, ANC, PATH, KC, VC, DKC, DVC, S, R, LH, M_ALLOC, DLH,
                     DM_ALLOC, R_P, S_P, D, DD, LH_BLOCK, DLH_BLOCK)
        tl.atomic_xchg(LOCK, 0)


# -- the sampled accept step (exact rejection sampling at a plain temperature) ---------------------------------------
@triton.jit
def _sampled_stats(LOGITS, Q, U, OUT, P, WS_MAX, WS_SUM, STATE, LOCK, stride_row, temperature, R, T, V,
                   BLOCK_V: tl.constexpr, R_P: tl.constexpr, T_P: tl.constexpr, PDL_ON: tl.constexpr):
    """Program (row, tile): the tile's max and sum exp of l = logits / T. The last program to arrive: each row's
    (M, Z), p_j(t_j) = exp(l_j(t_j) - M_j) / Z_j, the accepted prefix a (u_j q_j(t_j) < p_j(t_j) and j < cap, slot
    by slot), out[0] = a, p += a + 1, and STATE = [a, M_a, Z_a] for ``_sampled_bonus``."""
    if PDL_ON:
        gdc_wait()
    row = tl.program_id(0)
    tile = tl.program_id(1)
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    cmask = cols < V
    lt = tl.load(LOGITS + row.to(tl.int64) * stride_row + cols, mask=cmask, other=float("-inf")).to(tl.float32)
    lt = lt / temperature
    m = tl.max(lt, 0)
    z = tl.sum(tl.where(cmask, tl.exp(lt - m), 0.0), 0)
    if PDL_ON:
        gdc_launch_dependents()
    arrived = _publish(WS_MAX, WS_SUM, row * T + tile, m, z, LOCK)
    if arrived == R * T - 1:
        r = tl.arange(0, R_P)  # [R_P]
        t = tl.arange(0, T_P)  # [T_P]
        valid = (r[:, None] < R) & (t[None, :] < T)
        offs = r[:, None] * T + t[None, :]  # [R_P, T_P]
        pm = tl.load(WS_MAX + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")
        ps = tl.load(WS_SUM + offs, mask=valid, other=0.0, cache_modifier=".cg")
        big = tl.max(pm, 1)  # [R_P] row max M
        big = tl.where(r < R, big, 0.0)  # padding rows: 0, not -inf (no inf - inf below)
        mass = tl.sum(tl.where(valid, ps * tl.exp(pm - big[:, None]), 0.0), 1)  # [R_P] row Z
        mass = tl.where(r < R, mass, 1.0)
        s = R - 1
        slot = r < s
        tok = tl.load(OUT + 2 + r, mask=slot, other=0)  # [R_P] t_{j+1}
        l_tok = tl.load(LOGITS + r.to(tl.int64) * stride_row + tok, mask=slot, other=0.0).to(tl.float32)
        p_tok = tl.exp(l_tok / temperature - big) / mass  # [R_P]
        cap = tl.load(OUT + 1)
        live = slot & (r < cap)
        q_tok = tl.load(Q + r.to(tl.int64) * V + tok, mask=live, other=0.0)  # [R_P]
        u = tl.load(U + r, mask=slot, other=1.0)
        ok = (u * q_tok < p_tok) & live
        a = tl.min(tl.where(slot & ~ok, r, s), 0)  # the first rejected (or uncounted) slot, or S
        tl.store(OUT, a.to(tl.int64))
        tl.store(P, tl.load(P) + a + 1)
        tl.store(STATE, a.to(tl.float32))
        tl.store(STATE + 1, tl.sum(tl.where(r == a, big, 0.0), 0))
        tl.store(STATE + 2, tl.sum(tl.where(r == a, mass, 0.0), 0))
        tl.atomic_xchg(LOCK, 0)


@triton.jit
def _sampled_bonus(LOGITS, Q, RACE, OUT, ANCHOR, STATE, WS_RES, WS_IDX, LOCK, stride_row, temperature, S, T, V,
                   BLOCK_V: tl.constexpr, T_P: tl.constexpr, PDL_ON: tl.constexpr):
    """Program (tile): over row a's tile, p = exp(l / T - M_a) / Z_a, q = q_a where slot a was counted (else 0),
    the residual max(p - q, 0): its mass and its exponential-race winner, and p's winner. The last program: the
    bonus is the residual's winner where its mass > 0, else p's (a rejection has probability 0 when p == q), as
    ``sampling.rejection_step``; out[2+S] = anchor = bonus."""
    if PDL_ON:
        gdc_wait()
    tile = tl.program_id(0)
    a = tl.load(STATE).to(tl.int32)
    big = tl.load(STATE + 1)
    mass = tl.load(STATE + 2)
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    cmask = cols < V
    lt = tl.load(LOGITS + a.to(tl.int64) * stride_row + cols, mask=cmask, other=float("-inf")).to(tl.float32)
    p = tl.exp(lt / temperature - big) / mass  # [BLOCK_V] 0 past V
    q_live = ((a < S) & (a < tl.load(OUT + 1))).to(tl.int32)  # slot a was counted: it has a q
    q = tl.load(Q + a.to(tl.int64) * V + cols, mask=cmask & (tl.zeros_like(cols) + q_live > 0), other=0.0)
    res = tl.maximum(p - q, 0.0)
    e = -tl.log(tl.maximum(tl.load(RACE + cols, mask=cmask, other=0.5), 1e-30))  # [BLOCK_V] Exp(1)
    k_res = tl.where(cmask, res / e, -1.0)
    k_p = tl.where(cmask, p / e, -1.0)
    best_res = tl.max(k_res, 0)
    best_p = tl.max(k_p, 0)
    if PDL_ON:
        gdc_launch_dependents()
    tl.store(WS_RES + tile, tl.sum(res, 0))
    tl.store(WS_RES + T_P + tile, best_res)
    tl.store(WS_RES + 2 * T_P + tile, best_p)
    tl.store(WS_IDX + tile, tl.min(tl.where(k_res == best_res, cols, V), 0))
    tl.store(WS_IDX + T_P + tile, tl.min(tl.where(k_p == best_p, cols, V), 0))
    tl.debug_barrier()
    arrived = tl.atomic_add(LOCK, 1, sem="acq_rel", scope="gpu")
    if arrived == T - 1:
        t = tl.arange(0, T_P)
        tm = t < T
        res_mass = tl.sum(tl.load(WS_RES + t, mask=tm, other=0.0, cache_modifier=".cg"), 0)
        use = tl.where(res_mass > 0, 0, 1)  # 0: the residual's race, 1: p's
        kv = tl.load(WS_RES + (1 + use) * T_P + t, mask=tm, other=-2.0, cache_modifier=".cg")  # [T_P]
        ki = tl.load(WS_IDX + use * T_P + t, mask=tm, other=V, cache_modifier=".cg")
        top = tl.max(kv, 0)
        bonus = tl.minimum(tl.min(tl.where(kv == top, ki, V), 0), V - 1).to(tl.int64)
        tl.store(OUT + 2 + S, bonus)
        tl.store(ANCHOR, bonus)
        tl.atomic_xchg(LOCK, 0)


class SampledAccept:
    """The sampled accept step of the static engine (exact rejection sampling at a plain temperature: no top-k /
    top-p) in two launches, in place of ``logits_to_probs`` on [S+1, V] + ``sampling.rejection_step`` (~50 torch
    kernels): ``_sampled_stats`` (row max / mass partials; the last program decides the accepted prefix) and
    ``_sampled_bonus`` (row a's residual or p, drawn by the exponential race). Same draws as the torch path:
    u [S] for the accept tests, race [V] for the bonus."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str, *, block_v: int | None = None,
                 num_warps: int = 4) -> None:
        if not 2 <= rows <= MAX_ROWS:
            raise ValueError(f"rows (S+1) must be in [2, {MAX_ROWS}]; got {rows}")
        block_v = default_block(rows, vocab) if block_v is None else int(block_v)
        if block_v < 16 or block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16; got {block_v}")
        self.rows, self.vocab, self.block_v, self.num_warps = rows, vocab, block_v, num_warps
        self.tiles = triton.cdiv(vocab, block_v)
        self.t_p = triton.next_power_of_2(self.tiles)
        dev = torch.device(device)
        self.ws_max = torch.empty(rows * self.tiles, dtype=torch.float32, device=dev)  # [R, T]
        self.ws_sum = torch.empty(rows * self.tiles, dtype=torch.float32, device=dev)  # [R, T]
        self.ws_res = torch.empty(3 * self.t_p, dtype=torch.float32, device=dev)  # [3, T']
        self.ws_idx = torch.empty(2 * self.t_p, dtype=torch.int32, device=dev)  # [2, T']
        self.state = torch.zeros(3, dtype=torch.float32, device=dev)  # [a, M_a, Z_a]
        self.locks = torch.zeros(2, dtype=torch.int32, device=dev)  # arrivals of each kernel; 0 between launches

    def __call__(self, logits: torch.Tensor, q: torch.Tensor, out: torch.Tensor, p: torch.Tensor,
                 anchor: torch.Tensor, u: torch.Tensor, race: torch.Tensor, temperature: float) -> None:
        """logits [S+1, V] (the verify's), q [S, V] float32 (the draft's distributions), out int64 [S+3] = [a, cap,
        t_1..t_S, bonus], p / anchor int64 [1], u [S] and race [V] U[0, 1) draws: writes a and the bonus into out,
        p += a + 1, anchor = bonus."""
        r, v, s = self.rows, self.vocab, self.rows - 1
        if tuple(logits.shape) != (r, v) or logits.stride(1) != 1 or logits.dtype not in LOGIT_DTYPES:
            raise ValueError(f"SampledAccept: logits must be [{r}, {v}] float, contiguous along the vocab; got "
                             f"{logits.dtype} {list(logits.shape)}")
        if tuple(q.shape) != (s, v) or q.dtype != torch.float32 or not q.is_contiguous():
            raise ValueError(f"SampledAccept: q must be contiguous float32 [{s}, {v}]; got {q.dtype} {list(q.shape)}")
        if not temperature > 0:
            raise ValueError(f"SampledAccept: temperature must be > 0; got {temperature!r}")
        temperature = float(temperature)
        _sampled_stats[(r, self.tiles)](logits, q, u, out, p, self.ws_max, self.ws_sum, self.state, self.locks,
                                        logits.stride(0), temperature, r, self.tiles, v, BLOCK_V=self.block_v,
                                        R_P=triton.next_power_of_2(r), T_P=self.t_p, PDL_ON=PDL,
                                        num_warps=self.num_warps, **_LAUNCH)
        _sampled_bonus[(self.tiles,)](logits, q, race, out, anchor, self.state, self.ws_res, self.ws_idx,
                                      self.locks[1:], logits.stride(0), temperature, s, self.tiles, v,
                                      BLOCK_V=self.block_v, T_P=self.t_p, PDL_ON=PDL, num_warps=self.num_warps,
                                      **_LAUNCH)


def kv_move_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, path: torch.Tensor) -> None:
    """Move the accepted tree path's K/V into place, as torch ops: for every layer and kv head, slot path[1, e]
    -> path[2, e] (caches [L, 1, Hkv, M, D], path int64 [3, S+1]; the tree accept kernel does this itself).
    Gather first, then scatter: sources are branch rows beyond every destination, or the destination itself."""
    for cache in (k_cache, v_cache):
        cache.index_copy_(3, path[2], cache.index_select(3, path[1]))


def default_block(rows: int, vocab: int) -> int:
    """Tile width: about 512 programs at most (a few hundred for R = 8, V = 49152: BLOCK_V 1024, 384 programs),
    between 1024 and 4096 columns (152k vocab, 16 rows: 4096, 608 programs)."""
    want = triton.next_power_of_2(triton.cdiv(rows * vocab, 512))
    return min(4096, max(1024, want))


class GreedyAccept:
    """The fused greedy accept step for logits [batch * rows, vocab] (rows = S+1 per request, row-major by
    request); see the module docstring.

    The workspace and the arrival counters are allocated here, once (before any CUDA-graph capture); one
    object must not run on two streams at once (they would share the counters). ``block_v`` (a power of two)
    overrides the tile width, for tests. ``tree`` mode takes batch 1."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str, *, batch: int = 1,
                 block_v: int | None = None, num_warps: int = 4, tree=None) -> None:
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"rows (S+1) must be in [1, {MAX_ROWS}]; got {rows}")
        if vocab < 1:
            raise ValueError(f"vocab must be positive; got {vocab}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1; got {batch}")
        if tree is not None and batch != 1:
            raise ValueError(f"GreedyAccept: tree mode takes batch 1; got batch={batch}")
        block_v = default_block(batch * rows, vocab) if block_v is None else int(block_v)
        if block_v < 16 or block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16; got {block_v}")
        self.rows, self.vocab, self.block_v, self.num_warps, self.batch = rows, vocab, block_v, num_warps, batch
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means the current device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tiles = triton.cdiv(vocab, block_v)
        self.ws_max = torch.empty(batch * rows * self.tiles, dtype=torch.float32, device=self.device)  # [B*R, T]
        self.ws_idx = torch.empty(batch * rows * self.tiles, dtype=torch.int32, device=self.device)  # [B*R, T]
        self.lock = torch.zeros(batch, dtype=torch.int32, device=self.device)  # arrivals per request; 0 between
        self.tree = tree  # TreeLayout (dspark_core.decoding.tree) or None: the chain
        if tree is not None:
            if tree.rows != rows:
                raise ValueError(f"the tree has {tree.rows} verify rows; GreedyAccept was given rows={rows}")
            self.block_size = tree.block_size
            self.tables = tree.tensors(self.device)
            self.path = torch.zeros(3, tree.block_size + 1, dtype=torch.int64, device=self.device)  # [3, S+1]

    def _check(self, logits: torch.Tensor, out: torch.Tensor, p: torch.Tensor, anchor: torch.Tensor) -> None:
        r, v, b = self.rows, self.vocab, self.batch
        if logits.dim() != 2 or tuple(logits.shape) != (b * r, v):
            raise ValueError(f"logits must have shape [{b * r}, {v}] (batch x rows = S+1, vocab); got "
                             f"{list(logits.shape)}")
        if logits.dtype not in LOGIT_DTYPES:
            raise ValueError(f"logits must be float32, bfloat16 or float16; got {logits.dtype}")
        if logits.stride(1) != 1:
            raise ValueError(f"logits must be contiguous along the vocab; strides {logits.stride()}")
        out_len = r + 2 if self.tree is None else self.block_size + 3 + (r - 1)
        out_shape = (out_len,) if b == 1 and out.dim() == 1 else (b, out_len)  # batch 1: [S+3] or [1, S+3]
        for name, t, shape in (("out", out, out_shape), ("p", p, (b,)), ("anchor", anchor, (b,))):
            if tuple(t.shape) != shape or t.dtype != torch.int64:
                raise ValueError(f"{name} must be int64 of shape {list(shape)}; got {t.dtype} {list(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous; strides {t.stride()}")
        for name, t in (("logits", logits), ("out", out), ("p", p), ("anchor", anchor)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}; this GreedyAccept was built for {self.device}")

    def _check_caches(self, name: str, kv: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        if kv is None:
            raise ValueError(f"GreedyAccept (tree): pass {name}=(k_cache, v_cache)")
        k, v = kv
        if not (k.dim() == 5 and k.shape == v.shape and k.shape[1] == 1 and k.is_contiguous() and v.is_contiguous()
                and k.device == self.device and v.device == self.device):
            raise ValueError(f"GreedyAccept (tree): {name} caches must be contiguous [layers, 1, heads, M, D] on "
                             f"{self.device}; got {list(k.shape)}, {list(v.shape)}")
        layers, _, heads, m_alloc, d = k.shape
        if d & (d - 1):
            raise ValueError(f"GreedyAccept (tree): {name} head dim {d} is not a power of two")
        return k, v, layers * heads, m_alloc, d

    def __call__(self, logits: torch.Tensor, out: torch.Tensor, p: torch.Tensor, anchor: torch.Tensor,
                 kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                 draft_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """logits [B*R, V] (request b's rows at b*R ..); out int64 [B, R+2] (batch 1: also [R+2]), per request
        [a, cap, t_1..t_S, bonus] (a, bonus written); p, anchor int64 [B] (p += a + 1, anchor = bonus). One launch
        for every request, no host sync.

        Tree mode: out = [a, cap, path tokens, bonus, node tokens]; ``kv`` / ``draft_kv`` = the target's and the
        draft's K/V caches [layers, 1, heads, M, D], whose accepted branch rows it moves to their logical slots."""
        self._check(logits, out, p, anchor)
        r_p = triton.next_power_of_2(self.rows)
        t_p = triton.next_power_of_2(self.tiles)
        if self.tree is not None:
            kc, vc, lh, m_alloc, d = self._check_caches("kv", kv)
            dkc, dvc, dlh, dm_alloc, dd = self._check_caches("draft_kv", draft_kv)
            t, s = self.tables, self.block_size
            _greedy_accept_tree[(self.rows, self.tiles)](
                logits, out, p, anchor, self.ws_max, self.ws_idx, self.lock, t.parent, t.depth, t.ancestors,
                self.path, kc, vc, dkc, dvc, logits.stride(0), self.rows, self.tiles, self.vocab, s, lh, m_alloc, dlh,
                dm_alloc, BLOCK_V=self.block_v, R_P=r_p, T_P=t_p, S_P=triton.next_power_of_2(s + 1), D=d, DD=dd,
                LH_BLOCK=min(64, triton.next_power_of_2(lh)), DLH_BLOCK=min(64, triton.next_power_of_2(dlh)),
                PDL_ON=PDL, num_warps=self.num_warps, **_LAUNCH)
            return
        _greedy_accept[(self.batch * self.rows, self.tiles)](logits, out, p, anchor, self.ws_max, self.ws_idx,
                                                             self.lock, logits.stride(0), self.rows, self.tiles,
                                                             self.vocab, BLOCK_V=self.block_v, R_P=r_p, T_P=t_p,
                                                             PDL_ON=PDL, num_warps=self.num_warps, **_LAUNCH)


def greedy_accept_reference(logits: torch.Tensor, out: torch.Tensor, p: torch.Tensor, anchor: torch.Tensor) -> None:
    """The same step as torch ops (the static engine's original code), in place: logits [R, V] (R = S+1);
    out int64 [S+3] = [a, cap, t_1..t_S, bonus]; p, anchor int64 [1]."""
    s = logits.shape[0] - 1
    tokens = out[2 : 2 + s]  # [S]
    best = logits.argmax(dim=-1)  # [S+1]
    match = (best[:s] == tokens) & (torch.arange(s, device=out.device) < out[1])  # [S]
    a = match.long().cumprod(dim=0).sum()  # [] accepted prefix
    bonus = best.gather(0, a.view(1))  # [1]
    out[0] = a
    out[2 + s] = bonus[0]
    p += a + 1
    anchor.copy_(bonus)


def greedy_accept_tree_reference(logits: torch.Tensor, out: torch.Tensor, p: torch.Tensor, anchor: torch.Tensor,
                                 tables, path: torch.Tensor) -> None:
    """The tree mode of ``GreedyAccept`` as torch ops (``dspark_core.decoding.tree.tree_accept_reference``), in place:
    out int64 [S+3+N] = [a, cap, path tokens, bonus, node tokens]; path int64 [3, S+1] (rows, from, to slots)."""
    from dspark_core.decoding.tree import tree_accept_reference

    s = tables.ancestors.shape[1] - 1
    nodes = out[3 + s :]  # [N]
    a, _, rows, bonus = tree_accept_reference(logits, nodes, tables)
    tokens = torch.cat([anchor, nodes])  # [R] row r's token (row 0: the anchor)
    out[0] = a
    out[2 : 2 + s] = tokens[rows[1:]]
    out[2 + s] = bonus
    path[0] = rows
    path[1] = p + rows
    path[2] = p + torch.arange(s + 1, device=p.device)
    p += a + 1
    anchor.copy_(bonus.view(1))
