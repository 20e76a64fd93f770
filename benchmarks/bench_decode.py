"""Decode speed of the online engine: AR at real model shapes vs the weight-read limit, and
speculative decoding with a trained draft.

(a) AR decode, batch 1, random weights, through ``TargetRunner`` (static KV cache; on GPU CUDA graphs of the
    n = 1 step and, with ``--compile``, torch.compile'd decoder layers) at Qwen3-4B shapes (hidden 2560, 36
    layers, 32 Q / 8 KV heads, head dim 128, FFN 9728, vocab 151936, tied embeddings) and SmolLM2-135M
    shapes (Llama: hidden 576, 30 layers, 9 / 3 heads, FFN 1536, vocab 49152, tied). Reference rows:
    - the weight-read limit = measured device copy bandwidth (bytes read + written per second) / bytes of
      weights: decoding one token reads every weight once;
    - transformers' own ``generate`` (eager, dynamic cache), greedy, prefill subtracted;
    - the verify step (n = block_size + 1 tokens in one forward) vs the n = 1 step.
    Target: >= 70 % of the limit at Qwen3-4B shapes. Qwen3-8B shapes (hidden 4096, 36 layers, 32 / 8
    heads, FFN 12288, untied head) too. With ``--kernels`` every shape runs in each ``--kernel-modes`` small-GEMM
    family (mma, fma: same process), and each mode's row carries the fastest AR of all modes beside its own
    (a speedup counts against the fastest AR the project has on the machine).
(b) ``--draft DIR --target DIR``: speculative vs AR decoding (greedy, identity checked) on prompts from
    ``--prompts`` (JSONL with ``turns``) or a few built-in GSM8K-style questions; skipped otherwise.

    python benchmarks/bench_decode.py --kernels --kernel-modes mma,fma --shapes qwen3-4b \
        --out reports/bench/decode_h200/qwen3-4b.json                   # H200: the README's decode figures
    python benchmarks/bench_decode.py --compile                         # torch.compile + CUDA graphs, no kernels
    python benchmarks/bench_decode.py --compile --target data/target --draft data/train/baseline/draft
    python benchmarks/bench_decode.py --kernels --shapes qwen3-4b,qwen3-8b --draft-vocab 32000 \
        --out reports/bench/decode_h200/draft_vocab.json                # the cycle with a reduced draft vocabulary
    python benchmarks/bench_decode.py --tiny --out /tmp/decode.json     # CPU smoke run on tiny shapes

Imports only torch, transformers and dspark_core (no zarr / dvclive / vllm).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dspark_core.io import write_json  # noqa: E402
from dspark_core.decoding.common import synced_clock  # noqa: E402
from dspark_core.decoding.ar import ARDecoder, StaticARDecoder  # noqa: E402
from dspark_core.decoding.target_runner import TargetRunner  # noqa: E402
from dspark_core.decoding.tree import parse_branches  # noqa: E402

SHAPES = {
    "qwen3-4b": ("qwen3", dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                               rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                               rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6)),
    "smollm2-135m": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                                   rope_theta=100_000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)),
}
TINY = {"tiny-qwen3": ("qwen3", {}), "tiny-llama": ("llama", {})}
HEADLINE_SHAPE = "qwen3-4b"
BUILTIN_PROMPTS = [
    "A baker makes 24 muffins in the morning and 3 times as many in the afternoon. She sells 70 of them. "
    "How many muffins are left? Think step by step.",
    "Tom has 5 boxes with 12 pencils each. He gives 17 pencils to his sister and buys 8 more. "
    "How many pencils does he have now? Think step by step.",
    "A train travels 60 km per hour for 2.5 hours and then 80 km per hour for 1.5 hours. "
    "How far does it travel in total? Think step by step.",
    "A shop sells pens at 3 dollars each. If you buy 4 pens you get 1 free. How much do 15 pens cost? "
    "Think step by step.",
]


def build_model(family: str, overrides: dict, device: torch.device, dtype: torch.dtype, tiny: bool):
    """A randomly initialised HF causal LM of the given shapes, directly on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if tiny:
        from dspark_core.testing import tiny_model

        return tiny_model(family).to(device=device, dtype=dtype)
    cls = Qwen3Config if family == "qwen3" else LlamaConfig
    cfg = cls(**overrides, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter once (tied weights counted once), but an input embedding of
    its own (untied, e.g. Qwen3-8B) only for the token's row, so it is left out."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb.data_ptr() != head.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy (the decode's memory-bound ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t = synced_clock(device)
    t0 = t()
    for _ in range(iters):
        dst.copy_(src)
    return 2 * nbytes * iters / (t() - t0)


def cache_len(args, needed: int) -> int:
    """KV-cache positions of a runner: ``--max-len`` when given (bench_online's ``max_len`` is 2048; the split-KV
    attention launches programs for every position, live or not), else what the run needs."""
    if args.max_len is None:
        return needed
    if args.max_len < needed:
        raise ValueError(f"--max-len {args.max_len} < the {needed} positions this run needs")
    return args.max_len


def step_ms(runner: TargetRunner, n: int, iters: int) -> float:
    """Mean time of one ``forward`` of n tokens at a fixed position (rolled back after each)."""
    ids = torch.zeros(1, n, dtype=torch.long, device=runner.device)
    start = runner.length
    for _ in range(3):
        runner.forward(ids)
        runner.truncate(start)
    t = synced_clock(runner.device)
    t0 = t()
    for _ in range(iters):
        runner.forward(ids)
        runner.truncate(start)
    return 1e3 * (t() - t0) / iters


def kernel_profile(long_fn, short_fn, units, top: int = 14) -> dict:
    """GPU kernels of the decode units (steps or cycles) that ``long_fn()`` runs beyond ``short_fn()`` (the same
    work with fewer units, so prefill and set-up cancel), per unit: how many kernels a unit launches and their
    summed device time (overlapping under PDL: the sum exceeds the wall time when kernels overlap; with
    ``PDL_PREFETCH`` a kernel launches early, so its duration includes its wait for the previous one: read the
    counts, not the times), the ``top`` kernels by time. ``units``: a number, or ``units(long_result,
    short_result)`` from the profiled calls' results. ``--profile`` only (CUPTI traces the kernels a CUDA graph
    replays)."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(fn) -> tuple[dict[str, list[float]], object]:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            result = fn()
            torch.cuda.synchronize()
        out: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type.name == "CUDA" and e.device_time_total > 0 and not e.name.startswith("Memcpy"):
                out.setdefault(e.name[:80], []).append(e.device_time_total)
        return out, result

    (long, long_result), (short, short_result) = kernels(long_fn), kernels(short_fn)
    units = units(long_result, short_result) if callable(units) else units
    rows = []
    for name, times in long.items():
        count = (len(times) - len(short.get(name, []))) / units
        us = (sum(times) - sum(short.get(name, []))) / units
        if count > 0 or us > 0:
            rows.append({"kernel": name, "per_unit": round(count, 2), "us_per_unit": round(us, 2)})
    rows.sort(key=lambda r: -r["us_per_unit"])
    return {"units": units, "kernels_per_unit": round(sum(r["per_unit"] for r in rows), 2),
            "device_us_per_unit": round(sum(r["us_per_unit"] for r in rows), 1), "top": rows[:top]}


def hf_generate_tokens_per_s(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """transformers' generate (greedy, its defaults: dynamic cache, eager loop), prefill subtracted."""
    kw = dict(do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0, eos_token_id=None)
    t = synced_clock(prompt.device)
    model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    t0 = t()
    model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = t()
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    t2 = t()
    return (new_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9)


def cycle_draft(model, cfg_kwargs: dict, aux: list[int], vocab_size: int | None):
    """A random DSpark draft on the target's shapes; ``vocab_size`` N: over N target tokens (a random ascending
    selection, as a ranking's would be: the gathers read scattered rows)."""
    from dspark_core.draft import DraftConfig, DSparkDraft

    first = next(model.parameters())
    torch.manual_seed(0)
    cfg = DraftConfig(**cfg_kwargs, vocab_size=vocab_size)
    draft = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                        aux_layer_ids=aux)
    if vocab_size is not None:
        gen = torch.Generator().manual_seed(0)
        draft.draft_vocab.set_ids(torch.randperm(model.config.vocab_size, generator=gen)[:vocab_size].sort().values)
    return draft.to(device=first.device, dtype=first.dtype).eval()


