"""Draft variants, one file each, selected by ``draft.kind`` in params.yaml.

A variant subclasses :class:`~dspark_core.draft.model.DSparkDraft`, names its kind in the class statement
(``class MyDraft(DSparkDraft, kind="my_kind")``, which registers it) and overrides the hooks it needs
(``block_inputs``, ``markov_features``, ``extra_kv``, ``score_candidates``, ``prepare_batch``); nothing of
it lives in the baseline. A variant with loss terms of its own registers its training task the same way
(``class MyTask(DSparkTask, kind="my_kind")``). Adding a variant is one new file here plus its line below
(and its params); importing this package registers them all.
"""

from __future__ import annotations

from typing import Any

from dspark_core.draft.variants import engram, memory, reranker  # noqa: F401  (each registers its kinds)


def param_counts(draft: Any) -> dict[str, int]:
    """``draft`` (trainable draft weights, the table excluded), ``variant`` (the variant's own weights),
    ``engram_table`` (rows x widths, reported on its own; 0 without one)."""
    table = getattr(draft, "engram_table", None)
    table_keys = {f"engram_table.{k}" for k, _ in table.named_parameters()} if table is not None else set()
    own = sum(p.numel() for k, p in draft.named_parameters() if p.requires_grad and k not in table_keys)
    variant = sum(p.numel() for p in getattr(draft, "variant_params", dict)().values())
    return {"draft": own, "variant": variant, "engram_table": table.num_params if table is not None else 0}
