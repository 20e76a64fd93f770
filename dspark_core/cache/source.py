"""Token sequences of the cache stage, read from a regenerate parquet (`data/regen/{split}.parquet`).

A row is a conversation: its sample ``prompt_ids + response_ids`` with loss spans (columns ``span_starts`` /
``span_ends``, positions in the sample: every answer; a file or row without them: the response) and, for a row of
several answers, each answer's own sample -- the conversation rendered up to that answer, the answer as generated --
in the ``turn_*`` columns (:class:`Turn`). ``long_conversations`` makes samples of it (see docs/DESIGN.md
"Multi-turn answers and their loss spans"):

- ``split``: samples that each end at an answer, with as much earlier context as fits ``max_length``. The last
  answer's sample comes first; it also takes the loss of every earlier answer it holds exactly as generated (the
  tokens of that answer's own sample) and whole; each answer left gets the sample ending at it, the latest first,
  by the same rule. So every answer is trained once, with the tokens it was generated as (a Qwen3-style template,
  which drops earlier answers' thinking: one sample an answer). An answer longer than ``max_length`` alone keeps
  its first ``max_length`` tokens (cut at its tail, counted).
- ``truncate``: the row's sample cut to its first ``max_length`` tokens, its loss spans on it.

``on_too_long: error`` refuses a row (split: also an answer's sample) longer than ``max_length`` instead of cutting
it. The store keeps samples sorted by length (longest first, ties in file order) so padded batches waste little
compute; ``order[n]`` is the parquet row of sample n (a split row: several samples).

Shape legend: N samples, T tokens of all samples, L tokens of a sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from dspark_core.data.chat import TURN_COLUMNS
from dspark_core.errors import UserError
from dspark_core.io import parquet_schema, read_parquet

REQUIRED_COLUMNS = ("id", "prompt_ids", "response_ids")
SPAN_COLUMNS = ("span_starts", "span_ends")
ON_TOO_LONG = ("truncate", "error")
LONG_CONVERSATIONS = ("split", "truncate")
FIX = "rerun the regenerate stage (`dvc repro -f regenerate`)"


@dataclass(frozen=True)
class TokenSamples:
    """Samples in store order, concatenated: sample n is ``input_ids[offsets[n]:offsets[n + 1]]``."""

    ids: list[str]            # [N] the row id of each sample, store order
    order: np.ndarray         # [N] int64 parquet row of each sample
    offsets: np.ndarray       # [N + 1] int64
    input_ids: np.ndarray     # [T] int32
    loss_mask: np.ndarray     # [T] uint8, 1 on the loss spans' tokens
    truncated: int            # samples cut to max_length
    no_response: int          # samples with no response token left (loss_mask all 0)
    conversations_split: int = 0  # rows that became several samples
    answers_cut: int = 0          # answers with loss tokens that no sample holds
    answer_tokens_lost: int = 0   # those tokens

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)  # [N]


@dataclass(frozen=True)
class Turn:
    """One answer's own sample: the conversation rendered up to the answer, and where the answer lies in it."""

    ids: list[int]            # [L]
    span: tuple[int, int]     # [start, end) of the answer
    prefix: int               # its first ``prefix`` tokens are the row's sample's

    @property
    def answer(self) -> list[int]:
        return self.ids[self.span[0]:self.span[1]]


@dataclass(frozen=True)
class RegenRow:
    """A regenerate parquet row: its sample, loss spans and (several answers) each answer's own sample."""

    row: int
    id: str
    ids: list[int]                    # prompt_ids + response_ids
    spans: list[tuple[int, int]]
    turns: list[Turn] | None          # None: a row of one answer (or one without the turn columns)


