"""The DSpark draft (the DSpark paper's baseline draft, as built by DeepSpec) and its variant registry
(saved and loaded by ``dspark_core.checkpoint``).

Shape legend: B batch, L tokens, A anchors, S slots (block_size), Q = A*S block tokens, K aux layers,
Ht target hidden, H draft hidden, V vocab, r Markov rank, E extra K/V entries, nq / nkv heads, d head dim.

Architecture (built from the target's HF config, Qwen3 / Qwen2 / Llama):

- context features ``c_j = RMSNorm(W_aux [H_j^l1; ...; H_j^lK])`` (W_aux: K*Ht -> H, no bias), shared by
  every layer;
- block inputs ``[E(anchor), E(MASK) x (S-1)]`` at positions ``p .. p+S-1`` (p = anchor position) with
  the target's frozen embedding (MASK = a token row, or a learned vector when the vocabulary has no
  spare token); projected Ht -> H only when the draft is narrower/wider than the target;
- ``num_draft_layers`` decoder layers mirroring the target's (Qwen3 q/k RMSNorm, Qwen2 qkv bias, Llama
  attention/mlp bias flags, the family's gated MLP, RMSNorm and RoPE as
  ``dspark_core.ops`` builds them, bit-identical to transformers' modules), or with ``layer_style: qwen3`` Qwen3 layers
  (q/k RMSNorm, the ``attention_bias`` flag on all four projections) on any target, which is what the serving
  engines' DSpark layout holds (``dspark_core/export``): queries from the block states, keys and
  values from ``[c_0..c_{p-1} ; block states]`` through the layer's own k_proj / v_proj in one attention;
  context RoPE positions 0..p-1;
- final RMSNorm -> ``h_1..h_S``; frozen LM head of the target (+ H -> Ht projection when widths differ);
- Markov head (``draft.markov_head``: vanilla, gated, rnn or none) and confidence head (``heads.py``).

Variant hooks, one overridable method each, so a variant subclasses ``DSparkDraft``, adds its
module in ``__init__`` and overrides one method:

1. :meth:`DSparkDraft.block_inputs` -- the block's input embeddings (Engram-MASK replaces / gates the
   MASK slots with a projected pre-anchor feature read from ``extras``).
2. :meth:`DSparkDraft.markov_features` -- ``m_i`` fed to the Markov head type (then W2) and to the confidence
   head (Engram-Markov adds ``g_i v_i``).
3. :meth:`DSparkDraft.extra_kv` -- extra K/V sources of every layer's attention (Draft Memory returns
   its memory states with their RoPE positions and owning block); the mask and both attention paths
   already handle them.
4. :meth:`DSparkDraft.score_candidates` -- rescoring of a slot's logits before a token is chosen (the
   prefix reranker rescoring the Markov top-16).

``extras`` is a mapping the hooks read their inputs from: the training batch itself (variant tensors
are extra batch keys), or what the engine passes to ``propose``. The baseline ignores it.

A variant registers itself by its class statement, ``class MyDraft(DSparkDraft, kind="my_kind")``, in its
own file under ``dspark_core/draft/variants/`` (imported by that package, which ``dspark_core.draft``
imports): ``draft.kind: my_kind`` in params.yaml then selects it (:func:`draft_class`). This module never
imports a variant.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dspark_core.config import ParamsError
from dspark_core.draft import inference
from dspark_core.draft.attention import AttentionMask, attend, build_attention_mask
from dspark_core.draft.config import DraftConfig
from dspark_core.draft.heads import ConfidenceHead, build_markov_head
from dspark_core.draft.vocab import DraftVocab
from dspark_core.errors import UserError
from dspark_core.ops import HF_CLASS_PREFIX, GatedMLP, RMSNorm, rotary_embedding

FAMILIES = tuple(HF_CLASS_PREFIX)  # the target families the draft mirrors
FROZEN_KEYS = ("lm_head_weight", "embed_tokens_weight")
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [B, T, d]


def check_family(model_type: Any) -> str:
    """``model_type`` if the draft supports that HF family (its layers are built from :mod:`dspark_core.ops`)."""
    if model_type not in FAMILIES:
        raise ValueError(f"target model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    return model_type


def target_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def draft_hf_config(cfg: DraftConfig, target_config: Any) -> Any:
    """A copy of the target's HF config with the draft's depth and widths (None = the target's)."""
    c = copy.deepcopy(target_config)
    c.hidden_size = cfg.hidden_size or target_config.hidden_size
    c.intermediate_size = cfg.intermediate_size or target_config.intermediate_size
    c.num_attention_heads = cfg.num_attention_heads or target_config.num_attention_heads
    c.num_key_value_heads = cfg.num_key_value_heads or target_config.num_key_value_heads
    c.head_dim = cfg.head_dim or target_head_dim(target_config)
    c.num_hidden_layers = cfg.num_draft_layers
    if hasattr(c, "layer_types"):
        c.layer_types = ["full_attention"] * cfg.num_draft_layers
    if c.num_attention_heads % c.num_key_value_heads:
        raise UserError(f"draft: num_attention_heads {c.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads {c.num_key_value_heads}; set draft.num_attention_heads to a multiple "
                        "of it (null: the target's heads) or draft.num_key_value_heads to a divisor")
    return c


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x [B, nh, T, d] rotated by cos/sin [B, T, d]."""
    cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
    return x * cos + rotate_half(x) * sin


@dataclass
class ExtraKV:
    """Extra K/V entries of a variant (hook 3): ``states [B, E, H]`` (go through each layer's k_proj /
    v_proj like the context), ``positions [B, E]`` (RoPE), ``owner [B, E]`` (the block index that may see
    the entry in training; at inference the one block sees all)."""

    states: torch.Tensor
    positions: torch.Tensor
    owner: torch.Tensor


class DraftAttention(nn.Module):
    """Queries from the block; keys/values from [context ; extra ; block] through this layer's projections."""

    def __init__(self, hf_cfg: Any, model_type: str) -> None:
        super().__init__()
        h, d = hf_cfg.hidden_size, hf_cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, d
        attn_bias = bool(getattr(hf_cfg, "attention_bias", False))
        qkv_bias, o_bias = (True, False) if model_type == "qwen2" else (attn_bias, attn_bias)
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)
        qk_norm = model_type == "qwen3"
        self.q_norm = RMSNorm(d, eps=hf_cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, eps=hf_cfg.rms_norm_eps) if qk_norm else None
        self.scale = d ** -0.5

    def _heads(self, x: torch.Tensor, proj: nn.Linear, heads: int, norm: nn.Module | None) -> torch.Tensor:
        y = proj(x).view(*x.shape[:2], heads, self.head_dim)  # [B, T, nh, d]
        if norm is not None:
            y = norm(y)
        return y.transpose(1, 2)  # [B, nh, T, d]

    def project_kv(self, states: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """states [B, T, H] -> k (normed, rotated), v: [B, nkv, T, d]. Context, extras and block all use it."""
        k = apply_rope(self._heads(states, self.k_proj, self.num_kv_heads, self.k_norm), rope)
        return k, self._heads(states, self.v_proj, self.num_kv_heads, None)

    def forward(self, x: torch.Tensor, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], rope: Rope,
                mask: AttentionMask) -> torch.Tensor:
        """x [B, Q, H] (normed block states), prefix_kv: [(k, v) [B, nkv, T_i, d]] -> [B, Q, H]."""
        q = apply_rope(self._heads(x, self.q_proj, self.num_heads, self.q_norm), rope)  # [B, nq, Q, d]
        k_blk, v_blk = self.project_kv(x, rope)
        dtype = v_blk.dtype
        k = torch.cat([kv[0].to(dtype) for kv in prefix_kv] + [k_blk.to(dtype)], dim=2)  # [B, nkv, KV, d]
        v = torch.cat([kv[1].to(dtype) for kv in prefix_kv] + [v_blk], dim=2)
        out = attend(q, k, v, mask, self.scale)  # [B, nq, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, hf_cfg: Any, model_type: str) -> None:
        super().__init__()
        h, eps = hf_cfg.hidden_size, hf_cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.self_attn = DraftAttention(hf_cfg, model_type)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        mlp_bias = model_type == "llama" and bool(getattr(hf_cfg, "mlp_bias", False))  # Llama's flag; Qwen: none
        self.mlp = GatedMLP(h, hf_cfg.intermediate_size, hf_cfg.hidden_act, bias=mlp_bias)

    def forward(self, x: torch.Tensor, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], rope: Rope,
                mask: AttentionMask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), prefix_kv, rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def check_aux_layer_ids(aux_layer_ids: Any, num_hidden_layers: int) -> tuple[int, ...]:
    ids = tuple(aux_layer_ids)
    if not ids:
        raise ValueError("aux_layer_ids must not be empty")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not -1 <= i <= num_hidden_layers - 2:
            raise ValueError(f"aux layer id {i!r} must be an integer in [-1, {num_hidden_layers - 2}] "
                             f"(-1 = embeddings; the final layer {num_hidden_layers - 1} is refused)")
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"aux_layer_ids must be strictly increasing; got {list(ids)}")
    return ids


