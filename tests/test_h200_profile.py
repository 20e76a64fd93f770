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
pytestmark = pytest.mark.workspace("the project's params.yaml: the profile applies to it")


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


def test_ablation_profile_trains_each_variant_at_one_budget(tmp_path):
    """h200_smollm2_ablation on top of h200_smollm2: its five variants replace params.yaml's (reduced vocabulary,
    each Markov head type), each a valid draft config trained the same number of steps, and the five eval_offline
    targets resolve to the chain target -> ... -> draft_vocab -> train@v -> eval_offline@v, nothing else."""
    from dspark_core.draft import DraftConfig
    from dspark_core.pipeline import load_stages, plan
    from dspark_core.train.trainer import TrainConfig
    from dspark_core.variants import check_variant_dag, section_for_variant

    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    apply_profile("h200_smollm2", params)
    apply_profile("h200_smollm2_ablation", params)
    doc = yaml.safe_load(params.read_text())
    names = ["baseline", "vocab_8k", "markov_gated", "markov_rnn", "markov_none"]
    assert list(doc["variants"]) == doc["variant_dag"]["scratch"] == names and doc["variant_dag"]["warm"] == {}
    check_variant_dag(params)
    drafts = {v: DraftConfig.from_dict(section_for_variant(params, "draft", v)) for v in names}
    assert [(d.vocab_size, d.markov_head) for d in drafts.values()] == [
        (None, "vanilla"), (8192, "vanilla"), (None, "gated"), (None, "rnn"), (None, "none")]
    trains = {TrainConfig.from_dict(section_for_variant(params, "train", v)).stop_step for v in names}
    assert trains == {300}
    stages = load_stages(str(ROOT / "dvc.yaml"), params)
    order = [s.name for s in plan(stages, [f"eval_offline@{v}" for v in names])]
    assert order[:6] == ["target", "prepare", "regenerate", "cache", "engram_build", "draft_vocab"]
    assert sorted(order[6:]) == sorted([f"train@{v}" for v in names] + [f"eval_offline@{v}" for v in names])
