"""The peers of the online benchmark on the same prompts: Hugging Face ``generate`` (greedy), assisted generation
with a smaller assistant (``assistant_model``; by default the target's first layers) and prompt-lookup decoding
(``prompt_lookup_num_tokens``): decode tokens/s and whether the greedy output equals ours."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dspark_core.decoding.common import synced_clock
from dspark_core.errors import UserError

PEERS = ("hf_generate", "assisted", "prompt_lookup")


def truncated_assistant(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """An assistant for HF assisted generation sharing the target's tokenizer: the target's first
    ``num_layers`` decoder layers + its final norm and LM head (weights copied)."""
    import copy

    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    if not 1 <= num_layers < cfg.num_hidden_layers:
        raise UserError(f"bench_online.assistant_layers must be in [1, {cfg.num_hidden_layers - 1}]; got {num_layers}")
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    first = next(model.parameters())
    small = AutoModelForCausalLM.from_config(cfg, dtype=first.dtype).to(first.device)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    small.load_state_dict(state, strict=False)
    if getattr(cfg, "tie_word_embeddings", False):
        small.tie_weights()
    return small.eval()


@torch.no_grad()
def peer_comparison(model: torch.nn.Module, prompts: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
                    max_new_tokens: int, stop_ids: Sequence[int], peers: Sequence[str] = PEERS,
                    assistant: torch.nn.Module | None = None, prompt_lookup_num_tokens: int = 10,
                    pad_token_id: int | None = None) -> dict[str, dict[str, Any]]:
    """Greedy HF ``generate`` variants on ``prompts``: decode tokens/s (prefill excluded, estimated by a
    1-token run) and whether each output equals ``reference`` (our AR tokens)."""
    rows: dict[str, dict[str, Any]] = {}
    for peer in peers:
        kwargs: dict[str, Any] = {}
        if peer == "assisted":
            if assistant is None:
                raise UserError("peer 'assisted' needs an assistant model")
            kwargs["assistant_model"] = assistant
        elif peer == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
        tokens = seconds = 0.0
        identical = True
        for prompt, ref in zip(prompts, reference):
            out, decode_s = _timed_generate(model, prompt, max_new_tokens, stop_ids, pad_token_id, kwargs)
            identical &= out == list(ref)
            tokens += max(len(out) - 1, 0)
            seconds += decode_s
        rows[peer] = {"tokens_per_s": tokens / seconds if seconds > 0 else None, "identical": identical}
    return rows


def _timed_generate(model, prompt, max_new_tokens, stop_ids, pad_token_id, kwargs) -> tuple[list[int], float]:
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    common = dict(do_sample=False, eos_token_id=list(stop_ids) or None, pad_token_id=pad_token_id,
                  attention_mask=torch.ones_like(ids), **kwargs)
    clock = synced_clock(device)
    t0 = clock()
    model.generate(ids, max_new_tokens=1, **common)  # the prefill's share
    t1 = clock()
    out = model.generate(ids, max_new_tokens=max_new_tokens, **common)
    t2 = clock()
    return out[0, ids.shape[1]:].tolist(), max((t2 - t1) - (t1 - t0), 1e-9)
