"""Data types of the online speculative decoding engine.

``DraftProposal`` belongs to the draft (``dspark_core.draft``); the engine only reads the fields named
in the draft <-> engine contract (docs/DESIGN.md), described here by the ``Proposal`` / ``Draft``
protocols so any draft (the DSpark draft, a test double) can be plugged in.

Shape legend: B batch (1 in the engine), n proposed tokens (0..S), S block size, V vocab,
K aux layers, H target hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

# sample_fn(logits [B, V]) -> (token [B] long, probs [B, V] float32): how the draft picks a slot's token.
SampleFn = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


class ContextCache(Protocol):
    """The draft's cached projected context (positions 0 .. length-1)."""

    length: int

    def truncate(self, length: int) -> None: ...


class Proposal(Protocol):
    """What the engine reads from a ``DraftProposal``."""

    tokens: torch.Tensor  # [B, n] long
    probs: torch.Tensor  # [B, n, V] q, the distributions the tokens were drawn from
    num_tokens: int  # n


class Draft(Protocol):
    """The inference half of the draft <-> engine contract (docs/DESIGN.md)."""

    def new_context_cache(self, batch: int, max_len: int, device: Any, dtype: torch.dtype) -> ContextCache: ...

    def extend_context(self, cache: ContextCache, aux_hidden: torch.Tensor) -> None: ...  # [B, n, K, H]

    def propose(
        self, cache: ContextCache, anchor_token: torch.Tensor, sample_fn: SampleFn, confidence_threshold: float = 0.0
    ) -> Proposal: ...


@dataclass(frozen=True)
class VerificationResult:
    """Outcome of verifying one proposal of ``num_proposed`` tokens.

    ``num_accepted`` draft tokens were accepted (a prefix); ``next_token`` is the target's bonus token
    (all accepted) or its corrected token (first rejection). ``committed`` = accepted tokens + next_token.
    """

    num_proposed: int
    num_accepted: int
    next_token: int
    committed: tuple[int, ...]

    @property
    def all_accepted(self) -> bool:
        return self.num_accepted == self.num_proposed


@dataclass(frozen=True)
class CycleInfo:
    """State after one propose -> verify -> update cycle, handed to the engine's ``on_cycle`` hook."""

    cycle: int
    anchor_position: int  # position of the anchor this cycle verified from
    num_proposed: int
    num_accepted: int
    committed: tuple[int, ...]  # accepted draft tokens + bonus/corrected token
    target_length: int  # target KV length after the rollback
    draft_context_length: int  # draft context length after the update
    next_anchor_position: int  # position of the new anchor (= both lengths when consistent)


@dataclass
class GenerationResult:
    """Tokens generated for one prompt and the per-cycle record.

    ``tokens`` excludes the prompt and is cut exactly after the first stop token (included, as HF's
    ``generate`` does) or at ``max_new_tokens``. The first token comes from the prefill logits; every
    later token from a cycle (speculative: accepted + 1 per cycle; AR: 1 per cycle).
    """

    tokens: list[int]
    cycles: int = 0
    accepted_per_cycle: list[int] = field(default_factory=list)  # accepted draft tokens per cycle (no bonus)
    proposal_lengths: list[int] = field(default_factory=list)  # tokens proposed per cycle
    draft_s: list[float] = field(default_factory=list)  # draft time per cycle
    verify_s: list[float] = field(default_factory=list)  # verification (+ commit) time per cycle
    prefill_s: float = 0.0
    decode_s: float = 0.0  # wall time after the prefill (every cycle, all overheads)
    stop_reason: str = "length"  # "stop" (a stop token) or "length" (max_new_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """MAL: mean tokens committed per cycle, bonus included (1.0 for AR)."""
        if not self.accepted_per_cycle:
            return 0.0
        return sum(a + 1 for a in self.accepted_per_cycle) / len(self.accepted_per_cycle)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by the cycles (all but the prefill's first token) per second of decoding."""
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0


def cut_at_stop(tokens: Sequence[int], stop_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """``tokens`` cut after the first stop token (kept) and to ``max_new_tokens``; also whether a stop was hit."""
    stops = set(stop_ids)
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stops:
            return list(tokens[: i + 1]), True
    return list(tokens[:max_new_tokens]), False