def timed_cycles(runner, draft, prompt: torch.Tensor, args) -> tuple[dict, object]:
    """Greedy (and with ``--cycle-temperature`` sampled) static cycles of ``draft``: ms per cycle, draft part,
    verify + update part. Returns the row and the greedy engine (for the profile)."""
    from dspark_core.decoding.static_engine import StaticSpeculativeDecoder

    static = StaticSpeculativeDecoder(runner, draft, time_every=4, tree_branches=args.tree_branches)
    static.generate(prompt[0], 16)  # warm-up: capture
    res = static.generate(prompt[0], args.new_tokens)
    out = {"cycle_ms": 1e3 * res.decode_s / res.cycles, "cycle_draft_ms": 1e3 * sum(res.draft_s) / len(res.draft_s),
           "cycle_verify_ms": 1e3 * sum(res.verify_s) / len(res.verify_s), "cycle_draft_layers": args.cycle_draft_layers,
           "cycle_draft_kernels": static.static.kernels, "cycle_random_draft_mal": res.mean_accepted_length}
    if args.cycle_temperature > 0:  # the sampling cycle: draft draws + exact rejection sampling
        from dspark_core.decoding.sampling import SamplingParams

        hot = StaticSpeculativeDecoder(runner, draft, time_every=4, sampling=SamplingParams(args.cycle_temperature))
        hot.generate(prompt[0], 16)  # warm-up: capture
        res = hot.generate(prompt[0], args.new_tokens)
        out.update({"cycle_temperature": args.cycle_temperature, "cycle_sampled_ms": 1e3 * res.decode_s / res.cycles,
                    "cycle_sampled_draft_ms": 1e3 * sum(res.draft_s) / len(res.draft_s),
                    "cycle_sampled_verify_ms": 1e3 * sum(res.verify_s) / len(res.verify_s)})
        del hot
    return out, static


