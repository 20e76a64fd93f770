"""Speculative decoding against concurrency, structurally: at real model shapes with random weights, what one
cycle of the fast engine (``StaticSpeculativeDecoder``: every row's block proposed in one draft call, verified in
one target forward, CUDA graphs) costs in AR steps of the same engine on the same rows (``draft=None``), at each
concurrency -- and the floor under it, the target's linear layers alone.

Per shape and concurrency c (c prompts of ``--prompt-len`` random tokens, every row busy, ``--new-tokens`` each;
random weights: the draft is almost never right, so every cycle verifies a full block and commits one token, the
timing does not depend on it):

- ``ar_step_ms``: a step of the engine's AR on c rows; ``cycle_ms``: a speculative cycle, fixed proposals
  (c x (S+1) tokens verified); ``propose_ms`` / ``verify_ms``: its parts (every 4th cycle timed apart);
- ``cycle_ar_steps = cycle_ms / ar_step_ms``, which is also the break-even acceptance length: speculation pays
  only where its mean accepted length (tokens per row per cycle, bonus included) exceeds it;
- ``verify_ms_by_tokens``: the verify's cost at each step size c x j (j = 1 .. S+1) that ``proposal: confidence``
  chooses among (the engine's own measurement, ``cost_s``);
- ``target_step``: ``triton`` (the decode kernels, batch-invariant: every token computed as in a one-token step,
  the exact mode) or ``torch`` (cuBLAS products and SDPA: faster at high concurrency, not bit-exact across
  concurrency); a GPU run measures both at each level;
- ``linear_ms`` / ``linear_floor_ar_steps``: the target's linear layers (Q/K/V, O, gate/up, down, LM head; bf16
  products in a CUDA graph) on c x (S+1) tokens against c tokens: what no verify can go below.

    python benchmarks/bench_concurrency.py --shapes qwen3-8b,qwen3-4b --concurrency 1,4,16,64 \\
        --out reports/bench/h100/concurrency_structural.json
    python benchmarks/bench_concurrency.py --tiny --concurrency 1,2 --out /tmp/concurrency.json   # CPU smoke run

Imports only torch, transformers and dspark_core.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_decode import SHAPES, TINY, build_model  # noqa: E402
from dspark_core.decoding.static_engine import StaticSpeculativeDecoder  # noqa: E402
from dspark_core.decoding.target_runner import TargetRunner, kernels_problem  # noqa: E402
from dspark_core.draft import DraftConfig  # noqa: E402
from dspark_core.draft.model import build_draft  # noqa: E402
from dspark_core.io import write_json  # noqa: E402


def build_random_draft(model: torch.nn.Module, args) -> torch.nn.Module:
    """A random DSpark draft at the target's width (``--draft-layers`` layers, the seed's Markov rank)."""
    n = model.config.num_hidden_layers
    aux = tuple(sorted({1, n // 4, n // 2, 3 * n // 4, n - 3}))
    cfg = DraftConfig(num_draft_layers=args.draft_layers, block_size=args.block, mask_token_id=None,
                      markov_rank=args.markov_rank, layer_style="qwen3")
    first = next(model.parameters())
    torch.manual_seed(0)
    draft = build_draft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                        aux_layer_ids=aux)
    return draft.to(device=first.device, dtype=first.dtype).eval()


def linear_ms(model: torch.nn.Module, tokens: int, repeats: int = 20) -> float:
    """One pass of the target's linear layers (and LM head) over ``tokens`` tokens, in ms (CUDA graph replay on a
    GPU; eager on CPU)."""
    first = next(model.parameters())
    mats = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mats += [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                 mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    mats.append(model.lm_head.weight)
    x = torch.randn(tokens, max(w.shape[1] for w in mats), device=first.device, dtype=first.dtype)

    def run() -> None:
        for w in mats:  # each product reads x's width: the right FLOPs and weight bytes, not the data flow
            F.linear(x[:, : w.shape[1]], w)

    with torch.no_grad():
        if first.is_cuda:
            run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            step = graph.replay
        else:
            step = run
        for _ in range(3):
            step()
        clock = _clock(first.device)
        t0 = clock()
        for _ in range(repeats):
            step()
        return (clock() - t0) / repeats * 1e3


def _clock(device: torch.device):
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def run_level(model, draft, c: int, args, graphs: bool, kernels: bool) -> dict:
    """Every row of c busy on one prompt each: the engine's AR, fixed and confidence cycles, the target's step on
    the Triton decode kernels (``kernels``: batch-invariant, each token as in a one-token step) or torch ops."""
    s = draft.block_size
    need = args.prompt_len + args.new_tokens + 2 * (s + 1) + 16
    runner = TargetRunner(model, max_len=need, aux_layer_ids=draft.aux_layer_ids, batch_size=c, cuda_graph=graphs,
                          kernels=kernels)
    gen = torch.Generator().manual_seed(c)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(c)]
    reserve = 2 * (s + 1)
    row = {"concurrency": c, "target_step": "triton" if kernels else "torch"}
    for name, engine in (("ar", StaticSpeculativeDecoder(runner, None, cuda_graph=graphs, reserve=reserve)),
                         ("fixed", StaticSpeculativeDecoder(runner, draft, cuda_graph=graphs, time_every=4,
                                                            reserve=reserve))):
        engine.serve(prompts, min(8, args.new_tokens))  # warm-up: graph capture, kernel tuning
        batch = engine.serve(prompts, args.new_tokens)
        row[f"{name}_cycle_ms"] = batch.cycle_s * 1e3
        row[f"{name}_mal"] = sum(r.mean_accepted_length for r in batch.results) / c
        if name == "fixed":
            row["propose_ms"] = 1e3 * sum(batch.draft_s) / max(len(batch.draft_s), 1)
            row["verify_ms"] = 1e3 * sum(batch.verify_s) / max(len(batch.verify_s), 1)
    conf = StaticSpeculativeDecoder(runner, draft, cuda_graph=graphs, proposal="confidence", reserve=reserve)
    conf.serve(prompts, min(8, args.new_tokens))
    row["verify_ms_by_tokens"] = {str(t): v * 1e3 for t, v in sorted(conf.cost_s.items())}
    row["ar_step_ms"] = row.pop("ar_cycle_ms")
    row["cycle_ms"] = row.pop("fixed_cycle_ms")
    row["cycle_ar_steps"] = row["cycle_ms"] / row["ar_step_ms"]
    row["break_even_mal"] = row["cycle_ar_steps"]
    row["linear_ms"] = {"ar": linear_ms(model, c), "verify": linear_ms(model, c * (s + 1))}
    row["linear_floor_ar_steps"] = row["linear_ms"]["verify"] / row["linear_ms"]["ar"]
    del runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-8b,qwen3-4b")
    ap.add_argument("--tiny", action="store_true", help="tiny random models on the CPU (a smoke run)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--block", type=int, default=7)
    ap.add_argument("--draft-layers", type=int, default=5, help="the seed recipe's draft depth")
    ap.add_argument("--markov-rank", type=int, default=256)
    ap.add_argument("--no-kernels", action="store_true", help="the target's step on torch ops only (default on a "
                    "GPU: each level on the Triton decode kernels, then on torch ops)")
    ap.add_argument("--tune", action="store_true", help="time the Triton tiles per shape (minutes at these shapes); "
                    "default: each kernel's first candidate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    levels = [int(c) for c in args.concurrency.split(",")]
    if cuda:
        from dspark_core.kernels import tuning

        tuning.set_tuning(args.tune)
    shapes = TINY if args.tiny else {name: SHAPES[name] for name in args.shapes.split(",")}
    if args.tiny:
        args.prompt_len, args.new_tokens = min(args.prompt_len, 24), min(args.new_tokens, 12)
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": str(dtype).replace("torch.", ""),
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "block_size": args.block,
           "draft_layers": args.draft_layers, "tuned_kernels": args.tune, "command": "python benchmarks/bench_concurrency.py " + " ".join(
               sys.argv[1:] if argv is None else argv), "shapes": {}}
    for name, (family, overrides) in shapes.items():
        model = build_model(family, overrides, device, dtype, args.tiny)
        draft = build_random_draft(model, args)
        steps = [False] if not cuda or args.no_kernels or kernels_problem(model) else [True, False]
        rows = [run_level(model, draft, c, args, graphs=cuda, kernels=k) for c in levels for k in steps]
        out["shapes"][name] = rows
        print(f"\n{name} ({out['device']}, {out['dtype']}, context {args.prompt_len}, block {args.block}, "
              f"{args.draft_layers}-layer draft)")
        print(f"{'c':>4} {'step':>7} {'AR step ms':>11} {'cycle ms':>9} {'propose':>8} {'verify':>8} {'cycle/AR':>9} "
              f"{'linear floor':>13}")
        for r in rows:
            print(f"{r['concurrency']:>4} {r['target_step']:>7} {r['ar_step_ms']:>11.3f} {r['cycle_ms']:>9.3f} "
                  f"{r['propose_ms']:>8.3f} {r['verify_ms']:>8.3f} {r['cycle_ar_steps']:>9.2f} "
                  f"{r['linear_floor_ar_steps']:>13.2f}")
        del model, draft
        if cuda:
            torch.cuda.empty_cache()
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
