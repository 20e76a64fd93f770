"""The ``prepare`` stage: collect conversations, mix the training split by weights, hold out eval prompts per
domain, check that no eval conversation is trained on, write parquet.

Output ``{out_dir}/{train,eval}.parquet`` with columns ``id`` (str), ``source`` (str), ``domain`` (str: one of
``math_word``, ``competition_math``, ``code``, ``chat``), ``group`` (str or null: the upstream problem a prompt
derives from), ``turns`` (list<str>, user messages), ``system`` (str or null: the conversation's system message)
and ``replies`` (list<str>: the data set's own assistant turns, ``replies[i]`` answering ``turns[i]``), and the
stats (``stats_path``): per source the records read, held out, drawn and skipped (by reason), per split the
prompts, turns, system messages and replies.

Sources (``dspark_core/data/sources.py``): a registry of packaged data sets, plus files and data sets of chat
records (``jsonl:<path>``, ``parquet:<path>``, ``hf:<dataset>[:<config>[:<split>]][@<revision>]``; dspark ``turns``,
OpenAI ``messages`` and ShareGPT ``conversations`` records, multi-turn, with system messages: ``records.py``). Every
source has a domain (a file's records carry theirs) and the upstream split it reads; a public benchmark's test
split is **eval-only** and refused in the training mix. A source is a value, never a mapping key, so that
``dvc exp run -S`` can set it (``-S 'prepare.train=jsonl:data/sources/mine.jsonl'``).

Params (section ``prepare``):
- ``train``: the training mix, one source name or a list of ``{source, weight, holdout}`` (``weight`` default 1,
  ``holdout`` default none; a bare name in the list: weight 1): the weights are normalised and ``n_train`` is split by
  them (largest remainder, ties to the earlier source; weight 0 leaves a source out). A source with too few usable
  prompts is an error (no silent cap). ``n_train: null`` takes every usable record of every source of weight > 0
  that is not held out. ``holdout``: that share of the source's records, chosen by a hash of each record's id
  (stable: the same records whatever the sizes, the seed or the other sources), is held out: eval draws from it,
  train never.
- ``eval_sources: {domain: [sources]}``: ``n_eval_per_domain`` held-out prompts per domain, shared evenly over
  its sources (the first ones get the remainder). A domain with no source is not evaluated.
- ``on_bad_record``: ``error`` (default) refuses a file record of no accepted shape, or a JSONL line that is not
  JSON, naming its place; ``skip`` skips and counts it (by reason). ``max_bad_fraction``: a source whose share of
  such records is above it stops the run (the file is likely not what the source says).
- ``snapshot_dir``: read every registry source from ``{snapshot_dir}/{source}.jsonl`` instead of its package
  (pools saved by ``scripts/make_h200_prompts.py`` for a machine without the packages; the registry's domains and
  eval-only refusals still apply). A relative path is tried against the working directory, then the repo root.
- The old list form of ``eval_sources`` still reads: ``eval_sources: [..]`` with ``n_eval`` prompts in all (one
  group per source, each tagged with its source's domain). ``train_mix`` / ``train_sources`` / ``holdout`` (sources
  as mapping keys) are refused with the ``train`` value they spell.

An ``hf:`` source's revision is resolved to a commit before the first read and every read is of that commit; the
stats record both (``sources.<source>.revision`` / ``commit``).

Selection. A ``parquet:`` or ``hf:`` source, and any source given a ``holdout`` (0 too), is **streamed**: read once,
each record put on its side of the holdout, and drawn in a seeded hash order of the record ids (``seed``): only
the lowest keys a draw needs are held (a heap), so memory follows the records kept, not the source's size, and
nothing is shuffled in memory (a draw that skips more than expected reads the source again for the next keys).
The other sources (the registry's, and a ``jsonl:`` file without a ``holdout``) are read whole and shuffled
with ``seed`` (ShareGPT: a bounded prefix of the file; the GSM-Symbolic variants come in a seeded order already).
Either way a candidate's first turn must have at most ``max_prompt_chars`` characters. All eval prompts are drawn
first, then train; an id, a (normalised) first turn or an evaluated group is never drawn twice, and a train
conversation that overlaps an eval conversation (``overlap.py``: any user turn of either, the same text,
normalised text, group or a containment) is skipped and counted. :func:`check_no_overlap` then verifies what is
written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import heapq
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dspark_core.config import ParamsError, Section, one_of, positive, require
from dspark_core.data.overlap import MIN_CONTAINED_CHARS, EvalIndex, find_overlaps  # noqa: F401
from dspark_core.data.records import BAD_REASONS, ON_BAD_RECORD
from dspark_core.data.sources import (DOMAINS, GSM_DIR, GSM_PACKAGE, JSONL_PREFIX, REGISTRY, Prompt,  # noqa: F401
                                      ReadOptions, SourceInfo, _load_toml, check_source_name, iter_aime2025,
                                      iter_codeio, iter_gsm8k_symbolic, iter_gsm8k_test, iter_gsm_symbolic_variants,
                                      iter_humaneval, iter_json_array, iter_jsonl, iter_project_euler, iter_sharegpt,
                                      iter_snapshot, normalize_text, normalized_words, pinned, snapshot_options,
                                      source_info)
from dspark_core.errors import UserError
from dspark_core.io import atomic_dir, package_dir  # noqa: F401  (package_dir re-exported: dspark_core.dmtd.stage)

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")
BUILTIN_SOURCES = tuple(REGISTRY)
DEFAULT_TRAIN = [{"source": "sharegpt", "weight": 3}, {"source": "gsm_symbolic_variants", "weight": 2},
                 {"source": "codeio", "weight": 2}, {"source": "project_euler", "weight": 1}]
DEFAULT_EVAL_SOURCES = {"math_word": ("gsm8k_symbolic",), "competition_math": ("aime2025",), "code": ("humaneval",),
                        "chat": ("sharegpt",)}
DEFAULT_N_EVAL_PER_DOMAIN = 2
# a lazily-read source yields this many candidates per requested prompt (at least _MIN_POOL),
# so the seed picks among more than the first few records while the read stays short
_POOL_FACTOR = 4
_MIN_POOL = 256
# a streamed draw holds its need plus this share (at least _MIN_SLACK) of the lowest keys: room for the records
# the draw skips (repeated texts, eval overlaps) before the source is read again
_SLACK_SHARE = 0.25
_MIN_SLACK = 256
_HOLDOUT_PERSON = b"dspark-holdout"   # the holdout hash's personalisation: independent of the draw order's


def _prompts_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("source", pa.string()), ("domain", pa.string()), ("group", pa.string()),
                      ("turns", pa.list_(pa.string())), ("system", pa.string()), ("replies", pa.list_(pa.string()))])


@dataclasses.dataclass(frozen=True)
class EvalDraw:
    domain: str | None    # None: the old list form (each prompt keeps its source's domain)
    source: str
    n: int


@dataclasses.dataclass(frozen=True)
class MixEntry:
    """One source of the training mix: its weight and the share of its records held out for eval."""

    source: str
    weight: float = 1.0
    holdout: float | None = None   # None: none asked for (a holdout of 0 still draws the source in the hash order)


TRAIN_FORM = ("a source name (train: jsonl:data/sources/mine.jsonl) or a list of {source, weight[, holdout]} "
              "(train: [{source: sharegpt, weight: 3}, {source: 'jsonl:data/sources/mine.jsonl', weight: 1}])")
# keys of the sources-as-mapping-keys form, which `dvc exp run -S` cannot set: refused, showing their `train` value
OLD_KEYS = ("train_mix", "train_sources", "holdout")


@dataclasses.dataclass(frozen=True)
class PrepareConfig(Section):
    """params section ``prepare``."""

    train: Any = None                     # a source | [{source, weight?, holdout?} | source, ...]; None: DEFAULT_TRAIN
    eval_sources: Any = None              # {domain: [sources]} (or the old list); None: DEFAULT_EVAL_SOURCES
    n_train: int | None = 24              # None: every usable record (not held out) of the train sources
    n_eval_per_domain: int | None = None  # None: DEFAULT_N_EVAL_PER_DOMAIN (with the mapping form)
    n_eval: int | None = None             # old form: eval prompts in all, over a list of eval_sources
    max_prompt_chars: int = 1500
    seed: int = 0
    gsm8k_instruction: bool = True        # math_word: append the package's "solve step by step ... \boxed{}" line
    competition_instruction: bool = True  # competition_math: append "reason step by step ... \boxed{}"
    on_bad_record: str = "error"          # a file record of no accepted shape: error (refused) | skip (counted)
    max_bad_fraction: float | None = 0.1  # a source whose share of bad (skipped) records is above it stops the run
    snapshot_dir: str | None = None       # read every registry source from {snapshot_dir}/{source}.jsonl
    out_dir: str = "data/prompts"
    stats_path: str | None = None         # the stats JSON (None: not written)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, src: str = "", prefix: str = "") -> "PrepareConfig":
        old = [k for k in OLD_KEYS if k in (data or {})]
        if old:
            where = f"{src}: " if src else ""
            raise ParamsError(f"{where}{prefix}{old[0]} is not a parameter: the training mix and its holdout are one "
                              f"value, {prefix}train (a source name or a list of {{source, weight[, holdout]}}, which "
                              f"`dvc exp run -S` can set); here: train: {_train_from_old(data)}")
        return super().from_dict(data, src=src, prefix=prefix)

    def validate(self) -> None:
        if self.n_train is not None:
            positive("n_train", self.n_train)
        positive("max_prompt_chars", self.max_prompt_chars)
        one_of("on_bad_record", self.on_bad_record, ON_BAD_RECORD)
        if self.max_bad_fraction is not None:
            require(0 <= self.max_bad_fraction <= 1, f"max_bad_fraction must be in [0, 1] (or null: no limit); got "
                                                      f"{self.max_bad_fraction!r}")
        self.entries()
        draws = self.eval_draws()
        require(len(draws) > 0, "eval_sources must name at least one source")

    # -- the training mix -----------------------------------------------------------------------------
    def entries(self) -> list[MixEntry]:
        """The training mix in the params' order (weights as given, not normalised)."""
        items = _entries(DEFAULT_TRAIN if self.train is None else self.train)
        names = [e.source for e in items]
        require(len(set(names)) == len(names), f"train lists a source twice: {names}")
        for e in items:
            info = source_info(e.source, "train")
            require(not info.eval_only,
                    f"train: {e.source!r} is eval-only ({info.split}: a public benchmark's test split) and never "
                    f"trains; list it under eval_sources")
            require(math.isfinite(e.weight) and e.weight >= 0,
                    f"train: the weight of {e.source!r} must be a number >= 0; got {e.weight!r}")
            require(e.holdout is None or 0 <= e.holdout < 1,
                    f"train: the holdout of {e.source!r} must be >= 0 and < 1; got {e.holdout!r}")
        require(sum(e.weight for e in items) > 0, "train: at least one weight must be > 0")
        return items

    def mix(self) -> list[tuple[str, float]]:
        """``[(source, weight)]`` of the training mix."""
        return [(e.source, e.weight) for e in self.entries()]

    def train_counts(self) -> list[tuple[str, int | None]]:
        """``[(source, prompts)]``: ``n_train`` split by the normalised weights (sources with 0 left out); with
        ``n_train: null`` every source of weight > 0 with None (all its usable records)."""
        pairs = self.mix()
        if self.n_train is None:
            return [(s, None) for s, w in pairs if w > 0]
        counts = allocate(self.n_train, [w for _, w in pairs])
        return [(s, k) for (s, _), k in zip(pairs, counts) if k > 0]

    # -- the eval sets -------------------------------------------------------------------------------
    def eval_draws(self) -> list[EvalDraw]:
        spec = DEFAULT_EVAL_SOURCES if self.eval_sources is None else self.eval_sources
        if isinstance(spec, dict):
            require(self.n_eval is None, "n_eval (eval prompts in all) goes with a list of eval_sources; with "
                                         "the per-domain mapping set n_eval_per_domain")
            n = DEFAULT_N_EVAL_PER_DOMAIN if self.n_eval_per_domain is None else self.n_eval_per_domain
            positive("n_eval_per_domain", n)
            draws, seen = [], []
            for domain, sources in spec.items():
                require(domain in DOMAINS, f"eval_sources: unknown domain {domain!r} (domains: {', '.join(DOMAINS)})")
                if sources is None:
                    continue
                require(isinstance(sources, (list, tuple)) and all(isinstance(s, str) for s in sources),
                        f"eval_sources.{domain} must be a list of source names, got {sources!r}")
                if not sources:
                    continue
                require(n >= len(sources), f"eval_sources.{domain} has {len(sources)} sources but "
                                           f"n_eval_per_domain asks for only {n} prompts")
                for s, k in zip(sources, split_evenly(n, len(sources))):
                    info = source_info(s, f"eval_sources.{domain}")
                    require(not info.domain or info.domain == domain,
                            f"eval_sources.{domain}: {s!r} is a {info.domain} source")
                    seen.append(s)
                    draws.append(EvalDraw(domain, s, k))
            require(len(set(seen)) == len(seen), f"eval_sources lists a source twice: {seen}")
            return draws
        if isinstance(spec, (list, tuple)):
            require(self.n_eval_per_domain is None, "n_eval_per_domain goes with the mapping form of eval_sources "
                                                    "({domain: [sources]}); with a list set n_eval")
            require(len(spec) > 0, "eval_sources must name at least one source")
            require(all(isinstance(s, str) for s in spec), f"eval_sources must be source names, got {list(spec)}")
            require(len(set(spec)) == len(spec), f"eval_sources lists a source twice: {list(spec)}")
            n = 16 if self.n_eval is None else self.n_eval
            positive("n_eval", n)
            require(n >= len(spec), f"eval_sources has {len(spec)} sources but the split asks for only {n} prompts")
            for s in spec:
                source_info(s, "eval_sources")
            return [EvalDraw(None, s, k) for s, k in zip(spec, split_evenly(n, len(spec)))]
        raise UserError(f"eval_sources must be a mapping {{domain: [sources]}}, got {spec!r}")

    @property
    def eval_count_key(self) -> str:
        return "n_eval" if isinstance(self.eval_sources, (list, tuple)) else "n_eval_per_domain"

    # -- the holdout ---------------------------------------------------------------------------------
    def holdouts(self) -> dict[str, float]:
        """``{source: fraction}`` of the training sources that name a holdout."""
        return {e.source: e.holdout for e in self.entries() if e.holdout is not None}

    @property
    def read_options(self) -> ReadOptions:
        return ReadOptions(self.seed, self.gsm8k_instruction, self.competition_instruction, self.on_bad_record)


