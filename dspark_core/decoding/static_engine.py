"""The fast engine: speculative decoding of ``concurrency`` requests at once, with the whole cycle on the device.

The same algorithm as :class:`dspark_core.decoding.engine.SpeculativeDecoder` (the reference: one request, any
draft, any sampling, host-side bookkeeping), run over the request rows of one ``TargetRunner`` (its
``batch_size`` is the concurrency). Every length lives in device tensors, so a cycle has static shapes and is
captured as CUDA graphs:

    propose   every row's block t_1..t_S at (anchor_r, p_r)                                  (one draft call)
    verify    every row's [anchor, t_1..t_k] in one target forward (``TargetRunner.step_rows``)
    accept    a_r = matching prefix (greedy) or exact rejection sampling per row; bonus_r
    update    the draft context of positions p_r..p_r+k written (only p_r..p_r+a_r count);
              p_r += a_r + 1; anchor_r = bonus_r

Each row keeps its own KV length p_r: rows accept different counts and a rejection rolls a row back by its own
length (the stale K/V past p_r are never read and are overwritten later), with no re-padding. ``serve(prompts)``
keeps every row busy as a serving engine under ``--max-concurrency`` does: when a request ends (stop token,
``max_new_tokens``, or the cache's end: ``stop_reason`` ``max_len``) its row takes the next prompt (prefilled
into that row alone, ``TargetRunner.prefill_row``). The host reads one small tensor per cycle, ``[a, n,
t_1..t_S, bonus]`` per row, copied asynchronously into a pinned slot after it has enqueued the next cycle (one
cycle in flight with CUDA graphs).

``draft=None`` is AR decoding on the very same rows, step and graphs: every row verifies its anchor alone (k_r =
0) and commits the target's token, so a speedup compares like with like at every concurrency.

``proposal`` (``dspark_core.decoding.rows``): ``fixed`` -- every row verifies its whole block (k_r = S) --, or
``confidence`` -- the rows share the verify step, sized each cycle among the step sizes ``concurrency x j`` (j = 1
.. S+1): the draft tokens of all rows ranked by their predicted acceptance (the running product of the
confidence head's per-slot acceptance), and the size chosen whose expected committed tokens per second of cycle is
highest, with the cost of each size measured on this machine when the engine first serves (``cost_s``). At low
concurrency a wider step costs about nothing and every row verifies its block; at high concurrency the verify is
compute-bound and draft tokens unlikely to be accepted are left out. ``verify_budget`` caps the step's tokens. The
draft's own cost must be earned too: while AR cycles (every row its anchor alone) commit more tokens per second
than the speculative cycles did -- their measured committed tokens over the measured draft and verify times --, the
engine runs AR cycles, and proposes again every ``PROBE_EVERY`` cycles to measure anew.

Two ways to run a cycle, chosen by its shape:

- **one row** (concurrency 1, a baseline draft, fixed proposals): the batch-1 path, with the Triton decode kernels
  where the target runner has them (draft layers, Markov slots, the one-launch greedy / sampled accept), draft
  trees (``tree_branches``: side branches verified in the same forward, ``dspark_core.decoding.tree``), and a
  confidence cut that caps the accepted prefix at the first slot below ``confidence_threshold`` (the target always
  verifies S+1 tokens; the same commits as the reference, which proposes only the confident slots);
- **rows** (any other case): the flat step of ``rows``, any draft -- a variant's hooks read their per-row state
  through ``DSparkDraft.rows_extras`` (Engram: each row's token history, ``seq``; Draft Memory: each row's last
  block) and run eagerly, the baseline's propose is captured --, greedy or sampling along a chain. Draft trees are
  refused here.

``sampling`` (temperature > 0, chain only): the draft draws each slot from its processed distribution q, and the
accept step is exact rejection sampling against the target's p (accept t_i while u_i q_i(t_i) < p_i(t_i), then one
token from normalize(max(p_a - q_a, 0)), or from p_a past the last counted slot), every draw an exponential race
on device uniforms: no host read, static shapes (one row with the Triton draft at a plain temperature:
``MarkovSampler`` slots, and the accept step in two launches, ``kernels.accept.SampledAccept``; ``REJECT_KERNEL =
False`` for the torch ops). Without CUDA graphs the draws come from ``torch.Generator(seed)``; with them from the
default CUDA generator (graph-safe).

Without ``cuda_graph`` (CPU, tests) the very same cycle code runs eagerly. Timing: ``time_every = k`` times draft
and verify separately on every k-th cycle (a sync between the two on those cycles only).

Shape legend: R request rows (the concurrency), S block size, T tokens of a verify step, V vocab, K aux layers,
H target hidden, N tree nodes.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Sequence

import numpy as np
import torch

from dspark_core.decoding.common import BudgetError, Clock, check_budget, prompt_tensor
from dspark_core.decoding.rows import (PROPOSALS, BatchResult, accept_greedy_rows, confident_prefix_rows,
                                       schedule_by_confidence, scatter_rows, token_layout)
from dspark_core.decoding.sampling import SamplingParams, logits_to_probs, race_sample, rejection_rows
from dspark_core.decoding.static_draft import StaticDraft, draft_kernels_problem, static_draft_problem
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.decoding.tree import TreeLayout, parse_branches
from dspark_core.decoding.types import GenerationResult, cut_at_stop
from dspark_core.draft.inference import choose_tokens

# The sampled accept step in two Triton launches (``kernels.accept.SampledAccept``) instead of ~50 torch kernels:
# tested against the torch step (interpreter and H200) and, in CUDA graphs, against the target's distribution
# (chi-square, H200); SmolLM2 ``mma`` sampling cycle 1.166 -> 1.094 ms. False keeps the torch ops
# (``logits_to_probs`` + ``sampling.rejection_step``), the reference the tests compare it with.
REJECT_KERNEL = True
COST_REPEATS = 5  # replays timed per verify step size (proposal: confidence); the median is kept
PROBE_EVERY = 16  # proposal: confidence: while AR cycles pay more, a speculative cycle every this many measures again
RATE_WEIGHT = 0.3  # weight of the newest speculative cycle in the running tokens-per-second estimate


class StaticSpeculativeDecoder:
    """Speculative (or, with ``draft=None``, AR) decoding of ``target.batch_size`` requests at once (see the
    module docstring).

    ``kernels`` (None: the target runner's choice where the draft allows it) runs the one-row path's draft layers
    through the Triton decode kernels. ``cuda_graph`` (None: the target runner's choice) captures the cycle.
    ``reserve``: cache positions kept free past a request's last token (at least what the cycles in flight may
    write); give AR and speculative engines the same value to cap their requests alike at the cache's end."""

    def __init__(self, target: TargetRunner, draft, *, block_size: int | None = None,
                 confidence_threshold: float = 0.0, sampling: SamplingParams | None = None,
                 kernels: bool | None = None, cuda_graph: bool | None = None, time_every: int = 0,
                 tree_branches=(), seed: int = 0, proposal: str = "fixed", verify_budget: int | None = None,
                 min_gain: float = 0.0, reserve: int = 0) -> None:
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        self.target, self.draft, self.concurrency = target, draft, target.batch_size
        branches = parse_branches(tree_branches)
        self.hooked = draft is not None and static_draft_problem(draft) is not None
        self.single = self.concurrency == 1 and draft is not None and proposal == "fixed" and not self.hooked
        self._check(draft, block_size, confidence_threshold, proposal, branches, verify_budget)
        self.cuda_graph = target.cuda_graph if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and target.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs CUDA; the target is on {target.device}")
        self.block_size = s = 0 if draft is None else int(draft.block_size)
        self.confidence_threshold = float(confidence_threshold)
        self.proposal, self.verify_budget, self.min_gain = proposal, verify_budget, float(min_gain)
        self.time_every, self.seed = int(time_every), int(seed)
        self.tree = TreeLayout(s, branches) if draft is not None else None
        dev, rows = target.device, self.concurrency
        self.p = torch.zeros(rows, dtype=torch.long, device=dev)  # [R] anchor positions
        self.anchor = torch.zeros(rows, dtype=torch.long, device=dev)  # [R] anchor tokens
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)  # [R] rows decoding a request
        # per row [a, n, t_1..t_S, bonus] (+ the tree's node tokens [N]: then t = the accepted path's tokens, and
        # out[2+S:] = [anchor, nodes] is the verify's input: the bonus slot holds the anchor between cycles)
        tree_nodes = 0 if self.tree is None or self.tree.is_chain else self.tree.nodes
        self.out = torch.zeros(rows, s + 3 + tree_nodes, dtype=torch.long, device=dev)  # [R, W]
        self.out[:, 1] = s
        self._gen = None if self.cuda_graph else torch.Generator(dev).manual_seed(int(seed))
        self._graphs: Any = None
        self._ring: _HostRing | None = None
        self._clock = Clock(dev)
        self.reserve = max(int(reserve), self._depth() * (1 if self.tree is None else self.tree.rows))
        if self.single:
            self._init_single(kernels)
        else:
            self._init_rows()

    def _check(self, draft, block_size, threshold, proposal, branches, budget) -> None:
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {', '.join(PROPOSALS)}; got {proposal!r}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1]; got {threshold!r}")
        if budget is not None and budget < self.concurrency:
            raise ValueError(f"verify_budget {budget} is below the concurrency {self.concurrency} (every row "
                             "verifies its anchor)")
        if self.sampling is not None and branches:
            raise ValueError("the static engine verifies draft trees greedily (greedy tree acceptance inside the "
                             "CUDA-graph cycle); a sampling tree (recursive rejection sampling over siblings, "
                             "dspark_core.decoding.tree_sampling) runs in the reference engine: "
                             f"SpeculativeDecoder(..., tree_branches=...) (temperature {self.sampling.temperature})")
        if draft is None:
            if branches or proposal != "fixed" or threshold > 0:
                raise ValueError("AR decoding (no draft) takes no tree_branches, proposal or confidence_threshold")
            return
        if branches and not self.single:
            why = (f"concurrency {self.concurrency}" if self.concurrency != 1 else
                   f"proposal {proposal}" if proposal != "fixed" else static_draft_problem(draft))
            raise ValueError(f"draft trees run on one row with a baseline draft and fixed proposals ({why}); "
                             "set tree_branches: [] to decode the chain")
        if block_size is not None and block_size != draft.block_size:
            raise ValueError(f"block_size {block_size} differs from the draft's {draft.block_size}")
        if tuple(draft.aux_layer_ids) != tuple(self.target.aux_layer_ids):
            raise ValueError(f"draft aux_layer_ids {list(draft.aux_layer_ids)} differ from the target runner's "
                             f"{list(self.target.aux_layer_ids)}")
        if proposal == "confidence" and draft.confidence is None:
            raise ValueError(f"proposal: confidence ranks draft tokens by the confidence head, and draft.kind "
                             f"{draft.cfg.kind!r} has none (draft.confidence_head: false); use proposal: fixed")
        if branches and threshold > 0:
            raise ValueError("tree_branches with a confidence_threshold: the confidence cut applies to the chain only")

    def _depth(self) -> int:
        """Cycles in flight: one ahead only where it pays (replayed graphs; eager cycles are host-bound anyway)."""
        return 2 if self.cuda_graph else 1

    # == the one-row path =======================================================================================
    def _init_single(self, kernels: bool | None) -> None:
        target, draft, s, dev = self.target, self.draft, self.block_size, self.target.device
        if kernels is None:  # the target's choice, where the draft's layers allow it
            kernels = target.kernels and draft_kernels_problem(draft) is None
        self.static = StaticDraft(draft, target.max_len, kernels=kernels)
        if not self.tree.is_chain and self.confidence_threshold > 0:
            raise ValueError("tree_branches with a confidence_threshold: the confidence cut applies to the chain only")
        self.o = self.out[0]  # [W] the row's out
        self.verify_slots = torch.arange(s + 1, device=dev)  # [S+1]
        self.tables = None if self.tree.is_chain else self.tree.tensors(dev)
        self.path = torch.zeros(3, s + 1, dtype=torch.long, device=dev)  # [3, S+1] tree: rows, from, to slots
        self._accept = None  # the Triton accept step (one launch) with the Triton draft; else torch ops
        if self.sampling is not None:
            self.q = torch.zeros(s, target.vocab_size, dtype=torch.float32, device=dev)  # [S, V] the draft's q
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

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self._gen, device=self.target.device)

    def _propose(self) -> None:
        if self.sampling is not None:
            need_hidden = self.confidence_threshold > 0
            race = self._rand(self.block_size, self.q.shape[1])  # [S, V]
            _, hidden = self.static.propose_sampled(self.anchor, self.p, self.sampling, self.q, race, need_hidden)
            self.o[1] = self.static.confident_slots(self.anchor, hidden, self.confidence_threshold)
            self.o[2 : 2 + self.block_size] = self.static.tokens
            return
        if not self.tree.is_chain:
            self.static.propose_tree(self.anchor, self.p, self.tree, self.o[2 + self.block_size :])
            return  # o[1] (slots allowed) stays S, set once in __init__
        need_hidden = self.confidence_threshold > 0
        tokens, hidden = self.static.propose(self.anchor, self.p, need_hidden)  # [S], [S, H] | None
        self.o[1] = self.static.confident_slots(self.anchor, hidden, self.confidence_threshold)
        self.o[2 : 2 + self.block_size] = tokens

    def _verify_update(self) -> None:
        if not self.tree.is_chain:
            return self._verify_update_tree()
        s = self.block_size
        tokens = self.o[2 : 2 + s]  # [S]
        ids = torch.cat([self.anchor, tokens]).view(1, s + 1)  # [1, S+1]
        pos = self.p + self.verify_slots  # [S+1]
        logits, aux = self.target.step(ids, pos)  # [1, S+1, V], [1, S+1, K, H]
        if self.sampling is not None and self._sampled_accept is not None:  # the same step in two kernels
            self._sampled_accept(logits[0], self.q, self.o, self.p, self.anchor, self._rand(s),
                                 self._rand(self.q.shape[1]), self.sampling.temperature)
        elif self.sampling is not None:  # exact rejection sampling on the device
            from dspark_core.decoding.sampling import rejection_step

            probs = logits_to_probs(logits[0].float(), self.sampling)  # [S+1, V]
            a, bonus = rejection_step(probs, self.q, tokens, self.o[1], self._rand(s), self._rand(self.q.shape[1]))
            self.o[0] = a
            self.o[2 + s] = bonus
            self.p += a + 1
            self.anchor.copy_(bonus.view(1))
        elif self._accept is not None:  # the same step in one kernel (kernels/accept.py)
            self._accept(logits[0], self.o, self.p, self.anchor)
        else:
            best = logits[0].argmax(dim=-1)  # [S+1]
            match = (best[:s] == tokens) & (self.verify_slots[:s] < self.o[1])
            a = match.long().cumprod(dim=0).sum()  # [] accepted prefix
            bonus = best.gather(0, a.view(1))  # [1]
            self.o[0] = a
            self.o[2 + s] = bonus[0]
            self.p += a + 1
            self.anchor.copy_(bonus)
        self.static.extend(aux, pos)  # all S+1 positions; only p..p+a are below the new length

    def _verify_update_tree(self) -> None:
        from dspark_core.kernels.accept import greedy_accept_tree_reference, kv_move_reference

        s, t = self.block_size, self.tables
        ids = self.o[2 + s :].view(1, -1)  # [1, R] the anchor (= the last bonus) and the node tokens
        pos = self.p + t.depth  # [R] logical positions
        logits, aux = self.target.step(ids, pos, tree=(t.offset, t.back))  # [1, R, V], [1, R, K, H]
        self.static.extend(aux, pos, slot_offset=t.offset)  # every row's context, in its row's slot like the target
        kv, draft_kv = self.target.caches, (self.static.k, self.static.v)
        if self._accept is not None:  # one launch: accept, then the winning branch's K/V moves (target and draft)
            self._accept(logits[0], self.o, self.p, self.anchor, kv=kv, draft_kv=draft_kv)
        else:
            greedy_accept_tree_reference(logits[0], self.o, self.p, self.anchor, t, self.path)
            self.target.move_kv(self.path[1], self.path[2])  # the accepted path's K/V to slots p+1..p+a
            kv_move_reference(*draft_kv, self.path)

    def _capture_single(self) -> None:
        """Warm up (Triton tuning, lazy inits) on a side stream, then capture propose and verify+update.
        The warm-up moves p / anchor and writes caches beyond the live length; both are restored."""
        p, anchor = self.p.clone(), self.anchor.clone()
        with _side_stream():
            for _ in range(3):
                self._propose()
                self._verify_update()
                self.p.copy_(p)
        pool = torch.cuda.graph_pool_handle()
        graphs = (torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[0], pool=pool):
            self._propose()
        with torch.cuda.graph(graphs[1], pool=pool):
            self._verify_update()
        self.p.copy_(p)
        self.anchor.copy_(anchor)
        self._graphs = graphs

    def _launch_single(self, timed: bool, batch: BatchResult) -> int:
        if self.cuda_graph and self._graphs is None:
            self._capture_single()
        c0 = self._clock() if timed else 0.0
        self._graphs[0].replay() if self._graphs else self._propose()
        c1 = self._clock() if timed else 0.0
        self._graphs[1].replay() if self._graphs else self._verify_update()
        if timed:
            batch.draft_s.append(c1 - c0)
            batch.verify_s.append(self._clock() - c1)
        return self.tree.rows

    def _admit_single(self, prompt: torch.Tensor) -> torch.Tensor:
        logits, aux = self.target.prefill(prompt, last_logits_only=True)  # [1, 1, V], [1, P, K, H]
        n = prompt.shape[1]
        self.static.extend(aux, self.static.key_pos[:n])
        self.anchor.copy_(self._first_token(logits[0, -1]))
        self.p.fill_(n)
        self.o[2 + self.block_size : 3 + self.block_size].copy_(self.anchor)  # a tree's token buffer: the anchor
        return self.anchor

    # == the rows path ==========================================================================================
    def _init_rows(self) -> None:
        target, draft, s, rows, dev = self.target, self.draft, self.block_size, self.concurrency, self.target.device
        self.static = None if draft is None else StaticDraft(draft, target.max_len, rows=rows, hooks=self.hooked)
        self.tokens = torch.zeros(rows, s, dtype=torch.long, device=dev)  # [R, S] the proposal
        self.conf = torch.ones(rows, s, device=dev)  # [R, S] its per-slot confidence
        self.cut = torch.full((rows,), s, dtype=torch.long, device=dev)  # [R] slots before the confidence cut
        self.counts = torch.full((rows,), s, dtype=torch.long, device=dev)  # [R] draft tokens each row verifies
        self._counts_host = torch.full((rows,), s, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.q = None
        if self.sampling is not None and s > 0:
            self.q = torch.zeros(rows, s, target.vocab_size, device=dev)  # [R, S, V] the draft's q
        history = 0 if draft is None else int(getattr(draft, "token_history", 0))
        # [R, max_len + 2 (S+1)] every row's tokens by position (the variants' token history)
        self.seq = torch.zeros(rows, target.max_len + 2 * (s + 1), dtype=torch.long, device=dev) if history else None
        self.variant_state = draft.rows_state(rows, dev) if self.hooked else None
        self.sizes = [rows * (j + 1) for j in range(s + 1)] if self.proposal == "confidence" else [rows * (s + 1)]
        self.cost_s: dict[int, float] = {}  # verify seconds per step size (measured when first serving)
        self.draft_cost_s = 0.0
        self._spec_rate: float | None = None  # measured committed tokens per second of speculative cycles (running)
        self._since_spec = 0  # cycles since the last speculative one
        self._graphs = {}

    def _extras(self) -> dict | None:
        if not self.hooked:
            return None
        return self.draft.rows_extras(self.variant_state, self.seq, self.p)

    def _pick(self):
        """The slots' token choice: greedy argmax, or a draw from q on device uniforms (graph-safe)."""
        if self.sampling is None:
            return lambda logits: (logits.argmax(dim=-1), None)
        races = iter(self._rand(self.concurrency, self.block_size, self.target.vocab_size).unbind(1))  # S x [R, V]

        def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            probs = logits_to_probs(logits, self.sampling)  # [R, V]
            return race_sample(probs, next(races)), probs

        return pick

    def _propose_rows(self) -> None:
        """Every row's block: tokens, confidence (and q when sampling) into the engine's buffers."""
        extras = self._extras()
        hidden = self.static.block_rows(self.anchor, self.p, extras)  # [R, S, H]
        tokens, probs, conf = choose_tokens(self.draft, hidden, self.anchor, self._pick(), extras)
        if self.hooked:
            self.draft.rows_record(self.variant_state, self.p, hidden, extras,
                                   lambda e: self.static.block_rows(self.anchor, self.p, e))
        self.tokens.copy_(tokens)
        self.conf.copy_(conf)
        self.cut.copy_(confident_prefix_rows(conf, self.confidence_threshold))
        if self.q is not None:
            self.q.copy_(probs)

    def _verify_rows(self, total: int) -> None:
        """Verify ``total`` tokens: each row's anchor and its first ``counts`` draft tokens, then accept and update."""
        s, rows_n = self.block_size, self.concurrency
        rows, cols = token_layout(1 + self.counts, total)  # [T], [T]
        pos = self.p[rows] + cols  # [T]
        ids = self.anchor[rows]  # [T]
        if s:
            ids = torch.where(cols == 0, ids, self.tokens[rows, (cols - 1).clamp(min=0)])
        logits, aux = self.target.step_rows(ids, rows, pos, cols, s + 1)  # [T, V], [T, K, H]
        allowed = torch.minimum(self.cut, self.counts)  # [R]
        if self.sampling is None:
            a, bonus = accept_greedy_rows(logits.argmax(dim=-1), rows, cols, self.tokens, allowed)
        else:
            probs = scatter_rows(logits_to_probs(logits.float(), self.sampling), rows, cols, rows_n, s + 1)
            q = self.q if self.q is not None else probs.new_zeros(rows_n, 0, probs.shape[-1])
            a, bonus = rejection_rows(probs, q, self.tokens, allowed, self._rand(rows_n, s),
                                      self._rand(rows_n, probs.shape[-1]))
        self.out[:, 0] = a
        self.out[:, 1] = allowed
        self.out[:, 2 : 2 + s] = self.tokens
        self.out[:, 2 + s] = bonus
        if self.seq is not None:  # committed tokens by position (the slots past a + 1 are overwritten later)
            self.seq.scatter_(1, self.p.view(-1, 1) + 1 + torch.arange(s, device=a.device), self.tokens)
            self.seq.scatter_(1, (self.p + a + 1).view(-1, 1), bonus.view(-1, 1))
        if self.static is not None:
            self.static.extend_rows(aux, rows, pos)  # every verified position; only p..p+a are below the new p
        self.p += (a + 1) * self.active
        self.anchor.copy_(torch.where(self.active, bonus, self.anchor))

    def _capture_rows(self, total: int) -> None:
        """Capture the propose (once, a draft without variant hooks) and the verify of ``total`` tokens, after a
        warm-up on a side stream (every row verifying as many draft tokens as the size allows); the state a
        cycle moves is restored (the warm-up writes past the live lengths only)."""
        saved = self._saved()
        self.counts.fill_((total - self.concurrency) // self.concurrency)
        pool = self._graphs.setdefault("pool", torch.cuda.graph_pool_handle())
        capture_propose = self.draft is not None and not self.hooked and "propose" not in self._graphs
        with _side_stream():
            for _ in range(3):
                if capture_propose:
                    self._propose_rows()
                self._verify_rows(total)
                self._restore(saved, counts=False)
        if capture_propose:
            self._graphs["propose"] = graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._propose_rows()
        self._graphs[total] = graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._verify_rows(total)
        self._restore(saved)

    def _saved(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.p, self.anchor, self.out, self.counts)]

    def _restore(self, saved: list[torch.Tensor], counts: bool = True) -> None:
        for t, v in zip((self.p, self.anchor, self.out, self.counts)[: 4 if counts else 3], saved):
            t.copy_(v)

    def _run_propose_rows(self) -> None:
        if self.draft is None:
            return
        graph = self._graphs.get("propose")
        graph.replay() if graph is not None else self._propose_rows()

    def _run_verify_rows(self, total: int) -> None:
        if self.cuda_graph and total not in self._graphs:
            self._capture_rows(total)
        graph = self._graphs.get(total)
        graph.replay() if graph is not None else self._verify_rows(total)

    def _schedule(self) -> int:
        """``proposal: confidence``: read the proposal's confidence, choose the step size and each row's verified
        draft tokens (``rows.schedule_by_confidence``), hand them to the device. Returns the step size."""
        gains = torch.cumprod(self.conf, dim=1).cpu().numpy()  # [R, S] (a sync: the proposal must be done)
        active = self.active.cpu().numpy()
        plan = schedule_by_confidence(gains, active, self.sizes, self.cost_s, self.draft_cost_s, self.min_gain,
                                      self.verify_budget)
        self._counts_host.copy_(torch.from_numpy(plan.counts))
        self.counts.copy_(self._counts_host, non_blocking=True)
        return plan.total

    def _measure_costs(self) -> None:
        """The wall time of each verify step size on the rows as they are (the median of ``COST_REPEATS``; the
        state a verify moves is restored). The propose's is measured on the cycle that follows."""
        saved = self._saved()
        for total in self.sizes:
            self.counts.fill_((total - self.concurrency) // self.concurrency)
            self._run_verify_rows(total)  # captured (CUDA) or warmed up
            self._restore(saved, counts=False)
            times = []
            for _ in range(COST_REPEATS):
                t0 = self._clock()
                self._run_verify_rows(total)
                times.append(self._clock() - t0)
                self._restore(saved, counts=False)
            self.cost_s[total] = float(np.median(times))
        self._restore(saved)

    def _launch_rows(self, timed: bool, batch: BatchResult, active: int) -> tuple[int, bool]:
        """Enqueue one cycle of the rows path; returns its verify size and whether the draft proposed."""
        if self.cuda_graph:
            for size in self.sizes:
                if size not in self._graphs:
                    self._capture_rows(size)
        measure = self.proposal == "confidence" and not self.cost_s
        if measure:
            self._measure_costs()
        speculate = self.draft is not None and self._speculate(active)
        c0 = self._clock() if timed or measure else 0.0
        if speculate:
            self._run_propose_rows()
        c1 = self._clock() if timed or measure else 0.0
        if measure:
            self.draft_cost_s = c1 - c0
        if self.proposal != "confidence":
            total = self.sizes[-1]
        elif speculate:
            total = self._schedule()
        else:  # an AR cycle: every row verifies its anchor alone
            self.counts.zero_()
            total = self.sizes[0]
        self._run_verify_rows(total)
        if timed:
            batch.draft_s.append(c1 - c0)
            batch.verify_s.append(self._clock() - c1)
        return total, speculate

    def _speculate(self, active: int) -> bool:
        """``proposal: confidence``: propose this cycle unless AR cycles commit more tokens per second -- ``active``
        rows per AR step's measured time against the running rate of the speculative cycles (their committed tokens
        over the measured draft and verify times), measured again every ``PROBE_EVERY`` cycles."""
        if self.proposal != "confidence" or self._spec_rate is None or self._since_spec >= PROBE_EVERY:
            return True
        return self._spec_rate >= active / self.cost_s[self.sizes[0]]

    def _observe(self, out: list[int], snapshot: tuple[int, ...], total: int, speculated: bool) -> None:
        """After a cycle was read: update the running rate of the speculative cycles (``proposal: confidence``)."""
        if self.proposal != "confidence" or self.draft is None:
            return
        if not speculated:
            self._since_spec += 1
            return
        width = len(out) // len(snapshot)
        committed = sum(out[r * width] + 1 for r, index in enumerate(snapshot) if index >= 0)
        rate = committed / max(self.draft_cost_s + self.cost_s[total], 1e-12)
        self._spec_rate = rate if self._spec_rate is None else (1 - RATE_WEIGHT) * self._spec_rate + RATE_WEIGHT * rate
        self._since_spec = 0

    def _admit_rows(self, row: int, prompt: torch.Tensor) -> torch.Tensor:
        n = prompt.shape[1]
        history = 0 if self.draft is None else int(getattr(self.draft, "token_history", 0))
        if n < history - 1:
            raise ValueError(f"a prompt of {n} tokens is shorter than the {history - 1} tokens before the anchor "
                             f"that draft.kind {self.draft.cfg.kind!r} reads (token_history {history})")
        logits, aux = self.target.prefill_row(row, prompt)  # [1, 1, V], [1, P, K, H]
        if self.static is not None:
            self.static.extend_rows(aux[0], torch.full((n,), row, device=prompt.device), self.static.key_pos[:n])
        first = self._first_token(logits[0, -1])  # [1]
        self.anchor[row : row + 1].copy_(first)
        self.p[row] = n
        self.active[row] = True
        if self.seq is not None:
            self.seq[row, :n] = prompt[0]
            self.seq[row, n] = first[0]
        if self.hooked:
            self.draft.rows_reset(self.variant_state, row)
        return first

    def _retire_row(self, row: int) -> None:
        """No request left for ``row``: it stops moving (its cycles write at positions 0..S, never read)."""
        self.active[row] = False
        self.p[row] = 0
        self.anchor[row] = 0

    # == serving ================================================================================================
    def _first_token(self, logits: torch.Tensor) -> torch.Tensor:
        """[1] the token after a prompt: the argmax, or a draw from the processed distribution."""
        if self.sampling is None:
            return logits.argmax().view(1)
        return race_sample(logits_to_probs(logits.float(), self.sampling), self._rand(logits.shape[-1])).view(1)

    def _limit(self, index: int, prompt_len: int, max_new_tokens: int, strict: bool) -> int:
        """The tokens request ``index`` may make: max_new_tokens, or fewer where the cache ends first."""
        if strict:
            check_budget(self.target, prompt_len, max_new_tokens, self.reserve)
            return max_new_tokens
        check_budget(self.target, prompt_len, 1, self.reserve)  # the prompt itself must fit
        return min(max_new_tokens, self.target.max_len - prompt_len - self.reserve)

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 stop_ids: Sequence[int] = ()) -> GenerationResult:
        """Decode one prompt (concurrency 1): ``serve([prompt])``'s result, with the timed cycles' draft / verify
        seconds; a request that does not fit the cache is refused (``BudgetError``)."""
        if self.concurrency != 1:
            raise ValueError(f"generate decodes one request; this engine has {self.concurrency} rows: use serve()")
        batch = self.serve([prompt_ids], max_new_tokens, stop_ids, strict=True)
        res = batch.results[0]
        res.draft_s, res.verify_s = batch.draft_s, batch.verify_s
        # host view of the target cache: the returned tokens but the last (the next anchor)
        self.target.commit(len(prompt_tensor(prompt_ids, "cpu")[0]) + len(res.tokens) - 1)
        return res

    @torch.no_grad()
    def serve(self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int,
              stop_ids: Sequence[int] = (), *, strict: bool = False) -> BatchResult:
        """Decode every prompt, ``concurrency`` at a time, each row taking the next prompt when its request ends
        (see the module docstring). A request stops at its first stop token (kept), at ``max_new_tokens``, or
        where the cache ends (``stop_reason`` ``max_len``; ``strict``: refused instead, ``BudgetError``)."""
        if not prompts:
            raise ValueError("serve needs at least one prompt")
        dev = self.target.device
        reqs = [prompt_tensor(p, dev) for p in prompts]
        limits = []
        for i, req in enumerate(reqs):
            try:
                limits.append(self._limit(i, req.shape[1], max_new_tokens, strict))
            except BudgetError as e:
                raise BudgetError(f"request {i}: {e}", prompt_len=e.prompt_len, need=e.need, max_len=e.max_len) from None
        run = _Run(reqs, limits, set(int(t) for t in stop_ids), self.concurrency, max_new_tokens)
        batch = BatchResult([GenerationResult(tokens=[]) for _ in reqs], self.concurrency)
        start = self._clock()
        for row in range(self.concurrency):
            self._fill(row, run, batch)
        depth = self._depth()
        if self._ring is None or self._ring.shape != (depth, self.out.numel()):  # pinned slots, reused
            self._ring = _HostRing(self.out, depth)
        ring, launched, s = self._ring, 0, self.block_size
        while run.busy():
            while len(ring) < depth and run.needs_cycle(len(ring), s + 1):
                timed = self.time_every > 0 and launched % self.time_every == 0
                if timed and len(ring):
                    break  # a timed cycle starts on an idle device
                if self.single:
                    total, speculated = self._launch_single(timed, batch), True
                else:
                    total, speculated = self._launch_rows(timed, batch, run.active())
                ring.push(self.out, (run.snapshot(), total, speculated))
                launched += 1
                if timed:
                    break
            if not len(ring):
                break
            out, (snapshot, total, speculated) = ring.pop()  # the oldest cycle in flight (waits for it)
            batch.active_rows.append(sum(r >= 0 for r in snapshot))
            batch.verify_tokens.append(total)
            batch.proposed.append(speculated)
            self._observe(out, snapshot, total, speculated)
            for row in run.commit(out, snapshot, s, batch):
                self._fill(row, run, batch)
        ring.drain()
        batch.decode_s = self._clock() - start - batch.prefill_s
        for res, limit in zip(batch.results, limits):
            res.tokens, hit_stop = cut_at_stop(res.tokens, sorted(run.stops), limit)
            res.stop_reason = "stop" if hit_stop else ("length" if limit == max_new_tokens else "max_len")
        return batch

    def _fill(self, row: int, run: "_Run", batch: BatchResult) -> None:
        """Give ``row`` the next pending request (prefilled now), or retire it when none is left. A request done
        after its first token (a stop token, a limit of 1) hands the row on at once."""
        while run.pending:
            index = run.pending.popleft()
            t0 = self._clock()
            first = self._admit_single(run.reqs[index]) if self.single else self._admit_rows(row, run.reqs[index])
            token = int(first[0].item())
            t1 = self._clock()
            batch.prefill_s += t1 - t0
            res = batch.results[index]
            res.prefill_s, res.tokens = t1 - t0, [token]
            if run.start_row(row, index, token, t1):
                return
            res.decode_s = 0.0
        run.rows[row] = -1
        if not self.single:
            self._retire_row(row)


class _Run:
    """Host bookkeeping of one ``serve``: which request each row decodes, their tokens and when they started."""

    def __init__(self, reqs: list[torch.Tensor], limits: list[int], stops: set[int], rows: int,
                 max_new_tokens: int) -> None:
        self.reqs, self.limits, self.stops = reqs, limits, stops
        self.pending = deque(range(len(reqs)))
        self.rows = [-1] * rows  # the request each row decodes (-1: none)
        self.started = [0.0] * rows
        self.tokens: dict[int, list[int]] = {}

    def busy(self) -> bool:
        return any(r >= 0 for r in self.rows)

    def active(self) -> int:
        return sum(r >= 0 for r in self.rows)

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.rows)

    def start_row(self, row: int, index: int, first: int, now: float) -> bool:
        """Row ``row`` decodes request ``index`` from its first token; False when that token already ends it."""
        if first in self.stops or self.limits[index] <= 1:
            return False
        self.rows[row], self.started[row] = index, now
        self.tokens[index] = [first]
        return True

    def needs_cycle(self, in_flight: int, per_cycle: int) -> bool:
        """Whether some row may still need another cycle beyond the ``in_flight`` ones."""
        return any(r >= 0 and len(self.tokens[r]) + per_cycle * in_flight < self.limits[r] for r in self.rows)

    def commit(self, out: list[int], snapshot: tuple[int, ...], s: int, batch: BatchResult) -> list[int]:
        """Apply one cycle's ``out`` (rows of ``[a, n, t_1..t_S, bonus, ...]``) to the requests its rows held at
        launch (rows refilled since are skipped); returns the rows whose request ended."""
        width, now, done = len(out) // len(snapshot), time.perf_counter(), []
        for row, index in enumerate(snapshot):
            if index < 0 or self.rows[row] != index:
                continue
            o = out[row * width : (row + 1) * width]
            a, n = o[0], o[1]
            committed = o[2 : 2 + a] + [o[2 + s]]
            tokens = self.tokens[index]
            tokens.extend(committed)
            res = batch.results[index]
            res.tokens = tokens
            res.cycles += 1
            res.accepted_per_cycle.append(a)
            res.proposal_lengths.append(n)
            if self.stops.intersection(committed) or len(tokens) >= self.limits[index]:
                res.decode_s = now - self.started[row]
                self.rows[row] = -1
                done.append(row)
        return done


