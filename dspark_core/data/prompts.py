"""The ``prepare`` stage: collect user prompts, mix the training split by weights, hold out eval prompts per
domain, check that no eval prompt is trained on, write parquet.

Output ``{out_dir}/{train,eval}.parquet`` with columns ``id`` (str), ``source`` (str), ``domain`` (str: one of
``math_word``, ``competition_math``, ``code``, ``chat``), ``group`` (str or null: the upstream problem a prompt
derives from), ``turns`` (list<str>, user messages), ``system`` (str or null: the conversation's system message)
and ``replies`` (list<str>: the data set's own assistant turns, ``replies[i]`` answering ``turns[i]``).

Sources (``dspark_core/data/sources.py``: a registry of packaged data sets, plus ``jsonl:<path>``): every source
has a domain and the upstream split it reads; a public benchmark's test split is **eval-only** and refused in
the training mix.

Params (section ``prepare``):
- ``train_mix: {source: weight}`` (or a list of ``[source, weight]`` pairs, e.g. for ``jsonl:`` names, which
  hold dots): the weights are normalised and ``n_train`` is split by them (largest remainder, ties to the
  earlier source; weight 0 leaves a source out). A source with too few usable prompts is an error (no silent cap).
- ``eval_sources: {domain: [sources]}``: ``n_eval_per_domain`` held-out prompts per domain, shared evenly over
  its sources (the first ones get the remainder). A domain with no source is not evaluated.
- ``snapshot_dir``: read every registry source from ``{snapshot_dir}/{source}.jsonl`` instead of its package
  (pools saved by ``scripts/make_h200_prompts.py`` for a machine without the packages; the registry's domains and
  eval-only refusals still apply). A relative path is tried against the working directory, then the repo root.
- The old forms still read: ``train_sources: [..]`` (equal weights) and ``eval_sources: [..]`` with ``n_eval``
  prompts in all (one group per source, each tagged with its source's domain).

Selection: each source's candidates are de-duplicated (normalised text), filtered by ``max_prompt_chars`` and
shuffled with ``seed`` (ShareGPT: a bounded prefix of the file; the GSM-Symbolic variants come in a seeded order
already). All eval prompts are drawn first, then train; an id, a (normalised) text or an evaluated group is never
drawn twice. :func:`check_no_overlap` then verifies what is written: no train prompt shares an id, an exact or
normalised text, a group, or a containment (one text inside the other) with an eval prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dspark_core.config import ParamsError, Section, positive, require
from dspark_core.data.sources import (DOMAINS, GSM_DIR, GSM_PACKAGE, JSONL_PREFIX, REGISTRY, Prompt,  # noqa: F401
                                      ReadOptions, SourceInfo, _load_toml, check_source_name, iter_aime2025,
                                      iter_codeio, iter_gsm8k_symbolic, iter_gsm8k_test, iter_gsm_symbolic_variants,
                                      iter_humaneval, iter_json_array, iter_jsonl, iter_project_euler, iter_sharegpt,
                                      iter_snapshot, normalize_text, snapshot_options, source_info)
from dspark_core.errors import UserError
from dspark_core.io import package_dir  # noqa: F401  (re-exported: dspark_core.dmtd.stage)

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")
BUILTIN_SOURCES = tuple(REGISTRY)
DEFAULT_TRAIN_MIX = {"sharegpt": 3.0, "gsm_symbolic_variants": 2.0, "codeio": 2.0, "project_euler": 1.0}
DEFAULT_EVAL_SOURCES = {"math_word": ("gsm8k_symbolic",), "competition_math": ("aime2025",), "code": ("humaneval",),
                        "chat": ("sharegpt",)}
DEFAULT_N_EVAL_PER_DOMAIN = 2
# a lazily-read source yields this many candidates per requested prompt (at least _MIN_POOL),
# so the seed picks among more than the first few records while the read stays short
_POOL_FACTOR = 4
_MIN_POOL = 256
# the containment check compares texts of at least this many normalised characters
MIN_CONTAINED_CHARS = 40


@dataclasses.dataclass(frozen=True)
class EvalDraw:
    domain: str | None    # None: the old list form (each prompt keeps its source's domain)
    source: str
    n: int


@dataclasses.dataclass(frozen=True)
class PrepareConfig(Section):
    """params section ``prepare``."""

    train_mix: Any = None                 # {source: weight} | [[source, weight], ...]; None: DEFAULT_TRAIN_MIX
    eval_sources: Any = None              # {domain: [sources]} (or the old list); None: DEFAULT_EVAL_SOURCES
    n_train: int = 24
    n_eval_per_domain: int | None = None  # None: DEFAULT_N_EVAL_PER_DOMAIN (with the mapping form)
    train_sources: tuple[str, ...] | None = None   # old form of train_mix: equal weights
    n_eval: int | None = None             # old form: eval prompts in all, over a list of eval_sources
    max_prompt_chars: int = 1500
    seed: int = 0
    gsm8k_instruction: bool = True        # math_word: append the package's "solve step by step ... \boxed{}" line
    competition_instruction: bool = True  # competition_math: append "reason step by step ... \boxed{}"
    snapshot_dir: str | None = None       # read every registry source from {snapshot_dir}/{source}.jsonl
    out_dir: str = "data/prompts"

    def validate(self) -> None:
        positive("n_train", self.n_train)
        positive("max_prompt_chars", self.max_prompt_chars)
        mix = self.mix()
        if self.train_sources is not None:
            require(self.n_train >= len(mix), f"train_sources has {len(mix)} sources but the split asks for only "
                                              f"{self.n_train} prompts")
        draws = self.eval_draws()
        require(len(draws) > 0, "eval_sources must name at least one source")

    # -- the training mix -----------------------------------------------------------------------------
    def mix(self) -> list[tuple[str, float]]:
        """``[(source, weight)]`` in the params' order (weights as given, not normalised)."""
        if self.train_mix is not None and self.train_sources is not None:
            raise UserError("train_sources is the old form of train_mix: give one of them, not both")
        if self.train_sources is not None:
            require(len(self.train_sources) > 0, "train_sources must name at least one source")
            pairs = [(s, 1.0) for s in self.train_sources]
            field = "train_sources"
        else:
            pairs = _mix_pairs(DEFAULT_TRAIN_MIX if self.train_mix is None else self.train_mix)
            field = "train_mix"
        names = [s for s, _ in pairs]
        require(len(set(names)) == len(names), f"{field} lists a source twice: {names}")
        for s, w in pairs:
            info = source_info(s, field)
            require(not info.eval_only,
                    f"{field}: {s!r} is eval-only ({info.split}: a public benchmark's test split) and never "
                    f"trains; list it under eval_sources")
            require(math.isfinite(w) and w >= 0, f"{field}: the weight of {s!r} must be a number >= 0; got {w!r}")
        require(sum(w for _, w in pairs) > 0, f"{field}: at least one weight must be > 0")
        return pairs

    def train_counts(self) -> list[tuple[str, int]]:
        """``[(source, prompts)]``: ``n_train`` split by the normalised weights (sources with 0 left out)."""
        pairs = self.mix()
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

    @property
    def read_options(self) -> ReadOptions:
        return ReadOptions(self.seed, self.gsm8k_instruction, self.competition_instruction)


