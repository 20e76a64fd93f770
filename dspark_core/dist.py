"""Processes launched by ``torchrun`` (``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK``): NCCL on GPU, gloo on CPU.
Shared by the trainer (DDP) and the cache stage (one shard of each store per rank)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def init_distributed() -> Dist:
    """This process's rank (a single process when ``WORLD_SIZE`` is unset or 1); joins the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def relaunch_under_torchrun(nproc_per_node: int, argv: list[str]) -> None:
    """A stage whose params ask for ``nproc_per_node`` > 1 processes, started as one plain process (``dvc repro``
    runs ``python stages/X.py``), replaces itself with ``torchrun --nproc_per_node N <the same script and
    args>``. Under torchrun already (``LOCAL_RANK`` set), or for one process, it returns and the stage runs here.
    So the process count is a param DVC records, and dvc.yaml's command stays the same on one CPU or 8 GPUs."""
    if nproc_per_node <= 1 or "LOCAL_RANK" in os.environ:
        return
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
           *argv]
    print("relaunch: " + " ".join(cmd[1:]), flush=True)
    os.execv(sys.executable, cmd)  # does not return


def shutdown_distributed() -> None:
    """Leave the process group (end of a torchrun stage); nothing to do in a single process."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
