"""The H200 SmolLM2 profile gives valid stage params and the GPU scripts parse (tests/test_h200_prompts.py checks
its prompt snapshot)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dspark_core.cache.build import CacheConfig
from dspark_core.data.regenerate import RegenerateConfig
from dspark_core.profiles import apply_profile
from dspark_core.target import TargetConfig

ROOT = Path(__file__).resolve().parent.parent


def test_profile_gives_valid_stage_params(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    apply_profile("h200_smollm2", params)
    doc = yaml.safe_load(params.read_text())
    # the prepare section (the snapshot mix, no overlap) is tests/test_h200_prompts.py's
    assert TargetConfig.from_dict(doc["target"]).source == "smollm2_gguf"  # the packaged target
    regen = RegenerateConfig.from_dict(doc["regenerate"])
    assert regen.device == "cuda"
    # the 30 eval prompts first (seconds), so a time budget never leaves eval_offline without its held-out split
    assert regen.splits == CacheConfig.from_dict(doc["cache"]).splits == ("eval", "train")


def test_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    for name in ("h200_multi_gpu_run.sh", "gpu_tests.sh", "setup.sh"):
        subprocess.run([bash, "-n", str(ROOT / "scripts" / name)], check=True)
