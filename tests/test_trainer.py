"""The shared trainer: global loss normalisation, accumulation, bit-identical resume, 2-process DDP (gloo)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from dspark_core.checkpoint import read_train_state
from dspark_core.config import ParamsError
from dspark_core.train.task import TermSpec
from dspark_core.train.trainer import TrainConfig, lr_factor, lr_factor_by_time, sample_indices, train


class ToyTask:
    """Masked linear regression whose per-sample weight count varies, so normalisation matters."""

    name = "toy"
    terms = {"mse": TermSpec(1.0, "w"), "l1": TermSpec(0.5, "w")}
    metric_denominators = {"hits": "w"}

    def __init__(self, n: int = 40, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, 5, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(5, 3, generator=g)) + 0.05 * torch.randn(n, 6, 3, generator=g)
        self.m = (torch.rand(n, 6, generator=g) < torch.linspace(0.2, 1.0, n)[:, None]).float()

    def build_model(self, device, dtype):
        torch.manual_seed(123)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(device, dtype)

    def train_dataset(self):
        return [(self.x[i], self.y[i], self.m[i]) for i in range(len(self.x))]

    def collate(self, items, generators):
        x, y, m = (torch.stack(t) for t in zip(*items))
        noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in generators]) * 0.01
        return {"x": x + noise, "y": y, "m": m}

    def denominators(self, batch):
        return {"w": batch["m"].sum()}

    def forward_sums(self, model, batch):
        err = model(batch["x"]) - batch["y"]  # [B, 6, 3]
        m = batch["m"]
        return {"mse": (err.pow(2).mean(-1) * m).sum(), "l1": (err.abs().mean(-1) * m).sum(),
                "hits": ((err.abs().max(-1).values < 0.5).float() * m).sum()}


def _cfg(tmp: Path, **kw) -> TrainConfig:
    base = dict(lr=1e-2, warmup_ratio=0.1, total_steps=8, micro_batch_size=2, global_batch_size=8,
                checkpoint_every=3, log_every=1, out_dir=str(tmp), seed=7)
    base.update(kw)
    return TrainConfig.from_dict(base)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_loss_decreases(tmp_path):
    res = train(ToyTask(), _cfg(tmp_path, total_steps=60, checkpoint_every=100, lr=3e-2), progress=False)
    first, last = res.history[0]["loss"], res.history[-1]["loss"]
    assert last < 0.7 * first
    assert "hits" in res.history[-1] and 0 <= res.history[-1]["hits"] <= 1


def test_accumulation_equals_one_big_batch(tmp_path):
    # per-item generators: the collate noise is the same however the global batch is split
    a = train(ToyTask(), _cfg(tmp_path / "a", micro_batch_size=2), progress=False)
    b = train(ToyTask(), _cfg(tmp_path / "b", micro_batch_size=8), progress=False)
    for (k, va), vb in zip(_params(a.model).items(), _params(b.model).values()):
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6, msg=k)


class LengthTask(ToyTask):
    """ToyTask whose dataset knows each sample's length (here its weight count), as CacheDataset does."""

    def train_dataset(self):
        data = _Sized(super().train_dataset())
        data.lengths = self.m.sum(1).long().numpy()
        return data


class _Sized(list):
    lengths = None


def test_group_by_length_fills_micro_batches_by_length_and_keeps_the_step(tmp_path):
    """``group_by_length``: a step's micro-batches hold samples of rising length, each item keeps its slot's
    generator, and the trained weights are those of the ungrouped run (and of one big batch)."""
    from dspark_core.dist import Dist
    from dspark_core.train.trainer import StepBatches

    task, cfg = LengthTask(), _cfg(tmp_path / "s", micro_batch_size=2)
    micro = StepBatches(task, cfg, Dist(), 0, 1)[0]
    lengths = [b["m"].sum(1).tolist() for b in micro]  # [accum][2]
    flat = [n for pair in lengths for n in pair]
    assert flat == sorted(flat) and len(set(flat)) > 1
    plain = StepBatches(task, cfg.replace(group_by_length=False), Dist(), 0, 1)[0]
    plain_flat = [n for b in plain for n in b["m"].sum(1).tolist()]
    assert sorted(plain_flat) == flat and plain_flat != flat  # the same samples, regrouped
    runs = {name: train(LengthTask(), _cfg(tmp_path / name, **kw), progress=False)
            for name, kw in (("grouped", dict(micro_batch_size=2)),
                             ("plain", dict(micro_batch_size=2, group_by_length=False)),
                             ("one", dict(micro_batch_size=8)))}
    ref = _params(runs["plain"].model)
    for name in ("grouped", "one"):
        for (k, va), vb in zip(_params(runs[name].model).items(), ref.values()):
            torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")


def test_resume_is_bit_identical(tmp_path):
    full = train(ToyTask(), _cfg(tmp_path / "full"), progress=False)
    part_cfg = _cfg(tmp_path / "part", max_steps=5)   # checkpoints at 3 and 5
    train(ToyTask(), part_cfg, progress=False)
    # simulate a crash after step 3: drop the step-5 checkpoint and point latest at step 3
    ck = tmp_path / "part" / "checkpoints"
    import json
    import shutil
    shutil.rmtree(ck / "step_00000005")
    (ck / "latest.json").write_text(json.dumps({"step": 3, "dir": "step_00000003"}))
    resumed = train(ToyTask(), _cfg(tmp_path / "part"), progress=False)
    assert len(resumed.history) == 5  # steps 3..7 only
    for (k, va), vb in zip(_params(full.model).items(), _params(resumed.model).values()):
        assert torch.equal(va, vb), k
    assert [h["loss"] for h in full.history[3:]] == [h["loss"] for h in resumed.history]


