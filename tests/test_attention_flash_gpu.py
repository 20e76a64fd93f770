"""``train.attention_kernel: flash`` (FlashAttention-4 through flex_attention) against torch's Triton flex kernels
and a float32 dense reference, on each mask the draft builds: blocks over their context prefix (with invalid
anchors), Draft Memory's owned extra entries, packed rows (a block sees its own document only); then a few training
steps of a DSpark draft under each kernel. Needs a Hopper / Blackwell GPU with flash-attn-4 (scripts/gpu_tests.sh);
skipped elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_core.draft import attention
from dspark_core.draft.attention import attend, build_attention_mask, flash_unavailable

pytestmark = pytest.mark.skipif(bool(flash_unavailable()), reason=f"flash attention: {flash_unavailable()}")

HQ, HKV, D, S = 4, 2, 128, 7


@pytest.fixture
def kernel():
    """Set train.attention_kernel for one test; back to triton afterwards."""
    yield attention.set_attention_kernel
    attention.set_attention_kernel("triton")


def _mask_inputs(case: str, g: torch.Generator):
    """anchors [B, A], valid [B, A], context length, extra_owner [B, E] | None, anchor_start [B, A] | None."""
    batch, num_anchors, ctx = 2, 40, 640  # 280 query rows, not a multiple of the 128-row tiles
    anchors = torch.stack([torch.randperm(ctx - S - 2, generator=g)[:num_anchors].sort().values + 1
                           for _ in range(batch)])
    valid = torch.ones(batch, num_anchors, dtype=torch.bool)
    valid[1, -5:] = False  # dummy blocks: they see only themselves
    owner = start = None
    if case == "memory":
        owner = torch.randint(-1, num_anchors, (batch, 96), generator=g)  # -1: an entry no block owns
    if case == "packed":  # documents of 200 positions: a block sees [start of its document, anchor)
        start = anchors // 200 * 200
    return anchors, valid, ctx, owner, start


@pytest.mark.parametrize("case", ["blocks", "memory", "packed"])
def test_flash_matches_triton_and_the_dense_reference(case, kernel):
    g = torch.Generator().manual_seed(0)
    anchors, valid, ctx, owner, start = _mask_inputs(case, g)
    dev = torch.device("cuda")
    anchors, valid = anchors.to(dev), valid.to(dev)
    owner = owner.to(dev) if owner is not None else None
    start = start.to(dev) if start is not None else None
    batch, q_len = anchors.shape[0], anchors.shape[1] * S
    kv_len = ctx + (owner.shape[1] if owner is not None else 0) + q_len
    q = torch.randn(batch, HQ, q_len, D, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(batch, HKV, kv_len, D, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(batch, HKV, kv_len, D, generator=g).to(dev, torch.bfloat16)
    do = torch.randn(batch, HQ, q_len, D, generator=g).to(dev, torch.bfloat16)

    def run(backend: str, dtype: torch.dtype):
        mask = build_attention_mask(anchors, valid, ctx, S, owner, backend=backend, anchor_start=start)
        qq, kk, vv = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))  # fresh leaves: no grad carried over
        out = attend(qq, kk, vv, mask, D ** -0.5)
        out.backward(do.to(dtype))
        return [t.float() for t in (out.detach(), qq.grad, kk.grad, vv.grad)]

    ref = run("dense", torch.float32)
    kernel("triton")
    tri = run("flex", torch.bfloat16)
    kernel("flash")
    fla = run("flex", torch.bfloat16)
    for name, r, t, f in zip(("out", "dq", "dk", "dv"), ref, tri, fla):
        err_t, err_f = (t - r).abs().max().item(), (f - r).abs().max().item()
        assert err_f <= 2 * err_t + 1e-3, f"{name}: flash {err_f:.3g} vs triton {err_t:.3g} off the fp32 reference"


def test_a_dspark_draft_trains_alike_under_both_kernels(tmp_path, kernel):
    from dspark_core.draft.config import DraftConfig, LossConfig
    from dspark_core.draft.synthetic import items_from_target
    from dspark_core.draft.task import task_class
    from dspark_core.testing import tiny_model
    from dspark_core.train.trainer import TrainConfig, train

    aux = (0, 1, 2)
    target = tiny_model("qwen3", vocab_size=64, eos_token_id=None, pad_token_id=None, hidden_size=256,
                        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, num_hidden_layers=4)
    items = items_from_target(target, aux, 8, 6, 120, seed=1, token_range=64)
    losses = {}
    for choice in ("triton", "flash"):
        kernel(choice)
        cfg = DraftConfig(num_draft_layers=1, block_size=S, mask_token_id=None, num_anchors=16, markov_rank=8)
        task = task_class(cfg.kind)(cfg, LossConfig(), target_config=target.config,
                                    embed_weight=target.get_input_embeddings().weight.detach(),
                                    lm_head_weight=target.get_output_embeddings().weight.detach(), aux_layer_ids=aux,
                                    train_data=items, pad_id=0, target_fingerprint="fp-flash")
        tcfg = TrainConfig.from_dict(dict(lr=1e-3, total_steps=3, micro_batch_size=2, global_batch_size=2,
                                          checkpoint_every=3, log_every=1, out_dir=str(tmp_path / choice), seed=3,
                                          precision="bf16", attention_kernel=choice))
        res = train(task, tcfg, progress=False)
        losses[choice] = [row["loss"] for row in res.history]
        assert all(math.isfinite(x) for x in losses[choice])
    # the same batches and initial weights: the first step's loss agrees to bf16 rounding of the attention
    assert losses["flash"][0] == pytest.approx(losses["triton"][0], rel=2e-2)
