"""Run a training stage end to end: stale-checkpoint check, dvclive, the trainer, export, final metrics.

Without dvclive installed (a GPU machine with no DVC), :class:`JsonLive` stands in for ``dvclive.Live``
after a one-line warning: the same ``metrics.json`` summary and ``plots/metrics/<name>.tsv`` curves under
the report dir, plus ``params.json`` (no DVC experiment, no dvc.yaml / report files).

Shared by ``stages/train.py`` (DSpark variants) and ``stages/dmtd_train.py`` (DMTD variants).

The stage's output folder is DVC-``persist``ed so a killed run resumes from its last checkpoint.
``run_config.json`` records what the checkpoints belong to: the run's configuration (params + input fingerprints)
and, apart from it, the code (a hash of ``dspark_core``'s sources). A rerun whose configuration matches resumes from
the last checkpoint; when only the code differs it says so in one line ("the code changed since step N") and
resumes (``train.resume: continue``), or refuses (``strict``); the code changes are listed beside the output, in
``<out_dir's parent>/.previous/<name>.code_changes.json`` (outside the DVC output: a resumed run's output hashes as a
fresh run's under the same code, so a fresh clone's ``dvc repro`` matches dvc.lock). A rerun whose configuration differs (DVC reruns the stage after a params change) starts over,
after moving the older output -- checkpoints, run_config.json, and a copy of its curves -- to
``<out_dir's parent>/.previous/<name>-<time>-step<N>/``: outside every DVC output (the stage never rewrites it, DVC
never commits it), git-ignored by a ``.gitignore`` of its own, deleted by nothing. A run that fails before its first
checkpoint (bad data, a bad setting found in the first step) removes the output folder and a report folder it
created: nothing half-written is left where the stage's outputs go.

Under several processes, on one host or several (``nnodes``), global rank 0 alone reads and writes the outputs:
``run_config.json``, checkpoints, ``final/`` and the report folder (curves, ``metrics.json``; the stage's
``model.json``). The other ranks write nothing and read no output (a resumed run's state reaches them by
broadcast, ``TrainRun._resume``), so the other hosts need the stage's inputs only; their processes must agree with
rank 0 on the run configuration (checked before anything is written).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dspark_core.checkpoint import verify_latest_checkpoint
from dspark_core.dist import Dist, on_main
from dspark_core.errors import UserError
from dspark_core.io import atomic_path, git_ignored_dir, read_json, sha256_json, write_json
from dspark_core.train.trainer import TrainConfig, TrainResult, TrainRun


PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the dspark_core package whose sources code_fingerprint hashes
MOVED_ASIDE = ".previous"  # a run whose configuration changed goes to <out_dir's parent>/.previous/ (never deleted)


def code_fingerprint() -> str:
    """sha256 over the path and contents of every ``.py`` file of the ``dspark_core`` package."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _prepare_out_dir(out_dir: Path, run_config: dict[str, Any], code: str, cfg: TrainConfig | None = None,
                     report_dir: Path | None = None) -> bool:
    """Return True when checkpoints of this configuration exist (resume). Same configuration, other code: resume
    saying so, or refuse (``cfg.resume`` strict). Another configuration: the older output is moved aside
    (:func:`move_aside`, with a copy of ``report_dir``'s curves) and the run starts over."""
    rc = out_dir / "run_config.json"
    try:
        old = read_json(rc) if rc.is_file() else {}
    except UserError as e:
        raise UserError(f"{e}; it records which configuration the checkpoints beside it belong to: move {out_dir} "
                        "aside (or delete it) to start over") from None
    before = dict(old.get("config") or {})
    old_code = old.get("code", before.pop("code", None))  # an older run_config.json kept it inside the config
    step, record = _checkpoint_step(out_dir), {"hash": sha256_json(run_config), "config": run_config, "code": code}
    if old and sha256_json(before) == record["hash"]:
        if step:  # a damaged checkpoint is refused before anything is written
            verify_latest_checkpoint(out_dir / "checkpoints")
        if step and old_code != code:
            _code_changed(out_dir, step, cfg or TrainConfig())
            log_code_change(out_dir, {"step": step, "from": old_code, "to": code})
        if old != record:
            write_json(rc, record)
        return step > 0
    if out_dir.exists() and any(out_dir.iterdir()):
        changed = changed_keys(before, json_plain(run_config)) or ["configuration"]
        dest = move_aside(out_dir, step, report_dir)
        print(f"{out_dir}: {', '.join(changed)} changed since the last run; its output (checkpoints up to step "
              f"{step}) moved to {dest}, where nothing deletes it (delete it yourself when done); starting over")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(rc, record)
    return False


