"""The `report` stage: one page (``reports/summary.md``) and comparison plots over every variant's metrics.

Reads the metrics JSON the other stages wrote (``reports/eval_offline/<v>.json``, ``reports/bench_online/<v>.json``,
``reports/dmtd/<v>.json``) for the variants listed in params.yaml and writes:
- ``reports/summary.md``: a table per family (DSpark variants, DMTD variants) and, for a draft with extra anchor
  sets (Draft Memory: ``post_error/...`` keys), the draft and the reference draft on exactly those anchors;
- ``reports/plots/dspark_accept_rate.png``: offline accept_rate@i per DSpark variant;
- ``reports/plots/dmtd_quality_speed.png``: DMTD perplexity vs decode speedup per variant;
- ``reports/plots/speedup_vs_concurrency.png`` / ``.json``: the online speedup over AR at each
  ``bench_online.concurrency`` level, one line per variant (the JSON rows are what ``dvc plots`` draws, through
  the ``by_variant`` template of ``.dvc/plots/``), and a table per variant and level in ``summary.md``;
- ``reports/metrics/``: the headline figures people compare, flat, one small JSON per variant and concern, so
  that ``dvc metrics show reports/metrics/<concern>`` and ``dvc metrics diff --targets reports/metrics/<concern>``
  give narrow tables of keys that belong together:
  ``offline/<v>.json``: tau_prob, accept_rate@0, accept_rate@1 (+ ``<set>/tau_prob`` and
  ``<set>/<reference>/tau_prob`` of a draft's extra anchor sets, e.g. Draft Memory's ``post_error``);
  ``reranker/<v>.json`` (variants with a prefix reranker): candidate_recall and the reranker's gains;
  ``online/<v>.json``: mal, tokens_per_s, speedup (+ speedup_vs_fastest_ar with GPU kernels), greedy decoding, and
  ``online/<v>@t<T>.json`` the same keys for a sampling pass at temperature T (``bench_online.also_temperatures``);
  ``concurrency/<v>@c<c>.json``: mal, tokens_per_s, request_tokens_per_s, cycle_ms, speedup at concurrency c
  (``bench_online.concurrency``; speedup over the AR at the same concurrency);
  ``dmtd/<v>.json``: perplexity, token_acc, accuracy, tokens_per_s, speedup;
  ``data.json``: regenerate_tokens_per_s, cache_tokens_per_s, bytes_per_token.
  ``dvc metrics show`` alone merges every file into one table, so the concerns share key names (tokens_per_s,
  speedup) and keep few keys. The stages' full JSON (every slot's accept_rate@i, per-domain MAL, timings) stay
  plain outputs beside them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from dspark_core.io import atomic_path

REPORTS = Path("reports")


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


# the prefix reranker's offline metrics (seed 000), dashes for the other variants
RERANK_KEYS = ("rerank_tau_gain", "rerank_target_agreement_gain", "candidate_recall",
               "rerank_teacher_forced_prefix_gain")


def dspark_rows(variants: Sequence[str], root: Path = REPORTS) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        off = _load(root / "eval_offline" / f"{v}.json") or {}
        on = (_load(root / "bench_online" / f"{v}.json") or {}).get("overall", {})
        rows.append({"variant": v, "tau_prob": off.get("tau_prob"), "accept_rate@0": off.get("accept_rate@0"),
                     "ce": off.get("ce"), "conf_mae": off.get("conf_mae"), "mal": on.get("mal"),
                     "tokens_per_s": on.get("tokens_per_s"), "ar_tokens_per_s": on.get("ar_tokens_per_s"),
                     "speedup": on.get("speedup"), "identical": on.get("identical"),
                     "engram_lookup_share": on.get("engram_lookup_share_of_cycle"),
                     "mal_first_stage_memory": (on.get("online_modes") or {}).get("first_stage", {}).get("mal"),
                     **{k: off.get(k) for k in RERANK_KEYS}, "reranker_share": on.get("reranker_share_of_cycle"),
                     "_rates": [off.get(f"accept_rate@{i}") for i in range(64) if f"accept_rate@{i}" in off],
                     "_speedup_vs_fastest_ar": on.get("speedup_vs_fastest_ar"),  # GPU kernels: both modes' AR
                     "_at_temperature": on.get("at_temperature") or {},  # bench_online.also_temperatures
                     "_concurrency": on.get("concurrency") or {},  # bench_online.concurrency: {level: row}
                     "_anchor_set_tau": {k: x for k, x in off.items() if k.endswith("/tau_prob")}})
    return rows


ANCHOR_SET_COLUMNS = ("tau_prob", "accept_rate@0", "accept_rate@1", "ce", "num_blocks")


def anchor_set_rows(variants: Sequence[str], root: Path = REPORTS) -> list[dict[str, Any]]:
    """One row per (variant, extra anchor set, measured draft) from keys ``<set>/<key>`` (the variant itself) and
    ``<set>/<reference>/<key>`` (the reference draft on the same anchors), e.g. Draft Memory's ``post_error``."""
    rows = []
    for v in variants:
        off = _load(root / "eval_offline" / f"{v}.json") or {}
        prefixes = sorted({k[:-len("/tau_prob")] for k in off if k.endswith("/tau_prob")})
        for prefix in prefixes:
            anchor_set, _, measured = prefix.partition("/")
            rows.append({"variant": v, "anchors": anchor_set, "measured draft": measured or v,
                         **{c: off.get(f"{prefix}/{c}") for c in ANCHOR_SET_COLUMNS}})
    return rows


