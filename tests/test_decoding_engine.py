"""The speculative engine: greedy identity with AR, rollback bookkeeping, stops, and the sampled
distribution at the engine level. Drafts: the real (randomly initialised) DSparkDraft, and test doubles
of controlled quality that follow the same contract (tests/_fake_draft.py: the target's own greedy
continuation, a noisy one, an always-wrong one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _fake_draft import FakeDraft
from _decoding_utils import chisquare_pvalue, one_thread  # noqa: F401 (fixture)
from dspark_core.draft import DraftConfig, DSparkDraft
from dspark_core.decoding.ar import ARDecoder
from dspark_core.decoding.engine import SpeculativeDecoder
from dspark_core.decoding.sampling import SamplingParams, logits_to_probs
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.decoding.types import CycleInfo, cut_at_stop
from dspark_core.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

AUX = (-1, 1, 3)  # -1 lets the fake draft read the committed tokens back from the context
BLOCK = 4
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10]
MAX_NEW = 40


def _setup(family: str):
    model = tiny_model(family)
    runner = TargetRunner(model, max_len=128, aux_layer_ids=AUX)
    ar = ARDecoder(runner).generate(PROMPT, MAX_NEW)
    return model, runner, ar.tokens


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return _setup(request.param)


def _draft(model, **kwargs) -> FakeDraft:
    return FakeDraft(model, embed_weight=model.model.embed_tokens.weight, embed_aux_index=0, block_size=BLOCK,
                     **kwargs)


class RollbackChecker:
    """on_cycle hook: after every cycle both lengths equal the new anchor's position, and the draft's
    context holds exactly prompt + committed tokens minus the anchor (read back from its aux hidden)."""

    def __init__(self, draft: FakeDraft, first_token: int) -> None:
        self.draft = draft
        self.generated = [first_token]  # the prefill's token, then everything cycles commit
        self.partial_cycles = 0

    def __call__(self, info: CycleInfo) -> None:
        assert info.anchor_position == len(PROMPT) + len(self.generated) - 1
        assert info.target_length == info.draft_context_length == info.next_anchor_position
        assert info.next_anchor_position == info.anchor_position + info.num_accepted + 1
        assert len(info.committed) == info.num_accepted + 1 and 0 <= info.num_accepted <= info.num_proposed
        self.generated.extend(info.committed)
        assert self.draft.cache.tokens == PROMPT + self.generated[:-1]  # never a rejected token
        self.partial_cycles += info.num_accepted < info.num_proposed


@pytest.mark.parametrize("kind", ["oracle", "noisy", "wrong", "confidence"])
def test_greedy_identical_to_ar(target, kind):
    model, runner, ar_tokens = target
    draft = {"oracle": lambda: _draft(model), "noisy": lambda: _draft(model, noise=1.5, seed=3),
             "wrong": lambda: _draft(model, mode="wrong"),
             "confidence": lambda: _draft(model, noise=0.7, confidence="random")}[kind]()
    threshold = 0.2 if kind == "confidence" else 0.0
    checker = RollbackChecker(draft, ar_tokens[0])
    res = SpeculativeDecoder(runner, draft, block_size=BLOCK, confidence_threshold=threshold,
                             on_cycle=checker).generate(PROMPT, MAX_NEW)
    assert res.tokens == ar_tokens and checker.generated[:MAX_NEW] == ar_tokens
    assert res.cycles == len(res.accepted_per_cycle) == len(res.proposal_lengths) == len(res.draft_s)
    assert 1 + sum(a + 1 for a in res.accepted_per_cycle) >= MAX_NEW  # every committed token is counted
    mal = res.mean_accepted_length
    if kind == "oracle":
        assert res.accepted_per_cycle == [BLOCK] * res.cycles and mal == BLOCK + 1
    elif kind == "wrong":
        assert res.accepted_per_cycle == [0] * res.cycles and mal == 1.0 and res.cycles == MAX_NEW - 1
    else:
        assert 1.0 < mal < BLOCK + 1 and checker.partial_cycles > 0
    if kind == "confidence":  # the threshold cut blocks short, to nothing too
        assert min(res.proposal_lengths) == 0 and max(res.proposal_lengths) == BLOCK


def test_stop_tokens_and_max_new_tokens():
    model, runner, ar_tokens = _setup("qwen3")
    stop = ar_tokens[7]
    expected = ar_tokens[: ar_tokens.index(stop) + 1]
    for decoder in (ARDecoder(runner), SpeculativeDecoder(runner, _draft(model), block_size=BLOCK)):
        res = decoder.generate(PROMPT, MAX_NEW, stop_ids=[stop, 10_000])
        assert res.tokens == expected and res.stop_reason == "stop"
        for n in (1, 2, 5, 6):  # cut exactly, also inside a fully accepted block
            res = decoder.generate(PROMPT, n)
            assert res.tokens == ar_tokens[:n] and res.stop_reason == "length"


def test_cut_at_stop():
    assert cut_at_stop([1, 2, 3, 2], [2], 10) == ([1, 2], True)
    assert cut_at_stop([1, 2, 3], [9], 2) == ([1, 2], False)
    assert cut_at_stop([1, 2, 3], [3], 2) == ([1, 2], False)


def test_budget_errors():
    model, runner, _ = _setup("llama")
    decoder = SpeculativeDecoder(runner, _draft(model), block_size=BLOCK)
    with pytest.raises(ValueError, match="max_len=128"):
        decoder.generate(list(range(100)), 40)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate(PROMPT, 0)
    with pytest.raises(ValueError, match="non-empty"):
        decoder.generate([], 4)
    with pytest.raises(ValueError, match="block_size"):
        SpeculativeDecoder(runner, _draft(model), block_size=0)


def _dspark(model, aux, block: int, seed: int = 0, vocab: tuple[int, ...] | None = None) -> DSparkDraft:
    """The random DSpark draft; ``vocab``: a reduced draft vocabulary of these target ids (draft.vocab_size)."""
    torch.manual_seed(seed)
    cfg = DraftConfig(num_draft_layers=1, block_size=block, mask_token_id=None, num_anchors=4, markov_rank=8,
                      vocab_size=None if vocab is None else len(vocab))
    draft = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                        aux_layer_ids=aux).eval()
    if vocab is not None:
        draft.draft_vocab.set_ids(torch.tensor(vocab))
    return draft


class ProposalRecorder:
    """Wraps a draft's ``propose``: keeps every proposal's tokens and q."""

    def __init__(self, draft) -> None:
        self.tokens, self.probs, self._propose = [], [], draft.propose
        draft.propose = self

    def __call__(self, *args, **kwargs):
        prop = self._propose(*args, **kwargs)
        self.tokens.append(prop.tokens)
        self.probs.append(prop.probs)
        return prop


class LengthChecker:
    """on_cycle hook for any draft: target KV length == draft context length == new anchor position."""

    def __init__(self) -> None:
        self.partial_cycles = 0  # some tokens rejected
        self.accepting_cycles = 0  # at least one token accepted

    def __call__(self, info: CycleInfo) -> None:
        assert info.target_length == info.draft_context_length == info.next_anchor_position
        assert info.next_anchor_position == info.anchor_position + info.num_accepted + 1
        self.partial_cycles += info.num_accepted < info.num_proposed
        self.accepting_cycles += info.num_accepted > 0


@pytest.mark.parametrize("family,threshold,reduced", [("qwen3", 0.0, False), ("qwen3", 0.5, False),
                                                      ("llama", 0.0, False), ("llama", 0.5, False),
                                                      ("qwen3", 0.0, True), ("llama", 0.5, True)])
def test_greedy_identical_to_ar_with_dspark_draft(family, threshold, reduced):
    """A 16-token vocabulary makes a random draft right often enough for partial acceptances. ``reduced``: a
    draft vocabulary of the AR output's 4 most frequent tokens (as the draft_vocab stage picks them), so the
    draft can be right but the target also says tokens it cannot propose; the output is still the target's."""
    model = tiny_model(family, vocab_size=16, eos_token_id=None, pad_token_id=None)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=(0, 2, 4))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ar = ARDecoder(runner).generate(prompt, MAX_NEW)
    vocab = tuple(sorted(sorted(set(ar.tokens), key=lambda t: (-ar.tokens.count(t), t))[:4])) if reduced else None
    draft = _dspark(model, (0, 2, 4), BLOCK, vocab=vocab)
    recorder = ProposalRecorder(draft)
    checker = LengthChecker()
    res = SpeculativeDecoder(runner, draft, block_size=BLOCK, confidence_threshold=threshold,
                             on_cycle=checker).generate(prompt, MAX_NEW)
    assert res.tokens == ar.tokens
    assert checker.partial_cycles > 0 and checker.accepting_cycles > 0
    assert 1.0 < res.mean_accepted_length < BLOCK + 1
    if threshold > 0:
        assert min(res.proposal_lengths) < BLOCK
    if vocab is not None:
        assert set(torch.cat(recorder.tokens, 1).flatten().tolist()) <= set(vocab)
        assert not set(ar.tokens) <= set(vocab)  # the target says tokens the draft cannot