def code_changes_path(out_dir: Path) -> Path:
    """Where the code changes a run resumed across are listed: ``<parent>/.previous/<name>.code_changes.json``,
    outside the DVC output, so a resumed run's output is byte for byte a fresh run's under the same code."""
    return out_dir.parent / MOVED_ASIDE / f"{out_dir.name}.code_changes.json"


def log_code_change(out_dir: Path, change: dict[str, Any]) -> None:
    """Append ``change`` (step, from, to) to :func:`code_changes_path`'s list."""
    path = code_changes_path(out_dir)
    git_ignored_dir(path.parent)
    changes = read_json(path) if path.is_file() else []
    write_json(path, changes + [change])


def _code_changed(out_dir: Path, step: int, cfg: TrainConfig) -> None:
    """The one line of a resume whose code differs from the code that wrote the checkpoints (or its refusal)."""
    if cfg.resume == "strict":
        raise UserError(f"{out_dir}: the code (dspark_core) changed since step {step}, and resume is strict (train / "
                        f"dmtd_train): set resume: continue to resume from step {step} under this code, or move "
                        f"{out_dir} aside to start over")
    done = f"; the run is complete at step {step}, so nothing is trained (move {out_dir} aside to train it again " \
        "under this code)" if step >= cfg.stop_step else ""
    print(f"{out_dir}: the code changed since step {step}; resuming from step {step}'s checkpoint (resume: "
          f"continue; strict refuses){done}")


