"""Kernel-level timings of the decode and training kernels, on one GPU (H200), at Qwen3-4B shapes.

- ``gemv``: each decode matrix of Qwen3-4B (fused Q/K/V, O, fused gate/up, down, LM head) at n = 1 and
  n = 8 tokens: cuBLAS (``F.linear``, no fusion) vs ``dspark_core.kernels.linear.fused_linear`` (with its
  norm / SiLU / residual fusions), as weight bytes read per second. These are eager calls back to back, so
  the Triton wrapper's host launch (~20-30 us) bounds the small matrices; the decode step inside a CUDA graph
  (``bench_decode.py --kernels``, and ``decode_profile`` below) is the figure that counts.
- ``loss``: the per-chunk distillation math (512 slots x vocab 151,936, float32 logits, bf16 gradient):
  torch.compile of ``chunk_math`` vs the Triton kernels.
- ``flex``: the DSpark training attention (512 anchors x block 7 queries, 32 / 8 heads, head dim 128,
  context L) forward + backward through flex_attention under several kernel options, each row with its
  largest difference from the first variant's output and gradients (``--flex-set flash``: torch's Triton
  kernels beside the FlashAttention-4 backend, ``BACKEND: FLASH``, which needs the ``flash-attn-4`` package).
- ``adamw``: one AdamW step (bf16 parameters, gradients and moments, the clip factor applied inside) over the
  parameter shapes of a 5-layer Qwen3-4B-shaped draft with a rank-256 Markov head (615M values): torch's fused
  step beside the Triton kernel (``kernels/adamw.py``) at several launch shapes, as bytes moved per second (7 x 2
  bytes a value) against a plain copy's bandwidth.
- ``decode_profile``: the top CUDA kernels of Triton decode steps (no CUDA graph, so names are visible).
- ``tiles``: every small-GEMM candidate (``tuning.MMA_CONFIGS``, ``tuning.GEMV_CONFIGS``) on each decode
  matrix at n = 1 (``--tile-tokens 1,8``: also n = 8; ``--tile-candidates``: some families only), 20 launches
  captured in a CUDA graph (no host launch cost) over copies of the matrix that
  add up to >= 256 MiB (each launch reads from DRAM, not L2: timed from L2 the ranking is noise), as a fraction
  of the measured copy bandwidth; the best three per (matrix, mode) printed. Beside them cuBLAS (``F.linear``,
  no fusions) at m = 1, 8 and 16 token rows: whether a fixed 16-row GEMM (batch-invariant by its fixed shape)
  reads at bandwidth. ``--tile-shape qwen3-8b`` for Qwen3-8B's matrices.
  The question it answers: which tiles bring the ``mma`` step near ``fma``'s bandwidth.

    python benchmarks/bench_kernels.py                       # all parts -> reports/bench/kernels.json
    python benchmarks/bench_kernels.py --parts gemv loss
    python benchmarks/bench_kernels.py --parts tiles --out reports/bench/tiles.json
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
import torch.nn.functional as F  # noqa: E402

from dspark_core.io import write_json  # noqa: E402

H, FFN, HQ, HKV, D, VOCAB = 2560, 9728, 32, 8, 128, 151936


def bench(fn, iters: int = 50, warmup: int = 5) -> float:
    """Mean ms of ``fn`` (CUDA events around ``iters`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def part_gemv(dev) -> list[dict]:
    from dspark_core.kernels.linear import fused_linear

    bf = torch.bfloat16
    shapes = {  # name: (rows of W, K, fusion kwargs builder)
        "qkv": ((HQ + 2 * HKV) * D, H, "norm"),
        "o": (H, HQ * D, "resid"),
        "gate_up": (2 * FFN, H, "gated"),
        "down": (H, FFN, "resid"),
        "lm_head": (VOCAB, H, "norm"),
    }
    rows = []
    for n in (1, 8):
        for name, (n_rows, k, kind) in shapes.items():
            w = torch.randn(n_rows, k, device=dev, dtype=bf) * 0.02
            x = torch.randn(n, k, device=dev, dtype=bf)
            n_out = n_rows // 2 if kind == "gated" else n_rows
            kw = {}
            if kind in ("norm", "gated"):
                kw.update(norm_weight=torch.ones(k, device=dev, dtype=bf), eps=1e-6)
            if kind == "gated":
                kw["gated"] = True
            if kind == "resid":
                kw["residual"] = torch.randn(n, n_out, device=dev, dtype=bf)
            wbytes = w.numel() * 2
            t_cublas = bench(lambda x=x, w=w: F.linear(x, w))
            fused_linear(x, w, **kw)  # tunes
            t_triton = bench(lambda x=x, w=w, kw=kw: fused_linear(x, w, **kw))
            rows.append({"n": n, "matrix": name, "shape": [n_rows, k], "fusion": kind, "cublas_ms": t_cublas,
                         "triton_ms": t_triton, "cublas_tb_s": wbytes / t_cublas / 1e9,
                         "triton_tb_s": wbytes / t_triton / 1e9})
            print(f"gemv n={n} {name:8s} {n_rows:>6}x{k:<5} cuBLAS {t_cublas * 1e3:7.1f} us "
                  f"({rows[-1]['cublas_tb_s']:.2f} TB/s)  triton+{kind} {t_triton * 1e3:7.1f} us "
                  f"({rows[-1]['triton_tb_s']:.2f} TB/s)", flush=True)
            del w
    from dspark_core.kernels.tuning import _TUNED

    print("tuned configs:", {str(k[1:4]): v for k, v in _TUNED.items()})
    return rows


TILE_SHAPES = {"qwen3-4b": dict(h=2560, ffn=9728, hq=32, hkv=8, d=128, vocab=151936),
               "qwen3-8b": dict(h=4096, ffn=12288, hq=32, hkv=8, d=128, vocab=151936),
               "smollm2-135m": dict(h=576, ffn=1536, hq=9, hkv=3, d=64, vocab=49152),
               "tiny": dict(h=64, ffn=96, hq=4, hkv=2, d=16, vocab=128)}  # CPU interpreter smoke run


def decode_matrices(h: int, ffn: int, hq: int, hkv: int, d: int, vocab: int) -> dict[str, tuple[int, int, str]]:
    """name: (rows of W, K, fusion) of one decoder layer + the head, as TargetRunner(kernels=True) runs them."""
    return {"qkv": ((hq + 2 * hkv) * d, h, "norm"), "o": (h, hq * d, "resid"), "gate_up": (2 * ffn, h, "gated"),
            "down": (h, ffn, "resid"), "lm_head": (vocab, h, "norm")}


def part_tiles(dev, shape: str = "qwen3-4b", launches: int = 20, replays: int = 5, tokens: tuple[int, ...] = (1,),
               candidates: str = "all") -> list[dict]:
    """Every candidate at n = each of ``tokens``; ``candidates``: all, or a comma list of families to time
    (tc: tensor-core tiles, fma_tile: the mma mode's FMA tiles, gemv: the fma mode's GEMV, cublas)."""
    from dspark_core.kernels import linear, tuning

    gpu = dev.type == "cuda"
    dt = torch.bfloat16 if gpu else torch.float32
    bw = _copy_bandwidth(dev)
    families = {"tc", "fma_tile", "gemv", "cublas"} if candidates == "all" else set(candidates.split(","))
    mma = ([c for c in tuning.MMA_CONFIGS if not tuning.is_fma_tile(c)] if "tc" in families else []) + (
        tuning.FMA_TILES if "fma_tile" in families else [])
    modes = (("mma", mma),
             ("fma", tuning.GEMV_CONFIGS if "gemv" in families else []))
    rows = []
    for name, (n_rows, k, kind) in decode_matrices(**TILE_SHAPES[shape]).items():
        gated = kind == "gated"
        n_out = n_rows // 2 if gated else n_rows
        # copies of W adding up to >= 256 MiB, taken in turn: each launch reads its W from DRAM, not from the 50 MB
        # L2 that one small matrix launched 20 times over would live in (the kernel tuner times the same way)
        w = torch.randn(n_rows, k, device=dev, dtype=dt) * 0.02
        ws = tuning.weight_copies(w, max_copies=launches) if gpu else [w]
        nw = torch.ones(k, device=dev, dtype=dt) if kind in ("norm", "gated") else None
        for n in tokens:
            x = torch.randn(n, k, device=dev, dtype=dt)
            res = torch.randn(n, n_out, device=dev, dtype=dt) if kind == "resid" else None
            y = torch.empty(n, n_out, device=dev, dtype=dt)
            where = {"shape": shape, "matrix": name, "n": n}
            for mode, configs in modes:
                linear.set_small_gemm(mode)
                for cfg in configs:
                    def launch(i=0, cfg=cfg, ws=ws, x=x, res=res, y=y):
                        linear._launch(x, ws[i % len(ws)], None, nw, 1e-6, res, y, n_out, gated, cfg)
                    try:
                        ms = tuning.graph_time_ms(launch, launches, replays) if gpu else _eager_ms(launch)
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile (resources) is reported
                        rows.append({**where, "mode": mode, "cfg": list(cfg), "error": repr(e)[:200]})
                        continue
                    rows.append(_tile_row(where, mode, cfg, ms, w, bw))
            if "cublas" in families:  # F.linear, no fusions, on n rows (and 16: a fixed 16-row GEMM)
                for m in sorted({n, 16}):
                    xm = torch.randn(m, k, device=dev, dtype=dt)

                    def blas(i=0, xm=xm, ws=ws):
                        return F.linear(xm, ws[i % len(ws)])
                    ms = tuning.graph_time_ms(blas, launches, replays) if gpu else _eager_ms(blas)
                    rows.append(_tile_row(where, "cublas", (m,), ms, w, bw))
            for mode in ("mma", "fma", "cublas"):
                ok = sorted((r for r in rows if r["matrix"] == name and r["n"] == n and r["mode"] == mode and "us" in r),
                            key=lambda r: r["us"])
                best = ", ".join(f"{tuple(r['cfg'])} {r['us']:.1f} us {100 * r['of_copy_bandwidth']:.0f}%"
                                 for r in ok[:3])
                print(f"tiles {shape} n={n} {name:8s} {n_rows:>6}x{k:<5} {mode}: {best}", flush=True)
        del w, ws
    linear.set_small_gemm("mma")
    return rows


def tile_pins(rows: list[dict], shape: str, device: str, dtype: str = "bfloat16") -> dict:
    """A pinned kernel configs table (``tuning.pin_kernel_configs``) from a tiles run: per matrix, the ``mma``-mode
    candidate with the least time summed over the timed n (what the kernel tuner ranks by), keyed as the tuner
    keys it."""
    dims = decode_matrices(**TILE_SHAPES[shape])
    configs = {}
    for name, (n_rows, k, kind) in dims.items():
        totals: dict[tuple, list[float]] = {}
        for r in rows:
            if r["matrix"] == name and r["mode"] == "mma" and "us" in r:
                totals.setdefault(tuple(r["cfg"]), []).append(r["us"])
        ns = {r["n"] for r in rows if r["matrix"] == name and r["mode"] == "mma"}
        full = {c: sum(t) for c, t in totals.items() if len(t) == len(ns)}
        if full:
            gated = kind == "gated"
            key = f"mma:1:{n_rows // 2 if gated else n_rows}:{k}:{int(gated)}:{dtype}"
            configs[key] = list(min(full, key=full.get))
    return {"device": device, "configs": configs}


def _tile_row(where: dict, mode: str, cfg: tuple, ms: float, w: torch.Tensor, bw: float) -> dict:
    """One timed candidate: microseconds, and W's bytes per second absolute and as a share of copy bandwidth."""
    nbytes = w.numel() * w.element_size()
    return {**where, "mode": mode, "cfg": list(cfg), "us": 1e3 * ms, "tb_s": nbytes / ms / 1e9,
            "of_copy_bandwidth": nbytes / (ms / 1e3) / bw}


def _eager_ms(fn, iters: int = 2) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1e3 * (time.perf_counter() - t0) / iters


def _copy_bandwidth(dev, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device copy (the memory-bound ceiling)."""
    if dev.type != "cuda":
        return 1e9  # the interpreter: no meaningful ceiling
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), iters=10, warmup=3)
    return 2 * nbytes / (ms / 1e3)


def part_loss(dev) -> list[dict]:
    from dspark_core.draft.loss import chunk_math
    from dspark_core.kernels.distill import chunk_math_triton

    n = 512
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(n, VOCAB, device=dev, generator=g) * 4
    teacher = torch.randn(n, VOCAB, device=dev, generator=g) * 4
    targets = torch.randint(0, VOCAB, (n,), device=dev, generator=g)
    weights = torch.rand(n, device=dev, generator=g)
    compiled = torch.compile(chunk_math, dynamic=True)
    args = (logits, teacher, targets, weights, 0.1, 0.9, torch.bfloat16)
    ref = compiled(*args)
    out = chunk_math_triton(*args)
    err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, out))
    rows = []
    for name, fn in (("compile", compiled), ("triton", chunk_math_triton), ("eager", chunk_math)):
        ms = bench(lambda: fn(*args), iters=20)
        rows.append({"impl": name, "slots": n, "vocab": VOCAB, "ms": ms,
                     "min_bytes_tb_s": (2 * n * VOCAB * 4 + n * VOCAB * 2) / ms / 1e9})
        print(f"loss chunk {name:8s} {ms:7.3f} ms", flush=True)
    rows.append({"max_abs_diff_compile_vs_triton": err})
    print(f"loss chunk max |compile - triton| = {err:.3g}")
    return rows


ADAMW_SHAPES = 5 * [(4096, H), (HKV * D, H), (HKV * D, H), (H, HQ * D), (FFN, H), (FFN, H), (H, FFN), (H,), (H,),
                    (D,), (D,)] + [(H, 5 * H), (H,), (VOCAB, 256), (VOCAB, 256), (H,)]
ADAMW_LAUNCHES = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]  # (BLOCK, warps)


def part_adamw(dev) -> list[dict]:
    from dspark_core.kernels.adamw import adamw_step_
    from dspark_core.train.optim import TritonAdamW

    params = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02) for s in ADAMW_SHAPES]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    scale = torch.tensor(1.5, device=dev)
    copy_src = torch.empty(n, device=dev, dtype=torch.bfloat16)
    copy_dst = torch.empty_like(copy_src)
    copy_tb_s = 2 * copy_src.numel() * 2 / (bench(lambda: copy_dst.copy_(copy_src), iters=10) / 1e3) / 1e12
    rows = [{"impl": "copy", "values": n, "tb_s": copy_tb_s}]
    print(f"adamw: {n / 1e6:.1f}M values; copy {copy_tb_s:.2f} TB/s", flush=True)

    def opt_step(opt):
        opt.grad_scale = scale
        opt.step()

    for name, opt in (("torch_fused", torch.optim.AdamW(params, lr=1e-4, fused=True)),
                      ("triton_default", TritonAdamW(params, lr=1e-4))):
        ms = bench(lambda: opt_step(opt), iters=10)
        rows.append({"impl": name, "values": n, "ms": ms, "tb_s": 14 * n / (ms / 1e3) / 1e12})
        print(f"adamw {name:16s} {ms:7.3f} ms {rows[-1]['tb_s']:.2f} TB/s", flush=True)
    state = [opt.state[p] for p in params]
    lists = ([p.detach() for p in params], [p.grad for p in params], [s["exp_avg"] for s in state],
             [s["exp_avg_sq"] for s in state], [s["step"] for s in state])
    for block, warps in ADAMW_LAUNCHES:
        ms = bench(lambda: adamw_step_(*lists, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                       grad_scale=scale, block=block, num_warps=warps), iters=10)
        rows.append({"impl": "triton", "block": block, "num_warps": warps, "values": n, "ms": ms,
                     "tb_s": 14 * n / (ms / 1e3) / 1e12})
        print(f"adamw triton block {block:5d} warps {warps:2d} {ms:7.3f} ms {rows[-1]['tb_s']:.2f} TB/s", flush=True)
    return rows


# (name, dynamic shapes, compile mode, kernel_options) of the flex part; static shapes only at the longest L
FLEX_VARIANTS = [("default", True, None, None), ("max_autotune", True, "max-autotune-no-cudagraphs", None),
                 ("static", False, None, None), ("m64n64", True, None, {"BLOCK_M": 64, "BLOCK_N": 64})]
# --flex-set sweep: the training path's static shapes under backward / forward kernel options
FLEX_SWEEP = [("static", False, None, None),
              ("static_autotune", False, "max-autotune-no-cudagraphs", None),
              ("bwd_m64n128_m128n64", False, None, {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                                                    "bwd_BLOCK_N2": 64}),
              ("bwd_m32n128_m128n32", False, None, {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                                                    "bwd_BLOCK_N2": 32}),
              ("bwd_w8_s2", False, None, {"bwd_num_warps": 8, "bwd_num_stages": 2}),
              ("fwd_tma", False, None, {"fwd_USE_TMA": True})]
# --flex-set flash: the training path's static shapes, Triton kernels vs FlashAttention-4 (CuTe DSL)
FLEX_FLASH = [("static", False, None, None), ("static_flash", False, None, {"BACKEND": "FLASH"})]
FLEX_SETS = {"default": None, "sweep": FLEX_SWEEP, "flash": FLEX_FLASH}


def part_flex(dev, lengths=(2048, 4096), variants=None) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from dspark_core.draft.attention import make_mask_mod

    anchors_n, block = 512, 7
    variants = FLEX_VARIANTS if variants is None else variants
    static_everywhere = variants is not FLEX_VARIANTS
    rows = []
    for length in lengths:
        g = torch.Generator().manual_seed(0)
        cand = torch.arange(length // 16, length - block - 1)
        anchors = cand[torch.randperm(cand.numel(), generator=g)[:anchors_n]].sort().values.view(1, -1).to(dev)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        q_len = anchors_n * block
        kv_len = length + q_len
        mask_mod = make_mask_mod(anchors, valid, length, block)
        bm = create_block_mask(mask_mod, B=1, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=dev)
        q = torch.randn(1, HQ, q_len, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, HKV, kv_len, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, HKV, kv_len, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(1, HQ, q_len, D, device=dev, dtype=torch.bfloat16)
        pairs = _visible_pairs(anchors[0].cpu(), length, block)
        flops_fwd = 4 * pairs * HQ * D
        print(f"flex L={length}: {bm}".split("\n")[0], flush=True)
        ref = None  # the first variant's (out, dq, dk, dv): every other row is compared with it
        for name, dyn, mode, opts in variants:
            if not dyn and length != max(lengths) and not static_everywhere:
                continue
            fn = torch.compile(flex_attention, dynamic=dyn, mode=mode)
            t0 = time.perf_counter()
            try:
                def step():
                    out = fn(q, k, v, block_mask=bm, scale=D ** -0.5, enable_gqa=True, kernel_options=opts)
                    out.backward(do)

                def fwd():
                    with torch.no_grad():
                        fn(q, k, v, block_mask=bm, scale=D ** -0.5, enable_gqa=True, kernel_options=opts)

                t_fwd = bench(fwd, iters=20)
                t_all = bench(step, iters=20)
                got = _flex_result(fn, q, k, v, do, bm, opts)
            except Exception as e:  # noqa: BLE001 - options a kernel cannot take are recorded and skipped
                rows.append({"L": length, "variant": name, "error": str(e).split("\n")[0][:200]})
                print(f"  {name:12s}: failed ({rows[-1]['error'][:80]})", flush=True)
                continue
            ref = got if ref is None else ref
            diff = {f"max_abs_diff_{key}": float((a.float() - b.float()).abs().max())
                    for key, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
            rows.append({"L": length, "variant": name, "dynamic": dyn, "mode": mode, "kernel_options": opts,
                         "fwd_ms": t_fwd, "fwd_bwd_ms": t_all, "bwd_ms": t_all - t_fwd, "visible_pairs": pairs,
                         "fwd_tflops": flops_fwd / t_fwd / 1e9, "bwd_tflops": 2.5 * flops_fwd / (t_all - t_fwd) / 1e9,
                         **diff})
            print(f"  {name:12s}: fwd {t_fwd:.3f} ms, fwd+bwd {t_all:.3f} ms ({flops_fwd / t_fwd / 1e9:.0f} TFLOP/s "
                  f"fwd; {time.perf_counter() - t0:.0f} s incl. compile); max |diff| vs {variants[0][0]}: "
                  + ", ".join(f"{k[13:]} {v:.2g}" for k, v in diff.items()), flush=True)
    return rows


def _flex_result(fn, q, k, v, do, bm, opts) -> tuple[torch.Tensor, ...]:
    """One forward + backward: (out, dq, dk, dv), detached copies."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, block_mask=bm, scale=D ** -0.5, enable_gqa=True, kernel_options=opts)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _visible_pairs(anchors: torch.Tensor, length: int, block: int) -> int:
    """(query, key) pairs the mask lets through: each block sees its context prefix and its own block."""
    return int((anchors.long() * block).sum() + anchors.numel() * block * block)


def part_decode_profile(dev) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dspark_core.decoding.target_runner import TargetRunner

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=36,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, tie_word_embeddings=True,
                      rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    runner = TargetRunner(model, max_len=512, kernels=True)
    runner.prefill(torch.randint(0, VOCAB, (1, 128), device=dev))
    ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
    for _ in range(3):
        runner.forward(ids)
    torch.cuda.synchronize()
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.forward(ids)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60)
    print(table)
    total_us = sum(e.self_device_time_total for e in prof.key_averages()) / steps
    print(f"decode step kernel time (sum of kernels, no graph): {total_us / 1e3:.3f} ms")
    rows = [{"name": e.key[:80], "us_per_step": e.self_device_time_total / steps, "calls_per_step": e.count / steps}
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:15]]
    return [{"kernel_ms_per_step": total_us / 1e3, "top": rows}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["gemv", "loss", "flex", "decode_profile"])
    ap.add_argument("--tile-shape", choices=list(TILE_SHAPES), default="qwen3-4b", help="matrices of the tiles part")
    ap.add_argument("--tile-tokens", default="1", help="tiles part: comma list of token counts n (e.g. 1,8)")
    ap.add_argument("--tile-candidates", default="all",
                    help="tiles part: all, or a comma list of tc, fma_tile, gemv, cublas")
    ap.add_argument("--tile-pins", default=None,
                    help="tiles part: also write the best mma-mode candidate per matrix (least time summed over "
                         "--tile-tokens) as a kernel configs table to this file (bench_online.kernel_configs)")
    ap.add_argument("--flex-set", choices=tuple(FLEX_SETS), default="default",
                    help="flex part: the default variants, the static-shape kernel-option sweep (FLEX_SWEEP), or "
                         "Triton vs the FlashAttention-4 backend (FLEX_FLASH)")
    ap.add_argument("--flex-lengths", default="2048,4096", help="flex part: comma list of context lengths")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench" / "kernels.json"))
    args = ap.parse_args()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not (interpret and args.parts == ["tiles"]):
        raise SystemExit("bench_kernels.py needs a CUDA device (the tiles part also runs under TRITON_INTERPRET=1)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)",
              "torch": torch.__version__}
    flex_lengths = tuple(int(n) for n in args.flex_lengths.split(","))
    parts = {"gemv": part_gemv, "loss": part_loss, "decode_profile": part_decode_profile, "adamw": part_adamw,
             "flex": lambda d: part_flex(d, flex_lengths, FLEX_SETS[args.flex_set]),
             "tiles": lambda d: part_tiles(d, args.tile_shape, tokens=tuple(int(t) for t in args.tile_tokens.split(",")),
                                           candidates=args.tile_candidates)}
    for name in args.parts:
        t0 = time.perf_counter()
        try:
            report[name] = parts[name](dev)
        except Exception as e:  # noqa: BLE001 - one failing part must not lose the others' numbers
            report[name] = {"error": repr(e)[:500]}
            print(f"part {name} failed: {e!r}", flush=True)
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
        write_json(Path(args.out), report)
        if name == "tiles" and args.tile_pins and isinstance(report[name], list):
            write_json(Path(args.tile_pins), tile_pins(report[name], args.tile_shape, report["device"]))
    print(json.dumps({k: v for k, v in report.items() if k in ("device", "torch")}))


if __name__ == "__main__":
    main()
