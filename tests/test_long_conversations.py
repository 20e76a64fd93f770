"""What a long run keeps of its regenerated answers: every answer trained exactly once -- a conversation longer than
``cache.max_length`` split into samples that each end at an answer with as much context as fits, each answer's
thinking trained in the sample the Qwen3-style template keeps it in (``cache.long_conversations: split``), an
answer longer than the limit cut at its tail and counted -- and cut answers that stay cut (an answer stopped by
``max_new_tokens`` has no end token and ends its conversation). Samples are checked against the templates' renders
written out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dspark_core.data.regenerate as regen
from dspark_core.cache import CacheConfig, run_cache
from dspark_core.cache.source import load_regen
from dspark_core.data.prompts import Prompt, write_prompts
from dspark_core.data.regenerate import RegenerateConfig, read_regen, run_regenerate
from dspark_core.errors import UserError
from dspark_core.profile_check import check_profile
from dspark_core.testing import save_tiny_target, tiny_tokenizer
from _regen_utils import Scripted

S, E = "<|im_start|>", "<|im_end|>"   # the templates' markers (one token each)
ROOT = Path(__file__).resolve().parent.parent


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _turn(role: str, content: str) -> str:
    return f"{S}{role}\n{content}{E}\n"


def _last_user(prompt_text: str) -> str:
    return prompt_text.rsplit(f"{S}user\n", 1)[1].split(E, 1)[0]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {t: save_tiny_target(root / t, "qwen3", template=t) for t in ("simple", "qwen3")}


def _regenerate(monkeypatch, target: Path, root: Path, conversations: dict[str, tuple[str, ...]], answer,
                **kw) -> tuple[list[dict], dict, Scripted]:
    """Every turn of ``conversations`` ({id: user turns}) answered by ``answer(last user turn)``; the rows (by
    conversation order), the split's stats and the backend."""
    write_prompts(root / "prompts" / "eval.parquet", [Prompt(i, "test", t) for i, t in conversations.items()])
    made: list[Scripted] = []
    tok = tiny_tokenizer(target.name)   # the fixture's targets are named after their template
    monkeypatch.setattr(regen, "make_backend", lambda *a, **k: made.append(
        Scripted(tok, lambda text: answer(_last_user(text)))) or made[-1])
    cfg = dict(backend="hf", max_new_tokens=400, batch_size=8, splits=["eval"], target_dir=str(target),
               prompts_dir=str(root / "prompts"), out_dir=str(root / "regen"),
               stats_path=str(root / "regen_stats.json"), max_turns=3)
    stats = run_regenerate(RegenerateConfig.from_dict({**cfg, **kw}))
    rows = {r["id"]: r for r in read_regen(root / "regen" / "eval.parquet")}
    return [rows[i] for i in conversations], stats["splits"]["eval"], made[0] if made else None


def _samples(samples) -> dict[int, list[tuple[list[int], list[int]]]]:
    """{regen row: [(tokens, loss positions)]} of load_regen's samples, in each row's order of making."""
    out: dict[int, list] = {}
    off = samples.offsets
    for n in np.argsort(samples.order, kind="stable"):  # ties (one row's samples) in store order: longest first
        ids, mask = samples.input_ids[off[n]:off[n + 1]], samples.loss_mask[off[n]:off[n + 1]]
        out.setdefault(int(samples.order[n]), []).append((ids.tolist(), np.flatnonzero(mask).tolist()))
    return {row: sorted(v, key=lambda x: len(x[0])) for row, v in out.items()}


