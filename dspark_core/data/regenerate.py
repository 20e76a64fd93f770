"""The ``regenerate`` stage: the target answers every prompt; responses become the training data.

For each split in ``splits`` it reads ``{prompts_dir}/{split}.parquet`` and answers each conversation's user
turns in order, up to ``max_turns`` of them, with the chosen backend (``hf`` / ``vllm`` / ``openai``) and the
sampling params. Turn k's prompt is the chat template's render of ``[system?, u1, a1, ..., uk]`` with the
generation prompt, ``a1 ..`` being the target's own answers of this run (the decoded text of the generated ids
without their EOS, as assistant messages); all first turns of a batch go to the backend in one call, then the
second turns, ... The system message is the conversation's own, else ``system_prompt``; ``enable_thinking``
(when not null) reaches the template (Qwen3's flag). ``backend: none`` answers nothing: it takes the data set's
own assistant turns (``Prompt.replies``, data the target produced) and loads no model.

The sample of a conversation is the token ids of the last turn's context (the template's render, which holds the
earlier answers as the template renders history) followed by the last answer's ids exactly as generated; with
``backend: none`` the render of the whole conversation. Its loss spans are the assistant turns, found by the
template itself (:mod:`dspark_core.data.chat`): each earlier answer as the template renders it plus its
end-of-turn EOS token, the last answer's generated ids including the EOS it produced. A row of several answers
also keeps each answer's own sample: the context the target answered it in (``backend: none``: the render of the
conversation up to it) followed by the answer as generated, which a Qwen3-style template renders with its
thinking (the ``turn_*`` columns, :func:`dspark_core.data.chat.turn_columns`; the cache stage makes its samples
from them). Output ``{out_dir}/{split}.parquet``, one row a conversation:

    id, source, prompt_ids list<int32>, response_ids list<int32>, prompt_text, response_text, backend,
    finish_reason, span_starts list<int32>, span_ends list<int32>, finish_reasons list<str>, num_turns int32,
    input_key, turn_prefix list<int32>, turn_tails list<list<int32>>, turn_span_starts list<int32>,
    turn_span_ends list<int32>

``prompt_ids`` are the sample's tokens before the first answer and ``response_ids`` the rest, so
``prompt_ids + response_ids`` is the sample and a single-turn row is what it always was (the prompt, then the
answer). ``span_starts`` / ``span_ends`` are the loss spans, positions in ``prompt_ids + response_ids`` (a file
or row without them: one span, the response). An answer's ids end with an EOS id when the model stopped
(``'stop'``), or hold exactly ``max_new_tokens`` ids (``'length'``: its span ends at its last generated token,
no end-of-turn token is added); ``finish_reasons`` has one a turn (``'given'`` for ``backend: none``),
``finish_reason`` is the last turn's. An answer cut at ``max_new_tokens`` ends its conversation: the later user
turns are not asked (an unfinished answer, maybe inside its ``<think>``, is no history to answer after), so a cut
answer is always a row's last (``turns_dropped`` in the stats). ``num_turns``: the turns answered (fewer than
asked after a cut answer, or when a turn's context would pass the positions the conversation was given, see
:func:`conversation_positions`). ``response_text`` is ``response_ids`` decoded without special tokens;
``prompt_text`` is the chat-templated text before the first answer. ``input_key``: what the row's answers
depend on besides the settings (the rendered first prompt and the conversation's later turns, see
:func:`build_conversations`).

Resumable: each finished batch is written atomically as a small parquet under
``{out_dir}/parts/{split}/``; a restarted run skips the prompts answered there (parts written under other
settings -- another target, sampling params, system prompt, backend, dtype, max_turns, enable_thinking -- are
discarded). The final parquet is assembled in prompt order at the end and the parts are removed; a final parquet
written under the same settings for the same prompts makes the split a no-op (so ``persist: true`` in dvc.yaml is
safe). ``stats_path`` records tokens and tokens/s per split, and ``last_measured`` (new tokens and seconds of the
run that made the split's answers: this run's when it answered any, else the earlier stats file's for the same
answers), so a rerun that kept every answer still says how fast they were made (dvc.yaml keeps the file:
``persist: true``).

Another prompt set (a source added, ``n_train`` raised): the answers of the split's earlier final parquet
that were made under the same settings are kept (``kept_answers`` in the stats) and only the prompts without
one are answered. An answer is kept for a prompt with the same id *and* the same inputs (its ``input_key``;
a row without one, of a single-turn file, by its ``prompt_ids``): a prompt whose text or chat template changed
is answered again. A final parquet of an older version of this stage
(no row key) is kept only for its own prompts; a run on those prompts, or :func:`mark_answers_reusable`,
marks it reusable (checked by its settings key).

Time budget (``run_regenerate(cfg, time_budget_s=...)``, ``stages/regenerate.py --time-budget-s``; off by
default): no new batch starts once that many seconds have passed since the stage started (the batch in
flight finishes; a split with no answered prompt yet still gets one batch). The batches, length-sorted
inside, then run in a seeded random order, so the answered prompts are a random subset of every split's
prompts rather than its longest ones. A split cut short writes its final parquet with the answered
prompts only (prompt order; ``skipped_prompts`` in the stats) and keeps its parts, so a rerun continues
with the rest.

The vLLM backend spawns worker processes: call :func:`run_regenerate` under
``if __name__ == "__main__":``.

Shape legend: B batch, L prompt tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dspark_core.config import Section, device_name, non_negative, one_of, positive, require, resolve_device
from dspark_core.data.backends import BACKENDS, Backend, Request, SamplingSpec, finalize_response, request_seed
from dspark_core.data.chat import Rendered, render, render_with_spans, turn_columns
from dspark_core.data.prompts import SPLITS, Prompt, read_prompts
from dspark_core.errors import UserError
from dspark_core.io import (atomic_path, parquet_schema, read_json, read_parquet, sha256_file, sha256_json,
                            write_json, write_parquet)

log = logging.getLogger(__name__)

PARTS_DIR = "parts"
META_FILE = "meta.json"
KEY_METADATA = b"dspark_regen_key"          # the settings and the prompts file: the split is done
ROW_KEY_METADATA = b"dspark_regen_row_key"  # the settings alone: each row answers its own prompt
COLUMNS = ("id", "source", "prompt_ids", "response_ids", "prompt_text", "response_text", "backend",
           "finish_reason")
NONE = "none"                       # backend: the data set's own replies, no model
BACKEND_CHOICES = (*BACKENDS, NONE)
GIVEN = "given"                     # the finish reason of a reply taken from the data set
TURN_SLACK = 16                     # tokens a rendered earlier answer may take beyond max_new_tokens
# The layout of rows of several turns, in the settings key when max_turns > 1: 2 = each answer's own sample in the
# turn columns, and an answer cut at max_new_tokens ends its conversation
MULTI_TURN_ROWS = 2


@dataclasses.dataclass(frozen=True)
class RegenerateConfig(Section):
    """params section ``regenerate``."""

    backend: str = "hf"                  # hf | vllm | openai | none (the data set's own replies, no model)
    temperature: float = 0.7             # 0 = greedy
    top_p: float = 0.8
    top_k: int = 20                      # 0 = off
    max_new_tokens: int = 160
    batch_size: int = 16                 # prompts a batch (and a resumable part)
    seed: int = 0
    system_prompt: str | None = None     # a conversation without its own system message gets it (null: none)
    max_turns: int = 1                   # user turns answered per conversation, in order (1: the first only)
    enable_thinking: bool | None = None  # passed to the chat template when not null (Qwen3's flag)
    dtype: str = "float32"               # compute dtype (hf and vllm)
    device: str = "auto"                 # hf backend: auto | cpu | cuda | cuda:N
    threads: int | None = None           # hf backend CPU threads (null: torch's default)
    vllm_gpu_memory_utilization: float = 0.25
    vllm_enforce_eager: bool = False     # skip vLLM's torch.compile warm-up
    vllm: dict[str, Any] = dataclasses.field(default_factory=dict)  # more vllm.LLM engine arguments, as they are
    openai_base_url: str | tuple[str, ...] = "http://127.0.0.1:8000/v1"  # one server or a list (spread over them)
    openai_concurrency: int = 32         # requests in flight per server
    openai_model: str | None = None      # null: the first model the server lists
    openai_api_key_env: str = "OPENAI_API_KEY"  # env var holding the key, if the server wants one
    openai_timeout_s: float = 600.0
    openai_send_token_ids: bool = True   # prompt as token ids (false: as chat-templated text)
    splits: tuple[str, ...] = SPLITS
    target_dir: str = "data/target"
    prompts_dir: str = "data/prompts"
    out_dir: str = "data/regen"
    stats_path: str = "reports/regenerate_stats.json"
    time_budget_s: float | None = None   # start no batch after this many seconds: a random subset is answered

    def validate(self) -> None:
        one_of("backend", self.backend, BACKEND_CHOICES)
        positive("max_turns", self.max_turns)
        device_name("device", self.device)
        if self.time_budget_s is not None:
            positive("time_budget_s", self.time_budget_s)
        non_negative("temperature", self.temperature)
        require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1]; got {self.top_p!r}")
        non_negative("top_k", self.top_k)
        positive("max_new_tokens", self.max_new_tokens)
        positive("batch_size", self.batch_size)
        require(0.0 < self.vllm_gpu_memory_utilization <= 1.0,
                f"vllm_gpu_memory_utilization must be in (0, 1]; got {self.vllm_gpu_memory_utilization!r}")
        positive("openai_timeout_s", self.openai_timeout_s)
        positive("openai_concurrency", self.openai_concurrency)
        urls = self.openai_urls
        require(len(urls) > 0, "openai_base_url must name at least one server")
        for url in urls:
            require(url.startswith(("http://", "https://")),
                    f"openai_base_url: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")
        dup = sorted({u for u in urls if urls.count(u) > 1})
        require(not dup, f"openai_base_url names {dup[:1]} more than once")
        check_vllm_args(self.vllm)
        if self.threads is not None:
            positive("threads", self.threads)
        require(len(self.splits) > 0, "splits must not be empty")
        for s in self.splits:
            one_of("splits[]", s, SPLITS)
        from dspark_core.target import resolve_dtype

        resolve_dtype(self.dtype)

    @property
    def sampling(self) -> SamplingSpec:
        return SamplingSpec(self.temperature, self.top_p, self.top_k, self.max_new_tokens)

    @property
    def openai_urls(self) -> tuple[str, ...]:
        """``openai_base_url`` as a tuple of server URLs (one or several)."""
        url = self.openai_base_url
        return (url,) if isinstance(url, str) else tuple(url)


# engine arguments dspark sets itself: regenerate.vllm may not hold them (where each is given instead)
VLLM_OWN_ARGS = {"dtype": "regenerate.dtype", "seed": "regenerate.seed",
                 "gpu_memory_utilization": "regenerate.vllm_gpu_memory_utilization",
                 "enforce_eager": "regenerate.vllm_enforce_eager",
                 "max_model_len": "the stage itself (the longest prompt + regenerate.max_new_tokens)",
                 "model": "the target (params.yaml target, data/target)", "tokenizer": "the target (data/target)",
                 "revision": "target.revision", "tokenizer_revision": "target.revision",
                 "trust_remote_code": "target.trust_remote_code"}


def check_vllm_args(args: dict[str, Any]) -> None:
    """``regenerate.vllm``: no key dspark sets itself (named with where it is set), and no data parallelism inside
    one offline engine (vLLM's ``LLM`` refuses ``data_parallel_size`` > 1: one rank per process)."""
    for key in args:
        require(isinstance(key, str) and bool(key), f"vllm: keys must be vLLM engine argument names; got {key!r}")
        require(key not in VLLM_OWN_ARGS, f"vllm.{key} is given both ways, as regenerate.vllm.{key} and by "
                                          f"{VLLM_OWN_ARGS.get(key)}; drop it from regenerate.vllm")
    dp = args.get("data_parallel_size", 1)
    require(not isinstance(dp, int) or dp <= 1,
            f"vllm.data_parallel_size: {dp}: vLLM's offline engine (vllm.LLM) runs one data-parallel rank per "
            f"process; use tensor_parallel_size here, or serve the target (`vllm serve ... --data-parallel-size "
            f"{dp}`, or several servers) and set regenerate.backend: openai with openai_base_url")


# ----------------------------------------------------------------------------------------------
# prompts -> requests
# ----------------------------------------------------------------------------------------------
def eos_token_ids(tok, target_dir: str | Path) -> list[int]:
    """The tokenizer's EOS first, then any other EOS of ``generation_config.json`` (order kept)."""
    ids: list[int] = []
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    gc = Path(target_dir) / "generation_config.json"
    extra = read_json(gc).get("eos_token_id") if gc.is_file() else None
    for e in extra if isinstance(extra, list) else [extra]:
        if e is not None and int(e) not in ids:
            ids.append(int(e))
    if not ids:
        raise UserError(f"{target_dir}: the target defines no EOS token (tokenizer or generation_config.json)")
    return ids


def chat_prompt(tok, user_turn: str, system_prompt: str | None = None,
                enable_thinking: bool | None = None) -> tuple[str, list[int]]:
    """``(text, ids)`` of one user turn rendered with the chat template, ready for the answer."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
    messages.append({"role": "user", "content": user_turn})
    text = render(tok, messages, add_generation_prompt=True, enable_thinking=enable_thinking)
    return text, list(tok(text, add_special_tokens=False)["input_ids"])


def turn_seed(seed: int, conversation_id: str, turn: int) -> int:
    """The sampling seed of a conversation's turn: turn 0 keeps :func:`request_seed` of the id (single-turn
    answers keep their bytes), a later turn gets its own."""
    return request_seed(seed, conversation_id if turn == 0 else f"{conversation_id}\x1fturn{turn}")


def build_requests(prompts: Sequence[Prompt], tok, system_prompt: str | None, seed: int,
                   enable_thinking: bool | None = None) -> list[Request]:
    """The first turn's request of each prompt (its own system message, else ``system_prompt``)."""
    out = []
    for p in prompts:
        text, ids = chat_prompt(tok, p.turns[0], _system(p, system_prompt), enable_thinking)
        out.append(Request(p.id, tuple(ids), text, turn_seed(seed, p.id, 0)))
    return out


