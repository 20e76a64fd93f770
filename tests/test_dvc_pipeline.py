"""The DAG through DVC on the smoke profile (profiles/smoke.yaml: every kind of stage once -- a scratch-trained and
a warm-started draft, export, one DMTD variant, the report -- on the packaged SmolLM2 target, taken from the
session's converted copy), in a temporary git + DVC repo holding this project's dvc.yaml, params.yaml, stages/ and
dspark_core/; then the everyday loop of the README:

- `dvc repro` runs every stage `dspark stages list` names (the no-DVC runner reads the same dvc.yaml), and
  the report writes the headline metrics (each concurrency level's too) and the speedup-against-concurrency points
  that `dvc plots show` draws as one chart with a line per variant; a second `dvc repro` has nothing to do, nor
  `dvc status` once the bytecode caches are gone (as in a fresh clone);
- `dvc exp run -S '++variants.reranker_frozen.train.lr=5e-4'` reruns exactly that variant's train / eval_offline /
  bench_online and the report (not the draft it starts from), with the new lr in the run's config;
- `dvc metrics diff` names the changed headline file and fits a terminal; `dvc metrics show` of one concern is
  that concern's narrow table;
- the README's comparison of two revisions, the experiment and the committed run (`HEAD`, as the README allows in
  place of an experiment): `dvc exp show` restricted to the columns that matter (`--drop` / `--keep`) lists both
  with the changed param and metric, `dvc metrics diff` between them moves that variant's metrics only, and
  `dvc plots diff` between them draws both revisions' accept_rate@i and training curves on one chart each.
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

pytestmark = [pytest.mark.slow,  # the packaged model (setup.sh installs it)
              pytest.mark.workspace("the project's params.yaml: the pipeline under test")]
ROOT = Path(__file__).resolve().parent.parent
DVC = [sys.executable, "-m", "dvc"]
ABLATION = "++variants.reranker_frozen.train.lr=5e-4"
ABLATED_STAGES = ["train_warm@reranker_frozen", "eval_offline@reranker_frozen", "bench_online@reranker_frozen",
                  "report"]
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
    for folder in ("sources", "prompts_h200"):  # prepare's data dependencies (the packaged sources here)
        (repo / "data" / folder).mkdir(parents=True)
        (repo / "data" / folder / "README.md").write_text("no data files\n")
    (repo / ".gitignore").write_text("/data/\n/dvc_plots/\n")
    _run(["git", "init", "-q"], repo)
    _run(DVC + ["init", "-q"], repo)
    shutil.copy(ROOT / ".dvcignore", repo / ".dvcignore")
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")  # dvc.yaml's plot templates
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
        off = json.loads((repo / "reports/metrics/offline" / f"{v}.json").read_text())
        on = json.loads((repo / "reports/metrics/online" / f"{v}.json").read_text())
        assert set(off) == {"tau_prob", "accept_rate@0", "accept_rate@1"}, v
        assert set(on) == {"mal", "tokens_per_s", "speedup"}, v
        assert 1.0 <= off["tau_prob"] <= 7.0 and 1.0 <= on["mal"] <= 7.0
        for c in params["bench_online"]["concurrency"]:  # the levels: speedup over AR at the same concurrency
            level = json.loads((repo / "reports/metrics/concurrency" / f"{v}@c{c}.json").read_text())
            assert set(level) == {"mal", "tokens_per_s", "request_tokens_per_s", "cycle_ms", "speedup"}, (v, c)
            assert 1.0 <= level["mal"] <= 7.0 and level["speedup"] > 0
    assert set(json.loads((repo / "reports/metrics/reranker/reranker_frozen.json").read_text())) == {
        "candidate_recall", "rerank_tau_gain", "rerank_target_agreement_gain", "rerank_teacher_forced_prefix_gain"}
    for v in params["dmtd"]["variants"]:
        m = json.loads((repo / "reports/metrics/dmtd" / f"{v}.json").read_text())
        assert {"perplexity", "accuracy", "tokens_per_s", "speedup"} <= set(m), v
    assert {"bytes_per_token", "regenerate_tokens_per_s"} <= set(json.loads((repo / "reports/metrics/data.json")
                                                                             .read_text()))
    assert "| baseline |" in (repo / "reports/summary.md").read_text()
    # dvc plots: speedup against concurrency, one chart, a line (colour) per variant
    shown = json.loads(_run(DVC + ["plots", "show", "--json", "reports/plots/speedup_vs_concurrency.json"], repo))
    [chart] = shown["data"]["reports/plots/speedup_vs_concurrency.json"]
    points = chart["content"]["data"]["values"]
    levels = params["bench_online"]["concurrency"]
    assert sorted((p["variant"], p["concurrency"]) for p in points) == sorted(
        (v, c) for v in params["variants"] for c in levels)
    line = chart["content"]["layer"][0]["encoding"]
    assert line["x"]["field"] == "concurrency" and line["y"]["field"] == "speedup"
    assert line["color"]["field"] == "variant"
    for layout in ("deepspec", "speculators"):
        assert (repo / "data/export/baseline" / layout / "model.safetensors").is_file()
    assert _ran(_run(DVC + ["repro"], repo)) == []  # everything up to date
    for cache in repo.rglob("__pycache__"):  # a fresh clone has no bytecode: the lock must not depend on it
        shutil.rmtree(cache)
    assert "up to date" in _run(DVC + ["status"], repo)


def test_exp_run_reruns_only_the_ablated_variant(repo, first_repro):
    out = _run(DVC + ["exp", "run", "-n", "lr5e4", "-S", ABLATION], repo)
    assert sorted(_ran(out)) == sorted(ABLATED_STAGES)
    run_config = json.loads((repo / "data/train/reranker_frozen/run_config.json").read_text())
    assert run_config["config"]["train"]["lr"] == 5e-4
    assert json.loads((repo / "data/train/baseline/run_config.json").read_text())["config"]["train"]["lr"] == 1e-3

    diff = _run(DVC + ["metrics", "diff"], repo)
    lines = [ln for ln in diff.splitlines() if ln.strip()]
    assert lines[0].split()[:2] == ["Path", "Metric"]
    changed = {ln.split()[0] for ln in lines[1:]}
    assert "reports/metrics/offline/reranker_frozen.json" in changed
    assert all("reranker_frozen" in p for p in changed)  # untouched variants, DMTD and data do not move
    assert max(len(ln) for ln in lines) <= TERMINAL

    show = _run(DVC + ["metrics", "show", "reports/metrics/offline"], repo).splitlines()
    assert show[0].split() == ["Path", "accept_rate@0", "accept_rate@1", "tau_prob"]
    assert [ln.split()[0] for ln in show[1:]] == [f"reports/metrics/offline/{v}.json"
                                                  for v in ("baseline", "reranker_frozen")]


def test_compare_two_experiments(repo, first_repro):
    """The README's "Compare variants and ablations" on the smoke profile: the experiment lr5e4 against the
    committed run (HEAD, lr 1e-3), through the commands that compare two revisions, checked on what they print."""
    if "lr5e4" not in _run(DVC + ["exp", "list", "--name-only"], repo):  # the test above makes it
        assert sorted(_ran(_run(DVC + ["exp", "run", "-n", "lr5e4", "-S", ABLATION], repo))) == sorted(ABLATED_STAGES)

    # dvc exp show: every column dropped but the experiment, the ablated param and two of its variant's metrics
    keep = r"Experiment|.*reranker_frozen.json:(tau_prob|mal)|(variants.reranker_frozen.)?train.lr$"
    rows = list(csv.DictReader(io.StringIO(_run(DVC + ["exp", "show", "--drop", ".*", "--keep", keep, "--csv"],
                                                 repo))))
    param, tau = "variants.reranker_frozen.train.lr", "reports/metrics/offline/reranker_frozen.json:tau_prob"
    assert set(rows[0]) == {"Experiment", "train.lr", param, tau, "reports/metrics/online/reranker_frozen.json:mal"}
    exps = {r["Experiment"]: r for r in rows if r["Experiment"]}
    assert sorted(exps) == ["lr5e4"] and float(exps["lr5e4"][param]) == 5e-4
    [head] = [r for r in rows if not r["Experiment"] and not r[param]]  # the committed run: the key unset (the
    assert head[tau] and float(head[tau]) > 0  # workspace row holds lr5e4's applied params and results)
    assert head[tau] != exps["lr5e4"][tau]  # the changed metric
    assert {r["train.lr"] for r in rows} == {"0.001"}  # the other variants' lr, unchanged

    # dvc metrics diff between the two revisions, two concerns: that variant's rows only, both columns named
    diff = _run(DVC + ["metrics", "diff", "HEAD", "lr5e4", "--targets", "reports/metrics/offline",
                       "reports/metrics/online"], repo).splitlines()
    assert diff[0].split() == ["Path", "Metric", "HEAD", "lr5e4", "Change"]
    moved = {(ln.split()[0], ln.split()[1]) for ln in diff[1:] if ln.strip()}
    assert ("reports/metrics/offline/reranker_frozen.json", "tau_prob") in moved
    assert all(path.endswith("/reranker_frozen.json") for path, _ in moved)
    assert max(map(len, diff)) <= TERMINAL

    # dvc plots diff between them: one chart per plot file, both revisions' curves on it
    _run(DVC + ["plots", "diff", "HEAD", "lr5e4", "--targets", "reports/eval_offline/reranker_frozen/accept_rate.json",
                "reports/train/reranker_frozen/plots/metrics/train/loss.tsv", "-o", "dvc_plots"], repo)
    html = (repo / "dvc_plots" / "index.html").read_text()
    for target in ("reports/eval_offline/reranker_frozen/accept_rate.json",
                   "reports/train/reranker_frozen/plots/metrics/train/loss.tsv"):
        assert target in html
    for rev in ("HEAD", "lr5e4"):
        assert f'"rev": "{rev}"' in html or f'"rev":"{rev}"' in html, rev


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