def _entries(spec: Any) -> list[MixEntry]:
    """The :class:`MixEntry` list of a ``train`` value: a source name, or a list of names (weight 1) and
    ``{source, weight?, holdout?}`` mappings."""
    if isinstance(spec, str):
        return [MixEntry(spec)]
    if isinstance(spec, dict):
        raise UserError(f"train is a list, not a mapping of sources: train: {_flow(_old_entries(spec, 'weight'))}")
    if not isinstance(spec, (list, tuple)) or not spec:
        raise UserError(f"train must be {TRAIN_FORM}; got {spec!r}")
    out = []
    for e in spec:
        if isinstance(e, str):
            out.append(MixEntry(e))
            continue
        if not isinstance(e, dict) or not isinstance(e.get("source"), str) or set(e) - {"source", "weight", "holdout"}:
            hint = f" (written {_flow(_old_entries([e], 'weight')[0])})" if _old_entries([e], "weight") else ""
            raise UserError(f"train: entry {e!r} is not a source name or a {{source, weight[, holdout]}} mapping"
                            f"{hint}")
        weight, holdout = e.get("weight", 1), e.get("holdout")
        for what, v in (("weight", weight), ("holdout", 0 if holdout is None else holdout)):
            require(isinstance(v, (int, float)) and not isinstance(v, bool),
                    f"train: the {what} of {e['source']!r} must be a number, got {v!r}")
        out.append(MixEntry(e["source"], float(weight), None if holdout is None else float(holdout)))
    return out


