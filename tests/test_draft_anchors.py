"""Anchor sampling and slot supervision against brute-force loops; the attention mask against its definition."""

from __future__ import annotations

import pytest
import torch

from dspark_core.draft.anchors import add_anchor_fields, sample_anchors
from dspark_core.draft.attention import build_attention_mask, dense_mask, make_mask_mod


def _loss_mask(seed: int, b=4, length=30):
    g = torch.Generator().manual_seed(seed)
    lm = torch.rand(b, length, generator=g) < 0.7
    lm[:, :3] = False  # a prompt
    lm[1, 20:] = False  # padding
    lm[2] = False  # no response at all
    return lm


@pytest.mark.parametrize("num_anchors", [3, 8, 40])
def test_sample_anchors_follow_the_rules(num_anchors):
    lm = _loss_mask(num_anchors)
    gens = [torch.Generator().manual_seed(i) for i in range(lm.shape[0])]
    anchors, valid = sample_anchors(lm, num_anchors, gens)
    assert anchors.shape == valid.shape == (lm.shape[0], num_anchors)
    for b in range(lm.shape[0]):
        cands = [i for i in range(lm.shape[1] - 1) if lm[b, i] and lm[b, i + 1]]
        k = min(num_anchors, len(cands))
        assert valid[b].tolist() == [True] * k + [False] * (num_anchors - k)
        picked = anchors[b, :k].tolist()
        assert picked == sorted(set(picked)) and set(picked) <= set(cands)
        assert anchors[b, k:].tolist() == [0] * (num_anchors - k)
        if k == len(cands):
            assert picked == cands


def test_a_samples_anchors_depend_only_on_its_own_generator():
    lm = _loss_mask(1)
    alone = sample_anchors(lm[3:4], 5, [torch.Generator().manual_seed(77)])
    together = sample_anchors(lm, 5, [torch.Generator().manual_seed(s) for s in (1, 2, 3, 77)])
    assert torch.equal(alone[0][0], together[0][3]) and torch.equal(alone[1][0], together[1][3])
    with pytest.raises(ValueError, match="generators"):
        sample_anchors(lm, 5, [torch.Generator()])


def test_block_targets_against_a_loop():
    lm = _loss_mask(5)
    b, length = lm.shape
    ids = torch.arange(b * length).view(b, length) % 97
    batch = add_anchor_fields({"input_ids": ids, "loss_mask": lm}, 6, 5, torch.Generator().manual_seed(0))
    for i in range(b):
        for a in range(6):
            p = int(batch["anchors"][i, a])
            ok = bool(batch["anchor_valid"][i, a])
            for j in range(5):
                t = p + j + 1
                want_valid = ok and all(p + k + 1 < length and bool(lm[i, p + k + 1]) for k in range(j + 1))
                assert bool(batch["slot_valid"][i, a, j]) == want_valid
                if want_valid:
                    assert int(batch["targets"][i, a, j]) == int(ids[i, t])
                    prev = ids[i, p] if j == 0 else ids[i, t - 1]
                    assert int(batch["prev_tokens"][i, a, j]) == int(prev)
            if ok:
                assert bool(batch["slot_valid"][i, a, 0])  # an anchor always supervises its first slot


def _brute_mask(anchors, valid, ctx_len, s, owner):
    b, na = anchors.shape
    e = owner.shape[1] if owner is not None else 0
    q_len, kv_len = na * s, ctx_len + e + na * s
    out = torch.zeros(b, 1, q_len, kv_len, dtype=torch.bool)
    for i in range(b):
        for q in range(q_len):
            blk = q // s
            for kv in range(kv_len):
                if kv < ctx_len:
                    out[i, 0, q, kv] = bool(valid[i, blk]) and kv < int(anchors[i, blk])
                elif kv < ctx_len + e:
                    out[i, 0, q, kv] = bool(valid[i, blk]) and int(owner[i, kv - ctx_len]) == blk
                else:
                    out[i, 0, q, kv] = (kv - ctx_len - e) // s == blk
    return out


@pytest.mark.parametrize("with_extra", [False, True])
def test_attention_mask_against_its_definition(with_extra):
    g = torch.Generator().manual_seed(3)
    anchors = torch.tensor([[2, 5, 9, 7], [1, 4, 6, 0]])  # invalid blocks at non-zero anchors too: no context
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    owner = torch.randint(-1, 4, (2, 5), generator=g) if with_extra else None
    got = build_attention_mask(anchors, valid, 12, 3, owner, backend="dense").dense
    torch.testing.assert_close(got, _brute_mask(anchors, valid, 12, 3, owner))
    assert bool(got.any(dim=-1).all())  # every query row sees something (no NaN rows)


def test_flex_block_mask_equals_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    anchors = torch.tensor([[3, 7, 11, 0]])
    valid = torch.tensor([[True, True, True, False]])
    mod = make_mask_mod(anchors, valid, 16, 4)
    dense = dense_mask(mod, 1, 16, 32, "cpu")
    torch.testing.assert_close(create_mask(mod, 1, 1, 16, 32, device="cpu"), dense)


def test_attention_kernel_choice_is_checked_before_any_compilation(monkeypatch):
    from dspark_core.draft import attention
    from dspark_core.errors import UserError
    from dspark_core.train.trainer import TrainConfig

    with pytest.raises(UserError, match=r"train.attention_kernel must be one of auto, triton, flash; got 'fa4'"):
        attention.set_attention_kernel("fa4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"flash, but no CUDA device .*set train.attention_kernel: triton"):
        attention.set_attention_kernel("flash")
    assert attention.set_attention_kernel("auto") == "triton"  # auto: flash only where it runs
    monkeypatch.setattr(attention, "flash_unavailable", lambda: "")
    assert attention.set_attention_kernel("auto") == "flash"
    monkeypatch.setattr(attention, "flash_unavailable", lambda: "the flash-attn-4 package is not installed")
    assert attention.set_attention_kernel("auto") == "triton"
    # triton: the main flex kernel always (not the decoding one, which fails for < 128 query rows with GQA)
    assert attention.ATTENTION_KERNEL == "triton"
    assert attention.flex_kernel_options() == {"FORCE_USE_FLEX_ATTENTION": True}
    with pytest.raises(UserError, match=r"attention_kernel must be one of auto, triton, flash; got 'fa3'"):
        TrainConfig.from_dict({"attention_kernel": "fa3"})
    assert TrainConfig.from_dict({"attention_kernel": "auto"}).attention_kernel == "auto"
    # under flash every flex call gets the FLASH backend on top of the tile options
    monkeypatch.setattr(attention, "ATTENTION_KERNEL", "flash")
    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", {"BLOCK_M": 64})
    assert attention.flex_kernel_options() == {"BLOCK_M": 64, "BACKEND": "FLASH"}
