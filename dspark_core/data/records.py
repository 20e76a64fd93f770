"""Conversation records of the ``prepare`` stage's file and Hugging Face sources, read as :class:`Prompt`.

Sources (names in ``prepare.train`` / ``eval_sources``):

- ``jsonl:<path>``: a JSONL file (``.jsonl.gz``: gzip-compressed), one record a line (ids default to the line
  number, from 1);
- ``parquet:<path>``: a Parquet file, read in record batches (ids default to the row number, from 0);
- ``hf:<org>/<name>[:<config>[:<split>]][@<revision>]``: a Hugging Face data set (split default ``train``;
  ``hf:org/name::test`` takes split ``test`` of the default config) streamed through
  ``datasets.load_dataset(..., streaming=True)``. ``@<revision>`` (a branch, tag or commit; default ``main``) is
  resolved to a commit once, before the first read, and every read of the run is of that commit
  (:func:`resolve_hf`; ``prepare`` records it). ``hf:/abs/path`` or ``hf:./rel[:<config>[:<split>]]`` is a local
  dataset folder (e.g. the hub's parquet layout ``data/train-00000-of-00001.parquet``) read the same way. With
  ``HF_HUB_OFFLINE=1`` a hub name is read from its snapshot in the hub cache (``hf download --repo-type dataset
  <dataset>`` puts it there). Ids default to the row number, from 0.

Record shapes, detected per record (one file may mix them):

- dspark's own ``{"turns": [user turns], "system"?: str, "replies"?: [assistant turns]}``;
- OpenAI ``{"messages": [{"role": "system" | "user" | "assistant", "content": ...}]}``: ``content`` a string or a
  list of ``{"type": "text", "text": ...}`` parts (joined by newlines);
- ShareGPT ``{"conversations": [{"from": "system" | "human" | "gpt", "value": ...}]}``, with the other assistant
  names ShareGPT dumps use (``chatgpt``, ``bing``, ``bard``) and the ``role`` / ``content`` keys inside
  ``conversations`` as well (either key pair in either list).

Each record may carry ``id``, ``domain`` (one of :data:`DOMAINS`, default ``chat``) and ``group`` (the upstream
problem, see ``sources.py``). A conversation is an optional system message first, then user and assistant turns
alternating, user first; it becomes ``Prompt(turns = the user turns, system, replies = the assistant turns)``
(``replies[i]`` answers ``turns[i]``; the last user turn may be unanswered). Texts are stripped of surrounding
whitespace; an empty system message is the same as none.

Skipped and counted (``skipped`` counters, written to the prepare stats): a conversation that holds tool or
function messages, tool calls or tool definitions (``tool``: dspark regenerates with a plain chat template and
cannot regenerate tool outputs), and one with a non-text content part (``non_text``: an image, audio). Anything
else that is not an accepted conversation (an assistant-first conversation, an unknown role, two user or two
assistant turns in a row, a system message after the first, an empty content, no user turn) is refused with its
place (``file:line``, ``file row N`` or ``dataset[split] row N``) and the accepted shapes, in one line; with
``prepare.on_bad_record: skip`` it is skipped and counted (``bad_record``) instead, and so is a JSONL line that is
not JSON (``bad_json``) or not UTF-8 (``not_utf8``): :data:`BAD_REASONS`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dspark_core.errors import UserError

try:  # a C JSON parser (dvc's dependency dvc-data brings it): ~2x json.loads on chat records
    import orjson
except ImportError:  # pragma: no cover - the standard parser; the same records and errors
    orjson = None

DOMAINS = ("math_word", "competition_math", "code", "chat")
JSONL_PREFIX = "jsonl:"
PARQUET_PREFIX = "parquet:"
HF_PREFIX = "hf:"
REPO_ROOT = Path(__file__).resolve().parents[2]
ON_BAD_RECORD = ("error", "skip")
BAD_REASONS = ("bad_json", "not_utf8", "bad_record")   # what ``on_bad_record: skip`` skips and counts
BATCH_ROWS = 2048   # Parquet / HF rows converted to Python at a time

USER, ASSISTANT, SYSTEM, TOOL = "user", "assistant", "system", "tool"
# message role names (OpenAI ``role``, ShareGPT ``from``) -> the part they play
ROLES = {
    "user": USER, "human": USER,
    "assistant": ASSISTANT, "gpt": ASSISTANT, "chatgpt": ASSISTANT, "bing": ASSISTANT, "bard": ASSISTANT,
    "system": SYSTEM, "developer": SYSTEM,
    "tool": TOOL, "function": TOOL, "ipython": TOOL, "function_call": TOOL, "observation": TOOL,
    "tool_call": TOOL, "tool_response": TOOL,
}
CONVERSATION_FIELDS = ("messages", "conversations", "turns")
# the columns a Parquet / HF source is read with (others are not converted)
RECORD_COLUMNS = ("id", "domain", "group", "system", "replies", "tools", *CONVERSATION_FIELDS)
ACCEPTED = ("accepted records: {'turns': [user texts]}, OpenAI {'messages': [{'role', 'content'}]} or ShareGPT "
            "{'conversations': [{'from', 'value'}]}: an optional system message, then user and assistant turns "
            "alternating, user first")
_SKIP_HINT = "; or set prepare.on_bad_record: skip to skip and count such records"


class BadLine(UserError):
    """A JSONL line that is not UTF-8 or not JSON; ``reason`` is its :data:`BAD_REASONS` name."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """A conversation to answer: its user turns in order, the system message it carries (None: the chat
    template's default) and the assistant turns the data set gave (``replies[i]`` answers ``turns[i]``; used
    as given by ``regenerate.backend: none``, otherwise regenerated by the target)."""

    id: str
    source: str
    turns: tuple[str, ...]
    domain: str = "chat"
    group: str | None = None   # the upstream problem it derives from; never both trained and evaluated on
    system: str | None = None          # the conversation's own system message
    replies: tuple[str, ...] = ()      # the data set's assistant turns (at most one a user turn, in order)


class BadRecord(Exception):
    """A record that is not an accepted conversation; the message says what is wrong (no place)."""


# ----------------------------------------------------------------------------------------------
# one record
# ----------------------------------------------------------------------------------------------
def parse_record(rec: Any) -> tuple[str | None, tuple[str, ...], tuple[str, ...]] | str:
    """``(system, turns, replies)`` of a record of any accepted shape, or the reason it is skipped (``tool``,
    ``non_text``); raises :class:`BadRecord` for anything else."""
    if not isinstance(rec, dict):
        raise BadRecord(f"a record is a JSON object, got {type(rec).__name__}")
    present = [f for f in CONVERSATION_FIELDS if rec.get(f) is not None]
    if len(present) != 1:
        if not present:
            raise BadRecord("record has no 'turns', 'messages' or 'conversations' field")
        raise BadRecord(f"record holds both {present[0]!r} and {present[1]!r}")
    field = present[0]
    if field == "turns":
        return _turns_record(rec)
    if has_tools(rec.get("tools")):   # tool definitions: the replies may call them
        return "tool"
    return parse_messages(rec[field], field)


def _turns_record(rec: dict) -> tuple[str | None, tuple[str, ...], tuple[str, ...]]:
    turns = rec["turns"]
    if (not isinstance(turns, list) or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)):
        raise BadRecord(f"field 'turns' must be a non-empty list of non-empty strings, got {str(turns)[:80]!r}")
    system = rec.get("system")
    if system is not None and not isinstance(system, str):
        raise BadRecord(f"field 'system' must be a string, got {str(system)[:80]!r}")
    replies = rec.get("replies") or []
    if (not isinstance(replies, list) or len(replies) > len(turns)
            or not all(isinstance(r, str) and r.strip() for r in replies)):
        raise BadRecord(f"field 'replies' must be a list of non-empty strings, at most one a turn, got "
                        f"{str(replies)[:80]!r}")
    system = (system.strip() or None) if system else None
    return system, tuple(t.strip() for t in turns), tuple(r.strip() for r in replies)


@dataclasses.dataclass(slots=True)
class MessageColumns:
    """One record's messages as parallel lists (read column-wise from Arrow: no dict a message)."""

    names: list[Any]            # role / from
    contents: list[Any]         # content / value
    tools: list[Any] | None     # tool_calls / function_call (None: the data has neither)


