"""Targets by hub id (``target.source: hf_hub``), offline: a hub cache laid out in a temp dir as huggingface_hub
writes it (``dspark_core.testing.save_hub_repo``: refs, snapshots linking to blobs) from tiny random targets.

The stage resolves the revision to a commit, copies only the small files into the target dir (no weights for DVC
to cache), records the commit and every weights file's size and SHA-256; every reader finds the weights in the
snapshot of that commit (the same tensors as loading the snapshot dir itself), refuses a file of another size, and
a repository's own code never runs unless ``trust_remote_code``. The hub's errors are one line each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dspark_core.errors import UserError
from dspark_core.frozen_target import load_frozen_target
from dspark_core.io import sha256_file
from dspark_core.target import (FINGERPRINT_FILE, INFO_FILE, TargetConfig, TargetRequires, compute_fingerprint,
                                load_target, read_fingerprint, remote_code_kwargs, run_target, target_weights_dir,
                                weight_files)
from dspark_core.testing import save_hub_repo, save_tiny_target

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "org/tiny"
SNAPSHOTS = "models--org--tiny/snapshots"


@pytest.fixture(scope="module")
def srcs(tmp_path_factory) -> dict[str, Path]:
    """Two tiny Qwen3 targets (other weights), one of them sharded into several safetensors files."""
    root = tmp_path_factory.mktemp("hub_src")
    sharded = save_tiny_target(root / "sharded", "qwen3", seed=2)
    from dspark_core.testing import tiny_model

    for f in sharded.glob("*.safetensors"):
        f.unlink()
    tiny_model("qwen3", seed=2).save_pretrained(sharded, max_shard_size="500KB")
    first = sorted(sharded.glob("model-*.safetensors"))[0]
    shutil.copy(first, sharded / "consolidated.safetensors")  # a repository's other weights file: not read
    return {"a": save_tiny_target(root / "a", "qwen3"), "b": save_tiny_target(root / "b", "qwen3", seed=1),
            "sharded": sharded}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """huggingface_hub's cache in a temp dir, offline (what HF_HUB_CACHE / HF_HUB_OFFLINE=1 set in a process)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _stage(out: Path, model: str = REPO_ID, **kw) -> dict:
    return run_target(TargetConfig(source="hf_hub", model=model, out_dir=str(out), **kw))


def _bytes(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())}


def test_hub_target_keeps_its_weights_in_the_hub_cache(srcs, hub_cache, tmp_path):
    commit = save_hub_repo(hub_cache, REPO_ID, srcs["a"])
    out = tmp_path / "target"
    fp = _stage(out)
    snap = hub_cache / SNAPSHOTS / commit
    small = {f.name for f in srcs["a"].iterdir()} - {"model.safetensors"}
    assert {f.name for f in out.iterdir()} == small | {FINGERPRINT_FILE, INFO_FILE}  # no weights for DVC to cache
    assert not any(f.is_symlink() for f in out.iterdir())
    assert all((out / n).read_bytes() == (srcs["a"] / n).read_bytes() for n in small)
    w = srcs["a"] / "model.safetensors"
    info = json.loads((out / INFO_FILE).read_text())
    assert info == {"source": "hf_hub", "model": REPO_ID, "revision": "main", "commit": commit,
                    "trust_remote_code": False, "fingerprint": fp["fingerprint"],
                    "weights": {"model.safetensors": {"size": w.stat().st_size, "sha256": sha256_file(w)}}}
    assert fp == {**compute_fingerprint(srcs["a"]), "commit": commit}  # the same files as a local dir's fingerprint
    assert read_fingerprint(out) == fp == json.loads((out / FINGERPRINT_FILE).read_text())
    assert target_weights_dir(out) == snap and weight_files(out) == [snap / "model.safetensors"]
    assert remote_code_kwargs(out) == {}

    model, tok = load_target(out)
    ref, ref_tok = load_target(snap)  # the snapshot dir itself, as a plain HF dir
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert tok.chat_template == ref_tok.chat_template is not None
    frozen, pad = load_frozen_target(out)
    ref_frozen, ref_pad = load_frozen_target(snap)
    assert pad == ref_pad
    for get in ("get_input_embeddings", "get_output_embeddings"):
        assert torch.equal(getattr(frozen, get)().weight, getattr(ref_frozen, get)().weight)

    again = tmp_path / "again"  # the same commit, the same bytes (DVC's hash of data/target stays)
    _stage(again)
    assert _bytes(again) == _bytes(out)


