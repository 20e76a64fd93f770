"""bench_online library end to end on a tiny saved target and a DSpark draft trained a few steps on the target's
own answers to the benchmark prompts, so it is partly right (CPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from _decoding_utils import fit_draft_to_target
from _decoding_utils import one_thread  # noqa: F401 (fixture)
import yaml

from dspark_core.decoding.ar import ARDecoder
from dspark_core.bench.concurrency import LEVEL_KEYS
from dspark_core.bench.online import (BenchOnlineConfig, DatasetRun, decode_dataset, level_kernels, load_prompt_sets,
                                      read_jsonl_prompts, run_bench_online_stage, stop_ids_of, summarize)
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.config import ParamsError
from dspark_core.checkpoint import save_draft
from dspark_core.draft import DraftConfig, DSparkDraft
from dspark_core.decoding.types import GenerationResult
from dspark_core.target import load_target
from dspark_core.testing import save_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
FIT_STEPS = 20  # training steps of the draft on the target's answers: partly right (1 < MAL < 5)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A project dir laid out as the DAG leaves it: data/target, data/train/baseline/final, prompts, params."""
    root = tmp_path_factory.mktemp("bench")
    target_dir = save_tiny_target(root / "data" / "target", "qwen3")
    model, tok = load_target(target_dir)
    conversations = [["What is 2 + 3?", "And times 4?"], ["Name a colour."]]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"turns": t}) for t in conversations) + "\n")
    section = dict(datasets=["jsonl:prompts.jsonl"], max_prompts=2, max_new_tokens=12, max_turns=2, max_len=256,
                   assistant_layers=2, peers=["hf_generate", "assisted", "prompt_lookup"], out_dir="reports/bo",
                   concurrency=[1, 2])
    (root / "params.yaml").write_text(yaml.safe_dump({"bench_online": section}))
    torch.manual_seed(0)
    cfg = DraftConfig(num_draft_layers=1, block_size=4, mask_token_id=259, num_anchors=4, markov_rank=8)
    draft = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight,
                        model.get_output_embeddings().weight, aux_layer_ids=(1, 3))
    # The target's own greedy answers to the benchmark's turns (AR in the stage's place, for both decoders), the
    # draft trained a few steps on them: partly right, so the stage's "identical" covers accepted and rejected tokens
    ar = ARDecoder(TargetRunner(model, max_len=256, aux_layer_ids=draft.aux_layer_ids))
    run = decode_dataset(conversations, tok, ar, ar, BenchOnlineConfig.from_dict(section), stop_ids_of(model, tok))
    fit_draft_to_target(draft, model, run.prompts, [r.tokens for r in run.ar], steps=FIT_STEPS)
    save_draft(root / "data" / "train" / "baseline" / "final", draft)
    return root