def _mix_pairs(mix: Any) -> list[tuple[str, float]]:
    if isinstance(mix, dict):
        items = list(mix.items())
    elif isinstance(mix, (list, tuple)):
        items = []
        for e in mix:
            if isinstance(e, str):
                items.append((e, 1.0))
            elif isinstance(e, (list, tuple)) and len(e) == 2:
                items.append((e[0], e[1]))
            elif isinstance(e, dict) and len(e) == 1:
                items.append(next(iter(e.items())))
            else:
                raise UserError(f"train_mix: entry {e!r} is not a source name or a [source, weight] pair")
    else:
        raise UserError(f"train_mix must be a mapping {{source: weight}} or a list of [source, weight] pairs, "
                        f"got {mix!r}")
    require(len(items) > 0, "train_mix must name at least one source")
    out = []
    for s, w in items:
        require(isinstance(s, str), f"train_mix: source names are strings, got {s!r}")
        require(isinstance(w, (int, float)) and not isinstance(w, bool),
                f"train_mix: the weight of {s!r} must be a number, got {w!r}")
        out.append((s, float(w)))
    return out


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
# selection
# ----------------------------------------------------------------------------------------------
def iter_source(source: str, cfg: PrepareConfig) -> Iterator[Prompt]:
    return source_info(source).read(cfg.read_options)


def candidate_pool(prompts: Iterable[Prompt], max_chars: int, limit: int | None, seed: int) -> list[Prompt]:
    """Unique-text prompts of at most ``max_chars`` (first turn), at most ``limit`` of them, shuffled."""
    pool = list(_candidates(prompts, max_chars, limit))
    random.Random(seed).shuffle(pool)
    return pool


