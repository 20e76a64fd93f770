"""The cache stage on several processes: ``torchrun --nproc_per_node W stages/cache.py`` writes one
zarr store in chunk-aligned shards, one per rank; this checks the store against a one-process build and the
target, and times both.

For each W of ``--nprocs`` (1 first): the real stage under torchrun on a random target (Qwen3-4B widths:
hidden 2560, vocab 151,936, 32/8 heads, ``--layers`` decoder layers) and a random regenerate parquet of
``--samples`` samples. Then:

- every array of each W > 1 store is compared with the W = 1 store bit for bit (``identical``);
- ``verify_cache`` recomputes ``--verify`` samples with the target (``exact``: stored bits reproduced);
- the store's manifest is complete and no shard progress file is left over.

    python benchmarks/bench_cache_shard.py --nprocs 1 2 --out reports/bench/cache_shard.json   # 2 GPUs
    python benchmarks/bench_cache_shard.py --shapes tiny --nprocs 1 2 --out /tmp/x.json    # CPU (gloo)

``wall_s`` is the stage's wall time (process start, model load and compilation included); ``tokens_per_s``
is the stage's own figure (tokens / the slowest rank's forward-and-write seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_core.io import write_json  # noqa: E402

AUX_TINY = (-1, 0, 2, 4)


def make_target(path: Path, shapes: str, layers: int) -> Path:
    """A random Qwen3 target dir (weights, config, tokenizer, fingerprint); kept when it is already there."""
    import torch
    from transformers import AutoModelForCausalLM

    from dspark_core.target import write_fingerprint
    from dspark_core.testing import QWEN3_4B_SHAPES, save_tiny_target, tiny_config, tiny_tokenizer

    if (path / "fingerprint.json").is_file():
        return path
    if shapes == "tiny":
        save_tiny_target(path, "qwen3")
    else:
        cfg = tiny_config("qwen3", **{**QWEN3_4B_SHAPES, "num_hidden_layers": layers, "torch_dtype": "bfloat16"})
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
        tiny_tokenizer().save_pretrained(path)
    write_fingerprint(path)
    return path


def aux_layer_ids(shapes: str, layers: int) -> list[int]:
    """Four aux layers spread over the target (1, 4, 8, 10 of 12), as the seeds pick them; the tiny target's own."""
    if shapes == "tiny":
        return list(AUX_TINY)
    if layers < 4:
        raise ValueError(f"--layers must be >= 4 (aux layers before the last one); got {layers}")
    return sorted({1, layers // 3, 2 * layers // 3, layers - 2})


def stage_params(work: Path, target: Path, world: int, args) -> Path:
    import yaml

    tiny = args.shapes == "tiny"
    cache = {"aux_layer_ids": aux_layer_ids(args.shapes, args.layers), "max_length": args.max_length,
             "chunk_tokens": 256 if tiny else 512, "clevel": 1, "batch_tokens": args.batch_tokens,
             "dtype": "float32" if tiny else "bfloat16", "device": "cpu" if tiny else "auto", "splits": ["train"],
             "target_dir": str(target), "regen_dir": str(work / "regen"), "out_dir": str(work / f"cache_w{world}"),
             "stats_path": str(work / f"stats_w{world}.json")}
    path = work / f"params_w{world}.yaml"
    path.write_text(yaml.safe_dump({"cache": cache}, sort_keys=False))
    return path


def run_stage(params: Path, world: int) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "stages" / "cache.py"), "--params", str(params)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    return time.perf_counter() - t0


def compare_stores(a: Path, b: Path) -> dict[str, bool]:
    from dspark_core.cache.store import open_store

    ga, gb = open_store(a), open_store(b)
    names = sorted(set(ga.array_keys()) | set(gb.array_keys()))
    return {n: n in ga and n in gb and np.array_equal(ga[n][:], gb[n][:]) for n in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", choices=("qwen3-4b", "tiny"), default="qwen3-4b")
    p.add_argument("--layers", type=int, default=12, help="decoder layers of the random Qwen3-4B-wide target")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--verify", type=int, default=4, help="samples verify_cache recomputes per store")
    p.add_argument("--work", type=Path, default=Path("/tmp/dspark_cache_shard"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.nprocs[0] != 1:
        p.error("--nprocs must start with 1 (the reference store)")
    from dspark_core.cache import read_manifest, verify_cache
    from dspark_core.testing import write_regen

    args.work.mkdir(parents=True, exist_ok=True)
    target = make_target(args.work / "target", args.shapes, args.layers)
    rng = np.random.default_rng(0)
    lengths = [(int(rng.integers(16, 200)), int(rng.integers(1, args.max_length - 200))) for _ in range(args.samples)]
    vocab = 272 if args.shapes == "tiny" else 151936
    write_regen(args.work / "regen" / "train.parquet", lengths, seed=1, vocab=vocab)
    rows = []
    for world in args.nprocs:
        params = stage_params(args.work, target, world, args)
        shutil.rmtree(args.work / f"cache_w{world}", ignore_errors=True)  # a fresh build, not a resumed one
        wall = run_stage(params, world)
        store = args.work / f"cache_w{world}" / "train.zarr"
        stats = json.loads((args.work / f"stats_w{world}.json").read_text())
        manifest = read_manifest(store)
        ver = verify_cache(store, target, n_samples=args.verify, seed=world,
                           device="cuda" if args.shapes != "tiny" and _cuda() else "cpu")
        row = {"world_size": world, "wall_s": wall, "tokens_per_s": stats["tokens_per_s"],
               "num_tokens": stats["num_tokens"], "num_samples": stats["num_samples"],
               "bytes_per_token": stats["bytes_per_token"], "complete": bool(manifest["complete"]),
               "leftover_progress_files": sorted(x.name for x in store.parent.glob("train.zarr.shard*")),
               "verify_exact": ver["exact"], "verify_ok": ver["ok"], "verify_max_aux_rel_err": ver["max_aux_rel_err"],
               "verify_max_last_rel_err": ver["max_last_rel_err"]}
        if world != 1:
            same = compare_stores(args.work / "cache_w1" / "train.zarr", store)
            row["identical"] = all(same.values())
            row["arrays_identical"] = same
            row["speedup_vs_1"] = rows[0]["tokens_per_s"] and stats["tokens_per_s"] / rows[0]["tokens_per_s"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "arrays_identical"}), flush=True)
    out = {"shapes": args.shapes, "layers": args.layers if args.shapes != "tiny" else 6, "samples": args.samples,
           "max_length": args.max_length, "batch_tokens": args.batch_tokens, "rows": rows}
    write_json(args.out, out)
    print(f"{'W':>2} {'tokens':>8} {'wall_s':>7} {'tok/s':>9} {'identical':>9} {'verify':>7} {'complete':>8}")
    for r in rows:
        print(f"{r['world_size']:>2} {r['num_tokens']:>8} {r['wall_s']:7.1f} {r['tokens_per_s'] or 0:9.0f} "
              f"{str(r.get('identical', '-')):>9} {str(r['verify_exact']):>7} {str(r['complete']):>8}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