def _old_entries(spec: Any, what: str) -> list[dict]:
    """``[{source, <what>}]`` of an old ``{source: number}`` mapping or ``[[source, number], ...]`` list ([] when
    it is neither)."""
    items = list(spec.items()) if isinstance(spec, dict) else spec if isinstance(spec, (list, tuple)) else []
    out = []
    for e in items:
        if isinstance(e, dict) and len(e) == 1:
            e = next(iter(e.items()))
        if isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], str):
            out.append({"source": e[0], what: e[1]})
        elif isinstance(e, str):
            out.append({"source": e, what: 1})
    return out


def _train_from_old(data: dict) -> str:
    """The ``train`` value (YAML flow) that the old ``train_mix`` / ``train_sources`` / ``holdout`` keys spell."""
    if "train_mix" in data or "train_sources" in data:
        entries = _old_entries(data.get("train_mix", data.get("train_sources")), "weight")
    else:
        try:
            entries = [{"source": e.source, "weight": int(e.weight) if e.weight.is_integer() else e.weight}
                       for e in _entries(DEFAULT_TRAIN if data.get("train") is None else data["train"])]
        except UserError:
            entries = []
    by = {e["source"]: e for e in entries}
    for h in _old_entries(data.get("holdout"), "holdout"):
        by.setdefault(h["source"], {"source": h["source"], "weight": 0})["holdout"] = h["holdout"]
    return _flow(list(by.values()))


