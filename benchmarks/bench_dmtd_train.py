"""GPU check of the DMTD training forward (the path the shared trainer runs: fp32 weights, bf16 autocast).

1. flex_attention (compiled, the GPU path) vs the dense SDPA mask path: loss and gradient agreement for every
   variant on a mid-size Qwen3 with packed documents.
2. Qwen3-4B shapes (P28/S8, tau 4, random weights): forward + backward time and peak memory of one packed
   row of ``--length`` tokens per variant, with and without per-layer gradient checkpointing.

    python benchmarks/bench_dmtd_train.py --variants bidir_refresh causal_norefresh
Writes ``reports/bench/dmtd_train_check.json``. Needs a GPU; imports only torch, transformers, dspark_core.dmtd.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_core.dmtd.config import VARIANTS  # noqa: E402
from dspark_core.io import write_json  # noqa: E402
from dspark_core.dmtd.model import IGNORE, DMTDModel  # noqa: E402

MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=8, head_dim=64, tie_word_embeddings=False)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def packed_batch(length: int, docs: int, vocab: int, batch: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """``batch`` identical rows of ``docs`` random documents packed into ``length`` tokens; every token supervised."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    bounds = [0, *sorted(torch.randint(1, length, (docs - 1,), generator=g).tolist()), length]
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]).expand(batch, length)
    doc = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]).expand(batch, length)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = IGNORE
    labels[(torch.roll(doc, -1, 1) != doc)] = IGNORE  # no target across a document boundary
    return {k: v.to(device) for k, v in dict(input_ids=ids, position_ids=pos, doc_ids=doc, labels=labels).items()}


def step(model: DMTDModel, batch: dict[str, torch.Tensor], collect: bool):
    """Mean-CE backward under bf16 autocast; returns the CE sum and (optionally) the flat gradient."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        sums = model(**batch)
    (sums["ce"] / (batch["labels"] != IGNORE).sum()).backward()
    grad = torch.cat([p.grad.flatten().float() for p in model.parameters()]) if collect else None
    return float(sums["ce"].detach()), grad


def build(shapes: dict, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(Qwen3Config(**shapes))


def flex_vs_dense(device) -> dict:
    lm = build(MID, device)
    batch = packed_batch(1024, 5, MID["vocab_size"], 2, device)
    out = {}
    for v in VARIANTS:
        lf, gf = step(DMTDModel(lm, 6, 4, 7, v, attn_backend="flex"), batch, True)
        ld, gd = step(DMTDModel(lm, 6, 4, 7, v, attn_backend="dense"), batch, True)
        out[v] = dict(loss_flex=lf, loss_dense=ld, grad_cos=float(torch.nn.functional.cosine_similarity(gf, gd, dim=0)),
                      rel_grad_diff=float((gf - gd).norm() / gd.norm()))
        print("flex vs dense", v, out[v], flush=True)
    return out


def step_time(device, variants, length: int, repeats: int = 3) -> dict:
    lm = build(QWEN3_4B, device)
    batch = packed_batch(length, 4, QWEN3_4B["vocab_size"], 1, device)
    out = {}
    for v in variants:
        for ckpt in (False, True):
            model = DMTDModel(lm, 28, 4, 151660, v, grad_checkpoint=ckpt)
            for _ in range(repeats):  # the first compiles flex forward + backward
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                step(model, batch, False)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            key = f"{v}/grad_checkpoint={ckpt}"
            out[key] = dict(step_s=dt, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            print(f"qwen3-4b L={length}", key, out[key], flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["bidir_refresh", "causal_norefresh"], choices=VARIANTS)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--out", default="reports/bench/dmtd_train_check.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_dmtd_train needs a CUDA GPU")
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "flex_vs_dense_mid_model": flex_vs_dense(device)}
    torch.cuda.empty_cache()
    result[f"qwen3_4b_fwd_bwd_L{args.length}"] = step_time(device, args.variants, args.length)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
