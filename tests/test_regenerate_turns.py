"""Multi-turn answers: every user turn answered in order after the target's own earlier answers, the assistant
spans found from the chat template's own render (simple and Qwen3-style templates, checked by hand),
``backend: none`` (the data set's replies), resume, and the spans through cache, anchors, DMTD rows and draft_vocab.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import dspark_core.data.regenerate as regen
from dspark_core.cache import CacheConfig, CacheDataset, CacheCollator, build_store
from dspark_core.cache.source import load_regen
from dspark_core.data.chat import render_with_spans
from dspark_core.data.prompts import Prompt, write_prompts
from dspark_core.data.regenerate import RegenerateConfig, read_regen, run_regenerate
from dspark_core.dmtd.data import read_documents
from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.errors import UserError
from dspark_core.target import load_target, read_fingerprint
from dspark_core.testing import save_tiny_target, tiny_tokenizer
from _regen_utils import CompletionServer, Recorder, Scripted, greedy

MAX_NEW = 10
# greedy (the tiny fixture): c:1 stops twice, then is cut at MAX_NEW; c:3's first answer is cut, its turn 2 dropped
CONVERSATIONS = [("What is 2 + 3?", "And times 4?"), ("Name a color.", "Another one?", "A third?"),
                 ("hi",), ("Name a colour.", "Another one?")]
S, E = "<|im_start|>", "<|im_end|>"   # the simple template's markers (one token each)
_REAL_MAKE_BACKEND = regen.make_backend


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _turn(role: str, content: str) -> str:
    """The simple template's message, by hand."""
    return f"{S}{role}\n{content}{E}\n"


def _write(prompts_dir: Path, prompts: list[Prompt]) -> Path:
    write_prompts(prompts_dir / "eval.parquet", prompts)
    return prompts_dir


def _prompts(root: Path, conversations=CONVERSATIONS, **kw) -> Path:
    return _write(root / "prompts", [Prompt(f"c:{i}", "test", t, **kw) for i, t in enumerate(conversations)])


