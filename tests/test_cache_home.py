"""One copy of the cache on disk, and a store that switching modes keeps (dspark_core/cache/home.py).

The cache stage builds and keeps its stores in ``cache.store_dir`` and publishes hard links of them as its DVC output.
Under DVC -- the repository's own cache stage (dvc.yaml) and link type (.dvc/config) in a temporary repo -- every
file of the store has one inode for its three names (home, output, DVC's cache), a rerun neither copies nor
recomputes it, and a home that is gone (a clone after `dvc pull`) takes the store back from DVC's cache. A consumer
switched to online and back keeps the store with hidden states, complete or half-built. Writes into a store never
reach another name of its files. The free-disk check and `profile check` count DVC's copy when it makes one. Tiny
random Qwen3 target on the CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dspark_core.cache import CacheConfig, build_store, read_manifest, run_cache
from dspark_core.cache.build import check_disk_space, target_model_config
from dspark_core.cache.store import cache_bytes_per_token
from dspark_core.errors import UserError
from dspark_core.profile_check import check_profile
from dspark_core.target import load_target, read_fingerprint
from dspark_core.testing import cache_stage_repo, scratch_env

from _cache_utils import CACHE, LAYERS, regen, target  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]


def _cfg(root: Path, target: Path, regen: Path, **kw) -> CacheConfig:
    return CacheConfig(**{**CACHE, **kw}, target_dir=str(target), regen_dir=str(regen.parent),
                       out_dir=str(root / "cache"), stats_path=str(root / "cache_stats.json"))


def tree_files(path: Path) -> dict[str, Path]:
    return {str(f.relative_to(path)): f for f in sorted(Path(path).rglob("*")) if f.is_file()}


def _inodes(path: Path) -> dict[str, int]:
    return {rel: f.stat().st_ino for rel, f in tree_files(path).items()}


def _bytes(path: Path) -> dict[str, bytes]:
    return {rel: f.read_bytes() for rel, f in tree_files(path).items()}


class Killed(RuntimeError):
    pass


def _half_built(cfg: CacheConfig, target: Path, regen: Path, dest: Path) -> None:
    """A store with hidden states killed after its second commit."""
    model, _ = load_target(target)
    commits = []

    def kill(done: int) -> None:
        commits.append(done)
        if len(commits) == 2:
            raise Killed

    with pytest.raises(Killed):
        build_store(model, read_fingerprint(target)["fingerprint"], cfg, regen, dest, on_commit=kill)
    assert not read_manifest(dest, require_complete=False)["complete"]


# -- without DVC ------------------------------------------------------------------------------------------------------
def test_the_output_is_hard_links_of_the_kept_store(tmp_path, target, regen, capsys):
    """The store lives in <out_dir>_stores (git-ignored); the output holds the same files under a second name. A
    rerun keeps it; an output deleted (as DVC deletes a plain output before a rerun) is linked again; a store left
    in the output by a workspace without the home is moved in. Nothing is recomputed, and the inodes never change.
    Other settings rebuild the store and the output links the new one."""
    cfg = _cfg(tmp_path, target, regen)
    stats = run_cache(cfg)
    home, view = tmp_path / "cache_stores" / "train.zarr", tmp_path / "cache" / "train.zarr"
    inodes = _inodes(home)
    assert not stats["splits"]["train"]["reused"] and _inodes(view) == inodes
    assert all(f.stat().st_nlink == 2 for f in tree_files(view).values())
    assert (tmp_path / "cache_stores" / ".gitignore").read_text() == "*\n"
    assert run_cache(cfg)["splits"]["train"]["reused"] and _inodes(view) == inodes
    shutil.rmtree(view)
    assert run_cache(cfg)["splits"]["train"]["reused"] and _inodes(view) == _inodes(home) == inodes
    shutil.rmtree(tmp_path / "cache_stores")  # the output is now the only name of the store's files
    capsys.readouterr()
    again = run_cache(cfg)
    assert f"cache train: {home} taken from {view} (a complete store of this content; nothing recomputed)" in \
        capsys.readouterr().out
    assert again["splits"]["train"]["reused"] and _inodes(home) == _inodes(view) == inodes
    rebuilt = run_cache(_cfg(tmp_path, target, regen, clevel=3), rebuild_stale=True)  # other settings: a new store
    assert not rebuilt["splits"]["train"]["reused"] and read_manifest(view)["clevel"] == 3
    assert _inodes(view) == _inodes(home) and not set(_inodes(home).values()) & set(inodes.values())


def test_switching_online_and_back_keeps_the_store_with_hidden_states(tmp_path, target, regen, monkeypatch, capsys):
    """cache -> online -> cache: the online consumer reads the tokens of the complete store with hidden states, which
    is published as it is (no forward, no weights, no token-only store, nothing deleted); back, nothing is
    recomputed. Its files keep their inodes throughout."""
    import dspark_core.cache.build as build

    cfg = _cfg(tmp_path, target, regen)
    run_cache(cfg)
    home, view = tmp_path / "cache_stores" / "train.zarr", tmp_path / "cache" / "train.zarr"
    inodes = _inodes(home)
    monkeypatch.setattr(build, "load_target", lambda *a, **k: pytest.fail("the online switch loaded the target"))
    capsys.readouterr()
    online = run_cache(cfg, hidden_states={"train": "online"}, rebuild_stale=True)
    assert f"cache train: train.hidden_states: online reads the tokens of {home}, the store with hidden states of " \
           "this content, kept as it is" in capsys.readouterr().out
    assert online["splits"]["train"]["reused"] and _inodes(view) == _inodes(home) == inodes
    assert not (tmp_path / "cache_stores" / "train.tokens.zarr").exists()
    monkeypatch.undo()
    back = run_cache(cfg, hidden_states={"train": "cache"}, rebuild_stale=True)
    assert back["splits"]["train"]["reused"] and back["compute_seconds"] == 0
    assert _inodes(view) == _inodes(home) == inodes


def test_a_half_built_store_survives_a_switch_to_online(tmp_path, target, regen, capsys):
    """A store with hidden states killed half-way, then its consumer switched to online: a token-only store is built
    beside it and published, the half-built store is left byte for byte; switched back, its build resumes and ends
    with the bytes of a build never stopped."""
    cfg = _cfg(tmp_path, target, regen)
    home = tmp_path / "cache_stores" / "train.zarr"
    _half_built(cfg, target, regen, home)
    half = _bytes(home)
    capsys.readouterr()
    run_cache(cfg, hidden_states={"train": "online"}, rebuild_stale=True)
    assert f"cache train: {home}, a store with hidden states (incomplete), is kept as it is" in capsys.readouterr().out
    assert read_manifest(tmp_path / "cache" / "train.zarr")["hidden_states"] == "online"
    assert _bytes(home) == half
    run_cache(cfg, hidden_states={"train": "cache"}, rebuild_stale=True)
    reference = tmp_path / "ref"
    run_cache(_cfg(reference, target, regen))
    assert _bytes(tmp_path / "cache" / "train.zarr") == _bytes(reference / "cache" / "train.zarr")


def test_writing_into_a_store_never_reaches_another_name_of_its_files(tmp_path, target, regen):
    """A half-built store whose files also have a second name (as DVC's cache objects do, hard-linked): resuming it
    rewrites its last chunk and zarr.json by writing a new file and renaming it over the old, so the other names
    keep their bytes."""
    cfg = _cfg(tmp_path, target, regen)
    store, objects = tmp_path / "train.zarr", tmp_path / "objects"
    _half_built(cfg, target, regen, store)
    for rel, f in tree_files(store).items():
        (objects / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(f, objects / rel)
    before = _bytes(objects)
    build_store(load_target(target)[0], read_fingerprint(target)["fingerprint"], cfg, regen, store)
    assert read_manifest(store)["complete"] and _bytes(objects) == before
    assert _bytes(store)["zarr.json"] != before["zarr.json"]  # rewritten in the store, not through the link


# -- under DVC --------------------------------------------------------------------------------------------------------
def _dvc(repo: Path, *args: str) -> str:
    cmd = list(args) if args[0] == "git" else [sys.executable, "-m", "dvc", *args]
    res = subprocess.run(cmd, cwd=repo, env=scratch_env(repo), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


def _params(train_hidden: str) -> dict:
    return {"cache": {**CACHE, "aux_layer_ids": list(LAYERS), "splits": ["train"]},
            "train": {"hidden_states": train_hidden}, "eval_offline": {"hidden_states": "cache"}}


def _set_params(repo: Path, train_hidden: str) -> None:
    (repo / "params.yaml").write_text(yaml.safe_dump(_params(train_hidden)))


@pytest.fixture
def dvc_repo(tmp_path, target, regen) -> Path:
    """A git + DVC repo holding this project's cache stage (dvc.yaml), .dvc/config, stages/cache.py and dspark_core,
    the tiny target as data/target and the regen file as data/regen/train.parquet."""
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["cache"]
    return cache_stage_repo(tmp_path / "repo", stage, target, regen, _params("cache"))


def _cache_objects(repo: Path) -> dict[int, Path]:
    return {f.stat().st_ino: f for f in (repo / ".dvc" / "cache").rglob("*") if f.is_file()}


def _stats(repo: Path) -> dict:
    return json.loads((repo / "reports" / "cache_stats.json").read_text())["splits"]["train"]


def test_under_dvc_a_rerun_neither_copies_nor_recomputes_the_store(dvc_repo):
    """`dvc repro cache` with the project's stage and link type: each file of the store has one inode for the home,
    the output and DVC's cache (the hidden states exist once). Rerun after a code edit under dspark_core/cache, after
    train.hidden_states online and back, and with the home deleted (a clone after `dvc pull`: the store is taken
    back from DVC's cache): the same inodes, nothing recomputed, `dvc status` clean, the home git-ignored."""
    repo = dvc_repo
    home, view = repo / "data" / "cache_stores" / "train.zarr", repo / "data" / "cache" / "train.zarr"
    _dvc(repo, "repro", "cache")
    inodes = _inodes(home)
    assert _inodes(view) == inodes and not _stats(repo)["reused"]
    assert set(inodes.values()) <= set(_cache_objects(repo))
    assert all(f.stat().st_nlink == 3 for f in tree_files(view).values())

    def rerun(note: str) -> str:
        with (repo / "dspark_core" / "cache" / "verify.py").open("a") as fh:
            fh.write(f"# {note}\n")
        out = _dvc(repo, "repro", "cache")
        assert "Running stage 'cache'" in out and _stats(repo)["reused"]
        return out

    rerun("a code edit: DVC deletes the output's links, the stage links them again")
    assert _inodes(home) == _inodes(view) == inodes
    _set_params(repo, "online")
    assert "online reads the tokens of data/cache_stores/train.zarr" in _dvc(repo, "repro", "cache")
    _set_params(repo, "cache")
    _dvc(repo, "repro", "cache")
    assert _stats(repo)["reused"] and _inodes(home) == _inodes(view) == inodes
    shutil.rmtree(repo / "data" / "cache_stores")
    out = rerun("the home is gone")
    assert "cache train: data/cache_stores/train.zarr taken from DVC's cache" in out
    assert _inodes(home) == _inodes(view) == inodes
    assert "up to date" in _dvc(repo, "status")
    assert "cache_stores" not in _dvc(repo, "git", "status", "--porcelain", "--ignored=no")


# -- what the disk holds ------------------------------------------------------------------------------------------
@pytest.mark.workspace("the project's params.yaml and .dvc/config: the estimate on the defaults, its link type")
def test_the_disk_checks_count_dvcs_copy(tmp_path, target, regen, monkeypatch):
    """In a DVC repository whose cache.type copies (DVC's default) a store exists twice on its disk, with the
    project's hardlink,symlink once, outside a repository once: the free-disk check asks for that many copies (one
    line naming why), and `profile check`'s estimate says it."""
    import dspark_core.cache.build as build
    from dspark_core.cache.home import dvc_copies

    repo = tmp_path / "repo"
    repo.mkdir()
    _dvc(repo, "init", "-q", "--no-scm")  # DVC's defaults
    assert dvc_copies(repo)[0] == 1 and "twice on this disk" in dvc_copies(repo)[1]
    assert dvc_copies(tmp_path) == (0, "no DVC repository: the store alone")
    cfg = _cfg(repo / "data", target, regen)
    per_token = cache_bytes_per_token(64, len(LAYERS), "bf16")
    monkeypatch.setattr(build.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(0, 0, 1000 * per_token))
    model_config = target_model_config(target)
    with pytest.raises(UserError, match=r"the hidden states of 710 tokens \(train\) take .* \(.* bytes a token, "
                                        r"twice \(DVC copies it into its cache"):
        check_disk_space(cfg, model_config, {"train": 710}, {})
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"] = {"source": "hf_dir", "path": str(target)}
    params["cache"]["aux_layer_ids"] = list(LAYERS)
    (repo / "params.yaml").write_text(yaml.safe_dump(params))

    def estimate() -> str:
        lines = check_profile(None, repo / "params.yaml", ROOT / "dvc.yaml", samples=10).lines
        return next(line for line in lines if line.startswith("cache estimate:"))

    assert "on disk twice (DVC copies it into its cache" in estimate()
    cache_type = next(line for line in (ROOT / ".dvc" / "config").read_text().splitlines() if "type =" in line)
    _dvc(repo, "config", "cache.type", cache_type.split("=")[1].strip())  # the project's link type
    assert dvc_copies(repo) == (0, "DVC hard-links it into its cache (cache.type: hardlink,symlink)")
    assert check_disk_space(cfg, model_config, {"train": 710}, {}) == 710 * per_token
    assert "on disk once (DVC hard-links it into its cache (cache.type: hardlink,symlink))" in estimate()
