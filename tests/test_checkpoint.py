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
    with pytest.raises(UserError, match=r"step_00000003/state.safetensors: \d+ bytes, manifest.json records \d+ .*delete "):
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
