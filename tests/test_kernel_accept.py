"""The fused greedy accept kernel (``dspark_core.kernels.accept``) against its torch reference, bit for bit.

Runs where Triton can: on a CUDA device, or on CPU under Triton's interpreter (set here when there is no GPU,
as in ``tests/test_kernels.py``). The kernel only compares and selects, so bfloat16 is exact on CPU too.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton's CPU interpreter; read when the kernels are defined (first use below)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dspark_core.kernels import triton_ok  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_ok(DEVICE), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.bfloat16]


def _state(logits, a, cap, g, p0=17):
    """out / p / anchor for logits [S+1, V] whose draft tokens match the row argmaxes for slots < a, then
    mismatch at slot a (the rest random)."""
    s, v = logits.shape[0] - 1, logits.shape[1]
    best = logits.argmax(dim=-1)  # [S+1]
    tokens = torch.randint(0, v, (s,), generator=g).to(DEVICE)  # [S]
    tokens[:a] = best[:a]
    if a < s:
        tokens[a] = (best[a] + 1) % v
    out = torch.cat([torch.tensor([-5, cap]).to(DEVICE), tokens, torch.tensor([-7]).to(DEVICE)])  # [S+3]
    p = torch.tensor([p0], device=DEVICE)
    anchor = torch.tensor([-3], device=DEVICE)
    return out, p, anchor


def _check(acc, logits, out, p, anchor):
    """Run kernel and reference on copies; every output bit for bit equal, the counter back at 0."""
    from dspark_core.kernels.accept import greedy_accept_reference

    ref = [out.clone(), p.clone(), anchor.clone()]
    greedy_accept_reference(logits, *ref)
    got = [out.clone(), p.clone(), anchor.clone()]
    acc(logits, *got)
    for name, x, y in zip(("out", "p", "anchor"), got, ref):
        assert torch.equal(x, y), f"{name}: kernel {x.tolist()} vs reference {y.tolist()}"
    assert int(acc.lock.item()) == 0
    return got


def _logits(s, v, dtype, g):
    return (torch.randn(s + 1, v, generator=g) * 4).to(DEVICE, dtype)  # [S+1, V]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,v,block", [(7, 1000, 128), (3, 300, 64)])
def test_every_accept_length(s, v, block, dtype):
    """a = 0..S (no cap), V not a multiple of the tile."""
    from dspark_core.kernels.accept import GreedyAccept

    g = torch.Generator().manual_seed(s)
    acc = GreedyAccept(s + 1, v, DEVICE, block_v=block)
    assert v % block != 0 and acc.tiles > 1
    for a in range(s + 1):
        logits = _logits(s, v, dtype, g)
        out, p, anchor = _state(logits, a, s, g)
        got = _check(acc, logits, out, p, anchor)
        assert int(got[0][0]) == a and int(got[1]) == 17 + a + 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_cap_cuts_the_prefix(dtype):
    """cap < S (confidence cut): a = min(matching prefix, cap); cap 0 and a negative cap accept nothing."""
    from dspark_core.kernels.accept import GreedyAccept

    s, v = 7, 700
    g = torch.Generator().manual_seed(1)
    acc = GreedyAccept(s + 1, v, DEVICE, block_v=256)
    for planted, cap in [(7, 0), (7, 3), (5, 2), (2, 5), (7, 6), (4, -1), (7, 99)]:
        logits = _logits(s, v, dtype, g)
        out, p, anchor = _state(logits, planted, cap, g)
        got = _check(acc, logits, out, p, anchor)
        assert int(got[0][0]) == max(0, min(planted, cap))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_lowest_index(dtype):
    """Exact ties within and across tiles (and whole rows of one value): the lowest index, as torch.argmax."""
    from dspark_core.kernels.accept import GreedyAccept

    s, v, block = 7, 1000, 128
    g = torch.Generator().manual_seed(2)
    acc = GreedyAccept(s + 1, v, DEVICE, block_v=block)
    logits = _logits(s, v, torch.float32, g).clamp(-10, 10)
    spots = [[900, 5, 5 + block], [v - 1, 3 * block + 1], [2 * block - 1, 2 * block], [130, 131, 999],
             [0, v - 1], [7 * block, 7 * block + 3], [64, 64 + 4 * block, 64 + 6 * block], [300]]
    for r, cols in enumerate(spots):
        logits[r, cols] = 20.0
    logits[3] = 0.5  # a whole row of one value: index 0
    logits = logits.to(dtype)
    best = logits.argmax(dim=-1).tolist()
    assert best == [5, 3 * block + 1, 2 * block - 1, 0, 0, 7 * block, 64, 300]
    for a in (0, 4, s):
        out, p, anchor = _state(logits, a, s, g)
        _check(acc, logits, out, p, anchor)
    # many ties everywhere: small integer logits
    coarse = torch.randint(0, 4, (s + 1, v), generator=g).to(DEVICE, dtype)
    for a in (1, s):
        out, p, anchor = _state(coarse, a, s, g)
        _check(acc, coarse, out, p, anchor)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_tiles_and_single_tile(dtype):
    """The default tile width (a few tiles of 1024 at V = 5000) and a vocab inside one tile."""
    from dspark_core.kernels.accept import GreedyAccept

    g = torch.Generator().manual_seed(3)
    for s, v, block in [(7, 5000, None), (3, 100, 128)]:
        acc = GreedyAccept(s + 1, v, DEVICE, block_v=block)
        assert acc.tiles == (5 if block is None else 1)
        for a in (0, s // 2, s):
            logits = _logits(s, v, dtype, g)
            out, p, anchor = _state(logits, a, s, g)
            _check(acc, logits, out, p, anchor)


def test_back_to_back_calls_accumulate():
    """One object, many calls: the counter resets each time, p accumulates a + 1, anchor follows the bonus;
    also a row-strided logits view (the [1, S+1, V] verify output sliced)."""
    from dspark_core.kernels.accept import GreedyAccept, greedy_accept_reference

    s, v = 7, 900
    g = torch.Generator().manual_seed(4)
    acc = GreedyAccept(s + 1, v, DEVICE, block_v=128)
    mine = [None, torch.tensor([3], device=DEVICE), torch.tensor([0], device=DEVICE)]
    ref = [None, mine[1].clone(), mine[2].clone()]
    total = 3
    for i in range(24):
        wide = _logits(s, v + 16, torch.bfloat16 if i % 2 else torch.float32, g)  # [S+1, V+16]
        logits = wide[:, :v] if i % 3 == 0 else wide[:, :v].contiguous()
        a = int(torch.randint(0, s + 1, (1,), generator=g))
        out, _, _ = _state(logits, a, s if i % 4 else a // 2 + 1, g)
        mine[0], ref[0] = out.clone(), out.clone()
        acc(logits, *mine)
        greedy_accept_reference(logits, *ref)
        for x, y in zip(mine, ref):
            assert torch.equal(x, y)
        assert int(acc.lock.item()) == 0
        total += int(mine[0][0]) + 1
        assert int(mine[1]) == total and int(mine[2]) == int(mine[0][s + 2])


def test_argument_errors():
    from dspark_core.kernels.accept import GreedyAccept

    s, v = 3, 200
    acc = GreedyAccept(s + 1, v, DEVICE, block_v=64)
    logits = torch.zeros(s + 1, v, device=DEVICE)
    out = torch.zeros(s + 3, dtype=torch.long, device=DEVICE)
    p = torch.zeros(1, dtype=torch.long, device=DEVICE)
    anchor = torch.zeros(1, dtype=torch.long, device=DEVICE)
    bad = [
        ((logits[None], out, p, anchor), r"logits must have shape \[4, 200\]"),
        ((logits[:, :100], out, p, anchor), r"logits must have shape"),
        ((logits.double(), out, p, anchor), r"logits must be float32, bfloat16 or float16"),
        ((torch.zeros(v, s + 1, device=DEVICE).t(), out, p, anchor), r"contiguous along the vocab"),
        ((logits, out[:-1], p, anchor), r"out must be int64 of shape \[6\]"),
        ((logits, out.int(), p, anchor), r"out must be int64"),
        ((logits, out, p.int(), anchor), r"p must be int64 of shape \[1\]"),
        ((logits, out, p, torch.zeros(2, dtype=torch.long, device=DEVICE)), r"anchor must be int64 of shape \[1\]"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            acc(*args)
    with pytest.raises(ValueError, match="rows"):
        GreedyAccept(17, v, DEVICE)
    with pytest.raises(ValueError, match="block_v"):
        GreedyAccept(4, v, DEVICE, block_v=100)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,v,block", [(7, 1000, 128), (3, 300, 64)])
def test_sampled_accept_matches_rejection_step(s, v, block, dtype):
    """``SampledAccept`` (two launches) against ``logits_to_probs`` + ``sampling.rejection_step`` on the same draws:
    the same accepted prefix, bonus, position and anchor, over draws that reject at different slots, accept every
    counted slot, and cut at a cap (rows past the cap have no q); the arrival counters back at 0."""
    from dspark_core.decoding.sampling import SamplingParams, logits_to_probs, rejection_step
    from dspark_core.kernels.accept import SampledAccept

    g = torch.Generator().manual_seed(s * v)
    temperature = 0.8
    acc = SampledAccept(s + 1, v, DEVICE, block_v=block)
    seen = set()
    for trial in range(24):
        logits = _logits(s, v, dtype, g)  # [S+1, V]
        p_ref = logits_to_probs(logits.float(), SamplingParams(temperature=temperature))  # [S+1, V]
        q = torch.softmax((p_ref[:s].log() + torch.randn(s, v, generator=g).to(DEVICE)).float(), dim=-1)  # [S, V]
        tokens = torch.multinomial(q.cpu(), 1, generator=g)[:, 0].to(DEVICE)  # [S] drawn from q
        cap = s if trial % 3 else int(torch.randint(0, s, (1,), generator=g))
        u = torch.rand(s, generator=g).to(DEVICE) * (0.02 if trial % 4 == 0 else 1.0)  # [S] small u: accept
        race = torch.rand(v, generator=g).to(DEVICE)  # [V]
        out = torch.cat([torch.tensor([-5, cap]).to(DEVICE), tokens, torch.tensor([-7]).to(DEVICE)])  # [S+3]
        p, anchor = torch.tensor([17], device=DEVICE), torch.tensor([-3], device=DEVICE)
        a, bonus = rejection_step(p_ref, q, tokens, torch.tensor(cap, device=DEVICE), u, race)
        acc(logits, q, out, p, anchor, u, race, temperature)
        assert out.tolist() == [a.item(), cap, *tokens.tolist(), bonus.item()], trial
        assert p.item() == 17 + a.item() + 1 and anchor.item() == bonus.item()
        assert acc.locks.tolist() == [0, 0]
        seen.add(a.item())
    assert {0, s} <= seen and len(seen) >= 3  # rejections at the first slot, full acceptances, and in between
    with pytest.raises(ValueError, match="temperature must be > 0"):
        acc(logits, q, out, p, anchor, u, race, 0.0)
    with pytest.raises(ValueError, match=r"q must be contiguous float32 \[3, 300\]|q must be contiguous float32"):
        acc(logits, q[:, :5], out, p, anchor, u, race, temperature)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_accept_matches_each_request_alone(dtype):
    """``batch=B``: logits [B*(S+1), V] row-major by request, out [B, S+3], p / anchor [B], one launch: every
    request's a, bonus, position and anchor are bit for bit the reference's for that request alone (different
    accept lengths and caps per request, ties, back-to-back launches); the per-request counters end at 0."""
    from dspark_core.kernels.accept import GreedyAccept, greedy_accept_reference

    s, v, batch = 7, 1000, 5
    g = torch.Generator().manual_seed(58)
    acc = GreedyAccept(s + 1, v, DEVICE, batch=batch, block_v=128)
    assert acc.tiles == 8
    seen = set()
    for launch in range(3):
        logits = torch.cat([_logits(s, v, dtype, g) for _ in range(batch)])  # [B*(S+1), V]
        if launch == 1:  # coarse logits: ties everywhere
            logits = torch.randint(0, 4, (batch * (s + 1), v), generator=g).to(DEVICE, dtype)
        states = [_state(logits[b * (s + 1) : (b + 1) * (s + 1)], (b + launch) % (s + 1), s if b % 2 else b + 1, g,
                         p0=10 * b) for b in range(batch)]
        out = torch.stack([st[0] for st in states])  # [B, S+3]
        p, anchor = torch.cat([st[1] for st in states]), torch.cat([st[2] for st in states])  # [B]
        ref = [out.clone(), p.clone(), anchor.clone()]
        for b in range(batch):
            greedy_accept_reference(logits[b * (s + 1) : (b + 1) * (s + 1)], ref[0][b], ref[1][b : b + 1],
                                    ref[2][b : b + 1])
        acc(logits, out, p, anchor)
        for name, x, y in zip(("out", "p", "anchor"), (out, p, anchor), ref):
            assert torch.equal(x, y), f"launch {launch} {name}: kernel {x.tolist()} vs reference {y.tolist()}"
        assert acc.lock.tolist() == [0] * batch
        seen.update(out[:, 0].tolist())
    assert len(seen) >= 4  # several accept lengths across the requests


def test_batched_accept_argument_errors():
    from dspark_core.kernels.accept import GreedyAccept

    s, v, batch = 3, 200, 3
    acc = GreedyAccept(s + 1, v, DEVICE, batch=batch, block_v=64)
    logits = torch.zeros(batch * (s + 1), v, device=DEVICE)
    out = torch.zeros(batch, s + 3, dtype=torch.long, device=DEVICE)
    p = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    bad = [((logits[: s + 1], out, p, p.clone()), r"logits must have shape \[12, 200\]"),
           ((logits, out[0], p, p.clone()), r"out must be int64 of shape \[3, 6\]"),
           ((logits, out, p[:1], p.clone()), r"p must be int64 of shape \[3\]")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            acc(*args)
    with pytest.raises(ValueError, match="batch must be >= 1; got 0"):
        GreedyAccept(s + 1, v, DEVICE, batch=0)
    with pytest.raises(ValueError, match="tree mode takes batch 1; got batch=2"):
        GreedyAccept(s + 1, v, DEVICE, batch=2, tree=object())
    one = GreedyAccept(s + 1, v, DEVICE, block_v=64)  # batch 1 takes out [S+3] or [1, S+3]
    one(logits[: s + 1], out[:1], p[:1], p[1:2])
    assert one.lock.tolist() == [0]
