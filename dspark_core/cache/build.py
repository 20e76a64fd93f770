"""The `cache` stage: one target forward per sample, aux layers + final normalised hidden state into zarr.

``run_cache(cfg)`` builds ``{out_dir}/{split}.zarr`` for every split from ``{regen_dir}/{split}.parquet``
with the target in ``target_dir`` and writes ``stats_path`` (bytes/token, tokens/s). A store left by a
killed run resumes at its first uncommitted sample; a store built with other settings, another model or
another source file is refused (or rebuilt with ``force=True``).

The stores are built and kept in ``cache.store_dir`` (``data/cache_stores``); ``{out_dir}/{split}.zarr``, the
stage's DVC output, is a tree of hard links to the store the split's consumer reads (:mod:`~dspark_core.cache.home`:
one copy on disk, DVC's cache included).

A split whose consumer runs the target itself (``train.hidden_states`` for ``train``,
``eval_offline.hidden_states`` for ``eval``: ``online``) reads a complete store with hidden states of the same
content when the home keeps one (nothing is built or deleted), else a token-only store: the same manifest and
token arrays, no hidden arrays, no forward and no weights loaded (:func:`build_token_store`). Before any forward
the stage prints what the hidden states will take on disk (``store.estimate_cache_bytes``, times the copies DVC
makes: ``home.dvc_copies``) and refuses to start when the free space cannot hold it uncompressed.

Shape legend: B batch, L tokens (padded), K aux layers, H hidden, T tokens of a store, N samples.
"""

from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from dspark_core.cache.capture import (
    capture_batch, check_layer_ids, forward_pad_id, nonfinite_rows, plan_batches,
)
from dspark_core.cache.home import (
    adopt, dvc_copies, existing_parent, holds, home_dir, home_store, prepare_home, publish, store_attrs,
)
from dspark_core.cache.source import LONG_CONVERSATIONS, ON_TOO_LONG, TokenSamples, load_regen
from dspark_core.cache.store import (
    AUX_DTYPES, CUT_COUNTS, FORMAT_VERSION, HIDDEN_ARRAYS, HIDDEN_STATES, TOKEN_BYTES, HiddenWriter,
    cache_bytes_per_token, commit, create_store, encode_hidden, estimate_cache_bytes, human_bytes, is_store,
    mismatches, open_store, remove_store, store_stats,
)
from dspark_core.config import ParamsError, Section, device_name, one_of, positive, read_yaml, require, resolve_device
from dspark_core.dist import Dist, init_distributed, on_main
from dspark_core.errors import UserError
from dspark_core.io import read_json, sha256_file, write_json
from dspark_core.target import FINGERPRINT_FILE, check_target_dir, load_target, read_fingerprint, resolve_dtype

