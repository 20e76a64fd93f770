"""The decode step's attention inputs in one kernel: Qwen3's per-head q/k RMSNorm, RoPE, and the K/V cache write.

Shape legend: n tokens of the step, Hq / Hkv query / KV heads, D head dim, R cache rows (requests), M cache
positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_core.kernels.pdl import _LAUNCH, PDL, PDL_PREFETCH, gdc_launch_dependents, gdc_wait


@triton.jit
def _qk_rope_cache(QKV, QN, KN, COS, SIN, POS, OFF, ROWS, KC, VC, QOUT, M_ALLOC, eps, HQ: tl.constexpr,
                   HKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr, TREE: tl.constexpr,
                   HAS_ROWS: tl.constexpr, PDL_ON: tl.constexpr, EARLY: tl.constexpr):
    """Token t, head j: RoPE at position POS[t]; K/V written at cache row ROWS[t] (0 without HAS_ROWS), slot
    POS[t] (+ OFF[t] with TREE). EARLY: the next kernel may launch first thing (``PDL_PREFETCH``)."""
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
    cache_row = 0
    if HAS_ROWS:
        cache_row = tl.load(ROWS + t).to(tl.int64)
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
    dst = ((cache_row * HKV + h) * M_ALLOC + slot) * D + d
    tl.store(KC + dst, out, mask=is_k)
    v = tl.load(row + (HQ + HKV + h) * D + d, mask=is_k, other=0.0)
    tl.store(VC + dst, v, mask=is_k)


def qk_norm_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                       cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float,
                       slot_offset: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [n, (Hq + 2 Hkv) D] -> q [n, Hq, D] (normed, rotated at ``pos [n]``); writes token t's k / v into the
    layer's caches [R, Hkv, M, D] (contiguous) at row ``rows[t]`` (``rows [n]`` int32 / int64 on the device; None:
    row 0), slot ``pos[t]`` (``pos[t] + slot_offset[t]`` when given: a draft tree's rows,
    ``dspark_core.decoding.tree``). ``cos`` / ``sin`` [M, D] are the full tables (rows picked by ``pos`` on the
    device)."""
    n = qkv.shape[0]
    check_rows(rows, n, k_cache, v_cache)
    d = cos.shape[1]
    q = torch.empty(n, num_heads, d, device=qkv.device, dtype=qkv.dtype)
    has_norm = q_norm is not None
    qn = q_norm if has_norm else cos
    kn = k_norm if has_norm else cos
    tree = slot_offset is not None
    _qk_rope_cache[(n, num_heads + num_kv_heads)](qkv, qn, kn, cos, sin, pos, slot_offset if tree else pos,
                                                  pos if rows is None else rows, k_cache, v_cache, q,
                                                  k_cache.shape[2], eps, HQ=num_heads, HKV=num_kv_heads, D=d,
                                                  HAS_NORM=has_norm, TREE=tree, HAS_ROWS=rows is not None,
                                                  PDL_ON=PDL, EARLY=PDL_PREFETCH, num_warps=1 if d <= 64 else 2,
                                                  **_LAUNCH)
    return q


def check_rows(rows: torch.Tensor | None, n: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Refuse (ValueError, one line) cache rows that are not an int32 / int64 [n] tensor on the caches' device, or
    caches that are not contiguous [R, Hkv, M, D] of one shape. The row values are not read (no host sync): each
    must be in [0, R)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or not (k_cache.is_contiguous()
                                                                    and v_cache.is_contiguous()):
        raise ValueError(f"the K / V caches must be contiguous [R, Hkv, M, D] of one shape; got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    if rows is None:
        return
    if rows.shape != (n,) or rows.dtype not in (torch.int32, torch.int64) or rows.device != k_cache.device:
        raise ValueError(f"rows must be an int32 / int64 tensor [{n}] (one cache row per token) on "
                         f"{k_cache.device}; got {rows.dtype} {list(rows.shape)} on {rows.device}")
