"""Does a change of numerics change what is learned? The same training run in two or more arms that differ only in
the settings under test, each scored on the held-out split.

    python benchmarks/bench_numerics.py --profile h200_smollm2 --steps 1000 --parallel \\
        --set regenerate.time_budget_s=30 --set train.hidden_states=online --set eval_offline.num_anchors=64 \\
        --arm default:train.attention_kernel=triton,train.optimizer_kernel=torch \\
        --arm fast:train.attention_kernel=flash,train.optimizer_kernel=triton \\
        --out reports/bench/h100/fast_kernels/numerics_fast_kernels.json

The params are params.yaml, the profile, the ``--set`` overrides, then ``train.max_steps = train.total_steps =
--steps`` on the steps schedule. The pipeline's own stages run them (``dspark_core.pipeline``, as ``dspark stages
run``) in ``--workdir`` (default: a new folder under the system temp dir; the repository's data/ is never touched):
once in ``shared/``, every stage ``eval_offline@baseline`` needs but ``train@baseline`` (target, prompts, answers,
cache, ...), then in ``arms/<name>/`` each arm's ``train@baseline`` and ``eval_offline@baseline`` on the shared data
(linked), from the same seed. So an arm may set ``train.``, ``loss.``, ``draft.`` and ``eval_offline.`` keys only.
``--parallel`` trains the arms at once (small drafts share one GPU); the same command again keeps the arms that
finished (``--max-arms`` spreads them over several calls).

Printed and written to ``--out`` (JSON) with the training-loss curves (``<out stem>.png``): held-out ``tau_prob``,
accept rates and block count from ``eval_offline``, the last logged training loss, the train stage's wall time, the
numerics settings of each arm, and each arm's differences from the first.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_core.errors import UserError  # noqa: E402
from dspark_core.io import atomic_path  # noqa: E402
from dspark_core.pipeline import load_stages, plan, run  # noqa: E402
from dspark_core.profiles import leaves, load_profile  # noqa: E402

ARM_SECTIONS = ("train", "loss", "draft", "eval_offline")  # what train@ / eval_offline@ read: no upstream rerun
LINKED = ("stages", "dvc.yaml", "profiles", "data/sources", "data/prompts_h200")  # the stages' own inputs
TARGETS = ("train@baseline", "eval_offline@baseline")
NUMERICS_KEYS = ("precision", "param_dtype", "master_dtype", "attention_kernel", "optimizer_kernel", "loss_kernel")
EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # 1e-4, 2.5E3: numbers however the YAML reads them
EVAL_JSON = Path("reports/eval_offline/baseline.json")  # an arm's held-out metrics, in its folder
EVAL_KEYS = ("tau_prob", *(f"accept_rate@{i}" for i in range(7)), "num_blocks")


def parse_value(key: str, text: str) -> Any:
    """``KEY=VALUE``'s value as YAML (``null``, numbers, lists), as ``dvc exp run -S`` reads it."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SystemExit(f"--set / --arm {key}={text}: not a YAML value ({e})") from None
    if isinstance(value, str) and EXPONENT.fullmatch(value):  # YAML 1.1 reads 2e-3 as a string, DVC's 1.2 a number
        return float(value)
    return value


