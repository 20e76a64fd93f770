"""The regenerate stage's engines at scale: ``regenerate.vllm`` engine arguments reach ``vllm.LLM`` (a stand-in
engine), and the OpenAI backend spreads a batch over several local servers with ``openai_concurrency`` requests in
flight per server, answers in request order and the same answers as one server, leaving out (and naming) a server
that fails its probe."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

import _fake_vllm
from _regen_utils import CompletionServer
from dspark_core.config import ParamsError
from dspark_core.data.backends import openai_backend
from dspark_core.data.prompts import Prompt, write_prompts
from dspark_core.data.regenerate import RegenerateConfig, read_regen, run_regenerate
from dspark_core.errors import UserError
from dspark_core.testing import save_tiny_target

def _answer(body: dict) -> str:
    """A function of the request alone: the same answer from any server."""
    return f"answer {len(body['prompt'])} {body['seed'] % 97}"


QUESTIONS = [f"Question {i}: name {'many ' * i}colours." for i in range(10)]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("engines") / "target", "qwen3")


def _cfg(target: Path, root: Path, out: str, **kw) -> RegenerateConfig:
    prompts = root / "prompts"
    if not prompts.is_dir():
        write_prompts(prompts / "eval.parquet", [Prompt(f"q{i}", "test", (t,)) for i, t in enumerate(QUESTIONS)])
    base = dict(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=8, batch_size=10, splits=["eval"], seed=5,
                target_dir=str(target), prompts_dir=str(prompts), out_dir=str(root / out),
                stats_path=str(root / f"{out}_stats.json"), openai_timeout_s=20)
    return RegenerateConfig.from_dict({**base, **kw})


# ----------------------------------------------------------------------------------------------
# vLLM: engine arguments as they are
# ----------------------------------------------------------------------------------------------
def test_vllm_engine_args_reach_the_engine(target, tmp_path, monkeypatch):
    built = _fake_vllm.install(monkeypatch)
    args = {"tensor_parallel_size": 2, "max_num_seqs": 7, "enable_prefix_caching": True}
    run_regenerate(_cfg(target, tmp_path, "out", backend="vllm", vllm=args, dtype="bfloat16",
                        vllm_gpu_memory_utilization=0.5))
    assert len(built) == 1
    kw = built[0]
    assert {k: kw[k] for k in args} == args
    assert (kw["model"], kw["tokenizer"], kw["dtype"], kw["seed"], kw["gpu_memory_utilization"]) == (
        str(target), str(target), "bfloat16", 5, 0.5)
    assert "trust_remote_code" not in kw  # passed only for a target recorded with it
    rows = read_regen(tmp_path / "out" / "eval.parquet")
    assert len(rows) == len(QUESTIONS) and all(r["response_ids"] == _fake_vllm.ANSWER for r in rows)


@pytest.mark.parametrize("key, where", [("dtype", "regenerate.dtype"), ("seed", "regenerate.seed"),
                                        ("gpu_memory_utilization", "regenerate.vllm_gpu_memory_utilization"),
                                        ("enforce_eager", "regenerate.vllm_enforce_eager"),
                                        ("max_model_len", "the stage itself"), ("model", "the target"),
                                        ("trust_remote_code", "target.trust_remote_code")])
def test_a_key_given_both_ways_is_refused(key, where):
    with pytest.raises(ParamsError, match=rf"^params.yaml: regenerate.vllm.{key} is given both ways, as "
                                          rf"regenerate.vllm.{key} and by {where}"):
        RegenerateConfig.from_dict({"vllm": {key: 1}}, src="params.yaml", prefix="regenerate.")


def test_offline_data_parallel_is_refused_with_the_way_that_works():
    with pytest.raises(ParamsError, match=r"regenerate.vllm.data_parallel_size: 8: vLLM's offline engine \(vllm.LLM\) "
                                          r"runs one data-parallel rank per process; .*regenerate.backend: openai"):
        RegenerateConfig.from_dict({"vllm": {"data_parallel_size": 8}}, src="params.yaml", prefix="regenerate.")
    assert RegenerateConfig.from_dict({"vllm": {"data_parallel_size": 1}}).vllm == {"data_parallel_size": 1}


@pytest.mark.slow
def test_an_unknown_engine_argument_is_named():
    """Against the installed vLLM's own ``LLM`` / ``EngineArgs`` (importing vLLM takes ~10 s)."""
    vllm = pytest.importorskip("vllm")
    from dspark_core.data.backends.vllm_backend import check_engine_args

    check_engine_args(vllm.LLM, {"tensor_parallel_size": 2, "max_num_seqs": 8, "enable_prefix_caching": True,
                                 "data_parallel_size": 1, "kv_cache_dtype": "auto"})
    with pytest.raises(UserError, match=r"regenerate.vllm.tensor_paralel_size is not an argument of vllm.LLM"):
        check_engine_args(vllm.LLM, {"tensor_paralel_size": 2})


