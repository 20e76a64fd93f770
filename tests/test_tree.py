"""Draft trees (``dspark_core.decoding.tree``): the layout, greedy tree acceptance against a plain walk, the Triton
tree accept / K/V move / Markov top-2 against torch, the target's tree step against the chain forward of each
node's path, and the static engine with branches against AR (identical output, more tokens per cycle).

CPU: the Triton pieces run under Triton's interpreter (the target and draft small)."""

from __future__ import annotations

import os

import pytest
import torch

from _decoding_utils import assert_partial_acceptance, fit_draft_to_target, greedy_continuations
from _decoding_utils import one_thread, untuned_kernels  # noqa: F401 (fixtures)
from dspark_core.decoding.tree import TreeLayout, parse_branches, top2_reference, tree_accept_reference

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from dspark_core.kernels import triton_ok  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "untuned_kernels")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_ok(DEVICE), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
LAYOUTS = [((1, 3), (2, 1), (3, 1), (4, 1)), ((1, 7),), ((3, 2), (1, 1))]


def test_layout_table_and_errors():
    layout = TreeLayout(4, ((1, 2), (3, 1)))
    depth, offset, back, parent, anc = layout.table()
    # rows: 0 anchor, 1-4 main, 5-6 branch at depth 1-2, 7 branch at depth 3
    assert depth == [0, 1, 2, 3, 4, 1, 2, 3]
    assert parent == [0, 0, 1, 2, 3, 0, 5, 2]
    assert offset == [0, 0, 0, 0, 0, 4, 4, 4]
    assert back == [0, 0, 0, 0, 0, 0, 1, 0]
    assert anc[6] == [0, 5, 6, 3, 4] and anc[7] == [0, 1, 2, 7, 4] and anc[3] == [0, 1, 2, 3, 4]
    assert layout.rows == 8 and layout.nodes == 7
    assert parse_branches("1:3, 2:1") == ((1, 3), (2, 1)) == parse_branches([[1, 3], [2, 1]])
    with pytest.raises(ValueError, match="start 5"):
        TreeLayout(4, ((5, 1),))
    with pytest.raises(ValueError, match="same depth"):
        TreeLayout(4, ((1, 1), (1, 2)))
    with pytest.raises(ValueError, match="exceeds"):
        TreeLayout(7, ((1, 7), (2, 2)))
    with pytest.raises(ValueError, match="tree_branches"):
        parse_branches("1:x")


def tree_accept_bruteforce(best: list[int], nodes: list[int], layout: TreeLayout
                           ) -> tuple[int, list[int], int]:
    """Plain-Python walk (tests): from the anchor, follow the child whose token equals the argmax at the
    current row. Returns (a, path rows at depths 0..a, bonus)."""
    _, _, _, parent, _ = layout.table()
    row, path = 0, [0]
    while True:
        children = [r for r in range(1, layout.rows) if parent[r] == row and r != row]
        nxt = [r for r in children if nodes[r - 1] == best[row]]
        if not nxt:
            return len(path) - 1, path, best[row]
        row = nxt[0]
        path.append(row)


