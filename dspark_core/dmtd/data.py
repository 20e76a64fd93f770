"""DMTD training rows: regenerated samples (``prompt_ids + response_ids``) packed into fixed-length rows.

Each document keeps its own position ids (0, 1, ...) and a document id, so cycles
(``position // tau``) restart in every document and no attention crosses a boundary (seed 001 1.4).
``labels[i]`` is the token position i predicts (``x_{i+1}`` of the same document) where that token is
supervised -- response tokens (``loss_on: response``) or every token after the first (``all``) --
and -100 elsewhere. The free tail of a row is one padding document with no labels.

Shape legend: R rows, L tokens of a row (max_length).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark_core.cache.source import load_regen
from dspark_core.dmtd.model import IGNORE
from dspark_core.errors import UserError


@dataclass(frozen=True)
class Document:
    ids: np.ndarray        # [n] int64
    supervised: np.ndarray  # [n] bool: the token is a training target


@dataclass(frozen=True)
class PackStats:
    documents: int
    rows: int
    truncated: int              # documents cut to max_length
    dropped_unsupervised: int   # documents without any supervised target (not packed)
    supervised_tokens: int


def read_documents(path: str | Path, max_length: int, loss_on: str = "response",
                   vocab_size: int | None = None) -> tuple[list[Document], int]:
    """Documents of a regenerate parquet: its samples at ``max_length`` (:func:`load_regen`, ``long_conversations:
    split``: a document an answer where a conversation's answers do not fit together), longest first; and the
    count of those cut."""
    samples = load_regen(path, max_length=max_length, vocab_size=vocab_size)
    docs = []
    for i in range(len(samples.ids)):
        a, b = samples.offsets[i], samples.offsets[i + 1]
        ids = samples.input_ids[a:b].astype(np.int64)
        if loss_on == "response":
            sup = samples.loss_mask[a:b].astype(bool)
        elif loss_on == "all":
            sup = np.ones(b - a, dtype=bool)
        else:
            raise ValueError(f"dmtd.loss_on must be response or all; got {loss_on!r}")
        docs.append(Document(ids=ids, supervised=sup))
    return docs, samples.truncated


def document_labels(doc: Document) -> np.ndarray:
    """``[n]``: the next token where it is supervised, else -100 (position 0 is never a target)."""
    labels = np.full(doc.ids.size, IGNORE, dtype=np.int64)
    nxt = doc.supervised[1:]
    labels[:-1][nxt] = doc.ids[1:][nxt]
    return labels


def pack_documents(docs: list[Document], max_length: int, pad_id: int
                   ) -> tuple[list[dict[str, torch.Tensor]], PackStats]:
    """Best-fit-decreasing packing into rows of ``max_length``; each row a dict of ``[L]`` long tensors
    ``input_ids, position_ids, doc_ids, labels``. Documents must already fit (see ``read_documents``)."""
    kept = [d for d in docs if d.ids.size and (document_labels(d) != IGNORE).any()]
    order = sorted(range(len(kept)), key=lambda i: -kept[i].ids.size)
    rows: list[list[Document]] = []
    free: list[tuple[int, int]] = []  # sorted (free slots, row index)
    for i in order:
        doc = kept[i]
        if doc.ids.size > max_length:
            raise ValueError(f"a document of {doc.ids.size} tokens does not fit max_length={max_length}")
        j = bisect.bisect_left(free, (doc.ids.size, -1))
        if j == len(free):
            rows.append([doc])
            bisect.insort(free, (max_length - doc.ids.size, len(rows) - 1))
        else:
            space, r = free.pop(j)
            rows[r].append(doc)
            bisect.insort(free, (space - doc.ids.size, r))
    packed = [_row(r, max_length, pad_id) for r in rows]
    stats = PackStats(documents=len(kept), rows=len(packed), truncated=0,
                      dropped_unsupervised=len(docs) - len(kept),
                      supervised_tokens=int(sum(int((p["labels"] != IGNORE).sum()) for p in packed)))
    return packed, stats


def _row(docs: list[Document], max_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    ids, pos, doc_ids, labels = [], [], [], []
    for k, d in enumerate(docs):
        ids.append(d.ids)
        pos.append(np.arange(d.ids.size))
        doc_ids.append(np.full(d.ids.size, k))
        labels.append(document_labels(d))
    pad = max_length - sum(d.ids.size for d in docs)
    if pad:
        ids.append(np.full(pad, pad_id))
        pos.append(np.arange(pad))
        doc_ids.append(np.full(pad, len(docs)))
        labels.append(np.full(pad, IGNORE))
    return {k: torch.from_numpy(np.concatenate(v).astype(np.int64))
            for k, v in (("input_ids", ids), ("position_ids", pos), ("doc_ids", doc_ids), ("labels", labels))}


def load_packed(path: str | Path, max_length: int, loss_on: str, pad_id: int,
                vocab_size: int | None = None) -> tuple[list[dict[str, torch.Tensor]], PackStats]:
    """Read, cut and pack one regenerate split."""
    docs, truncated = read_documents(path, max_length, loss_on, vocab_size)
    rows, stats = pack_documents(docs, max_length, pad_id)
    if not rows:
        raise UserError(f"{path}: no document keeps a supervised token within dmtd.max_length={max_length} "
                        f"(dmtd.loss_on={loss_on!r}); raise max_length or set loss_on: all")
    return rows, PackStats(stats.documents, stats.rows, truncated, stats.dropped_unsupervised, stats.supervised_tokens)


def collate_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack packed rows into ``[B, L]`` tensors."""
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
