"""The `cache` stage on tiny random Qwen3 / Llama targets: exactness, fp8, resume, refusals, reader, verify."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from dspark_core.cache import (
    CacheCollator, CacheConfig, CacheDataset, build_store, check_layer_ids, read_manifest, run_cache, verify_cache,
)
from dspark_core.cache.capture import plan_batches
from dspark_core.cache.store import open_store
from dspark_core.config import ParamsError
from dspark_core.target import load_target, read_fingerprint
from dspark_core.testing import NAN_TOKEN, save_tiny_target, write_regen

LAYERS = (-1, 0, 2, 4)  # tiny targets have 6 decoder layers: 5 is the final one


# 14 samples, 710 tokens: three 256-token chunks, three samples longer than max_length=96, one without response
LENGTHS = [(12, 30), (40, 70), (5, 0), (20, 20), (33, 64), (8, 9), (60, 50), (15, 3), (25, 25), (3, 40),
           (30, 31), (11, 12), (7, 80), (18, 18)]
MAX_LEN = 96
N_TRUNCATED = sum(p + r > MAX_LEN for p, r in LENGTHS)  # 3


def kept(p: int, r: int) -> slice:
    """The tokens of a (prompt, response) row a store keeps (``long_conversations: split``): all when they fit, else
    the response with as much of the prompt's tail as fits (a response alone longer than MAX_LEN: its head)."""
    if p + r <= MAX_LEN:
        return slice(0, p + r)
    return slice(p, p + MAX_LEN) if r > MAX_LEN else slice(p + r - MAX_LEN, p + r)


def cfg_for(root: Path, target: Path, **kw) -> CacheConfig:
    base = dict(aux_layer_ids=LAYERS, max_length=MAX_LEN, chunk_tokens=256, batch_tokens=200,
                target_dir=str(target), regen_dir=str(root / "regen"), out_dir=str(root / "cache"),
                stats_path=str(root / "reports" / "cache_stats.json"), splits=("train",), device="cpu")
    base.update(kw)
    return CacheConfig(**base)


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    out = {fam: save_tiny_target(root / fam, fam) for fam in ("qwen3", "llama")}
    out["qwen3_other"] = save_tiny_target(root / "qwen3_other", "qwen3", seed=1)
    return out


@pytest.fixture(scope="module")
def regen(tmp_path_factory) -> Path:
    return write_regen(tmp_path_factory.mktemp("regen") / "train.parquet", LENGTHS)


def build(tmp: Path, target: Path, regen_path: Path, **kw) -> Path:
    """Build ``tmp/train.zarr`` with :func:`cfg_for` settings overridden by ``kw``."""
    cfg = cfg_for(tmp, target, **kw)
    model, _ = load_target(target, dtype=cfg.dtype)
    build_store(model, read_fingerprint(target)["fingerprint"], cfg, regen_path, tmp / "train.zarr")
    return tmp / "train.zarr"


