"""``DMTDTask``: the shared trainer's ``TrainTask`` for Parallel DMTD fine-tuning of the target.

The model is the target itself wrapped as :class:`DMTDModel` (all weights trainable unless
``dmtd.freeze_embeddings``); the data are packed regenerated samples (``dmtd/data.py``); the loss is
the plain next-token CE summed over supervised tokens, normalised by their global count.

Shape legend: B rows of a micro-batch, L tokens of a row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark_core.dmtd.config import DMTDConfig, parse_variant
from dspark_core.dmtd.data import PackStats, collate_rows, load_packed
from dspark_core.dmtd.model import IGNORE, DMTDModel
from dspark_core.errors import UserError
from dspark_core.train.task import TermSpec


class DMTDTask:
    terms = {"ce": TermSpec(1.0, "tokens")}
    metric_denominators = {"token_acc": "tokens"}

    def __init__(self, cfg: DMTDConfig, variant: str):
        parse_variant(variant)
        self.cfg = cfg
        self.variant = variant
        self.name = f"dmtd_{variant}"
        self.pack_stats: dict[str, PackStats] = {}
        self._rows: dict[str, list[dict[str, torch.Tensor]]] = {}

    def _target_config(self):
        from transformers import AutoConfig

        from dspark_core.target import remote_code_kwargs

        path = Path(self.cfg.target_dir)
        if not (path / "config.json").is_file():
            raise UserError(f"dmtd.target_dir={path}: no config.json; run the target stage first or fix the path")
        return AutoConfig.from_pretrained(path, local_files_only=True, **remote_code_kwargs(path))

    def build_model(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        from dspark_core.target import load_target

        if self.cfg.attn_backend == "flex" and device.type != "cuda":
            raise UserError(f"dmtd.attn_backend: flex trains on CUDA only (flex_attention has no backward on "
                            f"{device.type}); set it to auto or dense")
        lm, _ = load_target(self.cfg.target_dir, dtype=dtype, device=device)
        model = DMTDModel.from_config(lm, self.cfg, self.variant)
        if self.cfg.freeze_embeddings:
            model.lm.model.embed_tokens.weight.requires_grad_(False)
        return model.train()

    def rows(self, split: str) -> list[dict[str, torch.Tensor]]:
        """Packed rows of ``{regen_dir}/{split}.parquet`` (read once)."""
        if split not in self._rows:
            cfg = self.cfg
            rows, stats = load_packed(Path(cfg.regen_dir) / f"{split}.parquet", cfg.max_length, cfg.loss_on,
                                      pad_id=cfg.mask_token_id, vocab_size=self._target_config().vocab_size)
            self._rows[split], self.pack_stats[split] = rows, stats
        return self._rows[split]

    def train_dataset(self) -> list[dict[str, torch.Tensor]]:
        return self.rows("train")

    def eval_dataset(self) -> list[dict[str, torch.Tensor]]:
        return self.rows("eval")

    def collate(self, items: list[dict[str, torch.Tensor]], generators: Any = None) -> dict[str, torch.Tensor]:
        return collate_rows(items)  # packing is deterministic: nothing random here

    def denominators(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"tokens": (batch["labels"] != IGNORE).sum()}

    def forward_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                     doc_ids=batch["doc_ids"])