def _system(prompt: Prompt, default: str | None) -> str | None:
    return prompt.system if prompt.system is not None else default


@dataclasses.dataclass(frozen=True)
class Conversation:
    """What the stage does for one prompt: the user turns it answers (at most ``max_turns``) after its system
    message, the data set's replies (``backend: none``), the first turn's request, the row's ``input_key`` and
    the positions its turns may take (:func:`conversation_positions`)."""

    id: str
    source: str
    system: str | None
    turns: tuple[str, ...]
    replies: tuple[str, ...]
    first: Request
    key: str
    positions: int

    def messages(self, answers: Sequence[str]) -> list[dict]:
        """``[system?, u1, a1, u2, a2, ...]``: every user turn with an answer, then the next user turn if any."""
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        for k, turn in enumerate(self.turns[:len(answers) + 1]):
            out.append({"role": "user", "content": turn})
            if k < len(answers):
                out.append({"role": "assistant", "content": answers[k]})
        return out


def conversation_positions(skeleton_ids: int, turns: int, max_new_tokens: int, max_positions: int | None) -> int:
    """Positions a conversation's turns may take: its render with empty answers (``skeleton_ids`` tokens, the
    generation prompt included), ``max_new_tokens`` + :data:`TURN_SLACK` for each earlier answer and
    ``max_new_tokens`` for the last, at most the target's positions. A turn whose context and ``max_new_tokens``
    would pass it is not asked (the conversation ends with the turn before). A single turn: its prompt (the
    skeleton) and ``max_new_tokens``, as before. A function of the conversation alone, so an answer never depends
    on the other prompts of the set; vLLM's ``max_model_len`` is the largest."""
    need = skeleton_ids + (turns - 1) * (max_new_tokens + TURN_SLACK) + max_new_tokens
    return need if max_positions is None else min(need, max_positions)