def store_files(path: Path) -> dict[str, bytes]:
    """Every file of a store by its path inside it: what DVC hashes."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def store_arrays(path: Path) -> dict[str, np.ndarray]:
    group = open_store(path)
    return {name: group[name][:] for name in group.array_keys()}


def source_rows(regen_path: Path) -> list[list[int]]:
    t = pq.read_table(regen_path)
    return [p + r for p, r in zip(t.column("prompt_ids").to_pylist(), t.column("response_ids").to_pylist())]


@pytest.fixture(scope="module")
def bf16_store(tmp_path_factory, targets, regen) -> Path:
    return build(tmp_path_factory.mktemp("bf16"), targets["qwen3"], regen)


# -- exactness -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_roundtrip_equals_direct_forward_exactly(tmp_path, targets, regen, family):
    """One sample per forward (batch_tokens=1): stored bits == bf16 of output_hidden_states, exactly."""
    path = build(tmp_path, targets[family], regen, batch_tokens=1)
    model, _ = load_target(targets[family])
    ds = CacheDataset(path, dtype=torch.bfloat16)
    rows = source_rows(regen)
    src = open_store(path)["source_index"][:]
    assert len(ds) == len(LENGTHS) and ds.manifest["truncated_samples"] == N_TRUNCATED
    for n in range(len(ds)):
        item = ds[n]
        row, (p, r) = rows[src[n]], LENGTHS[src[n]]
        assert item["input_ids"].tolist() == row[kept(p, r)]
        assert item["loss_mask"].tolist() == ([False] * p + [True] * r)[kept(p, r)]
        with torch.no_grad():
            hs = model(input_ids=item["input_ids"][None], output_hidden_states=True).hidden_states
        for k, lid in enumerate(LAYERS):
            assert torch.equal(item["aux_hidden"][:, k], hs[lid + 1][0].to(torch.bfloat16)), (n, lid)
        assert torch.equal(item["last_hidden"], hs[-1][0].to(torch.bfloat16))
        assert torch.equal(item["last_hidden"], model.model(item["input_ids"][None]).last_hidden_state[0]
                           .detach().to(torch.bfloat16))


def test_a_rebuild_gives_the_same_bytes(tmp_path, bf16_store, targets, regen):
    """The same inputs make a byte-identical store (no build time or id left in it), so DVC's hash of a re-run
    cache stage is unchanged and the stages after it are not re-run; the build's time is in the stats."""
    again = build(tmp_path, targets["qwen3"], regen)
    assert store_files(again) == store_files(bf16_store)
    manifest = read_manifest(again)
    assert "compute_seconds" not in manifest and "build_id" not in manifest


