"""Autoregressive baseline through the same ``TargetRunner`` and sampling code as the speculative engine.

Prefill -> first token from the last prompt logits -> one n = 1 ``forward`` per further token (CUDA
graph replay when the runner was built with ``cuda_graph=True``). The next token stays on the device
(the graph reads it from there), and the host reads tokens back only every ``sync_every`` steps to check
stop tokens: the GPU never waits for the host between steps (gpt-fast's loop does the same). Tokens made
after a stop token within those steps are dropped, so the output is the same for any ``sync_every``.
Same stop / max_new_tokens rules and the same ``GenerationResult`` (one cycle per token, MAL 1), so speedups
compare like with like.

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
                 record_steps: bool = False, sync_every: int = 8) -> None:
        if target.batch_size != 1:
            raise ValueError(f"the AR decoder decodes batch size 1; the target runner has {target.batch_size}")
        self.target = target
        self.sampling = sampling or SamplingParams()
        self.generator = make_generator(target.device, seed)
        self.record_steps = record_steps
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1; got {sync_every}")
        self.sync_every = 1 if record_steps else int(sync_every)  # per-step times need a sync per step
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
            pending = []
            for _ in range(min(self.sync_every, max_new_tokens - len(tokens))):
                logits, _ = self.target.forward(token.view(1, 1))  # [1, 1, V]
                token = select_tokens(logits[:, -1], self.sampling, self.generator)  # [1], stays on the device
                pending.append(token)
            for t in torch.cat(pending).tolist():  # one host sync per sync_every steps
                tokens.append(t)
                result.cycles += 1
                result.accepted_per_cycle.append(0)
                result.proposal_lengths.append(0)
                if self.record_steps:
                    result.verify_s.append(self._clock() - step_t0)
                    result.draft_s.append(0.0)
                if t in stops:
                    break
        result.decode_s = self._clock() - t1
        result.tokens, hit_stop = cut_at_stop(tokens, sorted(stops), max_new_tokens)
        result.stop_reason = "stop" if hit_stop else "length"
        return result