def test_a_checkpoint_of_the_older_state_pt_layout_resumes_bit_identically(tmp_path):
    """A run stopped at step 3 whose checkpoint is in the older layout (the state pickled as state.pt, the RNG states
    as Python / numpy objects) resumes, read with weights_only, to the uninterrupted run's weights and losses."""
    import json

    import numpy as np

    from dspark_core.checkpoint import write_manifest

    full = train(ToyTask(), _cfg(tmp_path / "full"), progress=False)
    train(ToyTask(), _cfg(tmp_path / "part", max_steps=3), progress=False)
    step = tmp_path / "part" / "checkpoints" / "step_00000003"
    state = read_train_state(step)
    py, npy = state["rng"]["python"], state["rng"]["numpy"]
    state["rng"]["python"] = (py["version"], tuple(py["state"]), py["gauss_next"])
    state["rng"]["numpy"] = (npy["kind"], np.asarray(npy["key"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                             npy["cached_gaussian"])
    for name in ("state.json", "state.safetensors"):
        (step / name).unlink()
    torch.save(state, step / "state.pt")
    write_manifest(step, ["model.safetensors", "state.pt"])
    assert json.loads((step.parent / "latest.json").read_text())["step"] == 3
    resumed = train(ToyTask(), _cfg(tmp_path / "part"), progress=False)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history[3:]]
    for (k, a), b in zip(_params(full.model).items(), _params(resumed.model).values()):
        assert torch.equal(a, b), k


def test_the_same_run_writes_the_same_checkpoint_bytes(tmp_path):
    """Two runs of the same config write byte-identical checkpoints (the RNG states they hold are seeded), so a
    DVC stage that reruns leaves its output, and every stage after it, unchanged."""
    import random

    import numpy as np

    for name in ("a", "b"):
        random.random(), np.random.rand()  # what ran before (another process' history) moves the global RNGs
        train(ToyTask(), _cfg(tmp_path / name, max_steps=5), progress=False)
    for step in ("step_00000003", "step_00000005"):
        for f in ("model.safetensors", "state.safetensors", "state.json", "manifest.json"):
            a = (tmp_path / "a" / "checkpoints" / step / f).read_bytes()
            assert a == (tmp_path / "b" / "checkpoints" / step / f).read_bytes(), (step, f)


def test_time_budget_stops_with_a_checkpoint_and_resumes(tmp_path):
    full = train(ToyTask(), _cfg(tmp_path / "full"), progress=False)
    cut = train(ToyTask(), _cfg(tmp_path / "cut"), progress=False, time_budget_s=1e-9)  # out of time at step 1
    assert cut.steps == 1 and len(cut.history) == 1
    assert (tmp_path / "cut" / "checkpoints" / "step_00000001").is_dir()
    rest = train(ToyTask(), _cfg(tmp_path / "cut"), progress=False)  # resumes at step 1
    assert rest.steps == 8 and len(rest.history) == 7
    for (k, va), vb in zip(_params(full.model).items(), _params(rest.model).values()):
        assert torch.equal(va, vb), k
    with pytest.raises(ValueError, match="time budget"):
        train(ToyTask(), _cfg(tmp_path / "bad"), progress=False, time_budget_s=0)


def test_finished_schedule_keeps_weights_not_optimizer_state(tmp_path):
    """The step that ends the lr schedule is saved without AdamW state (2x the weights, of no use to a finished
    run); a rerun restores it and trains nothing; a stop before the end (max_steps) keeps the state."""
    full = train(ToyTask(), _cfg(tmp_path / "full"), progress=False)
    ck = tmp_path / "full" / "checkpoints"
    last = ck / "step_00000008"
    assert "optimizer" not in read_train_state(last)
    again = train(ToyTask(), _cfg(tmp_path / "full"), progress=False)
    assert again.history == []
    for (k, va), vb in zip(_params(full.model).items(), _params(again.model).values()):
        assert torch.equal(va, vb), k
    train(ToyTask(), _cfg(tmp_path / "part", max_steps=5), progress=False)
    assert "optimizer" in read_train_state(tmp_path / "part" / "checkpoints" / "step_00000005")
    with pytest.raises(ValueError, match=r"step_00000008: saved at the end of a 8-step schedule.*total_steps=12"):
        train(ToyTask(), _cfg(tmp_path / "full", total_steps=12), progress=False)


def test_without_checkpoints_nothing_is_written_or_resumed(tmp_path):
    """checkpoints=False (the benchmarks): the same run, no checkpoint on disk, a second call starts at step 0."""
    ref = train(ToyTask(), _cfg(tmp_path / "ref"), progress=False)
    a = train(ToyTask(), _cfg(tmp_path / "none"), progress=False, checkpoints=False)
    assert not (tmp_path / "none" / "checkpoints").exists()
    b = train(ToyTask(), _cfg(tmp_path / "none"), progress=False, checkpoints=False)
    assert a.steps == b.steps == ref.steps and len(b.history) == ref.steps
    for (k, va), vb in zip(_params(ref.model).items(), _params(b.model).values()):
        assert torch.equal(va, vb), k


def test_data_workers_give_the_same_run(tmp_path):
    inline = train(ToyTask(), _cfg(tmp_path / "a", micro_batch_size=4), progress=False)
    workers = train(ToyTask(), _cfg(tmp_path / "b", micro_batch_size=4, data_workers=2), progress=False)
    assert [h["loss"] for h in inline.history] == [h["loss"] for h in workers.history]
    for (k, va), vb in zip(_params(inline.model).items(), _params(workers.model).values()):
        assert torch.equal(va, vb), k
    cut = train(ToyTask(), _cfg(tmp_path / "c", data_workers=2), progress=False, time_budget_s=1e-9)
    assert cut.steps == 1  # leaving steps unread stops the workers cleanly


def test_run_training_without_dvclive(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from dspark_core.train.run import run_training

    monkeypatch.setitem(sys.modules, "dvclive", None)  # `import dvclive` raises ImportError
    cfg = _cfg(tmp_path / "out", log_every=2)
    res = run_training(ToyTask(), cfg, {"x": 1}, tmp_path / "report", time_budget_s=None)
    assert res.steps == 8
    assert "dvclive is not installed" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["step"] == 8 and metrics["train"]["loss"] == pytest.approx(res.history[-1]["loss"])
    rows = (tmp_path / "report" / "plots" / "metrics" / "train" / "loss.tsv").read_text().splitlines()
    assert rows[0] == "step\tloss" and [int(r.split("\t")[0]) for r in rows[1:]] == [2, 4, 6, 8]


class KilledTask(ToyTask):
    """Killed during the forward of micro-batch ``at`` (counted from 1): as a crash or a preempted job."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def forward_sums(self, model, batch):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return super().forward_sums(model, batch)


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """A copy of dspark_core's sources that ``code_fingerprint`` hashes (a test edits it); dvclive left out."""
    import shutil
    import sys

    from dspark_core.train import run

    monkeypatch.setitem(sys.modules, "dvclive", None)
    pkg = tmp_path / "dspark_core"
    shutil.copytree(run.PACKAGE_ROOT, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(run, "PACKAGE_ROOT", pkg)
    return pkg


def _killed_at_step_5(tmp_path, **kw):
    """A run of _cfg (checkpoints at steps 3 and 6) killed during step 5: its last checkpoint is step 3's."""
    from dspark_core.train.run import run_training

    cfg = _cfg(tmp_path / "out", **kw)
    with pytest.raises(KeyboardInterrupt):  # 4 micro-batches a step: call 17 is step 5's first
        run_training(KilledTask(at=17), cfg, {"train": cfg.identity_dict()}, tmp_path / "report")
    assert json.loads((tmp_path / "out" / "checkpoints" / "latest.json").read_text())["step"] == 3
    return cfg


def test_a_code_edit_resumes_from_the_last_checkpoint(tmp_path, package_copy, capsys):
    """A run killed after its step-3 checkpoint, then a one-line edit of a package file: the rerun resumes at step
    3 with one line saying the code changed since step 3, ends with the weights of a run never stopped, and
    run_config.json lists the change. Unchanged code resumes without the line."""
    from dspark_core.train import run

    full = run.run_training(ToyTask(), _cfg(tmp_path / "full"), {"x": 1}, tmp_path / "full_report")
    cfg = _killed_at_step_5(tmp_path)
    before = run.code_fingerprint()
    with (package_copy / "metrics.py").open("a") as fh:
        fh.write("# a one-line fix\n")
    assert run.code_fingerprint() != before
    capsys.readouterr()
    resumed = run.run_training(ToyTask(), cfg, {"train": cfg.identity_dict()}, tmp_path / "report")
    out = capsys.readouterr().out
    assert f"{tmp_path / 'out'}: the code changed since step 3; resuming from step 3's checkpoint" in out
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history[3:]]
    for (k, a), b in zip(_params(full.model).items(), _params(resumed.model).values()):
        assert torch.equal(a, b), k
    record = json.loads((tmp_path / "out" / "run_config.json").read_text())
    assert record["code"] == run.code_fingerprint() and "code_changes" not in record
    assert json.loads(run.code_changes_path(tmp_path / "out").read_text()) == [
        {"step": 3, "from": before, "to": run.code_fingerprint()}]
    fresh = run.run_training(ToyTask(), _cfg(tmp_path / "fresh"), {"train": cfg.identity_dict()}, tmp_path / "r2")
    assert fresh.history  # the same configuration under this code from scratch: the same run_config.json bytes
    assert (tmp_path / "fresh" / "run_config.json").read_bytes() == (tmp_path / "out" / "run_config.json").read_bytes()
    again = run.run_training(ToyTask(), cfg, {"train": cfg.identity_dict()}, tmp_path / "report")
    assert again.history == [] and "code changed" not in capsys.readouterr().out  # finished, same code
    with (package_copy / "metrics.py").open("a") as fh:
        fh.write("# another\n")
    run.run_training(ToyTask(), cfg, {"train": cfg.identity_dict()}, tmp_path / "report")
    assert "the run is complete at step 8, so nothing is trained" in capsys.readouterr().out


def test_strict_resume_refuses_a_code_edit(tmp_path, package_copy):
    """train.resume: strict refuses to resume checkpoints that other code wrote, in one line naming the two ways on,
    and changes nothing on disk."""
    from dspark_core.errors import UserError
    from dspark_core.train.run import run_training

    cfg = _killed_at_step_5(tmp_path, resume="strict")
    files = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file() and "dspark_core" not in p.parts}
    with (package_copy / "metrics.py").open("a") as fh:
        fh.write("# a one-line fix\n")
    with pytest.raises(UserError, match=r"out: the code \(dspark_core\) changed since step 3, and resume is strict "
                                        r".*set resume: continue to resume from step 3 .*or move .* aside"):
        run_training(ToyTask(), cfg, {"train": cfg.identity_dict()}, tmp_path / "report")
    assert {p: p.read_bytes() for p in files} == files
    assert TrainConfig.from_dict({"resume": "strict"}).identity_dict() == TrainConfig().identity_dict()
    with pytest.raises(ParamsError, match="resume must be one of continue, strict"):
        TrainConfig.from_dict({"resume": "restart"})


def test_a_params_change_moves_the_older_run_aside(tmp_path, monkeypatch, capsys):
    """train.lr changed: the older output (checkpoints, run_config.json, and a copy of its curves) moves to
    out's parent's .previous/ folder, git-ignored, named in one line with the changed key; the new run starts at
    step 0. The old checkpoints are there, byte for byte."""
    import sys

    from dspark_core.train.run import run_training

    monkeypatch.setitem(sys.modules, "dvclive", None)
    cfg = _cfg(tmp_path / "out")
    run_training(ToyTask(), cfg, {"train": cfg.identity_dict()}, tmp_path / "report")
    old = {p.relative_to(tmp_path / "out"): p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    curves = (tmp_path / "report" / "plots" / "metrics" / "train" / "loss.tsv").read_text()
    capsys.readouterr()
    new_cfg = _cfg(tmp_path / "out", lr=2e-2)
    res = run_training(ToyTask(), new_cfg, {"train": new_cfg.identity_dict()}, tmp_path / "report")
    assert len(res.history) == 8
    (moved,) = [p for p in (tmp_path / ".previous").iterdir() if p.is_dir()]
    assert moved.name.startswith("out-") and moved.name.endswith("-step8")
    line = capsys.readouterr().out
    assert f"{tmp_path / 'out'}: train.lr changed since the last run; its output (checkpoints up to step 8) moved " \
           f"to {moved}, where nothing deletes it" in line
    assert {p: moved.joinpath(p).read_bytes() for p in old} == old
    assert (moved / "report" / "plots" / "metrics" / "train" / "loss.tsv").read_text() == curves
    assert (tmp_path / ".previous" / ".gitignore").read_text() == "*\n"
    assert json.loads((tmp_path / "out" / "run_config.json").read_text())["config"]["train"]["lr"] == 2e-2


def test_an_older_run_config_keeps_its_checkpoints(tmp_path, capsys, monkeypatch):
    """A run_config.json written with the code inside the configuration (an older layout) resumes as one of
    the current layout: the same configuration and code resume silently, other code resumes saying so."""
    from dspark_core.io import sha256_json, write_json
    from dspark_core.train.run import _prepare_out_dir

    out = tmp_path / "out"
    config = {"x": 1, "code": "c0"}
    write_json(out / "run_config.json", {"hash": sha256_json(config), "config": config})
    write_json(out / "checkpoints" / "latest.json", {"step": 3, "dir": "step_00000003"})
    monkeypatch.setattr("dspark_core.train.run.verify_latest_checkpoint", lambda root: None)  # no step folder here
    assert _prepare_out_dir(out, {"x": 1}, "c0") and capsys.readouterr().out == ""
    assert _prepare_out_dir(out, {"x": 1}, "c1") and "the code changed since step 3" in capsys.readouterr().out
    assert not [p for p in (tmp_path / ".previous").iterdir() if p.is_dir()]  # nothing moved aside (a log only)


class NeedsTargetTask(ToyTask):
    """A task whose model build refuses its setting (as the draft's does for a vocabulary the target lacks)."""

    def build_model(self, device, dtype):
        from dspark_core.errors import UserError

        raise UserError("draft.vocab_size 999999 must be in [1, 272] (the target's vocabulary)")


def test_a_bad_setting_found_at_the_model_build_leaves_the_older_run_alone(tmp_path, monkeypatch):
    """A changed configuration starts over, but only once the new run is built: a setting refused by the model
    build or by the batch arithmetic fails before the older run's checkpoints and curves are moved aside."""
    import sys

    from dspark_core.errors import UserError
    from dspark_core.train.run import run_training

    monkeypatch.setitem(sys.modules, "dvclive", None)
    cfg = _cfg(tmp_path / "out")
    run_training(ToyTask(), cfg, {"x": 1}, tmp_path / "report")
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(UserError, match="vocab_size"):
        run_training(NeedsTargetTask(), cfg, {"x": 2}, tmp_path / "report")
    with pytest.raises(ValueError, match="global_batch_size"):
        run_training(ToyTask(), _cfg(tmp_path / "out", global_batch_size=3), {"x": 3}, tmp_path / "report")
    after = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert after == before and (tmp_path / "out" / "checkpoints" / "latest.json").is_file()


class PoisonedTask(ToyTask):
    """Its third step's inputs hold a NaN (as a poisoned sample or an exploding update would make the loss)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward_sums(self, model, batch):
        self.calls += 1
        if self.calls == 3:
            batch = {**batch, "x": batch["x"] * float("nan")}
        return super().forward_sums(model, batch)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_non_finite_step_stops_the_run_before_anything_of_it_is_saved(tmp_path, monkeypatch, deferred):
    """A NaN loss stops training with an error naming the step and what to change; the checkpoints hold only the
    finite steps before it (with reads one step late too, as on a GPU). Non-finite params are refused."""
    from dspark_core.errors import UserError
    from dspark_core.train import trainer

    monkeypatch.setattr(trainer, "DEFERRED_READS", ("cpu", "cuda") if deferred else ())
    with pytest.raises(UserError, match=r"step 3: loss nan .*not finite.*Lower lr .*\(train / dmtd_train\)"):
        train(PoisonedTask(), _cfg(tmp_path, micro_batch_size=8, checkpoint_every=2), progress=False)
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert steps == ["step_00000002"]  # deferred: step 4 was queued before step 3 was read; neither is saved
    for bad in (".inf", "-.inf", ".nan", "1e400"):
        (tmp_path / "params.yaml").write_text(f"train: {{lr: {bad}}}\n")
        with pytest.raises(ParamsError, match=r"params.yaml: train.lr must be a finite number"):
            TrainConfig.load(tmp_path / "params.yaml", "train")


def test_resumed_run_continues_its_curves_once(tmp_path, monkeypatch):
    """A run killed after logging steps 7-8 but before checkpointing step 8 resumes at step 6: the curves (a
    DVC-persisted folder) keep steps 1-6, and the resumed steps are logged once; its weights are the full run's."""
    import json
    import shutil
    import sys

    from dspark_core.train.run import run_training

    monkeypatch.setitem(sys.modules, "dvclive", None)
    cfg = _cfg(tmp_path / "out", log_every=1)
    full = run_training(ToyTask(), cfg, {"x": 1}, tmp_path / "report")
    ck = tmp_path / "out" / "checkpoints"
    shutil.rmtree(ck / "step_00000008")
    (ck / "latest.json").write_text(json.dumps({"step": 6, "dir": "step_00000006"}))
    resumed = run_training(ToyTask(), cfg, {"x": 1}, tmp_path / "report")
    assert len(resumed.history) == 2
    rows = (tmp_path / "report" / "plots" / "metrics" / "train" / "loss.tsv").read_text().splitlines()
    assert [int(r.split("\t")[0]) for r in rows[1:]] == list(range(1, 9))
    assert float(rows[-1].split("\t")[1]) == full.history[-1]["loss"]
    for (k, va), vb in zip(_params(full.model).items(), _params(resumed.model).values()):
        assert torch.equal(va, vb), k


def test_trim_curves_reads_dvclives_columns(tmp_path):
    from dspark_core.train.run import trim_curves

    path = tmp_path / "train" / "loss.tsv"
    path.parent.mkdir(parents=True)
    path.write_text("timestamp\tstep\tloss\n1\t2\t0.5\n2\t4\t0.4\n3\t6\t0.3\n")
    (tmp_path / "other.tsv").write_text("no\tstep column\n1\t2\n")
    trim_curves(tmp_path, 4)
    assert path.read_text() == "timestamp\tstep\tloss\n1\t2\t0.5\n2\t4\t0.4\n"
    assert (tmp_path / "other.tsv").read_text() == "no\tstep column\n1\t2\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["loss.tsv", "other.tsv", "train"]


def test_schedule_and_data_order():
    cfg = TrainConfig.from_dict(dict(total_steps=100, warmup_ratio=0.1, min_lr_ratio=0.1))
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(99, cfg) == pytest.approx(0.1, abs=1e-3)
    cfg2 = TrainConfig.from_dict(dict(global_batch_size=8, seed=1))
    seen = sample_indices(0, 12, cfg2) + sample_indices(1, 12, cfg2)[:4]
    assert sorted(seen) == list(range(12))  # one epoch covers each sample once


def test_bad_params_are_named():
    with pytest.raises(ParamsError, match="train.lr"):
        TrainConfig.from_dict({"lr": -1}, prefix="train.")
    with pytest.raises(ParamsError, match="max_steps"):
        TrainConfig.from_dict({"total_steps": 10, "max_steps": 20})
    with pytest.raises(ParamsError, match="not a known parameter"):
        TrainConfig.from_dict({"lrr": 1e-3})
    with pytest.raises(ParamsError, match="data_workers"):
        TrainConfig.from_dict({"data_workers": -1})
    with pytest.raises(ValueError, match="global_batch_size"):
        TrainConfig.from_dict({"global_batch_size": 6, "micro_batch_size": 4}).grad_accum(1)


# -- two processes with gloo must match one process at the same global batch ----------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, result_dir: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res = train(ToyTask(), _cfg(Path(out_dir), total_steps=4, checkpoint_every=100), progress=False)
    if rank == 0:
        torch.save({"params": _params(res.model), "loss": [h["loss"] for h in res.history]},
                   Path(result_dir) / "ddp.pt")
    import torch.distributed as dist
    dist.destroy_process_group()


def test_two_process_gloo_matches_one_process(tmp_path):
    one = train(ToyTask(), _cfg(tmp_path / "one", total_steps=4, checkpoint_every=100), progress=False)
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path / "two"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    ddp = torch.load(tmp_path / "ddp.pt")
    for (k, va), vb in zip(_params(one.model).items(), ddp["params"].values()):
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6, msg=k)
    assert ddp["loss"] == pytest.approx([h["loss"] for h in one.history], rel=1e-5)


class EmbedTask(ToyTask):
    """ToyTask whose inputs also index a table trained in its own group (own lr, sparse or dense gradients),
    as a trainable Engram table is."""

    def __init__(self, sparse: bool, table_lr: float | None):
        super().__init__()
        self.sparse, self.table_lr = sparse, table_lr

    def build_model(self, device, dtype):
        torch.manual_seed(123)
        sparse = self.sparse

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.table = nn.Embedding(50, 5, sparse=sparse)
                self.mlp = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

            def forward(self, x):
                idx = (x[..., 0].abs() * 20).long().clamp(max=49)  # [B, 6]
                return self.mlp(x + self.table(idx))

        return Net().to(device, dtype)

    def param_groups(self, model):
        return [{"params": list(model.mlp.parameters())},
                {"params": [model.table.weight], "lr": self.table_lr, "sparse": self.sparse}]


@pytest.mark.parametrize("sparse", [False, True])
def test_own_lr_group_and_sparse_table_resume_bit_identically(tmp_path, sparse):
    seen = []
    full = train(EmbedTask(sparse, 0.05), _cfg(tmp_path / "full", grad_clip=0.5), progress=False)
    init = EmbedTask(sparse, 0.05).build_model("cpu", torch.float32)
    moved = (full.model.table.weight - init.table.weight).abs().sum(-1) > 0  # [50]
    assert 0 < int(moved.sum()) < 50  # only looked-up rows move (both with sparse and dense Adam)
    part = train(EmbedTask(sparse, 0.05), _cfg(tmp_path / "part", grad_clip=0.5, max_steps=3), progress=False)
    assert len(part.history) == 3
    resumed = train(EmbedTask(sparse, 0.05), _cfg(tmp_path / "part", grad_clip=0.5), progress=False,
                    on_step=lambda s, row: seen.append(row["lr"]))
    for (k, va), vb in zip(_params(full.model).items(), _params(resumed.model).values()):
        assert torch.equal(va, vb), k
    assert [h["loss"] for h in full.history[3:]] == [h["loss"] for h in resumed.history]
    slow = train(EmbedTask(sparse, 1e-6), _cfg(tmp_path / "slow", grad_clip=0.5), progress=False)
    drift = (slow.model.table.weight - init.table.weight).abs().max()
    assert 0 < drift < 1e-4 < (full.model.table.weight - init.table.weight).abs().max()  # the group's own lr


class PreparedTask(ToyTask):
    """Supervision decided by the model before the denominators: only entries the model gets wrong by more
    than 0.7 count (a model-dependent mask, as Draft Memory's stage 1 or the reranker's hit set)."""

    calls = 0

    def prepare_step(self, model, batches):
        assert not torch.is_grad_enabled()
        PreparedTask.calls += 1
        out = []
        for b in batches:
            err = (model(b["x"]) - b["y"]).abs().max(-1).values  # [B, 6]
            out.append({**b, "m": b["m"] * (err > 0.7).float()})
        return out


def test_prepare_step_runs_before_the_denominators(tmp_path):
    PreparedTask.calls = 0
    res = train(PreparedTask(), _cfg(tmp_path / "p", micro_batch_size=4, grad_clip=0.0), progress=False)
    assert PreparedTask.calls == 8  # once per step
    task, model = PreparedTask(), PreparedTask().build_model("cpu", torch.float32)
    batches = [task.collate([task.train_dataset()[i] for i in idx], [torch.Generator().manual_seed(0)] * 4)
               for idx in ([0, 1, 2, 3], [4, 5, 6, 7])]
    with torch.no_grad():
        prepared = task.prepare_step(model, batches)
    den = sum(b["m"].sum() for b in prepared)
    assert 0 < den < sum(b["m"].sum() for b in batches)  # the mask really depends on the model
    assert len(res.history) == 8 and all(h["loss"] > 0 for h in res.history)


class _FakeClock:
    """The trainer's clock (``trainer._now``) advancing one second a call -- two calls a step (its start and end)
    and one when the loop starts, so a step lasts 2 s; ``crash_at``: raise on that call (a killed run)."""

    def __init__(self, crash_at: int | None = None, rate: float = 1.0):
        self.calls, self.crash_at, self.rate = 0, crash_at, rate

    def __call__(self) -> float:
        self.calls += 1
        if self.calls == self.crash_at:
            raise KeyboardInterrupt("killed")
        return self.rate * (self.calls - 1)


def test_time_schedule_ends_annealed_and_resumes_where_it_stopped(tmp_path, monkeypatch):
    """lr_schedule time: the warmup + cosine curve laid over the time budget, its clock started after the first
    step -- brute force against the fake clock: step k ends at 2k + 2 s, so step k + 1 runs at
    lr_factor_by_time(2k / (B - 2)). The budget stops the run with its last step below 1.1x the minimum lr; a run killed mid-way resumes from
    its checkpoint with the seconds it had spent and ends with the same weights; a rerun trains nothing."""
    from dspark_core.train import trainer

    budget = 42.0  # 21 steps of 2 s
    cfg = _cfg(tmp_path / "full", total_steps=100, checkpoint_every=5, lr_schedule="time", time_budget_s=budget)
    monkeypatch.setattr(trainer, "_now", _FakeClock())
    full = train(ToyTask(), cfg, progress=False)
    assert full.steps == 21
    want = [0.0] + [cfg.lr * lr_factor_by_time(2 * k / (budget - 2), cfg) for k in range(20)]
    assert [h["lr"] for h in full.history] == pytest.approx(want)
    assert max(want) == pytest.approx(cfg.lr, rel=0.01) and want[-1] < 1.1 * cfg.min_lr_ratio * cfg.lr
    assert "optimizer" in read_train_state(tmp_path / "full/checkpoints/step_00000021")

    killed = _cfg(tmp_path / "killed", total_steps=100, checkpoint_every=5, lr_schedule="time", time_budget_s=budget)
    monkeypatch.setattr(trainer, "_now", _FakeClock(crash_at=26))  # during step 12: the last checkpoint is 10
    with pytest.raises(KeyboardInterrupt):
        train(ToyTask(), killed, progress=False)
    monkeypatch.setattr(trainer, "_now", _FakeClock())
    rest = train(ToyTask(), killed, progress=False)
    assert rest.steps == 21 and [h["lr"] for h in rest.history] == pytest.approx(want[10:])
    for (k, va), vb in zip(_params(full.model).items(), _params(rest.model).values()):
        assert torch.equal(va, vb), k
    assert train(ToyTask(), killed, progress=False).history == []  # the budget is spent


def test_time_schedule_needs_a_budget(tmp_path):
    with pytest.raises(ParamsError, match="lr_schedule: time.*time_budget_s"):
        TrainConfig.from_dict({"lr_schedule": "time"})
    with pytest.raises(ParamsError, match="lr_schedule"):
        TrainConfig.from_dict({"lr_schedule": "cosine"})
    with pytest.raises(ValueError, match="lr_schedule: time.*time_budget_s"):  # built directly, refused by train()
        train(ToyTask(), TrainConfig(lr_schedule="time", out_dir=str(tmp_path)), progress=False)
    assert not (tmp_path / "checkpoints").exists()
    cfg = TrainConfig.from_dict({"lr_schedule": "time", "time_budget_s": 5.0, "warmup_ratio": 0.2})
    assert lr_factor_by_time(0.1, cfg) == pytest.approx(0.5)
    assert lr_factor_by_time(0.2, cfg) == pytest.approx(1.0)
    assert lr_factor_by_time(1.0, cfg) == pytest.approx(cfg.min_lr_ratio)
    assert lr_factor_by_time(3.0, cfg) == pytest.approx(cfg.min_lr_ratio)  # past the budget (the last step)


def _timed_worker(rank: int, world: int, port: int, out_dir: str, result_dir: str) -> None:
    from dspark_core.train import trainer

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    trainer._now = _FakeClock(rate=1.5 if rank == 1 else 1.0)  # rank 1's clock runs ahead
    res = train(ToyTask(), _cfg(Path(out_dir), total_steps=100, checkpoint_every=100, lr_schedule="time",
                                time_budget_s=30.0), progress=False)
    torch.save({"params": _params(res.model), "lr": [h["lr"] for h in res.history]},
               Path(result_dir) / f"timed_{rank}.pt")
    import torch.distributed as dist
    dist.destroy_process_group()


def test_time_schedule_is_the_same_on_every_rank(tmp_path, monkeypatch):
    """Two processes whose clocks disagree: the trainer takes the slowest rank's seconds (the latest clock), so
    both run the same lr and stop at the same step -- the run of one process on that clock."""
    from dspark_core.train import trainer

    monkeypatch.setattr(trainer, "_now", _FakeClock(rate=1.5))
    one = train(ToyTask(), _cfg(tmp_path / "one", total_steps=100, checkpoint_every=100, lr_schedule="time",
                                time_budget_s=30.0), progress=False)
    mp.start_processes(_timed_worker, args=(2, _free_port(), str(tmp_path / "two"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"timed_{r}.pt") for r in range(2)]
    assert ranks[0]["lr"] == ranks[1]["lr"] == pytest.approx([h["lr"] for h in one.history])
    assert len(one.history) == 10  # 3 s a step, 30 s
    for (k, va), vb in zip(_params(one.model).items(), ranks[0]["params"].values()):
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("scale", [0.01, 100.0])  # the gradients' norm below and above the clip
def test_clip_and_step_with_a_fused_adamw_matches_clip_grad_norm_then_step(scale):
    """The clip factor passed as the fused AdamW's grad_scale == clip_grad_norm_ then step (float rounding)."""
    from dspark_core.train.trainer import clip_and_step

    g = torch.Generator().manual_seed(3)
    shapes = [(40, 30), (30,), (7, 5)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) * scale for s in shapes]
    runs = []
    for ours in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        for step in range(3):
            for p, gr in zip(params, grads):
                p.grad = gr * (step + 1)
            if ours:
                norm = clip_and_step(opt, params, 1.0)
            else:
                norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
        assert "grad_scale" not in vars(opt)
        runs.append(([p.detach() for p in params], float(norm)))
    (ref, n_ref), (got, n_got) = runs
    assert n_got == pytest.approx(n_ref, rel=1e-6)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_reading_each_step_one_step_late_changes_nothing_but_the_timing(tmp_path, monkeypatch):
    """The GPU loop (a step's numbers read after the next step is queued; checkpoint and final steps at once), run
    here on the CPU: the same weights, checkpoints, logged rows in step order and callbacks as reading each step
    at once."""
    from dspark_core.train import trainer

    class Traced(ToyTask):
        def forward_sums(self, model, batch):
            events.append("queue")
            return super().forward_sums(model, batch)

    def run(out, deferred):
        monkeypatch.setattr(trainer, "DEFERRED_READS", ("cpu", "cuda") if deferred else ())
        seen = []
        res = train(Traced(), _cfg(out, total_steps=10, checkpoint_every=4, micro_batch_size=8), progress=False,
                    on_step=lambda step, row: (seen.append((step, row["loss"])), events.append(f"read {step}")))
        rows = [{k: v for k, v in r.items() if k != "step_s"} for r in res.history]
        ckpt = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
        return _params(res.model), rows, seen, ckpt, res.steps

    events: list[str] = []
    ref = run(tmp_path / "sync", False)
    assert events[:4] == ["queue", "read 1", "queue", "read 2"]
    events.clear()
    got = run(tmp_path / "late", True)
    # step 1 is read once step 2 is queued; step 4 (a checkpoint) and 10 (the last) at once
    assert events[:7] == ["queue", "queue", "read 1", "queue", "read 2", "queue", "read 3"]
    assert events[7:10] == ["read 4", "queue", "queue"] and events[-3:] == ["queue", "read 9", "read 10"]
    for (k, a), b in zip(ref[0].items(), got[0].values()):
        assert torch.equal(a, b), k
    assert got[1:] == ref[1:] and [s for s, _ in got[2]] == list(range(1, 11))
    for step in (8, 10):  # the checkpoints hold the weights of their own step
        fa = (tmp_path / "sync" / "checkpoints" / f"step_{step:08d}" / "model.safetensors").read_bytes()
        fb = (tmp_path / "late" / "checkpoints" / f"step_{step:08d}" / "model.safetensors").read_bytes()
        assert fa == fb, step


def _master_reference(task, cfg: TrainConfig, steps: int):
    """A plain fp32-master loop (DeepSpec's BF16Optimizer numerics, written out): the task's model in bf16, a
    float32 copy of each trainable weight under ``torch.optim.AdamW`` (not fused), the step's micro-batches in
    bf16 autocast with the global denominators, the bf16 gradients cast to float32, ``clip_grad_norm_``, the
    step, the masters rounded into the model. Returns (model, masters, per-step losses)."""
    from dspark_core.dist import Dist
    from dspark_core.train.trainer import StepBatches

    torch.manual_seed(cfg.seed)
    model = task.build_model(torch.device("cpu"), torch.bfloat16)
    working = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in working]
    opt = torch.optim.AdamW(masters, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    batches, losses = StepBatches(task, cfg, Dist(), 0, steps), []
    for step in range(steps):
        micro = batches[step]
        dens = {k: sum(task.denominators(b)[k].double() for b in micro) for k in ("w",)}
        total = 0.0
        for b in micro:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                sums = task.forward_sums(model, b)
                loss = sum(spec.weight * sums[name] / dens[spec.denominator].float()
                           for name, spec in task.terms.items())
            loss.backward()
            total += sum(spec.weight * float(sums[name].detach())
                         for name, spec in task.terms.items()) / float(dens["w"])
        losses.append(total)
        for m, w in zip(masters, working):
            m.grad = w.grad.float()
            w.grad = None
        torch.nn.utils.clip_grad_norm_(masters, cfg.grad_clip)
        opt.step()
        sched.step()
        with torch.no_grad():
            for m, w in zip(masters, working):
                w.copy_(m)
    return model, masters, losses


def test_master_weights_match_a_plain_fp32_master_loop(tmp_path):
    """train.param_dtype bfloat16 (master_dtype float32 by default): bf16 working weights, float32 masters and AdamW
    moments in the optimiser. Seven steps (the clip active on some) against a plain fp32-master loop: the masters to
    float32 rounding, the working weights the masters rounded (within one bf16 step of the reference's), the same
    losses; the working weights are what the forward reads (bf16 parameters, no float32 copy in the model)."""
    cfg = _cfg(tmp_path / "run", param_dtype="bfloat16", lr=3e-2, grad_clip=0.5, max_steps=7, checkpoint_every=100)
    res = train(ToyTask(), cfg, progress=False)
    assert all(p.dtype == torch.bfloat16 for p in res.model.parameters())
    ref_model, ref_masters, ref_losses = _master_reference(ToyTask(), cfg, 7)
    assert any(h["grad_norm"] > cfg.grad_clip for h in res.history)  # the clip took part
    state = read_train_state(tmp_path / "run" / "checkpoints" / "step_00000007")
    masters = state["optimizer"]["master_params"]
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in state["optimizer"]["state"].values())
    working = [p for p in res.model.parameters() if p.requires_grad]
    for m, ref_m, w, ref_w in zip(masters, ref_masters, working, ref_model.parameters()):
        torch.testing.assert_close(m, ref_m, rtol=1e-5, atol=1e-6)
        assert torch.equal(w.data, m.to(torch.bfloat16))
        torch.testing.assert_close(w.data.float(), ref_w.data.float(), rtol=2 ** -7, atol=1e-6)
    assert [h["loss"] for h in res.history] == pytest.approx(ref_losses, rel=1e-4)


