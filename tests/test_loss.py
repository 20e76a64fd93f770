"""The chunked DSpark loss against a naive full-vocabulary reference: values and gradients (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark_core.cache.dataset import CacheCollator
from dspark_core.draft import loss as loss_mod
from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.draft.loss import chunked_distill, dspark_sums, slot_weights
from dspark_core.draft.model import DSparkDraft
from dspark_core.draft.synthetic import items_from_target
from dspark_core.metrics import overlap, tau_prob_per_block
from dspark_core.testing import tiny_model

TOL = dict(rtol=1e-5, atol=1e-5)


def _naive_distill(head_h, m, w2, lm_w, teacher_h, targets, weights, a_ce, a_l1):
    logits = head_h @ lm_w.t() + (m @ w2.t() if m is not None else 0.0)  # [N, V] all at once
    q = torch.softmax(logits, -1)
    p = torch.softmax(teacher_h @ lm_w.t(), -1)
    ce = F.cross_entropy(logits, targets, reduction="none")
    l1 = (q - p).abs().sum(-1)
    return (weights * (a_ce * ce + a_l1 * l1)).sum(), ce, l1


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("with_markov", [True, False])
def test_chunked_distill_matches_naive_values_and_grads(chunk, with_markov):
    g = torch.Generator().manual_seed(chunk)
    n, v, ht, r = 13, 50, 16, 4
    lm_w = torch.randn(v, ht, generator=g)
    teacher = torch.randn(n, ht, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    weights = torch.rand(n, generator=g)
    leaves = [torch.randn(n, ht, generator=g), torch.randn(n, r, generator=g), torch.randn(v, r, generator=g) * 0.5]
    results = []
    for fn in (_naive_distill, lambda *a: chunked_distill(*a, chunk_slots=chunk)):
        h, m, w2 = (t.clone().requires_grad_(True) for t in leaves)
        if not with_markov:
            m = w2 = None
        distill, ce, l1 = fn(h, m, w2, lm_w, teacher, targets, weights, 0.1, 0.9)
        (1.7 * distill).backward()
        grads = [t.grad for t in (h, m, w2) if t is not None]
        results.append((distill.detach(), ce.detach(), l1.detach(), grads))
    (d0, ce0, l10, g0), (d1, ce1, l11, g1) = results
    torch.testing.assert_close(d1, d0, **TOL)
    torch.testing.assert_close(ce1, ce0, **TOL)
    torch.testing.assert_close(l11, l10, **TOL)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, **TOL)


def test_chunks_never_hold_more_than_vocab_chunk_slots(monkeypatch):
    rows = []

    def spy(device):
        def math(logits, *args):
            rows.append(logits.shape[0])
            return loss_mod.chunk_math(logits, *args)
        return math

    monkeypatch.setattr(loss_mod, "_math_fn", spy)
    h = torch.randn(23, 8, requires_grad=True)
    out = chunked_distill(h, None, None, torch.randn(40, 8), torch.randn(23, 8), torch.zeros(23, dtype=torch.long),
                          torch.ones(23), 0.1, 0.9, chunk_slots=10)
    out[0].backward()
    assert rows == [10, 10, 3]


def test_chunked_distill_refuses_a_trainable_lm_head():
    with pytest.raises(ValueError, match="frozen"):
        chunked_distill(torch.randn(2, 4), None, None, torch.randn(5, 4, requires_grad=True), torch.randn(2, 4),
                        torch.zeros(2, dtype=torch.long), torch.ones(2), 0.1, 0.9, 4)


def _naive_dspark_total(draft, batch, cfg: LossConfig):
    """The whole objective with full-vocabulary tensors for every slot (DeepSpec's way)."""
    h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
    m = draft.markov_features(batch["prev_tokens"], h, None)  # [B, A, S, r]
    logits = h @ draft.lm_head_weight.t() + draft.markov_block(m, h) @ draft.markov.w2.weight.t()  # [B, A, S, V]
    tpos = batch["anchors"].unsqueeze(-1) + torch.arange(h.shape[2])  # [B, A, S]
    teacher_h = torch.stack([batch["last_hidden"][b][tpos[b].clamp(max=batch["input_ids"].shape[1] - 1)]
                             for b in range(h.shape[0])])  # [B, A, S, Ht]
    q, p = torch.softmax(logits, -1), torch.softmax(teacher_h @ draft.lm_head_weight.t(), -1)
    ce = F.cross_entropy(logits.flatten(0, 2), batch["targets"].flatten(), reduction="none").view_as(tpos)
    l1 = (q - p).abs().sum(-1)
    a = overlap(p, q).detach()  # sum_v min(p, q) = 1 - 0.5 L1
    w = slot_weights(batch["slot_valid"], cfg.decay_gamma)
    conf = F.binary_cross_entropy_with_logits(draft.confidence_logits(h, m), a, reduction="none")
    den = w.sum()
    total = (cfg.ce_alpha * (w * ce).sum() + cfg.l1_alpha * (w * l1).sum() + cfg.conf_alpha * (w * conf).sum()) / den
    tau = (tau_prob_per_block(a, batch["slot_valid"]) * batch["slot_valid"][..., 0]).sum()
    return total, {"ce": (w * ce).sum(), "l1": (w * l1).sum(), "conf": (w * conf).sum(), "tau_prob": tau}, den


@pytest.mark.parametrize("markov_head", ["vanilla", "gated", "rnn"])
def test_dspark_sums_match_the_naive_objective_on_a_draft(markov_head):
    target = tiny_model("qwen3")
    torch.manual_seed(0)
    cfg_d = DraftConfig(num_draft_layers=2, block_size=4, mask_token_id=259, num_anchors=6, markov_rank=8,
                        markov_head=markov_head)
    draft = DSparkDraft(cfg_d, target.config, target.get_input_embeddings().weight,
                        target.get_output_embeddings().weight, aux_layer_ids=[0, 3])
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.mul_(4.0)
    items = items_from_target(target, [0, 3], 3, 5, 15, seed=3)
    batch = add_anchor_fields(CacheCollator(0)(items), 6, 4, torch.Generator().manual_seed(1))
    cfg = LossConfig(vocab_chunk_slots=7)
    params = [p for p in draft.parameters() if p.requires_grad]

    total_ref, sums_ref, den = _naive_dspark_total(draft, batch, cfg)
    grads_ref = torch.autograd.grad(total_ref, params)

    h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
    sums = dspark_sums(draft, h, batch, cfg)
    total = (sums["distill"] + cfg.conf_alpha * sums["confidence"]) / den
    grads = torch.autograd.grad(total, params)

    torch.testing.assert_close(total, total_ref, **TOL)
    for key in ("ce", "l1", "conf", "tau_prob"):
        torch.testing.assert_close(sums[key], sums_ref[key], **TOL)
    for (name, _), a, b in zip([(n, p) for n, p in draft.named_parameters() if p.requires_grad], grads, grads_ref):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_no_grad_path_gives_the_same_statistics():
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(9, 8, generator=g), torch.randn(9, 3, generator=g), torch.randn(30, 3, generator=g),
            torch.randn(30, 8, generator=g), torch.randn(9, 8, generator=g), torch.randint(0, 30, (9,), generator=g),
            torch.rand(9, generator=g), 0.1, 0.9, 4)
    with torch.no_grad():
        d0, ce0, l10 = chunked_distill(*args)
    d1, ce1, l11 = chunked_distill(args[0].requires_grad_(True), *args[1:])
    torch.testing.assert_close((d1.detach(), ce1, l11), (d0, ce0, l10), rtol=0, atol=0)


