"""The H200 SmolLM2 run (scripts/h200_spec_run.sh): its prompt files keep the held-out GSM8K problems out of
training, its profile gives valid stage params, and the script parses."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dspark_core.data.prompts import PrepareConfig, iter_jsonl
from dspark_core.data.regenerate import RegenerateConfig
from dspark_core.cache.build import CacheConfig
from dspark_core.profiles import apply_profile
from dspark_core.target import TargetConfig

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "scripts" / "h200_data"
INSTRUCTION_START = "\nSolve the following math problem step by step."


def _records(name: str) -> list[dict]:
    text = (DATA / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n") if line.strip()]  # not splitlines(): U+2028 in strings


def test_eval_problems_and_their_templates_are_never_trained_on():
    split = json.loads((DATA / "split.json").read_text())
    evals, train = _records("eval_gsm8k.jsonl"), _records("train_prompts.jsonl")
    assert len(evals) == split["eval_prompts"] == 30 and len(train) == split["train_prompts"]
    eval_ids, train_ids = set(split["eval_template_ids_orig"]), set(split["train_template_ids_orig"])
    assert not eval_ids & train_ids and len(eval_ids | train_ids) == 100
    assert {int(r["id"].rsplit("_", 1)[1]) for r in evals} == eval_ids
    # every GSM training prompt comes from a training template (ids name it)
    gsm = [r for r in train if r["id"].startswith(("gsm_symbolic_", "gsm8k_train_template_"))]
    assert len(gsm) == split["train_gsm"]
    assert all(int(r["id"].split("_")[-2]) in train_ids for r in gsm)  # ..._<template>_<k> / ..._<template>_orig
    # no eval question text inside any training prompt
    questions = [r["turns"][0].split(INSTRUCTION_START)[0] for r in evals]
    texts = [r["turns"][0] for r in train]
    assert all(INSTRUCTION_START in r["turns"][0] for r in evals)
    assert not any(q in t for q in questions for t in texts)
    assert len({r["id"] for r in train}) == len(train)


def test_prompt_files_read_as_jsonl_sources():
    assert len(list(iter_jsonl(DATA / "eval_gsm8k.jsonl"))) == 30
    assert len(list(iter_jsonl(DATA / "train_prompts.jsonl"))) > 4000


def test_profile_gives_valid_stage_params(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    apply_profile("h200_smollm2", params)
    doc = yaml.safe_load(params.read_text())
    prep = doc["prepare"]
    prep["train_sources"] = [s.replace("jsonl:", f"jsonl:{ROOT}/") for s in prep["train_sources"]]
    prep["eval_sources"] = [s.replace("jsonl:", f"jsonl:{ROOT}/") for s in prep["eval_sources"]]
    cfg = PrepareConfig.from_dict(prep)
    assert cfg.n_train == len(_records("train_prompts.jsonl")) and cfg.n_eval == 30
    assert TargetConfig.from_dict(doc["target"]).source == "gguf_file"
    regen = RegenerateConfig.from_dict(doc["regenerate"])
    assert regen.device == "cuda"
    # the 30 eval prompts first (seconds), so a time budget never leaves eval_offline without its held-out split
    assert regen.splits == CacheConfig.from_dict(doc["cache"]).splits == ("eval", "train")


def test_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    subprocess.run([bash, "-n", str(ROOT / "scripts" / "h200_spec_run.sh")], check=True)
    subprocess.run([bash, "-n", str(ROOT / "scripts" / "h200_multi_gpu_run.sh")], check=True)


def test_sampled_answers_are_merged_after_the_greedy_ones(tmp_path, monkeypatch):
    """DSPARK_REGEN_SAMPLED=1: the sampled copy's params differ only in sampling / GPU / paths, and the merged
    train split holds both answer sets (distinct ids) in a file the cache stage reads."""
    import sys

    from dspark_core.cache.source import load_regen
    from dspark_core.testing import write_regen

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import h200_regen_merge as m
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "params.yaml", "params.yaml")
    apply_profile("h200_smollm2", Path("params.yaml"))
    m.write_sampled_params()
    greedy = yaml.safe_load(Path("params.yaml").read_text())["regenerate"]
    sampled = RegenerateConfig.from_dict(yaml.safe_load(Path("params_sampled.yaml").read_text())["regenerate"])
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.device) == (0.7, 0.8, 20, "cuda:1")
    assert sampled.splits == ("train",) and sampled.out_dir != greedy["out_dir"]
    assert sampled.max_new_tokens == greedy["max_new_tokens"] and sampled.target_dir == greedy["target_dir"]
    write_regen(Path("data/regen/train.parquet"), [(5, 7), (6, 8), (4, 4)], seed=0)
    write_regen(Path("data/regen/eval.parquet"), [(5, 7)], seed=1)
    write_regen(Path("data/regen_sampled/train.parquet"), [(5, 9), (6, 3), (4, 5)], seed=2)
    m.merge()
    train = load_regen(Path("data/regen_all/train.parquet"), 64, "error")
    assert len(train.ids) == 6 and len(set(train.ids)) == 6
    assert sorted(i for i in train.ids if i.endswith("~t07")) == ["s000~t07", "s001~t07", "s002~t07"]
    assert len(load_regen(Path("data/regen_all/eval.parquet"), 64, "error").ids) == 1
