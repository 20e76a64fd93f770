"""What the cache's per-chunk CRC-32C costs: the same store written with and without the ``crc32c`` codec at the
end of each chunk's codec chain, then one training epoch read through ``CacheDataset``.

The store is written by the cache stage's own path (``create_store`` -> ``HiddenWriter`` -> ``commit``) from
random hidden states of the given width (normal activations in bf16 bits: near-incompressible, as real ones
are), so the figures are the codec's and the file system's, without a target forward in them. ``--checksums
off`` is built by leaving ``Crc32cCodec`` out of ``chunk_codecs`` (this benchmark only; every real store has
it). Each configuration is run ``--repeats`` times in alternation; the table shows the fastest run of each (the
JSON also the medians and every run).

    python benchmarks/bench_cache_checksum.py --out reports/bench/cache_checksum.json          # < 2 min on CPU
    python benchmarks/bench_cache_checksum.py --samples 512 --hidden 2560 --out /tmp/x.json    # Qwen3-4B width

Figures: ``write_s`` (all hidden chunks written and committed), ``epoch_s`` (every sample read once in a seeded
random order through ``CacheDataset.__getitem__``, bf16 -> float32 decode included), ``verify_s``
(``bad_chunks``: the checksum of every chunk file, on the store with checksums), ``crc_only_s`` (CRC-32C of every
chunk file's bytes, already in memory: the checksum's own cost), sizes on disk; each also as
``*_cpu_s``, the CPU seconds of the process (all threads), which other load on a shared machine disturbs less
than the wall time.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_core.cache import store as store_mod  # noqa: E402
from dspark_core.cache.build import CacheConfig, wanted_manifest  # noqa: E402
from dspark_core.cache.dataset import CacheDataset  # noqa: E402
from dspark_core.cache.source import load_regen  # noqa: E402
from dspark_core.io import write_json  # noqa: E402
from dspark_core.testing import tiny_config, write_regen  # noqa: E402


@contextmanager
def checksums(on: bool):
    """Stores created inside have the crc32c codec (``on``) or blosc alone."""
    if on:
        yield
        return
    with mock.patch.object(store_mod, "chunk_codecs", lambda *a: [store_mod.blosc_codec(*a)]):
        yield


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: every thread) of ``fn()``."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def build(dest: Path, regen: Path, args, on: bool) -> tuple[float, float]:
    """Write a complete store at ``dest``; returns (wall, CPU) seconds spent writing its hidden states."""
    cfg = CacheConfig(aux_layer_ids=tuple(range(args.aux_layers)), max_length=args.max_length,
                      chunk_tokens=args.chunk_tokens, clevel=args.clevel)
    model_cfg = tiny_config("qwen3", hidden_size=args.hidden, num_hidden_layers=args.aux_layers + 1)
    samples = load_regen(regen, cfg.max_length)
    manifest = wanted_manifest(cfg, model_cfg, "bench", samples, regen, "bench")
    shutil.rmtree(dest, ignore_errors=True)
    with checksums(on):
        group = store_mod.create_store(dest, manifest, input_ids=samples.input_ids, loss_mask=samples.loss_mask,
                                       offsets=samples.offsets, source_index=samples.order)
    g = torch.Generator().manual_seed(0)
    lengths = np.diff(samples.offsets)
    hidden = [store_mod.encode_hidden(torch.randn(int(n), args.aux_layers, args.hidden, generator=g),  # [L, K, H]
                                      torch.randn(int(n), args.hidden, generator=g), "bf16") for n in lengths]

    def write() -> None:
        writer = store_mod.HiddenWriter(group, 0, ("aux_hidden", "last_hidden"))
        for i, arrays in enumerate(hidden):
            writer.append(arrays)
            if i % 8 == 7:
                store_mod.commit(group, samples.offsets, writer.flush(), 0.0)
        store_mod.commit(group, samples.offsets, writer.flush(final=True), 0.0, complete=True)

    return timed(write)


def read_epoch(path: Path) -> tuple[float, float]:
    ds = CacheDataset(path)
    order = np.random.default_rng(0).permutation(len(ds))
    return timed(lambda: [ds[int(n)] for n in order])


METRICS = ("write_s", "write_cpu_s", "epoch_s", "epoch_cpu_s")


def measure(work: Path, regen: Path, args) -> dict[str, dict]:
    runs: dict[str, dict[str, list[float]]] = {k: {m: [] for m in METRICS} for k in ("on", "off")}
    for rep in range(args.repeats):
        for key in (("off", "on") if rep % 2 == 0 else ("on", "off")):  # alternate which goes first
            dest = work / f"checksums_{key}.zarr"
            for name, (wall, cpu) in (("write", build(dest, regen, args, key == "on")), ("epoch", read_epoch(dest))):
                runs[key][f"{name}_s"].append(wall)
                runs[key][f"{name}_cpu_s"].append(cpu)
    # the fastest of the repeats is the cost itself (a shared machine only adds to it); the median beside it
    out = {k: {**{m: min(v) for m, v in r.items()}, **{f"{m}_median": statistics.median(v) for m, v in r.items()},
               "runs": r} for k, r in runs.items()}
    for key in ("on", "off"):
        out[key]["store_bytes"] = sum(f.stat().st_size for f in (work / f"checksums_{key}.zarr").rglob("*")
                                      if f.is_file())
    bad: list = []
    out["on"]["verify_s"], out["on"]["verify_cpu_s"] = timed(lambda: bad.extend(store_mod.bad_chunks(
        work / "checksums_on.zarr")))
    assert not bad, bad
    chunks = [f.read_bytes() for f in (work / "checksums_on.zarr").rglob("*") if f.is_file() and f.name != "zarr.json"]
    ok: list = []
    out["on"]["crc_only_s"] = min(timed(lambda: ok.extend(store_mod.checksum_ok(c) for c in chunks))[1]
                                  for _ in range(3))
    out["on"]["crc_bytes"] = sum(len(c) for c in chunks)
    assert all(ok)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024, help="hidden width (Qwen3-4B: 2560)")
    p.add_argument("--aux-layers", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--clevel", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--work", type=Path, default=Path("/tmp/dspark_cache_checksum"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lengths = [(int(rng.integers(16, 128)), int(rng.integers(16, args.max_length - 128))) for _ in range(args.samples)]
    regen = write_regen(args.work / "regen.parquet", lengths, seed=1)
    res = measure(args.work, regen, args)
    tokens = int(np.diff(load_regen(regen, args.max_length).offsets).sum())
    on, off = res["on"], res["off"]
    overhead = {m: on[m] / off[m] - 1.0 for m in METRICS}
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
           "hardware": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                        "cpus": _cpus(), "python": platform.python_version(), "torch": torch.__version__,
                        "torch_threads": torch.get_num_threads()},
           "config": {k: getattr(args, k) for k in ("samples", "max_length", "hidden", "aux_layers", "chunk_tokens",
                                                     "clevel", "repeats")},
           "num_tokens": tokens, "checksums_on": on, "checksums_off": off, "overhead": overhead,
           "crc_share": {m: on["crc_only_s"] / off[m] for m in ("write_cpu_s", "epoch_cpu_s")},
           "on_tokens_per_s": {"write": tokens / on["write_s"], "epoch": tokens / on["epoch_s"],
                               "verify": tokens / on["verify_s"]}}
    write_json(args.out, out)
    print(f"{tokens} tokens, hidden {args.hidden} x {args.aux_layers} aux layers, chunk {args.chunk_tokens}, "
          f"fastest of {args.repeats}")
    print(f"{'':>14} " + " ".join(f"{m:>12}" for m in METRICS) + f" {'MB':>10}")
    for name, r in (("crc32c off", off), ("crc32c on", on)):
        print(f"{name:>14} " + " ".join(f"{r[m]:12.3f}" for m in METRICS) + f" {r['store_bytes'] / 1e6:10.1f}")
    print(f"{'overhead':>14} " + " ".join(f"{overhead[m]:+12.1%}" for m in METRICS)
          + f" {on['store_bytes'] - off['store_bytes']:+9d}B")
    print(f"CRC-32C alone over the store's {on['crc_bytes'] / 1e6:.1f} MB of chunks (in memory): "
          f"{on['crc_only_s']:.4f} s CPU = {out['crc_share']['write_cpu_s']:.1%} of a write's CPU, "
          f"{out['crc_share']['epoch_cpu_s']:.1%} of an epoch's")
    print(f"verify (every chunk's checksum): {on['verify_s']:.3f} s wall, {on['verify_cpu_s']:.3f} s CPU, "
          f"{tokens / on['verify_s']:,.0f} tokens/s")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    main()
