"""Inference half of the draft <-> engine contract (docs/DESIGN.md): context cache, extend, propose.

Shape legend: B batch, n positions, K aux layers, Ht target hidden, H draft hidden, V vocab, S slots,
nl draft layers, nkv KV heads, d head dim, T cache capacity (max_len).

The cache holds, per draft layer, the K/V of the projected context ``c_j`` (k_proj (+ k_norm) and RoPE
at the context positions already applied, v_proj), in static buffers [nl, B, nkv, T, d] with a length
pointer. ``extend_context`` appends positions ``length .. length+n-1``; ``truncate`` rolls back;
``propose`` runs one block ``[anchor, MASK x (S-1)]`` at positions ``length .. length+S-1`` against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

class BlockDraft(Protocol):
    """What this module needs of a draft (``DSparkDraft`` implements it; this module never imports the model, the
    model imports this module): its layers and heads, and one block forward against a ``ContextCache``."""

    layers: Any
    fc: Any
    rope: Any
    block_size: int
    compute_dtype: torch.dtype

    def context_features(self, aux_hidden: torch.Tensor) -> torch.Tensor: ...
    def forward_block(self, cache: "ContextCache", anchor_token: torch.Tensor, **kwargs: Any) -> Any: ...
    def slot_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def markov_features(self, *args: Any, **kwargs: Any) -> Any: ...
    def markov_bias(self, *args: Any, **kwargs: Any) -> Any: ...
    def markov_step(self, *args: Any, **kwargs: Any) -> Any: ...
    def confidence_logits(self, *args: Any, **kwargs: Any) -> Any: ...
    def score_candidates(self, *args: Any, **kwargs: Any) -> Any: ...


SampleFn = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class DraftProposal:
    """One block's proposal. ``tokens [B, n]``, ``probs [B, n, V]`` (q of each token, for rejection
    sampling), ``confidence [B, S]`` (sigmoid of the confidence head; ones without one), ``num_tokens`` n.
    ``hidden [B, S, H]``: the block's final draft states (what a Draft Memory variant carries over)."""

    tokens: torch.Tensor
    probs: torch.Tensor
    confidence: torch.Tensor
    num_tokens: int
    hidden: torch.Tensor | None = None


@dataclass
class ContextCache:
    """Per-layer K/V of the projected context, ``k, v [nl, B, nkv, T, d]``; positions ``0 .. length-1`` are live."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` positions (0 <= length <= current length)."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be an integer in [0, {self.length}]; got {length!r}")
        self.length = length

    def layer_kv(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The live K/V of one layer: [B, nkv, length, d] each."""
        n = self.length
        return self.k[layer, :, :, :n].to(dtype), self.v[layer, :, :, :n].to(dtype)


def new_context_cache(draft: BlockDraft, batch: int, max_len: int, device: Any = None,
                      dtype: torch.dtype | None = None) -> ContextCache:
    if batch < 1 or max_len < 1:
        raise ValueError(f"new_context_cache: batch and max_len must be >= 1; got batch={batch}, max_len={max_len}")
    attn = draft.layers[0].self_attn
    device = device if device is not None else draft.fc.weight.device
    dtype = dtype or draft.compute_dtype
    shape = (len(draft.layers), batch, attn.num_kv_heads, max_len, attn.head_dim)
    return ContextCache(k=torch.zeros(shape, device=device, dtype=dtype),
                        v=torch.zeros(shape, device=device, dtype=dtype))


@torch.no_grad()
def extend_context(draft: BlockDraft, cache: ContextCache, aux_hidden: torch.Tensor) -> None:
    """Append the aux hidden of positions ``cache.length .. +n`` (aux_hidden [B, n, K, Ht])."""
    batch, n = aux_hidden.shape[:2]
    if batch != cache.batch:
        raise ValueError(f"extend_context: aux_hidden has batch {batch}, the cache {cache.batch}")
    start = cache.length
    if start + n > cache.max_len:
        raise ValueError(f"extend_context: {start} + {n} positions exceed the cache's max_len {cache.max_len}")
    if n == 0:
        return
    c = draft.context_features(aux_hidden.to(cache.k.device))  # [B, n, H]
    pos = torch.arange(start, start + n, device=c.device).expand(batch, n)  # [B, n]
    rope = draft.rope(c, pos)
    for i, layer in enumerate(draft.layers):
        k, v = layer.self_attn.project_kv(c, rope)  # [B, nkv, n, d]
        cache.k[i, :, :, start:start + n] = k.to(cache.k.dtype)
        cache.v[i, :, :, start:start + n] = v.to(cache.v.dtype)
    cache.length = start + n


