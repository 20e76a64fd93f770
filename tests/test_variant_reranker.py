"""Prefix reranker (seed 000): training scores == single-block inference, zero-init greedy equivalence with the
baseline, the rank loss and the offline metrics against brute-force loops, the frozen-baseline warm start
(only reranker weights move, cumulative-step curves), parameter counts at seed shapes, and the online engine
(greedy identical to AR with partial acceptance; sampling keeps the target's distribution, chi-square)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _draft_utils import seed000_param_counts, teacher_forcing
from dspark_core.cache.dataset import CacheCollator
from dspark_core.checkpoint import load_draft, save_draft
from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.draft.config import DraftConfig, LossConfig, RerankerConfig
from dspark_core.draft.model import DSparkDraft, build_draft
from dspark_core.draft.synthetic import items_from_target
from dspark_core.draft.task import DSparkTask, task_class
from dspark_core.draft.variants.reranker import RerankerTask, keep_dspark_on_ties, top_candidates
from dspark_core.draft.eval_offline import EvalOfflineConfig, evaluate_offline
from dspark_core.metrics import overlap
from dspark_core.testing import tiny_model

from _decoding_utils import chisquare_pvalue

AUX = (0, 2, 4)
S = 4
SMALL = RerankerConfig(top_k=5, width=16, num_heads=2, ffn_size=32)


def _cfg(**over) -> DraftConfig:
    base = dict(num_draft_layers=2, block_size=S, mask_token_id=259, num_anchors=6, markov_rank=8, kind="reranker",
                reranker=SMALL)
    return DraftConfig(**{**base, **over})


def _draft(model, seed: int = 1, perturb: bool = True, **over):
    torch.manual_seed(seed)
    d = build_draft(_cfg(**over), model.config, model.get_input_embeddings().weight,
                    model.get_output_embeddings().weight, aux_layer_ids=AUX)
    if perturb:
        _perturb(d)
    return d.eval()


def _perturb(draft) -> None:
    """A non-zero W_o and a large W_c (E_out is small at init), so the reranker changes choices."""
    with torch.no_grad():
        draft.reranker.w_o.weight.normal_(0.0, 3.0)
        draft.reranker.w_c.weight.normal_(0.0, 30.0)


_ITEMS: dict = {}


def _items(model, n=3, seed=0):
    key = (model.config.model_type, model.config.vocab_size, n, seed)
    if key not in _ITEMS:
        items = items_from_target(model, AUX, n, 5, 19, seed=seed, token_range=min(256, model.config.vocab_size))
        items[1] = {k: v[:-4] for k, v in items[1].items()}  # ragged
        _ITEMS[key] = items
    return _ITEMS[key]


def _batch(model, anchors=4, seed=0, n=3):
    return add_anchor_fields(CacheCollator(0)(_items(model, n, seed)), anchors, S, torch.Generator().manual_seed(seed))


def _greedy(seen: list):
    def sample_fn(logits):
        seen.append(logits.clone())
        return logits.argmax(-1), torch.softmax(logits, -1)

    return sample_fn


def _block(draft, batch, b, a):
    p = int(batch["anchors"][b, a])
    cache = draft.new_context_cache(batch=1, max_len=64)
    draft.extend_context(cache, batch["aux_hidden"][b:b + 1, :p])
    return cache, batch["input_ids"][b, p].view(1), p


# -- training scores == single-block inference --------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_training_scores_equal_single_block_inference(family):
    target = tiny_model(family)
    draft = _draft(target)
    batch = draft.prepare_batch(_batch(target))
    with torch.no_grad():
        h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"],
                                extras=batch)
        out = draft.rank_outputs(h, batch)
    assert (out["scores"] - out["dspark"]).abs().max() > 0.1  # the residual is live
    row = {tuple(i): n for n, i in enumerate(out["index"].t().tolist())}
    checked = 0
    for b, a in batch["anchor_valid"].nonzero().tolist():
        cache, anchor, _ = _block(draft, batch, b, a)
        seen: list = []
        draft.propose(cache, anchor, teacher_forcing(batch["targets"][b, a], seen))
        for j in range(int(batch["slot_valid"][b, a].sum())):
            n = row[(b, a, j)]
            got = seen[j][0]  # [V]: s on the candidates, -inf elsewhere
            assert torch.isfinite(got).sum() == SMALL.top_k
            assert set(torch.isfinite(got).nonzero().view(-1).tolist()) == set(out["candidates"][n].tolist())
            torch.testing.assert_close(got[out["candidates"][n]], out["scores"][n], rtol=0, atol=1e-5)
            checked += 1
    assert checked > 20


def test_candidates_and_teacher_argmax_in_one_precision_under_autocast():
    """prepare_batch runs under the trainer's bf16 autocast; its candidates, teacher argmax and teacher
    probabilities equal those that decoding's logits (slot_logits + markov_bias, no autocast) give on the same
    states, and rank_outputs' l_i on the candidates equals those logits."""
    target = tiny_model("qwen3")
    draft = _draft(target)
    raw = _batch(target, anchors=6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        batch = draft.prepare_batch(raw)
        h = draft.forward_train(raw["input_ids"], raw["aux_hidden"], raw["anchors"], raw["anchor_valid"],
                                extras=raw)  # the states prepare_batch scored: [B, A, S, H]
        m = draft.markov_features(raw["prev_tokens"], h, raw)
        out = draft.rank_outputs(h, batch)
    b, a, j = batch["slot_valid"].bool().nonzero(as_tuple=True)
    with torch.no_grad():
        logits = draft.slot_logits(h[b, a, j]) + draft.markov_bias(m[b, a, j])  # [N, V] what propose scores
        teacher = torch.softmax(draft.slot_logits(batch["last_hidden"][b, batch["anchors"][b, a] + j]), -1)
    cand = top_candidates(logits, SMALL.top_k)
    assert torch.equal(batch["rank_candidates"][b, a, j], cand)
    assert torch.equal(batch["rank_target"][b, a, j], teacher.argmax(-1))
    torch.testing.assert_close(batch["rank_teacher_p"][b, a, j], teacher.gather(-1, cand), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["dspark"], logits.gather(-1, cand), rtol=1e-6, atol=1e-5)
    assert logits.dtype == teacher.dtype == torch.float32 and len(b) > 30


def test_prefix_kv_grows_in_the_block_and_is_cleared_each_cycle():
    target = tiny_model("qwen3")
    draft = _draft(target)
    batch = _batch(target)
    cache, anchor, _ = _block(draft, batch, 0, 0)
    lengths = []
    inner = draft.reranker.encoder.forward

    def spy(emb, start=0, kv=None):
        lengths.append((emb.shape[1], start, 0 if kv is None else kv[0].shape[2]))
        return inner(emb, start, kv)

    draft.reranker.encoder.forward = spy
    first = draft.propose(cache, anchor, _greedy([]))
    second = draft.propose(cache, anchor, _greedy([]))  # a new cycle: the block's K/V starts over
    assert lengths == [(1, 0, 0), (1, 1, 1), (1, 2, 2), (1, 3, 3)] * 2
    assert torch.equal(first.tokens, second.tokens)
    # the incremental encoder equals the causal one over the whole prefix
    prefix = torch.cat([anchor, first.tokens[0]]).view(1, -1)[:, :S]  # the last chosen token is never encoded
    full, _ = inner(draft.markov.features(prefix))
    state = None
    for i in range(S):
        r, state = inner(draft.markov.features(prefix[:, i:i + 1]), i, state if i else None)
        torch.testing.assert_close(r[:, 0], full[:, i], rtol=0, atol=1e-6)


def test_prefix_kv_is_keyed_by_path_across_tree_branches():
    """Breadth-first over a tree (siblings at one depth, then their children): each r_i equals a fresh causal
    encoding of that very path, though the cache last held a sibling's prefix of the same length."""
    target = tiny_model("qwen3")
    draft = _draft(target).eval()
    a, x, z, y, w = 3, 5, 7, 11, 13
    paths = [[a], [a, x], [a, z], [a, x, y], [a, z, w], [a, x, w], [a, x, y, z], [a, z, w, y], [a, x, y, w]]
    with torch.no_grad():
        for path in paths:
            prefix = torch.tensor([path, path[:1] + path[1:][::-1]])  # [2, slot+1]: two rows, two paths
            got = draft._block_prefix_state(prefix, prefix.shape[1] - 1)  # [2, w]
            want, _ = draft.reranker.encoder(draft.markov.features(prefix))  # [2, slot+1, w]
            torch.testing.assert_close(got, want[:, -1], rtol=0, atol=1e-6, msg=f"path {path}")


# -- zero-init equivalence ----------------------------------------------------------------------------------
def _baseline_with_same_weights(model, variant):
    cfg = DraftConfig(**{**variant.cfg.to_dict(), "kind": "baseline", "reranker": SMALL})
    base = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                       aux_layer_ids=AUX)
    missing, unexpected = base.load_state_dict(variant.state_dict(), strict=False)
    assert not missing and unexpected and all(k.startswith("reranker.") for k in unexpected)
    return base.eval()