@pytest.fixture(scope="module")
def stage_metrics(workdir):
    """The stage ``bench_online@baseline`` run once in ``workdir``: its metrics."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        return run_bench_online_stage("params.yaml", "baseline")
    finally:
        os.chdir(cwd)


def test_run_bench_online_stage(workdir, stage_metrics, monkeypatch):
    monkeypatch.chdir(workdir)
    metrics = stage_metrics
    m = metrics["jsonl:prompts.jsonl"]
    assert m["num_generations"] == 3  # two turns + one turn
    assert m["identical"] is True
    assert 1.0 < m["mal"] < 5.0, m  # block 4: some draft tokens accepted, some blocks rejected (rolled back)
    assert 1.0 <= m["mal"] <= 5.0 and m["tokens_per_s"] > 0 and m["ar_tokens_per_s"] > 0 and m["speedup"] > 0
    assert sum(m["proposal_length_hist"].values()) == m["cycles"]
    assert set(m["peers"]) == {"hf_generate", "assisted", "prompt_lookup"}
    assert all(row["identical"] for row in m["peers"].values()), m["peers"]
    assert metrics["overall"]["cycles"] == m["cycles"]
    assert json.loads((workdir / "reports/bo/baseline.json").read_text())["overall"]["mal"] == metrics["overall"]["mal"]
    for png in ("accept_rate.png", "proposal_lengths.png"):
        assert (workdir / "reports/bo/baseline" / png).stat().st_size > 1000
    with pytest.raises(ValueError, match="no trained draft"):
        run_bench_online_stage("params.yaml", "other")


def test_also_temperatures_adds_a_sampling_pass(workdir, monkeypatch):
    """``also_temperatures: [0.7]`` beside the greedy run: the same prompts again, AR and speculative, sampling
    (the reference engine with rejection sampling), per dataset and overall; the greedy figures unchanged."""
    from dspark_core.bench.online import run_bench_online

    monkeypatch.chdir(workdir)
    cfg = BenchOnlineConfig.from_dict(dict(datasets=["jsonl:prompts.jsonl"], max_prompts=2, max_new_tokens=12,
                                           max_turns=2, max_len=256, peers=[], also_temperatures=[0.7]))
    sets = load_prompt_sets("", cfg.datasets, cfg.max_prompts)
    metrics = run_bench_online("data/target", "data/train/baseline/final", sets, cfg)
    greedy = metrics["jsonl:prompts.jsonl"]
    hot = greedy["at_temperature"]["0.7"]
    assert hot["engine"] == "reference" and 1.0 <= hot["mal"] <= 5.0
    assert hot["tokens_per_s"] > 0 and hot["ar_tokens_per_s"] > 0 and hot["speedup"] > 0
    assert metrics["overall"]["at_temperature"]["0.7"]["mal"] == hot["mal"]  # one dataset
    assert greedy["identical"] is True and 1.0 < greedy["mal"] < 5.0
    with pytest.raises(ParamsError, match=r"also_temperatures: 0(\.0)? is not a temperature > 0"):
        BenchOnlineConfig.from_dict(dict(also_temperatures=[0]))


def test_dflash_draft_through_the_stage(workdir, monkeypatch):
    """The dflash variant (no Markov head, no confidence head), trained a few steps on the target's answers: the
    stage's greedy run identical to AR with some tokens accepted, a sampling pass beside it, and its concurrency
    level under ``proposal: confidence`` (fixed blocks: nothing to schedule by)."""
    from dspark_core.bench.online import run_bench_online

    monkeypatch.chdir(workdir)
    model, tok = load_target("data/target")
    cfg = BenchOnlineConfig.from_dict(dict(datasets=["jsonl:prompts.jsonl"], max_prompts=2, max_new_tokens=12,
                                           max_turns=2, max_len=256, peers=[], also_temperatures=[0.7],
                                           confidence_threshold=0.5, concurrency=[2], proposal="confidence"))
    sets = load_prompt_sets("", cfg.datasets, cfg.max_prompts)
    torch.manual_seed(0)
    dcfg = DraftConfig(num_draft_layers=1, block_size=4, mask_token_id=259, num_anchors=4, markov_head="none",
                       confidence_head=False)
    draft = DSparkDraft(dcfg, model.config, model.get_input_embeddings().weight,
                        model.get_output_embeddings().weight, aux_layer_ids=(1, 3))
    ar = ARDecoder(TargetRunner(model, max_len=256, aux_layer_ids=draft.aux_layer_ids))
    run = decode_dataset(sets["jsonl:prompts.jsonl"], tok, ar, ar, cfg, stop_ids_of(model, tok))
    fit_draft_to_target(draft, model, run.prompts, [r.tokens for r in run.ar], steps=FIT_STEPS)
    save_draft(workdir / "data" / "train" / "dflash" / "final", draft)
    metrics = run_bench_online("data/target", "data/train/dflash/final", sets, cfg)
    m = metrics["jsonl:prompts.jsonl"]
    assert m["identical"] is True and 1.0 < m["mal"] < 5.0, m  # no confidence head: the 0.5 threshold cuts nothing
    assert 1.0 <= m["at_temperature"]["0.7"]["mal"] <= 5.0
    # proposal: confidence has no confidence head to schedule by: the levels verify fixed blocks, and say so
    assert metrics["setup"]["proposal"] == "fixed"
    assert "draft.kind 'baseline' has no confidence head" in metrics["setup"]["proposal_note"]
    row = m["concurrency"]["2"]
    assert row["proposal"] == "fixed" and row["identical"] is True and row["mean_verify_tokens"] == 2 * 5


def test_summarize_rates():
    """accept_rate@i among cycles that proposed slot i; cond_ among those that also reached it."""
    res = GenerationResult(tokens=list(range(9)), cycles=4, accepted_per_cycle=[0, 2, 3, 1],
                           proposal_lengths=[3, 3, 3, 1], draft_s=[0.1] * 4, verify_s=[0.2] * 4,
                           decode_s=1.0)
    m = summarize(DatasetRun(prompts=[[1]], spec=[res], ar=[res]), block_size=3, greedy=True)
    assert m["mal"] == (1 + 3 + 4 + 2) / 4
    assert m["accept_rate@0"] == 3 / 4 and m["accept_rate@1"] == 2 / 3 and m["accept_rate@2"] == 1 / 3
    assert m["cond_accept_rate@1"] == 2 / 2 and m["cond_accept_rate@2"] == 1 / 2
    assert m["proposal_length_hist"] == {"0": 0, "1": 1, "2": 0, "3": 3}
    assert m["draft_ms"] == pytest.approx(100.0) and m["verify_ms"] == pytest.approx(200.0)
    assert m["speedup"] == 1.0 and m["identical"] is True


def test_config_and_prompt_errors(tmp_path):
    with pytest.raises(ParamsError, match="peers"):
        BenchOnlineConfig.from_dict({"peers": ["vllm"]})
    with pytest.raises(ParamsError, match="temperature"):
        BenchOnlineConfig.from_dict({"temperature": -1.0})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": []}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_prompt_sets("unused", [f"jsonl:{bad}"], 4)
    with pytest.raises(ValueError, match="not found"):
        load_prompt_sets(tmp_path / "none.parquet", ["gsm8k"], 4)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"turns": ["a"]}\n{"turns": ["b"\n')
    with pytest.raises(ValueError, match="broken.jsonl: line 2: not JSON"):
        read_jsonl_prompts(broken)


def test_jsonl_prompts_keep_unicode_line_separators(tmp_path):
    """U+2028 / U+0085 inside a JSON string are valid JSON (ShareGPT has them): one record per "\\n" line."""
    path = tmp_path / "p.jsonl"
    turns = ["one\u2028two", "three\x85four"]
    path.write_text("".join(json.dumps({"turns": [t]}, ensure_ascii=False) + "\n" for t in turns), encoding="utf-8")
    assert [r["turns"] for r in read_jsonl_prompts(path)] == [[t] for t in turns]


def test_kernels_setting_is_resolved_with_reasons():
    from dspark_core.bench.online import _resolve_kernels
    from dspark_core.testing import tiny_model

    model = tiny_model("qwen3")
    cpu = torch.device("cpu")
    assert _resolve_kernels(BenchOnlineConfig(), model, cpu) is False  # auto: never on CPU
    assert _resolve_kernels(BenchOnlineConfig(kernels=False), model, cpu) is False
    with pytest.raises(ValueError, match="bench_online.kernels: true needs a CUDA device"):
        _resolve_kernels(BenchOnlineConfig(kernels=True), model, cpu)


def test_speedup_against_the_fastest_ar_of_all_modes():
    """``add_fastest_ar``: per dataset and overall, the AR tokens/s of each small-GEMM mode, the fastest, and
    the speculative tokens/s over it -- against a brute-force count of tokens and seconds."""
    from dspark_core.bench.online import add_fastest_ar

    def gen(n, s):
        return GenerationResult(tokens=list(range(n)), cycles=n, decode_s=s)

    by_mode = {"a": {"mma": [gen(11, 1.0), gen(21, 1.0)], "fma": [gen(11, 0.5), gen(21, 0.5)]},
               "b": {"mma": [gen(41, 1.0)], "fma": [gen(41, 2.0)]}}
    metrics = {"a": {"tokens_per_s": 60.0}, "b": {"tokens_per_s": 80.0}, "overall": {"tokens_per_s": 70.0}}
    add_fastest_ar(metrics, by_mode)
    assert metrics["a"]["ar_tokens_per_s_by_mode"] == {"mma": 15.0, "fma": 30.0}
    assert metrics["a"]["fastest_ar_mode"] == "fma" and metrics["a"]["speedup_vs_fastest_ar"] == 2.0
    assert metrics["b"]["fastest_ar_mode"] == "mma" and metrics["b"]["speedup_vs_fastest_ar"] == 2.0
    # overall: mma 70 tokens / 3 s, fma 70 tokens / 3 s -> equal; either is the fastest at 70/3
    assert metrics["overall"]["fastest_ar_tokens_per_s"] == pytest.approx(70 / 3)
    assert metrics["overall"]["speedup_vs_fastest_ar"] == pytest.approx(3.0)
    # a sampling pass: its rows (``at_temperature``) against its own AR of each mode, the greedy rows untouched
    hot = {name: {"tokens_per_s": 45.0} for name in metrics}
    for name, row in metrics.items():
        row["at_temperature"] = {"0.7": hot[name]}
    add_fastest_ar({name: row["at_temperature"]["0.7"] for name, row in metrics.items()},
                   {"a": {"mma": [gen(10, 1.0)], "fma": [gen(31, 1.0)]}, "b": {"mma": [gen(9, 1.0)]}})
    assert hot["a"]["fastest_ar_mode"] == "fma" and hot["a"]["speedup_vs_fastest_ar"] == 1.5
    assert hot["b"]["ar_tokens_per_s_by_mode"] == {"mma": 8.0} and hot["b"]["speedup_vs_fastest_ar"] == 5.625
    assert hot["overall"]["fastest_ar_tokens_per_s"] == 30.0 and hot["overall"]["fastest_ar_mode"] == "fma"
    assert metrics["a"]["speedup_vs_fastest_ar"] == 2.0




def _check_level(row: dict, c: int, block: int, requests: int) -> None:
    """A level's row: every key, the definitions that tie them (speedup over the AR it names; fixed proposals verify
    every row's whole block), and a partly right draft."""
    assert set(row) == set(LEVEL_KEYS) and row["concurrency"] == c and row["requests"] == requests
    assert 1.0 < row["mal"] < block + 1, row
    assert row["speedup"] == pytest.approx(row["tokens_per_s"] / row["ar_tokens_per_s"])
    assert 1.0 <= row["mean_active_rows"] <= c
    assert min(row["tokens_per_s"], row["request_tokens_per_s"], row["cycle_ms"], row["ar_step_ms"]) > 0
    if row["proposal"] == "fixed":
        assert row["mean_verify_tokens"] == c * (block + 1)