def parse_messages(msgs: Any, field: str = "messages") -> tuple[str | None, tuple[str, ...], tuple[str, ...]] | str:
    """``(system, turns, replies)`` of an OpenAI / ShareGPT message list (see the module docstring) or of
    :class:`MessageColumns`, or a skip reason; raises :class:`BadRecord`."""
    if type(msgs) is MessageColumns:
        return _conversation(msgs.names, msgs.contents, msgs.tools, field)
    if not isinstance(msgs, list):
        raise BadRecord(f"field {field!r} must be a non-empty list of messages, got {str(msgs)[:80]!r}")
    try:   # the usual record: every message an object with the first one's key pair
        if "role" in msgs[0]:
            names = [m["role"] for m in msgs]
            contents = [m.get("content") for m in msgs]
            tools = [m.get("tool_calls") or m.get("function_call") for m in msgs]
        else:
            names = [m["from"] for m in msgs]
            contents = [m.get("value") for m in msgs]
            tools = None
        if None not in names:
            return _conversation(names, contents, tools, field)
    except (KeyError, TypeError, IndexError, AttributeError):
        pass
    names, contents, tools = [], [], []    # mixed key pairs, or a message that is not an object
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRecord(f"{field}[{i}] is not an object: {str(m)[:60]!r}")
        name = m.get("role")
        if name is None:
            names.append(m.get("from"))
            contents.append(m.get("value"))
        else:
            names.append(name)
            contents.append(m.get("content"))
        tools.append(m.get("tool_calls") or m.get("function_call"))
    return _conversation(names, contents, tools, field)


