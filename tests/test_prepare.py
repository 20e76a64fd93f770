"""The `prepare` stage: sources and their domains, the weighted training mix, per-domain held-out eval sets,
eval-only sources refused for training, no train / eval overlap, disjoint splits, sizes, errors."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dspark_core.config import ParamsError
from dspark_core.data.prompts import (DOMAINS, PrepareConfig, Prompt, allocate, check_no_overlap, find_overlaps,
                                      is_held_out, iter_gsm8k_symbolic, iter_json_array, iter_jsonl, iter_sharegpt,
                                      read_prompts, run_prepare, select_splits, split_evenly, write_prompts)
from dspark_core.data.sources import (REGISTRY, ReadOptions, iter_aime2025, iter_codeio, iter_gsm8k_test,
                                      iter_gsm_symbolic_variants, iter_humaneval, iter_project_euler, normalize_text,
                                      source_info)


def _jsonl(path: Path, texts: list[str], **extra) -> Path:
    path.write_text("".join(json.dumps({"turns": [t], **extra}) + "\n" for t in texts))
    return path


def _cfg(tmp_path: Path, **kw) -> PrepareConfig:
    return PrepareConfig.from_dict({"out_dir": str(tmp_path / "prompts"), **kw})


def _one(src: str, n_train: int, n_eval: int, **kw) -> dict:
    """A config drawing train and eval from one source."""
    return dict(train=src, eval_sources={"chat": [src]}, n_train=n_train, n_eval_per_domain=n_eval, **kw)


def _check_disjoint(splits) -> None:
    """The independent check: no shared id, exact or normalised text, or upstream problem between the splits."""
    train, ev = splits["train"], splits["eval"]
    assert not {p.id for p in train} & {p.id for p in ev}
    assert not {p.turns[0] for p in train} & {t for p in ev for t in p.turns}
    assert not {normalize_text(p.turns[0]) for p in train} & {normalize_text(t) for p in ev for t in p.turns}
    assert not {p.group for p in train if p.group} & {p.group for p in ev if p.group}
    for s in (train, ev):
        assert len({p.id for p in s}) == len(s) and len({normalize_text(p.turns[0]) for p in s}) == len(s)


# ----------------------------------------------------------------------------------------------
# JSONL sources, sizes, determinism
# ----------------------------------------------------------------------------------------------
def test_same_jsonl_feeds_both_splits_disjointly(tmp_path):
    f = _jsonl(tmp_path / "q.jsonl", [f"question {i}" for i in range(30)])
    cfg = _cfg(tmp_path, **_one(f"jsonl:{f}", 20, 10))
    assert run_prepare(cfg) == {"train": 20, "eval": 10}
    splits = {s: read_prompts(tmp_path / "prompts" / f"{s}.parquet") for s in ("train", "eval")}
    _check_disjoint(splits)
    used = {p.turns[0] for s in splits.values() for p in s}
    assert used == {f"question {i}" for i in range(30)}        # 30 asked from 30: all used once
    table = pq.read_table(tmp_path / "prompts" / "train.parquet")
    assert table.column_names == ["id", "source", "domain", "group", "turns", "system", "replies"]
    assert str(table.schema.field("turns").type) == "list<element: string>"
    assert {p.source for p in splits["train"]} == {f"jsonl:{f}"}
    assert {p.domain for p in splits["train"]} == {"chat"} and {p.domain for p in splits["eval"]} == {"chat"}


def test_seed_changes_selection_and_is_deterministic(tmp_path):
    f = _jsonl(tmp_path / "q.jsonl", [f"question {i}" for i in range(40)])
    base = _one(f"jsonl:{f}", 5, 5)
    a = select_splits(_cfg(tmp_path, seed=1, **base))
    b = select_splits(_cfg(tmp_path, seed=1, **base))
    c = select_splits(_cfg(tmp_path, seed=2, **base))
    assert a == b and a != c


def test_texts_shared_by_two_sources_are_not_reused(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [f"q{i}" for i in range(6)])
    b = _jsonl(tmp_path / "b.jsonl", [f"Q{i}." for i in range(3, 9)])   # Q3..Q5: the same as q3..q5, normalised
    cfg = _cfg(tmp_path, train=f"jsonl:{b}", eval_sources={"chat": [f"jsonl:{a}"]}, n_train=3,
               n_eval_per_domain=6)
    splits = select_splits(cfg)
    _check_disjoint(splits)
    assert {p.turns[0] for p in splits["train"]} == {"Q6.", "Q7.", "Q8."}


def test_max_prompt_chars_and_multi_turn(tmp_path):
    f = tmp_path / "m.jsonl"
    rows = [{"id": "long", "turns": ["x" * 50]}] + [{"id": i, "turns": [f"t{i}", "again"]} for i in range(4)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    splits = select_splits(_cfg(tmp_path, **_one(f"jsonl:{f}", 2, 2, max_prompt_chars=10)))
    got = splits["train"] + splits["eval"]
    assert sorted(p.id for p in got) == ["m:0", "m:1", "m:2", "m:3"]
    assert all(p.turns[1] == "again" for p in got)


def test_sizes_are_shared_by_weight():
    assert split_evenly(10, 3) == [4, 3, 3]
    assert split_evenly(16, 2) == [8, 8]
    assert allocate(24, [3, 2, 2, 1]) == [9, 6, 6, 3]
    assert allocate(10, [1, 1, 1]) == split_evenly(10, 3)
    assert allocate(7, [0.5, 0, 0.5]) == [4, 0, 3]            # ties to the earlier source; weight 0: none
    assert sum(allocate(7891, [45, 33, 19, 3])) == 7891


def test_weighted_mix_of_jsonl_sources_and_domains(tmp_path):
    code = _jsonl(tmp_path / "code.jsonl", [f"write a function {i}" for i in range(40)], domain="code")
    chat = _jsonl(tmp_path / "chat.jsonl", [f"hello {i}" for i in range(40)])
    math = _jsonl(tmp_path / "math.jsonl", [f"what is {i} + {i}" for i in range(40)], domain="math_word")
    cfg = _cfg(tmp_path, train=[{"source": f"jsonl:{code}", "weight": 1}, {"source": f"jsonl:{chat}", "weight": 3},
                                {"source": f"jsonl:{math}", "weight": 0}], n_train=12,
               eval_sources={"code": [f"jsonl:{code}"], "math_word": [f"jsonl:{math}"]}, n_eval_per_domain=3)
    splits = select_splits(cfg)
    assert Counter(p.domain for p in splits["train"]) == {"chat": 9, "code": 3}
    assert Counter(p.domain for p in splits["eval"]) == {"code": 3, "math_word": 3}
    _check_disjoint(splits)
    # a bare name in the list weighs 1; a weight-0 source left out draws the same prompts
    cfg2 = dataclasses.replace(cfg, train=[f"jsonl:{code}", {"source": f"jsonl:{chat}", "weight": 3}])
    assert select_splits(cfg2) == splits


@pytest.mark.workspace("data/prompts_h200, the snapshot in git: a repo-relative jsonl: path")
def test_jsonl_paths_resolve_against_the_repo_and_without_suffix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = list(iter_jsonl("data/prompts_h200/eval_gsm8k"))   # relative to the repo root, '.jsonl' left out
    assert len(prompts) == 30 and prompts[0].source == "jsonl:data/prompts_h200/eval_gsm8k"


def test_old_list_form_of_eval_sources_still_reads(tmp_path):
    f = _jsonl(tmp_path / "q.jsonl", [f"question {i}" for i in range(12)])
    cfg = _cfg(tmp_path, train=[f"jsonl:{f}"], eval_sources=[f"jsonl:{f}"], n_train=6, n_eval=3)
    splits = select_splits(cfg)
    assert len(splits["train"]) == 6 and len(splits["eval"]) == 3
    _check_disjoint(splits)


# ----------------------------------------------------------------------------------------------
# the packaged sources
# ----------------------------------------------------------------------------------------------
def test_registry_domains_and_eval_only_splits():
    assert {s.domain for s in REGISTRY.values()} == set(DOMAINS)
    eval_only = {n for n, s in REGISTRY.items() if s.eval_only}
    assert eval_only == {"gsm8k_symbolic", "gsm8k_test", "aime2025", "humaneval"}   # benchmark test splits
    for dom in DOMAINS:   # every domain has a training source and an eval-only or held-out one
        assert any(s.domain == dom and not s.eval_only for s in REGISTRY.values()), dom


def test_packaged_sources_have_their_sizes():
    plain = list(iter_gsm8k_symbolic(with_instruction=False))
    assert len(plain) == 100 and len({p.id for p in plain}) == 100
    by_id = {p.id: p.turns[0] for p in plain}
    assert by_id["gsm8k_symbolic:473"] == ("Benny saw a 10-foot shark with 2 6-inch remoras attached to it. What "
                                          "percentage of the shark's body length is the combined length of the "
                                          "remoras?")
    assert {p.group for p in plain} == {f"gsm8k_test:{p.id.split(':')[1]}" for p in plain}
    with_instr = list(iter_gsm8k_symbolic())
    assert with_instr[0].turns[0].startswith(plain[0].turns[0] + "\n") and "\\boxed" in with_instr[0].turns[0]
    gsm8k = list(iter_gsm8k_test(with_instruction=False))
    assert len(gsm8k) == 1319 and gsm8k[473].turns[0] == by_id["gsm8k_symbolic:473"]   # line i = test index i
    aime = list(iter_aime2025())
    assert len(aime) == 30 and all("\\boxed" in p.turns[0] and p.domain == "competition_math" for p in aime)
    he = list(iter_humaneval())
    assert len(he) == 164 and "def has_close_elements" in he[0].turns[0] and he[0].domain == "code"
    euler = list(iter_project_euler())
    assert 250 <= len(euler) <= 330 and euler[0].id == "project_euler:1"
    assert euler[0].turns[0].startswith("If we list all the natural numbers below 10 that are multiples of 3 or 5, "
                                        "we get 3, 5, 6 and 9.")
    assert not any(p.id in ("project_euler:22", "project_euler:67") for p in euler)   # need data files
    codeio = list(iter_codeio())
    assert len(codeio) > 3000 and len({normalize_text(p.turns[0]) for p in codeio}) == len(codeio)
    assert "`main_solution`" in codeio[0].turns[0] and codeio[0].domain == "code"


def test_gsm_symbolic_variants_are_new_instances_of_their_template():
    originals = {p.group: normalize_text(p.turns[0].split("\n")[0])
                 for p in iter_gsm8k_symbolic(with_instruction=False)}
    it = iter_gsm_symbolic_variants(seed=0)
    first = [next(it) for _ in range(60)]
    assert len({p.group for p in first}) >= 25                      # a prefix spreads over the templates
    assert all(p.group in originals and p.domain == "math_word" and "\\boxed" in p.turns[0] for p in first)
    assert not any(normalize_text(p.turns[0].split("\n")[0]) == originals[p.group] for p in first)
    again = iter_gsm_symbolic_variants(seed=0)
    assert [next(again) for _ in range(60)] == first                # deterministic (no time-outs)


def test_sharegpt_first_turns_are_read_lazily():
    it = iter_sharegpt()
    first = [next(it) for _ in range(5)]
    assert all(p.id.startswith("sharegpt:") and p.id.endswith("_0") for p in first)
    assert first[0].turns[0].startswith("Summarize the main ideas of Jeff Walker")


def test_default_run_mixes_every_domain_and_never_trains_on_eval(tmp_path):
    """The embedded default: 24 train prompts by weight over four domains, 2 held-out prompts per domain."""
    cfg = _cfg(tmp_path)
    assert run_prepare(cfg) == {"train": 24, "eval": 8}
    splits = {s: read_prompts(tmp_path / "prompts" / f"{s}.parquet") for s in ("train", "eval")}
    _check_disjoint(splits)
    check_no_overlap(splits["train"], splits["eval"])
    assert Counter(p.source for p in splits["train"]) == {"sharegpt": 9, "gsm_symbolic_variants": 6, "codeio": 6,
                                                          "project_euler": 3}
    assert Counter(p.domain for p in splits["train"]) == {"chat": 9, "math_word": 6, "code": 6,
                                                          "competition_math": 3}
    assert Counter(p.source for p in splits["eval"]) == {"gsm8k_symbolic": 2, "aime2025": 2, "humaneval": 2,
                                                         "sharegpt": 2}
    assert Counter(p.domain for p in splits["eval"]) == {d: 2 for d in DOMAINS}
    assert not any(REGISTRY[p.source].eval_only for p in splits["train"])   # no test split reaches training
    # the held-out GSM8K problems: no variant of their template is trained on
    eval_groups = {p.group for p in splits["eval"] if p.source == "gsm8k_symbolic"}
    assert len(eval_groups) == 2 and not eval_groups & {p.group for p in splits["train"]}


def test_evaluated_problems_are_never_trained_on_in_any_form(tmp_path):
    """Eval on GSM8K test problems, train on GSM-Symbolic variants: no variant of an evaluated problem."""
    cfg = _cfg(tmp_path, train="gsm_symbolic_variants", n_train=300,
               eval_sources={"math_word": ["gsm8k_symbolic", "gsm8k_test"]}, n_eval_per_domain=60)
    splits = select_splits(cfg)
    _check_disjoint(splits)
    templates = {p.group for p in iter_gsm8k_symbolic(with_instruction=False)}
    held = {p.group for p in splits["eval"]}
    trained = {p.group for p in splits["train"]}
    assert len(held) == 60 and len(held & templates) >= 30          # one eval prompt per problem
    assert trained and trained <= templates - held                  # variants of the other templates only


# ----------------------------------------------------------------------------------------------
# refusals and the overlap check
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["gsm8k_symbolic", "gsm8k_test", "aime2025", "humaneval"])
def test_eval_only_sources_are_refused_for_training(tmp_path, source):
    with pytest.raises(ParamsError, match=rf"train: '{source}' is eval-only .*test split.* never trains"):
        _cfg(tmp_path, train=["sharegpt", source])
    with pytest.raises(ValueError, match=rf"train: '{source}' is eval-only"):
        _cfg(tmp_path, train=source, eval_sources=["sharegpt"], n_eval=2)
    with pytest.raises(ValueError, match="is eval-only"):   # weight 0 is refused as well: it has no place there
        _cfg(tmp_path, train=["sharegpt", {"source": source, "weight": 0}])


def _p(pid: str, text: str, group: str | None = None, *more: str) -> Prompt:
    return Prompt(pid, "t", (text, *more), "chat", group)


def test_overlap_check_names_every_kind_of_overlap():
    long_q = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    evals = [_p("e:1", "What is the capital of France?"), _p("e:2", long_q, "gsm8k_test:0"),
             _p("e:3", "Tell me a joke", None, "Another one about cats, please")]
    assert find_overlaps([_p("t:1", "What is 2 + 2?")], evals) == []
    cases = {
        "same id": _p("e:1", "unrelated"),
        "same text": _p("t:2", "What is the capital of France?"),
        "same normalised text": _p("t:3", "what is the CAPITAL of france"),
        "same problem 'gsm8k_test:0'": _p("t:4", "Maria sold pens to 12 friends.", "gsm8k_test:0"),
        "the eval text is inside the train text": _p("t:5", long_q + "\nAnswer in \\boxed{}."),
        "the train text is inside the eval text": _p("t:6", long_q[:-14]),
    }
    for why, t in cases.items():
        found = find_overlaps([t], evals)
        assert len(found) == 1 and found[0].endswith(why), (why, found)
    assert find_overlaps([_p("t:7", "another one about cats please")], evals)[0].endswith("same normalised text")
    with pytest.raises(ValueError, match=r"eval prompts must never be trained on.*\n  train 't:2' .* vs eval 'e:1'"):
        check_no_overlap([cases["same text"]], evals)


def test_a_train_source_that_only_repeats_eval_problems_runs_out(tmp_path):
    ev = _jsonl(tmp_path / "ev.jsonl", ["problem A", "problem B"], group="g1")
    tr = tmp_path / "tr.jsonl"
    tr.write_text("".join(json.dumps({"id": i, "turns": [f"variant {i}"], "group": "g1" if i < 5 else f"h{i}"}) + "\n"
                          for i in range(7)))
    cfg = _cfg(tmp_path, train=f"jsonl:{tr}", eval_sources={"math_word": [f"jsonl:{ev}"]}, n_train=2,
               n_eval_per_domain=1)
    splits = select_splits(cfg)
    assert {p.id for p in splits["train"]} == {"tr:5", "tr:6"} and splits["eval"][0].domain == "math_word"
    with pytest.raises(ValueError, match=r"source 'jsonl:.*tr.jsonl' has too few usable prompts.*none from an "
                                         r"evaluated problem.*ran out while filling train"):
        select_splits(dataclasses.replace(cfg, n_train=3))


def test_too_few_prompts_is_a_clear_error(tmp_path):
    f = _jsonl(tmp_path / "few.jsonl", [f"q{i}" for i in range(5)])
    cfg = _cfg(tmp_path, **_one(f"jsonl:{f}", 4, 2))
    with pytest.raises(ValueError, match=r"source 'jsonl:.*few.jsonl' has too few usable prompts.*needs 2 eval \+ 4 "
                                         r"train.*lower prepare.n_train"):
        run_prepare(cfg)
    assert not (tmp_path / "prompts").exists()
    with pytest.raises(ValueError, match=r"ran out while filling eval; lower prepare.n_eval_per_domain"):
        run_prepare(_cfg(tmp_path, **_one(f"jsonl:{f}", 1, 6)))


def test_config_errors(tmp_path):
    with pytest.raises(ParamsError, match="unknown source 'wiki'"):
        _cfg(tmp_path, train="wiki")
    with pytest.raises(ParamsError, match="n_eval_per_domain must be > 0"):
        _cfg(tmp_path, n_eval_per_domain=0)
    with pytest.raises(ParamsError, match="lists a source twice"):
        _cfg(tmp_path, eval_sources={"chat": ["jsonl:a.jsonl"], "code": ["jsonl:a.jsonl"]})
    with pytest.raises(ParamsError, match="eval_sources.chat has 2 sources but n_eval_per_domain asks for only 1"):
        _cfg(tmp_path, eval_sources={"chat": ["sharegpt", "jsonl:x.jsonl"]}, n_eval_per_domain=1)
    with pytest.raises(ParamsError, match="eval_sources: unknown domain 'poetry'"):
        _cfg(tmp_path, eval_sources={"poetry": ["sharegpt"]})
    with pytest.raises(ParamsError, match=r"eval_sources.code: 'sharegpt' is a chat source"):
        _cfg(tmp_path, eval_sources={"code": ["sharegpt"]})
    with pytest.raises(ParamsError, match="the weight of 'sharegpt' must be a number >= 0"):
        _cfg(tmp_path, train=[{"source": "sharegpt", "weight": -1}])
    with pytest.raises(ParamsError, match="at least one weight must be > 0"):
        _cfg(tmp_path, train=[{"source": "sharegpt", "weight": 0}])
    with pytest.raises(ParamsError, match=r"train: entry \{'source': 'sharegpt', 'share': 1\} is not a source name"):
        _cfg(tmp_path, train=[{"source": "sharegpt", "share": 1}])
    with pytest.raises(ParamsError, match="n_eval .* goes with a list of eval_sources"):
        _cfg(tmp_path, n_eval=4)
    with pytest.raises(ParamsError, match="asks for only 1 prompts"):
        _cfg(tmp_path, eval_sources=["sharegpt", "gsm8k_symbolic"], n_eval=1)
    with pytest.raises(ParamsError, match=r"prepare.train: unknown source 'wiki'"):
        PrepareConfig.from_dict({"train": "wiki"}, prefix="prepare.")
    with pytest.raises(ParamsError, match="must be a mapping"):
        _cfg(tmp_path, eval_sources="sharegpt")


def test_old_prompt_files_read_with_domains(tmp_path):
    import pyarrow as pa

    old = tmp_path / "old.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "source": ["gsm8k_symbolic", "jsonl:x"], "turns": [["q"], ["r"]]}), old)
    assert [(p.domain, p.group) for p in read_prompts(old)] == [("math_word", None), ("chat", None)]
    new = tmp_path / "new.parquet"
    write_prompts(new, [Prompt("a", "codeio", ("w",), "code", "codeio:1")])
    assert read_prompts(new) == [Prompt("a", "codeio", ("w",), "code", "codeio:1")]


# ----------------------------------------------------------------------------------------------
# readers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [3, 7, 1 << 20])
def test_truncated_json_array_recovers_whole_records(tmp_path, chunk):
    f = tmp_path / "t.json"
    f.write_text('[\n {"a": "héllo ✓"},\n {"b": [1, 2, {"c": "]"}]} ,{"d": "cut her', encoding="utf-8")
    assert list(iter_json_array(f, chunk_chars=chunk)) == [{"a": "héllo ✓"}, {"b": [1, 2, {"c": "]"}]}]
    f.write_text('[{"a": 1}, {"b": 2}]')
    assert list(iter_json_array(f, chunk_chars=chunk)) == [{"a": 1}, {"b": 2}]
    f.write_text('   \n [12345, 678, true, "x, y"]')
    assert list(iter_json_array(f, chunk_chars=chunk)) == [12345, 678, True, "x, y"]
    f.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(iter_json_array(f, chunk_chars=chunk))


def test_jsonl_errors_name_file_line_and_field(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty.jsonl: the file is empty"):
        list(iter_jsonl(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": ["unterminated"\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(iter_jsonl(bad))
    no_turns = tmp_path / "nt.jsonl"
    no_turns.write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match=r"nt.jsonl:1: record has no 'turns', 'messages' or 'conversations' field; "
                                         r"accepted records: "):
        list(iter_jsonl(no_turns))
    wrong = tmp_path / "w.jsonl"
    wrong.write_text('{"turns": "hi"}\n')
    with pytest.raises(ValueError, match=r"w.jsonl:1: field 'turns' must be a non-empty list"):
        list(iter_jsonl(wrong))
    dom = tmp_path / "dom.jsonl"
    dom.write_text('{"turns": ["hi"], "domain": "poetry"}\n')
    with pytest.raises(ValueError, match=r"dom.jsonl:1: field 'domain' must be one of"):
        list(iter_jsonl(dom))
    dup = _jsonl(tmp_path / "d.jsonl", ["a", "b"], id=7)
    with pytest.raises(ValueError, match=r"d.jsonl:2: duplicate id '7'"):
        list(iter_jsonl(dup))
    with pytest.raises(ValueError, match="not found"):
        list(iter_jsonl(tmp_path / "nope.jsonl"))


def test_snapshot_dir_replaces_the_packages(tmp_path):
    from dspark_core.data.sources import write_snapshot

    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "split.json").write_text(json.dumps({"read_options": {"gsm8k_instruction": True,
                                                                  "competition_instruction": True}}))
    write_snapshot(snap / "codeio.jsonl", [Prompt(f"codeio:{i}", "codeio", (f"task {i}",), "code") for i in range(9)])
    write_snapshot(snap / "humaneval.jsonl", [Prompt(f"humaneval:{i}", "humaneval", (f"def f{i}():",), "code")
                                              for i in range(5)])
    cfg = _cfg(tmp_path, snapshot_dir=str(snap), train="codeio", eval_sources={"code": ["humaneval"]},
               n_train=6, n_eval_per_domain=3)
    splits = select_splits(cfg)
    assert Counter(p.source for p in splits["train"]) == {"codeio": 6}
    assert Counter(p.source for p in splits["eval"]) == {"humaneval": 3}
    assert splits["train"][0].id.startswith("codeio:") and splits["eval"][0].domain == "code"
    with pytest.raises(ValueError, match=r"snap/sharegpt.jsonl not found: the snapshot holds no 'sharegpt'"):
        select_splits(dataclasses.replace(cfg, train="sharegpt"))


# ----------------------------------------------------------------------------------------------
# chat record shapes (records.py)
# ----------------------------------------------------------------------------------------------
SYSTEM = "You are terse."
USERS = ("What is a prime number?", "Is 9 one?", "And 11?")
REPLIES = ("A number with exactly two divisors.", "No: 3 divides it.", "Yes.")


def _openai(users=USERS, replies=REPLIES, system=SYSTEM, parts=False) -> dict:
    msgs = [{"role": "system", "content": system}] if system is not None else []
    for i, u in enumerate(users):
        msgs.append({"role": "user", "content": [{"type": "text", "text": u}] if parts else u})
        if i < len(replies):
            msgs.append({"role": "assistant", "content": replies[i]})
    return {"messages": msgs}


def _sharegpt(users=USERS, replies=REPLIES, system=SYSTEM, bot="gpt", keys=("from", "value")) -> dict:
    k, v = keys
    names = {"system": "system", "user": "human" if k == "from" else "user", "bot": bot if k == "from" else "assistant"}
    msgs = [{k: names["system"], v: system}] if system is not None else []
    for i, u in enumerate(users):
        msgs.append({k: names["user"], v: u})
        if i < len(replies):
            msgs.append({k: names["bot"], v: replies[i]})
    return {"conversations": msgs}


def _write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


SHAPES = {
    "turns": {"turns": list(USERS), "system": SYSTEM, "replies": list(REPLIES)},
    "openai": _openai(),
    "openai_text_parts": _openai(parts=True),
    "sharegpt": _sharegpt(),
    "sharegpt_chatgpt": _sharegpt(bot="chatgpt"),
    "sharegpt_bing": _sharegpt(bot="bing"),
    "sharegpt_bard": _sharegpt(bot="bard"),
    "conversations_role_content": _sharegpt(keys=("role", "content")),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_record_shape_reads_to_the_same_conversation(tmp_path, shape):
    f = _write_jsonl(tmp_path / "c.jsonl", [SHAPES[shape]])
    [p] = list(iter_jsonl(f))
    assert (p.id, p.source, p.domain, p.group) == ("c:1", f"jsonl:{f}", "chat", None)
    assert (p.turns, p.system, p.replies) == (USERS, SYSTEM, REPLIES)


def test_single_turn_no_system_and_an_unanswered_last_turn(tmp_path):
    recs = [_openai(USERS[:1], (), None), _sharegpt(USERS[:1], REPLIES[:1], None), _openai(USERS, REPLIES[:2]),
            {"messages": [{"role": "system", "content": "  "}, {"role": "user", "content": " hi "}]}]
    got = list(iter_jsonl(_write_jsonl(tmp_path / "c.jsonl", recs)))
    assert [(p.turns, p.system, p.replies) for p in got] == [
        (USERS[:1], None, ()), (USERS[:1], None, REPLIES[:1]), (USERS, SYSTEM, REPLIES[:2]), (("hi",), None, ())]


def test_one_file_mixes_shapes_ids_domains_and_groups(tmp_path):
    recs = [{"id": "a", **_openai(), "domain": "code", "group": "g1"}, _sharegpt(("Hi there",), ()),
            {"turns": ["plain"], "id": 7, "domain": "math_word"}]
    got = list(iter_jsonl(_write_jsonl(tmp_path / "mix.jsonl", recs)))
    assert [(p.id, p.domain, p.group, p.turns[0]) for p in got] == [
        ("mix:a", "code", "g1", USERS[0]), ("mix:2", "chat", None, "Hi there"), ("mix:7", "math_word", None, "plain")]


TOOL_RECORDS = [
    {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None,
                                                          "tool_calls": [{"id": "1", "function": {"name": "w"}}]},
                  {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]},
    {"messages": [{"role": "user", "content": "Weather?"}, {"role": "function", "content": "sunny"}]},
    {"messages": [{"role": "user", "content": "Weather?"}], "tools": [{"type": "function"}]},
    {"conversations": [{"from": "human", "value": "Weather?"}, {"from": "function_call", "value": "{}"},
                       {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}]},
]
IMAGE_RECORD = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                          {"type": "image_url", "image_url": {"url": "x"}}]}]}


def test_tool_and_image_conversations_are_skipped_and_counted(tmp_path):
    from collections import Counter as C

    f = _write_jsonl(tmp_path / "t.jsonl", TOOL_RECORDS + [IMAGE_RECORD] + [_openai()] * 1)
    skipped = C()
    got = list(iter_jsonl(f, skipped=skipped))
    assert [p.id for p in got] == ["t:6"] and skipped == {"tool": 4, "non_text": 1}
    only_tools = _write_jsonl(tmp_path / "only.jsonl", TOOL_RECORDS)
    assert list(iter_jsonl(only_tools)) == []          # not "empty": its records were read and skipped


BAD_RECORDS = {
    "assistant_first": ({"conversations": [{"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Hi"}]},
                        r"conversations\[0\] is an assistant turn before any user turn"),
    "assistant_after_system": ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant",
                                                                               "content": "a"}]},
                               r"messages\[1\] is an assistant turn before any user turn"),
    "unknown_role": ({"conversations": [{"from": "narrator", "value": "Once"}]},
                     r"conversations\[0\] has an unknown role 'narrator' \(roles: user / human, assistant / gpt"),
    "no_role": ({"messages": [{"content": "hi"}]}, r"messages\[0\] has no role"),
    "two_users": ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                  r"messages\[0\] and \[1\] are two user turns in a row"),
    "two_assistants": ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                     {"role": "assistant", "content": "c"}]},
                       r"messages\[2\] is an assistant turn after another \(two assistant turns in a row\)"),
    "empty_content": ({"conversations": [{"from": "human", "value": "  "}]},
                      r"conversations\[0\] \(human\) has an empty content"),
    "null_content": ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\] has an empty content"),
    "no_user_turn": ({"messages": [{"role": "system", "content": "s"}]}, r"field 'messages' holds no user turn"),
    "late_system": ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]},
                    r"messages\[1\] is a system message after the first message"),
    "empty_list": ({"messages": []}, r"field 'messages' must be a non-empty list of messages"),
    "not_a_list": ({"conversations": "hi"}, r"field 'conversations' must be a non-empty list of messages"),
    "not_an_object": ({"messages": [{"role": "user", "content": "a"}, "b"]}, r"messages\[1\] is not an object"),
    "both_fields": ({"turns": ["a"], "messages": [{"role": "user", "content": "a"}]},
                    r"record holds both 'messages' and 'turns'"),
    "bad_part": ({"messages": [{"role": "user", "content": [{"text": "a"}]}]},
                 r"messages\[0\]: a content part must be an object with a 'type'"),
    "bad_replies": ({"turns": ["a"], "replies": ["x", "y"]}, r"field 'replies' must be a list of non-empty strings, at "
                                                           r"most one a turn"),
    "bad_domain": ({**_openai(), "domain": "poetry"}, r"field 'domain' must be one of math_word"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_bad_records_are_refused_with_their_line_and_the_accepted_shapes(tmp_path, case):
    rec, msg = BAD_RECORDS[case]
    f = _write_jsonl(tmp_path / "bad.jsonl", [_openai(), rec])
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: {msg}.*; accepted records: .*'turns'.*'messages'.*"
                                         r"'conversations'.*; or set prepare.on_bad_record: skip") as e:
        list(iter_jsonl(f))
    assert "\n" not in str(e.value)
    from collections import Counter as C

    skipped = C()
    assert len(list(iter_jsonl(f, on_bad_record="skip", skipped=skipped))) == 1 and skipped == {"bad_record": 1}


def test_stage_counts_what_it_skipped(tmp_path):
    recs = TOOL_RECORDS + [BAD_RECORDS["two_users"][0]] + [_sharegpt((f"question {i}",), (f"answer {i}",))
                                                           for i in range(12)]
    f = _write_jsonl(tmp_path / "s.jsonl", recs)
    cfg = _cfg(tmp_path, **_one(f"jsonl:{f}", 6, 3), on_bad_record="skip", stats_path=str(tmp_path / "stats.json"))
    assert run_prepare(cfg) == {"train": 6, "eval": 3}
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["sources"][f"jsonl:{f}"]["skipped"] == {"bad_record": 1, "tool": 4}
    assert stats["sources"][f"jsonl:{f}"]["records"] == len(recs)
    assert stats["train"]["prompts"] == 6 and stats["train"]["with_replies"] == 6
    assert stats["eval"]["by_domain"] == {f"chat/jsonl:{f}": 3}
    with pytest.raises(ValueError, match=r"s.jsonl:5: messages\[0\] and \[1\] are two user turns in a row"):
        run_prepare(dataclasses.replace(cfg, on_bad_record="error"))


def test_skip_counts_lines_that_are_not_json_by_reason(tmp_path):
    """on_bad_record: skip skips a JSONL line that is not JSON or not UTF-8 as it skips a malformed record, each
    counted under its reason; error refuses the first one, naming its line and the skip setting."""
    good = [json.dumps(_sharegpt((f"question {i}",), (f"answer {i}",))).encode() for i in range(40)]
    lines = good[:5] + [b'{"conversations": [{"from": "human", "value": "cut'] + good[5:10] + [b"\xff\xfe not text"]
    lines += good[10:] + [json.dumps(BAD_RECORDS["two_users"][0]).encode()]
    f = tmp_path / "s.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    cfg = _cfg(tmp_path, **_one(f"jsonl:{f}", 8, 2), on_bad_record="skip", stats_path=str(tmp_path / "stats.json"))
    assert run_prepare(cfg) == {"train": 8, "eval": 2}
    source = json.loads((tmp_path / "stats.json").read_text())["sources"][f"jsonl:{f}"]
    assert source["skipped"] == {"bad_json": 1, "bad_record": 1, "not_utf8": 1} and source["records"] == 43
    with pytest.raises(ValueError, match=r"^\S+s.jsonl:6: not valid JSON \(.*\); or set prepare.on_bad_record: skip "
                                         r"to skip and count such records$"):
        run_prepare(dataclasses.replace(cfg, on_bad_record="error"))


def test_max_bad_fraction_stops_a_file_that_is_not_what_it_says(tmp_path):
    """A source whose share of bad records (skipped) is above prepare.max_bad_fraction stops the run with one line
    of counts, writing nothing; under the limit it runs."""
    recs = [_sharegpt((f"question {i}",), (f"answer {i}",)) for i in range(14)] + [{"text": f"row {i}"}
                                                                                   for i in range(6)]
    f = _write_jsonl(tmp_path / "mixed.jsonl", recs)   # 6 of 20 records of no accepted shape: 30%
    cfg = _cfg(tmp_path, **_one(f"jsonl:{f}", 4, 2), on_bad_record="skip")
    assert cfg.max_bad_fraction == 0.1
    with pytest.raises(ValueError, match=r"^prepare: jsonl:\S+mixed.jsonl: 6 of 20 records are bad \(bad_record 6; "
                                         r"30.0%\), more than prepare.max_bad_fraction 0.1: .*on_bad_record: error"):
        run_prepare(cfg)
    assert not (tmp_path / "prompts").exists()
    assert run_prepare(dataclasses.replace(cfg, max_bad_fraction=0.3)) == {"train": 4, "eval": 2}
    assert run_prepare(dataclasses.replace(cfg, max_bad_fraction=None)) == {"train": 4, "eval": 2}
    with pytest.raises(ParamsError, match=r"max_bad_fraction must be in \[0, 1\]"):
        _cfg(tmp_path, max_bad_fraction=1.5)


def test_old_source_keys_fail_with_the_train_value_they_spell(tmp_path):
    """train_mix / train_sources / holdout (sources as mapping keys, which `dvc exp run -S` cannot set) are refused
    in one line that shows the `train` value; that value, pasted into params.yaml, is the same mix."""
    import yaml

    old = {"train_mix": {"sharegpt": 3, "jsonl:data/sources/my.v2.jsonl": 1}, "holdout": {"sharegpt": 0.05}}
    with pytest.raises(ParamsError) as e:
        PrepareConfig.from_dict(old, src="params.yaml", prefix="prepare.")
    msg = str(e.value)
    assert msg.startswith("params.yaml: prepare.train_mix is not a parameter: the training mix and its holdout are one "
                          "value, prepare.train (") and "\n" not in msg
    train = yaml.safe_load(msg.split("here: train: ", 1)[1])
    assert train == [{"source": "sharegpt", "weight": 3, "holdout": 0.05},
                     {"source": "jsonl:data/sources/my.v2.jsonl", "weight": 1}]
    cfg = PrepareConfig.from_dict({"train": train})
    assert cfg.mix() == [("sharegpt", 3), ("jsonl:data/sources/my.v2.jsonl", 1)]
    assert cfg.holdouts() == {"sharegpt": 0.05}
    with pytest.raises(ParamsError, match=r"prepare.train_sources is not a parameter: .* here: train: \[\{source: "
                                          r"codeio, weight: 1\}\]$"):
        PrepareConfig.from_dict({"train_sources": ["codeio"]}, prefix="prepare.")
    with pytest.raises(ParamsError, match=r"prepare.train is a list, not a mapping of sources: train: \[\{source: "
                                          r"'jsonl:data/my.jsonl', weight: 1\}\]$"):
        PrepareConfig.from_dict({"train": {"jsonl:data/my.jsonl": 1}}, prefix="prepare.")


def test_a_source_file_outside_the_stage_deps_is_named(tmp_path, monkeypatch):
    """A jsonl: / parquet: file outside the prepare stage's dependencies in dvc.yaml gets one warning line: DVC
    will not rerun prepare when it changes. A file under data/sources/ gets none."""
    from dspark_core.data.prompts import warn_untracked_files

    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.yaml").write_text("stages:\n  prepare:\n    cmd: x\n    deps: [data/sources]\n")
    inside = _jsonl((tmp_path / "data" / "sources").mkdir(parents=True) or tmp_path / "data/sources/in.jsonl", ["a"])
    outside = _jsonl(tmp_path / "out.jsonl", ["b"])
    cfg = _cfg(tmp_path, train=["jsonl:data/sources/in.jsonl", f"jsonl:{outside}"],
               eval_sources={"chat": ["jsonl:data/sources/in.jsonl"]}, n_eval_per_domain=1)
    lines = warn_untracked_files(cfg)
    assert inside.is_file() and len(lines) == 1
    assert lines[0] == (f"prepare: jsonl:{outside} reads {outside}, which is no dependency of the prepare stage in "
                        f"dvc.yaml: DVC will not rerun prepare when it changes (put it under data/sources/, or run "
                        f"`dvc repro -f prepare` after changing it)")
    assert warn_untracked_files(cfg, tmp_path / "none.yaml") == []


# ----------------------------------------------------------------------------------------------
# parquet: and hf: sources
# ----------------------------------------------------------------------------------------------
def _arrow_rows(n: int, bad_row: int | None = None) -> list[dict]:
    """ShareGPT and OpenAI rows for one Arrow table (the other column null), multi-turn, some with a system."""
    rows = []
    for i in range(n):
        users = (f"question {i}", f"follow-up {i}") if i % 3 == 0 else (f"question {i}",)
        replies = tuple(f"answer {i}.{k}" for k in range(len(users)))
        system = SYSTEM if i % 2 else None
        if i % 2:
            rows.append({"id": f"r{i}", "conversations": _sharegpt(users, replies, system)["conversations"],
                         "messages": None})
        else:
            rows.append({"id": None, "conversations": None, "messages": _openai(users, replies, system)["messages"]})
    if bad_row is not None:
        rows[bad_row]["conversations"] = [{"from": "gpt", "value": "I start"}] + (rows[bad_row]["conversations"] or [])
        rows[bad_row]["messages"] = None
    return rows


def _expected(rows: list[dict], prefix: str) -> list[tuple]:
    out = []
    for i, r in enumerate(rows):
        msgs = r["conversations"] or r["messages"]
        text = [m.get("value") or m.get("content") for m in msgs]
        system = text[0] if len(text) % 2 else None
        rest = text[1:] if system else text
        out.append((f"{prefix}:{r['id'] if r['id'] is not None else i}", tuple(rest[0::2]), system, tuple(rest[1::2])))
    return out


def _parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)   # several row groups and batches
    return path


def test_parquet_source_reads_mixed_rows_streamed(tmp_path, monkeypatch):
    from dspark_core.data import records

    monkeypatch.setattr(records, "BATCH_ROWS", 2)
    rows = _arrow_rows(11)
    f = _parquet(tmp_path / "chat.parquet", rows)
    got = list(source_info(f"parquet:{f}").read(ReadOptions(), Counter()))
    assert [(p.id, p.turns, p.system, p.replies) for p in got] == _expected(rows, "chat")
    assert {p.source for p in got} == {f"parquet:{f}"}
    # the same records as JSONL read the same
    j = _write_jsonl(tmp_path / "chat.jsonl", [{k: v for k, v in r.items() if v is not None} for r in rows])
    assert [(p.turns, p.system, p.replies) for p in iter_jsonl(j)] == [(p.turns, p.system, p.replies) for p in got]
    bad = _parquet(tmp_path / "bad.parquet", _arrow_rows(7, bad_row=5))
    with pytest.raises(ValueError, match=r"bad.parquet row 5: conversations\[0\] is an assistant turn before any "
                                         r"user turn; accepted records"):
        list(source_info(f"parquet:{bad}").read(ReadOptions(), Counter()))
    import pyarrow as pa

    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["hi"]}), other)
    with pytest.raises(ValueError, match=r"other.parquet: no 'turns', 'messages' or 'conversations' column "
                                         r"\(columns: text\)"):
        list(source_info(f"parquet:{other}").read(ReadOptions(), Counter()))
    with pytest.raises(ValueError, match=r"parquet:nope.parquet: file nope.parquet not found"):
        list(source_info("parquet:nope.parquet").read(ReadOptions(), Counter()))


def test_parquet_message_columns_with_tool_calls_and_text_parts(tmp_path):
    """Arrow unifies the message structs of a column: absent keys are nulls; tool calls and text parts still
    read as in JSON."""
    rows = [{"messages": [{"role": "user", "content": "Weather?", "tool_calls": None},
                          {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
            {"messages": [{"role": "user", "content": "Hi", "tool_calls": None},
                          {"role": "assistant", "content": "Hello", "tool_calls": []}]}]
    f = _parquet(tmp_path / "t.parquet", rows)
    skipped = Counter()
    got = list(source_info(f"parquet:{f}").read(ReadOptions(), skipped))
    assert [(p.id, p.turns, p.replies) for p in got] == [("t:1", ("Hi",), ("Hello",))] and skipped == {"tool": 1}
    as_text = [{"messages": [{"role": "user", "content": "Hi"}], "tools": "[]"},     # tool definitions as JSON text
               {"messages": [{"role": "user", "content": "Hi"}], "tools": '[{"type": "function"}]'}]
    skipped = Counter()
    f = _parquet(tmp_path / "d.parquet", as_text)
    assert [p.id for p in source_info(f"parquet:{f}").read(ReadOptions(), skipped)] == ["d:0"]
    assert skipped == {"tool": 1}
    parts = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}]
    f = _parquet(tmp_path / "p.parquet", parts)
    assert [p.turns for p in source_info(f"parquet:{f}").read(ReadOptions(), Counter())] == [("a\nb",)]


def _hub_layout(folder: Path, train: list[dict], test: list[dict]) -> Path:
    """A data set folder as the hub lays out parquet data sets."""
    _parquet(folder / "data" / "train-00000-of-00001.parquet", train)
    _parquet(folder / "data" / "test-00000-of-00001.parquet", test)
    return folder


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")


def test_hf_local_dataset_folder(tmp_path, monkeypatch, datasets_cache):
    rows = _arrow_rows(9)
    folder = _hub_layout(tmp_path / "my-set", rows, rows[:2])
    got = list(source_info(f"hf:{folder}").read(ReadOptions(), Counter()))
    assert [(p.id, p.turns, p.system, p.replies) for p in got] == _expected(rows, "my-set@train")
    monkeypatch.chdir(tmp_path)
    test = list(source_info("hf:./my-set::test").read(ReadOptions(), Counter()))
    assert [(p.id, p.turns) for p in test] == [(i, t) for i, t, _, _ in _expected(rows[:2], "my-set@test")]
    assert test[0].source == "hf:./my-set::test"
    with pytest.raises(ValueError, match=r"^prepare.train: 'hf:./my-set@test': a local dataset folder has no revision "
                                         r"\(@test\); its split is written hf:./my-set::test$"):
        PrepareConfig.from_dict({"train": "hf:./my-set@test"}, prefix="prepare.")
    _hub_layout(tmp_path / "bad-set", _arrow_rows(4, bad_row=3), rows[:1])
    with pytest.raises(ValueError, match=r"bad-set\[train\] row 3: conversations\[0\] is an assistant turn"):
        list(source_info("hf:./bad-set").read(ReadOptions(), Counter()))
    with pytest.raises(ValueError, match=r"hf:./my-set::validation: cannot load .*my-set\[validation\] \(.*split"):
        list(source_info("hf:./my-set::validation").read(ReadOptions(), Counter()))
    with pytest.raises(ValueError, match=r"hf:./none: no dataset folder none"):
        list(source_info("hf:./none").read(ReadOptions(), Counter()))
    # the prepare stage over it: eval from the test split, train from train
    cfg = _cfg(tmp_path, train="hf:./my-set", eval_sources={"chat": ["hf:./my-set::test"]}, n_train=None,
               n_eval_per_domain=2)
    splits = select_splits(cfg)
    assert len(splits["train"]) == 7 and {p.id for p in splits["eval"]} == {"my-set@test:0", "my-set@test:r1"}


def test_hf_hub_name_reads_the_hub_cache_offline(tmp_path):
    """``hf:org/name`` with HF_HUB_OFFLINE=1 resolves the data set's snapshot in the hub cache (HF_HOME) and
    reads it through the same load_dataset path; a data set not in the cache is one clear line."""
    pytest.importorskip("datasets")
    hub = tmp_path / "hf_home" / "hub" / "datasets--org--chat-set"
    rows = _arrow_rows(5)
    _hub_layout(hub / "snapshots" / ("a" * 40), rows, rows[:1])
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("a" * 40)
    script = ("from collections import Counter\n"
              "from dspark_core.data.sources import ReadOptions, source_info\n"
              "print([(p.id, p.turns) for p in source_info('hf:org/chat-set').read(ReadOptions(), Counter())])\n"
              "try:\n    list(source_info('hf:org/other').read(ReadOptions(), Counter()))\n"
              "except ValueError as e:\n    print(e)\n")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got, err = out.stdout.strip().splitlines()[-2:]
    assert got == str([(i, t) for i, t, _, _ in _expected(rows, "chat-set@train")])
    assert err.startswith("hf:org/other: HF_HUB_OFFLINE is set and org/other is not in the hub cache (")
    assert err.endswith("download it first (hf download --repo-type dataset org/other) or unset HF_HUB_OFFLINE")


def test_hf_revision_is_pinned_and_its_commit_recorded(tmp_path, monkeypatch, datasets_cache):
    """``hf:org/name@<revision>`` reads that commit; without one, main; the stats record the revision and the
    commit it resolved to. Offline from a hub cache laid out here (two commits), online through a stand-in for the
    hub's answer (the commit goes to load_dataset as its revision): nothing reaches the network. The old
    ``@<split>`` form is one line that shows the split form."""
    import datasets
    from huggingface_hub import HfApi, constants

    from dspark_core.testing import save_hub_repo

    hub = tmp_path / "hub"
    old, new = _arrow_rows(6), _arrow_rows(9)
    first = save_hub_repo(hub, "org/chat-set", _hub_layout(tmp_path / "v1", old, old[:3]), repo_type="dataset")
    main = save_hub_repo(hub, "org/chat-set", _hub_layout(tmp_path / "v2", new, new[:3]), repo_type="dataset")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def prepare(src: str) -> dict:
        stats: dict = {}
        run_prepare(_cfg(tmp_path, train=src, eval_sources={"chat": [f"{src.split('@')[0]}::test"]}, n_train=None,
                         n_eval_per_domain=2), stats)
        return stats

    stats = prepare("hf:org/chat-set")
    assert stats["sources"]["hf:org/chat-set"]["revision"] == "main"
    assert stats["sources"]["hf:org/chat-set"]["commit"] == main and stats["sources"]["hf:org/chat-set"]["records"] == 9
    assert stats["sources"]["hf:org/chat-set::test"]["commit"] == main
    stats = prepare(f"hf:org/chat-set@{first}")
    assert stats["sources"][f"hf:org/chat-set@{first}"] == {**stats["sources"][f"hf:org/chat-set@{first}"],
                                                            "revision": first, "commit": first, "records": 6}
    with pytest.raises(ValueError, match=r"^hf:org/chat-set@test: HF_HUB_OFFLINE is set and org/chat-set @ test is "
                                         r"not in the hub cache .* \(`@` names a revision; a split is written "
                                         r"hf:org/chat-set::test\)$"):
        prepare("hf:org/chat-set@test")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)   # the hub answers (a stand-in): v1.0 is commit `first`
    asked = []
    monkeypatch.setattr(HfApi, "dataset_info", lambda self, repo, revision=None, **k: asked.append((repo, revision))
                        or type("Info", (), {"sha": first})())
    load = datasets.load_dataset

    def load_commit(path, *args, revision=None, **kwargs):
        asked.append(revision)
        return load(str(hub / "datasets--org--chat-set" / "snapshots" / revision), *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_commit)
    stats = prepare("hf:org/chat-set@v1.0")
    assert stats["sources"]["hf:org/chat-set@v1.0"]["commit"] == first
    assert stats["sources"]["hf:org/chat-set@v1.0"]["records"] == 6
    assert ("org/chat-set", "v1.0") in asked and set(asked) - {("org/chat-set", "v1.0"), ("org/chat-set", "main")} == {
        first}   # every read of the run is of the resolved commit

    import httpx2
    from huggingface_hub import errors

    def no_revision(self, repo, revision=None, **k):   # main is there, a branch named test is not
        if revision == "main":
            return type("Info", (), {"sha": first})()
        request = httpx2.Request("GET", f"https://huggingface.co/api/datasets/{repo}/revision/{revision}")
        raise errors.RevisionNotFoundError("no rev", response=httpx2.Response(404, request=request))

    monkeypatch.setattr(HfApi, "dataset_info", no_revision)
    with pytest.raises(ValueError, match=r"^hf:org/chat-set@test: revision 'test' not found in org/chat-set \(the "
                                         r"revision after @: a branch, tag or commit sha of the repository\) \(`@` "
                                         r"names a revision; a split is written hf:org/chat-set::test\)$"):
        prepare("hf:org/chat-set@test")


def test_hf_names_parse_and_a_malformed_name_is_one_line(tmp_path, monkeypatch):
    from dspark_core.data.records import HfName, parse_hf_name

    assert parse_hf_name("hf:mlabonne/open-perfectblend") == HfName("mlabonne/open-perfectblend", None, "train",
                                                                     False)
    assert parse_hf_name("hf:org/set.v2:cfg_1:test") == HfName("org/set.v2", "cfg_1", "test", False)
    assert parse_hf_name("hf:squad::validation") == HfName("squad", None, "validation", False)
    assert parse_hf_name("hf:org/set:cfg@v1.2") == HfName("org/set", "cfg", "train", False, "v1.2")
    assert parse_hf_name("hf:org/set::test@refs/convert/parquet") == HfName("org/set", None, "test", False,
                                                                            "refs/convert/parquet")
    assert parse_hf_name("hf:org/name@" + "a" * 40).revision == "a" * 40
    assert parse_hf_name("hf:org/name").id_prefix == "name@train"
    odd = tmp_path / "runs:1" / "set@v2"          # a local folder whose name holds ':' and '@'
    odd.mkdir(parents=True)
    assert parse_hf_name(f"hf:{odd}") == HfName(str(odd), None, "train", True)
    assert parse_hf_name(f"hf:{odd}:cfg:test") == HfName(str(odd), "cfg", "test", True)
    monkeypatch.chdir(tmp_path)
    assert parse_hf_name("hf:./runs:1/set@v2::test") == HfName("runs:1/set@v2", None, "test", True)
    for bad in ("hf:", "hf:a/b/c", "hf:org/name:", "hf:org/name::", "hf:org/name@", "hf:org/na me",
                "hf:org/name:a:b:c", "hf:-org/x", "hf:org//x", "hf:org/x@a@b", "hf:org--x/y", "hf:org/../x"):
        with pytest.raises(ParamsError, match=rf"prepare.train: malformed source name '{re.escape(bad)}': use "
                                              r"hf:<org>/<name>\[:<config>\[:<split>\]\]\[@<revision>\] "
                                              r"\(hf:<org>/<name>::<split> for the default config; a local dataset "
                                              r"folder"):
            PrepareConfig.from_dict({"train": bad}, prefix="prepare.")


# ----------------------------------------------------------------------------------------------
# the holdout and the streamed draw
# ----------------------------------------------------------------------------------------------
def _chat_file(path: Path, n: int, start: int = 0, ids: bool = True) -> Path:
    recs = []
    for i in range(start, start + n):
        rec = _sharegpt((f"Tell me about topic number {i}.", f"More on {i}?"), (f"Topic {i} is ...",), None)
        recs.append({"id": f"q{i}", **rec} if ids else rec)
    return _write_jsonl(path, recs)


def test_holdout_is_stable_disjoint_and_the_only_eval_pool(tmp_path):
    f = _chat_file(tmp_path / "big.jsonl", 2000)
    src = f"jsonl:{f}"
    base = dict(train=[{"source": src, "holdout": 0.1}], eval_sources={"chat": [src]}, n_eval_per_domain=30)
    held = {f"big:q{i}" for i in range(2000) if is_held_out(f"q{i}", 0.1)}
    assert 150 < len(held) < 250                                    # ~10%
    stats: dict = {}
    everything = select_splits(_cfg(tmp_path, **base, n_train=None), stats)
    assert {p.id for p in everything["train"]} == {f"big:q{i}" for i in range(2000)} - held   # every other record
    assert {p.id for p in everything["eval"]} <= held and len(everything["eval"]) == 30
    assert stats[src]["held_out"] == len(held) and stats[src]["records"] == 2000
    assert stats[src]["drawn"] == {"eval": 30, "train": 2000 - len(held)}
    for seed, n_train in ((0, 50), (1, 50), (0, 400)):
        got = select_splits(_cfg(tmp_path, **base, n_train=n_train, seed=seed))
        assert len(got["train"]) == n_train and not {p.id for p in got["train"]} & held     # never a held-out one
        assert {p.id for p in got["eval"]} <= held
    # the seed orders the draw; the holdout does not move with it, nor with another source beside it
    a = select_splits(_cfg(tmp_path, **base, n_train=50, seed=0))
    b = select_splits(_cfg(tmp_path, **base, n_train=50, seed=1))
    assert a["train"] != b["train"] and a["eval"] != b["eval"]
    other = _chat_file(tmp_path / "other.jsonl", 100, start=5000)
    c = select_splits(_cfg(tmp_path, **{**base, "train": [*base["train"], f"jsonl:{other}"]}, n_train=100, seed=0))
    assert not {p.id for p in c["train"]} & held and [p.id for p in c["eval"]] == [p.id for p in a["eval"]]


def test_streamed_draw_is_a_prefix_of_one_seeded_order(tmp_path):
    """A streamed source is drawn in one seeded order of its ids: a smaller draw is a prefix of a bigger one, and
    the same order whether the lowest keys fit the first pass or the source is read again for more."""
    f = _chat_file(tmp_path / "s.jsonl", 600, ids=False)
    src = f"jsonl:{f}"
    base = dict(train=[{"source": src, "holdout": 0}], eval_sources={"chat": [src]}, n_eval_per_domain=5)
    full = select_splits(_cfg(tmp_path, **base, n_train=None))
    assert len(full["train"]) == 595
    for n in (1, 40, 300):
        got = select_splits(_cfg(tmp_path, **base, n_train=n))
        assert got["eval"] == full["eval"] and got["train"] == full["train"][:n]


def test_streamed_draw_reads_again_when_its_slack_runs_out(tmp_path, monkeypatch):
    import dspark_core.data.prompts as prompts

    recs = [_sharegpt((f"Question {i % 50}",), ()) for i in range(400)]   # 50 texts, each 8 times
    f = _write_jsonl(tmp_path / "dup.jsonl", recs)
    src = f"jsonl:{f}"
    cfg = _cfg(tmp_path, train=[{"source": src, "holdout": 0.2}], eval_sources={"chat": [src]}, n_train=30,
               n_eval_per_domain=4)
    stats: dict = {}
    roomy = select_splits(cfg, stats)
    assert stats[src]["passes"] == 1
    monkeypatch.setattr(prompts, "_MIN_SLACK", 0)
    monkeypatch.setattr(prompts, "_SLACK_SHARE", 0.0)
    tight_stats: dict = {}
    tight = select_splits(cfg, tight_stats)
    assert tight == roomy and tight_stats[src]["passes"] >= 2 and tight_stats[src]["skipped"] == stats[src]["skipped"]
    assert len({normalize_text(p.turns[0]) for p in tight["train"] + tight["eval"]}) == 34


def test_parquet_and_jsonl_copies_draw_the_same_records(tmp_path):
    """The holdout and the order hash the record's own id: a data set converted to Parquet keeps its split (a
    record without an id is known by its place: its line in a JSONL file, from 1, its row in Parquet, from 0)."""
    rows = [{**r, "id": f"x{i}"} for i, r in enumerate(_arrow_rows(300))]
    pqf = _parquet(tmp_path / "a.parquet", rows)
    jf = _write_jsonl(tmp_path / "a.jsonl", [{k: v for k, v in r.items() if v is not None} for r in rows])
    draws = []
    for src in (f"parquet:{pqf}", f"jsonl:{jf}"):
        cfg = _cfg(tmp_path, train=[{"source": src, "holdout": 0.1}], eval_sources={"chat": [src]}, n_train=40,
                   n_eval_per_domain=10)
        draws.append({s: [p.id for p in ps] for s, ps in select_splits(cfg).items()})
    assert draws[0] == draws[1]


def test_holdout_and_n_train_params(tmp_path):
    f = _jsonl(tmp_path / "q.jsonl", [f"question {i}" for i in range(30)])
    src = f"jsonl:{f}"
    held = {**_one(src, 5, 2), "train": [{"source": src, "holdout": 0.25}]}
    assert _cfg(tmp_path, **held).holdouts() == {src: 0.25}
    assert _cfg(tmp_path, **_one(src, None, 2)).train_counts() == [(src, None)]
    with pytest.raises(ParamsError, match=rf"train: the holdout of '{re.escape(src)}' must be >= 0 and < 1; got 1.0"):
        _cfg(tmp_path, **{**held, "train": [{"source": src, "holdout": 1}]})
    with pytest.raises(ParamsError, match=r"train: 'humaneval' is eval-only"):
        _cfg(tmp_path, train=[src, {"source": "humaneval", "weight": 0, "holdout": 0.1}])
    with pytest.raises(ParamsError, match=r"train: the holdout of .* must be a number, got 'x'"):
        _cfg(tmp_path, **{**held, "train": [{"source": src, "holdout": "x"}]})
    with pytest.raises(ParamsError, match=r"on_bad_record must be one of error, skip; got 'drop'"):
        _cfg(tmp_path, **_one(src, 5, 2), on_bad_record="drop")
    with pytest.raises(ValueError, match=rf"source '{re.escape(src)}' has too few usable prompts in its held-out 0.25 "
                                         r"\(its holdout in prepare.train\).*ran out while filling eval"):
        select_splits(_cfg(tmp_path, **{**held, "n_eval_per_domain": 20}))
    tools = _write_jsonl(tmp_path / "tools.jsonl", TOOL_RECORDS)
    with pytest.raises(ValueError, match=r"source 'jsonl:.*tools.jsonl' gave no usable train prompt"):
        select_splits(_cfg(tmp_path, train=[src, f"jsonl:{tools}"], eval_sources={"chat": [src]},
                           n_train=None, n_eval_per_domain=2))


# ----------------------------------------------------------------------------------------------
# the leak check over every user turn
# ----------------------------------------------------------------------------------------------
LONG_Q = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def test_overlap_check_covers_later_user_turns():
    evals = [_p("e:1", "Tell me a joke", None, LONG_Q), _p("e:2", "Hello there", None, "continue")]
    cases = {
        "same text": (_p("t:1", "Hi", None, "Tell me a joke"), "t:1' (t, turn 2) vs eval 'e:1' (t, turn 1)"),
        "same normalised text": (_p("t:2", "Hi", None, LONG_Q.upper()), "'t:2' (t, turn 2) vs eval 'e:1' (t, turn 2)"),
        "the train text is inside the eval text": (_p("t:3", "Hi", None, "Ok", LONG_Q[10:-12]), "turn 3"),
        "the eval text is inside the train text": (_p("t:4", "Hi", None, "Now: " + LONG_Q + " Thanks"), "turn 2"),
    }
    for why, (t, where) in cases.items():
        found = find_overlaps([t], evals)
        assert len(found) == 1 and found[0].endswith(why) and where in found[0], (why, found)
    # a short follow-up ("continue") is no leak between two later turns, only where it opens a conversation
    assert find_overlaps([_p("t:5", "Hi", None, "Continue!")], evals) == []
    assert find_overlaps([_p("t:6", "Continue!")], evals)[0].endswith("same normalised text")


def test_a_train_conversation_overlapping_an_eval_one_is_skipped_and_counted(tmp_path):
    ev = _write_jsonl(tmp_path / "ev.jsonl", [_sharegpt(("Opening question?", LONG_Q), ("a", "b"), None)])
    recs = [_sharegpt(("Hi", "Then: " + LONG_Q), ("x",), None)] + [_sharegpt((f"other question {i}",), (), None)
                                                                   for i in range(5)]
    tr = _write_jsonl(tmp_path / "tr.jsonl", recs)
    stats: dict = {}
    splits = select_splits(_cfg(tmp_path, train=f"jsonl:{tr}", eval_sources={"chat": [f"jsonl:{ev}"]},
                                n_train=None, n_eval_per_domain=1), stats)
    assert len(splits["train"]) == 5 and stats[f"jsonl:{tr}"]["skipped"] == {"eval_overlap": 1}
    assert find_overlaps(splits["train"], splits["eval"]) == []


def _reference_overlaps(t: Prompt, evals: list[Prompt]) -> set[str]:
    """Every reason ``t`` overlaps an eval prompt, by the definition (all pairs of turns)."""
    from dspark_core.data.overlap import MIN_CONTAINED_CHARS as M

    why = set()
    for e in evals:
        if t.id == e.id:
            why.add("same id")
        if t.group is not None and t.group == e.group:
            why.add("same problem")
        for i, a in enumerate(t.turns):
            for j, b in enumerate(e.turns):
                na, nb = normalize_text(a), normalize_text(b)
                if na == nb and (i == 0 or j == 0 or len(na) >= M):
                    why.add("same text" if a == b else "same normalised text")
                if na != nb and len(na) >= M and na in nb:
                    why.add("the train text is inside the eval text")
                if na != nb and len(nb) >= M and nb in na:
                    why.add("the eval text is inside the train text")
    return why


def test_eval_index_agrees_with_the_all_pairs_definition():
    """Random conversations over a small vocabulary (many containments, cut words at the edges, texts of one or
    two long tokens, CJK without spaces): the index finds an overlap exactly where the definition does, and the
    one it names is one of them."""
    import random as _random

    from dspark_core.data.overlap import EvalIndex

    rng = _random.Random(0)
    vocab = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    pool: list[str] = []

    def text() -> str:
        r = rng.random()
        if r < 0.2 and pool:                                         # a piece of an earlier text, cut anywhere
            src = rng.choice(pool)
            a = rng.randrange(len(src))
            return src[a:a + rng.randint(30, 90)] or src
        if r < 0.25 and pool:                                        # an earlier text inside a longer one
            return f"{rng.choice(vocab)}{rng.choice(' -')}{rng.choice(pool)} {rng.choice(vocab)}"
        if r < 0.3:
            return "".join(rng.choice("abcdefghij") for _ in range(rng.randint(35, 60)))   # one long token
        if r < 0.35:
            return "".join(rng.choice("数学问题答案计算") for _ in range(rng.randint(38, 50)))
        words = rng.choices(vocab, k=rng.randint(1, 16))
        return " ".join(words).capitalize() + rng.choice((".", "?", "", "!!"))

    def prompt(pid: str) -> Prompt:
        turns = tuple(t for t in (text() for _ in range(rng.randint(1, 3))) if t.strip()) or ("x",)
        pool.extend(turns)
        return Prompt(pid, "s", turns, "chat", rng.choice((None, None, None, "g1", "g2")))

    evals = [prompt(f"e{i}") for i in range(40)]
    train = [prompt(f"t{i}" if rng.random() < 0.97 else f"e{rng.randrange(40)}") for i in range(1500)]
    index = EvalIndex(evals)
    hits = 0
    for t in train:
        ref = _reference_overlaps(t, evals)
        got = index.overlap(t)
        assert (got is not None) == bool(ref), (t, ref, got)
        if got is not None:
            hits += 1
            assert got.why.split(" '")[0] in ref, (t, ref, got)
    assert 200 < hits < 1400          # both outcomes are exercised


def test_ascii_normalisation_takes_the_fast_path_with_the_same_result():
    import random as _random
    import unicodedata

    rng = _random.Random(1)
    for _ in range(3000):
        s = "".join(chr(rng.randrange(128)) for _ in range(rng.randint(0, 40)))
        slow = " ".join(re.sub(r"[\W_]+", " ", unicodedata.normalize("NFKC", s).casefold()).split())
        assert normalize_text(s) == slow, repr(s)
    assert normalize_text("Ｃafé — NAÏVE_x") == "cafe naive x".replace("cafe", "café").replace("naive", "naïve")


def test_a_registry_source_takes_a_holdout_too(tmp_path):
    from dspark_core.data.sources import write_snapshot

    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "split.json").write_text(json.dumps({"read_options": {}}))
    write_snapshot(snap / "codeio.jsonl", [Prompt(f"codeio:{i}", "codeio", (f"task {i}",), "code") for i in range(60)])
    cfg = _cfg(tmp_path, snapshot_dir=str(snap), train=[{"source": "codeio", "holdout": 0.3}],
               eval_sources={"code": ["codeio"]}, n_train=None, n_eval_per_domain=5)
    stats: dict = {}
    splits = select_splits(cfg, stats)
    held = {f"codeio:{i}" for i in range(60) if is_held_out(str(i), 0.3)}
    assert {p.id for p in splits["train"]} == {f"codeio:{i}" for i in range(60)} - held
    assert {p.id for p in splits["eval"]} <= held and len(splits["eval"]) == 5
    assert stats["codeio"]["held_out"] == len(held) and stats["codeio"]["records"] == 60
