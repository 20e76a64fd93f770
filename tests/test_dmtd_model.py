"""DMTD teacher-forced forward: plain path = HF, flex = dense, packing = documents alone, cycle dependencies,
loss sums, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark_core.dmtd.config import VARIANTS, DMTDConfig
from dspark_core.dmtd.model import IGNORE, DMTDModel, PlainModel, default_positions

TAU, P, MASK = 4, 4, 259
ATOL = 2e-5


pytestmark = pytest.mark.usefixtures("one_thread")



def dmtd(lm, variant, **kw) -> DMTDModel:
    return DMTDModel(lm, P, TAU, MASK, variant, **kw).eval()


def ids(*shape, seed=0):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_plain_path_equals_hf(lms, family):
    x = ids(2, 19)
    with torch.no_grad():
        torch.testing.assert_close(PlainModel(lms[family]).logits(x), lms[family](x).logits, atol=ATOL, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("variant", VARIANTS)
def test_flex_mask_mod_equals_dense(lms, variant):
    x = ids(2, 18)
    pos = torch.tensor([list(range(11)) + list(range(7))] * 2)
    doc = torch.tensor([[0] * 11 + [1] * 7] * 2)
    with torch.no_grad():
        dense = dmtd(lms["qwen3"], variant, attn_backend="dense").logits(x, pos, doc)
        flex = dmtd(lms["qwen3"], variant, attn_backend="flex").logits(x, pos, doc)
    torch.testing.assert_close(flex, dense, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_documents_equal_each_alone(lms, family, variant):
    a, b = ids(1, 7, seed=1), ids(1, 10, seed=2)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(10)])[None]
    doc = torch.tensor([[0] * 7 + [1] * 10])
    m = dmtd(lms[family], variant)
    with torch.no_grad():
        both = m.logits(packed, pos, doc)
        torch.testing.assert_close(both[:, :7], m.logits(a), atol=ATOL, rtol=0)
        torch.testing.assert_close(both[:, 7:], m.logits(b), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["causal_norefresh", "causal_refresh"])
def test_causal_variants_do_not_see_cycle_tails(lms, variant):
    m = dmtd(lms["qwen3"], variant)
    x = ids(1, 13)
    pos, doc = default_positions(x, None, None)
    with torch.no_grad():
        outs = []
        for tails in (False, True):
            lay = m.layout(x, pos, doc, complete_cycles=tails)
            outs.append(m.parallel_hidden(lay)[:, lay.shadow_start: lay.shadow_start + 13])
    torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=0)


def test_variants_and_plain_differ(lms):
    x = ids(1, 16)
    with torch.no_grad():
        outs = {v: dmtd(lms["llama"], v).logits(x) for v in VARIANTS}
        outs["plain"] = PlainModel(lms["llama"]).logits(x)
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (outs[a] - outs[b]).abs().max() > 1e-2, (a, b)


def _shadow_hidden(m: DMTDModel, x: torch.Tensor) -> torch.Tensor:
    pos, doc = default_positions(x, None, None)
    lay = m.layout(x, pos, doc)
    return m.parallel_hidden(lay)[:, lay.shadow_start: lay.shadow_start + x.shape[1]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_shadow_hidden_depends_on_the_right_tokens(lms, variant):
    """Changing the non-head token x5 (cycle 1): norefresh shadow never reads it; refresh shadow reads it only
    from cycle 2 on (real K/V of strictly earlier cycles). Changing the head x4 reaches shadow slots >= 4."""
    m = dmtd(lms["qwen3"], variant)
    x = ids(1, 16)
    y = x.clone()
    y[0, 5] = (x[0, 5] + 1) % 256
    z = x.clone()
    z[0, 4] = (x[0, 4] + 1) % 256
    with torch.no_grad():
        hx, hy, hz = (_shadow_hidden(m, t) for t in (x, y, z))
    changed = (hx - hy).abs().amax(-1)[0] > 1e-6  # [L]
    want = torch.arange(16) >= 8 if m.rule.refresh else torch.zeros(16, dtype=torch.bool)
    assert changed.tolist() == want.tolist()
    changed_head = (hx - hz).abs().amax(-1)[0] > 1e-6
    assert changed_head.tolist() == (torch.arange(16) >= 4).tolist()


def test_ce_sums_equal_naive_cross_entropy(lms):
    m = dmtd(lms["qwen3"], "bidir_refresh", ce_chunk_tokens=5)
    x = ids(2, 12)
    labels = torch.full_like(x, IGNORE)
    labels[:, 3:11] = x[:, 4:12]
    sums = m(input_ids=x, labels=labels)
    logits = m.logits(x)
    sel = labels != IGNORE
    ref = F.cross_entropy(logits[sel], labels[sel], reduction="sum")
    torch.testing.assert_close(sums["ce"], ref, atol=1e-4, rtol=1e-6)
    assert sums["token_acc"] == (logits[sel].argmax(-1) == labels[sel]).sum()
    sums["ce"].backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_no_supervised_token_gives_zero_loss_with_graph(lms):
    m = dmtd(lms["qwen3"], "causal_refresh")
    x = ids(1, 8)
    sums = m(input_ids=x, labels=torch.full_like(x, IGNORE))
    assert float(sums["ce"].detach()) == 0.0 and sums["ce"].requires_grad


def test_bad_config_is_named(lms):
    cfg = DMTDConfig(num_parallel_layers=P, mask_token_id=999)
    with pytest.raises(ValueError, match="dmtd.mask_token_id=999"):
        DMTDModel.from_config(lms["qwen3"], cfg, "causal_refresh")
    with pytest.raises(ValueError, match="num_parallel_layers=6"):
        DMTDModel.from_config(lms["qwen3"], DMTDConfig(num_parallel_layers=6, mask_token_id=MASK), "causal_refresh")
    with pytest.raises(ValueError, match="variant must be one of"):
        dmtd(lms["qwen3"], "causal_sometimes")
    with pytest.raises(ValueError, match="dmtd.tau"):
        DMTDConfig.from_dict({"tau": 1}, prefix="dmtd.")
    with pytest.raises(ValueError, match="not a known parameter"):
        DMTDConfig.from_dict({"taus": 4}, prefix="dmtd.")
    with pytest.raises(ValueError, match="variants"):
        DMTDConfig.from_dict({"variants": ["causal_refresh", "other"]}, prefix="dmtd.")