# ----------------------------------------------------------------------------------------------
# OpenAI: several servers
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def servers():
    made: list[CompletionServer] = []

    def make(n: int) -> list[CompletionServer]:
        made.extend(CompletionServer(_answer, delay_s=0.1) for _ in range(n))
        return made[-n:]
    yield make
    for s in made:
        s.stop()


def _dead_url() -> str:
    """A local port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_openai_spreads_over_servers_in_request_order(target, tmp_path, servers, monkeypatch, caplog):
    monkeypatch.setattr(openai_backend, "_BACKOFF_S", 0.01)
    one, a, b = servers(3)
    run_regenerate(_cfg(target, tmp_path, "one", backend="openai", openai_base_url=one.url))
    dead = _dead_url()
    with caplog.at_level(logging.WARNING):
        run_regenerate(_cfg(target, tmp_path, "two", backend="openai", openai_base_url=[a.url, dead, b.url],
                            openai_concurrency=2))
    assert f"server {dead} failed its probe and is left out" in caplog.text
    assert (tmp_path / "two" / "eval.parquet").read_bytes() == (tmp_path / "one" / "eval.parquet").read_bytes()
    rows = read_regen(tmp_path / "two" / "eval.parquet")
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(len(QUESTIONS))]
    assert len(a.bodies) + len(b.bodies) == len(QUESTIONS) and a.bodies and b.bodies
    assert 1 <= a.peak <= 2 and 1 <= b.peak <= 2          # openai_concurrency per server
    assert one.peak > 2                                   # one server, 32 a server: the batch of 10 at once
    seeds = {b_["seed"] for b_ in a.bodies + b.bodies}
    assert seeds == {b_["seed"] for b_ in one.bodies} and len(seeds) == len(QUESTIONS)  # one seed a request


def test_openai_without_any_server_names_each(target, tmp_path, monkeypatch):
    monkeypatch.setattr(openai_backend, "_BACKOFF_S", 0.01)
    urls = [_dead_url(), _dead_url()]
    with pytest.raises(UserError) as info:
        run_regenerate(_cfg(target, tmp_path, "out", backend="openai", openai_base_url=urls))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("regenerate.openai_base_url: no server answered its probe: ")
    assert all(f"GET {u}/models" in msg for u in urls)
    assert not (tmp_path / "out" / "eval.parquet").exists()


def test_openai_url_params():
    cfg = RegenerateConfig.from_dict({"openai_base_url": ["http://h1:8000/v1", "http://h2:8000/v1"]})
    assert cfg.openai_urls == ("http://h1:8000/v1", "http://h2:8000/v1") and cfg.openai_concurrency == 32
    assert RegenerateConfig.from_dict({}).openai_urls == ("http://127.0.0.1:8000/v1",)
    for bad, msg in [([], "must name at least one server"), (["h1:8000"], "is not an http\\(s\\) URL"),
                     (["http://a/v1", "http://a/v1"], "names \\['http://a/v1'\\] more than once")]:
        with pytest.raises(ParamsError, match=msg):
            RegenerateConfig.from_dict({"openai_base_url": bad})
    with pytest.raises(ParamsError, match="openai_concurrency must be > 0"):
        RegenerateConfig.from_dict({"openai_concurrency": 0})