def test_commits_and_pinned_revisions(srcs, hub_cache, tmp_path):
    """A new commit with other weights gives another fingerprint; a pinned sha the old one; a commit that leaves
    config and weights alone the same fingerprint but other bytes in the target dir (DVC reruns what reads it)."""
    c1 = save_hub_repo(hub_cache, REPO_ID, srcs["a"])
    fp1 = _stage(tmp_path / "t1")
    c2 = save_hub_repo(hub_cache, REPO_ID, srcs["b"])  # main moves to c2
    fp2 = _stage(tmp_path / "t2")
    assert c1 != c2 and (fp1["commit"], fp2["commit"]) == (c1, c2)
    assert fp2["fingerprint"] != fp1["fingerprint"] and fp2["weights_sha256"] != fp1["weights_sha256"]
    assert _stage(tmp_path / "t3", revision=c1) == fp1
    assert json.loads((tmp_path / "t3" / INFO_FILE).read_text())["revision"] == c1

    readme = tmp_path / "with_readme"
    shutil.copytree(srcs["a"], readme)
    (readme / "README.md").write_text("model card\n")
    c3 = save_hub_repo(hub_cache, REPO_ID, readme, ref="v1")  # a tag
    fp3 = _stage(tmp_path / "t4", revision="v1")
    assert fp3 == {**fp1, "commit": c3} and c3 != c1
    assert not (tmp_path / "t4" / "README.md").exists()
    assert _bytes(tmp_path / "t4") != _bytes(tmp_path / "t1")



