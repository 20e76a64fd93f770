"""bench_online selects prepare's eval prompts by domain (gsm8k: an alias of math_word), by source, or from JSONL."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dspark_core.data.prompts import Prompt, write_prompts
from dspark_core.bench.online import load_prompt_sets


def test_domains_aliases_and_sources(tmp_path):
    path = tmp_path / "eval.parquet"
    write_prompts(path, [Prompt("g:1", "gsm8k_symbolic", ("m1",), "math_word", "gsm8k_test:1"),
                         Prompt("a:1", "aime2025", ("c1",), "competition_math"),
                         Prompt("h:1", "humaneval", ("k1",), "code"),
                         Prompt("j:1", "jsonl:x.jsonl", ("k2",), "code"),
                         Prompt("s:1", "sharegpt", ("h1", "h2"), "chat"),
                         Prompt("g:2", "gsm8k_test", ("m2",), "math_word", "gsm8k_test:2")])
    sets = load_prompt_sets(path, ["math_word", "competition_math", "code", "chat", "gsm8k", "humaneval"], 8)
    assert sets == {"math_word": [["m1"], ["m2"]], "competition_math": [["c1"]], "code": [["k1"], ["k2"]],
                    "chat": [["h1", "h2"]], "gsm8k": [["m1"], ["m2"]], "humaneval": [["k1"]]}
    assert load_prompt_sets(path, ["code"], 1) == {"code": [["k1"]]}
    with pytest.raises(ValueError, match=r"'poetry' selects no prompt .*known names: math_word, competition_math, "
                                         r"code, chat, gsm8k \(= math_word\)"):
        load_prompt_sets(path, ["poetry"], 8)


def test_prompt_files_without_a_domain_column(tmp_path):
    path = tmp_path / "old.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "source": ["gsm8k_symbolic", "sharegpt"], "turns": [["q"], ["hi"]]}),
                   path)
    assert load_prompt_sets(path, ["gsm8k", "chat", "math_word"], 8) == {"gsm8k": [["q"]], "chat": [["hi"]],
                                                                          "math_word": [["q"]]}
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"turns": ["w"], "domain": "code"}) + "\n" + json.dumps({"turns": ["x"]}) + "\n")
    assert load_prompt_sets(jsonl, ["code"], 8) == {"code": [["w"]]}


def test_conversations_carry_their_system_message_and_later_turns(tmp_path):
    """Each eval prompt's own system message (parquet column, JSONL field) goes with it, the params' system_prompt
    being the default; with max_turns 2 the second turn is asked after the first answer, under that system."""
    from dspark_core.bench.online import BenchOnlineConfig, chat_ids, decode_dataset
    from dspark_core.decoding.types import GenerationResult
    from dspark_core.testing import tiny_tokenizer

    path = tmp_path / "eval.parquet"
    write_prompts(path, [Prompt("s:1", "sharegpt", ("h1", "h2", "h3"), "chat", system="Be kind."),
                         Prompt("s:2", "sharegpt", ("k1",), "chat")])
    (chat,) = load_prompt_sets(path, ["chat"], 8).values()
    assert chat == [["h1", "h2", "h3"], ["k1"]] and [c.system for c in chat] == ["Be kind.", None]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"turns": ["w"], "system": "Sys."}) + "\n")
    assert [c.system for c in load_prompt_sets("", [f"jsonl:{jsonl}"], 8)[f"jsonl:{jsonl}"]] == ["Sys."]

    tok = tiny_tokenizer()
    answer = tok("ok", add_special_tokens=False)["input_ids"]

    class Echo:  # a decoder that answers "ok"
        def generate(self, prompt, max_new_tokens, stops):
            return GenerationResult(tokens=list(answer))

    cfg = BenchOnlineConfig.from_dict({"max_turns": 2, "system_prompt": "Default."})
    run = decode_dataset(chat, tok, Echo(), Echo(), cfg, [tok.eos_token_id])
    system = {"role": "system", "content": "Be kind."}
    assert run.prompts == [
        chat_ids(tok, [system, {"role": "user", "content": "h1"}]),
        chat_ids(tok, [system, {"role": "user", "content": "h1"}, {"role": "assistant", "content": "ok"},
                       {"role": "user", "content": "h2"}]),
        chat_ids(tok, [{"role": "system", "content": "Default."}, {"role": "user", "content": "k1"}])]
