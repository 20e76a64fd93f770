"""The prefix reranker of the DSpark variants: Markov top-K candidates rescored from the block's chosen prefix.

Shape legend: B batch, A anchors, S slots (block_size), N valid slots, n slots of a chunk, K candidates (top_k),
T prefix positions, w reranker width, nh reranker heads, d = w / nh, H draft hidden, Ht target hidden,
r Markov rank, V vocab.

Slot i (t_0 the anchor, t_j the tokens before it in the block: the reference tokens in training, the chosen
ones at inference):

- DSpark scores ``l_i = lm_head(h_i) + E_in(t_{i-1})^T E_out`` (the vanilla Markov head: E_in = W1, E_out = W2,
  shared) and candidates ``C_i = top-K(l_i)`` (the DSpark argmax always in it);
- prefix encoder over ``[t_0 .. t_{i-1}]``: ``E_in`` lookup, linear r -> w, learned in-block position embedding,
  one pre-norm causal Transformer layer (nh heads, FFN w -> ffn -> w, SiLU), LayerNorm out -> ``r_i [w]``;
- ``s_i(v) = l_i(v) + u_i^T k_v / sqrt(w)`` on ``C_i`` (-inf elsewhere), ``u_i = W_o SiLU(W_q [W_h h_i; r_i] +
  beta_q)``, ``k_v = W_c E_out(v)``; W_o zero-initialised, and a tie at the top keeps the DSpark argmax, so the
  initial greedy choices are the baseline's;
- q of the slot (what ``sample_fn`` sees): the softmax of ``s_i`` over ``C_i``, zero elsewhere -- a valid
  proposal for exact rejection sampling, and the distribution of the reranked ``tau_prob``.

Precision: ``l_i`` (hence ``C_i``) and the teacher logits are :func:`lm_logits` everywhere -- operands as the LM head
(and W2) store them, float32 accumulation and result, autocast off -- so ``prepare_batch`` under the trainer's bf16
autocast, eval_offline and decoding pick candidates and the teacher argmax in one precision.

Training (``RerankerTask``): ``prepare_batch`` (hook 5, no_grad) fixes each valid slot's candidates, the teacher
argmax ``v*`` and the teacher's probabilities on the candidates; the rank loss is the weighted CE of ``v*`` inside
``C_i`` on the slots where ``v*`` is a candidate, weights ``exp(-j/gamma)`` (slot j = 0 first), divided by their
sum over the global batch (the ``rank_weight`` denominator; zero when nothing hits). Online: the prefix
encoder's K/V grows slot by slot inside a block and is cleared at slot 0 of every block.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dspark_core.draft.config import DraftConfig, RerankerConfig
from dspark_core.draft.loss import dspark_sums, mm_f32, slot_weights
from dspark_core.draft.model import DSparkDraft
from dspark_core.draft.task import DSparkTask, DSparkTrainModel, draft_denominators
from dspark_core.metrics import tau_prob_per_block
from dspark_core.train.task import TermSpec

KV = tuple[torch.Tensor, torch.Tensor]  # k, v [B, nh, T, d]
RANK_KEYS = ("rank_candidates", "rank_target", "rank_teacher_p", "rank_hit", "rank_overlap_before")


class PrefixEncoder(nn.Module):
    """``E_in``-embedded prefix tokens [..., T, r] -> r_i [..., T, w] (causal; ``kv`` continues a cached prefix)."""

    def __init__(self, rank: int, cfg: RerankerConfig, slots: int) -> None:
        super().__init__()
        w, self.heads = cfg.width, cfg.num_heads
        self.in_proj = nn.Linear(rank, w, bias=False)
        self.pos = nn.Embedding(slots, w)  # learned in-block positions
        self.attn_norm = nn.LayerNorm(w, eps=cfg.norm_eps)
        self.qkv = nn.Linear(w, 3 * w)
        self.attn_out = nn.Linear(w, w)
        self.ffn_norm = nn.LayerNorm(w, eps=cfg.norm_eps)
        self.ffn_in = nn.Linear(w, cfg.ffn_size)
        self.ffn_out = nn.Linear(cfg.ffn_size, w)
        self.out_norm = nn.LayerNorm(w, eps=cfg.norm_eps)

    def forward(self, emb: torch.Tensor, start: int = 0, kv: KV | None = None) -> tuple[torch.Tensor, KV]:
        """emb [B, T, r] at in-block positions ``start .. start+T-1``; ``kv`` the K/V of positions < start."""
        batch, length = emb.shape[:2]
        if kv is not None and length > 1:
            raise ValueError("PrefixEncoder: continue a cached prefix one token at a time")
        pos = torch.arange(start, start + length, device=emb.device)
        x = self.in_proj(emb) + self.pos(pos)  # [B, T, w]
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if kv is not None:  # [B, nh, T, d] each
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=kv is None and length > 1)  # [B, nh, T, d]
        x = x + self.attn_out(att.transpose(1, 2).reshape(batch, length, -1))
        x = x + self.ffn_out(F.silu(self.ffn_in(self.ffn_norm(x))))
        return self.out_norm(x), (k, v)


class PrefixReranker(nn.Module):
    """The prefix encoder plus the residual scorer ``u_i^T k_v / sqrt(w)`` (module docstring)."""

    def __init__(self, hidden: int, rank: int, cfg: RerankerConfig, slots: int) -> None:
        super().__init__()
        w = cfg.width
        self.encoder = PrefixEncoder(rank, cfg, slots)
        self.w_h = nn.Linear(hidden, w, bias=False)  # W_h [w, H]
        self.w_q = nn.Linear(2 * w, w)  # W_q [w, 2w], beta_q
        self.w_o = nn.Linear(w, w, bias=False)  # W_o, zero: initial scores = DSpark's
        self.w_c = nn.Linear(rank, w, bias=False)  # W_c [w, r]
        self.scale = 1.0 / math.sqrt(w)

    def reset_parameters(self, std: float) -> None:
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, 0.0, std)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                nn.init.zeros_(mod.bias)
        nn.init.zeros_(self.w_o.weight)

    def residual(self, hidden: torch.Tensor, prefix: torch.Tensor, e_out: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (h_i), prefix [..., w] (r_i), e_out [..., K, r] (E_out of the candidates) -> [..., K]."""
        u = self.w_o(F.silu(self.w_q(torch.cat([self.w_h(hidden), prefix.to(hidden.dtype)], dim=-1))))  # [..., w]
        k = self.w_c(e_out.to(u.dtype))  # [..., K, w]
        return (k @ u.unsqueeze(-1)).squeeze(-1).float() * self.scale