def static_cycle(model, prompt: torch.Tensor, args) -> dict:
    """Cost of one greedy speculative cycle of the static engine (``StaticSpeculativeDecoder``: propose ->
    verify S+1 tokens -> accept -> context update, CUDA graphs on GPU) with a random DSpark draft of
    ``--cycle-draft-layers`` layers on these shapes. The draft is untrained (MAL ~1), so this measures time per
    cycle, not speedup: speculative beats AR when MAL > cycle_ms / decode_step_ms. The top-level keys are the
    full-vocabulary draft's; ``cycle_by_draft_vocab`` holds the same row for it (``"full"``) and for each
    ``--draft-vocab`` size N (key ``"N"``: the draft's LM head and Markov W2 over N target tokens)."""
    layers, vocab = model.config.num_hidden_layers, model.config.vocab_size
    aux = sorted({max(1, round(i * (layers - 2) / 4)) for i in range(5)})  # 5 layers spread like the seed's
    gpu = next(model.parameters()).device.type == "cuda"
    runner = TargetRunner(model, max_len=cache_len(args, args.prompt_len + args.new_tokens + 2 * 16 + 8),
                          aux_layer_ids=aux, compile=args.compile, cuda_graph=gpu,
                          graph_max_tokens=args.block_size + 1, kernels=args.kernels)
    cfg = dict(num_draft_layers=args.cycle_draft_layers, block_size=args.block_size, mask_token_id=None)
    by_vocab, out = {}, None
    for size in [None] + [n for n in args.draft_vocab if n < vocab]:
        draft = cycle_draft(model, cfg, aux, size)
        row, static = timed_cycles(runner, draft, prompt, args)
        row["draft_vocab_size"] = size or vocab
        by_vocab["full" if size is None else str(size)] = row
        if size is None:
            out = dict(row)
            if args.profile and gpu:  # a random draft accepts ~nothing: about one cycle per token
                out["profile_cycle"] = kernel_profile(lambda s=static: s.generate(prompt[0], 64),
                                                      lambda s=static: s.generate(prompt[0], 16),
                                                      lambda long, short: long.cycles - short.cycles)
        else:
            row["draft_ms_over_full"] = row["cycle_draft_ms"] / by_vocab["full"]["cycle_draft_ms"]
        del static, draft
    skipped = [n for n in args.draft_vocab if n >= vocab]
    if skipped:
        print(f"--draft-vocab {skipped}: not below this target's vocabulary ({vocab}); skipped", flush=True)
    out["cycle_by_draft_vocab"] = by_vocab
    del runner
    return out