def dmtd_rows(variants: Sequence[str], root: Path = REPORTS) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        d = _load(root / "dmtd" / f"{v}.json") or {}
        rows.append({"variant": v, "perplexity": d.get("perplexity"), "target_perplexity": d.get("target_perplexity"),
                     "gsm8k_accuracy": d.get("gsm8k_accuracy"), "target_gsm8k_accuracy": d.get("target_gsm8k_accuracy"),
                     "tokens_per_s": d.get("tokens_per_s"), "ar_tokens_per_s": d.get("ar_tokens_per_s"),
                     "speedup": d.get("speedup"), "device": d.get("device")})
    return rows


CONCURRENCY_COLUMNS = ("concurrency", "proposal", "mal", "tokens_per_s", "request_tokens_per_s", "cycle_ms",
                       "ar_tokens_per_s", "speedup", "mean_active_rows", "mean_verify_tokens", "identical",
                       "identical_to_alone")


def concurrency_rows(dspark: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant and concurrency level (``bench_online.concurrency``, all datasets), levels ascending."""
    return [{"variant": r["variant"], **{c: level.get(c) for c in CONCURRENCY_COLUMNS}}
            for r in dspark for _, level in sorted(r["_concurrency"].items(), key=lambda kv: int(kv[0]))]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)\n"
    cols = [c for c in rows[0] if not c.startswith("_")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_summary(dspark: list[dict[str, Any]], dmtd: list[dict[str, Any]], path: Path,
                  anchor_sets: list[dict[str, Any]] | None = None, levels: list[dict[str, Any]] | None = None) -> None:
    text = ("# dspark summary\n\nMade by the `report` stage from the metrics under reports/ "
            "(`dvc metrics show` has every key).\n\n## DSpark drafts (offline teacher-forced / online)\n\n"
            "Offline columns: every draft at the same random anchors of the eval cache (Draft Memory without memory: "
            "there is no previous block at a random anchor).\n\n" + markdown_table(dspark))
    if anchor_sets:
        text += ("\n## Offline metrics at a draft's own anchor sets, beside the reference draft on the same anchors\n\n"
                 "post_error: Draft Memory's anchors right after its first greedy error in a block, the draft with "
                 "the kept memory; the reference draft reads the same context, anchors and targets, no memory.\n\n"
                 + markdown_table(anchor_sets))
    if levels:
        text += ("\n## Speed against concurrency (online, all datasets)\n\n"
                 "Each level serves the requests that many at a time on the same request rows, speculative and AR; "
                 "speedup is over the AR at the same concurrency (at concurrency 1 over the fastest AR measured at "
                 "one request). identical: every request equals its AR output at that level; identical_to_alone: "
                 "equals that prompt decoded alone.\n\n" + markdown_table(levels))
    text += "\n## Parallel DMTD\n\n" + markdown_table(dmtd)
    with atomic_path(path, ".md") as tmp:
        tmp.write_text(text)


def plot(dspark: list[dict[str, Any]], dmtd: list[dict[str, Any]], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in dspark:
        if r["_rates"]:
            ax.plot(range(len(r["_rates"])), r["_rates"], "o-", label=f"{r['variant']} (tau {_fmt(r['tau_prob'])})")
    ax.set(xlabel="slot i", ylabel="offline accept_rate@i", ylim=(0, 1), title="DSpark variants")
    if ax.lines:
        ax.legend(fontsize=8)
    else:  # no variant evaluated yet: say so instead of an empty legend
        ax.text(0.5, 0.5, "no variant has offline accept rates", ha="center", va="center", transform=ax.transAxes)
    _save(fig, out_dir / "dspark_accept_rate.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in dmtd:
        if r["perplexity"] is not None and r["speedup"] is not None:
            ax.scatter(r["speedup"], r["perplexity"], s=40)
            ax.annotate(r["variant"], (r["speedup"], r["perplexity"]), fontsize=8, xytext=(4, 4),
                        textcoords="offset points")
    target = next((r["target_perplexity"] for r in dmtd if r["target_perplexity"] is not None), None)
    if target is not None:
        ax.axhline(target, ls="--", color="gray", label=f"target perplexity {target:.2f}")
        ax.legend(fontsize=8)
    ax.set(xlabel="decode speedup over AR", ylabel="held-out perplexity", yscale="log",
           title="Parallel DMTD: quality vs speed")
    _save(fig, out_dir / "dmtd_quality_speed.png")
    plot_concurrency(concurrency_rows(dspark), out_dir)


SPEEDUP_PLOT = "speedup_vs_concurrency"  # .json (dvc plots: one line per variant) and .png under reports/plots
SPEEDUP_PLOT_KEYS = ("speedup", "mal", "tokens_per_s", "request_tokens_per_s", "cycle_ms", "proposal")


def plot_concurrency(levels: list[dict[str, Any]], out_dir: Path) -> None:
    """Speedup over AR against concurrency, one line per variant: ``<SPEEDUP_PLOT>.json`` (the rows ``dvc plots``
    draws through the ``by_variant`` template, .dvc/plots/) and ``<SPEEDUP_PLOT>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dspark_core.io import write_json

    rows = [{"variant": r["variant"], "concurrency": r["concurrency"], **{k: r[k] for k in SPEEDUP_PLOT_KEYS}}
            for r in levels if r["speedup"] is not None]
    write_json(out_dir / f"{SPEEDUP_PLOT}.json", rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        ax.plot([r["concurrency"] for r in mine], [r["speedup"] for r in mine], "o-", label=variant)
    ax.axhline(1.0, ls="--", color="gray", lw=1)
    ax.set(xlabel="concurrency (requests served at once)", ylabel="speedup over AR at the same concurrency",
           title="speculative decoding against concurrency")
    if rows:
        levels = sorted({r["concurrency"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no variant has concurrency levels", ha="center", va="center", transform=ax.transAxes)
    _save(fig, out_dir / f"{SPEEDUP_PLOT}.png")


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)


# The headline keys of each concern (the module docstring lists the files); a key a stage did not make is left
# out. Offline: the first two slots' accept rates (seven slots beside the path do not fit a terminal; the whole
# curve is reports/eval_offline/<v>/accept_rate.json, which `dvc plots diff` draws).
OFFLINE_HEADLINE = ("tau_prob", "accept_rate@0", "accept_rate@1")
ONLINE_HEADLINE = ("mal", "tokens_per_s", "speedup", "speedup_vs_fastest_ar")
CONCURRENCY_HEADLINE = ("mal", "tokens_per_s", "request_tokens_per_s", "cycle_ms", "speedup")
DMTD_HEADLINE = {"perplexity": "perplexity", "token_acc": "token_acc", "accuracy": "gsm8k_accuracy",
                 "tokens_per_s": "tokens_per_s", "speedup": "speedup"}


def _num(x: Any) -> Any:
    return round(x, 6) if isinstance(x, float) else x


def _flat(m: dict[str, Any]) -> dict[str, Any]:
    return {k: _num(v) for k, v in m.items() if v is not None}


def headline_metrics(dspark: list[dict[str, Any]], dmtd: list[dict[str, Any]], root: Path = REPORTS
                     ) -> dict[str, dict[str, Any]]:
    """{relative path under reports/metrics: flat metrics}, one file per variant and concern (the module docstring);
    a figure a stage did not make is left out. ``offline`` / ``online`` / ``dmtd`` have a file for every variant of
    params.yaml (``{}`` before its stages ran); ``reranker`` and ``online/<v>@t<T>`` only where there are figures."""
    out: dict[str, dict[str, Any]] = {}
    for r in dspark:
        v, off = r["variant"], _load(root / "eval_offline" / f"{r['variant']}.json") or {}
        out[f"offline/{v}.json"] = _flat({**{k: off.get(k) for k in OFFLINE_HEADLINE}, **r["_anchor_set_tau"]})
        rerank = _flat({k: r[k] for k in RERANK_KEYS})
        if rerank:
            out[f"reranker/{v}.json"] = rerank
        greedy = {**r, "speedup_vs_fastest_ar": r["_speedup_vs_fastest_ar"]}
        out[f"online/{v}.json"] = _flat({k: greedy[k] for k in ONLINE_HEADLINE})
        for temp, row in r["_at_temperature"].items():
            out[f"online/{v}@t{temp}.json"] = _flat({k: row.get(k) for k in ONLINE_HEADLINE})
        for level, row in r["_concurrency"].items():
            out[f"concurrency/{v}@c{level}.json"] = _flat({k: row.get(k) for k in CONCURRENCY_HEADLINE})
    for r in dmtd:
        d = _load(root / "dmtd" / f"{r['variant']}.json") or {}
        out[f"dmtd/{r['variant']}.json"] = _flat({k: d.get(src) for k, src in DMTD_HEADLINE.items()})
    out["data.json"] = _flat(data_metrics(root))
    return out


def data_metrics(root: Path = REPORTS) -> dict[str, Any]:
    """Regenerate and cache throughput and the cache's bytes per token. The regenerate figure is the split-summed
    ``last_measured`` of ``regenerate_stats.json``: the run that made the answers, also after a rerun that kept
    them all (older stats files: the split's own generation, when it generated)."""
    regen, cache = _load(root / "regenerate_stats.json") or {}, _load(root / "cache_stats.json") or {}
    tokens = seconds = 0.0
    for split in (regen.get("splits") or {}).values():
        last = split.get("last_measured") or {"new_tokens": split.get("new_tokens_now"),
                                               "generate_seconds": split.get("generate_seconds")}
        if last.get("new_tokens") and last.get("generate_seconds"):
            tokens, seconds = tokens + last["new_tokens"], seconds + last["generate_seconds"]
    return {"regenerate_tokens_per_s": tokens / seconds if seconds else None,
            "cache_tokens_per_s": cache.get("tokens_per_s"), "bytes_per_token": cache.get("bytes_per_token")}


def write_headlines(metrics: dict[str, dict[str, Any]], out_dir: Path) -> None:
    """Rewrite ``out_dir`` with exactly these files (a variant removed from params leaves no stale file)."""
    from dspark_core.io import write_json

    keep = {out_dir / rel for rel in metrics}
    for old in out_dir.rglob("*.json") if out_dir.is_dir() else []:
        if old not in keep:
            old.unlink()
    for folder in sorted(out_dir.rglob("*"), reverse=True) if out_dir.is_dir() else []:  # a concern no longer made
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    for rel, m in metrics.items():
        write_json(out_dir / rel, m)


def run_report(params: str | Path, root: Path = REPORTS) -> None:
    from dspark_core.config import read_yaml

    doc = read_yaml(params)
    variants = list((doc.get("variants") or {}).keys())
    dmtd_variants = list((doc.get("dmtd") or {}).get("variants") or [])
    dspark, dmtd = dspark_rows(variants, root), dmtd_rows(dmtd_variants, root)
    write_summary(dspark, dmtd, root / "summary.md", anchor_set_rows(variants, root), concurrency_rows(dspark))
    write_headlines(headline_metrics(dspark, dmtd, root), root / "metrics")
    plot(dspark, dmtd, root / "plots")