def test_zero_init_greedy_equals_baseline():
    target = tiny_model("qwen3")
    draft = _draft(target, perturb=False)
    assert not draft.reranker.w_o.weight.any()
    base = _baseline_with_same_weights(target, draft)
    batch = _batch(target)
    for b, a in batch["anchor_valid"].nonzero().tolist():
        cache, anchor, _ = _block(draft, batch, b, a)
        mine = draft.propose(cache, anchor, _greedy([]))
        theirs = base.propose(cache, anchor, _greedy([]))
        assert torch.equal(mine.tokens, theirs.tokens)
        torch.testing.assert_close(mine.confidence, theirs.confidence, rtol=0, atol=0)
    res = evaluate_offline(draft, _items(target), EvalOfflineConfig(batch_size=2, num_anchors=4), progress=False)
    assert res["rerank_target_agreement_gain"] == 0 and res["rerank_teacher_forced_prefix_gain"] == 0


def test_ties_resolve_toward_the_dspark_choice():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, -1.0]])
    cand = top_candidates(logits, 3)
    assert 1 in cand[0].tolist() and set(cand[0].tolist()) <= {1, 3, 4}
    many = torch.zeros(1, 10)  # more tied maxima than candidates: the DSpark argmax (0) is kept
    assert 0 in top_candidates(many, 3)[0].tolist()
    scores = torch.tensor([[2.0, 5.0, 5.0]])
    cand = torch.tensor([[7, 3, 9]])
    bumped = keep_dspark_on_ties(scores, cand, torch.tensor([9]))
    assert bumped.argmax(-1).item() == 2 and bumped[0, 2] > 5.0 and bumped[0, :2].tolist() == [2.0, 5.0]
    assert torch.equal(keep_dspark_on_ties(scores, cand, torch.tensor([7])), scores)  # not at the top: no change


