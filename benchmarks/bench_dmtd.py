"""Decode tokens/s of cached Parallel DMTD against the project's AR decode, the per-cycle time split, and the logit
error of the cache.

Shapes (``--shapes``, random weights, bf16, batch 1, P28/S8, tau 4, one GPU): Qwen3-4B (36 layers, hidden 2560,
32 Q / 8 KV heads, head dim 128, FFN 9728, vocab 151936, tied embeddings) and Qwen3-8B (36 layers, hidden 4096,
FFN 12288, untied). ``--tiny`` runs a tiny Qwen3 on CPU in fp32 (a smoke test of the script).

Per shape, in one process:
- every DMTD variant through ``DMTDDecoder`` (``--kernels auto``: the Triton decode stack on CUDA, one CUDA graph
  for the per-token S step + LM head and one for the per-cycle P step);
- the AR of the same stack (the ``TargetRunner`` with the kernels in the S step's small-GEMM family) and every AR
  mode of the target runner (``dmtd.evaluate.AR_MODES``: kernels mma / fma, torch.compile, eager; CUDA graphs on a
  GPU): ``speedup_vs_fastest_ar`` counts against the fastest of them;
- the per-cycle time split: the P step, the S steps and the LM heads of one cycle, each captured piece
  (``DMTDDecoder.pieces``) replayed many times between CUDA events at a mid-generation position;
- the error check: the cached decoder's teacher-forced logits (``score``) against the training forward on the
  same sequence; the same for the AR runner (cached vs full causal forward) gives the dtype's noise floor.

    python benchmarks/bench_dmtd.py --shapes qwen3-4b,qwen3-8b     # H200, writes reports/bench/dmtd_decode.json
    python benchmarks/bench_dmtd.py --tiny --new-tokens 16 --out /tmp/x.json
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
from dspark_core.dmtd.evaluate import AR_MODES, ar_decoder, ar_modes, decode_speed, fastest_ar_speed  # noqa: E402
from dspark_core.dmtd.inference import S_STEP_GEMM, DMTDDecoder  # noqa: E402
from dspark_core.dmtd.model import DMTDModel, PlainModel  # noqa: E402

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
QWEN3_8B = {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}
SHAPES = {"qwen3-4b": QWEN3_4B, "qwen3-8b": QWEN3_8B}
TINY = dict(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen3 on CPU, fp32 (smoke test)")
    ap.add_argument("--shapes", default="qwen3-4b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--kernels", default="auto", choices=["auto", "on", "off"],
                    help="DMTD decoders on the Triton decode stack (auto: on CUDA where they apply)")
    ap.add_argument("--ar-modes", default=None, help=f"AR modes to time (comma list of {', '.join(AR_MODES)}; "
                                                    "default every one that applies)")
    ap.add_argument("--split-replays", type=int, default=200, help="replays of each piece for the time split")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--num-parallel-layers", type=int, default=None, help="P (default 28, tiny 4)")
    ap.add_argument("--tau", type=int, default=4)
    ap.add_argument("--mask-token-id", type=int, default=None, help="default 151660 (tiny 259)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=3, help="timed generations (different random prompts)")
    ap.add_argument("--graph", default="auto", choices=["auto", "none", "cuda_graph", "compile"])
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 (tiny fp32)")
    ap.add_argument("--error-len", type=int, default=128, help="tokens of the logit-error sequence (0: skip)")
    ap.add_argument("--fp32-ref", action="store_true", help="also compare with an fp32 copy of the model")
    ap.add_argument("--error-backend", default="auto", choices=["auto", "flex", "dense"],
                    help="attention of the teacher-forced forward (auto: flex on GPU, the training path)")
    ap.add_argument("--inductor-tuning", action="store_true",
                    help="with --graph compile: inductor coordinate-descent tuning (as gpt-fast; slower compile)")
    ap.add_argument("--skip-speed", action="store_true", help="only measure the logit error")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="reports/bench/dmtd_decode.json")
    return ap.parse_args(argv)


def build_lm(shape: str, dtype: torch.dtype, device: torch.device, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tiny = shape == "tiny-qwen3"
    cfg = Qwen3Config(**(TINY if tiny else SHAPES[shape]), bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        lm = Qwen3ForCausalLM(cfg).to(dtype)
    if tiny:  # larger weights than HF's 0.02 init so the tiny model's logits are not all equal
        with torch.no_grad():
            for p in lm.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.15)
    return lm.eval()


def logit_error(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Max / mean absolute difference, relative to the reference's std, and argmax agreement."""
    a, b = a.float(), b.float()
    d = (a - b).abs()
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "ref_std": float(b.std()),
            "max_rel_to_std": float(d.max() / b.std()),
            "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