def _candidates(prompts: Iterable[Prompt], max_chars: int, limit: int | None = None) -> Iterator[Prompt]:
    seen: set[str] = set()
    n = 0
    for p in prompts:
        text = p.turns[0]
        key = normalize_text(text)
        if len(text) > max_chars or key in seen:
            continue
        seen.add(key)
        yield p
        n += 1
        if limit is not None and n >= limit:
            return


def _pool(info: SourceInfo, cfg: PrepareConfig, need: int) -> Iterator[Prompt]:
    if cfg.snapshot_dir is not None and info.name in REGISTRY:  # a saved pool: read whole, shuffled
        return iter(candidate_pool(iter_snapshot(cfg.snapshot_dir, info.name), cfg.max_prompt_chars, None, cfg.seed))
    prompts = info.read(cfg.read_options)
    if info.shuffled:  # a seeded random order already: drawn as it comes (no need to read it all)
        return _candidates(prompts, cfg.max_prompt_chars)
    limit = max(_POOL_FACTOR * need, _MIN_POOL) if info.lazy else None
    return iter(candidate_pool(prompts, cfg.max_prompt_chars, limit, cfg.seed))


def select_splits(cfg: PrepareConfig) -> dict[str, list[Prompt]]:
    """Draw every eval set, then the training mix, never reusing an id, a text or an evaluated group."""
    if cfg.snapshot_dir is not None:
        check_snapshot_options(cfg)
    draws = cfg.eval_draws()
    train_counts = cfg.train_counts()
    need: dict[str, dict[str, int]] = {}
    for d in draws:
        need.setdefault(d.source, {"eval": 0, "train": 0})["eval"] += d.n
    for s, k in train_counts:
        need.setdefault(s, {"eval": 0, "train": 0})["train"] += k
    pools: dict[str, Iterator[Prompt]] = {}
    used_ids: set[str] = set()
    used_texts: set[str] = set()
    eval_groups: set[str] = set()
    out: dict[str, list[Prompt]] = {"eval": [], "train": []}

    def draw(source: str, k: int, split: str, domain: str | None) -> None:
        if source not in pools:
            pools[source] = _pool(source_info(source), cfg, sum(need[source].values()))
        for _ in range(k):
            p = next((q for q in pools[source] if q.id not in used_ids
                      and normalize_text(q.turns[0]) not in used_texts
                      and (q.group is None or q.group not in eval_groups)), None)
            if p is None:
                raise UserError(_too_few(source, split, need[source], cfg))
            if domain is not None and p.domain != domain:
                p = dataclasses.replace(p, domain=domain)
            used_ids.add(p.id)
            used_texts.add(normalize_text(p.turns[0]))
            if split == "eval" and p.group is not None:
                eval_groups.add(p.group)
            out[split].append(p)

    for d in draws:
        draw(d.source, d.n, "eval", d.domain)
    for s, k in train_counts:
        draw(s, k, "train", None)
    check_no_overlap(out["train"], out["eval"])
    return out


def check_snapshot_options(cfg: PrepareConfig) -> None:
    """A snapshot's texts carry the instructions it was written with: they must be the ones asked for."""
    saved = snapshot_options(cfg.snapshot_dir)
    for key, value in dataclasses.asdict(cfg.read_options).items():
        if key in saved and key != "seed" and saved[key] != value:
            raise UserError(f"prepare.{key}={value} but the snapshot {cfg.snapshot_dir} was written with {saved[key]} "
                            f"(set it so, or rewrite the snapshot: scripts/make_h200_prompts.py)")


def _too_few(source: str, split: str, need: dict[str, int], cfg: PrepareConfig) -> str:
    key = "n_train (or its train_mix weight)" if split == "train" else cfg.eval_count_key
    return (f"prepare: source {source!r} has too few usable prompts for the requested sizes "
            f"(needs {need['eval']} eval + {need['train']} train of at most max_prompt_chars="
            f"{cfg.max_prompt_chars} characters, unique, none from an evaluated problem; ran out while filling "
            f"{split}; lower prepare.{key} or add sources)")


