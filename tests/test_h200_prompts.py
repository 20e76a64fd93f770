"""The H200 prompt snapshot (data/prompts_h200, made by scripts/make_h200_prompts.py) and the profile's mix: every
domain trains and is held out, no benchmark test split and no evaluated problem reaches training, and the
profile's prepare section draws its sizes from the snapshot."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml

from dspark_core.data.prompts import DOMAINS, PrepareConfig, check_no_overlap, iter_jsonl, select_splits
from dspark_core.data.sources import GSM_GROUP, REGISTRY, iter_gsm8k_symbolic, iter_snapshot, normalize_text
from dspark_core.profiles import apply_profile

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "prompts_h200"
pytestmark = pytest.mark.workspace("data/prompts_h200, the snapshot in git, and the project's params.yaml")
INSTRUCTION_START = "\nSolve the following math problem step by step."


def _split() -> dict:
    return json.loads((DATA / "split.json").read_text())


def _pools() -> dict[str, list]:
    return {name: list(iter_snapshot(DATA, name)) for name in _split()["sources"]}


def _more() -> dict[str, list]:
    """The train-only files that continue two registry sources (``jsonl:`` sources of the profile)."""
    return {name: list(iter_jsonl(DATA / name)) for name in _split()["more"]}


def test_snapshot_covers_every_domain_with_the_recorded_sizes():
    split, pools = _split(), _pools()
    assert split["sources"] == {n: len(ps) for n, ps in pools.items()}
    assert sorted(p.name for p in DATA.glob("*.jsonl")) == sorted([f"{n}.jsonl" for n in pools] + ["eval_gsm8k.jsonl"])
    assert {REGISTRY[n].domain for n in pools if not REGISTRY[n].eval_only} == set(DOMAINS)   # every domain trains
    assert {REGISTRY[n].domain for n in pools if REGISTRY[n].eval_only} == set(DOMAINS) - {"chat"}  # chat: held out
    assert split["sources"]["gsm8k_symbolic"] == 30 and split["sources"]["aime2025"] == 30
    assert split["sources"]["humaneval"] == 164 and split["sources"]["project_euler"] >= 238
    more = _more()
    assert split["more"] == {n: len(ps) for n, ps in more.items()} and all(len(ps) > 1000 for ps in more.values())
    assert sorted(p.name for p in (DATA / "more").iterdir()) == sorted(Path(n).name for n in more)
    chat, math = more["more/sharegpt_more.jsonl.gz"], more["more/gsm_symbolic_variants_more.jsonl.gz"]
    assert {p.domain for p in chat} == {"chat"} and {p.domain for p in math} == {"math_word"}
    # they go on from their registry source: no text of it again
    for extra, name in ((chat, "sharegpt"), (math, "gsm_symbolic_variants")):
        assert not {normalize_text(p.turns[0]) for p in extra} & {normalize_text(p.turns[0]) for p in pools[name]}


def test_no_test_split_and_no_evaluated_problem_is_trained_on():
    split, pools = _split(), _pools()
    eval_ids, train_ids = set(split["eval_template_ids_orig"]), set(split["train_template_ids_orig"])
    assert not eval_ids & train_ids and len(eval_ids | train_ids) == 100
    more = _more()
    train = [p for n, ps in pools.items() if not REGISTRY[n].eval_only for p in ps]
    train += [p for ps in more.values() for p in ps]
    evals = [p for n, ps in pools.items() if REGISTRY[n].eval_only for p in ps]
    check_no_overlap(train, evals)                                # ids, texts, normalised texts, problems, containment
    gsm_eval = pools["gsm8k_symbolic"]
    assert {p.group for p in gsm_eval} == {GSM_GROUP.format(i) for i in eval_ids}
    assert {p.group for p in pools["gsm_symbolic_variants"]} <= {GSM_GROUP.format(i) for i in train_ids}
    assert {p.group for p in more["more/gsm_symbolic_variants_more.jsonl.gz"]} <= {GSM_GROUP.format(i)
                                                                                for i in train_ids}
    # no GSM8K test question (of any template) is in the variants, and no held-out one inside any training prompt
    originals = {normalize_text(p.turns[0]) for p in iter_gsm8k_symbolic(with_instruction=False)}
    assert not any(normalize_text(p.turns[0].split(INSTRUCTION_START)[0]) in originals
                   for p in pools["gsm_symbolic_variants"] + more["more/gsm_symbolic_variants_more.jsonl.gz"])
    questions = [p.turns[0].split(INSTRUCTION_START)[0] for p in gsm_eval]
    assert all(INSTRUCTION_START in p.turns[0] for p in gsm_eval)
    assert not any(q in p.turns[0] for q in questions for p in train)
    # bench_decode's copy of the 30 held-out questions
    assert [p.turns for p in iter_jsonl(DATA / "eval_gsm8k.jsonl")] == [p.turns for p in gsm_eval]


@pytest.mark.parametrize("source", ["gsm8k_symbolic", "humaneval"])
def test_snapshot_keeps_the_eval_only_refusal(source):
    with pytest.raises(ValueError, match=f"'{source}' is eval-only"):
        PrepareConfig.from_dict({"snapshot_dir": str(DATA), "train": source})


def test_profile_mixes_the_snapshot(tmp_path, monkeypatch):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    apply_profile("h200_smollm2", params)
    prep = yaml.safe_load(params.read_text())["prepare"]
    monkeypatch.chdir(tmp_path)                                   # the snapshot's relative path: the repo root

    def no_package(name, *_):  # the device has no data package: the snapshot alone must do
        raise AssertionError(f"package {name} read")
    monkeypatch.setattr("dspark_core.data.sources.package_dir", no_package)
    cfg = PrepareConfig.from_dict({**prep, "out_dir": str(tmp_path / "prompts")})
    assert cfg.n_train == 19234 and cfg.n_eval_per_domain == 30
    splits = select_splits(cfg)
    assert Counter(p.domain for p in splits["train"]) == {"chat": 7654, "math_word": 8111, "code": 3216,
                                                          "competition_math": 253}
    # the earlier 7,920-prompt mix: its train prompts are all drawn again, and its eval sets are the same prompts
    # (the drafts trained then were trained on no eval prompt of now)
    old_mix = [{"source": s, "weight": w} for s, w in (("sharegpt", 45), ("gsm_symbolic_variants", 30), ("codeio", 22),
                                                        ("project_euler", 3))]
    old = select_splits(PrepareConfig.from_dict({**prep, "train": old_mix, "n_train": 7920}))
    assert Counter(p.domain for p in old["train"]) == {"chat": 3564, "math_word": 2376, "code": 1742,
                                                       "competition_math": 238}
    assert [p.id for p in old["eval"]] == [p.id for p in splits["eval"]]
    assert {p.id for p in old["train"]} <= {p.id for p in splits["train"]}
    assert Counter(p.domain for p in splits["eval"]) == {d: 30 for d in DOMAINS}
    assert Counter(p.source for p in splits["eval"]) == {"gsm8k_symbolic": 30, "aime2025": 30, "humaneval": 30,
                                                         "sharegpt": 30}
    with pytest.raises(ValueError, match="gsm8k_instruction=False but the snapshot .* was written with True"):
        select_splits(PrepareConfig.from_dict({**prep, "gsm8k_instruction": False}))
    tiny = select_splits(PrepareConfig.from_dict({**prep, "n_train": 24, "n_eval_per_domain": 1}))  # DSPARK_TINY
    assert len(tiny["train"]) == 24 and Counter(p.domain for p in tiny["eval"]) == {d: 1 for d in DOMAINS}
