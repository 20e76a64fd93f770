"""Every draft kind on a CUDA device (skipped without one): a few training steps through the shared trainer on the
GPU path (bf16 autocast, compiled layer step, flex attention), export + load, then greedy speculative decoding with
the reference engine on a CUDA-graph target runner, identical to AR with partial acceptance."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_core.checkpoint import load_draft
from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.draft.model import draft_kinds
from dspark_core.draft.synthetic import items_from_target
from dspark_core.draft.task import task_class
from dspark_core.testing import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

AUX = (0, 2, 4)
S = 4


@pytest.mark.parametrize("kind", draft_kinds())
def test_kind_trains_and_decodes_on_cuda(kind, tmp_path):
    from dspark_core.decoding.ar import ARDecoder
    from dspark_core.decoding.engine import SpeculativeDecoder
    from dspark_core.decoding.target_runner import TargetRunner
    from dspark_core.train.trainer import TrainConfig, train

    target = tiny_model("qwen3", vocab_size=16, eos_token_id=None, pad_token_id=None)
    items = items_from_target(target, AUX, 8, 6, 40, seed=1, token_range=16)
    cfg = DraftConfig(num_draft_layers=1, block_size=S, mask_token_id=None, num_anchors=8, markov_rank=8, kind=kind)
    task = task_class(kind)(cfg, LossConfig(), target_config=target.config,
                            embed_weight=target.get_input_embeddings().weight.detach(),
                            lm_head_weight=target.get_output_embeddings().weight.detach(), aux_layer_ids=AUX,
                            train_data=items, pad_id=0, target_fingerprint="fp-gpu")
    tcfg = TrainConfig.from_dict(dict(lr=1e-3, total_steps=4, micro_batch_size=2, global_batch_size=4,
                                      checkpoint_every=4, log_every=1, out_dir=str(tmp_path / "run"), seed=3,
                                      precision="bf16"))
    res = train(task, tcfg, progress=False)
    assert next(res.model.parameters()).is_cuda
    assert all(math.isfinite(v) for v in res.history[-1].values())
    out = task.export(res.model, tmp_path / "draft")
    model = target.cuda()
    draft = load_draft(out, model, expected_fingerprint="fp-gpu")
    assert type(draft).__name__ == type(res.model.draft).__name__
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids, cuda_graph=True,
                          graph_max_tokens=S + 1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ar = ARDecoder(runner).generate(prompt, 40)
    spec = SpeculativeDecoder(runner, draft, block_size=S).generate(prompt, 40)
    assert spec.tokens == ar.tokens
    assert 1.0 < spec.mean_accepted_length < S + 1
