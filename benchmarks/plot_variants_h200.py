"""Plot several draft variants trained on the same cache: held-out teacher-forced accept_rate@i per variant and a
bar chart of held-out tau_prob and online MAL. The input is either a pipeline's ``reports/`` folder (each
variant's ``eval_offline/<v>.json`` and ``bench_online/<v>.json``) or a summary JSON holding the same per variant
(``{"variants": {name: {"eval_offline": ..., "bench_online": ...}}}``).

    python benchmarks/plot_variants_h200.py reports variants.png
    python benchmarks/plot_variants_h200.py reports/bench/engram_h200/summary.json reports/bench/engram_h200/variants.png
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def load_variants(summary: Path) -> dict:
    """name -> {"eval_offline": dict | None, "bench_online": dict | None}, from a reports/ folder or a summary JSON."""
    if not summary.is_dir():
        return json.loads(summary.read_text())["variants"]
    names = sorted(f.stem for f in (summary / "eval_offline").glob("*.json"))
    if not names:
        raise SystemExit(f"{summary}: no eval_offline/<variant>.json (run the pipeline's eval_offline stages first)")
    read = lambda f: json.loads(f.read_text()) if f.is_file() else None  # noqa: E731
    return {n: {"eval_offline": read(summary / "eval_offline" / f"{n}.json"),
                "bench_online": read(summary / "bench_online" / f"{n}.json")} for n in names}


def main(summary: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = load_variants(summary)
    names = list(variants)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        off = variants[name]["eval_offline"] or {}
        rates = [off[k] for k in sorted((k for k in off if k.startswith("accept_rate@")), key=lambda k: int(k[12:]))]
        ax0.plot(range(len(rates)), rates, marker="o", label=f"{name} (tau {off.get('tau_prob', float('nan')):.2f})")
    ax0.set(xlabel="slot i", ylabel="accept_rate@i (held-out, teacher-forced)", ylim=(0, 1))
    ax0.legend(fontsize=8)
    taus = [(variants[n]["eval_offline"] or {}).get("tau_prob", 0.0) for n in names]
    mals = [((variants[n]["bench_online"] or {}).get("overall") or {}).get("mal", 0.0) for n in names]
    xs = range(len(names))
    ax1.bar([x - 0.2 for x in xs], taus, width=0.4, label="held-out tau_prob")
    ax1.bar([x + 0.2 for x in xs], mals, width=0.4, label="online MAL (greedy)")
    ax1.set_xticks(list(xs), names, rotation=20, fontsize=8)
    ax1.legend(fontsize=8)
    ax1.set_title("same data, same steps, one H200")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