def test_master_weights_resume_bit_identically(tmp_path):
    """A master-weights run stopped after step 3 and resumed ends where an uninterrupted one does: the same working
    weights, losses and float32 masters, and byte-identical checkpoint files after the resume."""
    kw = dict(param_dtype="bfloat16", lr=3e-2, max_steps=7)
    full = train(ToyTask(), _cfg(tmp_path / "full", **kw), progress=False)
    assert full.history[-1]["loss"] < full.history[0]["loss"]
    train(ToyTask(), _cfg(tmp_path / "part", **{**kw, "max_steps": 4}), progress=False)  # checkpoints 3 and 4
    ck = tmp_path / "part" / "checkpoints"
    import json
    import shutil
    shutil.rmtree(ck / "step_00000004")
    (ck / "latest.json").write_text(json.dumps({"step": 3, "dir": "step_00000003", "manifest": True}))
    resumed = train(ToyTask(), _cfg(tmp_path / "part", **kw), progress=False)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history[3:]]
    for (k, a), b in zip(_params(full.model).items(), _params(resumed.model).values()):
        assert torch.equal(a, b), k
    for step in ("step_00000006", "step_00000007"):
        for f in ("model.safetensors", "state.safetensors", "state.json"):
            a = (tmp_path / "full" / "checkpoints" / step / f).read_bytes()
            assert a == (ck / step / f).read_bytes(), (step, f)


