"""The golden-curve check of the training numerics (docs/DESIGN.md, "Training numerics"): may a memory-lean mode be
offered for training? Slow: it builds the default pipeline's cache with the pipeline's own stages.

Protocol. The default pipeline's target (the packaged SmolLM2), prompts, answers and cache, made by its stages from
params.yaml as it is (the workspace's own, where `dvc repro` built them and `dvc status` finds them up to date, as
CI leaves them before the tests; else built here); the baseline draft and its train section as params.yaml has them, except the lr, seed 000's
peak 3e-4 (the pipeline's 1e-3 is a CPU demo value; small updates are where numerics differ) and ``GOLDEN_STEPS``
steps (the whole warmup + cosine schedule, down to 3e-5). Each mode trains from one seed on the same batches; its
draft is exported and measured by eval_offline on the held-out cache, as the pipeline measures drafts.

Tolerance. The default numerics (fp32 weights and AdamW state) give the golden curve. The bf16 master mode computes
the forward in bf16 like the lean mode and differs from it only in the optimiser's precision, so its distance to
the golden curve is what bf16 compute alone costs. A mode follows the golden curve when, over the last quarter of
the schedule (the smallest lr), its mean relative loss distance to the golden losses is at most 1.5x the master
mode's + 0.1%, its held-out tau_prob is within max(2x the master's distance, 0.005) of the golden one, and no step
is more than 5% away; the master mode itself must be within 1% (late loss) and 0.01 (tau_prob).

Two tiers. In CI: the default numerics against their pinned curve (``tests/golden/numerics_default.json``, written
from this module's ``golden_run`` on a 2-core AVX2 CPU, torch 2.13): the late-schedule loss within 3%, no step past
10% (the pinned data are the pipeline's regenerated answers, sampled: another CPU may draw a few other tokens), the
held-out tau_prob within 0.03. The bf16 modes (``pytest -m study``; ~17 min on 2 CPU cores without bf16 units, hence
outside the README's test command): on 2026-12-05 (CPU, torch 2.13) the master mode 0.47% / 0.0038, pure bf16
0.97% / 0.0129 (bounds 0.80% / 0.0076): pure bf16 fails, so training refuses it (``train.trainer.PURE_BF16_TRAINING``);
the study fails the day it passes, to offer it again. Both modes stayed within 2.5% of the golden loss at every step:
the evidence is the late-schedule and held-out distance, 2-3x what bf16 compute alone moves (with seed 7 instead of
42: late loss 0.33% / 0.64%, a fail again; tau_prob 0.0009 / 0.0016, within its bound).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

import dspark_core.train.trainer as trainer

pytestmark = [pytest.mark.slow,  # the packaged model; regenerate and cache stages; three training runs
              pytest.mark.workspace("the project's params.yaml: the golden curves are its default recipe's; its "
                                    "target and cache where `dvc repro` built them up to date")]
ROOT = Path(__file__).resolve().parents[1]
PINNED = Path(__file__).resolve().parent / "golden" / "numerics_default.json"
GOLDEN_STEPS = 40
GOLDEN_LR = 3e-4
MODES = {"default": ("float32", "float32"), "master": ("bfloat16", "float32"), "pure_bf16": ("bfloat16", "bfloat16")}


@contextmanager
def _inside(path: Path):
    cwd = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(cwd)


PIPELINE_STAGE = "cache"  # with the stages before it: the target, prompts, answers and cache golden_run reads


def workspace_is_built(root: Path = ROOT) -> bool:
    """Whether ``root`` holds the default pipeline's outputs up to its `cache` stage, up to date with its params.yaml
    and code: DVC's own check (`dvc status --with-deps cache` names nothing; a missing output is a change)."""
    if not (root / "dvc.lock").is_file():
        return False
    res = subprocess.run([sys.executable, "-m", "dvc", "status", "--json", "--with-deps", PIPELINE_STAGE], cwd=root,
                         env=dict(os.environ, DVC_NO_ANALYTICS="1"), capture_output=True, text=True, timeout=300)
    return res.returncode == 0 and json.loads(res.stdout or "null") == {}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, request) -> Path:
    """A project laid out as the default pipeline leaves it after its `cache` stage (params.yaml as it is): the
    workspace itself where `dvc repro` built it (golden_run only reads it), else one built here by the same
    stage functions."""
    from dspark_core.cache import CacheConfig, run_cache
    from dspark_core.data.prompts import PrepareConfig, run_prepare
    from dspark_core.data.regenerate import RegenerateConfig, run_regenerate

    if workspace_is_built():
        return ROOT
    root = tmp_path_factory.mktemp("golden")
    shutil.copy(ROOT / "params.yaml", root / "params.yaml")
    packaged_target = request.getfixturevalue("packaged_target")  # the target stage's output (session's conversion)
    shutil.copytree(packaged_target, root / "data" / "target")
    with _inside(root):
        run_prepare(PrepareConfig.load("params.yaml", "prepare"))
        run_regenerate(RegenerateConfig.load("params.yaml", "regenerate"))
        run_cache(CacheConfig.load("params.yaml", "cache"))
    return root


