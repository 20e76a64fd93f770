"""Offline evaluation of a DSpark draft on a held-out cache (stage ``eval_offline``), teacher forcing.

For every sample, ``num_anchors`` anchors are drawn (one generator seeded with ``seed``, samples in
order: the same anchors on every run), the draft runs all blocks in one multi-anchor forward on the
reference prefix, and the per-slot overlap with the teacher (``lm_head(last_hidden)``), CE and
confidence are accumulated by :class:`dspark_core.metrics.OfflineMetrics`.

Outputs: the metrics dict (keys ``tau_prob, accept_rate@0.., ce, conf_mae, conf_bias, num_blocks,
num_tokens`` plus a variant's own) as JSON, and under ``plots_dir``: ``accept_rate.png`` / ``accept_rate.json``
(per slot) and ``confidence_reliability.png`` / ``confidence_reliability.json`` (reliability table).

Anchor sets in the keys: the plain keys are measured at the random anchors above, the same for every draft. A
draft measured on another anchor set too (``offline_anchor_sets``: Draft Memory's ``post_error``, the anchors right
after a draft error) reports it as ``<set>/<key>`` (``post_error/tau_prob``), and the ``reference`` draft (the
baseline) measured on exactly that set's batch as ``<set>/<reference name>/<key>``
(``post_error/baseline/tau_prob``): a like-for-like comparison. Plots show the plain keys.

Shape legend: B batch, A anchors, S slots, N valid slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dspark_core.config import Section, one_of, positive, require
from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.draft.config import LossConfig
from dspark_core.draft.loss import slot_outputs
from dspark_core.errors import UserError
from dspark_core.io import atomic_path, write_json
from dspark_core.metrics import OfflineMetrics


@dataclass(frozen=True)
class EvalOfflineConfig(Section):
    """Params section ``eval_offline``."""

    max_samples: int | None = None
    batch_size: int = 4
    seed: int = 1234
    num_anchors: int = 256
    calibration_bins: int = 10
    reference: str = "baseline"  # the variant also measured on another draft's extra anchor sets (post_error)
    hidden_states: str = "cache"  # cache: read from the eval store | online: the target run here (cache/online.py)
    target_compile: bool = True  # online on a GPU: the target's layers compiled (as train.target_compile)

    def validate(self) -> None:
        if self.max_samples is not None:
            positive("max_samples", self.max_samples)
        positive("batch_size", self.batch_size)
        positive("num_anchors", self.num_anchors)
        positive("calibration_bins", self.calibration_bins)
        require(bool(self.reference) and "/" not in self.reference,
                f"reference must name a variant (a key of variants); got {self.reference!r}")
        one_of("hidden_states", self.hidden_states, ("cache", "online"))


@torch.no_grad()
def evaluate_offline(draft, dataset: Sequence[dict[str, torch.Tensor]], cfg: EvalOfflineConfig, *,
                     metrics_path: str | Path | None = None, plots_dir: str | Path | None = None,
                     pad_id: int = 0, chunk_slots: int = 512, device: torch.device | str | None = None,
                     collator: Any = None, progress: bool = True, reference: Any = None,
                     fill_hidden: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Teacher-forced offline metrics of ``draft`` on ``dataset`` (``CacheDataset`` items); ``reference`` (a draft
    of the same block size, named ``cfg.reference``) is measured on the draft's extra anchor sets. ``fill_hidden``:
    adds each batch's hidden states on the device (``OnlineTarget.fill``, items read online with the
    ``OnlineCollator``)."""
    from tqdm.auto import tqdm

    draft.eval()
    if reference is not None:
        reference.eval()
        for field in ("block_size", "aux_layer_ids"):
            if getattr(reference, field) != getattr(draft, field):
                raise UserError(f"eval_offline.reference {cfg.reference}: {field} {getattr(reference, field)} "
                                f"differs from the draft's {getattr(draft, field)}; name a reference variant trained "
                                "alike")
    device = torch.device(device) if device is not None else draft.fc.weight.device
    n = len(dataset) if cfg.max_samples is None else min(len(dataset), cfg.max_samples)
    if n == 0:
        raise ValueError("evaluate_offline: the evaluation dataset is empty")
    if collator is None:
        from dspark_core.cache.dataset import CacheCollator

        collator = CacheCollator(pad_id)
    loss_cfg = LossConfig(vocab_chunk_slots=chunk_slots)  # only the chunking is used here
    metrics = {name: OfflineMetrics(draft.block_size, cfg.calibration_bins) for name in _set_keys(draft, reference,
                                                                                                cfg.reference)}
    gen = torch.Generator().manual_seed(cfg.seed)
    for start in tqdm(range(0, n, cfg.batch_size), desc="eval_offline", unit="batch", disable=not progress):
        items = [dataset[i] for i in range(start, min(n, start + cfg.batch_size))]
        # compact anchor slots: no dummy blocks for short answers (the same valid slots, so the same metrics)
        batch = add_anchor_fields(collator(items), cfg.num_anchors, draft.block_size, gen, compact=True)
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        if fill_hidden is not None:
            batch = fill_hidden(batch)
        for name, prepared in draft.offline_anchor_sets(batch).items():
            _accumulate(draft, prepared, loss_cfg, metrics[name])
            if name and reference is not None:  # the same anchors, targets and validity; no memory of the draft's
                theirs = {k: v for k, v in prepared.items() if not k.startswith("memory_")}
                _accumulate(reference, reference.prepare_batch(theirs), loss_cfg,
                            metrics[f"{name}/{cfg.reference}"])
    plain = metrics.pop("")
    result = plain.result()
    for name, m in metrics.items():
        result.update({f"{name}/{k}": v for k, v in m.result().items()})
    if metrics_path is not None:
        write_json(metrics_path, result)
    if plots_dir is not None:
        write_plots(Path(plots_dir), result, plain.reliability(), draft.block_size)
    return result


