"""The `regenerate` stage: hf backend (reference greedy, batching, resume), openai stub (hf == vLLM on the packaged
model: tests/test_regenerate_turns.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import dspark_core.data.regenerate as regen
from dspark_core.config import ParamsError
from dspark_core.data.backends import finalize_response
from dspark_core.data.prompts import Prompt, write_prompts
from dspark_core.data.regenerate import (RegenerateConfig, chat_prompt, mark_answers_reusable, read_regen,
                                         run_regenerate)
from dspark_core.target import load_target
from dspark_core.testing import save_tiny_target
from _regen_utils import Recorder, greedy

QUESTIONS = ["What is 2 + 3?", "Name a color.", "Write a haiku about rain.", "hi",
             "Explain gravity in one sentence.", "Count to five."]
MAX_NEW = 12
_REAL_MAKE_BACKEND = regen.make_backend


def _prompts_dir(root: Path, texts=QUESTIONS) -> Path:
    d = root / "prompts"
    prompts = [Prompt(f"q:{i}", "test", (t,)) for i, t in enumerate(texts)]
    write_prompts(d / "eval.parquet", prompts)
    write_prompts(d / "train.parquet", [Prompt("t:0", "test", ("Say yes.",))])
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen3 target whose EOS head row is 2x the head row of a token greedy decoding picks early,
    so some answers stop ('stop') and others run to max_new_tokens ('length')."""
    root = tmp_path_factory.mktemp("regen")
    target = save_tiny_target(root / "target", "qwen3")
    model, tok = load_target(target)
    _, ids = chat_prompt(tok, QUESTIONS[0])
    first = greedy(model, ids, MAX_NEW, eos=-1)[2]
    with torch.no_grad():
        head = model.lm_head.weight  # [V, H]
        head[tok.eos_token_id] = 2.0 * head[first]
    model.save_pretrained(target)
    return target, _prompts_dir(root)


def _cfg(target: Path, prompts: Path, out: Path, **kw) -> RegenerateConfig:
    base = dict(backend="hf", temperature=0.0, max_new_tokens=MAX_NEW, batch_size=4, splits=["eval"],
                target_dir=str(target), prompts_dir=str(prompts), out_dir=str(out),
                stats_path=str(out.parent / f"{out.name}_stats.json"))
    return RegenerateConfig.from_dict({**base, **kw})


def test_finalize_response():
    assert finalize_response([5, 9, 2, 7, 2], "length", [2], 10) == ([5, 9, 2], "stop")
    assert finalize_response([5, 9, 7], "length", [2, 3], 3) == ([5, 9, 7], "length")
    assert finalize_response([5, 9, 7, 8], "length", [2], 3) == ([5, 9, 7], "length")
    assert finalize_response([5, 3], "stop", [2, 3], 8) == ([5, 3], "stop")
    assert finalize_response([5, 9], "stop", [2, 3], 8) == ([5, 9, 2], "stop")   # server cut the EOS
    assert finalize_response([], "stop", [2], 8) == ([2], "stop")


def test_hf_greedy_equals_reference_loop(tiny, tmp_path):
    target, prompts = tiny
    run_regenerate(_cfg(target, prompts, tmp_path / "out"))
    rows = read_regen(tmp_path / "out" / "eval.parquet")
    model, tok = load_target(target)
    eos = tok.eos_token_id
    assert [r["id"] for r in rows] == [f"q:{i}" for i in range(len(QUESTIONS))]   # prompt order
    for r, q in zip(rows, QUESTIONS):
        text, ids = chat_prompt(tok, q)
        assert r["prompt_ids"] == ids and r["prompt_text"] == text and r["backend"] == "hf"
        assert r["response_ids"] == greedy(model, ids, MAX_NEW, eos)
        assert r["response_text"] == tok.decode(r["response_ids"], skip_special_tokens=True)
        if r["finish_reason"] == "stop":
            assert r["response_ids"][-1] == eos and eos not in r["response_ids"][:-1]
        else:
            assert r["finish_reason"] == "length" and len(r["response_ids"]) == MAX_NEW
    assert {r["finish_reason"] for r in rows} == {"stop", "length"}
    stats = json.loads((tmp_path / "out_stats.json").read_text())["splits"]["eval"]
    assert stats["new_tokens_now"] == stats["response_tokens"] == sum(len(r["response_ids"]) for r in rows)
    assert not (tmp_path / "out" / "parts").exists()


