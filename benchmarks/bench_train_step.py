"""DSpark draft training step at Qwen3-4B shapes: step time, peak memory, tokens/s.

One step = forward (multi-anchor draft + chunked loss) + backward + grad clip + AdamW step, batch 1,
random inputs, for each sequence length L. Shapes: target hidden 2560, 36 target layers, vocab 151936
(tied embeddings, as Qwen3-4B), aux layers [1, 9, 17, 25, 33] (K = 5), 5 draft layers mirroring
Qwen3-4B (FFN 9728, 32 Q / 8 KV heads, head dim 128), 512 anchors, block 7, Markov rank 256,
confidence head with Markov features.

Reference: measurements of the peers' own code on one H200 (DeepSpec and ``speculators``, each compiled as it
compiles, the same shapes; speculators also at a 32,000-token draft vocabulary), read from ``--reference``
(default ``../shared/anchors/train_step_peers_h200.json`` beside the checkout); its path and values are copied into
the output JSON, and each row gets ``speedup_vs_<peer>`` / ``peak_ratio_vs_<peer>`` against the peer's run at the
same L and draft vocabulary. Targets: >= 1.5x DeepSpec's throughput at <= 0.5x its peak memory (``meets_target``);
>= 1.35x speculators' at <= 0.7x its memory (``meets_speculators_target``). Without the file the ratios are left
out. ``model_tflop`` counts the step's matrix work (``step_tflop``) and ``mfu`` divides it by ``--peak-tflops``.
``host_s``: the host's time to queue one step onto an idle GPU (``queue_seconds``): near or above ``step_s``, the
step is bound by the host's launches; well below it, by the GPU's work. ``--launch graph`` replays each batch's
whole step from a CUDA graph (``train/step_graph.py``): its ``step_s`` is the GPU's time for the step with no
launch gaps (rows say ``launch``).

Precision modes (docs/DESIGN.md, "Training numerics"): ``amp`` (the shared trainer's default, ``train.param_dtype:
float32``: fp32 weights and AdamW state, bf16 autocast, frozen LM head kept in bf16), ``bf16_master``
(``train.param_dtype: bfloat16``: bf16 working weights the forward reads, fp32 master weights and AdamW state in
``MasterAdamW``, its one-pass Triton step on CUDA) and ``bf16`` (pure bf16: bf16 weights, gradients and AdamW
moments, no master copy; a benchmark mode only, the trainer refuses it).

Where the hidden states come from (``--hidden-states cache online``, ``train.hidden_states``): ``cache`` (the
default) gives the step its aux / last states as a cache read would, already in memory; ``online`` builds a random
target of the same shapes (36 layers, Qwen3-4B's widths; on the GPU in bf16, where it runs) and the step first
fills the batch with its states (``cache/online.py``: ``OnlineTarget.fill``, one target forward, autocast off, no
host read), as the trainer's ``prepare_step`` does. Online rows add ``target_forward_s`` (that fill alone, timed
after the steps) and ``target_share`` (its share of the online step), ``target_tflop`` (its forward's matrix work;
``mfu`` then counts both); each row says ``hidden_states``, and the rows of one length are side by side.


``--peers`` adds, in the same process and on the same samples, ``speculators``' own DSpark model and loss stepped in
its trainer's default numerics (fp32 weights and AdamW state, bf16 autocast; ``dspark_core/bench/train_peers.py``)
at each length (rows ``loop: speculators``, with its MFU), and each dspark row's ``speedup_vs_speculators_run`` /
``peak_ratio_vs_speculators_run`` against it. DeepSpec is not on PyPI: its rows come from ``--reference``.

    python benchmarks/bench_train_step.py    # amp + bf16_master, L = 2048, 4096 -> reports/bench/train_step.json
    python benchmarks/bench_train_step.py --peers [--vocab-size 32000 --teacher-vocab draft]   # + speculators
    python benchmarks/bench_train_step.py --hidden-states cache online   # + the online target forward
    python benchmarks/bench_train_step.py --precision amp --recompute --profile   # one mode, layer recompute, kernels
    python benchmarks/bench_train_step.py --tiny --out /tmp/x.json   # CPU smoke run on tiny shapes
    python benchmarks/bench_train_step.py --precision bf16 --markov-head rnn --out reports/bench/train_step_rnn.json
    python benchmarks/bench_train_step.py --precision bf16 --mixed 4 [--packed [--packed-length 16384]] \
        --out reports/bench/train_step_mix.json   # 4 samples of L/8..L: padded rows, or packed (one row of 16384)
    python benchmarks/bench_train_step.py --vocab-size 32000 --out reports/bench/train_step_v32k.json
        # a reduced draft vocabulary (draft.vocab_size): the draft's head and W2 over 32,000 tokens, the teacher
        # over all 151,936; the batch's tokens are drawn from those 32,000 (the ranking's full coverage)
    python benchmarks/bench_train_step.py --vocab-size 32000 --teacher-vocab draft --out reports/bench/train_step_v32k_td.json
        # loss.teacher_vocab: draft, the teacher over the 32,000 only and renormalised (speculators' 32k teacher)
    python benchmarks/bench_train_step.py --precision amp --hidden-states cache online \
        --out reports/bench/train_step_online.json   # training without a cache: the target's forward in the step

``--profile`` profiles one more step after the timed ones (at the last length) and writes its tables beside the
JSON (``<out stem>.profile_<precision>.txt``): the device time by part (the chunked loss = LM-head GEMMs + chunk
math, the rest) and kernel kind (GEMM, attention, the loss kernels, optimiser, other elementwise), the top kernels
by device time, the top host ops, and every host-device synchronisation of a step with its caller.
    torchrun --nproc_per_node 4 benchmarks/bench_train_step.py --precision bf16 \
        --baseline reports/bench/train_step.json --out reports/bench/train_step_ddp4.json   # 4 GPUs, DDP

Several processes (``torchrun``; NCCL on GPU, gloo on CPU): the draft is wrapped in DistributedDataParallel,
each rank steps on its own sample of length L (weak scaling: global batch = world size), ``step_s`` is the
slowest rank's, ``tokens_per_s`` counts all ranks, and with ``--baseline`` (a one-process JSON of the same
settings) each row gets ``scaling_efficiency`` = one-process step_s / this step_s. Each rank normalises its own
loss here: that equal-global-batch runs give the one-process trajectory is the trainer's job (tests/test_draft_ddp.py).

Imports only torch, transformers and ``dspark_core.draft``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from dspark_core.bench.train_peers import speculators_available  # noqa: E402
from dspark_core.dist import Dist, init_distributed  # noqa: E402
from dspark_core.draft import attention  # noqa: E402
from dspark_core.draft.anchors import add_anchor_fields  # noqa: E402
from dspark_core.draft.config import DraftConfig, LossConfig  # noqa: E402
from dspark_core.draft.loss import PROFILE_RANGE  # noqa: E402
from dspark_core.draft.model import DSparkDraft  # noqa: E402
from dspark_core.draft.packing import collate_packed, sample_places  # noqa: E402
from dspark_core.draft.synthetic import random_item  # noqa: E402
from dspark_core.draft.task import DSparkTrainModel, draft_denominators  # noqa: E402
from dspark_core.errors import UserError  # noqa: E402
from dspark_core.testing import QWEN3_4B_SHAPES, QWEN3_8B_SHAPES  # noqa: E402

SHAPES = {"qwen3-4b": QWEN3_4B_SHAPES, "qwen3-8b": QWEN3_8B_SHAPES}  # --shape: the target's (and the draft's) widths
from dspark_core.train.optim import MasterAdamW, TritonAdamW, optimizer_kernel  # noqa: E402
from dspark_core.train.trainer import clip_and_step  # noqa: E402

DEFAULT_REFERENCE = ROOT.parent / "shared" / "anchors" / "train_step_peers_h200.json"
AUX_LAYERS = (1, 9, 17, 25, 33)
PRECISIONS = ("amp", "bf16_master", "bf16")  # the trainer's default, master weights, pure bf16 (benchmark only)


def target_config(tiny: bool, shape: str = "qwen3-4b") -> Qwen3Config:
    if tiny:
        return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=36,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                           rope_theta=1e6, max_position_embeddings=8192)
    return Qwen3Config(**SHAPES[shape])


def build(args, precision: str,
          device: torch.device) -> tuple[DSparkTrainModel, torch.optim.Optimizer, list[torch.nn.Parameter]]:
    tc = target_config(args.tiny, args.shape)
    cfg = draft_config(args, tc)
    frozen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lm = torch.randn(tc.vocab_size, tc.hidden_size, device=device, dtype=frozen_dtype) * 0.02  # tied embed/LM head
    with torch.device(device):  # build the weights where they will live
        draft = DSparkDraft(cfg, tc, lm, lm, aux_layer_ids=AUX_LAYERS)  # a draft vocabulary: ids 0 .. N-1
    draft.gradient_checkpointing = args.recompute
    draft.compile_layers = args.compile_layers
    param_dtype = torch.float32 if precision == "amp" else torch.bfloat16
    draft = draft.to(device=device, dtype=param_dtype)
    draft.set_frozen_dtype(frozen_dtype)
    model = DSparkTrainModel(draft, loss_config(args, args.chunk[0]))
    params = [p for p in model.parameters() if p.requires_grad]
    hp = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    kernel = optimizer_kernel(args.opt_kernel, device)  # train/optim.py
    if precision == "bf16_master":  # train.param_dtype: bfloat16 (master_dtype float32)
        opt = MasterAdamW(params, kernel=kernel, **hp)
    elif kernel == "triton":
        opt = TritonAdamW(params, **hp)
    else:
        opt = torch.optim.AdamW(params, fused=device.type == "cuda" and args.fused, **hp)
    return model, opt, params


def build_target(args, device: torch.device):
    """The online rows' frozen target: a random Qwen3 of ``target_config``'s shapes (36 layers), built on ``device``
    in its compute dtype (bf16 on a GPU, float32 on the CPU), as the trainer's ``OnlineTarget`` over the draft's
    aux layers (its states rounded as a bf16 store would hold them)."""
    from transformers import AutoModelForCausalLM

    from dspark_core.cache.online import OnlineTarget

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(1)
    with torch.device(device):  # the weights made where they run, in their dtype
        model = AutoModelForCausalLM.from_config(target_config(args.tiny, args.shape), dtype=dtype, attn_implementation="sdpa")
    return OnlineTarget(model, AUX_LAYERS, "bf16", dtype)


def online_batch(batch: dict, items: list[dict], places: list[tuple[int, int]]) -> dict:
    """``batch`` without its hidden states, plus the target forwards that fill it (each sample at its own length:
    the bench has no cache batch plan)."""
    from dspark_core.cache.online import PLAN_KEY, target_forwards

    marked = [{**it, "forward_width": len(it["input_ids"]), "forward_padded": False} for it in items]
    out = {k: v for k, v in batch.items() if k not in ("aux_hidden", "last_hidden")}
    out[PLAN_KEY] = target_forwards(marked, places)
    return out



def optimizer_name(args, device: torch.device) -> str:
    """The AdamW step a row ran: ``--optimizer-kernel`` resolved on its device."""
    return optimizer_kernel(args.opt_kernel, device)


def make_item(args, length: int, device: torch.device, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One random sample of ``length`` tokens (on the CPU; token ids from the draft vocabulary when reduced)."""
    tc = target_config(args.tiny, args.shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return random_item(length, args.vocab_size or tc.vocab_size, len(AUX_LAYERS), tc.hidden_size,
                       prompt_len=max(1, length // 16), generator=g, dtype=dtype)


def make_batch(args, length: int, device: torch.device, seed: int, online: bool = False) -> dict[str, torch.Tensor]:
    tc = target_config(args.tiny, args.shape)
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab = args.vocab_size or tc.vocab_size  # token ids drawn from the draft vocabulary when it is reduced
    if args.mixed:  # N samples of L/8 .. L tokens: one a row (padded to the longest), or packed into rows of L
        lens = mixed_lengths(args, length)
        items = [random_item(n, vocab, len(AUX_LAYERS), tc.hidden_size, prompt_len=max(1, n // 16),
                             generator=g, dtype=dtype) for n in lens]
        row_length = (args.packed_length or length) if args.packed else 1
        batch = collate_packed(items, args.anchors, 7, row_length, g, compact=args.slots == "compact")
        if online:
            batch = online_batch(batch, items, sample_places(lens, row_length))
        return to_device(batch, device)
    item = make_item(args, length, device, g)
    batch = {k: v.unsqueeze(0) for k, v in item.items()}
    batch["lengths"] = torch.tensor([length])
    batch = add_anchor_fields(batch, args.anchors, 7, g, compact=args.slots == "compact")
    if online:
        batch = online_batch(batch, [item], [(0, 0)])
    return to_device(batch, device)


def mixed_lengths(args, length: int) -> list[int]:
    """``--mixed N``: the N sample lengths of L/8 .. L, the same in every batch (contents differ by seed): one
    compiled shape, not one per batch."""
    return torch.randint(max(8, length // 8), length + 1, (args.mixed,),
                         generator=torch.Generator().manual_seed(length)).tolist()


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on ``device``; other values (the teacher plan, a host-side object) as they are."""
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def draft_config(args, tc) -> DraftConfig:
    return DraftConfig(num_draft_layers=5, block_size=7, mask_token_id=tc.vocab_size - 1, num_anchors=args.anchors,
                       markov_rank=16 if args.tiny else 256, markov_head=args.markov_head,
                       confidence_with_markov=args.markov_head != "none", vocab_size=args.vocab_size,
                       anchor_slots=args.slots)


TRAINER_NUMERICS = {"amp": ("float32", "float32"), "bf16_master": ("bfloat16", "float32"),
                    "bf16": ("bfloat16", "bfloat16")}  # precision -> train.param_dtype, train.master_dtype


def run_trainer(args, precision: str, length: int, device: torch.device, target=None) -> dict:
    """The shared trainer's own loop (``train.trainer.train``: batches collated in the loop or by
    ``--trainer-workers`` processes, moved to the device, clip + AdamW, its per-step logging) on 3 random samples of
    ``length`` tokens in ``precision``'s numerics (``TRAINER_NUMERICS``: amp is ``train.param_dtype: float32``,
    bf16_master ``bfloat16`` on float32 masters; pure bf16 the trainer refuses); time per step between the step
    callbacks of the timed steps, and peak memory. ``target`` (online rows): the items carry tokens only and the
    trainer's ``prepare_step`` runs the target on each step (``train.hidden_states: online``)."""
    import tempfile

    from dspark_core.draft.task import DSparkTask
    from dspark_core.train.trainer import TrainConfig, train

    tc = target_config(args.tiny, args.shape)
    g = torch.Generator().manual_seed(0)
    lm = torch.randn(tc.vocab_size, tc.hidden_size, generator=g).mul_(0.02)  # tied embedding / LM head
    items = [make_item(args, length, device, g) for _ in range(3)]
    online = {}
    if target is not None:  # tokens only; the plan's widths: each sample's own length
        items = [{"input_ids": it["input_ids"], "loss_mask": it["loss_mask"], "forward_width": length,
                  "forward_padded": False} for it in items]
        online = {"online_target": lambda dev: target}
    task = DSparkTask(draft_config(args, target_config(args.tiny, args.shape)), loss_config(args, args.chunk[0]), target_config=tc,
                      embed_weight=lm, lm_head_weight=lm, aux_layer_ids=AUX_LAYERS, train_data=items, **online)
    stamps: list[float] = []
    total = args.warmup + args.steps
    param_dtype, master_dtype = TRAINER_NUMERICS[precision]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(lr=1e-4, warmup_ratio=0.0, total_steps=total, micro_batch_size=1, global_batch_size=1,
                          checkpoint_every=10 ** 9, log_every=10 ** 9, data_workers=args.trainer_workers, out_dir=tmp,
                          param_dtype=param_dtype, master_dtype=master_dtype,
                          attention_kernel=attention.ATTENTION_KERNEL, optimizer_kernel=args.opt_kernel)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        result = train(task, cfg, progress=False, checkpoints=False,
                       on_step=lambda step, row: stamps.append(time.perf_counter()))
    step_s = (stamps[-1] - stamps[args.warmup - 1]) / args.steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    row = {"precision": precision, "loop": "trainer", "trainer_workers": args.trainer_workers,
           "trainable_params": sum(p.numel() for p in result.model.parameters() if p.requires_grad),
           "chunk": args.chunk[0], "L": length, "draft_vocab_size": args.vocab_size, "teacher_vocab": args.teacher_vocab,
           "step_s": step_s, "tokens_per_s": length / step_s, "peak_gib": peak, "loss": result.history[-1]["loss"],
           "warmup_s": stamps[args.warmup - 1] - stamps[0], "world_size": 1,
           "hidden_states": "cache" if target is None else "online"}
    row["model_tflop"] = step_tflop(tc, result.model.draft, length, args.anchors, args.teacher_vocab)
    if target is not None:
        row["target_tflop"] = target_tflop(tc, [length])
    if device.type == "cuda" and args.peak_tflops:
        row["mfu"] = (row["model_tflop"] + row.get("target_tflop", 0.0)) / step_s / args.peak_tflops
    return row


def train_step(model: DSparkTrainModel, opt, params, batch: dict[str, torch.Tensor], amp: bool,
               forward) -> torch.Tensor:
    """One optimiser step; returns the loss without synchronising (steps queue up on the GPU)."""
    dens = draft_denominators(batch["slot_valid"], model.loss_cfg.decay_gamma)
    weight = dens["weight"].clamp_min(1e-12)
    with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=amp):
        sums = forward(batch)
        loss = (sums["distill"] + model.loss_cfg.conf_alpha * sums["confidence"]) / weight
    loss.backward()
    clip_and_step(opt, params, 1.0)  # the trainer's clip + AdamW step
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def step_launcher(model, opt, params, batches: list[dict], amp: bool, forward, fill, launch: str,
                  device: torch.device):
    """``step(i)``: one training step on ``batches[i]`` (filled by ``fill``), eagerly or (``launch`` graph) replayed
    from that batch's CUDA graph, recorded at its first call (``CapturedStep``, key i; the optimiser's groups made
    ``capturable``, so its step counts stay on the device)."""
    if launch == "eager":
        return lambda i: train_step(model, opt, params, fill(batches[i]), amp, forward)
    from dspark_core.train.step_graph import CapturedStep

    for group in opt.param_groups:
        group["capturable"] = True
    names = [[k for k, v in b.items() if torch.is_tensor(v)] for b in batches]  # [batch][its tensor keys]

    def run(i: int, *tensors: torch.Tensor) -> torch.Tensor:
        batch = {**batches[i], **dict(zip(names[i], tensors))}  # the host values (a teacher plan) stay batch i's
        return train_step(model, opt, params, fill(batch), amp, forward)

    captured = CapturedStep(run, device)
    return lambda i: captured(i, [batches[i][k] for k in names[i]])


def queue_seconds(step, n: int, device: torch.device, reps: int = 3) -> float:
    """``host_s``: the host's time to queue one step onto an idle GPU (the median of ``reps``; each step starts after
    the device has finished the last). In the timed loop the host runs ahead until CUDA's launch queue is full and
    then waits for the GPU, so the time it spends there tracks the GPU's; this one does not: a step whose
    ``host_s`` is below its ``step_s`` leaves the GPU enough work to stay busy, one whose ``host_s`` is near or
    above it starves the GPU between launches."""
    times = []
    for i in range(reps):
        sync(device)
        t0 = time.perf_counter()
        step(i % n)
        times.append(time.perf_counter() - t0)
    sync(device)
    return sorted(times)[len(times) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_length(args, precision: str, model, opt, params, length: int, device: torch.device, forward,
               d: Dist = Dist(), target=None, launch: str = "eager") -> dict:
    """The timed steps at ``length``; ``target`` (online rows): each step first fills its batch with the target's
    states (``OnlineTarget.fill``), then the fill alone is timed. ``launch`` ``graph``: each of the 3 batches' whole
    step (the fill included) is recorded once in a CUDA graph (``train/step_graph.py``; the recording's eager run
    is its warm-up step) and the timed steps replay them."""
    batches = [make_batch(args, length, device, seed + 1000 * d.rank, online=target is not None)
               for seed in range(3)]  # [rank's samples]
    fill = target.fill if target is not None else (lambda batch: batch)
    amp = precision == "amp" and device.type == "cuda"
    say = (lambda msg: print(f"  L {length}: {msg}", file=sys.stderr, flush=True)) if d.is_main else (lambda msg: None)
    say(f"{int(batches[0]['input_ids'].shape[0])} row(s) of {int(batches[0]['input_ids'].shape[1])} tokens, "
        f"{int(batches[0]['anchors'].shape[1])} anchor slots a row; {launch}; warm-up ({args.warmup} steps, compiles)")
    step = step_launcher(model, opt, params, batches, amp, forward, fill, launch, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # a graph's recording allocates its memory once, here
    t0 = time.perf_counter()
    for i in range(max(args.warmup, len(batches) if launch == "graph" else 0)):
        step(i % len(batches))
        sync(device)
        say(f"warm-up step {i + 1} done at {time.perf_counter() - t0:.1f} s")
    warm_s = time.perf_counter() - t0
    if device.type == "cuda" and launch == "eager":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    d.barrier()
    t0 = time.perf_counter()
    loss = torch.zeros(())
    for i in range(args.steps):
        loss = step(i % len(batches))
    sync(device)
    loss = float(loss)
    step_s = slowest((time.perf_counter() - t0) / args.steps, d)
    host_s = queue_seconds(step, len(batches), device)
    for group in opt.param_groups:  # the next row's eager steps as built (step_launcher set it for the graphs)
        group["capturable"] = False
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    online = {"hidden_states": "cache"}
    if target is not None:  # the target's forward alone, as many times
        t0 = time.perf_counter()
        for i in range(args.steps):
            fill(batches[i % len(batches)])
        sync(device)
        forward_s = slowest((time.perf_counter() - t0) / args.steps, d)
        online = {"hidden_states": "online", "target_forward_s": forward_s, "target_share": forward_s / step_s,
                  "target_tflop": target_tflop(target_config(args.tiny, args.shape),
                                               mixed_lengths(args, length) if args.mixed else [length])}
    tokens = int(batches[0]["lengths"].sum()) if args.mixed else length  # a step's real tokens (first batch)
    row = {"precision": precision, "chunk": model.loss_cfg.vocab_chunk_slots, "L": length,
           "draft_vocab_size": args.vocab_size, "teacher_vocab": args.teacher_vocab, "step_s": step_s,
           "host_s": host_s,
           "tokens_per_s": d.world_size * tokens / step_s, "peak_gib": peak, "loss": loss,
           "mixed": args.mixed, "packed": args.packed,
           "packed_length": (args.packed_length or length) if args.packed else None, "rows": int(batches[0]["input_ids"].shape[0]),
           "warmup_s": warm_s, "valid_slots": int(batches[0]["slot_valid"].sum()),
           "anchor_width": int(batches[0]["anchors"].shape[1]), "world_size": d.world_size, "launch": launch,
           **online}
    row["model_tflop"] = step_tflop(target_config(args.tiny, args.shape), model.draft, length, args.anchors, args.teacher_vocab)
    if device.type == "cuda" and args.peak_tflops:
        row["mfu"] = (row["model_tflop"] + row.get("target_tflop", 0.0)) / step_s / args.peak_tflops
    if not args.tiny and target is None:  # the peers' reference steps are draft steps: beside the cache rows only
        add_reference(row, args.reference)
    return row


def add_reference(row: dict, reference) -> None:
    """The row's ratios to the peers' runs at its L and draft vocabulary (``speedup_vs_<peer>``,
    ``peak_ratio_vs_<peer>``; ``<peer>_default`` for a peer's default numerics) and whether it meets the goals
    (against the peers' pure-bf16 runs); nothing when no ``reference`` file is there."""
    refs = reference_runs(reference, row["L"], row.get("draft_vocab_size"))
    step_s, peak = row["step_s"], row["peak_gib"]
    for peer, ref in refs.items():
        sfx = "" if peer == "ref" else f"_{peer}"
        row[f"speedup_vs{sfx or '_ref'}"] = ref["step_s"] / step_s
        row[f"peak_ratio_vs{sfx or '_ref'}"] = peak / ref["peak_gib"] if peak is not None else None
    base = "ref" if "ref" in refs else "deepspec" if "deepspec" in refs else None
    if base is not None:  # the goal against DeepSpec
        row["meets_target"] = bool(row[f"speedup_vs_{base}"] >= 1.5 and peak is not None
                                   and row[f"peak_ratio_vs_{base}"] <= 0.5)
    if "speculators" in refs:  # the goal against speculators at the same draft vocabulary
        row["meets_speculators_target"] = bool(row["speedup_vs_speculators"] >= 1.35 and peak is not None
                                               and row["peak_ratio_vs_speculators"] <= 0.7)


def add_online_ratios(rows: list[dict], peak_tflops: float | None) -> None:
    """Each online row's ``online_over_cache`` (its step over the cache row of the same L, launch and loop, this
    run) and ``target_mfu`` (its target forward alone, ``target_tflop`` over ``target_forward_s``)."""
    def key(r: dict) -> tuple:
        return r["L"], r.get("launch", "eager"), r.get("loop", "script"), r["precision"], r.get("draft_vocab_size")

    cached = {key(r): r for r in rows if r.get("hidden_states", "cache") == "cache"}
    for r in rows:
        if r.get("hidden_states") != "online":
            continue
        if key(r) in cached:
            r["online_over_cache"] = r["step_s"] / cached[key(r)]["step_s"]
        if peak_tflops and r.get("target_forward_s"):
            r["target_mfu"] = r["target_tflop"] / r["target_forward_s"] / peak_tflops


def rescore(path: Path, reference: list[Path]) -> None:
    """Recompute the peer ratios of a report written where the reference files were absent (e.g. another machine),
    and its online rows' ratios, in place, and print its table."""
    report = json.loads(path.read_text())
    add_online_ratios(report["results"], report.get("peak_tflops"))
    for row in report["results"]:
        if row.get("loop") != "speculators" and row.get("hidden_states", "cache") == "cache":  # draft steps only
            add_reference(row, reference)
    report["reference"] = {"source": [str(r) for r in reference if Path(r).is_file()],
                           "runs": {r["L"]: reference_runs(reference, r["L"], r.get("draft_vocab_size"))
                                    for r in report["results"]},
                           "target": report.get("reference", {}).get("target")}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    print_table(report)


def slowest(seconds: float, d: Dist) -> float:
    """The largest ``seconds`` over the ranks (a step is as slow as its slowest rank)."""
    if d.world_size == 1:
        return seconds
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def add_scaling(rows: list[dict], baseline: Path) -> None:
    """``scaling_efficiency`` of each row against the matching row (precision, chunk, L) of a one-process run."""
    base = json.loads(baseline.read_text())
    if base["results"] and base["results"][0].get("world_size", 1) != 1:
        raise ValueError(f"--baseline {baseline}: not a one-process run (world_size {base['results'][0]['world_size']})")
    ref = {(r["precision"], r["chunk"], r["L"]): r["step_s"] for r in base["results"]}
    for r in rows:
        key = (r["precision"], r["chunk"], r["L"])
        if key not in ref:
            raise ValueError(f"--baseline {baseline}: no one-process row for precision {key[0]}, chunk {key[1]}, L {key[2]}")
        r["scaling_efficiency"] = ref[key] / r["step_s"]


def profile_step(args, precision: str, model, opt, params, length: int, device: torch.device, forward,
                 target=None) -> Path:
    """Profile one step at ``length`` (``target``: an online step, its fill included); its tables go to
    ``<out stem>.profile_<precision>.txt`` (returned)."""
    from torch.profiler import ProfilerActivity, profile

    batch = make_batch(args, length, device, 7, online=target is not None)
    fill = target.fill if target is not None else (lambda b: b)
    amp = precision == "amp" and device.type == "cuda"
    train_step(model, opt, params, fill(batch), amp, forward)
    lines = [f"bench_train_step profile: precision {precision}, L {length}, draft vocab {args.vocab_size or 'full'}, "
             f"teacher {args.teacher_vocab}, chunk {model.loss_cfg.vocab_chunk_slots}, recompute {args.recompute}, "
             f"hidden states {'online' if target is not None else 'cache'}"]
    if device.type == "cuda":  # every host<->device synchronisation of one step, with its caller
        lines += sync_sites(lambda: train_step(model, opt, params, fill(batch), amp, forward))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        train_step(model, opt, params, fill(batch), amp, forward)
        sync(device)
    lines.append(f"profiled step wall {time.perf_counter() - t0:.4f} s")
    avg = prof.key_averages()
    lines += [f"{e.key}: {e.count} call(s), host {e.cpu_time_total / 1e3:.2f} ms, device {e.device_time_total / 1e3:.2f} "
              f"ms (its kernels and its children's)" for e in avg if e.key == PROFILE_RANGE]
    if device.type == "cuda":
        listed = sum(e.self_device_time_total for e in avg)
        lines += ["", device_time_shares(prof.events(), listed), "",
                  avg.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90)]
    lines += ["", avg.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=90)]
    path = args.out.with_name(f"{args.out.stem}.profile_{precision}.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    print("\n".join(lines[:-2]))  # all but the host-op table
    print(f"wrote {path}")
    return path


def sync_sites(step) -> list[str]:
    """Every call that synchronised host and device during ``step()``: the innermost frames of its Python stack
    (the op's own site, then its callers up to this file), each distinct stack once with its count."""
    import traceback
    import warnings

    stacks: dict[tuple[str, ...], int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                  if not f.filename.endswith(("warnings.py", "bench_train_step.py"))]
        key = tuple(frames[-6:][::-1])  # innermost first
        if key and key[0].endswith(" set_sync_debug_mode"):  # switching the debug mode itself, not the step
            return
        stacks[key] = stacks.get(key, 0) + 1

    with warnings.catch_warnings():  # restores showwarning afterwards
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    lines = [f"synchronising calls in one step: {sum(stacks.values())}"]
    for key, count in stacks.items():
        lines += [f"  {count} x {key[0] if key else '?'}"] + [f"      from {frame}" for frame in key[1:]]
    return lines


# kernel kinds by name (first match wins): what a profiled step's device time goes to
KERNEL_KINDS = (
    ("loss math", ("_stats", "_reduce", "_grad")),  # dspark_core/kernels/distill.py
    ("attention", ("flex", "attention", "fmha", "flash")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "splitk")),
    ("optimiser", ("adam", "multi_tensor", "foreach", "norm_kernel")),
    ("copy / cast", ("copy", "cat", "index", "gather", "scatter", "fill")),
)


def kernel_kind(name: str) -> str:
    """The kind of a device kernel by its name (``KERNEL_KINDS``; ``other elementwise`` when none matches)."""
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other elementwise"


def _kernels(event, in_loss: bool, out: list) -> None:
    """(kernel name, device us, inside the loss range) of ``event``'s kernels and its children's, into ``out``."""
    in_loss = in_loss or event.name == PROFILE_RANGE
    out.extend((k.name, k.duration, in_loss) for k in event.kernels)
    for child in event.cpu_children:
        _kernels(child, in_loss, out)


def device_time_shares(events, listed_us: float) -> str:
    """A table of a profiled step's device time by part (the chunked loss, the rest) and kernel kind;
    ``listed_us``: the profile's own total of kernel time, to show how much of it the host ops account for."""
    rows: list = []
    for ev in events:
        if ev.cpu_parent is None:
            _kernels(ev, False, rows)
    total = sum(us for _, us, _ in rows) or 1.0
    table: dict[tuple[str, bool], float] = {}
    for name, us, in_loss in rows:
        key = (kernel_kind(name), in_loss)
        table[key] = table.get(key, 0.0) + us
    kinds = [k for k, _ in KERNEL_KINDS] + ["other elementwise"]
    out = [f"device time {total / 1e3:.2f} ms in {len(rows)} kernels launched by host ops (the profile lists "
           f"{listed_us / 1e3:.2f} ms); by kind: in the chunked loss (LM-head GEMMs "
           f"for teacher, draft and its gradient, chunk math) | elsewhere (layers, fc, heads, backward, optimiser)",
           f"{'kind':<18} {'loss ms':>9} {'loss %':>7} {'rest ms':>9} {'rest %':>7}"]
    for kind in kinds:
        a, b = table.get((kind, True), 0.0), table.get((kind, False), 0.0)
        out.append(f"{kind:<18} {a / 1e3:>9.2f} {a / total:>7.1%} {b / 1e3:>9.2f} {b / total:>7.1%}")
    a = sum(v for (_, inside), v in table.items() if inside)
    out.append(f"{'all':<18} {a / 1e3:>9.2f} {a / total:>7.1%} {(total - a) / 1e3:>9.2f} {(total - a) / total:>7.1%}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke test)")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-4b",
                    help="the target's shapes (the draft takes its widths; 5 layers, aux layers [1, 9, 17, 25, 33])")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths (default 2048 4096)")
    ap.add_argument("--anchors", type=int, default=None, help="anchors per sample (default 512; tiny 16)")
    ap.add_argument("--chunk", type=int, nargs="+", default=[512], help="loss.vocab_chunk_slots (one run each)")
    ap.add_argument("--precision", choices=PRECISIONS, nargs="+", default=["amp", "bf16_master"],
                    help="amp: fp32 weights + AdamW state, bf16 autocast (the trainer's default); bf16_master: bf16 "
                         "working weights, fp32 master weights + AdamW state (train.param_dtype: bfloat16); bf16: "
                         "pure bf16 weights + AdamW state (a benchmark mode: the trainer refuses it)")
    ap.add_argument("--markov-head", choices=("vanilla", "gated", "rnn", "none"), default="vanilla",
                    help="draft.markov_head (none: the confidence head reads h only)")
    ap.add_argument("--mixed", type=int, default=0,
                    help="a step is N samples of L/8..L tokens, one a row padded to the longest (default 0: one of L)")
    ap.add_argument("--packed", action="store_true", help="with --mixed: pack the samples into rows of L tokens")
    ap.add_argument("--packed-length", type=int, default=None,
                    help="with --packed: rows of this many tokens (draft.packed_length; default L); one row holding "
                         "every sample (e.g. N * L) has no anchor padding")
    ap.add_argument("--recompute", action="store_true", help="activation checkpointing of each draft layer")
    ap.add_argument("--no-fused", dest="fused", action="store_false", help="foreach AdamW instead of fused")
    ap.add_argument("--compile", action="store_true", help="torch.compile the whole training forward")
    ap.add_argument("--no-compile-layers", dest="compile_layers", action="store_false",
                    help="run the draft layers eagerly (default: each layer step compiled, flex inside)")
    ap.add_argument("--profile", action="store_true",
                    help="profile one extra step: tables written beside --out (<stem>.profile_<precision>.txt)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="draft.vocab_size: a reduced draft vocabulary of this many tokens (default: the target's)")
    ap.add_argument("--teacher-vocab", choices=("full", "draft"), default="full",
                    help="loss.teacher_vocab: the teacher over the full vocabulary, or over the draft's only "
                         "(renormalised there; the same as full without --vocab-size)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench" / "train_step.json")
    ap.add_argument("--reference", type=Path, nargs="+", default=[DEFAULT_REFERENCE],
                    help="JSON files of reference measurements: runs[] (one peer), {peer: {runs[], "
                         "default_numerics: {runs[]}}} or bench_deepspec_harness.py's list of runs "
                         "(seq_len / step_s / peak_gib[, draft_vocab_size, optimizer])")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="the GPU's dense bf16 peak for the MFU column (default 989: an H200 SXM)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="one-process JSON of the same settings: adds scaling_efficiency (torchrun runs)")
    ap.add_argument("--flex-options", type=json.loads, default=None,
                    help='flex_attention kernel_options as JSON (attention.FLEX_KERNEL_OPTIONS), e.g. '
                         '\'{"bwd_num_warps": 8}\'')
    ap.add_argument("--attention-kernel", choices=("auto", "triton", "flash"), nargs="+", default=["auto"],
                    help="train.attention_kernel: auto (the default: flash where it runs), torch's Triton flex kernels "
                         "and / or FlashAttention-4 (flash-attn-4 package); several: one pass each, same run (rows "
                         "say which ran)")
    ap.add_argument("--optimizer-kernel", choices=("auto", "torch", "triton"), nargs="+", default=["auto"],
                    help="train.optimizer_kernel: torch's fused AdamW and / or the Triton AdamW kernel "
                         "(train/optim.py); several: one pass each, same run (rows say optimizer)")
    ap.add_argument("--anchor-slots", choices=("compact", "fixed"), nargs="+", default=["compact"],
                    help="draft.anchor_slots: a row's anchor slots cut to its valid anchors (rounded up to "
                         "anchors / 8), or anchors per sample; several: one pass each per length (rows say which)")
    ap.add_argument("--hidden-states", choices=("cache", "online"), nargs="+", default=["cache"],
                    help="train.hidden_states: the step's states as read from a cache (in memory), and / or computed "
                         "by a random target of the same shapes (36 layers; bf16 on the GPU) in the step; rows say "
                         "hidden_states, online rows add target_forward_s and target_share")
    ap.add_argument("--target-compile", choices=("on", "off"), nargs="+", default=["on"],
                    help="online rows: the target's decoder layers under torch.compile (on, OnlineTarget's default "
                         "on a GPU) and / or eager (off); several: one row each, same run (rows say target_compiled)")
    ap.add_argument("--launch", choices=("eager", "graph"), nargs="+", default=["eager"],
                    help="how this script's loop launches a step: eager (Python queues every kernel) and / or graph "
                         "(each batch's whole step recorded once in a CUDA graph and replayed, train/step_graph.py); "
                         "several: one row each per length, same run (rows say launch)")
    ap.add_argument("--trainer", action="store_true",
                    help="run the shared trainer's own loop instead of this script's, in each --precision's numerics "
                         "(amp, bf16_master); rows say loop: trainer")
    ap.add_argument("--peers", action="store_true",
                    help="also step speculators' own DSpark model and loss in its default numerics (fp32 weights + "
                         "bf16 autocast) on the same samples, same process (rows say loop: speculators)")
    ap.add_argument("--peer-loss", choices=("eager", "fused"), default="eager",
                    help="with --peers: speculators' loss implementation (default eager, as --reference's rows)")
    ap.add_argument("--trainer-workers", type=int, default=2, help="with --trainer: train.data_workers (default 2)")
    ap.add_argument("--rescore", type=Path, default=None,
                    help="recompute the peer ratios of this report JSON with --reference (no run)")
    args = ap.parse_args()
    if args.rescore is not None:
        if not any(Path(r).is_file() for r in args.reference):
            raise SystemExit(f"--rescore needs a reference file; {', '.join(map(str, args.reference))} not found")
        return rescore(args.rescore, args.reference)
    if args.peers and not speculators_available():
        raise SystemExit("--peers needs the speculators package (pip install speculators)")
    if args.trainer and "bf16" in args.precision:
        raise SystemExit("--trainer --precision bf16: the trainer refuses pure-bf16 training (train.master_dtype "
                         "bfloat16); time it with this script's loop, or use bf16_master")
    if "graph" in args.launch and (args.tiny or not torch.cuda.is_available() or args.trainer):
        raise SystemExit("--launch graph records CUDA graphs: it needs a GPU and this script's loop (no --tiny, no "
                         "--trainer)")
    if args.packed and not args.mixed:
        raise SystemExit("--packed needs --mixed N (the samples to pack)")
    if args.baseline is not None and not args.baseline.is_file():
        raise SystemExit(f"--baseline {args.baseline}: file not found")
    args.lengths = args.lengths or ([64, 128] if args.tiny else [2048, 4096])
    if args.shape != "qwen3-4b":
        args.reference = []  # the peers' reference runs are at Qwen3-4B's shapes
    args.anchors = args.anchors or (16 if args.tiny else 512)
    args.slots = args.anchor_slots[0]  # the pass's draft.anchor_slots (the loops below set it)
    args.steps = args.steps or (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    if args.flex_options is not None:
        attention.FLEX_KERNEL_OPTIONS = args.flex_options
    d = init_distributed()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda" and d.world_size > 1:
        device = torch.device("cuda", d.local_rank)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    rows, n_params = [], 0
    for kernel, args.opt_kernel in [(a, o) for a in args.attention_kernel for o in args.optimizer_kernel]:
        try:
            attention.set_attention_kernel(kernel)
            optimizer_kernel(args.opt_kernel, device)
        except UserError as e:
            raise SystemExit(f"--attention-kernel {kernel} --optimizer-kernel {args.opt_kernel}: {e}") from None
        if args.trainer:
            n_params = bench_trainer(args, device, rows)
        else:
            n_params = bench_script(args, device, d, rows)
    if args.peers:
        if d.world_size > 1:
            raise SystemExit("--peers runs in one process (no torchrun)")
        bench_peers(args, device, rows)
    if d.is_main:
        print_table(write_report(args, device, n_params, rows))
        print(f"wrote {args.out}")
    if d.world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


_TARGETS: dict = {}  # (tiny, device) -> the online rows' target, built once a run


def online_target(args, device, hidden: str):
    """The random target of the online rows, built on first use and kept; None for cache rows."""
    if hidden == "cache":
        return None
    key = (args.tiny, str(device))
    if key not in _TARGETS:
        _TARGETS[key] = build_target(args, device)
    return _TARGETS[key]


def bench_trainer(args, device, rows: list[dict]) -> int:
    """The trainer's own loop at each precision and length (rows appended; returns the trainable parameter count)."""
    n_params = 0
    for precision, length, args.slots, hidden in [(p, n, s, h) for h in args.hidden_states for p in args.precision
                                                  for n in args.lengths for s in args.anchor_slots]:
        resident = bool(_TARGETS)  # the online rows' target already holds memory (in this row's peak)
        rows.append({**run_trainer(args, precision, length, device, online_target(args, device, hidden)),
                     "target_resident": resident or hidden == "online",
                     "attention": attention.ATTENTION_KERNEL, "optimizer": optimizer_name(args, device),
                     "anchor_slots": args.slots})
        n_params = rows[-1]["trainable_params"]
        print(json.dumps(rows[-1]), flush=True)
    write_report(args, device, n_params, rows)
    return n_params


def bench_peers(args, device, rows: list[dict]) -> None:
    """``--peers``: speculators' DSpark model and loss in its default numerics at each length, on this script's
    samples (rows appended, then each dspark row's ratios to the speculators row of its length and vocabulary)."""
    from dspark_core.bench.train_peers import SpeculatorsStep

    tc = target_config(args.tiny, args.shape)
    torch.manual_seed(0)
    peer = SpeculatorsStep(tc, AUX_LAYERS, num_layers=5, block_size=7, anchors=args.anchors,
                           markov_rank=draft_config(args, tc).markov_rank, draft_vocab_size=args.vocab_size,
                           mask_token_id=tc.vocab_size - 1, device=device, loss_implementation=args.peer_loss,
                           attention="simple_flex_attention" if device.type == "cuda" else "eager")
    for length in args.lengths:
        rows.append(run_peer(args, peer, length, device))
        print(json.dumps(rows[-1]), flush=True)
    del peer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    add_peer_ratios(rows)


def run_peer(args, peer, length: int, device: torch.device) -> dict:
    """speculators' steps on the 3 samples this script's rows use at ``length`` (same seeds): warm-up, then the
    timed steps queued without a read, as :func:`run_length` times dspark's."""
    batches = [peer.inputs(make_item(args, length, device, torch.Generator().manual_seed(seed))) for seed in range(3)]
    print(f"  L {length}: speculators, warm-up ({args.warmup} steps, compiles)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    for i in range(args.warmup):
        peer.step(batches[i % len(batches)])
        sync(device)
    warm_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    loss = torch.zeros(())
    for i in range(args.steps):
        loss = peer.step(batches[i % len(batches)])
    sync(device)
    step_s = (time.perf_counter() - t0) / args.steps
    host_s = queue_seconds(lambda i: peer.step(batches[i]), len(batches), device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    row = {"loop": "speculators", "precision": "amp", "optimizer": "torch", "attention": peer.model._attn_impl,
           "loss_implementation": args.peer_loss, "L": length, "draft_vocab_size": args.vocab_size,
           "teacher_vocab": "draft" if args.vocab_size else "full", "step_s": step_s, "host_s": host_s,
           "tokens_per_s": length / step_s, "peak_gib": peak, "loss": float(loss), "warmup_s": warm_s,
           "trainable_params": peer.trainable_params, "world_size": 1, "chunk": None, "anchor_slots": "fixed",
           "model_tflop": step_tflop(target_config(args.tiny, args.shape), shape_draft(args), length, args.anchors,
                                     "draft" if args.vocab_size else "full")}
    if device.type == "cuda" and args.peak_tflops:
        row["mfu"] = row["model_tflop"] / step_s / args.peak_tflops
    return row


def shape_draft(args) -> DSparkDraft:
    """dspark's draft of this run's shapes on the meta device (no memory): what :func:`step_tflop` reads."""
    tc = target_config(args.tiny, args.shape)
    with torch.device("meta"):
        lm = torch.empty(tc.vocab_size, tc.hidden_size)
        return DSparkDraft(draft_config(args, tc), tc, lm, lm, aux_layer_ids=AUX_LAYERS)


def add_peer_ratios(rows: list[dict]) -> None:
    """Each dspark row's ``speedup_vs_speculators_run`` (the speculators row's step time over its own) and
    ``peak_ratio_vs_speculators_run`` against the speculators row of the same L and draft vocabulary, this run."""
    peers = {(r["L"], r["draft_vocab_size"]): r for r in rows if r.get("loop") == "speculators"}
    for r in rows:
        peer = peers.get((r["L"], r["draft_vocab_size"]))
        if r.get("loop") == "speculators" or peer is None:
            continue
        r["speedup_vs_speculators_run"] = peer["step_s"] / r["step_s"]
        r["peak_ratio_vs_speculators_run"] = (r["peak_gib"] / peer["peak_gib"]
                                              if r["peak_gib"] is not None and peer["peak_gib"] else None)


def bench_script(args, device, d, rows: list[dict]) -> int:
    """This script's loop: each precision x chunk x length (rows appended; returns the trainable parameter count)."""
    n_params = 0
    for precision in args.precision:
        torch.manual_seed(0)
        model, opt, params = build(args, precision, device)
        n_params = sum(p.numel() for p in params)
        core = model
        if d.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            core = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        forward = torch.compile(core) if args.compile else core
        for chunk in args.chunk:
            model.loss_cfg = loss_config(args, chunk)
            for length, args.slots, hidden, launch, compiled in [
                    (n, s, h, c, t) for h in args.hidden_states for n in args.lengths for s in args.anchor_slots
                    for c in args.launch for t in (args.target_compile if h == "online" else [None])]:
                resident = bool(_TARGETS)  # the online rows' target already holds memory (in this row's peak)
                target = online_target(args, device, hidden)  # cache rows before the target exists
                if target is not None:
                    target.set_compiled(compiled == "on")
                try:
                    row = run_length(args, precision, model, opt, params, length, device, forward, d, target, launch)
                except RuntimeError as e:  # a step that cannot be recorded: say why, keep the other rows
                    if launch != "graph":
                        raise
                    print(f"L {length}: --launch graph: the step could not be recorded in a CUDA graph: "
                          f"{str(e).splitlines()[0][:300]}", file=sys.stderr, flush=True)
                    continue
                if target is not None:
                    row["target_compiled"] = target.compiled
                rows.append({**row,
                             "target_resident": resident or hidden == "online",
                             "attention": attention.ATTENTION_KERNEL,
                             "optimizer": optimizer_name(args, device), "anchor_slots": args.slots})
                if args.baseline is not None:
                    add_scaling(rows[-1:], args.baseline)
                if d.is_main:
                    print(json.dumps(rows[-1]), flush=True)
        if d.is_main:
            write_report(args, device, n_params, rows)  # after each mode, so a later failure keeps the numbers
        if args.profile:
            profile_step(args, precision, model, opt, params, args.lengths[-1], device, forward,
                         online_target(args, device, args.hidden_states[-1]))
        del model, opt, params, forward, core  # DDP torn down while its process group lives
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return n_params


def reference_runs(paths, length: int, vocab_size: int | None) -> dict[str, dict]:
    """The reference measurements at sequence length ``length``, by peer, from each file of ``paths`` (one path or
    several; missing files are skipped): a file with top-level ``runs`` (one peer: key ``ref``), one with a
    ``{"runs": [...]}`` per peer (``deepspec``, ``speculators``) and optionally, inside a peer, its default
    numerics' ``{"default_numerics": {"runs": [...]}}`` (key ``<peer>_default``), or the DeepSpec harness's output,
    a list of runs (key ``deepspec``, ``deepspec_default`` for its ``optimizer: bf16opt`` runs: fp32 master weights).
    A run's ``draft_vocab_size`` must be ``vocab_size``, or absent / the full vocabulary when ``vocab_size`` is
    None."""
    out: dict[str, dict] = {}
    for path in ([paths] if isinstance(paths, (str, Path)) or paths is None else paths):
        if path is not None and Path(path).is_file():
            out.update(_file_runs(json.loads(Path(path).read_text()), length, vocab_size))
    return out


def _file_runs(data, length: int, vocab_size: int | None) -> dict[str, dict]:
    """:func:`reference_runs` of one file's JSON."""
    if isinstance(data, list):  # bench_deepspec_harness.py's output
        peers = {}
        for r in data:
            peers.setdefault("deepspec_default" if r.get("optimizer") == "bf16opt" else "deepspec",
                             {"runs": []})["runs"].append(r)
    elif "runs" in data:
        peers = {"ref": data}
    else:
        peers = {k: v for k, v in data.items() if isinstance(v, dict) and "runs" in v}
        peers.update({f"{k}_default": v["default_numerics"] for k, v in data.items()
                      if isinstance(v, dict) and isinstance(v.get("default_numerics"), dict)})
    out = {}
    for peer, block in peers.items():
        for r in block["runs"]:
            if "error" in r:
                continue
            vocab = r.get("draft_vocab_size")
            same_vocab = vocab == vocab_size if vocab_size is not None else vocab in (None, QWEN3_4B_SHAPES["vocab_size"])
            if r.get("seq_len") == length and same_vocab:
                out[peer] = r
                break
    return out


def loss_config(args, chunk: int) -> LossConfig:
    return LossConfig(vocab_chunk_slots=chunk, teacher_vocab=args.teacher_vocab)


def step_tflop(tc, draft: DSparkDraft, length: int, anchors: int, teacher_vocab: str = "full") -> float:
    """Matrix work of one training step in TFLOP (2 per multiply-add; backward = 2x forward for trained weights,
    1x for the input gradient through frozen ones): the draft layers over the ``anchors * block`` block tokens,
    their K/V projections over the ``length`` context tokens and attention (each block over half the context on
    average plus itself), ``fc`` over context and block, the frozen LM head as teacher (forward) and as the
    draft's head (forward + input gradient), the Markov head's W2, all over the draft's vocabulary where reduced
    (the teacher too with ``teacher_vocab`` draft)."""
    c = draft.cfg
    h, hq, hkv, dh = draft.hidden_size, draft.layers[0].self_attn.num_heads, draft.layers[0].self_attn.num_kv_heads, \
        draft.layers[0].self_attn.head_dim
    f = draft.layers[0].mlp.gate_proj.out_features
    t = anchors * c.block_size  # block tokens
    layer = h * hq * dh * 2 + h * hkv * dh * 2 + 3 * h * f  # q, o, k, v, gate/up/down weights
    kv = h * hkv * dh * 2
    attn = 4 * hq * dh * (length / 2 + c.block_size)  # scores + values per block query
    v_draft = c.vocab_size or tc.vocab_size
    work = (6 * layer * t + 6 * kv * length) * c.num_draft_layers + 3 * attn * t * c.num_draft_layers
    work += 6 * len(draft.aux_layer_ids) * tc.hidden_size * h * (length + t)  # fc
    v_teacher = v_draft if teacher_vocab == "draft" else tc.vocab_size
    work += 2 * v_teacher * h * t + 4 * v_draft * h * t  # teacher logits; draft head forward + input grad
    if c.markov_head != "none":
        work += 6 * c.markov_rank * v_draft * t
    return work / 1e12


def target_tflop(tc, lengths: list[int]) -> float:
    """Matrix work of the online rows' target forward in TFLOP: each sample of n tokens through every decoder layer
    (q / k / v / o projections and the gated MLP, 2 per multiply-add, over n tokens; causal attention scores and
    values over n^2 / 2 pairs); no LM head (the forward stops at the final norm)."""
    h, f, hq, hkv = tc.hidden_size, tc.intermediate_size, tc.num_attention_heads, tc.num_key_value_heads
    dh = getattr(tc, "head_dim", None) or h // hq
    layer = 2 * h * hq * dh + 2 * h * hkv * dh + 3 * h * f  # q, o, k, v, gate / up / down weights
    return sum(2 * n * layer + 2 * n * n * hq * dh for n in lengths) * tc.num_hidden_layers / 1e12


def write_report(args, device: torch.device, n_params: int, rows: list[dict]) -> dict:
    report = {
        "config": {k: ([str(x) for x in v] if k == "reference" else str(v) if isinstance(v, Path) else v)
                   for k, v in vars(args).items() if k != "opt_kernel"},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": rows[0]["world_size"] if rows else 1,
        "torch": torch.__version__,
        "trainable_params": n_params,
        "reference": {"source": [str(r) for r in args.reference if Path(r).is_file()] or None,
                      "runs": {r["L"]: reference_runs(args.reference, r["L"], args.vocab_size) for r in rows},
                      "target": ">= 1.5x DeepSpec's throughput at <= 0.5x its peak memory (ref); >= 1.35x "
                                "speculators' at <= 0.7x its memory, same draft vocabulary"},
        "peak_tflops": args.peak_tflops,
        "results": rows,
    }
    add_online_ratios(rows, args.peak_tflops)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, args.out)
    return report


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(f"device {report['device']}, torch {report['torch']}, anchors {cfg['anchors']}, recompute "
          f"{cfg['recompute']}, trainable params {report['trainable_params'] / 1e6:.1f}M")
    print(f"{'loop':>11} {'launch':>6} {'attn':>6} {'adamw':>6} {'precision':>11} {'vocab':>7} {'teacher':>7} {'slots':>7} {'hidden':>6} {'L':>6} {'step_s':>9} {'host_s':>7} {'target':>6} {'tokens/s':>9} {'peak GiB':>9} {'TFLOP':>6} {'MFU':>5} {'on/cache':>8} {'tgt MFU':>7} "
          f"{'vs DeepSpec':>11} {'vs DS dflt':>10} {'mem vs DS d.':>12} {'vs specul.':>10} {'mem vs spec.':>12} {'vs spec. run':>12} {'mem vs run':>10}")

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    for r in report["results"]:
        vs_ref = r.get("speedup_vs_ref", r.get("speedup_vs_deepspec"))
        print(f"{r.get('loop', 'script'):>11} {r.get('launch', 'eager'):>6} {r.get('attention', 'triton')[:6]:>6} {r.get('optimizer', 'torch'):>6} {r['precision']:>11} {fmt(r['draft_vocab_size'], 'd') if r['draft_vocab_size'] else 'full':>7} "
              f"{r['teacher_vocab']:>7} {r.get('anchor_slots', 'fixed'):>7} {r.get('hidden_states', 'cache'):>6} {r['L']:>6} {r['step_s']:>9.4f} {fmt(r.get('host_s'), '.4f'):>7} {fmt(r.get('target_share'), '.0%'):>6} {r['tokens_per_s']:>9.0f} {fmt(r['peak_gib'], '.2f'):>9} {r['model_tflop'] + r.get('target_tflop', 0.0):>6.1f} "
              f"{fmt(r.get('mfu'), '.0%'):>5} {fmt(r.get('online_over_cache'), '.2f'):>8} {fmt(r.get('target_mfu'), '.0%'):>7} {fmt(vs_ref, '.2f'):>11} {fmt(r.get('speedup_vs_deepspec_default'), '.2f'):>10} "
              f"{fmt(r.get('peak_ratio_vs_deepspec_default'), '.2f'):>12} {fmt(r.get('speedup_vs_speculators'), '.2f'):>10} "
              f"{fmt(r.get('peak_ratio_vs_speculators'), '.2f'):>12} {fmt(r.get('speedup_vs_speculators_run'), '.2f'):>12} "
              f"{fmt(r.get('peak_ratio_vs_speculators_run'), '.2f'):>10}")


if __name__ == "__main__":
    main()
