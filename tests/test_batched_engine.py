"""The fast engine over several request rows (``StaticSpeculativeDecoder.serve`` at concurrency > 1) against the
simple references: every row's greedy output token for token that prompt's AR output decoded alone (draft tokens
accepted), the reference engine's decisions request by request, every variant batched, the sampled output
distributed as the target's (chi-square), and the confidence schedule against brute force.

CPU: the cycle runs eagerly (the code a CUDA graph captures). The CUDA-graph cases run on a GPU only."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from _decoding_utils import (assert_partial_acceptance, chisquare_pvalue, exact_marginals, fit_draft_to_target,
                             greedy_continuations)
from _decoding_utils import one_thread, untuned_kernels  # noqa: F401 (fixtures)
from dspark_core.decoding.ar import ARDecoder
from dspark_core.decoding.engine import SpeculativeDecoder
from dspark_core.decoding.rows import schedule_by_confidence, token_layout
from dspark_core.decoding.sampling import SamplingParams
from dspark_core.decoding.static_engine import StaticSpeculativeDecoder
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.draft import DraftConfig
from dspark_core.draft.config import EngramConfig, MemoryConfig, RerankerConfig
from dspark_core.draft.model import build_draft
from dspark_core.testing import tiny_model

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from dspark_core.kernels import triton_ok  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BLOCK = 4
AUX = (0, 2, 4)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2], [2, 7, 1, 8, 2, 8], [1, 1, 2, 3, 5], [9, 9, 9, 1], [4, 4, 13, 2]]
_BUILT: dict = {}


def _setup(kind: str = "baseline", **over):
    """A tiny target (16-token vocabulary) and a 2-layer draft of ``kind`` fitted 50 steps to the target's own
    greedy continuations of two prompts: right part of the time. Built once per argument set; deep copies."""
    import copy

    key = repr((kind, sorted(over.items())))
    if key not in _BUILT:
        model = tiny_model("qwen3", vocab_size=16, eos_token_id=None, pad_token_id=None, num_hidden_layers=6)
        model = model.to(DEVICE)
        torch.manual_seed(0)
        cfg = DraftConfig(**{**dict(num_draft_layers=2, block_size=BLOCK, mask_token_id=None, num_anchors=4,
                                    markov_rank=8, kind=kind), **over})
        draft = build_draft(cfg, model.config, model.get_input_embeddings().weight,
                            model.get_output_embeddings().weight, aux_layer_ids=AUX).to(DEVICE).eval()
        fit = PROMPTS[:2]
        fit_draft_to_target(draft, model, fit, greedy_continuations(model, fit, 40), 50)
        _BUILT[key] = (model, draft)
    return copy.deepcopy(_BUILT[key])


def _alone(model, prompts, max_new, stops=()):
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX)
    return [ARDecoder(runner).generate(p, max_new, stops) for p in prompts]


@pytest.mark.parametrize("concurrency", [1, 2, 3, 8])
def test_every_row_is_its_prompt_decoded_alone(concurrency):
    """Speculative (fixed and confidence-scheduled) and AR decoding of six prompts at each concurrency (8: more
    rows than requests): each request's tokens are its AR output decoded alone, its draft decisions cycle by cycle
    are the one-request reference engine's, and draft tokens are accepted and rejected."""
    model, draft = _setup()
    alone = _alone(model, PROMPTS, 30)
    ref_runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX)
    ref = [SpeculativeDecoder(ref_runner, draft, block_size=BLOCK).generate(p, 30) for p in PROMPTS]
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX, batch_size=concurrency)
    for engine in (StaticSpeculativeDecoder(runner, draft), StaticSpeculativeDecoder(runner, None),
                   StaticSpeculativeDecoder(runner, draft, proposal="confidence")):
        batch = engine.serve(PROMPTS, 30)
        assert [r.tokens for r in batch.results] == [a.tokens for a in alone]
        assert batch.concurrency == concurrency and batch.cycles > 0
        assert max(batch.active_rows) == min(concurrency, len(PROMPTS))
        if engine.draft is None:
            assert all(r.mean_accepted_length == 1.0 for r in batch.results)
            assert set(batch.verify_tokens) == {concurrency}
            continue
        if engine.proposal == "fixed":
            assert [r.accepted_per_cycle for r in batch.results] == [r.accepted_per_cycle for r in ref]
            assert set(batch.verify_tokens) == {concurrency * (BLOCK + 1)}
        merged = type(batch.results[0])(tokens=[], accepted_per_cycle=sum((r.accepted_per_cycle for r in
                                                                           batch.results), []),
                                        proposal_lengths=sum((r.proposal_lengths for r in batch.results), []))
        assert_partial_acceptance(merged, BLOCK)


