"""Cache-format items without a cache store: from a (tiny) target model, or random (benchmarks).

An item is what ``CacheDataset`` yields: ``input_ids [L] long, loss_mask [L] bool, aux_hidden [L, K, Ht],
last_hidden [L, Ht]``. ``aux_hidden[:, k]`` is the output of decoder layer ``aux_layer_ids[k]`` (-1 = the
embedding output) and ``last_hidden`` is what the LM head reads (captured at the LM head's input, so it is
the final-normed state whatever the transformers version puts into ``hidden_states[-1]``).

Shape legend: N samples, L tokens, P prompt tokens, K aux layers, Ht target hidden, V vocab.
"""

from __future__ import annotations

from typing import Sequence

import torch


@torch.no_grad()
def target_features(model: torch.nn.Module, input_ids: torch.Tensor,
                    aux_layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, L] -> (aux_hidden [B, L, K, Ht], last_hidden [B, L, Ht]) of a HF causal LM."""
    captured: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        out = model(input_ids=input_ids, output_hidden_states=True)
    finally:
        hook.remove()
    hs = out.hidden_states  # [layers + 1] x [B, L, Ht]; index 0 = embeddings
    aux = torch.stack([hs[layer + 1] for layer in aux_layer_ids], dim=2)  # [B, L, K, Ht]
    return aux, captured[0]


@torch.no_grad()
def sample_responses(model: torch.nn.Module, prompts: torch.Tensor, response_len: int,
                     generator: torch.Generator, temperature: float = 1.0) -> torch.Tensor:
    """prompts [N, P] -> [N, P + response_len]: the model's own sampled continuations (KV-cached)."""
    out = model(input_ids=prompts, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]  # [N, V]
    seqs = [prompts]
    for _ in range(response_len):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        tok = torch.multinomial(probs, 1, generator=generator)  # [N, 1]
        seqs.append(tok)
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    return torch.cat(seqs, dim=1)


def items_from_target(model: torch.nn.Module, aux_layer_ids: Sequence[int], num: int, prompt_len: int,
                      response_len: int, seed: int = 0, token_range: int = 256) -> list[dict[str, torch.Tensor]]:
    """``num`` items whose responses are sampled from ``model`` (so its distributions are learnable)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, token_range, (num, prompt_len), generator=g)  # [N, P]
    ids = sample_responses(model, prompts, response_len, g)  # [N, L]
    aux, last = target_features(model, ids, aux_layer_ids)
    mask = torch.arange(ids.shape[1]) >= prompt_len  # [L]
    return [{"input_ids": ids[n], "loss_mask": mask.clone(), "aux_hidden": aux[n], "last_hidden": last[n]}
            for n in range(num)]


def random_item(length: int, vocab: int, num_aux: int, hidden: int, prompt_len: int,
                generator: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A random item of the cache format (benchmarks): response = positions >= ``prompt_len``."""
    return {
        "input_ids": torch.randint(0, vocab, (length,), generator=generator),
        "loss_mask": torch.arange(length) >= prompt_len,
        "aux_hidden": torch.randn(length, num_aux, hidden, generator=generator).to(dtype),
        "last_hidden": torch.randn(length, hidden, generator=generator).to(dtype),
    }
