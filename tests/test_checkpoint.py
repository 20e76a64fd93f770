"""Checkpoints are checked on load: the manifest's size + SHA-256 refuse a truncated or altered file before any
weight is read; folders saved without a manifest load with a warning."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from dspark_core.checkpoint import MANIFEST, load_checkpoint, load_draft, save_checkpoint, save_draft
from dspark_core.draft.config import DraftConfig
from dspark_core.draft.model import DSparkDraft
from dspark_core.errors import UserError
from dspark_core.testing import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen3", num_hidden_layers=4)


def _draft(target) -> DSparkDraft:
    torch.manual_seed(0)
    cfg = DraftConfig(num_draft_layers=1, block_size=4, mask_token_id=259, num_anchors=2, markov_rank=4)
    return DSparkDraft(cfg, target.config, target.get_input_embeddings().weight,
                       target.get_output_embeddings().weight, aux_layer_ids=(0, 2))


def _flip(path, at: int) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x01
    path.write_bytes(bytes(b))


def test_draft_manifest_records_each_file(tmp_path, target):
    out = save_draft(tmp_path / "d", _draft(target))
    man = json.loads((out / MANIFEST).read_text())
    assert set(man["files"]) == {"model.safetensors", "config.json"}
    assert man["files"]["model.safetensors"]["size"] == (out / "model.safetensors").stat().st_size
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_draft_is_refused_naming_the_file(tmp_path, target, damage):
    out = save_draft(tmp_path / "d", _draft(target))
    f = out / "model.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-100])
        want = r"model.safetensors: \d+ bytes, manifest.json records \d+ \(truncated or replaced\); retrain the draft"
    elif damage == "flip":
        _flip(f, f.stat().st_size - 10)  # inside a tensor: the file still parses
        want = r"model.safetensors: SHA-256 differs from the one manifest.json records \(the file is damaged\)"
    else:
        f.unlink()
        want = r"model.safetensors: missing \(listed in manifest.json\)"
    with pytest.raises(UserError, match=want) as info:
        load_draft(out, target)
    assert "`dvc checkout`" in str(info.value) and "\n" not in str(info.value)


def test_draft_without_manifest_warns_and_loads(tmp_path, target):
    """A draft saved before manifests existed loads with a warning; one saved with a manifest (its config.json
    says so) is refused without it: deleting the manifest does not switch the checks off."""
    import json

    draft = _draft(target)
    out = save_draft(tmp_path / "d", draft)
    (out / MANIFEST).unlink()
    with pytest.raises(UserError, match=r"manifest.json: missing, though the checkpoint was saved with one"):
        load_draft(out, target)
    legacy = json.loads((out / "config.json").read_text())
    del legacy["manifest"]
    (out / "config.json").write_text(json.dumps(legacy))
    with pytest.warns(UserWarning, match=r"no manifest.json .* loading it unchecked"):
        back = load_draft(out, target)
    for k, v in draft.own_state_dict().items():
        assert torch.equal(back.own_state_dict()[k], v), k
    (out / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:200])
    with warnings.catch_warnings(), pytest.raises(UserError, match=r"model.safetensors: cannot be read as safetensors"):
        warnings.simplefilter("ignore")
        load_draft(out, target)


def _trainer_state(seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_training_checkpoint_roundtrip_and_truncation(tmp_path):
    model, opt, sched = _trainer_state(0)
    step_dir = save_checkpoint(tmp_path, 3, model, opt, sched, keep=2)
    assert json.loads((step_dir / MANIFEST).read_text())["files"].keys() == {"model.safetensors", "state.safetensors",
                                                                            "state.json"}
    fresh, fopt, fsched = _trainer_state(1)
    assert load_checkpoint(tmp_path, fresh, fopt, fsched) == 3
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)

    other, oopt, osched = _trainer_state(2)
    before = other.weight.detach().clone()
    (step_dir / "state.safetensors").write_bytes((step_dir / "state.safetensors").read_bytes()[:-7])
    with pytest.raises(UserError, match=r"step_00000003/state.safetensors: \d+ bytes, manifest.json records \d+ "
                                        r".*delete "):
        load_checkpoint(tmp_path, other, oopt, osched)
    assert torch.equal(other.weight, before)  # nothing restored from a damaged checkpoint
    (step_dir / MANIFEST).unlink()  # without its manifest: refused, not loaded unchecked (latest.json records one)
    with pytest.raises(UserError, match=r"step_00000003/manifest.json: missing, though the checkpoint was saved"):
        load_checkpoint(tmp_path, other, oopt, osched)
    (tmp_path / "latest.json").write_text('{"step": 5, "dir": "step_00000005"}')
    with pytest.raises(UserError, match=r"latest.json: names step_00000005, which does not exist"):
        load_checkpoint(tmp_path, other, oopt, osched)
    (tmp_path / "latest.json").write_text('{"step": 5, "di')
    with pytest.raises(UserError, match=r"latest.json: not valid JSON .*; rewrite it as .* or delete"):
        load_checkpoint(tmp_path, other, oopt, osched)
    assert torch.equal(other.weight, before)


def test_save_safetensors_writes_the_same_bytes_for_the_same_input(tmp_path):
    """safetensors writes its metadata map in a random order; save_safetensors' files are byte-identical (a DVC
    output that does not change when its stage reruns), and read back the same."""
    from safetensors import safe_open

    from dspark_core.io import save_safetensors

    meta = {"format": "x", "layout": json.dumps({"rows": [3]}), "target_fingerprint": "abc", "stats": "{}"}
    tensors = {"table_0": torch.arange(6.0).view(2, 3), "table_1": torch.ones(4, dtype=torch.bfloat16)}
    blobs = set()
    for i in range(6):
        save_safetensors(tensors, tmp_path / f"t{i}.safetensors", metadata=meta)
        blobs.add((tmp_path / f"t{i}.safetensors").read_bytes())
    assert len(blobs) == 1
    with safe_open(str(tmp_path / "t0.safetensors"), framework="pt") as f:
        assert f.metadata() == meta
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


# -- the trainer's state: safetensors + JSON, never a pickle -----------------------------------------------------
def _master_trainer_state(seed: int):
    """A bf16 model under MasterAdamW (masters and moments in its state) after one step, and its schedule."""
    from dspark_core.train.optim import MasterAdamW

    torch.manual_seed(seed)
    model = nn.Linear(4, 3).to(torch.bfloat16)
    opt = MasterAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _same(a, b) -> bool:
    """Nested state dicts equal: tensors bit for bit (and dtype), everything else by ==, tuples stay tuples."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_training_state_is_safetensors_and_json_and_restores_exactly(tmp_path):
    """A step folder holds no pickle: the state's tensors in state.safetensors, the rest (step, schedule, the
    optimiser's groups, Python's and numpy's RNG states as plain lists) in state.json. Loading restores the
    optimiser (float32 masters and moments), the schedule and every RNG to exactly what was saved."""
    import random

    import numpy as np

    from dspark_core.checkpoint import read_train_state

    model, opt, sched = _master_trainer_state(0)
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    step_dir = save_checkpoint(tmp_path, 1, model, opt, sched, keep=1)
    assert sorted(p.name for p in step_dir.iterdir()) == ["manifest.json", "model.safetensors", "state.json",
                                                          "state.safetensors"]
    doc = json.loads((step_dir / "state.json").read_text())
    assert doc["format"] == "dspark-train-state" and doc["state"]["step"] == 1
    assert len(doc["state"]["rng"]["python"]["state"]) == 625 and len(doc["state"]["rng"]["numpy"]["key"]) == 624
    assert doc["state"]["optimizer"]["param_groups"][0]["betas"] == {"__tuple__": [0.9, 0.95]}
    saved = read_train_state(step_dir)
    assert _same(saved["optimizer"], opt.state_dict()) and saved["scheduler"] == sched.state_dict()
    draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    fresh, fopt, fsched = _master_trainer_state(1)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    assert load_checkpoint(tmp_path, fresh, fopt, fsched) == 1
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == draws
    assert _same(fopt.state_dict(), opt.state_dict()) and fsched.state_dict() == sched.state_dict()
    assert torch.equal(fresh.weight, model.weight)


