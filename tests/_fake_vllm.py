"""A stand-in for the ``vllm`` package (tests only): ``LLM`` records the keyword arguments it was built with and
answers every prompt with the same few token ids, so what dspark hands the engine is checked without vLLM."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

ANSWER = [72, 105]  # "Hi" in the tiny targets' byte vocabulary


@dataclass
class _Out:
    token_ids: list[int]
    finish_reason: str


@dataclass
class _Result:
    outputs: list[_Out]


def install(monkeypatch) -> list[dict]:
    """Put the fake ``vllm`` (and ``vllm.inputs``) in ``sys.modules``; returns the list each ``LLM(...)``'s keyword
    arguments are appended to. The offline variables the backend sets are restored after the test."""
    built: list[dict] = []

    class LLM:
        def __init__(self, model: str, **kwargs):
            built.append({"model": model, **kwargs})

        def generate(self, prompts, params, use_tqdm=False):
            return [_Result([_Out(list(ANSWER), "length")]) for _ in prompts]

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        monkeypatch.setenv(key, "1")
    return built
