"""Online speculative decoding, batch size 1: propose -> verify -> update.

Invariant at the start of every cycle (p = position of the anchor, the last committed token):

    target KV length == draft context length == p      (the anchor's own hidden state is in neither)

1. Prefill: the target processes the prompt (P tokens); the first new token comes from its last
   logits and becomes the anchor at position P; the draft context gets the aux hidden of all P
   prompt positions.
2. Propose: ``draft.propose(cache, anchor, sample_fn, threshold)`` -> n <= block_size tokens
   ``t_1..t_n`` (the confidence head may cut the block short) and their draft distributions q.
3. Verify: the target forwards ``[anchor, t_1..t_n]`` at positions ``p..p+n`` in one call; greedy
   acceptance (argmax match) or exact rejection sampling gives ``a`` accepted tokens plus one
   bonus/corrected token.
4. Update: commit ``t_1..t_a`` + the bonus; roll the target back to ``p + a + 1`` (anchor + accepted:
   the bonus token is the next anchor, not yet processed); extend the draft context with the aux
   hidden of positions ``p..p+a`` only (never a rejected position).

Stops at the first stop token (kept in the output) or at ``max_new_tokens`` (cut exactly there).

Draft trees (``tree_branches``, ``dspark_core.decoding.tree``; a ``DSparkDraft``): the proposal is a tree of N
nodes (``tree_sampling.propose_tree``: greedy picks, or under sampling the branch tokens drawn without
replacement of the main chain's), verified in one tree step of the target (R = N + 1 rows at positions p + depth,
written to slots p + row); greedy tree acceptance at temperature 0 (the static engine's rule: AR's output) or
recursive rejection sampling over siblings (``tree_sampling.tree_verify_sampling``: exact under sampling). The
accepted path's K/V then move to slots p+1..p+a and the draft context takes the aux hidden of the anchor and
the accepted path's rows, so the invariant above holds after every cycle.

Shape legend: n proposed tokens, S block size, N tree nodes, R = N + 1 tree rows, V vocab, K aux layers,
H target hidden.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dspark_core.decoding.common import Clock, check_budget, make_generator, prefill_first_token, prompt_tensor
from dspark_core.decoding.sampling import SamplingParams, logits_to_probs, make_sample_fn, verify_greedy, verify_rejection
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.decoding.tree import TreeLayout, parse_branches, tree_accept_reference
from dspark_core.decoding.tree_sampling import propose_tree, tree_draft_problem, tree_verify_sampling
from dspark_core.decoding.types import CycleInfo, Draft, GenerationResult, Proposal, VerificationResult, cut_at_stop


class SpeculativeDecoder:
    """Speculative decoding of one prompt at a time with a draft that follows the draft <-> engine contract.

    ``on_cycle(CycleInfo)`` (optional) is called after every cycle's update (tests assert the rollback
    there). ``draft_dtype`` is the dtype of the draft's context cache (default None: the draft's choice).
    ``tree_branches`` ((start, length), ... or "1:2,2:1"; empty: the chain) verifies a draft tree instead of the
    chain (see the module docstring), greedy or under sampling."""

    def __init__(self, target: TargetRunner, draft: Draft, *, block_size: int, confidence_threshold: float = 0.0,
                 sampling: SamplingParams | None = None, seed: int = 0,
                 on_cycle: Callable[[CycleInfo], None] | None = None,
                 draft_dtype: torch.dtype | None = None, tree_branches=()) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1; got {block_size!r}")
        if not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1]; got {confidence_threshold!r}")
        if target.batch_size != 1:
            raise ValueError(f"the speculative engine decodes batch size 1; the target runner has {target.batch_size}")
        self.target = target
        self.draft = draft
        self.block_size = block_size
        self.confidence_threshold = float(confidence_threshold)
        self.sampling = sampling or SamplingParams()
        self.generator = make_generator(target.device, seed)
        self.sample_fn = make_sample_fn(self.sampling, self.generator)
        self.on_cycle = on_cycle
        self.draft_dtype = draft_dtype
        self._clock = Clock(target.device)
        branches = parse_branches(tree_branches)
        self.tree = TreeLayout(block_size, branches) if branches else None  # None: the chain
        self.tables = None
        if self.tree is not None:
            if self.confidence_threshold > 0:
                raise ValueError("tree_branches with a confidence_threshold: the confidence cut applies to the chain "
                                 "only")
            problem = tree_draft_problem(draft)
            if problem:
                raise ValueError(f"tree_branches: {problem}; use the chain (no tree_branches)")
            if int(draft.block_size) != block_size:
                raise ValueError(f"tree_branches: block_size {block_size} differs from the draft's {draft.block_size}")
            self.tables = self.tree.tensors(target.device)

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 stop_ids: Sequence[int] = ()) -> GenerationResult:
        """Decode up to ``max_new_tokens`` after ``prompt_ids``; see the module docstring."""
        prompt = prompt_tensor(prompt_ids, self.target.device)  # [1, P]
        check_budget(self.target, prompt.shape[1], max_new_tokens,
                     self.block_size + 1 if self.tree is None else self.tree.rows)
        stops = set(int(s) for s in stop_ids)
        result = GenerationResult(tokens=[])
        t0 = self._clock()
        anchor, prompt_aux = prefill_first_token(self.target, prompt, self.sampling, self.generator)  # [1], [1,P,K,H]
        cache = self.draft.new_context_cache(batch=1, max_len=self.target.max_len, device=self.target.device,
                                             dtype=self.draft_dtype)
        self.draft.extend_context(cache, prompt_aux)
        tokens = anchor.tolist()
        t1 = self._clock()
        result.prefill_s = t1 - t0
        history = prompt[0].tolist()  # committed ids before ``tokens`` (variants that read token ids)
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            committed = self._cycle(cache, anchor, result, self._extras(history, tokens))
            tokens.extend(committed)
            if stops.intersection(committed):
                break
            anchor = torch.tensor(committed[-1:], dtype=torch.long, device=self.target.device)  # [1]
        result.decode_s = self._clock() - t1
        result.tokens, hit_stop = cut_at_stop(tokens, sorted(stops), max_new_tokens)
        result.stop_reason = "stop" if hit_stop else "length"
        # the cache holds the returned tokens but the last (the next anchor): a cycle that accepted past the cut or
        # a stop token leaves no trace
        self.target.truncate(prompt.shape[1] + len(result.tokens) - 1)
        return result

    # -- one cycle ------------------------------------------------------------------------------
    def _extras(self, history: list[int], tokens: list[int]) -> dict[str, torch.Tensor] | None:
        """What a variant reads besides the context: the last ``draft.token_history`` committed ids through the
        anchor (``input_ids [1, n]``) and the anchor's index in them (``anchors [1, 1]``); None for the baseline."""
        n = int(getattr(self.draft, "token_history", 0))
        if n <= 0:
            return None
        tail = (history + tokens)[-n:]
        dev = self.target.device
        return {"input_ids": torch.tensor([tail], dtype=torch.long, device=dev),
                "anchors": torch.tensor([[len(tail) - 1]], dtype=torch.long, device=dev)}

    def _cycle(self, cache, anchor: torch.Tensor, result: GenerationResult,
               extras: dict[str, torch.Tensor] | None = None) -> tuple[int, ...]:
        if self.tree is not None:
            return self._tree_cycle(cache, anchor, result, extras)
        p = self.target.length  # anchor position
        t0 = self._clock()
        if extras is None:
            proposal = self.draft.propose(cache, anchor, self.sample_fn, self.confidence_threshold)
        else:
            proposal = self.draft.propose(cache, anchor, self.sample_fn, self.confidence_threshold, extras=extras)
        n = self._check_proposal(proposal)
        t1 = self._clock()
        verify_ids = torch.cat([anchor.view(1, 1), proposal.tokens[:, :n].to(anchor.device)], dim=1)  # [1, n+1]
        logits, aux = self.target.forward(verify_ids)  # [1, n+1, V], [1, n+1, K, H]
        verdict = self._verify(logits[0], proposal, n)
        a = verdict.num_accepted
        self.target.truncate(p + a + 1)
        t2 = self._clock()
        self.draft.extend_context(cache, aux[:, : a + 1])  # anchor + accepted positions only
        self._record(result, cache, p, n, a, verdict.committed, (t0, t1, t2, self._clock()))
        return verdict.committed

    def _record(self, result: GenerationResult, cache, p: int, n: int, a: int, committed: tuple[int, ...],
                times: tuple[float, float, float, float]) -> None:
        """Count one cycle (anchor at p, n proposed, a accepted); draft time = propose + extend."""
        t0, t1, t2, t3 = times
        result.cycles += 1
        result.accepted_per_cycle.append(a)
        result.proposal_lengths.append(n)
        result.draft_s.append((t1 - t0) + (t3 - t2))
        result.verify_s.append(t2 - t1)
        if self.on_cycle is not None:
            self.on_cycle(CycleInfo(cycle=result.cycles, anchor_position=p, num_proposed=n, num_accepted=a,
                                    committed=committed, target_length=self.target.length,
                                    draft_context_length=cache.length, next_anchor_position=p + a + 1))

    def _tree_cycle(self, cache, anchor: torch.Tensor, result: GenerationResult,
                    extras: dict[str, torch.Tensor] | None) -> tuple[int, ...]:
        """One cycle with a draft tree (see the module docstring)."""
        p, s, t = self.target.length, self.block_size, self.tables  # anchor position
        t0 = self._clock()
        proposal = propose_tree(self.draft, cache, anchor, self.tree, self.sampling, self.generator, extras)
        t1 = self._clock()
        ids = proposal.tokens.to(self.target.device).view(1, -1)  # [1, R]
        logits, aux = self.target.step(ids, p + t.depth, tree=(t.offset, t.back))  # [1, R, V], [1, R, K, H]
        nodes = ids[0, 1:]  # [N]
        if self.sampling.greedy:
            a, _, path, bonus = tree_accept_reference(logits[0], nodes, t)  # [], [], [S+1], []
        else:
            target_probs = logits_to_probs(logits[0], self.sampling)  # [R, V]
            node_probs = proposal.probs.to(target_probs.device)  # [N, V]
            a, _, path, bonus = (v[0] for v in tree_verify_sampling(target_probs[None], node_probs[None],
                                                                     nodes[None], t, self.generator))
        # The accepted path's K/V (rows at slots p + row) to slots p .. p + S (identity beyond the accepted depth).
        self.target.move_kv(p + path, p + torch.arange(s + 1, device=path.device))  # [S+1] slots
        host = torch.cat([a.view(1), bonus.view(1), ids[0, path]]).tolist()  # one sync: a, bonus, path tokens
        a = host[0]
        committed = tuple(host[3 : 3 + a]) + (host[1],)
        self.target.commit(p + a + 1)
        t2 = self._clock()
        self.draft.extend_context(cache, aux[:, path[: a + 1]])  # the anchor's and the accepted nodes' rows
        # proposal length = the tree's depth (as the static engine's tree: a <= S; N nodes were verified)
        self._record(result, cache, p, s, a, committed, (t0, t1, t2, self._clock()))
        return committed

    def _verify(self, logits: torch.Tensor, proposal: Proposal, n: int) -> VerificationResult:
        """logits [n+1, V] of the target at the anchor and the n proposed tokens."""
        draft_tokens = proposal.tokens[0, :n].to(logits.device)  # [n]
        if self.sampling.greedy:
            return verify_greedy(logits, draft_tokens)
        target_probs = logits_to_probs(logits, self.sampling)  # [n+1, V]
        draft_probs = proposal.probs[0, :n].to(logits.device)  # [n, V]
        return verify_rejection(target_probs, draft_probs, draft_tokens, self.generator)

    def _check_proposal(self, proposal: Proposal) -> int:
        n = int(proposal.num_tokens)
        if not 0 <= n <= self.block_size or proposal.tokens.shape[-1] < n:
            raise ValueError(f"the draft proposed {n} tokens (tokens shape {tuple(proposal.tokens.shape)}); "
                             f"expected 0..block_size={self.block_size}")
        return n