def test_a_target_that_lacks_what_the_params_need_is_refused_and_the_last_one_kept(srcs, hub_cache, tmp_path):
    """target.requires (a profile's declaration of the layers, vocabulary and hidden size its params need): a target
    that lacks them is refused in one line, before the target dir is replaced."""
    save_hub_repo(hub_cache, REPO_ID, srcs["a"])
    out = tmp_path / "target"
    _stage(out)
    before = _bytes(out)
    layers = json.loads((srcs["a"] / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(UserError, match=rf"^target.requires: org/tiny @ main has {layers} layers, vocabulary 272, but "
                                        rf"the params need at least {layers + 1} layers, vocabulary 151,936 \(a "
                                        r"profile declares it\); set target to such a model$"):
        _stage(out, requires=TargetRequires(min_layers=layers + 1, vocab_size=151936))
    assert _bytes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf_home", "target"]
    _stage(out, requires=TargetRequires(min_layers=layers, vocab_size=272))   # fits

def test_sharded_weights_are_read_from_the_snapshot(srcs, hub_cache, tmp_path):
    commit = save_hub_repo(hub_cache, REPO_ID, srcs["sharded"])
    out = tmp_path / "target"
    _stage(out)
    shards = sorted(f.name for f in srcs["sharded"].glob("model-*.safetensors"))
    assert len(shards) > 1
    info = json.loads((out / INFO_FILE).read_text())
    assert sorted(info["weights"]) == shards  # the index's files; consolidated.safetensors is not read
    assert (out / "model.safetensors.index.json").is_file() and not list(out.glob("*.safetensors"))
    assert weight_files(out) == [hub_cache / SNAPSHOTS / commit / n for n in shards]
    frozen, _ = load_frozen_target(out)
    ref, _ = load_target(srcs["sharded"])
    assert torch.equal(frozen.get_input_embeddings().weight, ref.get_input_embeddings().weight)
    assert torch.equal(frozen.get_output_embeddings().weight, ref.get_output_embeddings().weight)


def test_a_weights_file_of_another_size_is_refused(srcs, hub_cache, tmp_path):
    commit = save_hub_repo(hub_cache, REPO_ID, srcs["a"])
    out = tmp_path / "target"
    _stage(out)
    blob = (hub_cache / SNAPSHOTS / commit / "model.safetensors").resolve()
    size = blob.stat().st_size
    blob.write_bytes(blob.read_bytes()[:-100])
    msg = rf"{out}: weights file model.safetensors in the hub cache \(.*\) has {size - 100} bytes, target_info.json " \
          rf"records {size} \(a damaged or partial download\); fetch it again with `hf download {REPO_ID} " \
          rf"model.safetensors --revision {commit} --force-download`"
    for load in (load_target, load_frozen_target, read_fingerprint):
        with pytest.raises(UserError, match=msg):
            load(out)


def test_weights_missing_from_the_cache_are_named(srcs, hub_cache, tmp_path):
    """data/target without the weights in this machine's hub cache (e.g. after `dvc pull data/target` elsewhere):
    offline, one line saying how to get them; once they are there, every reader finds them."""
    commit = save_hub_repo(hub_cache, REPO_ID, srcs["a"])
    out = tmp_path / "target"
    fp = _stage(out)
    load_frozen_target(out)
    moved = tmp_path / "elsewhere"
    hub_cache.rename(moved)
    want = (f"{out}: {REPO_ID} (revision {commit}) is not in the hub cache {hub_cache} and HF_HUB_OFFLINE=1 forbids "
            f"downloading it; download it first (`hf download {REPO_ID} --revision {commit}`) or unset HF_HUB_OFFLINE")
    for load in (load_target, load_frozen_target, read_fingerprint):
        with pytest.raises(UserError) as info:
            load(out)
        assert str(info.value) == want
    moved.rename(hub_cache)
    assert read_fingerprint(out) == fp and target_weights_dir(out) == hub_cache / SNAPSHOTS / commit


def test_missing_repository_offline_is_one_line(hub_cache, tmp_path):
    out = tmp_path / "target"
    with pytest.raises(UserError) as info:
        _stage(out, model="org/none")
    assert str(info.value) == (
        f"target.model: org/none (revision main) is not in the hub cache {hub_cache} and HF_HUB_OFFLINE=1 "
        "forbids downloading it; download it first (`hf download org/none --revision main`) or unset HF_HUB_OFFLINE")
    assert list(tmp_path.iterdir()) == []  # no target dir, no temp dir left, nothing written to the cache


def _remote_code_repo(src: Path, dst: Path, marker: Path) -> Path:
    """``src`` with a config whose auto_map points at a .py file of the repository that writes ``marker`` when it
    is imported."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "marker_code.MarkerConfig", "AutoModelForCausalLM": "marker_code.MarkerModel"}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "marker_code.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                        "from transformers import Qwen3Config as MarkerConfig\n"
                                        "from transformers import Qwen3ForCausalLM as MarkerModel\n")
    return dst


def test_remote_code_never_runs_unless_trusted(srcs, hub_cache, tmp_path):
    marker = tmp_path / "marker"
    repo = _remote_code_repo(srcs["a"], tmp_path / "remote", marker)
    save_hub_repo(hub_cache, "org/remote", repo)
    with pytest.raises(UserError) as info:
        _stage(tmp_path / "target", model="org/remote")
    msg = str(info.value)
    assert "\n" not in msg and msg.endswith(
        "config.json: the model needs its repository's own code (auto_map ['AutoConfig', 'AutoModelForCausalLM']), "
        "which dspark runs only with target.trust_remote_code: true (read that code first)")
    assert not (tmp_path / "target").exists()
    with pytest.raises(UserError, match="target.trust_remote_code: true"):  # a local dir: the same rule
        run_target(TargetConfig(source="hf_dir", path=str(repo), out_dir=str(tmp_path / "local")))
    with pytest.raises(UserError, match="target.trust_remote_code: true"):  # and every reader of such a dir
        load_target(repo)
    assert not marker.exists()


def test_trust_remote_code_is_recorded_and_passed_only_when_set(srcs, hub_cache, tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    shutil.copytree(srcs["a"], plain)
    (plain / "helper.py").write_text("raise SystemExit('repository code')\n")  # fetched only when trusted
    save_hub_repo(hub_cache, REPO_ID, plain)
    off, on = tmp_path / "off", tmp_path / "on"
    _stage(off)
    _stage(on, trust_remote_code=True)
    assert not (off / "helper.py").exists() and (on / "helper.py").read_bytes() == (plain / "helper.py").read_bytes()
    assert json.loads((on / INFO_FILE).read_text())["trust_remote_code"] is True
    assert remote_code_kwargs(off) == {} and remote_code_kwargs(on) == {"trust_remote_code": True}

    import transformers

    seen, depth = [], [0]
    for name in ("AutoModelForCausalLM", "AutoTokenizer", "AutoConfig"):
        cls = getattr(transformers, name)
        real = cls.from_pretrained.__func__

        def spy(c, *args, _real=real, _name=name, **kw):  # dspark's calls, not transformers' own inner ones
            if not depth[0]:
                seen.append((_name, kw.get("trust_remote_code", "absent")))
            depth[0] += 1
            try:
                return _real(c, *args, **kw)
            finally:
                depth[0] -= 1
        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    load_target(off)
    assert seen and {flag for _, flag in seen} == {"absent"}
    seen.clear()
    load_target(on)
    assert {n for n, _ in seen} == {"AutoModelForCausalLM", "AutoTokenizer", "AutoConfig"}
    assert {flag for _, flag in seen} == {True}


@pytest.mark.parametrize("error", ["gated", "not_found", "revision", "offline", "no_network", "http_500",
                                   "connect"])
def test_hub_errors_are_one_line(error, monkeypatch, tmp_path):
    """Each of the library's exceptions (raised where snapshot_download would raise it) as one line naming the
    id and what to do."""
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub import errors as e

    def resp(code: int):
        return httpx2.Response(code, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO_ID}"))

    raised = {"gated": e.GatedRepoError("gated\nmore", response=resp(401)),
              "not_found": e.RepositoryNotFoundError("404", response=resp(404)),
              "revision": e.RevisionNotFoundError("no rev", response=resp(404)),
              "offline": e.LocalEntryNotFoundError("not cached"),
              "no_network": e.LocalEntryNotFoundError("Got: ConnectError"),
              "http_500": e.HfHubHTTPError("500 Server Error\nbody", response=resp(500)),
              "connect": httpx2.ConnectError("connection refused")}[error]
    want = {"gated": rf"target.model: {REPO_ID} is gated: accept its conditions on https://huggingface.co/{REPO_ID} "
                     r"with your account, then log in here \(`hf auth login`, or set HF_TOKEN\)",
            "not_found": rf"target.model: repository '{REPO_ID}' not found on the hub \(check the id; a private "
                         r"repository needs `hf auth login` or HF_TOKEN\)",
            "revision": rf"target.model: revision 'v9' not found in {REPO_ID} \(target.revision",
            "offline": rf"is not in the hub cache .* HF_HUB_OFFLINE=1 forbids downloading it; download it first "
                       rf"\(`hf download {REPO_ID} --revision v9`\)",
            "no_network": rf"target.model: cannot reach the hub to download {REPO_ID} \(revision v9\) and it is not "
                          r"in the hub cache .*; check the network",
            "http_500": rf"target.model: the hub refused {REPO_ID} \(revision v9\): 500 Server Error$",
            "connect": rf"target.model: cannot reach the hub for {REPO_ID} \(ConnectError: connection refused\)"}[error]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", error == "offline")

    def snapshot_download(*args, **kw):
        raise raised
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(UserError) as info:
        _stage(tmp_path / "target", revision="v9")
    assert "\n" not in str(info.value)
    assert __import__("re").search(want, str(info.value)), str(info.value)
    assert not (tmp_path / "target").exists()


def test_the_stage_honours_hf_home_and_hf_hub_offline(srcs, tmp_path):
    """``python stages/target.py`` in a process whose HF_HOME names the cache (huggingface_hub reads it)."""
    commit = save_hub_repo(tmp_path / "home" / "hub", REPO_ID, srcs["a"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"target": {"source": "hf_hub", "model": REPO_ID}}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, str(REPO / "stages" / "target.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "data/target" / FINGERPRINT_FILE).read_text())["commit"] == commit
    assert not list((tmp_path / "data/target").glob("*.safetensors"))


def test_export_names_the_hub_id_as_verifier(srcs, hub_cache, tmp_path):
    from dspark_core.export.run import default_verifier

    save_hub_repo(hub_cache, REPO_ID, srcs["a"])
    _stage(tmp_path / "target")
    assert default_verifier(tmp_path / "target") == REPO_ID
    assert default_verifier(srcs["a"]) == str(srcs["a"])  # a local target: its dir as given


def test_config_validation():
    from dspark_core.config import ParamsError

    with pytest.raises(ParamsError, match="model must name a hub id org/name .* when source is hf_hub"):
        TargetConfig.from_dict({"source": "hf_hub"})
    with pytest.raises(ParamsError, match=r"model must be a hub id org/name .*got '/data/qwen' \(a local directory: "
                                          r"target.source hf_dir with target.path\)"):
        TargetConfig.from_dict({"source": "hf_hub", "model": "/data/qwen"})
    with pytest.raises(ParamsError, match="revision must be a branch, tag or commit sha; got ''"):
        TargetConfig.from_dict({"source": "hf_hub", "model": REPO_ID, "revision": ""})
    with pytest.raises(ParamsError, match="trust_remote_code must be true or false"):
        TargetConfig.from_dict({"source": "hf_hub", "model": REPO_ID, "trust_remote_code": "yes"})
    cfg = TargetConfig.from_dict({"source": "hf_hub", "model": "Qwen/Qwen3-8B"})
    assert (cfg.revision, cfg.trust_remote_code) == ("main", False)


def test_vllm_reads_the_weights_from_the_snapshot(srcs, hub_cache, tmp_path, monkeypatch):
    import _fake_vllm
    from dspark_core.data.backends import SamplingSpec
    from dspark_core.data.backends.vllm_backend import VLLMBackend

    built = _fake_vllm.install(monkeypatch)
    commit = save_hub_repo(hub_cache, REPO_ID, srcs["a"])
    off, on = tmp_path / "off", tmp_path / "on"
    _stage(off)
    _stage(on, trust_remote_code=True)
    for out in (off, on):
        VLLMBackend(out, SamplingSpec(0.0, 1.0, 0, 4))
    snap = str(hub_cache / SNAPSHOTS / commit)
    assert [(kw["model"], kw["tokenizer"], kw.get("trust_remote_code")) for kw in built] == [
        (snap, str(off), None), (snap, str(on), True)]