def test_rows_refill_finish_apart_and_stop_at_the_cache_end():
    """Two rows, six requests with stop tokens: rows end at different cycles and take the next prompt; a request
    whose prompt nearly fills the cache stops where it ends (``max_len``) with AR's tokens up to there, and the
    rows beside it are unaffected."""
    model, draft = _setup()
    full = _alone(model, PROMPTS, 30)
    stops = (full[0].tokens[5], full[2].tokens[9])
    alone = _alone(model, PROMPTS, 30, stops)
    assert len({len(a.tokens) for a in alone}) > 2  # requests of different lengths
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX, batch_size=2)
    engine = StaticSpeculativeDecoder(runner, draft)
    batch = engine.serve(PROMPTS, 30, stops)
    assert [r.tokens for r in batch.results] == [a.tokens for a in alone]
    assert [r.stop_reason for r in batch.results] == [a.stop_reason for a in alone]
    assert batch.active_rows.count(2) > len(batch.active_rows) // 2  # both rows busy most of the run
    long = list(range(2, 16)) * 5 + [3]  # 71 tokens: 96 - 71 - reserve 5 = 20 tokens fit
    prompts = [PROMPTS[0], long, PROMPTS[2]]
    batch = engine.serve(prompts, 30)
    capped = batch.results[1]
    assert capped.stop_reason == "max_len" and len(capped.tokens) == 96 - len(long) - engine.reserve
    assert capped.tokens == _alone(model, [long], len(capped.tokens))[0].tokens
    assert [batch.results[i].tokens for i in (0, 2)] == [full[0].tokens, full[2].tokens]
    with pytest.raises(ValueError, match="request 1: .*max_len=96"):
        engine.serve(prompts, 30, strict=True)


@pytest.mark.parametrize("proposal", ["fixed", "confidence"])
def test_one_cycle_ahead_with_refills(monkeypatch, proposal):
    """Depth 2 (a cycle in flight while the host reads the last, what CUDA graphs run) on the CPU: requests that
    end while the next cycle is already queued hand their row on, and the queued cycle's tokens for the old request
    are dropped: the same outputs and cycle records as depth 1."""
    model, draft = _setup()
    full = _alone(model, PROMPTS, 30)
    stops = (full[0].tokens[5], full[2].tokens[9])
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX, batch_size=2)
    one = StaticSpeculativeDecoder(runner, draft, proposal=proposal).serve(PROMPTS, 30, stops)
    monkeypatch.setattr(StaticSpeculativeDecoder, "_depth", lambda self: 2)
    two = StaticSpeculativeDecoder(runner, draft, proposal=proposal).serve(PROMPTS, 30, stops)
    assert [r.tokens for r in two.results] == [r.tokens for r in one.results]
    assert [r.accepted_per_cycle for r in two.results] == [r.accepted_per_cycle for r in one.results]
    assert two.cycles >= one.cycles  # cycles launched for requests that had ended are read and dropped


@pytest.mark.parametrize("kind,over", [
    ("engram_markov", {"engram": EngramConfig(orders=(1, 2, 3), heads_per_order=2, table_rows=31,
                                              source="trainable")}),
    ("engram_mask_gated", {"engram": EngramConfig(orders=(1, 2, 3), heads_per_order=2, table_rows=31,
                                                  source="trainable")}),
    ("draft_memory", {"memory": MemoryConfig(online="chained")}),
    ("draft_memory", {"memory": MemoryConfig(online="first_stage")}),
    ("reranker", {"reranker": RerankerConfig(top_k=4, width=16, num_heads=2, ffn_size=32)}),
    ("baseline", {"markov_head": "none", "confidence_head": False}),  # dflash
])
def test_every_variant_runs_batched(kind, over):
    """Each variant at concurrency 3 (its per-row state: the Engram lookups over each row's own history, Draft
    Memory's last block per row, the reranker's prefix per row): every request's output is AR's alone and its
    accepted lengths, cycle by cycle, the one-request reference engine's."""
    model, draft = _setup(kind, **over)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name in ("engram_gate", "engram_v.weight") or name.startswith("engram_table"):
                p.copy_(torch.randn_like(p))
    prompts = PROMPTS[:5]
    alone = _alone(model, prompts, 24)
    ref_runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX)
    ref = [SpeculativeDecoder(ref_runner, draft, block_size=BLOCK).generate(p, 24) for p in prompts]
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX, batch_size=3)
    batch = StaticSpeculativeDecoder(runner, draft).serve(prompts, 24)
    assert [r.tokens for r in batch.results] == [a.tokens for a in alone]
    assert [r.accepted_per_cycle for r in batch.results] == [r.accepted_per_cycle for r in ref]
    assert any(sum(r.accepted_per_cycle) for r in batch.results)