def _set_keys(draft, reference, reference_name: str) -> list[str]:
    """The metric key prefixes: "" (random anchors), each extra anchor set, and ``<set>/<reference>``."""
    extra = [name for name in draft.offline_anchor_set_names if name]
    return [""] + extra + ([f"{name}/{reference_name}" for name in extra] if reference is not None else [])


def _accumulate(draft, batch: dict[str, torch.Tensor], loss_cfg: LossConfig, metrics: OfflineMetrics) -> None:
    """One prepared batch (``offline_anchor_sets`` / ``prepare_batch``) of ``draft`` into ``metrics``."""
    hidden = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"],
                                 extras=batch)  # [B, A, S, H]
    out = slot_outputs(draft, hidden, batch, loss_cfg, extras=batch)
    a_full = torch.zeros(batch["slot_valid"].shape, device=hidden.device)  # [B, A, S]
    a_full[tuple(out["index"])] = out["overlap"]
    conf = torch.sigmoid(out["conf_logits"]) if out["conf_logits"] is not None else None  # [N]
    metrics.add(a_full, batch["slot_valid"], out["ce"], conf)
    metrics.add_extra(draft.variant_offline_sums(hidden, batch))  # e.g. the reranker's metrics


def write_plots(plots_dir: Path, result: dict[str, Any], reliability: dict[str, list], block_size: int) -> None:
    """accept_rate@i bar chart and the confidence reliability diagram (PNG + the JSON they plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    rates = [result[f"accept_rate@{i}"] for i in range(block_size)]
    write_json(plots_dir / "accept_rate.json", [{"slot": i, "accept_rate": r} for i, r in enumerate(rates)])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(block_size), [r or 0.0 for r in rates], color="tab:blue")
    ax.set(xlabel="slot i", ylabel="accept_rate@i", ylim=(0, 1),
           title=f"tau_prob = {result['tau_prob']:.3f}" if result["tau_prob"] is not None else "no valid block")
    _save(fig, plots_dir / "accept_rate.png")

    write_json(plots_dir / "confidence_reliability.json", reliability)
    fig, ax = plt.subplots(figsize=(5, 5))
    centers = [(lo + hi) / 2 for lo, hi in zip(reliability["edges"][:-1], reliability["edges"][1:])]
    pts = [(c, m) for c, m in zip(reliability["mean_confidence"], reliability["mean_overlap"]) if m is not None]
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    if pts:
        ax.plot(*zip(*pts), "o-", color="tab:orange", label="draft")
    ax.bar(centers, [c / max(1, sum(reliability["count"])) for c in reliability["count"]],
           width=1 / len(centers), alpha=0.25, color="tab:blue", label="fraction of slots")
    ax.set(xlabel="predicted confidence", ylabel="actual overlap a_i", xlim=(0, 1), ylim=(0, 1),
           title="confidence reliability")
    ax.legend(loc="upper left")
    _save(fig, plots_dir / "confidence_reliability.png")


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
