"""The report stage tabulates every variant's metrics and draws the comparison plots."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_core.report import run_report


def test_report_tables_and_plots(tmp_path):
    (tmp_path / "eval_offline").mkdir()
    (tmp_path / "bench_online").mkdir()
    (tmp_path / "dmtd").mkdir()
    (tmp_path / "eval_offline" / "baseline.json").write_text(json.dumps(
        {"tau_prob": 2.5, "accept_rate@0": 0.7, "accept_rate@1": 0.5, "ce": 1.25, "conf_mae": 0.1}))
    levels = {str(c): {"concurrency": c, "proposal": "fixed", "mal": 2.5, "tokens_per_s": 30.0 * c,
                       "request_tokens_per_s": 30.0, "cycle_ms": 4.0 + c, "ar_tokens_per_s": 15.0 * c,
                       "speedup": 2.0 / c, "mean_active_rows": c * 0.75, "mean_verify_tokens": 8.0 * c,
                       "identical": True, "identical_to_alone": c < 16, "batched_ar_tokens_per_s": 15.0 * c}
              for c in (16, 1, 4)}  # levels in any order
    (tmp_path / "bench_online" / "baseline.json").write_text(json.dumps(
        {"overall": {"mal": 2.75, "tokens_per_s": 30.0, "ar_tokens_per_s": 10.0, "speedup": 3.0, "identical": True,
                     "concurrency": levels}}))
    (tmp_path / "dmtd" / "bidir_refresh.json").write_text(json.dumps(
        {"perplexity": 2.5, "target_perplexity": 2.0, "gsm8k_accuracy": 0.5, "target_gsm8k_accuracy": 0.5,
         "tokens_per_s": 40.0, "ar_tokens_per_s": 20.0, "speedup": 2.0, "device": "cpu"}))
    (tmp_path / "eval_offline" / "rr.json").write_text(json.dumps(
        {"tau_prob": 2.0, "rerank_tau_gain": 0.25, "rerank_target_agreement_gain": 0.02, "candidate_recall": 0.9,
         "rerank_teacher_forced_prefix_gain": 0.125}))
    params = tmp_path / "params.yaml"
    params.write_text("variants:\n  baseline: {}\n  other: {}\n  rr: {}\ndmtd:\n  variants: [bidir_refresh]\n")
    run_report(params, root=tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "| baseline | 2.500 | 0.700 | 1.250 | 0.100 | 2.750 | 30.000 | 10.000 | 3.000 | yes |" in text
    assert "| other | - |" in text  # a variant without results shows dashes, not zeros
    assert "| rr | 2.000 |" in text and "| 0.250 | 0.020 | 0.900 | 0.125 | - |" in text  # the reranker's gains
    assert "| bidir_refresh | 2.500 | 2.000 | 0.500 | 0.500 | 40.000 | 20.000 | 2.000 | cpu |" in text
    for png in ("dspark_accept_rate.png", "dmtd_quality_speed.png", "speedup_vs_concurrency.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    # speed against concurrency: a row per variant and level (ascending), the points dvc plots draws, headlines
    table = text.split("## Speed against concurrency")[1].split("## Parallel DMTD")[0]
    assert ("| variant | concurrency | proposal | mal | tokens_per_s | request_tokens_per_s | cycle_ms | ar_tokens_per_s "
            "| speedup | mean_active_rows | mean_verify_tokens | identical | identical_to_alone |") in table
    assert [ln.split(" | ")[1] for ln in table.splitlines() if ln.startswith("| baseline")] == ["1", "4", "16"]
    assert ("| baseline | 16 | fixed | 2.500 | 480.000 | 30.000 | 20.000 | 240.000 | 0.125 | 12.000 | 128.000 | yes "
            "| no |") in table
    assert "| other |" not in table  # no levels, no rows
    points = json.loads((tmp_path / "plots" / "speedup_vs_concurrency.json").read_text())
    assert [(p["variant"], p["concurrency"], p["speedup"]) for p in points] == [
        ("baseline", 1, 2.0), ("baseline", 4, 0.5), ("baseline", 16, 0.125)]
    assert set(points[0]) == {"variant", "concurrency", "speedup", "mal", "tokens_per_s", "request_tokens_per_s",
                              "cycle_ms", "proposal"}
    # the headline metrics (the only files dvc.yaml declares as metrics): flat, one per variant and concern,
    # only what exists
    head = tmp_path / "metrics"
    assert json.loads((head / "offline" / "baseline.json").read_text()) == {
        "tau_prob": 2.5, "accept_rate@0": 0.7, "accept_rate@1": 0.5}
    assert json.loads((head / "online" / "baseline.json").read_text()) == {
        "mal": 2.75, "tokens_per_s": 30.0, "speedup": 3.0}
    assert json.loads((head / "concurrency" / "baseline@c4.json").read_text()) == {
        "mal": 2.5, "tokens_per_s": 120.0, "request_tokens_per_s": 30.0, "cycle_ms": 8.0, "speedup": 0.5}
    assert sorted(p.name for p in (head / "concurrency").iterdir()) == [
        "baseline@c1.json", "baseline@c16.json", "baseline@c4.json"]
    assert json.loads((head / "offline" / "other.json").read_text()) == {}
    assert json.loads((head / "online" / "other.json").read_text()) == {}
    assert json.loads((head / "reranker" / "rr.json").read_text()) == {
        "rerank_tau_gain": 0.25, "rerank_target_agreement_gain": 0.02, "candidate_recall": 0.9,
        "rerank_teacher_forced_prefix_gain": 0.125}
    assert sorted(p.name for p in (head / "reranker").iterdir()) == ["rr.json"]  # no empty file for the others
    # a GPU run: the speedup over the fastest AR of both kernel modes; a sampling pass is a row of its own with the
    # greedy row's keys
    (tmp_path / "bench_online" / "rr.json").write_text(json.dumps(
        {"overall": {"mal": 2.0, "speedup": 1.5, "speedup_vs_fastest_ar": 1.25,
                     "at_temperature": {"0.7": {"mal": 1.75, "speedup": 1.125, "tokens_per_s": 9.0,
                                                "speedup_vs_fastest_ar": 0.75, "cycle_ms": 2.0}}}}))
    run_report(params, root=tmp_path)
    assert json.loads((head / "online" / "rr.json").read_text()) == {
        "mal": 2.0, "speedup": 1.5, "speedup_vs_fastest_ar": 1.25}
    assert json.loads((head / "online" / "rr@t0.7.json").read_text()) == {
        "mal": 1.75, "speedup": 1.125, "tokens_per_s": 9.0, "speedup_vs_fastest_ar": 0.75}
    assert json.loads((head / "dmtd" / "bidir_refresh.json").read_text()) == {
        "perplexity": 2.5, "accuracy": 0.5, "tokens_per_s": 40.0, "speedup": 2.0}
    assert json.loads((head / "data.json").read_text()) == {}  # no regenerate / cache stats here
    assert sorted(p.name for p in head.iterdir()) == ["concurrency", "data.json", "dmtd", "offline", "online",
                                                      "reranker"]


def test_report_headline_files_follow_params(tmp_path):
    """A variant dropped from params.yaml, or a concern of an older layout, leaves no stale file or folder behind
    (dvc metrics show lists files)."""
    stale = [tmp_path / "metrics" / "offline" / "gone.json", tmp_path / "metrics" / "draft" / "baseline.json"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    params = tmp_path / "params.yaml"
    params.write_text("variants:\n  baseline: {}\ndmtd:\n  variants: []\n")
    run_report(params, root=tmp_path)
    assert not any(path.exists() for path in stale) and not (tmp_path / "metrics" / "draft").exists()
    assert (tmp_path / "metrics" / "offline" / "baseline.json").is_file()


def test_data_metrics_keep_the_throughput_the_answers_were_made_at(tmp_path):
    """regenerate_tokens_per_s: new tokens over seconds summed over the splits, from each split's last_measured
    (the run that made its answers, carried by a rerun that generated nothing) or, in a stats file without it,
    its own generation; a split with neither adds nothing."""
    params = tmp_path / "params.yaml"
    params.write_text("variants: {}\n")
    (tmp_path / "cache_stats.json").write_text(json.dumps({"bytes_per_token": 4000.0, "tokens_per_s": 800.0}))
    (tmp_path / "regenerate_stats.json").write_text(json.dumps(
        {"splits": {"train": {"new_tokens_now": 300, "generate_seconds": 2.0},
                    "eval": {"new_tokens_now": 100, "generate_seconds": 2.0}}}))
    run_report(params, root=tmp_path)
    assert json.loads((tmp_path / "metrics" / "data.json").read_text()) == {
        "regenerate_tokens_per_s": 100.0, "cache_tokens_per_s": 800.0, "bytes_per_token": 4000.0}
    kept = {"new_tokens_now": 0, "generate_seconds": 0.0, "tokens_per_s": None}
    (tmp_path / "regenerate_stats.json").write_text(json.dumps(
        {"splits": {"train": {**kept, "last_measured": {"new_tokens": 250, "generate_seconds": 4.0}},
                    "eval": {**kept, "last_measured": {"new_tokens": 50, "generate_seconds": 1.0}},
                    "extra": kept}}))
    run_report(params, root=tmp_path)
    assert json.loads((tmp_path / "metrics" / "data.json").read_text())["regenerate_tokens_per_s"] == 60.0
    (tmp_path / "regenerate_stats.json").write_text(json.dumps({"splits": {"train": kept}}))
    run_report(params, root=tmp_path)
    assert "regenerate_tokens_per_s" not in json.loads((tmp_path / "metrics" / "data.json").read_text())


def test_report_compares_memory_with_the_reference_at_the_same_post_error_anchors(tmp_path):
    """Draft Memory's post_error/... keys (the draft with memory) and post_error/baseline/... (the baseline on the
    same anchors) become two rows of one table; the main table keeps the random-anchor figures."""
    (tmp_path / "eval_offline").mkdir()
    (tmp_path / "eval_offline" / "draft_memory.json").write_text(json.dumps(
        {"tau_prob": 2.5, "accept_rate@0": 0.75, "post_error/tau_prob": 1.75, "post_error/accept_rate@0": 0.5,
         "post_error/accept_rate@1": 0.25, "post_error/ce": 2.0, "post_error/num_blocks": 12,
         "post_error/baseline/tau_prob": 1.5, "post_error/baseline/accept_rate@0": 0.375,
         "post_error/baseline/accept_rate@1": 0.125, "post_error/baseline/ce": 2.25,
         "post_error/baseline/num_blocks": 12}))
    (tmp_path / "eval_offline" / "baseline.json").write_text(json.dumps({"tau_prob": 2.25}))
    params = tmp_path / "params.yaml"
    params.write_text("variants:\n  baseline: {}\n  draft_memory: {}\n")
    run_report(params, root=tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "| draft_memory | 2.500 | 0.750 |" in text and "| baseline | 2.250 |" in text
    table = text.split("## Offline metrics at a draft's own anchor sets")[1].split("## Parallel DMTD")[0]
    header = "| variant | anchors | measured draft | tau_prob | accept_rate@0 | accept_rate@1 | ce | num_blocks |"
    assert header in table
    assert "| draft_memory | post_error | draft_memory | 1.750 | 0.500 | 0.250 | 2.000 | 12 |" in table
    assert "| draft_memory | post_error | baseline | 1.500 | 0.375 | 0.125 | 2.250 | 12 |" in table
    assert "\n| baseline |" not in table  # no row of its own for a draft without extra anchor sets
    head = json.loads((tmp_path / "metrics" / "offline" / "draft_memory.json").read_text())
    assert head == {"tau_prob": 2.5, "accept_rate@0": 0.75, "post_error/tau_prob": 1.75,
                    "post_error/baseline/tau_prob": 1.5}
    assert json.loads((tmp_path / "metrics" / "offline" / "baseline.json").read_text()) == {"tau_prob": 2.25}


REPO = Path(__file__).resolve().parent.parent
WIDEST = 160  # characters: a per-concern table of `dvc metrics show` must fit a wide terminal


@pytest.mark.workspace("reports/metrics, the pipeline's headline metrics, and its dvc.yaml / params.yaml")
def test_each_concern_of_the_committed_metrics_is_a_narrow_dvc_table(tmp_path):
    """`dvc metrics show reports/metrics/<concern>` on the default pipeline's committed headline metrics, through
    DVC (its own table layout): every concern has rows, none is wider than WIDEST, and a concern's columns are its
    own keys (no other concern's key in the table)."""
    (tmp_path / "reports").mkdir()
    shutil.copytree(REPO / "reports" / "metrics", tmp_path / "reports" / "metrics")
    for name in ("dvc.yaml", "params.yaml"):  # the `metrics:` entry as the pipeline declares it (stages need params)
        shutil.copy(REPO / name, tmp_path / name)
    env = dict(os.environ, DVC_NO_ANALYTICS="1", COLUMNS="400")
    dvc = [sys.executable, "-m", "dvc"]
    subprocess.run(dvc + ["init", "-q", "--no-scm"], cwd=tmp_path, env=env, check=True)
    concerns = sorted(p.name for p in (tmp_path / "reports" / "metrics").iterdir())
    assert {"offline", "online", "dmtd", "data.json"} <= set(concerns)
    keys = {}
    for c in concerns:
        path = tmp_path / "reports" / "metrics" / c
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        keys[c] = set().union(*(json.loads(f.read_text()) for f in files))
        out = subprocess.run(dvc + ["metrics", "show", f"reports/metrics/{c}"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, check=True).stdout
        lines = out.splitlines()
        assert lines[0].split() == ["Path", *sorted(keys[c])], out  # DVC read every file (it exits 0 when not)
        assert [ln.split()[0] for ln in lines[1:]] == [str(f.relative_to(tmp_path)) for f in files]
        assert max(map(len, lines)) <= WIDEST, f"dvc metrics show reports/metrics/{c}:\n{out}"
    merged = set().union(*keys.values())
    assert "tau_prob" in merged and "mal" in merged and len(merged) <= 20, sorted(merged)
