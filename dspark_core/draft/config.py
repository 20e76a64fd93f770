"""Params sections of the DSpark draft: ``draft`` (architecture + anchors) and ``loss`` (training objective).

Both are frozen :class:`~dspark_core.config.Section` dataclasses: ``DraftConfig.load("params.yaml", "draft")``.
A variant's overrides are merged into the ``draft`` / ``loss`` mappings before ``from_dict`` (see
``dspark_core.variants``). The width fields default to ``None`` = the target's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_core.config import Section, non_negative, one_of, positive, require

MARKOV_HEADS = ("vanilla", "gated", "rnn", "none")
# the kinds whose Markov calls all go through the head type (markov_step / markov_block): gated / rnn heads allowed
MIXING_HEAD_KINDS = ("baseline", "engram_markov", "engram_mask_gated", "engram_mask_replace")
LAYER_STYLES = ("target", "qwen3")
ENGRAM_SOURCES = ("trainable", "frozen")
MEMORY_ONLINE = ("chained", "first_stage")
TEACHER_VOCABS = ("full", "draft")
ANCHOR_SLOTS = ("compact", "fixed")


@dataclass(frozen=True)
class EngramConfig(Section):
    """The hashed multi-head n-gram table of the Engram variants (seed 000; ``draft/variants/engram.py``).

    Each n-gram order has ``heads_per_order`` hash heads; head k of order n is a table of a prime number of
    rows (the ``k``-th prime >= ``table_rows`` for that order) whose row width is the feature width divided
    over all heads; the feature ``e_t`` of the prefix ending at t concatenates one row per head.
    ``source``: ``trainable`` (learned with the draft at ``lr``, dense or ``sparse`` gradients) or ``frozen``
    (read from ``table_path``, written by the ``engram_build`` stage). The table is not a draft parameter
    in the seed's counts; its size is reported on its own.
    """

    orders: tuple[int, ...] = (2, 3)
    heads_per_order: int = 2
    table_rows: int = 20011
    source: str = "trainable"
    lr: float | None = None             # None: train.lr (trainable tables)
    sparse: bool = False                # sparse gradients + SparseAdam for the table (one process only)
    table_path: str = "data/engram/table.safetensors"
    hash_seed: int = 0

    def validate(self) -> None:
        require(len(self.orders) > 0, "orders must not be empty")
        for n in self.orders:
            require(isinstance(n, int) and n >= 1, f"orders must be integers >= 1; got {list(self.orders)}")
        require(list(self.orders) == sorted(set(self.orders)), f"orders must be strictly increasing; got "
                f"{list(self.orders)}")
        positive("heads_per_order", self.heads_per_order)
        require(self.table_rows >= 2, f"table_rows must be >= 2; got {self.table_rows}")
        one_of("source", self.source, ENGRAM_SOURCES)
        if self.lr is not None:
            positive("lr", self.lr)
        non_negative("hash_seed", self.hash_seed)
        require(not (self.sparse and self.source == "frozen"), "sparse: true needs source: trainable "
                "(a frozen table has no gradient)")

    @property
    def num_heads(self) -> int:
        return len(self.orders) * self.heads_per_order


@dataclass(frozen=True)
class MemoryConfig(Section):
    """Draft Memory (seed 000; ``draft/variants/memory.py``). ``online``: where the memory fed at a cycle comes
    from -- ``chained`` (the previous cycle's proposal states, themselves computed with memory: what serving
    has) or ``first_stage`` (the previous block recomputed without memory, as in training's stage 1; one more
    draft block forward per cycle). Training does not read it; bench_online reports both."""

    online: str = "chained"

    def validate(self) -> None:
        one_of("online", self.online, MEMORY_ONLINE)


@dataclass(frozen=True)
class RerankerConfig(Section):
    """The prefix reranker (seed 000; ``draft/variants/reranker.py``): the Markov top-``top_k`` candidates rescored
    from a one-layer causal Transformer over the block's prefix (width ``width``, ``num_heads`` heads, FFN
    ``width -> ffn_size -> width``) and the draft hidden state."""

    top_k: int = 16
    width: int = 256
    num_heads: int = 4
    ffn_size: int = 1024
    norm_eps: float = 1e-5

    def validate(self) -> None:
        for name in ("top_k", "width", "num_heads", "ffn_size"):
            positive(name, getattr(self, name))
        positive("norm_eps", self.norm_eps)
        require(self.width % self.num_heads == 0, f"width ({self.width}) must be a multiple of num_heads "
                f"({self.num_heads})")


@dataclass(frozen=True)
class DraftConfig(Section):
    """The DSpark draft (seed 004 section 5.1, seed 000 "Baseline 架构")."""

    num_draft_layers: int = 2
    block_size: int = 7                 # S slots: [anchor, MASK x (S-1)]
    mask_token_id: int | None = None    # None (or >= vocab): a learned mask embedding
    num_anchors: int = 512              # anchors sampled per training sample (at most)
    packed_length: int | None = None    # training rows pack samples up to this many tokens (draft/packing.py)
    anchor_slots: str = "compact"       # compact: a row's anchor slots are the most valid anchors of any row, rounded
                                        # up to num_anchors / 8 (draft/anchors.py); fixed: num_anchors per sample
    markov_rank: int = 256
    markov_head: str = "vanilla"        # vanilla | gated | rnn | none (draft/heads.py)
    confidence_head: bool = True
    confidence_with_markov: bool = True
    hidden_size: int | None = None      # None: the target's
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None       # None: the target's; N: the N most frequent answer tokens (draft/vocab.py)
    layer_style: str = "target"         # target: the target family's layers; qwen3: Qwen3 layers (q/k RMSNorm)
    kind: str = "baseline"              # the draft class (registered by its class statement, draft/variants/)
    engram: EngramConfig = field(default_factory=EngramConfig)  # read by the engram_* kinds only
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # read by draft_memory only
    reranker: RerankerConfig = field(default_factory=RerankerConfig)  # read by the reranker kind only

    EXECUTION_KEYS = ("anchor_slots",)  # the same valid slots either way: a speed knob, not part of a run's identity

    def validate(self) -> None:
        require(isinstance(self.kind, str) and self.kind != "", f"kind must name a draft class; got {self.kind!r}")
        require(not (self.kind == "engram_markov" and self.markov_head == "none"),
                "kind engram_markov needs a Markov head (markov_head is 'none')")
        require(not (self.kind == "reranker" and self.markov_head == "none"),
                "kind reranker needs a Markov head (its E_in / E_out tables; markov_head is 'none')")
        require(not (self.kind == "reranker" and self.vocab_size is not None),
                "kind reranker reads W2 rows by target token id: it needs the full vocabulary (vocab_size null)")
        if self.vocab_size is not None:
            positive("vocab_size", self.vocab_size)
        positive("num_draft_layers", self.num_draft_layers)
        positive("block_size", self.block_size)
        positive("num_anchors", self.num_anchors)
        one_of("anchor_slots", self.anchor_slots, ANCHOR_SLOTS)
        if self.packed_length is not None:
            positive("packed_length", self.packed_length)
            require(self.kind == "baseline", f"packed_length needs kind baseline (kind {self.kind} reads "
                    "positions across the row); set packed_length: null")
        one_of("markov_head", self.markov_head, MARKOV_HEADS)
        one_of("layer_style", self.layer_style, LAYER_STYLES)
        require(self.markov_head in ("vanilla", "none") or self.kind in MIXING_HEAD_KINDS,
                f"markov_head {self.markov_head} is built for kinds {', '.join(MIXING_HEAD_KINDS)}; kind "
                f"{self.kind} reads W1 / W2 directly: use markov_head vanilla")
        if self.markov_head != "none":
            positive("markov_rank", self.markov_rank)
        if self.mask_token_id is not None:
            non_negative("mask_token_id", self.mask_token_id)
        require(not (self.confidence_head and self.confidence_with_markov and self.markov_head == "none"),
                "confidence_with_markov needs a Markov head (markov_head is 'none')")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None:
                positive(name, value)
        require(self.head_dim is None or self.head_dim % 2 == 0,
                f"head_dim must be even (RoPE rotates pairs of dimensions); got {self.head_dim}")
        if self.num_attention_heads is not None and self.num_key_value_heads is not None:
            require(self.num_attention_heads % self.num_key_value_heads == 0,
                    f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                    f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def has_markov(self) -> bool:
        return self.markov_head != "none"


@dataclass(frozen=True)
class LossConfig(Section):
    """``ce_alpha * CE + l1_alpha * L1 + conf_alpha * BCE(conf)``, slot weights ``exp(-i / decay_gamma)``.

    ``teacher_vocab`` (with a reduced ``draft.vocab_size``): ``full`` compares the draft with the target's whole
    distribution; ``draft`` computes the teacher over the draft vocabulary only and renormalises it there (as the
    ``speculators`` trainer does), a cheaper teacher that ignores its mass outside the draft vocabulary. With the
    full vocabulary both are the same loss. eval_offline is always against the full teacher."""

    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    conf_alpha: float = 1.0
    decay_gamma: float = 4.0
    vocab_chunk_slots: int = 512        # slots whose full-vocabulary logits exist at once
    rank_alpha: float = 1.0             # weight of the prefix reranker's rank loss (draft.kind reranker only)
    teacher_vocab: str = "full"         # full | draft: the teacher over the draft vocabulary only (draft/loss.py)

    def validate(self) -> None:
        one_of("teacher_vocab", self.teacher_vocab, TEACHER_VOCABS)
        non_negative("ce_alpha", self.ce_alpha)
        non_negative("l1_alpha", self.l1_alpha)
        non_negative("conf_alpha", self.conf_alpha)
        positive("decay_gamma", self.decay_gamma)
        positive("vocab_chunk_slots", self.vocab_chunk_slots)
        non_negative("rank_alpha", self.rank_alpha)
        require(self.ce_alpha + self.l1_alpha + self.conf_alpha + self.rank_alpha > 0,
                "ce_alpha, l1_alpha, conf_alpha and rank_alpha are all 0: the draft would train on a zero loss")


@dataclass(frozen=True)
class WarmStartConfig(Section):
    """Start ``train`` of a variant from another variant's trainer checkpoint (seed 000: the frozen-baseline
    reranker starts from baseline step 2,604), or from a saved draft dir of an earlier run (``from_dir``: its
    ``config.json`` + ``model.safetensors``, e.g. ``data/train/baseline/final`` carried from another machine; the
    target fingerprint must be this target's). Neither: from scratch. ``step`` null: that variant run's latest
    checkpoint. ``freeze_base``: train only the variant's own parameters (``draft.variant_params()``); the
    optimiser and the lr schedule start afresh either way, and the curves' x axis continues at ``step`` (at 0 from
    a dir). ``from_dir`` is outside DVC's graph: the trainer's resume identity records its weights' sha256."""

    from_variant: str | None = None
    step: int | None = None
    freeze_base: bool = False
    from_dir: str | None = None

    def validate(self) -> None:
        if self.step is not None:
            positive("step", self.step)
        require(self.from_variant is None or self.from_dir is None, "set from_variant or from_dir, not both")
        require(self.step is None or self.from_variant is not None, "step needs from_variant")
        require(not self.freeze_base or self.from_variant is not None or self.from_dir is not None,
                "freeze_base needs from_variant or from_dir")