def test_batching_and_system_prompt(tiny, tmp_path):
    target, prompts = tiny
    run_regenerate(_cfg(target, prompts, tmp_path / "a", batch_size=1))
    run_regenerate(_cfg(target, prompts, tmp_path / "b", batch_size=6))
    a, b = (read_regen(tmp_path / d / "eval.parquet") for d in "ab")
    assert [r["response_ids"] for r in a] == [r["response_ids"] for r in b]   # left padding changes nothing
    run_regenerate(_cfg(target, prompts, tmp_path / "s", system_prompt="Be brief."))
    s = read_regen(tmp_path / "s" / "eval.parquet")
    assert s[0]["prompt_text"].startswith("<|im_start|>system\nBe brief.<|im_end|>")


def _patch_backend(monkeypatch, fail_after=None) -> list[Recorder]:
    made: list[Recorder] = []

    def make(*args, **kw):
        made.append(Recorder(_REAL_MAKE_BACKEND(*args, **kw), fail_after))
        return made[-1]

    monkeypatch.setattr(regen, "make_backend", make)
    return made


def test_resume_after_interrupt_skips_done_ids(tiny, tmp_path, monkeypatch):
    target, prompts = tiny
    out = tmp_path / "out"
    cfg = _cfg(target, prompts, out, batch_size=2, temperature=0.7)
    first = _patch_backend(monkeypatch, fail_after=1)
    with pytest.raises(KeyboardInterrupt):
        run_regenerate(cfg)
    done = first[0].batches[0]
    assert len(done) == 2 and not (out / "eval.parquet").exists()
    assert len(list((out / "parts" / "eval").glob("part-*.parquet"))) == 1

    second = _patch_backend(monkeypatch)
    run_regenerate(cfg)
    redone = [i for b in second[0].batches for i in b]
    assert sorted(redone + done) == sorted(f"q:{i}" for i in range(len(QUESTIONS)))
    assert not set(redone) & set(done)
    resumed = read_regen(out / "eval.parquet")

    third = _patch_backend(monkeypatch)
    run_regenerate(cfg)                       # final file is current: nothing to do, no backend
    assert third == []
    assert read_regen(out / "eval.parquet") == resumed
    assert not (out / "parts").exists()


def test_a_rerun_that_keeps_every_answer_keeps_their_measured_throughput(tiny, tmp_path, monkeypatch):
    """The report's regenerate_tokens_per_s reads ``last_measured``: a rerun that generates nothing carries the
    figure of the run that made the answers; without that run's stats file, or with another target's, it has none."""
    target, prompts = tiny
    out = tmp_path / "out"
    cfg = _cfg(target, prompts, out, batch_size=3)
    first = run_regenerate(cfg)["splits"]["eval"]
    measured = first["last_measured"]
    assert measured["new_tokens"] == first["new_tokens_now"] == first["response_tokens"] > 0
    assert measured["generate_seconds"] == first["generate_seconds"] > 0
    assert measured["tokens_per_s"] == first["tokens_per_s"] > 0

    made = _patch_backend(monkeypatch)
    for _ in range(2):  # kept twice: the figure is carried on, not lost after one rerun
        again = run_regenerate(cfg)["splits"]["eval"]
        assert made == [] and again["generated_now"] == 0 and again["tokens_per_s"] is None
        assert again["last_measured"] == measured
    stats_path = Path(cfg.stats_path)
    other = {**json.loads(stats_path.read_text()), "target_fingerprint": "another"}
    stats_path.write_text(json.dumps(other))
    assert "last_measured" not in run_regenerate(cfg)["splits"]["eval"]  # not these answers' figure
    stats_path.unlink()
    assert "last_measured" not in run_regenerate(cfg)["splits"]["eval"]  # nothing measured is known


def test_time_budget_answers_a_subset_and_a_rerun_completes(tiny, tmp_path, monkeypatch):
    target, prompts = tiny
    out = tmp_path / "out"
    cfg = _cfg(target, prompts, out, batch_size=2)
    first = _patch_backend(monkeypatch)
    stats = run_regenerate(cfg, time_budget_s=1e-6)   # runs out at once: the split still gets one batch
    assert len(first[0].batches) == 1
    rows = read_regen(out / "eval.parquet")
    assert [r["id"] for r in rows] == [i for i in (f"q:{k}" for k in range(len(QUESTIONS)))
                                       if i in first[0].batches[0]]  # prompt order, answered ones only
    assert stats["splits"]["eval"]["skipped_prompts"] == len(QUESTIONS) - 2
    assert (out / "parts" / "eval").is_dir()         # kept: a rerun continues

    second = _patch_backend(monkeypatch)
    stats = run_regenerate(cfg)                       # no budget: the rest
    assert sorted(i for b in second[0].batches for i in b) == sorted(
        f"q:{k}" for k in range(len(QUESTIONS)) if f"q:{k}" not in first[0].batches[0])
    assert len(read_regen(out / "eval.parquet")) == len(QUESTIONS)
    assert "skipped_prompts" not in stats["splits"]["eval"] and not (out / "parts").exists()
    full = read_regen(out / "eval.parquet")
    ref = tmp_path / "ref"
    run_regenerate(_cfg(target, prompts, ref, batch_size=2))
    assert full == read_regen(ref / "eval.parquet")  # greedy: the same rows as one uninterrupted run

    with pytest.raises(ValueError, match="time budget must be > 0"):
        run_regenerate(cfg, time_budget_s=0)


