"""``fused_linear``: y = [residual +] act?(W @ norm?(x)) for x [n, K], the matrix products of the decode
step, through the FMA GEMV (``dspark_core.kernels.gemv``) or the tensor-core tiles (``dspark_core.kernels.gemm``),
with the tile tuned per shape (``dspark_core.kernels.tuning``). A step of n > 16 tokens (several requests'
tokens at once) runs in token tiles of 16 rows, more programs of the same kernels.

Shape legend: n tokens of the step, K input features, N output features.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from dspark_core.kernels import tuning
from dspark_core.kernels.gemm import MMA_ROWS, _gemm_small, _launch_stream, _split_buffers
from dspark_core.kernels.gemv import _gemv, _gemv_rows
from dspark_core.kernels.pdl import _LAUNCH, INTERPRET, PDL, PDL_PREFETCH
from dspark_core.kernels.tuning import is_fma_tile
from dspark_core.ops import rms_norm

# The widest step the decode path is tuned for: one token tile (a verify of a 15-token proposal). Wider steps run
# in token tiles of MMA_ROWS (batch-invariant mode: each token's bits as in a 1-token step) or, with
# ``set_batch_invariant(False)``, through cuBLAS.
MAX_TOKENS = MMA_ROWS
# Batch invariance (default): a step of n tokens computes each token exactly as a step of one token would,
# so greedy speculative decoding reproduces AR decoding bit for bit in bf16 too. Two ways (``set_small_gemm``;
# bench_online.small_gemm in params.yaml, bench_decode.py --kernel-modes):
#   mma (default where it applies): every step, n = 1 included, through the tensor-core kernel with 16 token
#        rows (padding rows cost nothing: the step is memory-bound) and split-K: a verify of n <= 16 costs
#        about one n = 1 step. Needs bf16 tensor cores (sm_80+; ``small_gemm_problem`` says why not);
#   fma: every token through the FMA GEMV, one program per (token, weight tile): the fastest n = 1 step, but
#        n tokens read each tile from L2 n times (a verify of 8 ~4x the n = 1 step).
# ``set_batch_invariant(False)`` (bench_online.batch_invariant, bench_decode.py --no-batch-invariant): the FMA
# GEMV for n = 1, tensor-core tiles tuned per n for 1 < n <= MAX_TOKENS, and torch (cuBLAS) beyond (a near-tie
# can then flip a greedy token between verify and AR).
BATCH_INVARIANT = True
SMALL_GEMM_MODES = ("mma", "fma")
SMALL_GEMM = "mma"


def set_batch_invariant(on: bool) -> None:
    """Batch-invariant products (True, the default; see above) or the fastest per n: the FMA GEMV for n = 1,
    tensor-core tiles for n <= MAX_TOKENS, cuBLAS beyond (False), for the kernels launched from now on."""
    global BATCH_INVARIANT
    BATCH_INVARIANT = bool(on)


def set_small_gemm(mode: str) -> None:
    """Switch the small-GEMM family for the kernels launched from now on (captured CUDA graphs keep theirs).
    Both are exact and batch-invariant, but they sum in different orders: AR and speculative decoding compared
    bit for bit must run in the same mode."""
    global SMALL_GEMM
    if mode not in SMALL_GEMM_MODES:
        raise ValueError(f"small_gemm must be one of {SMALL_GEMM_MODES}; got {mode!r}")
    SMALL_GEMM = mode


@contextlib.contextmanager
def small_gemm(mode: str):
    """``set_small_gemm(mode)`` for the kernels launched (or captured) inside the block, then the previous mode."""
    before = SMALL_GEMM
    set_small_gemm(mode)
    try:
        yield
    finally:
        set_small_gemm(before)


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


def _uses_mma(m: int) -> bool:
    return SMALL_GEMM == "mma" if BATCH_INVARIANT else m > 1


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
    # Grids below: axis 0 = weight tile x token tiles + token tile, token tiles fastest (``gemm`` module docstring)
    token_tiles = triton.cdiv(m, MMA_ROWS)
    if is_fma_tile(cfg):
        _, bn, bk, warps = cfg
        _gemv_rows[(triton.cdiv(n_out, bn) * token_tiles,)](x, nw, w, b, r, y, m, n_out, k, eps, **flags,
                                                            BLOCK_M=MMA_ROWS, BLOCK_N=bn, BLOCK_K=bk, PDL_ON=PDL,
                                                            PREFETCH=PDL_PREFETCH, num_warps=warps, **_LAUNCH)
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
    ws, lock = _split_buffers(x.device, token_tiles * tiles, splits, bn) if splits > 1 else (y, y)
    _gemm_small[(tiles * token_tiles, splits)](x, nw, w, b, r, y, ws, lock, m, n_out, k, k_split, eps, **flags,
                                               IEEE=x.dtype == torch.float32, BLOCK_M=MMA_ROWS, BLOCK_N=bn,
                                               BLOCK_K=bk, SPLITS=splits, SWAP=swap, PDL_ON=PDL,
                                               PREFETCH=PDL_PREFETCH, num_warps=warps, num_stages=stages, **_LAUNCH)


def _config(x, w, bias, norm_weight, eps, residual, y, n_out, gated):
    """The fastest candidate for this shape, timed once on first use (never while a CUDA graph is captured):
    ``tuning.graph_time_ms`` over ``tuning.weight_copies`` (DRAM reads, no host launch cost).

    Batch-invariant mode: every n uses the configuration tuned for n = 1 (same tiles, same sums)."""
    m, k = x.shape
    if m > 1 and BATCH_INVARIANT:
        one = (residual[:1] if residual is not None else None)
        return _config(x[:1], w, bias, norm_weight, eps, one, y[:1], n_out, gated)
    mma = _uses_mma(m)
    configs = tuning.mma_candidates() if mma else tuning.GEMV_CONFIGS
    key = (mma, m, n_out, k, gated, x.dtype, str(x.device))
    chosen = tuning.lookup(key)
    if chosen is not None:
        return chosen
    if INTERPRET:  # the CPU interpreter runs programs one by one: the fewest, widest (tensor-core) tiles
        return tuning.remember(key, max((c for c in configs if not is_fma_tile(c)), key=lambda c: c[0]))
    if not tuning.TUNE or not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return configs[0]
    return tuning.remember(key, _tune(x, w, bias, norm_weight, eps, residual, n_out, gated, configs, mma))


TUNE_VERIFY_TOKENS = 8  # mma mode with FMA tiles: a candidate's cost is its n = 1 + its n = 8 time (step + verify)


def _tune(x, w, bias, norm_weight, eps, residual, n_out, gated, configs, mma: bool) -> tuple:
    """The fastest of ``configs`` for x [1, K]: ``graph_time_ms`` over ``weight_copies`` (DRAM reads, no host
    launch cost). In ``mma`` mode one configuration serves every n; when FMA tiles compete (``set_fma_tiles``) a
    candidate is timed at n = 1 and at n = 8 (a block-7 verify) and ranked by the sum, since FMA tiles grow with n
    and tensor-core tiles barely do (tensor-core tiles alone: n = 1, half the warm-up)."""
    weights = tuning.weight_copies(w)
    inputs = [(x, residual, torch.empty(x.shape[0], n_out, device=x.device, dtype=x.dtype))]
    if mma and BATCH_INVARIANT and any(is_fma_tile(c) for c in configs):  # x is one token here; add the verify's n
        n = TUNE_VERIFY_TOKENS
        rn = residual.expand(n, -1).contiguous() if residual is not None else None
        inputs.append((x.expand(n, -1).contiguous(), rn, torch.empty(n, n_out, device=x.device, dtype=x.dtype)))

    def cost(cfg: tuple) -> float:
        total = 0.0
        for xn, rn, yn in inputs:
            total += tuning.graph_time_ms(lambda i: _launch(xn, weights[i % len(weights)], bias, norm_weight, eps, rn, yn,
                                                     n_out, gated, cfg))
        return total

    return tuning.fastest(configs, cost)


def fused_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, K] (any n >= 1) -> y [n, N]: ``residual + act(linear(rmsnorm(x)))`` with each part optional.

    ``w`` is [N, K], or [2N, K] with ``gated`` (rows = gate then up; y = SiLU(gate) * up); ``bias`` [N]
    or [2N]; ``norm_weight`` [K] applies HF's RMSNorm to x first; ``residual`` [n, N] is added last.
    Batch-invariant mode: token t's row is bit for bit that of ``fused_linear(x[t:t+1], ...)``, for any n (n > 16:
    token tiles of 16). ``set_batch_invariant(False)`` and n > MAX_TOKENS: ``fused_linear_reference`` (cuBLAS)."""
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"fused_linear takes x [n >= 1, K]; got {tuple(x.shape)}")
    m, k = x.shape
    if w.shape[1] != k:
        raise ValueError(f"fused_linear: x has {k} features, w is {tuple(w.shape)}")
    if m > MAX_TOKENS and not BATCH_INVARIANT:
        return fused_linear_reference(x, w, bias, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)
    x, w = x.contiguous(), w.contiguous()
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

