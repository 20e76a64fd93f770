"""The tensor-core kernels of ``fused_linear`` (``dspark_core.kernels.linear``, the ``mma`` mode): a token tile
of 16 rows against a weight tile (``_gemm_small``), with split-K (a column tile's K range over several
programs, reduced in a fixed order by the last to arrive) or stream-K (``_gemm_stream``: every tile's K blocks
laid end to end and cut into equal runs, a whole number of programs per SM). A step of more than 16 tokens runs
every token tile through the same programs (more of them), each with its own split-K / stream-K workspace and
counters. Each output
row depends on its own token only, so a fixed configuration is batch-invariant.

Grid order: grid axis 0 numbers (column tile or stream-K program) x T + token tile, so the token tile is the
fastest-varying program id (``gemv._token_tile``; one axis, which has no 65,535 limit). The programs of one
(column tile, split) for every token tile are consecutive ids, scheduled together: they read the same weight
tile at the same time, so it comes from DRAM once and from L2 for the others (a step is memory-bound: its cost
is the weight bytes from DRAM). The order changes which program runs when, never what a program sums.

Shape legend: M (= n) tokens of the step, K input features, N output features, T = cdiv(M, 16) token tiles.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dspark_core.kernels.gemv import _token_tile, _w_tile
from dspark_core.kernels.pdl import _LAUNCH, PDL, gdc_launch_dependents, gdc_wait

@triton.jit(do_not_specialize=["M"])
def _gemm_small(X, NW, W, BIAS, R, Y, WS, LOCK, M, N, K, K_SPLIT, eps, NORM: tl.constexpr, GATED: tl.constexpr,
                HAS_BIAS: tl.constexpr, RESID: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, SWAP: tl.constexpr,
                PDL_ON: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (token tile tt, column tile pid, split): tokens [tt * BLOCK_M, +BLOCK_M) of x [M, K], columns
    [pid * BLOCK_N, +BLOCK_N) of y over the K range [split * K_SPLIT, +K_SPLIT), tensor-core dots (IEEE float32
    dots for float32 inputs: no TF32). NORM in one pass as in ``_gemv``. Grid (column tiles x T, SPLITS), token
    tiles fastest (module docstring).

    Each output row depends on its own token only (an MMA computes every row independently; M is never
    specialised), so with a fixed configuration any n gives each token the same bits as n = 1, in whichever
    token tile and row it sits: the batch-invariant ``mma`` mode runs every step through here with BLOCK_M = 16.
    SPLITS > 1 (split-K, for parallelism when N is narrow): each program writes its float32 partials to the
    workspace WS, and the last program of a (token tile, column tile) to arrive (a counter in LOCK) adds the
    SPLITS partials in split order -- a fixed order, so the result is deterministic -- applies the epilogue and
    resets the counter. No second kernel launch.
    SWAP (swap-AB): the product is computed transposed, ``W_tile [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]``,
    so the weight tile is the MMA's M side (64+ rows: Hopper's warpgroup MMA) and the 16 token rows its N side;
    each output column still depends on its own token only (batch-invariant the same way).
    PREFETCH: see ``PDL_PREFETCH`` (same sums in the same order either way)."""
    X, R, Y, M, tt, pid = _token_tile(X, R, Y, M, N, K, BLOCK_M)  # token tile: the fastest-varying id
    split = tl.program_id(1)
    dt = Y.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    cn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc2_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    w_rows = W + cn.to(tl.int64)[:, None] * K
    k_lo = split * K_SPLIT
    k_hi = k_lo + K_SPLIT
    k_start = k_lo
    if PREFETCH:
        if PDL_ON:
            gdc_launch_dependents()  # the next kernel may launch now and prefetch its own weights
        cols = k_lo + tl.arange(0, BLOCK_K)
        w, w2 = _w_tile(w_rows, cols, (cols < K) & (cols < k_hi), nmask, N, K, GATED)  # weights: before the wait
        if PDL_ON:
            gdc_wait()  # the previous kernel's outputs are complete and visible after this
        acc, acc2, acc_t, acc2_t, ss = _gemm_block(X, NW, w, w2, acc, acc2, acc_t, acc2_t, ss, rm, mmask, cols,
                                                   K, k_hi, NORM, GATED, SWAP, IEEE)
        k_start = k_lo + BLOCK_K
    elif PDL_ON:
        gdc_wait()
    for k0 in range(k_start, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w, w2 = _w_tile(w_rows, cols, (cols < K) & (cols < k_hi), nmask, N, K, GATED)
        acc, acc2, acc_t, acc2_t, ss = _gemm_block(X, NW, w, w2, acc, acc2, acc_t, acc2_t, ss, rm, mmask, cols,
                                                   K, k_hi, NORM, GATED, SWAP, IEEE)
    if PDL_ON and not PREFETCH:
        gdc_launch_dependents()  # let the next kernel launch while this one finishes
    if SWAP:
        acc = tl.trans(acc_t)
        if GATED:
            acc2 = tl.trans(acc2_t)
    sq = tl.sum(ss, 1)  # [BLOCK_M] this split's sum of squares
    if SPLITS > 1:
        slot = tl.program_id(0)  # (column tile, token tile): its own workspace and counter
        tile = WS + slot.to(tl.int64) * (SPLITS * (2 * BLOCK_M * BLOCK_N + BLOCK_M))
        last, acc, acc2, sq = _split_fixup(tile, LOCK + slot, split, SPLITS, acc, acc2, sq, rm, BLOCK_M, BLOCK_N,
                                           GATED)
        if last:
            _gemm_epilogue(acc, acc2, sq, BIAS, R, Y, N, K, eps, rm, mmask, cn, nmask, dt, NORM, GATED, HAS_BIAS,
                           RESID, BLOCK_M)
    else:
        _gemm_epilogue(acc, acc2, sq, BIAS, R, Y, N, K, eps, rm, mmask, cn, nmask, dt, NORM, GATED, HAS_BIAS, RESID,
                       BLOCK_M)


@triton.jit
def _split_fixup(tile, lock, slot, count, acc, acc2, sq, rm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GATED: tl.constexpr):
    """A partial tile of a split K range: store it in ``slot`` of the tile's workspace, [count, 2 (acc, acc2),
    BLOCK_M, BLOCK_N] + [count, BLOCK_M] squares, and count in on the tile's counter ``lock``. The last of the
    ``count`` programs to arrive gets ``last`` and the sums of all slots in slot order (a fixed order: the
    result is deterministic), and resets the counter (zero between launches)."""
    mn = rm[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    part = tile + slot * (2 * BLOCK_M * BLOCK_N)
    tl.store(part + mn, acc)
    if GATED:
        tl.store(part + BLOCK_M * BLOCK_N + mn, acc2)
    sq_ptr = tile + count * (2 * BLOCK_M * BLOCK_N)
    tl.store(sq_ptr + slot * BLOCK_M + rm, sq)
    tl.debug_barrier()  # every thread's partial stores are issued before the release below
    arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
    last = arrived == count - 1
    if last:  # the last slot of this tile to arrive: reduce in slot order
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        sq = tl.zeros([BLOCK_M], tl.float32)
        for s in range(count):
            acc += tl.load(tile + s * (2 * BLOCK_M * BLOCK_N) + mn, cache_modifier=".cg")
            if GATED:
                acc2 += tl.load(tile + s * (2 * BLOCK_M * BLOCK_N) + BLOCK_M * BLOCK_N + mn, cache_modifier=".cg")
            sq += tl.load(sq_ptr + s * BLOCK_M + rm, cache_modifier=".cg")
        tl.atomic_xchg(lock, 0)
    return last, acc, acc2, sq


@triton.jit(do_not_specialize=["M"])
def _gemm_stream(X, NW, W, BIAS, R, Y, WS, LOCK, M, N, K, IPT, ITERS, S_MAX, eps, NORM: tl.constexpr,
                 GATED: tl.constexpr, HAS_BIAS: tl.constexpr, RESID: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                 PDL_ON: tl.constexpr):
    """Stream-K ``_gemm_small``: the column tiles' K blocks, IPT per tile, laid end to end and cut
    into equal runs of ITERS, one run per program, with a grid of a whole number of programs per SM. A
    memory-bound step is then spread over every SM: a grid of column tiles (or tiles x splits) that is not a
    multiple of the SM count leaves SMs idle while others take a second tile (Qwen3-4B's O / down: 40-160
    programs for 132 SMs). Grid (programs x T,): every token tile runs the same runs, token tiles fastest
    (module docstring), each with its own workspace and counters.

    A program sums its K blocks of each tile it touches; a tile cut between programs gets its partials added in
    program order by the last to arrive (``_split_fixup``). The cuts depend on N, K and the configuration only,
    never on M, so every token gets the same bits whatever n is (batch-invariant as ``_gemm_small``)."""
    token_tiles = tl.cdiv(M, BLOCK_M)
    X, R, Y, M, tt, cta = _token_tile(X, R, Y, M, N, K, BLOCK_M)  # token tile: the fastest-varying id
    dt = Y.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    it_lo = cta * ITERS
    it_hi = tl.minimum(it_lo + ITERS, tl.cdiv(N, BLOCK_N) * IPT)
    if PDL_ON:
        gdc_launch_dependents()  # the next kernel may launch now
        gdc_wait()  # the previous kernel's outputs are complete and visible after this
    for tile in range(it_lo // IPT, tl.cdiv(it_hi, IPT)):
        base = tile * IPT
        cn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cn < N
        w_rows = W + cn.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc2_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for kb in range(tl.maximum(it_lo, base) - base, tl.minimum(it_hi, base + IPT) - base):
            cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            w, w2 = _w_tile(w_rows, cols, cols < K, nmask, N, K, GATED)
            acc, acc2, acc_t, acc2_t, ss = _gemm_block(X, NW, w, w2, acc, acc2, acc_t, acc2_t, ss, rm, mmask, cols,
                                                       K, K, NORM, GATED, SWAP, IEEE)
        if SWAP:
            acc = tl.trans(acc_t)
            if GATED:
                acc2 = tl.trans(acc2_t)
        sq = tl.sum(ss, 1)
        first = base // ITERS  # the programs that share this tile: first .. first + count - 1
        count = (base + IPT - 1) // ITERS - first + 1
        if count == 1:
            _gemm_epilogue(acc, acc2, sq, BIAS, R, Y, N, K, eps, rm, mmask, cn, nmask, dt, NORM, GATED, HAS_BIAS,
                           RESID, BLOCK_M)
        else:
            slot = tile * token_tiles + tt  # (column tile, token tile): its own workspace and counter
            ws = WS + slot.to(tl.int64) * (S_MAX * (2 * BLOCK_M * BLOCK_N + BLOCK_M))
            last, acc, acc2, sq = _split_fixup(ws, LOCK + slot, cta - first, count, acc, acc2, sq, rm, BLOCK_M,
                                               BLOCK_N, GATED)
            if last:
                _gemm_epilogue(acc, acc2, sq, BIAS, R, Y, N, K, eps, rm, mmask, cn, nmask, dt, NORM, GATED,
                               HAS_BIAS, RESID, BLOCK_M)


@triton.jit
def _gemm_block(X, NW, w, w2, acc, acc2, acc_t, acc2_t, ss, rm, mmask, cols, K, k_hi, NORM: tl.constexpr,
                GATED: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """One K block of ``_gemm_small``: the x block [BLOCK_M, BLOCK_K] (normed: NORM) times the W tile(s)."""
    cmask = (cols < K) & (cols < k_hi)
    xv = tl.load(X + rm[:, None] * K + cols[None, :], mask=mmask[:, None] & cmask[None, :], other=0.0)
    if NORM:
        xf = xv.to(tl.float32)
        ss += xf * xf
        xv = (xf * tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]).to(xv.dtype)
    if SWAP:
        acc_t = _mma(w, tl.trans(xv), acc_t, IEEE)
        if GATED:
            acc2_t = _mma(w2, tl.trans(xv), acc2_t, IEEE)
    else:
        acc = _mma(xv, tl.trans(w), acc, IEEE)
        if GATED:
            acc2 = _mma(xv, tl.trans(w2), acc2, IEEE)
    return acc, acc2, acc_t, acc2_t, ss


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b on tensor cores; IEEE float32 dots (no TF32) for float32 inputs."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gemm_epilogue(acc, acc2, sq, BIAS, R, Y, N, K, eps, rm, mmask, cn, nmask, dt: tl.constexpr,
                   NORM: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, RESID: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """Norm scale, bias, gating and residual of ``_gemm_small``'s float32 tile; rounds where HF does."""
    y = acc
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM:
        rstd = tl.rsqrt(sq / K + eps)
        y = y * rstd[:, None]
    if HAS_BIAS:
        y += tl.load(BIAS + cn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = y.to(dt).to(tl.float32)
    if GATED:
        u = acc2 * rstd[:, None]
        if HAS_BIAS:
            u += tl.load(BIAS + N + cn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        u = u.to(dt).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dt).to(tl.float32)
        y = (y * u).to(dt).to(tl.float32)
    offs = rm[:, None] * N + cn[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if RESID:
        y = tl.load(R + offs, mask=omask, other=0.0).to(tl.float32) + y
    tl.store(Y + offs, y.to(dt), mask=omask)


MMA_ROWS = 16  # token rows of the tensor-core tile: a step of n tokens runs cdiv(n, MMA_ROWS) token tiles
_SPLIT_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device, tiles: int, splits: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K / stream-K workspace and arrival counters for ``tiles`` (token tile, column tile) pairs (zero
    between launches: the last program resets its counter), made once per shape -- before a CUDA graph is
    captured, by the warm-up that tunes."""
    key = (str(device), tiles, splits, block_n)
    if key not in _SPLIT_BUFFERS:
        ws = torch.empty(tiles * splits * (2 * MMA_ROWS * block_n + MMA_ROWS), device=device, dtype=torch.float32)
        _SPLIT_BUFFERS[key] = (ws, torch.zeros(tiles, device=device, dtype=torch.int32))
    return _SPLIT_BUFFERS[key]


INTERPRET_SMS = 4  # the SM count stream-K tiles assume under the CPU interpreter


def sm_count(device: torch.device) -> int:
    """SMs of ``device`` (stream-K grids are a whole number of programs per SM)."""
    if device.type != "cuda":
        return INTERPRET_SMS
    index = torch.device(device).index
    return _cuda_sms(torch.cuda.current_device() if index is None else index)


@functools.cache
def _cuda_sms(index: int) -> int:  # asked once per device, not on every launch
    return torch.cuda.get_device_properties(index).multi_processor_count


def stream_k_grid(n_out: int, k: int, bn: int, bk: int, ctas: int) -> tuple[int, int, int, int]:
    """(K blocks per tile, K blocks per program, programs, most programs sharing one tile) of a stream-K
    launch with at most ``ctas`` programs."""
    ipt = triton.cdiv(k, bk)
    total = triton.cdiv(n_out, bn) * ipt
    iters = triton.cdiv(total, ctas)
    return ipt, iters, triton.cdiv(total, iters), triton.cdiv(ipt, iters) + 1


def _launch_stream(x, nw, w, b, r, y, n_out, k, eps, flags, bn, bk, per_sm, warps, stages, swap):
    ipt, iters, grid, s_max = stream_k_grid(n_out, k, bn, bk, sm_count(x.device) * per_sm)
    token_tiles = triton.cdiv(x.shape[0], MMA_ROWS)
    ws, lock = _split_buffers(x.device, token_tiles * triton.cdiv(n_out, bn), s_max, bn)
    _gemm_stream[(grid * token_tiles,)](x, nw, w, b, r, y, ws, lock, x.shape[0], n_out, k, ipt, iters, s_max, eps,
                                        **flags, IEEE=x.dtype == torch.float32, BLOCK_M=MMA_ROWS, BLOCK_N=bn,
                                        BLOCK_K=bk, SWAP=swap, PDL_ON=PDL, num_warps=warps, num_stages=stages,
                                        **_LAUNCH)
