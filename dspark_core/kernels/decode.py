"""Triton kernels of the target's decode / verify step (batch 1, n <= 16 new tokens), used by
``dspark_core.decoding.target_runner.TargetRunner(kernels=True)``.

Decoding reads every weight once per step, so the step is a chain of memory-bound matrix-vector
products; what costs time besides the bytes is the number of kernels (each a few microseconds even
inside a CUDA graph). One decoder layer is 7 kernels here:

1. ``fused_linear(x, W_qkv, norm_weight=ln1)``: input RMSNorm fused into the fused Q/K/V projection;
2. ``qk_norm_rope_cache``: Qwen3's per-head q/k RMSNorm, RoPE, and the K/V cache write;
3. + 4. ``decode_attention``: split-KV attention over the cache (flash-decoding) and the combine;
5. ``fused_linear(attn, W_o, residual=x)``: output projection + residual;
6. + 7. ``fused_linear(x, W_gate_up, norm_weight=ln2, gated=True)`` then ``fused_linear(h, W_down, residual=x)``:
   post-attention RMSNorm + gate/up projection + SiLU(gate) * up, and the down projection + residual.

On Hopper every kernel is launched with programmatic dependent launch and lets the next one launch first thing;
the products read their first weight block before waiting for the previous kernel (``PDL_PREFETCH``), which
took the ``fma`` SmolLM2 step from 0.469 to 0.372 ms on an H200 (session 11: two runs of the same code, one with
DSPARK_PDL_PREFETCH=0).

Element-wise steps round to the model dtype where Hugging Face's modules do (projection outputs, RoPE
products, SiLU, residual adds); the RMSNorms are folded into the products (``W (g x rstd) = rstd W (g x)``,
one pass over the weights), so the fast step differs from the eager reference by rounding only (tested
against it, and against float32 in bf16).

Shape legend: n tokens of the step, K input features, N output features, Hq / Hkv heads, G = Hq / Hkv,
D head dim, M cache positions, S attention splits.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from dspark_core.ops import rms_norm

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_TOKENS = 16  # the widest step these kernels take (verify of a 15-token proposal)


def _pdl_supported() -> bool:
    """Programmatic dependent launch (Hopper+): each kernel is launched while the previous one drains and
    waits (``gdc_wait``, first thing) for it to finish; hides launch latency between the small kernels.
    ``DSPARK_PDL=0`` turns it off."""
    if INTERPRET or os.environ.get("DSPARK_PDL", "1") == "0" or not torch.cuda.is_available():
        return False
    try:
        import dataclasses

        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

        has_option = any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))
        return has_option and torch.cuda.get_device_capability()[0] >= 9
    except Exception:  # noqa: BLE001 - any missing piece: launch without PDL
        return False


PDL = _pdl_supported()
if PDL:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
else:  # never traced: every use sits under ``if PDL_ON:`` (a constexpr False)
    gdc_launch_dependents = gdc_wait = None
_LAUNCH = {"launch_pdl": True} if PDL else {}
# Weight prefetch across kernels (default on; DSPARK_PDL_PREFETCH=0 for the session-10 kernels): each product
# kernel lets the next one launch first thing (``gdc_launch_dependents``), and loads its first weight block
# *before* ``gdc_wait``: weights are constants, so that read may overlap the previous kernel, which is where a
# launch-bound step (SmolLM2: 30 layers x 7 small kernels) spends its time. The sums are the same either way.
PDL_PREFETCH = os.environ.get("DSPARK_PDL_PREFETCH", "1") != "0"


# --------------------------------------------------------------------------------------------------
# fused linear: y = [residual +] act?(W @ norm?(x)) for x [n <= 16, K]
# --------------------------------------------------------------------------------------------------
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
               HAS_BIAS: tl.constexpr, RESID: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PDL_ON: tl.constexpr, PREFETCH: tl.constexpr):
    """Rows [pid * BLOCK_N, +BLOCK_N) of W for all M tokens, one token after the other, fp32 FMA: the FMA tiles
    of the ``mma`` mode (``("fma", BLOCK_N, BLOCK_K, warps)``; session 11).

    Each token is summed exactly as ``_gemv`` sums it (same blocks, same order), by the same loop body whatever
    M is: batch-invariant. Unlike ``_gemv`` (a program per token and tile) the M tokens share one program, so
    when K <= BLOCK_K the weight tile is read once, before the wait (``PDL_PREFETCH``), and stays in registers
    for every token: a verify of n tokens reads W once, as one token does (small models, where tensor-core
    tiles lose to their fixed costs). When K > BLOCK_K later tokens re-read the tile from cache."""
    pid = tl.program_id(0)
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


@triton.jit(do_not_specialize=["M"])
def _gemm_small(X, NW, W, BIAS, R, Y, WS, LOCK, M, N, K, K_SPLIT, eps, NORM: tl.constexpr, GATED: tl.constexpr,
                HAS_BIAS: tl.constexpr, RESID: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, SWAP: tl.constexpr,
                PDL_ON: tl.constexpr, PREFETCH: tl.constexpr):
    """Up to BLOCK_M tokens (x [M, K]): columns [pid * BLOCK_N, +BLOCK_N) of y over the K range
    [split * K_SPLIT, +K_SPLIT), tensor-core dots (IEEE float32 dots for float32 inputs: no TF32). NORM in one
    pass as in ``_gemv``.

    Each output row depends on its own token only (an MMA computes every row independently; M is never
    specialised), so with a fixed configuration any n gives each token the same bits as n = 1: the
    batch-invariant ``mma`` mode runs every step through here with BLOCK_M = 16.
    SPLITS > 1 (split-K, for parallelism when N is narrow): each program writes its float32 partials to the
    workspace WS, and the last program of a column tile to arrive (a counter in LOCK) adds the SPLITS partials
    in split order -- a fixed order, so the result is deterministic -- applies the epilogue and resets the
    counter. No second kernel launch.
    SWAP (swap-AB): the product is computed transposed, ``W_tile [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]``,
    so the weight tile is the MMA's M side (64+ rows: Hopper's warpgroup MMA) and the 16 token rows its N side;
    each output column still depends on its own token only (batch-invariant the same way).
    PREFETCH: see ``PDL_PREFETCH`` (same sums in the same order either way)."""
    pid = tl.program_id(0)
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
        tile = WS + pid.to(tl.int64) * (SPLITS * (2 * BLOCK_M * BLOCK_N + BLOCK_M))
        last, acc, acc2, sq = _split_fixup(tile, LOCK + pid, split, SPLITS, acc, acc2, sq, rm, BLOCK_M, BLOCK_N, GATED)
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
    """Stream-K ``_gemm_small`` (session 12): the column tiles' K blocks, IPT per tile, laid end to end and cut
    into equal runs of ITERS, one run per program, with a grid of a whole number of programs per SM. A
    memory-bound step is then spread over every SM: a grid of column tiles (or tiles x splits) that is not a
    multiple of the SM count leaves SMs idle while others take a second tile (Qwen3-4B's O / down: 40-160
    programs for 132 SMs).

    A program sums its K blocks of each tile it touches; a tile cut between programs gets its partials added in
    program order by the last to arrive (``_split_fixup``). The cuts depend on N, K and the configuration only,
    never on M, so every token gets the same bits whatever n is (batch-invariant as ``_gemm_small``)."""
    cta = tl.program_id(0)
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
            ws = WS + tile * (S_MAX * (2 * BLOCK_M * BLOCK_N + BLOCK_M))  # < 2**31 floats: the workspace is small
            last, acc, acc2, sq = _split_fixup(ws, LOCK + tile, cta - first, count, acc, acc2, sq, rm, BLOCK_M,
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


# (BLOCK_N, BLOCK_K, num_warps) candidates of the FMA GEMV; the first is the default before tuning
_GEMV_CONFIGS = [(4, 512, 4), (2, 1024, 4), (1, 2048, 4), (1, 4096, 4), (2, 4096, 8), (2, 2048, 4), (4, 2048, 8),
                 (4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8)]
# (BLOCK_N, BLOCK_K, SPLITS, num_warps[, num_stages[, swap]]) candidates of the tensor-core path (SPLITS > 1:
# split-K; num_stages: Triton's software pipeline depth, 3 when left out; swap 1: swap-AB, see _gemm_small).
# A step of n <= 16 tokens is memory-bound, so what decides its speed is the bytes each SM has in flight:
# tile x stages x programs per SM. The 5- and 6-tuples (session 9) add deeper pipelines, wider tiles, swap-AB.
_MMA_CONFIGS = [(32, 128, 1, 4), (16, 256, 1, 4), (64, 128, 1, 4), (16, 128, 2, 4), (16, 256, 2, 4),
                (32, 128, 2, 4), (16, 128, 4, 4), (16, 256, 4, 4), (32, 128, 4, 4), (16, 64, 8, 4), (16, 128, 8, 4),
                (32, 64, 8, 4), (16, 512, 2, 8), (16, 1024, 1, 8),
                (32, 128, 1, 4, 5), (64, 128, 1, 4, 4), (64, 128, 2, 4, 4), (32, 256, 1, 4, 4), (32, 256, 2, 4, 4),
                (16, 256, 2, 4, 5), (16, 256, 4, 4, 5), (16, 512, 1, 4, 4), (16, 512, 2, 4, 4), (32, 128, 2, 4, 6),
                (64, 64, 2, 4, 6), (128, 64, 1, 8, 4), (128, 128, 1, 8, 3), (64, 256, 1, 8, 3),
                # session 9, not yet timed on a GPU: wider tiles (the 128 x 128 one won the largest GEMMs), and
                # swap-AB (6th entry 1: the weight tile as the MMA's M side, Hopper's warpgroup MMA)
                (128, 128, 1, 8, 4), (256, 64, 1, 8, 3), (64, 128, 1, 4, 4, 1), (128, 64, 1, 4, 4, 1),
                (128, 128, 1, 8, 3, 1), (128, 128, 1, 4, 4, 1), (64, 256, 1, 4, 3, 1), (64, 128, 2, 4, 4, 1),
                (128, 64, 2, 4, 5, 1), (256, 64, 1, 8, 3, 1),
                # session 10: swap-AB won Qwen3-4B's Q/K/V, O, gate/up and LM head on an H200; split-K with it for
                # the narrow matrices (N = 2560: O and down have 40 tiles of 64 for 132 SMs)
                (64, 128, 4, 4, 4, 1), (64, 128, 8, 4, 4, 1), (64, 256, 2, 4, 3, 1), (64, 256, 4, 4, 3, 1),
                (64, 64, 4, 4, 6, 1), (64, 64, 8, 4, 6, 1), (128, 128, 2, 8, 3, 1), (128, 64, 4, 4, 5, 1),
                # session 12: stream-K (SPLITS = -c: c programs per SM, ``_gemm_stream``), the 7 of 16 tried that
                # placed in the top 3 of some Qwen3-4B matrix on an H200 (bench_kernels tiles, same run): gate/up
                # 33.4 -> 29.6 us (its 76 column tiles of 128 leave 56 of 132 SMs idle), down 17.9 -> 17.2 us;
                # Q/K/V, O and the LM head keep plain tiles
                (64, 256, -1, 4, 3, 1), (128, 128, -1, 8, 3, 1), (64, 128, -2, 4, 4, 1), (64, 128, -1, 4, 4, 1),
                (128, 64, -1, 4, 5, 1), (64, 64, -2, 4, 6, 1), (128, 128, -2, 8, 3, 1)]
# Session 11: FMA tiles of the mma mode, ("fma", BLOCK_N, BLOCK_K, num_warps) (``_gemv_rows``: one program takes
# every token of the step, summed as the fma GEMV sums). Opt-in (DSPARK_FMA_TILES=1 adds them to the tuner's
# candidates; ``bench_kernels.py --parts tiles --tile-candidates fma_tile`` times them): on an H200 at SmolLM2
# shapes they match the GEMV at n = 1 (Q/K/V 1.7 vs 1.6 us, LM head 27.6 vs 25.7 us) but their tokens run one
# after another, so n = 8 costs 3.5-4.5x n = 1 (Q/K/V 7.2 us) -- no cheaper verify, and a slower warm-up.
_FMA_TILES = [("fma", 4, 1024, 4), ("fma", 2, 1024, 4), ("fma", 8, 1024, 8), ("fma", 16, 1024, 8), ("fma", 4, 2048, 8),
              ("fma", 2, 2048, 4), ("fma", 8, 512, 4), ("fma", 16, 512, 8), ("fma", 1, 2048, 4)]
if os.environ.get("DSPARK_FMA_TILES", "0") == "1":
    _MMA_CONFIGS += _FMA_TILES
_TUNED: dict[tuple, tuple] = {}
TUNE = os.environ.get("DSPARK_TUNE_KERNELS", "1") != "0"
# The tuner times each candidate once per process, and near-equal candidates can swap between runs. With
# DSPARK_SMALL_GEMM=mma a configuration fixes the order of the sums, so two runs that picked differently give
# (each batch-invariant, both correct) different bf16 greedy outputs, MAL and speed. Pin them:
# DSPARK_KERNEL_CONFIGS=FILE (written by ``save_kernel_configs``; benchmarks/bench_decode.py stores the table
# in its JSON under "kernel_configs", which is accepted too) fixes every shape it lists; others are tuned.
KERNEL_CONFIGS_ENV = "DSPARK_KERNEL_CONFIGS"
_PINNED: dict[str, tuple] = {}  # from DSPARK_KERNEL_CONFIGS (wins)
_STORED: dict[str, tuple] = {}  # from the config store (``use_config_store``)
# Batch invariance (default): a step of n tokens computes each token exactly as a step of one token would,
# so greedy speculative decoding reproduces AR decoding bit for bit in bf16 too. Two ways (DSPARK_SMALL_GEMM,
# or ``set_small_gemm``; bench_online.small_gemm in params.yaml):
#   mma (default where it applies): every step, n = 1 included, through the tensor-core kernel with 16 token
#        rows (padding rows cost nothing: the step is memory-bound) and split-K: a verify of n <= 16 costs
#        about one n = 1 step. Needs bf16 tensor cores (sm_80+; ``small_gemm_problem`` says why not);
#   fma: every token through the FMA GEMV, one program per (token, weight tile): the fastest n = 1 step of
#        session 3, but n tokens read each tile from L2 n times (a verify of 8 ~4x the n = 1 step).
# DSPARK_BATCH_INVARIANT=0: the FMA GEMV for n = 1 and tensor-core tiles for n > 1 (a near-tie can then flip a
# greedy token between verify and AR).
BATCH_INVARIANT = os.environ.get("DSPARK_BATCH_INVARIANT", "1") != "0"
SMALL_GEMM_MODES = ("mma", "fma")
SMALL_GEMM = os.environ.get("DSPARK_SMALL_GEMM", "mma")
if SMALL_GEMM not in SMALL_GEMM_MODES:
    raise ValueError(f"DSPARK_SMALL_GEMM must be mma or fma; got {SMALL_GEMM!r}")


def set_small_gemm(mode: str) -> None:
    """Switch the small-GEMM family for the kernels launched from now on (captured CUDA graphs keep theirs).
    Both are exact and batch-invariant, but they sum in different orders: AR and speculative decoding compared
    bit for bit must run in the same mode."""
    global SMALL_GEMM
    if mode not in SMALL_GEMM_MODES:
        raise ValueError(f"small_gemm must be one of {SMALL_GEMM_MODES}; got {mode!r}")
    SMALL_GEMM = mode


def small_gemm_problem(device: torch.device | str) -> str | None:
    """Why the ``mma`` family does not apply on ``device`` (None when it does)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None if INTERPRET else f"{device} is not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"bf16 tensor-core dots need sm_80 or newer; {torch.cuda.get_device_name(device)} is sm_{major}{minor}"
    return None


