"""The static (device-side, graph-capturable) speculative engine against the references: the target's greedy
AR output, the reference engine's cycles (same accepted lengths and proposal lengths), the reference draft's
block states and context K/V, and the Triton Markov slot against its torch path.

CPU: the cycle runs eagerly (the code a CUDA graph captures); the ``kernels`` cases run the Triton draft and
target kernels under Triton's interpreter. The CUDA-graph case runs on a GPU only."""

from __future__ import annotations

import dataclasses
import os
import statistics

import pytest
import torch

from _decoding_utils import (assert_partial_acceptance, chisquare_pvalue, exact_marginals, fit_draft_to_target,
                             greedy_continuations)
from _decoding_utils import one_thread, untuned_kernels  # noqa: F401 (fixtures)
from dspark_core.draft import DraftConfig, DSparkDraft
from dspark_core.decoding.ar import ARDecoder
from dspark_core.decoding.engine import SpeculativeDecoder
from dspark_core.decoding.sampling import SamplingParams
from dspark_core.decoding.static_draft import StaticDraft
from dspark_core.decoding.static_engine import StaticSpeculativeDecoder
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.decoding.tree import TreeLayout
from dspark_core.testing import tiny_model

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from dspark_core.kernels import triton_ok  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "untuned_kernels")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BLOCK = 4
MAX_NEW = 40
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
FIT_STEPS = 50  # training steps of the drafts of the identity tests: partly right (1 < MAL < BLOCK + 1)
needs_triton = pytest.mark.skipif(not triton_ok(DEVICE), reason="needs Triton on CUDA or TRITON_INTERPRET=1")


_BUILT: dict[str, tuple] = {}


def _setup(family: str, block: int = BLOCK, seed: int = 0, vocab: int = 16, layers: int = 6, aux=(0, 2, 4),
           fit=None, steps: int = FIT_STEPS, markov_head: str = "vanilla",
           draft_vocab: tuple[int, ...] | None = None):
    """:func:`_build`'s target and draft, built (and fitted) once per module for each set of arguments; every
    call gets its own deep copy (the draft's tied weights still the target's), so a test may cast or patch it,
    and torch's global RNG as a fresh build leaves it (tests that draw from it see the same numbers either way)."""
    import copy

    key = repr((family, block, seed, vocab, layers, aux, fit, steps, markov_head, draft_vocab))
    if key not in _BUILT:
        built = _build(family, block, seed, vocab, layers, aux, fit, steps, markov_head, draft_vocab)
        _BUILT[key] = (built, torch.get_rng_state())
    built, rng = _BUILT[key]
    torch.set_rng_state(rng)
    return copy.deepcopy(built)


def _build(family: str, block: int, seed: int, vocab: int, layers: int, aux, fit, steps: int, markov_head: str,
           draft_vocab: tuple[int, ...] | None):
    """A target with a 16-token vocabulary and a 2-layer DSpark draft: random, or with ``fit=(prompts,
    max_new_tokens)`` trained ``steps`` steps on the target's own greedy continuations of those prompts, so it is
    right part of the time (a random draft almost never is: the identity tests would not exercise acceptance).
    ``draft_vocab``: the draft predicts over these target ids only (``draft.vocab_size``)."""
    model = tiny_model(family, vocab_size=vocab, eos_token_id=None, pad_token_id=None,
                       num_hidden_layers=layers).to(DEVICE)
    torch.manual_seed(seed)
    cfg = DraftConfig(num_draft_layers=2, block_size=block, mask_token_id=None, num_anchors=4, markov_rank=8,
                      markov_head=markov_head, vocab_size=None if draft_vocab is None else len(draft_vocab))
    draft = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                        aux_layer_ids=aux).to(DEVICE).eval()
    if draft_vocab is not None:
        draft.draft_vocab.set_ids(torch.tensor(draft_vocab))
    if fit is not None:
        prompts, max_new = fit
        fit_draft_to_target(draft, model, prompts, greedy_continuations(model, prompts, max_new), steps, seed=seed)
    return model, draft


def _median_confidence(draft, runner, prompt, max_new: int) -> float:
    """The median slot-0 confidence of the draft's proposals in a reference-engine run with no cut: as a
    threshold it cuts about half the blocks to nothing, whatever the (trained) confidence head's scale."""
    seen, inner = [], draft.propose

    def spy(*args, **kwargs):
        prop = inner(*args, **kwargs)
        seen.append(float(prop.confidence[0, 0]))
        return prop

    draft.propose = spy
    try:
        SpeculativeDecoder(runner, draft, block_size=BLOCK).generate(prompt, max_new)
    finally:
        del draft.propose
    return statistics.median(seen)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("cut", [False, True])
