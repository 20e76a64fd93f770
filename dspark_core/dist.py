"""Processes launched by ``torchrun`` (``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK``): NCCL on GPU, gloo on CPU.
Shared by the trainer (DDP) and the cache stage (one shard of each store per rank).

Several hosts (the trainer's ``nnodes``): every host runs the same stage command; :func:`relaunch_under_torchrun`
starts torchrun's static rendezvous there, so global rank 0 is local rank 0 of node 0 (the host of
``rdzv_endpoint``). A host learns its own rank from its params (``node_rank``) or from the environment its cluster
sets (:data:`NODE_RANK_ENV`). Nothing assumes a file system shared between hosts: what rank 0 reads it passes on
(:func:`on_main`, :func:`broadcast_tree`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from dspark_core.errors import UserError

T = TypeVar("T")

# Where a host finds its node rank when the params leave it null, in this order: the common convention (Lightning,
# many launch scripts), torchrun's own variable for --node-rank, SLURM's index of the node in the job.
NODE_RANK_ENV = ("NODE_RANK", "PET_NODE_RANK", "SLURM_NODEID")


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


@dataclass(frozen=True)
class Nodes:
    """The hosts of one torchrun job: how many, this host's rank among them (``None``: from the environment, read
    by :meth:`resolved` when torchrun is started; ``field`` names the param that would set it), and node 0's
    ``host:port`` (where torchrun's rendezvous store listens; ``None`` on one host)."""

    count: int = 1
    rank: int | None = 0
    host: str | None = None
    port: int | None = None
    field: str = "node_rank"

    def resolved(self) -> "Nodes":
        """These nodes with this host's rank known (:func:`node_rank_from_env` when it is ``None``)."""
        if self.rank is not None:
            return self
        return replace(self, rank=0 if self.count == 1 else node_rank_from_env(self.count, self.field))


def node_rank_from_env(nnodes: int, field: str, env: dict[str, str] | None = None) -> int:
    """This host's rank among ``nnodes`` hosts, read from the first of :data:`NODE_RANK_ENV` that is set; a
    :class:`UserError` naming ``field`` (the param that would set it) when none is, or naming the variable when its
    value is not an integer in ``[0, nnodes)``."""
    env = os.environ if env is None else env
    for name in NODE_RANK_ENV:
        value = env.get(name, "").strip()
        if not value:
            continue
        if not value.isdigit() or int(value) >= nnodes:
            raise UserError(f"{name}={value!r} (this host's node rank) must be an integer in [0, {nnodes}) for "
                            f"{nnodes} nodes; fix the variable, or set {field}")
        return int(value)
    raise UserError(f"{field} is null and none of {', '.join(NODE_RANK_ENV)} is set: this host cannot tell its rank "
                    f"among the {nnodes} nodes; export NODE_RANK=<0..{nnodes - 1}> on each host (0 on the host of the "
                    f"rendezvous endpoint) or set {field}")


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


def torchrun_command(nproc_per_node: int, argv: list[str], nodes: Nodes = Nodes()) -> list[str]:
    """The torchrun command line (after the interpreter) that runs ``argv`` as ``nproc_per_node`` processes on this
    host: ``--standalone`` on one host; on several, torchrun's static rendezvous at node 0's endpoint with this
    host's rank (:meth:`Nodes.resolved`), so the global ranks are ``node rank x nproc_per_node + local rank``
    (global rank 0 on node 0)."""
    nodes, cmd = nodes.resolved(), ["-m", "torch.distributed.run"]
    if nodes.count == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nodes.count}", f"--node-rank={nodes.rank}", "--rdzv-backend=static",
                f"--master-addr={nodes.host}", f"--master-port={nodes.port}"]
    return [*cmd, f"--nproc-per-node={nproc_per_node}", *argv]