def _legacy_folder(step_dir, state) -> None:
    """Turn a step folder into the older layout: ``state`` pickled as state.pt, the manifest rewritten to match
    (what a copy with a consistent manifest, e.g. from a shared remote, looks like)."""
    from dspark_core.checkpoint import write_manifest

    for name in ("state.json", "state.safetensors"):
        (step_dir / name).unlink()
    torch.save(state, step_dir / "state.pt")
    write_manifest(step_dir, ["model.safetensors", "state.pt"])


class _Payload:
    """Unpickling this calls ``exec`` on code that writes a marker file."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_crafted_pickle_in_state_pt_is_refused_and_nothing_runs(tmp_path):
    """A state.pt whose pickle would run code (here: exec writing a marker file), with a manifest that matches it,
    is refused with one line naming the file and what it asks for, by the check a run makes first and by the
    resume itself; the code never runs and the model is left as it was."""
    from dspark_core.checkpoint import verify_latest_checkpoint

    model, opt, sched = _trainer_state(0)
    step_dir = save_checkpoint(tmp_path / "ckpt", 3, model, opt, sched, keep=1)
    marker = tmp_path / "pwned"
    _legacy_folder(step_dir, {"scheduler": sched.state_dict(), "step": 3, "rng": {}, "x": _Payload(marker)})
    other, oopt, osched = _trainer_state(2)
    before = other.weight.detach().clone()
    want = r"step_00000003/state.pt: refused, not a plain training state \(it asks for exec, which could run code\)"
    for call in (lambda: verify_latest_checkpoint(tmp_path / "ckpt"),
                 lambda: load_checkpoint(tmp_path / "ckpt", other, oopt, osched)):
        with pytest.raises(UserError, match=want) as info:
            call()
        assert "\n" not in str(info.value) and "delete" in str(info.value)
    assert not marker.exists()
    assert torch.equal(other.weight, before)


def test_older_state_pt_checkpoint_resumes_without_unpickling_code(tmp_path):
    """A step folder of the older layout (state.pt: a pickle with numpy's RNG array and Python's RNG tuple) still
    resumes, read with weights_only: the same optimiser state, schedule and RNG streams as saved."""
    import random

    import numpy as np

    model, opt, sched = _trainer_state(0)
    step_dir = save_checkpoint(tmp_path, 2, model, opt, sched, keep=1)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    old = {"scheduler": sched.state_dict(), "step": 2, "optimizer": opt.state_dict(),
           "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}}
    _legacy_folder(step_dir, old)
    draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    fresh, fopt, fsched = _trainer_state(1)
    assert load_checkpoint(tmp_path, fresh, fopt, fsched) == 2
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == draws
    assert _same(fopt.state_dict(), opt.state_dict()) and torch.equal(fresh.weight, model.weight)
