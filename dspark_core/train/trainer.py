"""The shared trainer: AdamW, warmup + cosine schedule, gradient accumulation, DDP, checkpoints, dvclive.

One optimiser step consumes ``global_batch_size`` samples = world_size x micro_batch_size x grad_accum.
Samples come from an endless stream of seeded epoch permutations, so the data of step ``s`` depends
only on (seed, s): a resumed run (model, optimiser, scheduler and RNG restored from the last
checkpoint) continues bit-identically. Loss normalisation is global (see ``train/task.py``).
``data_workers`` > 0 prepares the next steps' batches in DataLoader worker processes (the same batches,
made ahead; on GPU pinned for the host-to-device copy), so reading and collating overlap the steps.

Launch on several processes with ``torchrun --nproc_per_node N stages/train.py ...`` (the stage does it itself for
``nproc_per_node`` / ``nnodes`` > 1, see ``dspark_core.dist``): the trainer reads ``WORLD_SIZE``/``RANK``/
``LOCAL_RANK``, uses NCCL on GPU and gloo on CPU, and wraps the model in DDP. Global rank 0 alone reads and writes
checkpoints; a resumed run's state reaches the other ranks by broadcast, so hosts need not share a file system.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data
from torch import nn

from dspark_core.checkpoint import checkpoint_clock, load_checkpoint, save_checkpoint
from dspark_core.config import Section, non_negative, one_of, positive, require
from dspark_core.dist import NODE_RANK_ENV, Dist, Nodes, broadcast_tree, init_distributed, on_main
from dspark_core.errors import UserError
from dspark_core.train.optim import OPTIMIZER_KERNELS, MasterAdamW, TritonAdamW, optimizer_kernel
from dspark_core.train.task import TrainTask


PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # train.param_dtype / master_dtype
# Pure-bf16 training (param_dtype and master_dtype bfloat16: bf16 weights, gradients and AdamW moments) failed the
# golden-curve check against the default numerics (tests/test_numerics_golden.py), so training refuses it; that
# test flips this to offer it once it passes. (benchmarks/bench_train_step.py --precision bf16 still times it.)
PURE_BF16_TRAINING = False
RESUME_MODES = ("continue", "strict")  # train.resume: what a rerun does when only the code changed (train/run.py)


@dataclass(frozen=True)
class TrainConfig(Section):
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    total_steps: int = 1000          # length of the lr schedule (lr_schedule: steps)
    max_steps: int | None = None     # stop here (default: total_steps)
    micro_batch_size: int = 4
    global_batch_size: int = 8
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0           # 0 disables clipping
    min_lr_ratio: float = 0.1
    # steps: warmup + cosine over total_steps | time: the same curve over time_budget_s (needs it), its clock
    # started after the first step (compilation) -- a run that a time budget stops still ends annealed
    lr_schedule: str = "steps"
    seed: int = 42
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    precision: str = "auto"          # auto | fp32 | bf16: the autocast dtype of the forward
    param_dtype: str = "float32"     # float32 | bfloat16: the trainable weights the forward reads, their gradients
    master_dtype: str = "float32"    # the optimiser's copy of the weights and AdamW's moments (float32: a bf16
    #                                  param_dtype trains on float32 master weights, train/optim.py MasterAdamW)
    data_workers: int = 0            # processes preparing the next steps' batches (0: in the training loop)
    out_dir: str = "data/train"
    # How the run executes, not what it learns (left out of the resume identity, see identity_dict):
    time_budget_s: float | None = None   # stop (checkpoint + export) after the step that passes this many seconds
    nproc_per_node: int = 1              # > 1: the stage re-launches itself under torchrun with this many processes
    nnodes: int = 1                      # hosts; > 1: each runs the stage, joined by torchrun at rdzv_endpoint
    node_rank: int | None = None         # this host's rank; null: from the environment (dist.NODE_RANK_ENV)
    rdzv_endpoint: str | None = None     # node 0's host:port (torchrun's static rendezvous; nnodes > 1)
    loss_kernel: str = "auto"            # the draft loss's chunk math: auto | triton | compile | torch (same numbers)
    attention_kernel: str = "auto"       # the draft's flex attention on GPU: auto | triton | flash (FlashAttention-4)
    optimizer_kernel: str = "auto"       # the AdamW step: auto | torch | triton (train/optim.py; same numbers)
    group_by_length: bool = True         # a step's samples go to its micro-batches by length (same step gradient)
    # cache: the DSpark task reads the target's hidden states from the train store | online: this process runs the
    # frozen target on each micro-batch (the store is then token-only); the same states (cache/online.py)
    hidden_states: str = "cache"
    # online on a GPU: the target's decoder layers under torch.compile, rounding where the eager layers round (the
    # same states; the online step ~1.2x faster at Qwen3-4B shapes) | false: eager layers
    target_compile: bool = True
    # a rerun on this run's checkpoints after the code (dspark_core) changed: continue (from the last checkpoint,
    # saying so) | strict (refuse); a params change moves the older run aside instead (train/run.py)
    resume: str = "continue"

    EXECUTION_KEYS = ("time_budget_s", "nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "loss_kernel",
                      "attention_kernel", "optimizer_kernel", "group_by_length", "hidden_states", "target_compile",
                      "resume")

    def validate(self) -> None:
        positive("lr", self.lr)
        require(0 <= self.warmup_ratio < 1, f"warmup_ratio must be in [0, 1); got {self.warmup_ratio}")
        positive("total_steps", self.total_steps)
        if self.max_steps is not None:
            require(1 <= self.max_steps <= self.total_steps,
                    f"max_steps must be in [1, total_steps={self.total_steps}]; got {self.max_steps}")
        positive("micro_batch_size", self.micro_batch_size)
        positive("global_batch_size", self.global_batch_size)
        non_negative("weight_decay", self.weight_decay)
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1 and beta2 must be in [0, 1)")
        non_negative("grad_clip", self.grad_clip)
        require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio}")
        one_of("lr_schedule", self.lr_schedule, ("steps", "time"))
        require(self.lr_schedule != "time" or self.time_budget_s is not None,
                "lr_schedule: time spreads the lr schedule over time_budget_s, which is not set")
        positive("checkpoint_every", self.checkpoint_every)
        positive("keep_checkpoints", self.keep_checkpoints)
        positive("log_every", self.log_every)
        one_of("precision", self.precision, ("auto", "fp32", "bf16"))
        one_of("param_dtype", self.param_dtype, tuple(PARAM_DTYPES))
        one_of("master_dtype", self.master_dtype, tuple(PARAM_DTYPES))
        require(self.master_dtype == "float32" or self.param_dtype == "bfloat16",
                f"master_dtype: {self.master_dtype} below param_dtype: {self.param_dtype}; the optimiser keeps the "
                "weights at least as precise as the model: set master_dtype: float32")
        require(PURE_BF16_TRAINING or not self.pure_bf16,
                "param_dtype: bfloat16 with master_dtype: bfloat16 is pure-bf16 training (bf16 AdamW moments; an "
                "update below bf16's spacing is lost), which fails the golden-curve check against the default "
                "numerics (tests/test_numerics_golden.py); set master_dtype: float32 (bf16 working weights, float32 "
                "master weights and AdamW state) or param_dtype: float32")
        non_negative("data_workers", self.data_workers)
        one_of("attention_kernel", self.attention_kernel, ("auto", "triton", "flash"))
        one_of("optimizer_kernel", self.optimizer_kernel, OPTIMIZER_KERNELS)
        one_of("hidden_states", self.hidden_states, ("cache", "online"))
        one_of("resume", self.resume, RESUME_MODES)
        if self.time_budget_s is not None:
            positive("time_budget_s", self.time_budget_s)
        positive("nproc_per_node", self.nproc_per_node)
        self._validate_nodes()
        per_step = self.nnodes * self.nproc_per_node * self.micro_batch_size
        require(self.global_batch_size % per_step == 0,
                f"global_batch_size={self.global_batch_size} is not a multiple of nnodes x nproc_per_node x "
                f"micro_batch_size = {self.nnodes} x {self.nproc_per_node} x {self.micro_batch_size}")

    def _validate_nodes(self) -> None:
        positive("nnodes", self.nnodes)
        if self.node_rank is not None:
            require(0 <= self.node_rank < self.nnodes,
                    f"node_rank must be in [0, nnodes={self.nnodes}) or null (from the environment: "
                    f"{', '.join(NODE_RANK_ENV)}); got {self.node_rank}")
        if self.rdzv_endpoint is not None:
            self._endpoint()
        require(self.nnodes == 1 or self.rdzv_endpoint is not None,
                f"rdzv_endpoint is null but nnodes={self.nnodes}: give node 0's host:port (an address the other "
                "hosts reach and a free port, e.g. 10.0.0.1:29500)")

    def _endpoint(self) -> tuple[str, int]:
        """``rdzv_endpoint`` as (host, port); a bracketed IPv6 host keeps its brackets, as torchrun takes it."""
        host, _, port = (self.rdzv_endpoint or "").strip().rpartition(":")
        require(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                f"rdzv_endpoint must be node 0's host:port (e.g. 10.0.0.1:29500); got {self.rdzv_endpoint!r}")
        return host, int(port)

    def nodes(self, section: str = "train") -> Nodes:
        """The hosts a torchrun launch of this run spans (:func:`dspark_core.dist.relaunch_under_torchrun`): this
        host's rank is ``node_rank``, or when null the environment's, read at the launch
        (:func:`dspark_core.dist.node_rank_from_env`; ``section`` names the params section in its error)."""
        if self.nnodes == 1:
            return Nodes()
        return Nodes(self.nnodes, self.node_rank, *self._endpoint(), field=f"{section}.node_rank")

    @property
    def master_weights(self) -> bool:
        """Whether the optimiser keeps its own copy of the weights (master_dtype above param_dtype)."""
        return self.master_dtype != self.param_dtype

    @property
    def pure_bf16(self) -> bool:
        """bf16 weights, gradients and AdamW moments, no master copy (refused for training; a benchmark mode)."""
        return self.param_dtype == "bfloat16" and self.master_dtype == "bfloat16"

    @property
    def stop_step(self) -> int:
        return self.max_steps if self.max_steps is not None else self.total_steps

    def grad_accum(self, world_size: int) -> int:
        per_step = world_size * self.micro_batch_size
        if self.global_batch_size % per_step:
            raise UserError(
                f"global_batch_size={self.global_batch_size} is not a multiple of the {world_size} processes x "
                f"micro_batch_size {self.micro_batch_size} (torchrun's process count; nnodes x nproc_per_node in "
                "params)"
            )
        return self.global_batch_size // per_step


# -- distributed ------------------------------------------------------------------------------
def _all_reduce_(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


# -- schedule ---------------------------------------------------------------------------------
def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_ratio x total_steps, then cosine to min_lr_ratio at total_steps."""
    warmup = int(round(cfg.warmup_ratio * cfg.total_steps))
    if warmup and step < warmup:
        return (step + 1) / warmup
    return _cosine((step - warmup) / max(1, cfg.total_steps - warmup), cfg)