def json_plain(obj: Any) -> Any:
    """``obj`` as JSON gives it back (tuples as lists, paths as strings): how run_config.json holds it."""
    import json

    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def changed_keys(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested dicts (``train.lr``), sorted."""
    out = []
    for k in sorted(set(before) | set(after)):
        a, b = before.get(k), after.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def move_aside(out_dir: Path, step: int, report_dir: Path | None = None) -> Path:
    """Move ``out_dir`` to ``<parent>/.previous/<name>-<time>-step<step>`` (with a copy of ``report_dir`` as
    ``report/``) and return the new path. The folder holds a ``.gitignore`` of ``*``: git ignores it, and it lies
    outside every DVC output (a sibling of the stage's), so neither DVC nor a stage ever rewrites or commits it."""
    import time

    attic = git_ignored_dir(out_dir.parent / MOVED_ASIDE)
    stem = f"{out_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}-step{step}"
    dest, n = attic / stem, 1
    while dest.exists():
        dest, n = attic / f"{stem}.{n}", n + 1
    out_dir.rename(dest)
    if report_dir is not None and report_dir.is_dir():  # the curves: the new run starts them over
        shutil.copytree(report_dir, dest / "report")
    return dest


class JsonLive:
    """The part of ``dvclive.Live`` the trainer uses: ``step``, ``log_params``, ``log_metric``, ``make_summary``,
    ``end``. Writes ``<dir>/metrics.json`` ({"step": n, <nested metrics>}) and ``<dir>/plots/metrics/<name>.tsv``
    (``step<TAB>name`` rows, appended; a fresh, non-resumed run starts them over)."""

    def __init__(self, dir: str, resume: bool = False, **_: Any) -> None:
        self.dir = Path(dir)
        self.step = 0
        self._latest: dict[str, float] = {}
        self._plots = self.dir / "plots" / "metrics"
        if not resume and self._plots.exists():
            shutil.rmtree(self._plots)
        self._plots.mkdir(parents=True, exist_ok=True)

    def log_params(self, params: dict[str, Any]) -> None:
        write_json(self.dir / "params.json", params)

    def log_metric(self, name: str, value: float) -> None:
        self._latest[name] = float(value)
        path = self._plots / f"{name}.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.is_file()
        with path.open("a") as fh:
            if new:
                fh.write(f"step\t{Path(name).name}\n")
            fh.write(f"{self.step}\t{float(value)!r}\n")

    def make_summary(self) -> None:
        summary: dict[str, Any] = {"step": self.step}
        for name, value in self._latest.items():
            cur = summary
            *parents, leaf = name.split("/")
            for p in parents:
                cur = cur.setdefault(p, {})
            cur[leaf] = value
        write_json(self.dir / "metrics.json", summary)

    def end(self) -> None:
        self.make_summary()


def _live_class() -> Any:
    try:
        from dvclive import Live
    except ImportError:
        print("warning: dvclive is not installed; training metrics go to metrics.json + plots/metrics/*.tsv "
              "under the report dir (no DVC experiment tracking)")
        return JsonLive
    return Live


def run_training(task: Any, cfg: TrainConfig, run_config: dict[str, Any], report_dir: str | Path,
                 time_budget_s: float | None = None, log_step_offset: int = 0) -> TrainResult:
    """Train ``task`` into ``cfg.out_dir`` (checkpoints + ``final/``), curves and metrics into ``report_dir``.
    ``time_budget_s``, ``log_step_offset``: see :func:`dspark_core.train.trainer.train`."""
    from dspark_core.train.trainer import init_distributed

    out_dir, report_dir = Path(cfg.out_dir), Path(report_dir)
    code = code_fingerprint()
    d = init_distributed()
    # settings that need the target (a vocabulary, a head count, the batch arithmetic) fail here, before an
    # older run's outputs are moved aside
    run = TrainRun(task, cfg, time_budget_s=time_budget_s)
    _check_same_run(d, {**run_config, "code": code})  # before rank 0 moves an older run's outputs aside
    made = [_new_root(out_dir) or out_dir, _new_root(report_dir)]  # what a failed fresh run removes again
    # global rank 0 alone reads and writes the outputs (the other hosts need not hold them)
    # a damaged checkpoint is refused there, before run_config.json, the curves or the report folder are touched
    resume = on_main(d, lambda: _prepare_out_dir(out_dir, run_config, code, cfg, report_dir))
    try:
        return _run(run, run_config, out_dir, report_dir, resume, log_step_offset)
    except BaseException:
        if d.is_main and not (out_dir / "checkpoints" / "latest.json").is_file():
            # Failed before its first checkpoint: the output folder holds only run_config.json (and perhaps an
            # unfinished checkpoint temp dir), a report folder it created only the params / first curves.
            # Nothing there could be resumed, so the stage's outputs go as if it never ran.
            for path in made:
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
        raise


def _check_same_run(d: Dist, run_config: dict[str, Any]) -> None:
    """Refuse, on every rank, a run whose processes disagree on what they train: each host reads its own copy of
    the inputs, params and code, and a host whose target, cache, params or code differ from node 0's would train
    silently wrong steps. Names the first rank that differs and its differing keys of the run configuration."""
    if d.world_size == 1:
        return
    import torch.distributed as dist

    every: list[Any] = [None] * d.world_size
    dist.all_gather_object(every, run_config)
    for rank, other in enumerate(every):
        changed = sorted(k for k in set(other) | set(every[0]) if other.get(k) != every[0].get(k))
        if changed:
            raise UserError(f"train: global rank {rank} differs from global rank 0 in {', '.join(changed)} (each "
                            "host reads its own copy): give every node node 0's code and params (the same git "
                            "commit) and inputs (`dvc pull` of the stage's deps), then rerun")


def _checkpoint_step(out_dir: Path) -> int:
    latest = out_dir / "checkpoints" / "latest.json"
    return int(read_json(latest)["step"]) if latest.is_file() else 0


def trim_curves(plots_dir: Path, last_step: int) -> None:
    """Drop the rows after ``last_step`` from every curve (TSV with a ``step`` column, dvclive's or
    :class:`JsonLive`'s) under ``plots_dir``: a run killed after logging steps it had not checkpointed
    resumes at the checkpoint and logs them again. The report folder is DVC-``persist``ed, so a resumed run's
    curves continue the killed run's."""
    import csv

    for path in sorted(plots_dir.rglob("*.tsv")) if plots_dir.is_dir() else []:
        rows = list(csv.reader(path.read_text().splitlines(), delimiter="\t"))
        if not rows or "step" not in rows[0]:
            continue
        col = rows[0].index("step")
        keep = [rows[0]] + [r for r in rows[1:] if len(r) > col and int(float(r[col])) <= last_step]
        if len(keep) < len(rows):
            with atomic_path(path, ".tmp") as tmp:
                tmp.write_text("".join("\t".join(r) + "\n" for r in keep))


def _new_root(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (None when ``path`` exists)."""
    if path.exists():
        return None
    root = path
    for parent in path.parents:
        if parent.exists():
            break
        root = parent
    return root


def _run(run: TrainRun, run_config: dict[str, Any], out_dir: Path, report_dir: Path, resume: bool,
         log_step_offset: int) -> TrainResult:
    task, d = run.task, run.d
    if d.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
    live = None
    if d.is_main:
        if resume:  # curves past the checkpoint are logged again by the resumed steps
            trim_curves(report_dir / "plots" / "metrics", _checkpoint_step(out_dir) + log_step_offset)
        live = _live_class()(dir=str(report_dir), resume=resume, save_dvc_exp=False, dvcyaml=None, report=None)
        live.log_params({"run_config_hash": sha256_json(run_config)})
    result = run.loop(live=live, log_step_offset=log_step_offset)
    if d.is_main and hasattr(task, "export"):  # DMTD: the last checkpoint is the model
        task.export(result.model, out_dir / "final")
        if live is not None:
            live.end()
    return result