def relaunch_under_torchrun(nproc_per_node: int, argv: list[str], nodes: Nodes = Nodes()) -> None:
    """A stage whose params ask for ``nproc_per_node`` > 1 processes, or for several hosts (``nodes``), started as
    one plain process (``dvc repro`` runs ``python stages/X.py``), replaces itself with ``torchrun <the same script
    and args>`` (:func:`torchrun_command`). Under torchrun already (``LOCAL_RANK`` set), or for one process on one
    host, it returns and the stage runs here. So the process count is a param DVC records, and dvc.yaml's command
    stays the same on one CPU, 8 GPUs or several hosts (each runs it, knowing its own node rank)."""
    if (nproc_per_node <= 1 and nodes.count <= 1) or "LOCAL_RANK" in os.environ:
        return
    import sys

    cmd = [sys.executable, *torchrun_command(nproc_per_node, argv, nodes)]
    print("relaunch: " + " ".join(cmd[1:]), flush=True)
    os.execv(sys.executable, cmd)  # does not return


def on_main(d: Dist, fn: Callable[[], T]) -> T:
    """``fn()`` run by global rank 0 alone, its (picklable) result handed to every rank. What rank 0 reads (a
    checkpoint, a record of an older run) need exist on its host only. A :class:`UserError` it raises is raised on
    every rank with the same line, any other exception as a ``RuntimeError`` naming it: no rank is left waiting
    for a step that never comes."""
    if d.world_size == 1:
        return fn()
    box: list[Any] = [None]
    error: BaseException | None = None
    if d.is_main:
        try:
            box[0] = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 (passed on to the other ranks, then raised here too)
            error = e
            box[0] = ("user", str(e)) if isinstance(e, UserError) else ("bug", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if error is not None:
        raise error
    if kind == "user":
        raise UserError(value)
    if kind == "bug":
        raise RuntimeError(f"global rank 0 failed: {value}")
    return value


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in :func:`broadcast_tree`'s skeleton: its index in the tensor list, shape, dtype, and
    whether rank 0 held it on the CPU (else on its accelerator)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def _split(tree: Any, slots: list[_Slot], tensors: list[torch.Tensor]) -> Any:
    """``tree`` with each tensor replaced by a :class:`_Slot` (appended to ``slots``, the tensor to ``tensors``)."""
    if torch.is_tensor(tree):
        slots.append(_Slot(len(tensors), tuple(tree.shape), tree.dtype, tree.device.type == "cpu"))
        tensors.append(tree)
        return slots[-1]
    if isinstance(tree, dict):
        return {k: _split(v, slots, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_split(v, slots, tensors) for v in tree)
    return tree


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """:func:`_split`'s inverse: each :class:`_Slot` of ``skeleton`` replaced by its tensor."""
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


def broadcast_tree(tree: Any, d: Dist, device: torch.device) -> Any:
    """Global rank 0's ``tree`` (nested dicts / lists / tuples of tensors and picklable values: a state dict) on
    every rank; the others pass anything (``None``). Its structure and plain values go in one object broadcast,
    each tensor in its own broadcast (through ``device`` under NCCL), so no rank pickles the tensors' bytes. A
    received tensor lies on the CPU where rank 0's did, else on ``device``; rank 0 gets its own tree back."""
    if d.world_size == 1:
        return tree
    slots: list[_Slot] = []
    tensors: list[torch.Tensor] = []
    box = [(_split(tree, slots, tensors), slots) if d.is_main else None]
    dist.broadcast_object_list(box, src=0)
    skeleton, slots = box[0]
    wire = device if dist.get_backend() == "nccl" else torch.device("cpu")
    received = []
    for slot in slots:
        buf = (tensors[slot.index].detach().to(wire).contiguous() if d.is_main
               else torch.empty(slot.shape, dtype=slot.dtype, device=wire))
        dist.broadcast(buf, src=0)
        received.append(buf.cpu() if slot.on_cpu else buf.to(device))
    return tree if d.is_main else _fill(skeleton, received)


def shutdown_distributed() -> None:
    """Leave the process group (end of a torchrun stage); nothing to do in a single process."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