def lr_factor_by_time(progress: float, cfg: TrainConfig) -> float:
    """``lr_schedule: time``: lr_factor's curve over the spent fraction of the time budget -- linear warmup over
    its first warmup_ratio, then cosine to min_lr_ratio at its end."""
    if progress < cfg.warmup_ratio:
        return progress / cfg.warmup_ratio
    return _cosine((progress - cfg.warmup_ratio) / (1 - cfg.warmup_ratio), cfg)


def _cosine(progress: float, cfg: TrainConfig) -> float:
    """The decay after warmup: cosine from 1 at progress 0 to min_lr_ratio at progress >= 1."""
    progress = min(1.0, progress)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# -- data order -------------------------------------------------------------------------------
def sample_indices(step: int, n: int, cfg: TrainConfig) -> list[int]:
    """The ``global_batch_size`` dataset indices of optimiser step ``step`` (seeded epoch permutations)."""
    if n <= 0:
        raise UserError("the training dataset is empty")
    g = cfg.global_batch_size
    start, out = step * g, []
    while len(out) < g:
        epoch, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
        out.extend(perm[offset: offset + g - len(out)].tolist())
    return out


class StepBatches(torch.utils.data.Dataset):
    """Item i = the CPU micro-batches of optimiser step ``start + i`` for this rank: a pure function of
    (seed, step), so the batches are the same whether made in the loop or by DataLoader worker processes."""

    def __init__(self, task: TrainTask, cfg: TrainConfig, d: Dist, start: int, stop: int) -> None:
        self.task, self.cfg, self.d, self.start, self.stop = task, cfg, d, start, stop
        self.data = task.train_dataset()
        self.accum = cfg.grad_accum(d.world_size)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> list[dict[str, torch.Tensor]]:
        step, cfg, d = self.start + i, self.cfg, self.d
        order = sample_indices(step, len(self.data), cfg)
        places = self._places(order)
        return [self.task.collate([self.data[order[places[p]]] for p in micro_slots(m, d, cfg)],
                                  [item_generator(cfg, step, places[p]) for p in micro_slots(m, d, cfg)])
                for m in range(self.accum)]

    def _places(self, order: list[int]) -> list[int]:
        """The global-batch slot at each place of the step's micro-batches: in order, or with ``group_by_length``
        (and a dataset that knows its ``lengths``) sorted by sample length, so each micro-batch holds samples of
        similar length (less padding; compact anchor slots cut more). An item keeps its slot's generator and the
        loss sums over the whole global batch, so the step's gradient is the same either way."""
        lengths = getattr(self.data, "lengths", None) if self.cfg.group_by_length else None
        if lengths is None or self.accum * self.d.world_size == 1:  # one micro-batch holds the whole step
            return list(range(len(order)))
        return sorted(range(len(order)), key=lambda s: (int(lengths[order[s]]), s))