def _cfg(target: Path, prompts: Path, out: Path, **kw) -> RegenerateConfig:
    base = dict(backend="hf", temperature=0.0, max_new_tokens=MAX_NEW, batch_size=4, splits=["eval"],
                target_dir=str(target), prompts_dir=str(prompts), out_dir=str(out),
                stats_path=str(out.parent / f"{out.name}_stats.json"), max_turns=3)
    return RegenerateConfig.from_dict({**base, **kw})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen3 target whose EOS head row is 2x the head row of the token greedy decoding picks first after
    the first prompt: some turns stop, others run to max_new_tokens."""
    root = tmp_path_factory.mktemp("turns")
    target = save_tiny_target(root / "target", "qwen3")
    model, tok = load_target(target)
    first = greedy(model, _ids(tok, _turn("user", CONVERSATIONS[0][0]) + f"{S}assistant\n"), MAX_NEW, -1)[1]
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 2.0 * model.lm_head.weight[first]
    model.save_pretrained(target)
    return target, _prompts(root)


def _patch_backend(monkeypatch, fail_after=None, make=None) -> list[Recorder]:
    made: list[Recorder] = []

    def build(*args, **kw):
        made.append(Recorder((make or _REAL_MAKE_BACKEND)(*args, **kw), fail_after))
        return made[-1]

    monkeypatch.setattr(regen, "make_backend", build)
    return made


@pytest.fixture(scope="module")
def answered(tiny, tmp_path_factory):
    """Every turn of CONVERSATIONS answered greedily (max_turns 3): the regen file, the stats and the backend's
    calls."""
    target, prompts = tiny
    out = tmp_path_factory.mktemp("answered") / "out"
    made: list[Recorder] = []
    regen.make_backend = lambda *a, **kw: made.append(Recorder(_REAL_MAKE_BACKEND(*a, **kw))) or made[-1]
    try:
        stats = run_regenerate(_cfg(target, prompts, out))
    finally:
        regen.make_backend = _REAL_MAKE_BACKEND
    return out / "eval.parquet", stats, made[0].calls


def _spans(row) -> list[tuple[int, int]]:
    return list(zip(row["span_starts"], row["span_ends"]))


# -- the template's spans, by hand ---------------------------------------------------------------------------
def test_spans_of_the_simple_template_by_hand():
    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a  one\n"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": ""}, {"role": "user", "content": "u3"}]
    r = render_with_spans(tok, msgs, [eos], add_generation_prompt=True)
    head1 = _turn("system", "Be brief.") + _turn("user", "u1") + f"{S}assistant\n"
    head2 = head1 + "a  one\n" + f"{E}\n" + _turn("user", "u2") + f"{S}assistant\n"
    assert r.text == head2 + f"{E}\n" + _turn("user", "u3") + f"{S}assistant\n"
    assert r.ids == _ids(tok, r.text)
    s1 = len(_ids(tok, head1))
    s2 = len(_ids(tok, head2))
    assert r.spans == [(s1, s1 + len(_ids(tok, "a  one\n")) + 1), (s2, s2 + 1)]  # content + EOS; empty: the EOS
    assert all(r.ids[e - 1] == eos for _, e in r.spans)
    # an EOS id the template does not put right after the content is not taken
    assert render_with_spans(tok, msgs, [tok.pad_token_id], add_generation_prompt=True).spans == [
        (s1, s1 + len(_ids(tok, "a  one\n"))), (s2, s2)]


def test_spans_of_a_qwen3_style_template_by_hand():
    """History answers lose their think block (the span: what the template kept, + EOS); an answer after the last
    user turn keeps it, the span from the token after the assistant header; enable_thinking false adds the empty
    think block to the generation prompt only."""
    tok = tiny_tokenizer("qwen3")
    eos = tok.eos_token_id
    a1, a2 = "<think>\nfirst thoughts\n</think>\n\nA1", "<think>\nr2\n</think>\n\nA2 done"
    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": a1},
            {"role": "user", "content": "u2"}]
    history = _turn("user", "u1") + f"{S}assistant\n" + f"A1{E}\n" + _turn("user", "u2")
    head = _turn("user", "u1") + f"{S}assistant\n"
    for flag, gen in ((None, ""), (True, ""), (False, "<think>\n\n</think>\n\n")):
        r = render_with_spans(tok, msgs, [eos], add_generation_prompt=True, enable_thinking=flag)
        assert r.text == history + f"{S}assistant\n" + gen, flag
        assert r.spans == [(len(_ids(tok, head)), len(_ids(tok, head)) + len(_ids(tok, "A1")) + 1)]
        assert tok.decode(r.ids[slice(*r.spans[0])]) == f"A1{E}"
    whole = msgs + [{"role": "assistant", "content": a2}]
    r = render_with_spans(tok, whole, [eos], add_generation_prompt=False, enable_thinking=True)
    assert r.text == history + f"{S}assistant\n" + a2 + f"{E}\n"
    start = len(_ids(tok, history + f"{S}assistant\n"))
    assert r.spans[1] == (start, start + len(_ids(tok, a2)) + 1)
    assert _ids(tok, "<think>")[0] == r.ids[start] == tok.convert_tokens_to_ids("<think>")   # one token


def test_a_template_that_renders_an_answer_twice_is_refused():
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% if m['role'] == 'assistant' %}({{ m['content'] }}){% endif %}{% endfor %}")
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(UserError, match=r"tpl: the chat template does not render assistant message 1 once, in place"):
        render_with_spans(tok, msgs, [tok.eos_token_id], add_generation_prompt=False, where="tpl")


# -- regenerate: the target answers every turn -----------------------------------------------------------------
def test_every_turn_answered_after_the_targets_own_answers(tiny, answered):
    """Greedy, by hand: turn k's context is the simple template's render of the earlier turns with the target's
    answers (decoded without their EOS), the backend got exactly those ids, the answers are the plain greedy ones,
    the sample is the last context + the last answer, and its spans are the answers (+ the template's EOS)."""
    target, _ = tiny
    path, stats, calls = answered
    model, tok = load_target(target)
    eos = tok.eos_token_id
    rows = {r["id"]: r for r in read_regen(path)}
    asked = {}   # (conversation, turn) -> prompt ids the backend received
    for call in calls:
        for req in call:
            asked[(req.id, sum(k[0] == req.id for k in asked))] = list(req.prompt_ids)
    reasons, dropped = [], 0
    for i, turns in enumerate(CONVERSATIONS):
        row, text, spans, answer, ctx, n = rows[f"c:{i}"], "", [], [], [], 0
        for k, user in enumerate(turns):
            if k:
                if answer[-1] != eos:   # cut at max_new_tokens: its conversation ends with it
                    break
                spans.append((len(_ids(tok, text + f"{S}assistant\n")),))
                text += f"{S}assistant\n" + tok.decode(answer[:-1], clean_up_tokenization_spaces=False) + f"{E}\n"
                spans[-1] += (len(_ids(tok, text)) - 1,)
            text += _turn("user", user)
            ctx = _ids(tok, text + f"{S}assistant\n")
            assert asked[(f"c:{i}", k)] == ctx, (i, k)
            answer = greedy(model, ctx, MAX_NEW, eos)
            reasons.append("stop" if answer[-1] == eos else "length")
            n = k + 1
        dropped += len(turns) - n
        seq = row["prompt_ids"] + row["response_ids"]
        assert seq == ctx + answer
        assert _spans(row) == spans + [(len(ctx), len(ctx) + len(answer))]  # a cut answer: no end token added
        assert len(row["prompt_ids"]) == (spans[0][0] if spans else len(ctx))  # tokens before the first answer
        assert row["num_turns"] == n and len(row["finish_reasons"]) == n
        assert row["finish_reason"] == row["finish_reasons"][-1]
        assert all(seq[e - 1] == eos for _, e in spans)
        assert "length" not in row["finish_reasons"][:-1]
    assert {"stop", "length"} <= set(reasons)
    assert sorted(r for row in rows.values() for r in row["finish_reasons"]) == sorted(reasons)
    s = stats["splits"]["eval"]
    assert s["turns"] == len(reasons) == len(asked) and s["turns_dropped"] == dropped > 0
    assert s["answer_tokens"] == sum(b - a for row in rows.values() for a, b in _spans(row))
    assert max(r["num_turns"] for r in rows.values()) > 1
    assert [len(c) for c in calls] == [4, 2, 1]   # every first turn at once, then the second turns, ...


def test_max_turns_one_and_own_system_messages(tiny, answered, tmp_path):
    """max_turns 1: the first turns only, the rows of single-turn prompts unchanged, the settings key without the
    new params (earlier answers stay current); a conversation's own system message wins over system_prompt."""
    target, prompts = tiny
    model, tok = load_target(target)
    run_regenerate(_cfg(target, prompts, tmp_path / "one", max_turns=1))
    one = read_regen(tmp_path / "one" / "eval.parquet")
    three = {r["id"]: r for r in read_regen(answered[0])}
    assert [r["num_turns"] for r in one] == [1] * len(CONVERSATIONS)
    assert one[2] == three["c:2"]                                          # "hi": one turn either way
    for r, turns in zip(one, CONVERSATIONS):
        assert r["prompt_ids"] == _ids(tok, _turn("user", turns[0]) + f"{S}assistant\n")
        assert r["response_ids"] == greedy(model, r["prompt_ids"], MAX_NEW, tok.eos_token_id)
        assert _spans(r) == [(len(r["prompt_ids"]), len(r["prompt_ids"]) + len(r["response_ids"]))]
    settings = regen._settings(_cfg(target, prompts, tmp_path, max_turns=1), "fp")
    assert "max_turns" not in settings and "enable_thinking" not in settings
    assert regen._settings(_cfg(target, prompts, tmp_path, enable_thinking=False), "fp")["enable_thinking"] is False

    own = _write(tmp_path / "sys", [Prompt("a", "test", ("u1", "u2"), system="Mine."), Prompt("b", "test", ("u",))])
    run_regenerate(_cfg(target, own, tmp_path / "sys_out", system_prompt="Default."))
    a, b = read_regen(tmp_path / "sys_out" / "eval.parquet")
    assert a["prompt_text"].startswith(_turn("system", "Mine.") + _turn("user", "u1"))
    assert b["prompt_text"] == _turn("system", "Default.") + _turn("user", "u") + f"{S}assistant\n"


def test_a_killed_multi_turn_run_resumes_to_the_same_bytes(tiny, tmp_path, monkeypatch):
    """Sampling, two conversations a batch: killed during the second batch's third turn (the first batch is a
    part file), the same command gives the bytes of an uninterrupted run; later turns draw their own seeds."""
    target, prompts = tiny
    cfg = _cfg(target, prompts, tmp_path / "out", batch_size=2, temperature=1.0, top_p=1.0, top_k=0)
    killed = _patch_backend(monkeypatch, fail_after=4)   # batch 1: turns 1, 2; batch 2: turns 1, 2, then killed
    with pytest.raises(KeyboardInterrupt):
        run_regenerate(cfg)
    assert [len(c) for c in killed[0].calls] == [2, 1, 2, 1]
    assert len(list((tmp_path / "out" / "parts" / "eval").glob("part-*.parquet"))) == 1
    again = _patch_backend(monkeypatch)
    run_regenerate(cfg)
    first = {r.id for r in killed[0].calls[0]}
    assert {r.id for c in again[0].calls for r in c} == {f"c:{i}" for i in range(4)} - first   # not again
    monkeypatch.setattr(regen, "make_backend", _REAL_MAKE_BACKEND)
    run_regenerate(cfg.replace(out_dir=str(tmp_path / "ref")))
    assert (tmp_path / "out" / "eval.parquet").read_bytes() == (tmp_path / "ref" / "eval.parquet").read_bytes()
    seeds = {regen.turn_seed(0, "c:1", k) for k in range(3)}
    assert len(seeds) == 3 and regen.turn_seed(0, "c:1", 0) == regen.request_seed(0, "c:1")


def test_another_prompt_set_keeps_the_conversations_it_can_and_the_time_budget(tiny, answered, tmp_path,
                                                                                 monkeypatch):
    """A later turn reworded and a conversation added: only those two are answered, the others keep their rows
    (their input keys); another max_turns keeps nothing. A time budget answers whole conversations."""
    import shutil

    target, _ = tiny
    out = tmp_path / "out"
    shutil.copytree(answered[0].parent, out)
    before = {r["id"]: r for r in read_regen(out / "eval.parquet")}
    changed = list(CONVERSATIONS) + [("A new one.", "Go on.")]
    changed[1] = (changed[1][0], "Another colour?", changed[1][2])
    prompts = _prompts(tmp_path, changed)
    made = _patch_backend(monkeypatch)
    stats = run_regenerate(_cfg(target, prompts, out))
    assert {r.id for c in made[0].calls for r in c} == {"c:1", "c:4"}
    assert stats["splits"]["eval"]["kept_answers"] == 3
    rows = {r["id"]: r for r in read_regen(out / "eval.parquet")}
    assert all(rows[i] == before[i] for i in ("c:0", "c:2", "c:3")) and rows["c:1"] != before["c:1"]
    assert rows["c:1"]["input_key"] != before["c:1"]["input_key"]
    made = _patch_backend(monkeypatch)
    assert run_regenerate(_cfg(target, prompts, out, max_turns=2))["splits"]["eval"]["kept_answers"] == 0
    assert len({r.id for c in made[0].calls for r in c}) == len(changed)

    made = _patch_backend(monkeypatch)
    stats = run_regenerate(_cfg(target, prompts, tmp_path / "budget", batch_size=2), time_budget_s=1e-6)
    first = {r.id for r in made[0].calls[0]}
    rows = read_regen(tmp_path / "budget" / "eval.parquet")
    assert {r["id"] for r in rows} == first and stats["splits"]["eval"]["skipped_prompts"] == len(changed) - 2
    assert all(r["num_turns"] == len(changed[int(r["id"][2:])]) or r["finish_reason"] == "length"
               for r in rows)   # every turn of the batch (up to a cut answer)


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_style_template_drops_earlier_thinking_and_keeps_the_last(tmp_path, monkeypatch, thinking):
    """enable_thinking reaches the template: with thinking the answers carry a think block, which the next turn's
    context drops (the template's history) while the last answer keeps it, exactly as generated; without, every
    prompt ends with the empty think block."""
    target = save_tiny_target(tmp_path / "target", "qwen3", template="qwen3")
    tok = tiny_tokenizer("qwen3")
    answer = (lambda k: f"<think>\nstep {k}\n</think>\n\nA{k}") if thinking else (lambda k: f"A{k}")
    made: list[Scripted] = []
    monkeypatch.setattr(regen, "make_backend", lambda *a, **kw: made.append(
        Scripted(tok, lambda text: answer(text.count(f"{S}user")))) or made[-1])
    prompts = _write(tmp_path / "prompts", [Prompt("c", "test", ("u1", "u2"))])
    run_regenerate(_cfg(target, prompts, tmp_path / "out", enable_thinking=thinking, max_new_tokens=32))
    (row,) = read_regen(tmp_path / "out" / "eval.parquet")
    gen = "" if thinking else "<think>\n\n</think>\n\n"
    head = _turn("user", "u1") + f"{S}assistant\n"
    ctx2 = head + f"A1{E}\n" + _turn("user", "u2") + f"{S}assistant\n" + gen
    assert made[0].texts == [head + gen, ctx2]
    seq = row["prompt_ids"] + row["response_ids"]
    last = _ids(tok, answer(2)) + [tok.eos_token_id]
    assert seq == _ids(tok, ctx2) + last
    assert [tok.decode(seq[a:b]) for a, b in _spans(row)] == [f"A1{E}", answer(2) + E]
    assert row["prompt_ids"] == _ids(tok, head)


def test_openai_backend_answers_every_turn(tiny, tmp_path):
    """An OpenAI-compatible server (a local stub) gets each turn's context, as chat-templated text here
    (``openai_send_token_ids: false``), the earlier answers of the server in it."""
    server = CompletionServer(lambda body: f"ans {body['prompt'].count(S + 'user')}")
    target, _ = tiny
    tok = tiny_tokenizer()
    prompts = _write(tmp_path / "prompts", [Prompt("c", "test", ("u1", "u2"))])
    try:
        run_regenerate(_cfg(target, prompts, tmp_path / "out", backend="openai", openai_send_token_ids=False,
                            openai_base_url=server.url, openai_timeout_s=20))
    finally:
        server.stop()
    ctx2 = _turn("user", "u1") + f"{S}assistant\n" + f"ans 1{E}\n" + _turn("user", "u2") + f"{S}assistant\n"
    assert [b["prompt"] for b in server.bodies] == [_turn("user", "u1") + f"{S}assistant\n", ctx2]
    (row,) = read_regen(tmp_path / "out" / "eval.parquet")
    assert row["prompt_ids"] + row["response_ids"] == _ids(tok, ctx2 + f"ans 2{E}")
    assert [tok.decode((row["prompt_ids"] + row["response_ids"])[a:b]) for a, b in _spans(row)] == [f"ans 1{E}",
                                                                                                  f"ans 2{E}"]


# -- backend none: the data set's own replies ----------------------------------------------------------------
def test_backend_none_takes_the_replies_and_loads_no_model(tmp_path, monkeypatch):
    target = save_tiny_target(tmp_path / "target", "qwen3", template="qwen3")
    tok = tiny_tokenizer("qwen3")
    monkeypatch.setattr(regen, "make_backend", lambda *a, **kw: pytest.fail("backend none loaded a model"))
    r1, r2 = "<think>\nhm\n</think>\n\nFour.", "<think>\nok\n</think>\n\nSixteen."
    prompts = _write(tmp_path / "prompts", [Prompt("a", "test", ("2+2?", "squared?"), system="Math.",
                                                   replies=(r1, r2)),
                                            Prompt("b", "test", ("hi", "more"), replies=("hello",))])
    stats = run_regenerate(_cfg(target, prompts, tmp_path / "out", backend="none"))
    a, b = read_regen(tmp_path / "out" / "eval.parquet")
    head = _turn("system", "Math.") + _turn("user", "2+2?") + f"{S}assistant\n"
    history = head + f"Four.{E}\n" + _turn("user", "squared?") + f"{S}assistant\n"
    assert a["prompt_ids"] + a["response_ids"] == _ids(tok, history + r2 + f"{E}\n")
    s1, s2 = len(_ids(tok, head)), len(_ids(tok, history))
    assert _spans(a) == [(s1, s1 + len(_ids(tok, "Four.")) + 1), (s2, s2 + len(_ids(tok, r2)) + 1)]
    assert (a["backend"], a["finish_reasons"], a["num_turns"], a["prompt_ids"]) == ("none", ["given"] * 2, 2,
                                                                                   _ids(tok, head))
    assert b["num_turns"] == 1 and b["prompt_ids"] + b["response_ids"] == _ids(
        tok, _turn("user", "hi") + f"{S}assistant\n<think>\n\n</think>\n\nhello{E}\n")   # the template's last turn
    assert stats["splits"]["eval"]["turns"] == 3 and stats["splits"]["eval"]["tokens_per_s"] is None

    _write(tmp_path / "prompts", [Prompt("a", "test", ("q",), replies=("r",)), Prompt("x:7", "test", ("q",))])
    with pytest.raises(UserError, match=r"prompts/eval.parquet: row id='x:7' has no assistant replies; "
                                        r"regenerate.backend: none takes the data set's own answers"):
        run_regenerate(_cfg(target, prompts, tmp_path / "out2", backend="none"))
    assert not (tmp_path / "out2").exists()



@pytest.mark.parametrize("template", ["simple", "qwen3"])
def test_enable_thinking_on_a_template_without_the_switch_says_it_does_nothing(tmp_path, caplog, template):
    """regenerate.enable_thinking set on a target whose chat template renders the same with true and false (the
    simple one, as SmolLM2's): one warning line; a Qwen3-style template reads it: nothing said."""
    target = save_tiny_target(tmp_path / "target", "qwen3", template=template)
    prompts = _write(tmp_path / "prompts", [Prompt("a", "test", ("2+2?",), replies=("Four.",))])
    with caplog.at_level("WARNING", logger="dspark_core.data.regenerate"):
        run_regenerate(_cfg(target, prompts, tmp_path / "out", backend="none", enable_thinking=True))
    said = [r.getMessage() for r in caplog.records if "enable_thinking" in r.getMessage()]
    if template == "qwen3":
        assert said == []
        return
    assert said == [f"regenerate.enable_thinking: true does nothing: the chat template of {target} has no "
                    "enable_thinking switch (it renders the same with true and false); set it to null"]

# -- the spans downstream: cache, anchors, DMTD rows, draft_vocab ---------------------------------------------
def test_cache_loss_mask_anchors_and_dmtd_rows_follow_the_spans(tiny, answered, tmp_path):
    target, _ = tiny
    path = answered[0]
    rows = read_regen(path)
    masks = []
    for r in rows:
        m = np.zeros(len(r["prompt_ids"]) + len(r["response_ids"]), dtype=bool)
        for a, b in _spans(r):
            m[a:b] = True
        masks.append(m)
    assert any(len(r["span_starts"]) > 1 for r in rows)
    cfg = CacheConfig(aux_layer_ids=(1, 3), max_length=512, chunk_tokens=256, batch_tokens=512, device="cpu",
                      target_dir=str(target), splits=("eval",))
    model, _ = load_target(target)
    build_store(model, read_fingerprint(target)["fingerprint"], cfg, path, tmp_path / "eval.zarr")
    ds = CacheDataset(tmp_path / "eval.zarr")
    order = load_regen(path, 512).order
    items = [ds[n] for n in range(len(ds))]
    for n, item in enumerate(items):
        assert item["loss_mask"].numpy().tolist() == masks[order[n]].tolist()
    batch = add_anchor_fields(CacheCollator(pad_id=0)(items), num_anchors=64, block_size=4,
                              generator=torch.Generator().manual_seed(0))
    span_of = torch.full(batch["loss_mask"].shape, -1)           # [B, L] the span a position is in, -1 outside
    for n in range(len(items)):
        for j, (a, b) in enumerate(_spans(rows[order[n]])):
            span_of[n, a:b] = j
    anchors, valid = batch["anchors"], batch["anchor_valid"]    # [B, A]
    assert valid.sum() > 0
    inside = span_of.gather(1, anchors)
    assert (inside[valid] >= 0).all()
    pos = anchors.unsqueeze(-1) + torch.arange(1, 5)             # [B, A, S] the tokens the slots predict
    slot_span = span_of.gather(1, pos.clamp(max=span_of.shape[1] - 1).flatten(1)).view_as(pos)
    ok = batch["slot_valid"]
    assert (slot_span[ok] == inside.unsqueeze(-1).expand_as(pos)[ok]).all()   # a block never leaves its span
    assert ok[:, :, 0][valid].all()
    docs, _ = read_documents(path, 512)
    assert sorted(d.supervised.tolist() for d in docs) == sorted(m.tolist() for m in masks)


def test_load_regen_refuses_spans_out_of_order(tmp_path):
    import pyarrow as pa

    t = pa.table({"id": ["a"], "prompt_ids": [[1, 2]], "response_ids": [[3, 4, 5]],
                  "span_starts": pa.array([[3, 1]], pa.list_(pa.int32())),
                  "span_ends": pa.array([[4, 2]], pa.list_(pa.int32()))})
    pq.write_table(t, tmp_path / "r.parquet")
    with pytest.raises(UserError, match=r"r.parquet: row 0 \(id 'a'\) has loss spans \[\(3, 4\), \(1, 2\)\] that are "
                                        r"not ordered, disjoint spans of its 5 tokens; rerun the regenerate stage"):
        load_regen(tmp_path / "r.parquet", 16)


def test_draft_vocab_counts_the_span_tokens(tmp_path):
    import json

    import pyarrow as pa

    from dspark_core.draft.vocab import run_draft_vocab_stage

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"vocab_size": 10}))
    (tmp_path / "target" / "fingerprint.json").write_text(json.dumps({"fingerprint": "fp"}))
    # row a: spans 2..4 and 6..7 of [9 9 | 1 2 8 8 3 8]; row b: no span columns (the response: [4 4])
    t = pa.table({"id": ["a", "b"], "prompt_ids": [[9, 9], [8]], "response_ids": [[1, 2, 8, 8, 3, 8], [4, 4]],
                  "span_starts": pa.array([[2, 6], None], pa.list_(pa.int32())),
                  "span_ends": pa.array([[4, 7], None], pa.list_(pa.int32()))})
    pq.write_table(t, tmp_path / "train.parquet")
    (tmp_path / "params.yaml").write_text(json.dumps({"draft_vocab": {"report_sizes": [2]}}))
    stats = run_draft_vocab_stage(tmp_path / "params.yaml", target_dir=tmp_path / "target",
                                  regen=tmp_path / "train.parquet", out=tmp_path / "r.safetensors",
                                  report=tmp_path / "r.json")
    from dspark_core.draft.vocab import read_ranking

    _, counts = read_ranking(tmp_path / "r.safetensors", 10, "fp")
    assert counts.tolist() == [0, 1, 1, 1, 2, 0, 0, 0, 0, 0]
    assert stats["answer_tokens"] == 5 and stats["answers"] == 3


