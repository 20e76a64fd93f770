"""Training and evaluating without a hidden-state cache (``train.hidden_states`` / ``eval_offline.hidden_states:
online``), on a tiny random Qwen3 target on the CPU in float32: the premise (a sample's states depend on its padded
width, not on the other rows), online batches bit for bit equal to a cache store's (bf16 and fp8 aux), training
runs and offline metrics identical either way (baseline, Draft Memory, a frozen Engram table, packed rows), the
token-only store the cache stage writes, and the cache's size estimate with the free-disk refusal."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dspark_core.cache import CacheCollator, CacheConfig, CacheDataset, build_store, run_cache, verify_cache
from dspark_core.cache.build import build_token_store, consumer_hidden_states
from dspark_core.cache.capture import (HiddenCapture, capture_batch, capture_padded, decoder_parts, forward_pad_id,
                                       plan_batches, plan_widths)
from dspark_core.cache.online import PLAN_KEY, OnlineCollator, OnlineTarget, TargetForwards, target_forwards
from dspark_core.cache.store import (cache_bytes_per_token, decode_hidden, encode_hidden, estimate_cache_bytes,
                                     human_bytes, open_store, read_manifest, roundtrip_hidden)
from dspark_core.config import ParamsError
from dspark_core.draft.config import DraftConfig, EngramConfig, LossConfig
from dspark_core.draft.eval_offline import EvalOfflineConfig, evaluate_offline
from dspark_core.draft.model import build_draft
from dspark_core.draft.packing import collate_packed, sample_places
from dspark_core.draft.stage import cache_identity
from dspark_core.draft.task import task_class
from dspark_core.errors import UserError
from dspark_core.target import load_target, read_fingerprint
from dspark_core.testing import save_tiny_target
from dspark_core.train.trainer import TrainConfig, train

from _cache_utils import CACHE, LAYERS, regen, target  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(target):
    return load_target(target, dtype="float32")[0]


@pytest.fixture(scope="module")
def stores(tmp_path_factory, target, regen, model) -> dict[str, Path]:
    """The cache stage's stores of the regen file (bf16 and fp8 aux) and the token-only store of the same tokens."""
    root = tmp_path_factory.mktemp("stores")
    fp = read_fingerprint(target)["fingerprint"]
    out = {}
    for aux_dtype in ("bf16", "fp8_e4m3"):
        cfg = CacheConfig(**CACHE, aux_dtype=aux_dtype, target_dir=str(target))
        out[aux_dtype] = root / f"{aux_dtype}.zarr"
        build_store(model, fp, cfg, regen, out[aux_dtype])
    cfg = CacheConfig(**CACHE, target_dir=str(target))
    out["tokens"] = root / "tokens.zarr"
    build_token_store(model.config, fp, cfg, regen, out["tokens"])
    return out