def read_regen_table(path: str | Path):
    """A regenerate parquet's ``id, prompt_ids, response_ids`` and its span / turn columns where it has them; one
    clear error for a missing file or column."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: regenerate output not found; run the regenerate stage first")
    names = parquet_schema(path, fix=FIX).names
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise UserError(f"{path}: missing column(s) {missing} (has {names})")
    return read_parquet(path, [*REQUIRED_COLUMNS, *(c for c in SPAN_COLUMNS + TURN_COLUMNS if c in names)], fix=FIX)


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


def row_turns(path: Path, row: int, sid: str, ids: list[int], spans: list[tuple[int, int]],
              cols: Sequence) -> list[Turn] | None:
    """Each answer's own sample from a row's turn columns (None when they are null), checked: one an answer
    span, each prefix inside the row's sample, each answer inside its sample."""
    prefix, tails, starts, ends = cols
    if prefix is None:
        return None
    bad = not (len(prefix) == len(tails or []) == len(starts or []) == len(ends or []) == len(spans))
    turns = [] if bad else [Turn(ids[:p] + list(t), (s, e), p) for p, t, s, e in zip(prefix, tails, starts, ends)]
    if bad or any(not (0 <= t.prefix <= len(ids) and 0 <= t.span[0] <= t.span[1] <= len(t.ids)) for t in turns):
        raise UserError(f"{path}: row {row} (id {sid!r}) has turn columns that do not describe its {len(spans)} "
                        f"answers' samples; {FIX}")
    return turns


def regen_rows(path: str | Path, table=None) -> Iterator[RegenRow]:
    """Every row of a regenerate parquet as a :class:`RegenRow` (``table``: read already)."""
    path = Path(path)
    table = read_regen_table(path) if table is None else table
    n, cols = table.num_rows, table.column_names
    column = lambda c: table.column(c).to_pylist() if c in cols else [None] * n  # noqa: E731
    ids = [str(x) for x in column("id")]
    prompts, responses = column("prompt_ids"), column("response_ids")
    starts, ends = column("span_starts"), column("span_ends")
    turn_cols = list(zip(*(column(c) for c in TURN_COLUMNS)))
    for row, (sid, p, r, a, b) in enumerate(zip(ids, prompts, responses, starts, ends)):
        p, r = list(p or []), list(r or [])
        seq = p + r
        spans = row_spans(path, row, sid, a, b, len(p), len(seq))
        yield RegenRow(row, sid, seq, spans, row_turns(path, row, sid, seq, spans, turn_cols[row]))


def regen_answers(path: str | Path) -> Iterator[list[int]]:
    """Every answer's tokens once, as generated (its own sample's span; a row without turn columns: its spans)."""
    for r in regen_rows(path):
        if r.turns is None:
            yield from (r.ids[a:b] for a, b in r.spans)
        else:
            yield from (t.answer for t in r.turns)


# ----------------------------------------------------------------------------------------------
# a row's samples
# ----------------------------------------------------------------------------------------------
@dataclass
class Cuts:
    """What making a row's samples cut: samples cut to max_length, answers (and their tokens) no sample holds."""

    samples: int = 0
    answers: int = 0
    tokens: int = 0


def window(length: int, span: tuple[int, int], max_length: int) -> tuple[int, int]:
    """The tokens ``[lo, hi)`` of a sample kept for the answer at ``span``: all of it when it fits; else the answer
    with as much earlier context as fits (what follows the answer dropped); an answer longer than ``max_length``
    alone: its first ``max_length`` tokens."""
    s, e = span
    if length <= max_length:
        return 0, length
    if e - s > max_length:
        return s, s + max_length
    return max(0, e - max_length), e


def truncate_row(r: RegenRow, max_length: int, cuts: Cuts) -> list[tuple[list[int], np.ndarray]]:
    """``truncate``: the row's sample cut to its first ``max_length`` tokens, with its loss spans."""
    mask = np.zeros(len(r.ids), dtype=np.uint8)  # [L]
    for a, b in r.spans:
        mask[a:b] = 1
        if b > max(a, max_length):
            cuts.answers += 1
            cuts.tokens += b - max(a, max_length)
    cuts.samples += len(r.ids) > max_length
    return [(r.ids[:max_length], mask[:max_length])]


