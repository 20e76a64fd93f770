"""Token sequences of the cache stage, read from a regenerate parquet (`data/regen/{split}.parquet`).

A sample is ``prompt_ids + response_ids`` cut to ``max_length`` (or refused, per ``on_too_long``), with
``loss_mask`` 1 on its loss spans: the assistant turns of a multi-turn row (columns ``span_starts`` /
``span_ends``, positions in the sample), the response where a file or row has no spans. The store keeps samples
sorted by length (longest first, ties in file order) so padded batches waste little compute; ``order[n]`` is the
parquet row of sample n.

Shape legend: N samples, T tokens of all samples, L tokens of a sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_core.errors import UserError
from dspark_core.io import parquet_schema, read_parquet

REQUIRED_COLUMNS = ("id", "prompt_ids", "response_ids")
SPAN_COLUMNS = ("span_starts", "span_ends")
ON_TOO_LONG = ("truncate", "error")
FIX = "rerun the regenerate stage (`dvc repro -f regenerate`)"


@dataclass(frozen=True)
class TokenSamples:
    """Samples in store order, concatenated: sample n is ``input_ids[offsets[n]:offsets[n + 1]]``."""

    ids: list[str]            # [N] sample ids, store order
    order: np.ndarray         # [N] int64 parquet row of each sample
    offsets: np.ndarray       # [N + 1] int64
    input_ids: np.ndarray     # [T] int32
    loss_mask: np.ndarray     # [T] uint8, 1 on the loss spans' tokens
    truncated: int            # samples cut to max_length
    no_response: int          # samples with no response token left (loss_mask all 0)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)  # [N]


def read_regen_table(path: str | Path):
    """A regenerate parquet's ``id, prompt_ids, response_ids`` and its span columns where it has them; one clear
    error for a missing file or column."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: regenerate output not found; run the regenerate stage first")
    names = parquet_schema(path, fix=FIX).names
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise UserError(f"{path}: missing column(s) {missing} (has {names})")
    return read_parquet(path, [*REQUIRED_COLUMNS, *(c for c in SPAN_COLUMNS if c in names)], fix=FIX)


def row_spans(path: Path, row: int, sid: str, starts, ends, prompt_len: int, length: int) -> list[tuple[int, int]]:
    """A row's loss spans ``[(start, end)]`` over its ``length`` tokens: its span columns, checked (in order,
    not overlapping, inside the sample), or -- a file or row without them -- the response."""
    if starts is None and ends is None:
        return [(prompt_len, length)]
    starts, ends = list(starts or []), list(ends or [])
    bounds = [0] + [x for pair in zip(starts, ends) for x in pair] + [length]
    if len(starts) != len(ends) or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise UserError(f"{path}: row {row} (id {sid!r}) has loss spans {list(zip(starts, ends))[:4]} that are not "
                        f"ordered, disjoint spans of its {length} tokens; {FIX}")
    return list(zip(starts, ends))


def regen_sequences(path: str | Path, table=None):
    """``(row, id, token ids, loss spans)`` of every row of a regenerate parquet (``table``: read already)."""
    path = Path(path)
    table = read_regen_table(path) if table is None else table
    ids = [str(x) for x in table.column("id").to_pylist()]
    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    cols = table.column_names
    starts, ends = [table.column(c).to_pylist() if c in cols else [None] * len(ids) for c in SPAN_COLUMNS]
    for row, (sid, p, r, a, b) in enumerate(zip(ids, prompts, responses, starts, ends)):
        p, r = list(p or []), list(r or [])
        yield row, sid, p + r, row_spans(path, row, sid, a, b, len(p), len(p) + len(r))


def load_regen(path: str | Path, max_length: int, on_too_long: str = "truncate",
               vocab_size: int | None = None) -> TokenSamples:
    """Read a regenerate parquet into :class:`TokenSamples`; ValueError (naming file/row) on bad input."""
    path = Path(path)
    table = read_regen_table(path)
    if on_too_long not in ON_TOO_LONG:
        raise UserError(f"cache.on_too_long must be one of {', '.join(ON_TOO_LONG)}; got {on_too_long!r}")
    if table.num_rows == 0:
        raise UserError(f"{path}: no rows; the regenerate stage produced an empty split, nothing to cache")
    ids, seqs, masks, truncated = [], [], [], 0
    for row, sid, full, spans in regen_sequences(path, table):
        if not full:
            raise UserError(f"{path}: row {row} (id {sid!r}) has no prompt and no response tokens")
        if len(full) > max_length:
            if on_too_long == "error":
                raise UserError(f"{path}: row {row} (id {sid!r}) has {len(full)} tokens > "
                                f"cache.max_length={max_length} (cache.on_too_long=error)")
            truncated += 1
        seq = np.asarray(full, dtype=np.int64)[:max_length]
        outside = (seq < 0) | (seq >= vocab_size) if vocab_size is not None else seq < 0
        if outside.any():
            raise UserError(f"{path}: row {row} (id {sid!r}) has token id {int(seq[outside][0])} outside the "
                            f"target's vocabulary (vocab_size={vocab_size})")
        mask = np.zeros(len(full), dtype=np.uint8)
        for a, b in spans:
            mask[a:b] = 1
        ids.append(sid)
        seqs.append(seq.astype(np.int32))
        masks.append(mask[:max_length])
    order = np.array(sorted(range(len(seqs)), key=lambda i: (-seqs[i].size, i)), dtype=np.int64)  # [N]
    lengths = np.array([seqs[i].size for i in order], dtype=np.int64)
    return TokenSamples(
        ids=[ids[i] for i in order], order=order,
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        input_ids=np.concatenate([seqs[i] for i in order]), loss_mask=np.concatenate([masks[i] for i in order]),
        truncated=truncated, no_response=int(sum(1 for m in masks if not m.any())),
    )