def _random_case(layout: TreeLayout, vocab: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Node tokens whose siblings differ (as top-1 / top-2 do) and row argmaxes that often follow them."""
    _, _, _, parent, _ = layout.table()
    nodes = torch.randint(0, vocab, (layout.nodes,), generator=gen).tolist()
    for r in range(1, layout.rows):  # a branch's first token differs from the main chain's at its depth
        for q in range(1, r):
            if parent[q] == parent[r] and nodes[q - 1] == nodes[r - 1]:
                nodes[r - 1] = (nodes[r - 1] + 1) % vocab
    best = torch.randint(0, vocab, (layout.rows,), generator=gen).tolist()
    for r in range(1, layout.rows):  # the parent's argmax is this node's token half of the time
        if torch.rand(1, generator=gen).item() < 0.5:
            best[parent[r]] = nodes[r - 1]
    return nodes, best


def _logits(best: list[int], vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(len(best), vocab, generator=gen)
    logits[torch.arange(len(best)), torch.tensor(best)] = 10.0
    return logits


@pytest.mark.parametrize("branches", LAYOUTS)
def test_tree_accept_matches_walk(branches):
    layout = TreeLayout(7, branches)
    tables = layout.tensors("cpu")
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        nodes, best = _random_case(layout, 6, gen)
        a, w, path, bonus = tree_accept_reference(_logits(best, 6, gen), torch.tensor(nodes), tables)
        a_ref, path_ref, bonus_ref = tree_accept_bruteforce(best, nodes, layout)
        assert (int(a), int(bonus)) == (a_ref, bonus_ref)
        assert path[: a_ref + 1].tolist() == path_ref and int(w) == path_ref[-1]
        assert path[a_ref + 1 :].tolist() == list(range(a_ref + 1, 8))  # identity beyond the accepted depth
        seen.add(int(w) > 7)
    assert seen == {True, False}  # branches won some cycles


@needs_triton
@pytest.mark.parametrize("branches", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_accept_kernel_matches_torch(branches, dtype):
    """The tree accept kernel: a, path tokens, bonus, p, anchor, the path table and the K/V moves of the accepted
    branch nodes (target and draft caches) all equal the torch reference (tree_accept_reference + index ops)."""
    from dspark_core.kernels.accept import GreedyAccept, greedy_accept_tree_reference, kv_move_reference

    layout = TreeLayout(7, branches)
    vocab, s = 300, 7
    gen = torch.Generator().manual_seed(1)
    kernel = GreedyAccept(layout.rows, vocab, DEVICE, tree=layout, block_v=128)
    tables = layout.tensors(DEVICE)
    moved = 0
    for _ in range(12):
        nodes, best = _random_case(layout, vocab, gen)
        logits = _logits(best, vocab, gen).to(DEVICE, dtype)
        out = torch.zeros(s + 3 + layout.nodes, dtype=torch.long, device=DEVICE)
        out[1], out[3 + s :] = s, torch.tensor(nodes)
        p0 = int(torch.randint(5, 30, (1,), generator=gen))
        p, anchor = torch.tensor([p0], device=DEVICE), torch.tensor([3], device=DEVICE)
        k = torch.randn(3, 1, 2, 64, 16, generator=gen).to(DEVICE, dtype)  # [L, 1, Hkv, M, D] target
        v = torch.randn(3, 1, 2, 64, 16, generator=gen).to(DEVICE, dtype)
        dk = torch.randn(2, 1, 3, 48, 32, generator=gen).to(DEVICE, dtype)  # [nl, 1, nkv, M, d] draft
        dv = torch.randn(2, 1, 3, 48, 32, generator=gen).to(DEVICE, dtype)
        ref = [t.clone() for t in (out, p, anchor, k, v, dk, dv)]
        ref_path = torch.zeros(3, s + 1, dtype=torch.long, device=DEVICE)
        greedy_accept_tree_reference(logits, ref[0], ref[1], ref[2], tables, ref_path)
        kv_move_reference(ref[3], ref[4], ref_path)
        kv_move_reference(ref[5], ref[6], ref_path)
        kernel(logits, out, p, anchor, kv=(k, v), draft_kv=(dk, dv))
        a = int(ref[0][0])
        assert out[: 2 + a].tolist() == ref[0][: 2 + a].tolist()  # a, cap, the accepted path's tokens
        assert out[2 + s :].tolist() == ref[0][2 + s :].tolist()  # bonus, node tokens untouched
        assert (p.item(), anchor.item()) == (ref[1].item(), ref[2].item()) == (p0 + a + 1, out[2 + s].item())
        assert torch.equal(kernel.path, ref_path)
        assert torch.equal(k, ref[3]) and torch.equal(v, ref[4]) and torch.equal(dk, ref[5]) and torch.equal(dv, ref[6])
        moved += int((ref_path[0] != torch.arange(s + 1, device=DEVICE)).any())
    assert moved > 0  # some cycles accepted a branch: its K/V moved


@needs_triton
@pytest.mark.parametrize("vocab,rank", [(16, 8), (300, 24), (1000, 64)])
def test_markov_rows_kernel_matches_torch(vocab, rank):
    from dspark_core.kernels.markov import MarkovArgmax

    gen = torch.Generator().manual_seed(3)
    w1 = (torch.randn(vocab, rank, generator=gen) * 0.3).to(DEVICE)
    w2 = (torch.randn(vocab, rank, generator=gen) * 0.3).to(DEVICE)
    kernel = MarkovArgmax(w1, w2)
    for trial in range(6):
        base = torch.randn(vocab, generator=gen).to(DEVICE)
        if trial % 2:  # ties across tiles: the lowest ids win, first and second
            base = torch.round(base)
        prev = torch.randint(0, vocab, (2,), generator=gen).tolist()
        # two rows in one launch, (prev, out, out2) indices into a token buffer: top-2 of row 0, top-1 of row 1
        tok = torch.tensor([prev[0], -1, -1, prev[1], -1], device=DEVICE)
        table = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32, device=DEVICE)
        kernel.rows(base, tok, table)
        bias = torch.nn.functional.linear(torch.nn.functional.embedding(tok[[0, 3]], w1), w2).float()  # [2, V]
        first, second = top2_reference(base.view(1, -1) + bias[:1])
        other = (base.view(1, -1) + bias[1:]).argmax()
        assert tok.tolist() == [prev[0], first.item(), second.item(), prev[1], other.item()]


def _tiny(family: str, layers: int = 3, vocab: int = 16, fit=None, steps: int = 50):
    """A tiny target and a 2-layer DSpark draft (block 4): random, or with ``fit=(prompts, max_new_tokens)``
    trained ``steps`` steps on the target's own greedy continuations of those prompts, so it is right part of
    the time (the identity tests then exercise acceptance and rollback; a random draft is almost never right)."""
    from dspark_core.draft import DraftConfig, DSparkDraft
    from dspark_core.testing import tiny_model

    model = tiny_model(family, vocab_size=vocab, eos_token_id=None, pad_token_id=None,
                       num_hidden_layers=layers).to(DEVICE)
    torch.manual_seed(0)
    cfg = DraftConfig(num_draft_layers=2, block_size=4, mask_token_id=None, num_anchors=4, markov_rank=8)
    draft = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                        aux_layer_ids=(0, 1)).to(DEVICE).eval()
    if fit is not None:
        prompts, max_new = fit
        fit_draft_to_target(draft, model, prompts, greedy_continuations(model, prompts, max_new), steps)
    return model, draft


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_triton)])
def test_tree_step_matches_chain_of_each_path(kernels):
    """Every tree row's logits and aux states == the last row of a chain forward of its path (same prefix)."""
    from dspark_core.decoding.target_runner import TargetRunner

    model, _ = _tiny("qwen3", vocab=64)
    layout = TreeLayout(4, ((1, 2), (3, 1)))
    _, _, _, parent, _ = layout.table()
    runner = TargetRunner(model, max_len=48, aux_layer_ids=(0, 1), kernels=kernels)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2]], device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (1, layout.rows), generator=gen).to(DEVICE)
    t = layout.tensors(DEVICE)
    runner.prefill(prompt[:, :-1])
    p = runner.length
    logits, aux = runner.step(ids, p + t.depth, tree=(t.offset, t.back))
    for r in range(1, layout.rows):
        path = [r]
        while path[-1] != 0:
            path.append(parent[path[-1]])
        chain = ids[:, path[::-1]]  # [1, depth + 1] anchor .. node r
        runner.prefill(prompt[:, :-1])
        ref_logits, ref_aux = runner.forward(chain)
        torch.testing.assert_close(logits[0, r], ref_logits[0, -1], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(aux[0, r], ref_aux[0, -1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_triton)])