def _flow(value: Any) -> str:
    """``value`` as one line of YAML flow style (what a params.yaml line holds)."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 30).strip()


# ----------------------------------------------------------------------------------------------
# sizes
# ----------------------------------------------------------------------------------------------
def split_evenly(n: int, k: int) -> list[int]:
    """``n`` items over ``k`` parts, the first parts get the remainder: (10, 3) -> [4, 3, 3]."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def allocate(n: int, weights: list[float]) -> list[int]:
    """``n`` split by ``weights`` (normalised): floors, then the largest remainders (ties: the earlier part).

    ``allocate(24, [3, 2, 2, 1]) == [9, 6, 6, 3]``; equal weights give :func:`split_evenly`."""
    total = sum(weights)
    exact = [n * w / total for w in weights]
    out = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: n - sum(out)]:
        out[i] += 1
    return out


# ----------------------------------------------------------------------------------------------
# whole-pool sources (read whole, shuffled)
# ----------------------------------------------------------------------------------------------
def iter_source(source: str, cfg: PrepareConfig) -> Iterator[Prompt]:
    return source_info(source).read(cfg.read_options, Counter())


def candidate_pool(prompts: Iterable[Prompt], max_chars: int, limit: int | None, seed: int,
                   skipped: Counter | None = None) -> list[Prompt]:
    """Unique-text prompts of at most ``max_chars`` (first turn), at most ``limit`` of them, shuffled."""
    pool = list(_candidates(prompts, max_chars, limit, skipped))
    random.Random(seed).shuffle(pool)
    return pool


def _candidates(prompts: Iterable[Prompt], max_chars: int, limit: int | None = None,
                skipped: Counter | None = None) -> Iterator[Prompt]:
    seen: set[str] = set()
    skipped = Counter() if skipped is None else skipped
    n = 0
    for p in prompts:
        text = p.turns[0]
        if len(text) > max_chars:
            skipped["too_long"] += 1
            continue
        key = normalize_text(text)
        if key in seen:
            skipped["repeated_text"] += 1
            continue
        seen.add(key)
        yield p
        n += 1
        if limit is not None and n >= limit:
            return


def _source_prompts(info: SourceInfo, cfg: PrepareConfig, skipped: Counter) -> Iterator[Prompt]:
    """The prompts of a source: a registry source from its package or the snapshot, a file from the file."""
    if cfg.snapshot_dir is not None and info.name in REGISTRY:
        return iter_snapshot(cfg.snapshot_dir, info.name)
    return info.read(cfg.read_options, skipped)


def _pool(info: SourceInfo, cfg: PrepareConfig, need: int | None, stats: SourceStats) -> Iterator[Prompt]:
    prompts = stats.counted(_source_prompts(info, cfg, stats.skipped))
    if cfg.snapshot_dir is not None and info.name in REGISTRY:  # a saved pool: read whole, shuffled
        return iter(candidate_pool(prompts, cfg.max_prompt_chars, None, cfg.seed, stats.skipped))
    if info.shuffled:  # a seeded random order already: drawn as it comes (no need to read it all)
        return _candidates(prompts, cfg.max_prompt_chars, None, stats.skipped)
    limit = max(_POOL_FACTOR * need, _MIN_POOL) if info.lazy and need is not None else None
    return iter(candidate_pool(prompts, cfg.max_prompt_chars, limit, cfg.seed, stats.skipped))


# ----------------------------------------------------------------------------------------------
# streamed sources (hash order, holdout)
# ----------------------------------------------------------------------------------------------
def holdout_value(rid: str) -> int:
    """A record id's 64-bit holdout hash: the record is held out when it is below ``fraction * 2**64``."""
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8,
                                          person=_HOLDOUT_PERSON).digest(), "big")


def order_key(rid: str, seed: int) -> int:
    """A record id's 64-bit place in the seeded draw order of a streamed source."""
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8,
                                          key=str(seed).encode()).digest(), "big")


def is_held_out(rid: str, fraction: float) -> bool:
    """Whether record ``rid`` is in the held-out ``fraction`` of its source (stable: the id alone decides)."""
    return holdout_value(rid) < int(fraction * 2.0 ** 64)


