"""Functional decoder-layer code over a Hugging Face Qwen3 / Qwen2 / Llama ``*ForCausalLM``.

The training forward, every cached inference step and the plain AR baseline run the target's own
sub-modules (projections, q/k norms, MLP, RMSNorms, rotary embedding) through these few functions, so
DMTD and AR decode share one layer implementation and only differ in which slots attend to which.

A layer is split in two halves around attention so a caller can place the new K/V in a cache first:
``layer_qkv`` (input norm, projections, q/k norm, RoPE) and ``layer_out`` (o_proj, residual, MLP).

Shape legend: B batch, N slots, Nk key slots, H hidden, Hq query heads, Hkv key/value heads,
G = Hq / Hkv, D head dim.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")

# kv_sink(layer_index_in_group, k [B, Hkv, N, D], v [B, Hkv, N, D]): sees every layer's new K/V
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]


def check_supported(config) -> None:
    """ValueError unless the target is a full-attention Qwen3 / Qwen2 / Llama model."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"target model_type {config.model_type!r} is not supported by DMTD "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"target config.layer_types {sorted(kinds)}: DMTD needs full attention in every layer")


def head_dims(config) -> tuple[int, int, int]:
    """``(Hq, Hkv, D)`` of the target."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads, config.num_key_value_heads, d


def rope(rotary: nn.Module, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[B, N, D]`` for positions ``pos [B, N]`` (the target's rotary module, any rope type)."""
    return rotary(x, pos)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, N, D]
    return x * cos + _rotate_half(x) * sin


def layer_qkv(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q ``[B, Hq, N, D]``, k, v ``[B, Hkv, N, D]`` of decoder ``layer`` for hidden states ``x [B, N, H]``."""
    attn = layer.self_attn
    b, n, _ = x.shape
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(b, n, -1, attn.head_dim)  # [B, N, Hq, D]
    k = attn.k_proj(h).view(b, n, -1, attn.head_dim)  # [B, N, Hkv, D]
    v = attn.v_proj(h).view(b, n, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v


def layer_out(layer: nn.Module, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Residual stream after ``layer`` given its attention output ``attn_out [B, Hq, N, D]``."""
    b, _, n, _ = attn_out.shape
    x = x + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, n, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                 ) -> torch.Tensor:
    """SDPA with a boolean ``mask [B, 1, Nq, Nk]``; GQA by folding the G query heads of a K/V head into
    the query axis (no copy of K/V, which matters when K/V is a whole static cache). -> ``[B, Hq, Nq, D]``"""
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qf = q.reshape(b, hkv, g * nq, d)  # head h = kv * G + j, as in HF repeat_kv
    if g > 1:
        mask = mask[:, :, None].expand(-1, -1, g, -1, -1).reshape(mask.shape[0], 1, g * nq, mask.shape[-1])
    out = F.scaled_dot_product_attention(qf, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    return out.reshape(b, hq, nq, d)


_compiled_flex = None


def attend_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float) -> torch.Tensor:
    """flex_attention with a ``BlockMask`` (compiled on GPU; the eager reference on CPU)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    return fn(q, k.to(q.dtype), v.to(q.dtype), block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def attend(q, k, v, mask, scale: float) -> torch.Tensor:
    """Dispatch on the mask type: dense boolean tensor -> SDPA, BlockMask -> flex_attention."""
    if isinstance(mask, torch.Tensor):
        return attend_dense(q, k, v, mask, scale)
    return attend_flex(q, k, v, mask, scale)


def run_layers(layers, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask,
               kv_sink: KVSink | None = None, checkpoint: bool = False) -> torch.Tensor:
    """Self-attention through ``layers`` for slots ``x [B, N, H]`` under one mask shared by all layers."""
    for i, layer in enumerate(layers):
        if checkpoint and torch.is_grad_enabled():
            x = torch.utils.checkpoint.checkpoint(_self_attn_layer, layer, x, cos, sin, mask, use_reentrant=False)
        else:
            x = _self_attn_layer(layer, x, cos, sin, mask, kv_sink=kv_sink, index=i)
    return x


def _self_attn_layer(layer, x, cos, sin, mask, kv_sink: KVSink | None = None, index: int = 0) -> torch.Tensor:
    q, k, v = layer_qkv(layer, x, cos, sin)
    if kv_sink is not None:
        kv_sink(index, k, v)
    return layer_out(layer, x, attend(q, k, v, mask, layer.self_attn.scaling))