def test_stale_parts_are_discarded(tiny, tmp_path, monkeypatch):
    target, prompts = tiny
    out = tmp_path / "out"
    _patch_backend(monkeypatch, fail_after=1)
    with pytest.raises(KeyboardInterrupt):
        run_regenerate(_cfg(target, prompts, out, batch_size=2))
    made = _patch_backend(monkeypatch)
    run_regenerate(_cfg(target, prompts, out, batch_size=2, max_new_tokens=5))   # other settings
    assert sum(len(b) for b in made[0].batches) == len(QUESTIONS)
    assert all(len(r["response_ids"]) <= 5 for r in read_regen(out / "eval.parquet"))


def _write_eval(prompts: Path, items: list[tuple[str, str]]) -> None:
    write_prompts(prompts / "eval.parquet", [Prompt(i, "test", (t,)) for i, t in items])


def test_another_prompt_set_keeps_the_answers_it_can(tiny, tmp_path, monkeypatch):
    """Prompts added, one dropped, one reworded: only the new and the reworded prompts are answered, the
    others keep their rows, and the split equals a run from scratch on the new set. Other settings keep nothing;
    a final file of the older stage (no row key) is kept only once a run on its own prompts has marked it."""
    target, _ = tiny
    prompts, out = tmp_path / "prompts", tmp_path / "out"
    first = [(f"q:{i}", QUESTIONS[i]) for i in range(4)]
    second = first[:2] + [("q:2", "Name a fruit."), ("q:4", QUESTIONS[4]), ("q:5", QUESTIONS[5])]  # q:3 dropped
    _write_eval(prompts, first)
    cfg = _cfg(target, prompts, out, batch_size=2)
    run_regenerate(cfg)
    before = {r["id"]: r for r in read_regen(out / "eval.parquet")}

    _write_eval(prompts, second)
    made = _patch_backend(monkeypatch)
    stats = run_regenerate(cfg)
    assert sorted(i for b in made[0].batches for i in b) == ["q:2", "q:4", "q:5"]
    assert stats["splits"]["eval"]["kept_answers"] == 2 and stats["splits"]["eval"]["generated_now"] == 3
    rows = read_regen(out / "eval.parquet")
    assert [r["id"] for r in rows] == [i for i, _ in second] and rows[:2] == [before["q:0"], before["q:1"]]
    monkeypatch.setattr(regen, "make_backend", _REAL_MAKE_BACKEND)
    run_regenerate(_cfg(target, prompts, tmp_path / "scratch", batch_size=2))
    assert [(r["prompt_ids"], r["response_ids"]) for r in rows] == [
        (r["prompt_ids"], r["response_ids"]) for r in read_regen(tmp_path / "scratch" / "eval.parquet")]
    assert not (out / "parts").exists()

    _write_eval(prompts, first)  # other settings: nothing is kept
    made = _patch_backend(monkeypatch)
    stats = run_regenerate(_cfg(target, prompts, out, batch_size=2, max_new_tokens=5))
    assert sum(len(b) for b in made[0].batches) == 4 and stats["splits"]["eval"]["kept_answers"] == 0

    # the older stage's file: the settings key alone, which names its own prompts file
    rows = regen._read_rows(out / "eval.parquet")
    regen._write_rows(out / "eval.parquet", rows, regen._file_key(out / "eval.parquet"))
    short = _cfg(target, prompts, out, batch_size=2, max_new_tokens=5)
    _write_eval(prompts, second)
    made = _patch_backend(monkeypatch)
    assert run_regenerate(short)["splits"]["eval"]["kept_answers"] == 0  # not checked: answered again
    assert sum(len(b) for b in made[0].batches) == 5
    rows = regen._read_rows(out / "eval.parquet")
    regen._write_rows(out / "eval.parquet", rows, regen._file_key(out / "eval.parquet"))
    _write_eval(prompts, first)
    assert mark_answers_reusable(short) == {"eval": "not current for these prompts: left as it is"}
    assert regen._file_key(out / "eval.parquet", regen.ROW_KEY_METADATA) is None
    _write_eval(prompts, second)
    made = _patch_backend(monkeypatch)
    assert mark_answers_reusable(short) == {"eval": "marked reusable"}   # its own prompts, checked by its key
    assert mark_answers_reusable(short) == {"eval": "reusable already"} and made == []
    assert regen._read_rows(out / "eval.parquet") == rows
    run_regenerate(short)                     # the same by a run: current, nothing answered
    assert made == [] and regen._file_key(out / "eval.parquet", regen.ROW_KEY_METADATA)
    _write_eval(prompts, first)
    made = _patch_backend(monkeypatch)
    assert run_regenerate(short)["splits"]["eval"]["kept_answers"] == 2  # q:0, q:1 (q:2 reworded, q:3 new)
    assert sorted(i for b in made[0].batches for i in b) == ["q:2", "q:3"]