class _Lowest:
    """The ``limit`` entries of lowest ``(key, seq)`` offered (all of them when ``limit`` is None)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        # bounded: a heap of (-key, -seq, prompt), the highest kept on top; unbounded: (key, seq, prompt)
        self.entries: list[tuple[int, int, Prompt]] = []
        self.offered = 0

    def offer(self, key: int, seq: int, p: Prompt) -> None:
        self.offered += 1
        h = self.entries
        if self.limit is None:
            h.append((key, seq, p))
        elif len(h) < self.limit:
            h.append((-key, -seq, p))
            if len(h) == self.limit:
                heapq.heapify(h)
        elif (key, seq) < (-h[0][0], -h[0][1]):
            heapq.heapreplace(h, (-key, -seq, p))

    def take_descending(self) -> list[tuple[int, int, Prompt]]:
        """``(key, seq, prompt)`` in decreasing order (pop from the end: the lowest first), handed over."""
        h, self.entries = self.entries, []
        if self.limit is None:
            h.sort(reverse=True)       # (key, seq) decide: seq is unique, a prompt is never compared
            return h
        out = [(-k, -s, p) for k, s, p in h]
        out.sort(reverse=True)
        return out

    @property
    def complete(self) -> bool:
        return self.limit is None or self.offered <= self.limit


class StreamedSource:
    """A source drawn in the seeded hash order of its record ids, on the sides of its holdout: ``eval`` (the
    held-out records) and ``train`` (the others), or one side ``all`` without a holdout. One pass over the source
    fills every side's lowest keys; a side that runs out while more of its records exist reads the source again
    for the next ones (twice as many)."""

    def __init__(self, info: SourceInfo, cfg: PrepareConfig, fraction: float, need: dict[str, int | None],
                 stats: SourceStats):
        self.info, self.cfg, self.stats = info, cfg, stats
        self.threshold = int(fraction * 2.0 ** 64)
        self.need = need          # side -> prompts asked (None: all)
        self.sides: dict[str, Iterator[Prompt]] | None = None

    def side(self, name: str) -> Iterator[Prompt]:
        if self.sides is None:
            limits = {s: _limit(k) for s, k in self.need.items()}
            got = self._scan(limits, {}, self.stats.skipped, first=True)
            self.sides = {s: self._drain(s, got[s], limits[s]) for s in self.need}
        return self.sides[name]

    def _records(self, skipped: Counter) -> Iterator[tuple[str, Prompt]]:
        """``(record id, Prompt)``: a file's own records; a registry source's prompts with their ids less the
        ``source:`` prefix."""
        if self.info.records is not None:
            return self.info.records(self.cfg.read_options, skipped)
        return ((p.id.split(":", 1)[1], p) for p in _source_prompts(self.info, self.cfg, skipped))

    def _side_of(self, rid: str) -> str:
        if self.threshold == 0:
            return "all"
        return "eval" if holdout_value(rid) < self.threshold else "train"

    def _scan(self, limits: dict[str, int | None], after: dict[str, tuple[int, int]], skipped: Counter,
              first: bool = False) -> dict[str, _Lowest]:
        """One pass: per side the lowest keys (after ``after[side]``) of the usable records."""
        lowest = {s: _Lowest(k) for s, k in limits.items()}
        seed, max_chars = self.cfg.seed, self.cfg.max_prompt_chars
        held = 0
        seq = -1
        for seq, (rid, p) in enumerate(self._records(skipped)):
            side = self._side_of(rid)
            if side == "eval":
                held += 1
            if side not in lowest:
                continue
            if len(p.turns[0]) > max_chars:
                if first:
                    skipped["too_long"] += 1
                continue
            key = order_key(rid, seed)
            if side in after and (key, seq) <= after[side]:
                continue
            lowest[side].offer(key, seq, p)
        if first:
            self.stats.read += seq + 1
            self.stats.held_out += held
        return lowest

    def _drain(self, side: str, lowest: _Lowest, limit: int | None) -> Iterator[Prompt]:
        while True:
            last = None
            entries = lowest.take_descending()
            while entries:                     # popped as drawn: a drawn record is held by the split only
                key, seq, p = entries.pop()
                last = (key, seq)
                yield p
            if lowest.complete or last is None:
                return
            limit = 2 * limit
            lowest = self._scan({side: limit}, {side: last}, Counter())[side]
            self.stats.passes += 1


def _limit(need: int | None) -> int | None:
    return None if need is None else need + max(int(need * _SLACK_SHARE), _MIN_SLACK)


# ----------------------------------------------------------------------------------------------
# selection
# ----------------------------------------------------------------------------------------------
READER_SKIPS = ("tool", "non_text", *BAD_REASONS)   # skipped by the reader: records that are no prompt


@dataclasses.dataclass
class SourceStats:
    """What the draw did with one source: records read and held out, prompts drawn per split, records skipped
    (by reason: :data:`READER_SKIPS`, a first turn over ``max_prompt_chars`` (``too_long``), a repeated id or first
    turn, an evaluated group, an eval overlap), passes over a streamed source."""

    read: int = 0                 # prompts read (records less READER_SKIPS)
    held_out: int = 0
    passes: int = 1
    streamed: bool = False
    revision: str | None = None   # an hf: source's revision as asked for, and the commit it resolved to
    commit: str | None = None
    drawn: Counter = dataclasses.field(default_factory=Counter)
    skipped: Counter = dataclasses.field(default_factory=Counter)

    def counted(self, prompts: Iterable[Prompt]) -> Iterator[Prompt]:
        for p in prompts:
            self.read += 1
            yield p

    @property
    def records(self) -> int:
        return self.read + sum(self.skipped[k] for k in READER_SKIPS)

    def check_bad(self, source: str, max_fraction: float | None) -> None:
        """Stop when the share of bad records (``BAD_REASONS``, skipped) is above ``max_fraction``: the source is
        likely not what it says."""
        bad = {k: self.skipped[k] for k in BAD_REASONS if self.skipped[k]}
        if max_fraction is None or sum(bad.values()) <= max_fraction * self.records:
            return
        n = sum(bad.values())
        raise UserError(f"prepare: {source}: {n:,} of {self.records:,} records are bad "
                        f"({', '.join(f'{k} {v:,}' for k, v in bad.items())}; {n / self.records:.1%}), more than "
                        f"prepare.max_bad_fraction {max_fraction:g}: the source is likely not what it says (check it: "
                        f"on_bad_record: error stops at the first bad record and names its line; raise "
                        f"max_bad_fraction to train on the rest)")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"records": self.records, "drawn": dict(self.drawn),
                               "skipped": dict(sorted(self.skipped.items()))}
        if self.streamed:
            out.update(held_out=self.held_out, passes=self.passes)
        if self.commit is not None:
            out.update(revision=self.revision, commit=self.commit)
        return out


class _Selection:
    """The draw of both splits: the pools of every source, what is used, the eval index, the stats."""

    def __init__(self, cfg: PrepareConfig):
        self.cfg = cfg
        self.holdouts = cfg.holdouts()
        self.draws = cfg.eval_draws()
        self.train_counts = cfg.train_counts()
        self.need: dict[str, dict[str, int | None]] = {}
        for d in self.draws:
            self.need.setdefault(d.source, {"eval": 0, "train": 0})["eval"] += d.n
        for s, k in self.train_counts:
            self.need.setdefault(s, {"eval": 0, "train": 0})["train"] = k
        self.infos = {s: pinned(source_info(s)) for s in self.need}   # an hf: source: one commit for every read
        self.stats = {s: SourceStats(streamed=self._streamed(s)) for s in self.need}
        for s, info in self.infos.items():
            if info.hf is not None and info.hf.commit is not None:
                self.stats[s].revision, self.stats[s].commit = info.hf.revision or "main", info.hf.commit
        self.pools: dict[tuple[str, str], Iterator[Prompt]] = {}
        self.streams: dict[str, StreamedSource] = {}
        self.used_ids: set[str] = set()
        self.used_texts: set[str] = set()
        self.eval_groups: set[str] = set()
        self.index: EvalIndex | None = None
        self.out: dict[str, list[Prompt]] = {"eval": [], "train": []}

    def _streamed(self, source: str) -> bool:
        return self.infos[source].streamed or source in self.holdouts

    def pool(self, source: str, split: str) -> Iterator[Prompt]:
        need = self.need[source]
        if not self.stats[source].streamed:
            if source not in self.pools:
                total = None if need["train"] is None else need["eval"] + need["train"]
                self.pools[source] = _pool(self.infos[source], self.cfg, total, self.stats[source])
            return self.pools[source]
        if source not in self.streams:
            fraction = self.holdouts.get(source, 0.0)
            sides = ({"eval": need["eval"], "train": need["train"]} if fraction > 0 else
                     {"all": None if need["train"] is None else need["eval"] + need["train"]})
            self.streams[source] = StreamedSource(self.infos[source], self.cfg, fraction,
                                                  {s: k for s, k in sides.items() if k != 0}, self.stats[source])
        return self.streams[source].side(split if self.holdouts.get(source, 0.0) > 0 else "all")

    def skip_reason(self, p: Prompt, split: str) -> tuple[str | None, str]:
        """Why ``p`` cannot be drawn (None: it can), and its first turn normalised."""
        if p.id in self.used_ids:
            return "repeated_id", ""
        words = normalized_words(p.turns[0])
        first = " ".join(words)
        if first in self.used_texts:
            return "repeated_text", first
        if p.group is not None and p.group in self.eval_groups:
            return "evaluated_group", first
        if split == "train" and self.index is not None:
            turn_words = [words, *(normalized_words(t) for t in p.turns[1:])]
            norms = [first, *(" ".join(ws) for ws in turn_words[1:])]
            if self.index.overlap(p, norms, turn_words) is not None:
                return "eval_overlap", first
        return None, first

    def draw(self, source: str, k: int | None, split: str, domain: str | None) -> None:
        """``k`` prompts (None: every usable one) of ``source`` into ``split``."""
        pool = self.pool(source, split)
        stats = self.stats[source]
        taken = 0
        while k is None or taken < k:
            p = next(pool, None)
            if p is None:
                if k is None:
                    break
                stats.check_bad(source, self.cfg.max_bad_fraction)   # a wrong file: that, not "too few"
                raise UserError(_too_few(source, split, self.need[source], self.cfg, self.holdouts.get(source)))
            why, first = self.skip_reason(p, split)
            if why is not None:
                stats.skipped[why] += 1
                continue
            if domain is not None and p.domain != domain:
                p = dataclasses.replace(p, domain=domain)
            self.used_ids.add(p.id)
            self.used_texts.add(first)
            if split == "eval" and p.group is not None:
                self.eval_groups.add(p.group)
            self.out[split].append(p)
            taken += 1
        stats.drawn[split] += taken
        if k is None and taken == 0:
            raise UserError(f"prepare: source {source!r} gave no usable train prompt (n_train: null takes every "
                            f"usable record of at most max_prompt_chars={self.cfg.max_prompt_chars} characters, "
                            f"not held out and overlapping no eval prompt; check the source or take it out of "
                            f"prepare.train)")

    def run(self) -> dict[str, list[Prompt]]:
        for d in self.draws:
            self.draw(d.source, d.n, "eval", d.domain)
        self.index = EvalIndex(self.out["eval"])
        for s, k in self.train_counts:
            self.draw(s, k, "train", None)
        return self.out


def select_splits(cfg: PrepareConfig, stats: dict[str, Any] | None = None) -> dict[str, list[Prompt]]:
    """Draw every eval set, then the training mix, never reusing an id, a text or an evaluated group, and never
    training on a conversation that overlaps an eval one: every train prompt is checked against the finished eval
    split's :class:`~dspark_core.data.overlap.EvalIndex` as it is drawn (the check :func:`check_no_overlap` makes,
    without a second pass over the training split). ``stats``: filled with each source's :class:`SourceStats`."""
    if cfg.snapshot_dir is not None:
        check_snapshot_options(cfg)
    sel = _Selection(cfg)
    out = sel.run()
    for source, st in sel.stats.items():
        if st.skipped:
            log.info("prepare: %s skipped %s", source, ", ".join(f"{k} {v}" for k, v in sorted(st.skipped.items())))
        st.check_bad(source, cfg.max_bad_fraction)
    if stats is not None:
        stats.update({s: st.to_dict() for s, st in sel.stats.items()})
    return out