def test_pure_bf16_loses_small_updates_that_master_weights_keep():
    """Why the masters: a weight at 1 (every RMSNorm starts there) under lr 3e-4. AdamW on the bf16 weight itself
    rounds every step back to 1 (its neighbours are 1 - 2^-8 and 1 + 2^-7); the float32 master moves 3e-4 a step
    and after ten steps its bf16 working copy has moved too."""
    from dspark_core.train.optim import MasterAdamW

    pure = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    working = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opts = [torch.optim.AdamW([pure], lr=3e-4, weight_decay=0.0), MasterAdamW([working], lr=3e-4, weight_decay=0.0)]
    for _ in range(10):
        for p, opt in zip((pure, working), opts):
            p.grad = torch.full_like(p, 0.5)
            opt.step()
            opt.zero_grad()
    master = opts[1].state_dict()["master_params"][0]
    assert torch.equal(pure.data, torch.ones(4, dtype=torch.bfloat16))  # ten updates lost
    torch.testing.assert_close(master, torch.full((4,), 1 - 10 * 3e-4), rtol=0, atol=1e-6)
    assert torch.equal(working.data, master.to(torch.bfloat16)) and bool((working.data < 1).all())


def test_master_weights_refuse_sparse_gradients(tmp_path):
    """A task whose parameter group is marked sparse (an Engram table with sparse: true) cannot train on master
    weights: one line naming the settings to change, before anything is written."""
    class SparseGroup(ToyTask):
        def param_groups(self, model):
            return [{"params": list(model.parameters()), "sparse": True}]

    with pytest.raises(ValueError, match=r"sparse gradients \(draft.engram.sparse: true\) take no master weights; "
                                         r"set draft.engram.sparse: false or train.param_dtype: float32"):
        train(SparseGroup(), _cfg(tmp_path / "run", param_dtype="bfloat16"), progress=False)
    assert not (tmp_path / "run").exists()