def build_conversations(prompts: Sequence[Prompt], tok, cfg: "RegenerateConfig", max_positions: int | None,
                        where: str, eos_ids: Sequence[int] = ()) -> list[Conversation]:
    """A :class:`Conversation` of each prompt; ``backend: none`` refuses a prompt without replies. The chat
    template is checked on the first conversation of several turns (its answers' spans can be found), before
    anything is answered."""
    firsts = build_requests(prompts, tok, cfg.system_prompt, cfg.seed, cfg.enable_thinking)
    convs = [_conversation(p, first, tok, cfg, max_positions, where) for p, first in zip(prompts, firsts)]
    probe = next((c for c in convs if len(c.turns) > 1 or c.replies), None)
    if probe is not None:
        render_with_spans(tok, _skeleton(probe), eos_ids, add_generation_prompt=not probe.replies,
                          enable_thinking=cfg.enable_thinking, where=cfg.target_dir)
    return convs


def _skeleton(conv: Conversation) -> list[dict]:
    """The conversation's messages with its replies (``backend: none``) or empty answers: what its rows depend on
    besides the answers themselves."""
    return conv.messages(conv.replies or [""] * (len(conv.turns) - 1))


def _conversation(p: Prompt, first: Request, tok, cfg: "RegenerateConfig", max_positions: int | None,
                  where: str) -> Conversation:
    """One prompt's :class:`Conversation`: at most ``max_turns`` turns (``backend: none``: as many as it has
    replies), its key over the render of :func:`_skeleton` and its positions."""
    n, replies = min(cfg.max_turns, len(p.turns)), ()
    if cfg.backend == NONE:
        if not p.replies:
            raise UserError(f"{where}: row id={p.id!r} has no assistant replies; regenerate.backend: none takes "
                            "the data set's own answers (give the rows replies, or answer them with a backend: hf, "
                            "vllm or openai)")
        n = min(n, len(p.replies))
        replies = tuple(p.replies[:n])
    conv = Conversation(p.id, p.source, _system(p, cfg.system_prompt), tuple(p.turns[:n]), replies, first, "", 0)
    skeleton = render(tok, _skeleton(conv), add_generation_prompt=not replies, enable_thinking=cfg.enable_thinking)
    key = sha256_json({"first": list(first.prompt_ids), "conversation": skeleton})[:16]
    skeleton_ids = len(tok(skeleton, add_special_tokens=False)["input_ids"])
    return dataclasses.replace(conv, key=key,
                               positions=conversation_positions(skeleton_ids, n, cfg.max_new_tokens, max_positions))


