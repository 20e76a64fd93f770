"""Draft Memory: the extra training cost per step against the baseline, on the project's own data.

Builds the ``baseline`` and ``draft_memory`` tasks of a params file (variant overrides applied) on ``data/target``
and ``data/cache/train.zarr``, the same weights where they overlap (same seed) and the same micro-batches, and
times one training step of each, alternating (ABAB..., so a busy machine slows both alike):
``prepare_step`` (Draft Memory's stage 1: no-grad forward, greedy search, transition) + forward + loss + backward
+ AdamW. ``step_s`` is the median over ``--steps`` steps after ``--warmup``; ``stage1_s`` the prepare share.

Memory (``--memory``): each kind runs in its own process; the peak resident set of the steps is read from
``/proc/self/status`` (VmHWM, reset through ``/proc/self/clear_refs`` before the steps) minus the resident set
before them. Also reported: stage 1's statistics (mean matches m, kept transitions, memory entries per block).

    PYTHONPATH=. python benchmarks/bench_memory_cost.py --params params.yaml --out /tmp/memory_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from dspark_core.train.trainer import _combine as combine_loss  # noqa: E402

KINDS = ("baseline", "draft_memory")


def build(params: Path, variant: str, seed: int):
    from dspark_core.draft.stage import CACHE_DIR, TARGET_DIR, variant_configs
    from dspark_core.draft.task import DSparkTask

    draft_cfg, loss_cfg, train_cfg = variant_configs(params, variant)
    task = DSparkTask.from_paths(draft_cfg, loss_cfg, TARGET_DIR, CACHE_DIR / "train.zarr")
    torch.manual_seed(seed)
    model = task.build_model(torch.device("cpu"), torch.float32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return task, model, opt, train_cfg.micro_batch_size


def batches(task, micro: int, n: int, seed: int) -> list[dict]:
    data = task.train_dataset()
    out = []
    for s in range(n):
        idx = [(s * micro + i) % len(data) for i in range(micro)]
        gens = [torch.Generator().manual_seed(seed + 1000 * s + i) for i in idx]
        out.append(task.collate([data[i] for i in idx], gens))
    return out


def step(task, model, opt, batch: dict) -> tuple[float, float, dict]:
    """One training step -> (seconds, stage-1 seconds, the prepared batch)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        (prepared,) = task.prepare_step(model, [batch])
    t1 = time.perf_counter()
    loss = combine_loss(task, task.forward_sums(model, prepared), task.denominators(prepared))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, t1 - t0, prepared


def stage1_stats(prepared: list[dict]) -> dict:
    m = torch.cat([b["stage1_matches"][b["stage1_matches"] >= 0] for b in prepared]).float()
    kept = sum(int(b["stage1_kept"].sum()) for b in prepared)
    mem = sum(int(b["memory_valid"].sum()) for b in prepared)
    return {"old_blocks": m.numel(), "mean_matches": m.mean().item(), "all_matched": (m == prepared[0]["slot_valid"]
            .shape[-1]).float().mean().item(), "kept_fraction": kept / max(m.numel(), 1),
            "memory_entries_per_kept_block": mem / max(kept, 1)}


def time_both(args) -> dict:
    built = {k: build(args.params, k, args.seed) for k in KINDS}
    data = batches(built["baseline"][0], built["baseline"][3], args.warmup + args.steps, args.seed)
    times = {k: [] for k in KINDS}
    stage1 = []
    prepared = []
    for i, batch in enumerate(data):
        for k in (KINDS if i % 2 == 0 else KINDS[::-1]):
            task, model, opt, _ = built[k]
            sec, s1, prep = step(task, model, opt, batch)
            if i >= args.warmup:
                times[k].append(sec)
                if k == "draft_memory":
                    stage1.append(s1)
                    prepared.append(prep)
    base, mem = statistics.median(times["baseline"]), statistics.median(times["draft_memory"])
    return {"baseline_step_s": base, "draft_memory_step_s": mem, "draft_memory_stage1_s": statistics.median(stage1),
            "time_ratio": mem / base, "steps": args.steps, "micro_batch_size": built["baseline"][3],
            "stage1": stage1_stats(prepared), "raw_s": times}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def memory_one(args, kind: str) -> dict:
    task, model, opt, micro = build(args.params, kind, args.seed)
    data = batches(task, micro, args.warmup + args.steps, args.seed)
    step(task, model, opt, data[0])  # optimizer state and allocator warm
    rss0 = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    for batch in data[1:]:
        step(task, model, opt, batch)
    return {"kind": kind, "rss_before_mib": rss0 / 2**20, "peak_mib": _status("VmHWM") / 2**20,
            "step_peak_increase_mib": (_status("VmHWM") - rss0) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--memory", action="store_true", help="also measure peak memory (one process per kind)")
    ap.add_argument("--memory-kind", choices=KINDS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_kind:
        print(json.dumps(memory_one(args, args.memory_kind)))
        return
    report = time_both(args)
    if args.memory:
        for kind in KINDS:
            cmd = [sys.executable, __file__, "--params", str(args.params), "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--seed", str(args.seed), "--threads", str(args.threads), "--memory-kind", kind]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            report[f"{kind}_memory"] = json.loads(out)
        report["memory_increase_ratio"] = (report["draft_memory_memory"]["step_peak_increase_mib"]
                                           / report["baseline_memory"]["step_peak_increase_mib"])
    print(json.dumps({k: v for k, v in report.items() if k != "raw_s"}, indent=1))
    if args.out:
        from dspark_core.io import write_json

        write_json(args.out, report)


if __name__ == "__main__":
    main()