# -- the rank loss --------------------------------------------------------------------------------------------
def _task(target, items, cls=RerankerTask, init_checkpoint=None, freeze_base=False, **over) -> DSparkTask:
    cfg = _cfg(num_draft_layers=1, num_anchors=6, **over)
    return cls(cfg, LossConfig(), target_config=target.config,
               embed_weight=target.get_input_embeddings().weight.detach(),
               lm_head_weight=target.get_output_embeddings().weight.detach(), aux_layer_ids=AUX, train_data=items,
               pad_id=0, target_fingerprint="fp-test", init_checkpoint=init_checkpoint, freeze_base=freeze_base)


def _prefix_state(draft, prefix: list[int]) -> torch.Tensor:
    """r of the last position of ``prefix``, from the encoder run on that prefix alone (so causality is checked)."""
    r, _ = draft.reranker.encoder(draft.markov.features(torch.tensor([prefix])))
    return r[0, -1]


def _brute_force_rank_loss(draft, batch, top_k, gamma=4.0):
    num = den = 0.0
    rr = draft.reranker
    hidden = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
    for b, a, j in batch["slot_valid"].nonzero().tolist():
        p = int(batch["anchors"][b, a])
        h = hidden[b, a, j]
        prev = batch["prev_tokens"][b, a]
        l = draft.slot_logits(h) + draft.markov_bias(draft.markov.features(prev[j])).float()  # [V]
        cand = set(torch.topk(l, top_k).indices.tolist())
        v_star = int(torch.softmax(draft.slot_logits(batch["last_hidden"][b, p + j]), -1).argmax())
        if v_star not in cand:
            continue
        r = _prefix_state(draft, prev[:j + 1].tolist())
        u = rr.w_o(F.silu(rr.w_q(torch.cat([rr.w_h(h), r])))).double()
        scores = {v: float(l[v]) + float(u @ rr.w_c(draft.markov.w2.weight[v]).double()) / math.sqrt(SMALL.width)
                  for v in cand}
        z = math.log(sum(math.exp(s) for s in scores.values()))
        w = math.exp(-j / gamma)
        num += w * (z - scores[v_star])
        den += w
    return num, den


def test_rank_loss_against_brute_force():
    target = tiny_model("qwen3")
    items = _items(target)
    wide = RerankerConfig(top_k=64, width=16, num_heads=2, ffn_size=32)  # an untrained draft: some hits
    task = _task(target, items, reranker=wide)
    torch.manual_seed(0)
    model = task.build_model(torch.device("cpu"), torch.float32)
    _perturb(model.draft)
    batch = task.collate(items, [torch.Generator().manual_seed(i) for i in range(3)])
    batch = task.prepare_step(model, [batch])[0]
    dens = task.denominators(batch)
    sums = task.forward_sums(model, batch)
    with torch.no_grad():
        num, den = _brute_force_rank_loss(model.draft, batch, 64)
    assert den > 0 and int(batch["rank_hit"].sum()) < int(batch["slot_valid"].sum())  # some hit, some miss
    assert float(dens["rank_weight"]) == pytest.approx(den, rel=1e-6)
    assert float(sums["rank"].detach()) == pytest.approx(num, rel=1e-4)
    assert set(task.terms) == {"distill", "confidence", "rank"}
    assert set(task.terms) | set(task.metric_denominators) <= set(sums)
    # no hit at all: the term is zero (and has a gradient of zero), not NaN
    from dspark_core.train.trainer import _combine

    batch["rank_hit"] = torch.zeros_like(batch["rank_hit"])
    dens = task.denominators(batch)
    sums = task.forward_sums(model, batch)
    assert float(sums["rank"].detach()) == 0 and float(dens["rank_weight"]) == 0
    loss = _combine(task, sums, {k: v.double() for k, v in dens.items()})
    loss.backward()
    assert math.isfinite(float(loss.detach())) and not model.draft.reranker.w_o.weight.grad.any()


