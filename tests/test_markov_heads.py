"""The Markov head types (vanilla, gated, rnn): each formula pinned on tiny dimensions against a plain step-by-step
computation, the slot-by-slot ``step`` equal to the block-at-once ``block``, the peers' tensor names, config checks."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_core.errors import UserError
from dspark_core.draft.config import DraftConfig
from dspark_core.draft.heads import build_markov_head, peer_markov_name

V, R, H, S = 5, 2, 3, 3


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _matvec(w: list, x: list) -> list:
    return [sum(wi * xi for wi, xi in zip(row, x)) for row in w]


def _head(kind: str):
    """A head with every weight set to a distinct small number (seeded), in float64."""
    head = build_markov_head(kind, V, R, H).double()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.7)
    return head


def _expected(kind: str, head, prev: list[int], hidden: list[list[float]]) -> list[list[float]]:
    """The bias W2 u_i of each slot, by the formula of the head type, one scalar at a time."""
    w1, w2 = head.w1.weight.tolist(), head.w2.weight.tolist()
    state = [0.0] * R
    out = []
    for t, h in zip(prev, hidden):
        m = w1[t]
        if kind == "vanilla":
            u = m
        elif kind == "gated":
            pre = [a + b for a, b in zip(_matvec(head.gate_proj.weight.tolist(), h + m), head.gate_proj.bias.tolist())]
            u = [_sigmoid(p) * mi for p, mi in zip(pre, m)]
        else:  # rnn: [g; c; o] = W_j [s; m; h] + b_j, s' = sig(g) s + (1 - sig(g)) tanh(c), u = tanh(o)
            pre = [a + b for a, b in zip(_matvec(head.joint_proj.weight.tolist(), state + m + h),
                                         head.joint_proj.bias.tolist())]
            g, c, o = pre[:R], pre[R:2 * R], pre[2 * R:]
            u = [math.tanh(x) for x in o]
            state = [_sigmoid(gi) * si + (1 - _sigmoid(gi)) * math.tanh(ci) for gi, si, ci in zip(g, state, c)]
        out.append(_matvec(w2, u))
    return out


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_head_formula_pinned(kind):
    head = _head(kind)
    prev = [3, 0, 4]
    hidden = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.75], [-2.0, 1.0, 0.5]]
    want = torch.tensor(_expected(kind, head, prev, hidden), dtype=torch.float64)  # [S, V]
    m = head.features(torch.tensor([prev]))  # [1, S, r]
    h = torch.tensor([hidden], dtype=torch.float64)  # [1, S, H]
    got_block = head.bias(head.block(m, h))[0]  # [S, V]
    torch.testing.assert_close(got_block, want, rtol=1e-12, atol=1e-12)
    state, steps = None, []
    for i in range(S):  # slot by slot, as inference runs it
        u, state = head.step(m[:, i], h[:, i], state)
        steps.append(head.bias(u)[0])
    torch.testing.assert_close(torch.stack(steps), want, rtol=1e-12, atol=1e-12)
    if kind == "rnn":  # the rnn head reads the whole prefix: slot 2 changes with slot 0's token
        other = head.bias(head.block(head.features(torch.tensor([[1, 0, 4]])), h))[0]
        assert not torch.allclose(other[2], want[2])
    else:  # memoryless: slot 2 reads only its own previous token and state
        other = head.bias(head.block(head.features(torch.tensor([[1, 0, 4]])), h))[0]
        torch.testing.assert_close(other[2], want[2], rtol=0, atol=0)


def test_markov_head_shapes_and_output_vocabulary():
    head = build_markov_head("gated", V, R, H, out_vocab=4)
    assert head.w1.weight.shape == (V, R) and head.w2.weight.shape == (4, R)
    assert tuple(head.gate_proj.weight.shape) == (R, H + R)
    assert tuple(build_markov_head("rnn", V, R, H).joint_proj.weight.shape) == (3 * R, 2 * R + H)
    assert build_markov_head("none", V, R, H) is None
    with pytest.raises(ValueError, match="draft state"):
        head.step(torch.zeros(1, R), None, None)


def test_peer_markov_names():
    assert peer_markov_name("markov.w1.weight") == "markov_head.markov_w1.weight"
    assert peer_markov_name("markov.w2.weight") == "markov_head.markov_w2.weight"
    assert peer_markov_name("markov.joint_proj.bias") == "markov_head.joint_proj.bias"
    assert peer_markov_name("fc.weight") == "fc.weight"
    with pytest.raises(ValueError, match="markov.other"):
        peer_markov_name("markov.other.weight")


def test_markov_head_config_checks():
    for kind in ("vanilla", "gated", "rnn", "none"):
        DraftConfig.from_dict({"markov_head": kind, "confidence_with_markov": kind != "none"})
    with pytest.raises(UserError, match="markov_head"):
        DraftConfig.from_dict({"markov_head": "lstm"})
    with pytest.raises(UserError, match="kind reranker"):
        DraftConfig.from_dict({"markov_head": "rnn", "kind": "reranker"})
    DraftConfig.from_dict({"markov_head": "gated", "kind": "engram_markov"})
