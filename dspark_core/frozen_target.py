"""What the draft needs of the target, read straight from its HF dir: config.json, the embedding and LM head rows
of the safetensors weights, the tokenizer's pad id. No transformers import (about 3 s a process on 2 cores) and no
target layers: the draft's training, offline evaluation, export and Engram table use this; whatever runs the target
(regenerate, cache, decoding) loads it with :func:`dspark_core.target.load_target`.

- ``read_model_config(path) -> ModelConfig | None``: config.json as an HF-style attribute config, or None when a
  field the draft reads is missing there (transformers' config class then supplies its family defaults).
- ``load_frozen_target(path, dtype, device) -> (FrozenTarget, pad_id)``: ``FrozenTarget`` answers ``config``,
  ``get_input_embeddings()`` and ``get_output_embeddings()`` as the HF model does (a tied model: one tensor).

Shape legend: V vocab, Ht target hidden.
"""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark_core.errors import UserError
from dspark_core.target import (SUPPORTED_MODEL_TYPES, check_target_dir, load_target, resolve_dtype,
                                target_weights_dir, verify_target_weights)

# config.json fields the draft reads; a config without one of them goes through transformers' defaults
REQUIRED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "max_position_embeddings")
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


class ModelConfig(types.SimpleNamespace):
    """An HF config's fields as attributes (transformers 5's names: ``rope_parameters``)."""

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(vars(self))


def read_model_config(path: str | Path) -> ModelConfig | None:
    """config.json of the HF dir ``path`` with transformers' defaults for the optional fields the draft reads."""
    path = Path(path)
    d = json.loads((path / "config.json").read_text())
    if any(d.get(k) is None for k in REQUIRED) or d.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return None
    if "rope_parameters" not in d:  # a transformers 4 config.json: rope_theta + rope_scaling
        if d.get("rope_theta") is None:
            return None
        scaling = dict(d.pop("rope_scaling", None) or {})
        kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        d["rope_parameters"] = {**scaling, "rope_type": kind, "rope_theta": d.pop("rope_theta")}
    defaults = {"num_key_value_heads": d["num_attention_heads"], "attention_bias": False, "initializer_range": 0.02,
                "head_dim": d["hidden_size"] // d["num_attention_heads"]}
    if d["model_type"] == "llama":
        defaults["mlp_bias"] = False
    for key, value in defaults.items():
        if d.get(key) is None:
            d[key] = value
    d["_name_or_path"] = str(path)
    return ModelConfig(**d)


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or a sharded index), in the folder
    :func:`~dspark_core.target.target_weights_dir` gives (a hub target's snapshot in the hub cache)."""
    weights = target_weights_dir(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: weights / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = weights / "model.safetensors"
    if not single.is_file():
        raise UserError(f"{path}: no model.safetensors or model.safetensors.index.json; rebuild the target stage")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _read_tensor(files: dict[str, Path], name: str, path: Path) -> torch.Tensor:
    if name not in files:
        raise UserError(f"{path}: the weights have no {name}; the target dir is incomplete (rebuild the target stage)")
    from safetensors import safe_open

    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


class _Weight(nn.Module):
    """A module holding one frozen weight, as the HF model's embedding / LM head modules hold theirs."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class FrozenTarget(nn.Module):
    """The target's config, embedding [V, Ht] and LM head [V, Ht] (the same parameter when tied)."""

    def __init__(self, config: Any, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _Weight(nn.Parameter(embed, requires_grad=False))
        head = self.embed_tokens.weight if lm_head is None else nn.Parameter(lm_head, requires_grad=False)
        self.lm_head = _Weight(head)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def read_pad_token_id(path: str | Path) -> int | None:
    """The tokenizer's pad id as transformers gives it: ``pad_token`` of tokenizer_config.json (or
    special_tokens_map.json) looked up in tokenizer.json; None when the tokenizer has no pad token."""
    path = Path(path)
    pad = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = path / name
        if pad is None and f.is_file():
            pad = json.loads(f.read_text()).get("pad_token")
    if isinstance(pad, dict):
        pad = pad.get("content")
    if pad is None:
        return None
    from tokenizers import Tokenizer

    pad_id = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(pad)
    if pad_id is None:
        raise UserError(f"{path / 'tokenizer_config.json'}: pad_token {pad!r} is not in tokenizer.json")
    return pad_id


def load_frozen_target(path: str | Path, dtype: str | torch.dtype = "float32",
                       device: str | torch.device = "cpu") -> tuple[nn.Module, int | None]:
    """``(FrozenTarget, pad_id)`` of the HF dir ``path``; a config.json this reader cannot complete goes through
    transformers (its config class and the full model), with the same result."""
    path = Path(path)
    check_target_dir(path)
    verify_target_weights(path)
    config = read_model_config(path)
    files = _weight_files(path)
    if config is None or EMBED not in files:
        model, tok = load_target(path, dtype=dtype, device=device)
        return model, tok.pad_token_id
    dt = resolve_dtype(dtype)
    embed = _read_tensor(files, EMBED, path).to(device=device, dtype=dt)  # [V, Ht]
    head = None if config.tie_word_embeddings else _read_tensor(files, LM_HEAD, path).to(device=device, dtype=dt)
    return FrozenTarget(config, embed, head).eval(), read_pad_token_id(path)