# -- offline metrics -------------------------------------------------------------------------------------------
def _brute_force_offline(draft, items, ecfg):
    """Every valid block through the inference path (greedy and the reranked logits from propose), Python sums."""
    gen = torch.Generator().manual_seed(ecfg.seed)
    acc = dict(tau=0.0, tau0=0.0, blocks=0, tokens=0, hit=0, agree=0, agree0=0, pre=0, pre0=0)
    for start in range(0, len(items), ecfg.batch_size):
        batch = add_anchor_fields(CacheCollator(0)(items[start:start + ecfg.batch_size]), ecfg.num_anchors, S, gen)
        for b, a in batch["anchor_valid"].nonzero().tolist():
            cache, anchor, p = _block(draft, batch, b, a)
            h = draft.forward_block(cache, anchor)[0]
            seen: list = []
            draft.propose(cache, anchor, teacher_forcing(batch["targets"][b, a], seen))
            acc["blocks"] += 1
            t = t0 = prod = prod0 = 1.0
            run = run0 = True
            for j in range(S):
                if not batch["slot_valid"][b, a, j]:
                    break
                ref = int(batch["targets"][b, a, j])
                prev = batch["prev_tokens"][b, a, j]
                l = draft.slot_logits(h[j]) + draft.markov_bias(draft.markov.features(prev)).float()
                pt = torch.softmax(draft.slot_logits(batch["last_hidden"][b, p + j]), -1)
                v_star = int(pt.argmax())
                s = seen[j][0]
                prod *= float(overlap(pt, torch.softmax(s, -1)))
                prod0 *= float(overlap(pt, torch.softmax(l, -1)))
                t, t0 = t + prod, t0 + prod0
                acc["tokens"] += 1
                acc["hit"] += int(bool(torch.isfinite(s[v_star])))
                acc["agree"] += int(int(s.argmax()) == v_star)
                acc["agree0"] += int(int(l.argmax()) == v_star)
                run, run0 = run and int(s.argmax()) == ref, run0 and int(l.argmax()) == ref
                acc["pre"] += int(run)
                acc["pre0"] += int(run0)
            acc["tau"] += t
            acc["tau0"] += t0
    return acc


def test_offline_metrics_against_brute_force(tmp_path):
    target = tiny_model("qwen3")
    draft = _draft(target, reranker=RerankerConfig(top_k=64, width=16, num_heads=2, ffn_size=32))
    items = _items(target, n=5, seed=3)
    ecfg = EvalOfflineConfig(batch_size=2, seed=5, num_anchors=5)
    res = evaluate_offline(draft, items, ecfg, progress=False, metrics_path=tmp_path / "m.json")
    with torch.no_grad():
        bf = _brute_force_offline(draft, items, ecfg)
    n, blocks = bf["tokens"], bf["blocks"]
    assert res["num_blocks"] == blocks and res["num_tokens"] == n
    want = {"tau_prob": bf["tau"] / blocks, "tau_prob_before_rerank": bf["tau0"] / blocks,
            "rerank_tau_gain": (bf["tau"] - bf["tau0"]) / blocks, "candidate_recall": bf["hit"] / n,
            "target_agreement": bf["agree"] / n, "target_agreement_before_rerank": bf["agree0"] / n,
            "rerank_target_agreement_gain": (bf["agree"] - bf["agree0"]) / n,
            "teacher_forced_prefix": bf["pre"] / blocks, "teacher_forced_prefix_before_rerank": bf["pre0"] / blocks,
            "rerank_teacher_forced_prefix_gain": (bf["pre"] - bf["pre0"]) / blocks}
    for key, value in want.items():
        assert res[key] == pytest.approx(value, abs=1e-5), key
    assert res["rerank_tau_gain"] != 0 and res["target_agreement"] != res["target_agreement_before_rerank"]
    assert 0 < res["candidate_recall"] < 1
    assert (tmp_path / "m.json").is_file()


