"""The multi-GPU benchmarks on CPU (torchrun, gloo): 2 processes give the 1-process loss trajectory at the same
global batch for both trainer tasks, and the 2-process cache stage writes the 1-process store bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _bench(*args: str, world: int | None = None) -> None:
    cmd = [sys.executable]
    if world is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    subprocess.run(cmd + list(args), check=True, env=ENV, cwd=ROOT, capture_output=True, timeout=600)


@pytest.mark.parametrize("task", ["dspark", "dmtd"])
def test_ddp_train_bench_two_processes_match_one(tmp_path, task):
    common = ["benchmarks/bench_ddp_train.py", "--task", task, "--shapes", "tiny", "--length", "96",
              "--anchors", "12", "--global-batch", "4", "--micro", "1", "--warmup", "1", "--steps", "3"]
    for w in (1, 2):
        _bench(*common, "--out", str(tmp_path / f"w{w}.json"), world=w)
    _bench("benchmarks/bench_ddp_train.py", "--summary", str(tmp_path / "w1.json"), str(tmp_path / "w2.json"),
           "--out", str(tmp_path / "sum.json"))
    one, two = json.loads((tmp_path / "sum.json").read_text())["rows"]
    assert (one["world_size"], one["grad_accum"], two["world_size"], two["grad_accum"]) == (1, 4, 2, 2)
    assert one["loss_max_abs_diff"] == 0.0 and one["scaling_efficiency"] == pytest.approx(1.0)
    assert two["loss_max_rel_diff"] < 1e-5  # same global batch: the same steps up to float summation order
    assert two["loss_first_last"][0] != two["loss_first_last"][1]  # it trained
    assert two["scaling_efficiency"] == pytest.approx(one["step_s"] / (2 * two["step_s"]))


def test_summary_refuses_runs_of_other_settings(tmp_path):
    run = {"task": "dspark", "variant": None, "shapes": "tiny", "world_size": 1, "global_batch": 4, "micro_batch": 1,
           "grad_accum": 4, "length": 96, "step_s": 1.0, "tokens_per_s": 1.0, "peak_gib": None, "loss": [1.0]}
    (tmp_path / "a.json").write_text(json.dumps(run))
    (tmp_path / "b.json").write_text(json.dumps({**run, "world_size": 2, "global_batch": 8}))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_ddp_train import summarize
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    with pytest.raises(ValueError, match="global_batch=8"):
        summarize([tmp_path / "a.json", tmp_path / "b.json"])


def test_cache_shard_bench_two_processes_write_the_one_process_store(tmp_path):
    _bench("benchmarks/bench_cache_shard.py", "--shapes", "tiny", "--samples", "24", "--max-length", "300",
           "--batch-tokens", "1000", "--nprocs", "1", "2", "--work", str(tmp_path / "work"),
           "--out", str(tmp_path / "out.json"))
    one, two = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert two["world_size"] == 2 and two["identical"] and all(two["arrays_identical"].values())
    assert {"aux_hidden", "last_hidden", "input_ids", "offsets"} <= set(two["arrays_identical"])
    assert one["verify_exact"] and two["verify_exact"] and two["complete"] and not two["leftover_progress_files"]
    assert one["num_tokens"] == two["num_tokens"] > 0