MIN_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class CacheConfig(Section):
    """params.yaml section ``cache``."""

    aux_layer_ids: tuple[int, ...]   # zero-based decoder layers; -1 = embedding output; never the final layer
    max_length: int = 512            # tokens per sample (prompt + response), longer ones per on_too_long
    chunk_tokens: int = 512          # tokens per zarr chunk (>= 256)
    aux_dtype: str = "bf16"          # bf16 (lossless) | fp8_e4m3 (per-token, per-layer scale)
    clevel: int = 1                  # Blosc zstd level (0 = no compression)
    batch_tokens: int = 4096         # padded tokens per forward (batch count x longest sample)
    dtype: str = "float32"           # compute dtype of the target forward
    on_too_long: str = "truncate"    # truncate (counted in the stats) | error
    long_conversations: str = "split"  # split: a sample per answer, as much context as fits | truncate: one, its head
    device: str = "auto"             # auto (cuda if available) | cpu | cuda | cuda:N
    splits: tuple[str, ...] = ("train", "eval")
    target_dir: str = "data/target"
    regen_dir: str = "data/regen"
    out_dir: str = "data/cache"      # DVC's output: hard links of the stores the consumers read
    store_dir: str | None = None     # where the stores are built and kept (null: <out_dir>_stores)
    stats_path: str = "reports/cache_stats.json"
    nproc_per_node: int = 1          # > 1: the stage re-launches itself under torchrun (one store shard a rank)

    def validate(self) -> None:
        positive("nproc_per_node", self.nproc_per_node)
        ids = list(self.aux_layer_ids)
        require(len(ids) > 0, f"aux_layer_ids needs at least one layer id; got {ids}")
        require(min(ids) >= -1, f"aux_layer_ids: layer id {min(ids)} is out of range (-1 = embedding output)")
        dups = sorted({i for i in ids if ids.count(i) > 1})
        require(not dups, f"aux_layer_ids: duplicate layer id(s) {dups} in {ids}")
        positive("max_length", self.max_length)
        require(self.chunk_tokens >= MIN_CHUNK_TOKENS,
                f"chunk_tokens must be >= {MIN_CHUNK_TOKENS}; got {self.chunk_tokens}")
        one_of("aux_dtype", self.aux_dtype, AUX_DTYPES)
        require(0 <= self.clevel <= 9, f"clevel must be in 0..9; got {self.clevel}")
        positive("batch_tokens", self.batch_tokens)
        resolve_dtype(self.dtype)
        one_of("on_too_long", self.on_too_long, ON_TOO_LONG)
        one_of("long_conversations", self.long_conversations, LONG_CONVERSATIONS)
        device_name("device", self.device)
        require(len(self.splits) > 0 and len(set(self.splits)) == len(self.splits),
                f"splits must be non-empty and distinct; got {list(self.splits)}")
        home, out = (Path(p).resolve() for p in (home_dir(self), self.out_dir))
        require(home != out and out not in home.parents and home not in out.parents,
                f"store_dir {home_dir(self)} must lie outside out_dir {self.out_dir} and hold it not (the output is "
                "DVC's, deleted before every rerun; the stores live beside it)")


# The consumer of each split and the param that says whether it reads the hidden states from the store (cache) or
# runs the target itself (online: the split's store is token-only). dvc.yaml lists both among the stage's params.
SPLIT_CONSUMERS = {"train": "train.hidden_states", "eval": "eval_offline.hidden_states"}


def consumer_hidden_states(params: str | Path) -> dict[str, str]:
    """``{split: cache | online}`` from the consumers' params (:data:`SPLIT_CONSUMERS`; default cache), each value
    checked, one line naming the field."""
    doc = read_yaml(params)
    out = {}
    for split, field in SPLIT_CONSUMERS.items():
        section, key = field.split(".")
        value = (doc.get(section) or {}).get(key, "cache")
        if value not in HIDDEN_STATES:
            raise ParamsError(f"{params}: {field} must be one of {', '.join(HIDDEN_STATES)}; got {value!r}")
        out[split] = value
    return out


def wanted_manifest(cfg: CacheConfig, model_config: Any, fingerprint: str, samples: TokenSamples,
                    source: Path, source_sha256: str, hidden_states: str = "cache") -> dict[str, Any]:
    """The manifest a store built now from ``source`` with ``cfg`` must carry; a token-only store's (``hidden_states``
    online) adds ``hidden_states: online`` (a store with hidden states leaves the key out), a store of
    ``long_conversations: split`` adds that key (``truncate`` leaves it out: one sample a row, what a manifest
    without the key reads as)."""
    token_only = {"hidden_states": "online"} if hidden_states == "online" else {}
    split = {"long_conversations": cfg.long_conversations} if cfg.long_conversations != "truncate" else {}
    return {
        "format_version": FORMAT_VERSION, "model_fingerprint": fingerprint,
        "model_type": model_config.model_type, "aux_layer_ids": list(cfg.aux_layer_ids),
        "hidden_size": int(model_config.hidden_size), "num_hidden_layers": int(model_config.num_hidden_layers),
        "vocab_size": int(model_config.vocab_size), "aux_dtype": cfg.aux_dtype, "max_length": cfg.max_length,
        "chunk_tokens": cfg.chunk_tokens, "clevel": cfg.clevel, "compute_dtype": cfg.dtype,
        "batch_tokens": cfg.batch_tokens, "on_too_long": cfg.on_too_long, "source": str(source),
        "source_sha256": source_sha256, "order": "length_desc", "num_samples": len(samples.ids),
        "num_tokens": int(samples.offsets[-1]), "truncated_samples": samples.truncated,
        "no_response_samples": samples.no_response, "conversations_split": samples.conversations_split,
        "answers_cut": samples.answers_cut, "answer_tokens_lost": samples.answer_tokens_lost, **split, **token_only,
    }


