"""Draft variants (seed 000), one named file each, selected by ``draft.kind`` in params.yaml.

A variant subclasses :class:`~dspark_core.draft.model.DSparkDraft` and overrides its hooks (``block_inputs``,
``markov_features``, ``extra_kv``, ``score_candidates``, ``prepare_batch``); nothing of it lives in the baseline.
``build_draft`` is the one place that maps a kind to its class.
"""

from __future__ import annotations

from typing import Any

from dspark_core.draft.config import DRAFT_KINDS, DraftConfig


def draft_class(kind: str) -> type:
    """The draft class of ``draft.kind``."""
    from dspark_core.draft.model import DSparkDraft

    if kind == "baseline":
        return DSparkDraft
    if kind.startswith("engram_"):
        from dspark_core.draft.variants.engram import KINDS

        if kind in KINDS:
            return KINDS[kind]
    if kind == "draft_memory":
        from dspark_core.draft.variants.memory import DraftMemory

        return DraftMemory
    if kind == "reranker":
        from dspark_core.draft.variants.reranker import RerankerDraft

        return RerankerDraft
    raise ValueError(f"draft.kind {kind!r} is not a known draft (known: {', '.join(DRAFT_KINDS)})")


def task_class(kind: str) -> type:
    """The training task of ``draft.kind``: ``DSparkTask``, or a variant's subclass adding its loss terms."""
    if kind == "reranker":
        from dspark_core.draft.variants.reranker import RerankerTask

        return RerankerTask
    from dspark_core.draft.task import DSparkTask

    return DSparkTask


def build_draft(cfg: DraftConfig, target_config: Any, embed_weight: Any, lm_head_weight: Any, **kwargs: Any):
    """A draft of class ``draft_class(cfg.kind)`` (same arguments as ``DSparkDraft``)."""
    return draft_class(cfg.kind)(cfg, target_config, embed_weight, lm_head_weight, **kwargs)


def param_counts(draft: Any) -> dict[str, int]:
    """``draft`` (trainable draft weights, the table excluded), ``variant`` (the variant's own, the seed's
    counts), ``engram_table`` (rows x widths, reported on its own; 0 without one)."""
    table = getattr(draft, "engram_table", None)
    table_keys = {f"engram_table.{k}" for k, _ in table.named_parameters()} if table is not None else set()
    own = sum(p.numel() for k, p in draft.named_parameters() if p.requires_grad and k not in table_keys)
    variant = sum(p.numel() for p in getattr(draft, "variant_params", dict)().values())
    return {"draft": own, "variant": variant, "engram_table": table.num_params if table is not None else 0}