def bench_ar(name: str, family: str, overrides: dict, args, device: torch.device, dtype: torch.dtype,
             bandwidth: float) -> dict:
    model = build_model(family, overrides, device, dtype, args.tiny)
    wbytes = weight_bytes(model)
    gpu = device.type == "cuda"
    runner = TargetRunner(model, max_len=cache_len(args, args.prompt_len + args.new_tokens + args.block_size + 8),
                          compile=args.compile, cuda_graph=gpu, graph_max_tokens=args.block_size + 1,
                          kernels=args.kernels)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=gen).to(device)
    ar = ARDecoder(runner)
    t_build = time.perf_counter()
    ar.generate(prompt[0], 16)  # warm-up: compile + CUDA graph capture
    warmup_s = time.perf_counter() - t_build
    runs = [ar.generate(prompt[0], args.new_tokens) for _ in range(args.repeats)]
    loop_tokens_per_s = max(r.decode_tokens_per_s for r in runs)
    static_ar = StaticARDecoder(runner)  # the step + argmax + position update in one graph
    static_ar.generate(prompt[0], 16)
    static_runs = [static_ar.generate(prompt[0], args.new_tokens) for _ in range(args.repeats)]
    static_tokens_per_s = max(r.decode_tokens_per_s for r in static_runs)
    if [r.tokens for r in static_runs] != [r.tokens for r in runs]:
        raise RuntimeError(f"{name}: StaticARDecoder and ARDecoder disagree on greedy tokens")
    tokens_per_s = max(loop_tokens_per_s, static_tokens_per_s)
    if args.profile and gpu:
        row_profile = kernel_profile(lambda s=static_ar: s.generate(prompt[0], 48),
                                     lambda s=static_ar: s.generate(prompt[0], 16), 32)
    runner.prefill(prompt)
    decode_ms, verify_ms = step_ms(runner, 1, args.step_iters), step_ms(runner, args.block_size + 1, args.step_iters)
    limit = bandwidth / wbytes
    row = {"family": family, "weight_bytes": wbytes, "weight_read_limit_tokens_per_s": limit,
           "ar_tokens_per_s": tokens_per_s, "fraction_of_limit": tokens_per_s / limit,
           "ar_loop_tokens_per_s": loop_tokens_per_s, "static_ar_tokens_per_s": static_tokens_per_s,
           "decode_step_ms": decode_ms, "verify_step_ms": verify_ms, "verify_tokens": args.block_size + 1,
           "verify_over_decode": verify_ms / decode_ms, "warmup_s": warmup_s,
           "cuda_graph": gpu, "compile": args.compile, "kernels": args.kernels}
    if args.profile and gpu:
        row["profile_ar_step"] = row_profile
    if args.hf_tokens > 0:
        row["hf_generate_tokens_per_s"] = hf_generate_tokens_per_s(model, prompt, args.hf_tokens)
    del runner, ar, static_ar
    if args.cycle_draft_layers > 0:
        row.update(static_cycle(model, prompt, args))
        row["break_even_mal"] = row["cycle_ms"] / decode_ms  # MAL at which speculative = AR
        row["mal_for_2.5x"] = 2.5 * row["cycle_ms"] / decode_ms
    del model
    if gpu:
        torch.cuda.empty_cache()
    return row


