"""Pieces shared by the speculative engine and the AR baseline, so both run the same code path.

Shape legend: B batch (1), P prompt tokens, V vocab, K aux layers, H target hidden.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from dspark_core.decoding.sampling import SamplingParams, select_tokens
from dspark_core.decoding.target_runner import TargetRunner


def prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The prompt as ``[1, P]`` long on ``device``; ValueError when empty or not 1-D / [1, P]."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D token list (batch size 1); got shape {tuple(ids.shape)}")
    return ids.to(device).unsqueeze(0)


class BudgetError(ValueError):
    """A generation that does not fit the target cache (``max_len``); callers that know the param re-raise it
    naming that param and the prompt."""

    def __init__(self, msg: str, *, prompt_len: int, need: int, max_len: int) -> None:
        super().__init__(msg)
        self.prompt_len, self.need, self.max_len = prompt_len, need, max_len


def check_budget(target: TargetRunner, prompt_len: int, max_new_tokens: int, lookahead: int) -> None:
    """The static cache must hold the prompt, the new tokens and one verification block beyond them."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    need = prompt_len + max_new_tokens + lookahead
    if need > target.max_len:
        raise BudgetError(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + {lookahead} lookahead = "
                          f"{need} positions exceed the target cache's max_len={target.max_len}",
                          prompt_len=prompt_len, need=need, max_len=target.max_len)


def prefill_first_token(target: TargetRunner, prompt: torch.Tensor, params: SamplingParams,
                        generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill the prompt ``[1, P]``; returns the first new token ``[1]`` (from the last prompt logits,
    with the same sampling rule as every later token) and the prompt's aux hidden ``[1, P, K, H]``."""
    logits, aux = target.prefill(prompt, last_logits_only=True)  # [1, 1, V], [1, P, K, H]
    return select_tokens(logits[:, -1], params, generator), aux


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


class Clock:
    """Wall clock that first waits for the device's queued work (torch.cuda.synchronize on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def synced_clock(device: torch.device):
    """A ``perf_counter`` that first waits for ``device`` (CUDA work is asynchronous)."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now