def test_concurrency_levels_through_the_stage(stage_metrics):
    """``bench_online.concurrency: [1, 2]``: every dataset (and overall) at both levels, speculative and AR on the
    same request rows. Greedy: every request equals its AR output at that level and decoded alone, with the main
    run's acceptance (the same MAL); the first turns of both conversations are served at once at level 2; the
    speedup at level 1 is over the fastest AR at one request, at level 2 over the batched AR."""
    metrics = stage_metrics
    assert metrics["setup"]["concurrency"] == [1, 2] and metrics["setup"]["proposal"] == "fixed"
    assert metrics["setup"]["level_kernels"] == {"1": False, "2": False}  # CPU: no Triton kernels
    for name in ("jsonl:prompts.jsonl", "overall"):
        levels = metrics[name]["concurrency"]
        assert sorted(levels) == ["1", "2"]
        for c, row in levels.items():
            _check_level(row, int(c), 4, requests=3)
            assert row["proposal"] == "fixed" and row["identical"] is True and row["identical_to_alone"] is True
            assert row["mal"] == metrics[name]["mal"]  # the reference engine's decisions, request by request
        one, two = levels["1"], levels["2"]
        assert one["mean_active_rows"] == 1.0 and two["mean_active_rows"] > 1.0
        assert one["ar_tokens_per_s"] == max(one["batched_ar_tokens_per_s"], metrics[name]["ar_tokens_per_s"])
        assert one["ar_baseline"] in ("rows", "ar")
        assert two["ar_baseline"] == "rows" and two["ar_tokens_per_s"] == two["batched_ar_tokens_per_s"]
    assert level_kernels(True, 1) and level_kernels(True, 2) and not level_kernels(False, 1)
    assert level_kernels(True, 1, batch_invariant=False) and not level_kernels(True, 2, batch_invariant=False)