def check_snapshot_options(cfg: PrepareConfig) -> None:
    """A snapshot's texts carry the instructions it was written with: they must be the ones asked for."""
    saved = snapshot_options(cfg.snapshot_dir)
    for key, value in dataclasses.asdict(cfg.read_options).items():
        if key in saved and key != "seed" and saved[key] != value:
            raise UserError(f"prepare.{key}={value} but the snapshot {cfg.snapshot_dir} was written with {saved[key]} "
                            f"(set it so, or rewrite the snapshot: scripts/make_h200_prompts.py)")


def _too_few(source: str, split: str, need: dict[str, int | None], cfg: PrepareConfig,
             fraction: float | None = None) -> str:
    key = "n_train (or its weight in train)" if split == "train" else cfg.eval_count_key
    part = ""
    if fraction:
        part = (f" in its held-out {fraction:g} (its holdout in prepare.train)" if split == "eval" else
                f" outside its held-out {fraction:g} (its holdout in prepare.train)")
    return (f"prepare: source {source!r} has too few usable prompts{part} for the requested sizes "
            f"(needs {need['eval']} eval + {'all' if need['train'] is None else need['train']} train of at most "
            f"max_prompt_chars="
            f"{cfg.max_prompt_chars} characters, unique, none from an evaluated problem; ran out while filling "
            f"{split}; lower prepare.{key} or add sources)")


