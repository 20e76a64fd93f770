"""The DAG through DVC on the smoke profile (profiles/smoke.yaml: every kind of stage once -- a scratch-trained and
a warm-started draft, export, one DMTD variant, the report -- on the packaged SmolLM2 target, taken from the
session's converted copy), in a temporary git + DVC repo holding this project's dvc.yaml, params.yaml, stages/ and
dspark_core/; then the everyday loop of the README:

- `dvc repro` runs every stage `dspark stages list` names (the no-DVC runner reads the same dvc.yaml), and
  the report writes the headline metrics; a second `dvc repro` has nothing to do, nor `dvc status` once the
  bytecode caches are gone (as in a fresh clone);
- `dvc exp run -S '++variants.reranker_frozen.train.lr=5e-4'` reruns exactly that variant's train / eval_offline /
  bench_online and the report (not the draft it starts from), with the new lr in the run's config;
- `dvc metrics diff` names the changed headline file and fits a terminal; `dvc exp show` lists the experiment
  with tau_prob and mal columns; `dvc plots diff` draws accept_rate@i and the training curves.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dspark_core.pipeline import load_stages
from dspark_core.profiles import apply_profile

pytestmark = pytest.mark.slow  # the packaged model (setup.sh installs it)
ROOT = Path(__file__).resolve().parent.parent
DVC = [sys.executable, "-m", "dvc"]
ABLATION = "++variants.reranker_frozen.train.lr=5e-4"
TERMINAL = 120  # columns


def _run(cmd: list[str], cwd: Path) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DVC_NO_ANALYTICS="1", GIT_AUTHOR_NAME="t",
               GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t", COLUMNS=str(TERMINAL),
               TQDM_DISABLE="1")
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)
    if res.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return res.stdout + res.stderr


def _ran(out: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", out)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, packaged_target):
    repo = tmp_path_factory.mktemp("pipeline")
    for name in ("dvc.yaml", "params.yaml", "stages", "dspark_core", "profiles"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, repo / name)
    apply_profile("smoke", repo / "params.yaml")
    # the target stage copies the session's converted SmolLM2 (source hf_dir) instead of converting the GGUF
    # again: the same target; the conversion itself is tests/test_target.py's
    overlay = tmp_path_factory.mktemp("overlay")
    (overlay / "converted.yaml").write_text(yaml.safe_dump(
        {"target": {"source": "hf_dir", "path": str(packaged_target), "hf_dir_link": "copy"}}))
    apply_profile("converted", repo / "params.yaml", overlay)
    (repo / ".gitignore").write_text("/data/\n/dvc_plots/\n")
    _run(["git", "init", "-q"], repo)
    _run(DVC + ["init", "-q"], repo)
    shutil.copy(ROOT / ".dvcignore", repo / ".dvcignore")
    _run(DVC + ["config", "core.analytics", "false"], repo)
    _run(["git", "add", "-A"], repo)
    _run(["git", "commit", "-qm", "smoke"], repo)
    yield repo
    shutil.rmtree(repo, ignore_errors=True)  # ~3 GB of checkpoints and DVC cache: pytest keeps 3 runs' tmp dirs


@pytest.fixture(scope="module")
def first_repro(repo) -> str:
    out = _run(DVC + ["repro"], repo)
    _run(["git", "add", "-A"], repo)
    _run(["git", "commit", "-qm", "repro"], repo)
    return out


def test_repro_runs_every_stage_and_writes_headline_metrics(repo, first_repro):
    stages = [s.name for s in load_stages(repo / "dvc.yaml", repo / "params.yaml")]
    ran = _ran(first_repro)
    # 2 variants x 3 + DMTD 1 x 2 + 7 + export@baseline: one of each kind of stage
    assert sorted(ran) == sorted(stages) and len(stages) == 16
    assert {"train@baseline", "train_warm@reranker_frozen", "export@baseline", "dmtd_eval@bidir_refresh"} <= set(ran)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for v in params["variants"]:
        m = json.loads((repo / "reports/metrics/draft" / f"{v}.json").read_text())
        assert {"tau_prob", "accept_rate@0", "mal", "tokens_per_s", "speedup"} <= set(m), v
        assert 1.0 <= m["tau_prob"] <= 7.0 and 1.0 <= m["mal"] <= 7.0
    for v in params["dmtd"]["variants"]:
        m = json.loads((repo / "reports/metrics/dmtd" / f"{v}.json").read_text())
        assert {"perplexity", "accuracy", "tokens_per_s", "speedup"} <= set(m), v
    assert {"bytes_per_token", "regenerate_tokens_per_s"} <= set(json.loads((repo / "reports/metrics/data.json")
                                                                             .read_text()))
    assert "| baseline |" in (repo / "reports/summary.md").read_text()
    for layout in ("deepspec", "speculators"):
        assert (repo / "data/export/baseline" / layout / "model.safetensors").is_file()
    assert _ran(_run(DVC + ["repro"], repo)) == []  # everything up to date
    for cache in repo.rglob("__pycache__"):  # a fresh clone has no bytecode: the lock must not depend on it
        shutil.rmtree(cache)
    assert "up to date" in _run(DVC + ["status"], repo)


def test_exp_run_reruns_only_the_ablated_variant(repo, first_repro):
    out = _run(DVC + ["exp", "run", "-n", "lr5e4", "-S", ABLATION], repo)
    assert sorted(_ran(out)) == sorted(["train_warm@reranker_frozen", "eval_offline@reranker_frozen",
                                        "bench_online@reranker_frozen", "report"])
    run_config = json.loads((repo / "data/train/reranker_frozen/run_config.json").read_text())
    assert run_config["config"]["train"]["lr"] == 5e-4
    assert json.loads((repo / "data/train/baseline/run_config.json").read_text())["config"]["train"]["lr"] == 1e-3

    diff = _run(DVC + ["metrics", "diff"], repo)
    lines = [ln for ln in diff.splitlines() if ln.strip()]
    assert lines[0].split()[:2] == ["Path", "Metric"]
    changed = {ln.split()[0] for ln in lines[1:]}
    assert "reports/metrics/draft/reranker_frozen.json" in changed
    assert not any("baseline" in p or "dmtd" in p for p in changed)  # untouched variants do not move
    assert max(len(ln) for ln in lines) <= TERMINAL

    table = list(csv.DictReader(io.StringIO(_run(DVC + ["exp", "show", "--csv"], repo))))
    assert any(row.get("Experiment") == "lr5e4" for row in table)
    assert any(k.endswith("tau_prob") for k in table[0]) and any(k.endswith(":mal") or k == "mal" for k in table[0])

    show = _run(DVC + ["metrics", "show", "reports/metrics/draft"], repo)
    assert "reranker_frozen.json" in show and "tau_prob" in show

    html = repo / "dvc_plots" / "index.html"
    _run(DVC + ["plots", "diff", "HEAD", "-o", "dvc_plots"], repo)
    text = html.read_text()
    assert "accept_rate" in text and "reports/train/reranker_frozen/plots/metrics" in text


def test_bench_batch_layout_on_the_pipeline_cache(repo, first_repro, tmp_path):
    """benchmarks/bench_batch_layout.py on the cache the pipeline wrote: every layout trains to the same loss on
    the same valid blocks; compact slots compute fewer blocks where answers are shorter than num_anchors."""
    out = tmp_path / "layout.json"
    _run([sys.executable, str(ROOT / "benchmarks" / "bench_batch_layout.py"), "--num-anchors", "64",
          "--micro-batch-size", "4", "--steps", "1", "--warmup", "1", "--out", str(out)], repo)
    rows = {r["layout"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == ["packed:compact", "packed:fixed", "padded:compact", "padded:fixed"]
    fixed = rows["padded:fixed"]
    assert fixed["blocks_computed"] == 4 * 64 > fixed["blocks_valid"] > 0  # the timed step: 4 samples x 64 anchors
    for name, row in rows.items():
        assert row["blocks_valid"] == fixed["blocks_valid"], name
        assert abs(row["loss"] - fixed["loss"]) <= 1e-5 * abs(fixed["loss"]), name
    assert rows["packed:compact"]["blocks_computed"] < rows["packed:fixed"]["blocks_computed"]
