"""The target-cache store: a zarr v3 group of token-major arrays with a manifest in its attrs.

Layout (see docs/DESIGN.md, "Cache store"), every array chunked along tokens (C = chunk_tokens):

    input_ids    [T] int32         loss_mask [T] uint8 (1 on the answers' loss spans)
    aux_hidden   [T, K, H] uint16  (bf16 bits)   or uint8 (fp8 e4m3 bits) + aux_scale [T, K] float32
    last_hidden  [T, H] uint16     (bf16 bits of the final *normalised* hidden state, always lossless)
    offsets      [N + 1] int64     sample n = tokens offsets[n]:offsets[n + 1]
    source_index [N] int64         row of sample n in the source parquet (sorted by length; a split row: several)

Crash safety: ``input_ids``, ``loss_mask``, ``offsets`` and ``source_index`` are written when the store
is created (then ``initialized`` is set). Hidden states are appended by :class:`HiddenWriter`, which
writes whole chunks only (each chunk file is replaced atomically by zarr's LocalStore); after the data
is on disk, :func:`commit` records ``committed_samples`` / ``committed_tokens`` in the attrs. A killed
run therefore never leaves a sample marked done whose data is missing, and a restart continues at the
first uncommitted sample (reloading the committed tail of the last partial chunk).

Token-only stores (manifest ``hidden_states: online``, written when the split's consumer runs the target itself:
``train.hidden_states`` / ``eval_offline.hidden_states``) hold the same manifest and token-level arrays and no
hidden arrays; they are complete when created.

Integrity: every chunk of every array ends with a CRC-32C of its compressed bytes (zarr v3's ``crc32c`` codec,
last in the codec chain, format version 2). A damaged chunk is a :class:`DamagedChunkError` naming the store, the
array, the chunk file and the tokens it holds (:func:`read_rows`); :func:`bad_chunks` checks every chunk file's
checksum without decompressing anything (``dspark cache verify``).

Shape legend: T tokens of a store, N samples, K aux layers, H hidden, C chunk_tokens, L tokens of a sample.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Sequence

import google_crc32c
import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from dspark_core.errors import UserError

FORMAT_VERSION = 2  # 2: a CRC-32C at the end of every chunk
AUX_DTYPES = ("bf16", "fp8_e4m3")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
HIDDEN_ARRAYS = ("aux_hidden", "aux_scale", "last_hidden")
HIDDEN_STATES = ("cache", "online")  # a store with the hidden states / a token-only store (manifest hidden_states)
TOKEN_BYTES = 5  # input_ids int32 + loss_mask uint8, a token
# Manifest keys that decide the content of a store: a store built with other values is never resumed.
CONTENT_KEYS = (
    "format_version", "model_fingerprint", "aux_layer_ids", "aux_dtype", "max_length", "chunk_tokens",
    "clevel", "compute_dtype", "batch_tokens", "on_too_long", "source_sha256", "hidden_states", "long_conversations",
)
# The value of a content key a manifest leaves out: a store with hidden states does not write ``hidden_states``,
# so its manifest (and its bytes) are those of a store built before token-only stores existed; nor does a store of
# ``long_conversations: truncate`` (one sample a regen row, cut at its head).
CONTENT_DEFAULTS = {"hidden_states": "cache", "long_conversations": "truncate"}
# What making the samples cut, per store (None in stats where a manifest lacks them)
CUT_COUNTS = ("conversations_split", "answers_cut", "answer_tokens_lost")


# -- codecs and encodings ------------------------------------------------------------------------
def blosc_codec(clevel: int, typesize: int, chunk_bytes: int) -> BloscCodec:
    """Blosc zstd with byte shuffle and one block per chunk (best measured ratio on bf16 activations)."""
    return BloscCodec(cname="zstd", clevel=clevel, shuffle="shuffle" if typesize > 1 else "noshuffle",
                      typesize=typesize, blocksize=chunk_bytes)


def chunk_codecs(clevel: int, typesize: int, chunk_bytes: int) -> list:
    """The bytes-to-bytes chain of every array: blosc, then a CRC-32C of the compressed chunk (4 bytes appended)."""
    return [blosc_codec(clevel, typesize, chunk_bytes), Crc32cCodec()]


def checksum_ok(chunk: bytes) -> bool:
    """Whether a chunk file's trailing CRC-32C (little-endian, of all bytes before it) matches its contents."""
    if len(chunk) < 4:
        return False
    return google_crc32c.value(chunk[:-4]) == int.from_bytes(chunk[-4:], "little")


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    """bf16 bits of ``x`` (any float dtype, any shape) as a uint16 numpy array (round to nearest even)."""
    return x.detach().to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)


