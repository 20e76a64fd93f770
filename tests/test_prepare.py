"""The `prepare` stage: sources, disjoint splits, sizes, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dspark_core.config import ParamsError
from dspark_core.data.prompts import (PrepareConfig, iter_gsm8k_symbolic, iter_json_array, iter_jsonl,
                                      iter_sharegpt, read_prompts, run_prepare, select_splits, split_evenly)


def _jsonl(path: Path, texts: list[str], **extra) -> Path:
    path.write_text("".join(json.dumps({"turns": [t], **extra}) + "\n" for t in texts))
    return path


def _cfg(tmp_path: Path, **kw) -> PrepareConfig:
    return PrepareConfig.from_dict({"out_dir": str(tmp_path / "prompts"), **kw})


def _check_disjoint(splits) -> None:
    train, ev = splits["train"], splits["eval"]
    assert not {p.id for p in train} & {p.id for p in ev}
    assert not {p.turns[0] for p in train} & {p.turns[0] for p in ev}
    for s in (train, ev):
        assert len({p.id for p in s}) == len(s) and len({p.turns[0] for p in s}) == len(s)


def test_same_jsonl_feeds_both_splits_disjointly(tmp_path):
    f = _jsonl(tmp_path / "q.jsonl", [f"question {i}" for i in range(30)])
    cfg = _cfg(tmp_path, train_sources=[f"jsonl:{f}"], eval_sources=[f"jsonl:{f}"], n_train=20, n_eval=10)
    assert run_prepare(cfg) == {"train": 20, "eval": 10}
    splits = {s: read_prompts(tmp_path / "prompts" / f"{s}.parquet") for s in ("train", "eval")}
    _check_disjoint(splits)
    used = {p.turns[0] for s in splits.values() for p in s}
    assert used == {f"question {i}" for i in range(30)}        # 30 asked from 30: all used once
    table = pq.read_table(tmp_path / "prompts" / "train.parquet")
    assert table.column_names == ["id", "source", "turns"]
    assert str(table.schema.field("turns").type) == "list<element: string>"
    assert {p.source for p in splits["train"]} == {f"jsonl:{f}"}


def test_seed_changes_selection_and_is_deterministic(tmp_path):
    f = _jsonl(tmp_path / "q.jsonl", [f"question {i}" for i in range(40)])
    base = dict(train_sources=[f"jsonl:{f}"], eval_sources=[f"jsonl:{f}"], n_train=5, n_eval=5)
    a = select_splits(_cfg(tmp_path, seed=1, **base))
    b = select_splits(_cfg(tmp_path, seed=1, **base))
    c = select_splits(_cfg(tmp_path, seed=2, **base))
    assert a == b and a != c


def test_texts_shared_by_two_sources_are_not_reused(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [f"q{i}" for i in range(6)])
    b = _jsonl(tmp_path / "b.jsonl", [f"q{i}" for i in range(3, 9)])   # q3..q5 also in a
    cfg = _cfg(tmp_path, train_sources=[f"jsonl:{b}"], eval_sources=[f"jsonl:{a}"], n_train=3, n_eval=6)
    splits = select_splits(cfg)
    _check_disjoint(splits)
    assert {p.turns[0] for p in splits["train"]} == {"q6", "q7", "q8"}


def test_max_prompt_chars_and_multi_turn(tmp_path):
    f = tmp_path / "m.jsonl"
    rows = [{"id": "long", "turns": ["x" * 50]}] + [{"id": i, "turns": [f"t{i}", "again"]} for i in range(4)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    splits = select_splits(_cfg(tmp_path, train_sources=[f"jsonl:{f}"], eval_sources=[f"jsonl:{f}"],
                                n_train=2, n_eval=2, max_prompt_chars=10))
    got = splits["train"] + splits["eval"]
    assert sorted(p.id for p in got) == ["m:0", "m:1", "m:2", "m:3"]
    assert all(p.turns[1] == "again" for p in got)


def test_sizes_are_shared_over_sources():
    assert split_evenly(10, 3) == [4, 3, 3]
    assert split_evenly(16, 2) == [8, 8]


def test_default_sources(tmp_path):
    cfg = _cfg(tmp_path, n_train=10, n_eval=5)   # sharegpt + gsm8k_symbolic, both splits
    run_prepare(cfg)
    splits = {s: read_prompts(tmp_path / "prompts" / f"{s}.parquet") for s in ("train", "eval")}
    _check_disjoint(splits)
    assert len(splits["train"]) == 10 and len(splits["eval"]) == 5
    assert sorted(p.source for p in splits["train"]) == ["gsm8k_symbolic"] * 5 + ["sharegpt"] * 5
    assert sorted(p.source for p in splits["eval"]) == ["gsm8k_symbolic"] * 3 + ["sharegpt"] * 2


def test_gsm8k_symbolic_has_the_100_original_questions():
    plain = list(iter_gsm8k_symbolic(with_instruction=False))
    assert len(plain) == 100 and len({p.id for p in plain}) == 100
    by_id = {p.id: p.turns[0] for p in plain}
    assert by_id["gsm8k_symbolic:473"] == ("Benny saw a 10-foot shark with 2 6-inch remoras attached to it. What "
                                          "percentage of the shark's body length is the combined length of the remoras?")
    with_instr = list(iter_gsm8k_symbolic())
    assert with_instr[0].turns[0].startswith(plain[0].turns[0] + "\n") and "\\boxed" in with_instr[0].turns[0]


def test_sharegpt_first_turns_are_read_lazily():
    it = iter_sharegpt()
    first = [next(it) for _ in range(5)]
    assert all(p.id.startswith("sharegpt:") and p.id.endswith("_0") for p in first)
    assert first[0].turns[0].startswith("Summarize the main ideas of Jeff Walker")


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
    with pytest.raises(ValueError, match=r"nt.jsonl:1: record has no 'turns' field"):
        list(iter_jsonl(no_turns))
    wrong = tmp_path / "w.jsonl"
    wrong.write_text('{"turns": "hi"}\n')
    with pytest.raises(ValueError, match=r"w.jsonl:1: field 'turns' must be a non-empty list"):
        list(iter_jsonl(wrong))
    dup = _jsonl(tmp_path / "d.jsonl", ["a", "b"], id=7)
    with pytest.raises(ValueError, match=r"d.jsonl:2: duplicate id '7'"):
        list(iter_jsonl(dup))
    with pytest.raises(ValueError, match="not found"):
        list(iter_jsonl(tmp_path / "nope.jsonl"))


def test_too_few_prompts_is_a_clear_error(tmp_path):
    f = _jsonl(tmp_path / "few.jsonl", [f"q{i}" for i in range(5)])
    cfg = _cfg(tmp_path, train_sources=[f"jsonl:{f}"], eval_sources=[f"jsonl:{f}"], n_train=4, n_eval=2)
    with pytest.raises(ValueError, match=r"source 'jsonl:.*few.jsonl' has too few usable prompts.*needs 2 eval \+ 4 "
                                         r"train.*lower prepare.n_train"):
        run_prepare(cfg)
    assert not (tmp_path / "prompts").exists()


def test_config_errors(tmp_path):
    with pytest.raises(ParamsError, match="unknown source 'wiki'"):
        _cfg(tmp_path, train_sources=["wiki"])
    with pytest.raises(ParamsError, match="n_eval must be > 0"):
        _cfg(tmp_path, n_eval=0)
    with pytest.raises(ParamsError, match="lists a source twice"):
        _cfg(tmp_path, eval_sources=["sharegpt", "sharegpt"])
    with pytest.raises(ParamsError, match="asks for only 1 prompts"):
        _cfg(tmp_path, n_eval=1)