def step_batch_stream(task: TrainTask, cfg: TrainConfig, d: Dist, start: int, pin_memory: bool = False):
    """Iterator over the CPU micro-batches of steps ``start .. stop_step - 1``, in order. With
    ``cfg.data_workers`` > 0 a DataLoader's worker processes prepare the next steps meanwhile (the dataset
    must be safe to use after a fork, as ``CacheDataset`` is)."""
    steps = StepBatches(task, cfg, d, start, cfg.stop_step)
    if cfg.data_workers == 0:  # pinned too: a copy from pageable memory would wait for the device's queue
        return ([_pinned(b) for b in steps[i]] if pin_memory else steps[i] for i in range(len(steps)))
    loader = torch.utils.data.DataLoader(steps, batch_size=None, shuffle=False, num_workers=cfg.data_workers,
                                         prefetch_factor=2, pin_memory=pin_memory)
    return iter(loader)


def micro_slots(micro: int, d: Dist, cfg: TrainConfig) -> range:
    """Places in the global batch that rank ``d.rank`` handles in micro-batch ``micro``."""
    mb = cfg.micro_batch_size
    start = micro * mb * d.world_size + d.rank * mb
    return range(start, start + mb)


def item_generator(cfg: TrainConfig, step: int, slot: int) -> torch.Generator:
    """The generator of the item at place ``slot`` of step ``step``'s global batch."""
    return torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 65_537 + slot)


