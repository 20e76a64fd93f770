"""Autoregressive baseline through the same ``TargetRunner`` and sampling code as the speculative engine.

Prefill -> first token from the last prompt logits -> one n = 1 ``forward`` per further token (CUDA
graph replay when the runner was built with ``cuda_graph=True``). Same stop / max_new_tokens rules and
the same ``GenerationResult`` (one cycle per token, MAL 1), so speedups compare like with like.

Shape legend: V vocab.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dspark_core.spec.common import Clock, check_budget, make_generator, prefill_first_token, prompt_tensor
from dspark_core.spec.sampling import SamplingParams, select_tokens
from dspark_core.spec.target_runner import TargetRunner
from dspark_core.spec.types import GenerationResult, cut_at_stop


class ARDecoder:
    """Plain decoding of one prompt at a time; ``record_steps`` keeps per-step times (one host sync each)."""

    def __init__(self, target: TargetRunner, *, sampling: SamplingParams | None = None, seed: int = 0,
                 record_steps: bool = False) -> None:
        if target.batch_size != 1:
            raise ValueError(f"the AR decoder decodes batch size 1; the target runner has {target.batch_size}")
        self.target = target
        self.sampling = sampling or SamplingParams()
        self.generator = make_generator(target.device, seed)
        self.record_steps = record_steps
        self._clock = Clock(target.device)

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 stop_ids: Sequence[int] = ()) -> GenerationResult:
        prompt = prompt_tensor(prompt_ids, self.target.device)  # [1, P]
        check_budget(self.target, prompt.shape[1], max_new_tokens, 1)
        stops = set(int(s) for s in stop_ids)
        result = GenerationResult(tokens=[])
        t0 = self._clock()
        token, _ = prefill_first_token(self.target, prompt, self.sampling, self.generator)  # [1]
        tokens = token.tolist()
        t1 = self._clock()
        result.prefill_s = t1 - t0
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            step_t0 = self._clock() if self.record_steps else 0.0
            logits, _ = self.target.forward(token.view(1, 1))  # [1, 1, V]
            token = select_tokens(logits[:, -1], self.sampling, self.generator)  # [1]
            tokens.append(int(token.item()))
            result.cycles += 1
            result.accepted_per_cycle.append(0)
            result.proposal_lengths.append(0)
            if self.record_steps:
                result.verify_s.append(self._clock() - step_t0)
                result.draft_s.append(0.0)
        result.decode_s = self._clock() - t1
        result.tokens, hit_stop = cut_at_stop(tokens, sorted(stops), max_new_tokens)
        result.stop_reason = "stop" if hit_stop else "length"
        return result
