"""The online target forward alone: the frozen target's forward that fills a batch with its hidden states.

What runs is what the trainer runs under ``train.hidden_states: online`` and the cache stage runs to build its store
(``cache/capture.py``: ``capture_padded`` over the draft's aux layers, no row padded, the decoder layers under
``torch.compile`` as ``compile_layers`` sets them, autocast off, no grad): a random Qwen3 of ``--shape``'s widths
(36 layers for Qwen3-4B) in bf16 on the GPU, one row of L tokens. Each row of the table is one shape, L and SDPA
backend choice:

- ``step_s``: the forward as the trainer launches it (Python queues each layer), ``mfu`` its matrix work
  (``target_tflop``: projections, MLP, causal attention; no LM head) over ``--peak-tflops``;
- ``host_s``: the host's time to queue one forward onto an idle GPU: near ``step_s``, the launches are the limit;
- ``graph_s`` / ``graph_mfu``: the same forward replayed from a CUDA graph, the GPU's own time with no launch gaps
  (``graph_error`` instead where the forward cannot be captured);
- ``--profile``: ``ms_by_kind``, the device time of one forward by kernel kind (``bench_train_step.kernel_kind``:
  GEMM, attention, the rest) and ``attention_kernel``, the attention kernel that ran;
- ``max_diff_last``: the largest difference of its last hidden state from the first ``--sdpa`` choice's, same
  shape and L (0: the same bits).

``--projections`` adds a table of one decoder layer's projection GEMMs alone (bf16, random operands of the
layer's shapes, replayed from a CUDA graph): the seven a transformers layer launches (q, k, v, o, gate, up, down)
against five, q / k / v and gate / up each as one GEMM over the concatenated weights, in ms a layer and over the
target's layers (``saves_ms``): what fusing the projections would take off the forward's GEMM time (on the CPU,
with ``--tiny``: timed as called).

``--sdpa`` picks the attention backend of the SDPA call inside the layers (``torch.nn.attention.sdpa_kernel`` while
the layers compile and run): ``default`` (torch's own choice: cuDNN on Hopper), ``cudnn``, ``flash``, ``efficient``;
``fa4`` first activates torch's FlashAttention-4 implementation of its flash backend
(``torch.nn.attention.activate_flash_attention_impl("FA4")``, needs ``flash-attn-4``) and prefers the flash
backend. Several choices: one row each, in the order given (``fa4`` changes the process's flash backend, so it goes
last).

    python benchmarks/bench_target_forward.py --shape qwen3-4b qwen3-8b --profile --sdpa default fa4 \
        --out reports/bench/target_forward.json
    python benchmarks/bench_target_forward.py --tiny --out /tmp/target_forward.json   # CPU smoke run

Imports torch, transformers and ``dspark_core.cache``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_train_step import (AUX_LAYERS, SHAPES, build_target, kernel_kind, sync, target_config,  # noqa: E402
                              target_tflop)

from dspark_core.cache.capture import capture_padded, compile_layers  # noqa: E402
from dspark_core.io import write_json  # noqa: E402

SDPA_CHOICES = ("default", "cudnn", "flash", "efficient", "fa4")


def sdpa_context(choice: str):
    """The ``sdpa_kernel`` context of a ``--sdpa`` choice (none for ``default``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
                "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                "fa4": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]}
    if choice == "default":
        return contextlib.nullcontext()
    if choice == "fa4":
        from torch.nn.attention import activate_flash_attention_impl

        activate_flash_attention_impl("FA4")
    return sdpa_kernel(backends[choice], set_priority=True)


def build_model(args, shape: str, device: torch.device) -> torch.nn.Module:
    """The online rows' random target (``bench_train_step.build_target``) of ``shape``'s widths, in its compute
    dtype on ``device`` (bf16 on a GPU)."""
    return build_target(argparse.Namespace(tiny=args.tiny, shape=shape), device).model.eval()


def timed(fn, steps: int, device: torch.device) -> float:
    """Mean seconds of ``fn`` over ``steps`` calls, the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


def graph_seconds(fn, steps: int, device: torch.device) -> float:
    """Mean seconds of ``fn`` replayed from a CUDA graph (recorded after a warm-up run on a side stream)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    seconds = timed(graph.replay, steps, device)
    del graph
    return seconds


def kinds_of_one(fn, device: torch.device) -> tuple[dict[str, float], str | None]:
    """Device ms of one ``fn`` by kernel kind, and the name of its longest attention kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    ms: dict[str, float] = {}
    attention: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        kind = kernel_kind(ev.name)
        ms[kind] = ms.get(kind, 0.0) + ev.device_time / 1e3
        if kind == "attention":
            attention[ev.name] = attention.get(ev.name, 0.0) + ev.device_time
    top = max(attention, key=attention.get) if attention else None
    return {k: round(v, 3) for k, v in sorted(ms.items())}, top


def bench_row(args, model, shape: str, length: int, choice: str, device: torch.device) -> tuple[dict, torch.Tensor]:
    """One row: the forward of one random row of ``length`` tokens under SDPA ``choice``; and its last state."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=g).to(device)  # [1, L]
    valid = torch.ones(1, length, dtype=torch.bool, device=device)  # [1, L]
    fn = lambda: capture_padded(model, ids, valid, AUX_LAYERS, False)  # noqa: E731
    with torch.no_grad(), torch.autocast(device.type, enabled=False), sdpa_context(choice):
        t0 = time.perf_counter()
        _, last = fn()  # [1, L, H]; compiles at the first width
        sync(device)
        warm = time.perf_counter() - t0
        for _ in range(args.warmup):
            fn()
        step_s = timed(fn, args.steps, device)
        sync(device)
        t0 = time.perf_counter()
        fn()
        host_s = time.perf_counter() - t0
        sync(device)
        graph_s, graph_error = None, None
        if device.type == "cuda":
            try:
                graph_s = graph_seconds(fn, args.steps, device)
            except RuntimeError as e:  # a kernel that cannot be captured: the row keeps its eager figures
                graph_error = str(e).splitlines()[0][:200]
        kinds, attention = kinds_of_one(fn, device) if args.profile and device.type == "cuda" else (None, None)
    tflop = target_tflop(target_config(args.tiny, shape), [length])
    peak = args.peak_tflops if device.type == "cuda" else None
    row = {"shape": shape, "L": length, "sdpa": choice, "compiled": device.type == "cuda", "step_s": step_s,
           "host_s": host_s, "graph_s": graph_s, "warmup_s": warm, "target_tflop": tflop,
           "mfu": tflop / step_s / peak if peak else None,
           "graph_mfu": tflop / graph_s / peak if peak and graph_s else None,
           "graph_error": graph_error, "ms_by_kind": kinds, "attention_kernel": attention}
    return row, last


def fresh_compiles() -> None:
    """Each ``--sdpa`` choice compiles the layers anew: Inductor's graph caches key a compiled graph on the traced
    graph, not on the SDPA backend flags in force when it was traced, so a cached graph would keep the first
    choice's attention kernel."""
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.reset()


def bench_shape(args, shape: str, device: torch.device, rows: list[dict]) -> None:
    model = build_model(args, shape, device)
    first: dict[int, torch.Tensor] = {}
    for choice in args.sdpa:
        fresh_compiles()  # the layers compile again under this choice's context
        compile_layers(model, device.type == "cuda")
        for length in args.lengths:
            row, last = bench_row(args, model, shape, length, choice, device)
            ref = first.setdefault(length, last)
            row["max_diff_last"] = float((last.float() - ref.float()).abs().max())
            rows.append(row)
            print(f"  {shape} L {length} sdpa {choice}: {row['step_s']:.4f} s", file=sys.stderr, flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gemm_ms(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, reps: int = 20) -> float:
    """Device ms of one pass over ``pairs`` (``x @ w.T`` each), replayed from a CUDA graph of ``reps`` passes (on
    the CPU: timed as called)."""
    def run():
        for _ in range(reps):
            for x, w in pairs:
                torch.nn.functional.linear(x, w)

    seconds = graph_seconds(run, 5, device) if device.type == "cuda" else timed(run, 1, device)
    return seconds * 1e3 / reps


def projection_rows(args, shape: str, device: torch.device) -> list[dict]:
    """Per L: one decoder layer's projection GEMMs as transformers launches them and with q / k / v and gate / up
    fused (``--projections``), ms a layer, and the fused GEMMs' saving over the target's layers."""
    tc = target_config(args.tiny, shape)
    h, f, hq, hkv = tc.hidden_size, tc.intermediate_size, tc.num_attention_heads, tc.num_key_value_heads
    dh = getattr(tc, "head_dim", None) or h // hq
    w = {name: torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02  # [out, in]
         for name, n, k in [("q", hq * dh, h), ("k", hkv * dh, h), ("v", hkv * dh, h), ("o", h, hq * dh),
                            ("gate", f, h), ("up", f, h), ("down", h, f)]}
    qkv, gate_up = torch.cat([w["q"], w["k"], w["v"]]), torch.cat([w["gate"], w["up"]])  # [out, in]
    out = []
    for length in args.lengths:
        x, a, m = (torch.randn(length, k, device=device, dtype=torch.bfloat16) for k in (h, hq * dh, f))  # [L, in]
        separate = gemm_ms([(x, w["q"]), (x, w["k"]), (x, w["v"]), (a, w["o"]), (x, w["gate"]), (x, w["up"]),
                            (m, w["down"])], device)
        fused = gemm_ms([(x, qkv), (a, w["o"]), (x, gate_up), (m, w["down"])], device)
        tflop = 2 * length * (qkv.numel() + w["o"].numel() + gate_up.numel() + w["down"].numel()) / 1e12
        out.append({"shape": shape, "L": length, "separate_ms": separate, "fused_ms": fused,
                    "separate_tflops": tflop / separate * 1e3, "fused_tflops": tflop / fused * 1e3,
                    "saves_ms": (separate - fused) * tc.num_hidden_layers})
    return out


def print_table(rows: list[dict]) -> None:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"{'shape':>9} {'L':>5} {'sdpa':>9} {'step_s':>8} {'host_s':>8} {'graph_s':>8} {'MFU':>5} {'graph':>5} "
          f"{'gemm ms':>8} {'attn ms':>8} {'rest ms':>8} {'diff':>7}")
    for r in rows:
        k = r["ms_by_kind"] or {}
        rest = sum(v for n, v in k.items() if n not in ("gemm", "attention")) if k else None
        print(f"{r['shape']:>9} {r['L']:>5} {r['sdpa']:>9} {r['step_s']:>8.4f} {r['host_s']:>8.4f} "
              f"{fmt(r['graph_s'], '.4f'):>8} {fmt(r['mfu'], '.0%'):>5} {fmt(r['graph_mfu'], '.0%'):>5} "
              f"{fmt(k.get('gemm'), '.2f'):>8} {fmt(k.get('attention'), '.2f'):>8} {fmt(rest, '.2f'):>8} "
              f"{r['max_diff_last']:>7.4f}")


def write_report(args, device: torch.device, rows: list[dict], projections: list[dict]) -> None:
    report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "results": rows, "projections": projections or None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)  # atomic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", choices=tuple(SHAPES), default=["qwen3-4b"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--sdpa", nargs="+", choices=SDPA_CHOICES, default=["default"],
                    help="SDPA backend choices, one row each (fa4 last: it changes the process's flash backend)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="device ms of one forward by kernel kind (GPU)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 / H200 SXM)")
    ap.add_argument("--projections", action="store_true",
                    help="a table of one layer's projection GEMMs, as launched and with q/k/v and gate/up fused")
    ap.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench" / "target_forward.json")
    args = ap.parse_args()
    if "fa4" in args.sdpa[:-1]:
        ap.error("--sdpa fa4 changes the process's flash backend: give it last")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type != "cuda" and set(args.sdpa) != {"default"}:
        ap.error(f"--sdpa {' '.join(args.sdpa)}: the backend choices need a GPU; on the CPU give default")
    if args.tiny:
        args.lengths = sorted({min(n, 64) for n in args.lengths})
    rows: list[dict] = []
    projections: list[dict] = []
    for shape in args.shape:
        bench_shape(args, shape, device, rows)
        if args.projections:
            projections += projection_rows(args, shape, device)
        write_report(args, device, rows, projections)  # after each shape, so a later failure keeps the rows
    print_table(rows)
    if projections:
        print(f"\n{'shape':>9} {'L':>5} {'7 GEMMs ms':>10} {'5 GEMMs ms':>10} {'TFLOP/s':>8} {'fused':>6} "
              f"{'saves ms':>8}  (one layer's projections; saves: over the target's layers)")
        for r in projections:
            print(f"{r['shape']:>9} {r['L']:>5} {r['separate_ms']:>10.3f} {r['fused_ms']:>10.3f} "
                  f"{r['separate_tflops']:>8.0f} {r['fused_tflops']:>6.0f} {r['saves_ms']:>8.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