def _conversation(names: list[Any], contents: list[Any], tools: list[Any] | None,
                  field: str) -> tuple[str | None, tuple[str, ...], tuple[str, ...]] | str:
    """The role rules of :func:`parse_messages` over message ``i`` = (``names[i]``, ``contents[i]``,
    ``tools[i]``: its tool calls, if any)."""
    if not names:
        raise BadRecord(f"field {field!r} must be a non-empty list of messages, got []")
    system = None
    turns: list[str] = []
    replies: list[str] = []
    last = None
    for i, (name, content) in enumerate(zip(names, contents)):
        role = ROLES.get(name) if isinstance(name, str) else None
        if role is None:
            raise BadRecord(f"{field}[{i}] has {'no role' if name is None else f'an unknown role {name!r}'} "
                            f"(roles: user / human, assistant / gpt / chatgpt / bing / bard, system; tool messages "
                            f"skip the conversation)")
        if role == TOOL or (role == ASSISTANT and tools is not None and has_tools(tools[i])):
            return "tool"
        text = content if isinstance(content, str) else _text_parts(content, field, i)
        if text is None:
            return "non_text"
        text = text.strip()
        if role == SYSTEM:
            if i:
                raise BadRecord(f"{field}[{i}] is a system message after the first message")
            system = text or None
        elif not text:
            raise BadRecord(f"{field}[{i}] ({name}) has an empty content")
        elif role == USER:
            if last == USER:
                raise BadRecord(f"{field}[{i - 1}] and [{i}] are two user turns in a row")
            turns.append(text)
        else:
            if last != USER:
                raise BadRecord(f"{field}[{i}] is an assistant turn "
                                + ("before any user turn" if last is None or last == SYSTEM else
                                   "after another (two assistant turns in a row)"))
            replies.append(text)
        last = role
    if not turns:
        raise BadRecord(f"field {field!r} holds no user turn")
    return system, tuple(turns), tuple(replies)


