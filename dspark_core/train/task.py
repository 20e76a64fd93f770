"""What the shared trainer needs from a model family (DSpark draft, Parallel DMTD, ...).

The trainer (``dspark_core.train.trainer``) owns the optimiser, schedule, gradient accumulation,
DDP, checkpoints and logging. A ``TrainTask`` owns the model, the data and the loss.

Losses are written as *sums over a micro-batch* divided by *denominators that depend only on the
data* (e.g. the sum of position-decay weights of the valid slots). The trainer sums every
denominator over the micro-batches of one optimiser step and over all ranks **before** the
backward passes, so the gradient of a global batch split over G ranks x M micro-batches equals
the gradient of the same batch in one piece (exactly, up to float summation order).

    loss = sum_t  terms[t].weight * sums[t] / D[terms[t].denominator]

Metrics logged alongside (tau_prob, accept_rate@i, ...) are reported as
``sums[m] / D[metric_denominators[m]]`` over the same global batch.

Anything random in a batch (anchor sampling, ...) happens in ``collate`` with the generators the
trainer passes: ONE torch.Generator PER ITEM, seeded from (seed, step, the item's place in the global
batch). So a resumed run sees the same batches, and a global batch gives the same samples however it is
split over ranks and micro-batches (1 GPU x 8 accumulation == 8 GPUs x 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class TermSpec:
    weight: float
    denominator: str


class TrainTask(Protocol):
    name: str
    terms: dict[str, TermSpec]
    metric_denominators: dict[str, str]

    def build_model(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The module to train; frozen parts have ``requires_grad=False``."""

    def train_dataset(self) -> Sequence[Any]:
        """Indexable training samples."""

    def collate(self, items: list[Any], generators: list[torch.Generator]) -> dict[str, torch.Tensor]:
        """Batch ``items``; item j's randomness comes only from ``generators[j]``."""

    def denominators(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Data-only denominators (scalars) for this micro-batch."""

    def forward_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loss numerators (keys of ``terms``) and metric numerators (keys of ``metric_denominators``)."""

    # Optional: ``prepare_step(model, batches) -> batches``. Called once per optimiser step on the device
    # micro-batches, under no_grad with the unwrapped model, BEFORE ``denominators``: for supervision that
    # depends on the model (Draft Memory's stage-1 anchor moves, the reranker's candidate hits), so the
    # global denominators still come before any backward.
