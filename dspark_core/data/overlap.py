"""The eval-leak check of the ``prepare`` stage: no train conversation may overlap an eval conversation.

A train prompt overlaps an eval prompt when they share

- the id, or the group (the upstream problem, e.g. the GSM8K test problem behind a GSM-Symbolic variant);
- a user turn, exactly or normalised (:func:`normalize_text`: case, accent width and punctuation ignored). A turn
  that opens a conversation is its whole context and is matched at any length; a later turn of fewer than
  :data:`MIN_CONTAINED_CHARS` normalised characters ("continue", "thanks") is matched only against a turn that
  opens the other conversation;
- a containment: one user turn inside the other (normalised), the inner one at least ``MIN_CONTAINED_CHARS``
  characters long.

Every user turn of both splits is compared. :class:`EvalIndex` indexes the eval turns once, so that checking a
train prompt costs time linear in its own text (not in the number of eval prompts):

- equal texts: hash tables of the eval turns;
- a train turn inside an eval turn: its interior words (all but the first and last, which may be cut) are whole
  words of the eval turn, so only the eval turns holding its rarest interior word are searched (none when one
  of its words is in no eval turn);
- an eval turn inside a train turn: each eval turn is indexed by one interior word (the rarest among the eval
  turns, then the longest); a train turn is searched for the eval turns whose word it holds.

A text of two words or fewer (a long token, a language written without spaces) has no interior word: such a train
turn is searched in all eval turns at once (one C substring search over their joined text), and such an eval turn
in every train turn. ``tests/test_prepare.py`` checks the index against the all-pairs definition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from dspark_core.data.records import Prompt
from dspark_core.data.sources import normalize_text

# the containment check compares texts of at least this many normalised characters
MIN_CONTAINED_CHARS = 40


@dataclasses.dataclass(frozen=True)
class Overlap:
    """An eval prompt a train prompt overlaps: the turns involved (None: the whole prompt) and why."""

    eval: Prompt
    train_turn: int | None
    eval_turn: int | None
    why: str


class EvalIndex:
    """The eval prompts, indexed for :meth:`overlap` (see the module docstring)."""

    def __init__(self, evals: Iterable[Prompt]):
        self.by_id: dict[str, Prompt] = {}
        self.groups: dict[str, Prompt] = {}
        # text -> (eval prompt, turn): every turn, and the turns that open a conversation
        self.exact: dict[str, tuple[Prompt, int]] = {}
        self.exact_first: dict[str, tuple[Prompt, int]] = {}
        self.norm: dict[str, tuple[Prompt, int]] = {}
        self.norm_first: dict[str, tuple[Prompt, int]] = {}
        self.long: list[tuple[str, Prompt, int]] = []        # turns of >= MIN_CONTAINED_CHARS (normalised)
        for p in evals:
            self._add(p)
        self._index_words()

    def _add(self, p: Prompt) -> None:
        self.by_id.setdefault(p.id, p)
        if p.group is not None:
            self.groups.setdefault(p.group, p)
        for j, text in enumerate(p.turns):
            norm = normalize_text(text)
            self.exact.setdefault(text, (p, j))
            self.norm.setdefault(norm, (p, j))
            if j == 0:
                self.exact_first.setdefault(text, (p, j))
                self.norm_first.setdefault(norm, (p, j))
            if len(norm) >= MIN_CONTAINED_CHARS:
                self.long.append((norm, p, j))

    def _index_words(self) -> None:
        words = [t.split(" ") for t, _, _ in self.long]
        self.containing: dict[str, list[int]] = {}     # word -> long eval turns holding it
        for k, ws in enumerate(words):
            for w in dict.fromkeys(ws):
                self.containing.setdefault(w, []).append(k)
        self.blob = "\n".join(t for t, _, _ in self.long)   # normalised texts hold no newline
        self.anchored: dict[str, list[int]] = {}       # interior word -> long eval turns indexed by it
        self.loose: list[int] = []                     # long eval turns of <= 2 words (no interior word)
        for k, ws in enumerate(words):
            if len(ws) < 3:
                self.loose.append(k)
                continue
            inner = ws[1:-1]
            w = min(range(len(inner)), key=lambda i: (len(self.containing[inner[i]]), -len(inner[i]), i))
            self.anchored.setdefault(inner[w], []).append(k)
        self.vocab = set(self.containing)
        self.anchor_words = set(self.anchored)

    # -- checks -------------------------------------------------------------------------------------
    def overlap(self, p: Prompt, norms: Sequence[str] | None = None,
                words: Sequence[list[str]] | None = None) -> Overlap | None:
        """The first overlap of train prompt ``p`` with an eval prompt, or None. ``norms``: its turns normalised,
        ``words``: their words (both computed when not given)."""
        if p.id in self.by_id:
            return Overlap(self.by_id[p.id], None, None, "same id")
        if p.group is not None and p.group in self.groups:
            return Overlap(self.groups[p.group], None, None, f"same problem {p.group!r}")
        norms = [normalize_text(t) for t in p.turns] if norms is None else norms
        for i, (text, norm) in enumerate(zip(p.turns, norms)):
            anywhere = i == 0 or len(norm) >= MIN_CONTAINED_CHARS
            hit = (self.exact if anywhere else self.exact_first).get(text)
            if hit is not None:
                return Overlap(hit[0], i, hit[1], "same text")
            hit = (self.norm if anywhere else self.norm_first).get(norm)
            if hit is not None:
                return Overlap(hit[0], i, hit[1], "same normalised text")
        if self.long:
            for i, norm in enumerate(norms):
                if len(norm) >= MIN_CONTAINED_CHARS and norm not in self.norm:
                    ws = norm.split(" ") if words is None else words[i]
                    found = self._inside_eval(norm, ws, i) or self._eval_inside(norm, ws, i)
                    if found is not None:
                        return found
        return None

    def _inside_eval(self, norm: str, ws: list[str], i: int) -> Overlap | None:
        """A long train turn (``ws``: its words) inside a long eval turn."""
        if len(ws) >= 3:
            inner = ws[1:-1]                        # whole words of the eval turn (the first and last may be cut)
            if not self.vocab.issuperset(inner):    # stops at the first word no eval turn holds
                return None
            rarest = min(inner, key=lambda w: len(self.containing[w]))
            candidates: Iterable[int] = self.containing[rarest]
        elif norm in self.blob:
            candidates = range(len(self.long))
        else:
            return None
        for k in candidates:
            text, e, j = self.long[k]
            if norm in text:
                return Overlap(e, i, j, "the train text is inside the eval text")
        return None

    def _eval_inside(self, norm: str, ws: list[str], i: int) -> Overlap | None:
        """A long eval turn inside a long train turn (``ws``: the train turn's words)."""
        candidates: list[int] = []
        if not self.anchor_words.isdisjoint(ws):
            candidates = sorted({k for w in set(ws) & self.anchor_words for k in self.anchored[w]})
        for k in (*candidates, *self.loose) if self.loose else candidates:
            text, e, j = self.long[k]
            if text in norm:
                return Overlap(e, i, j, "the eval text is inside the train text")
        return None


def describe(t: Prompt, o: Overlap) -> str:
    """``train 'id' (source[ turn N]) vs eval 'id' (source[ turn N]): why``."""
    def turn(p: Prompt, n: int | None) -> str:
        return f", turn {n + 1}" if n is not None and len(p.turns) > 1 else ""

    return f"train {t.id!r} ({t.source}{turn(t, o.train_turn)}) vs eval {o.eval.id!r} ({o.eval.source}" \
           f"{turn(o.eval, o.eval_turn)}): {o.why}"


def find_overlaps(train: Iterable[Prompt], evals: Iterable[Prompt], limit: int = 5) -> list[str]:
    """Up to ``limit`` descriptions of train prompts that overlap an eval prompt (module docstring), in train
    order, one per train prompt."""
    index = EvalIndex(evals)
    found: list[str] = []
    for t in train:
        o = index.overlap(t)
        if o is not None:
            found.append(describe(t, o))
            if len(found) >= limit:
                break
    return found

