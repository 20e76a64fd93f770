"""The training-step benchmark runs (tiny shapes on CPU), writes its JSON report, imports nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_train_step.py"


def test_bench_train_step_tiny_smoke(tmp_path):
    out = tmp_path / "train_step.json"
    argv = ["bench", "--tiny", "--steps", "1", "--warmup", "1", "--lengths", "48", "--precision", "amp", "bf16",
            "--out", str(out)]
    # run it as __main__, then check it needed nothing beyond torch / transformers / dspark_core.draft
    script = (f"import runpy, sys\nsys.argv = {argv!r}\nrunpy.run_path({str(BENCH)!r}, run_name='__main__')\n"
              "bad = [m for m in ('zarr', 'dvclive', 'matplotlib', 'dspark_core.cache') if m in sys.modules]\n"
              "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["precision"] for r in report["results"]] == ["amp", "bf16"]
    for row in report["results"]:
        assert row["L"] == 48 and row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["valid_slots"] > 0
        assert row["loss"] == row["loss"]  # finite, not NaN
    assert "step_s" in proc.stdout and "tokens/s" in proc.stdout


def test_bench_train_step_two_processes(tmp_path):
    """``torchrun --nproc_per_node 2`` (gloo on CPU): DDP steps, one report from rank 0 with world_size 2,
    tokens/s over both ranks, and scaling_efficiency against a one-process baseline of the same settings."""
    common = ["--tiny", "--steps", "2", "--warmup", "1", "--lengths", "48", "--precision", "amp", "--no-compile-layers"]
    one = tmp_path / "one.json"
    proc = subprocess.run([sys.executable, str(BENCH), *common, "--out", str(one)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    two = tmp_path / "two.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(BENCH), *common, "--out", str(two), "--baseline", str(one)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(two.read_text())
    row = report["results"][0]
    assert report["world_size"] == row["world_size"] == 2
    base = json.loads(one.read_text())["results"][0]
    assert row["tokens_per_s"] == 2 * 48 / row["step_s"]
    assert row["scaling_efficiency"] == base["step_s"] / row["step_s"] > 0
    bad = subprocess.run([sys.executable, str(BENCH), *common, "--out", str(tmp_path / "x.json"), "--baseline",
                          str(two)], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "not a one-process run" in bad.stderr


def test_bench_train_step_mixed_lengths_padded_and_packed(tmp_path):
    """``--mixed 4``: four samples a step (61, 50, 46, 8 tokens), one a row or (``--packed``) packed into rows of
    L = 64 (three rows); the same loss."""
    rows = {}
    for extra in ([], ["--packed"]):
        out = tmp_path / f"mix{len(extra)}.json"
        proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--steps", "1", "--warmup", "1", "--lengths", "64",
                               "--precision", "amp", "--mixed", "4", *extra, "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows[bool(extra)] = json.loads(out.read_text())["results"][0]
    assert rows[False]["rows"] == 4 and rows[True]["rows"] == 3 and rows[True]["packed"] is True
    assert rows[True]["valid_slots"] == rows[False]["valid_slots"] > 0
    assert abs(rows[True]["loss"] - rows[False]["loss"]) <= 1e-4 * abs(rows[False]["loss"])
