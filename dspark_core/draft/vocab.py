"""Reduced draft vocabulary: the N most frequent target tokens of the training answers (``draft.vocab_size: N``).

Shape legend: V target vocabulary, N draft vocabulary (N <= V), ``...`` any leading shape.

The draft predicts over N tokens instead of V (its LM head is a row subset of the frozen target head, the
Markov head's W2 has N rows), as in the ``speculators`` trainers' ``draft_vocab_size``. The maps:

- ``d2t`` [N] int64: the target id of draft id i, **ascending** (draft id i is the i-th kept target id);
- ``t2d`` [V] int64: the draft id of target id t, ``-1`` for a token outside the draft vocabulary.

Both are buffers of the draft's :class:`DraftVocab` and are saved in the draft's ``model.safetensors`` as
``draft_vocab.d2t`` and ``draft_vocab.t2d`` (int64). ``speculators`` stores the same selection differently
(:func:`speculators_maps`): ``d2t`` as offsets (``target = i + d2t[i]``) and ``t2d`` as a bool mask [V].

The selection is made by the ``draft_vocab`` stage: every target token ranked by its count over the
regenerated train answers (every answer once, as generated: each answer's own sample's span, the
``response_ids`` of a single-turn row; :func:`dspark_core.cache.source.regen_answers`), most frequent first, ties
broken by the smaller token id (tokens never seen come last, by id). The ranking of all V tokens is stored, so
any N takes its first N (:func:`read_ranking`, :func:`top_ids`); the stage records the coverage (the share of
answer tokens inside the first N) of each size it is asked about.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from dspark_core.config import Section, positive
from dspark_core.errors import UserError

RANKING_PATH = Path("data/draft_vocab/ranking.safetensors")
RANKING_FORMAT = "dspark-draft-vocab-ranking"


# -- the ranking (stage draft_vocab) ---------------------------------------------------------------------------
def count_tokens(answers: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """counts [V] int64 of the token ids in ``answers``; an id outside [0, V) is refused."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for n, ids in enumerate(answers):
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            raise UserError(f"answer {n} holds token id {int(arr.max() if arr.max() >= vocab_size else arr.min())} "
                            f"outside the target vocabulary [0, {vocab_size}); regenerate with this target")
        counts += np.bincount(arr, minlength=vocab_size)
    return counts


def rank_tokens(counts: np.ndarray) -> np.ndarray:
    """order [V] int64: token ids by count descending, ties by id ascending."""
    ids = np.arange(len(counts), dtype=np.int64)
    return np.lexsort((ids, -counts)).astype(np.int64)


def coverage(counts: np.ndarray, order: np.ndarray, n: int) -> float:
    """Share of the counted tokens that lie in the first ``n`` of ``order`` (1.0 when nothing was counted)."""
    total = int(counts.sum())
    return 1.0 if total == 0 else float(counts[order[:n]].sum()) / total


def write_ranking(path: str | Path, order: np.ndarray, counts: np.ndarray, fingerprint: str | None) -> None:
    """``order`` [V] and ``counts`` [V] (int64) + the target's fingerprint, atomically."""
    from dspark_core.io import atomic_path, save_safetensors

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"order": torch.from_numpy(np.ascontiguousarray(order)),
               "counts": torch.from_numpy(np.ascontiguousarray(counts))}
    with atomic_path(path, ".safetensors") as tmp:
        save_safetensors(tensors, tmp, metadata={"format": RANKING_FORMAT, "fingerprint": fingerprint or ""})


def read_ranking(path: str | Path, vocab_size: int, fingerprint: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts) [V] int64 from ``path``, checked against the target's vocabulary size and fingerprint."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no draft vocabulary ranking; run `dvc repro draft_vocab` first")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != RANKING_FORMAT:
            raise UserError(f"{path}: not a draft vocabulary ranking (format {meta.get('format')!r})")
        order, counts = f.get_tensor("order"), f.get_tensor("counts")
    if fingerprint and meta.get("fingerprint") not in ("", fingerprint):
        raise UserError(f"{path}: ranking made for target {meta.get('fingerprint')}, this target is {fingerprint}; "
                        "rerun the draft_vocab stage")
    if order.shape != (vocab_size,):
        raise UserError(f"{path}: ranking of {order.shape[0]} tokens, the target has {vocab_size}; "
                        "rerun the draft_vocab stage")
    return order.long(), counts.long()


def top_ids(order: torch.Tensor, n: int) -> torch.Tensor:
    """d2t [N]: the first ``n`` tokens of a ranking, ascending."""
    if not 0 < n <= order.shape[0]:
        raise UserError(f"draft.vocab_size {n} must be in [1, {order.shape[0]}] (the target's vocabulary)")
    return order[:n].sort().values


