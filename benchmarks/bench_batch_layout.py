"""The trainer on a real cache under each training-batch layout: padded or packed rows, fixed or compact anchor slots.

A layout decides how the samples of a micro-batch become rows and how many anchor blocks each row carries; it does
not change the valid slots, so the loss and its gradients are the same under every layout (tests/test_packing.py):

- ``padded``: one sample a row, padded to the longest (``draft.packed_length: null``); ``packed``: samples end to
  end in rows of at most ``--packed-length`` tokens (``draft.packed_length``);
- ``fixed``: ``num_anchors`` anchor slots a sample, dummy blocks where a sample has fewer anchor positions;
  ``compact``: a row's slots cut to the most valid anchors of any row, rounded up to num_anchors / 8
  (``draft.anchor_slots``).

Each pass trains the variant's draft from the same initial weights on the same samples (``params.yaml``'s
``draft`` / ``loss`` / ``train`` for ``--variant``, with ``--num-anchors``, ``--micro-batch-size`` and the layout
overridden, and ``--global-batch-size`` / ``--no-group-by-length`` for steps of several micro-batches; no
checkpoints), ``--warmup`` + ``--steps`` optimiser steps, and reports the time per timed step, the warm-up's time
(on a GPU mostly compilation: each anchor width is a shape of its own), the answer tokens a second, the anchor
blocks the layers computed against those that carry a valid slot, the context positions (rows x row length,
padding included) and the last loss. Run from the repository root after ``dvc repro cache`` (the cache and the
target it was made with):

    python benchmarks/bench_batch_layout.py --num-anchors 128 --out reports/bench/batch_layout_cpu.json
    python benchmarks/bench_batch_layout.py --layouts padded:fixed packed:compact --steps 50   # a GPU, H200 profile
    python benchmarks/bench_batch_layout.py --layouts padded:compact --micro-batch-size 2 --global-batch-size 8 \
        [--no-group-by-length]   # four micro-batches a step, dealt by length or in draw order
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

LAYOUTS = ("padded:fixed", "padded:compact", "packed:fixed", "packed:compact")


def layout_configs(args, layout: str):
    """(draft, loss, train) configs of the variant with this layout and the run's overrides."""
    from dspark_core.draft.stage import variant_configs

    draft, loss, train = variant_configs(Path(args.params), args.variant)
    rows, slots = layout.split(":")
    draft = draft.replace(num_anchors=args.num_anchors or draft.num_anchors, anchor_slots=slots,
                          packed_length=args.packed_length if rows == "packed" else None)
    mb = args.micro_batch_size or train.micro_batch_size
    total = args.warmup + args.steps
    train = train.replace(micro_batch_size=mb, global_batch_size=args.global_batch_size or mb, total_steps=total,
                          max_steps=total, group_by_length=args.group_by_length,
                          checkpoint_every=10 ** 9, log_every=10 ** 9, data_workers=0, time_budget_s=None,
                          nproc_per_node=1, lr_schedule="steps")
    return draft, loss, train


def block_counts(task, cfg, first: int) -> tuple[int, int, int, int]:
    """Over the micro-batches of steps ``first ..`` (the timed ones): anchor blocks computed (rows x anchor slots),
    blocks with a valid slot, answer tokens (loss-mask positions), context positions computed (rows x row length)."""
    from dspark_core.dist import Dist
    from dspark_core.train.trainer import StepBatches

    batches = StepBatches(task, cfg, Dist(), 0, cfg.stop_step)
    computed = valid = tokens = context = 0
    for i in range(first, len(batches)):
        for b in batches[i]:
            computed += int(b["anchors"].numel())
            context += int(b["input_ids"].numel())
            valid += int(b["slot_valid"][..., 0].sum())
            tokens += int(b["loss_mask"].sum())
    return computed, valid, tokens, context


def run_layout(args, layout: str) -> dict:
    from dspark_core.draft.task import task_class
    from dspark_core.train.trainer import train

    draft_cfg, loss_cfg, cfg = layout_configs(args, layout)
    task = task_class(draft_cfg.kind).from_paths(draft_cfg, loss_cfg, Path(args.target), Path(args.cache))
    computed, valid, tokens, context = block_counts(task, cfg, args.warmup)
    stamps: list[float] = []
    t0 = time.perf_counter()
    result = train(task, cfg, progress=False, checkpoints=False,
                   on_step=lambda step, row: stamps.append(time.perf_counter()))
    step_s = (stamps[-1] - stamps[args.warmup - 1]) / args.steps
    return {"layout": layout, "num_anchors": draft_cfg.num_anchors, "packed_length": draft_cfg.packed_length,
            "micro_batch_size": cfg.micro_batch_size, "global_batch_size": cfg.global_batch_size,
            "group_by_length": cfg.group_by_length, "steps": args.steps, "step_s": step_s,
            "warmup_s": stamps[args.warmup - 1] - t0,  # model build and the warm-up steps (compilation on a GPU)
            "answer_tokens_per_s": tokens / (step_s * args.steps), "blocks_computed": computed,
            "blocks_valid": valid, "valid_block_share": valid / max(computed, 1), "context_positions": context,
            "loss": result.history[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--variant", default="baseline")
    ap.add_argument("--num-anchors", type=int, default=None, help="draft.num_anchors (default: params.yaml's)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="samples a micro-batch (default 8)")
    ap.add_argument("--packed-length", type=int, default=2048, help="draft.packed_length of the packed layouts")
    ap.add_argument("--global-batch-size", type=int, default=None,
                    help="samples an optimiser step (default: one micro-batch); a multiple of --micro-batch-size")
    ap.add_argument("--no-group-by-length", dest="group_by_length", action="store_false",
                    help="train.group_by_length false: a step's micro-batches take its samples in draw order")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--target", default="data/target")
    ap.add_argument("--cache", default="data/cache/train.zarr")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench" / "batch_layout.json")
    args = ap.parse_args()
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("--warmup and --steps must be >= 1")
    for path in (args.target, args.cache):
        if not Path(path).exists():
            raise SystemExit(f"{path} not found: run `dvc repro cache` first (or pass --target / --cache)")
    from dspark_core.io import write_json

    rows = []
    for layout in args.layouts:
        print(f"{layout}: {args.warmup} + {args.steps} steps ...", file=sys.stderr, flush=True)
        rows.append(run_layout(args, layout))
        print(json.dumps(rows[-1]), flush=True)
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "cache": args.cache, "command": " ".join(sys.argv), "results": rows}
    write_json(args.out, report)
    print(f"{'layout':>15} {'step_s':>8} {'tokens/s':>9} {'blocks':>7} {'valid':>6} {'context':>8} {'loss':>8}")
    for r in rows:
        print(f"{r['layout']:>15} {r['step_s']:>8.4f} {r['answer_tokens_per_s']:>9.0f} {r['blocks_computed']:>7} "
              f"{r['valid_block_share']:>6.0%} {r['context_positions']:>8} {r['loss']:>8.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
