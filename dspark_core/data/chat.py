"""A conversation through the target's chat template: its render, and where each assistant turn lies in it.

The loss of a multi-turn sample goes on the assistant turns. Where they are in the token sequence is found with
the chat template itself, for any model family, never with a parser that knows a family's markers:

1. render the conversation (text ``T``);
2. for each assistant message, render it again with that message's content replaced by a sentinel (a few
   Unicode private-use characters that occur nowhere in ``T``). The two renders differ in one region only: in
   ``T`` that region is the template's rendering of the message's content, whatever the template did to it (a
   Qwen3-style template drops the ``<think>`` block of an answer before the last user turn; a template may strip
   whitespace). The sentinel must appear exactly once in the second render, and the regions must follow each
   other in order; otherwise the template is refused (one line naming it);
3. where the render of the messages before that answer with the generation prompt is a prefix of ``T`` ending
   before the region, the region starts there instead: everything after the generation prompt is what the
   target says (a Qwen3-style template renders the last answer's ``<think>`` block after its header);
4. characters to tokens through the fast tokenizer's offsets: a span is every token that overlaps the region,
   plus the token right after it when that is one of the target's EOS ids (the template's end-of-turn token,
   which the draft must learn to propose).

Spans are token ``[start, end)`` pairs over the ids of ``T`` (``tok(T, add_special_tokens=False)``, the ids the
regenerate stage feeds the target).

A row of several answers also keeps each answer's own sample -- the conversation rendered up to that answer, which a
Qwen3-style template renders with the answer's thinking -- compactly, against the row's sample
(:func:`turn_columns`: the ``turn_*`` columns of the regenerate parquet, read by ``dspark_core.cache.source``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dspark_core.errors import UserError

PRIVATE_USE = 0xE000  # the first code point of the Basic Multilingual Plane's private-use area
SENTINEL_CHARS = 3
# answer k's own sample: the row's first turn_prefix[k] tokens, then turn_tails[k]; the answer at
# [turn_span_starts[k], turn_span_ends[k]) of it. Null in a row of one answer (its sample is the row's).
TURN_COLUMNS = ("turn_prefix", "turn_tails", "turn_span_starts", "turn_span_ends")


def render(tok, messages: Sequence[dict], *, add_generation_prompt: bool, enable_thinking: bool | None = None) -> str:
    """The chat template's text of ``messages``; ``enable_thinking`` reaches the template when not None (Qwen3's
    flag: ``false`` renders an empty think block after the generation prompt)."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False,
                                   **kwargs)


def has_thinking_switch(tok) -> bool:
    """Whether the chat template reads ``enable_thinking``: a user turn with the generation prompt renders
    differently with true and false (Qwen3's template; SmolLM2's and most others' ignore it)."""
    turn = [{"role": "user", "content": "Hi"}]
    return (render(tok, turn, add_generation_prompt=True, enable_thinking=True)
            != render(tok, turn, add_generation_prompt=True, enable_thinking=False))


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation: its text, its token ids and each assistant message's token span."""

    text: str
    ids: list[int]
    spans: list[tuple[int, int]]   # [start, end) token positions in ``ids``, one per assistant message, in order
    char_spans: list[tuple[int, int]]   # the same regions in ``text`` (without the EOS token)


def _sentinel(text: str, messages: Sequence[dict]) -> str:
    """``SENTINEL_CHARS`` private-use characters that occur neither in ``text`` nor in any message."""
    used = set(text).union(*(set(str(m.get("content") or "")) for m in messages))
    chars = [chr(c) for c in range(PRIVATE_USE, PRIVATE_USE + 6400) if chr(c) not in used][:SENTINEL_CHARS]
    return "".join(chars)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix(a: str, b: str, limit: int) -> int:
    i = 0
    while i < limit and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


