"""Check a cache store against the target: recompute random samples and compare (``dspark cache verify``).

Each chosen sample is recomputed inside the very batch it was built in (the batch plan is a pure
function of the stored lengths and ``batch_tokens``), so on the same device and dtype a bf16 store is
reproduced bit for bit (``exact``). Errors are measured between the decoded store and the recomputed
full-precision states: max abs error and relative error ``||stored - recomputed|| / ||recomputed||`` of each
token's H-vector (per layer), averaged.

Before that, every chunk file of every array is checked against its CRC-32C (:func:`~dspark_core.cache.store.bad_chunks`:
reads each file once, decompresses nothing); a damaged chunk makes the report not ``ok`` and is listed, and a chosen
sample whose chunks are damaged is reported with its error instead of errors. ``n_samples`` 0: checksums only, as
for a token-only store (``hidden_states: online``: nothing stored to recompute).

Shape legend: L tokens of a sample, K aux layers, H hidden, N samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_core.cache.capture import capture_batch, forward_pad_id, plan_batches
from dspark_core.cache.store import (DamagedChunkError, bad_chunks, decode_hidden, encode_hidden, open_store,
                                     read_manifest, read_rows, token_only)
from dspark_core.errors import UserError
from dspark_core.target import load_target, read_fingerprint

# Relative-error bounds for ``ok``: bf16 rounding is ~0.3% rms; fp8 e4m3 (3 mantissa bits) ~2-3%.
TOLERANCE = {"bf16": 1e-2, "fp8_e4m3": 6e-2}


def _errors(stored: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(max abs error, mean relative error of the H-vectors)`` of ``stored`` vs ``ref`` (``[..., H]``).

    The relative error is taken per token (and layer) so that the few massive-activation tokens of real
    models do not hide the error of all the others.
    """
    diff = stored.float() - ref.float()  # [..., H]
    if diff.numel() == 0:
        return 0.0, 0.0
    rel = diff.norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-30)  # [...]
    return float(diff.abs().max()), float(rel.mean())


def verify_cache(store_path: str | Path, target_dir: str | Path, n_samples: int = 4, seed: int = 0,
                 device: str | torch.device = "cpu") -> dict[str, Any]:
    """Check every chunk's checksum, then recompute ``n_samples`` random samples of ``store_path`` with
    ``target_dir``; returns a report dict.

    Keys: ``chunks`` (``checked``, ``bad``: each damaged chunk's array, file and rows), ``samples`` (per sample:
    index, source_index, num_tokens, aux/last max_abs_err, rel_err, exact; or ``error`` when its chunks are
    damaged), ``max_aux_rel_err``, ``max_last_rel_err``, ``exact`` (all stored bits reproduced), ``ok`` (no damaged
    chunk, errors within ``tolerance``). Refuses a store of another model.
    """
    if n_samples < 0:
        raise UserError(f"verify_cache: n_samples must be >= 0 (0: checksums only); got {n_samples}")
    manifest = read_manifest(store_path)
    fingerprint = read_fingerprint(target_dir)["fingerprint"]
    if fingerprint != manifest["model_fingerprint"]:
        raise UserError(f"{store_path}: cache from another model (its model_fingerprint is "
                        f"{manifest['model_fingerprint']}, {target_dir} is {fingerprint})")
    group = open_store(store_path)
    bad = bad_chunks(store_path)
    n_chunks = sum(int(np.prod(group[a].cdata_shape)) for a in group.array_keys())
    offsets = np.asarray(group["offsets"][:], dtype=np.int64) if not any(
        b["array"] == "offsets" for b in bad) else None  # [N + 1]
    samples = _recompute(store_path, target_dir, group, manifest, offsets, n_samples, seed, device) \
        if offsets is not None and n_samples > 0 and not token_only(manifest) else []
    compared = [s for s in samples if "error" not in s]
    tol = TOLERANCE[manifest["aux_dtype"]]
    report = {
        "store": str(store_path), "target": str(target_dir), "model_fingerprint": fingerprint,
        "aux_dtype": manifest["aux_dtype"], "compute_dtype": manifest["compute_dtype"],
        "hidden_states": "online" if token_only(manifest) else "cache",
        "chunks": {"checked": n_chunks, "bad": bad}, "samples": samples,
        "max_aux_rel_err": max((s["aux_rel_err"] for s in compared), default=None),
        "max_last_rel_err": max((s["last_rel_err"] for s in compared), default=None),
        "exact": bool(compared) and all(s["aux_exact"] and s["last_exact"] for s in compared),
        "tolerance": {"aux_rel_err": tol, "last_rel_err": TOLERANCE["bf16"]},
    }
    report["ok"] = not bad and len(compared) == len(samples) and all(
        s["aux_rel_err"] <= tol and s["last_rel_err"] <= TOLERANCE["bf16"] for s in compared)
    return report


