"""A test double that obeys the draft <-> engine contract (docs/DESIGN.md) without being a DSpark draft.

``FakeDraft`` proposes with any HF causal LM (the target itself, or another random model), so tests
can dial the proposal quality: ``mode="model"`` (the model's own logits, plus optional Gaussian noise),
``mode="wrong"`` (the model's argmax is forbidden: with the target as the model every greedy proposal
is rejected). The target's greedy continuation is ``FakeDraft(target, mode="model")``.

It only sees what the contract gives a draft: the aux hidden of committed positions (via
``extend_context``) and the anchor token. It needs layer ``-1`` (the embedding output) among the aux
layers and recovers each position's token from it by nearest embedding row, so a context extended
with a wrong position (a rejected token) really changes its proposals.

Shape legend: B batch (1), n positions, K aux layers, H hidden, V vocab, S block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FakeDraftProposal:
    tokens: torch.Tensor  # [B, n]
    probs: torch.Tensor  # [B, n, V]
    confidence: torch.Tensor  # [B, S]
    num_tokens: int


@dataclass
class FakeContextCache:
    max_len: int
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be in [0, {self.length}]; got {length}")
        del self.tokens[length:]


class FakeDraft:
    def __init__(self, model: torch.nn.Module, *, embed_weight: torch.Tensor, embed_aux_index: int,
                 block_size: int, mode: str = "model", noise: float = 0.0, seed: int = 0,
                 confidence: str = "max_prob") -> None:
        if mode not in ("model", "wrong"):
            raise ValueError(f"mode must be 'model' or 'wrong'; got {mode!r}")
        self.model = model.eval()
        self.embed_weight = embed_weight.detach()  # [V, H] of the target
        self.embed_aux_index = embed_aux_index
        self.block_size = block_size
        self.mode = mode
        self.noise = noise
        self.confidence = confidence
        self.gen = torch.Generator().manual_seed(seed)
        self.cache: FakeContextCache | None = None  # the latest cache, for tests to inspect

    def new_context_cache(self, batch: int, max_len: int, device=None, dtype=None) -> FakeContextCache:
        if batch != 1:
            raise ValueError("FakeDraft supports batch 1")
        self.cache = FakeContextCache(max_len=max_len)
        return self.cache

    @torch.no_grad()
    def extend_context(self, cache: FakeContextCache, aux_hidden: torch.Tensor) -> None:
        emb = aux_hidden[0, :, self.embed_aux_index].float()  # [n, H]
        dist = torch.cdist(emb, self.embed_weight.float().to(emb.device))  # [n, V]
        cache.tokens.extend(dist.argmin(dim=-1).tolist())
        if cache.length > cache.max_len:
            raise ValueError(f"context {cache.length} exceeds max_len {cache.max_len}")

    @torch.no_grad()
    def propose(self, cache: FakeContextCache, anchor_token: torch.Tensor, sample_fn, confidence_threshold=0.0):
        ids = torch.tensor([cache.tokens + anchor_token.view(-1).tolist()], dtype=torch.long)  # [1, p+1]
        out = self.model(ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]  # [1, V]
        tokens, probs, conf = [], [], []
        for slot in range(self.block_size):
            logits = self._distort(logits.float())
            tok, prob = sample_fn(logits)  # [1], [1, V]
            tokens.append(tok.view(1))
            probs.append(prob)
            conf.append(torch.softmax(logits, -1).max(-1).values if self.confidence == "max_prob"
                        else torch.rand(1, generator=self.gen))
            if slot + 1 < self.block_size:
                out = self.model(tok.view(1, 1), past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[:, -1]
        confidence = torch.stack(conf, dim=1)  # [1, S]
        below = (confidence[0] < confidence_threshold).nonzero()
        n = int(below[0, 0]) if below.numel() else self.block_size
        return FakeDraftProposal(tokens=torch.stack(tokens, dim=1)[:, :n], probs=torch.stack(probs, dim=1)[:, :n],
                                 confidence=confidence, num_tokens=n)

    def _distort(self, logits: torch.Tensor) -> torch.Tensor:
        if self.noise > 0:
            logits = logits + self.noise * torch.randn(logits.shape, generator=self.gen)
        if self.mode == "wrong":
            logits = logits.scatter(-1, logits.argmax(-1, keepdim=True), float("-inf"))
        return logits

