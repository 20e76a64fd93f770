"""`dvc repro` of the data half of the DAG (target -> prepare -> regenerate -> cache) on a tiny params profile,
in a temporary git + DVC repo holding this project's dvc.yaml and stages/. A second repro has nothing to do,
and changing one cache param reruns only the cache stage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dspark_core.testing import save_tiny_target

ROOT = Path(__file__).resolve().parent.parent
DVC = [sys.executable, "-m", "dvc"]


def _run(cmd: list[str], cwd: Path) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DVC_NO_ANALYTICS="1", GIT_AUTHOR_NAME="t",
               GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res.stdout + res.stderr


def _tiny_params(repo: Path, tiny_dir: Path) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"].update(source="hf_dir", path=str(tiny_dir))
    prompts = repo / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"question number {i}: what is {i} + {i}?"]}) + "\n"
                               for i in range(12)))
    params["prepare"].update(train_sources=[f"jsonl:{prompts}"], eval_sources=[f"jsonl:{prompts}"], n_train=6,
                             n_eval=3)
    params["regenerate"].update(backend="hf", max_new_tokens=12, batch_size=4, threads=1)
    params["cache"].update(aux_layer_ids=[0, 2, 4], max_length=64, chunk_tokens=256, batch_tokens=256)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("pipeline")
    for name in ("dvc.yaml", "stages"):
        src = ROOT / name
        shutil.copytree(src, repo / name) if src.is_dir() else shutil.copy(src, repo / name)
    shutil.copytree(ROOT / "dspark_core", repo / "dspark_core")  # dvc.yaml's code deps
    tiny = save_tiny_target(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")
    _tiny_params(repo, tiny)
    _run(["git", "init", "-q"], repo)
    _run(DVC + ["init", "-q"], repo)
    _run(DVC + ["config", "core.analytics", "false"], repo)
    return repo


def test_dvc_repro_data_stages(repo):
    out = _run(DVC + ["repro", "cache"], repo)
    for stage in ("target", "prepare", "regenerate", "cache"):
        assert f"Running stage '{stage}'" in out
    for split in ("train", "eval"):
        assert (repo / "data/cache" / f"{split}.zarr").is_dir()
        assert (repo / "data/regen" / f"{split}.parquet").is_file()
    stats = json.loads((repo / "reports/cache_stats.json").read_text())
    assert stats["num_samples"] == 9 and stats["num_tokens"] > 0
    assert 0 < stats["compression_ratio"] < 1.5
    again = _run(DVC + ["repro", "cache"], repo)
    assert "Running stage" not in again  # everything up to date

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["cache"]["aux_layer_ids"] = [1, 3]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    third = _run(DVC + ["repro", "cache"], repo)
    assert "Running stage 'cache'" in third and "Running stage 'regenerate'" not in third
    from dspark_core.cache.dataset import CacheDataset

    assert CacheDataset(repo / "data/cache/train.zarr").layer_ids == [1, 3]
    dag = _run(DVC + ["dag", "--dot"], repo)
    assert '"regenerate" -> "cache"' in dag or "regenerate" in dag