def test_static_tree_engine_matches_ar(kernels):
    """Branches change only the tokens per cycle: the output is AR's, and more tokens are accepted per cycle
    than with the chain (16-token vocabulary; the draft, trained a few steps on the target's outputs, is partly
    right and its second choice is often right where its first is not)."""
    from dspark_core.decoding.ar import ARDecoder
    from dspark_core.decoding.static_engine import StaticSpeculativeDecoder
    from dspark_core.decoding.target_runner import TargetRunner

    prompts = ([3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2], [11, 5])
    model, draft = _tiny("qwen3", fit=(prompts, 40), steps=25)  # this 3-layer target is learnt fast
    branches = ((1, 2), (2, 1), (3, 1))
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids, kernels=kernels)
    if kernels:  # the interpreter is slow: one prompt, the same cycles as the torch path's tree engine
        prompt, n = prompts[0], 20
        ar = ARDecoder(runner).generate(prompt, n)
        res = StaticSpeculativeDecoder(runner, draft, kernels=True, tree_branches=branches).generate(prompt, n)
        assert res.tokens == ar.tokens
        assert_partial_acceptance(res, 4)
        eager = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
        ref = StaticSpeculativeDecoder(eager, draft, tree_branches=branches).generate(prompt, n)
        assert res.accepted_per_cycle == ref.accepted_per_cycle
        return
    chain = StaticSpeculativeDecoder(runner, draft)
    tree = StaticSpeculativeDecoder(runner, draft, tree_branches=branches)
    mal = {"chain": [], "tree": []}
    for prompt in prompts:
        ar = ARDecoder(runner).generate(prompt, 40)
        for name, engine in (("chain", chain), ("tree", tree)):
            res = engine.generate(prompt, 40)
            assert res.tokens == ar.tokens, name
            assert_partial_acceptance(res, 4)
            assert runner.length == len(prompt) + len(res.tokens) - 1
            mal[name].append(res.mean_accepted_length)
    assert sum(mal["tree"]) > sum(mal["chain"])