def _brute_teacher_positions(batch):
    b, a, j = batch["slot_valid"].nonzero(as_tuple=True)
    return torch.stack([b, batch["anchors"][b, a] + j])  # [2, N] (row, position) of every valid slot


@pytest.mark.parametrize("packed", [False, True])
def test_teacher_fields_list_each_position_once_and_plan_covers_every_chunk(packed):
    from dspark_core.draft.packing import collate_packed

    target = tiny_model("qwen3")
    items = items_from_target(target, [0, 3], 4, 6, 24, seed=5)
    gen = torch.Generator().manual_seed(2)
    batch = (collate_packed(items, 9, 4, 64, gen) if packed
             else add_anchor_fields(CacheCollator(0)(items), 9, 4, gen))
    rows, index, plan = batch["teacher_rows"], batch["teacher_index"], batch["teacher_plan"]
    want = _brute_teacher_positions(batch)
    assert torch.equal(rows[:, index], want)  # every slot reads its own position
    assert rows.shape[1] == len({tuple(c) for c in want.t().tolist()}) < want.shape[1]  # once each, fewer rows
    n = index.shape[0]
    for chunk in (1, 3, 7, n):
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            lo, hi = plan.rows(s, e)
            assert lo <= int(index[s:e].min()) and int(index[s:e].max()) < hi
            assert hi - lo <= e - s + 2 * 4  # a chunk's teacher rows: at most its slots plus a block each side


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("vocab_mode", ["full", "reduced", "reduced_draft_teacher"])
def test_chunked_distill_shared_teacher_rows_match_per_slot_rows(chunk, vocab_mode):
    """Teacher rows read through teacher_index (each unique position once) == one teacher row per slot."""
    from dspark_core.draft.anchors import TeacherPlan

    g = torch.Generator().manual_seed(chunk)
    n, u, v, ht, r = 17, 9, 60, 16, 4
    d2t = torch.randperm(v, generator=g)[:25].sort().values if vocab_mode != "full" else None
    index = torch.cat([torch.arange(u), torch.randint(0, u, (n - u,), generator=g)]).sort().values  # [N]
    lm_w = torch.randn(v, ht, generator=g)
    teacher_u = torch.randn(u, ht, generator=g)
    targets = torch.randint(0, v if d2t is None else 25, (n,), generator=g)
    weights = torch.rand(n, generator=g)
    leaves = [torch.randn(n, ht, generator=g), torch.randn(n, r, generator=g),
              torch.randn(v if d2t is None else 25, r, generator=g) * 0.5]
    kw = dict(chunk_slots=chunk, d2t=d2t, teacher_vocab="draft" if vocab_mode == "reduced_draft_teacher" else "full")
    results = []
    for shared in (False, True):
        h, m, w2 = (t.clone().requires_grad_(True) for t in leaves)
        extra = dict(teacher_index=index, plan=TeacherPlan(index)) if shared else {}
        teacher = teacher_u if shared else teacher_u[index]
        distill, ce, l1 = chunked_distill(h, m, w2, lm_w, teacher, targets, weights, 0.1, 0.9, **kw, **extra)
        distill.backward()
        results.append([distill.detach(), ce, l1, h.grad, m.grad, w2.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="teacher_index and plan"):
        chunked_distill(*leaves[:3], lm_w, teacher_u, targets, weights, 0.1, 0.9, chunk_slots=4, teacher_index=index)


def test_teacher_rows_made_for_other_anchors_are_refused():
    """A hook that moves anchors after the collate but keeps its teacher rows: an error, not a wrong teacher."""
    target = tiny_model("qwen3")
    torch.manual_seed(0)
    cfg_d = DraftConfig(num_draft_layers=1, block_size=4, mask_token_id=259, num_anchors=6, markov_rank=8)
    draft = DSparkDraft(cfg_d, target.config, target.get_input_embeddings().weight,
                        target.get_output_embeddings().weight, aux_layer_ids=[0, 3])
    items = items_from_target(target, [0, 3], 3, 5, 15, seed=3)
    batch = add_anchor_fields(CacheCollator(0)(items), 6, 4, torch.Generator().manual_seed(1))
    h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
    dspark_sums(draft, h, batch, LossConfig(vocab_chunk_slots=5))  # as collated: fine
    moved = dict(batch, anchors=batch["anchors"] - batch["anchor_valid"].long())  # every valid anchor one back
    with pytest.raises(RuntimeError, match="TEACHER_KEYS"):
        dspark_sums(draft, h, moved, LossConfig(vocab_chunk_slots=5))


def test_slot_weights_are_the_seeds_position_decay():
    """Pinned values of the seed's decay exp(-i / 4) on valid slots (the loss references above reuse
    ``slot_weights``, so its formula is pinned here on its own)."""
    valid = torch.tensor([[True, True, True, False], [True, False, False, False]])
    want = torch.tensor([[1.0, 0.7788007831, 0.6065306597, 0.0], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(slot_weights(valid, 4.0), want, rtol=0, atol=1e-7)
