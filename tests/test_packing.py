"""Packed training batches (``draft/packing.py``): the same loss, metrics and gradients as the padded batch of the
same samples (dense attention; flex: the forward, it has no CPU backward); rows packed first fit; bad settings
refused."""

from __future__ import annotations

import pytest
import torch

from dspark_core.cache.dataset import CacheCollator
from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.draft.loss import dspark_sums
from dspark_core.draft.model import DSparkDraft
from dspark_core.draft.packing import collate_packed, pack_rows
from dspark_core.draft.synthetic import items_from_target
from dspark_core.draft.task import draft_denominators
from dspark_core.errors import UserError
from dspark_core.testing import tiny_model

AUX = (0, 2)
S, A = 4, 5
CUTS = (0, 7, 3, 11, 0)  # ragged samples: lengths 26, 19, 23, 15, 26


@pytest.fixture(scope="module")
def setup():
    target = tiny_model("qwen3")
    items = items_from_target(target, AUX, len(CUTS), 6, 20, seed=4)
    items = [{k: v[:len(v) - c] for k, v in it.items()} if c else it for it, c in zip(items, CUTS)]
    return target, items


def _gens():
    return [torch.Generator().manual_seed(100 + i) for i in range(len(CUTS))]


def _draft(target, markov_head: str) -> DSparkDraft:
    torch.manual_seed(0)
    cfg = DraftConfig(num_draft_layers=2, block_size=S, mask_token_id=259, num_anchors=A, markov_rank=8,
                      markov_head=markov_head)
    draft = DSparkDraft(cfg, target.config, target.get_input_embeddings().weight,
                        target.get_output_embeddings().weight, aux_layer_ids=AUX)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.mul_(4.0)
    return draft


def _loss_and_grads(draft, batch, cfg: LossConfig, grads: bool = True):
    if not grads:  # flex_attention has no backward on CPU: the forward only
        with torch.no_grad():
            return (*_loss_and_grads(draft, batch, cfg, grads=True)[:3], ())
    h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"],
                            extras=batch)
    sums = dspark_sums(draft, h, batch, cfg)
    dens = draft_denominators(batch["slot_valid"], cfg.decay_gamma)
    total = (sums["distill"] + cfg.conf_alpha * sums["confidence"]) / dens["weight"]
    params = [p for p in draft.parameters() if p.requires_grad]
    return total, sums, dens, torch.autograd.grad(total, params) if torch.is_grad_enabled() else ()


@pytest.mark.parametrize("backend,markov_head", [("dense", "vanilla"), ("flex", "vanilla"), ("dense", "rnn")])
def test_packed_batch_gives_the_padded_loss_and_gradients(setup, backend, markov_head):
    target, items = setup
    padded = add_anchor_fields(CacheCollator(0)(items), A, S, _gens())
    packed = collate_packed(items, A, S, packed_length=50, generator=_gens())
    assert packed["input_ids"].shape[0] == 3 < len(items)  # 26 + 19 | 23 + 15 | 26: three rows, not five
    assert int(packed["slot_valid"].sum()) == int(padded["slot_valid"].sum()) > 0
    draft = _draft(target, markov_head)
    draft.attention_backend = backend
    cfg = LossConfig(vocab_chunk_slots=9)
    with_grads = backend == "dense"
    ref_total, ref_sums, ref_dens, ref_grads = _loss_and_grads(draft, padded, cfg, with_grads)
    total, sums, dens, grads = _loss_and_grads(draft, packed, cfg, with_grads)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total, ref_total, **tol)
    for key in ref_dens:
        torch.testing.assert_close(dens[key], ref_dens[key], **tol)
    for key in ref_sums:
        torch.testing.assert_close(sums[key], ref_sums[key], **tol, msg=key)
    names = [n for n, p in draft.named_parameters() if p.requires_grad]
    for name, g, ref in zip(names, grads, ref_grads):  # float sums in another order: relative to the scale
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=name)
    if backend == "dense" and markov_head == "vanilla":  # the check can fail: without document starts it does
        leaky = {k: v for k, v in packed.items() if k != "anchor_start"}
        assert abs(float(_loss_and_grads(draft, leaky, cfg, grads=False)[0]) - float(ref_total.detach())) > 1e-3


def test_packed_fields_stay_within_each_document(setup):
    _, items = setup
    packed = collate_packed(items, A, S, packed_length=50, generator=_gens())
    b, a = packed["anchor_valid"].nonzero(as_tuple=True)
    anchors, start = packed["anchors"][b, a], packed["anchor_start"][b, a]
    doc = packed["doc_ids"][b, anchors]  # [n] the anchor's sample
    assert (packed["doc_ids"][b, start] == doc).all() and (start <= anchors).all()
    assert (packed["position_ids"][b, anchors] == anchors - start).all()
    bs, as_, js = packed["slot_valid"].nonzero(as_tuple=True)
    pos = packed["anchors"][bs, as_] + js + 1  # the predicted token of every valid slot: same document
    assert (packed["doc_ids"][bs, pos] == packed["doc_ids"][bs, packed["anchors"][bs, as_]]).all()
    assert (packed["input_ids"][bs, pos] == packed["targets"][bs, as_, js]).all()