def test_padded_batches_match_single_forwards(bf16_store, targets):
    """Several samples per padded forward: every value within one bf16 rounding of the unpadded forward."""
    model, _ = load_target(targets["qwen3"])
    ds = CacheDataset(bf16_store)
    assert read_manifest(bf16_store)["batch_tokens"] == 200
    for n in range(len(ds)):
        item = ds[n]
        with torch.no_grad():
            hs = model(input_ids=item["input_ids"][None], output_hidden_states=True).hidden_states
        ref = torch.stack([hs[lid + 1][0] for lid in LAYERS], dim=1)  # [L, K, H]
        torch.testing.assert_close(item["aux_hidden"], ref, rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(item["last_hidden"], hs[-1][0], rtol=2 ** -7, atol=1e-5)


def test_fp8_aux_small_error_and_last_hidden_lossless(tmp_path, bf16_store, targets, regen):
    path = build(tmp_path, targets["qwen3"], regen, aux_dtype="fp8_e4m3")
    fp8, ref = store_arrays(path), store_arrays(bf16_store)
    assert fp8["aux_hidden"].dtype == np.uint8 and fp8["aux_scale"].shape == fp8["aux_hidden"].shape[:2]
    assert np.array_equal(fp8["last_hidden"], ref["last_hidden"])
    a, b = CacheDataset(path)[3]["aux_hidden"], CacheDataset(bf16_store)[3]["aux_hidden"]
    rel = float((a - b).norm() / b.norm())
    assert 1e-4 < rel < 0.05, rel


# -- resume and refusals -----------------------------------------------------------------------------
class Killed(RuntimeError):
    pass


def test_resume_after_kill_is_bit_identical(tmp_path, bf16_store, targets, regen):
    cfg = cfg_for(tmp_path, targets["qwen3"])
    model, _ = load_target(targets["qwen3"])
    fp = read_fingerprint(targets["qwen3"])["fingerprint"]
    dest, commits = tmp_path / "train.zarr", []

    def kill_after_three(done: int) -> None:
        commits.append(done)
        if len(commits) == 3:
            raise Killed

    with pytest.raises(Killed):
        build_store(model, fp, cfg, regen, dest, on_commit=kill_after_three)
    attrs = read_manifest(dest, require_complete=False)
    assert not attrs["complete"] and 0 < attrs["committed_samples"] < len(LENGTHS)
    with pytest.raises(ValueError, match="incomplete"):
        CacheDataset(dest)
    resumed = []
    build_store(model, fp, cfg, regen, dest, on_commit=resumed.append)
    n_batches = len(plan_batches(sorted((min(p + r, MAX_LEN) for p, r in LENGTHS), reverse=True), 200))
    assert resumed[-1] == len(LENGTHS) and len(resumed) < n_batches  # committed batches were not redone
    got, want = store_arrays(dest), store_arrays(bf16_store)
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert read_manifest(dest)["complete"]


def test_store_with_other_settings_refused_then_forced(tmp_path, targets, regen):
    path = build(tmp_path, targets["qwen3"], regen)
    cfg = cfg_for(tmp_path, targets["qwen3"], aux_layer_ids=(0, 1))
    model, _ = load_target(targets["qwen3"])
    fp = read_fingerprint(targets["qwen3"])["fingerprint"]
    with pytest.raises(ValueError, match=r"other settings \(aux_layer_ids: stored \[-1, 0, 2, 4\], now \[0, 1\]"):
        build_store(model, fp, cfg, regen, path)
    build_store(model, fp, cfg, regen, path, force=True)
    assert read_manifest(path)["aux_layer_ids"] == [0, 1]


def test_cache_from_another_model_refused(bf16_store, targets, regen, tmp_path):
    other = read_fingerprint(targets["qwen3_other"])["fingerprint"]
    assert other != read_manifest(bf16_store)["model_fingerprint"]
    with pytest.raises(ValueError, match="cache from another model"):
        CacheDataset(bf16_store, expected_fingerprint=other)
    with pytest.raises(ValueError, match="cache from another model"):
        verify_cache(bf16_store, targets["qwen3_other"])
    model, _ = load_target(targets["qwen3_other"])
    copy = tmp_path / "train.zarr"
    build(tmp_path, targets["qwen3"], regen)
    with pytest.raises(ValueError, match="another model"):
        build_store(model, other, cfg_for(tmp_path, targets["qwen3_other"]), regen, copy)
    with pytest.raises(ValueError, match=r"aux layers \[-1, 0, 2, 4\], the caller expects \[0, 2\]"):
        CacheDataset(bf16_store, expected_layer_ids=[0, 2])


def test_nan_hidden_states_refused_naming_the_sample(tmp_path):
    target = save_tiny_target(tmp_path / "nan_target", "qwen3")
    model, _ = load_target(target)
    with torch.no_grad():
        model.model.embed_tokens.weight[NAN_TOKEN] = float("nan")
    model.save_pretrained(target)
    regen = write_regen(tmp_path / "regen" / "train.parquet", LENGTHS, poison=4)
    with pytest.raises(ValueError, match=r"sample 's004' \(source row 4\) are NaN/inf from token \d+; nothing stored"):
        build(tmp_path, target, regen)
    attrs = read_manifest(tmp_path / "train.zarr", require_complete=False)
    assert attrs["committed_samples"] < len(LENGTHS) and not attrs["complete"]


@pytest.mark.parametrize("ids, pattern", [
    ((0, 5), r"cache.aux_layer_ids: 5 is the final decoder layer"),
    ((0, 6), r"cache.aux_layer_ids: layer id 6 is out of range"),
    ((0, 2, 0), r"duplicate layer id\(s\) \[0\]"),
    ((-2, 1), r"layer id -2 is out of range"),
])
def test_bad_layer_ids(ids, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_layer_ids(ids, 6)


def _write_params(tmp: Path, **cache) -> Path:
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump({"cache": cache}))
    return path


def test_stage_params_errors(tmp_path, targets):
    with pytest.raises(ParamsError, match=r"params.yaml: cache.aux_layer_ids: duplicate layer id\(s\) \[2\] in"):
        CacheConfig.load(_write_params(tmp_path, aux_layer_ids=[2, 2]), "cache")
    with pytest.raises(ParamsError, match="chunk_tokens must be >= 256; got 64"):
        CacheConfig.load(_write_params(tmp_path, aux_layer_ids=[1], chunk_tokens=64), "cache")
    write_regen(tmp_path / "regen" / "train.parquet", LENGTHS[:2])
    with pytest.raises(ValueError, match="cache.aux_layer_ids: 5 is the final decoder layer"):
        run_cache(cfg_for(tmp_path, targets["qwen3"], aux_layer_ids=(0, 5)))


def test_empty_or_missing_regen_refused(tmp_path, targets):
    cfg = cfg_for(tmp_path, targets["qwen3"])
    with pytest.raises(ValueError, match="train.parquet: regenerate output not found"):
        run_cache(cfg)
    write_regen(tmp_path / "regen" / "train.parquet", [])
    with pytest.raises(ValueError, match="train.parquet: no rows"):
        run_cache(cfg)


def test_truncate_keeps_each_rows_head(regen):
    """``long_conversations: truncate``: a row's first MAX_LEN tokens, whatever they hold; the response tokens past
    them are counted as lost."""
    from dspark_core.cache.source import load_regen

    samples = load_regen(regen, MAX_LEN, long_conversations="truncate")
    rows, off = source_rows(regen), samples.offsets
    for n, row in enumerate(samples.order):
        p, r = LENGTHS[row]
        assert samples.input_ids[off[n]:off[n + 1]].tolist() == rows[row][:MAX_LEN]
        assert samples.loss_mask[off[n]:off[n + 1]].tolist() == ([0] * p + [1] * r)[:MAX_LEN]
    assert samples.truncated == N_TRUNCATED and samples.conversations_split == 0
    assert samples.answers_cut == 3 and samples.answer_tokens_lost == sum(max(0, p + r - MAX_LEN) for p, r in LENGTHS)
    split = load_regen(regen, MAX_LEN)  # the default: every response whole
    assert (split.truncated, split.answers_cut, split.answer_tokens_lost) == (N_TRUNCATED, 0, 0)


def test_too_long_sample_refused_when_asked(tmp_path, targets, regen):
    with pytest.raises(ValueError, match=r"row 1 \(id 's001'\) has 110 tokens > cache.max_length=96"):
        build(tmp_path, targets["qwen3"], regen, on_too_long="error")


# -- stage, stats, verify -----------------------------------------------------------------------------
def test_run_cache_writes_stores_and_stats(tmp_path, targets):
    write_regen(tmp_path / "regen" / "train.parquet", LENGTHS)
    write_regen(tmp_path / "regen" / "eval.parquet", LENGTHS[:4], seed=1)
    cfg = cfg_for(tmp_path, targets["llama"], splits=("train", "eval"))
    stats = run_cache(cfg)
    on_disk = json.loads(Path(cfg.stats_path).read_text())
    assert on_disk == json.loads(json.dumps(stats))
    n_tok = sum(min(p + r, MAX_LEN) for p, r in LENGTHS) + sum(min(p + r, MAX_LEN) for p, r in LENGTHS[:4])
    assert stats["num_tokens"] == n_tok and stats["num_samples"] == 18
    assert stats["truncated_samples"] == N_TRUNCATED + 1  # (40, 70) is in eval too
    assert stats["raw_bf16_bytes_per_token"] == 2 * (len(LAYERS) + 1) * 64 + 4 + 1
    stored = sum(f.stat().st_size for f in Path(cfg.out_dir).rglob("*") if f.is_file())
    assert stats["bytes_per_token"] == pytest.approx(stored / n_tok)
    assert stats["compression_ratio"] == pytest.approx(stats["bytes_per_token"] / stats["raw_bf16_bytes_per_token"])
    assert stats["tokens_per_s"] > 0 and set(stats["splits"]) == {"train", "eval"}
    for split in ("train", "eval"):
        m = read_manifest(Path(cfg.out_dir) / f"{split}.zarr")
        assert m["model_fingerprint"] == read_fingerprint(targets["llama"])["fingerprint"]
        assert m["num_hidden_layers"] == 6 and m["hidden_size"] == 64 and m["vocab_size"] == 272
    again = run_cache(cfg)  # complete stores are kept as they are: nothing computed this time
    assert again["num_tokens"] == n_tok and again["compute_seconds"] == 0.0 and again["tokens_per_s"] is None
    assert all(again["splits"][s]["reused"] and not stats["splits"][s]["reused"] for s in ("train", "eval"))


def test_verify_exact_on_bf16_and_detects_corruption(tmp_path, targets, regen):
    path = build(tmp_path, targets["qwen3"], regen)
    report = verify_cache(path, targets["qwen3"], n_samples=3, seed=0)
    assert report["exact"] and report["ok"] and len(report["samples"]) == 3
    assert report["max_aux_rel_err"] < 4e-3 and report["max_last_rel_err"] < 4e-3
    group = open_store(path, mode="r+")
    start, end = group["offsets"][0], group["offsets"][1]
    group["last_hidden"][start:end] = group["last_hidden"][start + 1:end + 1]  # sample 0 shifted by a token
    bad = verify_cache(path, targets["qwen3"], n_samples=len(LENGTHS))
    assert not bad["exact"] and not bad["ok"]
    assert [s["last_exact"] for s in bad["samples"]].count(False) == 1 and bad["samples"][0]["index"] == 0


def test_verify_fp8_store(tmp_path, targets, regen):
    path = build(tmp_path, targets["qwen3"], regen, aux_dtype="fp8_e4m3")
    report = verify_cache(path, targets["qwen3"], n_samples=2, seed=3)
    assert report["exact"] and report["ok"]
    assert 1e-3 < report["max_aux_rel_err"] < 0.05 and report["max_last_rel_err"] < 4e-3


# -- reader -------------------------------------------------------------------------------------------
def test_collator_pads_and_truncates(bf16_store):
    ds = CacheDataset(bf16_store, max_length=50)
    assert int(ds.lengths.max()) == 50
    items = [ds[i] for i in (0, len(ds) - 1, 5)]
    lens = [len(it["input_ids"]) for it in items]
    assert max(lens) == 50 and min(lens) < 50
    batch = CacheCollator(pad_id=99, max_length=40)(items)
    b = len(items)
    assert batch["input_ids"].shape == (b, 40) and batch["aux_hidden"].shape == (b, 40, len(LAYERS), 64)
    assert batch["last_hidden"].shape == (b, 40, 64) and batch["lengths"].tolist() == [min(n, 40) for n in lens]
    for i, it in enumerate(items):
        n = int(batch["lengths"][i])
        assert batch["attention_mask"][i].tolist() == [True] * n + [False] * (40 - n)
        assert torch.equal(batch["input_ids"][i, :n], it["input_ids"][:n])
        assert (batch["input_ids"][i, n:] == 99).all() and not batch["loss_mask"][i, n:].any()
        assert torch.equal(batch["aux_hidden"][i, :n], it["aux_hidden"][:n])
        assert (batch["aux_hidden"][i, n:] == 0).all() and (batch["last_hidden"][i, n:] == 0).all()
        assert torch.equal(batch["loss_mask"][i, :n], it["loss_mask"][:n])
    full = CacheDataset(bf16_store)[0]
    assert torch.equal(items[0]["aux_hidden"], full["aux_hidden"][:50])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_dataset_in_dataloader_workers(bf16_store):
    ds = CacheDataset(bf16_store, dtype="bfloat16")
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=CacheCollator(pad_id=0))
    total = sum(int(batch["lengths"].sum()) for batch in loader)
    assert total == int(ds.offsets[-1]) and next(iter(loader))["aux_hidden"].dtype == torch.bfloat16


