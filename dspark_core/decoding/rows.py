"""The pieces of one batched cycle over request rows (the static engine's rows path,
``dspark_core.decoding.static_engine``): where each verified token sits in the flat step, the greedy accept step
of every row, the choice of how many draft tokens each row verifies (``proposal: confidence``), and what a batch
of requests returns.

A step verifies T tokens laid end to end: row r contributes ``counts[r] = 1 + k_r`` consecutive tokens (its anchor,
then its first k_r draft tokens), at positions ``p_r .. p_r + k_r``. With fixed proposals every row verifies its
whole block (k_r = S); scheduled by confidence, the rows share a budget of verified tokens, given out by the
predicted acceptance of each draft token. AR decoding is the same step with k_r = 0.

Shape legend: R request rows, S block size, T tokens of a step, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dspark_core.decoding.types import GenerationResult

PROPOSALS = ("fixed", "confidence")


def token_layout(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[T]`` and columns ``[T]`` of a step of ``total`` tokens in which row r has ``counts[r]`` consecutive
    tokens (``counts.sum() <= total``): token t belongs to ``rows[t]`` and is the ``cols[t]``-th of its row.
    Tokens past ``counts.sum()`` are padding and repeat token 0's place (row 0, column 0). Static shapes, no
    host read."""
    end = counts.cumsum(0)  # [R]
    t = torch.arange(total, device=counts.device)  # [T]
    valid = t < end[-1]
    rows = torch.searchsorted(end, t, right=True).clamp(max=counts.shape[0] - 1)  # [T]
    cols = t - (end - counts)[rows]
    return torch.where(valid, rows, 0), torch.where(valid, cols, 0)


def scatter_rows(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, num_rows: int, width: int,
                 fill: float | int = 0) -> torch.Tensor:
    """``values [T, ...]`` placed at (rows, cols) of a ``[R, width, ...]`` tensor, ``fill`` elsewhere (padding
    tokens repeat token 0's place and value)."""
    out = values.new_full((num_rows, width, *values.shape[1:]), fill)
    out[rows, cols] = values
    return out


def accept_greedy_rows(best: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, tokens: torch.Tensor,
                       allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of every row: ``best [T]`` the target's argmax at each verified token, ``tokens [R, S]``
    the draft's, of which the first ``allowed [R]`` were verified and may be accepted. -> accepted prefix a [R]
    and the bonus / corrected token [R] (the target's argmax after the accepted prefix)."""
    num_rows, s = tokens.shape
    target = scatter_rows(best, rows, cols, num_rows, s + 1, fill=-1)  # [R, S+1]
    slots = torch.arange(s, device=tokens.device)
    match = (target[:, :s] == tokens) & (slots < allowed.view(-1, 1))  # [R, S]
    a = match.long().cumprod(dim=1).sum(dim=1)  # [R]
    return a, target.gather(1, a.view(-1, 1))[:, 0]


def confident_prefix_rows(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """[R] long: each row's slots before the first whose confidence (``[R, S]``) is below ``threshold``."""
    rows, s = confidence.shape
    slots = torch.arange(s, device=confidence.device).expand(rows, s)
    if threshold <= 0.0:
        return torch.full((rows,), s, dtype=torch.long, device=confidence.device)
    return torch.where(confidence < threshold, slots, torch.full_like(slots, s)).min(dim=1).values


@dataclass
class Schedule:
    """One cycle's verify under ``proposal: confidence``: the step's size and each row's verified draft tokens."""

    total: int  # T, one of the engine's step sizes
    counts: np.ndarray  # [R] k_r
    expected: float  # expected tokens committed this cycle (the active rows' 1 + predicted accepted each)


def schedule_by_confidence(gains: np.ndarray, active: np.ndarray, sizes: list[int], cost_s: dict[int, float],
                           draft_s: float, min_gain: float = 0.0, budget: int | None = None) -> Schedule:
    """How many of its draft tokens each row verifies this cycle. ``gains [R, S]``: the predicted probability that
    a row's draft tokens 1..j are all accepted (the running product of its confidence head's per-slot acceptance;
    non-increasing along j), so verifying token j adds ``gains[r, j]`` expected tokens. The step holds every row's
    anchor plus the selected draft tokens: of the step sizes ``sizes`` (each >= R; at most ``budget``), the one
    whose best selection -- the largest gains, which is a prefix of each row -- gives the most expected tokens per
    second of cycle, ``(active rows + selected gains) / (draft_s + cost_s[T])``. Tokens below ``min_gain`` are
    never verified; inactive rows verify their anchor only."""
    gains = np.where(active[:, None], gains, 0.0)
    flat = gains.reshape(-1)
    order = np.argsort(-flat, kind="stable")  # ties: earlier row, earlier slot (keeps each row's prefix)
    ranked = flat[order]
    usable = int((ranked >= max(min_gain, 1e-12)).sum())
    cum = np.concatenate([[0.0], np.cumsum(ranked[:usable])])
    rows, base = gains.shape[0], float(active.sum())
    best: Schedule | None = None
    best_rate = -1.0
    for total in [t for t in sorted(sizes) if budget is None or t <= budget] or [min(sizes)]:
        take = min(total - rows, usable)
        expected = base + float(cum[take])
        rate = expected / max(draft_s + cost_s[total], 1e-12)
        if rate > best_rate:
            counts = np.bincount(order[:take] // gains.shape[1], minlength=rows)
            best, best_rate = Schedule(total, counts, expected), rate
    return best


@dataclass
class BatchResult:
    """What :meth:`StaticSpeculativeDecoder.serve` returns: one ``GenerationResult`` per request (in request
    order; ``decode_s`` = the request's own wall time from its first token to its last, ``prefill_s`` its
    prefill), and the batch's cycles (``active_rows`` and ``verify_tokens`` per cycle; draft / verify seconds of
    the timed cycles; ``proposed``: False for a ``proposal: confidence`` cycle run as AR)."""

    results: list[GenerationResult]
    concurrency: int
    decode_s: float = 0.0  # wall time of the cycles (every prefill excluded)
    prefill_s: float = 0.0  # wall time of the prefills
    active_rows: list[int] = field(default_factory=list)  # rows decoding a request, per cycle
    verify_tokens: list[int] = field(default_factory=list)  # tokens the target verified, per cycle
    proposed: list[bool] = field(default_factory=list)  # whether the draft proposed, per cycle (else an AR cycle)
    draft_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)

    @property
    def cycles(self) -> int:
        return len(self.active_rows)

    @property
    def new_tokens(self) -> int:
        """Tokens the cycles made (each request's first token comes from its prefill)."""
        return sum(max(len(r.tokens) - 1, 0) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of the whole batch (prefills excluded)."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def request_tokens_per_s(self) -> float:
        """Mean over requests of each one's own output speed (its tokens over its decode wall time)."""
        rates = [r.decode_tokens_per_s for r in self.results if len(r.tokens) > 1 and r.decode_s > 0]
        return float(np.mean(rates)) if rates else 0.0

    @property
    def cycle_s(self) -> float:
        """Mean wall time of a cycle."""
        return self.decode_s / self.cycles if self.cycles else 0.0

    @property
    def mean_active_rows(self) -> float:
        return float(np.mean(self.active_rows)) if self.active_rows else 0.0
