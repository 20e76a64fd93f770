"""Offline metrics against brute-force Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_core.metrics import OfflineMetrics, block_metric_sums, overlap, overlap_from_l1, tau_prob_per_block


def _random_case(seed: int, b=3, a=5, s=6):
    g = torch.Generator().manual_seed(seed)
    a_vals = torch.rand(b, a, s, generator=g)
    lengths = torch.randint(0, s + 1, (b, a), generator=g)  # contiguous valid prefixes, some empty blocks
    valid = torch.arange(s) < lengths.unsqueeze(-1)
    return a_vals, valid


def test_overlap_is_sum_of_min_and_one_minus_half_l1():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 11, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(4, 11, generator=g) * 2, -1)
    brute = [sum(min(float(p[i, v]), float(q[i, v])) for v in range(11)) for i in range(4)]
    torch.testing.assert_close(overlap(p, q), torch.tensor(brute), rtol=0, atol=1e-6)
    torch.testing.assert_close(overlap_from_l1((p - q).abs().sum(-1)), torch.tensor(brute), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tau_prob_and_accept_rate_against_loops(seed):
    a_vals, valid = _random_case(seed)
    b, na, s = a_vals.shape
    tau_sum, acc_sum, blocks = 0.0, [0.0] * s, 0
    count = [0] * s
    for i in range(b):
        for j in range(na):
            if not valid[i, j, 0]:
                continue
            blocks += 1
            tau, prod = 1.0, 1.0
            for k in range(s):
                ak = float(a_vals[i, j, k]) if valid[i, j, k] else 0.0
                prod *= ak
                tau += prod
                if valid[i, j, k]:
                    acc_sum[k] += ak
                    count[k] += 1
            tau_sum += tau
    tau, acc = block_metric_sums(a_vals, valid)
    assert math.isclose(float(tau), tau_sum, rel_tol=1e-6)
    torch.testing.assert_close(acc, torch.tensor(acc_sum), rtol=1e-6, atol=1e-6)
    # invalid slots count as a = 0 in tau even when their a is not
    per_block = tau_prob_per_block(a_vals, valid)
    assert bool((per_block[~valid[..., 0]] == 1.0).all()) and bool((~valid[..., 0]).any())

    m = OfflineMetrics(s, calibration_bins=4)
    ce = torch.rand(int(valid.sum()))
    m.add(a_vals, valid, ce, confidence=None)
    res = m.result()
    assert res["num_blocks"] == blocks and res["num_tokens"] == int(valid.sum())
    assert math.isclose(res["tau_prob"], tau_sum / blocks, rel_tol=1e-6)
    for k in range(s):
        want = acc_sum[k] / count[k] if count[k] else None
        assert (res[f"accept_rate@{k}"] is None) if want is None else math.isclose(res[f"accept_rate@{k}"], want,
                                                                                   rel_tol=1e-6)
    assert math.isclose(res["ce"], float(ce.double().sum()) / int(valid.sum()), rel_tol=1e-9)
    assert res["conf_mae"] is None and res["conf_bias"] is None


def test_streaming_over_batches_equals_one_batch_and_calibration_loops():
    a1, v1 = _random_case(3)
    a2, v2 = _random_case(4)
    g = torch.Generator().manual_seed(9)
    c1, c2 = torch.rand(int(v1.sum()), generator=g), torch.rand(int(v2.sum()), generator=g)
    e1, e2 = torch.rand(c1.shape, generator=g), torch.rand(c2.shape, generator=g)
    split = OfflineMetrics(6, calibration_bins=5)
    split.add(a1, v1, e1, c1)
    split.add(a2, v2, e2, c2)
    whole = OfflineMetrics(6, calibration_bins=5)
    whole.add(torch.cat([a1, a2]), torch.cat([v1, v2]), torch.cat([e1, e2]), torch.cat([c1, c2]))
    r_split, r_whole = split.result(), whole.result()
    for k, v in r_whole.items():
        assert v == pytest.approx(r_split[k], rel=1e-6), k

    conf = torch.cat([c1, c2]).tolist()
    acc = torch.cat([a1[v1], a2[v2]]).tolist()
    n = len(conf)
    assert r_whole["conf_mae"] == pytest.approx(sum(abs(c - a) for c, a in zip(conf, acc)) / n, rel=1e-6)
    assert r_whole["conf_bias"] == pytest.approx(sum(c - a for c, a in zip(conf, acc)) / n, rel=1e-6)
    rel = whole.reliability()
    for k in range(5):
        members = [(c, a) for c, a in zip(conf, acc) if min(int(c * 5), 4) == k]
        assert rel["count"][k] == len(members)
        if members:
            assert rel["mean_confidence"][k] == pytest.approx(sum(c for c, _ in members) / len(members), rel=1e-6)
            assert rel["mean_overlap"][k] == pytest.approx(sum(a for _, a in members) / len(members), rel=1e-6)
        else:
            assert rel["mean_confidence"][k] is None
