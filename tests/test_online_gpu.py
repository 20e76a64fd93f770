"""The online target on CUDA (``scripts/gpu_tests.sh``; skipped without a GPU): filling a batch reads nothing back
to the host (so the trainer queues the next step's target forward while the draft's step runs), the states it gives
against a store the cache stage built on the same GPU in bf16, and the trainer runs online on the device."""

from __future__ import annotations

import pytest
import torch

from dspark_core.cache import CacheCollator, CacheConfig, CacheDataset, build_store
from dspark_core.cache.capture import capture_padded
from dspark_core.cache.online import OnlineCollator, OnlineTarget
from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.draft.task import DSparkTask
from dspark_core.target import load_target, read_fingerprint, write_fingerprint
from dspark_core.testing import save_tiny_target, write_regen
from dspark_core.train.trainer import TrainConfig, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LAYERS = (-1, 0, 2, 4)
LENGTHS = [(12, 30), (40, 70), (5, 0), (20, 20), (33, 64), (8, 9), (60, 50), (15, 3), (25, 25), (3, 40)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_online")
    target = save_tiny_target(root / "target", "qwen3")
    write_fingerprint(target)
    regen = write_regen(root / "regen" / "train.parquet", LENGTHS)
    model, _ = load_target(target, dtype="bfloat16", device="cuda")
    cfg = CacheConfig(aux_layer_ids=LAYERS, max_length=96, chunk_tokens=256, batch_tokens=200, dtype="bfloat16",
                      device="cuda", target_dir=str(target), splits=("train",))
    store = root / "train.zarr"
    build_store(model, read_fingerprint(target)["fingerprint"], cfg, regen, store)
    return target, store, model


def test_fill_reads_nothing_back_to_the_host(setup):
    target, store, model = setup
    data = CacheDataset(store, hidden_states="online", dtype=torch.bfloat16)
    online = OnlineTarget(model, LAYERS, "bf16", torch.bfloat16)
    batch = OnlineCollator(0)([data[i] for i in (0, 3, 5, 9)])
    batch = {k: (v.pin_memory().to("cuda", non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    online.fill(batch)  # warm (kernel selection, allocator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = online.fill(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out["aux_hidden"].shape == (4, 96, len(LAYERS), 64)


def test_online_states_against_the_gpu_cache(setup, capsys):
    """bf16 on the GPU: the same code, kernels possibly chosen by the batch's row count, so the states agree to bf16
    rounding; the run prints whether they were bit-identical here."""
    target, store, model = setup
    cached = CacheDataset(store, dtype=torch.float32)
    data = CacheDataset(store, hidden_states="online")
    online = OnlineTarget(model, LAYERS, "bf16", torch.float32)
    idx = list(range(len(cached)))
    want = CacheCollator(0)([cached[i] for i in idx])
    batch = OnlineCollator(0)([data[i] for i in idx])
    got = online.fill({k: (v.cuda() if torch.is_tensor(v) else v) for k, v in batch.items()})
    for key in ("aux_hidden", "last_hidden"):
        torch.testing.assert_close(got[key].cpu(), want[key], rtol=2e-2, atol=2e-2)
    exact = all(torch.equal(got[k].cpu(), want[k]) for k in ("aux_hidden", "last_hidden"))
    with capsys.disabled():
        print(f"\nonline vs GPU cache (bf16, {len(idx)} samples in one batch): bit-identical: {exact}")


def test_trainer_runs_online_on_the_device(setup, tmp_path):
    target, store, _ = setup
    cfg = DraftConfig(num_draft_layers=1, block_size=4, mask_token_id=259, num_anchors=8, markov_rank=8)
    task = DSparkTask.from_paths(cfg, LossConfig(), target, store, hidden_states="online")
    tcfg = TrainConfig(lr=1e-3, warmup_ratio=0.0, total_steps=3, micro_batch_size=2, global_batch_size=4,
                       checkpoint_every=100, log_every=1, out_dir=str(tmp_path / "run"), hidden_states="online")
    res = train(task, tcfg, progress=False, checkpoints=False)
    assert len(res.history) == 3 and all(row["loss"] == row["loss"] for row in res.history)
    assert task.target.device.type == "cuda"


@pytest.mark.parametrize("width,padded", [(64, False), (96, False), (64, True), (80, True)])
def test_compiled_target_layers_give_the_eager_layers_bits(setup, width, padded):
    """``train.target_compile``: each decoder layer under torch.compile with the eager layers' rounding
    (``capture.compile_layers``) gives the same bf16 states as the eager layers, bit for bit, at each width and on
    both attention paths (a padded group's explicit mask, an unpadded group's causal kernel)."""
    from dspark_core.cache.capture import compile_layers

    _, _, model = setup
    g = torch.Generator().manual_seed(width)
    ids = torch.randint(0, 200, (2, width), generator=g).cuda()  # [2, W]
    valid = torch.ones(2, width, dtype=torch.bool, device="cuda")  # [2, W]
    if padded:
        valid[1, width // 2:] = False
    try:
        with torch.no_grad():
            compile_layers(model, False)
            aux_e, last_e = capture_padded(model, ids, valid, LAYERS, padded)  # [2, W, K, H], [2, W, H]
            compile_layers(model, True)
            aux_c, last_c = capture_padded(model, ids, valid, LAYERS, padded)
    finally:
        compile_layers(model, False)
    keep = valid[:, :, None]  # positions that are a sample's
    assert torch.equal(aux_e * keep[..., None], aux_c * keep[..., None])
    assert torch.equal(last_e * keep, last_c * keep)