def bench_spec(args, device: torch.device, dtype: torch.dtype) -> dict:
    """Speculative vs AR with a trained draft on a real target (greedy), via the bench_online pieces."""
    from dspark_core.bench.online import (BenchOnlineConfig, decode_dataset, make_engine, read_jsonl_prompts,
                                          resolve_engine, stop_ids_of, summarize)
    from dspark_core.bench.peers import peer_comparison, truncated_assistant
    from dspark_core.checkpoint import load_draft
    from dspark_core.target import load_target

    model, tok = load_target(args.target, dtype=dtype, device=device)
    draft = load_draft(args.draft, model)
    block = int(draft.block_size)
    if args.prompts:
        convs = [r["turns"] for r in read_jsonl_prompts(Path(args.prompts))]
        convs = convs[: args.max_prompts] if args.max_prompts > 0 else convs
    else:
        convs = [[p] for p in BUILTIN_PROMPTS]
    cfg = BenchOnlineConfig(max_new_tokens=args.spec_new_tokens, max_len=args.spec_max_len,
                            confidence_threshold=args.confidence_threshold, tree_branches=args.tree_branches)
    runner = TargetRunner(model, max_len=cfg.max_len, aux_layer_ids=draft.aux_layer_ids, compile=args.compile,
                          cuda_graph=device.type == "cuda", graph_max_tokens=block + 1, kernels=args.kernels)
    engine = args.engine or ("static" if device.type == "cuda" or args.tree_branches else "reference")
    cfg = cfg.replace(engine=engine)
    engine = resolve_engine(engine, cfg.sampling, draft, device)
    spec = make_engine(engine, runner, draft, cfg)
    ar = ARDecoder(runner)  # the faster AR loop on the H200 (StaticARDecoder: ~1-3% slower, see bench_ar)
    stops = stop_ids_of(model, tok)
    decode_dataset(convs[:1], tok, spec, ar, cfg.replace(max_new_tokens=16), stops, desc="warm-up")
    run = decode_dataset(convs, tok, spec, ar, cfg, stops, desc="spec")
    out = summarize(run, block, greedy=True)
    out["engine"] = engine
    out["tree_branches"] = [list(b) for b in args.tree_branches]
    out["ar_decoder"] = type(ar).__name__
    out["ar_tokens"] = [r.tokens for r in run.ar]  # compare greedy outputs across kernel modes / runs
    if args.peers:
        assistant = truncated_assistant(model, args.assistant_layers)
        out["peers"] = peer_comparison(model, run.prompts, [r.tokens for r in run.ar], cfg.max_new_tokens, stops,
                                       assistant=assistant, pad_token_id=tok.pad_token_id)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke run)")
    ap.add_argument("--shapes", default=None, help="comma list (default: qwen3-4b,smollm2-135m; tiny: tiny-*)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decoder layer (GPU)")
    ap.add_argument("--kernels", action="store_true",
                    help="the Triton decode step (dspark_core.kernels) for chunks of <= 16 tokens (GPU)")
    ap.add_argument("--kernel-modes", default=None,
                    help="with --kernels: the small-GEMM families to run, comma list (first = headline and spec "
                         "run's mode); default: mma, fma")
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="with --kernels: FMA GEMV for n = 1, tensor-core tiles for n > 1 (not batch-invariant)")
    ap.add_argument("--no-tune", action="store_true", help="with --kernels: each shape on its first tile, untimed")
    ap.add_argument("--fma-tiles", action="store_true", help="with --kernels: the mma tuner also times FMA tiles")
    ap.add_argument("--kernel-configs", default=None,
                    help="with --kernels: pin the tiles listed in this JSON (a kernel_configs table, e.g. an "
                         "earlier run's output)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=None,
                    help="KV-cache positions of the AR and cycle runners (default: what the run needs)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--step-iters", type=int, default=50)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--hf-tokens", type=int, default=32, help="tokens for the transformers generate row (0 = skip)")
    ap.add_argument("--target", default=None, help="HF dir of the real target for (b)")
    ap.add_argument("--draft", default=None, help="trained draft dir for (b)")
    ap.add_argument("--prompts", default=None, help="JSONL with 'turns' for (b)")
    ap.add_argument("--spec-new-tokens", type=int, default=256)
    ap.add_argument("--spec-max-len", type=int, default=2048)
    ap.add_argument("--confidence-threshold", type=float, default=0.0)
    ap.add_argument("--tree-branches", type=parse_branches, default=(),
                    help='draft-tree branches "start:length,..." (static engine; dspark_core/decoding/tree.py), '
                         'e.g. "1:3,2:1,3:1,4:1"')
    ap.add_argument("--engine", choices=("static", "reference"), default=None,
                    help="speculative engine for (b): static (device-side cycle, CUDA graphs; default on GPU) or "
                         "reference (SpeculativeDecoder; default on CPU)")
    ap.add_argument("--peers", action="store_true", help="also HF generate / assisted / prompt lookup in (b)")
    ap.add_argument("--assistant-layers", type=int, default=4)
    ap.add_argument("--cycle-draft-layers", type=int, default=2,
                    help="(a) also time one static speculative cycle with a random draft of this depth (0 = skip)")
    ap.add_argument("--draft-vocab", type=_sizes, default=(),
                    help="comma list of reduced draft vocabulary sizes (e.g. 32000): the static cycle is also timed "
                         "with a draft over that many target tokens (cycle_by_draft_vocab beside the full one)")
    ap.add_argument("--cycle-temperature", type=float, default=0.0,
                    help="(a) also time the sampling cycle at this temperature (plain T: no top-k / top-p)")
    ap.add_argument("--max-prompts", type=int, default=0, help="(b) at most this many prompts (0 = all)")
    ap.add_argument("--profile", action="store_true",
                    help="(a, GPU) also record the kernels of one static AR step and one static cycle (torch "
                         "profiler: count and device time per kernel name) under profile_ar_step / profile_cycle")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench" / "decode.json"))
    args = ap.parse_args()

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.new_tokens, args.prompt_len, args.step_iters, args.hf_tokens = min(args.new_tokens, 32), 16, 5, 8
        args.spec_new_tokens = min(args.spec_new_tokens, 32)
    shapes = TINY if args.tiny else SHAPES
    names = args.shapes.split(",") if args.shapes else list(shapes)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown} (known: {', '.join(shapes)})")
    bandwidth = copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 26))
    modes = _kernel_modes(args, device)
    if modes[0] != "torch":
        from dspark_core.kernels.linear import set_small_gemm

        configure_kernels(args, device)
    rows = {}
    for name in names:
        family, overrides = shapes[name]
        per_mode = {}
        for mode in modes:
            if mode != "torch":
                set_small_gemm(mode)
            per_mode[mode] = bench_ar(name, family, overrides, args, device, dtype, bandwidth)
        rows[name] = against_fastest(per_mode)
        for mode, row in rows[name]["modes"].items():
            _print_ar(f"{name} {mode}", row)
        _write_result(args, device, dtype, bandwidth, modes, names, rows, None)  # each shape kept as it finishes
    if modes[0] != "torch":
        set_small_gemm(modes[0])
    spec = None
    if args.draft and args.target:
        spec_modes = {}
        for mode in modes:  # spec + AR in each mode: the speedup against the fastest AR of all of them too
            if mode != "torch":
                set_small_gemm(mode)
            spec_modes[mode] = bench_spec(args, device, dtype)
        fastest_ar = max(r["ar_tokens_per_s"] for r in spec_modes.values())
        for r in spec_modes.values():
            r["fastest_ar_tokens_per_s"] = fastest_ar
            r["speedup_vs_fastest_ar"] = r["tokens_per_s"] / fastest_ar
        if modes[0] != "torch":
            set_small_gemm(modes[0])
        spec = dict(spec_modes[modes[0]], modes={m: {k: v for k, v in r.items() if k != "ar_tokens"}
                                                  for m, r in spec_modes.items()})
        for mode, r in spec_modes.items():
            print(f"[{mode}]", end=" ")
            _print_spec(r)
    else:
        print("(b) speculative decoding skipped: pass --target DIR --draft DIR")
    _write_result(args, device, dtype, bandwidth, modes, names, rows, spec)
    print(f"wrote {args.out}")