# -- point 2: every regenerated answer is trained on ------------------------------------------------------------
@pytest.mark.parametrize("thinking", [True, False])
def test_each_answer_is_trained_once_where_the_template_keeps_its_thinking(targets, tmp_path, monkeypatch, thinking):
    """Qwen3-style template: the history drops an answer's think block, so with thinking the sample ending at turn k
    is the render of turns 1..k with answer k's thinking, and only answer k has loss there: three samples, every
    answer's generated tokens trained once. Without thinking the history holds each answer as generated: one sample,
    every answer's loss in it. ``truncate``: the row's one sample, earlier answers without their thinking."""
    tok = tiny_tokenizer("qwen3")
    eos = tok.eos_token_id
    text = {f"u{k}": (f"<think>\nstep {k}\n</think>\n\nA{k}" if thinking else f"A{k}") for k in (1, 2, 3)}
    (row,), _, _ = _regenerate(monkeypatch, targets["qwen3"], tmp_path, {"c": ("u1", "u2", "u3")},
                               lambda user: text[user], enable_thinking=thinking)
    gen = "" if thinking else "<think>\n\n</think>\n\n"
    history, own = "", []   # answer k's own sample, by hand: the context it was asked in + its ids as generated
    for k in (1, 2, 3):
        ctx = _ids(tok, history + _turn("user", f"u{k}") + f"{S}assistant\n" + gen)
        answer = _ids(tok, text[f"u{k}"]) + [eos]
        own.append((ctx + answer, list(range(len(ctx), len(ctx) + len(answer)))))
        history += _turn("user", f"u{k}") + f"{S}assistant\nA{k}{E}\n"
    seq = row["prompt_ids"] + row["response_ids"]
    assert seq == own[-1][0]
    split = load_regen(tmp_path / "regen" / "eval.parquet", 4096)
    if thinking:
        assert _samples(split)[0] == own and split.conversations_split == 1
    else:   # the last sample holds A1 and A2 exactly as generated (after the history's header, without the empty
        spans = [list(range(a, b)) for a, b in zip(row["span_starts"], row["span_ends"])]  # think block)
        assert [seq[p] for p in spans[0]] == _ids(tok, "A1") + [eos]
        assert _samples(split)[0] == [(seq, spans[0] + spans[1] + spans[2])] and split.conversations_split == 0
        assert row["turn_tails"][0] == _ids(tok, gen + "A1") + [eos]   # its own sample: from the think block on
    trained = sorted(t for ids, pos in _samples(split)[0] for t in (ids[p] for p in pos))
    assert trained == sorted(t for ids, pos in own for t in (ids[p] for p in pos))   # each answer exactly once
    from dspark_core.cache.source import regen_answers   # draft_vocab's counts: the same tokens

    assert sorted(t for a in regen_answers(tmp_path / "regen" / "eval.parquet") for t in a) == trained
    (one,) = _samples(load_regen(tmp_path / "regen" / "eval.parquet", 4096, long_conversations="truncate"))[0]
    assert one == (seq, [p for a, b in zip(row["span_starts"], row["span_ends"]) for p in range(a, b)])


