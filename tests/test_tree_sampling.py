"""Draft trees under sampling (``dspark_core.decoding.tree_sampling``): recursive rejection sampling over siblings.

The chi-square tests run a small speculative process on a V = 6 vocabulary, vectorised over DRAWS independent
trials: the target is a position-dependent Markov chain (the token at position k+1 ~ P[k][token at k]), the draft
proposes every node from its own Q[k][parent's token] (sibling tokens drawn without replacement, as the engine's
draft does, or i.i.d.), and each trial runs two tree cycles (so the first two emitted tokens exist even when the
first cycle rejects everything). The first emitted token must be distributed as P[0][anchor] and the first two
jointly as P[0][anchor](t1) P[1][t1](t2), whatever the draft; the same statistic rejects two wrong schemes (no
residual update between siblings; the sibling's law not updated for the removed token), which shows the test can
fail. Seeds are fixed, so every outcome is deterministic.

End to end: the reference engine with a tree on a tiny random target and a random DSpark draft, greedy (AR's
output, the static engine's tree cycles) and under sampling (valid tokens; the caches hold exactly the committed
sequence's K/V and context).

Shape legend: B trials, R tree rows (row 0 the anchor), N = R - 1 nodes, V vocab, K positions of P / Q.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _decoding_utils import chisquare_pvalue, one_thread  # noqa: F401 (fixture)
from dspark_core.decoding import tree_sampling
from dspark_core.decoding.sampling import SamplingParams, one_hot_argmax
from dspark_core.decoding.tree import TreeLayout, TreeTensors, tree_accept_reference
from dspark_core.decoding.tree_sampling import sibling_probs, tree_verify_sampling

pytestmark = pytest.mark.usefixtures("one_thread")

V = 6
DRAWS = 40_000
ALPHA = 1e-3  # a correct scheme must not be rejected at this level ...
POWER_ALPHA = 1e-8  # ... and a wrong one far below it
LAYOUT = TreeLayout(3, ((1, 2), (2, 1)))  # rows: 0 anchor, 1-3 chain, 4-5 branch at depths 1-2, 6 branch at depth 2
# a generic tree: the anchor has 3 children (drawn without replacement), the first of them 2, one more level
THREE = [0, 0, 0, 0, 1, 1, 4, 2]


def tables_from_parents(parents: list[int]) -> TreeTensors:
    """The tables ``tree_verify_sampling`` reads (depth, parent, ancestors) of any tree whose parents precede
    their children (parents[0] = 0, the anchor)."""
    depth = [0]
    for r in range(1, len(parents)):
        depth.append(depth[parents[r]] + 1)
    s = max(depth)
    anc = []
    for r in range(len(parents)):
        path = [r]
        while path[-1] != 0:
            path.append(parents[path[-1]])
        anc.append(path[::-1] + list(range(depth[r] + 1, s + 1)))
    zeros = torch.zeros(len(parents), dtype=torch.int32)
    return TreeTensors(torch.tensor(depth), zeros, zeros, torch.tensor(parents), torch.tensor(anc))


def _markov(seed: int, sharpness: float, positions: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return sharpness * torch.randn(positions, V, V, generator=g)  # [K, V, V] logits of token k+1 given token k


POSITIONS = 2 * (LAYOUT.block_size + 1) + 2
P = torch.softmax(_markov(0, 1.0, POSITIONS), dim=-1)  # [K, V, V] the target's transition at each position


def _draft_logits(case: str) -> torch.Tensor:
    """[K, V, V] draft logits of each case (its q: their softmax; one-hot for 'point')."""
    if case in ("adversarial", "iid_coincide"):
        return _markov(1, 3.0, POSITIONS)  # peaked and unrelated to P: the chain token takes most of q's mass
    if case == "anti":
        return -2.0 * torch.log(P)  # q puts its mass where p has the least
    if case == "point":
        return _markov(2, 1.0, POSITIONS)  # greedy draft (q one-hot), sampling target: siblings top-1 / top-2
    raise ValueError(case)


def _simulate(case: str, parents: list[int], seed: int, draws: int = DRAWS, iid: bool = False,
              sibling_law_wrong: bool = False) -> np.ndarray:
    """The first two emitted tokens [draws, 2] of two tree cycles from anchor token 0 at position 0."""
    gen = torch.Generator().manual_seed(seed)
    t = tables_from_parents(parents)
    rows, depth = len(parents), t.depth
    logits_all = _draft_logits(case)  # [K, V, V]
    q_all = one_hot_argmax(logits_all) if case == "point" else torch.softmax(logits_all, dim=-1)
    anchor = torch.zeros(draws, dtype=torch.long)  # [B]
    pos0 = torch.zeros(draws, dtype=torch.long)  # [B] position of the anchor
    out = torch.full((draws, 2 * rows), -1, dtype=torch.long)  # [B, .] committed tokens
    count = torch.zeros(draws, dtype=torch.long)  # [B]
    coincide, later_won = 0, 0
    later = torch.tensor([any(parents[k] == parents[r] for k in range(1, r)) for r in range(rows)])  # [R]
    for _ in range(2):
        tok = torch.zeros(draws, rows, dtype=torch.long)  # [B, R]
        tok[:, 0] = anchor
        node_probs = torch.zeros(draws, rows - 1, V)  # [B, N, V]
        for j in range(1, rows):
            par = parents[j]
            earlier = [k for k in range(1, j) if parents[k] == par]  # earlier siblings, in row order
            pos = pos0 + depth[par]  # [B] position of the parent's token
            logits, q = logits_all[pos, tok[:, par]], q_all[pos, tok[:, par]]  # [B, V] the slot's logits and q
            law = q if iid or not earlier else sibling_probs(q, tok[:, earlier], logits)  # [B, V]
            tok[:, j] = torch.multinomial(law, 1, generator=gen)[:, 0]
            node_probs[:, j - 1] = q if sibling_law_wrong else law
            if earlier:
                coincide += int((tok[:, j] == tok[:, earlier[0]]).sum())
        target = P[pos0[:, None] + depth[None, :], tok]  # [B, R, V] p at every row
        a, _, path, nxt = tree_verify_sampling(target, node_probs, tok[:, 1:], t, gen)
        later_won += int((later[path] & (torch.arange(path.shape[1]) <= a[:, None])).any(dim=1).sum())
        seq = torch.cat([tok.gather(1, path)[:, 1:], torch.zeros(draws, 1, dtype=torch.long)], dim=1)  # [B, S+1]
        seq.scatter_(1, a[:, None], nxt[:, None])  # accepted tokens, then the bonus / correction at index a
        for i in range(seq.shape[1]):
            keep = i <= a  # [B]
            out[keep, count[keep] + i] = seq[keep, i]
        count += a + 1
        anchor, pos0 = nxt, pos0 + a + 1
    if iid:
        assert coincide > 0.2 * draws  # sibling tokens often coincide: the verifier must handle them
    assert later_won > 0.05 * draws  # a sibling after the first was accepted in many cycles
    return out[:, :2].numpy()


def _pvalues(samples: np.ndarray) -> tuple[float, float]:
    first = P[0, 0].double().numpy()  # [V]
    joint = (P[0, 0].double()[:, None] * P[1].double()).numpy()  # [V, V]
    return chisquare_pvalue(samples[:, 0], first), chisquare_pvalue(samples[:, 0] * V + samples[:, 1], joint.ravel())


CASES = [
    ("adversarial", LAYOUT.table()[3], {}),
    ("anti", LAYOUT.table()[3], {}),
    ("point", LAYOUT.table()[3], {}),
    ("iid_coincide", LAYOUT.table()[3], {"iid": True}),
    ("adversarial_3_siblings", THREE, {}),
]


@pytest.mark.parametrize("name,parents,kw", CASES, ids=[c[0] for c in CASES])
def test_tree_sampling_matches_target(name, parents, kw):
    samples = _simulate(name.replace("_3_siblings", ""), parents, seed=11, **kw)
    p_first, p_joint = _pvalues(samples)
    print(f"\n{name}: chi-square p-value first token {p_first:.3g}, first two {p_joint:.3g}")
    assert p_first > ALPHA and p_joint > ALPHA


@pytest.mark.parametrize("wrong", ["no_residual_update", "sibling_law_not_updated"])
def test_wrong_schemes_fail_the_same_check(wrong, monkeypatch):
    """Forgetting the residual update (r stays p after a rejected sibling, the correction drawn from p), or
    verifying the without-replacement sibling against q instead of q without the chain token: both rejected."""
    kw = {}
    if wrong == "no_residual_update":
        monkeypatch.setattr(tree_sampling, "residual", lambda r, q: r)
    else:
        kw["sibling_law_wrong"] = True
    samples = _simulate("adversarial", LAYOUT.table()[3], seed=11, **kw)
    p_first, p_joint = _pvalues(samples)
    print(f"\nwrong scheme {wrong}: chi-square p-value first token {p_first:.3g}, first two {p_joint:.3g}")
    assert min(p_first, p_joint) < POWER_ALPHA


def test_sibling_probs():
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 1.0, 0.0, 0.0], [0.2, 0.2, 0.6, 0.0]])  # [3, 4]
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 5.0, 4.0, 4.0], [0.0, 1.0, 2.0, 3.0]])
    out = sibling_probs(q, torch.tensor([0, 1, 2]), logits)
    torch.testing.assert_close(out[0], torch.tensor([0.0, 0.6, 0.4, 0.0]))
    torch.testing.assert_close(out[1], torch.tensor([0.0, 0.0, 1.0, 0.0]))  # no mass left: the best other token
    torch.testing.assert_close(out[2], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    two = sibling_probs(q[1:2], torch.tensor([[1, 2]]), logits[1:2])  # [1, 2] taken: the third sibling
    torch.testing.assert_close(two[0], torch.tensor([0.0, 0.0, 0.0, 1.0]))


def test_one_hot_distributions_reduce_to_greedy_tree_acceptance():
    """With one-hot p (the target's argmax) and the greedy draft's laws, recursive rejection sampling accepts
    exactly the greedy tree's path and returns its bonus (``tree_accept_reference``)."""
    layout = TreeLayout(7, ((1, 3), (2, 1), (3, 1), (4, 1)))
    t = layout.tensors("cpu")
    _, _, _, parent, _ = layout.table()
    gen = torch.Generator().manual_seed(3)
    branch_won = 0
    for _ in range(200):
        nodes = torch.randint(0, V, (layout.nodes,), generator=gen)
        for r in range(1, layout.rows):  # siblings differ (top-1 / top-2)
            if any(parent[k] == parent[r] and nodes[k - 1] == nodes[r - 1] for k in range(1, r)):
                nodes[r - 1] = (nodes[r - 1] + 1) % V
        best = torch.randint(0, V, (layout.rows,), generator=gen)
        for r in range(1, layout.rows):
            if torch.rand(1, generator=gen).item() < 0.6:
                best[parent[r]] = nodes[r - 1]
        logits = torch.randn(layout.rows, V, generator=gen)
        logits[torch.arange(layout.rows), best] = 10.0
        node_q = torch.nn.functional.one_hot(nodes, V).float()  # [N, V] a greedy draft's point masses
        ref = tree_accept_reference(logits, nodes, t)
        got = tree_verify_sampling(one_hot_argmax(logits)[None], node_q[None], nodes[None], t, gen)
        for x, y in zip(ref, got):
            assert torch.equal(x, y[0])
        branch_won += int(ref[1]) > layout.block_size
    assert branch_won > 0


def test_verify_shape_errors():
    t = LAYOUT.tensors("cpu")
    with pytest.raises(ValueError, match="disagree"):
        tree_verify_sampling(torch.rand(2, LAYOUT.rows, V), torch.rand(2, LAYOUT.nodes - 1, V),
                             torch.zeros(2, LAYOUT.nodes, dtype=torch.long), t, None)


# -- end to end: the reference engine with a tree ----------------------------------------------------------------
BRANCHES = ((1, 2), (2, 1), (3, 1))


def _tiny(vocab: int = 16, seed: int = 0):
    from dspark_core.draft import DraftConfig, DSparkDraft
    from dspark_core.testing import tiny_model

    model = tiny_model("qwen3", seed=seed, vocab_size=vocab, eos_token_id=None, pad_token_id=None,
                       num_hidden_layers=3)
    torch.manual_seed(0)
    cfg = DraftConfig(num_draft_layers=2, block_size=4, mask_token_id=None, num_anchors=4, markov_rank=8)
    draft = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                        aux_layer_ids=(0, 1)).eval()
    return model, draft