def resolve_small_gemm(device: torch.device | str) -> str:
    """The mode to run on ``device``: the chosen one, or ``fma`` (printing why) where ``mma`` does not apply."""
    problem = small_gemm_problem(device) if SMALL_GEMM == "mma" else None
    if problem:
        print(f"kernels: small_gemm mma does not apply ({problem}); using fma")
        set_small_gemm("fma")
    return SMALL_GEMM


MMA_ROWS = 16  # token rows of the tensor-core tile (>= MAX_TOKENS)
_SPLIT_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _uses_mma(m: int) -> bool:
    return SMALL_GEMM == "mma" if BATCH_INVARIANT else m > 1


def _split_buffers(device, tiles: int, splits: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K / stream-K workspace and per-tile arrival counters (zero between launches: the last program resets
    its counter), made once per shape -- before a CUDA graph is captured, by the warm-up that tunes."""
    key = (str(device), tiles, splits, block_n)
    if key not in _SPLIT_BUFFERS:
        ws = torch.empty(tiles * splits * (2 * MMA_ROWS * block_n + MMA_ROWS), device=device, dtype=torch.float32)
        _SPLIT_BUFFERS[key] = (ws, torch.zeros(tiles, device=device, dtype=torch.int32))
    return _SPLIT_BUFFERS[key]


def is_fma_tile(cfg: tuple) -> bool:
    """An ``mma``-mode candidate that is an FMA tile (``_gemv_rows``) rather than a tensor-core one."""
    return cfg[0] == "fma"


def _launch(x, w, bias, norm_weight, eps, residual, y, n_out, gated, cfg):
    m, k = x.shape
    flags = dict(NORM=norm_weight is not None, GATED=gated, HAS_BIAS=bias is not None, RESID=residual is not None)
    nw = norm_weight if norm_weight is not None else x
    b = bias if bias is not None else x
    r = residual if residual is not None else y
    if not _uses_mma(m):
        bn, bk, warps = cfg
        _gemv[(m * triton.cdiv(n_out, bn),)](x, nw, w, b, r, y, m, n_out, k, eps, **flags, BLOCK_N=bn, BLOCK_K=bk,
                                             PDL_ON=PDL, PREFETCH=PDL_PREFETCH, num_warps=warps, **_LAUNCH)
        return
    if is_fma_tile(cfg):
        _, bn, bk, warps = cfg
        _gemv_rows[(triton.cdiv(n_out, bn),)](x, nw, w, b, r, y, m, n_out, k, eps, **flags, BLOCK_N=bn, BLOCK_K=bk,
                                              PDL_ON=PDL, PREFETCH=PDL_PREFETCH, num_warps=warps, **_LAUNCH)
        return
    bn, bk, splits, warps, *rest = cfg
    stages = rest[0] if rest else 3  # Triton's default
    swap = bool(rest[1]) if len(rest) > 1 else False
    if splits < 0:
        _launch_stream(x, nw, w, b, r, y, n_out, k, eps, flags, bn, bk, -splits, warps, stages, swap)
        return
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_split)
    tiles = triton.cdiv(n_out, bn)
    ws, lock = _split_buffers(x.device, tiles, splits, bn) if splits > 1 else (y, y)
    _gemm_small[(tiles, splits)](x, nw, w, b, r, y, ws, lock, m, n_out, k, k_split, eps, **flags,
                                 IEEE=x.dtype == torch.float32, BLOCK_M=MMA_ROWS, BLOCK_N=bn, BLOCK_K=bk,
                                 SPLITS=splits, SWAP=swap, PDL_ON=PDL, PREFETCH=PDL_PREFETCH, num_warps=warps,
                                 num_stages=stages,
                                 **_LAUNCH)


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
    ws, lock = _split_buffers(x.device, triton.cdiv(n_out, bn), s_max, bn)
    _gemm_stream[(grid,)](x, nw, w, b, r, y, ws, lock, x.shape[0], n_out, k, ipt, iters, s_max, eps, **flags,
                          IEEE=x.dtype == torch.float32, BLOCK_M=MMA_ROWS, BLOCK_N=bn, BLOCK_K=bk, SWAP=swap,
                          PDL_ON=PDL, num_warps=warps, num_stages=stages, **_LAUNCH)


def _config(x, w, bias, norm_weight, eps, residual, y, n_out, gated):
    """The fastest candidate for this shape, timed once on first use (never while a CUDA graph is captured):
    ``graph_time_ms`` over ``weight_copies`` (DRAM reads, no host launch cost).

    Batch-invariant mode: every n uses the configuration tuned for n = 1 (same tiles, same sums)."""
    m, k = x.shape
    if m > 1 and BATCH_INVARIANT:
        one = (residual[:1] if residual is not None else None)
        return _config(x[:1], w, bias, norm_weight, eps, one, y[:1], n_out, gated)
    mma = _uses_mma(m)
    configs = _MMA_CONFIGS if mma else _GEMV_CONFIGS
    key = (mma, m, n_out, k, gated, x.dtype, str(x.device))
    if key in _TUNED:
        return _TUNED[key]
    _load_pinned_once(x.device)
    pinned = _PINNED.get(_config_key(key)) or _STORED.get(_config_key(key))
    if pinned is not None:
        _TUNED[key] = pinned
        return pinned
    if INTERPRET:  # the CPU interpreter runs programs one by one: the fewest, widest (tensor-core) tiles
        return _remember(key, max((c for c in configs if not is_fma_tile(c)), key=lambda c: c[0]))
    if not TUNE or not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return configs[0]
    return _remember(key, _tune(x, w, bias, norm_weight, eps, residual, n_out, gated, configs, mma))


TUNE_VERIFY_TOKENS = 8  # mma mode with FMA tiles: a candidate's cost is its n = 1 + its n = 8 time (step + verify)


def _tune(x, w, bias, norm_weight, eps, residual, n_out, gated, configs, mma: bool) -> tuple:
    """The fastest of ``configs`` for x [1, K]: ``graph_time_ms`` over ``weight_copies`` (DRAM reads, no host
    launch cost). In ``mma`` mode one configuration serves every n; when FMA tiles compete (DSPARK_FMA_TILES=1) a
    candidate is timed at n = 1 and at n = 8 (a block-7 verify) and ranked by the sum, since FMA tiles grow with n
    and tensor-core tiles barely do (tensor-core tiles alone: n = 1, half the warm-up)."""
    weights = weight_copies(w)
    inputs = [(x, residual, torch.empty(x.shape[0], n_out, device=x.device, dtype=x.dtype))]
    if mma and BATCH_INVARIANT and any(is_fma_tile(c) for c in configs):  # x is one token here; add the verify's n
        n = TUNE_VERIFY_TOKENS
        rn = residual.expand(n, -1).contiguous() if residual is not None else None
        inputs.append((x.expand(n, -1).contiguous(), rn, torch.empty(n, n_out, device=x.device, dtype=x.dtype)))

    def cost(cfg: tuple) -> float:
        total = 0.0
        for xn, rn, yn in inputs:
            total += graph_time_ms(lambda i: _launch(xn, weights[i % len(weights)], bias, norm_weight, eps, rn, yn,
                                                     n_out, gated, cfg))
        return total

    best, best_ms = configs[0], float("inf")
    for cfg in configs:
        try:
            ms = cost(cfg)
        except Exception:  # a config that does not compile (resources) is skipped  # noqa: BLE001
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best


TUNE_BYTES = 256 << 20  # the tuner reads at least this many weight bytes per timing (> an H200's 50 MB L2)


def weight_copies(w: torch.Tensor, min_bytes: int = TUNE_BYTES, max_copies: int = 16) -> list[torch.Tensor]:
    """``w`` and copies of it adding up to >= ``min_bytes`` (at most ``max_copies``): launches that take them in
    turn read their weights from DRAM, as a decode step does, not from the L2 that one small matrix launched over
    and over would live in (session 10: timed from L2, the tuner ranked Qwen3-4B's O / down tiles by noise, and the
    step moved between 2.9 and 3.8 ms from one process to the next)."""
    copies = min(max_copies, max(1, -(-min_bytes // (w.numel() * w.element_size()))))
    out = [w]
    try:
        out += [w.clone() for _ in range(copies - 1)]
    except torch.cuda.OutOfMemoryError:  # a full device: time from fewer copies (partly from L2) rather than fail
        print(f"kernels: no memory for {copies - 1} copies of a {tuple(w.shape)} weight; tuning on {len(out)}")
    return out


def graph_time_ms(launch, launches: int = 20, replays: int = 5) -> float:
    """ms per call of ``launch(i)`` (i = 0, 1, ...): ``launches`` calls captured in one CUDA graph (no host launch
    cost in the figure, and back-to-back launches overlap as in a decode step under PDL), the graph replayed
    ``replays`` times after one warm replay. Compiles outside the capture (first call)."""
    launch(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * launches)


def _remember(key: tuple, cfg: tuple) -> tuple:
    """Record a newly chosen configuration (and add it to the config store, if one is in use)."""
    _TUNED[key] = cfg
    if _STORE["path"] is not None:
        _save_store(torch.device(key[-1]))
    return cfg


def _config_key(key: tuple) -> str:
    """``mma|fma:n:N:K:gated:dtype`` -- a tuned shape as a JSON key (the device is the file's)."""
    mma, m, n_out, k, gated, dtype, _ = key
    return f"{'mma' if mma else 'fma'}:{m}:{n_out}:{k}:{int(gated)}:{str(dtype).replace('torch.', '')}"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"


def kernel_configs(device: torch.device | str = "cuda") -> dict:
    """The configurations chosen so far in this process on ``device``: ``{"device": name, "configs": {key: cfg}}``."""
    device = torch.device(device)
    configs = {_config_key(k): list(v) for k, v in _TUNED.items() if torch.device(k[-1]).type == device.type}
    return {"device": _device_name(device), "configs": dict(sorted(configs.items()))}


def save_kernel_configs(path: str | os.PathLike, device: torch.device | str = "cuda") -> None:
    from dspark_core.io import write_json

    write_json(path, kernel_configs(device))


def load_kernel_configs(path: str | os.PathLike, device: torch.device | str = "cuda") -> dict[str, tuple]:
    """Read a table written by ``save_kernel_configs`` (or a bench_decode JSON holding one under
    "kernel_configs"); ValueError naming the file when it is not one, or was made on another device."""
    import json
    from pathlib import Path

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{KERNEL_CONFIGS_ENV}={path}: cannot read a JSON table ({e})") from e
    data = data.get("kernel_configs", data) if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise ValueError(f"{KERNEL_CONFIGS_ENV}={path}: no {{'device', 'configs'}} table in it")
    here = _device_name(torch.device(device))
    if data.get("device") != here:
        raise ValueError(f"{KERNEL_CONFIGS_ENV}={path}: configurations tuned on {data.get('device')!r}, "
                         f"this device is {here!r}")
    out = {}
    for key, cfg in data["configs"].items():
        parsed = _parse_config(key.split(":")[0], cfg)
        if parsed is None:
            raise ValueError(f"{KERNEL_CONFIGS_ENV}={path}: bad entry {key!r}: {cfg!r}")
        out[key] = parsed
    return out


def _parse_config(kind: str, cfg) -> tuple | None:
    """A stored configuration as the tuple ``_launch`` takes (None when it is not one of ``kind``'s)."""
    if not isinstance(cfg, list):
        return None
    if kind == "mma" and len(cfg) == 4 and cfg[0] == "fma" and all(isinstance(c, int) for c in cfg[1:]):
        return ("fma", *cfg[1:])
    sizes = {"mma": (4, 5, 6), "fma": (3,)}
    if kind not in sizes or len(cfg) not in sizes[kind] or not all(isinstance(c, int) for c in cfg):
        return None
    return tuple(cfg)


_PINNED_LOADED: list[bool] = [False]
_STORE: dict = {"path": None, "fingerprint": None}


def _load_pinned_once(device: torch.device) -> None:
    if _PINNED_LOADED[0]:
        return
    _PINNED_LOADED[0] = True
    path = os.environ.get(KERNEL_CONFIGS_ENV)
    if path:
        _PINNED.update(load_kernel_configs(path, device))


# -- the config store: a model's tuned tiles, kept per device and target fingerprint -------------------------------
def kernel_store_path(root: str | os.PathLike, device: torch.device | str, fingerprint: str):
    """``root/<device name>/<fingerprint[:16]>.json``: where the tiles tuned for a target on a device live."""
    import re
    from pathlib import Path

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", _device_name(torch.device(device))).strip("_")
    return Path(root).expanduser() / slug / f"{fingerprint[:16]}.json"


def use_config_store(path: str | os.PathLike, device: torch.device | str, fingerprint: str) -> dict[str, tuple]:
    """Pin every configuration stored in ``path`` (an earlier run of this target on this device) and add each
    shape tuned from now on to it, so that every later run picks the same tiles -- in ``mma`` mode the same
    sums, bit for bit -- without ``DSPARK_KERNEL_CONFIGS``. A configuration already chosen in this process for
    a stored shape is dropped (the store wins). ``DSPARK_KERNEL_CONFIGS``, when set, still wins over both.
    Returns the pinned table; ValueError naming the file when it is not one, or is another device's / target's."""
    import json
    from pathlib import Path

    path = Path(path)
    device = torch.device(device)
    pins: dict[str, tuple] = {}
    if path.is_file():
        pins = load_kernel_configs(path, device)
        stored = json.loads(path.read_text()).get("fingerprint")
        if stored != fingerprint:
            raise ValueError(f"{path}: kernel configurations of target {stored!r}, this target is {fingerprint!r}")
    for key in [k for k in _TUNED if _config_key(k) in pins]:
        del _TUNED[key]
    _STORED.clear()
    _STORED.update(pins)
    _STORE.update(path=path, fingerprint=fingerprint)
    return pins


def _save_store(device: torch.device) -> None:
    from dspark_core.io import write_json

    path = _STORE["path"]
    table = {k: list(v) for k, v in _STORED.items()}
    table.update(kernel_configs(device)["configs"])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"device": _device_name(device), "fingerprint": _STORE["fingerprint"],
                      "configs": dict(sorted(table.items()))})