def assistant_regions(tok, messages: Sequence[dict], *, add_generation_prompt: bool,
                      enable_thinking: bool | None = None, where: str = "chat template", last_only: bool = False
                      ) -> tuple[str, list[tuple[int, int]]]:
    """``(T, [(start, end) character region of each assistant message in T])`` (see the module docstring);
    ``last_only``: the last assistant message's only."""
    opts = dict(enable_thinking=enable_thinking)
    text = render(tok, messages, add_generation_prompt=add_generation_prompt, **opts)
    sentinel = _sentinel(text, messages)
    regions: list[tuple[int, int]] = []
    last = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for j, m in enumerate(messages):
        if m["role"] != "assistant" or (last_only and j != last):
            continue
        probe = [dict(x, content=sentinel) if i == j else x for i, x in enumerate(messages)]
        other = render(tok, probe, add_generation_prompt=add_generation_prompt, **opts)
        start = _common_prefix(text, other)
        end = len(text) - _common_suffix(text, other, min(len(text), len(other)) - start)
        inside = other[start:len(other) - (len(text) - end)]
        prev = regions[-1][1] if regions else 0
        if other.count(sentinel) != 1 or sentinel not in inside or start < prev:
            raise UserError(f"{where}: the chat template does not render assistant message {j} once, in place; "
                            "the answers' loss spans cannot be found from it (use a template that renders every "
                            "assistant message's content once, in order)")
        header = render(tok, messages[:j], add_generation_prompt=True, **opts)
        if text.startswith(header) and prev <= len(header) <= start:
            start = len(header)
        regions.append((start, end))
    return text, regions


def token_spans(offsets: Sequence[tuple[int, int]], ids: Sequence[int], regions: Sequence[tuple[int, int]],
                eos_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Character regions -> token spans: the tokens overlapping a region (an empty region: none, at the token
    that starts there), then the next token too when it is an EOS id."""
    eos, n = set(int(e) for e in eos_ids), len(ids)
    spans = []
    for cs, ce in regions:
        inside = [i for i, (a, b) in enumerate(offsets) if a < ce and b > cs]
        if inside:
            s, e = inside[0], inside[-1] + 1
        else:
            s = e = next((i for i, (a, _) in enumerate(offsets) if a >= cs), n)
        if e < n and int(ids[e]) in eos:
            e += 1
        spans.append((s, e))
    return spans


def render_with_spans(tok, messages: Sequence[dict], eos_ids: Sequence[int], *, add_generation_prompt: bool,
                      enable_thinking: bool | None = None, where: str = "chat template",
                      last_only: bool = False) -> Rendered:
    """Render ``messages`` and find every assistant message's token span (a fast tokenizer's offsets;
    ``last_only``: the last assistant message's only)."""
    if not getattr(tok, "is_fast", False):
        raise UserError(f"{where}: the target's tokenizer is not a fast tokenizer (tokenizer.json): the answers' "
                        "loss spans need its character offsets")
    text, regions = assistant_regions(tok, messages, add_generation_prompt=add_generation_prompt,
                                      enable_thinking=enable_thinking, where=where, last_only=last_only)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(t) for t in enc["input_ids"]]
    return Rendered(text, ids, token_spans(enc["offset_mapping"], ids, regions, eos_ids), regions)


def turn_columns(sample: Sequence[int], turns: Sequence[tuple[Sequence[int], tuple[int, int]]]) -> dict:
    """The ``turn_*`` columns of a row whose sample is ``sample``: each answer's own sample ``(ids, answer span)``
    as the tokens it shares with ``sample`` from the start and the rest (a template that renders history as the
    answers were: the rest is the answer alone); all null for one answer."""
    if len(turns) < 2:
        return dict.fromkeys(TURN_COLUMNS)
    row = np.asarray(sample, dtype=np.int64)  # [L]
    prefix, tails = [], []
    for ids, _ in turns:
        ids = np.asarray(ids, dtype=np.int64)  # [L_k]
        n = min(ids.size, row.size)
        differ = np.flatnonzero(ids[:n] != row[:n])
        p = int(differ[0]) if differ.size else n
        prefix.append(p)
        tails.append(ids[p:].tolist())
    return {"turn_prefix": prefix, "turn_tails": tails, "turn_span_starts": [int(s) for _, (s, _) in turns],
            "turn_span_ends": [int(e) for _, (_, e) in turns]}


__all__ = ["render", "has_thinking_switch", "Rendered", "assistant_regions", "token_spans", "render_with_spans",
           "turn_columns", "TURN_COLUMNS"]