# -- optimiser ----------------------------------------------------------------------------------
class AdamWWithSparse(torch.optim.Optimizer):
    """AdamW over the dense parameter groups and ``SparseAdam`` over those marked ``sparse`` (an embedding table
    with sparse gradients), one optimiser to the scheduler and the checkpoints. Every group keeps its own lr
    (the schedule scales each)."""

    def __init__(self, groups: list[dict[str, Any]], cfg: TrainConfig, fused: bool) -> None:
        super().__init__([{"params": g["params"]} for g in groups], {"lr": cfg.lr})
        kw = dict(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        dense = [g for g in groups if not g.get("sparse")]
        sparse = [{k: v for k, v in g.items() if k != "sparse"} for g in groups if g.get("sparse")]
        self.dense = torch.optim.AdamW([{k: v for k, v in g.items() if k != "sparse"} for g in dense], lr=cfg.lr,
                                       weight_decay=cfg.weight_decay, fused=fused, **kw)
        self.sparse = torch.optim.SparseAdam(sparse, lr=cfg.lr, **kw)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # the inner optimisers' (load_state_dict replaces them)
        if "sparse" not in self.__dict__:  # inside torch.optim.Optimizer.__init__
            return self.__dict__["_groups"]
        return self.dense.param_groups + self.sparse.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.__dict__["_groups"] = value

    def step(self, closure=None):  # noqa: D102
        self.dense.step()
        self.sparse.step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        self.dense.zero_grad(set_to_none=set_to_none)
        self.sparse.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # noqa: D102
        return {"dense": self.dense.state_dict(), "sparse": self.sparse.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: D102
        self.dense.load_state_dict(state["dense"])
        self.sparse.load_state_dict(state["sparse"])


def build_optimizer(task: TrainTask, model: nn.Module, cfg: TrainConfig, device: torch.device, d: Dist):
    """AdamW over the trainable parameters; a task's ``param_groups(model)`` may give groups their own ``lr``
    (None: ``train.lr``) and mark groups ``sparse`` (then :class:`AdamWWithSparse`). With master weights
    (``param_dtype: bfloat16``, ``master_dtype: float32``) a :class:`MasterAdamW` over float32 copies."""
    groups = task.param_groups(model) if hasattr(task, "param_groups") else [
        {"params": [p for p in model.parameters() if p.requires_grad]}]
    groups = [{**g, "lr": g.get("lr") or cfg.lr} for g in groups if g["params"]]
    fused = device.type == "cuda"
    kernel = optimizer_kernel(cfg.optimizer_kernel, device)
    if not any(g.get("sparse") for g in groups):
        dense = [{k: v for k, v in g.items() if k != "sparse"} for g in groups]
        kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
        if cfg.master_weights:
            return MasterAdamW(dense, kernel=kernel, master_dtype=PARAM_DTYPES[cfg.master_dtype], **kw)
        if kernel == "triton":
            return TritonAdamW(dense, **kw)
        return torch.optim.AdamW(dense, fused=fused, **kw)
    if cfg.master_weights:
        raise UserError("sparse gradients (draft.engram.sparse: true) take no master weights; set "
                        "draft.engram.sparse: false or train.param_dtype: float32")
    if d.world_size > 1:
        raise UserError("sparse gradients (draft.engram.sparse: true) train in one process only; "
                        "set draft.engram.sparse: false under torchrun")
    return AdamWWithSparse(groups, cfg, fused)


# -- the loop ---------------------------------------------------------------------------------
@dataclass
class TrainResult:
    model: nn.Module
    steps: int
    history: list[dict[str, float]]


def pick_device_dtype(cfg: TrainConfig, d: Dist) -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        device = torch.device("cuda", d.local_rank)
        amp = torch.float32 if cfg.precision == "fp32" else torch.bfloat16
    else:
        device = torch.device("cpu")
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and cfg.param_dtype == "bfloat16")
        amp = torch.bfloat16 if bf16 else torch.float32
    return device, amp


def _pinned(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.pin_memory() if torch.is_tensor(v) else v) for k, v in batch.items()}