def test_first_step_metrics_equal_a_hand_computed_global_batch(tmp_path):
    """The logged row of a 4-micro-batch step against sums over the whole global batch, computed here by hand:
    each term's sum over its global denominator, the loss their weighted sum, a metric over its denominator."""
    from dspark_core.dist import Dist
    from dspark_core.train.trainer import StepBatches

    task, cfg = ToyTask(), _cfg(tmp_path / "run", micro_batch_size=2, total_steps=2, checkpoint_every=100)
    assert cfg.grad_accum(1) == 4
    micro = StepBatches(task, cfg, Dist(), 0, 1)[0]
    torch.manual_seed(cfg.seed)
    model = task.build_model(torch.device("cpu"), torch.float32)  # the weights the run starts from
    tot = dict(mse=0.0, l1=0.0, hits=0.0, w=0.0)
    with torch.no_grad():
        for b in micro:
            err, m = model(b["x"]) - b["y"], b["m"]
            tot["mse"] += float((err.pow(2).mean(-1) * m).sum())
            tot["l1"] += float((err.abs().mean(-1) * m).sum())
            tot["hits"] += float(((err.abs().max(-1).values < 0.5).float() * m).sum())
            tot["w"] += float(m.sum())
    row = train(task, cfg, progress=False, checkpoints=False).history[0]
    mse, l1 = tot["mse"] / tot["w"], tot["l1"] / tot["w"]
    assert row["mse"] == pytest.approx(mse, rel=1e-5) and row["l1"] == pytest.approx(l1, rel=1e-5)
    assert row["loss"] == pytest.approx(mse + 0.5 * l1, rel=1e-5)
    assert row["hits"] == pytest.approx(tot["hits"] / tot["w"], rel=1e-6)


