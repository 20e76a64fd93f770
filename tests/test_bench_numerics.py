"""benchmarks/bench_numerics.py: the arms' settings are checked before anything runs, the params each arm trains
on are the file's plus the profile, the overrides and the step count, and a later call keeps the finished arms."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_numerics as bn  # noqa: E402


def test_an_arm_sets_only_what_train_and_eval_read():
    assert bn.parse_arm("default:") == ("default", {})
    assert bn.parse_arm("fast:train.attention_kernel=flash,train.lr=2e-3") == (
        "fast", {"train.attention_kernel": "flash", "train.lr": 0.002})  # 2e-3 a number, as DVC's -S reads it
    assert bn.parse_arm("k:train.attention_kernel=inf,train.resume=nan") == (
        "k", {"train.attention_kernel": "inf", "train.resume": "nan"})  # words stay words
    with pytest.raises(SystemExit, match=r"--arm x: cache.dtype would change the data every arm shares"):
        bn.parse_arm("x:cache.dtype=float32")
    with pytest.raises(SystemExit, match=r"write NAME:KEY=VALUE"):
        bn.parse_arm("train.lr=1")
    with pytest.raises(SystemExit, match=r"--set 'train.lr': write KEY=VALUE"):
        bn.parse_sets(["train.lr"])


@pytest.mark.workspace("the arms' params are built from params.yaml and a profile: that is what is checked")
def test_params_are_the_file_the_profile_the_overrides_and_the_steps():
    params = bn.build_params(ROOT / "params.yaml", "h200_smollm2", bn.parse_sets(["regenerate.time_budget_s=30"]),
                             1000)
    assert params["regenerate"]["time_budget_s"] == 30  # the override over the profile's 400
    assert params["regenerate"]["device"] == "cuda"  # the profile over params.yaml
    train = params["train"]
    assert (train["max_steps"], train["total_steps"], train["lr_schedule"], train["time_budget_s"]) == (
        1000, 1000, "steps", None)  # every arm the same number of steps on the same schedule, never a time cap
    with pytest.raises(SystemExit, match=r"--set: train.nonsense: params.yaml has no such key"):
        bn.build_params(ROOT / "params.yaml", None, {"train.nonsense": 1}, 10)
    with pytest.raises(SystemExit, match=r"--set: nosection.x: params.yaml has no section nosection"):
        bn.build_params(ROOT / "params.yaml", None, {"nosection.x": 1}, 10)


def test_a_later_call_keeps_the_arms_that_finished(tmp_path):
    workdir = tmp_path / "wd"
    (workdir / "arms" / "default" / bn.EVAL_JSON).parent.mkdir(parents=True)
    (workdir / "arms" / "default" / bn.EVAL_JSON).write_text("{}")
    (workdir / "arms" / "flash").mkdir()  # started, never finished
    out = tmp_path / "n.json"
    args = SimpleNamespace(out=out, steps=1000, profile="h200_smollm2", set=["train.hidden_states=online"])
    row = {"arm": "default", "sets": {}, "held_out": {"tau_prob": 2.0}}
    gone = {"arm": "flash", "sets": {"train.attention_kernel": "flash"}, "held_out": {}}  # no held-out metrics
    out.write_text(json.dumps({"workdir": str(workdir), "steps": 1000, "profile": "h200_smollm2",
                               "set": {"train.hidden_states": "online"}, "arms": [row, gone]}))
    assert bn.finished_arms(args, workdir) == {("default", "{}"): row}
    for changed in ({"steps": 500}, {"profile": None}, {"set": []}):  # other settings: nothing is kept
        assert bn.finished_arms(SimpleNamespace(**{**vars(args), **changed}), workdir) == {}
    assert bn.finished_arms(args, tmp_path / "elsewhere") == {}


def test_differences_are_against_the_first_arm():
    rows = [{"held_out": {"tau_prob": 2.5}, "train_loss_last": 1.0},
            {"held_out": {"tau_prob": 2.4}, "train_loss_last": 1.25},
            {"held_out": {"tau_prob": None}, "train_loss_last": None}]
    bn.add_differences(rows)
    assert rows[1]["tau_prob_minus_first"] == pytest.approx(-0.1) and rows[1]["train_loss_last_minus_first"] == 0.25
    assert rows[2]["tau_prob_minus_first"] is None and rows[2]["train_loss_last_minus_first"] is None