def _write_result(args, device, dtype, bandwidth, modes, names, rows, spec) -> None:
    """The run's JSON at ``--out``: the AR rows of the shapes done so far and, once timed, the speculative run."""
    head_modes = (rows.get(HEADLINE_SHAPE) or next(iter(rows.values())))["modes"]
    head = head_modes[modes[0]]
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth,
        "headline_shape": HEADLINE_SHAPE if HEADLINE_SHAPE in rows else names[0],
        "ar_tokens_per_s": head["ar_tokens_per_s"],
        "weight_read_limit_tokens_per_s": head["weight_read_limit_tokens_per_s"],
        "fraction_of_limit": head["fraction_of_limit"], "mode": modes[0],
        "tokens_per_s": spec["tokens_per_s"] if spec else None,
        "speedup": spec["speedup"] if spec else None,
        "ar": rows, "spec": spec,
        "args": vars(args), "kernel_settings": kernel_settings() if args.kernels else None,
    }
    if args.kernels:  # the tuned small-GEMM configurations: --kernel-configs <this JSON> pins them
        from dspark_core.kernels.tuning import kernel_configs

        result["kernel_configs"] = kernel_configs(device)
    write_json(args.out, result)


def _sizes(text: str) -> tuple[int, ...]:
    """``--draft-vocab``: a comma list of positive integers."""
    try:
        sizes = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of vocabulary sizes >= 1, e.g. 32000,8192")
    return sizes