class _Live:
    """dvclive's ``Live`` as the trainer uses it: ``step``, ``log_metric``, ``make_summary``."""

    def __init__(self):
        self.step, self.logged = 0, {}

    def log_metric(self, name: str, value: float) -> None:
        self.logged.setdefault(self.step, {})[name] = value

    def make_summary(self) -> None:
        pass


@pytest.mark.parametrize("deferred", [False, True])
def test_the_logged_step_time_is_the_mean_since_the_last_log(tmp_path, monkeypatch, deferred):
    """``train/step_s`` in the logs (metrics.json's figure) is the wall time since the previous logged step over the
    steps in between, by the trainer's clock. A row's own step_s is the time between two reads: under deferred
    reads the last step's is only its drain, which must not become the run's figure."""
    from dspark_core.train import trainer

    monkeypatch.setattr(trainer, "DEFERRED_READS", ("cpu", "cuda") if deferred else ())
    clock = _FakeClock()
    reads = []  # the clock when each step is read (the trainer calls it once a read, after the step's start)
    monkeypatch.setattr(trainer, "_now", clock)
    live = _Live()
    res = train(ToyTask(), _cfg(tmp_path / "r", total_steps=10, checkpoint_every=100, log_every=5), live=live,
                progress=False, on_step=lambda step, row: reads.append(clock.rate * (clock.calls - 1)))
    assert sorted(live.logged) == [5, 10]
    assert live.logged[5]["train/step_s"] == pytest.approx((reads[4] - 0.0) / 5)  # the loop started at clock 0
    assert live.logged[10]["train/step_s"] == pytest.approx((reads[9] - reads[4]) / 5)
    assert live.logged[10]["train/step_s"] > 0.5  # steps take clock time here, the drain or not
    if deferred:
        assert res.history[-1]["step_s"] < live.logged[10]["train/step_s"]  # the drain alone
