"""The online target forward benchmark runs on the CPU (tiny widths), writes its rows, and refuses GPU-only choices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_target_forward.py"


def test_tiny_rows_time_the_forward_and_count_its_matrix_work(tmp_path):
    out = tmp_path / "target_forward.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--steps", "1", "--warmup", "0", "--lengths", "40",
                           "48", "--projections", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["shape"], r["L"], r["sdpa"]) for r in rows] == [("qwen3-4b", 40, "default"), ("qwen3-4b", 48, "default")]
    layer = 2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 3 * 64 * 128  # q, o, k, v, gate / up / down of the tiny target
    for r in rows:
        n = r["L"]
        assert r["target_tflop"] == pytest.approx(36 * (2 * n * layer + 2 * n * n * 4 * 16) / 1e12)
        assert r["step_s"] > 0 and r["host_s"] > 0
        # no GPU: no graph replay, no MFU, no kernel table, layers not compiled
        assert r["graph_s"] is None and r["graph_error"] is None and r["mfu"] is None and r["ms_by_kind"] is None
        assert r["compiled"] is False
    assert "step_s" in proc.stdout and "graph_s" in proc.stdout
    # --projections: one layer's 7 projection GEMMs against the fused 5, per L, the saving over 36 layers
    proj = report["projections"]
    assert [(r["shape"], r["L"]) for r in proj] == [("qwen3-4b", 40), ("qwen3-4b", 48)]
    for r in proj:
        assert r["separate_ms"] > 0 and r["fused_ms"] > 0
        assert r["saves_ms"] == pytest.approx(36 * (r["separate_ms"] - r["fused_ms"]))
        weights = 2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 3 * 64 * 128  # the same matrix work either way
        assert r["fused_tflops"] == pytest.approx(2 * r["L"] * weights / 1e12 / r["fused_ms"] * 1e3)
    assert "7 GEMMs ms" in proc.stdout


def test_backend_choices_need_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--sdpa", "default", "cudnn", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--sdpa default cudnn" in proc.stderr and "need a GPU" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.json").exists()
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--sdpa", "fa4", "default", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give it last" in proc.stderr