def bf16_from_bits(bits: np.ndarray) -> torch.Tensor:
    """Inverse of :func:`bf16_bits`: a bfloat16 tensor of the same shape."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def bf16_bits_to(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Decode bf16 bits into ``dtype``; to float32 by a 16-bit shift (exact, ~8x faster than torch's cast)."""
    if dtype == torch.bfloat16:
        return bf16_from_bits(bits)
    return torch.from_numpy((bits.astype(np.uint32) << 16).view(np.float32)).to(dtype)


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 e4m3: ``x [..., H]`` -> ``(q [..., H] float8_e4m3fn, scale [...] float32)``, x ~ q * scale."""
    amax = x.detach().float().abs().amax(dim=-1)  # [...]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [...]
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [..., H]
    return q, scale


def fp8_scale_up(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [..., H]`` float8_e4m3fn and ``scale [...]`` -> float32 ``q * scale`` (any device: one exactly rounded
    float32 product an element, the same bits on every device)."""
    return q.float() * scale.float().unsqueeze(-1)


def fp8_dequantize(bits: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """``bits [..., H]`` uint8 (fp8 e4m3) and ``scale [...]`` float32 -> float32 ``[..., H]``."""
    q = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn)  # [..., H]
    return fp8_scale_up(q, torch.from_numpy(np.ascontiguousarray(scale)))


def encode_hidden(aux: torch.Tensor, last: torch.Tensor, aux_dtype: str) -> dict[str, np.ndarray]:
    """Storage form of ``aux [..., K, H]`` and ``last [..., H]`` (any float dtype, any device)."""
    out = {"last_hidden": bf16_bits(last)}
    if aux_dtype == "bf16":
        out["aux_hidden"] = bf16_bits(aux)
    elif aux_dtype == "fp8_e4m3":
        q, scale = fp8_quantize(aux)
        out["aux_hidden"] = q.cpu().view(torch.uint8).numpy()
        out["aux_scale"] = scale.cpu().numpy().astype(np.float32)
    else:
        raise UserError(f"aux_dtype must be one of {', '.join(AUX_DTYPES)}; got {aux_dtype!r}")
    return out