# ----------------------------------------------------------------------------------------------
# the overlap check
# ----------------------------------------------------------------------------------------------
def check_no_overlap(train: list[Prompt], evals: list[Prompt]) -> None:
    """Raise a UserError naming the overlaps when any train prompt overlaps an eval prompt
    (:func:`dspark_core.data.overlap.find_overlaps`)."""
    found = find_overlaps(train, evals)
    if found:
        raise UserError("prepare: eval prompts must never be trained on, but the training split overlaps the eval "
                        "split:\n  " + "\n  ".join(found) + "\n(remove the overlap from the sources, or take the "
                        "source out of prepare.train)")


# ----------------------------------------------------------------------------------------------
# parquet
# ----------------------------------------------------------------------------------------------
WRITE_ROWS = 1 << 16   # prompts converted to Arrow and written (one row group) at a time


def write_prompts(path: str | Path, prompts: list[Prompt]) -> None:
    """The prompts parquet (columns: the module docstring), written a row group of ``WRITE_ROWS`` at a time (so
    the Arrow copy is one group's, not the split's), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dspark_core.io import atomic_path

    schema = _prompts_schema()
    with atomic_path(path, ".parquet") as tmp:
        with pq.ParquetWriter(tmp, schema, write_page_checksum=True) as writer:
            for start in range(0, max(len(prompts), 1), WRITE_ROWS):
                writer.write_table(_prompts_table(prompts[start:start + WRITE_ROWS], schema, pa))


def _prompts_table(prompts: list[Prompt], schema: Any, pa: Any) -> Any:
    return pa.table({
        "id": pa.array([p.id for p in prompts], pa.string()),
        "source": pa.array([p.source for p in prompts], pa.string()),
        "domain": pa.array([p.domain for p in prompts], pa.string()),
        "group": pa.array([p.group for p in prompts], pa.string()),
        "turns": pa.array([p.turns for p in prompts], pa.list_(pa.string())),
        "system": pa.array([p.system for p in prompts], pa.string()),
        "replies": pa.array([p.replies for p in prompts], pa.list_(pa.string())),
    }, schema=schema)


def domain_of_source(source: str) -> str:
    """The registry domain of ``source`` (prompts files written before the ``domain`` column); else ``chat``."""
    info = REGISTRY.get(source)
    return info.domain if info else "chat"


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompts parquet written by :func:`write_prompts` (older files: no ``domain`` / ``group``)."""
    from dspark_core.io import read_parquet

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: prompts file not found (run the prepare stage)")
    table = read_parquet(path, fix="rerun the prepare stage (`dvc repro -f prepare`)")
    missing = {"id", "source", "turns"} - set(table.column_names)
    if missing:
        raise UserError(f"{path}: missing columns {sorted(missing)}")
    rows = table.to_pydict()
    n = len(rows["id"])
    domains = rows.get("domain") or [domain_of_source(s) for s in rows["source"]]
    groups = rows.get("group") or [None] * n
    systems = rows.get("system") or [None] * n
    replies = rows.get("replies") or [None] * n
    prompts = [Prompt(i, s, tuple(t or ()), d or domain_of_source(s), g, sy, tuple(r or ()))
               for i, s, t, d, g, sy, r in zip(rows["id"], rows["source"], rows["turns"], domains, groups, systems,
                                               replies)]
    bad = next((p for p in prompts if not p.turns or not all(isinstance(t, str) and t.strip() for t in p.turns)), None)
    if bad is not None:
        what = "an empty 'turns' list" if not bad.turns else f"an empty turn ({list(bad.turns)[:3]!r})"
        raise UserError(f"{path}: row id={bad.id!r} has {what}; fix the prompts (rerun the prepare stage)")
    return prompts