class _side_stream:
    """Run a warm-up on a side stream (what CUDA graph capture wants first), then join the current stream."""

    def __enter__(self):
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        self.ctx = torch.cuda.stream(self.stream)
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        torch.cuda.current_stream().wait_stream(self.stream)
        return False


class _HostRing:
    """FIFO of the per-cycle ``out`` tensors copied to the host: on CUDA asynchronously into pinned slots,
    each followed by an event, so the host can enqueue the next cycle before it reads this one. Each slot carries
    a host object too (what the cycle was launched for)."""

    def __init__(self, out: torch.Tensor, depth: int) -> None:
        self.cuda = out.is_cuda
        self.shape = (depth, out.numel())
        self.slots = torch.empty(self.shape, dtype=out.dtype, pin_memory=self.cuda)  # [depth, R*W]
        self.events = [torch.cuda.Event() for _ in range(depth)] if self.cuda else []
        self.tags: list[Any] = [None] * depth
        self.queue: deque[int] = deque()
        self.next = 0

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, out: torch.Tensor, tag: Any = None) -> None:
        i = self.next
        self.slots[i].copy_(out.view(-1), non_blocking=self.cuda)
        if self.cuda:
            self.events[i].record()
        self.tags[i] = tag
        self.queue.append(i)
        self.next = (i + 1) % len(self.slots)

    def wait_newest(self) -> None:
        if self.cuda:
            self.events[self.queue[-1]].synchronize()

    def pop(self) -> tuple[list[int], Any]:
        i = self.queue.popleft()
        if self.cuda:
            self.events[i].synchronize()
        return self.slots[i].tolist(), self.tags[i]

    def drain(self) -> None:
        """Forget the cycles still in flight (their tokens are not needed); waits for them to finish."""
        while self.queue:
            self.pop()