def _to(batch: dict[str, Any], device: torch.device, stream: Any = None) -> dict[str, Any]:
    """The batch's tensors on ``device``. On CUDA with a copy ``stream`` the copies run there, so they overlap the
    step still running on the compute stream (from pinned host memory; a pageable tensor's copy holds the host
    until it is done), and the compute stream waits for them before its first use."""
    if stream is None or device.type != "cuda":
        return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    compute = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        out = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    compute.wait_stream(stream)
    for v in out.values():
        if torch.is_tensor(v) and v.device.type == "cuda":
            v.record_stream(compute)  # the allocator keeps the memory until the compute stream is done with it
    return out


def train(task: TrainTask, cfg: TrainConfig, *, live: Any = None,
          on_step: Callable[[int, dict[str, float]], None] | None = None,
          progress: bool = True, time_budget_s: float | None = None, checkpoints: bool = True,
          log_step_offset: int = 0) -> TrainResult:
    """Run (or resume) training of ``task`` until ``cfg.stop_step``. Returns the (unwrapped) model.

    ``time_budget_s`` (off by default): stop after the first step that ends that many seconds after the
    loop started (compilation included), with a checkpoint, as if ``max_steps`` were that step. With
    ``lr_schedule: steps`` the lr schedule is not stretched; with ``time`` it is laid over the budget (its clock
    started after the first step), and the budget spans resumes: a resumed run has what the crashed one left.
    ``TrainResult.steps`` is the step reached. ``checkpoints=False`` (benchmarks) neither resumes from nor writes
    checkpoints. ``live`` (a dvclive ``Live``) gets the rows every ``log_every`` steps; ``on_step(step, row)`` every
    step. ``log_step_offset``: added to the logged step (the curves of a run warm-started at that step use
    cumulative steps; the schedule and the checkpoints count from 0)."""
    run = TrainRun(task, cfg, time_budget_s=time_budget_s, checkpoints=checkpoints)
    return run.loop(live=live, on_step=on_step, progress=progress, log_step_offset=log_step_offset)


DEFERRED_READS = ("cuda",)  # device types whose steps' numbers are read one step late (see TrainRun.loop)


@dataclass
class _Enqueued:
    """A step queued on the device whose numbers are not read yet: its number (1-based), start time, loss and
    metric sums, denominators, gradient norm (tensors on the device) and lr."""

    step: int
    t0: float
    sums: dict[str, torch.Tensor]
    dens: dict[str, torch.Tensor]
    grad_norm: Any
    lr: float


@dataclass
class _Reporter:
    """Where a finished step's row goes: dvclive (every ``log_every`` steps and the last), a callback, a bar."""

    live: Any
    on_step: Callable[[int, dict[str, float]], None] | None
    log_step_offset: int