def check_lengths(requests: Sequence[Request], max_new_tokens: int, max_positions: int | None, where: str) -> None:
    """Every prompt plus its answer must fit the model's positions."""
    if max_positions is None:
        return
    for r in requests:
        if len(r.prompt_ids) + max_new_tokens > max_positions:
            raise UserError(f"{where}: prompt id={r.id!r} has {len(r.prompt_ids)} tokens; with max_new_tokens="
                            f"{max_new_tokens} it exceeds the target's {max_positions} positions "
                            f"(lower prepare.max_prompt_chars or regenerate.max_new_tokens)")


# ----------------------------------------------------------------------------------------------
# parquet rows and resumable parts
# ----------------------------------------------------------------------------------------------
def _schema():
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("source", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                      ("response_ids", pa.list_(pa.int32())), ("prompt_text", pa.string()),
                      ("response_text", pa.string()), ("backend", pa.string()), ("finish_reason", pa.string()),
                      ("span_starts", pa.list_(pa.int32())), ("span_ends", pa.list_(pa.int32())),
                      ("finish_reasons", pa.list_(pa.string())), ("num_turns", pa.int32()),
                      ("input_key", pa.string()), ("turn_prefix", pa.list_(pa.int32())),
                      ("turn_tails", pa.list_(pa.list_(pa.int32()))), ("turn_span_starts", pa.list_(pa.int32())),
                      ("turn_span_ends", pa.list_(pa.int32()))])


def _write_rows(path: Path, rows: list[dict], key: str | None = None, row_key: str | None = None) -> None:
    import pyarrow as pa

    meta = {k: v.encode() for k, v in ((KEY_METADATA, key), (ROW_KEY_METADATA, row_key)) if v}
    schema = _schema().with_metadata(meta) if meta else _schema()
    table = pa.Table.from_pylist(rows, schema=schema)
    with atomic_path(path, ".parquet") as tmp:
        write_parquet(table, tmp)


PART_FIX = "delete the file and rerun the regenerate stage (it answers those prompts again)"


def _read_rows(path: Path) -> list[dict]:
    return read_parquet(path, fix=PART_FIX).to_pylist()


def _file_key(path: Path, name: bytes = KEY_METADATA) -> str | None:
    meta = parquet_schema(path, fix=PART_FIX).metadata or {}
    return meta.get(name, b"").decode() or None


def _answers(row: dict, conv: Conversation) -> bool:
    """Whether ``row`` answers ``conv``: the same inputs (``input_key``); a row without one (a file of the
    single-turn stage) its first turn's prompt ids."""
    if row.get("input_key") is not None:
        return row["input_key"] == conv.key
    return len(conv.turns) == 1 and not conv.replies and list(row["prompt_ids"]) == list(conv.first.prompt_ids)


def _answered(rows: list[dict], convs: Sequence[Conversation]) -> dict[str, dict]:
    """{id: row} of the rows that answer one of ``convs``: the same id and the same inputs (the first such row
    of an id wins)."""
    want = {c.id: c for c in convs}
    out: dict[str, dict] = {}
    for row in rows:
        rid = row["id"]
        if rid in want and rid not in out and _answers(row, want[rid]):
            out[rid] = row
    return out


class PartStore:
    """Finished batches of one split, one atomically written parquet each, tied to a settings key (the row key:
    parts stay valid when the prompt set changes; the rows are matched to the prompts when read)."""

    def __init__(self, root: Path, key: str):
        self.root, self.key = root, key
        meta = root / META_FILE
        if root.exists() and (not meta.is_file() or read_json(meta).get("key") != key):
            log.warning("%s: parts were written under other settings; discarding them", root)
            shutil.rmtree(root)
        if not root.exists():
            write_json(meta, {"key": key})

    def _files(self) -> list[Path]:
        return sorted(self.root.glob("part-*.parquet"))

    def rows(self) -> list[dict]:
        return [row for f in self._files() for row in _read_rows(f)]

    def write(self, rows: list[dict]) -> None:
        files = self._files()
        n = int(files[-1].stem.split("-")[1]) + 1 if files else 0
        _write_rows(self.root / f"part-{n:05d}.parquet", rows)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _row(conv: Conversation, sample: Rendered, reasons: Sequence[str], backend: str, tok,
         turns: Sequence[tuple[Sequence[int], tuple[int, int]]] = ()) -> dict:
    """The parquet row of a conversation whose sample (ids and loss spans) is ``sample`` and whose answers' own
    samples are ``turns`` (``(ids, answer span)`` each: :func:`turn_columns`)."""
    cut = sample.spans[0][0] if sample.spans else len(sample.ids)
    text_cut = sample.char_spans[0][0] if sample.char_spans else len(sample.text)
    return {"id": conv.id, "source": conv.source, "prompt_ids": sample.ids[:cut], "response_ids": sample.ids[cut:],
            "prompt_text": sample.text[:text_cut],
            "response_text": tok.decode(sample.ids[cut:], skip_special_tokens=True),
            "backend": backend, "finish_reason": reasons[-1], "span_starts": [a for a, _ in sample.spans],
            "span_ends": [b for _, b in sample.spans], "finish_reasons": list(reasons), "num_turns": len(reasons),
            "input_key": conv.key, **turn_columns(sample.ids, turns)}