def _kernel_modes(args, device: torch.device) -> list[str]:
    """The small-GEMM families to run (the first is the default's and the headline's); ["torch"] without
    --kernels."""
    if not args.kernels:
        return ["torch"]
    from dspark_core.kernels import linear

    spec = args.kernel_modes or ",".join([linear.SMALL_GEMM] + [m for m in ("mma", "fma") if m != linear.SMALL_GEMM])
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("mma", "fma")]
    if bad or not modes:
        raise SystemExit(f"--kernel-modes: {args.kernel_modes!r}; give a comma list of mma, fma")
    from dspark_core.kernels.linear import small_gemm_problem

    problem = small_gemm_problem(device)
    if problem and "mma" in modes:
        print(f"--kernel-modes: mma skipped ({problem})")
        modes = [m for m in modes if m != "mma"] or ["fma"]
    return modes


def against_fastest(per_mode: dict[str, dict]) -> dict:
    """Rows of one shape in each mode, each with the fastest AR of all modes beside its own: the step time
    and the static cycle in units of the fastest step (what a speedup is measured against)."""
    fastest = max(per_mode, key=lambda m: per_mode[m]["ar_tokens_per_s"])
    best = per_mode[fastest]
    for row in per_mode.values():
        row["fastest_ar_mode"] = fastest
        row["fastest_ar_tokens_per_s"] = best["ar_tokens_per_s"]
        row["fastest_step_ms"] = best["decode_step_ms"]
        row["step_over_fastest_step"] = row["decode_step_ms"] / best["decode_step_ms"]
        if "cycle_ms" in row:
            row["cycle_over_step"] = row["cycle_ms"] / row["decode_step_ms"]
            row["cycle_over_fastest_step"] = row["cycle_ms"] / best["decode_step_ms"]
            row["mal_for_2.5x_vs_fastest"] = 2.5 * row["cycle_over_fastest_step"]
    return {"fastest_ar_mode": fastest, "fastest_ar_tokens_per_s": best["ar_tokens_per_s"],
            "weight_read_limit_tokens_per_s": best["weight_read_limit_tokens_per_s"], "modes": per_mode}


def configure_kernels(args, device: torch.device) -> None:
    """The kernel switches of the command line (they change speed; batch invariance and the tiles change bits)."""
    from dspark_core.kernels import linear, tuning

    linear.set_batch_invariant(not args.no_batch_invariant)
    tuning.set_tuning(not args.no_tune)
    tuning.set_fma_tiles(args.fma_tiles)
    if args.kernel_configs:
        try:
            tuning.pin_kernel_configs(args.kernel_configs, device)
        except ValueError as e:
            raise SystemExit(f"--kernel-configs: {e}") from None


