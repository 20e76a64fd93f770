"""The `prepare` stage: sources and their domains, the weighted training mix, per-domain held-out eval sets,
eval-only sources refused for training, no train / eval overlap, disjoint splits, sizes, errors."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dspark_core.config import ParamsError
from dspark_core.data.prompts import (DOMAINS, PrepareConfig, Prompt, allocate, check_no_overlap, find_overlaps,
                                      iter_gsm8k_symbolic, iter_json_array, iter_jsonl, iter_sharegpt, read_prompts,
                                      run_prepare, select_splits, split_evenly, write_prompts)
from dspark_core.data.sources import (REGISTRY, iter_aime2025, iter_codeio, iter_gsm8k_test,
                                      iter_gsm_symbolic_variants, iter_humaneval, iter_project_euler, normalize_text)


def _jsonl(path: Path, texts: list[str], **extra) -> Path:
    path.write_text("".join(json.dumps({"turns": [t], **extra}) + "\n" for t in texts))
    return path


def _cfg(tmp_path: Path, **kw) -> PrepareConfig:
    return PrepareConfig.from_dict({"out_dir": str(tmp_path / "prompts"), **kw})


def _one(src: str, n_train: int, n_eval: int, **kw) -> dict:
    """A config drawing train and eval from one source."""
    return dict(train_mix={src: 1}, eval_sources={"chat": [src]}, n_train=n_train, n_eval_per_domain=n_eval, **kw)


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
    cfg = _cfg(tmp_path, train_mix={f"jsonl:{b}": 1}, eval_sources={"chat": [f"jsonl:{a}"]}, n_train=3,
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
    cfg = _cfg(tmp_path, train_mix=[[f"jsonl:{code}", 1], [f"jsonl:{chat}", 3], [f"jsonl:{math}", 0]], n_train=12,
               eval_sources={"code": [f"jsonl:{code}"], "math_word": [f"jsonl:{math}"]}, n_eval_per_domain=3)
    splits = select_splits(cfg)
    assert Counter(p.domain for p in splits["train"]) == {"chat": 9, "code": 3}
    assert Counter(p.domain for p in splits["eval"]) == {"code": 3, "math_word": 3}
    _check_disjoint(splits)
    # a mapping with the same weights draws the same prompts
    cfg2 = dataclasses.replace(cfg, train_mix={f"jsonl:{code}": 1, f"jsonl:{chat}": 3, f"jsonl:{math}": 0})
    assert select_splits(cfg2) == splits


def test_jsonl_paths_resolve_against_the_repo_and_without_suffix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = list(iter_jsonl("data/prompts_h200/eval_gsm8k"))   # relative to the repo root, '.jsonl' left out
    assert len(prompts) == 30 and prompts[0].source == "jsonl:data/prompts_h200/eval_gsm8k"


def test_old_list_form_still_reads(tmp_path):
    f = _jsonl(tmp_path / "q.jsonl", [f"question {i}" for i in range(12)])
    cfg = _cfg(tmp_path, train_sources=[f"jsonl:{f}"], eval_sources=[f"jsonl:{f}"], n_train=6, n_eval=3)
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
    cfg = _cfg(tmp_path, train_mix={"gsm_symbolic_variants": 1}, n_train=300,
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
    with pytest.raises(ParamsError, match=rf"train_mix: '{source}' is eval-only .*test split.* never trains"):
        _cfg(tmp_path, train_mix={"sharegpt": 1, source: 1})
    with pytest.raises(ValueError, match=rf"train_sources: '{source}' is eval-only"):
        _cfg(tmp_path, train_sources=[source], eval_sources=["sharegpt"], n_eval=2)
    with pytest.raises(ValueError, match="is eval-only"):   # weight 0 is refused as well: it has no place there
        _cfg(tmp_path, train_mix={"sharegpt": 1, source: 0})


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
    cfg = _cfg(tmp_path, train_mix={f"jsonl:{tr}": 1}, eval_sources={"math_word": [f"jsonl:{ev}"]}, n_train=2,
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
        _cfg(tmp_path, train_mix={"wiki": 1})
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
        _cfg(tmp_path, train_mix={"sharegpt": -1})
    with pytest.raises(ParamsError, match="at least one weight must be > 0"):
        _cfg(tmp_path, train_mix={"sharegpt": 0})
    with pytest.raises(ParamsError, match="train_sources is the old form of train_mix"):
        _cfg(tmp_path, train_sources=["sharegpt"], train_mix={"sharegpt": 1})
    with pytest.raises(ParamsError, match="n_eval .* goes with a list of eval_sources"):
        _cfg(tmp_path, n_eval=4)
    with pytest.raises(ParamsError, match="asks for only 1 prompts"):
        _cfg(tmp_path, eval_sources=["sharegpt", "gsm8k_symbolic"], n_eval=1)
    with pytest.raises(ParamsError, match=r"prepare.train_mix"):
        PrepareConfig.from_dict({"train_mix": {"wiki": 1}}, prefix="prepare.")
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
    cfg = _cfg(tmp_path, snapshot_dir=str(snap), train_mix={"codeio": 1}, eval_sources={"code": ["humaneval"]},
               n_train=6, n_eval_per_domain=3)
    splits = select_splits(cfg)
    assert Counter(p.source for p in splits["train"]) == {"codeio": 6}
    assert Counter(p.source for p in splits["eval"]) == {"humaneval": 3}
    assert splits["train"][0].id.startswith("codeio:") and splits["eval"][0].domain == "code"
    with pytest.raises(ValueError, match=r"snap/sharegpt.jsonl not found: the snapshot holds no 'sharegpt'"):
        select_splits(dataclasses.replace(cfg, train_mix={"sharegpt": 1}))