# -- training: the joint variant learns, the frozen one moves only the reranker -----------------------------------
def test_frozen_warm_start_trains_only_the_reranker(tmp_path):
    from safetensors.torch import load_file

    from dspark_core.train.run import JsonLive
    from dspark_core.train.trainer import TrainConfig, train

    target = tiny_model("qwen3")
    items = items_from_target(target, AUX, 8, 5, 24, seed=4)
    conf = dict(lr=3e-3, total_steps=2, micro_batch_size=2, global_batch_size=4, checkpoint_every=1, log_every=1,
                warmup_ratio=0.0, seed=3)
    base_task = _task(target, items, cls=DSparkTask, kind="baseline")
    train(base_task, TrainConfig.from_dict({**conf, "out_dir": str(tmp_path / "baseline")}), progress=False)
    ckpt = tmp_path / "baseline/checkpoints/step_00000002"
    base_w = load_file(str(ckpt / "model.safetensors"))

    task = _task(target, items, init_checkpoint=ckpt, freeze_base=True)
    torch.manual_seed(3)  # the trainer's seed: the same initial reranker as in train()
    init = task.build_model(torch.device("cpu"), torch.float32)
    trainable = {k for k, p in init.named_parameters() if p.requires_grad}
    assert trainable and all(k.startswith("draft.reranker.") for k in trainable)
    init_state = {k: v.clone() for k, v in init.state_dict().items()}
    for k, v in base_w.items():
        assert torch.equal(init_state[k], v), k  # the backbone, Markov and confidence heads are the baseline's
    live = JsonLive(str(tmp_path / "report"))
    res = train(task, TrainConfig.from_dict({**conf, "out_dir": str(tmp_path / "frozen")}), live=live,
                progress=False, log_step_offset=2)
    after = res.model.state_dict()
    moved = {k for k in after if not torch.equal(after[k], init_state[k])}
    assert "draft.reranker.w_o.weight" in moved and moved <= trainable
    assert all(math.isfinite(r["rank"]) for r in res.history) and res.history[-1]["rank"] > 0
    import json

    assert json.loads((tmp_path / "report/metrics.json").read_text())["step"] == 4  # cumulative steps
    assert (tmp_path / "report/plots/metrics/train/rank.tsv").read_text().split("\n")[1].startswith("3\t")
    saved = load_file(str(tmp_path / "frozen/checkpoints/step_00000002/model.safetensors"))
    assert set(saved) == trainable  # the run's own checkpoints hold the reranker only
    out = task.export(res.model, tmp_path / "final")
    back = load_draft(out, target)
    assert type(back).__name__ == "RerankerDraft"
    torch.testing.assert_close(back.reranker.w_o.weight, res.model.draft.reranker.w_o.weight)