def lm_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ w [V, D]^T -> [..., V] float32 (no grad): x cast to w's dtype, float32 accumulation and result,
    whatever autocast is on -- the one precision of the reranker's DSpark logits and teacher logits."""
    with torch.autocast(x.device.type, enabled=False):
        flat = x.reshape(-1, x.shape[-1]).to(w.dtype)  # [n, D]
        return mm_f32(flat, w.t()).view(*x.shape[:-1], w.shape[0])


def top_candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [..., V] -> the top-k ids [..., k], always holding the first argmax (the DSpark greedy choice)."""
    idx = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # [..., k]
    top1 = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
    missing = ~(idx == top1).any(dim=-1, keepdim=True)  # only with more than k tied maxima
    return torch.cat([idx[..., :-1], torch.where(missing, top1, idx[..., -1:])], dim=-1)


def keep_dspark_on_ties(scores: torch.Tensor, cand: torch.Tensor, dspark: torch.Tensor) -> torch.Tensor:
    """scores [..., K] of ``cand [..., K]``; where the DSpark choice ``dspark [...]`` ties the best score, raise
    its score by one ulp, so an argmax (first index) picks it: ties resolve toward the original choice."""
    is_base = cand == dspark.unsqueeze(-1)  # [..., K]
    best = scores.max(dim=-1, keepdim=True).values
    bump = is_base & (scores == best)
    return torch.where(bump, torch.nextafter(scores, torch.full_like(scores, math.inf)), scores)


def reranked_choice(scores: torch.Tensor, cand: torch.Tensor, dspark: torch.Tensor) -> torch.Tensor:
    """The reranked greedy token [...] (argmax of the scores over the candidates, ties to the DSpark choice)."""
    best = keep_dspark_on_ties(scores, cand, dspark).argmax(dim=-1, keepdim=True)
    return cand.gather(-1, best).squeeze(-1)


class RerankerDraft(DSparkDraft, kind="reranker"):
    """DSpark + the prefix reranker (hook ``score_candidates``); training supervision in ``prepare_batch``."""

    chunk_slots = 512  # slots whose full-vocabulary logits exist at once in prepare_batch

    def __init__(self, cfg: DraftConfig, target_config: Any, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(cfg, target_config, embed_weight, lm_head_weight, **kwargs)
        if self.markov is None:
            raise ValueError("draft.kind reranker needs a Markov head (markov_head is 'none')")
        self.reranker = PrefixReranker(self.hidden_size, cfg.markov_rank, cfg.reranker, cfg.block_size)
        self.reranker.reset_parameters(float(getattr(target_config, "initializer_range", 0.02)))
        self.top_k = min(cfg.reranker.top_k, self.vocab_size)
        # inference: the encoded prefix tokens [B, T] and their K/V, reused only by a path that starts with them
        self._prefix_kv: tuple[torch.Tensor, KV] | None = None
        self.timing, self.rerank_s = False, 0.0

    def variant_params(self) -> dict[str, nn.Parameter]:
        return {k: p for k, p in self.named_parameters() if k.startswith("reranker.")}

    def variant_timers(self) -> dict[str, float]:
        return {"reranker": self.rerank_s}

    def set_variant_timing(self, on: bool) -> None:
        self.timing, self.rerank_s = on, 0.0

    # -- the DSpark logits l_i, in the precision of lm_logits (decoding and prepare_batch alike) -----------------
    def slot_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [..., V] float32 of final states [..., H] (:func:`lm_logits`)."""
        return lm_logits(self.head_states(hidden), self.lm_head_weight)

    def markov_bias(self, m: torch.Tensor) -> torch.Tensor:
        """W2 m [..., V] float32 (:func:`lm_logits`)."""
        return lm_logits(m, self.markov.w2.weight)

    # -- scoring ---------------------------------------------------------------------------------------
    def candidate_scores(self, dspark: torch.Tensor, hidden: torch.Tensor, prefix: torch.Tensor,
                         cand: torch.Tensor) -> torch.Tensor:
        """s = l + residual on the candidates: dspark [..., K] (l), hidden [..., H], prefix [..., w] (r_i),
        cand [..., K] -> [..., K] float32."""
        e_out = F.embedding(cand, self.markov.w2.weight)  # [..., K, r]
        return dspark.float() + self.reranker.residual(hidden, prefix, e_out)

    def prefix_states(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Training: prev_tokens [B, A, S] (t_0 .. t_{S-1}) -> r [B, A, S, w], slot j reading t_0 .. t_j."""
        emb = self.markov.features(prev_tokens).flatten(0, 1)  # [B*A, S, r]
        r, _ = self.reranker.encoder(emb)
        return r.view(*prev_tokens.shape, -1)

    def _block_prefix_state(self, prefix: torch.Tensor, slot: int) -> torch.Tensor:
        """Inference: r of the last position of ``prefix [B, slot+1]``. The cached K/V is keyed by the tokens it
        encoded, not by their count: it is reused (cut to ``slot`` positions) only when ``prefix[:, :slot]`` is
        its first ``slot`` tokens, so a sibling branch of a draft tree never reads another branch's K/V; any
        other prefix is encoded whole."""
        cached = self._prefix_kv
        fresh = slot == 0 or cached is None or not _continues(cached[0], prefix[:, :slot])
        if fresh:
            r, kv = self.reranker.encoder(self.markov.features(prefix))
        else:
            k, v = (t[:, :, :slot] for t in cached[1])  # [B, nh, slot, d]
            r, kv = self.reranker.encoder(self.markov.features(prefix[:, -1:]), slot, (k, v))
        self._prefix_kv = (prefix.clone(), kv)
        return r[:, -1]  # [B, w]

    def score_candidates(self, logits: torch.Tensor, hidden: torch.Tensor, prefix: torch.Tensor, slot: int,
                         extras: Mapping[str, Any] | None) -> torch.Tensor:
        """logits [B, V] (l_i) -> s_i on the top-K candidates, -inf elsewhere [B, V] float32."""
        t0 = time.perf_counter() if self.timing else 0.0
        cand = top_candidates(logits, self.top_k)  # [B, K]
        state = self._block_prefix_state(prefix, slot)  # [B, w]
        scores = self.candidate_scores(logits.gather(-1, cand), hidden, state, cand)  # [B, K]
        scores = keep_dspark_on_ties(scores, cand, logits.argmax(dim=-1))
        out = torch.full(logits.shape, -math.inf, device=logits.device).scatter(-1, cand, scores)
        if self.timing:
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            self.rerank_s += time.perf_counter() - t0
        return out

    # -- training supervision (hook 5) -----------------------------------------------------------------------
    @torch.no_grad()
    def prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per valid slot, from a no-grad forward: ``rank_candidates [B, A, S, K]`` (top-K of l_i), ``rank_target``
        (teacher argmax), ``rank_teacher_p [B, A, S, K]`` (teacher probabilities of the candidates, not
        renormalised), ``rank_hit`` (valid and the target a candidate) and ``rank_overlap_before`` (full-vocabulary
        overlap of softmax(l_i) with the teacher: the metrics' "before")."""
        hidden = self.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"],
                                    extras=batch)  # [B, A, S, H]
        sv = batch["slot_valid"].bool()
        b, a, j = sv.nonzero(as_tuple=True)
        m = self.markov_features(batch["prev_tokens"], hidden, batch)[b, a, j]  # [N, r]
        head = self.head_states(hidden[b, a, j])  # [N, Ht]
        teach_h = batch["last_hidden"][b, batch["anchors"][b, a] + j]  # [N, Ht]
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for s in range(0, head.shape[0], self.chunk_slots):
            e = s + self.chunk_slots
            logits = lm_logits(head[s:e], self.lm_head_weight) + self.markov_bias(m[s:e])  # [n, V], as propose
            teacher = torch.softmax(lm_logits(teach_h[s:e], self.lm_head_weight), dim=-1)  # [n, V]
            cand = top_candidates(logits, self.top_k)  # [n, K]
            overlap = torch.minimum(torch.softmax(logits, dim=-1), teacher).sum(-1)  # [n]
            for out, val in zip(parts, (cand, teacher.argmax(-1), teacher.gather(-1, cand), overlap)):
                out.append(val)
        cand, target, p_cand, overlap = (torch.cat(p) if p else None for p in parts)
        k = self.top_k
        dense = {"rank_candidates": torch.zeros(*sv.shape, k, dtype=torch.long, device=sv.device),
                 "rank_target": torch.zeros(sv.shape, dtype=torch.long, device=sv.device),
                 "rank_teacher_p": torch.zeros(*sv.shape, k, device=sv.device),
                 "rank_overlap_before": torch.zeros(sv.shape, device=sv.device)}
        if cand is not None:
            for key, val in zip(dense, (cand, target, p_cand, overlap)):
                dense[key][b, a, j] = val.to(dense[key].dtype)
        dense["rank_hit"] = sv & (dense["rank_candidates"] == dense["rank_target"].unsqueeze(-1)).any(-1)
        return {**batch, **dense}

    def rank_outputs(self, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Differentiable reranked scores of every valid slot on its fixed candidates: ``scores [N, K]``, ``dspark
        [N, K]`` (l_i on the candidates), ``index [3, N]`` (b, a, j); needs ``prepare_batch``'s keys."""
        missing = [k for k in RANK_KEYS if k not in batch]
        if missing:
            raise ValueError(f"reranker: the batch lacks {missing}; run draft.prepare_batch first")
        b, a, j = batch["slot_valid"].bool().nonzero(as_tuple=True)
        cand = batch["rank_candidates"][b, a, j]  # [N, K]
        m = self.markov_features(batch["prev_tokens"], hidden, batch)[b, a, j]  # [N, r]
        head = self.head_states(hidden[b, a, j])  # [N, Ht]
        e_out = F.embedding(cand, self.markov.w2.weight)  # [N, K, r]
        with torch.autocast(head.device.type, enabled=False):  # l_i on the candidates with lm_logits' operands
            lm_rows = F.embedding(cand, self.lm_head_weight).float()  # [N, K, Ht]
            head_op = head.to(self.lm_head_weight.dtype).float()  # [N, Ht], rounded as lm_logits rounds it
            dspark = torch.einsum("nkh,nh->nk", lm_rows, head_op) + \
                torch.einsum("nkr,nr->nk", e_out.float(), m.to(e_out.dtype).float())  # [N, K]
        state = self.prefix_states(batch["prev_tokens"])[b, a, j]  # [N, w]
        scores = dspark + self.reranker.residual(hidden[b, a, j], state, e_out)
        return {"scores": scores, "dspark": dspark, "candidates": cand, "index": torch.stack([b, a, j])}

    def variant_offline_sums(self, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor]
                             ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return offline_sums(self, hidden, batch)


# -- loss and metrics ----------------------------------------------------------------------------------------
def rank_sums(draft: RerankerDraft, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor],
              gamma: float) -> dict[str, torch.Tensor]:
    """``rank`` (sum over hit slots of w_j * CE of the teacher argmax inside the candidates; differentiable) and the
    metric numerators of one micro-batch: ``tau_prob`` (reranked), ``tau_prob_before_rerank``,
    ``candidate_recall``, ``target_agreement`` / ``target_agreement_before_rerank`` (valid tokens)."""
    out = draft.rank_outputs(hidden, batch)
    idx = tuple(out["index"])
    sv = batch["slot_valid"].bool()
    cand, scores = out["candidates"], out["scores"]
    hit = batch["rank_hit"][idx]  # [N]
    target = batch["rank_target"][idx]  # [N]
    pos = (cand == target.unsqueeze(-1)).float().argmax(-1)  # [N] place of the target (any when not a hit)
    ce = -torch.log_softmax(scores, dim=-1).gather(-1, pos.unsqueeze(-1)).squeeze(-1)  # [N]
    weights = slot_weights(sv, gamma)[idx] * hit.float()
    sums = {"rank": (weights * ce).sum()}
    with torch.no_grad():
        sums.update(rerank_metric_sums(out, batch))
    return sums


