"""Speculative decoding with the whole cycle on the device: one CUDA graph pair per cycle.

The same algorithm as :class:`dspark_core.decoding.engine.SpeculativeDecoder` (the reference: any draft, any
sampling, host-side bookkeeping), restricted to a baseline ``DSparkDraft`` (greedy, or sampling along a chain) so that every
step of a cycle has a static shape and reads its lengths from device tensors:

    propose   tokens t_1..t_S = draft block at (anchor, p), greedy Markov slots      (graph 1)
    verify    target forward of [anchor, t_1..t_S] at p..p+S (``TargetRunner.step``)  (graph 2)
    accept    a = matching prefix of t vs the target's argmax (capped at the confident slots);
              bonus = target argmax at row a (one Triton kernel with the Triton draft: kernels/accept.py)
    update    draft context K/V of positions p..p+S written (only p..p+a count); p += a + 1; anchor = bonus

The host replays the two graphs and reads back one small tensor per cycle ``[a, n, t_1..t_S, bonus]`` (the
only sync) to append tokens and check stop tokens / max_new_tokens, like the reference. With CUDA graphs it
reads cycle k only after enqueuing cycle k+1 (copied asynchronously into pinned host slots), so the GPU does
not idle while the host works. The target always
verifies S+1 tokens; a confidence cut (``confidence_threshold`` > 0) caps the accepted prefix at the cut,
which commits the same tokens the reference commits after proposing only the confident slots.

``sampling`` (temperature > 0, chain only): the draft draws each slot from its processed distribution q
(``StaticDraft.propose_sampled``), and the accept step is exact rejection sampling against the target's p
(``sampling.rejection_step``: accept t_i while u_i q_i(t_i) < p_i(t_i), then one token from
normalize(max(p_a - q_a, 0)), or from p_a past the last counted slot), every draw an exponential race on device
uniforms: no host read, static shapes (with the Triton draft at a plain temperature: ``MarkovSampler`` slots, and
the accept step in two launches, ``kernels.accept.SampledAccept``; ``REJECT_KERNEL = False`` for the torch
ops). Without CUDA graphs the draws come from ``torch.Generator(seed)``; with them from the default CUDA generator
(graph-safe). Tested on CPU (chi-square against the target's distribution) and, captured in CUDA graphs with and
without the Triton kernels, on an H200 (``test_static_cuda_graph_sampling_matches_the_targets_distribution``):
``bench_online``'s ``engine: auto`` picks it for sampling on CUDA.

``tree_branches`` ((start, length), ...; ``dspark_core.decoding.tree``) adds side branches to the proposal: the
draft's second-best token at depth ``start`` and its greedy continuation, verified in the same forward (up to
16 rows cost about one with the ``mma`` kernels); every row's draft context is written like the target's K/V
(RoPE at its logical position, in its row's slot), and the accept step moves the winning branch's K/V -- target
and draft -- to their logical slots. The output is still the target's greedy output; only the accepted length
per cycle changes.

Without ``cuda_graph`` (CPU, tests) the very same cycle code runs eagerly. Timing: ``time_every = k`` times
draft and verify separately on every k-th cycle (a sync between the graphs on those cycles only); the
other cycles run back to back, and ``decode_s`` covers all of them.

Shape legend: S block size, V vocab, K aux layers, H target hidden.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Sequence

import torch

from dspark_core.decoding.common import Clock, check_budget, prompt_tensor
from dspark_core.decoding.sampling import SamplingParams
from dspark_core.decoding.static_draft import StaticDraft, draft_kernels_problem
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.decoding.tree import TreeLayout, parse_branches
from dspark_core.decoding.types import GenerationResult, cut_at_stop

# The sampled accept step in two Triton launches (``kernels.accept.SampledAccept``) instead of ~50 torch kernels:
# tested against the torch step (interpreter and H200) and, in CUDA graphs, against the target's distribution
# (chi-square, H200); SmolLM2 ``mma`` sampling cycle 1.166 -> 1.094 ms. False keeps the torch ops
# (``logits_to_probs`` + ``sampling.rejection_step``), the reference the tests compare it with.
REJECT_KERNEL = True


class StaticSpeculativeDecoder:
    """Speculative decoding, batch 1, with a device-side cycle (see the module docstring).

    ``kernels`` (None: the target runner's choice where the draft allows it) runs the draft layers through the Triton decode kernels.
    ``cuda_graph`` (None: the target runner's choice) captures the cycle as two CUDA graphs."""

    def __init__(self, target: TargetRunner, draft, *, block_size: int | None = None,
                 confidence_threshold: float = 0.0, sampling: SamplingParams | None = None,
                 kernels: bool | None = None, cuda_graph: bool | None = None, time_every: int = 0,
                 tree_branches=(), seed: int = 0) -> None:
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        if self.sampling is not None and tree_branches:
            raise ValueError("the static engine verifies draft trees greedily (greedy tree acceptance inside the "
                             "CUDA-graph cycle); a sampling tree (recursive rejection sampling over siblings, "
                             "dspark_core.decoding.tree_sampling) runs in the reference engine: "
                             f"SpeculativeDecoder(..., tree_branches=...) (temperature {sampling.temperature})")
        if target.batch_size != 1:
            raise ValueError(f"the static engine decodes batch size 1; the target runner has {target.batch_size}")
        if block_size is not None and block_size != draft.block_size:
            raise ValueError(f"block_size {block_size} differs from the draft's {draft.block_size}")
        if not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1]; got {confidence_threshold!r}")
        if tuple(draft.aux_layer_ids) != tuple(target.aux_layer_ids):
            raise ValueError(f"draft aux_layer_ids {list(draft.aux_layer_ids)} differ from the target runner's "
                             f"{list(target.aux_layer_ids)}")
        self.cuda_graph = target.cuda_graph if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and target.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs CUDA; the target is on {target.device}")
        self.target = target
        self.block_size = s = draft.block_size
        if kernels is None:  # the target's choice, where the draft's layers allow it
            kernels = target.kernels and draft_kernels_problem(draft) is None
        self.static = StaticDraft(draft, target.max_len, kernels=kernels)
        self.confidence_threshold = float(confidence_threshold)
        self.time_every = int(time_every)
        self.tree = TreeLayout(s, parse_branches(tree_branches))
        if not self.tree.is_chain and self.confidence_threshold > 0:
            raise ValueError("tree_branches with a confidence_threshold: the confidence cut applies to the chain only")
        dev = target.device
        self.p = torch.zeros(1, dtype=torch.long, device=dev)  # [1] anchor position
        self.anchor = torch.zeros(1, dtype=torch.long, device=dev)  # [1] anchor token
        # [a, n, t_1..t_S, bonus] (+ the tree's node tokens [N]: then t = the accepted path's tokens, and
        # out[2+S:] = [anchor, nodes] is the verify's input: the bonus slot holds the anchor between cycles)
        self.out = torch.zeros(s + 3 + (0 if self.tree.is_chain else self.tree.nodes), dtype=torch.long, device=dev)
        self.out[1] = s
        self.verify_slots = torch.arange(s + 1, device=dev)  # [S+1]
        self.tables = None if self.tree.is_chain else self.tree.tensors(dev)
        self.path = torch.zeros(3, s + 1, dtype=torch.long, device=dev)  # [3, S+1] tree: rows, from, to slots
        self._accept = None  # the Triton accept step (one launch) with the Triton draft; else torch ops
        if self.sampling is not None:
            self.q = torch.zeros(s, target.vocab_size, dtype=torch.float32, device=dev)  # [S, V] the draft's q
            self._gen = None if self.cuda_graph else torch.Generator(dev).manual_seed(int(seed))
            self._sampled_accept = None  # the Triton accept step at a plain temperature (kernels/accept.py)
            if self.static.kernels and self.static.plain_temperature(self.sampling) and REJECT_KERNEL:
                from dspark_core.kernels.accept import SampledAccept

                self._sampled_accept = SampledAccept(s + 1, target.vocab_size, dev)
        elif self.static.kernels:
            from dspark_core.kernels.accept import GreedyAccept

            tree = None if self.tree.is_chain else self.tree
            self._accept = GreedyAccept(self.tree.rows, target.vocab_size, dev, tree=tree)
            if tree is not None:
                self.path = self._accept.path
        self._graphs: tuple | None = None
        self._ring: _HostRing | None = None  # host copies of `out`, one per cycle in flight
        self._clock = Clock(dev)

    # -- the cycle (device code only: no host reads, static shapes) ---------------------------------
    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self._gen, device=self.target.device)

    def _propose(self) -> None:
        if self.sampling is not None:
            need_hidden = self.confidence_threshold > 0
            race = self._rand(self.block_size, self.q.shape[1])  # [S, V]
            _, hidden = self.static.propose_sampled(self.anchor, self.p, self.sampling, self.q, race, need_hidden)
            self.out[1] = self.static.confident_slots(self.anchor, hidden, self.confidence_threshold)
            self.out[2 : 2 + self.block_size] = self.static.tokens
            return
        if not self.tree.is_chain:
            self.static.propose_tree(self.anchor, self.p, self.tree, self.out[2 + self.block_size :])
            return  # out[1] (slots allowed) stays S, set once in __init__
        need_hidden = self.confidence_threshold > 0
        tokens, hidden = self.static.propose(self.anchor, self.p, need_hidden)  # [S], [S, H] | None
        self.out[1] = self.static.confident_slots(self.anchor, hidden, self.confidence_threshold)
        self.out[2 : 2 + self.block_size] = tokens

    def _verify_update(self) -> None:
        if not self.tree.is_chain:
            return self._verify_update_tree()
        s = self.block_size
        tokens = self.out[2 : 2 + s]  # [S]
        ids = torch.cat([self.anchor, tokens]).view(1, s + 1)  # [1, S+1]
        pos = self.p + self.verify_slots  # [S+1]
        logits, aux = self.target.step(ids, pos)  # [1, S+1, V], [1, S+1, K, H]
        if self.sampling is not None and self._sampled_accept is not None:  # the same step in two kernels
            self._sampled_accept(logits[0], self.q, self.out, self.p, self.anchor, self._rand(s),
                                 self._rand(self.q.shape[1]), self.sampling.temperature)
        elif self.sampling is not None:  # exact rejection sampling on the device
            from dspark_core.decoding.sampling import logits_to_probs, rejection_step

            probs = logits_to_probs(logits[0].float(), self.sampling)  # [S+1, V]
            a, bonus = rejection_step(probs, self.q, tokens, self.out[1], self._rand(s), self._rand(self.q.shape[1]))
            self.out[0] = a
            self.out[2 + s] = bonus
            self.p += a + 1
            self.anchor.copy_(bonus.view(1))
        elif self._accept is not None:  # the same step in one kernel (kernels/accept.py)
            self._accept(logits[0], self.out, self.p, self.anchor)
        else:
            best = logits[0].argmax(dim=-1)  # [S+1]
            match = (best[:s] == tokens) & (self.verify_slots[:s] < self.out[1])
            a = match.long().cumprod(dim=0).sum()  # [] accepted prefix
            bonus = best.gather(0, a.view(1))  # [1]
            self.out[0] = a
            self.out[2 + s] = bonus[0]
            self.p += a + 1
            self.anchor.copy_(bonus)
        self.static.extend(aux, pos)  # all S+1 positions; only p..p+a are below the new length

    def _verify_update_tree(self) -> None:
        from dspark_core.kernels.accept import greedy_accept_tree_reference, kv_move_reference

        s, t = self.block_size, self.tables
        ids = self.out[2 + s :].view(1, -1)  # [1, R] the anchor (= the last bonus) and the node tokens
        pos = self.p + t.depth  # [R] logical positions
        logits, aux = self.target.step(ids, pos, tree=(t.offset, t.back))  # [1, R, V], [1, R, K, H]
        self.static.extend(aux, pos, slot_offset=t.offset)  # every row's context, in its row's slot like the target
        kv, draft_kv = self.target.caches, (self.static.k, self.static.v)
        if self._accept is not None:  # one launch: accept, then the winning branch's K/V moves (target and draft)
            self._accept(logits[0], self.out, self.p, self.anchor, kv=kv, draft_kv=draft_kv)
        else:
            greedy_accept_tree_reference(logits[0], self.out, self.p, self.anchor, t, self.path)
            self.target.move_kv(self.path[1], self.path[2])  # the accepted path's K/V to slots p+1..p+a
            kv_move_reference(*draft_kv, self.path)

    # -- CUDA graphs ----------------------------------------------------------------------------
    def _capture(self) -> None:
        """Warm up (Triton tuning, lazy inits) on a side stream, then capture propose and verify+update.
        The warm-up moves p / anchor and writes caches beyond the live length; both are restored."""
        p, anchor = self.p.clone(), self.anchor.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._propose()
                self._verify_update()
                self.p.copy_(p)
        torch.cuda.current_stream().wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        graphs = (torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[0], pool=pool):
            self._propose()
        with torch.cuda.graph(graphs[1], pool=pool):
            self._verify_update()
        self.p.copy_(p)
        self.anchor.copy_(anchor)
        self._graphs = graphs

    def _run_propose(self) -> None:
        self._graphs[0].replay() if self._graphs else self._propose()

    def _run_verify(self) -> None:
        self._graphs[1].replay() if self._graphs else self._verify_update()

    # -- generation -----------------------------------------------------------------------------
    def _launch(self, ring: "_HostRing", timed: bool, result: GenerationResult) -> None:
        """Enqueue one cycle and the copy of its ``out`` into the next host slot; a timed cycle starts and
        ends with a sync (draft and verify timed apart)."""
        c0 = self._clock() if timed else 0.0
        self._run_propose()
        c1 = self._clock() if timed else 0.0
        self._run_verify()
        ring.push(self.out)
        if timed:
            ring.wait_newest()
            result.draft_s.append(c1 - c0)
            result.verify_s.append(time.perf_counter() - c1)

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 stop_ids: Sequence[int] = ()) -> GenerationResult:
        """Decode up to ``max_new_tokens`` after ``prompt_ids`` (greedy: the reference engine's output and
        ``GenerationResult``; sampling: the target's distribution) (draft_s / verify_s hold the timed cycles
        only, see ``time_every``).

        With CUDA graphs, one cycle runs ahead: cycle k+1 is enqueued before the host reads cycle k's result
        (its state lives on the device), so the GPU never waits for the host. The cycle after the one that
        ends the generation is wasted work (its tokens are never read); cycles are only enqueued while
        they may still be needed for ``max_new_tokens``."""
        s = self.block_size
        prompt = prompt_tensor(prompt_ids, self.target.device)  # [1, P]
        depth = 2 if self._ring_depth_ok() else 1
        check_budget(self.target, prompt.shape[1], max_new_tokens, depth * self.tree.rows)
        stops = set(int(t) for t in stop_ids)
        result = GenerationResult(tokens=[])
        t0 = self._clock()
        logits, aux = self.target.prefill(prompt, last_logits_only=True)  # [1, 1, V], [1, P, K, H]
        n_prompt = prompt.shape[1]
        self.static.extend(aux, self.static.key_pos[:n_prompt])
        self.anchor.copy_(self._first_token(logits[0, -1]))
        self.p.fill_(n_prompt)
        if self.cuda_graph and self._graphs is None:
            self._capture()
        self.out[2 + s : 3 + s].copy_(self.anchor)  # the tree's token buffer starts with the anchor
        tokens = [int(self.anchor.item())]
        t1 = self._clock()
        result.prefill_s = t1 - t0
        if self._ring is None or len(self._ring.slots) != depth:  # pinned slots: allocated once, reused
            self._ring = _HostRing(self.out, depth)
        ring, launched = self._ring, 0
        while tokens[-1] not in stops:
            while len(ring) < depth and len(tokens) + (s + 1) * len(ring) < max_new_tokens:
                timed = self.time_every > 0 and launched % self.time_every == 0
                if timed and len(ring):
                    break  # a timed cycle starts on an idle device
                self._launch(ring, timed, result)
                launched += 1
                if timed:
                    break
            if not len(ring):
                break
            out = ring.pop()  # the oldest cycle in flight (waits for it)
            a, n = out[0], out[1]
            committed = out[2 : 2 + a] + [out[2 + s]]
            tokens.extend(committed)
            result.cycles += 1
            result.accepted_per_cycle.append(a)
            result.proposal_lengths.append(n)
            if stops.intersection(committed) or len(tokens) >= max_new_tokens:
                break
        ring.drain()
        result.decode_s = self._clock() - t1
        result.tokens, hit_stop = cut_at_stop(tokens, sorted(stops), max_new_tokens)
        result.stop_reason = "stop" if hit_stop else "length"
        # host view of the target cache: the returned tokens but the last (the next anchor); a last cycle that
        # accepted past the cut or a stop token leaves no trace
        self.target.commit(n_prompt + len(result.tokens) - 1)
        return result

    def _first_token(self, logits: torch.Tensor) -> torch.Tensor:
        """[1] the token after the prompt: the argmax, or a draw from the processed distribution."""
        if self.sampling is None:
            return logits.argmax().view(1)
        from dspark_core.decoding.sampling import logits_to_probs, race_sample

        return race_sample(logits_to_probs(logits.float(), self.sampling), self._rand(logits.shape[-1])).view(1)

    def _ring_depth_ok(self) -> bool:
        """Run one cycle ahead only where it pays: replayed graphs (eager cycles are host-bound anyway)."""
        return self.cuda_graph


class _HostRing:
    """FIFO of the per-cycle ``out`` tensors copied to the host: on CUDA asynchronously into pinned slots,
    each followed by an event, so the host can enqueue the next cycle before it reads this one."""

    def __init__(self, out: torch.Tensor, depth: int) -> None:
        self.cuda = out.is_cuda
        self.slots = torch.empty((depth, out.numel()), dtype=out.dtype, pin_memory=self.cuda)  # [depth, S+3]
        self.events = [torch.cuda.Event() for _ in range(depth)] if self.cuda else []
        self.queue: deque[int] = deque()
        self.next = 0

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, out: torch.Tensor) -> None:
        i = self.next
        self.slots[i].copy_(out, non_blocking=self.cuda)
        if self.cuda:
            self.events[i].record()
        self.queue.append(i)
        self.next = (i + 1) % len(self.slots)

    def wait_newest(self) -> None:
        if self.cuda:
            self.events[self.queue[-1]].synchronize()

    def pop(self) -> list[int]:
        i = self.queue.popleft()
        if self.cuda:
            self.events[i].synchronize()
        return self.slots[i].tolist()

    def drain(self) -> None:
        """Forget the cycles still in flight (their tokens are not needed); waits for them to finish."""
        while self.queue:
            self.pop()