def test_joint_training_lowers_the_rank_loss():
    target = tiny_model("qwen3")
    items = items_from_target(target, AUX, 12, 5, 24, seed=6)
    task = _task(target, items)
    assert task_class("reranker") is RerankerTask and task_class("baseline") is DSparkTask
    torch.manual_seed(0)
    model = task.build_model(torch.device("cpu"), torch.float32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    fixed = task.collate(items[:4], [torch.Generator().manual_seed(i) for i in range(4)])
    ranks = []
    for step in range(25):
        batch = task.prepare_step(model, [dict(fixed)])[0]
        dens = task.denominators(batch)
        sums = task.forward_sums(model, batch)
        loss = sum(spec.weight * sums[k] / dens[spec.denominator].clamp_min(1e-12)
                   for k, spec in task.terms.items())
        loss.backward()
        grads = model.draft.fc.weight.grad
        assert grads is not None and grads.any()  # joint: the backbone trains too
        opt.step()
        opt.zero_grad(set_to_none=True)
        ranks.append(float(sums["rank"].detach() / dens["rank_weight"]))
    assert sum(ranks[-3:]) < 0.7 * sum(ranks[:3])


# -- parameter counts at seed shapes -----------------------------------------------------------------------------
def test_seed000_parameter_counts():
    w, r, ffn, hid = 256, 256, 1024, 2560
    encoder = r * w + 7 * w + 2 * w + (w * 3 * w + 3 * w) + (w * w + w) + 2 * w + (w * ffn + ffn) + (ffn * w + w) \
        + 2 * w
    scorer = hid * w + (2 * w * w + w) + w * w + r * w
    base, counts = seed000_param_counts("reranker")
    assert counts["variant"] == encoder + scorer == 1_775_360
    assert counts["draft"] - base["draft"] == counts["variant"]


def test_bad_reranker_params_are_named(tmp_path):
    from dspark_core.config import ParamsError

    with pytest.raises(ParamsError, match="draft.reranker.width .* must be a multiple of num_heads"):
        DraftConfig.from_dict({"reranker": {"width": 10, "num_heads": 4}}, prefix="draft.")
    with pytest.raises(ParamsError, match="kind reranker needs a Markov head"):
        DraftConfig.from_dict({"kind": "reranker", "markov_head": "none", "confidence_with_markov": False},
                              prefix="draft.")
    with pytest.raises(ParamsError, match="loss.rank_alpha"):
        LossConfig.from_dict({"rank_alpha": -1}, prefix="loss.")
    from dspark_core.draft.config import WarmStartConfig

    with pytest.raises(ParamsError, match="freeze_base needs from_variant or from_dir"):
        WarmStartConfig.from_dict({"freeze_base": True}, prefix="warm_start.")
    with pytest.raises(ParamsError, match="step needs from_variant"):
        WarmStartConfig.from_dict({"step": 3, "from_dir": "d"}, prefix="warm_start.")
    with pytest.raises(ParamsError, match="from_variant or from_dir, not both"):
        WarmStartConfig.from_dict({"from_variant": "baseline", "from_dir": "d"}, prefix="warm_start.")
    target = tiny_model("qwen3")
    task = _task(target, [], init_checkpoint=tmp_path / "nope")
    with pytest.raises(ValueError, match="nope/model.safetensors not found"):
        task.build_model(torch.device("cpu"), torch.float32)


def test_save_load_round_trip(tmp_path):
    target = tiny_model("qwen3")
    draft = _draft(target)
    save_draft(tmp_path / "d", draft)
    back = load_draft(tmp_path / "d", target)
    torch.testing.assert_close(back.reranker.w_o.weight, draft.reranker.w_o.weight)
    assert back.cfg.reranker == SMALL


# -- online: the reference engine -------------------------------------------------------------------------------
def _online_draft(model, top_k=4):
    torch.manual_seed(0)
    cfg = DraftConfig(num_draft_layers=1, block_size=S, mask_token_id=None, num_anchors=4, markov_rank=8,
                      kind="reranker", reranker=RerankerConfig(top_k=top_k, width=16, num_heads=2, ffn_size=32))
    draft = build_draft(cfg, model.config, model.get_input_embeddings().weight,
                        model.get_output_embeddings().weight, aux_layer_ids=AUX).eval()
    _perturb(draft)
    return draft


def test_online_greedy_identical_to_ar_with_partial_acceptance(one_thread):
    from dspark_core.decoding.ar import ARDecoder
    from dspark_core.decoding.engine import SpeculativeDecoder
    from dspark_core.decoding.static_draft import static_draft_problem
    from dspark_core.decoding.target_runner import TargetRunner

    model = tiny_model("qwen3", vocab_size=16, eos_token_id=None, pad_token_id=None)
    draft = _online_draft(model)
    assert "score_candidates" in static_draft_problem(draft)  # the static engine refuses it (the bench says why)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ar = ARDecoder(runner).generate(prompt, 40)
    cycles = []
    draft.set_variant_timing(True)
    res = SpeculativeDecoder(runner, draft, block_size=S, on_cycle=cycles.append).generate(prompt, 40)
    assert res.tokens == ar.tokens
    assert 1.0 < res.mean_accepted_length < S + 1
    assert any(c.num_accepted < c.num_proposed for c in cycles) and any(c.num_accepted > 0 for c in cycles)
    assert draft.variant_timers()["reranker"] > 0


def _sampled_tokens(model, draft, prompt, draws, misreport=False):
    """``draws`` x the first 3 output tokens under temperature 1 (token 1 from prefill, 2 and 3 from a cycle) and the
    largest support of a proposal's q. ``misreport``: verification gets the full-vocabulary DSpark softmax as q
    (the seed's greedy-only interface used for sampling), not the reranked distribution the tokens come from."""
    from dspark_core.decoding.engine import SpeculativeDecoder
    from dspark_core.decoding.sampling import SamplingParams
    from dspark_core.decoding.target_runner import TargetRunner

    runner = TargetRunner(model, max_len=32, aux_layer_ids=draft.aux_layer_ids)
    supports, before = [], []
    inner_score, inner_propose = draft.score_candidates, draft.propose

    def score(logits, *args):
        before.append(torch.softmax(logits, -1))
        return inner_score(logits, *args)

    def propose(*args, **kwargs):
        before.clear()
        prop = inner_propose(*args, **kwargs)
        supports.append(int((prop.probs[0] > 0).sum(-1).max()))
        if misreport:
            prop.probs = torch.stack(before, dim=1)[:, :prop.num_tokens]
        return prop

    draft.score_candidates, draft.propose = score, propose
    spec = SpeculativeDecoder(runner, draft, block_size=S, sampling=SamplingParams(temperature=1.0), seed=11)
    out = np.array([spec.generate(prompt, 3).tokens[:3] for _ in range(draws)])  # [draws, 3]
    return out, max(supports)


def _pair_pvalues(model, prompt, out):
    """p-values of (t1, t2) against p(t1) p(t2 | t1) and, for the likeliest t1, of (t2, t3) against the target."""
    with torch.no_grad():
        def next_dist(seq):
            return torch.softmax(model(torch.tensor([seq])).logits[0, -1].double(), -1)

        p1 = next_dist(prompt)  # [V]
        p2 = torch.stack([next_dist(prompt + [t]) for t in range(16)])  # [V, V]
        t1 = int(p1.argmax())
        p3 = torch.stack([next_dist(prompt + [t1, t]) for t in range(16)])
    first = chisquare_pvalue(out[:, 0] * 16 + out[:, 1], (p1.unsqueeze(1) * p2).numpy().ravel())
    rows = out[out[:, 0] == t1]
    second = chisquare_pvalue(rows[:, 1] * 16 + rows[:, 2], (p2[t1].unsqueeze(1) * p3).numpy().ravel())
    return first, second


DRAWS = 1000  # sampled outputs of each run of the chi-square test below


def test_sampling_with_the_reranked_proposal_keeps_the_target_distribution(one_thread):
    """Exact rejection sampling with the reranked q (top 4 of 16, W_o random; zero outside the candidates) keeps
    the target's distribution under temperature 1; the same test, on as many draws, rejects verifying with the
    pre-rerank q (its p-value ~2e-9 at DRAWS; ~6e-7 at 800, 2e-23 at 1,500)."""
    model = tiny_model("qwen3", vocab_size=16, eos_token_id=None, pad_token_id=None)
    prompt = [3, 1, 4, 1, 5]
    out, support = _sampled_tokens(model, _online_draft(model), prompt, DRAWS)
    assert support <= 4
    assert min(_pair_pvalues(model, prompt, out)) > 1e-3
    wrong, _ = _sampled_tokens(model, _online_draft(model), prompt, DRAWS, misreport=True)
    assert min(_pair_pvalues(model, prompt, wrong)) < 1e-6  # power


# -- params.yaml / dvc.yaml --------------------------------------------------------------------------------------
@pytest.mark.workspace("the project's params.yaml: its variant groups against dvc.yaml")
def test_params_variant_groups_match_the_dag(tmp_path):
    """``variant_dag`` splits ``variants`` into ``scratch`` (train@) and ``warm`` (train_warm@, whose warm-start
    source is a dep); exactly the warm ones have a warm_start, and check_variant_dag refuses a mismatch."""
    from pathlib import Path

    import yaml

    from dspark_core.config import ParamsError
    from dspark_core.draft.stage import variant_configs
    from dspark_core.variants import check_variant_dag

    root = Path(__file__).resolve().parent.parent
    params = yaml.safe_load((root / "params.yaml").read_text())
    scratch, warm = params["variant_dag"]["scratch"], params["variant_dag"]["warm"]
    assert set(params["variants"]) == set(scratch) | set(warm) and not set(scratch) & set(warm)
    assert all("warm_start" not in (params["variants"][v] or {}) for v in scratch)
    assert all(params["variants"][v]["warm_start"]["from_variant"] == src in scratch for v, src in warm.items())
    check_variant_dag(root / "params.yaml")
    dvc = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    assert dvc["train"]["foreach"] == "${variant_dag.scratch}"
    assert dvc["train_warm"]["foreach"] == "${variant_dag.warm}"
    assert "data/train/${item}" in dvc["train_warm"]["do"]["deps"]
    assert dvc["eval_offline"]["foreach"] == dvc["bench_online"]["foreach"] == "${variants}"
    frozen = params["variants"]["reranker_frozen"]["warm_start"]
    assert frozen["freeze_base"] and (frozen["step"] is None or frozen["step"] <= params["train"]["max_steps"])
    bad = dict(params, variant_dag={"scratch": scratch, "warm": {"reranker_frozen": "engram_markov"}})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ParamsError, match="variant_dag.warm.reranker_frozen"):
        check_variant_dag(tmp_path / "p.yaml")
    bad = dict(params, variant_dag={"scratch": scratch[1:], "warm": warm})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ParamsError, match="'baseline' must be in exactly one"):
        check_variant_dag(tmp_path / "p.yaml")
    draft, loss, _ = variant_configs(root / "params.yaml", "reranker_joint")
    assert draft.kind == "reranker" and draft.reranker.top_k == 16 and draft.reranker.width == 256
    assert loss.rank_alpha == 1.0


