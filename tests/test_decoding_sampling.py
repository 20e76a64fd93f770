"""Sampling processing and exact speculative verification (dspark_core.decoding.sampling).

The chi-square tests run a small decoding process on a V = 8 vocabulary where the target's
distribution at output position j is a fixed P[j] and the draft proposes from a fixed Q[j]: the token
at every output position must then be distributed as P[j], whatever the acceptance pattern (blocks of
several tokens, bonus tokens included). The same statistic rejects a wrong residual rule, which shows
the test has power. Seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_core.decoding.sampling import (
    SamplingParams,
    logits_to_probs,
    make_sample_fn,
    race_sample,
    rejection_step,
    verify_greedy,
    verify_rejection,
)
from dspark_core.decoding.types import VerificationResult

from _decoding_utils import chisquare_pvalue

V = 8
POSITIONS = 4  # output positions whose distribution is checked
BLOCK = 3
DRAWS = 4000
ALPHA = 1e-3  # a correct sampler must not be rejected at this level ...
POWER_ALPHA = 1e-8  # ... and a wrong one must be rejected far below it


def _dists(seed: int, rows: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(rows, V, generator=g), dim=-1)  # [rows, V]


P = _dists(0, POSITIONS + BLOCK + 1, 1.5)  # target distribution at each output position
Q = _dists(1, POSITIONS + BLOCK + 1, 1.5)  # draft distribution at each output position


def wrong_residual(target_probs, draft_probs, draft_tokens, generator) -> VerificationResult:
    """The classic mistake: on rejection sample from p instead of normalize(max(p - q, 0))."""
    n = draft_tokens.shape[0]
    p_tok = target_probs[:n].gather(1, draft_tokens.view(n, 1)).squeeze(1)
    q_tok = draft_probs.gather(1, draft_tokens.view(n, 1)).squeeze(1)
    u = torch.rand(n, generator=generator)
    a = int((u * q_tok < p_tok).long().cumprod(0).sum())
    nxt = int(torch.multinomial(target_probs[a], 1, generator=generator))
    return VerificationResult(n, a, nxt, tuple(draft_tokens[:a].tolist()) + (nxt,))


def _simulate(verify, draws: int, seed: int, draft: torch.Tensor = Q) -> np.ndarray:
    """Tokens ``[draws, POSITIONS]`` of a speculative process with position-wise fixed P / ``draft`` (Q)."""
    gen = torch.Generator().manual_seed(seed)
    out = np.zeros((draws, POSITIONS), dtype=np.int64)
    for d in range(draws):
        seq: list[int] = []
        while len(seq) < POSITIONS:
            j = len(seq)  # output position of the first proposed token
            q = draft[j : j + BLOCK]  # [BLOCK, V]
            tokens = torch.multinomial(q, 1, generator=gen).squeeze(1)  # [BLOCK]
            seq.extend(verify(P[j : j + BLOCK + 1], q, tokens, gen).committed)
        out[d] = seq[:POSITIONS]
    return out


def device_step(target_probs, draft_probs, draft_tokens, generator) -> VerificationResult:
    """``rejection_step`` (the static engine's on-device verify) in ``verify_rejection``'s place; every other
    cycle proposes one slot fewer (the confidence cut's ``num_proposed``): rows past it must not count."""
    n = draft_tokens.shape[0]
    device_step.calls = getattr(device_step, "calls", 0) + 1
    cut = n - (device_step.calls % 2)
    u = torch.rand(n, generator=generator)
    race = torch.rand(target_probs.shape[-1], generator=generator)
    a, nxt = rejection_step(target_probs, draft_probs, draft_tokens, torch.tensor(cut), u, race)
    a = int(a)
    return VerificationResult(cut, a, int(nxt), tuple(draft_tokens[:a].tolist()) + (int(nxt),))


@pytest.fixture(scope="module")
def correct_samples() -> np.ndarray:
    return _simulate(verify_rejection, DRAWS, seed=7)


@pytest.fixture(scope="module")
def wrong_samples() -> np.ndarray:
    return _simulate(wrong_residual, DRAWS, seed=7)


def test_rejection_sampling_matches_target_at_every_position(correct_samples):
    for j in range(POSITIONS):
        assert chisquare_pvalue(correct_samples[:, j], P[j].numpy()) > ALPHA, f"position {j}"
    joint = correct_samples[:, 0] * V + correct_samples[:, 1]  # positions 0 and 1 are independent under P
    assert chisquare_pvalue(joint, np.outer(P[0].numpy(), P[1].numpy()).ravel()) > ALPHA


def test_rejection_sampling_is_exact_with_a_reduced_draft_vocabulary():
    """A draft over 5 of the 8 tokens (``draft.vocab_size``: q = 0 on the others, which p still has): the
    output still follows P; the tokens outside the draft's vocabulary come from the residual only."""
    inside = torch.tensor([0, 2, 3, 5, 6])
    q = torch.zeros_like(Q).index_copy(1, inside, Q[:, inside])
    samples = _simulate(verify_rejection, DRAWS, seed=13, draft=q / q.sum(-1, keepdim=True))
    for j in range(POSITIONS):
        assert chisquare_pvalue(samples[:, j], P[j].numpy()) > ALPHA, f"position {j}"
    assert np.isin(samples, [1, 4, 7]).mean() > 0.2  # the target's tokens the draft cannot propose do occur


def test_device_rejection_step_matches_target_at_every_position():
    """The static engine's rejection step (exponential-race draws, a confidence cut on every other cycle)."""
    samples = _simulate(device_step, DRAWS, seed=11)
    for j in range(POSITIONS):
        assert chisquare_pvalue(samples[:, j], P[j].double().numpy()) > ALPHA, j


def test_cut_with_the_cut_slots_q_is_rejected():
    """Power: rejecting the slots past the cut but keeping their q in the residual (p - q at the cut instead of p)
    biases the output, and the same statistic sees it."""
    def cut_by_rejection(target_probs, draft_probs, draft_tokens, generator):
        n = draft_tokens.shape[0]
        u = torch.rand(n, generator=generator)
        u[n - 1] = 1e9  # the last slot "past the cut": always rejected, but its q stays in the residual
        race = torch.rand(target_probs.shape[-1], generator=generator)
        a, nxt = rejection_step(target_probs, draft_probs, draft_tokens, torch.tensor(n), u, race)
        a = int(a)
        return VerificationResult(n, a, int(nxt), tuple(draft_tokens[:a].tolist()) + (int(nxt),))

    samples = _simulate(cut_by_rejection, DRAWS, seed=11)
    assert min(chisquare_pvalue(samples[:, j], P[j].double().numpy()) for j in range(POSITIONS)) < POWER_ALPHA


def test_race_sample_draws_from_probs():
    g = torch.Generator().manual_seed(3)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    draws = race_sample(probs.expand(20000, 4), torch.rand(20000, 4, generator=g))
    assert chisquare_pvalue(draws.numpy(), probs.double().numpy()) > ALPHA  # cell 1 never drawn (asserted)


def test_wrong_residual_is_rejected(wrong_samples):
    """Power: the same test flags sampling the correction from p instead of the residual."""
    pvalues = [chisquare_pvalue(wrong_samples[:, j], P[j].numpy()) for j in range(POSITIONS)]
    assert min(pvalues) < POWER_ALPHA, pvalues


def test_rejection_with_equal_distributions_accepts_everything():
    gen = torch.Generator().manual_seed(0)
    p = _dists(3, 4, 1.0)
    for _ in range(50):
        tokens = torch.multinomial(p[:3], 1, generator=gen).squeeze(1)
        res = verify_rejection(p, p[:3].clone(), tokens, gen)
        assert res.num_accepted == 3 and res.all_accepted and len(res.committed) == 4


def test_rejection_never_accepts_a_token_the_target_forbids():
    gen = torch.Generator().manual_seed(0)
    p = torch.zeros(2, V)
    p[:, 0] = 1.0  # target: always token 0
    q = torch.full((1, V), 1.0 / V)
    for t in range(1, V):
        res = verify_rejection(p, q, torch.tensor([t]), gen)
        assert res.num_accepted == 0 and res.next_token == 0


def _forbidden_token_case():
    """The target forbids token 0 (top-k / top-p cut it: p = 0), the draft proposed it twice (q = 0.6)."""
    p = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])  # [S+1, V]
    q = torch.tensor([[0.6, 0.2, 0.2], [0.6, 0.2, 0.2]])  # [S, V]
    return p, q, torch.tensor([0, 0])


