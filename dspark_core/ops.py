"""Plain-torch ops shared by the draft, the decode engine and the kernels' references: HF's RMSNorm, gated MLP and
rotary embedding, bit-identical to transformers' Qwen3 / Qwen2 / Llama modules and importable without transformers.

Shape legend: B batch, T / n tokens, h heads, D / d head dim, H hidden, I intermediate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HF_CLASS_PREFIX = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}  # model_type -> transformers' class prefix


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, n, D], cos/sin [n, D]."""
    return x * cos + rotate_half(x) * sin


# -- the draft's modules: HF's Qwen3 / Qwen2 / Llama RMSNorm, gated MLP and default RoPE, same names and numerics --
class RMSNorm(nn.Module):
    """HF's ``<Family>RMSNorm`` (weight [H], ones): :func:`rms_norm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def activation(name: str) -> nn.Module:
    """``hidden_act`` as a module: SiLU here; any other name through transformers' table."""
    if name in ("silu", "swish"):
        return nn.SiLU()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class GatedMLP(nn.Module):
    """HF's ``<Family>MLP``: ``down(act(gate(x)) * up(x))``; x [.., H] -> [.., H] through [.., I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def rope_settings(config: Any) -> tuple[str, float | None]:
    """(rope type, theta) of an HF config: transformers 5's ``rope_parameters`` or 4's ``rope_theta`` /
    ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return kind, params.get("rope_theta", getattr(config, "rope_theta", None))


class RotaryEmbedding(nn.Module):
    """HF's default RoPE table (``inv_freq = theta^(-2i/d)``): forward(x, positions [B, T]) -> cos, sin [B, T, d]
    in x's dtype, computed in float32. Other rope types: :func:`rotary_embedding` hands them to transformers."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [d/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_type, self.attention_scaling = "default", 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, d]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotary_embedding(config: Any) -> nn.Module:
    """The RoPE module of an HF-style config (``head_dim``, rope settings): :class:`RotaryEmbedding` for the default
    type, transformers' own class (``model_type``'s family) for scaled types (llama3, yarn, ...)."""
    kind, theta = rope_settings(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if kind == "default" and theta is not None:
        return RotaryEmbedding(head_dim, float(theta))
    import importlib

    from transformers import AutoConfig

    hf = config if hasattr(config, "to_json_string") else AutoConfig.for_model(**config.to_dict())
    mod = importlib.import_module(f"transformers.models.{hf.model_type}.modeling_{hf.model_type}")
    return getattr(mod, f"{HF_CLASS_PREFIX[hf.model_type]}RotaryEmbedding")(config=hf)