# -- the sampled distribution at the engine level ----------------------------------------------
V = 8
DRAWS = 1500


@pytest.mark.parametrize("vocab", [None, (0, 2, 3, 5, 6)])
def test_engine_sampling_matches_target_distribution(vocab):
    """First three generated tokens through prefill + speculative cycles (block 3, the random DSpark
    draft: q differs from p) are distributed as the target's processed distribution: joint of (t1, t2)
    and marginal of t3. ``vocab``: a reduced draft vocabulary (5 of the 8 tokens; q = 0 on the other 3)."""
    small = dict(vocab_size=V, eos_token_id=None, pad_token_id=None, num_hidden_layers=3, hidden_size=32,
                 intermediate_size=64)
    model = tiny_model("qwen3", seed=5, **small)
    params = SamplingParams(temperature=0.9, top_k=6)
    prompt = [1, 5, 2]
    joint, third = _exact_distributions(model, prompt, params)
    draft = _dspark(model, (0, 1), 3, vocab=vocab)
    recorder = ProposalRecorder(draft)
    runner = TargetRunner(model, max_len=16, aux_layer_ids=draft.aux_layer_ids)
    checker = LengthChecker()
    decoder = SpeculativeDecoder(runner, draft, block_size=3, sampling=params, seed=0, on_cycle=checker)
    samples = np.array([decoder.generate(prompt, 3).tokens for _ in range(DRAWS)])  # [DRAWS, 3]
    assert checker.partial_cycles > 100 and checker.accepting_cycles > 100  # both paths well exercised
    assert chisquare_pvalue(samples[:, 0] * V + samples[:, 1], joint.ravel()) > 1e-3
    assert chisquare_pvalue(samples[:, 2], third) > 1e-3
    if vocab is not None:
        outside = [t for t in range(V) if t not in vocab]
        assert torch.cat(recorder.probs, 1)[..., outside].eq(0).all()
        assert set(torch.cat(recorder.tokens, 1).flatten().tolist()) <= set(vocab)
        assert any(t in outside for t in samples.ravel())  # the target still says them