def regen_samples(cfg: CacheConfig, source: Path, vocab_size: int | None = None) -> TokenSamples:
    """The samples of the regen parquet ``source`` under ``cfg`` (max_length, on_too_long, long_conversations)."""
    return load_regen(source, cfg.max_length, cfg.on_too_long, vocab_size=vocab_size,
                      long_conversations=cfg.long_conversations)


def open_for_build(path: Path, manifest: dict[str, Any], samples: TokenSamples, force: bool,
                   rebuild_stale: bool = False):
    """Resume a matching store, else create one. A store built otherwise (other model, settings or source) is
    refused, or rebuilt when ``rebuild_stale`` (what the DVC stage does after a params change); ``force``
    always rebuilds."""
    if path.exists():
        if force:
            remove_store(path)
        elif not is_store(path):
            raise UserError(f"{path}: exists and is not a cache store; remove it or rerun with --force")
        else:
            group = open_store(path, mode="r+")
            if group.attrs.get("initialized"):
                diff = mismatches(dict(group.attrs), manifest)
                if diff:
                    what = "a cache from another model" if any(d.startswith("model_fingerprint") for d in diff) \
                        else "a cache built with other settings"
                    if rebuild_stale:
                        print(f"{path}: {what} ({'; '.join(diff)}); rebuilding it")
                        remove_store(path)
                        return create_store(path, manifest, input_ids=samples.input_ids, loss_mask=samples.loss_mask,
                                            offsets=samples.offsets, source_index=samples.order)
                    raise UserError(f"{path}: {what} ({'; '.join(diff)}); rerun the cache stage with --force "
                                    f"to rebuild it")
                return group
            remove_store(path)  # killed while being created: nothing committed yet
    return create_store(path, manifest, input_ids=samples.input_ids, loss_mask=samples.loss_mask,
                        offsets=samples.offsets, source_index=samples.order)


def _batch_arrays(samples: TokenSamples, model: torch.nn.Module, start: int, end: int,
                  cfg: CacheConfig, pad_id: int) -> list[dict[str, np.ndarray]]:
    """Forward samples ``start:end`` and return each one's storage arrays (refusing NaN / inf)."""
    offs = samples.offsets
    seqs = [torch.from_numpy(samples.input_ids[offs[i]:offs[i + 1]].astype(np.int64)) for i in range(start, end)]
    aux, last = capture_batch(model, seqs, cfg.aux_layer_ids, pad_id)  # [B, L, K, H], [B, L, H]
    bad = nonfinite_rows(aux, last).cpu()  # [B, L]
    for b, seq in enumerate(seqs):
        if bad[b, : seq.numel()].any():
            pos = int(bad[b, : seq.numel()].nonzero()[0])
            raise UserError(f"cache: target hidden states of sample {samples.ids[start + b]!r} (source row "
                            f"{int(samples.order[start + b])}) are NaN/inf from token {pos}; nothing stored "
                            f"for it. Check the target weights and cache.dtype={cfg.dtype!r}")
    encoded = encode_hidden(aux, last, cfg.aux_dtype)  # whole batch at once: one device->host copy per array
    return [{k: v[b, : seq.numel()] for k, v in encoded.items()} for b, seq in enumerate(seqs)]


def build_store(model: torch.nn.Module, fingerprint: str, cfg: CacheConfig, source: str | Path,
                dest: str | Path, force: bool = False, rebuild_stale: bool = False,
                on_commit: Callable[[int], None] | None = None, dist: Dist = Dist()) -> dict[str, Any]:
    """Build (or resume) one store ``dest`` from the regen parquet ``source``; returns :func:`store_stats`.

    ``on_commit(committed)`` runs after every commit (tests use it to simulate a kill): committed samples, or
    with several processes (``dist``, every rank calls this) the tokens this rank has written.
    """
    source, dest = Path(source), Path(dest)
    check_layer_ids(cfg.aux_layer_ids, model.config.num_hidden_layers)
    samples = regen_samples(cfg, source, model.config.vocab_size)
    manifest = wanted_manifest(cfg, model.config, fingerprint, samples, source, sha256_file(source))
    if dist.world_size > 1:
        return _build_sharded(model, cfg, samples, manifest, dest, force, rebuild_stale, on_commit, dist)
    group = open_for_build(dest, manifest, samples, force, rebuild_stale)
    if group.attrs["complete"]:  # kept as it is (DVC's persist: a re-run whose store matches): nothing computed
        return store_stats(dest)
    return store_stats(dest, _fill(group, samples, model, cfg, dest.stem, on_commit))