def has_tools(value: Any) -> bool:
    """Whether a ``tools`` / ``tool_calls`` / ``function_call`` value holds anything (a Parquet column may keep them
    as JSON text: ``"[]"`` holds nothing)."""
    if isinstance(value, str):
        return value.strip() not in ("", "[]", "{}", "null")
    return bool(value)


def _text_parts(content: Any, field: str, i: int) -> str | None:
    """The text of a list of content parts (``{"type": "text", "text": ...}``, joined by newlines); None when a
    part is not text (an image, audio: the conversation is skipped)."""
    if not isinstance(content, list):
        raise BadRecord(f"{field}[{i}] has an empty content" if content is None else
                        f"{field}[{i}]: content must be a string or a list of text parts, got {str(content)[:60]!r}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadRecord(f"{field}[{i}]: a content part must be an object with a 'type', got {str(part)[:60]!r}")
        if part["type"] != "text":
            return None
        if not isinstance(part.get("text"), str):
            raise BadRecord(f"{field}[{i}]: a text part needs a 'text' string")
        texts.append(part["text"])
    return "\n".join(texts)


def record_extras(rec: dict, default_id: int) -> tuple[str, str, str | None]:
    """``(id, domain, group)`` of a record: its ``id`` (else ``default_id``), ``domain`` (default ``chat``) and
    ``group``; raises :class:`BadRecord`."""
    rid = rec.get("id")
    domain = rec.get("domain")
    group = rec.get("group")
    if domain is None:
        domain = "chat"
    elif domain not in DOMAINS:
        raise BadRecord(f"field 'domain' must be one of {', '.join(DOMAINS)}, got {domain!r}")
    if group is not None and not isinstance(group, str):
        raise BadRecord(f"field 'group' must be a string, got {group!r}")
    return str(default_id if rid is None else rid), domain, group


class RecordReader:
    """Turns the records of one source into ``(record id, Prompt)`` pairs: ids prefixed with ``prefix``, skipped
    records counted in ``skipped``, a bad one refused (``on_bad_record: error``) or counted as ``bad_record``."""

    def __init__(self, source: str, prefix: str, on_bad_record: str = "error", skipped: Counter | None = None):
        self.source, self.prefix, self.on_bad_record = source, prefix, on_bad_record
        self.skipped = Counter() if skipped is None else skipped

    def prompt(self, rec: Any, default_id: int, where: Any) -> tuple[str, Prompt] | None:
        """The record as ``(id, Prompt)``, or None when it is skipped. ``where()`` names its place (for errors)."""
        try:
            parsed = parse_record(rec)
            if isinstance(parsed, str):
                self.skipped[parsed] += 1
                return None
            rid, domain, group = record_extras(rec, default_id)
        except BadRecord as e:
            if self.on_bad_record == "skip":
                self.skipped["bad_record"] += 1
                return None
            raise UserError(f"{where()}: {e}; {ACCEPTED}{_SKIP_HINT}") from None
        system, turns, replies = parsed
        return rid, Prompt(f"{self.prefix}:{rid}", self.source, turns, domain, group, system, replies)


# ----------------------------------------------------------------------------------------------
# JSONL
# ----------------------------------------------------------------------------------------------
def jsonl_path(spec: str | Path) -> Path:
    """The file of a ``jsonl:`` source: as given (relative to the working directory), else relative to the repo
    root (profiles name the repo's files so); the ``.jsonl`` (or ``.jsonl.gz``: gzip) suffix may be left out."""
    path = Path(spec)
    candidates = [path] if path.is_absolute() else [path, REPO_ROOT / path]
    for c in candidates:
        for p in (c, c.with_name(c.name + ".jsonl"), c.with_name(c.name + ".jsonl.gz")):
            if p.is_file():
                return p
    return path


def local_path(spec: str | Path) -> Path:
    """A file named by a source: as given (relative to the working directory), else relative to the repo root."""
    path = Path(spec)
    if path.is_absolute() or path.exists() or not (REPO_ROOT / path).exists():
        return path
    return REPO_ROOT / path


def file_stem(path: Path) -> str:
    """``name`` of ``dir/name.jsonl``, ``name.jsonl.gz`` and ``name.parquet``: the prefix of the file's ids."""
    return Path(path.name.removesuffix(".gz")).stem


def utf8_line(raw: bytes, path: Path, lineno: int) -> str:
    """Line ``lineno`` of ``path`` decoded; bytes that are not UTF-8 are a :class:`UserError` naming the place."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLine(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                      "save the file as UTF-8", "not_utf8") from None


def raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a file, gunzipped when its name ends in ``.gz``; a damaged file is named."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            yield from enumerate(fh, 1)
    except (OSError, EOFError) as e:
        raise UserError(f"{path}: cannot be read as {'gzip-compressed ' if path.suffix == '.gz' else ''}text "
                        f"({e})") from None


def json_line(raw: bytes, path: Path, lineno: int) -> Any:
    """The JSON value of one line; not UTF-8 or not JSON: a :class:`BadLine` naming the place."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass   # the standard parser names the problem (and accepts what it accepts: NaN, lone surrogates)
    try:
        return json.loads(utf8_line(raw, path, lineno))
    except json.JSONDecodeError as e:
        raise BadLine(f"{path}:{lineno}: not valid JSON ({e.msg})", "bad_json") from None


def jsonl_rows(path: Path, reader: RecordReader) -> Iterator[tuple[int, str, Prompt]]:
    """``(line number, record id, Prompt)`` of every accepted record of a JSONL file, streamed. A line that is not
    JSON is refused, or with ``on_bad_record: skip`` skipped and counted by reason."""
    for lineno, raw in raw_lines(path):
        if raw.isspace() or not raw:
            continue
        try:
            rec = json_line(raw, path, lineno)
        except BadLine as e:
            if reader.on_bad_record != "skip":
                raise BadLine(f"{e}{_SKIP_HINT}", e.reason) from None
            reader.skipped[e.reason] += 1
            continue
        got = reader.prompt(rec, lineno, lambda: f"{path}:{lineno}")
        if got is not None:
            yield lineno, got[0], got[1]


def iter_jsonl(path: str | Path, source: str | None = None, on_bad_record: str = "error",
               skipped: Counter | None = None) -> Iterator[Prompt]:
    """Records of a JSONL file (gzip-compressed when its name ends in ``.gz``) of any accepted shape (module
    docstring). A repeated id and a file without records are refused (the whole file's ids are kept: use
    :func:`jsonl_records` to stream a big file)."""
    given = path
    path = _existing_jsonl(path, source)
    skipped = Counter() if skipped is None else skipped
    ids: set[str] = set()
    seen = False
    for lineno, rid, p in jsonl_rows(path, RecordReader(source or f"{JSONL_PREFIX}{given}", file_stem(path),
                                                        on_bad_record, skipped)):
        if rid in ids:
            raise UserError(f"{path}:{lineno}: duplicate id {rid!r}")
        ids.add(rid)
        seen = True
        yield p
    if not seen:
        _no_records(path, skipped)


def jsonl_records(path: str | Path, source: str, on_bad_record: str = "error",
                  skipped: Counter | None = None) -> Iterator[tuple[str, Prompt]]:
    """``(record id, Prompt)`` of a JSONL file, streamed (memory: one line)."""
    path = _existing_jsonl(path, source)
    skipped = Counter() if skipped is None else skipped
    seen = False
    for _, rid, p in jsonl_rows(path, RecordReader(source, file_stem(path), on_bad_record, skipped)):
        seen = True
        yield rid, p
    if not seen:
        _no_records(path, skipped)


def _existing_jsonl(spec: str | Path, source: str | None) -> Path:
    path = jsonl_path(spec)
    if not path.is_file():
        raise UserError(f"{source or JSONL_PREFIX + str(spec)}: file {spec} not found")
    return path


def _no_records(path: Any, skipped: Counter) -> None:
    """A source that gave no prompt: an empty file is refused; one whose records were all skipped is not (its
    counts say why, and the draw names the source if it runs short)."""
    if not sum(skipped.values()):
        raise UserError(f"{path}: the file is empty (no JSON records)")


# ----------------------------------------------------------------------------------------------
# Parquet and Hugging Face data sets (Arrow record batches)
# ----------------------------------------------------------------------------------------------
def arrow_rows(batches: Iterable[Any], reader: RecordReader, where: Any) -> Iterator[tuple[str, Prompt]]:
    """``(record id, Prompt)`` of the rows of Arrow record batches or tables (row numbers from 0; ``where(n)``
    names row n), converted to Python a column at a time."""
    row = 0
    for batch in batches:
        for part in batch.to_batches() if hasattr(batch, "to_batches") else (batch,):
            names = part.schema.names
            columns = [_python_column(part.column(k)) for k in range(part.num_columns)]
            for values in zip(*columns):
                got = reader.prompt(dict(zip(names, values)), row, lambda: where(row))
                if got is not None:
                    yield got
                row += 1


def _python_column(arr: Any) -> list[Any]:
    """A column as Python values; a list of message structs as :class:`MessageColumns` a row (its role / from,
    content / value and tool-call fields converted as flat lists, not as a dict a message)."""
    import pyarrow as pa

    t = arr.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return arr.to_pylist()
    fields = [t.value_type.field(k).name for k in range(t.value_type.num_fields)]
    if not ({"role", "from"} & set(fields)):
        return arr.to_pylist()
    children = dict(zip(fields, arr.flatten().flatten()))   # the rows' messages; a null message: null fields
    def child(name: str) -> list[Any] | None:
        return children[name].to_pylist() if name in children else None

    role, frm, content, value = child("role"), child("from"), child("content"), child("value")
    if role is None or frm is None:
        names, contents = (frm, value) if role is None else (role, content)
    else:
        names = [r if r is not None else f for r, f in zip(role, frm)]
        contents = [c if r is not None else v for r, c, v in zip(role, content or [None] * len(role),
                                                                  value or [None] * len(role))]
    if contents is None:
        contents = [None] * len(names)
    calls, fcall = child("tool_calls"), child("function_call")
    tools = calls if fcall is None else fcall if calls is None else [a or b for a, b in zip(calls, fcall)]
    offsets = arr.offsets.to_pylist()
    base = offsets[0]
    valid = arr.is_valid().to_pylist() if arr.null_count else None
    out: list[Any] = []
    for r in range(len(arr)):
        if valid is not None and not valid[r]:
            out.append(None)
            continue
        a, b = offsets[r] - base, offsets[r + 1] - base
        out.append(MessageColumns(names[a:b], contents[a:b], None if tools is None else tools[a:b]))
    return out


def _conversation_columns(names: list[str], what: str) -> list[str]:
    if not any(f in names for f in CONVERSATION_FIELDS):
        raise UserError(f"{what}: no 'turns', 'messages' or 'conversations' column (columns: "
                        f"{', '.join(names[:12])}); {ACCEPTED}")
    return [c for c in RECORD_COLUMNS if c in names]


def parquet_records(spec: str | Path, source: str, on_bad_record: str = "error",
                    skipped: Counter | None = None) -> Iterator[tuple[str, Prompt]]:
    """``(record id, Prompt)`` of a Parquet file, read in record batches of the record columns only."""
    import pyarrow.parquet as pq

    from dspark_core.io import _parquet_errors

    path = local_path(spec)
    if not path.is_file():
        raise UserError(f"{source}: file {spec} not found")
    fix = "check the file (a Parquet file of conversation records)"
    with _parquet_errors(path, fix):
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        columns = _conversation_columns(pf.schema_arrow.names, str(path))
        reader = RecordReader(source, file_stem(path), on_bad_record, skipped)
        # a reader a row group: one reader over the whole file keeps the list columns' buffers to its end
        batches = (b for g in range(pf.num_row_groups)
                   for b in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns, row_groups=[g]))
        yield from arrow_rows(batches, reader, lambda n: f"{path} row {n}")


