"""DSparkTask end to end: a short training run learns, the shared trainer runs it, offline eval is exact."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark_core.cache.dataset import CacheCollator
from dspark_core.checkpoint import load_draft
from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.draft.task import DSparkTask
from dspark_core.draft.synthetic import items_from_target
from dspark_core.draft.eval_offline import EvalOfflineConfig, evaluate_offline
from dspark_core.metrics import overlap
from dspark_core.testing import tiny_model

AUX = [0, 2, 4]


@pytest.fixture(scope="module")
def setup():
    target = tiny_model("qwen3")
    train_items = items_from_target(target, AUX, 24, 6, 34, seed=1)
    eval_items = items_from_target(target, AUX, 6, 6, 34, seed=2)
    return target, train_items, eval_items


def _task(target, items, **over) -> DSparkTask:
    cfg = DraftConfig(**{**dict(num_draft_layers=1, block_size=4, mask_token_id=259, num_anchors=16, markov_rank=16),
                         **over})
    return DSparkTask(cfg, LossConfig(), target_config=target.config,
                      embed_weight=target.get_input_embeddings().weight.detach(),
                      lm_head_weight=target.get_output_embeddings().weight.detach(), aux_layer_ids=AUX,
                      train_data=items, pad_id=0, target_fingerprint="fp-test")


def _step_loss(task, sums, dens):
    return sum(spec.weight * sums[name] / dens[spec.denominator] for name, spec in task.terms.items())


def _ranked_task(target, items, vocab_size: int, tmp_path) -> DSparkTask:
    """A task with ``draft.vocab_size``: the ranking (as the draft_vocab stage makes it) of the items' answers."""
    from dspark_core.draft.vocab import count_tokens, rank_tokens, write_ranking

    counts = count_tokens([it["input_ids"][it["loss_mask"].bool()].tolist() for it in items], target.config.vocab_size)
    write_ranking(tmp_path / "ranking.safetensors", rank_tokens(counts), counts, "fp-test")
    task = _task(target, items, vocab_size=vocab_size)
    task.vocab_ranking_path = tmp_path / "ranking.safetensors"
    return task