class TrainRun:
    """One training run of ``task`` under ``cfg`` (see :func:`train`), in two parts.

    Building it checks the settings and builds what they describe -- the process group, the model (where a
    setting that needs the target fails: a vocabulary, a head count), the optimiser, the lr schedule, the batch
    arithmetic -- and touches no file, so a caller can check a run before it clears an older one's outputs
    (``train/run.py``). :meth:`loop` then resumes from the last checkpoint, if any, and trains.

    ``clock_progress``: with ``lr_schedule: time``, the spent fraction of the budget after the first step (what
    the schedule's lambda reads). ``spent0`` / ``origin``: the seconds a resumed run had spent, and the spent
    seconds at which its time schedule started."""

    def __init__(self, task: TrainTask, cfg: TrainConfig, time_budget_s: float | None = None,
                 checkpoints: bool = True):
        cfg.validate()  # a TrainConfig built directly (not from params) is checked too
        budget = cfg.time_budget_s if time_budget_s is None else time_budget_s
        if budget is not None and not budget > 0:
            raise UserError(f"train: time budget must be > 0 seconds; got {budget!r}")
        self.task, self.cfg, self.budget, self.checkpoints = task, cfg, budget, checkpoints
        self.d = d = init_distributed()
        self.accum = cfg.grad_accum(d.world_size)
        self.device, self.amp_dtype = pick_device_dtype(cfg, d)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)  # the checkpoints hold these states too: seeded, a rerun writes the same bytes
        np.random.seed(cfg.seed % 2**32)
        self.model = task.build_model(self.device, PARAM_DTYPES[cfg.param_dtype])
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise UserError(f"task {task.name!r}: the model has no trainable parameters")
        self.opt = build_optimizer(task, self.model, cfg, self.device, d)
        self.by_time = cfg.lr_schedule == "time"
        self.clock_progress = 0.0
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, (lambda s: lr_factor_by_time(self.clock_progress, cfg)) if self.by_time
            else (lambda s: lr_factor(s, cfg)))
        self.ckpt_root = Path(cfg.out_dir) / "checkpoints"
        self.history: list[dict[str, float]] = []

    def _resume(self) -> None:
        """Restore the last checkpoint (model, optimiser, schedule, RNG, a time schedule's clock) and wrap for DDP.
        Only global rank 0 reads it: the checkpoints are on its host (no file system is assumed shared between
        hosts), and the other ranks receive what it restored (:meth:`_restore`)."""
        cfg, d = self.cfg, self.d
        self.start, resumed = self._restore() if self.checkpoints else (0, {})
        self.spent0, self.origin = resumed.get("spent_s", 0.0), resumed.get("origin_s")  # steps: the whole budget
        spent_out = self.by_time and self.spent0 >= self.budget
        self.stop_step = self.start if spent_out else cfg.stop_step  # a spent budget: nothing to do
        self.wrapped: nn.Module = self.model
        if d.world_size > 1:
            self.wrapped = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self.start < self.stop_step and len(self.task.train_dataset()) <= 0:
            raise UserError("the training dataset is empty")
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # batch copies

    def _restore(self) -> tuple[int, dict[str, float]]:
        """The step to continue from and a time schedule's clock (``checkpoint_clock``), both read by rank 0, which
        restores the latest checkpoint (``load_checkpoint``); a damaged one is refused on every rank. With a
        checkpoint, rank 0 then broadcasts the state it restored -- trainable weights, optimiser, scheduler, RNG
        states -- so every rank continues exactly as after a load of the same files."""
        def read() -> tuple[int, dict[str, float]]:
            step = load_checkpoint(self.ckpt_root, self.model, self.opt, self.sched, self.cfg.total_steps)
            return step, (checkpoint_clock(self.ckpt_root) if self.by_time else {})

        start, clock = on_main(self.d, read)
        if start > 0 and self.d.world_size > 1:
            self._receive_state()
        return start, clock

    def _receive_state(self) -> None:
        """Rank 0's restored state on every rank (:func:`dspark_core.dist.broadcast_tree`), loaded where it came."""
        d, model = self.d, self.model
        state = broadcast_tree(
            {"weights": {k: p.detach() for k, p in model.named_parameters() if p.requires_grad},
             "scheduler": self.sched.state_dict(), "optimizer": self.opt.state_dict(), "rng": _rng_states()}
            if d.is_main else None, d, self.device)
        if d.is_main:
            return
        with torch.no_grad():
            for k, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(state["weights"][k])
        self.sched.load_state_dict(state["scheduler"])  # load_checkpoint's order: the optimiser's lrs win
        self.opt.load_state_dict(state["optimizer"])
        _set_rng_states(state["rng"])

    def loop(self, *, live: Any = None, on_step: Callable[[int, dict[str, float]], None] | None = None,
             progress: bool = True, log_step_offset: int = 0) -> TrainResult:
        """Resume, then steps ``start`` .. ``stop_step``. On a GPU a step's numbers (loss sums, grad norm) are read
        when the next step has been queued, so the device never waits for the host between steps; a step that
        checkpoints, ends the run or is under a time budget (whose clock and lr need its end) is read at once,
        before anything else is queued. On a CPU every step is read at once (its work is done when it is queued).
        """
        self._resume()
        self.rep, self.last = _Reporter(live, on_step, log_step_offset), self.start
        self.bar = None
        if progress and self.d.is_main:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=self.cfg.stop_step, initial=self.start, desc=f"train {self.task.name}", unit="step")
        stream = step_batch_stream(self.task, self.cfg, self.d, self.start, pin_memory=self.device.type == "cuda")
        self.t_loop = self.prev_now = self.log_now = _now()
        self.log_done = self.start
        pending: _Enqueued | None = None
        for step in range(self.start, self.stop_step):
            rec = self._queue_step(step, next(stream))
            if pending is not None and self._finish(pending):
                pending = None
                break
            pending = None
            if self._read_at_once(rec):
                if self._finish(rec):
                    break
            else:
                pending = rec
        if pending is not None:
            self._finish(pending)
        if self.bar is not None:
            self.bar.close()
        del stream  # stops DataLoader workers (a time budget can leave steps unread)
        return TrainResult(model=self.model, steps=self.last, history=self.history)

    def _queue_step(self, step: int, host_batches: list[dict[str, Any]]) -> _Enqueued:
        """Queue step ``step + 1``: forward and backward of each micro-batch, clip, optimiser step (nothing read)."""
        t0, d, device = _now(), self.d, self.device
        batches = [_to(b, device, self.copy_stream) for b in host_batches]
        autocast = dict(device_type=device.type, dtype=self.amp_dtype, enabled=self.amp_dtype != torch.float32)
        if hasattr(self.task, "prepare_step"):  # model-dependent supervision, decided before the denominators
            with torch.no_grad(), torch.autocast(**autocast):
                batches = self.task.prepare_step(self.model, batches)
        dens = _global_denominators(self.task, batches, d, device)
        sums_acc: dict[str, torch.Tensor] = {}
        for m, batch in enumerate(batches):
            sync = m == self.accum - 1 or d.world_size == 1
            ctx = self.wrapped.no_sync() if (not sync and d.world_size > 1) else _null()
            with ctx, torch.autocast(**autocast):
                sums = self.task.forward_sums(self.wrapped, batch)
                loss = _combine(self.task, sums, dens) * d.world_size  # DDP averages over ranks
            loss.backward()
            for k, v in sums.items():
                sums_acc[k] = sums_acc.get(k, 0) + v.detach().float()
        grad_norm = clip_and_step(self.opt, self.params, self.cfg.grad_clip)
        self.opt.zero_grad(set_to_none=True)
        rec = _Enqueued(step + 1, t0, sums_acc, dens, grad_norm, self.sched.get_last_lr()[0])
        if not self.by_time:  # a steps schedule needs nothing from the device
            self.sched.step()
        return rec

    def _read_at_once(self, rec: _Enqueued) -> bool:
        return (self.device.type not in DEFERRED_READS or self.budget is not None or rec.step == self.stop_step
                or (self.checkpoints and rec.step % self.cfg.checkpoint_every == 0))

    def _finish(self, rec: _Enqueued) -> bool:
        """Read step ``rec``'s numbers (waits for the device to finish it), log, checkpoint; True: stop here."""
        row = _step_metrics(self.task, rec.sums, rec.dens, self.d, self.device)  # the device has finished the step
        norm = float(rec.grad_norm)
        _check_finite(rec, row["loss"], norm, self.cfg)
        now = _now()
        spent, out_of_time = self._tick_budget(now)
        row.update(lr=rec.lr, grad_norm=norm, step_s=now - max(rec.t0, self.prev_now))
        self.prev_now = now
        self.history.append(row)
        done = self.last = rec.step
        final = done == self.cfg.stop_step or out_of_time
        self._report(done, row, final, now)
        if self.checkpoints and (done % self.cfg.checkpoint_every == 0 or final):
            self._checkpoint(done, spent)
        if out_of_time and done < self.cfg.stop_step:
            if self.d.is_main:
                print(f"train: time budget of {self.budget:g} s reached after step {done} of {self.cfg.stop_step}; "
                      f"stopping there")
            return True
        return False

    def _tick_budget(self, now: float) -> tuple[float, bool]:
        """The seconds spent (the slowest rank's, so every rank gets the same lr and stop) and whether the budget is
        out; with ``lr_schedule: time`` the schedule moves to the spent fraction (its clock starts after step 1)."""
        if self.budget is None:
            return 0.0, False
        spent = _max_over_ranks(self.spent0 + now - self.t_loop, self.d, self.device)
        if self.by_time:
            self.origin = spent if self.origin is None else self.origin
            self.clock_progress = (spent - self.origin) / max(self.budget - self.origin, 1e-9)
            self.sched.step()
        return spent, spent >= self.budget

    def _report(self, done: int, row: dict[str, float], final: bool, now: float) -> None:
        """``live`` gets every ``log_every``-th row, its ``step_s`` the mean over the steps since the last logged
        one: a row's own ``step_s`` is the time between two reads, which under deferred reads leaves the last step
        of a run only its drain (its queueing overlapped the step before), ~0 where the host bounds the loop."""
        rep = self.rep
        if self.d.is_main:
            if rep.live is not None and (done % self.cfg.log_every == 0 or final):
                rep.live.step = done + rep.log_step_offset
                logged = {**row, "step_s": (now - self.log_now) / max(1, done - self.log_done)}
                self.log_now, self.log_done = now, done
                for k, v in logged.items():
                    rep.live.log_metric(f"train/{k}", v)
                rep.live.make_summary()
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)  # shown at tqdm's own pace
        if rep.on_step is not None:
            rep.on_step(done, row)

    def _checkpoint(self, done: int, spent: float) -> None:
        if self.d.is_main:
            save_checkpoint(self.ckpt_root, done, self.model, self.opt, self.sched, self.cfg.keep_checkpoints,
                            optimizer=done < self.cfg.total_steps,
                            clock={"spent_s": spent, "origin_s": self.origin} if self.by_time else None)
        if self.d.world_size > 1:
            dist.barrier()