@dataclasses.dataclass(frozen=True)
class HfName:
    """A parsed ``hf:`` source name; ``commit`` once :func:`resolve_hf` has resolved its revision."""

    path: str                 # a hub repo id (org/name) or a local folder
    config: str | None
    split: str
    local: bool
    revision: str | None = None   # a hub data set's branch, tag or commit as written (None: main)
    commit: str | None = None     # the commit it resolved to
    snapshot: str | None = None   # offline: the commit's snapshot folder in the hub cache

    @property
    def label(self) -> str:
        """``dataset[:config][split]``: how errors name a row's place (``<label> row N``)."""
        return f"{self.path}{':' + self.config if self.config else ''}[{self.split}]"

    @property
    def id_prefix(self) -> str:
        """The prefix of its prompts' ids: the data set's last name part, its config and split."""
        base = self.path.rstrip("/").rsplit("/", 1)[-1] or self.path
        return f"{base}{':' + self.config if self.config else ''}@{self.split}"


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?", re.ASCII)
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
# [:<config>[:<split>]] or ::<split>, then [@<revision>] (a git ref: no ':', may hold '/')
_TAIL = re.compile(rf"(?::(?P<config>{_NAME})(?::(?P<split>{_NAME}))?|::(?P<split_only>{_NAME}))?"
                   rf"(?:@(?P<revision>[A-Za-z0-9_.][A-Za-z0-9_./\-]*))?$", re.ASCII)