def test_sampling_is_seeded(tiny, tmp_path):
    target, prompts = tiny
    kw = dict(temperature=1.0, top_p=1.0, top_k=0)
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run_regenerate(_cfg(target, prompts, tmp_path / name, seed=seed, **kw))
        runs[name] = [r["response_ids"] for r in read_regen(tmp_path / name / "eval.parquet")]
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]


def test_config_errors(tmp_path):
    with pytest.raises(ParamsError, match="backend must be one of"):
        RegenerateConfig.from_dict({"backend": "sglang"})
    with pytest.raises(ParamsError, match=r"top_p must be in \(0, 1\]"):
        RegenerateConfig.from_dict({"top_p": 0.0})
    with pytest.raises(ParamsError, match="splits"):
        RegenerateConfig.from_dict({"splits": ["test"]})
    with pytest.raises(ValueError, match="not a directory"):
        run_regenerate(RegenerateConfig.from_dict({"target_dir": str(tmp_path / "none"),
                                                   "stats_path": str(tmp_path / "s.json")}))


def test_missing_prompts_file(tiny, tmp_path):
    target, _ = tiny
    with pytest.raises(ValueError, match=r"eval.parquet: prompts file not found"):
        run_regenerate(_cfg(target, tmp_path / "nope", tmp_path / "out"))


# ----------------------------------------------------------------------------------------------
# openai backend against a local stub server
# ----------------------------------------------------------------------------------------------
class _Stub(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def _send(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "stub-model"}]})
        return self._send(404, {"error": "no route"})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or body.get("model") != "stub-model":
            return self._send(400, {"error": f"bad request {self.path} {body.get('model')}"})
        _Stub.bodies.append(body)
        n = len(body["prompt"])
        if n % 2 == 0:
            choice = {"index": 0, "text": f"answer {n}", "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": "word " * 40, "finish_reason": "length"}
        return self._send(200, {"choices": [choice]})

    def log_message(self, *args):
        return None


@pytest.fixture()
def stub_server():
    _Stub.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_openai_backend_against_stub(tiny, tmp_path, stub_server):
    target, prompts = tiny
    run_regenerate(_cfg(target, prompts, tmp_path / "out", backend="openai", openai_base_url=stub_server,
                        temperature=0.7, top_p=0.8, top_k=20, seed=3, openai_timeout_s=20))
    rows = read_regen(tmp_path / "out" / "eval.parquet")
    _, tok = load_target(target)
    by_prompt = {tuple(b["prompt"]): b for b in _Stub.bodies}
    assert len(by_prompt) == len(rows) == len(QUESTIONS)
    for r in rows:
        body = by_prompt[tuple(r["prompt_ids"])]                       # token ids were sent
        assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (0.7, 0.8, 20, MAX_NEW)
        assert isinstance(body["seed"], int) and r["backend"] == "openai"
        n = len(r["prompt_ids"])
        if n % 2 == 0:
            want = tok(f"answer {n}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert (r["response_ids"], r["finish_reason"]) == (want, "stop")
        else:
            want = tok("word " * 40, add_special_tokens=False)["input_ids"][:MAX_NEW]
            assert (r["response_ids"], r["finish_reason"]) == (want, "length")


def test_openai_backend_reports_http_errors(tiny, tmp_path, stub_server):
    target, prompts = tiny
    from dspark_core.errors import UserError

    with pytest.raises(UserError, match=r"HTTP 400: .*\(regenerate.openai_base_url / openai_model\)"):
        run_regenerate(_cfg(target, prompts, tmp_path / "out", backend="openai", openai_base_url=stub_server,
                            openai_model="other", openai_timeout_s=20))
