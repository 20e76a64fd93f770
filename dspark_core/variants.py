"""Variants are params: ``variants.<name>`` holds overrides of the ``draft``, ``loss``, ``train`` and ``warm_start``
sections (``warm_start``: start from another variant's checkpoint; dvc.yaml's ``train_warm`` stage).

    variants:
      baseline: {}
      my_ablation: {draft: {markov_rank: 32}, train: {lr: 3.0e-4}}

``section_for_variant(params, "draft", name)`` is the ``draft`` section with that variant's overrides applied
(nested mappings merged key by key), ready for ``DraftConfig.from_dict``.

``variant_dag`` tells dvc.yaml how to train them (a DVC foreach cannot filter a mapping): ``scratch`` (a list,
``train@<v>``) and ``warm`` (``{v: the variant it starts from}``, ``train_warm@<v>``, that run a dependency).
:func:`check_variant_dag` refuses a variant in neither or both, or a ``warm`` entry that disagrees with the
variant's ``warm_start.from_variant``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark_core.config import ParamsError, Section, read_yaml

VARIANT_SECTIONS = ("draft", "loss", "train", "warm_start")


def _read(params: str | Path) -> dict[str, Any]:
    path = Path(params)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found")
    return read_yaml(path)


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


def check_variant(params: str | Path, name: str) -> None:
    """Refuse a variant that the params file's ``variants`` does not define, naming the known ones (stages that
    only read a variant's trained draft; a params file without a ``variants`` section accepts any name)."""
    if "variants" in _read(params):
        variant_overrides(params, name)


def check_variant_dag(params: str | Path) -> None:
    doc = _read(params)
    if "variant_dag" not in doc:  # a params file without one (tests, old runs): nothing to check
        return
    variants, dag = doc.get("variants") or {}, doc.get("variant_dag") or {}
    scratch, warm = list(dag.get("scratch") or []), dict(dag.get("warm") or {})
    where = f"{params}: variant_dag"
    for name in sorted(set(scratch) | set(warm)):
        if name not in variants:
            raise ParamsError(f"{where} names {name!r}, which variants does not define")
    for name, over in variants.items():
        in_scratch, in_warm = name in scratch, name in warm
        if in_scratch == in_warm:
            raise ParamsError(f"{where}: variant {name!r} must be in exactly one of scratch / warm "
                              f"({'both' if in_scratch else 'neither'})")
        src = ((over or {}).get("warm_start") or {}).get("from_variant")
        if in_warm and warm[name] != src:
            raise ParamsError(f"{where}.warm.{name} is {warm[name]!r} but variants.{name}.warm_start.from_variant "
                              f"is {src!r}: they must agree (the DAG dependency is the checkpoint it loads)")
        if in_scratch and src is not None:
            raise ParamsError(f"{where}: {name!r} starts from {src!r} (warm_start) but is listed in scratch; "
                              f"move it to warm: {{{name}: {src}}}")


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def section_for_variant(params: str | Path, section: str, name: str, optional: bool = False,
                        cls: type[Section] | None = None) -> dict[str, Any]:
    """``optional``: a section missing from the file is empty (its defaults). ``cls``: the section's class, whose
    fields the variant's override keys are checked against first (an unknown key named
    ``variants.<name>.<section>.<key>``, where it is written)."""
    doc = _read(params)
    if section not in doc and not optional:
        raise ParamsError(f"{params}: section '{section}' is missing")
    over = variant_overrides(params, name).get(section) or {}
    if cls is not None and isinstance(over, dict):
        cls.check_keys(over, f"{params}: variants.{name}.{section}")
    return merge(doc.get(section) or {}, over)
