"""Token sampling and exact speculative verification.

- ``SamplingParams``: temperature / top-k / top-p (temperature 0 = greedy).
- ``logits_to_probs``: logits -> the processed distribution (temperature, then top-k, then top-p; the
  order of Hugging Face's warpers). Draft and target go through the same processing, so the engine's
  output distribution equals the processed target distribution.
- ``verify_greedy``: accept while the target's argmax equals the draft token; the bonus / correction is
  the target's argmax.
- ``verify_rejection``: exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept
  ``t_i`` with probability ``min(1, p_i(t_i) / q_i(t_i))`` left to right; on the first rejection sample
  from ``normalize(max(p_i - q_i, 0))``; when every token is accepted sample the bonus from ``p_n``.

Every random draw goes through a caller-owned ``torch.Generator``: a fixed seed gives fixed outputs.
One host sync per verification (``.tolist()`` of the accepted count and the next token).

Shape legend: n proposed tokens, V vocab, R rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspark_core.decoding.types import SampleFn, VerificationResult


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (top_k / top_p ignored); top_k 0 = off; top_p 1.0 = off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0; got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off); got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed distribution ``[..., V]`` float32 of ``logits [..., V]``; greedy gives the argmax one-hot."""
    logits = logits.float()
    if params.greedy:
        return one_hot_argmax(logits)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one); renormalise."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # [..., V]
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more likely tokens
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy 'distribution': a one-hot ``[..., V]`` float32 at the argmax (first index on ties)."""
    idx = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, 1.0)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs [R, V]`` -> ``[R]`` long."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def select_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Tokens ``[R]`` for ``logits [R, V]``: argmax when greedy, else a draw from the processed distribution."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample_from_probs(logits_to_probs(logits, params), generator)


def make_sample_fn(params: SamplingParams, generator: torch.Generator | None) -> SampleFn:
    """The draft's ``sample_fn(logits [B, V]) -> (token [B], probs [B, V])`` for these params."""

    def sample_fn(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = logits_to_probs(logits, params)  # [B, V]
        if params.greedy:
            return probs.argmax(dim=-1), probs
        return sample_from_probs(probs, generator), probs

    return sample_fn


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> VerificationResult:
    """Greedy verification of ``draft_tokens [n]`` against ``target_logits [n+1, V]`` (rows at anchor..t_n)."""
    n = _check_block(target_logits, draft_tokens)
    target_argmax = target_logits.argmax(dim=-1)  # [n+1]
    match = (target_argmax[:n] == draft_tokens).long()  # [n]
    num_accepted = match.cumprod(dim=0).sum()  # [] prefix of matches
    next_token = target_argmax.gather(0, num_accepted.view(1)).squeeze(0)
    return _result(n, num_accepted, next_token, draft_tokens)


def verify_rejection(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None,
) -> VerificationResult:
    """Exact rejection sampling of ``draft_tokens [n]`` drawn from ``draft_probs [n, V]`` (q) against
    ``target_probs [n+1, V]`` (p; row n is the bonus distribution). The committed tokens are distributed
    exactly as sequential draws from p."""
    n = _check_block(target_probs, draft_tokens)
    if draft_probs.shape != (n, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must have shape {(n, target_probs.shape[-1])}; got {tuple(draft_probs.shape)}")
    p = target_probs.float()
    q = draft_probs.float()
    idx = draft_tokens.view(n, 1)
    p_tok = p[:n].gather(1, idx).squeeze(1)  # [n]
    q_tok = q.gather(1, idx).squeeze(1)  # [n]
    u = torch.rand(n, generator=generator, device=p.device)  # [n]
    accept = (u * q_tok < p_tok).long()  # u < p/q without dividing by q
    num_accepted = accept.cumprod(dim=0).sum()  # []
    # Row `num_accepted` of p gives the next token; the residual applies only on a rejection (a < n).
    row = num_accepted.view(1)
    p_row = p.index_select(0, row).squeeze(0)  # [V]
    q_pad = torch.cat([q, torch.zeros_like(p[:1])], dim=0)  # [n+1, V]; zero row -> residual = p_n
    residual = torch.clamp(p_row - q_pad.index_select(0, row).squeeze(0), min=0.0)  # [V]
    mass = residual.sum()
    # p == q on the support gives zero mass (a rejection then has probability 0); fall back to p.
    dist = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_row)
    next_token = torch.multinomial(dist, 1, generator=generator).squeeze(0)
    return _result(n, num_accepted, next_token, draft_tokens)


def race_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [..., V]`` from ``uniform [..., V]`` U[0, 1) draws, with no host sync and a
    static shape (CUDA-graph safe): ``argmax(probs / E)`` with ``E = -log U`` ~ Exp(1) (the exponential race:
    token i wins with probability ``probs_i``)."""
    e = -torch.log(uniform.clamp_min(1e-30))  # [..., V] > 0
    return (probs / e).argmax(dim=-1)


def rejection_step(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                   num_proposed: torch.Tensor, u: torch.Tensor, race: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_rejection`` on the device, for the static engine's cycle: ``target_probs [S+1, V]`` (p),
    ``draft_probs [S, V]`` (q), ``draft_tokens [S]`` drawn from q, of which the first ``num_proposed`` ([] long,
    the confidence cut) count; ``u [S]`` and ``race [V]`` U[0, 1) draws. Returns the accepted prefix ``a`` []
    and the next token [] (:func:`rejection_rows` of one row)."""
    a, token = rejection_rows(target_probs[None], draft_probs[None], draft_tokens[None], num_proposed.view(1),
                              u[None], race[None])
    return a[0], token[0]


def rejection_rows(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                   num_proposed: torch.Tensor, u: torch.Tensor, race: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection sampling of R independent rows on the device: ``target_probs [R, S+1, V]`` (p),
    ``draft_probs [R, S, V]`` (q), ``draft_tokens [R, S]`` drawn from q, of which the first ``num_proposed [R]``
    count; ``u [R, S]`` and ``race [R, V]`` U[0, 1) draws. Returns the accepted prefixes ``a [R]`` and the next
    tokens [R]: from ``normalize(max(p_a - q_a, 0))`` after a rejection, from ``p_a`` when every counted slot was
    accepted (rows past the cut have no q). No host reads, static shapes."""
    rows, s, vocab = draft_probs.shape
    live = torch.arange(s, device=draft_tokens.device) < num_proposed.view(rows, 1)  # [R, S]
    p = target_probs.float()
    q = draft_probs.float() * live[..., None]  # [R, S, V]
    idx = draft_tokens.view(rows, s, 1)
    p_tok, q_tok = p[:, :s].gather(2, idx)[..., 0], q.gather(2, idx)[..., 0]  # [R, S]
    accepted = ((u * q_tok < p_tok) & live).long().cumprod(dim=1).sum(dim=1)  # [R]
    at = accepted.view(rows, 1, 1).expand(rows, 1, vocab)
    p_row = p.gather(1, at)[:, 0]  # [R, V]
    q_row = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1).gather(1, at)[:, 0]  # [R, V]; row S: no q
    residual = (p_row - q_row).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)  # [R, 1]
    dist = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_row)  # p == q: a rejection has prob. 0
    return accepted, race_sample(dist, race)


def _check_block(target: torch.Tensor, draft_tokens: torch.Tensor) -> int:
    if draft_tokens.dim() != 1 or target.dim() != 2 or target.shape[0] != draft_tokens.shape[0] + 1:
        raise ValueError(
            f"expected draft_tokens [n] and target rows [n+1, V]; got {tuple(draft_tokens.shape)} "
            f"and {tuple(target.shape)}"
        )
    return int(draft_tokens.shape[0])


def _result(n: int, num_accepted: torch.Tensor, next_token: torch.Tensor, draft_tokens: torch.Tensor
            ) -> VerificationResult:
    """Build the result with a single device -> host transfer."""
    host = torch.cat([num_accepted.view(1), next_token.view(1), draft_tokens.long()]).tolist()
    a, nxt = host[0], host[1]
    return VerificationResult(num_proposed=n, num_accepted=a, next_token=nxt, committed=tuple(host[2 : 2 + a]) + (nxt,))