def split_row(path: Path, r: RegenRow, max_length: int, cuts: Cuts) -> list[tuple[list[int], np.ndarray]]:
    """``split``: one sample per answer no later sample holds as generated, in conversation order (the module
    docstring's rule)."""
    turns = r.turns
    if turns is None:
        if len(r.spans) > 1:
            raise UserError(f"{path}: row {r.row} (id {r.id!r}) holds {len(r.spans)} answers but not each answer's "
                            f"own sample (the turn_* columns); {FIX}, or set cache.long_conversations: truncate")
        turns = [Turn(r.ids, r.spans[-1] if r.spans else (len(r.ids), len(r.ids)), len(r.ids))]
    held = [False] * len(turns)
    out = []
    for k in range(len(turns) - 1, -1, -1):
        if held[k]:
            continue
        t, held[k] = turns[k], True
        (s, e), (lo, hi) = t.span, window(len(t.ids), t.span, max_length)
        mask = np.zeros(hi - lo, dtype=np.uint8)  # [L]
        mask[s - lo:min(e, hi) - lo] = 1
        if e - s > max_length:
            cuts.answers += 1
            cuts.tokens += e - s - max_length
        for j in range(k):  # earlier answers this sample holds whole and exactly as generated
            a, b = r.spans[j]
            if not held[j] and lo <= a and b <= min(t.prefix, hi) and r.ids[a:b] == turns[j].answer:
                mask[a - lo:b - lo], held[j] = 1, True
        cuts.samples += (lo, hi) != (0, len(t.ids))
        out.append((t.ids[lo:hi], mask))
    return out[::-1]


def _check_length(path: Path, r: RegenRow, max_length: int, long_conversations: str) -> None:
    """``on_too_long: error``: the row's sample, and under ``split`` each answer's own, must fit."""
    if len(r.ids) > max_length:
        raise UserError(f"{path}: row {r.row} (id {r.id!r}) has {len(r.ids)} tokens > cache.max_length={max_length} "
                        "(cache.on_too_long=error)")
    for k, t in enumerate((r.turns or []) if long_conversations == "split" else []):
        if len(t.ids) > max_length:
            raise UserError(f"{path}: row {r.row} (id {r.id!r}): the sample of its answer {k + 1} has {len(t.ids)} "
                            f"tokens > cache.max_length={max_length} (cache.on_too_long=error)")


def load_regen(path: str | Path, max_length: int, on_too_long: str = "truncate",
               vocab_size: int | None = None, long_conversations: str = "split") -> TokenSamples:
    """Read a regenerate parquet into :class:`TokenSamples`; one line (naming file/row) on bad input."""
    path = Path(path)
    table = read_regen_table(path)
    if on_too_long not in ON_TOO_LONG:
        raise UserError(f"cache.on_too_long must be one of {', '.join(ON_TOO_LONG)}; got {on_too_long!r}")
    if long_conversations not in LONG_CONVERSATIONS:
        raise UserError(f"cache.long_conversations must be one of {', '.join(LONG_CONVERSATIONS)}; "
                        f"got {long_conversations!r}")
    if table.num_rows == 0:
        raise UserError(f"{path}: no rows; the regenerate stage produced an empty split, nothing to cache")
    ids, rows, seqs, masks, cuts, split = [], [], [], [], Cuts(), 0
    for r in regen_rows(path, table):
        if not r.ids:
            raise UserError(f"{path}: row {r.row} (id {r.id!r}) has no prompt and no response tokens")
        if on_too_long == "error":
            _check_length(path, r, max_length, long_conversations)
        made = split_row(path, r, max_length, cuts) if long_conversations == "split" else \
            truncate_row(r, max_length, cuts)
        split += len(made) > 1
        for seq, mask in made:
            _check_vocab(path, r, seq, vocab_size)
            ids.append(r.id)
            rows.append(r.row)
            seqs.append(np.asarray(seq, dtype=np.int32))
            masks.append(mask)
    order = sorted(range(len(seqs)), key=lambda i: (-seqs[i].size, i))  # [N]
    lengths = np.array([seqs[i].size for i in order], dtype=np.int64)
    return TokenSamples(
        ids=[ids[i] for i in order], order=np.array([rows[i] for i in order], dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        input_ids=np.concatenate([seqs[i] for i in order]), loss_mask=np.concatenate([masks[i] for i in order]),
        truncated=cuts.samples, no_response=int(sum(1 for m in masks if not m.any())),
        conversations_split=split, answers_cut=cuts.answers, answer_tokens_lost=cuts.tokens,
    )


def _check_vocab(path: Path, r: RegenRow, seq: list[int], vocab_size: int | None) -> None:
    arr = np.asarray(seq, dtype=np.int64)  # [L]
    outside = (arr < 0) | (arr >= vocab_size) if vocab_size is not None else arr < 0
    if outside.any():
        raise UserError(f"{path}: row {r.row} (id {r.id!r}) has token id {int(arr[outside][0])} outside the "
                        f"target's vocabulary (vocab_size={vocab_size})")