def rerank_metric_sums(out: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums over valid blocks / tokens of the reranked and original metrics (``rank_outputs`` + prepared batch)."""
    idx = tuple(out["index"])
    sv = batch["slot_valid"].bool()
    cand = out["candidates"]
    q = torch.softmax(out["scores"].detach().float(), dim=-1)  # [N, K] reranked, zero outside the candidates
    a_after = torch.zeros(sv.shape, device=q.device)
    a_after[idx] = torch.minimum(q, batch["rank_teacher_p"][idx].float()).sum(-1)
    dspark_choice = cand.gather(-1, out["dspark"].detach().argmax(-1, keepdim=True)).squeeze(-1)  # [N]
    after = reranked_choice(out["scores"].detach(), cand, dspark_choice)  # [N]
    target = batch["rank_target"][idx]
    agree_after, agree_before = (after == target).float().sum(), (dspark_choice == target).float().sum()
    block = sv[..., 0]
    tau_after = (tau_prob_per_block(a_after, sv) * block).sum()
    tau_before = (tau_prob_per_block(batch["rank_overlap_before"], sv) * block).sum()
    return {"tau_prob": tau_after, "tau_prob_before_rerank": tau_before,
            "candidate_recall": batch["rank_hit"].float().sum(), "target_agreement": agree_after,
            "target_agreement_before_rerank": agree_before, "a_after": a_after,
            "prefix_after": _matched_prefix(after, idx, batch), "prefix_before": _matched_prefix(dspark_choice, idx,
                                                                                                 batch)}


def _continues(encoded: torch.Tensor, path: torch.Tensor) -> bool:
    """Whether the encoded tokens [B, T] begin with ``path [B, S]`` (S <= T) in every row."""
    return encoded.shape[0] == path.shape[0] and encoded.shape[1] >= path.shape[1] and bool(
        torch.equal(encoded[:, :path.shape[1]], path))


def _matched_prefix(choice: torch.Tensor, idx: tuple, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Sum over valid blocks of the length of the leading run of greedy choices equal to the reference tokens."""
    sv = batch["slot_valid"].bool()
    match = torch.zeros(sv.shape, dtype=torch.long, device=sv.device)
    match[idx] = (choice == batch["targets"][idx]).long()
    return match.cumprod(dim=-1).sum()


class RerankerTrainModel(DSparkTrainModel):
    """Draft + DSpark loss + the rank loss; ``tau_prob`` and ``accept_rate@i`` of the reranked distribution,
    ``tau_prob_before_rerank`` of the full-vocabulary one."""

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden = self.draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"],
                                          batch["anchor_valid"], extras=batch)  # [B, A, S, H]
        sums = dspark_sums(self.draft, hidden, batch, self.loss_cfg, extras=batch)
        rank = rank_sums(self.draft, hidden, batch, self.loss_cfg.decay_gamma)
        a_after = rank.pop("a_after")  # [B, A, S], zero on invalid slots
        for i in range(a_after.shape[-1]):
            rank[f"accept_rate@{i}"] = a_after[..., i].sum()
        for key in ("prefix_after", "prefix_before"):
            rank.pop(key)
        return {**sums, **rank}  # tau_prob, accept_rate@i: of the reranked distribution