# -- the real packaged model: hf and vLLM answer every turn alike ----------------------------------------------
@pytest.mark.slow
def test_hf_and_vllm_answer_every_turn_alike_on_packaged_model(packaged_target, tmp_path):
    """Greedy on SmolLM2, one vLLM run of the regenerate stage (its own process, under its __main__ guard: vLLM
    spawns workers) and one hf run: two conversations of two turns and one of one turn; vLLM (fed the same context
    ids a turn) gives hf's tokens, spans and finish reasons, for every turn."""
    import os
    import subprocess
    import sys

    import yaml

    pytest.importorskip("vllm")
    prompts = _write(tmp_path / "prompts", [Prompt("a", "test", ("What is 12 times 3?", "And plus 4?")),
                                            Prompt("b", "test", ("Name a fruit.", "Another one."), system="Be brief."),
                                            Prompt("c", "test", ("Say hello in French.",))])
    common = dict(temperature=0.0, max_new_tokens=24, batch_size=3, splits=["eval"], dtype="float32", max_turns=2,
                  target_dir=str(packaged_target), prompts_dir=str(prompts), stats_path=str(tmp_path / "stats.json"))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"regenerate": {**common, "backend": "vllm", "vllm_enforce_eager": True,
                                                     "out_dir": str(tmp_path / "vllm")}}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    script = Path(__file__).resolve().parents[1] / "stages" / "regenerate.py"
    proc = subprocess.run([sys.executable, str(script), "--params", str(params)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_regenerate(RegenerateConfig.from_dict({**common, "backend": "hf", "out_dir": str(tmp_path / "hf")}))
    v, h = (read_regen(tmp_path / d / "eval.parquet") for d in ("vllm", "hf"))
    assert [r["backend"] for r in v] == ["vllm"] * 3 and [r["backend"] for r in h] == ["hf"] * 3
    assert [r["id"] for r in v] == [r["id"] for r in h] == ["a", "b", "c"] and h[2]["num_turns"] == 1
    assert sum(len(r["response_ids"]) for r in h) > 3 * 8  # real answers, not just an EOS
    # both turns answered, unless the first answer was cut at max_new_tokens (a cut answer ends its conversation)
    assert all(r["num_turns"] == 2 or r["finish_reasons"] == ["length"] for r in h), [r["finish_reasons"] for r in h]
    assert h[0]["num_turns"] == 2 and all(len(r["span_starts"]) == r["num_turns"] for r in h)
    for a, b in zip(v, h):
        assert (a["prompt_ids"], a["response_ids"], _spans(a), a["finish_reasons"]) == (
            b["prompt_ids"], b["response_ids"], _spans(b), b["finish_reasons"]), a["id"]
