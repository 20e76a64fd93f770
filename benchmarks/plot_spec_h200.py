"""Plot one ``bench_online`` run over the four domains: tokens/s per domain, AR in each small-GEMM mode beside
speculative decoding (and, optionally, a draft-tree run of the same prompts), each bar labelled with its speedup
over the fastest AR and its MAL, greedy and at each sampling temperature of the run.

    python benchmarks/plot_spec_h200.py        # reports/bench/spec_h200_smollm2/bench_online_baseline.json
                                               #   -> reports/bench/spec_h200_smollm2/domains.png
    python benchmarks/plot_spec_h200.py reports/bench_online/baseline.json --out domains.png \
        --tree reports/bench_online_tree/baseline.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_core.bench.plots import save_figure  # noqa: E402

DEFAULT = ROOT / "reports" / "bench" / "spec_h200_smollm2" / "bench_online_baseline.json"
TITLE = ("SmolLM2-135M-Instruct, batch 1, bf16, held-out prompts of four domains; labels: speedup over the fastest "
         "AR, MAL\n(greedy; at each sampling temperature with its speedup over the fastest sampled AR)")


def plot_domains(bench: dict, out: Path, title: str, tree: dict | None = None) -> None:
    """Per domain: AR tokens/s in each small-GEMM mode and speculative (greedy) tokens/s, annotated with the speedup
    over the fastest AR and the MAL (greedy, and at each sampling temperature of the run); ``tree``: a greedy
    draft-tree run of the same prompts (``bench_online_tree_<variant>.json``), one more bar, annotated alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in bench if n not in ("setup", "overall")] + ["overall"]
    modes = sorted(bench["overall"].get("ar_tokens_per_s_by_mode") or {"ar": None})
    width = 0.8 / (len(modes) + 1 + (tree is not None))
    fig, ax = plt.subplots(figsize=(13 if tree is not None else 9, 3.8))
    for j, mode in enumerate(modes):
        ar = [(bench[n].get("ar_tokens_per_s_by_mode") or {}).get(mode, bench[n]["ar_tokens_per_s"]) for n in names]
        ax.bar([i + (j - len(modes) / 2) * width for i in range(len(names))], ar, width, label=f"AR ({mode})")
    spec = [bench[n]["tokens_per_s"] for n in names]
    xs = [i + (len(modes) - len(modes) / 2) * width for i in range(len(names))]
    ax.bar(xs, spec, width, label=f"speculative ({bench['setup'].get('small_gemm', '')}, greedy)")
    for x, n, t in zip(xs, names, spec):
        temps = (bench[n].get("at_temperature") or {}).items()
        hot = "".join(f"\nT{k} MAL {v['mal']:.2f} {_gain(v)}" for k, v in temps)
        gain = bench[n].get("speedup_vs_fastest_ar", bench[n]["speedup"])
        ax.text(x + width / 2 if tree is not None else x, t, f"{gain:.2f}x\nMAL {bench[n]['mal']:.2f}{hot}",
                ha="right" if tree is not None else "center", va="bottom", fontsize=7)  # a tree bar to the right
    if tree is not None:
        branches = ",".join(f"{a}:{b}" for a, b in tree["setup"].get("tree_branches") or [])
        xt = [x + width for x in xs]
        spec_tree = [tree[n]["tokens_per_s"] for n in names]
        ax.bar(xt, spec_tree, width, label=f"speculative tree {branches} (greedy)")
        for x, n, t in zip(xt, names, spec_tree):
            gain = tree[n].get("speedup_vs_fastest_ar", tree[n]["speedup"])
            ax.text(x, 0.98 * t, f"{gain:.2f}x\nMAL\n{tree[n]['mal']:.2f}", ha="center", va="top", fontsize=7,
                    color="white")  # inside the bar: the chain's label beside it is wide
        spec = spec + spec_tree
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("decode tokens/s (batch 1, bf16)")
    ax.set_ylim(0, max(spec + [bench[n]["ar_tokens_per_s"] for n in names]) * 1.45)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper right", fontsize=7)
    save_figure(fig, out)


def _gain(row: dict) -> str:
    """A sampling row's speedup: over the fastest sampled AR when the run measured it, else over its own mode's."""
    if row.get("speedup_vs_fastest_ar") is not None:
        return f"{row['speedup_vs_fastest_ar']:.2f}x"
    return f"{row['speedup']:.2f}x own" if row.get("speedup") is not None else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=Path, nargs="?", default=DEFAULT, help="a bench_online JSON (per domain)")
    ap.add_argument("--tree", type=Path, default=None, help="a draft-tree bench_online JSON of the same prompts")
    ap.add_argument("--out", type=Path, default=None, help="the PNG (default: domains.png beside the JSON)")
    ap.add_argument("--title", default=TITLE)
    args = ap.parse_args()
    bench = json.loads(args.bench.read_text())
    tree = json.loads(args.tree.read_text()) if args.tree is not None else None
    plot_domains(bench, args.out or args.bench.parent / "domains.png", args.title, tree)


if __name__ == "__main__":
    main()