def close_config_store() -> None:
    """Stop adding to the store (the pins stay)."""
    _STORE.update(path=None, fingerprint=None)


def fused_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, K] (n <= 16) -> y [n, N]: ``residual + act(linear(rmsnorm(x)))`` with each part optional.

    ``w`` is [N, K], or [2N, K] with ``gated`` (rows = gate then up; y = SiLU(gate) * up); ``bias`` [N]
    or [2N]; ``norm_weight`` [K] applies HF's RMSNorm to x first; ``residual`` [n, N] is added last."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"fused_linear takes x [n <= {MAX_TOKENS}, K]; got {tuple(x.shape)}")
    x, w = x.contiguous(), w.contiguous()
    m, k = x.shape
    if w.shape[1] != k:
        raise ValueError(f"fused_linear: x has {k} features, w is {tuple(w.shape)}")
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    y = torch.empty(m, n_out, device=x.device, dtype=x.dtype)
    cfg = _config(x, w, bias, norm_weight, eps, residual, y, n_out, gated)
    _launch(x, w, bias, norm_weight, eps, residual, y, n_out, gated, cfg)
    return y


def fused_linear_reference(x, w, bias=None, *, norm_weight=None, eps=0.0, gated=False, residual=None):
    """The same computation in plain torch (HF's module order and roundings)."""
    import torch.nn.functional as F

    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    y = F.linear(x, w, bias)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