def split_summary(prompts: list[Prompt]) -> dict[str, Any]:
    """A split's size: prompts, user turns, conversations of several turns, with a system message, with the data
    set's replies; and the prompts per ``domain/source``."""
    return {"prompts": len(prompts), "turns": sum(len(p.turns) for p in prompts),
            "multi_turn": sum(len(p.turns) > 1 for p in prompts),
            "with_system": sum(p.system is not None for p in prompts),
            "with_replies": sum(bool(p.replies) for p in prompts),
            "by_domain": dict(sorted(Counter(f"{p.domain}/{p.source}" for p in prompts).items()))}


def local_files(cfg: PrepareConfig) -> dict[str, Path]:
    """``{source: path}`` of the files and folders the sources read (``jsonl:``, ``parquet:``, a local ``hf:``
    folder, ``snapshot_dir``)."""
    from dspark_core.data.records import PARQUET_PREFIX, jsonl_path, local_path
    from dspark_core.data.sources import resolve_dir

    out: dict[str, Path] = {}
    for s in dict.fromkeys([*(s for s, _ in cfg.mix()), *(d.source for d in cfg.eval_draws())]):
        info = source_info(s)
        if s.startswith(JSONL_PREFIX):
            out[s] = jsonl_path(s[len(JSONL_PREFIX):])
        elif s.startswith(PARQUET_PREFIX):
            out[s] = local_path(s[len(PARQUET_PREFIX):])
        elif info.hf is not None and info.hf.local:
            out[s] = Path(info.hf.path)
    if cfg.snapshot_dir is not None:
        out["snapshot_dir"] = resolve_dir(cfg.snapshot_dir)
    return out


def warn_untracked_files(cfg: PrepareConfig, dvc_yaml: Path = Path("dvc.yaml")) -> list[str]:
    """One warning line for each local file a source reads that lies outside the prepare stage's dependencies in
    ``dvc_yaml`` (``data/sources/``): DVC does not rerun prepare when such a file changes. Returns the lines (none
    where there is no dvc.yaml)."""
    from dspark_core.config import read_yaml

    try:
        deps = read_yaml(dvc_yaml)["stages"]["prepare"]["deps"]
    except (UserError, KeyError, TypeError):
        return []
    roots = [(dvc_yaml.parent / d).resolve() for d in deps]
    lines = []
    for source, path in local_files(cfg).items():
        if not any(path.resolve().is_relative_to(r) for r in roots):
            lines.append(f"prepare: {source} reads {path}, which is no dependency of the prepare stage in {dvc_yaml}: "
                         f"DVC will not rerun prepare when it changes (put it under data/sources/, or run `dvc repro "
                         f"-f prepare` after changing it)")
            log.warning("%s", lines[-1])
    return lines


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """The draw makes millions of objects that hold no reference cycle (records, prompts, their texts); the cyclic
    collector's passes over the kept ones find nothing and cost ~9% of the stage at 250k records. Reference
    counting frees everything as usual meanwhile."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_prepare(cfg: PrepareConfig, stats: dict[str, Any] | None = None) -> dict[str, int]:
    """The ``prepare`` stage: write ``{out_dir}/{train,eval}.parquet`` and the stats (``stats_path``, and into
    ``stats`` when given); return the split sizes. ``out_dir`` is replaced whole once both splits are written: a
    run that fails leaves the previous prompts and stats as they were (dvc.yaml keeps them: ``persist``)."""
    t0 = time.perf_counter()
    per_source: dict[str, Any] = {}
    with _cyclic_gc_paused():
        splits = select_splits(cfg, per_source)
    with atomic_dir(cfg.out_dir) as tmp:
        for split in SPLITS:
            write_prompts(tmp / f"{split}.parquet", splits[split])
    for split in SPLITS:
        by = Counter(f"{p.domain}/{p.source}" for p in splits[split])
        log.info("prepare: %s %d prompts (%s)", split, len(splits[split]),
                 ", ".join(f"{k} {v}" for k, v in sorted(by.items())))
    report = {**{s: split_summary(splits[s]) for s in SPLITS}, "sources": per_source,
              "seconds": round(time.perf_counter() - t0, 3)}
    if cfg.stats_path is not None:
        from dspark_core.io import write_json

        write_json(cfg.stats_path, report)
    if stats is not None:
        stats.update(report)
    return {s: len(splits[s]) for s in SPLITS}


__all__ = ["PrepareConfig", "Prompt", "ParamsError", "select_splits", "run_prepare", "read_prompts", "write_prompts",
           "check_no_overlap", "find_overlaps", "allocate", "split_evenly", "candidate_pool", "iter_source",
           "iter_gsm8k_symbolic", "iter_gsm8k_test", "iter_gsm_symbolic_variants", "iter_aime2025",
           "iter_project_euler", "iter_humaneval", "iter_codeio", "iter_sharegpt", "iter_json_array", "iter_jsonl",
           "check_source_name", "is_held_out", "DOMAINS", "SPLITS", "JSONL_PREFIX", "BUILTIN_SOURCES"]
