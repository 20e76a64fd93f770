"""Training-side reader of a cache store: a torch ``Dataset`` of samples and a padding collator.

Reading sample n touches only the chunks that hold its tokens (zarr slices ``offsets[n]:offsets[n+1]``).
The zarr arrays are opened lazily in each process, so the dataset is safe to use with forked
``DataLoader`` workers.

Shape legend: B batch, L tokens of a sample (or of the longest in a batch), K aux layers, H hidden.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from dspark_core.cache.capture import plan_widths
from dspark_core.cache.store import (HIDDEN_STATES, REBUILD_HINT, check_store_contents, decode_hidden, open_store,
                                     read_manifest, read_rows, token_only)
from dspark_core.errors import UserError
from dspark_core.target import resolve_dtype

ITEM_KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


class CacheDataset(Dataset):
    """Samples of a complete cache store, as dicts of tensors.

    Item n: ``input_ids [L] long, loss_mask [L] bool, aux_hidden [L, K, H], last_hidden [L, H]``
    (hidden states in ``dtype``: bf16 bits decoded, or fp8 dequantised), L = min(length, max_length).
    ``hidden_states="online"`` (the consumer runs the target itself, ``cache/online.py``): no hidden arrays are
    read (a token-only store has none); item n has ``forward_width`` (int) and ``forward_padded`` (bool) instead,
    the width and padding of the cache stage's forward of sample n (``capture.plan_widths``). A token-only store
    read with ``hidden_states="cache"`` is refused.
    Refuses an incomplete store, a store of another model (``expected_fingerprint``), a store whose
    aux layers differ from ``expected_layer_ids`` when those are given, and a truncated store (offsets or
    arrays short of the manifest, missing chunk files). Reading an item whose hidden states hold NaN / inf
    is a ValueError naming the store and the sample; a chunk failing its checksum is a ``DamagedChunkError``
    naming the store, the sample and the chunk.
    """

    def __init__(self, path: str | Path, expected_fingerprint: str | None = None, max_length: int | None = None,
                 expected_layer_ids: Sequence[int] | None = None, dtype: str | torch.dtype = torch.float32,
                 hidden_states: str = "cache"):
        self.path = Path(path)
        self.manifest: dict[str, Any] = read_manifest(self.path)
        if hidden_states not in HIDDEN_STATES:
            raise UserError(f"CacheDataset: hidden_states must be one of {', '.join(HIDDEN_STATES)}; got "
                            f"{hidden_states!r}")
        if hidden_states == "cache" and token_only(self.manifest):
            raise UserError(f"{self.path}: a token-only store (the cache stage wrote it for hidden_states: online), "
                            f"it holds no hidden states; read it online, or rebuild it with hidden states")
        self.hidden_states = hidden_states
        stored_fp = self.manifest["model_fingerprint"]
        if expected_fingerprint is not None and stored_fp != expected_fingerprint:
            raise UserError(f"{self.path}: cache from another model (its model_fingerprint is {stored_fp}, "
                            f"the target's is {expected_fingerprint}); rebuild the cache stage")
        stored_ids = list(self.manifest["aux_layer_ids"])
        if expected_layer_ids is not None and stored_ids != list(expected_layer_ids):
            raise UserError(f"{self.path}: cache holds aux layers {stored_ids}, the caller expects "
                            f"{list(expected_layer_ids)}; rebuild the cache stage with matching cache.aux_layer_ids")
        if max_length is not None and max_length <= 0:
            raise UserError(f"CacheDataset: max_length must be > 0; got {max_length}")
        self.max_length = max_length
        self.dtype = resolve_dtype(dtype)
        self.aux_dtype = self.manifest["aux_dtype"]
        self.offsets = check_store_contents(self.path, self.manifest)  # [N + 1]; refuses a truncated store
        self._arrays: dict[str, Any] | None = None
        self._pid = -1
        if hidden_states == "online":  # [N] each: the cache stage's forward of every sample
            self.forward_widths, self.forward_padded = plan_widths(np.diff(self.offsets).tolist(),
                                                                   int(self.manifest["batch_tokens"]))

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["aux_layer_ids"])

    @property
    def lengths(self) -> np.ndarray:
        """``[N]`` tokens each item will have (after ``max_length``), e.g. for length-bucketed samplers."""
        n = np.diff(self.offsets)
        return np.minimum(n, self.max_length) if self.max_length is not None else n

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _open(self) -> dict[str, Any]:
        if self._arrays is None or self._pid != os.getpid():  # reopen after a fork
            group = open_store(self.path)
            self._arrays = {name: group[name] for name in group.array_keys()}
            self._pid = os.getpid()
        return self._arrays

    def __getitem__(self, n: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= n < len(self):
            raise IndexError(f"{self.path}: sample {n} out of range (N={len(self)})")
        n = n % len(self)
        start, end = int(self.offsets[n]), int(self.offsets[n + 1])
        if self.max_length is not None:
            end = min(end, start + self.max_length)
        arrays = self._open()
        what = f"sample {n} (tokens {start}..{end - 1})"
        input_ids = read_rows(self.path, arrays["input_ids"], start, end, what)  # [L]
        loss_mask = read_rows(self.path, arrays["loss_mask"], start, end, what)  # [L]
        tokens = {"input_ids": torch.from_numpy(input_ids.astype(np.int64)),  # [L]
                  "loss_mask": torch.from_numpy(loss_mask.astype(bool))}  # [L]
        if self.hidden_states == "online":
            return {**tokens, "forward_width": self.forward_widths[n], "forward_padded": self.forward_padded[n]}
        hidden = {k: read_rows(self.path, arrays[k], start, end, what)
                  for k in ("aux_hidden", "aux_scale", "last_hidden") if k in arrays}
        aux, last = decode_hidden(hidden, self.aux_dtype, self.dtype)  # [L, K, H], [L, H]
        bad = ~(torch.isfinite(aux).flatten(1).all(dim=1) & torch.isfinite(last).all(dim=1))  # [L]
        if bad.any():
            pos = int(bad.nonzero()[0])
            row = int(arrays["source_index"][n])
            raise UserError(f"{self.path}: sample {n} (source row {row}) holds NaN/inf hidden states from its token "
                            f"{pos}; check the target and cache.dtype, then {REBUILD_HINT}")
        return {**tokens, "aux_hidden": aux, "last_hidden": last}


class CacheCollator:
    """Right-pad items of :class:`CacheDataset` into a batch (optionally cutting each to ``max_length``).

    Returns ``input_ids [B, L] long`` (padded with ``pad_id``), ``loss_mask [B, L] bool`` and
    ``attention_mask [B, L] bool`` (False on padding), ``aux_hidden [B, L, K, H]``,
    ``last_hidden [B, L, H]`` (zeros on padding) and ``lengths [B] long``; items read online (no hidden states)
    give no hidden keys.
    """

    def __init__(self, pad_id: int, max_length: int | None = None):
        if max_length is not None and max_length <= 0:
            raise UserError(f"CacheCollator: max_length must be > 0; got {max_length}")
        self.pad_id = int(pad_id)
        self.max_length = max_length

    def __call__(self, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not items:
            raise UserError("CacheCollator: empty batch")
        lengths = torch.tensor([len(it["input_ids"]) for it in items], dtype=torch.long)  # [B]
        if self.max_length is not None:
            lengths = lengths.clamp(max=self.max_length)
        b, width = len(items), int(lengths.max())
        first = items[0]
        out = {
            "input_ids": torch.full((b, width), self.pad_id, dtype=torch.long),  # [B, L]
            "loss_mask": torch.zeros((b, width), dtype=torch.bool),  # [B, L]
            "attention_mask": torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1),  # [B, L]
            "lengths": lengths,
        }
        if "aux_hidden" in first:
            aux, last = first["aux_hidden"], first["last_hidden"]
            out["aux_hidden"] = aux.new_zeros((b, width, *aux.shape[1:]))  # [B, L, K, H]
            out["last_hidden"] = last.new_zeros((b, width, *last.shape[1:]))  # [B, L, H]
        keys = [k for k in ITEM_KEYS if k in out]
        for i, it in enumerate(items):
            n = int(lengths[i])
            for key in keys:
                out[key][i, :n] = it[key][:n]
        return out