def kernel_settings() -> dict:
    """The kernel switches this run used (small-GEMM family of the last mode run, PDL, tuning)."""
    from dspark_core.kernels import linear, pdl, tuning

    return {"small_gemm": linear.SMALL_GEMM, "batch_invariant": linear.BATCH_INVARIANT, "pdl": pdl.PDL,
            "pdl_prefetch": pdl.PDL_PREFETCH, "tune": tuning.TUNE, "fma_tiles": tuning.FMA_TILES_TUNED}


def _print_ar(name: str, r: dict) -> None:
    hf = r.get("hf_generate_tokens_per_s")
    if "fastest_ar_mode" in r:
        print(f"{name:>21} | fastest AR of all modes: {r['fastest_ar_mode']} {r['fastest_ar_tokens_per_s']:.1f} tok/s;"
              f" this mode's step = {r['step_over_fastest_step']:.2f} of it"
              + (f", its cycle = {r['cycle_over_fastest_step']:.2f} fastest steps" if "cycle_ms" in r else ""))
    print(f"{name:>21} | AR {r['ar_tokens_per_s']:9.1f} tok/s | limit {r['weight_read_limit_tokens_per_s']:9.1f} | "
          f"{100 * r['fraction_of_limit']:5.1f}% | step n=1 {r['decode_step_ms']:.3f} ms, n={r['verify_tokens']} "
          f"{r['verify_step_ms']:.3f} ms | HF generate {hf if hf is None else round(hf, 1)} tok/s", flush=True)
    if "cycle_ms" in r:
        print(f"{'':>21} | static spec cycle {r['cycle_ms']:.3f} ms (draft {r['cycle_draft_ms']:.3f}, verify + update "
              f"{r['cycle_verify_ms']:.3f}) | break-even MAL {r['break_even_mal']:.2f}, 2.5x needs MAL "
              f"{r['mal_for_2.5x']:.2f}", flush=True)
    for key, row in r.get("cycle_by_draft_vocab", {}).items():
        if key == "full":
            continue
        sampled = (f", sampling cycle {row['cycle_sampled_ms']:.3f} ms (draft {row['cycle_sampled_draft_ms']:.3f})"
                   if "cycle_sampled_ms" in row else "")
        print(f"{'':>21} | draft vocabulary {key}: cycle {row['cycle_ms']:.3f} ms (draft {row['cycle_draft_ms']:.3f} "
              f"= {row['draft_ms_over_full']:.2f} of the full vocabulary's, verify + update "
              f"{row['cycle_verify_ms']:.3f}){sampled}", flush=True)
    if "cycle_sampled_ms" in r:
        print(f"{'':>21} | sampling cycle at T {r['cycle_temperature']:g}: {r['cycle_sampled_ms']:.3f} ms (draft "
              f"{r['cycle_sampled_draft_ms']:.3f}, verify + update {r['cycle_sampled_verify_ms']:.3f})", flush=True)
    for key, unit in (("profile_ar_step", "AR step"), ("profile_cycle", "cycle")):
        if key in r:
            p = r[key]
            print(f"{'':>21} | profile: {p['kernels_per_unit']:.1f} kernels per {unit}, {p['device_us_per_unit']:.1f} us "
                  f"of kernel time; top: " + ", ".join(f"{k['kernel'][:40]} x{k['per_unit']:g} {k['us_per_unit']:.1f} us"
                                                      for k in p["top"][:6]), flush=True)


def _print_spec(s: dict) -> None:
    print(f"spec: MAL {s['mal']:.2f} | {s['tokens_per_s']:.1f} tok/s vs AR {s['ar_tokens_per_s']:.1f} | "
          f"speedup {s['speedup']:.2f}x (vs fastest AR {s.get('speedup_vs_fastest_ar', float('nan')):.2f}x) | "
          f"identical {s['identical']} | draft {s['draft_ms']:.2f} ms, "
          f"verify {s['verify_ms']:.2f} ms per cycle")
    for peer, row in (s.get("peers") or {}).items():
        print(f"  peer {peer:>14}: {row['tokens_per_s']:.1f} tok/s, identical {row['identical']}")


if __name__ == "__main__":
    main()