def test_a_long_conversation_becomes_samples_that_each_end_at_an_answer(targets, tmp_path, monkeypatch):
    """max_length 100, the simple template (history as generated). a: answers of 30, 120 and 20 tokens: three
    samples -- the last answer with the 100 tokens before it, the 120-token answer's first 100 (cut at its tail,
    counted), the first turn whole. b: fits, one sample with both answers. c: answers of 60, 30 and 20: the last
    sample holds the second answer whole, the first gets its own. reports/cache_stats.json counts it all;
    truncate keeps each conversation's first 100 tokens and loses the rest."""
    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    answers = {"a1": "A" * 29, "a2": "B" * 119, "a3": "C" * 19, "b1": "D" * 9, "b2": "E" * 9,
               "c1": "F" * 59, "c2": "G" * 29, "c3": "H" * 19}   # + EOS: 30, 120, 20, ...
    convs = {c: tuple(f"{c}{k}" for k in range(1, n + 1)) for c, n in (("a", 3), ("b", 2), ("c", 3))}
    rows, _, _ = _regenerate(monkeypatch, targets["simple"], tmp_path, convs, lambda user: answers[user])
    own = {}   # {conversation: [(answer k's own sample, the answer's positions in it)]}, by hand
    for c, turns in convs.items():
        history, own[c] = "", []
        for u in turns:
            ctx = _ids(tok, history + _turn("user", u) + f"{S}assistant\n")
            own[c].append((ctx + _ids(tok, answers[u]) + [eos], (len(ctx), len(ctx) + len(answers[u]) + 1)))
            history += _turn("user", u) + _turn("assistant", answers[u])
    for r, c in zip(rows, convs):
        assert r["prompt_ids"] + r["response_ids"] == own[c][-1][0] and r["finish_reasons"] == ["stop"] * len(own[c])

    def tail(ids, span, keep):  # the last `keep` tokens up to the answer's end; loss on the answer
        lo = span[1] - keep
        return ids[lo:span[1]], list(range(span[0] - lo, span[1] - lo))

    (a1, s1), (a2, s2), (a3, s3) = own["a"]
    (c1, t1), (c2, t2), (c3, t3) = own["c"]
    c3_ids, c3_loss = tail(c3, t3, 100)
    lo = t3[1] - 100
    assert c3_ids[t2[0] - lo:t2[1] - lo] == c2[t2[0]:t2[1]]   # answer c2 lies whole in c3's sample, as generated
    want = {0: [(a1, list(range(*s1))), (a2[s2[0]:s2[0] + 100], list(range(100))), tail(a3, s3, 100)],
            1: [(own["b"][1][0], list(range(*own["b"][0][1])) + list(range(*own["b"][1][1])))],
            2: [(c1, list(range(*t1))), (c3_ids, sorted(c3_loss + list(range(t2[0] - lo, t2[1] - lo))))]}
    assert _samples(load_regen(tmp_path / "regen" / "eval.parquet", 100)) == {
        row: sorted(v, key=lambda x: len(x[0])) for row, v in want.items()}

    cfg = CacheConfig(aux_layer_ids=(1, 3), max_length=100, splits=("eval",), target_dir=str(targets["simple"]),
                      regen_dir=str(tmp_path / "regen"), out_dir=str(tmp_path / "cache"),
                      stats_path=str(tmp_path / "cache_stats.json"))
    run_cache(cfg, hidden_states={"eval": "online"})   # token-only store: the same samples, no forward
    stats = json.loads((tmp_path / "cache_stats.json").read_text())
    assert (stats["num_samples"], stats["conversations_split"], stats["answers_cut"], stats["answer_tokens_lost"],
            stats["splits"]["eval"]["long_conversations"]) == (6, 2, 1, 20, "split")
    run_cache(cfg.replace(long_conversations="truncate"), rebuild_stale=True,   # the stage's rebuild: other key
              hidden_states={"eval": "online"})
    stats = json.loads((tmp_path / "cache_stats.json").read_text())
    lost = sum(max(0, b - max(a, 100)) for r in rows for a, b in zip(r["span_starts"], r["span_ends"]))
    assert (stats["num_samples"], stats["conversations_split"], stats["answer_tokens_lost"]) == (3, 0, lost)
    assert lost > 150 and stats["answers_cut"] == 4   # a2 (part of it), a3, c2 (part), c3


def test_backend_none_gives_each_reply_its_own_sample(targets, tmp_path, monkeypatch):
    """The data set's replies (backend: none) through a Qwen3-style template: each reply's own sample is the render
    of the conversation up to it, its thinking kept; split trains both replies with their thinking."""
    tok = tiny_tokenizer("qwen3")
    monkeypatch.setattr(regen, "make_backend", lambda *a, **kw: pytest.fail("backend none loaded a model"))
    r1, r2 = "<think>\nhm\n</think>\n\nFour.", "<think>\nok\n</think>\n\nSixteen."
    write_prompts(tmp_path / "prompts" / "eval.parquet", [Prompt("a", "test", ("2+2?", "squared?"), replies=(r1, r2))])
    run_regenerate(RegenerateConfig.from_dict(dict(
        backend="none", max_turns=3, splits=["eval"], target_dir=str(targets["qwen3"]),
        prompts_dir=str(tmp_path / "prompts"), out_dir=str(tmp_path / "regen"),
        stats_path=str(tmp_path / "stats.json"))))
    head = _turn("user", "2+2?") + f"{S}assistant\n"
    first = _ids(tok, head + r1 + f"{E}\n")        # the render up to reply 1: its think block kept
    whole = _ids(tok, head + f"Four.{E}\n" + _turn("user", "squared?") + f"{S}assistant\n" + r2 + f"{E}\n")
    n, m = len(_ids(tok, head)), len(whole) - len(_ids(tok, r2 + f"{E}\n"))
    assert _samples(load_regen(tmp_path / "regen" / "eval.parquet", 4096))[0] == [
        (first, list(range(n, len(first) - 1))), (whole, list(range(m, len(whole) - 1)))]