# ----------------------------------------------------------------------------------------------
# the overlap check
# ----------------------------------------------------------------------------------------------
def find_overlaps(train: list[Prompt], evals: list[Prompt], limit: int = 5) -> list[str]:
    """Up to ``limit`` descriptions of train prompts that overlap an eval prompt: the same id, the same text
    (exact or normalised; any eval turn against the trained first turn), the same group (upstream problem), or
    one first turn contained in the other (normalised, texts of at least MIN_CONTAINED_CHARS characters)."""
    found: list[str] = []
    by_id = {p.id: p for p in evals}
    exact: dict[str, Prompt] = {}
    norm: dict[str, Prompt] = {}
    groups: dict[str, Prompt] = {}
    for p in evals:
        for t in p.turns:
            exact.setdefault(t, p)
            norm.setdefault(normalize_text(t), p)
        if p.group is not None:
            groups.setdefault(p.group, p)
    eval_norm = [(normalize_text(p.turns[0]), p) for p in evals]
    eval_blob = "\0".join(t for t, _ in eval_norm)
    train_norm = [(normalize_text(p.turns[0]), p) for p in train]
    train_blob = "\0".join(t for t, _ in train_norm)
    train_set = {t for t, _ in train_norm}

    def add(t: Prompt, e: Prompt, why: str) -> bool:
        found.append(f"train {t.id!r} ({t.source}) vs eval {e.id!r} ({e.source}): {why}")
        return len(found) >= limit

    for (tn, t) in train_norm:
        text = t.turns[0]
        if t.id in by_id and add(t, by_id[t.id], "same id"):
            return found
        if text in exact and add(t, exact[text], "same text"):
            return found
        if text not in exact and tn in norm and add(t, norm[tn], "same normalised text"):
            return found
        if t.group is not None and t.group in groups and add(t, groups[t.group], f"same problem {t.group!r}"):
            return found
        if len(tn) >= MIN_CONTAINED_CHARS and tn not in norm and tn in eval_blob:
            e = next(p for en, p in eval_norm if tn in en)
            if add(t, e, "the train text is inside the eval text"):
                return found
    for en, e in eval_norm:
        if len(en) >= MIN_CONTAINED_CHARS and en not in train_set and en in train_blob:
            t = next(p for tn, p in train_norm if en in tn)
            if add(t, e, "the eval text is inside the train text"):
                return found
    return found


def check_no_overlap(train: list[Prompt], evals: list[Prompt]) -> None:
    """Raise ValueError naming the overlaps when any train prompt overlaps an eval prompt (:func:`find_overlaps`)."""
    found = find_overlaps(train, evals)
    if found:
        raise UserError("prepare: eval prompts must never be trained on, but the training split overlaps the eval "
                        "split:\n  " + "\n  ".join(found) + "\n(remove the overlap from the sources, or take the "
                        "source out of train_mix)")


# ----------------------------------------------------------------------------------------------
# parquet
# ----------------------------------------------------------------------------------------------
def write_prompts(path: str | Path, prompts: list[Prompt]) -> None:
    import pyarrow as pa

    from dspark_core.io import atomic_path, write_parquet

    table = pa.table({
        "id": pa.array([p.id for p in prompts], pa.string()),
        "source": pa.array([p.source for p in prompts], pa.string()),
        "domain": pa.array([p.domain for p in prompts], pa.string()),
        "group": pa.array([p.group for p in prompts], pa.string()),
        "turns": pa.array([list(p.turns) for p in prompts], pa.list_(pa.string())),
        "system": pa.array([p.system for p in prompts], pa.string()),
        "replies": pa.array([list(p.replies) for p in prompts], pa.list_(pa.string())),
    })
    with atomic_path(path, ".parquet") as tmp:
        write_parquet(table, tmp)


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


def run_prepare(cfg: PrepareConfig) -> dict[str, int]:
    """The ``prepare`` stage: write ``{out_dir}/{train,eval}.parquet``; return the split sizes."""
    splits = select_splits(cfg)
    for split in SPLITS:
        write_prompts(Path(cfg.out_dir) / f"{split}.parquet", splits[split])
        by = Counter(f"{p.domain}/{p.source}" for p in splits[split])
        log.info("prepare: %s %d prompts (%s)", split, len(splits[split]),
                 ", ".join(f"{k} {v}" for k, v in sorted(by.items())))
    return {s: len(splits[s]) for s in SPLITS}


__all__ = ["PrepareConfig", "Prompt", "ParamsError", "select_splits", "run_prepare", "read_prompts", "write_prompts",
           "check_no_overlap", "find_overlaps", "allocate", "split_evenly", "candidate_pool", "iter_source",
           "iter_gsm8k_symbolic", "iter_gsm8k_test", "iter_gsm_symbolic_variants", "iter_aime2025",
           "iter_project_euler", "iter_humaneval", "iter_codeio", "iter_sharegpt", "iter_json_array", "iter_jsonl",
           "check_source_name", "DOMAINS", "SPLITS", "JSONL_PREFIX", "BUILTIN_SOURCES"]