@pytest.mark.parametrize("vocab_size", [None, 192])
def test_short_training_run_lowers_loss_and_raises_tau_prob(setup, vocab_size, tmp_path):
    """``vocab_size`` 192: a reduced draft vocabulary (92% of the answer tokens), its tau_prob still measured
    against the full teacher."""
    target, train_items, eval_items = setup
    task = _task(target, train_items) if vocab_size is None else _ranked_task(target, train_items, vocab_size,
                                                                              tmp_path)
    torch.manual_seed(0)
    model = task.build_model(torch.device("cpu"), torch.float32)
    ecfg = EvalOfflineConfig(batch_size=3, seed=5, num_anchors=16)
    before = evaluate_offline(model.draft, eval_items, ecfg, progress=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(40):
        idx = [(step * 4 + i) % len(train_items) for i in range(4)]
        batch = task.collate([train_items[i] for i in idx], [torch.Generator().manual_seed(step * 10 + i) for i in idx])
        dens = task.denominators(batch)
        sums = task.forward_sums(model, batch)
        loss = _step_loss(task, sums, dens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    after = evaluate_offline(model.draft, eval_items, ecfg, progress=False)
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5
    assert after["tau_prob"] > before["tau_prob"] + 0.2
    assert after["ce"] < before["ce"]
    assert after["num_blocks"] == before["num_blocks"] > 0


def test_denominators_and_metric_keys(setup):
    target, items, _ = setup
    task = _task(target, items)
    batch = task.collate(items[:3], [torch.Generator().manual_seed(i) for i in range(3)])
    dens = task.denominators(batch)
    sv = batch["slot_valid"]
    want = sum(math.exp(-j / 4.0) for (_, _, j) in sv.nonzero().tolist())
    assert float(dens["weight"]) == pytest.approx(want, rel=1e-6)
    assert int(dens["blocks"]) == int(batch["anchor_valid"].sum())
    assert [int(dens[f"tokens@{i}"]) for i in range(4)] == sv.sum(dim=(0, 1)).tolist()
    model = task.build_model(torch.device("cpu"), torch.float32)
    sums = task.forward_sums(model, batch)
    assert set(task.terms) == {"distill", "confidence"}
    assert set(task.metric_denominators) == {"ce", "l1", "conf", "tau_prob"} | {f"accept_rate@{i}" for i in range(4)}
    assert set(task.terms) | set(task.metric_denominators) <= set(sums)
    assert set(task.metric_denominators.values()) | {"weight"} <= set(dens)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_shared_trainer_runs_the_task_and_export_loads(setup, tmp_path, param_dtype):
    from dspark_core.train.trainer import TrainConfig, train

    target, items, _ = setup
    task = _task(target, items[:8])
    cfg = TrainConfig.from_dict(dict(lr=1e-3, total_steps=3, micro_batch_size=2, global_batch_size=4,
                                     checkpoint_every=3, log_every=1, out_dir=str(tmp_path / "run"), seed=3,
                                     param_dtype=param_dtype))
    res = train(task, cfg, progress=False)
    row = res.history[-1]
    for key in ("loss", "distill", "confidence", "ce", "l1", "conf", "tau_prob", "accept_rate@0", "accept_rate@3"):
        assert math.isfinite(row[key]), key
    assert 1.0 <= row["tau_prob"] <= 5.0
    out = task.export(res.model, tmp_path / "draft")
    loaded = load_draft(out, target, expected_fingerprint="fp-test")
    assert res.model.draft.fc.weight.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[param_dtype]
    torch.testing.assert_close(loaded.fc.weight, res.model.draft.fc.weight.float())


def test_dflash_trains_with_the_distillation_term_alone(setup, tmp_path):
    """The dflash variant (no Markov head, no confidence head) through the shared trainer and its export."""
    from dspark_core.train.trainer import TrainConfig, train

    target, items, _ = setup
    task = _task(target, items[:8], **DFLASH)
    assert set(task.terms) == {"distill"} and "conf" not in task.metric_denominators
    cfg = TrainConfig.from_dict(dict(lr=1e-3, total_steps=2, micro_batch_size=2, global_batch_size=4,
                                     checkpoint_every=2, log_every=1, out_dir=str(tmp_path / "run"), seed=3))
    res = train(task, cfg, progress=False)
    row = res.history[-1]
    assert math.isfinite(row["loss"]) and row["loss"] == pytest.approx(row["distill"], rel=1e-6)
    assert "confidence" not in row and 1.0 <= row["tau_prob"] <= 5.0
    draft = load_draft(task.export(res.model, tmp_path / "draft"), target, expected_fingerprint="fp-test")
    assert draft.markov is None and draft.confidence is None
    assert not any(k.startswith(("markov.", "confidence.")) for k in draft.own_state_dict())


def _brute_force_metrics(draft, items, ecfg: EvalOfflineConfig):
    """Every valid block through the *inference* path, full-vocabulary distributions, Python sums."""
    gen = torch.Generator().manual_seed(ecfg.seed)
    tau, blocks, acc, cnt, ce, conf_err = 0.0, 0, [0.0] * 4, [0] * 4, 0.0, []
    for start in range(0, len(items), ecfg.batch_size):
        batch = add_anchor_fields(CacheCollator(0)(items[start:start + ecfg.batch_size]), ecfg.num_anchors, 4, gen)
        for b, a in batch["anchor_valid"].nonzero().tolist():
            p = int(batch["anchors"][b, a])
            cache = draft.new_context_cache(batch=1, max_len=64)
            draft.extend_context(cache, batch["aux_hidden"][b:b + 1, :p])
            h = draft.forward_block(cache, batch["input_ids"][b, p].view(1))[0]  # [S, H]
            blocks += 1
            prod, t, state = 1.0, 1.0, None
            for j in range(4):
                if not batch["slot_valid"][b, a, j]:
                    break
                m = draft.markov_features(batch["prev_tokens"][b, a, j].view(1), h[j : j + 1], None)  # [1, r] | None
                logits = draft.slot_logits(h[j])
                if m is not None:
                    u, state = draft.markov_step(m, h[j : j + 1], state)
                    logits = logits + draft.markov_bias(u)[0].float()
                q = torch.softmax(logits, -1)
                pt = torch.softmax(draft.slot_logits(batch["last_hidden"][b, p + j]), -1)
                aj = float(overlap(pt, q))
                prod *= aj
                t += prod
                acc[j] += aj
                cnt[j] += 1
                ce -= float(torch.log(q[batch["targets"][b, a, j]]))
                conf = draft.confidence_logits(h[j : j + 1], m)
                if conf is not None:
                    conf_err.append(float(torch.sigmoid(conf[0])) - aj)
            tau += t
    n = sum(cnt)
    conf_ok = bool(conf_err)
    return {"tau_prob": tau / blocks, **{f"accept_rate@{j}": acc[j] / cnt[j] for j in range(4)}, "ce": ce / n,
            "conf_mae": sum(abs(e) for e in conf_err) / n if conf_ok else None,
            "conf_bias": sum(conf_err) / n if conf_ok else None, "num_blocks": blocks, "num_tokens": n}


DFLASH = {"markov_head": "none", "confidence_head": False}  # the dflash variant of params.yaml


@pytest.mark.parametrize("over", [{}, {"markov_head": "rnn"}, DFLASH], ids=["vanilla", "rnn", "dflash"])
def test_evaluate_offline_matches_brute_force_and_writes_outputs(setup, tmp_path, over):
    target, _, eval_items = setup
    task = _task(target, eval_items, **over)
    torch.manual_seed(4)
    draft = task.build_model(torch.device("cpu"), torch.float32).draft
    ecfg = EvalOfflineConfig(batch_size=4, seed=11, num_anchors=5, calibration_bins=4)
    res = evaluate_offline(draft, eval_items, ecfg, metrics_path=tmp_path / "m.json", plots_dir=tmp_path / "plots",
                           chunk_slots=7, progress=False)
    keys = ["tau_prob"] + [f"accept_rate@{i}" for i in range(4)] + ["ce", "conf_mae", "conf_bias", "num_blocks",
                                                                    "num_tokens"]
    assert sorted(json.loads((tmp_path / "m.json").read_text())) == sorted(keys) == sorted(res)
    with torch.no_grad():
        brute = _brute_force_metrics(draft, eval_items, ecfg)
    for k in keys:
        if brute[k] is None:  # no confidence head: no calibration figures
            assert res[k] is None, k
            continue
        assert res[k] == pytest.approx(brute[k], rel=1e-5, abs=1e-6), k
    for name in ("accept_rate.png", "confidence_reliability.png", "accept_rate.json", "confidence_reliability.json"):
        assert (tmp_path / "plots" / name).stat().st_size > 0
    assert (tmp_path / "plots" / "accept_rate.png").read_bytes()[:4] == b"\x89PNG"
    again = evaluate_offline(draft, eval_items, ecfg, progress=False)
    assert {k for k, v in again.items() if v is None} == {k for k, v in res.items() if v is None}
    assert {k: v for k, v in again.items() if v is not None} == pytest.approx(
        {k: v for k, v in res.items() if v is not None}, rel=1e-6)  # same anchors (sums may differ in the last bits)