def test_rejection_step_refuses_a_forbidden_token_even_at_u_zero():
    """The accept test is strict, u q(t) < p(t): at p(t) = 0 even the draw u = 0 rejects (a `<=` would accept a
    token the target can never emit, once in 2^24 draws: no chi-square test sees it)."""
    p, q, tokens = _forbidden_token_case()
    for u in (torch.zeros(2), torch.tensor([0.0, 0.5])):
        race = torch.rand(3, generator=torch.Generator().manual_seed(0))
        a, nxt = rejection_step(p, q, tokens, torch.tensor(2), u, race)
        assert int(a) == 0 and int(nxt) != 0


def test_verify_rejection_refuses_a_forbidden_token_even_at_u_zero(monkeypatch):
    import dspark_core.decoding.sampling as sampling

    p, q, tokens = _forbidden_token_case()
    monkeypatch.setattr(sampling.torch, "rand", lambda n, **kw: torch.zeros(n))  # every accept draw u = 0
    res = verify_rejection(p, q, tokens, torch.Generator().manual_seed(0))
    assert res.num_accepted == 0 and res.next_token != 0


def test_verify_greedy():
    logits = torch.full((4, V), -1.0)
    for row, tok in enumerate([5, 2, 7, 1]):
        logits[row, tok] = 3.0
    full = verify_greedy(logits, torch.tensor([5, 2, 7]))
    assert (full.num_accepted, full.next_token, full.committed) == (3, 1, (5, 2, 7, 1))
    partial = verify_greedy(logits, torch.tensor([5, 3, 7]))
    assert (partial.num_accepted, partial.next_token, partial.committed) == (1, 2, (5, 2))
    none = verify_greedy(logits[:1], torch.tensor([], dtype=torch.long))
    assert (none.num_accepted, none.next_token, none.committed) == (0, 5, (5,))


