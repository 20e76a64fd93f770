"""params.yaml section ``dmtd``: Parallel DMTD (seed 001) model, data and evaluation settings.

The first ``num_parallel_layers`` (P) decoder layers of the target run once per cycle of ``tau`` tokens
on the shadow block ``[head, MASK x (tau-1)]``; the last S = num_hidden_layers - P layers run per token.
Training hyperparameters (lr, steps, batch, precision...) come from the shared trainer's section.

A variant name picks the two orthogonal options of seed 001:
``{causal,bidir}_{norefresh,refresh}`` = attention inside the current shadow cycle x history source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_core.config import Section, non_negative, one_of, positive, require
from dspark_core.errors import UserError

VARIANTS = ("causal_norefresh", "causal_refresh", "bidir_norefresh", "bidir_refresh")
ATTN_BACKENDS = ("auto", "flex", "dense")
LOSS_ON = ("response", "all")
GRAPH_MODES = ("auto", "none", "cuda_graph", "compile")


@dataclass(frozen=True)
class VariantRule:
    """The two options of a variant: bidirectional shadow attention inside the cycle; real-K/V history."""

    bidirectional: bool
    refresh: bool


def parse_variant(name: str) -> VariantRule:
    """``'bidir_refresh'`` -> ``VariantRule(bidirectional=True, refresh=True)``; ValueError on other names."""
    if name not in VARIANTS:
        raise UserError(f"DMTD variant must be one of {', '.join(VARIANTS)}; got {name!r}")
    within, history = name.split("_")
    return VariantRule(bidirectional=within == "bidir", refresh=history == "refresh")


@dataclass(frozen=True)
class DMTDEvalConfig(Section):
    """``dmtd.eval``: held-out perplexity, GSM8K accuracy, decode speed."""

    batch_size: int = 4               # packed rows per perplexity forward
    max_new_tokens: int = 256         # GSM8K generation length
    max_items: int | None = None      # GSM8K items to run (null: all given)
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    speed_prompts: int = 4            # prompts timed for tokens/s (DMTD and plain AR decode)
    speed_new_tokens: int = 128
    graph: str = "auto"               # auto (cuda_graph on GPU, none on CPU) | none | cuda_graph | compile
    seed: int = 0

    def validate(self) -> None:
        positive("batch_size", self.batch_size)
        positive("max_new_tokens", self.max_new_tokens)
        if self.max_items is not None:
            positive("max_items", self.max_items)
        non_negative("temperature", self.temperature)
        require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1]; got {self.top_p}")
        non_negative("top_k", self.top_k)
        positive("speed_prompts", self.speed_prompts)
        require(self.speed_new_tokens >= 2, f"speed_new_tokens must be >= 2 (the first token comes from the "
                f"prefill); got {self.speed_new_tokens}")
        one_of("graph", self.graph, GRAPH_MODES)


@dataclass(frozen=True)
class DMTDConfig(Section):
    """params.yaml section ``dmtd``."""

    num_parallel_layers: int = 23     # P: layers[0:P] run per cycle on the shadow block; S = layers[P:]
    tau: int = 4                      # cycle length
    mask_token_id: int = 16           # SmolLM2: <empty_output>, unused in chat
    variants: tuple[str, ...] = VARIANTS
    max_length: int = 512             # tokens of one packed training row
    loss_on: str = "response"         # response | all (next-token CE on every token of a document)
    freeze_embeddings: bool = False   # fine-tune all weights by default (tied LM head freezes with them)
    attn_backend: str = "auto"        # auto (flex on GPU, dense SDPA mask on CPU) | flex | dense
    grad_checkpoint: bool = False     # recompute each decoder layer in the backward pass
    ce_chunk_tokens: int = 1024       # supervised tokens whose full-vocab logits exist at once in the loss
    target_dir: str = "data/target"
    regen_dir: str = "data/regen"
    eval: DMTDEvalConfig = field(default_factory=DMTDEvalConfig)

    def validate(self) -> None:
        positive("num_parallel_layers", self.num_parallel_layers)
        require(self.tau >= 2, f"tau must be >= 2; got {self.tau}")
        non_negative("mask_token_id", self.mask_token_id)
        require(len(self.variants) > 0, "variants must name at least one variant")
        for name in self.variants:
            one_of("variants", name, VARIANTS)
        require(len(set(self.variants)) == len(self.variants), f"variants has duplicates: {list(self.variants)}")
        require(self.max_length >= self.tau, f"max_length must be >= tau={self.tau}; got {self.max_length}")
        one_of("loss_on", self.loss_on, LOSS_ON)
        one_of("attn_backend", self.attn_backend, ATTN_BACKENDS)
        positive("ce_chunk_tokens", self.ce_chunk_tokens)

    def check_target(self, model_config, where: str = "dmtd") -> None:
        """ValueError naming the field when P or the mask id do not fit the target's config."""
        n_layers = model_config.num_hidden_layers
        if not 1 <= self.num_parallel_layers < n_layers:
            raise UserError(f"{where}.num_parallel_layers={self.num_parallel_layers} must be in "
                            f"[1, {n_layers - 1}] for a target with {n_layers} decoder layers")
        if self.mask_token_id >= model_config.vocab_size:
            raise UserError(f"{where}.mask_token_id={self.mask_token_id} is outside the target's vocabulary "
                            f"(vocab_size={model_config.vocab_size})")