def test_store_killed_during_creation_is_rebuilt_and_foreign_dirs_kept(tmp_path, bf16_store, targets, regen):
    path = build(tmp_path, targets["qwen3"], regen)
    group = open_store(path, mode="r+")
    group.attrs.update({"initialized": False})  # as if killed before the token arrays were all written
    group["input_ids"][:5] = -1
    build(tmp_path, targets["qwen3"], regen)
    got, want = store_arrays(path), store_arrays(bf16_store)
    assert all(np.array_equal(got[n], want[n]) for n in want)
    foreign = tmp_path / "other"
    (foreign / "train.zarr").mkdir(parents=True)
    (foreign / "train.zarr" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a cache store"):
        build(foreign, targets["qwen3"], regen)
    model, _ = load_target(targets["qwen3"])
    with pytest.raises(ValueError, match="not a zarr store; refusing to delete it"):
        build_store(model, "x", cfg_for(foreign, targets["qwen3"]), regen, foreign / "train.zarr", force=True)
    assert (foreign / "train.zarr" / "notes.txt").read_text() == "mine"


def test_token_id_outside_vocab_refused(tmp_path, targets):
    regen = write_regen(tmp_path / "regen" / "train.parquet", LENGTHS[:3])
    table = pq.read_table(regen).to_pylist()
    table[1]["response_ids"][4] = 272  # tiny vocab is 272
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(regen)), regen)
    with pytest.raises(ValueError, match=r"row 1 \(id 's001'\) has token id 272 outside the target's vocabulary"):
        build(tmp_path, targets["qwen3"], regen)


