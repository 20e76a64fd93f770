"""The target model: resolve it into a plain HF dir, fingerprint it, load it.

(The `target` stage's GGUF conversion is added here by the data-stages work.)

Public API used across the project:
- ``load_target(path, dtype="float32", device="cpu") -> (model, tokenizer)``
- ``read_fingerprint(path) -> dict`` with keys ``config_sha256``, ``weights_sha256``, ``fingerprint``
- ``compute_fingerprint(path) -> dict`` (hash of config.json's model fields + every safetensors file)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_core.io import read_json, sha256_file, sha256_json, write_json

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
FINGERPRINT_FILE = "fingerprint.json"
# config.json keys that do not change the function the model computes
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures")


def _check_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a Hugging Face model directory (no config.json)")
    cfg = json.loads((path / "config.json").read_text())
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path / 'config.json'}: model_type {mt!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def compute_fingerprint(path: str | Path) -> dict[str, str]:
    path = Path(path)
    _check_dir(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{path}: no *.safetensors weights found")
    w_hash = sha256_json({w.name: sha256_file(w) for w in weights})
    c_hash = sha256_json(cfg)
    return {"config_sha256": c_hash, "weights_sha256": w_hash, "fingerprint": sha256_json([c_hash, w_hash])[:16]}


def write_fingerprint(path: str | Path) -> dict[str, str]:
    fp = compute_fingerprint(path)
    write_json(Path(path) / FINGERPRINT_FILE, fp)
    return fp


def read_fingerprint(path: str | Path) -> dict[str, str]:
    """The stored fingerprint, or a freshly computed one when the dir has none."""
    f = Path(path) / FINGERPRINT_FILE
    return read_json(f) if f.is_file() else compute_fingerprint(path)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype must be one of {', '.join(table)}; got {name!r}")
    return table[name]


def load_target(path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                attn_implementation: str = "sdpa"):
    """Load a local HF dir (Qwen3 / Qwen2 / Llama) as ``(model.eval(), tokenizer)``. Never touches a hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    _check_dir(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype), local_files_only=True, attn_implementation=attn_implementation
    ).to(device)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tok
