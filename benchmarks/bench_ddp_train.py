"""Training on several GPUs through the shared trainer: step time per process count, scaling
efficiency, and the loss trajectory against a one-process run at the same global batch.

Runs ``dspark_core.train.trainer.train`` (DDP under ``torchrun``; NCCL on GPU, gloo on CPU) on random inputs
at Qwen3-4B shapes (``--shapes tiny`` for a CPU check):

- ``--task dspark``: the DSpark draft task (5 draft layers, 512 anchors, block 7, Markov rank 256, frozen tied
  embedding / LM head of vocab 151,936) on random cache items of ``--length`` tokens (5 aux layers of 2560).
- ``--task dmtd``: Parallel DMTD fine-tuning of the whole target (random Qwen3-4B weights, P28/S8, tau 4,
  ``--variant``) on random packed rows of ``--length`` tokens.

Every run uses the same global batch (``--global-batch``), so W processes each run global / (W x micro)
micro-batches and the trainer's global loss normalisation must give the one-process trajectory (up to the
order of float sums). ``step_s`` is the median over the timed steps (after ``--warmup``), as the trainer
measures it on rank 0 (each step ends with an all-reduce of its metrics, so all ranks finish together).

    torchrun --standalone --nproc_per_node 1 benchmarks/bench_ddp_train.py --task dspark --out /tmp/dspark_w1.json
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_ddp_train.py --task dspark --out /tmp/dspark_w2.json
    python benchmarks/bench_ddp_train.py --summary /tmp/dspark_w1.json /tmp/dspark_w2.json \
        --out reports/bench/ddp_train.json     # table: step_s, tokens_per_s, scaling_efficiency, loss drift

Same global batch G on W processes: throughput G / step_s, so ``scaling_efficiency`` = step_s(1) / (W x
step_s(W)) (1.0 = perfect). Imports torch, transformers and dspark_core only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dspark_core.dist import init_distributed  # noqa: E402
from dspark_core.io import write_json  # noqa: E402
from dspark_core.testing import QWEN3_4B_SHAPES  # noqa: E402

AUX_4B = (1, 9, 17, 25, 33)
AUX_TINY = (0, 2, 4)


def target_config(shapes: str):
    from transformers import Qwen3Config

    if shapes == "tiny":
        return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                           rope_theta=1e6, max_position_embeddings=4096)
    return Qwen3Config(**QWEN3_4B_SHAPES)


class RandomPool(torch.utils.data.Dataset):
    """``n`` distinct random items made once (seeded by index: the same on every rank and every run)."""

    def __init__(self, n: int, make) -> None:
        self.items = [make(torch.Generator().manual_seed(1000 + i)) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def dspark_task(args, tc):
    from dspark_core.draft.config import DraftConfig, LossConfig
    from dspark_core.draft.synthetic import random_item
    from dspark_core.draft.task import DSparkTask

    tiny = args.shapes == "tiny"
    aux = AUX_TINY if tiny else AUX_4B
    g = torch.Generator().manual_seed(7)
    lm = torch.randn(tc.vocab_size, tc.hidden_size, generator=g) * 0.02  # tied embedding / LM head [V, H]
    cfg = DraftConfig(num_draft_layers=2 if tiny else 5, block_size=7, mask_token_id=tc.vocab_size - 1,
                      num_anchors=args.anchors, markov_rank=16 if tiny else 256)
    dtype = torch.float32 if tiny else torch.bfloat16
    pool = RandomPool(args.pool, lambda gen: random_item(args.length, tc.vocab_size - 1, len(aux), tc.hidden_size,
                                                         prompt_len=max(1, args.length // 16), generator=gen,
                                                         dtype=dtype))
    return DSparkTask(cfg, LossConfig(vocab_chunk_slots=args.chunk), target_config=tc, embed_weight=lm,
                      lm_head_weight=lm, aux_layer_ids=aux, train_data=pool, pad_id=0)


def dmtd_task(args, tc):
    from transformers import AutoModelForCausalLM

    from dspark_core.dmtd.config import DMTDConfig
    from dspark_core.dmtd.model import DMTDModel
    from dspark_core.dmtd.task import DMTDTask

    tiny = args.shapes == "tiny"
    cfg = DMTDConfig(num_parallel_layers=4 if tiny else 28, tau=4, mask_token_id=tc.vocab_size - 1,
                     max_length=args.length, grad_checkpoint=args.grad_checkpoint,
                     attn_backend="dense" if tiny else "auto")

    def row(gen: torch.Generator) -> dict[str, torch.Tensor]:  # 4 documents packed into one row
        ids = torch.randint(0, tc.vocab_size - 1, (args.length,), generator=gen)  # [L]
        cuts = [0, *sorted(torch.randperm(args.length - 1, generator=gen)[:3].add(1).tolist()), args.length]
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])  # [L]
        doc = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))])  # [L]
        labels = torch.roll(ids, -1)
        labels[torch.tensor(cuts[1:]) - 1] = -100  # no target across a document end
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "doc_ids": doc}

    class RandomDMTD(DMTDTask):
        def build_model(self, device, dtype):
            with torch.device(device):  # random weights made where they live (seeded by the trainer)
                lm = AutoModelForCausalLM.from_config(tc, dtype=dtype)
            return DMTDModel.from_config(lm, cfg, args.variant).train()

        def rows(self, split):
            return pool

    pool = RandomPool(args.pool, row)
    return RandomDMTD(cfg, args.variant)


def run(args) -> dict:
    from dspark_core.train.trainer import TrainConfig, train

    d = init_distributed()
    tc = target_config(args.shapes)
    task = dspark_task(args, tc) if args.task == "dspark" else dmtd_task(args, tc)
    steps = args.warmup + args.steps
    cfg = TrainConfig(lr=args.lr, warmup_ratio=0.0, total_steps=steps, micro_batch_size=args.micro,
                      global_batch_size=args.global_batch, precision="bf16" if torch.cuda.is_available() else "fp32",
                      seed=5, data_workers=args.data_workers)
    cfg.grad_accum(d.world_size)  # ValueError naming the batch sizes before any work
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    res = train(task, cfg, progress=d.is_main, checkpoints=False)  # writes nothing (a DMTD checkpoint is 48 GB)
    hist = res.history
    timed = [h["step_s"] for h in hist[args.warmup:]]
    step_s = statistics.median(timed)
    tokens = args.global_batch * args.length
    return {
        "task": args.task, "variant": args.variant if args.task == "dmtd" else None, "shapes": args.shapes,
        "world_size": d.world_size, "global_batch": args.global_batch, "micro_batch": args.micro,
        "grad_accum": cfg.grad_accum(d.world_size), "length": args.length, "warmup_steps": args.warmup,
        "timed_steps": len(timed), "step_s": step_s, "step_s_all": [round(t, 5) for t in timed],
        "tokens_per_s": tokens / step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "loss": [h["loss"] for h in hist], "grad_norm": [h["grad_norm"] for h in hist],
    }


def summarize(paths: list[Path]) -> dict:
    """Rows of several runs of one task (same settings, different world sizes) with scaling efficiency and
    the loss drift against the one-process run."""
    runs = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: (r["task"], r["world_size"]))
    out = []
    for r in runs:
        one = next((o for o in runs if o["task"] == r["task"] and o["world_size"] == 1), None)
        row = {k: r[k] for k in ("task", "variant", "world_size", "global_batch", "micro_batch", "grad_accum",
                                 "length", "step_s", "tokens_per_s", "peak_gib")}
        if one is not None:
            for key in ("global_batch", "length", "micro_batch", "shapes", "variant"):
                if one[key] != r[key]:
                    raise ValueError(f"{r['task']}: run with world_size {r['world_size']} has {key}={r[key]!r}, "
                                     f"the one-process run {one[key]!r}; summarise runs of the same settings")
            row["scaling_efficiency"] = one["step_s"] / (r["world_size"] * r["step_s"])
            diffs = [abs(a - b) for a, b in zip(r["loss"], one["loss"])]
            row["loss_max_abs_diff"] = max(diffs)
            row["loss_max_rel_diff"] = max(x / max(abs(b), 1e-12) for x, b in zip(diffs, one["loss"]))
            row["loss_first_last"] = [r["loss"][0], r["loss"][-1]]
        out.append(row)
    return {"rows": out, "runs": runs}


def print_table(summary: dict) -> None:
    print(f"{'task':8} {'W':>2} {'G':>3} {'accum':>5} {'L':>5} {'step_s':>8} {'tok/s':>9} {'eff':>6} "
          f"{'peak GiB':>8} {'max|dloss|':>10} {'rel':>9}")
    for r in summary["rows"]:
        eff = r.get("scaling_efficiency")
        print(f"{r['task']:8} {r['world_size']:>2} {r['global_batch']:>3} {r['grad_accum']:>5} {r['length']:>5} "
              f"{r['step_s']:8.4f} {r['tokens_per_s']:9.0f} {eff if eff is not None else float('nan'):6.3f} "
              f"{r['peak_gib'] or 0:8.2f} {r.get('loss_max_abs_diff', float('nan')):10.2e} "
              f"{r.get('loss_max_rel_diff', float('nan')):9.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("dspark", "dmtd"), default="dspark")
    p.add_argument("--shapes", choices=("qwen3-4b", "tiny"), default="qwen3-4b")
    p.add_argument("--variant", default="bidir_refresh", help="DMTD variant (--task dmtd)")
    p.add_argument("--length", type=int, default=2048, help="tokens of a sample / packed row")
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--micro", type=int, default=1, help="samples per micro-batch")
    p.add_argument("--anchors", type=int, default=512, help="DSpark anchors per sample")
    p.add_argument("--chunk", type=int, default=1024, help="DSpark loss vocab_chunk_slots")
    p.add_argument("--grad-checkpoint", action="store_true", help="DMTD: recompute each layer in the backward")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (compilation)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--pool", type=int, default=8, help="distinct random samples cycled through")
    p.add_argument("--data-workers", type=int, default=0)
    p.add_argument("--summary", type=Path, nargs="+", help="summarise these run JSONs instead of running")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.summary:
        summary = summarize(args.summary)
        print_table(summary)
        write_json(args.out, summary)
        return
    if args.global_batch % args.micro:
        p.error(f"--global-batch {args.global_batch} is not a multiple of --micro {args.micro}")
    row = run(args)
    if init_distributed().is_main:
        print(json.dumps({k: v for k, v in row.items() if k not in ("loss", "grad_norm", "step_s_all")}))
        write_json(args.out, row)
    if init_distributed().world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
