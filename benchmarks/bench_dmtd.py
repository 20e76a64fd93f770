"""Decode tokens/s of cached Parallel DMTD vs plain AR decode, and the bf16 logit error of the cache.

Default: Qwen3-4B shapes (36 layers, hidden 2560, 32 Q / 8 KV heads, head dim 128, FFN 9728, vocab
151936, tied embeddings) with random weights, bf16, batch 1, P28/S8, tau 4, on one GPU. ``--tiny`` runs a
tiny Qwen3 on CPU in fp32 (a smoke test of the script). Only torch, transformers and dspark_core.dmtd
(+ its sampling helper) are imported.

Both decoders run the same layer code over static KV caches; with ``--graph cuda_graph`` (default on
GPU) the per-token S step, the per-cycle P step and the AR step are each one captured CUDA graph;
``--graph compile`` also torch.compiles the decoder layer (one graph per slot count, shared by all layers).

Error check: for every variant, the benchmarked cached decoder's teacher-forced logits (``score``) against the
training forward on the same sequence, both in the benchmark dtype; the same comparison for AR (cached
AR vs full causal forward) gives the dtype's noise floor; with ``--fp32-ref`` each is also compared with
an fp32 copy of the model.

    python benchmarks/bench_dmtd.py                      # H200, writes reports/bench/dmtd_decode.json
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
from dspark_core.dmtd.evaluate import decode_speed  # noqa: E402
from dspark_core.dmtd.inference import ARDecoder, DMTDDecoder  # noqa: E402
from dspark_core.dmtd.model import DMTDModel, PlainModel  # noqa: E402

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen3 on CPU, fp32 (smoke test)")
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


def build_lm(tiny: bool, dtype: torch.dtype, device: torch.device, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**(TINY if tiny else QWEN3_4B), bos_token_id=None, eos_token_id=None)
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


@torch.no_grad()
def measure_errors(lm, args, device, vocab: int, lm_ref=None) -> dict:
    g = torch.Generator().manual_seed(args.seed + 1)
    seq = torch.randint(0, vocab, (1, args.error_len), generator=g).to(device)
    n = max(1, args.error_len // 3 + 1)  # prompt end not on a cycle boundary
    out = {}
    plain = PlainModel(lm, attn_backend="dense").eval()
    ref_plain = PlainModel(lm_ref, attn_backend="dense").eval() if lm_ref is not None else None
    full = plain.logits(seq)
    cached = ARDecoder(plain, args.error_len, graph=args.graph).score(seq[:, :n], seq[:, n:])
    out["ar"] = {"cached_vs_teacher_forced": logit_error(cached, full)}
    if ref_plain is not None:
        ref = ref_plain.logits(seq)
        out["ar"].update(teacher_forced_vs_fp32=logit_error(full, ref), cached_vs_fp32=logit_error(cached, ref))
    for v in args.variants:
        model = DMTDModel(lm, args.P, args.tau, args.mask_id, v, attn_backend=args.error_backend).eval()
        full = model.logits(seq)  # auto: flex on GPU, dense SDPA on CPU -- the training path
        cached = DMTDDecoder(model, args.error_len, graph=args.graph).score(seq[:, :n], seq[:, n:])
        out[v] = {"cached_vs_teacher_forced": logit_error(cached, full)}
        if lm_ref is not None:
            ref = DMTDModel(lm_ref, args.P, args.tau, args.mask_id, v, attn_backend="dense").eval().logits(seq)
            out[v].update(teacher_forced_vs_fp32=logit_error(full, ref),
                          cached_vs_fp32=logit_error(cached, ref))
    return out


def measure_speed(lm, args, device, vocab: int) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    max_len = args.prompt_len + args.new_tokens
    rows = {}
    t0 = time.perf_counter()
    ar = ARDecoder(PlainModel(lm).eval(), max_len, graph=args.graph)
    rows["ar"] = decode_speed(ar, prompts, args.new_tokens)
    rows["ar"]["setup_s"] = time.perf_counter() - t0
    del ar
    for v in args.variants:
        t0 = time.perf_counter()
        dec = DMTDDecoder(DMTDModel(lm, args.P, args.tau, args.mask_id, v).eval(), max_len, graph=args.graph)
        rows[v] = decode_speed(dec, prompts, args.new_tokens)
        rows[v]["setup_s"] = time.perf_counter() - t0
        del dec
    return rows


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
    lm = build_lm(args.tiny, dtype, device, args.seed)
    vocab = lm.config.vocab_size
    import transformers

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "dtype": str(dtype).replace("torch.", ""), "graph": args.graph, "inductor_tuning": args.inductor_tuning,
        "shapes": "tiny-qwen3" if args.tiny else "qwen3-4b", "num_parallel_layers": args.P, "tau": args.tau,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "prompts": args.prompts,
    }
    if not args.skip_speed:
        speed = measure_speed(lm, args, device, vocab)
        ar_tps = speed["ar"]["tokens_per_s"]
        result.update(ar_tokens_per_s=ar_tps, tokens_per_s={v: speed[v]["tokens_per_s"] for v in args.variants},
                      speedup={v: speed[v]["tokens_per_s"] / ar_tps for v in args.variants}, detail=speed)
    if args.error_len:
        lm_ref = None
        if args.fp32_ref and dtype != torch.float32:
            lm_ref = build_lm(args.tiny, torch.float32, device, args.seed)
            lm_ref.load_state_dict({k: v.float() for k, v in lm.state_dict().items()})
        result["logit_error"] = measure_errors(lm, args, device, vocab, lm_ref)
    print_table(result)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


def print_table(r: dict) -> None:
    errs = r.get("logit_error", {})
    speed = "tokens_per_s" in r
    names = ["ar", *(r["tokens_per_s"] if speed else [k for k in errs if k != "ar"])]
    print(f"\nDMTD decode on {r['device']} ({r['shapes']}, {r['dtype']}, graph={r['graph']}, "
          f"P={r['num_parallel_layers']}, tau={r['tau']}, prompt {r['prompt_len']}, "
          f"{r['new_tokens']} new tokens x {r['prompts']})")
    print(f"{'decoder':<18}{'tokens/s':>12}{'speedup':>10}{'max|dlogit|':>14}{'/std':>9}{'argmax=':>9}")
    for name in names:
        tps = (r["ar_tokens_per_s"] if name == "ar" else r["tokens_per_s"][name]) if speed else float("nan")
        ratio = tps / r["ar_tokens_per_s"] if speed else float("nan")
        e = errs.get(name, {}).get("cached_vs_teacher_forced")
        err = f"{e['max_abs']:>14.3e}{e['max_rel_to_std']:>9.3f}{e['argmax_agree']:>9.3f}" if e else ""
        print(f"{name:<18}{tps:>12.1f}{ratio:>10.2f}{err}")
    if any("cached_vs_fp32" in v for v in errs.values()):
        print(f"\n{'vs fp32 model':<18}{'teacher-forced':>16}{'cached':>12}   (max |dlogit|)")
        for name, e in errs.items():
            print(f"{name:<18}{e['teacher_forced_vs_fp32']['max_abs']:>16.3e}{e['cached_vs_fp32']['max_abs']:>12.3e}")


if __name__ == "__main__":
    main()