def _rng_states() -> dict[str, Any]:
    """This process's RNG states (torch, Python, numpy, every CUDA device's): what a checkpoint restores."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    """Set :func:`_rng_states`' states (CUDA: on the devices this host has of the sender's)."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if torch.cuda.is_available():
        for i, st in enumerate(states.get("cuda", [])[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(st, i)


def _check_finite(rec: _Enqueued, loss: float, norm: float, cfg: TrainConfig) -> None:
    """Refuse a step whose loss or gradient norm is NaN / inf: its update has made the weights non-finite, so
    nothing of it is checkpointed or exported (the run stops at the last finite checkpoint)."""
    if math.isfinite(loss) and math.isfinite(norm):
        return
    raise UserError(f"train: step {rec.step}: loss {loss} / gradient norm {norm} is not finite (lr "
                    f"{rec.lr:g}); nothing of this step was saved. Lower lr or lengthen warmup_ratio, keep grad_clip "
                    f"> 0 (now {cfg.grad_clip:g}) in the training section (train / dmtd_train), or check the data "
                    "(`dspark cache verify`)")


def _now() -> float:  # the trainer's clock (time budgets, step_s); tests replace it
    return time.perf_counter()


def _max_over_ranks(value: float, d: Dist, device) -> float:
    if d.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _global_denominators(task: TrainTask, batches, d: Dist, device) -> dict[str, torch.Tensor]:
    dens: dict[str, torch.Tensor] = {}
    for b in batches:
        for k, v in task.denominators(b).items():
            dens[k] = dens.get(k, torch.zeros((), dtype=torch.float64, device=device)) + v.double()
    for k in sorted(dens):
        _all_reduce_(dens[k], d)
    return dens


def _combine(task: TrainTask, sums: dict[str, torch.Tensor], dens: dict[str, torch.Tensor]) -> torch.Tensor:
    total = None
    for name, spec in task.terms.items():
        if spec.weight == 0:
            continue
        den = dens[spec.denominator].clamp_min(1e-12).float()
        part = spec.weight * sums[name] / den
        total = part if total is None else total + part
    if total is None:
        raise UserError(f"task {task.name!r}: every loss weight is zero")
    return total


def clip_and_step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float) -> Any:
    """Clip the gradients to the global norm ``max_norm`` (0: no clipping), then ``opt.step()``; returns the norm
    before clipping (a device tensor, not read here, or a float).

    A fused AdamW over dense gradients takes the clip factor as its ``grad_scale`` (it divides each gradient by
    it inside its own kernel): the same update as ``clip_grad_norm_`` then ``step`` up to float rounding, without
    a separate pass that rescales every gradient in memory."""
    grads = [p.grad for p in params if p.grad is not None]
    fused = isinstance(opt, torch.optim.AdamW) and bool(opt.defaults.get("fused")) and "grad_scale" not in vars(opt)
    if not (fused and max_norm > 0 and grads and not any(g.is_sparse for g in grads)):
        norm = _clip(params, max_norm)
        opt.step()
        return norm
    norm = total_norm(grads)  # [] float32 on the device
    opt.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)  # 1 / clip_grad_norm_'s factor (fp32)
    try:
        opt.step()
    finally:
        del opt.grad_scale
    return norm


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of ``grads`` as a float32 device tensor: ``get_total_norm``'s for float32 gradients, and
    for bf16 ones (master weights) each tensor's norm taken and summed in float32, not rounded to bf16."""
    if all(g.dtype == torch.float32 for g in grads):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def _clip(params: list[torch.nn.Parameter], max_norm: float) -> Any:
    """The global gradient norm before clipping: a device tensor (read by the caller when it needs it), or a float
    when some gradients are sparse (their clipping decides on the host)."""
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        return _clip_with_sparse(params, max_norm)
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return torch.stack(grads).norm() if grads else 0.0


