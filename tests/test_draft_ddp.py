"""DSpark training on 2 processes (gloo, CPU) gives the 1-process result at the same global batch.

Loss denominators are summed over ranks before the backward (train/task.py), anchors come from one
generator per item, so the split of the global batch over ranks must not change a single step.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.draft.synthetic import items_from_target
from dspark_core.draft.task import DSparkTask
from dspark_core.testing import tiny_model
from dspark_core.train.trainer import TrainConfig, train

AUX = [0, 2, 4]


def _task() -> DSparkTask:
    target = tiny_model("qwen3")
    items = items_from_target(target, AUX, 8, 6, 30, seed=3)
    cfg = DraftConfig(num_draft_layers=1, block_size=4, mask_token_id=259, num_anchors=8, markov_rank=8)
    return DSparkTask(cfg, LossConfig(), target_config=target.config,
                      embed_weight=target.get_input_embeddings().weight.detach(),
                      lm_head_weight=target.get_output_embeddings().weight.detach(), aux_layer_ids=AUX,
                      train_data=items, pad_id=0)


def _cfg(out: Path, micro: int) -> TrainConfig:
    # eps 1 >> sqrt(v): AdamW's step is then about linear in the gradient. At eps 1e-8 it divides each gradient by
    # its own size, so a near-zero gradient's float rounding (1 process vs 2 sum in another order) became a 4e-4
    # relative parameter difference on one CPU; a wrong gradient still moves the parameters here.
    return TrainConfig(lr=3e-3, warmup_ratio=0.0, total_steps=3, micro_batch_size=micro, global_batch_size=4,
                       checkpoint_every=100, seed=5, eps=1.0, out_dir=str(out))


def _trainable(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res = train(_task(), _cfg(Path(tmp) / "two", micro=1), progress=False)  # 2 ranks x 1 x accum 2
    if rank == 0:
        torch.save({"params": _trainable(res.model), "loss": [h["loss"] for h in res.history],
                    "tau": [h["tau_prob"] for h in res.history]}, Path(tmp) / "ddp.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


def test_two_process_gloo_matches_one_process(tmp_path):
    one = train(_task(), _cfg(tmp_path / "one", micro=2), progress=False)  # 1 rank x 2 x accum 2
    mp.start_processes(_worker, args=(_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    two = torch.load(tmp_path / "ddp.pt")
    for k, v in _trainable(one.model).items():
        torch.testing.assert_close(v, two["params"][k], rtol=1e-4, atol=1e-6, msg=k)
    torch.testing.assert_close(torch.tensor(two["loss"]), torch.tensor([h["loss"] for h in one.history]),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(two["tau"]), torch.tensor([h["tau_prob"] for h in one.history]),
                               rtol=1e-5, atol=1e-6)
    assert one.history[-1]["loss"] != one.history[0]["loss"]  # it trained
