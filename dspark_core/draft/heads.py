"""Heads on top of the draft backbone: the Markov heads (vanilla, gated, rnn) and the confidence head.

Shape legend: V vocab (the previous token's), Vo the bias's vocabulary (V unless the draft has its own), r Markov
rank, H draft hidden, S slots, ``...`` any leading shape ([B, A, S] in training, [B] at inference).

Markov head (the DSpark paper's sequential correction): ``m_i = W1[t_{i-1}]`` (rank r; ``t_0`` is the anchor),
the head type turns it into W2's input ``u_i`` and ``b_i = W2 u_i`` is added to the slot's LM-head logits:

- ``vanilla``: ``u_i = m_i``;
- ``gated``: ``u_i = sigmoid(W_g [h_i; m_i] + b_g) * m_i``;
- ``rnn``: a recurrent state over the block's slots, ``u_i = tanh(o_i)`` (``RNNMarkovHead``).

The types and their tensor names (``w1`` / ``w2`` / ``gate_proj`` / ``joint_proj``; DeepSpec and speculators
spell the first two ``markov_w1`` / ``markov_w2``) follow DeepSpec and vLLM's speculators. The training loss never
materialises ``b_i`` for all slots: it reads ``w2.weight`` inside its vocabulary chunks (``draft/loss.py``).

Confidence head: ``s_i = w^T [h_i; m_i] + b`` (or ``w^T h_i + b`` without the Markov features);
``sigmoid(s_i)`` estimates the overlap ``a_i`` of the slot.
"""

from __future__ import annotations

import torch
from torch import nn


class VanillaMarkovHead(nn.Module):
    """``features(prev) = W1[prev]`` [..., r]; ``bias(u) = W2 u`` [..., Vo]; the W2 input ``u_i = m_i``.

    ``vocab_size`` indexes the previous token (the target's vocabulary); ``out_vocab`` (default the same) is the
    vocabulary the bias is added onto (the draft's LM head rows)."""

    kind = "vanilla"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int = 0, out_vocab: int | None = None) -> None:
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)  # W1 [V, r]
        self.w2 = nn.Linear(rank, out_vocab or vocab_size, bias=False)  # W2 [Vo, r]

    @property
    def rank(self) -> int:
        return self.w1.embedding_dim

    def features(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.w1(prev_tokens)  # [..., r]

    def bias(self, u: torch.Tensor) -> torch.Tensor:
        return self.w2(u.to(self.w2.weight.dtype))  # [..., Vo]

    def step(self, m: torch.Tensor, hidden: torch.Tensor | None, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: m [B, r] (the previous token's features), h [B, H], the carried state -> (u [B, r], state)."""
        return m, state

    def block(self, m: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """All S slots of blocks at once (teacher forcing): m [..., S, r], h [..., S, H] -> u [..., S, r]."""
        return m


class GatedMarkovHead(VanillaMarkovHead):
    """``u_i = sigmoid(W_g [h_i; m_i] + b_g) * m_i``: the slot's state decides how much of the previous token's
    features reach W2 (DeepSpec's and speculators' ``gated`` head; ``gate_proj`` [r, H + r])."""

    kind = "gated"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, out_vocab: int | None = None) -> None:
        super().__init__(vocab_size, rank, hidden_size, out_vocab)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def _gated(self, m: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        w = self.gate_proj.weight
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(w.dtype), m.to(w.dtype)], dim=-1)))  # [..., r]
        return gate * m.to(w.dtype)

    def step(self, m, hidden, state):
        if hidden is None:
            raise ValueError("the gated Markov head reads the slot's draft state; got none")
        return self._gated(m, hidden), state

    def block(self, m, hidden):
        return self._gated(m, hidden)


class RNNMarkovHead(VanillaMarkovHead):
    """A gated recurrent state over the block's slots (DeepSpec's and speculators' ``rnn`` head): with
    ``z_i = [s_{i-1}; m_i; h_i]`` and ``[g; c; o] = W_j z_i + b_j`` (``joint_proj`` [3r, 2r + H]),
    ``s_i = sigmoid(g) * s_{i-1} + (1 - sigmoid(g)) * tanh(c)`` (``s_0 = 0``) and ``u_i = tanh(o)``; slot i so
    reads the whole prefix ``t_0 .. t_{i-1}``, not only the last token."""

    kind = "rnn"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, out_vocab: int | None = None) -> None:
        super().__init__(vocab_size, rank, hidden_size, out_vocab)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(self, m, hidden, state):
        if hidden is None:
            raise ValueError("the rnn Markov head reads the slot's draft state; got none")
        w = self.joint_proj.weight
        m = m.to(w.dtype)
        state = torch.zeros_like(m) if state is None else state  # [B, r]
        gate, cand, out = self.joint_proj(torch.cat([state, m, hidden.to(w.dtype)], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(cand)  # [B, r], [B, r]

    def block(self, m, hidden):
        state, outs = None, []
        for i in range(m.shape[-2]):
            u, state = self.step(m[..., i, :], hidden[..., i, :], state)
            outs.append(u)
        return torch.stack(outs, dim=-2)  # [..., S, r]


MARKOV_HEAD_CLASSES = {cls.kind: cls for cls in (VanillaMarkovHead, GatedMarkovHead, RNNMarkovHead)}


def build_markov_head(kind: str, vocab_size: int, rank: int, hidden_size: int,
                      out_vocab: int | None = None) -> VanillaMarkovHead | None:
    """The Markov head of ``draft.markov_head`` (None for ``none``)."""
    if kind == "none":
        return None
    return MARKOV_HEAD_CLASSES[kind](vocab_size, rank, hidden_size, out_vocab)


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


# dspark's Markov tensor names -> DeepSpec's / speculators' (``markov_head.<name>`` in their checkpoints)
PEER_MARKOV_NAMES = {"w1": "markov_w1", "w2": "markov_w2", "gate_proj": "gate_proj", "joint_proj": "joint_proj"}


def peer_markov_name(name: str, prefix: str = "markov.", peer_prefix: str = "markov_head.") -> str:
    """A draft state-dict key under ``prefix`` in the peers' layout (``markov.w1.weight`` ->
    ``markov_head.markov_w1.weight``); any other key is returned unchanged."""
    if not name.startswith(prefix):
        return name
    module, _, rest = name[len(prefix):].partition(".")
    if module not in PEER_MARKOV_NAMES:
        raise ValueError(f"{name}: no Markov tensor {module!r} in the peers' layout ({', '.join(PEER_MARKOV_NAMES)})")
    return f"{peer_prefix}{PEER_MARKOV_NAMES[module]}.{rest}"