def _clip_with_sparse(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global-norm clipping when some gradients are sparse (torch's clip_grad_norm_ cannot norm them)."""
    norms = []
    for p in params:
        if p.grad is not None:
            g = p.grad.coalesce() if p.grad.is_sparse else p.grad
            if p.grad.is_sparse:
                p.grad = g
            norms.append((g.values() if g.is_sparse else g).detach().float().norm())
    total = float(torch.stack(norms).norm()) if norms else 0.0
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total


def _step_metrics(task: TrainTask, sums: dict[str, torch.Tensor], dens: dict[str, torch.Tensor],
                  d: Dist, device) -> dict[str, float]:
    keys = sorted(sums)
    if not keys:
        return {"loss": 0.0}
    vec = torch.stack([sums[k].to(device).double().reshape(()) for k in keys])
    _all_reduce_(vec, d)
    tot = dict(zip(keys, vec.tolist()))
    row: dict[str, float] = {}
    loss = 0.0
    for name, spec in task.terms.items():
        v = tot[name] / max(float(dens[spec.denominator]), 1e-12)
        row[name] = v
        loss += spec.weight * v
    row["loss"] = loss
    for name, den in task.metric_denominators.items():
        if name in tot:
            row[name] = tot[name] / max(float(dens[den]), 1e-12)
    return row