class _Dialogue:
    """One conversation being answered: its answers so far (text for the template, ids and finish reasons as
    the backend gave them, each with the context it answered) and the request of its current turn."""

    def __init__(self, conv: Conversation):
        self.conv, self.texts, self.reasons = conv, [], []
        self.answer: list[int] = []
        self.request: Request | None = None
        self.turns: list[tuple[np.ndarray, list[int]]] = []  # (context ids [L] int32, answer ids) a turn

    def next_request(self, tok, cfg: "RegenerateConfig") -> Request | None:
        """The next turn's request, or None (no turn left, the last answer was cut at ``max_new_tokens``, or the
        context would pass ``conv.positions``)."""
        k = len(self.texts)
        if k >= len(self.conv.turns) or (self.reasons and self.reasons[-1] == "length"):
            return None
        if k == 0:
            return self.conv.first
        text = render(tok, self.conv.messages(self.texts), add_generation_prompt=True,
                      enable_thinking=cfg.enable_thinking)
        ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
        if len(ids) + cfg.max_new_tokens > self.conv.positions:
            log.warning("regenerate: conversation %r stops after %d turns: turn %d's context of %d tokens would "
                        "pass its %d positions", self.conv.id, k, k + 1, len(ids), self.conv.positions)
            return None
        return Request(self.conv.id, ids, text, turn_seed(cfg.seed, self.conv.id, k))

    def add(self, request: Request, ids: list[int], reason: str, tok, eos_ids: Sequence[int]) -> None:
        """Record a turn's answer: its ids, and its text for the next turns (decoded without the EOS it ends
        with, special tokens and spaces kept: the template renders the answer as the target produced it)."""
        body = ids[:-1] if ids and ids[-1] in eos_ids else ids
        self.request, self.answer = request, ids
        self.turns.append((np.asarray(request.prompt_ids, dtype=np.int32), list(ids)))
        self.texts.append(tok.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        self.reasons.append(reason)

    def sample(self, tok, eos_ids: Sequence[int], cfg: "RegenerateConfig") -> Rendered:
        """The last turn's context (its render, with the earlier answers' spans) and its answer, whose span is
        its generated ids."""
        assert self.request is not None
        messages = self.conv.messages(self.texts[:-1])
        ctx = render_with_spans(tok, messages, eos_ids, add_generation_prompt=True,
                                enable_thinking=cfg.enable_thinking, where=cfg.target_dir)
        if tuple(ctx.ids) != tuple(self.request.prompt_ids):
            raise RuntimeError(f"conversation {self.conv.id!r}: the context rendered again differs from the one "
                               "the target answered")
        n = len(ctx.ids)
        return Rendered(ctx.text, ctx.ids + list(self.answer), ctx.spans + [(n, n + len(self.answer))],
                        ctx.char_spans + [(len(ctx.text), len(ctx.text))])

    def answer_samples(self) -> list[tuple[np.ndarray, tuple[int, int]]]:
        """Each answer's own sample: the context it answered, then its ids as generated (the answer's span)."""
        return [(np.concatenate([ctx, np.asarray(ids, dtype=np.int32)]), (ctx.size, ctx.size + len(ids)))
                for ctx, ids in self.turns]


def answer_batch(convs: Sequence[Conversation], backend: Backend, tok, eos_ids: Sequence[int],
                 cfg: "RegenerateConfig") -> tuple[list[dict], int]:
    """Answer ``convs`` turn by turn (every first turn in one backend call, then the second turns, ...);
    returns their rows and the number of tokens generated."""
    dialogues = [_Dialogue(c) for c in convs]
    new_tokens = 0
    while True:
        asked = [(d, r) for d in dialogues if (r := d.next_request(tok, cfg)) is not None]
        if not asked:
            break
        gens = backend.generate([r for _, r in asked])
        for (d, req), g in zip(asked, gens):
            ids, reason = finalize_response(g.response_ids, g.finish_reason, eos_ids, cfg.max_new_tokens)
            d.add(req, ids, reason, tok, eos_ids)
            new_tokens += len(ids)
    rows = [_row(d.conv, d.sample(tok, eos_ids, cfg), d.reasons, backend.name, tok, d.answer_samples())
            for d in dialogues]
    return rows, new_tokens


def given_rows(convs: Sequence[Conversation], tok, eos_ids: Sequence[int], cfg: "RegenerateConfig") -> list[dict]:
    """``backend: none``: each conversation as the data set gives it, its replies the answers: the render of
    the whole conversation, a span for every reply; each reply's own sample the render up to it."""
    rows = []
    for c in convs:
        opts = dict(add_generation_prompt=False, enable_thinking=cfg.enable_thinking, where=cfg.target_dir)
        sample = render_with_spans(tok, _skeleton(c), eos_ids, **opts)
        turns = [(sample.ids, sample.spans[-1])]
        for k in range(len(c.replies) - 1, 0, -1):  # the earlier replies' own samples (several replies only)
            upto = c.messages(c.replies[:k])[:-1]  # [system?, u1, r1, ..., uk, rk]: the next user turn left out
            own = render_with_spans(tok, upto, eos_ids, last_only=True, **opts)
            turns.insert(0, (own.ids, own.spans[-1]))
        rows.append(_row(c, sample, [GIVEN] * len(c.replies), NONE, tok, turns))
    return rows


# ----------------------------------------------------------------------------------------------
# backends
# ----------------------------------------------------------------------------------------------
def make_backend(cfg: RegenerateConfig, tok, eos_ids: Sequence[int], max_model_len: int) -> Backend:
    """Build the backend named by ``cfg.backend`` (vLLM: call under a ``__main__`` guard)."""
    if cfg.backend == "hf":
        from dspark_core.data.backends.hf_backend import HFBackend

        return HFBackend(cfg.target_dir, cfg.sampling, eos_ids, dtype=cfg.dtype, device=str(resolve_device(cfg.device, "regenerate.device")),
                         threads=cfg.threads)
    if cfg.backend == "vllm":
        from dspark_core.data.backends.vllm_backend import VLLMBackend

        return VLLMBackend(cfg.target_dir, cfg.sampling, dtype=cfg.dtype, seed=cfg.seed,
                           gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, max_model_len=max_model_len,
                           enforce_eager=cfg.vllm_enforce_eager, engine_args=cfg.vllm)
    from dspark_core.data.backends.openai_backend import OpenAIBackend

    backend = OpenAIBackend(cfg.openai_urls, cfg.openai_model, cfg.sampling, tok,
                            api_key_env=cfg.openai_api_key_env, timeout_s=cfg.openai_timeout_s,
                            send_token_ids=cfg.openai_send_token_ids, concurrency=cfg.openai_concurrency)
    in_flight = len(backend.servers) * cfg.openai_concurrency
    if cfg.batch_size < in_flight:
        log.warning("regenerate: batch_size %d < openai_concurrency x servers = %d: at most %d requests in flight "
                    "(a batch is answered whole before the next starts); raise regenerate.batch_size",
                    cfg.batch_size, in_flight, cfg.batch_size)
    return backend


# ----------------------------------------------------------------------------------------------
# the stage
# ----------------------------------------------------------------------------------------------
def _settings(cfg: RegenerateConfig, fingerprint: str) -> dict:
    """What an answer depends on besides its prompt: target, template inputs, sampling, backend, dtype, turns.
    ``max_turns`` (with the layout of multi-turn rows, :data:`MULTI_TURN_ROWS`) and ``enable_thinking`` enter only
    when not at their defaults (1, null), so the answers of the single-turn stage stay current."""
    out = {"target": fingerprint, "sampling": dataclasses.asdict(cfg.sampling), "seed": cfg.seed,
           "system_prompt": cfg.system_prompt, "backend": cfg.backend, "dtype": cfg.dtype}
    if cfg.max_turns != 1:
        out.update(max_turns=cfg.max_turns, rows=MULTI_TURN_ROWS)
    if cfg.enable_thinking is not None:
        out["enable_thinking"] = cfg.enable_thinking
    return out


def _settings_key(cfg: RegenerateConfig, fingerprint: str, prompts_file: Path) -> str:
    """What makes a split's final file current: the settings and the prompts file."""
    return sha256_json({**_settings(cfg, fingerprint), "prompts": sha256_file(prompts_file)})[:16]


def _row_key(cfg: RegenerateConfig, fingerprint: str) -> str:
    """What makes one answer valid, whatever the other prompts are: the settings alone (the prompt itself is
    checked row by row, see :func:`_answered`)."""
    return sha256_json(_settings(cfg, fingerprint))[:16]


def generate_split(convs: Sequence[Conversation], store: PartStore, get_backend: Callable[[], Backend], tok,
                   eos_ids: Sequence[int], cfg: RegenerateConfig, desc: str = "regenerate",
                   deadline: float | None = None) -> dict:
    """Answer every conversation whose id is not in ``store`` yet, one part a batch. Returns counters.

    ``deadline`` (a ``time.perf_counter()`` value): start no batch after it, except a split's first when
    it has no answered prompt yet; the batches then run in a seeded random order (``stopped_early`` in the
    counters when some were left)."""
    from tqdm.auto import tqdm

    done = set(_answered(store.rows(), convs))
    todo = sorted((c for c in convs if c.id not in done), key=lambda c: -len(c.first.prompt_ids))
    stats = {"generated": 0, "new_tokens": 0, "seconds": 0.0, "stopped_early": False}
    if not todo:
        return stats
    batches = [todo[start:start + cfg.batch_size] for start in range(0, len(todo), cfg.batch_size)]
    if deadline is not None:
        random.Random(cfg.seed).shuffle(batches)
    backend = get_backend() if cfg.backend != NONE else None
    with tqdm(total=len(convs), initial=len(convs) - len(todo), desc=desc, unit="prompt") as bar:
        for batch in batches:
            if deadline is not None and (stats["generated"] or done) and time.perf_counter() >= deadline:
                stats["stopped_early"] = True
                log.warning("regenerate: time budget reached; %d of %d prompts of %s left unanswered",
                            len(convs) - bar.n, len(convs), desc)
                break
            t0 = time.perf_counter()
            if backend is None:
                rows, new = given_rows(batch, tok, eos_ids, cfg), 0
            else:
                rows, new = answer_batch(batch, backend, tok, eos_ids, cfg)
                stats["seconds"] += time.perf_counter() - t0
            stats["new_tokens"] += new
            store.write(rows)
            stats["generated"] += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(stats['seconds'], 1e-9):.1f}", refresh=False)
    return stats