def test_tree_refuses_confidence_cut():
    from dspark_core.decoding.static_engine import StaticSpeculativeDecoder
    from dspark_core.decoding.target_runner import TargetRunner

    model, draft = _tiny("qwen3")
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    with pytest.raises(ValueError, match="confidence"):
        StaticSpeculativeDecoder(runner, draft, confidence_threshold=0.5, tree_branches="1:2")
    with pytest.raises(ValueError, match="start 9"):
        StaticSpeculativeDecoder(runner, draft, tree_branches="9:1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_tree_cuda_graph_bf16_matches_ar():
    """bf16, batch-invariant Triton kernels, the cycle captured as CUDA graphs: the tree engine's output is AR's
    bit for bit (each tree row sums its keys in AR's order), on capture and on replay."""
    from dspark_core.decoding.ar import ARDecoder
    from dspark_core.decoding.static_engine import StaticSpeculativeDecoder
    from dspark_core.decoding.target_runner import TargetRunner

    prompt = [7, 7, 2]  # (this target continues [3, 1, 4, ...] with one token, repeated)
    model, draft = _tiny("qwen3", layers=4, vocab=64, fit=([prompt], 64))  # trained in float32, then cast
    model, draft = model.to(torch.bfloat16), draft.to(torch.bfloat16)
    runner = TargetRunner(model, max_len=160, aux_layer_ids=draft.aux_layer_ids, cuda_graph=True, kernels=True)
    ar = ARDecoder(runner).generate(prompt, 64)
    tree = StaticSpeculativeDecoder(runner, draft, cuda_graph=True, tree_branches="1:4,2:2,3:1,4:1")
    assert tree.tree.rows == 13  # block 4 + 8 branch nodes + the anchor
    for _ in range(2):
        res = tree.generate(prompt, 64)
        assert res.tokens == ar.tokens
        assert_partial_acceptance(res, 4)