def test_logits_to_probs_against_brute_force():
    torch.manual_seed(0)
    logits = torch.randn(5, V) * 2
    for params in [SamplingParams(0.7), SamplingParams(1.3, top_k=3), SamplingParams(0.9, top_p=0.6),
                   SamplingParams(1.0, top_k=5, top_p=0.8)]:
        got = logits_to_probs(logits, params)
        for row in range(logits.shape[0]):
            torch.testing.assert_close(got[row], _brute_force_probs(logits[row], params), rtol=1e-6, atol=1e-7)


def _brute_force_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scaled = (logits / params.temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[: params.top_k] if params.top_k else order)
    z = sum(np.exp(scaled[i]) for i in keep)
    probs = {i: np.exp(scaled[i]) / z for i in keep}
    kept, mass = [], 0.0
    for i in sorted(keep, key=lambda i: -probs[i]):
        if mass >= params.top_p and kept:
            break
        kept.append(i)
        mass += probs[i]
    out = torch.zeros(len(scaled), dtype=torch.float64)
    z = sum(probs[i] for i in kept)
    for i in kept:
        out[i] = probs[i] / z
    return out.float()


def test_greedy_processing_and_sample_fn():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0]])
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # first argmax on ties
    tok, q = make_sample_fn(SamplingParams(), None)(logits)
    assert tok.tolist() == [1] and q.tolist() == probs.tolist()
    gen = torch.Generator().manual_seed(0)
    tok, q = make_sample_fn(SamplingParams(1.0, top_k=1), gen)(logits[:, :3])
    assert tok.tolist() == [1] and q[0, 1] == 1.0


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.5)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_block_shapes():
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_greedy(torch.zeros(3, V), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_rejection(torch.full((3, V), 1 / V), torch.full((3, V), 1 / V), torch.tensor([1, 2]), None)