def parse_sets(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: write KEY=VALUE (e.g. train.lr=1e-4)")
        out[key] = parse_value(key, text)
    return out


def parse_arm(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME:KEY=V,KEY=V`` (``NAME:`` alone: the settings as they are)."""
    name, sep, body = text.partition(":")
    if not sep or not name.replace("_", "").replace("-", "").isalnum():
        raise SystemExit(f"--arm {text!r}: write NAME:KEY=VALUE,KEY=VALUE (NAME of letters, digits, _ and -)")
    sets = parse_sets([s for s in body.split(",") if s])
    bad = [k for k in sets if k.split(".")[0] not in ARM_SECTIONS]
    if bad:
        raise SystemExit(f"--arm {name}: {', '.join(bad)} would change the data every arm shares; an arm sets "
                         f"only {', '.join(s + '.' for s in ARM_SECTIONS)} keys (put the rest in --set)")
    return name, sets


def set_key(params: dict, key: str, value: Any, where: str) -> None:
    """``params[a][b] = value`` for ``key`` ``a.b``; an unknown key is refused, naming ``where`` it came from."""
    *parents, last = key.split(".")
    cur = params
    for i, p in enumerate(parents):
        if not isinstance(cur.get(p), dict):
            raise SystemExit(f"{where}: {key}: params.yaml has no section {'.'.join(parents[:i + 1])}")
        cur = cur[p]
    if last not in cur:
        raise SystemExit(f"{where}: {key}: params.yaml has no such key")
    cur[last] = value


def build_params(base: Path, profile: str | None, sets: dict[str, Any], steps: int) -> dict:
    params = yaml.safe_load(base.read_text())
    if profile:
        for key, value in leaves(load_profile(profile)):
            set_key(params, key, value, f"profiles/{profile}.yaml")
    for key, value in sets.items():
        set_key(params, key, value, "--set")
    for key, value in {"max_steps": steps, "total_steps": steps, "lr_schedule": "steps", "time_budget_s": None}.items():
        params["train"][key] = value
    return params


def make_workdir(workdir: Path) -> None:
    """The stages' inputs linked from the checkout; everything a stage writes stays in ``workdir``."""
    for rel in LINKED:
        src, dst = ROOT / rel, workdir / rel
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src, target_is_directory=src.is_dir())


def read_curve(tsv: Path) -> list[tuple[int, float]]:
    if not tsv.is_file():
        return []
    with tsv.open() as fh:
        return [(int(r["step"]), float(r[tsv.stem])) for r in csv.DictReader(fh, delimiter="\t")]


def prepare_shared(workdir: Path, base: dict) -> dict[str, float]:
    """Every stage the arms need before ``train@baseline`` (target, prompts, answers, cache, ...), run once in
    ``workdir/shared`` (again only if the common settings changed)."""
    shared = workdir / "shared"
    make_workdir(shared)
    text = yaml.safe_dump(base, sort_keys=False)
    done = shared / "prepared.yaml"
    if done.is_file() and done.read_text() == text:
        print(f"=== shared stages: kept ({shared})", flush=True)
        return {}
    write_text(shared / "params.yaml", text)
    stages = load_stages(shared / "dvc.yaml", shared / "params.yaml")
    seconds = dict(run([s for s in plan(stages, TARGETS) if s.name not in TARGETS], params=shared / "params.yaml",
                       cwd=shared))
    write_text(done, text)
    return seconds


def arm_dir(workdir: Path, name: str) -> Path:
    """``arms/<name>``: the checkout's inputs and the shared stages' outputs linked, its own data/train and reports."""
    arm = workdir / "arms" / name
    make_workdir(arm)
    for entry in sorted((workdir / "shared" / "data").iterdir()):
        dst = arm / "data" / entry.name
        if entry.name != "train" and not dst.exists() and not dst.is_symlink():
            dst.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return arm


def run_arm(workdir: Path, params: dict, name: str) -> dict:
    """One arm: ``train@baseline`` and ``eval_offline@baseline`` on its params in ``arms/<name>``, then its row."""
    arm = arm_dir(workdir, name)
    write_text(arm / "params.yaml", yaml.safe_dump(params, sort_keys=False))
    stages = load_stages(arm / "dvc.yaml", arm / "params.yaml")
    t0 = time.perf_counter()
    seconds = dict(run([s for s in stages if s.name in TARGETS], params=arm / "params.yaml", cwd=arm))
    return {**arm_row(arm, name, seconds, time.perf_counter() - t0),
            "numerics": {k: params["train"].get(k) for k in NUMERICS_KEYS}}


def arm_row(arm: Path, name: str, seconds: dict[str, float], wall: float) -> dict:
    """An arm's report row from what its stages wrote in ``arm``."""
    evaluation = json.loads((arm / EVAL_JSON).read_text())
    train = json.loads((arm / "reports" / "train" / "baseline" / "metrics.json").read_text())
    loss = read_curve(arm / "reports" / "train" / "baseline" / "plots" / "metrics" / "train" / "loss.tsv")
    return {"arm": name, "held_out": {k: evaluation.get(k) for k in EVAL_KEYS},
            "train_loss_last": loss[-1][1] if loss else None, "train_step": train.get("step"),
            "train_stage_s": seconds.get("train@baseline"),
            "stages_s": seconds, "wall_s": round(wall, 1), "loss_curve": loss}


def add_differences(rows: list[dict]) -> None:
    ref = rows[0]
    for row in rows[1:]:
        a, b = row["held_out"].get("tau_prob"), ref["held_out"].get("tau_prob")
        row["tau_prob_minus_first"] = None if a is None or b is None else a - b
        la, lb = row["train_loss_last"], ref["train_loss_last"]
        row["train_loss_last_minus_first"] = None if la is None or lb is None else la - lb


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        if row["loss_curve"]:
            steps, values = zip(*row["loss_curve"])
            tau = row["held_out"].get("tau_prob")
            ax.plot(steps, values, label=f"{row['arm']} (held-out tau_prob {tau:.3f})" if tau else row["arm"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    print(f"{'arm':<16} {'tau_prob':>9} {'d tau':>8} {'loss':>8} {'train s':>8}")
    for row in rows:
        tau, d = row["held_out"].get("tau_prob"), row.get("tau_prob_minus_first")
        print(f"{row['arm']:<16} {tau if tau is not None else float('nan'):>9.4f} "
              f"{d if d is not None else 0.0:>+8.4f} {row['train_loss_last'] or float('nan'):>8.4f} "
              f"{row['train_stage_s'] or float('nan'):>8.1f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arm", action="append", required=True, help="NAME:KEY=VALUE,... (two or more; the first is "
                                                                 "the reference)")
    p.add_argument("--steps", type=int, default=1000, help="training steps of every arm (default 1000)")
    p.add_argument("--profile", default=None, help="a profiles/ name applied over --params first")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE for every arm (YAML value)")
    p.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    p.add_argument("--workdir", type=Path, default=None, help="where the stages run (default: a new temp folder)")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "bench" / "numerics.json")
    p.add_argument("--parallel", action="store_true",
                   help="train the arms at the same time (one GPU holds several small drafts; their times then "
                        "share it)")
    p.add_argument("--max-arms", type=int, default=None,
                   help="run at most this many arms now (the same command later keeps them and runs the rest)")
    args = p.parse_args(argv)
    arms = [parse_arm(a) for a in args.arm]
    if len(arms) < 2 or len({n for n, _ in arms}) != len(arms):
        raise SystemExit("--arm: give two or more arms with distinct names")
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: give a positive number of steps")
    base = build_params(args.params, args.profile, parse_sets(args.set), args.steps)
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="dspark-numerics-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir}", flush=True)
    done = finished_arms(args, workdir)
    kept = {name for name, sets in arms if (name, json.dumps(sets, sort_keys=True)) in done}
    for name in kept:
        print(f"=== arm {name}: kept from {args.out} ({workdir / 'arms' / name})")
    todo = [(name, sets) for name, sets in arms if name not in kept]
    if args.max_arms is not None:
        for name, _ in todo[args.max_arms:]:
            print(f"=== arm {name}: not run (--max-arms {args.max_arms}); the same command again runs it")
        todo = todo[:args.max_arms]
    shared_s = prepare_shared(workdir, base) if todo else {}
    rows = {name: done[name, json.dumps(sets, sort_keys=True)] for name, sets in arms if name in kept}
    failed = []

    def one(name: str, sets: dict[str, Any]) -> None:
        params = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
        for key, value in sets.items():
            set_key(params, key, value, f"--arm {name}")
        print(f"=== arm {name}: {sets or 'the settings as given'}", flush=True)
        try:
            rows[name] = {**run_arm(workdir, params, name), "sets": sets, "shared_stages_s": shared_s}
        except (UserError, subprocess.CalledProcessError, OSError, ValueError) as e:
            failed.append(f"arm {name}: {e}")
            return
        write(args, [rows[n] for n, _ in arms if n in rows], workdir)  # a crash or a later call keeps it

    with ThreadPoolExecutor(max_workers=max(1, len(todo)) if args.parallel else 1) as pool:
        list(pool.map(lambda arm: one(*arm), todo))
    rows = [rows[n] for n, _ in arms if n in rows]
    if failed:
        raise SystemExit("; ".join(failed) + f" (the finished arms are in {args.out})")
    if len(rows) < len(arms):
        print(f"wrote {args.out} ({len(rows)} of {len(arms)} arms)")
        return
    add_differences(rows)
    write(args, rows, workdir)
    plot(rows, args.out.with_suffix(".png"))
    print_table(rows)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def finished_arms(args, workdir: Path) -> dict[tuple[str, str], dict]:
    """The arms ``--out`` already holds from this workdir and these settings, keyed by (name, its settings)."""
    if not args.out.is_file():
        return {}
    old = json.loads(args.out.read_text())
    same = (old.get("workdir") == str(workdir) and old.get("steps") == args.steps
            and old.get("profile") == args.profile and old.get("set") == parse_sets(args.set))
    return {(r["arm"], json.dumps(r["sets"], sort_keys=True)): r for r in old.get("arms", [])
            if same and (workdir / "arms" / r["arm"] / EVAL_JSON).is_file()}


def write(args, rows: list[dict], workdir: Path) -> None:
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "steps": args.steps,
              "profile": args.profile, "set": parse_sets(args.set), "workdir": str(workdir),
              "device": device_name(), "arms": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text(args.out, json.dumps(report, indent=1) + "\n")


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # a bad profile name, params file or stage input: one line, no traceback
        raise SystemExit(f"error: {e}") from None