def test_a_row_of_several_answers_without_turn_columns(tmp_path):
    """Without each answer's own sample, split refuses the row in one line (rerun regenerate, or truncate), which
    reads it; a row of one answer needs none."""
    t = pa.table({"id": ["a", "b"], "prompt_ids": [[1, 2], [1]], "response_ids": [[3, 4, 5, 6], [2, 3]],
                  "span_starts": pa.array([[2, 5], None], pa.list_(pa.int32())),
                  "span_ends": pa.array([[4, 6], None], pa.list_(pa.int32()))})
    pq.write_table(t, tmp_path / "r.parquet")
    with pytest.raises(UserError, match=r"r.parquet: row 0 \(id 'a'\) holds 2 answers but not each answer's own "
                                        r"sample \(the turn_\* columns\); rerun the regenerate stage \(`dvc repro -f "
                                        r"regenerate`\), or set cache.long_conversations: truncate$"):
        load_regen(tmp_path / "r.parquet", 16)
    assert load_regen(tmp_path / "r.parquet", 16, long_conversations="truncate").offsets.tolist() == [0, 6, 9]
    with pytest.raises(ValueError, match="long_conversations must be one of split, truncate; got 'keep'"):
        CacheConfig.from_dict({"aux_layer_ids": [1], "long_conversations": "keep"}, src="params.yaml")


@pytest.mark.workspace("the project's params.yaml: what the profile check warns of on its defaults")
def test_profile_check_warns_when_the_turns_cannot_fit(tmp_path):
    """seed004 (16 turns x 4,096 new tokens, samples of 4,096): split warns that a 4,096-token answer fills a
    sample alone; truncate warns that the answers past 4,096 tokens are regenerated and not trained; the default
    params (1 x 32 against 256) warn of nothing."""
    import yaml

    seed = yaml.safe_load((ROOT / "profiles" / "seed004_qwen3_4b.yaml").read_text())
    assert seed["cache"]["long_conversations"] == "split"
    report = check_profile("seed004_qwen3_4b", ROOT / "params.yaml", ROOT / "dvc.yaml", samples=10)
    assert report.warnings == ["regenerate.max_new_tokens 4,096 >= cache.max_length 4,096: an answer of 4,096 "
                               "tokens fills its sample alone, with none of its prompt; raise cache.max_length to "
                               "keep long answers with their context"]
    seed["cache"]["long_conversations"] = "truncate"
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(seed))
    (warning,) = check_profile("t", ROOT / "params.yaml", ROOT / "dvc.yaml", samples=10,
                               profiles_dir=tmp_path).warnings
    assert warning.startswith("regenerate.max_turns x max_new_tokens = 16 x 4,096 = 65,536 answer tokens a "
                              "conversation can hold, against cache.max_length 4,096: with "
                              "cache.long_conversations: truncate a conversation keeps its first 4,096 tokens")
    assert check_profile(None, ROOT / "params.yaml", ROOT / "dvc.yaml", samples=10).warnings == []


# -- point 3: cut answers stay cut ------------------------------------------------------------------------------
def test_a_cut_answer_ends_its_conversation_without_an_end_token(targets, tmp_path, monkeypatch):
    """max_new_tokens 16: x's first answer (a think block still open at token 16) is cut: finish reason length, its
    span its 16 generated tokens (no end-of-turn token added), its second turn never asked (counted); y's answers
    stop, so y is asked both turns. The cache's loss ends at the cut answer's last generated token."""
    tok = tiny_tokenizer("qwen3")
    answers = {"x1": "<think>\n" + "long thought " * 4, "x2": "never", "y1": "Sure.", "y2": "Done."}
    (x, y), stats, backend = _regenerate(monkeypatch, targets["qwen3"], tmp_path, {"x": ("x1", "x2"),
                                                                                   "y": ("y1", "y2")},
                                         lambda user: answers[user], max_new_tokens=16)
    ctx = _ids(tok, _turn("user", "x1") + f"{S}assistant\n")
    cut = _ids(tok, answers["x1"])[:16]
    assert (x["prompt_ids"], x["response_ids"], x["finish_reasons"], x["num_turns"]) == (ctx, cut, ["length"], 1)
    assert list(zip(x["span_starts"], x["span_ends"])) == [(len(ctx), len(ctx) + 16)]
    assert tok.eos_token_id not in x["response_ids"] and x["turn_prefix"] is None
    assert [_last_user(t) for t in backend.texts] == ["x1", "y1", "y2"]     # x2 never asked
    assert (y["finish_reasons"], stats["finish_length"], stats["turns_dropped"]) == (["stop", "stop"], 1, 1)
    samples = load_regen(tmp_path / "regen" / "eval.parquet", 4096)
    assert _samples(samples)[0] == [(ctx + cut, list(range(len(ctx), len(ctx) + 16)))]
