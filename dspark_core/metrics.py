"""Offline draft metrics on cached reference prefixes (seed 000, "离线指标"), teacher forcing.

Shape legend: B batch, A anchors, S slots of a block, N valid slots, V vocab, M calibration bins.

- overlap ``a_i = sum_v min(p_i(v), q_i(v)) = 1 - 0.5 * ||p_i - q_i||_1`` (p teacher, q draft after Markov);
- ``tau_prob = 1 + sum_{i=0}^{S-1} prod_{j<=i} a_j`` per valid block, with ``a_j = 0`` on invalid slots;
- ``accept_rate@i``: mean ``a_i`` over the valid tokens of slot i (no position-decay weights);
- ``ce``: mean cross-entropy of the reference token over valid tokens;
- confidence calibration: ``conf_mae = mean |sigmoid(s_i) - a_i|``, ``conf_bias = mean (sigmoid(s_i) - a_i)``,
  and a reliability table over ``M`` equal-width bins of the predicted confidence.

Everything is accumulated as sums + counts, so batches (and ranks) add up exactly.
"""

from __future__ import annotations

from typing import Any

import torch


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q [..., V] distributions -> a [...] = sum_v min(p, q)."""
    return torch.minimum(p, q).sum(dim=-1)


def overlap_from_l1(l1: torch.Tensor) -> torch.Tensor:
    """a = 1 - 0.5 * ||p - q||_1 (equal to :func:`overlap` for two distributions), clamped to [0, 1]."""
    return (1.0 - 0.5 * l1).clamp(0.0, 1.0)


def tau_prob_per_block(a: torch.Tensor, slot_valid: torch.Tensor) -> torch.Tensor:
    """a, slot_valid [..., S] -> [...]: 1 + sum_i prod_{j<=i} a_j, invalid slots counted as a = 0."""
    a = torch.where(slot_valid, a.float(), torch.zeros((), dtype=torch.float32, device=a.device))
    return 1.0 + a.cumprod(dim=-1).sum(dim=-1)


def block_metric_sums(a: torch.Tensor, slot_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, slot_valid [B, A, S] -> (sum of tau_prob over valid blocks [], sum of a per slot over valid tokens [S])."""
    slot_valid = slot_valid.bool()
    block_valid = slot_valid[..., 0]  # a block is valid when its first slot is
    tau = (tau_prob_per_block(a, slot_valid) * block_valid).sum()
    acc = torch.where(slot_valid, a.float(), torch.zeros((), device=a.device)).flatten(0, -2).sum(dim=0)  # [S]
    return tau, acc


def block_counts(slot_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slot_valid [B, A, S] -> (valid blocks [], valid tokens per slot [S])."""
    slot_valid = slot_valid.bool()
    return slot_valid[..., 0].sum(), slot_valid.flatten(0, -2).sum(dim=0)


class OfflineMetrics:
    """Streaming accumulator of the offline metrics over batches."""

    def __init__(self, block_size: int, calibration_bins: int = 10) -> None:
        if block_size < 1 or calibration_bins < 1:
            raise ValueError(f"block_size and calibration_bins must be >= 1; got {block_size}, {calibration_bins}")
        self.block_size, self.bins = block_size, calibration_bins
        self.tau_sum = 0.0
        self.blocks = 0
        self.acc_sum = torch.zeros(block_size, dtype=torch.float64)  # [S]
        self.tokens = torch.zeros(block_size, dtype=torch.float64)  # [S]
        self.ce_sum = 0.0
        self.has_conf = False
        self.conf_abs = self.conf_err = 0.0
        self.bin_count = torch.zeros(calibration_bins, dtype=torch.float64)  # [M]
        self.bin_conf = torch.zeros(calibration_bins, dtype=torch.float64)  # [M]
        self.bin_acc = torch.zeros(calibration_bins, dtype=torch.float64)  # [M]
        self.extra: dict[str, list[float]] = {}  # a variant's own metrics: name -> [numerator, denominator]

    def add(self, a: torch.Tensor, slot_valid: torch.Tensor, ce: torch.Tensor,
            confidence: torch.Tensor | None = None) -> None:
        """a, slot_valid [B, A, S]; ce [N] and confidence [N] (probabilities) of the valid slots in
        ``slot_valid.nonzero()`` order."""
        slot_valid = slot_valid.bool()
        tau, acc = block_metric_sums(a, slot_valid)
        blocks, tokens = block_counts(slot_valid)
        self.tau_sum += float(tau)
        self.blocks += int(blocks)
        self.acc_sum += acc.double().cpu()
        self.tokens += tokens.double().cpu()
        self.ce_sum += float(ce.double().sum())
        if confidence is not None:
            self._add_confidence(confidence.double().cpu(), a[slot_valid].double().cpu())

    def add_extra(self, sums: dict[str, tuple[Any, Any]]) -> None:
        """A variant's metrics of one batch, ``{name: (numerator, denominator)}`` (see ``result``)."""
        for name, (num, den) in sums.items():
            acc = self.extra.setdefault(name, [0.0, 0.0])
            acc[0] += float(num)
            acc[1] += float(den)

    def _add_confidence(self, conf: torch.Tensor, a: torch.Tensor) -> None:
        self.has_conf = True
        err = conf - a  # [N]
        self.conf_abs += float(err.abs().sum())
        self.conf_err += float(err.sum())
        idx = (conf * self.bins).long().clamp(0, self.bins - 1)  # [N]
        self.bin_count += torch.bincount(idx, minlength=self.bins).double()
        self.bin_conf += torch.bincount(idx, weights=conf, minlength=self.bins)
        self.bin_acc += torch.bincount(idx, weights=a, minlength=self.bins)

    def result(self) -> dict[str, Any]:
        """``tau_prob, accept_rate@0..S-1, ce, conf_mae, conf_bias, num_blocks, num_tokens`` (None when undefined)."""
        n_tok = float(self.tokens.sum())
        out: dict[str, Any] = {"tau_prob": self.tau_sum / self.blocks if self.blocks else None}
        for i in range(self.block_size):
            t = float(self.tokens[i])
            out[f"accept_rate@{i}"] = float(self.acc_sum[i]) / t if t else None
        out["ce"] = self.ce_sum / n_tok if n_tok else None
        out["conf_mae"] = self.conf_abs / n_tok if self.has_conf and n_tok else None
        out["conf_bias"] = self.conf_err / n_tok if self.has_conf and n_tok else None
        out["num_blocks"] = self.blocks
        out["num_tokens"] = int(n_tok)
        for name, (num, den) in self.extra.items():  # a variant's metrics (may replace tau_prob, accept_rate@i)
            out[name] = num / den if den else None
        return out

    def reliability(self) -> dict[str, list]:
        """Per bin: edges, count, mean predicted confidence, mean actual overlap (None for empty bins)."""
        edges = torch.linspace(0.0, 1.0, self.bins + 1).tolist()
        return {"edges": edges, "count": [int(c) for c in self.bin_count.tolist()],
                "mean_confidence": self._bin_means(self.bin_conf), "mean_overlap": self._bin_means(self.bin_acc)}

    def _bin_means(self, sums: torch.Tensor) -> list[float | None]:
        return [float(s) / c if c else None for s, c in zip(sums.tolist(), self.bin_count.tolist())]