def test_sampled_rows_are_distributed_as_the_target():
    """Sampling (T 0.8, top-p 0.95) at concurrency 4, fixed and confidence-scheduled proposals: tokens 1-3 of 400
    requests of one prompt follow the target's exact marginals (chi-square); cycles accept and reject."""
    model, draft = _setup()
    params = SamplingParams(temperature=0.8, top_p=0.95)
    marginals = exact_marginals(model, PROMPTS[0], params, 4)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX, batch_size=4)
    for proposal in ("fixed", "confidence"):
        engine = StaticSpeculativeDecoder(runner, draft, sampling=params, seed=3, proposal=proposal)
        batch = engine.serve([PROMPTS[0]] * 400, 4)
        accepted = [a for r in batch.results for a in r.accepted_per_cycle]
        assert 0 < sum(accepted) and min(accepted) == 0
        tokens = np.array([r.tokens[:4] for r in batch.results])  # [400, 4]
        for j in range(1, 4):
            assert chisquare_pvalue(tokens[:, j], marginals[j].numpy()) > 1e-3, (proposal, j)


def test_confidence_falls_back_to_ar_cycles_when_the_draft_does_not_pay():
    """``proposal: confidence`` with a draft too slow to earn its cost (an injected cost table: a draft 50 AR steps
    long, verify sizes flat): the engine runs AR cycles and proposes again only every PROBE_EVERY cycles; with a
    free draft it proposes every cycle. The outputs are AR's alone either way."""
    from dspark_core.decoding.static_engine import PROBE_EVERY

    model, draft = _setup()
    alone = _alone(model, PROMPTS, 30)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX, batch_size=2)
    for draft_s, mostly in ((50.0, False), (0.0, True)):
        engine = StaticSpeculativeDecoder(runner, draft, proposal="confidence")
        engine.cost_s, engine.draft_cost_s = {t: 1.0 for t in engine.sizes}, draft_s
        batch = engine.serve(PROMPTS, 30)
        assert [r.tokens for r in batch.results] == [a.tokens for a in alone]
        if mostly:
            assert all(batch.proposed)
        else:
            assert 1 <= sum(batch.proposed) <= 1 + len(batch.proposed) // PROBE_EVERY
            assert all(t == 2 for t, p in zip(batch.verify_tokens, batch.proposed) if not p)


def test_confidence_schedule_against_brute_force():
    """For random gains and a cost table, the schedule's step and counts reach the best expected tokens per second
    over every choice of per-row counts (each row a prefix of its block) at every step size."""
    rng = np.random.default_rng(0)
    rows, s = 3, 3
    sizes = [rows * (j + 1) for j in range(s + 1)]
    for trial in range(30):
        conf = rng.uniform(0.05, 1.0, (rows, s))
        gains = np.cumprod(conf, axis=1)
        active = rng.uniform(size=rows) < 0.8
        cost = {t: 1.0 + rng.uniform(0, 0.3) * t for t in sizes}
        draft_s = rng.uniform(0, 1.0)
        plan = schedule_by_confidence(gains, active, sizes, cost, draft_s)
        best = 0.0
        for counts in itertools.product(range(s + 1), repeat=rows):
            total = rows + sum(counts)
            size = min((t for t in sizes if t >= total), default=None)
            if size is None:
                continue
            got = active.sum() + sum(gains[r, :k].sum() for r, k in enumerate(counts) if active[r])
            best = max(best, got / (draft_s + cost[size]))
        assert plan.expected / (draft_s + cost[plan.total]) == pytest.approx(best)
        assert rows + plan.counts.sum() <= plan.total
        assert all(plan.counts[r] == 0 for r in range(rows) if not active[r])
    flat = {t: 1.0 for t in sizes}  # verifying more costs nothing: every active row verifies its whole block
    plan = schedule_by_confidence(gains, np.ones(rows, bool), sizes, flat, 0.1)
    assert plan.total == sizes[-1] and list(plan.counts) == [s] * rows
    plan = schedule_by_confidence(gains, np.ones(rows, bool), sizes, flat, 0.1, budget=rows * 2)
    assert plan.total == rows * 2 and plan.counts.sum() == rows


def test_token_layout_against_a_loop():
    counts = torch.tensor([3, 1, 4, 2])
    rows, cols = token_layout(counts, 12)
    expect = [(r, c) for r, n in enumerate(counts.tolist()) for c in range(n)]
    expect += [(0, 0)] * (12 - len(expect))  # padding repeats token 0's place
    assert list(zip(rows.tolist(), cols.tolist())) == expect


