"""Plot of the multi-GPU training runs (``bench_ddp_train.py --summary`` JSON): the loss trajectory of each task
on 1 and W processes at the same global batch (left) and step time / scaling efficiency (right).

    python benchmarks/plot_multi_gpu.py    # reports/bench/multi_gpu_h200x2/ddp_train.json -> ddp_train.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_core.bench.plots import save_figure  # noqa: E402

DEFAULT = ROOT / "reports" / "bench" / "multi_gpu_h200x2" / "ddp_train.json"


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in summary["runs"]})
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.2 * (len(tasks) + 1), 3.6))
    for ax, task in zip(axes, tasks):
        for r in (r for r in summary["runs"] if r["task"] == task):
            ax.plot(range(1, len(r["loss"]) + 1), r["loss"], marker="o" if r["world_size"] == 1 else "x",
                    linestyle="-" if r["world_size"] == 1 else "--", label=f"{r['world_size']} GPU")
        g = next(r for r in summary["runs"] if r["task"] == task)
        ax.set_title(f"{task}: loss, global batch {g['global_batch']} x {g['length']} tokens", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    ax = axes[-1]
    rows = summary["rows"]
    labels = [f"{r['task']}\n{r['world_size']} GPU" for r in rows]
    ax.bar(range(len(rows)), [r["step_s"] for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, r["step_s"], f"eff {r['scaling_efficiency']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("step_s (median)")
    ax.set_title("step time, same global batch", fontsize=9)
    fig.tight_layout()
    save_figure(fig, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", type=Path, default=DEFAULT)
    ap.add_argument("--out", type=Path, default=None, help="default: ddp_train.png beside the summary")
    args = ap.parse_args()
    plot(json.loads(args.summary.read_text()), args.out or args.summary.with_suffix(".png"))


if __name__ == "__main__":
    main()