def _confident_prefix(confidence: torch.Tensor, threshold: float) -> int:
    """Slots before the first one whose confidence is below ``threshold`` (min over the batch)."""
    slots = confidence.shape[1]
    if threshold <= 0.0:
        return slots
    below = confidence < threshold  # [B, S]
    idx = torch.arange(slots, device=confidence.device).expand_as(below)
    first = torch.where(below, idx, torch.full_like(idx, slots)).min(dim=1).values  # [B]
    return int(first.min())


@torch.no_grad()
def propose(draft: BlockDraft, cache: ContextCache, anchor_token: torch.Tensor, sample_fn: SampleFn,
            confidence_threshold: float = 0.0, extras: Mapping[str, Any] | None = None) -> DraftProposal:
    """One block at anchor position ``cache.length``; tokens chosen slot by slot by ``sample_fn``
    (:func:`choose_tokens`). The proposal is cut before the first slot whose confidence is below
    ``confidence_threshold`` (0 keeps all S slots; with B > 1 the earliest cut over the batch).
    """
    if not 0.0 <= confidence_threshold <= 1.0:
        raise ValueError(f"confidence_threshold must be in [0, 1]; got {confidence_threshold!r}")
    anchor_token = anchor_token.reshape(-1).to(cache.k.device)  # [B]
    hidden = draft.forward_block(cache, anchor_token, extras)  # [B, S, H]
    tokens, probs, confidence = choose_tokens(draft, hidden, anchor_token, sample_fn, extras)
    n = _confident_prefix(confidence, confidence_threshold)
    return DraftProposal(tokens=tokens[:, :n], probs=probs[:, :n], confidence=confidence, num_tokens=n,
                         hidden=hidden)


def choose_tokens(draft: BlockDraft, hidden: torch.Tensor, anchor_token: torch.Tensor, sample_fn: SampleFn,
                  extras: Mapping[str, Any] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The block's tokens from its final states ``hidden [B, S, H]`` after ``anchor_token [B]``, slot by slot:
    ``logits = lm_head(h_i) + W2 u_i`` (u_i from ``markov_step`` on ``m_i = markov_features(t_{i-1})``; ``t_0`` =
    the anchor, later the chosen tokens), then the candidate-scoring hook, then ``sample_fn(logits [B, V]) ->
    (token [B], probs [B, V] | None)``. -> tokens [B, S], probs [B, S, V] (None when sample_fn gives none: a
    greedy pick), confidence [B, S] (sigmoid of the confidence head; ones without one)."""
    base = draft.slot_logits(hidden)  # [B, S, V] float32
    prev, prefix = anchor_token, anchor_token.unsqueeze(1)  # [B], [B, 1]
    tokens, probs, conf, state = [], [], [], None
    for i in range(draft.block_size):
        slot_extras = {**(extras or {}), "block_prefix": prefix}  # a variant's per-slot lookups read the prefix
        m = draft.markov_features(prev, hidden[:, i], slot_extras)  # [B, r] | None
        if m is None:
            logits = base[:, i]  # [B, V]
        else:
            u, state = draft.markov_step(m, hidden[:, i], state)  # [B, r]; the rnn head's state carried on
            logits = base[:, i] + draft.markov_bias(u).float()  # [B, V]
        logits = draft.score_candidates(logits, hidden[:, i], prefix, i, slot_extras)
        c = draft.confidence_logits(hidden[:, i], m)  # [B] | None
        tok, prob = sample_fn(logits)
        tok = tok.reshape(-1).to(anchor_token.device)
        tokens.append(tok)
        probs.append(prob)
        conf.append(torch.sigmoid(c) if c is not None else torch.ones_like(logits[:, 0]))
        prev, prefix = tok, torch.cat([prefix, tok.unsqueeze(1)], dim=1)
    stacked = None if probs[0] is None else torch.stack(probs, dim=1)  # [B, S, V]
    return torch.stack(tokens, dim=1), stacked, torch.stack(conf, dim=1)
