"""DSpark attention masks and the attention call: flex_attention (block-sparse) on GPU, dense SDPA on CPU.

Shape legend: B batch, A anchors, S slots of a block, Q = A*S query rows (block tokens), C context
positions, E extra K/V entries (a variant's memory), nq / nkv heads, d head dim.

Key/value layout of the multi-anchor training forward::

    [context 0..C-1 | extra 0..E-1 | block tokens 0..Q-1]

Visibility of query row q of batch b (its block a = q // S, anchor position p = anchors[b, a]):

- context kv c:  c < p, and block a is valid. Padding is never seen: a valid anchor has p + 1 < length. In a
  packed row (``draft/packing.py``) also c >= the start of the anchor's document.
- extra kv e:    extra_owner[b, e] == a, and block a is valid (a Draft Memory entry belongs to one block).
- block kv j:    j // S == a: its own block, bidirectionally, for *every* block. Dummy (invalid) blocks
  see only themselves, so no row is empty: a fully masked row would give NaN in SDPA (and in its
  backward); their outputs are finite and never read by the loss. (Rows can still be empty *within* a
  128x128 tile, so flex's ``ROWS_GUARANTEED_SAFE`` must stay off: with it the H200 run produced NaN.)

One function, :func:`make_mask_mod`, defines this. The GPU path turns it into a flex ``BlockMask``; the
CPU path evaluates the very same function on broadcast index grids to get a dense boolean mask, so both
paths implement one definition (tests compare it with a brute-force loop and the two outputs).
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from dspark_core.errors import UserError

BACKENDS = ("auto", "flex", "dense")
_compiled_flex: dict[bool, Callable[..., torch.Tensor]] = {}  # dynamic shapes? -> compiled flex_attention
# flex_attention's kernel_options on GPU (tile sizes, warps, stages; None: torch's defaults). A speed setting:
# every choice computes the same attention. benchmarks/bench_kernels.py --parts flex --flex-set sweep times them.
FLEX_KERNEL_OPTIONS: dict[str, Any] | None = None
# train.attention_kernel: which kernels run flex_attention on GPU (set_attention_kernel). triton: torch's own;
# flash: FlashAttention-4 (CuTe DSL) through flex's BACKEND "FLASH", block-sparse forward and backward with the
# same mask_mod; auto: flash where it runs (the package installed, a Hopper or Blackwell GPU), else triton. The
# same attention either way (bf16 rounding aside; tests/test_attention_flash_gpu.py).
ATTENTION_KERNELS = ("auto", "triton", "flash")
ATTENTION_KERNEL = "triton"  # what runs: triton or flash (auto resolved)
FLASH_INSTALL = "pip install -e '.[flash]'"


def set_attention_kernel(choice: str) -> str:
    """Choose the GPU attention kernels (``train.attention_kernel``) and return the one that runs. ``flash`` is
    checked here, before any compilation: it needs the ``flash-attn-4`` package and an NVIDIA GPU of compute
    capability >= 9.0; ``auto`` takes it where those hold, else ``triton``."""
    global ATTENTION_KERNEL
    if choice not in ATTENTION_KERNELS:
        raise UserError(f"train.attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}; got {choice!r}")
    if choice == "auto":
        choice = "triton" if flash_unavailable() else "flash"
    elif choice == "flash":
        problem = flash_unavailable()
        if problem:
            raise UserError(f"train.attention_kernel: flash, but {problem}; set train.attention_kernel: triton")
    ATTENTION_KERNEL = choice
    return choice


def flash_unavailable() -> str:
    """Why FlashAttention-4 cannot run here ('' when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible (FlashAttention-4 runs on NVIDIA Hopper and Blackwell GPUs)"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"this GPU has compute capability {major}.{minor}; FlashAttention-4 needs >= 9.0 (Hopper, Blackwell)"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # a flash_attn without the cute subpackage (FlashAttention-2)
        found = False
    return "" if found else f"the flash-attn-4 package is not installed ({FLASH_INSTALL})"


def flex_kernel_options() -> dict[str, Any]:
    """The kernel_options every flex_attention call of the draft gets: FLEX_KERNEL_OPTIONS, plus the FLASH
    backend under ``train.attention_kernel: flash``. Under ``triton`` the main flex kernel is forced: torch picks
    its decoding kernel for fewer than 128 query rows (anchors x block size), and on torch 2.11 that kernel has no
    tile for more than 128 rows x grouped heads ("No choices exist for backend")."""
    if ATTENTION_KERNEL != "flash":
        return {"FORCE_USE_FLEX_ATTENTION": True, **(FLEX_KERNEL_OPTIONS or {})}
    return {**(FLEX_KERNEL_OPTIONS or {}), "BACKEND": "FLASH"}


def make_mask_mod(anchors: torch.Tensor, anchor_valid: torch.Tensor, ctx_len: int, block_size: int,
                  extra_owner: torch.Tensor | None = None,
                  anchor_start: torch.Tensor | None = None) -> Callable[..., torch.Tensor]:
    """``mask_mod(b, h, q_idx, kv_idx) -> bool`` for anchors [B, A], anchor_valid [B, A], extra_owner [B, E];
    ``anchor_start [B, A]`` (packed rows, ``draft/packing.py``): the context a block sees starts there, not at 0.

    Works on scalars (flex) and on broadcastable index tensors (the dense mask). The context length
    is captured as a tensor [B] (read at the batch index: FlashAttention-4's generated mask code loads
    tensors at computed indices only) so a compiled flex kernel does not specialise on it.
    """
    # a fill kernel, not a host->device copy: no synchronisation at the start of every forward
    c_len = torch.full((anchors.shape[0],), ctx_len, device=anchors.device, dtype=torch.long)  # [B]
    n_extra = 0 if extra_owner is None else extra_owner.shape[1]
    kv_owner = None  # [B, C + E + Q]: the block owning an extra entry, -1 at every other key (no index clamping:
    if n_extra > 0:  # FlashAttention-4's mask codegen on torch 2.11 has no maximum / minimum)
        kv_owner = torch.full((anchors.shape[0], ctx_len + n_extra + anchors.shape[1] * block_size), -1,
                              device=anchors.device, dtype=torch.long)
        kv_owner[:, ctx_len:ctx_len + n_extra] = extra_owner

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        valid = anchor_valid[b, blk]
        ctx = c_len[b]
        own_start = ctx + n_extra
        visible = (kv_idx < ctx) & (kv_idx < anchors[b, blk]) & valid
        if anchor_start is not None:
            visible = visible & (kv_idx >= anchor_start[b, blk])  # its own document only
        visible = visible | ((kv_idx >= own_start) & ((kv_idx - own_start) // block_size == blk))
        if kv_owner is not None:
            visible = visible | ((kv_owner[b, kv_idx] == blk) & valid)  # an extra entry owned by this block
        return visible

    return mask_mod


def dense_mask(mask_mod: Callable[..., torch.Tensor], batch: int, q_len: int, kv_len: int,
               device: torch.device | str) -> torch.Tensor:
    """Evaluate ``mask_mod`` on the full grid: bool [B, 1, Q, KV] (True = may attend)."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


@dataclass
class AttentionMask:
    """What :func:`attend` needs: a flex ``BlockMask``, a dense bool mask [B, 1, Q, KV], or nothing (all visible)."""

    block_mask: Any = None
    dense: torch.Tensor | None = None


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return backend


def build_attention_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, ctx_len: int, block_size: int,
                         extra_owner: torch.Tensor | None = None, backend: str = "auto",
                         anchor_start: torch.Tensor | None = None) -> AttentionMask:
    """The training mask for anchors [B, A] over keys [context C | extra E | blocks A*S]."""
    batch, num_anchors = anchors.shape
    q_len = num_anchors * block_size
    kv_len = ctx_len + (0 if extra_owner is None else extra_owner.shape[1]) + q_len
    mask_mod = make_mask_mod(anchors, anchor_valid, ctx_len, block_size, extra_owner, anchor_start)
    if resolve_backend(backend, anchors.device) == "dense":
        return AttentionMask(dense=dense_mask(mask_mod, batch, q_len, kv_len, anchors.device))
    return AttentionMask(block_mask=_block_mask(mask_mod, batch, q_len, kv_len, anchors.device))


_COMPILE_BLOCK_MASK = [True]


def _block_mask(mask_mod, batch: int, q_len: int, kv_len: int, device: torch.device):
    """flex's BlockMask of ``mask_mod``; on CUDA its construction is compiled (``_compile=True``: a few fused
    kernels instead of a vmapped eager evaluation that costs milliseconds of host time every step).
    A first failure (a torch build without it; with a warning) falls back to the eager construction."""
    from torch.nn.attention.flex_attention import create_block_mask

    use = device.type == "cuda" and _COMPILE_BLOCK_MASK[0]
    if use:
        try:
            return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device,
                                     _compile=True)
        except Exception as e:  # noqa: BLE001 - a torch build without it: eager construction, same mask
            warnings.warn(f"compiled create_block_mask failed ({e!r:.200}); building block masks eagerly")
            _COMPILE_BLOCK_MASK[0] = False
    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)


def _flex(q, k, v, block_mask, scale: float, enable_gqa: bool) -> torch.Tensor:
    """flex_attention, compiled on GPU (one dynamic-shape kernel; static shapes under FlashAttention-4, whose
    generated mask code takes no symbolic sizes); the unfused reference elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    options = flex_kernel_options()
    if torch.compiler.is_compiling():  # inside a compiled layer: traced and fused there
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                              kernel_options=options)
    if q.device.type == "cuda":
        dynamic = ATTENTION_KERNEL != "flash"
        if dynamic not in _compiled_flex:
            _compiled_flex[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
        return _compiled_flex[dynamic](q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                       kernel_options=options)
    with warnings.catch_warnings():  # CPU: the unfused path is what we want (tests only)
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float) -> torch.Tensor:
    """Attention of q [B, nq, Q, d] over k, v [B, nkv, KV, d] (GQA when nkv < nq) -> [B, nq, Q, d].

    q and k are cast to v's dtype (under autocast the projections give bf16 while RoPE may promote).
    """
    q, k = q.to(v.dtype), k.to(v.dtype)
    gqa = q.shape[1] != k.shape[1]
    if mask.block_mask is not None:
        return _flex(q, k, v, mask.block_mask, scale, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, scale=scale, enable_gqa=gqa)