def test_task_collates_packed_rows_with_the_param(setup):
    from dspark_core.draft.task import DSparkTask

    target, items = setup
    cfg = DraftConfig(num_draft_layers=1, block_size=S, mask_token_id=259, num_anchors=A, markov_rank=8,
                      packed_length=64)
    task = DSparkTask(cfg, LossConfig(), target_config=target.config,
                      embed_weight=target.get_input_embeddings().weight.detach(),
                      lm_head_weight=target.get_output_embeddings().weight.detach(), aux_layer_ids=AUX,
                      train_data=items)
    batch = task.collate(items, _gens())
    want = collate_packed(items, A, S, 64, _gens(), compact=True)  # anchor_slots: compact, the default
    assert batch["input_ids"].shape[0] == 2 and set(batch) == set(want)
    for key, value in want.items():
        assert torch.equal(batch[key], value) if torch.is_tensor(value) else batch[key] == value, key


def test_compact_anchor_slots_drop_only_dummy_blocks(setup):
    """Short samples (fewer anchor positions than num_anchors): ``anchor_slots: compact`` gives narrower rows, the
    same valid slots and the fixed layout's loss and gradients, padded and packed."""
    target, items = setup
    short, many = [items[i] for i in (1, 2, 3)], 24  # 11 / 15 / 7 anchor positions < 24 anchors
    gens = lambda: _gens()[:3]  # noqa: E731
    fixed = add_anchor_fields(CacheCollator(0)(short), many, S, gens())
    compact = add_anchor_fields(CacheCollator(0)(short), many, S, gens(), compact=True)
    packed = collate_packed(short, many, S, packed_length=50, generator=gens(), compact=True)
    valid = fixed["anchor_valid"].sum(1).tolist()
    assert max(valid) < many and fixed["anchors"].shape[1] == many
    assert compact["anchors"].shape[1] == -(-max(valid) // 3) * 3 < many  # steps of ceil(24 / 8)
    assert packed["anchors"].shape[1] < collate_packed(short, many, S, 50, gens())["anchors"].shape[1]

    def slots(batch):  # every valid slot as (document, position, target)
        b, a, j = batch["slot_valid"].nonzero(as_tuple=True)
        pos = batch["anchors"][b, a] - batch.get("anchor_start", torch.zeros_like(batch["anchors"]))[b, a] + j
        doc = batch["doc_ids"][b, batch["anchors"][b, a]] if "doc_ids" in batch else b
        return sorted(zip(doc.tolist(), pos.tolist(), batch["targets"][b, a, j].tolist()))

    assert slots(compact) == slots(fixed) == slots(packed) and len(slots(fixed)) > 0
    draft = _draft(target, "vanilla")
    draft.attention_backend = "dense"
    cfg = LossConfig(vocab_chunk_slots=9)
    ref_total, _, _, ref_grads = _loss_and_grads(draft, fixed, cfg)
    for batch in (compact, packed):
        total, _, _, grads = _loss_and_grads(draft, batch, cfg)
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)
        for g, ref in zip(grads, ref_grads):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_compact_width_and_the_param():
    from dspark_core.draft.anchors import compact_width

    assert [compact_width(n, 512, 512) for n in (0, 1, 64, 65, 448, 449, 512)] == [64, 64, 64, 128, 448, 512, 512]
    assert compact_width(700, 512, 1024) == 704 and compact_width(1000, 512, 960) == 960  # packed rows: capped
    big = 10 ** 6  # past 16 steps of 64: 8 widths per doubling
    assert [compact_width(64 * u + 1, 512, big) // 64 for u in (16, 17, 31, 32, 40)] == [18, 18, 32, 36, 44]
    assert [compact_width(n, 8, 8) for n in (1, 5, 8)] == [1, 5, 8]  # num_anchors <= 8: no rounding
    assert DraftConfig().anchor_slots == "compact" and "anchor_slots" not in DraftConfig().identity_dict()
    with pytest.raises(UserError, match="anchor_slots"):
        DraftConfig.from_dict({"anchor_slots": "tight"})


def test_pack_rows_first_fit_and_settings():
    assert pack_rows([5, 3, 4, 2, 9], 8) == [[0, 1], [2, 3], [4]]  # 9 > 8: a row of its own
    assert pack_rows([1, 1, 1], 100) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="packed_length"):
        collate_packed([{"input_ids": torch.zeros(3)}], 2, 2, 0, torch.Generator())
    with pytest.raises(UserError, match="packed_length"):
        DraftConfig.from_dict({"packed_length": 0})
    with pytest.raises(UserError, match="kind baseline"):
        DraftConfig.from_dict({"packed_length": 512, "kind": "engram_markov"})
