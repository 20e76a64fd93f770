"""Packed training batches: several cache samples in one row, each a document of its own.

Shape legend: B rows, L row length, n_i a sample's length, A anchor slots of a row (``compact``: the valid anchors
of the fullest row, rounded up; else ``num_anchors`` per packed sample), S slots, K aux layers, Ht target hidden.

A padded batch (``CacheCollator`` + ``add_anchor_fields``) spends a row of the longest sample's length on every
sample. A packed batch lays the samples end to end in rows of at most ``packed_length`` tokens (first fit, in
order; a longer sample gets a row of its own) and records, per anchor, where its document starts:

- ``anchor_start [B, A]``: the row position of the anchor's document's first token; the draft's attention lets a
  block see the context ``anchor_start <= j < anchor`` only (``attention.make_mask_mod``);
- ``position_ids [B, L]``: each token's position within its document (the RoPE positions of context and block);
- ``doc_ids [B, L]``: the index of each token's sample in the micro-batch (-1 on the row's padding).

Anchors and slot supervision are drawn per sample exactly as the padded batch draws them (the same generator per
sample, ``sample_anchors`` / ``block_targets`` on the sample alone), then shifted by the sample's row offset, so a
block never reaches past its document and the loss and its gradients equal the padded batch's (up to the order of
float sums): ``tests/test_packing.py``.

What packing saves is the padding's share of the context work (features, K/V projections, attention against
it); with ``compact`` anchor slots (``draft.anchor_slots``) a row also carries only its samples' valid anchors, so
short answers bring no dummy blocks, which a padded batch cuts only down to its fullest sample's. A packed row
holds more anchors, and the dense (CPU) attention path's block-to-block grid grows with the square of a row's
anchors, so there packing is slower than padding; flex (GPU) skips the masked tiles (docs/DESIGN.md,
``benchmarks/bench_batch_layout.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dspark_core.draft.anchors import _generators, block_targets, compact_width, sample_anchors, teacher_fields

ITEM_KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")  # a cache item's per-token tensors
SLOT_KEYS = ("targets", "prev_tokens", "slot_valid")


def pack_rows(lengths: Sequence[int], packed_length: int) -> list[list[int]]:
    """Sample indices per row: first fit in order into rows of at most ``packed_length`` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(packed_length - n)
    return rows


def sample_places(lengths: Sequence[int], packed_length: int) -> list[tuple[int, int]]:
    """``(row, start)`` of each sample in the rows of :func:`pack_rows`: where its tokens lie in the packed batch."""
    places: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for r, row in enumerate(pack_rows(lengths, packed_length)):
        start = 0
        for i in row:
            places[i] = (r, start)
            start += int(lengths[i])
    return places


def _sample_fields(item: dict[str, Any], num_anchors: int, block_size: int, gen: torch.Generator
                   ) -> dict[str, torch.Tensor]:
    """One sample's anchors [A], anchor_valid [A] and slot fields [A, S], as the padded batch draws them."""
    ids, mask = item["input_ids"].view(1, -1), item["loss_mask"].bool().view(1, -1)
    anchors, valid = sample_anchors(mask, num_anchors, [gen])
    out = block_targets(ids, mask, anchors, valid, block_size)
    return {"anchors": anchors[0], "anchor_valid": valid[0], **{k: out[k][0] for k in SLOT_KEYS}}


def collate_packed(items: Sequence[dict[str, Any]], num_anchors: int, block_size: int, packed_length: int,
                   generator: torch.Generator | Sequence[torch.Generator], pad_id: int = 0, compact: bool = False
                   ) -> dict[str, torch.Tensor]:
    """A packed training batch of cache ``items`` (module docstring); the keys of a padded one plus
    ``anchor_start``, ``position_ids`` and ``doc_ids``. ``compact``: each sample's valid anchors only, a row's
    slots :func:`~dspark_core.draft.anchors.compact_width` of the fullest row (else ``num_anchors`` a sample)."""
    if not items:
        raise ValueError("collate_packed: empty batch")
    if packed_length < 1:
        raise ValueError(f"collate_packed: packed_length must be >= 1; got {packed_length}")
    gens = _generators(generator, len(items))
    fields = [_sample_fields(it, num_anchors, block_size, g) for it, g in zip(items, gens)]  # in order (shared gen)
    lengths = [len(it["input_ids"]) for it in items]
    rows = pack_rows(lengths, packed_length)
    width = max(sum(lengths[i] for i in row) for row in rows)
    cols_of = [int(f["anchor_valid"].sum()) if compact else num_anchors for f in fields]  # a sample's anchor slots
    anchors_per_row = num_anchors * max(len(row) for row in rows)
    if compact:
        anchors_per_row = compact_width(max(sum(cols_of[i] for i in row) for row in rows), num_anchors,
                                        anchors_per_row)
    out = _empty_batch(items[0], len(rows), width, anchors_per_row, block_size, pad_id)
    keys = [k for k in ITEM_KEYS if k in out]  # items read online carry no hidden states (cache/online.py)
    for r, row in enumerate(rows):
        start = col = 0
        for i in row:
            n, f, c = lengths[i], fields[i], cols_of[i]
            for key in keys:
                out[key][r, start:start + n] = items[i][key][:n]
            out["position_ids"][r, start:start + n] = torch.arange(n)
            out["doc_ids"][r, start:start + n] = i
            cols = slice(col, col + c)
            out["anchors"][r, cols] = f["anchors"][:c] + start
            out["anchor_valid"][r, cols] = f["anchor_valid"][:c]
            out["anchor_start"][r, cols] = start
            for key in SLOT_KEYS:
                out[key][r, cols] = f[key][:c]
            start, col = start + n, col + c
        out["lengths"][r] = start
    out["attention_mask"] = out["doc_ids"] >= 0
    out["slot_index"] = out["slot_valid"].nonzero().t().contiguous()  # [3, N]
    out.update(teacher_fields(out["slot_index"], out["anchors"], width))
    return out


def _empty_batch(first: dict[str, Any], rows: int, width: int, anchors: int, slots: int, pad_id: int
                 ) -> dict[str, torch.Tensor]:
    hidden = {} if "aux_hidden" not in first else {
        "aux_hidden": first["aux_hidden"].new_zeros((rows, width, *first["aux_hidden"].shape[1:])),  # [B, L, K, Ht]
        "last_hidden": first["last_hidden"].new_zeros((rows, width, *first["last_hidden"].shape[1:])),  # [B, L, Ht]
    }
    return {
        "input_ids": torch.full((rows, width), pad_id, dtype=torch.long),  # [B, L]
        "loss_mask": torch.zeros((rows, width), dtype=torch.bool),  # [B, L]
        **hidden,
        "position_ids": torch.zeros((rows, width), dtype=torch.long),  # [B, L]
        "doc_ids": torch.full((rows, width), -1, dtype=torch.long),  # [B, L]
        "lengths": torch.zeros(rows, dtype=torch.long),  # [B]
        "anchors": torch.zeros((rows, anchors), dtype=torch.long),  # [B, A]
        "anchor_valid": torch.zeros((rows, anchors), dtype=torch.bool),  # [B, A]
        "anchor_start": torch.zeros((rows, anchors), dtype=torch.long),  # [B, A]
        "targets": torch.zeros((rows, anchors, slots), dtype=torch.long),  # [B, A, S]
        "prev_tokens": torch.zeros((rows, anchors, slots), dtype=torch.long),  # [B, A, S]
        "slot_valid": torch.zeros((rows, anchors, slots), dtype=torch.bool),  # [B, A, S]
    }