def test_greedy_tree_identical_to_ar_and_static_engine():
    from dspark_core.decoding.ar import ARDecoder
    from dspark_core.decoding.engine import SpeculativeDecoder
    from dspark_core.decoding.static_engine import StaticSpeculativeDecoder
    from dspark_core.decoding.target_runner import TargetRunner

    model, draft = _tiny()
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    chain = SpeculativeDecoder(runner, draft, block_size=4)
    tree = SpeculativeDecoder(runner, draft, block_size=4, tree_branches=BRANCHES)
    static = StaticSpeculativeDecoder(runner, draft, tree_branches=BRANCHES)
    mal = {"chain": 0.0, "tree": 0.0}
    for prompt in ([3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2]):
        ar = ARDecoder(runner).generate(prompt, 40)
        res = tree.generate(prompt, 40)
        assert res.tokens == ar.tokens
        assert runner.length == len(prompt) + len(res.tokens) - 1
        assert res.accepted_per_cycle == static.generate(prompt, 40).accepted_per_cycle  # the same tree cycles
        mal["tree"] += res.mean_accepted_length
        mal["chain"] += chain.generate(prompt, 40).mean_accepted_length
    assert mal["tree"] > mal["chain"]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=0.6, top_p=0.9)])
def test_sampling_tree_end_to_end(params, monkeypatch):
    """Temperature > 0 with a tree: valid tokens, lengths kept, and the target cache / draft context hold exactly
    the K/V and aux states of the committed sequence (so every accepted branch's K/V moved into place)."""
    from dspark_core.decoding import engine as engine_mod
    from dspark_core.decoding.engine import SpeculativeDecoder
    from dspark_core.decoding.target_runner import TargetRunner
    from dspark_core.decoding.types import CycleInfo

    winners: list[int] = []  # the deepest accepted row of every cycle

    def verify(*args):
        out = tree_verify_sampling(*args)
        winners.append(int(out[1][0]))
        return out

    monkeypatch.setattr(engine_mod, "tree_verify_sampling", verify)

    model, draft = _tiny()
    runner = TargetRunner(model, max_len=128, aux_layer_ids=draft.aux_layer_ids)
    extended: list[torch.Tensor] = []
    extend = draft.extend_context
    draft.extend_context = lambda cache, aux: (extended.append(aux.clone()), extend(cache, aux))[1]
    cycles: list[CycleInfo] = []
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    try:
        engine = SpeculativeDecoder(runner, draft, block_size=4, sampling=params, seed=5, tree_branches=BRANCHES,
                                    on_cycle=cycles.append)
        res = engine.generate(prompt, 60)
    finally:
        del draft.extend_context
    assert len(res.tokens) == 60 and all(0 <= x < 16 for x in res.tokens)
    for info in cycles:
        assert info.target_length == info.draft_context_length == info.next_anchor_position
        assert len(info.committed) == info.num_accepted + 1 and info.num_accepted <= 4
    assert sum(res.accepted_per_cycle) > 0 and min(res.accepted_per_cycle) == 0  # accepts and rejections
    assert len(winners) == res.cycles and max(winners) > 4  # some cycles accepted a branch (rows 5..8)
    length = runner.length
    k, v = runner.k_cache[:, :, :, :length].clone(), runner.v_cache[:, :, :, :length].clone()
    committed = res.tokens[:1] + [x for info in cycles for x in info.committed]  # beyond the cut at 60 too
    assert committed[:60] == res.tokens
    seq = prompt + committed[:-1]  # what the caches hold: every position before the last anchor
    assert len(seq) == length
    fresh = TargetRunner(model, max_len=128, aux_layer_ids=draft.aux_layer_ids)
    _, aux = fresh.prefill(torch.tensor([seq]))
    torch.testing.assert_close(k, fresh.k_cache[:, :, :, :length], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, fresh.v_cache[:, :, :, :length], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(extended, dim=1)[:, :length], aux, atol=1e-4, rtol=1e-4)