HF_FORMS = ("hf:<org>/<name>[:<config>[:<split>]][@<revision>] (hf:<org>/<name>::<split> for the default config; "
            "a local dataset folder: hf:/abs/path or hf:./rel)")
# revisions that are usually split names: `hf:name@test` was written for a split
_SPLIT_NAMES = re.compile(r"train|test|validation|valid|val|dev|eval\w*|(train|test)_\w+", re.ASCII)


def parse_hf_name(source: str, field: str = "source") -> HfName:
    """``hf:<dataset>[:<config>[:<split>]][@<revision>]`` (split default ``train``). A dataset that starts with
    ``/``, ``./``, ``../`` or ``~`` is a local folder (no revision); a local path may hold ``:`` and ``@`` itself,
    so the first prefix that is an existing folder is the path. A malformed name is refused naming the forms."""
    spec = source[len(HF_PREFIX):]
    if spec.startswith(("/", "./", "../", "~")):
        return _local_hf_name(spec, source, field)
    path = _HUB_ID.match(spec)
    tail = _TAIL.match(spec, path.end()) if path else None
    if path is None or tail is None or ".." in path.group() or "--" in path.group():
        raise UserError(f"{field}: malformed source name {source!r}: use {HF_FORMS}")
    return HfName(path.group(), tail["config"], tail["split"] or tail["split_only"] or "train", False,
                  tail["revision"])


