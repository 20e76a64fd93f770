"""Token sequences of the cache stage, read from a regenerate parquet (`data/regen/{split}.parquet`).

A sample is ``prompt_ids + response_ids`` cut to ``max_length`` (or refused, per ``on_too_long``), with
``loss_mask`` 1 on the response tokens. The store keeps samples sorted by length (longest first, ties
in file order) so padded batches waste little compute; ``order[n]`` is the parquet row of sample n.

Shape legend: N samples, T tokens of all samples, L tokens of a sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_core.errors import UserError
from dspark_core.io import read_parquet

REQUIRED_COLUMNS = ("id", "prompt_ids", "response_ids")
ON_TOO_LONG = ("truncate", "error")


@dataclass(frozen=True)
class TokenSamples:
    """Samples in store order, concatenated: sample n is ``input_ids[offsets[n]:offsets[n + 1]]``."""

    ids: list[str]            # [N] sample ids, store order
    order: np.ndarray         # [N] int64 parquet row of each sample
    offsets: np.ndarray       # [N + 1] int64
    input_ids: np.ndarray     # [T] int32
    loss_mask: np.ndarray     # [T] uint8, 1 on response tokens
    truncated: int            # samples cut to max_length
    no_response: int          # samples with no response token left (loss_mask all 0)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)  # [N]


def load_regen(path: str | Path, max_length: int, on_too_long: str = "truncate",
               vocab_size: int | None = None) -> TokenSamples:
    """Read a regenerate parquet into :class:`TokenSamples`; ValueError (naming file/row) on bad input."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: regenerate output not found; run the regenerate stage first")
    if on_too_long not in ON_TOO_LONG:
        raise UserError(f"cache.on_too_long must be one of {', '.join(ON_TOO_LONG)}; got {on_too_long!r}")
    table = read_parquet(path, fix="rerun the regenerate stage (`dvc repro -f regenerate`)")
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise UserError(f"{path}: missing column(s) {missing} (has {table.column_names})")
    if table.num_rows == 0:
        raise UserError(f"{path}: no rows; the regenerate stage produced an empty split, nothing to cache")
    ids = [str(x) for x in table.column("id").to_pylist()]
    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    seqs, masks, truncated = [], [], 0
    for row, (sid, p, r) in enumerate(zip(ids, prompts, responses)):
        p, r = list(p or []), list(r or [])
        if not p and not r:
            raise UserError(f"{path}: row {row} (id {sid!r}) has no prompt and no response tokens")
        if len(p) + len(r) > max_length:
            if on_too_long == "error":
                raise UserError(f"{path}: row {row} (id {sid!r}) has {len(p) + len(r)} tokens > "
                                f"cache.max_length={max_length} (cache.on_too_long=error)")
            truncated += 1
        seq = np.asarray(p + r, dtype=np.int64)[:max_length]
        outside = (seq < 0) | (seq >= vocab_size) if vocab_size is not None else seq < 0
        if outside.any():
            raise UserError(f"{path}: row {row} (id {sid!r}) has token id {int(seq[outside][0])} outside the "
                            f"target's vocabulary (vocab_size={vocab_size})")
        mask = np.zeros(seq.size, dtype=np.uint8)
        mask[len(p):] = 1
        seqs.append(seq.astype(np.int32))
        masks.append(mask)
    order = np.array(sorted(range(len(seqs)), key=lambda i: (-seqs[i].size, i)), dtype=np.int64)  # [N]
    lengths = np.array([seqs[i].size for i in order], dtype=np.int64)
    return TokenSamples(
        ids=[ids[i] for i in order], order=order,
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        input_ids=np.concatenate([seqs[i] for i in order]), loss_mask=np.concatenate([masks[i] for i in order]),
        truncated=truncated, no_response=int(sum(1 for m in masks if not m.any())),
    )
