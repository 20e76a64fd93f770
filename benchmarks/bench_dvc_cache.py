"""What DVC adds to the cache stage -- its hashing and committing after the stage, and what it does before a rerun --
as a share of the store's build, on a store of ``--gb`` GB, through this repository's own cache stage (dvc.yaml)
and link type (.dvc/config) in a scratch git + DVC repo.

The target is a tiny random Qwen3 (width ``--hidden``, ``--layers`` layers, every layer but the last an aux layer)
whose forward is cheap, so the build runs about as fast as the store's writer allows on this machine: a real target's
forward makes the build longer and DVC's share smaller. The stage's command is wrapped by a timer
(``python timed.py python stages/cache.py``, nothing else changed), so each ``dvc repro`` splits into DVC's seconds
before the command (dependency hashes, removing the output's links), the command, and DVC's seconds after it
(hashing the output, linking it into its cache, dvc.lock).

Rows:

- ``build``: ``dvc repro cache`` in a fresh repo: the store is built in ``data/cache_stores`` and linked as the
  output; DVC hashes every file once and hard-links it into its cache.
- ``rerun``: after a code edit under dspark_core/cache, which reruns the stage: DVC deletes the output's links, the
  stage keeps the store and links it again, DVC finds every hash in its state database.
- ``baseline`` (``--baseline``, on by default): the layout without a home, the store persisted in place as the stage's
  output, in a second repo whose workspace holds the same files (hard links, no extra disk): ``dvc commit`` under
  DVC's default link type (reflink,copy: hash and copy into its cache, the store twice on disk), then, with
  ``cache.type hardlink,symlink``, ``dvc unprotect`` of the output -- what DVC does to a persisted output before
  every rerun (a copy of every file).

    python benchmarks/bench_dvc_cache.py --gb 10.5 --out reports/bench/dvc_cache_cpu.json   # hours on 2 busy CPUs
    python benchmarks/bench_dvc_cache.py --gb 0.2 --out /tmp/x.json                      # a quick look

The scratch repos live under ``--work`` (deleted at the end unless ``--keep``); the disk needs ``--gb`` free, twice
that with ``--baseline``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_core.cache.home import link_tree, tree_files  # noqa: E402
from dspark_core.cache.store import cache_bytes_per_token, human_bytes  # noqa: E402
from dspark_core.io import write_json  # noqa: E402
from dspark_core.target import write_fingerprint  # noqa: E402
from dspark_core.testing import cache_stage_repo, save_tiny_target, scratch_env, write_regen  # noqa: E402

TIMER = '''import json, subprocess, sys, time
t0 = time.time()
rc = subprocess.call(sys.argv[1:])
json.dump({"start": t0, "end": time.time()}, open("timing.json", "w"))
sys.exit(rc)
'''
RATIO = 0.686  # the store's share of its raw bytes (random-weight activations, Blosc zstd level 1; measured)


def run(cmd: list[str], cwd: Path) -> tuple[float, str]:
    t0 = time.time()
    res = subprocess.run(cmd, cwd=cwd, env=scratch_env(cwd), capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return time.time() - t0, res.stdout + res.stderr


def dvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def make_repo(repo: Path, args, stage: dict, target: Path, regen: Path, link_config: bool) -> None:
    """:func:`cache_stage_repo` with ``stage``, the timer and the cache params of ``args``."""
    params = {"cache": {"aux_layer_ids": list(range(args.layers - 1)), "max_length": args.max_length,
                        "chunk_tokens": args.chunk_tokens, "batch_tokens": args.batch_tokens, "clevel": 1,
                        "dtype": "float32", "device": "cpu", "splits": ["train"]},
              "train": {"hidden_states": "cache"}, "eval_offline": {"hidden_states": "cache"}}
    cache_stage_repo(repo, stage, target, regen, params, link_config)
    (repo / "timed.py").write_text(TIMER)


def split_times(t0: float, total: float, timing: dict) -> dict[str, float]:
    stage = timing["end"] - timing["start"]
    return {"total_s": total, "stage_s": stage, "dvc_before_s": timing["start"] - t0,
            "dvc_after_s": t0 + total - timing["end"]}


def timed_repro(repo: Path) -> dict[str, float]:
    t0 = time.time()
    total, out = run(dvc("repro", "cache"), repo)
    row = split_times(t0, total, json.loads((repo / "timing.json").read_text()))
    stats = json.loads((repo / "reports" / "cache_stats.json").read_text())["splits"]["train"]
    return {**row, "reused": stats["reused"], "compute_s": stats["compute_seconds"]}


def disk_bytes(*roots: Path) -> int:
    """Bytes of the distinct files (inodes) under ``roots``: what they hold on disk, hard links counted once."""
    seen: dict[tuple[int, int], int] = {}
    for root in roots:
        for f in root.rglob("*"):
            if f.is_file() and not f.is_symlink():
                st = f.stat()
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def baseline(work: Path, args, stage: dict, target: Path, regen: Path, home: Path) -> dict[str, float]:
    """The store persisted in place as the output (no home), in a repo whose workspace holds it as hard links:
    ``dvc commit`` under DVC's default link type, then ``dvc unprotect`` under hardlink,symlink."""
    old = {**stage, "outs": [{"data/cache": {"persist": True}}, *stage["outs"][1:]]}
    repo = work / "baseline"
    make_repo(repo, args, old, target, regen, link_config=False)
    link_tree(tree_files(home), repo / "data" / "cache" / "train.zarr")
    (repo / "reports").mkdir()
    shutil.copy(work / "repo" / "reports" / "cache_stats.json", repo / "reports" / "cache_stats.json")
    commit_s, _ = run(dvc("commit", "-f", "cache"), repo)
    copies = disk_bytes(repo / "data" / "cache", repo / ".dvc" / "cache") / disk_bytes(home)
    shutil.rmtree(repo / ".dvc" / "cache")
    (repo / "dvc.lock").unlink()
    run(dvc("config", "cache.type", "hardlink,symlink"), repo)
    run(dvc("commit", "-f", "cache"), repo)
    unprotect_s, _ = run(dvc("unprotect", "data/cache"), repo)
    shutil.rmtree(repo)
    return {"copy_commit_s": commit_s, "copy_layout_copies": copies, "hardlink_unprotect_s": unprotect_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=10.5, help="the store's size on disk (compressed), about")
    p.add_argument("--hidden", type=int, default=256, help="the target's width (narrow: a cheap forward)")
    p.add_argument("--layers", type=int, default=16, help="target layers; all but the last are aux layers")
    p.add_argument("--max-length", type=int, default=512, help="tokens a sample (every sample has this many)")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/dspark_dvc_cache"))
    p.add_argument("--keep", action="store_true", help="keep the scratch repos")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    per_token = cache_bytes_per_token(args.hidden, args.layers - 1, "bf16")
    samples = max(1, round(args.gb * 1e9 / (per_token * RATIO * args.max_length)))
    target = save_tiny_target(args.work / "target", "qwen3", hidden_size=args.hidden, num_hidden_layers=args.layers,
                              intermediate_size=args.hidden // 4, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=args.hidden // 8)
    write_fingerprint(target)
    regen = write_regen(args.work / "train.parquet", [(64, args.max_length - 64)] * samples)
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["cache"]
    stage = {**stage, "cmd": f"python timed.py {stage['cmd']}"}
    repo = args.work / "repo"
    make_repo(repo, args, stage, target, regen, link_config=True)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "scratch"], repo)
    print(f"building a store of ~{args.gb:g} GB: {samples:,} samples of {args.max_length} tokens, hidden "
          f"{args.hidden} x {args.layers - 1} aux layers + the last ({per_token:,} bytes a token raw)", flush=True)
    load = {"start": os.getloadavg()}  # other jobs on the machine slow the build and DVC alike
    rows = {"build": timed_repro(repo)}
    home = repo / "data" / "cache_stores" / "train.zarr"
    store = {"bytes": disk_bytes(home), "files": len(tree_files(home)), "tokens": samples * args.max_length}
    store["copies_on_disk"] = disk_bytes(repo / "data" / "cache", home.parent, repo / ".dvc" / "cache") / store["bytes"]
    with (repo / "dspark_core" / "cache" / "verify.py").open("a") as fh:
        fh.write("# a code edit: DVC reruns the stage\n")
    rows["rerun"] = timed_repro(repo)
    assert rows["rerun"]["reused"], "the rerun rebuilt the store"
    base = baseline(args.work, args, stage, target, regen, home) if args.baseline else None
    load["end"] = os.getloadavg()
    build_s = rows["build"]["stage_s"]
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
           "hardware": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                        "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                        "dvc": run(dvc("--version"), args.work)[1].strip(), "load_average": load},
           "config": {k: getattr(args, k) for k in ("gb", "hidden", "layers", "max_length", "chunk_tokens",
                                                     "batch_tokens")},
           "store": store, "rows": rows,
           "share_of_build": {k: r["dvc_after_s"] / build_s for k, r in rows.items()},
           "baseline": base and {**base, "copy_commit_share": base["copy_commit_s"] / build_s,
                                 "hardlink_unprotect_share": base["hardlink_unprotect_s"] / build_s}}
    write_json(args.out, out)
    print(f"store: {human_bytes(store['bytes'])} in {store['files']:,} files, {store['tokens']:,} tokens; on disk "
          f"{store['copies_on_disk']:.2f}x (home, output and DVC's cache: one inode a file)")
    print(f"{'':>34} {'stage s':>9} {'DVC before s':>13} {'DVC after s':>12} {'after / build':>14}")
    for name, r in rows.items():
        print(f"{name:>34} {r['stage_s']:9.1f} {r['dvc_before_s']:13.1f} {r['dvc_after_s']:12.1f} "
              f"{r['dvc_after_s'] / build_s:14.2%}")
    if base:
        print(f"{'persisted, reflink,copy: commit':>34} {'':>9} {'':>13} {base['copy_commit_s']:12.1f} "
              f"{base['copy_commit_s'] / build_s:14.2%}  (the store {base['copy_layout_copies']:.2f}x on disk)")
        print(f"{'persisted, hardlink: unprotect':>34} {'':>9} {base['hardlink_unprotect_s']:13.1f} {'':>12} "
              f"{base['hardlink_unprotect_s'] / build_s:14.2%}  (before every rerun)")
    if not args.keep:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
