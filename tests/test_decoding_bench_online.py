"""bench_online library end to end on a tiny saved target and a DSpark draft trained a few steps on the target's
own answers to the benchmark prompts, so it is partly right (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from _decoding_utils import fit_draft_to_target
from _decoding_utils import one_thread  # noqa: F401 (fixture)
import yaml

from dspark_core.decoding.ar import ARDecoder
from dspark_core.bench.online import (BenchOnlineConfig, DatasetRun, decode_dataset, load_prompt_sets,
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
                   assistant_layers=2, peers=["hf_generate", "assisted", "prompt_lookup"], out_dir="reports/bo")
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


def test_run_bench_online_stage(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    metrics = run_bench_online_stage("params.yaml", "baseline")
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
    stage's greedy run identical to AR with some tokens accepted, and a sampling pass beside it."""
    from dspark_core.bench.online import run_bench_online

    monkeypatch.chdir(workdir)
    model, tok = load_target("data/target")
    cfg = BenchOnlineConfig.from_dict(dict(datasets=["jsonl:prompts.jsonl"], max_prompts=2, max_new_tokens=12,
                                           max_turns=2, max_len=256, peers=[], also_temperatures=[0.7],
                                           confidence_threshold=0.5))
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
