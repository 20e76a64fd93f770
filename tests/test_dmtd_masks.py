"""DMTD visibility: the one predicate (dense and flex mask_mod) against brute-force enumerations of seed 001's
rules, and the inference cycle mask against the seed's 8-slot table (7.3)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark_core.dmtd.config import VARIANTS, parse_variant
from dspark_core.dmtd.masks import CAUSAL, Slots, dense_mask, mask_mod
from dspark_core.dmtd.model import cycle_tails

TAU = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def seed_rule(variant: str, q: dict, k: dict) -> bool:
    """Seed 001 sections 2-5 (and 1.4: never across documents), written out per variant."""
    if q["doc"] != k["doc"]:
        return False
    if not q["shadow"]:  # real branch / S layers: standard causal over real tokens
        return not k["shadow"] and k["pos"] <= q["pos"]
    qc, kc = q["pos"] // TAU, k["pos"] // TAU
    if variant == "causal_norefresh":   # "shadow position i only sees shadow positions <= i"
        return k["shadow"] and k["pos"] <= q["pos"]
    if variant == "bidir_norefresh":    # "visible = same_cycle or causal_history"
        return k["shadow"] and (qc == kc or k["pos"] <= q["pos"])
    real_visible = not k["shadow"] and kc < qc
    if variant == "causal_refresh":
        shadow_visible = k["shadow"] and kc == qc and k["pos"] <= q["pos"]
    else:                               # bidir_refresh
        shadow_visible = k["shadow"] and kc == qc
    return real_visible or shadow_visible


def packed_slots(lengths: list[int], with_real: bool, tails: bool) -> tuple[Slots, list[dict]]:
    """Training layout of documents packed back to back: [real ;] shadow [; cycle tails]."""
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    parts = [Slots.make(pos, doc, True, TAU)]
    if tails:
        tp, td = cycle_tails(pos, doc, TAU)
        parts.append(Slots.make(tp, td, True, TAU))
    if with_real:
        parts.insert(0, Slots.make(pos, doc, False, TAU))
    s = Slots.cat(parts)
    rows = [dict(pos=int(p), doc=int(d), shadow=bool(sh)) for p, d, sh in zip(s.pos[0], s.doc[0], s.shadow[0])]
    return s, rows


@pytest.mark.parametrize("variant", VARIANTS)
def test_dense_and_flex_predicate_equal_seed_rules(variant):
    rule = parse_variant(variant)
    slots, rows = packed_slots([7, 1, 10, 4], with_real=rule.refresh, tails=True)
    want = torch.tensor([[seed_rule(variant, q, k) for k in rows] for q in rows])
    got = dense_mask(slots, slots, rule)[0, 0]
    assert torch.equal(got, want)
    fn = mask_mod(slots, slots, rule)
    b, h = torch.tensor(0), torch.tensor(0)
    flex = torch.tensor([[bool(fn(b, h, torch.tensor(i), torch.tensor(j))) for j in range(len(rows))]
                         for i in range(len(rows))])
    assert torch.equal(flex, want)
    # every query sees at least itself (no empty softmax row)
    assert got.diagonal().all()


def test_variants_have_distinct_masks():
    slots, _ = packed_slots([9, 6], with_real=True, tails=True)
    masks = {v: dense_mask(slots, slots, parse_variant(v)) for v in VARIANTS}
    for a, b in itertools.combinations(VARIANTS, 2):
        assert not torch.equal(masks[a], masks[b]), (a, b)


def test_refresh_pattern_1111_1111_1000():
    """Seed 3.2: the shadow query at a cycle head sees [1111] [1111] real and [1000] of its own block."""
    slots, rows = packed_slots([12], with_real=True, tails=False)
    m = dense_mask(slots, slots, parse_variant("causal_refresh"))[0, 0]
    q = 12 + 8  # shadow slot of position 8
    assert m[q, :12].tolist() == [True] * 8 + [False] * 4
    assert m[q, 12:].tolist() == [False] * 8 + [True, False, False, False]


def test_cycle_tails_complete_each_document():
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]])
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2]])
    tp, td = cycle_tails(pos, doc, TAU, multiple=8)
    assert tp.shape == (1, 8)
    assert tp[0, :5].tolist() == [5, 6, 7, 2, 3] and td[0, :5].tolist() == [0, 0, 0, 1, 1]
    assert (td[0, 5:] == -1).all()


def test_causal_rule_ignores_kind_of_variant():
    slots, rows = packed_slots([5, 3], with_real=False, tails=False)
    real = Slots(slots.pos, slots.cycle, slots.doc, torch.zeros_like(slots.shadow))
    m = dense_mask(real, real, CAUSAL)[0, 0]
    want = torch.tensor([[q["doc"] == k["doc"] and k["pos"] <= q["pos"] for k in rows] for q in rows])
    assert torch.equal(m, want)