def decode_hidden(arrays: dict[str, np.ndarray], aux_dtype: str,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage form (as read from a store) -> ``(aux [..., K, H], last [..., H])`` in ``dtype``."""
    last = bf16_bits_to(arrays["last_hidden"], dtype)
    if aux_dtype == "bf16":
        aux = bf16_bits_to(arrays["aux_hidden"], dtype)
    else:
        aux = fp8_dequantize(arrays["aux_hidden"], arrays["aux_scale"]).to(dtype)
    return aux, last


def roundtrip_hidden(aux: torch.Tensor, last: torch.Tensor, aux_dtype: str,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_hidden(encode_hidden(aux, last, aux_dtype), aux_dtype, dtype)`` computed where the tensors are:
    ``aux [..., K, H]`` and ``last [..., H]`` as a store would hold and its reader give them, bit for bit
    (bf16 rounding; or fp8 e4m3 with its per-token scale for aux), without a copy to the host."""
    last = last.to(torch.bfloat16).to(dtype)  # bf16 -> float32 is exact: the reader's 16-bit shift
    if aux_dtype == "bf16":
        return aux.to(torch.bfloat16).to(dtype), last
    if aux_dtype == "fp8_e4m3":
        q, scale = fp8_quantize(aux)  # [..., K, H], [..., K]
        return fp8_scale_up(q, scale).to(dtype), last
    raise UserError(f"aux_dtype must be one of {', '.join(AUX_DTYPES)}; got {aux_dtype!r}")


def token_only(manifest: dict[str, Any]) -> bool:
    """Whether the store of ``manifest`` is token-only (no hidden arrays; its consumers run the target)."""
    return manifest.get("hidden_states", CONTENT_DEFAULTS["hidden_states"]) == "online"


# -- sizes -------------------------------------------------------------------------------------------
def cache_bytes_per_token(hidden_size: int, num_aux_layers: int, aux_dtype: str) -> int:
    """Uncompressed bytes a token takes in a store with hidden states: ``K`` aux layers and the last normed state
    of ``hidden_size`` H, plus ``input_ids`` and ``loss_mask`` (5). bf16 aux: ``2 (K + 1) H + 5``; fp8 e4m3 aux
    (one float32 scale a token and layer): ``K H + 4 K + 2 H + 5``. A token-only store holds 5."""
    k, h = int(num_aux_layers), int(hidden_size)
    if aux_dtype == "bf16":
        return 2 * (k + 1) * h + TOKEN_BYTES
    if aux_dtype == "fp8_e4m3":
        return k * h + 4 * k + 2 * h + TOKEN_BYTES
    raise UserError(f"aux_dtype must be one of {', '.join(AUX_DTYPES)}; got {aux_dtype!r}")


def estimate_cache_bytes(hidden_size: int, num_aux_layers: int, aux_dtype: str, tokens: int) -> int:
    """Uncompressed bytes of the stores holding the hidden states of ``tokens`` tokens (the per-sample
    ``offsets`` / ``source_index``, 16 bytes a sample, left out): what the cache stage needs on disk at most.
    Blosc zstd stores bf16 activations in about 0.7x of it (``reports/cache_stats.json``: ``compression_ratio``).
    E.g. Qwen3-4B (H 2560), 5 aux layers, bf16: 30,725 bytes a token."""
    return int(tokens) * cache_bytes_per_token(hidden_size, num_aux_layers, aux_dtype)


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units (``"38.2 TB"``)."""
    units, i = ("B", "kB", "MB", "GB", "TB", "PB"), 0
    while abs(n) >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:,.0f} {units[i]}" if i == 0 else f"{n:,.1f} {units[i]}"


# -- creation, opening, manifest -------------------------------------------------------------------
def is_store(path: str | Path) -> bool:
    return (Path(path) / "zarr.json").is_file()


def remove_store(path: str | Path) -> None:
    """Delete a cache store; refuses anything that is not a zarr store (never deletes a random folder)."""
    path = Path(path)
    if not path.exists():
        return
    if not is_store(path):
        raise UserError(f"{path}: exists and is not a zarr store; refusing to delete it (remove it yourself)")
    shutil.rmtree(path)


def create_store(path: str | Path, manifest: dict[str, Any], *, input_ids: np.ndarray, loss_mask: np.ndarray,
                 offsets: np.ndarray, source_index: np.ndarray) -> zarr.Group:
    """Create an empty store (hidden arrays unwritten) holding the token-level arrays; returns the group. A
    token-only manifest (``hidden_states: online``) gets no hidden arrays at all.

    ``manifest`` needs at least aux_layer_ids, hidden_size, aux_dtype, chunk_tokens, clevel.
    """
    path = Path(path)
    c = int(manifest["chunk_tokens"])
    k, h = len(manifest["aux_layer_ids"]), int(manifest["hidden_size"])
    n_tok, n_smp = int(offsets[-1]), len(offsets) - 1
    clevel = int(manifest["clevel"])
    group = zarr.open_group(zarr.storage.LocalStore(path), mode="w", zarr_format=3)
    group.attrs.update({**manifest, "initialized": False, "complete": False,
                        "committed_samples": 0, "committed_tokens": 0, "compute_seconds": 0.0})

    def make(name: str, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: Any) -> zarr.Array:
        itemsize = np.dtype(dtype).itemsize
        return group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0,
                                  compressors=chunk_codecs(clevel, itemsize, int(np.prod(chunks)) * itemsize))

    aux_bits = np.uint16 if manifest["aux_dtype"] == "bf16" else np.uint8
    make("input_ids", (n_tok,), (c,), np.int32)[:] = input_ids
    make("loss_mask", (n_tok,), (c,), np.uint8)[:] = loss_mask
    if not token_only(manifest):
        make("aux_hidden", (n_tok, k, h), (c, k, h), aux_bits)
        if manifest["aux_dtype"] == "fp8_e4m3":
            make("aux_scale", (n_tok, k), (c, k), np.float32)
        make("last_hidden", (n_tok, h), (c, h), np.uint16)
    meta_chunk = (max(1, min(n_smp + 1, 1 << 16)),)
    make("offsets", (n_smp + 1,), meta_chunk, np.int64)[:] = offsets
    make("source_index", (n_smp,), meta_chunk, np.int64)[:] = source_index
    group.attrs.update({"initialized": True})
    return group


def open_store(path: str | Path, mode: str = "r") -> zarr.Group:
    path = Path(path)
    if not is_store(path):
        raise UserError(f"{path}: not a cache store (no zarr.json); run the cache stage first")
    try:
        group = zarr.open_group(zarr.storage.LocalStore(path, read_only=(mode == "r")), mode=mode, zarr_format=3)
        list(group.arrays())  # every array's zarr.json parsed here, not deep inside a later read
    except (ValueError, KeyError, TypeError, OSError) as e:  # json.JSONDecodeError is a ValueError
        raise UserError(f"{path}: cache store metadata is damaged ({type(e).__name__}: {str(e)[:120]}); rebuild "
                        "the store with `dvc repro -f cache`") from None
    if "format_version" not in group.attrs:
        raise UserError(f"{path}: zarr group without a dspark cache manifest")
    return group


def read_manifest(path: str | Path, require_complete: bool = True) -> dict[str, Any]:
    """The manifest of a store; by default refuses an unfinished store and an unknown format."""
    attrs = dict(open_store(path).attrs)
    if attrs["format_version"] != FORMAT_VERSION:
        older = " (an older store, without chunk checksums)" if attrs["format_version"] < FORMAT_VERSION else ""
        raise UserError(f"{path}: cache format_version {attrs['format_version']}{older} is not supported "
                        f"(this code reads {FORMAT_VERSION}); rebuild it with `dvc repro -f cache`")
    if require_complete and not attrs.get("complete"):
        raise UserError(f"{path}: cache store is incomplete ({attrs.get('committed_samples', 0)} of "
                        f"{attrs.get('num_samples')} samples written); rerun the cache stage to finish it")
    return attrs


REBUILD_HINT = "rebuild it with `dvc repro -f cache` (or `python stages/cache.py --force`)"


def check_store_contents(path: str | Path, manifest: dict[str, Any] | None = None) -> np.ndarray:
    """Refuse a complete store whose arrays do not hold what its manifest says; returns its ``offsets [N + 1]``.

    Checks ``offsets`` against the manifest's ``num_samples`` / ``num_tokens``, every array's token count and the
    hidden arrays' ``[K, H]``, and that every chunk file of the hidden arrays exists: zarr reads a missing chunk
    as its fill value (zeros), so a truncated copy of a store would otherwise train on zeros without a word.
    (Only the hidden arrays: zarr skips writing a chunk equal to the fill value, which a chunk of bf16
    activations never is, but a ``loss_mask`` chunk of a long prompt may be.)
    """
    path = Path(path)
    m = dict(manifest) if manifest is not None else read_manifest(path)
    group = open_store(path)
    n_smp, n_tok = int(m["num_samples"]), int(m["num_tokens"])
    have = set(group.array_keys())
    hidden = [] if token_only(m) else \
        ["aux_hidden", "last_hidden"] + (["aux_scale"] if m.get("aux_dtype") == "fp8_e4m3" else [])
    lacking = [a for a in ("input_ids", "loss_mask", "offsets", "source_index", *hidden) if a not in have]
    if lacking:
        raise UserError(f"{path}: cache store lacks the array(s) {lacking}; {REBUILD_HINT}")
    offsets = np.asarray(read_rows(path, group["offsets"], 0, n_smp + 1, "offsets"), dtype=np.int64)  # [N + 1]
    if len(offsets) - 1 != n_smp or int(offsets[-1]) != n_tok or int(offsets[0]) != 0 or (np.diff(offsets) < 0).any():
        raise UserError(f"{path}: the manifest says {n_smp} samples / {n_tok} tokens, but its offsets hold "
                        f"{len(offsets) - 1} samples / {int(offsets[-1]) if len(offsets) else 0} tokens; the store "
                        f"is truncated or damaged; {REBUILD_HINT}")
    k, h = len(m["aux_layer_ids"]), int(m["hidden_size"])
    want_shapes = {"input_ids": (n_tok,), "loss_mask": (n_tok,), "aux_hidden": (n_tok, k, h),
                   "last_hidden": (n_tok, h), "aux_scale": (n_tok, k), "source_index": (n_smp,)}
    for name in [a for a in want_shapes if a in have]:
        if tuple(group[name].shape) != want_shapes[name]:
            raise UserError(f"{path}: array {name} has shape {tuple(group[name].shape)}, the manifest says "
                            f"{want_shapes[name]}; {REBUILD_HINT}")
    for name in hidden:
        arr = group[name]
        chunk = int(arr.chunks[0])
        n_chunks = -(-n_tok // chunk)
        tail = (0,) * (arr.ndim - 1)
        missing = [i for i in range(n_chunks)
                   if not (path / name / arr.metadata.encode_chunk_key((i, *tail))).is_file()]
        if missing:
            lo = missing[0] * chunk
            raise UserError(f"{path}: truncated cache store: {len(missing)} of {n_chunks} chunk(s) of {name} are "
                            f"missing (the first holds tokens {lo}..{min(lo + chunk, n_tok) - 1}); {REBUILD_HINT}")
    return offsets


# -- chunk checksums ---------------------------------------------------------------------------------
class DamagedChunkError(UserError):
    """A chunk file whose CRC-32C does not match its bytes (a bad disk, a torn copy)."""


def _chunk_rows(arr: zarr.Array, index: tuple[int, ...]) -> tuple[int, int]:
    """First and last row (token, or sample for the per-sample arrays) of chunk ``index`` of ``arr``."""
    c = int(arr.chunks[0])
    return index[0] * c, min((index[0] + 1) * c, int(arr.shape[0])) - 1


def bad_chunks(path: str | Path, names: Sequence[str] | None = None,
               rows: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Chunk files of ``names`` (default: every array) whose checksum fails, optionally only those holding rows
    ``rows = (start, stop)``; each as ``{"array", "chunk" (file under the store), "rows" [first, last]}``.

    Reads every chunk file once and decompresses nothing. A chunk file that does not exist is not listed (zarr
    reads it as the fill value; :func:`check_store_contents` refuses a store whose hidden chunks are missing)."""
    path = Path(path)
    group = open_store(path)
    out = []
    for name in names if names is not None else sorted(group.array_keys()):
        arr = group[name]
        c = int(arr.chunks[0])
        first, last = (0, arr.cdata_shape[0]) if rows is None else (rows[0] // c, -(-rows[1] // c))
        for index in np.ndindex(last - first, *arr.cdata_shape[1:]):
            index = (first + index[0], *index[1:])
            key = arr.metadata.encode_chunk_key(index)
            f = path / name / key
            if f.is_file() and not checksum_ok(f.read_bytes()):
                out.append({"array": name, "chunk": f"{name}/{key}", "rows": list(_chunk_rows(arr, index))})
    return out


def describe_bad_chunks(bad: list[dict[str, Any]]) -> str:
    first = bad[0]
    unit = "samples" if first["array"] in ("offsets", "source_index") else "tokens"
    rows = f"{unit} {first['rows'][0]}..{first['rows'][1]}"
    more = f" (and {len(bad) - 1} more chunk(s))" if len(bad) > 1 else ""
    return f"chunk {first['chunk']} ({rows}) fails its CRC-32C checksum{more}"


def read_rows(path: str | Path, arr: zarr.Array, start: int, stop: int, what: str = "") -> np.ndarray:
    """``arr[start:stop]`` of the store at ``path``; a damaged chunk is a :class:`DamagedChunkError` naming the
    store, ``what`` was read (e.g. "sample 3 (tokens 40..89)"), the chunk and how to rebuild the store."""
    try:
        return arr[start:stop]
    except Exception as e:  # zarr says "Stored and computed checksum do not match" and nothing else
        bad = bad_chunks(path, [arr.basename], (start, stop))
        if not bad:
            raise
        head = f"{path}: {what + ' cannot be read: ' if what else ''}"
        raise DamagedChunkError(f"{head}{describe_bad_chunks(bad)}; the store is damaged; {REBUILD_HINT}") from e


def mismatches(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Human-readable differences of the content-defining manifest keys."""
    out = []
    for key in CONTENT_KEYS:
        a, b = stored.get(key, CONTENT_DEFAULTS.get(key)), wanted.get(key, CONTENT_DEFAULTS.get(key))
        if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
            out.append(f"{key}: stored {a!r}, now {b!r}")
    return out


# -- appending hidden states -------------------------------------------------------------------------
class HiddenWriter:
    """Append per-sample hidden arrays in store order; writes whole chunks only until ``flush(final=True)``.

    The buffer starts at the chunk boundary at or before ``start_token``; the committed tokens between
    that boundary and ``start_token`` are reloaded from the store so the chunk is rewritten whole.
    ``stop_token`` (default: the store's end) is where the final flush must end: a shard of a store built by
    several processes writes the chunk-aligned window [start_token, stop_token) only.
    """

    def __init__(self, group: zarr.Group, start_token: int, names: tuple[str, ...], stop_token: int | None = None):
        self.arrays = {n: group[n] for n in names}
        self.chunk = int(group.attrs["chunk_tokens"])
        self.total = int(group.attrs["num_tokens"]) if stop_token is None else int(stop_token)  # final flush end
        self.base = (start_token // self.chunk) * self.chunk  # first token held in the buffer
        self.parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
        if start_token > self.base:
            self.append({n: a[self.base:start_token] for n, a in self.arrays.items()})
        self.end = start_token

    def append(self, sample: dict[str, np.ndarray]) -> None:
        """Add one sample's arrays (each with its tokens on axis 0)."""
        lengths = {v.shape[0] for v in sample.values()}
        if len(lengths) != 1 or set(sample) != set(self.parts):
            raise RuntimeError(f"HiddenWriter.append: arrays {sorted(sample)} with token counts {sorted(lengths)}")
        for n, v in sample.items():
            self.parts[n].append(v)
        self.end = self.base + sum(p.shape[0] for p in self.parts[next(iter(self.parts))])

    def flush(self, final: bool = False) -> int:
        """Write the whole chunks held (all tokens if ``final``); returns the written token prefix."""
        stop = self.end if final else self.base + ((self.end - self.base) // self.chunk) * self.chunk
        if final and self.end != self.total:
            raise RuntimeError(f"HiddenWriter: final flush at token {self.end}, store holds {self.total}")
        if stop > self.base:
            for n, a in self.arrays.items():
                buf = np.concatenate(self.parts[n], axis=0)  # [tokens held, ...]
                a[self.base:stop] = buf[: stop - self.base]
                self.parts[n] = [buf[stop - self.base:]]
            self.base = stop
        return self.base


def commit(group: zarr.Group, offsets: np.ndarray, written_tokens: int, compute_seconds: float,
           complete: bool = False) -> int:
    """Record as done every sample whose tokens all lie below ``written_tokens``; returns their count.

    ``compute_seconds`` (the build's time so far, kept for a resumed build) is dropped when the store is complete:
    a complete store's bytes depend on its inputs alone, so a stage re-run that makes the same hidden states
    leaves DVC's hash, and the stages after it, as they were. The build's time goes to the stage's stats."""
    n_done = int(np.searchsorted(offsets, written_tokens, side="right")) - 1
    group.attrs.update({"committed_samples": n_done, "committed_tokens": int(offsets[n_done]),
                        "compute_seconds": float(compute_seconds), "complete": bool(complete)})
    if complete:
        del group.attrs["compute_seconds"]
    return n_done


# -- size statistics ---------------------------------------------------------------------------------
def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def store_stats(path: str | Path, compute_seconds: float | None = None) -> dict[str, Any]:
    """Stored bytes per token (whole store and per array) against raw bf16, from the files on disk; tokens/s
    from ``compute_seconds``, the build's forward time. None: a store found complete and kept, nothing computed
    (``reused``, compute_seconds 0, tokens_per_s None; the time of the build that made it is not in the store).
    A token-only store's raw figure is its token arrays' (5 bytes a token; no hidden ratio)."""
    path = Path(path)
    m = read_manifest(path)
    t, k, h = int(m["num_tokens"]), len(m["aux_layer_ids"]), int(m["hidden_size"])
    hidden_raw = 0.0 if token_only(m) else float(cache_bytes_per_token(h, k, "bf16") - TOKEN_BYTES)
    raw_per_array = {"input_ids": 4.0, "loss_mask": 1.0, "aux_hidden": 2.0 * k * h, "last_hidden": 2.0 * h}
    if token_only(m):
        raw_per_array = {"input_ids": 4.0, "loss_mask": 1.0}
    arrays = {}
    for child in sorted(p for p in path.iterdir() if p.is_dir()):
        arrays[child.name] = {"bytes_per_token": _dir_bytes(child) / t,
                              "raw_bf16_bytes_per_token": raw_per_array.get(child.name, 0.0)}
    hidden_stored = sum(arrays[n]["bytes_per_token"] for n in HIDDEN_ARRAYS if n in arrays)
    total = _dir_bytes(path) / t
    raw = sum(raw_per_array.values())
    seconds = float(compute_seconds or 0.0)
    return {
        "reused": compute_seconds is None, "hidden_states": "online" if token_only(m) else "cache",
        "bytes_per_token": total, "raw_bf16_bytes_per_token": raw, "compression_ratio": total / raw,
        "hidden_bytes_per_token": hidden_stored, "hidden_raw_bf16_bytes_per_token": hidden_raw,
        "hidden_compression_ratio": hidden_stored / hidden_raw if hidden_raw else None,
        "tokens_per_s": t / seconds if seconds > 0 else None, "compute_seconds": seconds,
        "num_tokens": t, "num_samples": int(m["num_samples"]), "truncated_samples": int(m["truncated_samples"]),
        "no_response_samples": int(m["no_response_samples"]), **{k: m.get(k) for k in CUT_COUNTS},
        "long_conversations": m.get("long_conversations", CONTENT_DEFAULTS["long_conversations"]),
        "aux_dtype": m["aux_dtype"], "arrays": arrays,
    }