def golden_run(root: Path, param_dtype: str, master_dtype: str, out: Path) -> dict:
    """Train the baseline draft of ``root``'s params in one mode's numerics; its per-step losses and the
    held-out tau_prob of its exported draft."""
    from dspark_core.cache.dataset import CacheDataset
    from dspark_core.checkpoint import load_draft
    from dspark_core.draft.eval_offline import EvalOfflineConfig, evaluate_offline
    from dspark_core.draft.stage import variant_configs
    from dspark_core.draft.task import DSparkTask
    from dspark_core.frozen_target import load_frozen_target
    from dspark_core.target import read_fingerprint

    with _inside(root):
        draft_cfg, loss_cfg, train_cfg = variant_configs(Path("params.yaml"), "baseline")
        cfg = train_cfg.replace(param_dtype=param_dtype, master_dtype=master_dtype, lr=GOLDEN_LR,
                                total_steps=GOLDEN_STEPS, max_steps=GOLDEN_STEPS, out_dir=str(out))
        task = DSparkTask.from_paths(draft_cfg, loss_cfg, "data/target", "data/cache/train.zarr")
        result = trainer.train(task, cfg, progress=False, checkpoints=False)
        draft_dir = task.export(result.model, out / "final")
        target, pad_id = load_frozen_target("data/target")
        draft = load_draft(draft_dir, target, expected_fingerprint=read_fingerprint("data/target")["fingerprint"])
        data = CacheDataset("data/cache/eval.zarr", expected_layer_ids=draft.aux_layer_ids)
        metrics = evaluate_offline(draft, data, EvalOfflineConfig.load("params.yaml", "eval_offline"),
                                   pad_id=pad_id or 0, progress=False)
    return {"loss": [row["loss"] for row in result.history], "tau_prob": metrics["tau_prob"]}


@pytest.fixture(scope="module")
def default_curve(pipeline, tmp_path_factory) -> dict:
    return golden_run(pipeline, *MODES["default"], tmp_path_factory.mktemp("golden_default"))