def _exact_distributions(model, prompt, params) -> tuple[np.ndarray, np.ndarray]:
    """p(t1, t2) [V, V] and p(t3) [V] of the processed target distribution, by enumeration."""
    def probs(ids):  # [R, V] next-token distributions after each row of ids [R, L]
        with torch.no_grad():
            return logits_to_probs(model(torch.tensor(ids)).logits[:, -1], params).double()

    p1 = probs([prompt])[0]  # [V]
    p2 = probs([prompt + [a] for a in range(V)])  # [V, V]
    p3 = probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    joint = p1[:, None] * p2  # [V, V]
    return joint.numpy(), (joint[:, :, None] * p3).sum((0, 1)).numpy()




@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0)])
def test_ar_output_does_not_depend_on_sync_every(target, sampling):
    """The AR loop reads tokens back every ``sync_every`` steps; a stop token met mid-chunk cuts the same."""
    _, runner, greedy = target
    stop = greedy[len(greedy) // 2]
    outs = [ARDecoder(runner, sampling=sampling, seed=7, sync_every=k).generate(PROMPT, MAX_NEW, stop_ids=[stop])
            for k in (1, 3, 16)]
    assert outs[0].tokens == outs[1].tokens == outs[2].tokens
    assert outs[0].cycles == outs[1].cycles == outs[2].cycles
    if sampling.greedy:
        assert outs[0].tokens[-1] == stop and outs[0].stop_reason == "stop"