# --------------------------------------------------------------------------------------------------
# q/k RMSNorm + RoPE + cache write
# --------------------------------------------------------------------------------------------------
@triton.jit
def _qk_rope_cache(QKV, QN, KN, COS, SIN, POS, OFF, KC, VC, QOUT, M_ALLOC, eps, HQ: tl.constexpr,
                   HKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr, TREE: tl.constexpr,
                   PDL_ON: tl.constexpr, EARLY: tl.constexpr):
    """Token t, head j: RoPE at position POS[t]; K/V written at slot POS[t] (+ OFF[t] with TREE).
    EARLY: the next kernel may launch first thing (``PDL_PREFETCH``)."""
    if PDL_ON and EARLY:
        gdc_launch_dependents()
    if PDL_ON:
        gdc_wait()  # the previous kernel's outputs are complete and visible after this
    t = tl.program_id(0)
    j = tl.program_id(1)  # q heads [0, HQ), then k heads [HQ, HQ + HKV)
    dt = QOUT.dtype.element_ty
    pos = tl.load(POS + t).to(tl.int64)
    slot = pos
    if TREE:
        slot += tl.load(OFF + t).to(tl.int64)
    row = QKV + t * (HQ + 2 * HKV) * D
    d = tl.arange(0, D)
    half = D // 2
    rot = tl.where(d < half, d + half, d - half)
    is_q = (d * 0 + j) < HQ  # [D] (a vector: the interpreter wants vector masks)
    x = tl.load(row + j * D + d).to(tl.float32)
    xr = tl.load(row + j * D + rot).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        wq = tl.load(QN + d).to(tl.float32)
        wk = tl.load(KN + d).to(tl.float32)
        wqr = tl.load(QN + rot).to(tl.float32)
        wkr = tl.load(KN + rot).to(tl.float32)
        x = (tl.where(is_q, wq, wk) * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xr = (tl.where(is_q, wqr, wkr) * (xr * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    if PDL_ON and not EARLY:
        gdc_launch_dependents()  # let the next kernel launch while this one finishes
    cos = tl.load(COS + pos * D + d).to(tl.float32)
    sin = tl.load(SIN + pos * D + d).to(tl.float32)
    xr = tl.where(d < half, -xr, xr)
    out = ((x * cos).to(dt).to(tl.float32) + (xr * sin).to(dt).to(tl.float32)).to(dt)
    tl.store(QOUT + (t * HQ + j) * D + d, out, mask=is_q)
    h = tl.maximum(j - HQ, 0).to(tl.int64)
    is_k = ~is_q
    tl.store(KC + (h * M_ALLOC + slot) * D + d, out, mask=is_k)
    v = tl.load(row + (HQ + HKV + h) * D + d, mask=is_k, other=0.0)
    tl.store(VC + (h * M_ALLOC + slot) * D + d, v, mask=is_k)


def qk_norm_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                       cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float,
                       slot_offset: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [n, (Hq + 2 Hkv) D] -> q [n, Hq, D] (normed, rotated); writes k / v at ``pos [n]`` of the layer's
    caches [1, Hkv, M, D] (at ``pos + slot_offset`` when given: a draft tree's rows, ``dspark_core.decoding.tree``).
    ``cos`` / ``sin`` [M, D] are the full tables (rows picked by ``pos`` on the device)."""
    n = qkv.shape[0]
    d = cos.shape[1]
    q = torch.empty(n, num_heads, d, device=qkv.device, dtype=qkv.dtype)
    has_norm = q_norm is not None
    qn = q_norm if has_norm else cos
    kn = k_norm if has_norm else cos
    tree = slot_offset is not None
    _qk_rope_cache[(n, num_heads + num_kv_heads)](qkv, qn, kn, cos, sin, pos, slot_offset if tree else pos,
                                                  k_cache, v_cache, q, k_cache.shape[2], eps, HQ=num_heads,
                                                  HKV=num_kv_heads, D=d, HAS_NORM=has_norm, TREE=tree, PDL_ON=PDL,
                                                  EARLY=PDL_PREFETCH, num_warps=1 if d <= 64 else 2, **_LAUNCH)
    return q


# --------------------------------------------------------------------------------------------------
# split-KV attention over the cache
# --------------------------------------------------------------------------------------------------
@triton.jit
def _attn_split(Q, KC, VC, POS, OFF, BACK, OP, MP, LP, M_ALLOC, split_len, scale, G: tl.constexpr,
                HKV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, NS_P: tl.constexpr, BLOCK: tl.constexpr,
                IEEE: tl.constexpr, TREE: tl.constexpr, LIVE: tl.constexpr, PDL_ON: tl.constexpr,
                EARLY: tl.constexpr):
    """Program (kv head h, split s, token t): the G query heads of token t over keys
    [s * split_len, +split_len) that t may see (<= its position). One token per program: batch-invariant.
    TREE: the keys are logical positions; those >= POS[t] - BACK[t] are read OFF[t] slots further (a draft
    tree's branch rows, ``dspark_core.decoding.tree``), so the sums run in the same order as without a tree.
    LIVE: a split past the token's keys writes nothing (``ATTN_LIVE_SPLITS``).
    EARLY: the next kernel may launch first thing (``PDL_PREFETCH``)."""
    if PDL_ON and EARLY:
        gdc_launch_dependents()
    if PDL_ON:
        gdc_wait()  # the previous kernel's outputs are complete and visible after this
    h = tl.program_id(0)
    s = tl.program_id(1)
    t = tl.program_id(2)
    g = tl.arange(0, ROWS)  # query head h * G + g
    gvalid = g < G
    last = tl.load(POS + t) + 1  # token t sees keys [0, last)
    d = tl.arange(0, D)
    q = tl.load(Q + ((t * HKV * G + h * G + g) * D)[:, None] + d[None, :], mask=gvalid[:, None], other=0.0)
    start = s * split_len
    end = tl.minimum(start + split_len, last)
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    base = h.to(tl.int64) * M_ALLOC * D
    if TREE:
        off = tl.load(OFF + t)
        branch = last - 1 - tl.load(BACK + t)  # the first logical key read at + off
    for m0 in range(start, end, BLOCK):
        km = m0 + tl.arange(0, BLOCK)
        kmask = km < end
        slot = km
        if TREE:
            slot = tl.where(km >= branch, km + off, km)
        k = tl.load(KC + base + slot[:, None].to(tl.int64) * D + d[None, :], mask=kmask[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [ROWS, BLOCK]
        else:
            sc = tl.dot(q, tl.trans(k)) * scale
        sc = tl.where(kmask[None, :], sc, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(kmask[None, :], tl.exp(sc - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + base + slot[:, None].to(tl.int64) * D + d[None, :], mask=kmask[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if PDL_ON and not EARLY:
        gdc_launch_dependents()  # let the next kernel launch while this one finishes
    idx = ((t * HKV + h) * NS_P + s) * ROWS + g
    write = start < last  # the split holds some of the token's keys
    if not LIVE:
        write = start >= 0  # every split writes its partials (an empty one: m -1e30, l 0, acc 0)
    if write:
        tl.store(MP + idx, m_i)
        tl.store(LP + idx, l_i)
        tl.store(OP + idx[:, None] * D + d[None, :], acc)


@triton.jit
def _attn_combine(OP, MP, LP, POS, OUT, NS, split_len, NS_P: tl.constexpr, G: tl.constexpr, HKV: tl.constexpr,
                  D: tl.constexpr, ROWS: tl.constexpr, LIVE: tl.constexpr, PDL_ON: tl.constexpr, EARLY: tl.constexpr):
    """LIVE: only the splits holding some of the token's keys are read (``ATTN_LIVE_SPLITS``); a masked-out slot
    reads as what an empty split would have written (m -1e30, l 0, o 0), so the sums are the same bits.
    EARLY: the next kernel (a product, prefetching its weights) may launch first thing (``PDL_PREFETCH``)."""
    if PDL_ON and EARLY:
        gdc_launch_dependents()
    if PDL_ON:
        gdc_wait()  # the previous kernel's outputs are complete and visible after this
    h = tl.program_id(0)
    r = tl.program_id(1)
    t = r // G
    g = r % G
    s = tl.arange(0, NS_P)
    ns = NS
    if LIVE:
        ns = tl.minimum(ns, (tl.load(POS + t) + split_len) // split_len)  # splits with keys <= POS[t]
    smask = s < ns
    idx = ((t * HKV + h) * NS_P + s) * ROWS + g
    m = tl.load(MP + idx, mask=smask, other=-1.0e30)
    l_s = tl.load(LP + idx, mask=smask, other=0.0)
    mx = tl.max(m, 0)
    w = tl.exp(m - mx) * (l_s > 0)
    d = tl.arange(0, D)
    o = tl.load(OP + idx[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)  # [NS_P, D]
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w * l_s, 0)
    tl.store(OUT + (t * HKV * G + h * G + g) * D + d, out.to(OUT.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     scale: float, block: int = 64, tree: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """q [n, Hq, D] at positions ``pos [n]`` (device) over the layer's caches [1, Hkv, M, D] (keys <= each
    token's own position) -> [n, Hq, D]. Split-KV: (Hkv x S x n) programs, then a combine.
    ``tree = (offset [n], back [n])`` int32: token t reads logical keys >= pos[t] - back[t] at + offset[t]."""
    n, hq, d = q.shape
    hkv, m_alloc = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    rows = max(16, triton.next_power_of_2(g))
    splits = max(1, min(64, triton.cdiv(m_alloc, 64)))  # ~64 keys per program: latency, not bandwidth, rules
    split_len = triton.cdiv(triton.cdiv(m_alloc, splits), block) * block
    splits = triton.cdiv(m_alloc, split_len)
    ns_p = triton.next_power_of_2(splits)
    op = torch.empty(n, hkv, ns_p, rows, d, device=q.device, dtype=torch.float32)
    mp = torch.empty(n, hkv, ns_p, rows, device=q.device, dtype=torch.float32)
    lp = torch.empty_like(mp)
    off, back = tree if tree is not None else (pos, pos)
    _attn_split[(hkv, splits, n)](q, k_cache, v_cache, pos, off, back, op, mp, lp, m_alloc, split_len, scale, G=g,
                                  HKV=hkv, D=d, ROWS=rows, NS_P=ns_p, BLOCK=block, IEEE=q.dtype == torch.float32,
                                  TREE=tree is not None, LIVE=ATTN_LIVE_SPLITS, PDL_ON=PDL, EARLY=PDL_PREFETCH,
                                  num_warps=4, **_LAUNCH)
    out = torch.empty_like(q)
    _attn_combine[(hkv, n * g)](op, mp, lp, pos, out, splits, split_len, NS_P=ns_p, G=g, HKV=hkv, D=d, ROWS=rows,
                                LIVE=ATTN_LIVE_SPLITS, PDL_ON=PDL, EARLY=PDL_PREFETCH, num_warps=1, **_LAUNCH)
    return out


# Splits past a token's keys write nothing and the combine reads only the live ones (default; same bits:
# DSPARK_ATTN_LIVE_SPLITS=0 writes and reads every split, as before session 13). The split count follows the
# cache size (static, for CUDA graphs), not the context: at bench_online's max_len 2048 a 300-token context
# leaves 27 of 32 splits empty per (kv head, token).
ATTN_LIVE_SPLITS = os.environ.get("DSPARK_ATTN_LIVE_SPLITS", "1") != "0"