def assemble(convs: Sequence[Conversation], rows: list[dict], path: Path, key: str, row_key: str | None = None,
             allow_missing: bool = False) -> list[dict]:
    """Write the split's rows in prompt order to ``path`` (atomic); every conversation must have a row unless
    ``allow_missing`` (a run cut by its time budget: the answered ones, at least one)."""
    by_id = _answered(rows, convs)
    missing = [c.id for c in convs if c.id not in by_id]
    if missing and (not allow_missing or len(missing) == len(convs)):
        raise RuntimeError(f"{path}: {len(missing)} prompts have no generation (first: {missing[0]!r})")
    ordered = [by_id[c.id] for c in convs if c.id in by_id]
    _write_rows(path, ordered, key, row_key)
    return ordered


def keep_earlier_answers(final: Path, row_key: str, convs: Sequence[Conversation], store: PartStore) -> int:
    """The answers in an earlier final parquet of the split that were made under the same settings (its row key)
    and answer one of ``convs`` go into ``store`` as one part (those it has not already); returns how many."""
    if not final.is_file() or _file_key(final, ROW_KEY_METADATA) != row_key:
        return 0
    have = _answered(store.rows(), convs)
    rows = [row for rid, row in _answered(_read_rows(final), convs).items() if rid not in have]
    if rows:
        store.write(rows)
        log.info("regenerate: %d answers of %s kept for the new prompt set", len(rows), final)
    return len(rows)


