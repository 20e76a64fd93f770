"""Plots of the H200 speculative-decoding runs in ``reports/bench/spec_h200_smollm2/`` (session 6 at the top,
sessions 3-5 in ``session3/`` .. ``session5/``): decode tokens/s of AR and speculative decoding per kernel
mode and proposal shape (chain or draft tree), and the per-depth acceptance of the drafts on the same 30
held-out GSM8K problems; and, for a ``bench_online`` run over the four domains (session 10), tokens/s per domain:
speculative vs AR in each small-GEMM mode, with the speedup over the fastest AR and the MAL greedy / sampling.

    python benchmarks/plot_spec_h200.py        # -> reports/bench/spec_h200_smollm2/{speed,accept_rate}.png
                                               #    and session10/, session13/domains.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_core.decoding.bench_online import _save  # noqa: E402

DIR = ROOT / "reports" / "bench" / "spec_h200_smollm2"
# (label, file): the runs with the trained draft, all on the same 30 prompts
RUNS = [("s3 mma", "session3/decode.json"), ("s3 fma", "session3/decode_fma.json"),
        ("s4 mma", "session4/decode.json"), ("s4 fma", "session4/decode_fma_torch_accept.json"),
        ("s5 mma", "session5/decode.json"), ("s5 mma tree", "session5/decode_tree_1-4_2-2_3-1_4-1.json"),
        ("s6 mma", "decode.json"), ("s6 mma tree", "decode_tree_1-4_2-2_3-1_4-1.json")]


def load(folder: Path, rel: str) -> dict:
    return json.loads((folder / rel).read_text())["spec"]


def plot_speed(runs: list[tuple[str, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10.5, 3.8))
    x = range(len(runs))
    ar = [s["ar_tokens_per_s"] for _, s in runs]
    spec = [s["tokens_per_s"] for _, s in runs]
    ax.bar([i - 0.2 for i in x], ar, 0.4, label="AR (same kernels)")
    ax.bar([i + 0.2 for i in x], spec, 0.4, label="speculative (static engine)")
    for i, s in enumerate(spec):
        ax.text(i + 0.2, s, f"{s / ar[i]:.2f}x\nMAL {runs[i][1]['mal']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [label for label, _ in runs], fontsize=8)
    ax.set_ylabel("decode tokens/s (batch 1, bf16)")
    ax.set_ylim(0, max(spec + ar) * 1.3)
    ax.set_title("SmolLM2-135M on one H200, 30 held-out GSM8K, greedy (output identical to AR)")
    ax.legend(loc="upper left", fontsize=8)
    _save(fig, out)


def plot_accept(runs: list[tuple[str, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, s in runs:
        rates = [s[f"accept_rate@{i}"] for i in range(7)]
        ax.plot(range(7), rates, marker="o", label=label)
    ax.set_xlabel("depth i")
    ax.set_ylabel("accept_rate@i (online: P(accepted depth > i))")
    ax.set_title("Acceptance by depth, 30 held-out GSM8K")
    ax.legend(fontsize=8)
    _save(fig, out)


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
    _save(fig, out)


def _gain(row: dict) -> str:
    """A sampling row's speedup: over the fastest sampled AR when the run measured it, else over its own mode's."""
    if row.get("speedup_vs_fastest_ar") is not None:
        return f"{row['speedup_vs_fastest_ar']:.2f}x"
    return f"{row['speedup']:.2f}x own" if row.get("speedup") is not None else ""


# bench_online runs over the four domains: (folder, title)
DOMAIN_RUNS = [("session10", "session 10: SmolLM2-135M on one H200, 30 held-out prompts a domain, 160 new tokens, "
                             "1,026 train steps; labels: speedup over the fastest AR, MAL (greedy, T 0.7)"),
               ("session13", "session 13: the same, 563 train steps, kernels with the fused attention combine (since "
                             "reverted), T 0.7 on the static engine;\nlabels: speedup over the fastest AR, MAL (greedy; "
                             "T 0.7 with its speedup over the same-mode AR)"),
               ("session14", "session 14: session 13's draft trained on (3,087 more steps, same 2,640 answers), the "
                             "one-launch sampled Markov slot;\nlabels: speedup over the fastest AR, MAL (greedy; T 0.7 "
                             "with its speedup over the fastest sampled AR)"),
               ("session15", "session 15: session 14's draft trained on (1,576 more steps) with all 7,920 train prompts "
                             "answered (5,280 new);\nlabels: speedup over the fastest AR, MAL (greedy; "
                             "T 0.7 with its speedup over the fastest sampled AR)"),
               ("session16", "session 16: session 15's draft trained on (3,700 more steps, lr_schedule time: ends "
                             "annealed), the sampled accept kernel;\nlabels: speedup over the fastest AR, MAL (greedy; "
                             "T 0.7 with its speedup over the fastest sampled AR)"),
               ("session17", "session 17: a new draft from scratch (3,273 steps, lr_schedule time) on 13,740 of the "
                             "19,234 train prompts (four domains);\nlabels: speedup over the fastest AR, MAL (greedy; "
                             "T 0.7 with its speedup over the fastest sampled AR)")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=DIR)
    args = ap.parse_args()
    runs = [(label, load(args.dir, rel)) for label, rel in RUNS]
    plot_speed(runs, args.dir / "speed.png")
    plot_accept([r for r in runs if "mma" in r[0]], args.dir / "accept_rate.png")
    for label, s in runs:
        print(f"{label:>16}: MAL {s['mal']:.2f} | {s['tokens_per_s']:.1f} vs AR {s['ar_tokens_per_s']:.1f} tokens/s "
              f"= {s['speedup']:.2f}x | identical {s['identical']}")
    for folder, title in DOMAIN_RUNS:
        domains, tree = (args.dir / folder / f"bench_online{kind}_baseline.json" for kind in ("", "_tree"))
        if domains.is_file():
            plot_domains(json.loads(domains.read_text()), domains.parent / "domains.png", title,
                         json.loads(tree.read_text()) if tree.is_file() else None)


if __name__ == "__main__":
    main()