# -- the maps the draft holds -------------------------------------------------------------------------------
class DraftVocab(nn.Module):
    """The draft's vocabulary maps (buffers ``d2t`` [N], ``t2d`` [V], int64; see the module docstring).

    Built with placeholder ids ``0 .. N-1``; :meth:`set_ids` (training: from the ranking) or the checkpoint's
    ``draft_vocab.d2t`` / ``draft_vocab.t2d`` (``load_draft``) give the real ones."""

    def __init__(self, target_vocab: int, size: int) -> None:
        super().__init__()
        if not 0 < size <= target_vocab:
            raise UserError(f"draft.vocab_size {size} must be in [1, {target_vocab}] (the target's vocabulary)")
        self.register_buffer("d2t", torch.arange(size, dtype=torch.long))  # [N]
        self.register_buffer("t2d", torch.full((target_vocab,), -1, dtype=torch.long))  # [V]
        self.t2d[:size] = torch.arange(size)

    @property
    def size(self) -> int:
        return self.d2t.shape[0]

    @property
    def target_size(self) -> int:
        return self.t2d.shape[0]

    def set_ids(self, d2t: torch.Tensor) -> None:
        """Keep the target ids ``d2t`` [N] (strictly ascending, inside [0, V))."""
        d2t = d2t.to(self.d2t.device, torch.long)
        if d2t.shape != self.d2t.shape:
            raise UserError(f"draft vocabulary of {d2t.shape[0]} ids; the draft has draft.vocab_size {self.size}")
        if d2t.numel() and (d2t[0] < 0 or d2t[-1] >= self.target_size or bool((d2t[1:] <= d2t[:-1]).any())):
            raise UserError(f"draft vocabulary ids must be strictly ascending target ids in [0, {self.target_size})")
        self.d2t.copy_(d2t)
        self.t2d.fill_(-1)
        self.t2d[d2t] = torch.arange(self.size, device=d2t.device)

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """target ids [...] -> draft ids [...] (-1 outside the draft vocabulary)."""
        return self.t2d[target_ids]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """draft ids [...] -> target ids [...]."""
        return self.d2t[draft_ids]

    def expand(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """x [..., N] over the draft vocabulary -> [..., V] over the target's, ``fill`` outside."""
        out = x.new_full((*x.shape[:-1], self.target_size), fill)  # [..., V]
        out[..., self.d2t] = x
        return out


def speculators_maps(vocab: DraftVocab) -> tuple[torch.Tensor, torch.Tensor]:
    """The same selection in the ``speculators`` layout: d2t offsets [N] int64 (``target = i + d2t[i]``) and
    t2d [V] bool (True on kept target ids)."""
    d2t = vocab.d2t.cpu()
    return d2t - torch.arange(d2t.shape[0]), vocab.t2d.cpu() >= 0


def from_speculators_maps(d2t: torch.Tensor, t2d: torch.Tensor, src: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`speculators_maps`: offsets d2t [N] + bool mask t2d [V] -> dspark's d2t [N] (ascending
    target ids) and t2d [V] (draft id or -1). ``src`` names the file in errors; maps that disagree are refused."""
    bad = f"{src}: d2t / t2d are not one draft vocabulary"
    if d2t.dim() != 1 or t2d.dim() != 1 or d2t.dtype.is_floating_point or t2d.dtype != torch.bool:
        raise UserError(f"{bad}: expected d2t [N] integer offsets and t2d [V] bool, got d2t {d2t.dtype} "
                        f"{tuple(d2t.shape)}, t2d {t2d.dtype} {tuple(t2d.shape)}; export the draft again")
    ids = d2t.long() + torch.arange(d2t.shape[0])  # [N] target ids
    kept = t2d.nonzero().flatten()  # [N'] ascending target ids
    if not torch.equal(ids, kept):
        raise UserError(f"{bad}: the {d2t.shape[0]} ids of d2t (id + offset) are not the {kept.shape[0]} target ids "
                        "t2d marks, in ascending order; export the draft again")
    vocab = DraftVocab(t2d.shape[0], ids.shape[0])
    vocab.set_ids(ids)
    return vocab.d2t, vocab.t2d


def load_ranked_vocab(vocab: DraftVocab, path: str | Path = RANKING_PATH, fingerprint: str | None = None) -> float:
    """Give ``vocab`` the first ``vocab.size`` tokens of the ranking at ``path``; returns their coverage."""
    order, counts = read_ranking(path, vocab.target_size, fingerprint)
    vocab.set_ids(top_ids(order, vocab.size))
    return coverage(counts.numpy(), order.numpy(), vocab.size)


# -- the stage -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftVocabConfig(Section):
    """Params section ``draft_vocab``: ``report_sizes``, vocabulary sizes whose coverage the stage records (a
    training run prints its own ``draft.vocab_size``'s)."""

    report_sizes: tuple[int, ...] = (1024, 8192, 32000)

    def validate(self) -> None:
        for n in self.report_sizes:
            positive("report_sizes", n)


def run_draft_vocab_stage(params: str | Path, target_dir: Path = Path("data/target"),
                          regen: Path = Path("data/regen/train.parquet"), out: Path = RANKING_PATH,
                          report: Path = Path("reports/draft_vocab.json")) -> dict:
    """Rank the target's tokens over the train answers -> ``out``; coverage per size -> ``report`` (returned)."""
    from dspark_core.cache.source import regen_answers
    from dspark_core.io import read_json, write_json
    from dspark_core.target import read_fingerprint

    cfg = DraftVocabConfig.load(params, "draft_vocab")
    vocab = int(read_json(target_dir / "config.json")["vocab_size"])
    if not regen.is_file():
        raise UserError(f"{regen}: no regenerated train answers; run `dvc repro regenerate` first")
    answers = list(regen_answers(regen))  # every answer once, as generated
    counts = count_tokens(answers, vocab)
    order = rank_tokens(counts)
    write_ranking(out, order, counts, read_fingerprint(target_dir)["fingerprint"])
    stats = {"target_vocab_size": vocab, "answers": len(answers), "answer_tokens": int(counts.sum()),
             "distinct_tokens": int((counts > 0).sum()),
             "coverage": [{"vocab_size": n, "coverage": coverage(counts, order, n)}
                          for n in sorted(set(cfg.report_sizes)) if n <= vocab]}
    write_json(report, stats)
    return stats