def _final_is_current(path: Path, key: str, convs: Sequence[Conversation]) -> bool:
    if not path.is_file() or _file_key(path) != key:
        return False
    return read_parquet(path, ["id"], fix=PART_FIX).column("id").to_pylist() == [c.id for c in convs]


def _plans(cfg: RegenerateConfig):
    """(tokenizer, target fingerprint, {split: (conversations, settings key)}) of the prompts files."""
    from dspark_core.target import load_tokenizer, read_fingerprint, validate_hf_dir

    model_cfg = validate_hf_dir(cfg.target_dir)
    fingerprint = read_fingerprint(cfg.target_dir)["fingerprint"]
    tok = load_tokenizer(cfg.target_dir)  # with the target's trust_remote_code, as every reader
    warn_thinking_switch(cfg, tok)
    positions = model_cfg.get("max_position_embeddings")
    plans = {}
    for split in cfg.splits:
        prompts_file = Path(cfg.prompts_dir) / f"{split}.parquet"
        prompts = read_prompts(prompts_file)
        if not prompts:
            raise UserError(f"{prompts_file}: no prompts")
        convs = build_conversations(prompts, tok, cfg, positions, str(prompts_file), eos_token_ids(tok, cfg.target_dir))
        if cfg.backend != NONE:
            check_lengths([c.first for c in convs], cfg.max_new_tokens, positions, str(prompts_file))
        plans[split] = (convs, _settings_key(cfg, fingerprint, prompts_file))
    return tok, fingerprint, plans


def warn_thinking_switch(cfg: RegenerateConfig, tok) -> str | None:
    """One warning line when ``enable_thinking`` is set but the target's chat template has no such switch (it
    renders the same either way): the setting does nothing. Returns the line (None: nothing to say)."""
    from dspark_core.data.chat import has_thinking_switch

    if cfg.enable_thinking is None or has_thinking_switch(tok):
        return None
    line = (f"regenerate.enable_thinking: {str(cfg.enable_thinking).lower()} does nothing: the chat template of "
            f"{cfg.target_dir} has no enable_thinking switch (it renders the same with true and false); set it to "
            "null")
    log.warning("%s", line)
    return line


def mark_answers_reusable(cfg: RegenerateConfig) -> dict[str, str]:
    """Answers of an older version of this stage (a final parquet without a row key) for another prompt set: each
    split whose final parquet is current for the prompts in ``cfg.prompts_dir`` -- checked by its settings key --
    gets the row key, so that a run on a new prompt set keeps its answers. Answers nothing, loads no model, leaves
    a file that is not current as it is. Returns ``{split: what was found}``."""
    _, fingerprint, plans = _plans(cfg)
    row_key = _row_key(cfg, fingerprint)
    found = {}
    for split, (convs, key) in plans.items():
        final = Path(cfg.out_dir) / f"{split}.parquet"
        if not _final_is_current(final, key, convs):
            found[split] = "not current for these prompts: left as it is"
        elif _file_key(final, ROW_KEY_METADATA) == row_key:
            found[split] = "reusable already"
        else:
            _write_rows(final, _read_rows(final), key, row_key)
            found[split] = "marked reusable"
        log.info("regenerate: %s: %s", final, found[split])
    return found


def run_regenerate(cfg: RegenerateConfig, time_budget_s: float | None = None) -> dict:
    """The ``regenerate`` stage. Returns (and writes to ``stats_path``) per-split counters.

    ``time_budget_s``: start no batch after that many seconds from now (see the module docstring)."""
    time_budget_s = cfg.time_budget_s if time_budget_s is None else time_budget_s
    if time_budget_s is not None and not time_budget_s > 0:
        raise UserError(f"regenerate: time budget must be > 0 seconds; got {time_budget_s!r}")
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s

    tok, fingerprint, plans = _plans(cfg)
    eos_ids = eos_token_ids(tok, cfg.target_dir)
    out_dir = Path(cfg.out_dir)
    row_key = _row_key(cfg, fingerprint)

    longest = max(c.positions for convs, _ in plans.values() for c in convs)  # one turn: prompt + max_new_tokens
    backend: list[Backend] = []

    def get_backend() -> Backend:
        if not backend:
            backend.append(make_backend(cfg, tok, eos_ids, max_model_len=longest))
        return backend[0]

    earlier = _earlier_stats(cfg.stats_path)
    stats: dict = {"backend": cfg.backend, "target_fingerprint": fingerprint, "splits": {}}
    try:
        for split, (convs, key) in plans.items():
            final = out_dir / f"{split}.parquet"
            if _final_is_current(final, key, convs):
                log.info("regenerate: %s is up to date", final)
                rows, counters = _read_rows(final), {"generated": 0, "new_tokens": 0, "seconds": 0.0, "kept": 0}
                if _file_key(final, ROW_KEY_METADATA) != row_key:  # an older stage's file, checked by its key:
                    _write_rows(final, rows, key, row_key)           # reusable for another prompt set now
            else:
                store = PartStore(out_dir / PARTS_DIR / split, row_key)
                kept = keep_earlier_answers(final, row_key, convs, store)
                counters = generate_split(convs, store, get_backend, tok, eos_ids, cfg,
                                          desc=f"regenerate {split}", deadline=deadline)
                counters["kept"] = kept
                rows = assemble(convs, store.rows(), final, key, row_key, allow_missing=counters["stopped_early"])
                if len(rows) == len(convs):
                    store.remove()
            asked = {c.id: len(c.turns) for c in convs} if cfg.max_turns > 1 or cfg.backend == NONE else None
            stats["splits"][split] = split_stats = _split_stats(rows, counters, len(convs), asked)
            measured = _last_measured(split_stats, (earlier.get("splits") or {}).get(split), earlier, stats)
            if measured:
                split_stats["last_measured"] = measured
    finally:
        for b in backend:
            b.close()
        _remove_unused_parts(out_dir / PARTS_DIR)   # a failed run keeps its answers, adds no empty store
    write_json(cfg.stats_path, stats)
    return stats


