"""Seed profiles: YAML overlays on params.yaml holding the seeds' own large-model settings.

    dspark profile list
    dspark profile apply seed004_qwen3_4b          # rewrite params.yaml in place (comments kept)
    dvc exp run $(dspark profile args seed004_qwen3_4b)   # or run it as a DVC experiment, params.yaml untouched

A profile is a nested mapping with the same sections as params.yaml; its leaves replace params.yaml's (a list,
such as ``prepare.train``, is one leaf). Every key must already exist in params.yaml (a typo is an error, not a
silent new key). A parameter whose value is a mapping of names (:data:`WHOLE_VALUES`: ``prepare.eval_sources``,
keyed by domain; ``regenerate.vllm``, vLLM's engine arguments; ``variants``) is one leaf, replaced whole: its keys
are data (a profile's ``variants`` are the only ones its DAG trains).

A profile stands alone: it names its target (``target.source`` and the model) or declares what it needs of one
(``target.requires``: layers, vocabulary, hidden size), so that ``dspark profile check`` gives the same answer
whatever target the workspace holds (:func:`names_target`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import yaml

from dspark_core.errors import UserError

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
# mappings of names, set whole: a profile's ``variants`` is its experiment's set of variants (names of its own,
# params.yaml's not kept), with the ``variant_dag.warm`` that goes with it
WHOLE_VALUES = frozenset({"prepare.eval_sources", "regenerate.vllm", "variants", "variant_dag.warm"})


def available(profiles_dir: Path = PROFILES_DIR) -> list[str]:
    return sorted(p.stem for p in profiles_dir.glob("*.yaml"))


def load_profile(name: str, profiles_dir: Path = PROFILES_DIR) -> dict[str, Any]:
    path = profiles_dir / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"profile {name!r} not found in {profiles_dir} (have: {', '.join(available(profiles_dir))})")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a profile must be a mapping of params.yaml sections")
    data.pop("description", None)
    return data


def names_target(profile: dict[str, Any]) -> bool:
    """Whether a profile names its target (``target.source``, ``model`` or ``path``), rather than keeping the
    workspace's."""
    target = profile.get("target")
    return isinstance(target, dict) and any(k in target for k in ("source", "model", "path"))


def leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in WHOLE_VALUES:
            yield from leaves(v, key + ".")
        else:
            yield key, v


def _check_keys(profile: dict[str, Any], params: dict[str, Any], src: str, params_name: str = "params.yaml") -> None:
    for key, _ in leaves(profile):
        cur: Any = params
        for part in key.split("."):
            if not isinstance(cur, dict) or part not in cur:
                raise UserError(f"{src}: profile key {key!r} does not exist in {params_name}")
            cur = cur[part]


def apply_profile(name: str, params_path: Path = Path("params.yaml"), profiles_dir: Path = PROFILES_DIR) -> list[str]:
    """Merge the profile into ``params_path`` keeping its comments; return the changed keys."""
    from ruamel.yaml import YAML

    from dspark_core.io import atomic_path

    from dspark_core.config import read_yaml

    prof = load_profile(name, profiles_dir)
    read_yaml(params_path)  # a missing file or a YAML error: one line naming it
    ry = YAML()
    ry.preserve_quotes = True
    doc = ry.load(params_path.read_text())
    _check_keys(prof, doc, str(profiles_dir / f"{name}.yaml"), str(params_path))
    changed = []
    for key, value in leaves(prof):
        *parents, last = key.split(".")
        cur = doc
        for p in parents:
            cur = cur[p]
        if cur[last] != value:
            _replace(cur, last, value)
            changed.append(key)
    with atomic_path(params_path, ".yaml") as tmp, tmp.open("w") as fh:
        ry.dump(doc, fh)
    return changed


def _replace(mapping: Any, key: str, value: Any) -> None:
    """``mapping[key] = value`` in a ruamel document. A list or mapping replacing one is written into the old
    object, which holds the line's end-of-line comment: a new object would drop it, and ruamel then joins the
    next key onto that line (a corrupt params.yaml)."""
    old = mapping[key]
    if isinstance(old, list) and isinstance(value, list) and hasattr(old, "ca"):
        del old[:]
        old.extend(value)
    elif isinstance(old, dict) and isinstance(value, dict) and hasattr(old, "ca"):
        for k in list(old):
            del old[k]
        old.update(value)
    else:
        mapping[key] = value


def exp_run_args(name: str, profiles_dir: Path = PROFILES_DIR) -> list[str]:
    """``-S key=value`` arguments for ``dvc exp run`` (scalars as YAML flow scalars; lists and mappings in Hydra's
    override grammar, which DVC parses ``-S`` with: a list replaces params.yaml's).

    A whole value (:data:`WHOLE_VALUES`) becomes ``-S ~key -S +key=VALUE``: DVC merges a mapping into the one in
    params.yaml, so it is deleted and added anew."""
    out = []
    for key, value in leaves(load_profile(name, profiles_dir)):
        if key in WHOLE_VALUES:
            out += ["-S", f"~{key}", "-S", f"+{key}={_hydra(value, key)}"]
            continue
        if isinstance(value, (list, dict)):
            out += ["-S", f"{key}={_hydra(value, key)}"]
            continue
        text = yaml.safe_dump(value, default_flow_style=True).strip()
        if text.endswith("\n..."):
            text = text[: -len("\n...")]
        text = text.removesuffix("...").strip().replace(", ", ",")  # one shell word per value
        out += ["-S", f"{key}={text}"]
    return out


def _hydra(value: Any, key: str) -> str:
    """``value`` in Hydra's override grammar: strings quoted, no spaces (one shell word)."""
    if isinstance(value, dict):
        bad = [k for k in value if not (isinstance(k, str) and re.fullmatch(r"[A-Za-z_]\w*", k))]
        if bad:
            raise UserError(f"{key}: key {bad[0]!r} cannot be written as a `dvc exp run -S` mapping key")
        return "{" + ",".join(f"{k}:{_hydra(v, key)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra(v, key) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)
