"""What every regenerate backend takes and returns.

A backend answers a list of :class:`Request` (chat-templated prompt token ids) with one
:class:`Generation` each. It may return raw ids; :func:`finalize_response` then applies the one
rule shared by all backends: a response that stopped ends with an EOS id ('stop'), otherwise it
is cut at ``max_new_tokens`` ('length').
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """Sampling params shared by all backends. ``temperature == 0`` is greedy; ``top_k == 0`` is off."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: tuple[int, ...]
    prompt_text: str
    seed: int  # per-request sampling seed (derived from params seed and id)


@dataclasses.dataclass(frozen=True)
class Generation:
    response_ids: list[int]
    finish_reason: str  # as reported by the backend; normalised by finalize_response


class Backend(Protocol):
    name: str

    def generate(self, requests: Sequence[Request]) -> list[Generation]: ...

    def close(self) -> None: ...


def request_seed(seed: int, request_id: str) -> int:
    """A stable 31-bit seed per (params seed, prompt id): resumed runs sample the same way."""
    return int(hashlib.sha256(f"{seed}:{request_id}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def finalize_response(ids: Sequence[int], reported: str, eos_ids: Sequence[int],
                      max_new_tokens: int) -> tuple[list[int], str]:
    """``(response_ids, finish_reason)``: cut after the first EOS ('stop') or at ``max_new_tokens``
    ('length'); a backend that reports 'stop' without emitting an EOS id gets ``eos_ids[0]`` appended."""
    eos = set(eos_ids)
    head = list(ids[:max_new_tokens])
    for i, t in enumerate(head):
        if t in eos:
            return head[: i + 1], "stop"
    if len(ids) >= max_new_tokens:
        return head, "length"
    if reported == "stop":
        return head + [eos_ids[0]], "stop"
    return head, reported
