"""Heads on top of the draft backbone: the vanilla Markov head and the confidence head.

Shape legend: V vocab, r Markov rank, H draft hidden, ``...`` any leading shape ([B, A, S] in training,
[B] at inference).

Markov head (seed 000, "Markov 顺序修正"): ``m_i = W1[t_{i-1}]`` (rank r), ``b_i = W2 m_i`` added to the
slot's LM-head logits; ``t_0`` is the anchor. The training loss never materialises ``b_i`` for all
slots: it reads ``w2.weight`` inside its vocabulary chunks (``draft/loss.py``).

Confidence head: ``s_i = w^T [h_i; m_i] + b`` (or ``w^T h_i + b`` without the Markov features);
``sigmoid(s_i)`` estimates the overlap ``a_i`` of the slot.
"""

from __future__ import annotations

import torch
from torch import nn


class VanillaMarkovHead(nn.Module):
    """``features(prev) = W1[prev]`` [..., r]; ``bias(m) = W2 m`` [..., Vd]. W1 reads any target token (the
    anchor is one); W2 writes the draft's vocabulary: ``out_size`` Vd rows (a reduced draft vocabulary), else V."""

    def __init__(self, vocab_size: int, rank: int, out_size: int | None = None) -> None:
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)  # W1 [V, r]
        self.w2 = nn.Linear(rank, out_size or vocab_size, bias=False)  # W2 [Vd, r]

    @property
    def rank(self) -> int:
        return self.w1.embedding_dim

    def features(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.w1(prev_tokens)  # [..., r]

    def bias(self, m: torch.Tensor) -> torch.Tensor:
        return self.w2(m.to(self.w2.weight.dtype))  # [..., Vd]


class ConfidenceHead(nn.Module):
    """Logit of the predicted overlap of a slot from ``[h; m]`` (or ``h``)."""

    def __init__(self, hidden_size: int, markov_rank: int = 0) -> None:
        super().__init__()
        self.with_markov = markov_rank > 0
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, hidden: torch.Tensor, markov: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., H], markov [..., r] (or None when built without it) -> logits [...] (float32)."""
        feats = hidden
        if self.with_markov:
            if markov is None:
                raise ValueError("this confidence head reads the Markov features; got none")
            feats = torch.cat([hidden, markov.to(hidden.dtype)], dim=-1)  # [..., H + r]
        return self.proj(feats).squeeze(-1).float()