def test_static_matches_ar_and_reference_engine(family, cut):
    model, draft = _setup(family, fit=([PROMPT], MAX_NEW))
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    threshold = _median_confidence(draft, runner, PROMPT, MAX_NEW) if cut else 0.0
    ar = ARDecoder(runner).generate(PROMPT, MAX_NEW)
    ref = SpeculativeDecoder(runner, draft, block_size=BLOCK, confidence_threshold=threshold).generate(PROMPT, MAX_NEW)
    static = StaticSpeculativeDecoder(runner, draft, confidence_threshold=threshold, time_every=3)
    res = static.generate(PROMPT, MAX_NEW)
    assert res.tokens == ar.tokens == ref.tokens
    assert res.accepted_per_cycle == ref.accepted_per_cycle  # the same draft decisions, cycle by cycle
    assert res.proposal_lengths == ref.proposal_lengths
    assert len(res.draft_s) == len(res.verify_s) == -(-res.cycles // 3)
    assert runner.length == len(PROMPT) + len(res.tokens) - 1
    assert_partial_acceptance(res, BLOCK)  # 1 < MAL < BLOCK + 1, some cycle rolled back
    if threshold > 0:  # the cut happens, and not always at slot 0
        assert min(res.proposal_lengths) < BLOCK and max(res.proposal_lengths) > 0
    else:
        assert 0 < sum(res.accepted_per_cycle) and min(res.accepted_per_cycle) < BLOCK  # partial acceptances


def test_static_matches_ar_and_reference_engine_with_a_reduced_draft_vocabulary():
    """A draft over 4 of the 16 tokens (those the target's greedy output uses most; it uses 6), fitted
    to it: the static engine (torch draft path) gives AR's output and the reference engine's decisions, cycle by
    cycle."""
    model, _ = _setup("qwen3")
    ar_tokens = ARDecoder(TargetRunner(model, max_len=96, aux_layer_ids=(0, 2, 4))).generate(PROMPT, MAX_NEW).tokens
    vocab = tuple(sorted(sorted(range(16), key=lambda t: (-ar_tokens.count(t), t))[:4]))
    model, draft = _setup("qwen3", fit=([PROMPT], MAX_NEW), draft_vocab=vocab)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    ref = SpeculativeDecoder(runner, draft, block_size=BLOCK).generate(PROMPT, MAX_NEW)
    static = StaticSpeculativeDecoder(runner, draft)
    assert not static.static.kernels
    res = static.generate(PROMPT, MAX_NEW)
    assert res.tokens == ar_tokens == ref.tokens and not set(ar_tokens) <= set(vocab)
    assert res.accepted_per_cycle == ref.accepted_per_cycle and sum(res.accepted_per_cycle) > 0


@pytest.mark.parametrize("markov_head", ["gated", "rnn"])
def test_markov_head_types_match_ar_in_every_engine(markov_head):
    """Greedy output == the target's AR output for a gated / rnn Markov head, in the reference engine and the
    static one (chain and tree: the rnn state follows each node's path), with the same cycles; the chain
    accepts part of the time (1 < MAL < BLOCK + 1)."""
    model, draft = _setup("qwen3", fit=([PROMPT], MAX_NEW), markov_head=markov_head)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    ar = ARDecoder(runner).generate(PROMPT, MAX_NEW)
    branches = ((1, 2), (2, 1))
    ref = SpeculativeDecoder(runner, draft, block_size=BLOCK).generate(PROMPT, MAX_NEW)
    static = StaticSpeculativeDecoder(runner, draft).generate(PROMPT, MAX_NEW)
    ref_tree = SpeculativeDecoder(runner, draft, block_size=BLOCK, tree_branches=branches).generate(PROMPT, MAX_NEW)
    static_tree = StaticSpeculativeDecoder(runner, draft, tree_branches=branches).generate(PROMPT, MAX_NEW)
    assert ref.tokens == static.tokens == ref_tree.tokens == static_tree.tokens == ar.tokens
    assert static.accepted_per_cycle == ref.accepted_per_cycle
    assert static_tree.accepted_per_cycle == ref_tree.accepted_per_cycle
    assert_partial_acceptance(static, BLOCK)


@pytest.mark.parametrize("cut", [False, True])
def test_static_sampling_matches_the_targets_distribution(cut):
    """Sampling (T 0.8, top-p 0.95) along a chain, on the device: tokens 1-3 of the static engine's outputs are
    distributed as the target's own (chi-square against the exact marginals, enumerated); some cycles accept
    draft tokens, some reject. With the confidence cut too (rows past it must not count)."""
    model, draft = _setup("qwen3", fit=([PROMPT], MAX_NEW))
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    threshold = _median_confidence(draft, runner, PROMPT, MAX_NEW) if cut else 0.0
    runs = _check_sampled_distribution(runner, draft, exact=model, confidence_threshold=threshold)
    if cut:
        assert min(r for run in runs for r in run.proposal_lengths) < BLOCK


def _check_sampled_distribution(runner, draft, exact=None, new: int = 4, params=None, **kw):
    """Output tokens 1..new-1 of the static engine (sampling) against the target's distribution.

    ``exact`` (the target, float32): a one-sample chi-square of 400 engine outputs against its exact marginals
    (:func:`exact_marginals`) -- the power of a two-sample test of 800 engine vs 800 AR outputs (noncentrality
    n1 n2 / (n1 + n2) = 400 times the same divergence) at a quarter of the generations. Else (bf16, where only the
    runner's own rounding is the reference): a two-sample chi-square of 800 engine outputs vs 800 AR outputs
    sampled on ``runner``."""
    from scipy.stats import chi2_contingency

    params = params or SamplingParams(temperature=0.8, top_p=0.95)
    static = StaticSpeculativeDecoder(runner, draft, sampling=params, seed=1, **kw)
    spec_runs = [static.generate(PROMPT, new) for _ in range(400 if exact is not None else 800)]
    accepted = [a for r in spec_runs for a in r.accepted_per_cycle]
    assert 0 < sum(accepted) and min(accepted) == 0  # acceptances and rejections
    spec = torch.tensor([r.tokens[:new] for r in spec_runs])  # [n, new]
    if exact is not None:
        marginals = exact_marginals(exact, PROMPT, params, new)
        for j in range(1, new):
            assert chisquare_pvalue(spec[:, j].numpy(), marginals[j].numpy()) > 1e-3, j
        return spec_runs
    ar = ARDecoder(runner, sampling=params, seed=2)
    ar_tokens = torch.tensor([ar.generate(PROMPT, new).tokens[:new] for _ in range(800)])  # [800, new]
    for j in range(1, new):
        table = torch.stack([torch.bincount(s[:, j], minlength=runner.vocab_size) for s in (spec, ar_tokens)])
        keep = table.sum(0) >= 10  # pool the rare cells
        pooled = torch.cat([table[:, keep], table[:, ~keep].sum(1, keepdim=True)], dim=1)
        pooled = pooled[:, pooled.sum(0) > 0]
        assert chi2_contingency(pooled.numpy())[1] > 1e-3, (j, pooled)
    return spec_runs


def test_static_stops_and_repeated_use():
    """Stop tokens end the output where AR's ends; a second prompt on the same engine starts clean."""
    model, draft = _setup("qwen3", fit=([PROMPT, [7, 7, 2]], MAX_NEW))
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    static = StaticSpeculativeDecoder(runner, draft)
    full = ARDecoder(runner).generate(PROMPT, MAX_NEW).tokens
    stop = full[len(full) // 2]
    for prompt in (PROMPT, [7, 7, 2], PROMPT):
        for stops in ((), (stop,)):
            ar = ARDecoder(runner).generate(prompt, MAX_NEW, stops)
            res = static.generate(prompt, MAX_NEW, stops)
            assert res.tokens == ar.tokens and res.stop_reason == ar.stop_reason
            assert_partial_acceptance(res, BLOCK)


def test_static_draft_matches_reference_draft():
    """Block states of the static block (all M cached positions under a mask) == forward_block over the live
    context; context K/V written by ``extend`` == ``extend_context``."""
    model, draft = _setup("qwen3", block=5)
    aux = torch.randn(1, 11, 3, model.config.hidden_size, device=DEVICE)
    ref_cache = draft.new_context_cache(batch=1, max_len=40)
    draft.extend_context(ref_cache, aux)
    static = StaticDraft(draft, max_len=40)
    static.extend(aux[:, :6], torch.arange(6, device=DEVICE))
    static.extend(aux[:, 6:], torch.arange(6, 11, device=DEVICE))
    torch.testing.assert_close(static.k[:, :, :, :11], ref_cache.k[:, :, :, :11])
    torch.testing.assert_close(static.v[:, :, :, :11], ref_cache.v[:, :, :, :11])
    anchor = torch.tensor([3], device=DEVICE)
    ref_h = draft.forward_block(ref_cache, anchor)[0]  # [S, H]
    tokens, h = static.propose(anchor, torch.tensor([11], device=DEVICE))
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    ref = draft.propose(ref_cache, anchor, lambda logits: (logits.argmax(-1), logits))
    assert tokens.tolist() == ref.tokens[0].tolist()


@needs_triton
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_static_kernels_match_ar(family):
    """Triton target and draft kernels (interpreter on CPU): output identical to the Triton AR decoder, the
    same cycles as the reference engine on the eager path."""
    model, draft = _setup(family, layers=3, aux=(0, 1), fit=([PROMPT], MAX_NEW))  # small: the interpreter is slow
    runner = TargetRunner(model, max_len=48, aux_layer_ids=draft.aux_layer_ids, kernels=True)
    ar = ARDecoder(runner).generate(PROMPT, 14)
    static = StaticSpeculativeDecoder(runner, draft, kernels=True)
    res = static.generate(PROMPT, 14)
    assert res.tokens == ar.tokens
    eager = TargetRunner(model, max_len=48, aux_layer_ids=draft.aux_layer_ids)
    ref = SpeculativeDecoder(eager, draft, block_size=BLOCK).generate(PROMPT, 14)
    assert res.accepted_per_cycle == ref.accepted_per_cycle
    assert sum(res.accepted_per_cycle) > 0
    assert_partial_acceptance(res, BLOCK)


@needs_triton
def test_static_kernels_with_an_rnn_markov_head_match_ar():
    """The Triton draft block with a Markov head the slot kernels do not compute (rnn: its torch slots read the
    block's states): AR's output and the eager reference engine's cycles."""
    model, draft = _setup("qwen3", layers=3, aux=(0, 1), fit=([PROMPT], MAX_NEW), markov_head="rnn")
    runner = TargetRunner(model, max_len=48, aux_layer_ids=draft.aux_layer_ids, kernels=True)
    ar = ARDecoder(runner).generate(PROMPT, 14)
    res = StaticSpeculativeDecoder(runner, draft, kernels=True).generate(PROMPT, 14)
    assert res.tokens == ar.tokens
    eager = TargetRunner(model, max_len=48, aux_layer_ids=draft.aux_layer_ids)
    assert res.accepted_per_cycle == SpeculativeDecoder(eager, draft, block_size=BLOCK).generate(PROMPT, 14
                                                                                                ).accepted_per_cycle
    assert_partial_acceptance(res, BLOCK)


@needs_triton
def test_static_sampling_kernels_match_torch_ops(monkeypatch):
    """The sampling cycle with the Triton draft and target at a plain temperature: the one-launch sampled slots
    (``MarkovSampler``) and the two-launch accept step (``SampledAccept``) give the outputs and cycles of the torch
    ops (``logits_to_probs`` + ``race_sample`` per slot, ``rejection_step``) on the same seeded draws."""
    import dspark_core.decoding.static_draft as static_draft
    import dspark_core.decoding.static_engine as static_engine

    model, draft = _setup("qwen3", layers=3, aux=(0, 1), fit=([PROMPT], MAX_NEW))
    runner = TargetRunner(model, max_len=48, aux_layer_ids=draft.aux_layer_ids, kernels=True)
    params = SamplingParams(temperature=0.8)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(static_draft, "SAMPLE_KERNEL", on)
        monkeypatch.setattr(static_engine, "REJECT_KERNEL", on)
        engine = StaticSpeculativeDecoder(runner, draft, kernels=True, sampling=params, seed=5)
        assert (engine._sampled_accept is not None) == on
        assert engine.static._sample_kernel_applies(params) == on
        results[on] = [engine.generate(PROMPT, 12)]
    for got, want in zip(results[True], results[False]):
        assert got.tokens == want.tokens and got.accepted_per_cycle == want.accepted_per_cycle
    assert_partial_acceptance(results[True][0], BLOCK)  # draft tokens accepted, and rejections


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,rank", [(16, 8), (256, 5), (300, 24), (1000, 256)])
def test_markov_kernel_matches_torch(vocab, rank, dtype):
    """One launch per slot: random slots, then 12 slots chained through one token buffer (slot i's prev is
    slot i-1's out, the same object each time: the arrival counter must be back to 0 after every launch)."""
    from dspark_core.kernels.markov import MarkovArgmax, markov_slot_reference

    gen = torch.Generator().manual_seed(vocab)
    w1, w2 = _markov_weights(vocab, rank, dtype, gen)
    base = (3 * torch.randn(vocab, generator=gen)).to(DEVICE)  # [V] float32
    kernel = MarkovArgmax(w1, w2)
    out = torch.full((2,), -1, dtype=torch.long, device=DEVICE)
    for prev in (0, vocab // 2, vocab - 1):
        prev_t = torch.tensor([prev], device=DEVICE)
        kernel(base, prev_t, out[1:])
        assert out[1].item() == markov_slot_reference(base, w1, w2, prev_t).item()
    slots = 12
    bases = (3 * torch.randn(slots, vocab, generator=gen)).to(DEVICE)  # [n, V] float32
    tokens = torch.full((slots + 1,), -1, dtype=torch.long, device=DEVICE)  # [n + 1]; tokens[0]: the anchor
    tokens[0] = vocab // 3
    for i in range(slots):
        kernel(bases[i], tokens[i:i + 1], tokens[i + 1:i + 2])
    want = [vocab // 3]
    for i in range(slots):
        want.append(markov_slot_reference(bases[i], w1, w2, torch.tensor([want[-1]], device=DEVICE)).item())
    assert tokens.tolist() == want
    assert kernel.arrived.item() == 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [16, 300, 1000])
def test_markov_kernel_ties_go_to_lowest_id(vocab, dtype):
    """Exact ties planted in several row tiles (and twice in one tile): the lowest token id wins, as
    ``torch.argmax``. The tied rows of W2 are zero, so their bias is exactly 0 in both paths."""
    from dspark_core.kernels.markov import BLOCK_V, MarkovArgmax, markov_slot_reference

    gen = torch.Generator().manual_seed(vocab + 1)
    rank = 16
    w1 = torch.randn(vocab, rank, generator=gen).to(DEVICE, dtype)  # [V, r]
    w2 = (torch.randn(vocab, rank, generator=gen) / rank ** 0.5).to(DEVICE, dtype)  # [V, r]; bias |.| < ~5
    base = (torch.randn(vocab, generator=gen) - 100).to(DEVICE)  # [V] far below the planted maxima
    kernel_zero = MarkovArgmax(w1, torch.zeros_like(w2))
    out = torch.full((1,), -1, dtype=torch.long, device=DEVICE)
    kernel_zero(torch.zeros(vocab, device=DEVICE), torch.tensor([0], device=DEVICE), out)  # all tied
    assert out.item() == 0
    tied = sorted({vocab - 1, vocab // 2, vocab // 2 + 1, min(BLOCK_V + 7, vocab - 2)})  # not tile 0's first row
    for drop in range(len(tied)):  # the winner moves to later tiles as the lower tied ids are dropped
        ids = torch.tensor(tied[drop:], device=DEVICE)
        w2t, bt = w2.clone(), base.clone()
        w2t[ids] = 0
        bt[ids] = 7.0
        kernel = MarkovArgmax(w1, w2t)
        for prev in (0, vocab - 1):
            prev_t = torch.tensor([prev], device=DEVICE)
            out.fill_(-1)
            kernel(bt, prev_t, out)
            assert out.item() == tied[drop] == markov_slot_reference(bt, w1, w2t, prev_t).item()
        assert kernel.arrived.item() == 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,rank", [(16, 8), (300, 24), (1000, 256)])
def test_markov_sample_kernel_matches_torch(vocab, rank, dtype):
    """The sampled slot (one launch) + normalisation against the torch path of ``propose_sampled``: the same token
    as ``race_sample(logits_to_probs(...))`` on the same U draws (that function is checked to draw from its
    probabilities in test_decoding_sampling.py), q equal to float32 rounding, slots chained through one token
    buffer, the arrival counter back to 0 after each launch."""
    from dspark_core.decoding.sampling import SamplingParams, logits_to_probs, race_sample
    from dspark_core.kernels.markov import MarkovSampler

    gen = torch.Generator().manual_seed(vocab + rank)
    w1, w2 = _markov_weights(vocab, rank, dtype, gen)
    sampler = MarkovSampler(w1, w2)
    slots = 6
    for temperature in (0.7, 1.3):
        bases = (3 * torch.randn(slots, vocab, generator=gen)).to(DEVICE)  # [n, V] float32
        race = torch.rand(slots, vocab, generator=gen).to(DEVICE)  # [n, V]
        q = torch.full((slots, vocab), float("nan"), device=DEVICE)  # [n, V]
        stats = torch.zeros(slots, 2, device=DEVICE)
        tokens = torch.full((slots + 1,), -1, dtype=torch.long, device=DEVICE)  # tokens[0]: the anchor
        tokens[0] = vocab // 3
        for i in range(slots):
            sampler.sample(bases[i], tokens[i:i + 1], race[i], q[i], tokens[i + 1:i + 2], stats[i], temperature)
            assert sampler.sample_lock.item() == 0
        sampler.normalize(q, stats)
        prev, params = vocab // 3, SamplingParams(temperature=temperature)
        for i in range(slots):
            m = torch.nn.functional.embedding(torch.tensor([prev], device=DEVICE), w1)  # [1, r]
            logits = bases[i:i + 1] + torch.nn.functional.linear(m, w2).float()  # [1, V]
            want_q = logits_to_probs(logits, params)[0]  # [V]
            torch.testing.assert_close(q[i], want_q, rtol=1e-5, atol=1e-7)
            prev = race_sample(want_q, race[i]).item()
            assert tokens[i + 1].item() == prev, (temperature, i)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampler.sample(bases[0], tokens[:1], race[0], q[0], tokens[1:2], stats[0], 0.0)


@needs_triton
def test_static_sampled_slots_kernel_matches_torch_path(monkeypatch):
    """``StaticDraft.propose_sampled`` with the Triton draft: the one-launch sampled slots give the torch slots'
    tokens and q on the same draws (the kernel applies to a plain temperature only: top-p keeps the torch path)."""
    import dspark_core.decoding.static_draft as static_draft

    model, draft = _setup("qwen3", layers=3, aux=(0, 1), vocab=300)
    static = StaticDraft(draft, max_len=32, kernels=True)
    aux = torch.randn(1, 9, 2, model.config.hidden_size, device=DEVICE)
    static.extend(aux, torch.arange(9, device=DEVICE))
    anchor, p = torch.tensor([5], device=DEVICE), torch.tensor([9], device=DEVICE)
    race = torch.rand(BLOCK, 300, generator=torch.Generator().manual_seed(3)).to(DEVICE)  # [S, V]
    runs = {}
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9)):
        for on in (True, False):
            monkeypatch.setattr(static_draft, "SAMPLE_KERNEL", on)
            assert static._sample_kernel_applies(params) == (on and params.top_p == 1.0)
            q = torch.zeros(BLOCK, 300, device=DEVICE)
            tokens, _ = static.propose_sampled(anchor, p, params, q, race, need_hidden=False)
            runs[params.top_p, on] = (tokens.clone(), q)
    torch.testing.assert_close(runs[1.0, True][1], runs[1.0, False][1], rtol=1e-5, atol=1e-7)
    assert runs[1.0, True][0].tolist() == runs[1.0, False][0].tolist()
    assert runs[0.9, True][0].tolist() == runs[0.9, False][0].tolist()
    assert not torch.equal(runs[1.0, True][1], runs[0.9, True][1])  # top-p was applied (by the torch slots)


@needs_triton
def test_markov_kernels_over_a_reduced_vocabulary_match_torch():
    """W2 and the base logits over Vd = 100 draft tokens of a 300-token target (W1 keeps the 300 rows): the greedy
    slot, a gated / rnn head's input u in place of W1[prev], the tree's top-2 rows and the sampled slot pick as
    the torch path does over the target vocabulary (draft logits scattered, -inf elsewhere; bias 0 there) and
    write target ids; q is the torch path's and exactly 0 outside the draft tokens."""
    from dspark_core.decoding.sampling import SamplingParams, logits_to_probs, race_sample
    from dspark_core.decoding.tree import top2_reference
    from dspark_core.kernels.markov import MarkovSampler

    gen = torch.Generator().manual_seed(11)
    vt, vd, rank, slots = 300, 100, 8, 4
    d2t = torch.randperm(vt, generator=gen)[:vd].sort().values.to(DEVICE)  # [Vd] ascending target ids
    w1, w2 = (torch.randn(vt, rank, generator=gen).to(DEVICE), torch.randn(vd, rank, generator=gen).to(DEVICE) / 3)
    sampler = MarkovSampler(w1, w2, d2t)

    def full(x, fill):  # [..., Vd] -> [..., Vt]: what the torch path sees
        out = x.new_full((*x.shape[:-1], vt), fill)
        out[..., d2t] = x
        return out

    bases = (3 * torch.randn(slots, vd, generator=gen)).to(DEVICE)  # [n, Vd] float32
    tok = torch.full((2,), -1, dtype=torch.long, device=DEVICE)
    for i, prev in enumerate((0, 7, vt - 1, int(d2t[5]))):
        u = torch.randn(rank, generator=gen).to(DEVICE)
        for m, features in ((w1[prev], None), (u, u)):  # vanilla (W1[prev] read by the kernel), then u given
            sampler(bases[i], torch.tensor([prev], device=DEVICE), tok[1:], features=features)
            want = (full(bases[i], float("-inf")) + full(w2 @ m, 0.0)).argmax()
            assert tok[1].item() == want.item() and want.item() in d2t.tolist()
    table = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32, device=DEVICE)
    buf = torch.tensor([3, -1, -1, int(d2t[0]), -1], device=DEVICE)
    sampler.rows(bases[0], buf, table)
    logits = full(bases[0], float("-inf")) + full(w1[buf[[0, 3]]] @ w2.T, 0.0)  # [2, Vt]
    first, second = top2_reference(logits[:1])
    assert buf.tolist() == [3, first.item(), second.item(), int(d2t[0]), logits[1].argmax().item()]
    race = torch.rand(slots, vt, generator=gen).to(DEVICE)  # [n, Vt] U draws over the target vocabulary
    q_draft = torch.full((slots, vd), float("nan"), device=DEVICE)
    q = torch.full((slots, vt), float("nan"), device=DEVICE)
    stats = torch.zeros(slots, 2, device=DEVICE)
    tokens = torch.full((slots + 1,), -1, dtype=torch.long, device=DEVICE)
    tokens[0] = 2
    for i in range(slots):
        sampler.sample(bases[i], tokens[i:i + 1], race[i], q_draft[i], tokens[i + 1:i + 2], stats[i], 0.7)
    sampler.normalize(q, stats, src=q_draft)
    prev = 2
    for i in range(slots):
        want_q = logits_to_probs(full(bases[i], float("-inf")) + full(w2 @ w1[prev], 0.0), SamplingParams(0.7))
        torch.testing.assert_close(q[i], want_q, rtol=1e-5, atol=1e-7)
        assert q[i][full(torch.zeros(vd, device=DEVICE), 1.0) == 1.0].eq(0).all()  # q = 0 outside, not NaN
        prev = race_sample(want_q, race[i]).item()
        assert tokens[i + 1].item() == prev
    with pytest.raises(ValueError, match="give d2t"):
        MarkovSampler(w1, w2)
    with pytest.raises(ValueError, match="needs src"):
        sampler.normalize(q, stats)


@needs_triton
@pytest.mark.parametrize("markov_head", ["vanilla", "gated", "rnn", "none"])
def test_static_draft_kernels_with_a_reduced_vocabulary_match_torch_path(markov_head):
    """``StaticDraft(kernels=True)`` over 40 draft tokens of a 300-token target, each Markov head type: the greedy
    chain, a tree and a sampled block (plain temperature: the one-launch slots) give the torch path's tokens
    (target ids inside the draft vocabulary), block logits within float32 rounding, and its q, 0 outside."""
    gen = torch.Generator().manual_seed(4)
    ids = tuple(torch.randperm(300, generator=gen)[:40].sort().values.tolist())
    model, draft = _setup("qwen3", layers=3, aux=(0, 1), vocab=300, markov_head=markov_head, draft_vocab=ids)
    paths = {on: StaticDraft(draft, max_len=32, kernels=on) for on in (False, True)}
    aux = torch.randn(1, 9, 2, model.config.hidden_size, generator=gen).to(DEVICE)
    anchor, p = torch.tensor([5], device=DEVICE), torch.tensor([9], device=DEVICE)
    race = torch.rand(BLOCK, 300, generator=gen).to(DEVICE)  # [S, V]
    layout = TreeLayout(BLOCK, ((1, 2), (2, 1)))
    runs = {}
    for on, static in paths.items():
        static.extend(aux, torch.arange(9, device=DEVICE))
        tokens, hidden = static.propose(anchor, p)
        tree = torch.zeros(layout.rows, dtype=torch.long, device=DEVICE)
        tree[0] = anchor
        static.propose_tree(anchor, p, layout, tree)
        q = torch.full((BLOCK, 300), float("nan"), device=DEVICE)
        sampled, _ = static.propose_sampled(anchor, p, SamplingParams(temperature=0.7), q, race)
        runs[on] = (tokens.tolist(), tree.tolist(), sampled.tolist(), q, hidden)
    assert runs[True][:3] == runs[False][:3]
    assert set(runs[True][0] + runs[True][1][1:] + runs[True][2]) <= set(ids)
    torch.testing.assert_close(runs[True][3], runs[False][3], rtol=1e-5, atol=1e-7)
    outside = torch.ones(300, dtype=torch.bool)
    outside[list(ids)] = False
    assert runs[True][3][:, outside.to(DEVICE)].eq(0).all()
    _, base = paths[True]._block_kernels(anchor, p, need_hidden=False)  # [S, Vd]
    torch.testing.assert_close(paths[True]._full(base), draft.slot_logits(runs[False][4]), rtol=1e-4, atol=1e-4)
    assert paths[True]._sample_kernel_applies(SamplingParams(temperature=0.7)) == (markov_head != "none")


@needs_triton
def test_static_kernels_with_a_reduced_draft_vocabulary_match_ar():
    """The Triton draft over 2 of the 16 tokens (those AR uses most), fitted to the target: greedy output == the
    Triton AR decoder's, with the eager reference engine's cycles (the sampled slots against the torch path:
    ``test_static_draft_kernels_with_a_reduced_vocabulary_match_torch_path``)."""
    model, _ = _setup("qwen3", layers=3, aux=(0, 1))
    ar_tokens = ARDecoder(TargetRunner(model, max_len=48, aux_layer_ids=(0, 1))).generate(PROMPT, 14).tokens
    vocab = tuple(sorted(sorted(range(16), key=lambda t: (-ar_tokens.count(t), t))[:2]))
    model, draft = _setup("qwen3", layers=3, aux=(0, 1), fit=([PROMPT], MAX_NEW), draft_vocab=vocab)
    runner = TargetRunner(model, max_len=48, aux_layer_ids=draft.aux_layer_ids, kernels=True)
    ar = ARDecoder(runner).generate(PROMPT, 14)
    static = StaticSpeculativeDecoder(runner, draft)
    assert static.static.kernels  # the target's choice: the draft's reduced vocabulary no longer refuses it
    res = static.generate(PROMPT, 14)
    assert res.tokens == ar.tokens and not set(ar.tokens) <= set(vocab)
    eager = TargetRunner(model, max_len=48, aux_layer_ids=draft.aux_layer_ids)
    assert res.accepted_per_cycle == SpeculativeDecoder(eager, draft, block_size=BLOCK).generate(PROMPT, 14
                                                                                                ).accepted_per_cycle
    assert sum(res.accepted_per_cycle) > 0


def _markov_weights(vocab: int, rank: int, dtype: torch.dtype, gen: torch.Generator):
    """Random W1, W2 [V, r]. bfloat16: on a grid (W1 in {-1, 0, 1}, W2 in {-3..3} / 8) where every bias
    W2 W1[prev] is an exact float32 sum and exact in bfloat16, so its rounding to bfloat16 is a no-op -- Triton's
    interpreter casts float32 -> bfloat16 by truncation, a GPU to nearest even: only then do both agree."""
    if dtype == torch.float32:
        w1 = torch.randn(vocab, rank, generator=gen)  # [V, r]
        w2 = torch.randn(vocab, rank, generator=gen) / rank ** 0.5  # [V, r]
        return w1.to(DEVICE), w2.to(DEVICE)
    w1 = torch.randint(-1, 2, (vocab, rank), generator=gen).double()  # [V, r]
    w2 = torch.randint(-3, 4, (vocab, rank), generator=gen).double() / 8  # [V, r]
    bias = w1 @ w2.T  # [V (prev), V] every bias the slots can see
    assert torch.equal(bias.to(dtype).double(), bias)
    return w1.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def test_static_refuses_what_it_cannot_do():
    model, draft = _setup("qwen3")
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    with pytest.raises(ValueError, match="verifies draft trees greedily.*temperature 0.8"):
        StaticSpeculativeDecoder(runner, draft, sampling=SamplingParams(temperature=0.8), tree_branches=((1, 1),))
    other = TargetRunner(model, max_len=96, aux_layer_ids=(0, 1))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        StaticSpeculativeDecoder(other, draft)

    class Variant(DSparkDraft):
        def score_candidates(self, logits, hidden, prefix, slot, extras):
            return logits

    variant = Variant(draft.cfg, model.config, model.get_input_embeddings().weight,
                      model.get_output_embeddings().weight, aux_layer_ids=(0, 2, 4))
    with pytest.raises(ValueError, match="draft trees run on one row with a baseline draft.*score_candidates"):
        StaticSpeculativeDecoder(runner, variant, tree_branches=((1, 1),))
    assert not StaticSpeculativeDecoder(runner, variant).single  # a variant's hooks run on the rows path
    with pytest.raises(ValueError, match="confidence head"):
        StaticSpeculativeDecoder(runner, DSparkDraft(dataclasses.replace(draft.cfg, confidence_head=False),
                                                     model.config, model.get_input_embeddings().weight,
                                                     model.get_output_embeddings().weight, aux_layer_ids=(0, 2, 4)),
                                 proposal="confidence")
    with pytest.raises(ValueError, match="max_len=96"):
        StaticSpeculativeDecoder(runner, draft).generate(list(range(10)) * 6, 40)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kernels", [False, True])
def test_static_cuda_graph_matches_ar(kernels):
    """bf16 with the batch-invariant Triton kernels (a verify step computes each token as the AR step does);
    float32 on the cuBLAS path, whose n = 1 and n = S+1 products may round differently in bf16."""
    model, draft = _setup("qwen3", vocab=64, fit=([PROMPT], 64))  # trained in float32, then cast
    if kernels:
        model, draft = model.to(torch.bfloat16), draft.to(torch.bfloat16)
    runner = TargetRunner(model, max_len=128, aux_layer_ids=draft.aux_layer_ids, cuda_graph=True, kernels=kernels)
    ar = ARDecoder(runner).generate(PROMPT, 64)
    static = StaticSpeculativeDecoder(runner, draft, cuda_graph=True)
    for _ in range(2):  # captured on the first call, replayed on the second
        res = static.generate(PROMPT, 64)
        assert res.tokens == ar.tokens
        assert_partial_acceptance(res, BLOCK)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kernels,top_p", [(False, 0.95), (True, 0.95), (True, 1.0)])
def test_static_cuda_graph_sampling_matches_the_targets_distribution(kernels, top_p, monkeypatch):
    """The sampling cycle captured in CUDA graphs (device RNG under capture): the same test as on CPU against
    the exact marginals in float32; in bf16 (kernels) a two-sample test against AR sampled on the same runner. top_p 1.0 with kernels: the one-launch sampled slots
    (``MarkovSampler``) and the Triton accept step (``SampledAccept``, the default; switched on here whatever
    ``static_engine.REJECT_KERNEL`` says); top_p 0.95 keeps the torch slots and accept step."""
    import dspark_core.decoding.static_engine as static_engine

    monkeypatch.setattr(static_engine, "REJECT_KERNEL", True)
    model, draft = _setup("qwen3", vocab=64, fit=([PROMPT], 64))  # the kernel shapes of the greedy graph test
    if kernels:
        model, draft = model.to(torch.bfloat16), draft.to(torch.bfloat16)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids, cuda_graph=True, kernels=kernels)
    _check_sampled_distribution(runner, draft, exact=None if kernels else model,
                                params=SamplingParams(temperature=0.8, top_p=top_p), cuda_graph=True)


def test_bench_online_engine_param():
    """``bench_online.engine``: auto = reference on CPU (and for sampling), static on request (sampling along a
    chain too, not with a tree), bad names refused."""
    from dspark_core.bench.online import BenchOnlineConfig, make_engine, resolve_engine

    model, draft = _setup("qwen3")
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7)
    cpu = torch.device("cpu")
    assert resolve_engine("auto", greedy, draft, cpu) == "reference"
    assert resolve_engine("auto", greedy, draft, torch.device("cuda")) == "static"
    assert resolve_engine("auto", sampled, draft, torch.device("cuda")) == "static"  # chain sampling: static
    assert resolve_engine("auto", sampled, draft, torch.device("cuda"), tree=True) == "reference"
    assert resolve_engine("static", sampled, draft, cpu) == "static"
    with pytest.raises(ValueError, match="bench_online.engine: static, but temperature 0.7 with tree_branches"):
        resolve_engine("static", sampled, draft, cpu, tree=True)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    engine = make_engine(resolve_engine("static", greedy, draft, cpu), runner, draft, BenchOnlineConfig())
    assert isinstance(engine, StaticSpeculativeDecoder) and engine.sampling is None
    hot = make_engine("static", runner, draft, BenchOnlineConfig(temperature=0.7))
    assert hot.sampling == sampled
    with pytest.raises(ValueError, match="engine"):
        BenchOnlineConfig.from_dict({"engine": "fast"}, src="params.yaml", prefix="bench_online.")
