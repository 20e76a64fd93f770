"""Triton kernels for the GPU fast paths (decode step of the target, fused distillation loss).

The target's decode / verify step (batch 1, n <= 16 new tokens; ``TargetRunner(kernels=True)``): decoding
reads every weight once per step, so the step is a chain of memory-bound matrix-vector products; what costs
time besides the bytes is the number of kernels (each a few microseconds even inside a CUDA graph). One
decoder layer is 7 kernels:

1. ``linear.fused_linear(x, W_qkv, norm_weight=ln1)``: input RMSNorm fused into the fused Q/K/V projection;
2. ``rope.qk_norm_rope_cache``: Qwen3's per-head q/k RMSNorm, RoPE, and the K/V cache write;
3. + 4. ``attention.decode_attention``: split-KV attention over the cache (flash-decoding) and the combine;
5. ``fused_linear(attn, W_o, residual=x)``: output projection + residual;
6. + 7. ``fused_linear(x, W_gate_up, norm_weight=ln2, gated=True)`` then ``fused_linear(h, W_down, residual=x)``:
   post-attention RMSNorm + gate/up projection + SiLU(gate) * up, and the down projection + residual.

``fused_linear`` runs the FMA GEMV (``gemv``) or the tensor-core tiles with split-K / stream-K (``gemm``), the
tile tuned per shape and optionally pinned (``tuning``). On Hopper every kernel is launched with programmatic
dependent launch (``pdl``) and lets the next one launch first thing; the products read their first weight block
before waiting for the previous kernel (``pdl.PDL_PREFETCH``), which took the ``fma`` SmolLM2 step from 0.469 to
0.372 ms on an H200.

The same kernels take a step of many requests' tokens at once: ``fused_linear`` any n (token tiles of 16 beyond
16), the caches [R, Hkv, M, D] hold R request rows and ``rows [n]`` says each token's row
(``qk_norm_rope_cache``, ``decode_attention``), ``accept.GreedyAccept(batch=B)`` decides B requests in one
launch. Each token is computed exactly as in a one-token step of its request alone (batch-invariant mode).

Element-wise steps round to the model dtype where Hugging Face's modules do (projection outputs, RoPE
products, SiLU, residual adds); the RMSNorms are folded into the products (``W (g x rstd) = rstd W (g x)``,
one pass over the weights), so the fast step differs from the eager reference by rounding only (tested
against it, and against float32 in bf16).

Importing this package never imports Triton; :func:`triton_ok` says whether the kernels can run on a
tensor's device: on CUDA when Triton imports, or anywhere under ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, which the kernel tests use on machines without a GPU). Every kernel has a plain-torch
reference next to it and a test against that reference (``tests/test_kernels.py``).
"""

from __future__ import annotations

import os

import torch


def triton_ok(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on ``device``."""
    device = torch.device(device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpret:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