def test_batched_engine_refusals():
    model, draft = _setup()
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX, batch_size=2)
    with pytest.raises(ValueError, match="draft trees run on one row.*concurrency 2"):
        StaticSpeculativeDecoder(runner, draft, tree_branches=((1, 1),))
    with pytest.raises(ValueError, match="AR decoding .* takes no"):
        StaticSpeculativeDecoder(runner, None, proposal="confidence")
    with pytest.raises(ValueError, match="verify_budget 1 is below the concurrency 2"):
        StaticSpeculativeDecoder(runner, draft, proposal="confidence", verify_budget=1)
    with pytest.raises(ValueError, match="use serve"):
        StaticSpeculativeDecoder(runner, draft).generate(PROMPTS[0], 4)
    with pytest.raises(ValueError, match="proposal must be one of fixed, confidence"):
        StaticSpeculativeDecoder(runner, draft, proposal="adaptive")


@pytest.mark.skipif(not triton_ok(DEVICE), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
def test_a_step_of_rows_on_the_triton_kernels(untuned_kernels):
    """One step of three request rows on the Triton decode kernels (the interpreter on CPU): each token's logits
    and K/V are those of a one-row step of its own request (bit for bit on a GPU in bf16; within float32 rounding
    under the interpreter, whose dots are not row-independent), and the torch step of the same rows agrees."""
    model, _ = _setup()
    exact = CUDA
    if CUDA:
        model = model.to(torch.bfloat16)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    rows = TargetRunner(model, max_len=32, aux_layer_ids=AUX, batch_size=3, kernels=True)
    torch_rows = TargetRunner(model, max_len=32, aux_layer_ids=AUX, batch_size=3)
    singles = [TargetRunner(model, max_len=32, aux_layer_ids=AUX, kernels=True) for _ in prompts]
    ids, row, pos, col = [], [], [], []
    for r, prompt in enumerate(prompts):
        for runner in (rows, torch_rows):
            runner.prefill_row(r, torch.tensor([prompt[:-2]], device=DEVICE))
        singles[r].prefill_row(0, torch.tensor([prompt[:-2]], device=DEVICE))
        for c in range(2):  # the prompt's last two tokens, as a verify step would give them
            ids.append(prompt[-2 + c]), row.append(r), pos.append(len(prompt) - 2 + c), col.append(c)
    t = [torch.tensor(v, device=DEVICE) for v in (ids, row, pos, col)]
    logits, aux = rows.step_rows(*t, 2)  # [6, V], [6, K, H]
    ref_logits, ref_aux = torch_rows.step_rows(*t, 2)
    gap = (logits.float() - ref_logits.float()).norm() / ref_logits.float().norm()  # two paths: their rounding only
    assert gap < (3e-2 if exact else 1e-5), gap  # bf16: ~1e-2 after a few layers
    for r, single in enumerate(singles):
        mine = slice(2 * r, 2 * r + 2)
        one_logits, one_aux = single.step_rows(t[0][mine], torch.zeros(2, dtype=torch.long, device=DEVICE),
                                               t[2][mine], t[3][mine], 2)
        tol = dict(atol=0, rtol=0) if exact else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[mine], one_logits, **tol)
        torch.testing.assert_close(aux[mine], one_aux, **tol)
        torch.testing.assert_close(rows.k_cache[:, r, :, : pos[2 * r + 1] + 1],
                                   single.k_cache[:, 0, :, : pos[2 * r + 1] + 1], **tol)


@pytest.mark.skipif(not CUDA, reason="the decode kernels in bf16 on a GPU (the interpreter is too slow for decoding)")
def test_rows_on_the_triton_kernels_match_one_row(untuned_kernels):
    """Concurrency 3 on the Triton decode kernels in bf16: every request's tokens are its AR output alone on the
    same kernels (the engine's AR at concurrency 1), speculative and AR."""
    model, draft = _setup()
    model, draft = model.to(torch.bfloat16), draft.to(torch.bfloat16)
    one = TargetRunner(model, max_len=96, aux_layer_ids=AUX, kernels=True, cuda_graph=True)
    alone = StaticSpeculativeDecoder(one, None).serve(PROMPTS, 30).results
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX, batch_size=3, kernels=True, cuda_graph=True)
    for d in (draft, None):
        batch = StaticSpeculativeDecoder(runner, d).serve(PROMPTS, 30)
        assert [r.tokens for r in batch.results] == [a.tokens for a in alone]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("proposal", ["fixed", "confidence"])
def test_rows_cuda_graphs_match_ar(proposal):
    """The rows path captured in CUDA graphs (float32: the torch products of one row and of many round alike)."""
    model, draft = _setup()
    alone = _alone(model, PROMPTS, 30)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=AUX, batch_size=3, cuda_graph=True)
    engine = StaticSpeculativeDecoder(runner, draft, proposal=proposal)
    for _ in range(2):  # captured on the first call, replayed on the second
        batch = engine.serve(PROMPTS, 30)
        assert [r.tokens for r in batch.results] == [a.tokens for a in alone]