def dmtd_decoder(lm, args, variant: str, max_len: int, backend: str = "auto") -> DMTDDecoder:
    model = DMTDModel(lm, args.P, args.tau, args.mask_id, variant, attn_backend=backend).eval()
    kernels = {"auto": "auto", "on": True, "off": False}[args.kernels]
    return DMTDDecoder(model, max_len, graph=args.graph, kernels=kernels)


@torch.no_grad()
def ar_score(runner, prompt: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits ``[1, n+m, V]`` of ``prompt [1, n] + continuation [1, m]`` through the AR cache."""
    out = [runner.prefill(prompt)[0].float()]
    for j in range(continuation.shape[1]):
        out.append(runner.forward(continuation[:, j: j + 1])[0].float().clone())
    return torch.cat(out, dim=1)


@torch.no_grad()
def measure_errors(lm, args, device, vocab: int, same_stack: str, lm_ref=None) -> dict:
    g = torch.Generator().manual_seed(args.seed + 1)
    seq = torch.randint(0, vocab, (1, args.error_len), generator=g).to(device)
    n = max(1, args.error_len // 3 + 1)  # prompt end not on a cycle boundary
    out = {}
    plain = PlainModel(lm, attn_backend="dense").eval()
    full = plain.logits(seq)
    cached = ar_score(ar_decoder(lm, args.error_len, same_stack).target, seq[:, :n], seq[:, n:])
    out["ar"] = {"cached_vs_teacher_forced": logit_error(cached, full)}
    if lm_ref is not None:
        ref = PlainModel(lm_ref, attn_backend="dense").eval().logits(seq)
        out["ar"].update(teacher_forced_vs_fp32=logit_error(full, ref), cached_vs_fp32=logit_error(cached, ref))
    for v in args.variants:
        dec = dmtd_decoder(lm, args, v, args.error_len, backend=args.error_backend)
        full = dec.model.logits(seq)  # auto: flex on GPU, dense SDPA on CPU -- the training path
        cached = dec.score(seq[:, :n], seq[:, n:])
        out[v] = {"cached_vs_teacher_forced": logit_error(cached, full)}
        if lm_ref is not None:
            ref = DMTDModel(lm_ref, args.P, args.tau, args.mask_id, v, attn_backend="dense").eval().logits(seq)
            out[v].update(teacher_forced_vs_fp32=logit_error(full, ref),
                          cached_vs_fp32=logit_error(cached, ref))
        del dec
    return out


def piece_ms(step, replays: int, device: torch.device) -> float:
    """Mean ms of one call of a captured piece over ``replays`` replays (CUDA events on a GPU)."""
    for _ in range(3):
        step()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(replays):
            step()
        return (time.perf_counter() - t0) * 1e3 / replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        step()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / replays


def time_split(dec: DMTDDecoder, position: int, tokens_per_s: float, replays: int) -> dict:
    """ms per cycle of tau tokens: one P step, tau S steps, tau LM heads (each piece timed alone at the cycle whose
    head is ``position``), their sum, and the cycle the measured tokens/s implies."""
    tau = dec.tau
    dec._pos.fill_(position)
    ms = {name: piece_ms(step, replays, dec.device) for name, step in dec.pieces().items()}
    split = {"p_step": ms["p_step"], "s_steps": tau * ms["s_step"], "lm_head": tau * ms["lm_head"]}
    split["sum"] = sum(split.values())
    split["measured_cycle"] = tau * 1e3 / tokens_per_s
    return {k: round(v, 4) for k, v in split.items()}


def measure_speed(lm, args, device, vocab: int, same_stack: str) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    max_len = args.prompt_len + args.new_tokens
    modes = args.ar_modes.split(",") if args.ar_modes else ar_modes(lm)
    if same_stack not in modes:
        modes.append(same_stack)
    t0 = time.perf_counter()
    ar = fastest_ar_speed(lm, prompts, args.new_tokens, max_len, modes)
    ar["setup_s"] = time.perf_counter() - t0
    rows = {"ar": ar}
    middle = args.tau * ((args.prompt_len + args.new_tokens // 2) // args.tau)
    for v in args.variants:
        t0 = time.perf_counter()
        dec = dmtd_decoder(lm, args, v, max_len)
        rows[v] = decode_speed(dec, prompts, args.new_tokens)
        rows[v]["setup_s"] = time.perf_counter() - t0
        rows[v]["kernels"] = dec.kernels
        rows[v]["time_split_ms"] = time_split(dec, middle, rows[v]["tokens_per_s"], args.split_replays)
        del dec
    return rows


def bench_shape(shape: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    lm = build_lm(shape, dtype, device, args.seed)
    vocab = lm.config.vocab_size
    same_stack = f"kernels_{S_STEP_GEMM}" if f"kernels_{S_STEP_GEMM}" in ar_modes(lm) else ar_modes(lm)[0]
    result = {"shape": shape, "ar_same_stack_mode": same_stack}
    if not args.skip_speed:
        speed = measure_speed(lm, args, device, vocab, same_stack)
        ar = speed["ar"]
        same = ar["modes"][same_stack]["tokens_per_s"]
        tps = {v: speed[v]["tokens_per_s"] for v in args.variants}
        result.update(ar_tokens_per_s=same, fastest_ar_tokens_per_s=ar["tokens_per_s"], fastest_ar_mode=ar["fastest"],
                      ar_modes_tokens_per_s={m: r["tokens_per_s"] for m, r in ar["modes"].items()},
                      tokens_per_s=tps, speedup={v: t / same for v, t in tps.items()},
                      speedup_vs_fastest_ar={v: t / ar["tokens_per_s"] for v, t in tps.items()},
                      time_split_ms={v: speed[v]["time_split_ms"] for v in args.variants}, detail=speed)
    if args.error_len:
        lm_ref = None
        if args.fp32_ref and dtype != torch.float32:
            lm_ref = build_lm(shape, torch.float32, device, args.seed)
            lm_ref.load_state_dict({k: v.float() for k, v in lm.state_dict().items()})
        result["logit_error"] = measure_errors(lm, args, device, vocab, same_stack, lm_ref)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    args.P = args.num_parallel_layers or (4 if args.tiny else 28)
    args.mask_id = args.mask_token_id if args.mask_token_id is not None else (259 if args.tiny else 151660)
    if args.graph == "auto":
        args.graph = "cuda_graph" if device.type == "cuda" else "none"
    if args.inductor_tuning:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    shapes = ["tiny-qwen3"] if args.tiny else args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES and s != "tiny-qwen3"]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    import transformers

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "dtype": str(dtype).replace("torch.", ""), "graph": args.graph, "kernels": args.kernels,
        "inductor_tuning": args.inductor_tuning, "num_parallel_layers": args.P, "tau": args.tau,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "prompts": args.prompts, "shapes": {},
    }
    for shape in shapes:
        result["shapes"][shape] = bench_shape(shape, args, device, dtype)
        print_table(result, shape)
        write_json(args.out, result)  # after each shape: a run stopped later keeps the shapes it finished
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {args.out}")
    return result


def print_table(top: dict, shape: str) -> None:
    r = top["shapes"][shape]
    errs = r.get("logit_error", {})
    speed = "tokens_per_s" in r
    names = ["ar", *(r["tokens_per_s"] if speed else [k for k in errs if k != "ar"])]
    print(f"\nDMTD decode on {top['device']} ({shape}, {top['dtype']}, graph={top['graph']}, "
          f"P={top['num_parallel_layers']}, tau={top['tau']}, prompt {top['prompt_len']}, "
          f"{top['new_tokens']} new tokens x {top['prompts']})")
    if speed:
        modes = ", ".join(f"{m} {t:.1f}" for m, t in r["ar_modes_tokens_per_s"].items())
        print(f"AR tokens/s: {modes}; fastest {r['fastest_ar_mode']}; same stack {r['ar_same_stack_mode']}")
    print(f"{'decoder':<18}{'tokens/s':>10}{'x same':>8}{'x fastest':>10}{'P ms':>8}{'S ms':>8}{'head ms':>8}"
          f"{'cycle':>8}{'max|dlogit|':>13}{'argmax=':>9}")
    for name in names:
        if speed:
            tps = r["ar_tokens_per_s"] if name == "ar" else r["tokens_per_s"][name]
            cols = f"{tps:>10.1f}{tps / r['ar_tokens_per_s']:>8.2f}{tps / r['fastest_ar_tokens_per_s']:>10.2f}"
            t = r["time_split_ms"].get(name)
            cols += (f"{t['p_step']:>8.3f}{t['s_steps']:>8.3f}{t['lm_head']:>8.3f}{t['measured_cycle']:>8.3f}"
                     if t else " " * 32)
        else:
            cols = " " * 60
        e = errs.get(name, {}).get("cached_vs_teacher_forced")
        err = f"{e['max_abs']:>13.3e}{e['argmax_agree']:>9.3f}" if e else ""
        print(f"{name:<18}{cols}{err}")
    if any("cached_vs_fp32" in v for v in errs.values()):
        print(f"\n{'vs fp32 model':<18}{'teacher-forced':>16}{'cached':>12}   (max |dlogit|)")
        for name, e in errs.items():
            print(f"{name:<18}{e['teacher_forced_vs_fp32']['max_abs']:>16.3e}{e['cached_vs_fp32']['max_abs']:>12.3e}")


if __name__ == "__main__":
    main()