class DSparkDraft(nn.Module):
    """The DSpark draft. See the module docstring for the architecture and the four variant hooks.

    ``embed_weight`` / ``lm_head_weight`` [V, Ht] are the target's (shared storage, frozen: parameters
    with ``requires_grad=False``, so DDP never broadcasts them and trainer checkpoints skip them). A tied
    target (the same tensor for both) is stored once.

    ``token_history``: how many trailing committed tokens (through the anchor) a variant reads at inference;
    the engine then passes ``extras = {"input_ids": [B, n], "anchors": [B, 1]}`` (0: no extras, the baseline).

    ``kind``: the ``draft.kind`` that selects the class; a subclass names its own in the class statement
    (``class MyDraft(DSparkDraft, kind="my_kind")``), which registers it.
    """

    token_history = 0
    kind: ClassVar[str] = "baseline"

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            register_draft(cls, kind)

    def __init__(self, cfg: DraftConfig, target_config: Any, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, *, aux_layer_ids: Any, target_fingerprint: str | None = None) -> None:
        super().__init__()
        self.model_type = getattr(target_config, "model_type", None)
        check_family(self.model_type)
        vocab, t_hidden = lm_head_weight.shape
        if tuple(embed_weight.shape) != (vocab, t_hidden) or t_hidden != target_config.hidden_size:
            raise ValueError(f"embedding {tuple(embed_weight.shape)} / LM head {tuple(lm_head_weight.shape)} do not "
                             f"match the target's hidden_size {target_config.hidden_size}")
        self.cfg = cfg
        self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, target_config.num_hidden_layers)
        self.target_fingerprint = target_fingerprint
        self.target_summary = {"model_type": self.model_type, "vocab_size": vocab, "hidden_size": t_hidden,
                               "num_hidden_layers": target_config.num_hidden_layers}
        self.hf_config = draft_hf_config(cfg, target_config)
        self.block_size, self.vocab_size, self.target_hidden_size = cfg.block_size, vocab, t_hidden
        self.hidden_size = hid = self.hf_config.hidden_size
        self.attention_backend = "auto"  # auto: flex_attention on GPU, dense SDPA on CPU
        self.gradient_checkpointing = False  # recompute each layer in backward (less activation memory)
        self.compile_layers = True  # on GPU: torch.compile the layer step (fuses norms / RoPE / MLP with flex)
        self.context_bucket = 1  # uncompiled path: pad the context to a multiple of this (tests; GPU: CONTEXT_BUCKET)
        self._build_frozen(embed_weight, lm_head_weight)
        self._build_mask(cfg, vocab, t_hidden)
        eps = self.hf_config.rms_norm_eps
        self.embed_proj = nn.Linear(t_hidden, hid, bias=False) if hid != t_hidden else None
        self.fc = nn.Linear(len(self.aux_layer_ids) * t_hidden, hid, bias=False)  # W_aux
        self.hidden_norm = RMSNorm(hid, eps=eps)
        self.layer_family = "qwen3" if cfg.layer_style == "qwen3" else self.model_type
        self.layers = nn.ModuleList(DraftLayer(self.hf_config, self.layer_family)
                                    for _ in range(cfg.num_draft_layers))
        self.norm = RMSNorm(hid, eps=eps)
        self.head_proj = nn.Linear(hid, t_hidden, bias=False) if hid != t_hidden else None
        self.rotary_emb = rotary_embedding(self.hf_config)
        # draft.vocab_size: the LM head's rows and W2 over the draft vocabulary only (maps in draft_vocab)
        self.draft_vocab = DraftVocab(vocab, cfg.vocab_size) if cfg.vocab_size is not None else None
        self.markov = build_markov_head(cfg.markov_head, vocab, cfg.markov_rank, hid, cfg.vocab_size)
        conf_rank = cfg.markov_rank if cfg.has_markov and cfg.confidence_with_markov else 0
        self.confidence = ConfidenceHead(hid, conf_rank) if cfg.confidence_head else None
        self._init_weights(float(getattr(target_config, "initializer_range", 0.02)))

    # -- construction ----------------------------------------------------------------------------
    def _build_frozen(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        self.tied_embeddings = embed_weight is lm_head_weight
        self.lm_head_weight = nn.Parameter(lm_head_weight.detach(), requires_grad=False)  # [V, Ht]
        if not self.tied_embeddings:
            self.embed_tokens_weight = nn.Parameter(embed_weight.detach(), requires_grad=False)  # [V, Ht]

    def _build_mask(self, cfg: DraftConfig, vocab: int, t_hidden: int) -> None:
        spare = cfg.mask_token_id is not None and cfg.mask_token_id < vocab
        self.mask_token_id = cfg.mask_token_id if spare else None
        self.mask_embedding = None if spare else nn.Parameter(torch.empty(t_hidden))  # [Ht], learned

    def _init_weights(self, std: float) -> None:
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, 0.0, std)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, 0.0, std)
        if self.mask_embedding is not None:
            nn.init.normal_(self.mask_embedding, 0.0, std)

    def set_frozen_dtype(self, dtype: torch.dtype) -> None:
        """Keep the frozen embedding / LM head in ``dtype`` (e.g. bf16 beside fp32 trainable weights)."""
        for key in FROZEN_KEYS:
            if key in self._parameters:
                self._parameters[key].data = self._parameters[key].data.to(dtype)

    # -- small pieces ------------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embedding_matrix(self) -> torch.Tensor:
        return self.lm_head_weight if self.tied_embeddings else self.embed_tokens_weight  # [V, Ht]

    def mask_vector(self) -> torch.Tensor:
        """E(MASK) [Ht]: the token's frozen row, or the learned vector."""
        if self.mask_embedding is not None:
            return self.mask_embedding
        return self.embedding_matrix()[self.mask_token_id]

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight of the draft except the frozen copies of the target's embedding / LM head."""
        return {k: v for k, v in self.state_dict().items() if k not in FROZEN_KEYS}

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> Rope:
        return self.rotary_emb(like, positions)  # cos, sin [B, T, d]

    def context_features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux_hidden [B, n, K, Ht] -> c [B, n, H] = RMSNorm(W_aux concat_k(H^k))."""
        k, t_hidden = len(self.aux_layer_ids), self.target_hidden_size
        if aux_hidden.dim() != 4 or tuple(aux_hidden.shape[2:]) != (k, t_hidden):
            raise ValueError(f"aux_hidden must be [B, n, {k}, {t_hidden}] (aux layers {list(self.aux_layer_ids)}); "
                             f"got {tuple(aux_hidden.shape)}")
        flat = aux_hidden.reshape(*aux_hidden.shape[:2], k * t_hidden)  # [B, n, K*Ht]
        dev = flat.device.type
        if not (torch.is_autocast_enabled(dev) and flat.dtype == torch.get_autocast_dtype(dev)):
            flat = flat.to(self.compute_dtype)  # under autocast fc reads the cache's bf16 as it is: no fp32 round trip
        return self.hidden_norm(self.fc(flat))

    def _block_states(self, anchor_tokens: torch.Tensor, extras: Mapping[str, Any] | None) -> torch.Tensor:
        """anchor_tokens [B, A] -> block input states [B, A*S, H]."""
        x = self.block_inputs(anchor_tokens, extras).to(self.compute_dtype)  # [B, A, S, Ht]
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        return x.reshape(x.shape[0], -1, self.hidden_size)

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final draft states [..., H] -> what the LM head reads [..., Ht]."""
        return self.head_proj(hidden) if self.head_proj is not None else hidden

    def draft_head_weight(self) -> torch.Tensor:
        """The LM head's rows the draft predicts over: [V, Ht], or [Vd, Ht] with a reduced draft vocabulary."""
        w = self.lm_head_weight
        return w if self.draft_vocab is None else w.index_select(0, self.draft_vocab.d2t)

    def slot_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [..., V] (float32) of final states [..., H] (inference; training uses the chunked loss).
        A reduced draft vocabulary's tokens get their logits, every other token ``-inf`` (q = 0 there)."""
        w = self.draft_head_weight()
        logits = (self.head_states(hidden).to(w.dtype) @ w.t()).float()  # [..., Vd]
        return logits if self.draft_vocab is None else self.draft_vocab.expand(logits, float("-inf"))

    def markov_bias(self, u: torch.Tensor) -> torch.Tensor:
        """W2 u over the target's vocabulary [..., V] (0 outside a reduced draft vocabulary): u from ``markov_step`` /
        ``markov_block`` (for a vanilla head, the features m)."""
        bias = self.markov.bias(u)  # [..., Vd]
        return bias if self.draft_vocab is None else self.draft_vocab.expand(bias, 0.0)

    def markov_step(self, m: torch.Tensor, hidden: torch.Tensor | None, state: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot of the head type: m [B, r] (``markov_features``), h [B, H], the state carried from the slot
        before (None at slot 0) -> (u [B, r] for ``markov_bias``, the state for the next slot)."""
        return self.markov.step(m, hidden, state)

    def markov_block(self, m: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Every slot of blocks at once (training, teacher forcing): m [..., S, r], h [..., S, H] -> u [..., S, r]."""
        return self.markov.block(m, hidden)

    def confidence_logits(self, hidden: torch.Tensor, markov: torch.Tensor | None) -> torch.Tensor | None:
        return None if self.confidence is None else self.confidence(hidden, markov)

    # -- variant hooks -----------------------------------------------------------------------------
    def block_inputs(self, anchor_tokens: torch.Tensor, extras: Mapping[str, Any] | None) -> torch.Tensor:
        """Hook 1. anchor_tokens [B, A] -> input embeddings [B, A, S, Ht] = [E(anchor), E(MASK) x (S-1)]."""
        anchor = nn.functional.embedding(anchor_tokens, self.embedding_matrix())  # [B, A, Ht]
        mask = self.mask_vector().to(anchor.dtype)
        mask = mask.expand(*anchor_tokens.shape, self.block_size - 1, mask.shape[-1])  # [B, A, S-1, Ht]
        return torch.cat([anchor.unsqueeze(2), mask], dim=2)

    def markov_features(self, prev_tokens: torch.Tensor, hidden: torch.Tensor,
                        extras: Mapping[str, Any] | None) -> torch.Tensor | None:
        """Hook 2. prev_tokens [...] (t_{i-1}), hidden [..., H] (h_i) -> m_i [..., r] (None without a Markov head):
        the previous token's features, read by the confidence head and turned into W2's input by the head type
        (``markov_step`` / ``markov_block``)."""
        return None if self.markov is None else self.markov.features(prev_tokens)

    def extra_kv(self, extras: Mapping[str, Any] | None, anchors: torch.Tensor,
                 anchor_valid: torch.Tensor) -> ExtraKV | None:
        """Hook 3. Extra K/V sources for anchors [B, A] (training) or one block [B, 1] (inference)."""
        return None

    def score_candidates(self, logits: torch.Tensor, hidden: torch.Tensor, prefix: torch.Tensor, slot: int,
                         extras: Mapping[str, Any] | None) -> torch.Tensor:
        """Hook 4. Rescore slot ``slot``'s logits [B, V] given h [B, H] and the chosen prefix [B, slot+1]."""
        return logits

    def prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hook 5 (training and eval_offline, no_grad): model-dependent supervision added to a batch before
        its loss denominators are taken (Draft Memory's stage 1). The baseline returns the batch unchanged."""
        return batch

    # eval_offline: the names of the anchor sets ``offline_anchor_sets`` returns ("" = the random anchors)
    offline_anchor_set_names: tuple[str, ...] = ("",)

    def offline_anchor_sets(self, batch: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """eval_offline (no_grad): ``{name: prepared batch}``, the anchor sets this draft is measured on. ``""``:
        the evaluation's random anchors, reported under the plain metric keys, the same for every draft; another
        name (Draft Memory's ``post_error``) prefixes its keys (``post_error/tau_prob``). The baseline: the
        random anchors through ``prepare_batch``."""
        return {"": self.prepare_batch(batch)}

    def variant_offline_sums(self, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor]
                             ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """eval_offline: a variant's own metrics of one batch as ``{name: (numerator, denominator)}`` (summed over
        batches, then divided; a name of the baseline's metrics replaces it). hidden [B, A, S, H] from
        ``forward_train`` on the prepared batch. The baseline has none."""
        return {}

    def variant_timers(self) -> dict[str, float]:
        """Seconds spent in a variant's own online work since ``set_variant_timing(True)`` (bench_online)."""
        return {}

    def set_variant_timing(self, on: bool) -> None:
        """Start (and zero) or stop the variant's timers; the baseline has none."""

    # -- training forward ----------------------------------------------------------------------------
    def forward_train(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, anchors: torch.Tensor,
                      anchor_valid: torch.Tensor, extras: Mapping[str, Any] | None = None) -> torch.Tensor:
        """All anchor blocks of a batch in one pass -> final draft states h [B, A, S, H].

        input_ids [B, L], aux_hidden [B, L, K, Ht], anchors [B, A] (positions < L), anchor_valid [B, A].
        """
        batch, length = input_ids.shape
        num_anchors, slots = anchors.shape[1], self.block_size
        if anchors.shape[0] != batch or aux_hidden.shape[:2] != input_ids.shape:
            raise ValueError(f"forward_train: input_ids {tuple(input_ids.shape)}, aux_hidden "
                             f"{tuple(aux_hidden.shape)} and anchors {tuple(anchors.shape)} disagree")
        x = self._block_states(input_ids.gather(1, anchors), extras)  # [B, Q, H]
        c = self.context_features(aux_hidden)  # [B, L, H]
        compiled = x.is_cuda and self.compile_layers
        bucket = CONTEXT_BUCKET if compiled else self.context_bucket
        if bucket > 1:  # static-shape kernels: pad the context to a bucket (padding is never visible: c < anchor)
            length = length + (-length) % bucket
            c = F.pad(c, (0, 0, 0, length - c.shape[1]))  # [B, Lp, H]
        ctx_pos, anchor_pos, start = _positions(extras, anchors, batch, length, c.device)  # [B, L], [B, A]
        blk_pos = (anchor_pos.unsqueeze(-1) + torch.arange(slots, device=c.device)).reshape(batch, -1)  # [B, Q]
        ctx_rope, blk_rope = self.rope(c, ctx_pos), self.rope(x, blk_pos)
        extra = self.extra_kv(extras, anchors, anchor_valid)
        extra_rope = self.rope(extra.states, extra.positions) if extra is not None else None
        mask = build_attention_mask(anchors, anchor_valid, length, slots,
                                    extra.owner if extra is not None else None, self.attention_backend, start)
        extra_states = extra.states if extra is not None else None
        step = _compiled_layer_step() if compiled else _layer_step
        for layer in self.layers:
            args = (layer, x, c, ctx_rope, extra_states, extra_rope, blk_rope, mask)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(step, *args, use_reentrant=False)
            else:
                x = step(*args)
        return self.norm(x).view(batch, num_anchors, slots, self.hidden_size)

    # -- inference (docs/DESIGN.md "Draft <-> engine contract") -----------------------------------------
    def new_context_cache(self, batch: int = 1, max_len: int = 4096, device: Any = None,
                          dtype: torch.dtype | None = None) -> inference.ContextCache:
        return inference.new_context_cache(self, batch, max_len, device, dtype)

    def extend_context(self, cache: inference.ContextCache, aux_hidden: torch.Tensor) -> None:
        inference.extend_context(self, cache, aux_hidden)

    def propose(self, cache: inference.ContextCache, anchor_token: torch.Tensor, sample_fn: inference.SampleFn,
                confidence_threshold: float = 0.0, extras: Mapping[str, Any] | None = None) -> inference.DraftProposal:
        return inference.propose(self, cache, anchor_token, sample_fn, confidence_threshold, extras)

    # -- batched online decoding (the fast engine's request rows, dspark_core/decoding/static_engine.py) ----------
    def rows_state(self, rows: int, device: Any) -> dict[str, torch.Tensor]:
        """A variant's online state for ``rows`` request rows, kept by the engine across cycles (the baseline has
        none)."""
        return {}

    def rows_extras(self, state: dict[str, torch.Tensor], seq: torch.Tensor | None, p: torch.Tensor
                    ) -> dict[str, torch.Tensor] | None:
        """What the hooks read for one block per row at anchor positions ``p [R]``: with ``token_history`` n > 0,
        each row's last n committed tokens through its anchor from ``seq [R, W]`` (every row's tokens by position)
        as ``input_ids [R, n]`` and the anchor's index in them, ``anchors [R, 1]`` (what the one-request engine
        passes). The engine admits no prompt shorter than n - 1 tokens."""
        n = int(self.token_history)
        if n <= 0:
            return None
        start = (p - (n - 1)).clamp_min(0)  # [R]
        ids = seq.gather(1, start.view(-1, 1) + torch.arange(n, device=seq.device))  # [R, n]
        return {"input_ids": ids, "anchors": (p - start).view(-1, 1)}

    def rows_record(self, state: dict[str, torch.Tensor], p: torch.Tensor, hidden: torch.Tensor,
                    extras: Mapping[str, Any] | None, block: Any) -> None:
        """After each row's block at anchors ``p [R]`` gave ``hidden [R, S, H]`` (``block(extras)`` recomputes it
        with other extras): what a variant carries to the next cycle (the baseline: nothing)."""

    def rows_reset(self, state: dict[str, torch.Tensor], row: int) -> None:
        """Row ``row`` starts a new request: forget what it carried."""

    @torch.no_grad()
    def forward_block(self, cache: inference.ContextCache, anchor_token: torch.Tensor,
                      extras: Mapping[str, Any] | None = None) -> torch.Tensor:
        """One block at anchor position ``cache.length`` against the cached context -> h [B, S, H]."""
        batch = anchor_token.shape[0]
        if batch != cache.batch:
            raise ValueError(f"anchor_token has batch {batch}, the cache {cache.batch}")
        p, slots = cache.length, self.block_size
        x = self._block_states(anchor_token.view(batch, 1), extras)  # [B, S, H]
        rope = self.rope(x, (p + torch.arange(slots, device=x.device)).expand(batch, slots))
        anchors = torch.full((batch, 1), p, dtype=torch.long, device=x.device)
        extra = self.extra_kv(extras, anchors, torch.ones_like(anchors, dtype=torch.bool))
        extra_rope = self.rope(extra.states, extra.positions) if extra is not None else None
        for i, layer in enumerate(self.layers):
            prefix = [cache.layer_kv(i, x.dtype)]
            if extra is not None:
                prefix.append(layer.self_attn.project_kv(extra.states, extra_rope))
            x = layer(x, prefix, rope, AttentionMask())
        return self.norm(x)


# draft.kind -> class, filled by the class statements (the baseline below, the variants in their files)
DRAFT_CLASSES: dict[str, type[DSparkDraft]] = {}


def register_draft(cls: type[DSparkDraft], kind: str) -> None:
    """Select ``cls`` by ``draft.kind: kind``; a kind names one class."""
    old = DRAFT_CLASSES.get(kind)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"draft.kind {kind!r} is registered twice: {old.__qualname__} and {cls.__qualname__}")
    cls.kind = kind
    DRAFT_CLASSES[kind] = cls


register_draft(DSparkDraft, "baseline")


def draft_kinds() -> tuple[str, ...]:
    """Every registered ``draft.kind``, in registration order."""
    return tuple(DRAFT_CLASSES)


def draft_class(kind: str) -> type[DSparkDraft]:
    """The draft class registered as ``draft.kind``."""
    if kind not in DRAFT_CLASSES:
        raise ParamsError(f"draft.kind must be one of {', '.join(DRAFT_CLASSES)}; got {kind!r}")
    return DRAFT_CLASSES[kind]


def build_draft(cfg: DraftConfig, target_config: Any, embed_weight: Any, lm_head_weight: Any,
                **kwargs: Any) -> DSparkDraft:
    """A draft of class ``draft_class(cfg.kind)`` (same arguments as ``DSparkDraft``)."""
    return draft_class(cfg.kind)(cfg, target_config, embed_weight, lm_head_weight, **kwargs)


def _positions(extras: Mapping[str, Any] | None, anchors: torch.Tensor, batch: int, length: int, device: Any
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RoPE positions of the context [B, L] and of the anchors [B, A], and the anchors' document starts [B, A]
    (None): row positions, or in a packed batch (``position_ids`` / ``anchor_start`` in ``extras``, see
    ``draft/packing.py``) positions within each document."""
    start = extras.get("anchor_start") if extras is not None else None
    if start is None:
        return torch.arange(length, device=device).expand(batch, length), anchors, None
    pos = extras["position_ids"].to(device)  # [B, n]
    pos = F.pad(pos, (0, length - pos.shape[1]))  # [B, L] (a padded context bucket: never visible)
    start = start.to(device)
    return pos, anchors - start, start


def _layer_step(layer: DraftLayer, x: torch.Tensor, c: torch.Tensor, ctx_rope: Rope, extra_states: torch.Tensor | None,
                extra_rope: Rope | None, blk_rope: Rope, mask: AttentionMask) -> torch.Tensor:
    """One layer of the training forward (a function, so it can be recomputed by activation checkpointing)."""
    prefix = [layer.self_attn.project_kv(c, ctx_rope)]
    if extra_states is not None:
        prefix.append(layer.self_attn.project_kv(extra_states, extra_rope))
    return layer(x, prefix, blk_rope, mask)


_COMPILED_STEP: list = []
# The compiled training forward pads the context to a multiple of this many positions and compiles
# static shapes: flex_attention's kernels then know every length is a multiple of their 128-wide tiles
# (measured on an H200 at Qwen3-4B shapes, L = 4096: 2.41 ms forward + backward per layer against 3.68 ms
# with dynamic shapes). One graph per (rows, context bucket, anchor slots): at most 8 anchor widths under
# ``draft.anchor_slots: compact`` (anchors.compact_width), some dozens over a long run.
CONTEXT_BUCKET = 512
COMPILED_SHAPES = 512  # torch._dynamo's recompile limit here: past it a new shape would run uncompiled


def _compiled_layer_step():
    """``_layer_step`` under torch.compile (static shapes, one graph per shape shared by every layer), built once."""
    if not _COMPILED_STEP:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):  # one entry per shape bucket
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(COMPILED_SHAPES, getattr(torch._dynamo.config, name)))
        _COMPILED_STEP.append(torch.compile(_layer_step, dynamic=False))
    return _COMPILED_STEP[0]
