"""dvc.yaml without DVC: the stage commands, expanded and ordered as ``dvc repro`` runs them.

For a machine where DVC cannot be installed (e.g. a GPU machine with no package index): ``dspark stages list`` prints
each stage's command, ``dspark stages run TARGET...`` runs TARGET and every stage it depends on, in DAG order,
with exactly the command dvc.yaml gives (no cache, no lock: the stages resume their own persisted outputs).
Where DVC is installed, use ``dvc repro``: it is the same commands, recorded in dvc.lock.

Understood of dvc.yaml: ``stages`` with ``cmd``, ``deps``, ``outs`` / ``metrics`` / ``plots`` (a path or a
one-key mapping), ``foreach`` over a params dict (``${key}``, ``${item.a.b}``) or list (``${item}``), and
``${section.key}`` params in commands and paths.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dspark_core.config import read_yaml
from dspark_core.errors import EXIT_USER_ERROR, UserError

_VAR = re.compile(r"\$\{\s*([^}]+?)\s*\}")


@dataclass(frozen=True)
class Stage:
    name: str                          # "train@baseline" for foreach stages, as DVC names them
    cmd: str
    deps: tuple[str, ...] = ()
    outs: tuple[str, ...] = field(default=())


def _lookup(ctx: dict[str, Any], dotted: str, where: str) -> Any:
    cur: Any = ctx
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise UserError(f"dvc.yaml {where}: ${{{dotted}}} is not defined (params.yaml or foreach)")
        cur = cur[part]
    return cur


def _interp(value: Any, ctx: dict[str, Any], where: str) -> Any:
    if isinstance(value, str):
        whole = _VAR.fullmatch(value.strip())
        if whole:
            return _lookup(ctx, whole.group(1), where)
        return _VAR.sub(lambda m: str(_lookup(ctx, m.group(1), where)), value)
    if isinstance(value, list):
        return [_interp(v, ctx, where) for v in value]
    if isinstance(value, dict):
        return {_interp(k, ctx, where): _interp(v, ctx, where) for k, v in value.items()}
    return value


def _paths(entries: Any) -> tuple[str, ...]:
    out = []
    for e in entries or []:
        out.append(next(iter(e)) if isinstance(e, dict) else str(e))
    return tuple(out)


def _stage(name: str, body: dict[str, Any]) -> Stage:
    if "cmd" not in body:
        raise UserError(f"dvc.yaml stage {name}: no cmd")
    outs = _paths(body.get("outs")) + _paths(body.get("metrics")) + _paths(body.get("plots"))
    return Stage(name, str(body["cmd"]), _paths(body.get("deps")), outs)


def load_stages(dvc_yaml: str | Path = "dvc.yaml", params: str | Path = "params.yaml") -> list[Stage]:
    """Every stage of ``dvc_yaml`` (foreach expanded), in file order."""
    doc, ctx = read_yaml(dvc_yaml), read_yaml(params)
    stages = []
    for name, body in (doc.get("stages") or {}).items():
        if "foreach" not in body:
            stages.append(_stage(name, _interp(body, ctx, name)))
            continue
        items = _interp(body["foreach"], ctx, f"{name}.foreach")
        pairs = items.items() if isinstance(items, dict) else ((str(i), i) for i in items)
        for key, item in pairs:
            stages.append(_stage(f"{name}@{key}", _interp(body["do"], {**ctx, "key": key, "item": item}, name)))
    return stages


def _produces(out: str, dep: str) -> bool:
    """An out feeds a dep when one path contains the other (``data/cache`` feeds ``data/cache/train.zarr``)."""
    a, b = Path(out).parts, Path(dep).parts
    return a[: len(b)] == b or b[: len(a)] == a


def plan(stages: Sequence[Stage], targets: Sequence[str] = ()) -> list[Stage]:
    """``targets`` (names; empty: all) and their ancestors, each after the stages whose outs it depends on."""
    by_name = {s.name: s for s in stages}
    unknown = [t for t in targets if t not in by_name]
    if unknown:
        raise UserError(f"unknown stage(s) {unknown}; dvc.yaml has: {', '.join(by_name)}")
    parents = {s.name: [p.name for p in stages if p is not s and any(_produces(o, d) for o in p.outs
                                                                    for d in s.deps)] for s in stages}
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(n: str, chain: tuple[str, ...]) -> None:
        if state.get(n) == "done":
            return
        if state.get(n) == "open":
            raise UserError(f"dvc.yaml: dependency cycle {' -> '.join(chain + (n,))}")
        state[n] = "open"
        for p in parents[n]:
            visit(p, chain + (n,))
        state[n] = "done"
        order.append(n)

    for t in targets or [s.name for s in stages]:
        visit(t, ())
    return [by_name[n] for n in order]


def run(stages: Sequence[Stage], params: str | Path = "params.yaml", cwd: str | Path = ".",
        dry: bool = False) -> list[tuple[str, float]]:
    """Run each stage's command in ``cwd`` (``python`` is this interpreter); ``--params`` is added when
    ``params`` is not ``params.yaml``. Stops at the first failure (a user error: ``UserError``, else
    ``CalledProcessError``). Returns wall times."""
    times = []
    for i, s in enumerate(stages, 1):
        argv = shlex.split(s.cmd)
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        if Path(params).name != "params.yaml" or Path(params).parent != Path("."):
            argv += ["--params", str(params)]
        print(f"=== stage {i}/{len(stages)} {s.name}: {shlex.join(argv)}", flush=True)
        if dry:
            continue
        t = time.perf_counter()
        rc = subprocess.run(argv, cwd=cwd).returncode
        if rc == EXIT_USER_ERROR:  # the stage has printed what to fix
            raise UserError(f"stage {s.name} stopped on the error above (exit status {rc})")
        if rc:
            raise subprocess.CalledProcessError(rc, argv)
        times.append((s.name, round(time.perf_counter() - t, 1)))
        print(f"=== stage {s.name} done in {times[-1][1]} s", flush=True)
    return times
