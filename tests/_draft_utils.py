"""Helpers shared by the draft tests: a teacher-forcing ``sample_fn`` and parameter counts at seed 000's shapes."""

from __future__ import annotations

import torch

from dspark_core.draft.config import DraftConfig
from dspark_core.draft.model import DSparkDraft
from dspark_core.draft.model import build_draft
from dspark_core.draft.variants import param_counts

# Seed 000's draft: 3 layers, hidden 2560, FFN 9728, 24 / 2 heads of 256, Markov rank 256, aux layers 45-47.
SEED000_DRAFT = dict(num_draft_layers=3, block_size=7, markov_rank=256, num_attention_heads=24, num_key_value_heads=2,
                     head_dim=256, mask_token_id=151669)


def teacher_forcing(targets: torch.Tensor, seen: list):
    """A sample_fn that picks the reference token of each slot and records the logits it was given."""
    it = iter(targets.tolist())

    def sample_fn(logits):
        seen.append(logits.clone())
        return torch.tensor([next(it)]), torch.softmax(logits, -1)

    return sample_fn


def seed000_param_counts(kind: str) -> tuple[dict[str, int], dict[str, int]]:
    """``param_counts`` of the baseline and of ``kind`` at seed 000's shapes, built on the meta device."""
    from transformers import Qwen3Config

    tc = Qwen3Config(vocab_size=151936, hidden_size=2560, num_hidden_layers=64, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, tie_word_embeddings=True)
    with torch.device("meta"):
        w = torch.empty(151936, 2560)
        base = param_counts(DSparkDraft(DraftConfig(**SEED000_DRAFT), tc, w, w, aux_layer_ids=(45, 46, 47)))
        counts = param_counts(build_draft(DraftConfig(**SEED000_DRAFT, kind=kind), tc, w, w,
                                          aux_layer_ids=(45, 46, 47)))
    return base, counts
