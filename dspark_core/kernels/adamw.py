"""AdamW as one streaming Triton kernel per tensor (``train.optimizer_kernel``).

Shape legend: n elements of a tensor, BLOCK elements a program.

torch's fused AdamW walks the tensor lists with ``multi_tensor_apply``; on an H200 its bf16 step over a
Qwen3-4B-shaped draft moves param, grad, exp_avg and exp_avg_sq at about half the memory bandwidth. Here each
tensor gets one launch whose programs stream BLOCK contiguous elements with vector loads (the pointers are
arguments, so Triton knows their alignment), plus torch's own step-count increment for all.

The update is torch's (``torch.optim.AdamW``, ``aten/src/ATen/native/cuda/fused_adam_utils.cuh``), in float32
whatever the storage dtype: ``g /= grad_scale`` (the clip factor, ``train.trainer.clip_and_step``), then
``p -= lr * wd * p``, ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
``p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)`` with t the tensor's step count after the
increment; the bias corrections come from ``exp2(t log2 b)`` rather than ``powf``, so results agree with torch to
float32 rounding (bf16 storage: to a bf16 rounding step; tests/test_adamw_kernel.py). The optimiser state keeps
torch's layout (``step``, ``exp_avg``, ``exp_avg_sq``): a checkpoint resumes under either kernel.

Master weights (``train.param_dtype: bfloat16``, ``train/optim.py``'s ``MasterAdamW``): ``p`` is the float32 master
copy, ``g`` the bf16 gradient of the working copy, and ``working`` names the bf16 working tensors, which the same
pass writes as ``p`` rounded to nearest even (``p.to(bfloat16)``): one read of the gradient, master and moments,
one write of master, moments and working copy, no float32 gradient in memory.
"""

from __future__ import annotations

import math
from typing import Any

import torch

BLOCK = 4096  # elements per program: 16 per thread at 8 warps (two 16-byte loads of bf16)
NUM_WARPS = 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_kernel: Any = None
_store_rounded: Any = None


def _build_kernel():
    import triton
    import triton.language as tl

    global _store_rounded  # a module global: Triton resolves the kernel's callees there

    @triton.jit
    def _store_rounded(ptrs, x, mask):
        """Store float32 ``x`` in the pointers' dtype, rounded to nearest even as torch's ``.to()`` rounds; bf16 from
        its bits (NaN stays NaN), so Triton's CPU interpreter, whose cast truncates, writes the GPU's bits too."""
        if ptrs.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            top = tl.where(x != x, 0x7FC0, top)
            tl.store(ptrs, top.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def adamw_tensor(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, scale_ptr, w_ptr, n, lr, lr_wd, beta1, beta2, log2_b1,
                     log2_b2, eps, HAS_SCALE: tl.constexpr, WORKING: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        if HAS_SCALE:
            g = tl.div_rn(g, tl.load(scale_ptr).to(tl.float32))
        step = tl.load(step_ptr)
        bc1 = 1.0 - tl.exp2(step * log2_b1)
        bc2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(step * log2_b2))
        p = p - lr_wd * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(tl.div_rn(lr, bc1) * m, denom)
        _store_rounded(p_ptr + offs, p, mask)
        _store_rounded(m_ptr + offs, m, mask)
        _store_rounded(v_ptr + offs, v, mask)
        if WORKING:  # the working copy the forward reads: the new master rounded to its dtype
            _store_rounded(w_ptr + offs, p, mask)

    return adamw_tensor


def supported(tensors: list[torch.Tensor]) -> bool:
    """Whether the kernel can take these tensors: dense, contiguous, float32 / bfloat16 / float16."""
    return all(t.layout == torch.strided and t.is_contiguous() and t.dtype in _DTYPES for t in tensors)


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, grad_scale: torch.Tensor | None = None,
                working: list[torch.Tensor] | None = None, block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """One AdamW update of every tensor in place (``steps``: float32 step counts, already incremented);
    ``working``: per tensor, a copy of the same shape (bf16) that receives the updated ``params`` rounded to its
    dtype (the master-weights step); ``block`` / ``num_warps``: the launch shape (``bench_kernels.py --parts
    adamw`` compares them)."""
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    scalars = (float(lr), float(lr) * float(weight_decay), float(beta1), float(beta2), math.log2(beta1),
               math.log2(beta2), float(eps))
    outs = working if working is not None else [None] * len(params)
    for p, g, m, v, s, w in zip(params, grads, exp_avgs, exp_avg_sqs, steps, outs):
        n = p.numel()
        _kernel[(-(-n // block),)](p, g, m, v, s, grad_scale if grad_scale is not None else s,
                                   w if w is not None else p, n, *scalars, HAS_SCALE=grad_scale is not None,
                                   WORKING=w is not None, BLOCK=block, num_warps=num_warps)


def adamw_reference_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: float, *, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float,
                     grad_scale: torch.Tensor | None = None) -> None:
    """The kernel's update of one tensor in plain torch (float32 math, in place): the tests' reference."""
    g32 = g.float() if grad_scale is None else g.float() / grad_scale.float()
    p32, m32, v32 = p.float(), m.float(), v.float()
    p32 = p32 - float(lr) * float(weight_decay) * p32
    m32 = beta1 * m32 + (1.0 - beta1) * g32
    v32 = beta2 * v32 + (1.0 - beta2) * g32 * g32
    bc1 = 1.0 - 2.0 ** (step * math.log2(beta1))
    bc2_sqrt = math.sqrt(1.0 - 2.0 ** (step * math.log2(beta2)))
    p32 = p32 - (lr / bc1) * m32 / (v32.sqrt() / bc2_sqrt + eps)
    p.copy_(p32)
    m.copy_(m32)
    v.copy_(v32)


def master_adamw_reference_(master: torch.Tensor, working: torch.Tensor, g: torch.Tensor, m: torch.Tensor,
                            v: torch.Tensor, step: float, **hp: Any) -> None:
    """The master-weights step of one tensor in plain torch: :func:`adamw_reference_` on the float32 ``master``
    with the working copy's gradient ``g``, then ``working`` = the new master rounded to its dtype (the tests'
    reference for ``adamw_step_(..., working=...)``)."""
    adamw_reference_(master, g, m, v, step, **hp)
    working.copy_(master)