def build_token_store(model_config: Any, fingerprint: str, cfg: CacheConfig, source: str | Path, dest: str | Path,
                      force: bool = False, rebuild_stale: bool = False, dist: Dist = Dist()) -> dict[str, Any]:
    """A token-only store ``dest`` from the regen parquet ``source``: :func:`build_store`'s manifest (plus
    ``hidden_states: online``) and token-level arrays, no hidden arrays, no forward (``model_config``: the target's
    config.json, no weights). Complete once written; one of the same content is kept, one built otherwise refused
    or rebuilt as :func:`open_for_build` decides. Under several processes rank 0 writes it. Returns
    :func:`store_stats`."""
    source, dest = Path(source), Path(dest)
    samples = regen_samples(cfg, source, model_config.vocab_size)
    manifest = wanted_manifest(cfg, model_config, fingerprint, samples, source, sha256_file(source), "online")
    seconds = None  # kept as it was: nothing written
    if dist.is_main:
        group = open_for_build(dest, manifest, samples, force, rebuild_stale)
        if not group.attrs["complete"]:
            commit(group, samples.offsets, int(samples.offsets[-1]), 0.0, complete=True)
            seconds = 0.0
    dist.barrier()  # complete before any rank reads it
    return store_stats(dest, seconds)


# -- one store, several processes ------------------------------------------------------------------
# Rank r owns the chunk-aligned token window shard_window(...) of every array: it forwards the batches (of the
# single-process plan, so the numbers are the same bits) holding those tokens and writes whole chunks of its
# window only, so no two ranks ever write one chunk file. Progress goes to a file per rank beside the store
# (``<store>.shard<r>of<W>.json``, tied to the build_id rank 0 gives the store while it is incomplete), never to
# the shared zarr.json; rank 0 creates the store first and marks it complete after every shard reports its whole
# window, dropping the build_id: a complete store is byte for byte the one-process store.
def shard_window(total_tokens: int, chunk: int, rank: int, world: int) -> tuple[int, int]:
    """Tokens [lo, hi) of rank ``rank`` of ``world``: whole chunks, balanced; the last rank ends at the total."""
    n_chunks = -(-total_tokens // chunk)
    lo = min(total_tokens, n_chunks * rank // world * chunk)
    hi = total_tokens if rank == world - 1 else min(total_tokens, n_chunks * (rank + 1) // world * chunk)
    return lo, hi


def shard_progress_path(dest: Path, rank: int, world: int) -> Path:
    return dest.with_name(f"{dest.name}.shard{rank}of{world}.json")


def prepare_shared_store(dest: Path, manifest: dict[str, Any], samples: TokenSamples, force: bool,
                         rebuild_stale: bool, world: int):
    """Rank 0, before the others open it: resume / create / refuse the store as :func:`open_for_build` does;
    a new store forgets any shard progress files left by an older one."""
    group = open_for_build(dest, manifest, samples, force, rebuild_stale)
    if "build_id" not in group.attrs:  # a store new to sharded building (just created, or made by one process)
        group.attrs["build_id"] = uuid.uuid4().hex  # progress files of any other store at this path are stale
    for path in dest.parent.glob(f"{dest.name}.shard*of*.json"):
        if read_json(path).get("build_id") != group.attrs["build_id"] or not path.name.endswith(f"of{world}.json"):
            path.unlink()
    return group


def fill_shard(group, samples: TokenSamples, model: torch.nn.Module, cfg: CacheConfig, dest: Path, rank: int,
               world: int, on_commit: Callable[[int], None] | None = None) -> None:
    """Forward and write rank ``rank``'s window, resuming at its last recorded chunk."""
    offs, total, chunk = samples.offsets, int(samples.offsets[-1]), int(group.attrs["chunk_tokens"])
    lo, hi = shard_window(total, chunk, rank, world)
    progress = shard_progress_path(dest, rank, world)
    state = read_json(progress) if progress.is_file() else {}
    if state.get("build_id") != group.attrs["build_id"]:
        state = {"build_id": group.attrs["build_id"], "written_tokens": lo, "compute_seconds": 0.0}
    start = int(state["written_tokens"])
    if start >= hi:
        return
    first, last = int(np.searchsorted(offs, start, side="right")) - 1, int(np.searchsorted(offs, hi, side="left"))
    todo = [b for b in plan_batches(samples.lengths.tolist(), cfg.batch_tokens) if b[1] > first and b[0] < last]
    writer = HiddenWriter(group, start, tuple(n for n in HIDDEN_ARRAYS if n in group), stop_token=hi)
    pad_id, t0 = forward_pad_id(model.config), time.perf_counter()
    with tqdm(total=hi - lo, initial=start - lo, desc=f"cache {dest.stem} rank {rank}", unit="tok",
              unit_scale=True) as bar:
        for start_b, end_b in todo:
            for i, sample in zip(range(start_b, end_b), _batch_arrays(samples, model, start_b, end_b, cfg, pad_id)):
                a, b = max(int(offs[i]), writer.end), min(int(offs[i + 1]), hi)  # this rank's part not yet held
                if b > a:
                    writer.append({k: v[a - int(offs[i]): b - int(offs[i])] for k, v in sample.items()})
            written = writer.flush(final=writer.end == hi)
            bar.update(written - state["written_tokens"])
            state.update(written_tokens=written, compute_seconds=state["compute_seconds"] + time.perf_counter() - t0)
            t0 = time.perf_counter()
            write_json(progress, state)  # atomic
            if on_commit is not None:
                on_commit(written)


def finalize_shards(group, dest: Path, offsets: np.ndarray, world: int) -> float:
    """Rank 0, after every rank's fill: check each shard reported its whole window, then mark the store
    complete and drop the progress files. Returns the build's compute seconds (the slowest rank's)."""
    total, chunk = int(offsets[-1]), int(group.attrs["chunk_tokens"])
    seconds = 0.0
    for rank in range(world):
        path = shard_progress_path(dest, rank, world)
        state = read_json(path) if path.is_file() else {}
        lo, hi = shard_window(total, chunk, rank, world)
        done = int(state.get("written_tokens", lo)) if state.get("build_id") == group.attrs["build_id"] else lo
        if hi > lo and done < hi:
            raise RuntimeError(f"{dest}: shard {rank} of {world} wrote tokens [{lo}, {done}) of [{lo}, {hi}); "
                               "rerun the cache stage with the same number of processes to finish it")
        seconds = max(seconds, float(state.get("compute_seconds", 0.0)))
    commit(group, offsets, total, seconds, complete=True)
    del group.attrs["build_id"]  # it only tied the progress files: the store is now a one-process store's bytes
    for rank in range(world):
        shard_progress_path(dest, rank, world).unlink(missing_ok=True)
    return seconds


def _build_sharded(model, cfg: CacheConfig, samples: TokenSamples, manifest: dict[str, Any], dest: Path,
                   force: bool, rebuild_stale: bool, on_commit, dist: Dist) -> dict[str, Any]:
    if dist.is_main:
        prepare_shared_store(dest, manifest, samples, force, rebuild_stale, dist.world_size)
    dist.barrier()  # the store exists (and matches) before any rank opens it
    group = open_store(dest, mode="r+")
    if not group.attrs["complete"]:
        fill_shard(group, samples, model, cfg, dest, dist.rank, dist.world_size, on_commit)
    dist.barrier()  # every shard written
    seconds = None  # rank 0's stats are the ones written
    if dist.is_main and not open_store(dest).attrs["complete"]:
        seconds = finalize_shards(group, dest, samples.offsets, dist.world_size)
    dist.barrier()  # complete before anyone reads it
    return store_stats(dest, seconds)


def _fill(group, samples: TokenSamples, model: torch.nn.Module, cfg: CacheConfig, label: str,
          on_commit: Callable[[int], None] | None) -> float:
    """Forward and append every batch from the first uncommitted sample on, committing after each. Returns the
    build's compute seconds, an interrupted build's before this run included."""
    done, offs = int(group.attrs["committed_samples"]), samples.offsets
    plan = plan_batches(samples.lengths.tolist(), cfg.batch_tokens)
    todo = [b for b in plan if b[1] > done]  # the batch holding the first uncommitted sample is redone whole
    names = tuple(n for n in HIDDEN_ARRAYS if n in group)
    first_token = int(offs[todo[0][0]]) if todo else int(offs[-1])
    writer = HiddenWriter(group, first_token, names)
    pad_id = forward_pad_id(model.config)
    seconds0, t0 = float(group.attrs["compute_seconds"]), time.perf_counter()
    with tqdm(total=int(offs[-1]), initial=first_token, desc=f"cache {label}", unit="tok", unit_scale=True) as bar:
        for start, end in todo:
            for sample in _batch_arrays(samples, model, start, end, cfg, pad_id):
                writer.append(sample)
            done = commit(group, offs, writer.flush(), seconds0 + time.perf_counter() - t0)
            bar.update(int(offs[end] - offs[start]))
            if on_commit is not None:
                on_commit(done)
    seconds = seconds0 + time.perf_counter() - t0
    done = commit(group, offs, writer.flush(final=True), seconds, complete=True)
    if on_commit is not None:
        on_commit(done)
    return seconds


def run_cache(cfg: CacheConfig, force: bool = False, rebuild_stale: bool = False,
              hidden_states: dict[str, str] | None = None) -> dict[str, Any]:
    """The `cache` stage: every split's store in the home, published to ``out_dir``, then ``stats_path``. Returns
    the stats written.

    ``hidden_states``: ``{split: cache | online}`` (:func:`consumer_hidden_states`; default cache): an online
    split reads a kept store with hidden states or gets a token-only store (:func:`plan_stores`). Before any
    forward, :func:`check_disk_space`. Under ``torchrun`` each of the processes writes one shard of every store
    (rank 0 adopts, publishes and writes the stats); a CUDA device is then ``cuda:LOCAL_RANK`` whatever ``device``
    names."""
    modes = {s: (hidden_states or {}).get(s, "cache") for s in cfg.splits}
    sources = {s: Path(cfg.regen_dir) / f"{s}.parquet" for s in cfg.splits}
    samples = {s: regen_samples(cfg, src) for s, src in sources.items()}  # a missing / empty input fails first
    dist = init_distributed()
    model_config = target_model_config(cfg.target_dir)
    check_layer_ids(cfg.aux_layer_ids, model_config.num_hidden_layers)
    cached = [s for s in cfg.splits if modes[s] == "cache"]
    fingerprint = (read_fingerprint(cfg.target_dir) if cached else _stored_fingerprint(cfg.target_dir))["fingerprint"]
    device = resolve_device(cfg.device, "cache.device") if cached else None  # refused before any store moves
    if device is not None and dist.world_size > 1 and device.type == "cuda":
        device = torch.device("cuda", dist.local_rank)
    manifests = {s: wanted_manifest(cfg, model_config, fingerprint, samples[s], src, sha256_file(src))
                 for s, src in sources.items()}
    plan = on_main(dist, lambda: plan_stores(cfg, manifests, modes, force))
    pending = {s: int(samples[s].offsets[-1]) - (0 if force else _written_tokens(Path(path), manifests[s]))
               for s, (what, path) in plan.items() if what == "cache"}  # tokens whose hidden states are to write
    token_only = {s: int(samples[s].offsets[-1]) for s, (what, _) in plan.items() if what == "online"}
    check_disk_space(cfg, model_config, pending, token_only, announce=dist.is_main)
    on_main(dist, lambda: prepare_home(cfg))
    model = None
    if any(what == "cache" for what, _ in plan.values()):  # the target's weights only for stores with hidden states
        model, _ = load_target(cfg.target_dir, dtype=cfg.dtype, device=device)
    per_split = {}
    for s, (what, path) in plan.items():
        dest = Path(path)
        if what == "cache":
            per_split[s] = build_store(model, fingerprint, cfg, sources[s], dest, force, rebuild_stale, dist=dist)
        elif what == "online":
            per_split[s] = build_token_store(model_config, fingerprint, cfg, sources[s], dest, force,
                                             rebuild_stale=rebuild_stale, dist=dist)
        else:  # keep: an online consumer reads the tokens of the complete store with hidden states
            per_split[s] = store_stats(dest)
        on_main(dist, lambda s=s, dest=dest: publish(cfg, s, dest))
    stats = combine_stats(per_split)
    if dist.is_main:
        write_json(cfg.stats_path, stats)
    return stats


def plan_stores(cfg: CacheConfig, manifests: dict[str, dict[str, Any]], modes: dict[str, str],
                force: bool = False) -> dict[str, tuple[str, str]]:
    """What the stage does for each split, after the home adopted the store it builds when it lacks it
    (:func:`home.adopt`, unless ``force``): ``(cache, path)`` build or resume the store with hidden states there;
    ``(keep, path)`` an online consumer reads the tokens of the complete store with hidden states the home holds
    there, kept as it is; ``(online, path)`` a token-only store there, a store with hidden states (if any) kept
    beside it. An online split never adopts a store with hidden states: deleting it from the home frees its disk
    (once `dvc gc` drops DVC's names of its files). ``manifests``: each split's wanted manifest (with hidden
    states). Prints a line for what it adopts or keeps."""
    plan = {}
    for s, manifest in manifests.items():
        full, field = home_store(cfg, s, "cache"), SPLIT_CONSUMERS.get(s, s)
        if modes[s] == "cache":
            if not force:
                _say_adopted(s, full, adopt(cfg, s, "cache", manifest, replace=True))
            plan[s] = ("cache", str(full))
        elif not force and holds(store_attrs(full), manifest, complete=True):
            print(f"cache {s}: {field}: online reads the tokens of {full}, the store with hidden states of this "
                  "content, kept as it is (delete it to free its disk; the next run then writes a token-only store)")
            plan[s] = ("keep", str(full))
        else:
            tokens = home_store(cfg, s, "online")
            if not force:
                _say_adopted(s, tokens, adopt(cfg, s, "online", {**manifest, "hidden_states": "online"}, True))
            if full.exists():
                state = "incomplete" if holds(store_attrs(full), manifest) else "of other settings"
                print(f"cache {s}: {full}, a store with hidden states ({state}), is kept as it is; {field}: online "
                      "reads a token-only store")
            plan[s] = ("online", str(tokens))
    return plan


def _say_adopted(split: str, home: Path, source: str | None) -> None:
    if source is not None:
        print(f"cache {split}: {home} taken from {source}")


def target_model_config(target_dir: str | Path) -> Any:
    """The target's config (model type, widths, layer count, vocabulary) from its config.json, weights unread."""
    from dspark_core.frozen_target import read_model_config

    check_target_dir(Path(target_dir))
    config = read_model_config(target_dir)
    if config is None:  # a field only transformers' config class fills in
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    return config


def _stored_fingerprint(target_dir: str | Path) -> dict[str, str]:
    """fingerprint.json as the target stage wrote it (a token-only store reads no weights, so they are not hashed
    here: the consumer that loads them checks them), or the fingerprint computed when there is none."""
    f = Path(target_dir) / FINGERPRINT_FILE
    return read_json(f) if f.is_file() else read_fingerprint(target_dir)


def _written_tokens(dest: Path, manifest: dict[str, Any]) -> int:
    """Tokens whose hidden states a store of this content at ``dest`` already holds (a complete one: all; one being
    built: its committed prefix); 0 when there is none (or one built otherwise, rebuilt or refused later)."""
    if not is_store(dest):
        return 0
    try:
        attrs = dict(open_store(dest).attrs)
    except UserError:  # damaged: build_store says so
        return 0
    if not attrs.get("initialized") or mismatches(attrs, manifest):
        return 0
    return int(manifest["num_tokens"]) if attrs.get("complete") else int(attrs.get("committed_tokens", 0))


def check_disk_space(cfg: CacheConfig, model_config: Any, pending: dict[str, int], token_only: dict[str, int],
                     announce: bool = True) -> int:
    """Print what each split's store will take (``pending``: tokens whose hidden states are still to be written, by
    split; ``token_only``: tokens of the token-only stores) and refuse to start, in one line, when the free space
    under ``store_dir`` (``shutil.disk_usage``) cannot hold the pending hidden states uncompressed, as many times as
    they will exist there: once, or twice when DVC's commit copies them into a cache on that disk
    (:func:`home.dvc_copies`). Returns those bytes."""
    k, h = len(cfg.aux_layer_ids), int(model_config.hidden_size)
    per_token = cache_bytes_per_token(h, k, cfg.aux_dtype)
    where = existing_parent(home_dir(cfg))
    extra, why = dvc_copies(where) if sum(pending.values()) else (0, "")
    need = estimate_cache_bytes(h, k, cfg.aux_dtype, sum(pending.values())) * (1 + extra)
    free = shutil.disk_usage(where).free
    if announce:
        for split, tokens in pending.items():
            print(f"cache {split}: {tokens:,} tokens to write, {human_bytes(tokens * per_token)} uncompressed "
                  f"({per_token:,} bytes a token: {k} aux layers ({cfg.aux_dtype}) + the last layer of width {h}); "
                  f"{human_bytes(free)} free on {where}")
        if why:
            print(f"cache: on disk {'twice' if extra else 'once'}: {why}")
        for split, tokens in token_only.items():
            print(f"cache {split}: token-only store ({SPLIT_CONSUMERS.get(split, split)}: online), {tokens:,} tokens, "
                  f"{TOKEN_BYTES} bytes a token")
    if need > free:
        splits = ", ".join(s for s, tokens in pending.items() if tokens)
        twice = f", twice ({why})" if extra else ""
        raise UserError(f"cache: the hidden states of {sum(pending.values()):,} tokens ({splits}) take "
                        f"{human_bytes(need)} uncompressed ({per_token:,} bytes a token{twice}), but {where} has "
                        f"{human_bytes(free)} free; free some space, or train without a cache: set "
                        f"train.hidden_states: online (and eval_offline.hidden_states: online), and the cache stage "
                        f"writes token-only stores")
    return need


def combine_stats(per_split: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Token-weighted totals over splits (bytes/token, ratio, tokens/s: of the stores with hidden states), with each
    split's own stats."""
    tokens = sum(s["num_tokens"] for s in per_split.values())
    forwarded = sum(s["num_tokens"] for s in per_split.values() if s.get("hidden_states", "cache") == "cache")
    stored = sum(s["bytes_per_token"] * s["num_tokens"] for s in per_split.values())
    raw = sum(s["raw_bf16_bytes_per_token"] * s["num_tokens"] for s in per_split.values())
    hidden = sum(s["hidden_bytes_per_token"] * s["num_tokens"] for s in per_split.values())
    hidden_raw = sum(s["hidden_raw_bf16_bytes_per_token"] * s["num_tokens"] for s in per_split.values())
    seconds = sum(s["compute_seconds"] for s in per_split.values())
    return {
        "bytes_per_token": stored / tokens, "raw_bf16_bytes_per_token": raw / tokens,
        "compression_ratio": stored / raw, "hidden_compression_ratio": hidden / hidden_raw if hidden_raw else None,
        "tokens_per_s": forwarded / seconds if seconds > 0 else None, "compute_seconds": seconds,
        "num_tokens": tokens, "num_samples": sum(s["num_samples"] for s in per_split.values()),
        "truncated_samples": sum(s["truncated_samples"] for s in per_split.values()),
        "no_response_samples": sum(s["no_response_samples"] for s in per_split.values()),
        **{k: _sum_counts([s.get(k) for s in per_split.values()]) for k in CUT_COUNTS},
        "aux_dtype": next(iter(per_split.values()))["aux_dtype"], "splits": per_split,
    }


def _sum_counts(counts: list[int | None]) -> int | None:
    """A counter summed over splits; None when a split's store's manifest lacks it."""
    return None if any(c is None for c in counts) else sum(counts)
