"""benchmarks/bench_dmtd.py runs on CPU with --tiny and writes the JSON the lead's report reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from dspark_core.dmtd.config import VARIANTS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dmtd.py"


def test_bench_tiny_writes_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_dmtd", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "dmtd_decode.json"
        mod.main(["--tiny", "--new-tokens", "8", "--prompts", "1", "--prompt-len", "9", "--error-len", "21",
                  "--out", str(out)])
    finally:
        torch.set_num_threads(n)
    res = json.loads(out.read_text())
    assert set(res["tokens_per_s"]) == set(VARIANTS) == set(res["speedup"])
    assert res["ar_tokens_per_s"] > 0 and all(v > 0 for v in res["tokens_per_s"].values())
    for name in ("ar", *VARIANTS):  # fp32 on CPU: the cache is exact
        err = res["logit_error"][name]["cached_vs_teacher_forced"]
        assert err["max_abs"] < 1e-4 and err["argmax_agree"] == 1.0