def _forward_2d(model, seqs, width):
    """The cache stage's forward before it built its own masks: transformers given the 2-D padding mask."""
    ids = torch.full((len(seqs), width), forward_pad_id(model.config), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    base, _, _ = decoder_parts(model)
    with torch.no_grad(), HiddenCapture(model, LAYERS) as cap:
        base(input_ids=ids, attention_mask=mask, use_cache=False)
    return torch.stack([cap.outputs[k] for k in LAYERS], dim=2), cap.outputs["last"]


def _alone(model, seq, width, padded):
    ids = torch.zeros((1, width), dtype=torch.long)
    valid = torch.zeros((1, width), dtype=torch.bool)
    ids[0, : len(seq)], valid[0, : len(seq)] = seq, True
    with torch.no_grad():
        return capture_padded(model, ids, valid, LAYERS, padded)


# -- the premise ----------------------------------------------------------------------------------------------------
def test_a_sample_alone_at_its_batch_width_gets_the_batch_bits(model, one_thread):
    """CPU float32: a sample's states in a padded batch equal its states forwarded alone at the batch's width (the
    other rows do not matter), not at its own width (the padded width does); the masks built by capture_padded are
    transformers' own (the same bits as a 2-D mask), padded or not."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(8, 256, (n,), generator=g) for n in (90, 77, 60, 45, 33)]
    with torch.no_grad():
        aux, last = capture_batch(model, seqs, LAYERS, forward_pad_id(model.config))  # [5, 90, K, H]
    ref_aux, ref_last = _forward_2d(model, seqs, 90)
    assert torch.equal(aux, ref_aux) and torch.equal(last, ref_last)
    full_aux, _ = _forward_2d(model, seqs[:1] * 2, 90)  # no row padded: the causal kernel
    assert torch.equal(_alone(model, seqs[0], 90, padded=False)[0][0], full_aux[0])
    own_width_differs = []
    for i, s in enumerate(seqs):
        n = len(s)
        a, h = _alone(model, s, 90, padded=True)
        assert torch.equal(a[0, :n], aux[i, :n]) and torch.equal(h[0, :n], last[i, :n]), i
        own = _alone(model, s, n, padded=False)[0]
        torch.testing.assert_close(own[0], aux[i, :n], rtol=1e-5, atol=1e-5)
        own_width_differs.append(not torch.equal(own[0], aux[i, :n]))
    assert any(own_width_differs)  # why online forwards pad to the cache batch's width


def test_an_unpadded_forward_skips_the_packed_sequence_check(model, tmp_path, monkeypatch):
    """transformers' packed-sequence check reads the device (``.all()``) in every forward given no mask; a Qwen3
    target gets its mask mapping precomputed and never runs it; a Llama target, whose forward takes no mapping, does
    (the same bits either way: the test above)."""
    import transformers.masking_utils as masking

    calls = []
    real = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda pos: calls.append(1) or real(pos))
    seq = torch.arange(8, 40)
    _alone(model, seq, 32, padded=False)
    assert calls == []
    llama = load_target(save_tiny_target(tmp_path / "llama", "llama"), dtype="float32")[0]
    ids, valid = seq[None], torch.ones(1, 32, dtype=torch.bool)
    with torch.no_grad():
        capture_padded(llama, ids, valid, LAYERS, False)
    assert calls == [1]


def test_plan_widths_are_the_plan_batches_longest_and_padding():
    lengths = [96, 96, 96, 90, 61, 61, 40, 18]
    widths, padded = plan_widths(lengths, 200)
    for start, end in plan_batches(lengths, 200):
        for n in range(start, end):
            assert widths[n] == max(lengths[start:end])
            assert padded[n] == (min(lengths[start:end]) < widths[n])
    assert widths == [96, 96, 96, 96, 61, 61, 61, 18] and padded == [False, False, True, True, True, True, True,
                                                                    False]


def test_roundtrip_hidden_is_the_store_encoding_then_its_reader():
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(3, 7, 4, 64, generator=g) * torch.logspace(-3, 3, 64)  # [B, L, K, H]
    aux[0, 0] = 0.0  # an all-zero row: fp8 scale 1
    aux[1, 2, 1, 5] = 3e38
    last = torch.randn(3, 7, 64, generator=g) * 50
    for aux_dtype in ("bf16", "fp8_e4m3"):
        for dtype in (torch.float32, torch.bfloat16):
            want_aux, want_last = decode_hidden(encode_hidden(aux, last, aux_dtype), aux_dtype, dtype)
            got_aux, got_last = roundtrip_hidden(aux, last, aux_dtype, dtype)
            assert got_aux.dtype == want_aux.dtype == dtype
            assert torch.equal(got_aux, want_aux) and torch.equal(got_last, want_last), (aux_dtype, dtype)


# -- online batches are the cache's bits ----------------------------------------------------------------------------
@pytest.mark.parametrize("aux_dtype", ["bf16", "fp8_e4m3"])
def test_online_batches_are_the_cache_bits(stores, model, aux_dtype, one_thread):
    """Every sample, in micro-batches mixing cache widths and padding (padded rows, and packed rows), read from
    the store and computed online: the same aux / last bits, in the trainer's bf16 and eval_offline's float32."""
    path = stores[aux_dtype]
    groups = [[3, 0, 9, 13, 2], [1, 12, 6, 7], [4, 5, 8, 10, 11]]  # every sample, each batch of several widths
    for dtype in (torch.bfloat16, torch.float32):
        cached = CacheDataset(path, dtype=dtype)
        online = CacheDataset(path, dtype=dtype, hidden_states="online")
        target_states = OnlineTarget(model, LAYERS, aux_dtype, dtype)
        for idx in groups:
            want = CacheCollator(0)([cached[i] for i in idx])
            got = target_states.fill(OnlineCollator(0)([online[i] for i in idx]))
            assert PLAN_KEY not in got and got["aux_hidden"].dtype == dtype
            for key in ("aux_hidden", "last_hidden", "input_ids", "loss_mask", "attention_mask"):
                assert torch.equal(got[key], want[key]), (aux_dtype, dtype, idx, key)
            items = [online[i] for i in idx]
            gen = torch.Generator().manual_seed(0)
            packed = collate_packed(items, 4, 4, 160, gen, 0)
            lengths = [len(it["input_ids"]) for it in items]
            packed[PLAN_KEY] = target_forwards(items, sample_places(lengths, 160))
            want = collate_packed([cached[i] for i in idx], 4, 4, 160, torch.Generator().manual_seed(0), 0)
            got = target_states.fill(packed)
            assert torch.equal(got["aux_hidden"], want["aux_hidden"]) and torch.equal(got["last_hidden"],
                                                                                     want["last_hidden"])


def test_the_plan_groups_samples_by_their_cache_forward(stores):
    online = CacheDataset(stores["bf16"], hidden_states="online")
    items = [online[i] for i in (3, 0, 9, 2, 1)]
    plan = OnlineCollator(0)(items)[PLAN_KEY]
    lens = [len(it["input_ids"]) for it in items]
    assert plan == TargetForwards([(96, True, [(0, 0, lens[0]), (3, 0, lens[3])]),
                                   (96, False, [(1, 0, lens[1]), (4, 0, lens[4])]),
                                   (42, True, [(2, 0, lens[2])])])
    assert [(it["forward_width"], it["forward_padded"]) for it in items] == [
        (96, True), (96, False), (42, True), (96, True), (96, False)]
    assert set(items[0]) == {"input_ids", "loss_mask", "forward_width", "forward_padded"}  # no hidden states read


# -- the token-only store -------------------------------------------------------------------------------------------
def test_cache_stage_writes_a_token_only_store_without_loading_weights(tmp_path, target, regen, stores, monkeypatch,
                                                                      capsys):
    """hidden_states online for train: no forward, no weights (load_target refused here), the store holds the
    token arrays and the manifest of the full store plus ``hidden_states: online``; the training run's identity is
    the full store's. Flipping back rebuilds the store with hidden states, byte for byte the cache stage's."""
    import dspark_core.cache.build as build

    cfg = CacheConfig(**CACHE, target_dir=str(target), regen_dir=str(regen.parent),  # the stores' source path
                      out_dir=str(tmp_path / "cache"), stats_path=str(tmp_path / "cache_stats.json"))
    monkeypatch.setattr(build, "load_target", lambda *a, **k: pytest.fail("a token-only store loaded the target"))
    stats = run_cache(cfg, hidden_states={"train": "online"}, rebuild_stale=True)
    path = tmp_path / "cache" / "train.zarr"
    assert "token-only store (train.hidden_states: online), 710 tokens, 5 bytes a token" in capsys.readouterr().out
    assert sorted(open_store(path).array_keys()) == ["input_ids", "loss_mask", "offsets", "source_index"]
    token_manifest, full_manifest = read_manifest(path), read_manifest(stores["bf16"])
    assert token_manifest.pop("hidden_states") == "online" and "hidden_states" not in full_manifest
    assert token_manifest == full_manifest
    assert cache_identity(read_manifest(path)) == cache_identity(full_manifest)
    split = stats["splits"]["train"]
    assert split["hidden_states"] == "online" and split["raw_bf16_bytes_per_token"] == 5.0
    assert split["hidden_bytes_per_token"] == 0 and split["hidden_compression_ratio"] is None
    assert split["bytes_per_token"] < 20  # the token arrays, compressed, with their chunk headers
    with pytest.raises(UserError, match=r"tokens.zarr: a token-only store .* holds no hidden states"):
        CacheDataset(stores["tokens"])
    report = verify_cache(path, target, n_samples=4)
    assert report["ok"] and report["samples"] == [] and report["hidden_states"] == "online"
    monkeypatch.undo()
    run_cache(cfg, hidden_states={"train": "cache"}, rebuild_stale=True)  # the param flipped back
    files = {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}
    want = {str(f.relative_to(stores["bf16"])): f.read_bytes() for f in sorted(stores["bf16"].rglob("*"))
            if f.is_file()}
    assert files == want


def test_consumer_hidden_states_reads_each_splits_consumer(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"train": {"hidden_states": "online"}, "eval_offline": {}}))
    assert consumer_hidden_states(params) == {"train": "online", "eval": "cache"}
    assert "hidden_states" not in TrainConfig(hidden_states="online").identity_dict()  # a run resumes across it
    params.write_text(yaml.safe_dump({"train": {}, "eval_offline": {"hidden_states": "disk"}}))
    with pytest.raises(ParamsError, match=r"params.yaml: eval_offline.hidden_states must be one of cache, online; "
                                          r"got 'disk'"):
        consumer_hidden_states(params)


# -- the cache's cost -----------------------------------------------------------------------------------------------
def test_the_estimate_is_a_stores_uncompressed_bytes(stores):
    """bytes a token = the token-dimension arrays' uncompressed bytes of a store, for both aux dtypes; Qwen3-4B's
    shapes (H 2560, 5 aux layers) pinned: ~30 KB a token in bf16, ~18 KB with fp8 aux."""
    for aux_dtype in ("bf16", "fp8_e4m3"):
        group = open_store(stores[aux_dtype])
        m = read_manifest(stores[aux_dtype])
        tokens = int(m["num_tokens"])
        raw = sum(group[a].nbytes for a in group.array_keys() if group[a].shape[0] == tokens)
        per_token = cache_bytes_per_token(m["hidden_size"], len(m["aux_layer_ids"]), aux_dtype)
        assert raw == tokens * per_token == estimate_cache_bytes(m["hidden_size"], len(LAYERS), aux_dtype, tokens)
    assert cache_bytes_per_token(2560, 5, "bf16") == 30725 and cache_bytes_per_token(2560, 5, "fp8_e4m3") == 17945
    with pytest.raises(UserError, match="aux_dtype must be one of bf16, fp8_e4m3; got 'fp16'"):
        cache_bytes_per_token(2560, 5, "fp16")


def test_cache_stage_refuses_to_start_without_the_disk_space(tmp_path, target, regen, monkeypatch, capsys):
    """The stage prints the bytes its stores will take and, when the free space cannot hold them uncompressed,
    refuses in one line naming the figure, the free space and the online switch; nothing is written. A resumed
    store asks only for its tokens not yet written; token-only splits ask for nothing."""
    import dspark_core.cache.build as build

    (tmp_path / "regen").mkdir()
    for split in ("train", "eval"):
        shutil.copy(regen, tmp_path / "regen" / f"{split}.parquet")
    cfg = CacheConfig(**{**CACHE, "splits": ("train", "eval")}, target_dir=str(target),
                      regen_dir=str(tmp_path / "regen"), out_dir=str(tmp_path / "cache"),
                      stats_path=str(tmp_path / "cache_stats.json"))
    per_token = cache_bytes_per_token(64, len(LAYERS), "bf16")
    need = 2 * 710 * per_token
    free = need - 1
    monkeypatch.setattr(build.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 * need, 0, free))
    with pytest.raises(UserError) as info:
        run_cache(cfg)
    msg = str(info.value)
    assert "\n" not in msg and f"1,420 tokens (train, eval) take {human_bytes(need)} uncompressed" in msg
    assert f"({per_token:,} bytes a token)" in msg and f"has {human_bytes(free)} free" in msg
    assert "train.hidden_states: online" in msg
    assert not (tmp_path / "cache").exists() and not (tmp_path / "cache_stats.json").exists()
    out = capsys.readouterr().out
    assert f"cache train: 710 tokens to write, {human_bytes(710 * per_token)} uncompressed ({per_token:,} bytes " \
           f"a token: 4 aux layers (bf16) + the last layer of width 64)" in out
    run_cache(cfg, hidden_states={"train": "cache", "eval": "online"})  # one split's hidden states fit
    free = 710 * per_token - 1
    with pytest.raises(UserError, match=r"the hidden states of 710 tokens \(eval\)"):
        run_cache(cfg, hidden_states={"train": "cache", "eval": "cache"})  # the train store is complete: eval's only


# -- training and evaluation: identical either way ------------------------------------------------------------------
DRAFT = dict(num_draft_layers=1, block_size=4, mask_token_id=259, num_anchors=8, markov_rank=8)


def _run(target, store, hidden_states, tmp_path, precision="fp32", data_workers=0, **draft):
    cfg = DraftConfig(**{**DRAFT, **draft})
    task = task_class(cfg.kind).from_paths(cfg, LossConfig(), target, store, hidden_states=hidden_states)
    tcfg = TrainConfig(lr=3e-3, warmup_ratio=0.0, total_steps=3, micro_batch_size=2, global_batch_size=4,
                       checkpoint_every=100, log_every=1, seed=3, precision=precision, out_dir=str(tmp_path / "run"),
                       hidden_states=hidden_states, data_workers=data_workers if hidden_states == "online" else 0)
    return train(task, tcfg, progress=False, checkpoints=False)


def _engram_table(tmp_path, target, store) -> dict:
    """draft.engram of a frozen table built from the store's token ids (what engram_build does)."""
    from dspark_core.draft.variants.engram import EngramTable, build_frozen_table, write_frozen_table
    from dspark_core.frozen_target import load_frozen_target

    eng = EngramConfig(orders=(2, 3), heads_per_order=2, table_rows=31, table_path=str(tmp_path / "table.st"))
    frozen, _ = load_frozen_target(target)
    group = open_store(store)
    ids, offs = group["input_ids"][:], group["offsets"][:]
    weights = build_frozen_table(eng, 64, (torch.from_numpy(ids[offs[n]:offs[n + 1]].astype(np.int64))
                                           for n in range(len(offs) - 1)),
                                 frozen.get_input_embeddings().weight.float())
    write_frozen_table(eng.table_path, weights, EngramTable(eng, 64).layout(),
                       read_fingerprint(target)["fingerprint"], {})
    return {"kind": "engram_markov", "engram": eng}


@pytest.mark.parametrize("case", ["baseline_bf16_autocast", "packed", "draft_memory", "engram_markov", "fp8"])
def test_training_online_is_training_on_the_cache(tmp_path, target, stores, case, one_thread):
    """Three optimiser steps of two micro-batches from the same seed: the same loss, metrics and weights, bit for
    bit, whether the hidden states come from the cache store or from the target run in the trainer (bf16 autocast
    on: it does not reach the target; packed rows, collated online by a DataLoader worker; Draft Memory's stage 1
    reads the filled states; a frozen Engram table; fp8 aux)."""
    store = stores["fp8_e4m3" if case == "fp8" else "bf16"]
    kw = {"baseline_bf16_autocast": {"precision": "bf16"}, "packed": {"packed_length": 160, "data_workers": 1},
          "draft_memory": {"kind": "draft_memory"}, "engram_markov": _engram_table(tmp_path, target, store),
          "fp8": {}}[case]
    cached = _run(target, store, "cache", tmp_path / "c", **kw)
    online = _run(target, store, "online", tmp_path / "o", **kw)
    assert len(cached.history) == len(online.history) == 3
    for a, b in zip(cached.history, online.history):
        a, b = ({k: v for k, v in row.items() if k != "step_s"} for row in (a, b))
        assert a == b and all(math.isfinite(v) for v in a.values())
    assert cached.history[0]["loss"] != cached.history[-1]["loss"]  # the steps did train
    want, got = cached.model.state_dict(), online.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_eval_offline_online_equals_the_cache(tmp_path, target, stores, model, one_thread):
    """eval_offline's metrics of a Draft Memory draft (plain keys, post_error/..., and the baseline reference on
    its anchors), read from the eval store or computed online: the same dict."""
    fp = read_fingerprint(target)["fingerprint"]
    torch.manual_seed(0)
    args = (model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    memory = build_draft(DraftConfig(**DRAFT, kind="draft_memory"), *args, aux_layer_ids=LAYERS,
                         target_fingerprint=fp)
    reference = build_draft(DraftConfig(**DRAFT), *args, aux_layer_ids=LAYERS, target_fingerprint=fp)
    cfg = EvalOfflineConfig(batch_size=3, num_anchors=8, seed=5)
    want = evaluate_offline(memory, CacheDataset(stores["bf16"]), cfg, progress=False, reference=reference)
    data = CacheDataset(stores["tokens"], hidden_states="online")
    target_states = OnlineTarget.load(target, data.manifest, "cpu", data.dtype)
    got = evaluate_offline(memory, data, cfg, progress=False, reference=reference, collator=OnlineCollator(0),
                           fill_hidden=target_states.fill)
    assert got == want and want["num_blocks"] > 0 and "post_error/baseline/tau_prob" in want


# -- the stages end to end ------------------------------------------------------------------------------------------
PARAMS = {
    "cache": {"aux_layer_ids": [1, 3], "max_length": 96, "chunk_tokens": 256, "batch_tokens": 200, "device": "cpu"},
    "draft": {"num_draft_layers": 1, "block_size": 4, "mask_token_id": 259, "num_anchors": 4, "markov_rank": 8},
    "loss": {},
    "train": {"lr": 1.0e-3, "total_steps": 2, "max_steps": 2, "micro_batch_size": 2, "global_batch_size": 2,
              "checkpoint_every": 1, "keep_checkpoints": 1, "log_every": 1, "precision": "fp32",
              "hidden_states": "online"},
    "variants": {"baseline": {}},
    "eval_offline": {"batch_size": 2, "num_anchors": 4, "hidden_states": "online"},
}


def _stage(root: Path, script: str, *args: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(REPO / "stages" / f"{script}.py"), *args], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{script} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


def test_stages_online_end_to_end(tmp_path, target, regen):
    """A params file switched to online runs cache (token-only stores: no hidden arrays) -> train -> eval_offline as
    stage scripts; flipping train.hidden_states back to cache then reruns the cache stage (hidden states written)
    and train resumes the finished run instead of starting over (the switch is not part of its identity)."""
    root = tmp_path / "proj"
    shutil.copytree(target, root / "data" / "target")
    for split in ("train", "eval"):
        (root / "data" / "regen").mkdir(parents=True, exist_ok=True)
        shutil.copy(regen, root / "data" / "regen" / f"{split}.parquet")
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS, sort_keys=False))
    out = _stage(root, "cache")
    assert "cache eval: token-only store (eval_offline.hidden_states: online)" in out
    for split in ("train", "eval"):
        store = root / "data" / "cache" / f"{split}.zarr"
        assert sorted(p.name for p in store.iterdir() if p.is_dir()) == ["input_ids", "loss_mask", "offsets",
                                                                          "source_index"]
        assert read_manifest(store)["hidden_states"] == "online"
    _stage(root, "train", "--variant", "baseline")
    assert (root / "data/train/baseline/final/model.safetensors").is_file()
    _stage(root, "eval_offline", "--variant", "baseline")
    metrics = yaml.safe_load((root / "reports/eval_offline/baseline.json").read_text())
    assert metrics["num_blocks"] > 0 and 1.0 <= metrics["tau_prob"] <= 4.0
    flipped = {**PARAMS, "train": {**PARAMS["train"], "hidden_states": "cache"}}
    (root / "params.yaml").write_text(yaml.safe_dump(flipped, sort_keys=False))
    _stage(root, "cache")
    assert (root / "data/cache/train.zarr/aux_hidden").is_dir()
    assert not (root / "data/cache/eval.zarr/aux_hidden").exists()
    out = _stage(root, "train", "--variant", "baseline")
    assert "starting over" not in out


