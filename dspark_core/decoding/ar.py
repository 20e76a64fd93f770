"""Autoregressive baseline through the same ``TargetRunner`` and sampling code as the speculative engine.

Prefill -> first token from the last prompt logits -> one n = 1 ``forward`` per further token (CUDA
graph replay when the runner was built with ``cuda_graph=True``). The next token stays on the device
(the graph reads it from there), and the host reads tokens back only every ``sync_every`` steps to check
stop tokens: the GPU never waits for the host between steps (gpt-fast's loop does the same). Tokens made
after a stop token within those steps are dropped, so the output is the same for any ``sync_every``.
Same stop / max_new_tokens rules and the same ``GenerationResult`` (one cycle per token, MAL 1), so speedups
compare like with like.

``StaticARDecoder`` (greedy) keeps the whole step on the device (one CUDA graph with the argmax and the
position update). Measured on an H200 (SmolLM2 shapes, ``benchmarks/bench_decode.py`` reports
both) it is 1-3% *slower* than ``ARDecoder``'s host loop, whose GPU never waits for the host either; the
benchmarks therefore compare speculative decoding with ``ARDecoder``, and keep this one as a measured
alternative.

Shape legend: V vocab, M cache positions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dspark_core.decoding.common import Clock, check_budget, make_generator, prefill_first_token, prompt_tensor
from dspark_core.decoding.sampling import SamplingParams, select_tokens
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.decoding.types import GenerationResult, cut_at_stop


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


class StaticARDecoder:
    """Greedy AR decoding with the whole step on the device (see the module docstring for how it compares).

    One CUDA graph per step holds the forward, the argmax and the position update: the token to feed is
    read from ``seq`` (every token by position) at the device position ``p``, its argmax written to
    ``seq[p + 1]``, and ``p`` advanced -- no host op between steps. The host replays ``sync_every`` steps,
    then reads their tokens (one sync) to check stop tokens; tokens after a stop within those steps are
    dropped, so the output does not depend on ``sync_every``. Same ``GenerationResult`` as ``ARDecoder``
    (one cycle per token) and the same ``TargetRunner`` step as the static speculative engine's verify.
    Without ``cuda_graph`` (CPU, tests) the same step runs eagerly."""

    def __init__(self, target: TargetRunner, *, sampling: SamplingParams | None = None,
                 cuda_graph: bool | None = None, sync_every: int = 8) -> None:
        if sampling is not None and not sampling.greedy:
            raise ValueError("StaticARDecoder decodes greedily; use ARDecoder for sampling "
                             f"(temperature {sampling.temperature})")
        if target.batch_size != 1:
            raise ValueError(f"the AR decoder decodes batch size 1; the target runner has {target.batch_size}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1; got {sync_every}")
        self.cuda_graph = target.cuda_graph if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and target.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs CUDA; the target is on {target.device}")
        self.target, self.sync_every = target, int(sync_every)
        dev = target.device
        self.seq = torch.zeros(target.max_len + 1, dtype=torch.long, device=dev)  # [M + 1] tokens by position
        self.p = torch.zeros(1, dtype=torch.long, device=dev)  # [1] position of the token fed next
        self._graph: torch.cuda.CUDAGraph | None = None
        self._clock = Clock(dev)

    def _step(self) -> None:
        ids = self.seq.index_select(0, self.p).view(1, 1)  # [1, 1]
        logits, _ = self.target.step(ids, self.p)  # [1, 1, V]
        self.seq.index_copy_(0, self.p + 1, logits[0, -1].argmax().view(1))
        self.p += 1

    def _capture(self) -> None:
        """Warm up on a side stream (tuning, lazy inits), then capture one step; p is restored."""
        p = self.p.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._step()
                self.p.copy_(p)
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._step()
        self.p.copy_(p)

    def _run_step(self) -> None:
        self._graph.replay() if self._graph is not None else self._step()

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 stop_ids: Sequence[int] = ()) -> GenerationResult:
        prompt = prompt_tensor(prompt_ids, self.target.device)  # [1, P]
        n_prompt = prompt.shape[1]
        check_budget(self.target, n_prompt, max_new_tokens, 1)
        stops = set(int(s) for s in stop_ids)
        result = GenerationResult(tokens=[])
        t0 = self._clock()
        logits, _ = self.target.prefill(prompt, last_logits_only=True)  # [1, 1, V]
        self.seq[:n_prompt] = prompt[0]
        self.seq[n_prompt] = logits[0, -1].argmax()
        self.p.fill_(n_prompt)
        if self.cuda_graph and self._graph is None:
            self._capture()
        tokens = [int(self.seq[n_prompt].item())]
        t1 = self._clock()
        result.prefill_s = t1 - t0
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            k = min(self.sync_every, max_new_tokens - len(tokens))
            for _ in range(k):
                self._run_step()
            start = n_prompt + len(tokens)
            for t in self.seq[start : start + k].tolist():  # one host sync per sync_every steps
                tokens.append(t)
                result.cycles += 1
                result.accepted_per_cycle.append(0)
                result.proposal_lengths.append(0)
                if t in stops:
                    break
        self.target.commit(n_prompt + len(tokens) - 1)  # host view of the target cache (last token not in it)
        result.decode_s = self._clock() - t1
        result.tokens, hit_stop = cut_at_stop(tokens, sorted(stops), max_new_tokens)
        result.stop_reason = "stop" if hit_stop else "length"
        return result