def _bench(workdir, draft: str = "baseline", **over):
    from dspark_core.bench.online import run_bench_online

    cfg = BenchOnlineConfig.from_dict(dict(datasets=["jsonl:prompts.jsonl"], max_prompts=2, max_new_tokens=12,
                                           max_turns=2, max_len=256, peers=[], **over))
    sets = load_prompt_sets("", cfg.datasets, cfg.max_prompts)
    return run_bench_online("data/target", f"data/train/{draft}/final", sets, cfg)


def test_levels_with_proposals_scheduled_by_confidence(workdir, monkeypatch):
    """``proposal: confidence`` with a verify budget at concurrency 2 (no level 1: decoded alone = the main run's
    AR): greedy output still every request's AR output; each cycle verifies 2 .. 6 tokens."""
    monkeypatch.chdir(workdir)
    metrics = _bench(workdir, concurrency=[2], proposal="confidence", verify_budget=6)
    row = metrics["overall"]["concurrency"]["2"]
    assert sorted(metrics["overall"]["concurrency"]) == ["2"] and row["proposal"] == "confidence"
    _check_level(row, 2, 4, requests=3)
    assert row["identical"] is True and row["identical_to_alone"] is True
    assert 2 <= row["mean_verify_tokens"] <= 6


def test_levels_when_sampling(workdir, monkeypatch):
    """Sampling (temperature 0.7): the levels decode by exact rejection sampling; no identity to check (None)."""
    monkeypatch.chdir(workdir)
    row = _bench(workdir, temperature=0.7, concurrency=[2])["overall"]["concurrency"]["2"]
    assert row["identical"] is None and row["identical_to_alone"] is None
    assert row["requests"] == 3 and 1.0 <= row["mal"] <= 5.0 and row["tokens_per_s"] > 0 and row["speedup"] > 0