def _recompute(store_path, target_dir, group, manifest: dict[str, Any], offsets: np.ndarray, n_samples: int,
               seed: int, device) -> list[dict[str, Any]]:
    """Recompute ``n_samples`` random samples in their build batches and compare each with the store."""
    n_total = len(offsets) - 1
    chosen = sorted(torch.randperm(n_total, generator=torch.Generator().manual_seed(seed))[:n_samples].tolist())
    plan = plan_batches(np.diff(offsets).tolist(), int(manifest["batch_tokens"]))
    model, _ = load_target(target_dir, dtype=manifest["compute_dtype"], device=device)
    pad_id = forward_pad_id(model.config)
    samples = []
    for start, end in plan:
        wanted = [n for n in chosen if start <= n < end]
        if not wanted:
            continue
        try:
            seqs = [torch.from_numpy(read_rows(store_path, group["input_ids"], offsets[i], offsets[i + 1],
                                               f"sample {i}").astype(np.int64)) for i in range(start, end)]
        except DamagedChunkError as e:  # the batch's tokens are damaged: none of it can be recomputed
            samples += [{"index": n, "error": str(e)} for n in wanted]
            continue
        aux, last = capture_batch(model, seqs, manifest["aux_layer_ids"], pad_id)  # [B, L, K, H], [B, L, H]
        for n in wanted:
            try:
                samples.append(_compare(store_path, group, manifest, offsets, n, aux[n - start], last[n - start]))
            except DamagedChunkError as e:
                samples.append({"index": n, "error": str(e)})
    return samples


def _compare(store_path, group, manifest: dict[str, Any], offsets: np.ndarray, n: int, aux: torch.Tensor,
             last: torch.Tensor) -> dict[str, Any]:
    """Stored sample n against the recomputed ``aux [>=L, K, H]``, ``last [>=L, H]`` (padded rows ignored)."""
    start, end = int(offsets[n]), int(offsets[n + 1])
    length = end - start
    aux, last = aux[:length].cpu(), last[:length].cpu()  # [L, K, H], [L, H]
    stored = {k: read_rows(store_path, group[k], start, end, f"sample {n}")
              for k in ("aux_hidden", "aux_scale", "last_hidden") if k in group}
    again = encode_hidden(aux, last, manifest["aux_dtype"])
    aux_exact = all(np.array_equal(stored[k], again[k]) for k in again if k != "last_hidden")
    s_aux, s_last = decode_hidden(stored, manifest["aux_dtype"], torch.float32)  # [L, K, H], [L, H]
    aux_abs, aux_rel = _errors(s_aux, aux)
    last_abs, last_rel = _errors(s_last, last)
    return {
        "index": n, "source_index": int(group["source_index"][n]), "num_tokens": length,
        "aux_max_abs_err": aux_abs, "aux_rel_err": aux_rel, "aux_exact": bool(aux_exact),
        "last_max_abs_err": last_abs, "last_rel_err": last_rel,
        "last_exact": bool(np.array_equal(stored["last_hidden"], again["last_hidden"])),
    }
