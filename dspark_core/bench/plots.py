"""PNG plots of the online benchmark's metrics (Agg backend, written atomically)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark_core.io import atomic_path


def plot_metrics(metrics: dict[str, Any], plots_dir: Path, block_size: int) -> None:
    """``accept_rate.png`` (accept_rate@i per dataset) and ``proposal_lengths.png`` (histograms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in metrics if k not in ("setup",)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        rates = [metrics[name].get(f"accept_rate@{i}") for i in range(block_size)]
        ax.plot(range(block_size), [r if r is not None else float("nan") for r in rates], marker="o",
                label=f"{name} (MAL {_fmt(metrics[name]['mal'])}, x{_fmt(metrics[name]['speedup'])})")
    ax.set(xlabel="slot i", ylabel="accept_rate@i", ylim=(0, 1), title="online acceptance per slot")
    ax.legend(fontsize=8)
    save_figure(fig, plots_dir / "accept_rate.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        hist = metrics[name]["proposal_length_hist"]
        total = max(sum(hist.values()), 1)
        ax.bar([int(k) + j * width for k in hist], [v / total for v in hist.values()], width=width, label=name)
    ax.set(xlabel="proposed tokens per cycle", ylabel="fraction of cycles", title="proposal lengths")
    ax.legend(fontsize=8)
    save_figure(fig, plots_dir / "proposal_lengths.png")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, dpi=100, bbox_inches="tight", format="png")
    plt.close(fig)
