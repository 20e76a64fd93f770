"""Reduced draft vocabulary (``draft.vocab_size``): the ranking stage, the maps, the reduced draft's loss,
inference and exactness of speculative decoding with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dspark_core.draft.model import DSparkDraft
from dspark_core.draft.vocab import (DraftVocab, count_tokens, coverage, from_speculators_maps, rank_tokens,
                                     read_ranking, run_draft_vocab_stage, speculators_maps, top_ids)
from dspark_core.errors import UserError

ITEM_KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


# -- the ranking stage -----------------------------------------------------------------------------------------
def _stage_inputs(tmp_path: Path, answers: list[list[int]], vocab: int = 10) -> Path:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    (target / "fingerprint.json").write_text(json.dumps({"fingerprint": "fp-test"}))
    prompts = [[3, 3, 8]] * len(answers)  # the prompts' tokens are not counted
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(answers))], "prompt_ids": prompts,
                             "response_ids": answers}), tmp_path / "train.parquet")
    params = tmp_path / "params.yaml"
    doc = {"draft_vocab": {"report_sizes": [5, 1, 3, 11]}}
    params.write_text(json.dumps(doc))  # JSON is YAML
    return params


def _run(tmp_path: Path, params: Path) -> dict:
    return run_draft_vocab_stage(params, target_dir=tmp_path / "target", regen=tmp_path / "train.parquet",
                                 out=tmp_path / "out" / "ranking.safetensors", report=tmp_path / "report.json")


def test_ranking_counts_answers_breaks_ties_by_id_and_records_coverage(tmp_path):
    # counts: 7 x4, 2 x2, 5 x2, 9 x1, 0 x1; ties (2, 5) and (0, 9) by the smaller id; unseen ids last by id
    answers = [[7, 7, 2, 5], [7, 9, 2], [5, 7, 0]]
    params = _stage_inputs(tmp_path, answers)
    stats = _run(tmp_path, params)
    order, counts = read_ranking(tmp_path / "out" / "ranking.safetensors", 10, "fp-test")
    assert order.tolist() == [7, 2, 5, 0, 9, 1, 3, 4, 6, 8]
    assert stats["answer_tokens"] == 10 and stats["distinct_tokens"] == 5
    assert counts.tolist() == [1, 0, 2, 0, 0, 2, 0, 4, 0, 1]
    # sorted report_sizes; 11 exceeds the vocabulary
    assert [(r["vocab_size"], r["coverage"]) for r in stats["coverage"]] == [(1, 0.4), (3, 0.8), (5, 1.0)]
    assert json.loads((tmp_path / "report.json").read_text()) == stats
    assert top_ids(order, 3).tolist() == [2, 5, 7]  # ascending target ids


def test_ranking_refuses_foreign_ids_other_targets_and_bad_sizes(tmp_path):
    with pytest.raises(UserError, match="token id 12 outside the target vocabulary"):
        count_tokens([[1, 12]], 10)
    params = _stage_inputs(tmp_path, [[1, 2]])
    _run(tmp_path, params)
    path = tmp_path / "out" / "ranking.safetensors"
    with pytest.raises(UserError, match="ranking made for target fp-test"):
        read_ranking(path, 10, "another")
    with pytest.raises(UserError, match="ranking of 10 tokens, the target has 11"):
        read_ranking(path, 11)
    with pytest.raises(UserError, match="vocab_size 11 must be in"):
        top_ids(read_ranking(path, 10)[0], 11)


def test_rank_and_coverage_reference():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, size=50)
    order = rank_tokens(counts)
    ref = sorted(range(50), key=lambda t: (-counts[t], t))
    assert order.tolist() == ref
    assert coverage(counts, order, 50) == 1.0
    assert coverage(counts, order, 7) == pytest.approx(counts[ref[:7]].sum() / counts.sum())


def test_maps_round_trip_and_speculators_layout():
    vocab = DraftVocab(10, 4)
    vocab.set_ids(torch.tensor([1, 4, 5, 9]))
    assert vocab.to_target(torch.arange(4)).tolist() == [1, 4, 5, 9]
    assert vocab.to_draft(torch.tensor([1, 2, 9])).tolist() == [0, -1, 3]
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    full = vocab.expand(x, float("-inf"))
    assert full[0, [1, 4, 5, 9]].tolist() == [1.0, 2.0, 3.0, 4.0] and torch.isinf(full).sum() == 6
    offsets, mask = speculators_maps(vocab)
    assert offsets.tolist() == [1, 3, 3, 6] and mask.dtype == torch.bool and mask.nonzero().flatten().tolist() == \
        [1, 4, 5, 9]
    back = from_speculators_maps(offsets, mask, "f")  # speculators' form -> dspark's, exactly
    assert back[0].tolist() == [1, 4, 5, 9] and torch.equal(back[1], vocab.t2d)
    with pytest.raises(UserError, match="f: d2t / t2d are not one draft vocabulary: the 4 ids"):
        from_speculators_maps(offsets, mask.index_fill(0, torch.tensor([2]), True), "f")
    with pytest.raises(UserError, match="expected d2t .N. integer offsets and t2d .V. bool"):
        from_speculators_maps(offsets, mask.long(), "f")
    with pytest.raises(UserError, match="strictly ascending"):
        vocab.set_ids(torch.tensor([4, 1, 5, 9]))
    with pytest.raises(UserError, match="3 ids; the draft has draft.vocab_size 4"):
        DraftVocab(10, 4).set_ids(torch.tensor([1, 2, 3]))


# -- the reduced draft: loss against a naive reference, train == inference, save / load -------------------------
def _ids(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n].sort().values


def _naive_reduced(head_h, m, w2, lm_w, teacher_h, targets, weights, a_ce, a_l1, d2t):
    """Full-vocabulary tensors: q over V is the draft's softmax on d2t, 0 elsewhere; p the target's over V."""
    logits = head_h @ lm_w[d2t].t() + (m @ w2.t() if m is not None else 0.0)  # [N, Vd]
    q = torch.zeros(head_h.shape[0], lm_w.shape[0]).index_copy(1, d2t, torch.softmax(logits, -1))  # [N, V]
    p = torch.softmax(teacher_h @ lm_w.t(), -1)  # [N, V]
    inside = torch.isin(targets, d2t)
    ce = torch.where(inside, -torch.log(q.gather(1, targets.unsqueeze(1)).squeeze(1)), torch.zeros(()))
    l1 = (q - p).abs().sum(-1)
    return (weights * (a_ce * ce + a_l1 * l1)).sum(), ce, l1


def _distill_case(chunk: int, outside: int):
    """13 slots over a 50-token target vocabulary drafted over 20 of them; the last ``outside`` targets outside."""
    g = torch.Generator().manual_seed(chunk)
    n, v, vd, ht, r = 13, 50, 20, 16, 4
    d2t = _ids(v, vd, seed=chunk)
    vocab = DraftVocab(v, vd)
    vocab.set_ids(d2t)
    lm_w, teacher = torch.randn(v, ht, generator=g), torch.randn(n, ht, generator=g)
    targets = torch.cat([d2t[torch.randint(0, vd, (n - outside,), generator=g)],
                         torch.tensor([i for i in range(v) if i not in set(d2t.tolist())][:outside])])
    weights = torch.rand(n, generator=g)
    leaves = [torch.randn(n, ht, generator=g), torch.randn(n, r, generator=g), torch.randn(vd, r, generator=g)]
    return d2t, vocab, (lm_w, teacher, targets, weights), leaves


def _distill_runs(fns, leaves, data, with_markov: bool) -> list[list[torch.Tensor]]:
    """Each loss of ``fns`` on fresh copies of ``leaves``: [distill, ce, l1, grads of head_h, m, w2]."""
    lm_w, teacher, targets, weights = data
    results = []
    for fn in fns:
        h, m, w2 = (t.clone().requires_grad_(True) for t in leaves)
        if not with_markov:
            m = w2 = None
        distill, ce, l1 = fn(h, m, w2, lm_w, teacher, targets, weights, 0.1, 0.9)
        (1.7 * distill).backward()
        results.append([distill.detach(), ce, l1] + [t.grad for t in (h, m, w2) if t is not None])
    return results


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("with_markov", [True, False])
def test_reduced_distill_matches_the_full_vocabulary_reference(chunk, with_markov):
    from dspark_core.draft.loss import chunked_distill

    d2t, vocab, data, leaves = _distill_case(chunk, outside=4)
    results = _distill_runs(
        (lambda *a: _naive_reduced(*a, d2t),
         lambda *a: chunked_distill(*a[:5], vocab.to_draft(a[5]), *a[6:], chunk_slots=chunk, d2t=d2t)),
        leaves, data, with_markov)
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert results[1][1][-4:].eq(0).all() and results[1][2][-4:].gt(0).all()  # outside: no CE, L1 kept


def _naive_draft_teacher(head_h, m, w2, lm_w, teacher_h, targets, weights, a_ce, a_l1, d2t):
    """``teacher_vocab: draft``: the teacher's softmax over the d2t rows only, renormalised there (speculators')."""
    logits = head_h @ lm_w[d2t].t() + (m @ w2.t() if m is not None else 0.0)  # [N, Vd]
    q, p = torch.softmax(logits, -1), torch.softmax(teacher_h @ lm_w[d2t].t(), -1)  # [N, Vd] both
    t2d = torch.full((lm_w.shape[0],), -1).index_copy(0, d2t, torch.arange(len(d2t)))
    inside = t2d[targets] >= 0
    ce = torch.where(inside, -torch.log(q.gather(1, t2d[targets].clamp(min=0).unsqueeze(1)).squeeze(1)), 0.0)
    l1 = (q - p).abs().sum(-1)
    return (weights * (a_ce * ce + a_l1 * l1)).sum(), ce, l1


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("with_markov", [True, False])
def test_draft_teacher_matches_the_renormalised_brute_force(chunk, with_markov):
    from dspark_core.draft.loss import chunked_distill

    d2t, vocab, data, leaves = _distill_case(chunk, outside=3)
    ref, got, full = _distill_runs(
        (lambda *a: _naive_draft_teacher(*a, d2t),
         lambda *a: chunked_distill(*a[:5], vocab.to_draft(a[5]), *a[6:], chunk_slots=chunk, d2t=d2t,
                                    teacher_vocab="draft"),
         lambda *a: chunked_distill(*a[:5], vocab.to_draft(a[5]), *a[6:], chunk_slots=chunk, d2t=d2t)),
        leaves, data, with_markov)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (full[2] - got[2]).abs().max() > 1e-3  # the full teacher's mass outside d2t moves L1: another loss
    torch.testing.assert_close(full[1], got[1], rtol=0, atol=0)  # CE reads the draft only


def test_draft_teacher_without_a_reduced_vocabulary_is_the_full_loss():
    """``teacher_vocab: draft`` with ``draft.vocab_size`` null: the draft's vocabulary is the target's, the same
    loss to the bit (a no-op, not an error: a sweep over vocab sizes may include null)."""
    from dspark_core.draft.config import LossConfig
    from dspark_core.draft.loss import chunked_distill

    g = torch.Generator().manual_seed(3)
    n, v, ht, r = 9, 30, 8, 3
    args = [torch.randn(n, ht, generator=g), torch.randn(n, r, generator=g), torch.randn(v, r, generator=g),
            torch.randn(v, ht, generator=g), torch.randn(n, ht, generator=g), torch.randint(0, v, (n,), generator=g),
            torch.rand(n, generator=g), 0.1, 0.9, 4]
    outs = []
    for teacher_vocab in ("full", "draft"):
        h = args[0].clone().requires_grad_(True)
        d, ce, l1 = chunked_distill(h, *args[1:], teacher_vocab=teacher_vocab)
        d.backward()
        outs.append((d.detach(), ce, l1, h.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert LossConfig().teacher_vocab == "full"
    with pytest.raises(UserError, match="loss.teacher_vocab must be one of full, draft; got 'target'"):
        LossConfig.from_dict({"teacher_vocab": "target"}, src="params.yaml", prefix="loss.")
    with pytest.raises(ValueError, match="teacher_vocab must be full or draft"):
        chunked_distill(*args, teacher_vocab="Draft")


def test_teacher_vocab_reaches_the_training_loss_not_eval_offline(monkeypatch):
    """A reduced draft's training sums under ``loss.teacher_vocab: draft`` are the renormalised teacher's; the
    offline metrics (eval_offline's own LossConfig) stay against the full teacher."""
    from test_draft_model import _batch

    from dspark_core.draft import eval_offline
    from dspark_core.draft.config import LossConfig
    from dspark_core.draft.loss import slot_outputs
    from dspark_core.testing import tiny_model

    target = tiny_model("qwen3")
    draft = _reduced_draft(target)
    d2t = draft.draft_vocab.d2t
    batch = _batch(target)
    with torch.no_grad():
        h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
        m = draft.markov_features(batch["prev_tokens"], h, None)
        logits = h @ draft.draft_head_weight().t() + draft.markov.bias(draft.markov_block(m, h))  # [B, A, S, Vd]
        out = slot_outputs(draft, h, batch, LossConfig(vocab_chunk_slots=5, teacher_vocab="draft"))
        full = slot_outputs(draft, h, batch, LossConfig(vocab_chunk_slots=5))
    b, a, j = out["index"]
    teacher = batch["last_hidden"][b, batch["anchors"][b, a] + j] @ draft.lm_head_weight[d2t].t()  # [N, Vd]
    q, p = torch.softmax(logits[b, a, j], -1), torch.softmax(teacher, -1)
    torch.testing.assert_close(out["overlap"], torch.minimum(p, q).sum(-1), rtol=1e-5, atol=1e-5)
    assert (out["overlap"] > full["overlap"]).all()  # the renormalised teacher hides its outside mass
    seen = []

    def spy(draft, hidden, batch, cfg, extras=None):
        seen.append(cfg.teacher_vocab)
        return slot_outputs(draft, hidden, batch, cfg, extras)

    monkeypatch.setattr(eval_offline, "slot_outputs", spy)
    items = [{k: v[0, :int(batch["lengths"][0])] for k, v in batch.items() if k in ITEM_KEYS}]
    eval_offline.evaluate_offline(draft, items, eval_offline.EvalOfflineConfig(num_anchors=3), progress=False)
    assert seen == ["full"]  # its own loss config: the full teacher whatever the training params say


def _reduced_draft(target, vd: int = 120, seed: int = 1, **over):
    from test_draft_model import _draft

    draft = _draft(target, seed=seed, vocab_size=vd, **over)
    draft.draft_vocab.set_ids(_ids(target.config.vocab_size, vd, seed))
    return draft


@pytest.mark.parametrize("markov_head", ["vanilla", "rnn"])
def test_reduced_training_forward_equals_single_block_inference_and_offline_overlap_is_full_vocab(markov_head):
    from _draft_utils import teacher_forcing
    from test_draft_model import S, _batch

    from dspark_core.draft.config import LossConfig
    from dspark_core.draft.loss import slot_outputs
    from dspark_core.testing import tiny_model

    target = tiny_model("qwen3")
    draft = _reduced_draft(target, markov_head=markov_head)
    d2t = draft.draft_vocab.d2t
    assert draft.markov.w2.weight.shape == (120, 8) and draft.draft_head_weight().shape == (120, 64)
    batch = _batch(target)
    with torch.no_grad():
        h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
        m = draft.markov_features(batch["prev_tokens"], h, None)
        train_logits = draft.slot_logits(h) + draft.markov_bias(draft.markov_block(m, h)).float()  # [B, A, S, V]
        out = slot_outputs(draft, h, batch, LossConfig(vocab_chunk_slots=5))
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[d2t] = False
    assert torch.isinf(train_logits[..., outside]).all() and torch.isfinite(train_logits[..., d2t]).all()
    b, a, j = out["index"]
    teacher = target.lm_head(batch["last_hidden"][b, batch["anchors"][b, a] + j])  # [N, V]
    q, p = torch.softmax(train_logits[b, a, j], -1), torch.softmax(teacher, -1)  # q = 0 outside d2t
    torch.testing.assert_close(out["overlap"], torch.minimum(p, q).sum(-1), rtol=1e-5, atol=1e-5)
    assert not torch.isin(batch["targets"][b, a, j], d2t).all()  # some slot's token is outside the vocabulary
    for bb, aa in batch["anchor_valid"].nonzero().tolist()[:3]:
        pos = int(batch["anchors"][bb, aa])
        cache = draft.new_context_cache(batch=1, max_len=64)
        draft.extend_context(cache, batch["aux_hidden"][bb:bb + 1, :pos])
        seen: list = []
        anchor = batch["input_ids"][bb, pos].view(1)
        prop = draft.propose(cache, anchor, teacher_forcing(batch["targets"][bb, aa], seen))
        valid = int(batch["slot_valid"][bb, aa].sum())
        torch.testing.assert_close(torch.cat(seen)[:valid], train_logits[bb, aa, :valid], rtol=0, atol=1e-5)
        assert prop.probs[..., outside].eq(0).all() and prop.num_tokens == S


def test_reduced_draft_saves_its_maps_and_loads_them(tmp_path):
    from safetensors.torch import load_file

    from dspark_core.decoding.static_draft import draft_kernels_problem, static_draft_problem
    from dspark_core.checkpoint import load_draft, save_draft
    from dspark_core.testing import tiny_model

    target = tiny_model("qwen3")
    draft = _reduced_draft(target, vd=50, seed=3)
    save_draft(tmp_path / "d", draft)
    weights = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert weights["draft_vocab.d2t"].dtype == torch.int64 and weights["draft_vocab.d2t"].tolist() == \
        _ids(272, 50, 3).tolist()
    assert weights["draft_vocab.t2d"].shape == (272,) and weights["markov.w2.weight"].shape == (50, 8)
    back = load_draft(tmp_path / "d", target)
    assert back.draft_vocab.d2t.tolist() == draft.draft_vocab.d2t.tolist()
    torch.testing.assert_close(back.draft_vocab.t2d, draft.draft_vocab.t2d)
    assert back.cfg.vocab_size == 50 and static_draft_problem(back) is None  # the static engine
    assert "vocab" not in (draft_kernels_problem(back) or "")  # and its Triton draft path
    from dspark_core.export.common import check_exportable

    with pytest.raises(UserError, match="reduced draft vocabulary .draft.vocab_size 50.; the deepspec layout has no"):
        check_exportable(back, "deepspec")  # never an export whose W2 rows silently mean other tokens
    check_exportable(back, "speculators")  # it writes d2t / t2d (tests/test_export.py)
    from test_draft_model import _draft

    assert not any(k.startswith("draft_vocab") for k in _draft(target).own_state_dict())  # the default: no maps


def test_task_takes_the_first_n_tokens_of_the_ranking(tmp_path, capsys):
    from dspark_core.draft.config import DraftConfig, LossConfig
    from dspark_core.draft.task import DSparkTask
    from dspark_core.draft.vocab import write_ranking
    from dspark_core.testing import tiny_model

    target = tiny_model("qwen3")
    counts = np.random.default_rng(0).integers(0, 9, size=272)
    order = rank_tokens(counts)
    write_ranking(tmp_path / "r.safetensors", order, counts, None)
    cfg = DraftConfig(num_draft_layers=1, block_size=4, mask_token_id=259, num_anchors=4, markov_rank=8,
                      vocab_size=30)
    task = DSparkTask(cfg, LossConfig(), target_config=target.config,
                      embed_weight=target.get_input_embeddings().weight,
                      lm_head_weight=target.get_output_embeddings().weight, aux_layer_ids=(0, 2), train_data=[])
    task.vocab_ranking_path = tmp_path / "r.safetensors"
    draft = task.build_model(torch.device("cpu"), torch.float32).draft
    assert draft.draft_vocab.d2t.tolist() == sorted(order[:30].tolist())
    share = counts[order[:30]].sum() / counts.sum()
    assert f"the 30 most frequent of 272 tokens, {share:.2%} of the train answer tokens" in capsys.readouterr().out
    with pytest.raises(Exception, match="reranker reads W2 rows"):
        DraftConfig(kind="reranker", vocab_size=30).validate()

    from dspark_core.checkpoint import save_draft

    saved = DSparkDraft(cfg, target.config, target.get_input_embeddings().weight,
                        target.get_output_embeddings().weight, aux_layer_ids=(0, 2))
    saved.draft_vocab.set_ids(_ids(272, 30, seed=9))  # another selection than the ranking's
    save_draft(tmp_path / "saved", saved)
    task.init_checkpoint = tmp_path / "saved"  # a warm start from a saved draft keeps its own maps (and W2 rows)
    warm = task.build_model(torch.device("cpu"), torch.float32).draft
    assert warm.draft_vocab.d2t.tolist() == _ids(272, 30, seed=9).tolist()
    torch.testing.assert_close(warm.markov.w2.weight, saved.markov.w2.weight)


def test_set_ids_refuses_a_repeated_target_id():
    vocab = DraftVocab(10, 4)
    with pytest.raises(UserError, match="strictly ascending"):
        vocab.set_ids(torch.tensor([1, 4, 4, 9]))
    assert vocab.d2t.tolist() == [0, 1, 2, 3]  # nothing of the refused ids was kept