def _local_name(spec: str, at: int, source: str, field: str) -> HfName | None:
    """The local folder ``spec[:at]`` with the tail ``spec[at:]``, or None when the tail is no tail."""
    tail = _TAIL.match(spec, at)
    if tail is None:
        return None
    if tail["revision"] is not None:
        hint = ("" if tail["split"] or tail["split_only"] else
                f"; its split is written hf:{spec[:at]}:{tail['config'] or ''}:{tail['revision']}")
        raise UserError(f"{field}: {source!r}: a local dataset folder has no revision (@{tail['revision']}){hint}")
    return HfName(str(Path(spec[:at]).expanduser()), tail["config"], tail["split"] or tail["split_only"] or "train",
                  True)


def _local_hf_name(spec: str, source: str, field: str) -> HfName:
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return HfName(str(folder), None, "train", True)
    cuts = [i for i in range(len(spec)) if spec[i] in ":@"]
    for at in cuts:
        if Path(spec[:at]).expanduser().is_dir():
            got = _local_name(spec, at, source, field)
            if got is not None:
                return got
    for at in cuts:   # no such folder: refused when it is read
        got = _local_name(spec, at, source, field)
        if got is not None:
            return got
    return HfName(str(folder), None, "train", True)


def hf_records(name: HfName, source: str, on_bad_record: str = "error",
               skipped: Counter | None = None) -> Iterator[tuple[str, Prompt]]:
    """``(record id, Prompt)`` of a Hugging Face data set, streamed as Arrow batches of the record columns."""
    ds = load_hf(name, source)
    if hasattr(ds, "reshard"):   # a Parquet shard a row group: a file's read buffers are held to its shard's end
        ds = ds.reshard()
    names = list(ds.column_names or [])
    columns = _conversation_columns(names, f"{source} ({name.label})") if names else None
    if columns is not None and len(columns) < len(names):
        ds = ds.select_columns(columns)
    reader = RecordReader(source, name.id_prefix, on_bad_record, skipped)
    batches = ds.with_format("arrow").iter(batch_size=BATCH_ROWS)
    try:
        yield from arrow_rows(batches, reader, lambda n: f"{name.label} row {n}")
    except (OSError, ValueError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"{source}: reading {name.label} failed ({_first_line(e)})") from None
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def load_hf(name: HfName, source: str) -> Any:
    """``datasets.load_dataset(path, config, split=split, streaming=True)`` of the data set's resolved commit
    (:func:`resolve_hf`; offline, its snapshot folder in the hub cache). Failures are one :class:`UserError`."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"{source}: hf: sources are read with the 'datasets' package; install it (pip install "
                        f"datasets)") from None
    if name.local and not Path(name.path).is_dir():
        raise UserError(f"{source}: no dataset folder {name.path}")
    name = resolve_hf(name, source)
    path, revision = (name.snapshot, None) if name.snapshot else (name.path, name.commit)
    try:
        return datasets.load_dataset(path, name.config, split=name.split, streaming=True,
                                     **({"revision": revision} if revision else {}))
    except (OSError, ValueError) as e:
        raise UserError(f"{source}: cannot load {name.label} ({_first_line(e)}); check the name, its config and "
                        f"split") from None


def resolve_hf(name: HfName, source: str) -> HfName:
    """``name`` with its revision resolved to a commit (a hub data set; a local folder is returned as it is):
    offline (``HF_HUB_OFFLINE``) the commit of its snapshot in the hub cache, else the hub's answer. A revision
    that is not there is one :class:`UserError`, which says how a split is written when the revision looks like a
    split name."""
    if name.local or name.commit is not None:
        return name
    revision = name.revision or "main"
    try:
        if _hub_offline():
            snap = _cached_snapshot(name, revision, source)
            return dataclasses.replace(name, commit=Path(snap).name, snapshot=snap)  # snapshots/<commit>
        from huggingface_hub import HfApi

        from dspark_core.hub import hub_errors

        with hub_errors(name.path, revision, source, repo_type="dataset"):
            return dataclasses.replace(name, commit=HfApi().dataset_info(name.path, revision=revision).sha)
    except UserError as e:
        if name.revision and _SPLIT_NAMES.fullmatch(name.revision):
            raise UserError(f"{e} (`@` names a revision; a split is written "
                            f"hf:{name.path}:{name.config or ''}:{name.revision})") from None
        raise


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cached_snapshot(name: HfName, revision: str, source: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name.path, repo_type="dataset", revision=revision, local_files_only=True)
    except (OSError, ValueError) as e:
        at = f" @ {name.revision}" if name.revision else ""
        get = f" --revision {name.revision}" if name.revision else ""
        raise UserError(f"{source}: HF_HUB_OFFLINE is set and {name.path}{at} is not in the hub cache "
                        f"({_first_line(e)[:100]}); download it first (hf download --repo-type dataset {name.path}"
                        f"{get}) or unset HF_HUB_OFFLINE") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]
