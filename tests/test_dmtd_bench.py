"""benchmarks/bench_dmtd.py runs on CPU with --tiny and writes the JSON the lead's report reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
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
                  "--split-replays", "3", "--out", str(out)])
    finally:
        torch.set_num_threads(n)
    res = json.loads(out.read_text())["shapes"]["tiny-qwen3"]
    assert set(res["tokens_per_s"]) == set(VARIANTS) == set(res["speedup"]) == set(res["speedup_vs_fastest_ar"])
    assert res["ar_tokens_per_s"] > 0 and all(v > 0 for v in res["tokens_per_s"].values())
    assert res["fastest_ar_tokens_per_s"] == max(res["ar_modes_tokens_per_s"].values())
    for v in VARIANTS:
        split = res["time_split_ms"][v]
        assert all(split[k] > 0 for k in ("p_step", "s_steps", "lm_head", "measured_cycle"))
        assert split["sum"] == pytest.approx(split["p_step"] + split["s_steps"] + split["lm_head"], rel=1e-3)
    for name in ("ar", *VARIANTS):  # fp32 on CPU: the cache is exact
        err = res["logit_error"][name]["cached_vs_teacher_forced"]
        assert err["max_abs"] < 1e-4 and err["argmax_agree"] == 1.0