def test_compiled_target_layers_are_a_gpu_switch_that_leaves_the_cpu_eager():
    """``compile_layers`` puts a compiled ``forward`` on each decoder layer instance and takes it off again (the
    class's forward back); ``OnlineTarget`` compiles only on a GPU, so the CPU keeps the cache's bits. The compiled
    layers' states against the cache are tests/test_online_gpu.py's (on a GPU)."""
    from dspark_core.cache.capture import compile_layers
    from dspark_core.testing import tiny_model

    model = tiny_model("qwen3")
    layers = decoder_parts(model)[1]
    compile_layers(model, True)
    assert all("forward" in layer.__dict__ for layer in layers)
    compile_layers(model, False)
    assert all("forward" not in layer.__dict__ for layer in layers)
    online = OnlineTarget(model, (0, 1), "bf16", compiled=True)
    assert online.compiled is False and all("forward" not in layer.__dict__ for layer in layers)


def test_target_compile_params_are_booleans_and_execution_keys():
    assert TrainConfig().target_compile is True and EvalOfflineConfig().target_compile is True
    assert "target_compile" in TrainConfig.EXECUTION_KEYS  # a speed knob: a run resumes across it
    with pytest.raises(ParamsError, match="target_compile"):
        TrainConfig.from_dict({"target_compile": "yes"}, src="params.yaml", prefix="train.")
