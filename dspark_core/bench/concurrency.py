"""The metrics of one concurrency level of the online benchmark (``bench_online.concurrency``): what the fast
engine's ``serve`` returned for a dataset's requests, speculative and AR on the same request rows, as one row of
``metrics[dataset]["concurrency"][str(c)]`` (and ``overall``):

- ``mal``: tokens committed per row and cycle, bonus included (over every request's cycles);
- ``tokens_per_s``: output tokens per second of the whole batch (prefills excluded); ``request_tokens_per_s``: the
  mean over requests of each one's own tokens per second of its decode (what one user sees);
- ``cycle_ms``: wall time of a cycle (every row's propose and one verify); ``draft_ms`` / ``verify_ms``: its parts on
  the timed cycles; ``ar_step_ms``: a step of the AR on the same rows;
- ``mean_active_rows``: rows decoding a request, per cycle; ``mean_verify_tokens``: tokens the target verified per
  cycle (``proposal: confidence`` sizes it);
- ``batched_ar_tokens_per_s``: AR on the same rows at this concurrency (the engine with ``draft=None``);
  ``ar_tokens_per_s``: the AR the speedup is taken over -- the batched AR, and at concurrency 1 the fastest AR the
  run measured at one request (``ar_baseline`` names it: ``rows``, ``ar`` the main run's ``ARDecoder``, or
  ``ar:<mode>`` its AR in the fastest small-GEMM mode); ``speedup = tokens_per_s / ar_tokens_per_s``;
- ``identical``: greedy, every request's speculative tokens equal its AR tokens at this concurrency;
  ``identical_to_alone``: equal to that prompt decoded alone (AR at concurrency 1); None when sampling.

Pure bookkeeping over :class:`dspark_core.decoding.rows.BatchResult`: no model, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from dspark_core.decoding.rows import BatchResult

# the keys of a level's row, in this order (the report's table reads them)
LEVEL_KEYS = ("concurrency", "proposal", "requests", "mal", "tokens_per_s", "request_tokens_per_s", "cycle_ms",
              "draft_ms", "verify_ms", "ar_step_ms", "mean_active_rows", "mean_verify_tokens",
              "batched_ar_tokens_per_s", "ar_tokens_per_s", "ar_baseline", "speedup", "identical",
              "identical_to_alone")


@dataclass
class LevelRun:
    """One dataset's requests at one concurrency: the prompts in serving order (turn by turn: every
    conversation's first turn, then the second turns, ...) and each wave's ``serve`` results."""

    prompts: list[list[int]] = field(default_factory=list)
    spec: list[BatchResult] = field(default_factory=list)
    ar: list[BatchResult] = field(default_factory=list)


def merge_batches(batches: Sequence[BatchResult]) -> BatchResult:
    """The serves of several waves (or datasets) as one ``BatchResult``: requests, seconds and cycles summed."""
    return BatchResult(results=[r for b in batches for r in b.results],
                       concurrency=batches[0].concurrency if batches else 0,
                       decode_s=sum(b.decode_s for b in batches), prefill_s=sum(b.prefill_s for b in batches),
                       active_rows=[n for b in batches for n in b.active_rows],
                       verify_tokens=[n for b in batches for n in b.verify_tokens],
                       draft_s=[t for b in batches for t in b.draft_s], verify_s=[t for b in batches for t in b.verify_s])


def merge_runs(runs: Sequence[Any], merged: Any = None) -> Any:
    """Several datasets' runs as one: their prompts and results end to end, into ``merged`` (a new ``LevelRun`` by
    default; any record of ``prompts`` / ``spec`` / ``ar`` lists, e.g. the main run's ``DatasetRun``)."""
    merged = LevelRun() if merged is None else merged
    for run in runs:
        merged.prompts += run.prompts
        merged.spec += run.spec
        merged.ar += run.ar
    return merged


def _ms(seconds: Sequence[float]) -> float | None:
    return 1e3 * sum(seconds) / len(seconds) if seconds else None


def _per_cycle(values: Sequence[int]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_level(run: LevelRun, proposal: str, greedy: bool, alone: dict[tuple[int, ...], list[int]],
                    ar_at_one: dict[str, float | None] | None = None) -> dict[str, Any]:
    """The row of one level (see the module docstring). ``alone``: each prompt's tokens decoded alone by AR (by its
    token ids); ``ar_at_one`` (concurrency 1 only): the other AR throughputs of the run at one request, by name
    (``ar``, ``ar:<mode>``), the fastest of which (with the batched AR) the speedup is taken over."""
    spec, ar = merge_batches(run.spec), merge_batches(run.ar)
    accepted = [a for r in spec.results for a in r.accepted_per_cycle]
    ar_rates = {"rows": ar.tokens_per_s or None, **(ar_at_one or {})}
    known = {name: rate for name, rate in ar_rates.items() if rate}
    baseline = max(known, key=known.get) if known else None
    row: dict[str, Any] = {
        "concurrency": spec.concurrency, "proposal": proposal, "requests": len(spec.results),
        "mal": sum(a + 1 for a in accepted) / len(accepted) if accepted else None,
        "tokens_per_s": spec.tokens_per_s or None, "request_tokens_per_s": spec.request_tokens_per_s or None,
        "cycle_ms": 1e3 * spec.cycle_s if spec.cycles else None, "draft_ms": _ms(spec.draft_s),
        "verify_ms": _ms(spec.verify_s), "ar_step_ms": 1e3 * ar.cycle_s if ar.cycles else None,
        "mean_active_rows": _per_cycle(spec.active_rows), "mean_verify_tokens": _per_cycle(spec.verify_tokens),
        "batched_ar_tokens_per_s": ar_rates["rows"], "ar_tokens_per_s": known.get(baseline), "ar_baseline": baseline}
    row["speedup"] = (row["tokens_per_s"] / row["ar_tokens_per_s"]
                      if row["tokens_per_s"] and row["ar_tokens_per_s"] else None)
    row["identical"] = all(s.tokens == a.tokens for s, a in zip(spec.results, ar.results)) if greedy else None
    row["identical_to_alone"] = (all(alone.get(tuple(p)) == s.tokens for p, s in zip(run.prompts, spec.results))
                                 if greedy else None)
    return {k: row[k] for k in LEVEL_KEYS}


def alone_tokens(prompts: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]) -> dict[tuple[int, ...], list[int]]:
    """{prompt ids: its tokens} of AR decoding at one request."""
    return {tuple(p): list(t) for p, t in zip(prompts, tokens)}


def ar_at_one_request(row: dict[str, Any]) -> dict[str, float | None]:
    """The AR throughputs a dataset's main-run metrics ``row`` measured at one request: ``ar`` (``ARDecoder``) and,
    with GPU kernels, ``ar:<mode>`` (the fastest small-GEMM mode's)."""
    out = {"ar": row.get("ar_tokens_per_s")}
    if row.get("fastest_ar_mode"):
        out[f"ar:{row['fastest_ar_mode']}"] = row.get("fastest_ar_tokens_per_s")
    return out