class RerankerTask(DSparkTask, kind="reranker"):
    """DSparkTask + the rank term ``rank_alpha * rank / rank_weight`` (``rank_weight``: the slot weights of the hit
    slots, known after ``prepare_step``) and the reranker's training metrics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.terms["rank"] = TermSpec(self.loss_cfg.rank_alpha, "rank_weight")
        self.metric_denominators.update(tau_prob_before_rerank="blocks", candidate_recall="tokens",
                                        target_agreement="tokens", target_agreement_before_rerank="tokens")

    def build_model(self, device: torch.device, dtype: torch.dtype) -> DSparkTrainModel:
        """The base model (warm start and freezing included) with the rank loss added to its forward."""
        return RerankerTrainModel(super().build_model(device, dtype).draft, self.loss_cfg)

    def denominators(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "rank_hit" not in batch:
            raise ValueError("reranker: denominators before prepare_step (the batch lacks rank_hit)")
        dens = draft_denominators(batch["slot_valid"], self.loss_cfg.decay_gamma)
        weights = slot_weights(batch["slot_valid"], self.loss_cfg.decay_gamma)
        dens["rank_weight"] = (weights * batch["rank_hit"].float()).sum()
        dens["tokens"] = batch["slot_valid"].float().sum()
        return dens


def offline_sums(draft: RerankerDraft, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor]
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """eval_offline's reranker metrics ``{name: (numerator, denominator)}`` on the prepared batch: ``tau_prob`` and
    ``accept_rate@i`` of the reranked distribution, ``tau_prob_before_rerank``, ``rerank_tau_gain``,
    ``candidate_recall``, ``target_agreement`` (before / after / ``rerank_target_agreement_gain``) and the
    teacher-forced matched prefix (before / after / ``rerank_teacher_forced_prefix_gain``)."""
    sums = rerank_metric_sums(draft.rank_outputs(hidden, batch), batch)
    sv = batch["slot_valid"].bool()
    blocks, tokens = sv[..., 0].float().sum(), sv.float().sum()
    out = {name: (sums[name], blocks) for name in ("tau_prob", "tau_prob_before_rerank")}
    out["rerank_tau_gain"] = (sums["tau_prob"] - sums["tau_prob_before_rerank"], blocks)
    for i in range(sv.shape[-1]):
        out[f"accept_rate@{i}"] = (sums["a_after"][..., i][sv[..., i]].sum(), sv[..., i].float().sum())
    out["candidate_recall"] = (sums["candidate_recall"], tokens)
    out["target_agreement_before_rerank"] = (sums["target_agreement_before_rerank"], tokens)
    out["target_agreement"] = (sums["target_agreement"], tokens)
    out["rerank_target_agreement_gain"] = (sums["target_agreement"] - sums["target_agreement_before_rerank"], tokens)
    out["teacher_forced_prefix_before_rerank"] = (sums["prefix_before"], blocks)
    out["teacher_forced_prefix"] = (sums["prefix_after"], blocks)
    out["rerank_teacher_forced_prefix_gain"] = (sums["prefix_after"] - sums["prefix_before"], blocks)
    return out