def test_warm_start_checkpoint_resolution(tmp_path, monkeypatch):
    import yaml

    from dspark_core.config import ParamsError
    from dspark_core.draft.stage import warm_start_checkpoint

    monkeypatch.chdir(tmp_path)
    params = tmp_path / "params.yaml"
    variants = {"baseline": {}, "warm": {"warm_start": {"from_variant": "baseline", "step": 2, "freeze_base": True}},
                "latest": {"warm_start": {"from_variant": "baseline"}},
                "self": {"warm_start": {"from_variant": "self"}}}
    params.write_text(yaml.safe_dump({"variants": variants}))
    assert warm_start_checkpoint(params, "baseline")[1:] == (None, 0)
    with pytest.raises(ValueError, match=r"step_00000002 not found \(kept: none\)"):
        warm_start_checkpoint(params, "warm")
    with pytest.raises(ValueError, match="run `dvc repro train@baseline` first"):
        warm_start_checkpoint(params, "latest")
    with pytest.raises(ParamsError, match="names the variant itself"):
        warm_start_checkpoint(params, "self")
    root = tmp_path / "data/train/baseline/checkpoints"
    for step in (1, 2):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}/model.safetensors").write_bytes(b"")
    (root / "latest.json").write_text('{"step": 1, "dir": "step_00000001"}')
    warm, ckpt, step = warm_start_checkpoint(params, "warm")
    assert warm.freeze_base and step == 2 and ckpt == root.relative_to(tmp_path) / "step_00000002"
    assert warm_start_checkpoint(params, "latest")[2] == 1