@pytest.fixture(scope="module")
def curves(pipeline, default_curve, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("golden_runs")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(trainer, "PURE_BF16_TRAINING", True)  # the lean mode runs here to be judged
        return {"default": default_curve, **{mode: golden_run(pipeline, *dtypes, out / mode)
                                             for mode, dtypes in MODES.items() if mode != "default"}}


def distances(run: dict, golden: dict) -> dict[str, float]:
    """A run's distance to the golden one: mean relative loss distance over the last quarter of the schedule,
    the largest over every step, and the held-out tau_prob's absolute difference."""
    rel = [abs(a - b) / b for a, b in zip(run["loss"], golden["loss"], strict=True)]
    late = rel[-(len(rel) // 4):]
    return {"late_loss": sum(late) / len(late), "max_loss": max(rel),
            "tau_prob": abs(run["tau_prob"] - golden["tau_prob"])}


def golden_check(run: dict, golden: dict, master: dict) -> list[str]:
    """What keeps ``run`` from following the golden curve (the module's tolerance; empty: it follows)."""
    d, m = distances(run, golden), distances(master, golden)
    bounds = {"late_loss": 1.5 * m["late_loss"] + 1e-3, "max_loss": 0.05, "tau_prob": max(2 * m["tau_prob"], 5e-3)}
    return [f"{k} {d[k]:.4g} > {bounds[k]:.4g}" for k in bounds if d[k] > bounds[k]]


def test_default_numerics_follow_their_pinned_curve(default_curve):
    """The default numerics trained the whole schedule, learned, and follow the pinned golden curve."""
    pinned = json.loads(PINNED.read_text())
    assert (pinned["steps"], pinned["lr"]) == (GOLDEN_STEPS, GOLDEN_LR)
    assert len(default_curve["loss"]) == GOLDEN_STEPS
    assert default_curve["loss"][-1] < 0.5 * default_curve["loss"][0] and default_curve["tau_prob"] > 1.0
    d = distances(default_curve, pinned)
    assert d["late_loss"] <= 0.03 and d["max_loss"] <= 0.10 and d["tau_prob"] <= 0.03, d


@pytest.mark.study
def test_golden_runs_trained(curves):
    """Every mode ran the whole schedule from the same first step and learned (a check that compares curves of
    runs that did not train would pass for nothing)."""
    first = {mode: c["loss"][0] for mode, c in curves.items()}
    for mode, c in curves.items():
        assert len(c["loss"]) == GOLDEN_STEPS, mode
        assert c["loss"][-1] < 0.5 * c["loss"][0], mode
        assert c["tau_prob"] > 1.0, mode
    assert max(first.values()) - min(first.values()) < 0.01 * first["default"]  # one starting point


@pytest.mark.study
def test_master_weights_follow_the_golden_curve(curves):
    golden, master = curves["default"], curves["master"]
    d = distances(master, golden)
    assert d["late_loss"] <= 0.01 and d["tau_prob"] <= 0.01 and d["max_loss"] <= 0.05, d


@pytest.mark.study
def test_pure_bf16_fails_the_golden_curve_and_training_refuses_it(curves):
    """Pure bf16 is judged by the same check; it fails it, so TrainConfig refuses it naming master_dtype float32.
    Should it pass one day, this fails: set ``PURE_BF16_TRAINING = True`` and offer it."""
    from dspark_core.config import ParamsError
    from dspark_core.train.trainer import TrainConfig

    failures = golden_check(curves["pure_bf16"], curves["default"], curves["master"])
    assert golden_check(curves["master"], curves["default"], curves["master"]) == []
    assert failures, (f"pure bf16 now follows the golden curve ({distances(curves['pure_bf16'], curves['default'])})"
                      ": set train.trainer.PURE_BF16_TRAINING = True to offer it for training")
    assert not trainer.PURE_BF16_TRAINING
    with pytest.raises(ParamsError, match=r"train.param_dtype: bfloat16 with master_dtype: bfloat16 is pure-bf16 "
                                          r"training .*set master_dtype: float32"):
        TrainConfig.from_dict({"param_dtype": "bfloat16", "master_dtype": "bfloat16"}, src="params.yaml",
                              prefix="train.")


def test_the_workspace_serves_only_when_dvc_finds_it_up_to_date(tmp_path):
    """workspace_is_built: no dvc.lock, a missing or a changed output of the `cache` stage or of a stage before it:
    the golden fixture builds its own; after `dvc repro`, untouched: the workspace's."""
    assert not workspace_is_built(tmp_path)
    (tmp_path / "dvc.yaml").write_text("stages:\n  prepare:\n    cmd: echo a > a.txt\n    outs: [a.txt]\n"
                                       "  cache:\n    cmd: cp a.txt b.txt\n    deps: [a.txt]\n    outs: [b.txt]\n")
    dvc = [sys.executable, "-m", "dvc"]
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    subprocess.run(dvc + ["init", "-q", "--no-scm"], cwd=tmp_path, env=env, check=True)
    subprocess.run(dvc + ["repro", "-q"], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert workspace_is_built(tmp_path)
    (tmp_path / "a.txt").write_text("changed\n")  # an upstream stage's output
    assert not workspace_is_built(tmp_path)
    subprocess.run(dvc + ["repro", "-q"], cwd=tmp_path, env=env, check=True, capture_output=True)
    (tmp_path / "b.txt").unlink()
    assert not workspace_is_built(tmp_path)