def _split_stats(rows: list[dict], counters: dict, num_requests: int | None = None,
                 asked: dict[str, int] | None = None) -> dict:
    """A split's counters; ``asked`` (several turns or given replies: {id: the user turns to answer}): also
    ``turns`` (answered, all rows), ``answer_tokens`` (the loss spans' tokens; ``response_tokens`` then holds the
    later user turns too) and ``turns_dropped`` (user turns not asked because the answer before was cut at
    max_new_tokens)."""
    secs = counters["seconds"]
    reasons = [x for r in rows for x in (r.get("finish_reasons") or [r["finish_reason"]])]  # one a turn
    out = {
        "prompts": len(rows),
        "response_tokens": sum(len(r["response_ids"]) for r in rows),
        "finish_stop": reasons.count("stop"),
        "finish_length": reasons.count("length"),
        "generated_now": counters["generated"],
        "kept_answers": counters.get("kept", 0),  # from the split's earlier final file (another prompt set)
        "new_tokens_now": counters["new_tokens"],
        "generate_seconds": round(secs, 3),
        "tokens_per_s": round(counters["new_tokens"] / secs, 2) if secs > 0 else None,
    }
    if asked is not None:
        out["turns"] = len(reasons)
        out["answer_tokens"] = sum(sum(r["span_ends"]) - sum(r["span_starts"]) if r.get("span_starts") is not None
                                   else len(r["response_ids"]) for r in rows)
        out["turns_dropped"] = sum(asked[r["id"]] - (r.get("num_turns") or 1) for r in rows
                                   if r["finish_reason"] == "length" and r["id"] in asked)
    if num_requests is not None and num_requests > len(rows):
        out["skipped_prompts"] = num_requests - len(rows)  # left by a time budget
    return out


def _earlier_stats(path: str | Path) -> dict:
    """The stats file an earlier run left ({} if none or unreadable: it only carries a throughput figure)."""
    try:
        doc = read_json(path)
    except (FileNotFoundError, UserError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _last_measured(now: dict, before: dict | None, earlier: dict, stats: dict) -> dict | None:
    """``{new_tokens, generate_seconds, tokens_per_s}`` of the run that made a split's answers: this run's when it
    generated any; else the earlier stats' split figure (its ``last_measured``, or its own generation) when that
    run had the same backend and target and ended with the same prompts and response tokens -- the same answers.
    None when nothing was ever measured for them."""
    if now["new_tokens_now"] and now["generate_seconds"]:
        return {"new_tokens": now["new_tokens_now"], "generate_seconds": now["generate_seconds"],
                "tokens_per_s": now["tokens_per_s"]}
    before = before if isinstance(before, dict) else {}
    same_run = all(earlier.get(k) == stats[k] for k in ("backend", "target_fingerprint"))
    same_answers = all(before.get(k) == now[k] for k in ("prompts", "response_tokens"))
    if not (same_run and same_answers):
        return None
    last = before.get("last_measured") or {"new_tokens": before.get("new_tokens_now"),
                                             "generate_seconds": before.get("generate_seconds"),
                                             "tokens_per_s": before.get("tokens_per_s")}
    tokens, seconds = last.get("new_tokens"), last.get("generate_seconds")
    if not (isinstance(tokens, int) and isinstance(seconds, (int, float)) and tokens > 0 and seconds > 0):
        return None
    return {"new_tokens": tokens, "generate_seconds": seconds, "tokens_per_s": last.get("tokens_per_s")}


def _remove_if_empty(path: Path) -> None:
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()


def _remove_unused_parts(parts: Path) -> None:
    """Each split's part folder that holds no answered batch (its settings file only), then the parts folder if
    nothing is left: what a run leaves is its answers, never an empty store."""
    if not parts.is_dir():
        return
    for split in parts.iterdir():
        if split.is_dir() and not any(split.glob("part-*.parquet")):
            shutil.rmtree(split)
    _remove_if_empty(parts)


def read_regen(path: str | Path) -> list[dict]:
    """Rows of a regenerate parquet (dicts with the :data:`COLUMNS` keys)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: regenerate output not found (run the regenerate stage)")
    rows = _read_rows(path)
    if rows and set(COLUMNS) - set(rows[0]):
        raise UserError(f"{path}: missing columns {sorted(set(COLUMNS) - set(rows[0]))}")
    return rows


__all__ = ["RegenerateConfig", "run_regenerate", "mark_answers_reusable", "chat_prompt", "build_requests",
           "build_conversations", "Conversation", "conversation_positions", "turn_seed", "answer_batch",
           "given_rows", "eos_token_ids", "make_backend", "generate_split", "PartStore", "read_regen", "COLUMNS",
           "BACKEND_CHOICES"]