def test_refusals():
    from dspark_core.decoding.engine import SpeculativeDecoder
    from dspark_core.decoding.static_engine import StaticSpeculativeDecoder
    from dspark_core.decoding.target_runner import TargetRunner

    model, draft = _tiny()
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    with pytest.raises(ValueError, match=r"greedily.*sampling tree.*SpeculativeDecoder\(\.\.\., tree_branches"):
        StaticSpeculativeDecoder(runner, draft, sampling=SamplingParams(temperature=0.7), tree_branches="1:2")
    with pytest.raises(ValueError, match="confidence"):
        SpeculativeDecoder(runner, draft, block_size=4, confidence_threshold=0.5, tree_branches="1:2")
    with pytest.raises(ValueError, match="not a DSparkDraft"):
        SpeculativeDecoder(runner, object(), block_size=4, tree_branches="1:2")
    with pytest.raises(ValueError, match="start 9"):
        SpeculativeDecoder(runner, draft, block_size=4, tree_branches="9:1")


def test_engine_tree_sampling_matches_target_distribution():
    """Through prefill + tree cycles of the reference engine (block 3, branches at depths 1 and 2, the random DSpark
    draft: q far from p, top-k 6 of 8): the first two generated tokens jointly, and the third, are distributed as the
    target's processed distribution (computed by enumeration)."""
    from dspark_core.decoding.engine import SpeculativeDecoder
    from dspark_core.decoding.sampling import logits_to_probs
    from dspark_core.decoding.target_runner import TargetRunner
    from dspark_core.draft import DraftConfig, DSparkDraft
    from dspark_core.testing import tiny_model

    v, draws, prompt = 8, 1500, [1, 5, 2]
    model = tiny_model("qwen3", seed=5, vocab_size=v, eos_token_id=None, pad_token_id=None, num_hidden_layers=3,
                       hidden_size=32, intermediate_size=64)
    params = SamplingParams(temperature=0.9, top_k=6)
    torch.manual_seed(0)
    cfg = DraftConfig(num_draft_layers=1, block_size=3, mask_token_id=None, num_anchors=4, markov_rank=8)
    draft = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                        aux_layer_ids=(0, 1)).eval()

    def probs(ids):  # [R, V] next-token distributions after each row of ids [R, L]
        with torch.no_grad():
            return logits_to_probs(model(torch.tensor(ids)).logits[:, -1], params).double()

    p1 = probs([prompt])[0]  # [V]
    joint = p1[:, None] * probs([prompt + [a] for a in range(v)])  # [V, V]
    p3 = probs([prompt + [a, b] for a in range(v) for b in range(v)]).view(v, v, v)
    third = (joint[:, :, None] * p3).sum((0, 1))  # [V]
    runner = TargetRunner(model, max_len=24, aux_layer_ids=draft.aux_layer_ids)
    accepted: list[int] = []
    engine = SpeculativeDecoder(runner, draft, block_size=3, sampling=params, seed=0, tree_branches="1:2,2:1",
                                on_cycle=lambda info: accepted.append(info.num_accepted))
    samples = np.array([engine.generate(prompt, 3).tokens for _ in range(draws)])  # [draws, 3]
    assert accepted.count(0) > 100 and len(accepted) - accepted.count(0) > 100  # rejections and acceptances
    p_joint = chisquare_pvalue(samples[:, 0] * v + samples[:, 1], joint.ravel().numpy())
    p_third = chisquare_pvalue(samples[:, 2], third.numpy())
    print(f"\nengine: chi-square p-value (t1, t2) {p_joint:.3g}, t3 {p_third:.3g}")
    assert p_joint > ALPHA and p_third > ALPHA
