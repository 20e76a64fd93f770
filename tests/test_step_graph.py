"""The whole training step replayed from a CUDA graph (``train/step_graph.py``) against the same steps run eagerly:
the losses and every weight after them bit for bit (the same kernels on the same addresses), for batches recorded
once each and for new batches of a recorded shape copied into its graph. GPU only (``scripts/gpu_tests.sh``)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config

from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.draft.model import DSparkDraft
from dspark_core.draft.synthetic import random_item
from dspark_core.draft.task import DSparkTrainModel, draft_denominators
from dspark_core.train.step_graph import CapturedStep
from dspark_core.train.trainer import clip_and_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
AUX = (1, 3, 5)
TC = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=4096)


def _setup(capturable: bool):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    lm = torch.randn(TC.vocab_size, TC.hidden_size, device=dev, dtype=torch.bfloat16) * 0.02
    cfg = DraftConfig(num_draft_layers=2, block_size=7, mask_token_id=TC.vocab_size - 1, num_anchors=16,
                      markov_rank=16, anchor_slots="compact")
    with torch.device(dev):
        draft = DSparkDraft(cfg, TC, lm, lm, aux_layer_ids=AUX)
    draft = draft.to(device=dev, dtype=torch.float32)
    draft.set_frozen_dtype(torch.bfloat16)
    model = DSparkTrainModel(draft, LossConfig(vocab_chunk_slots=32))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), fused=True, capturable=capturable)
    return model, opt, params


def _batch(length: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    item = random_item(length, TC.vocab_size, len(AUX), TC.hidden_size, prompt_len=length // 8, generator=g,
                       dtype=torch.bfloat16)
    batch = {k: v.unsqueeze(0) for k, v in item.items()}
    batch["lengths"] = torch.tensor([length])
    batch = add_anchor_fields(batch, 16, 7, g, compact=True)
    return {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in batch.items()}


def _step(model, opt, params, batch) -> torch.Tensor:
    weight = draft_denominators(batch["slot_valid"], model.loss_cfg.decay_gamma)["weight"].clamp_min(1e-12)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        sums = model(batch)
        loss = (sums["distill"] + model.loss_cfg.conf_alpha * sums["confidence"]) / weight
    loss.backward()
    clip_and_step(opt, params, 1.0)
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _tensors(batch: dict) -> tuple[list[str], list[torch.Tensor]]:
    names = sorted(k for k, v in batch.items() if torch.is_tensor(v))
    return names, [batch[k] for k in names]


def test_replayed_steps_equal_eager_steps_bit_for_bit():
    eager, opt_e, params_e = _setup(capturable=True)
    graphed, opt_g, params_g = copy.deepcopy((eager, opt_e, params_e))
    batches = [_batch(96, 1), _batch(160, 2)]
    order = [0, 1, 0, 1, 0]
    losses_e = [float(_step(eager, opt_e, params_e, batches[i])) for i in order]

    hosts = {i: {k: v for k, v in b.items() if not torch.is_tensor(v)} for i, b in enumerate(batches)}

    def run(i, *tensors):
        names, _ = _tensors(batches[i])
        return _step(graphed, opt_g, params_g, {**hosts[i], **dict(zip(names, tensors))})

    captured = CapturedStep(run, torch.device("cuda"))
    losses_g = [float(captured(i, _tensors(batches[i])[1], clone=True)) for i in order]
    assert captured.captures == 2 and captured.eager_calls == 0
    assert losses_g == losses_e
    for pe, pg in zip(params_e, params_g):
        assert torch.equal(pe, pg)


def test_a_new_batch_of_a_recorded_shape_is_copied_in_and_replayed():
    """The trainer's case: key k recorded on one batch, replayed on another of the same shapes and host values
    (here: the same anchors and teacher plan, other hidden states), whose tensors are copied into the graph's."""
    eager, opt_e, params_e = _setup(capturable=True)
    graphed, opt_g, params_g = copy.deepcopy((eager, opt_e, params_e))
    first = _batch(128, 3)
    g = torch.Generator(device="cuda").manual_seed(4)
    second = {**first, **{k: torch.randn(first[k].shape, generator=g, device="cuda").to(first[k].dtype)
                          for k in ("aux_hidden", "last_hidden")}}
    losses_e = [float(_step(eager, opt_e, params_e, b)) for b in (first, second, first)]
    assert losses_e[0] != losses_e[1]
    names, _ = _tensors(first)
    host = {k: v for k, v in first.items() if not torch.is_tensor(v)}

    def run(key, *tensors):
        return _step(graphed, opt_g, params_g, {**host, **dict(zip(names, tensors))})

    captured = CapturedStep(run, torch.device("cuda"))
    losses_g = [float(captured("L128", _tensors(b)[1], clone=True)) for b in (first, second, first)]
    assert captured.captures == 1
    assert losses_g == losses_e
    for pe, pg in zip(params_e, params_g):
        assert torch.equal(pe, pg)


def test_keys_past_the_limit_run_eagerly():
    model, opt, params = _setup(capturable=True)
    batches = [_batch(96, 5), _batch(112, 6)]
    hosts = [{k: v for k, v in b.items() if not torch.is_tensor(v)} for b in batches]

    def run(i, *tensors):
        return _step(model, opt, params, {**hosts[i], **dict(zip(_tensors(batches[i])[0], tensors))})

    captured = CapturedStep(run, torch.device("cuda"), max_graphs=1)
    for i in (0, 1, 1):
        assert torch.isfinite(captured(i, _tensors(batches[i])[1], clone=True))
    assert captured.captures == 1 and captured.eager_calls == 2