def test_concurrency_params_are_refused_with_one_line(tmp_path):
    bad = {"concurrency: 0 is not a number of request rows >= 1": dict(concurrency=[1, 0]),
           "concurrency must be a list, got 4": dict(concurrency=4),
           r"concurrency\[0\] must be an integer, got 1.5": dict(concurrency=[1.5]),
           r"concurrency: \[2, 2\] names a level twice": dict(concurrency=[2, 2]),
           "proposal must be one of fixed, confidence; got 'sometimes'": dict(proposal="sometimes"),
           r"concurrency \[1, 4\] with engine: reference: the reference engine decodes one request; set engine: "
           r"auto \(or static\), or concurrency: \[1\]": dict(engine="reference", concurrency=[1, 4]),
           r"concurrency \[1, 2\] with tree_branches: draft trees are verified at concurrency 1 only; set "
           r"concurrency: \[1\] or tree_branches: \[\]": dict(tree_branches=[[1, 1]]),
           "verify_budget and min_gain size the verify of proposal: confidence": dict(verify_budget=8),
           r"verify_budget 2 is below concurrency 4 \(every row verifies its anchor\)":
               dict(proposal="confidence", verify_budget=2, concurrency=[1, 4]),
           r"min_gain must be in \[0, 1\]": dict(proposal="confidence", min_gain=1.5)}
    for message, over in bad.items():
        with pytest.raises(ParamsError, match=message):
            BenchOnlineConfig.from_dict(over)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"bench_online": {"concurrency": [1, -4]}}))
    with pytest.raises(ParamsError, match=r"^\S*params.yaml: bench_online.concurrency: -4 is not a number"):
        BenchOnlineConfig.load(params, "bench_online")
    BenchOnlineConfig.from_dict(dict(concurrency=[], tree_branches=[[1, 1]], engine="reference"))  # no levels
    BenchOnlineConfig.from_dict(dict(concurrency=[1], tree_branches=[[1, 1]]))


def test_levels_refuse_what_the_engine_cannot_do_and_name_max_len(workdir, monkeypatch):
    """An engine that refuses the levels' setup (a sampled draft tree) and a request past the cache's end: one
    line naming the params, not a traceback from the engine."""
    from dspark_core.bench.online import chat_ids, level_engines, serve_waves
    from dspark_core.checkpoint import load_draft
    from dspark_core.errors import UserError

    monkeypatch.chdir(workdir)
    model, tok = load_target("data/target")
    draft = load_draft("data/train/baseline/final", model)
    runner = TargetRunner(model, max_len=256, aux_layer_ids=draft.aux_layer_ids)
    cfg = BenchOnlineConfig.from_dict(dict(temperature=0.7, tree_branches=[[1, 1]], concurrency=[1]))
    with pytest.raises(UserError, match=r"^bench_online.concurrency \[1\] \(level 1\): the static engine verifies "
                                        r"draft trees greedily"):
        level_engines(runner, draft, cfg, "fixed")
    convs = [["What is 2 + 3?"]]
    prompt = chat_ids(tok, [{"role": "user", "content": convs[0][0]}])
    cfg = BenchOnlineConfig.from_dict(dict(max_len=len(prompt) + 12, max_new_tokens=12, concurrency=[2]))
    runner = TargetRunner(model, max_len=cfg.max_len, aux_layer_ids=draft.aux_layer_ids, batch_size=2)
    spec, ar = level_engines(runner, draft, cfg, "fixed")
    with pytest.raises(UserError, match=rf"^bench_online.max_len={cfg.max_len} is too small for turn 0 of dataset "
                                        rf"'d' at concurrency 2: {len(prompt)} prompt tokens need"):
        serve_waves(convs, tok, spec, ar, cfg, [], "dataset 'd' at concurrency 2")
