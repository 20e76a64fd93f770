"""The FMA matrix-vector kernels of ``fused_linear`` (``dspark_core.kernels.linear``): one program per (token,
weight tile) (``_gemv``, the ``fma`` mode), or one program per (token tile of up to 16 tokens, weight tile)
(``_gemv_rows``, the FMA tiles of the ``mma`` mode). Both sum each token in the same blocks and order whatever n
is (batch-invariant), and both number their programs token (tile) first, so the programs that read one weight
tile run side by side and share it through L2.

Shape legend: M (= n) tokens of the step, K input features, N output features.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dspark_core.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit(do_not_specialize=["M"])
def _gemv(X, NW, W, BIAS, R, Y, M, N, K, eps, NORM: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
          RESID: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL_ON: tl.constexpr,
          PREFETCH: tl.constexpr):
    """Token ``pid % M`` (x [M, K]): rows [(pid // M) * BLOCK_N, +BLOCK_N) of W, fp32 FMA.

    Every token is computed by the same instructions whatever M is (batch-invariant: a verify step of n
    tokens gives bit for bit the logits of n single steps); the M programs of one weight tile run side by
    side, so the tile comes from DRAM once and from L2 for the others.
    NORM in one pass: ``W (g * x * rstd) = rstd * (W (g * x))``, the sum of squares accumulated alongside.
    PREFETCH: see ``PDL_PREFETCH`` (same sums in the same order either way)."""
    pid = tl.program_id(0)
    tok = pid % M
    pid = pid // M
    X += tok * K
    Y += tok * N
    R += tok * N
    dt = Y.dtype.element_ty
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    ss = tl.zeros([BLOCK_K], tl.float32)
    w_rows = W + rows.to(tl.int64)[:, None] * K
    k_start = 0
    if PREFETCH:
        if PDL_ON:
            gdc_launch_dependents()  # the next kernel may launch now and prefetch its own weights
        cols = tl.arange(0, BLOCK_K)
        w, w2 = _w_tile(w_rows, cols, cols < K, rmask, N, K, GATED)  # weights: safe to read before the wait
        if PDL_ON:
            gdc_wait()  # the previous kernel's outputs are complete and visible after this
        acc, acc2, ss = _gemv_block(X, NW, w, w2, acc, acc2, ss, cols, K, NORM, GATED)
        k_start = BLOCK_K
    elif PDL_ON:
        gdc_wait()
    for k0 in range(k_start, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w, w2 = _w_tile(w_rows, cols, cols < K, rmask, N, K, GATED)
        acc, acc2, ss = _gemv_block(X, NW, w, w2, acc, acc2, ss, cols, K, NORM, GATED)
    if PDL_ON and not PREFETCH:
        gdc_launch_dependents()  # let the next kernel launch while this one finishes
    _gemv_epilogue(acc, acc2, ss, BIAS, R, Y, rows, rmask, N, K, eps, dt, NORM, GATED, HAS_BIAS, RESID)


@triton.jit
def _gemv_epilogue(acc, acc2, ss, BIAS, R, Y, rows, rmask, N, K, eps, dt: tl.constexpr, NORM: tl.constexpr,
                   GATED: tl.constexpr, HAS_BIAS: tl.constexpr, RESID: tl.constexpr):
    """One token's outputs of ``_gemv`` / ``_gemv_rows``: row sums, norm scale, bias, gating, residual (rounding
    where HF does), stored at Y[rows]."""
    y = tl.sum(acc, 1)
    rstd = 1.0
    if NORM:
        rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)
        y = y * rstd
    if HAS_BIAS:
        y += tl.load(BIAS + rows, mask=rmask, other=0.0).to(tl.float32)
    y = y.to(dt).to(tl.float32)
    if GATED:
        u = tl.sum(acc2, 1) * rstd
        if HAS_BIAS:
            u += tl.load(BIAS + N + rows, mask=rmask, other=0.0).to(tl.float32)
        u = u.to(dt).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dt).to(tl.float32)
        y = (y * u).to(dt).to(tl.float32)
    if RESID:
        y = tl.load(R + rows, mask=rmask, other=0.0).to(tl.float32) + y
    tl.store(Y + rows, y.to(dt), mask=rmask)


@triton.jit
def _token_tile(X, R, Y, M, N, K, BLOCK_M: tl.constexpr):
    """Program id 0 = weight-side index * T + token tile (T = cdiv(M, BLOCK_M) token tiles, the fastest-varying
    part): x, residual and y of the token tile (rows [tt * BLOCK_M, +BLOCK_M) of [M, K] / [M, N]), its token count
    (the rows < it are live; it may exceed BLOCK_M), the token tile tt and the weight-side index."""
    pid = tl.program_id(0)
    token_tiles = tl.cdiv(M, BLOCK_M)
    tt = pid % token_tiles
    row0 = tt.to(tl.int64) * BLOCK_M
    return X + row0 * K, R + row0 * N, Y + row0 * N, M - tt * BLOCK_M, tt, pid // token_tiles


@triton.jit
def _w_tile(w_rows, cols, cmask, rmask, N, K, GATED: tl.constexpr):
    """The weight tile [rows, cols] (w_rows: the rows' pointers), and with GATED the same rows of W's second half
    (the up projection, N rows further); the first one otherwise."""
    m2 = rmask[:, None] & cmask[None, :]
    w = tl.load(w_rows + cols[None, :], mask=m2, other=0.0)
    w2 = w
    if GATED:
        w2 = tl.load(w_rows + N * K + cols[None, :], mask=m2, other=0.0)
    return w, w2


@triton.jit
def _gemv_block(X, NW, w, w2, acc, acc2, ss, cols, K, NORM: tl.constexpr, GATED: tl.constexpr):
    """One K block of ``_gemv``: acc (+ acc2) += W tile * x block, ss += x^2 (NORM)."""
    cmask = cols < K
    xf = tl.load(X + cols, mask=cmask, other=0.0).to(tl.float32)
    if NORM:
        ss += xf * xf
        xf = xf * tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
    acc += w.to(tl.float32) * xf[None, :]
    if GATED:
        acc2 += w2.to(tl.float32) * xf[None, :]
    return acc, acc2, ss


@triton.jit(do_not_specialize=["M"])
def _gemv_rows(X, NW, W, BIAS, R, Y, M, N, K, eps, NORM: tl.constexpr, GATED: tl.constexpr,
               HAS_BIAS: tl.constexpr, RESID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, PDL_ON: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (token tile tt, weight tile pid): rows [pid * BLOCK_N, +BLOCK_N) of W for tokens
    [tt * BLOCK_M, +BLOCK_M) of x [M, K], one token after the other, fp32 FMA: the FMA tiles of the ``mma`` mode
    (``("fma", BLOCK_N, BLOCK_K, warps)``). Grid (weight tiles x T,): token tiles fastest, so the programs of one
    weight tile run side by side and read it from L2 after the first.

    Each token is summed exactly as ``_gemv`` sums it (same blocks, same order), by the same loop body whatever
    M is: batch-invariant. Unlike ``_gemv`` (a program per token and tile) the tokens of a token tile share one
    program, so when K <= BLOCK_K the weight tile is read once, before the wait (``PDL_PREFETCH``), and stays in
    registers for every token: a verify of n <= BLOCK_M tokens reads W once, as one token does (small models,
    where tensor-core tiles lose to their fixed costs). When K > BLOCK_K later tokens re-read the tile from
    cache."""
    X, R, Y, M, tt, pid = _token_tile(X, R, Y, M, N, K, BLOCK_M)
    M = tl.minimum(M, BLOCK_M)  # this tile's tokens
    dt = Y.dtype.element_ty
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    w_rows = W + rows.to(tl.int64)[:, None] * K
    if PREFETCH and PDL_ON:
        gdc_launch_dependents()  # the next kernel may launch now and prefetch its own weights
    if PDL_ON and not PREFETCH:
        gdc_wait()
    cols = tl.arange(0, BLOCK_K)
    w_first, w2_first = _w_tile(w_rows, cols, cols < K, rmask, N, K, GATED)  # weights: before the wait
    if PDL_ON and PREFETCH:
        gdc_wait()  # the previous kernel's outputs are complete and visible after this
    for tok in range(0, M):
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        ss = tl.zeros([BLOCK_K], tl.float32)
        acc, acc2, ss = _gemv_block(X + tok * K, NW, w_first, w2_first, acc, acc2, ss, cols, K, NORM, GATED)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            ck = k0 + tl.arange(0, BLOCK_K)
            w, w2 = _w_tile(w_rows, ck, ck < K, rmask, N, K, GATED)
            acc, acc2, ss = _gemv_block(X + tok * K, NW, w, w2, acc, acc2, ss, ck, K, NORM, GATED)
        _gemv_epilogue(acc, acc2, ss, BIAS, R + tok * N, Y + tok * N, rows, rmask, N, K, eps, dt, NORM, GATED,
                       HAS_BIAS, RESID)
    if PDL_ON and not PREFETCH:
        gdc_launch_dependents()
