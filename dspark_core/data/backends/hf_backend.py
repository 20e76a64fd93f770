"""Regenerate backend ``hf``: batched ``model.generate`` of transformers with left padding.

Shape legend: B batch, L prompt tokens (padded), N new tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import torch

from dspark_core.data.backends.base import Generation, Request, SamplingSpec


class HFBackend:
    name = "hf"

    def __init__(self, target_dir: str | Path, sampling: SamplingSpec, eos_ids: Sequence[int],
                 dtype: str = "float32", device: str = "cpu", threads: int | None = None):
        from dspark_core.target import load_target

        if threads is not None:
            torch.set_num_threads(threads)
        self.model, self.tok = load_target(target_dir, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.sampling = sampling
        self.eos_ids = list(eos_ids)
        pad = self.tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]

    def _generation_config(self):
        from transformers import GenerationConfig

        s = self.sampling
        sample = dict(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None)
        greedy = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        return GenerationConfig(max_new_tokens=s.max_new_tokens, eos_token_id=self.eos_ids,
                                pad_token_id=self.pad_id, **(greedy if s.greedy else sample))

    def _left_pad(self, requests: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)  # [B, L]
        mask = torch.zeros((len(requests), width), dtype=torch.long)              # [B, L]
        for b, r in enumerate(requests):
            ids[b, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[b, width - len(r.prompt_ids):] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        if not requests:
            return []
        ids, mask = self._left_pad(requests)  # [B, L]
        if not self.sampling.greedy:
            # one RNG stream per batch, fixed by the batch's request seeds
            torch.manual_seed(int(hashlib.sha256(str([r.seed for r in requests]).encode()).hexdigest()[:8], 16))
        out = self.model.generate(input_ids=ids, attention_mask=mask,
                                  generation_config=self._generation_config())  # [B, L + N]
        new = out[:, ids.shape[1]:].cpu()  # [B, N]; finished rows are padded with pad_id
        # finalize_response cuts at the first EOS; rows without one ran to max_new_tokens
        return [Generation(row.tolist(), "length") for row in new]

    def close(self) -> None:
        self.model = None