def test_warm_start_from_a_saved_draft_dir(tmp_path, monkeypatch):
    """``warm_start.from_dir``: a draft saved by an earlier run (``config.json`` + ``model.safetensors``, e.g. carried
    from another machine) starts the training model with exactly its weights, at curve step 0; a draft of another
    target is refused naming its config.json; a dir that is not a saved draft is refused naming the param."""
    import yaml

    from dspark_core.draft.stage import warm_start_checkpoint

    target = tiny_model("qwen3")
    items = items_from_target(target, AUX, 8, 5, 24, seed=4)
    torch.manual_seed(5)
    first = _task(target, items, cls=DSparkTask, kind="baseline")
    saved = first.export(first.build_model(torch.device("cpu"), torch.float32), tmp_path / "final")
    monkeypatch.chdir(tmp_path)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"variants": {"baseline": {"warm_start": {"from_dir": str(saved)}},
                                                   "bad": {"warm_start": {"from_dir": str(tmp_path)}}}}))
    warm, ckpt, step = warm_start_checkpoint(params, "baseline")
    assert ckpt == saved and step == 0 and warm.from_dir == str(saved)
    with pytest.raises(ValueError, match=r"variants.bad.warm_start.from_dir .*: not a saved draft"):
        warm_start_checkpoint(params, "bad")
    torch.manual_seed(6)  # another initialisation: every draft weight must come from the saved dir
    model = _task(target, items, cls=DSparkTask, kind="baseline", init_checkpoint=ckpt).build_model(
        torch.device("cpu"), torch.float32)
    own = load_draft(saved, target, expected_fingerprint="fp-test").own_state_dict()
    state = model.draft.own_state_dict()
    assert set(own) == set(state)
    for k, v in own.items():
        assert torch.equal(state[k], v), k
    other = _task(target, items, cls=DSparkTask, kind="baseline", init_checkpoint=ckpt)
    other.target_fingerprint = "fp-other"
    with pytest.raises(ValueError, match=r"final/config.json: draft trained on target fingerprint fp-test"):
        other.build_model(torch.device("cpu"), torch.float32)


def test_matched_prefix_counts_only_the_leading_run_of_each_block():
    """rerank_teacher_forced_prefix_gain's count against a loop: per block, the chosen tokens that equal the
    targets from slot 0 on, stopping at the first miss (a later match does not count)."""
    from dspark_core.draft.variants.reranker import _matched_prefix

    targets = torch.tensor([[[5, 6, 7, 8], [1, 2, 3, 4]], [[9, 9, 9, 9], [4, 3, 2, 1]]])  # [B, A, S]
    sv = torch.tensor([[[1, 1, 1, 1], [1, 1, 1, 0]], [[1, 1, 0, 0], [0, 0, 0, 0]]], dtype=torch.bool)
    idx = sv.nonzero(as_tuple=True)
    choice = torch.tensor([5, 0, 7, 8, 1, 2, 3, 0, 9])  # one per valid slot, in idx order
    per_slot, want = dict(zip(zip(*(t.tolist() for t in idx)), choice.tolist())), 0
    for b in range(2):
        for a in range(2):
            for j in range(4):
                if not sv[b, a, j] or per_slot[(b, a, j)] != int(targets[b, a, j]):
                    break
                want += 1
    assert want == 4
    assert int(_matched_prefix(choice, idx, {"slot_valid": sv, "targets": targets})) == want


def test_reranker_training_candidate_recall_is_the_hit_share_of_valid_slots():
    from dspark_core.dist import Dist
    from dspark_core.train.trainer import _step_metrics

    target = tiny_model("qwen3")
    items = items_from_target(target, AUX, 4, 5, 24, seed=6)
    task = _task(target, items)
    torch.manual_seed(0)
    model = task.build_model(torch.device("cpu"), torch.float32)
    batch = task.collate(items, [torch.Generator().manual_seed(i) for i in range(4)])
    with torch.no_grad():
        batch = task.prepare_step(model, [batch])[0]
        dens, sums = task.denominators(batch), task.forward_sums(model, batch)
    row = _step_metrics(task, {k: v.detach() for k, v in sums.items()}, dens, Dist(), torch.device("cpu"))
    hits = batch["rank_hit"][batch["slot_valid"].bool()].float()
    assert 0 < float(hits.mean()) < 1
    assert row["candidate_recall"] == pytest.approx(float(hits.mean()), rel=1e-6)
