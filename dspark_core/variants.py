"""Variants are params: ``variants.<name>`` holds overrides of the ``draft``, ``loss``, ``train`` and ``warm_start``
sections (``warm_start``: start from another variant's checkpoint; dvc.yaml's ``train_warm`` stage).

    variants:
      baseline: {}
      my_ablation: {draft: {markov_rank: 32}, train: {lr: 3.0e-4}}

``section_for_variant(params, "draft", name)`` is the ``draft`` section with that variant's overrides applied
(nested mappings merged key by key), ready for ``DraftConfig.from_dict``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dspark_core.config import ParamsError

VARIANT_SECTIONS = ("draft", "loss", "train", "warm_start")


def _read(params: str | Path) -> dict[str, Any]:
    path = Path(params)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found")
    return yaml.safe_load(path.read_text()) or {}


def variant_overrides(params: str | Path, name: str) -> dict[str, Any]:
    doc = _read(params)
    variants = doc.get("variants") or {}
    if name not in variants:
        raise ParamsError(f"{params}: variants.{name} is not defined (have: {', '.join(variants) or 'none'})")
    over = variants[name] or {}
    if not isinstance(over, dict):
        raise ParamsError(f"{params}: variants.{name} must be a mapping")
    bad = sorted(set(over) - set(VARIANT_SECTIONS))
    if bad:
        raise ParamsError(f"{params}: variants.{name}.{bad[0]} is not a section a variant may override "
                          f"({', '.join(VARIANT_SECTIONS)})")
    return over


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def section_for_variant(params: str | Path, section: str, name: str, optional: bool = False) -> dict[str, Any]:
    """``optional``: a section missing from the file is empty (its defaults)."""
    doc = _read(params)
    if section not in doc and not optional:
        raise ParamsError(f"{params}: section '{section}' is missing")
    return merge(doc.get(section) or {}, variant_overrides(params, name).get(section, {}))