# -- one store, several processes (torchrun) ---------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_build_equals_one_process_and_resumes(tmp_path, bf16_store, targets, regen, world):
    """Ranks run one after another in this process (the barriers are no-ops here): each writes only its
    chunk-aligned window, a killed rank resumes from its progress file, the store is marked complete only
    when every window is written, and the arrays equal the single-process store bit for bit."""
    from dspark_core.cache.build import (
        fill_shard, finalize_shards, prepare_shared_store, shard_progress_path, shard_window, wanted_manifest,
    )
    from dspark_core.cache.source import load_regen
    from dspark_core.io import sha256_file

    cfg = cfg_for(tmp_path, targets["qwen3"])
    model, _ = load_target(targets["qwen3"])
    fp = read_fingerprint(targets["qwen3"])["fingerprint"]
    samples = load_regen(regen, cfg.max_length, cfg.on_too_long, vocab_size=model.config.vocab_size)
    dest = tmp_path / "train.zarr"
    total = int(samples.offsets[-1])
    windows = [shard_window(total, 256, r, world) for r in range(world)]
    assert windows[0][0] == 0 and windows[-1][1] == total
    assert all(a[1] == b[0] and a[1] % 256 == 0 for a, b in zip(windows, windows[1:]))  # whole chunks, no gaps
    assert any(lo not in samples.offsets for lo, _ in windows[1:])  # a sample straddles a rank boundary
    manifest = wanted_manifest(cfg, model.config, fp, samples, regen, sha256_file(regen))
    group = prepare_shared_store(dest, manifest, samples, False, False, world)

    def kill(_written: int) -> None:
        raise Killed

    with pytest.raises(Killed):  # the last rank dies after its first batch
        fill_shard(group, samples, model, cfg, dest, world - 1, world, on_commit=kill)
    for rank in range(world - 1):
        fill_shard(group, samples, model, cfg, dest, rank, world)
    with pytest.raises(RuntimeError, match=f"shard {world - 1} of {world}"):
        finalize_shards(group, dest, samples.offsets, world)
    assert not read_manifest(dest, require_complete=False)["complete"]
    group = prepare_shared_store(dest, manifest, samples, False, False, world)  # the rerun: resumed, not rebuilt
    written = []
    fill_shard(group, samples, model, cfg, dest, world - 1, world, on_commit=written.append)
    assert written and written[-1] == total
    finalize_shards(group, dest, samples.offsets, world)
    assert read_manifest(dest)["complete"] and read_manifest(dest)["committed_samples"] == len(LENGTHS)
    assert not any(shard_progress_path(dest, r, world).exists() for r in range(world))
    got, want = store_arrays(dest), store_arrays(bf16_store)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert store_files(dest) == store_files(bf16_store)  # the build id is gone: the one-process store's bytes
    assert verify_cache(dest, targets["qwen3"], n_samples=4, seed=1)["exact"]  # the recomputed bits


def _cache_worker(rank: int, port: int, tmp: str, target: str, regen_path: str) -> None:
    import os

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    root = Path(tmp)
    (root / "regen").mkdir(exist_ok=True)
    if rank == 0:
        import shutil

        shutil.copy(regen_path, root / "regen" / "train.parquet")
    import torch.distributed as dist

    from dspark_core.dist import init_distributed

    init_distributed().barrier()  # the regen file is in place
    run_cache(cfg_for(root, Path(target)))
    dist.destroy_process_group()


def test_two_processes_write_one_store(tmp_path, bf16_store, targets, regen):
    """run_cache under 2 gloo processes (what torchrun starts): one complete store equal to the 1-process one,
    stats written once."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_cache_worker, args=(port, str(tmp_path), str(targets["qwen3"]), str(regen)), nprocs=2,
                       start_method="spawn")
    dest = tmp_path / "cache" / "train.zarr"
    assert read_manifest(dest)["complete"]
    got, want = store_arrays(dest), store_arrays(bf16_store)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    stats = json.loads((tmp_path / "reports" / "cache_stats.json").read_text())
    assert stats["num_samples"] == len(LENGTHS)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["train.zarr"]  # no progress files left
