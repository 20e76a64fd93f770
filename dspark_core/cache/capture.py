"""One target forward over a padded batch, capturing the aux layers and the final normalised hidden state.

Forward hooks on the decoder layers (a pre-hook on layer 0 for id -1, the embedding output, and a hook
on the final norm) keep only the K + 1 tensors the cache stores, instead of every layer's output as
``output_hidden_states`` would; the base model is called without the LM head, so no ``[B, L, V]``
logits are ever built. Layer id ``l`` is HF ``hidden_states[l + 1]``; ``last`` is ``hidden_states[-1]``
(the output of the final norm, what the LM head reads).

Shape legend: B batch, L tokens (padded), K aux layers, H hidden.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dspark_core.errors import UserError

LAYER_IDS_FIELD = "cache.aux_layer_ids"


def check_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int, field: str = LAYER_IDS_FIELD) -> None:
    """Refuse an empty list, duplicates, ids outside ``-1 .. num_hidden_layers - 2`` and the final layer."""
    ids = list(layer_ids)
    if not ids:
        raise UserError(f"{field}: needs at least one layer id; got {ids}")
    for lid in ids:
        if isinstance(lid, bool) or not isinstance(lid, int):
            raise UserError(f"{field}: layer ids must be integers; got {lid!r} in {ids}")
        if lid == num_hidden_layers - 1:
            raise UserError(
                f"{field}: {lid} is the final decoder layer of this {num_hidden_layers}-layer target; its "
                f"normalised output is always stored as last_hidden, so it cannot be an aux layer (got {ids})")
        if not -1 <= lid < num_hidden_layers - 1:
            raise UserError(f"{field}: layer id {lid} is out of range for a {num_hidden_layers}-layer target "
                            f"(allowed -1 .. {num_hidden_layers - 2}; -1 = embedding output); got {ids}")
    dups = sorted({lid for lid in ids if ids.count(lid) > 1})
    if dups:
        raise UserError(f"{field}: duplicate layer id(s) {dups} in {ids}")


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """``(base model without LM head, decoder layers, final norm)`` of a HF ``*ForCausalLM``."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise UserError(f"{type(model).__name__}: expected a Qwen3/Qwen2/Llama *ForCausalLM "
                        f"(with .model.layers and .model.norm)")
    return base, base.layers, base.norm


COMPILED_TARGET_SHAPES = 256  # torch._dynamo's recompile limit for the compiled target layers (widths x layers)


def compile_layers(model: nn.Module, on: bool = True) -> None:
    """Each decoder layer of ``model`` runs its ``forward`` under ``torch.compile`` (on) or eagerly (off, the
    class's own). The compiled layer fuses the norms, RoPE, activation and residual adds that an eager layer runs as
    separate kernels; the layer hooks (:class:`HiddenCapture`) stay outside it. The first forward at a width
    compiles (a second width makes the compiled graph shape-dynamic). Inductor's ``emulate_precision_casts``
    rounds the fused intermediates where the eager layers round them, so the states agree with the eager layers'
    to bf16 rounding, bit for bit at most widths but not all (tests/test_online_gpu.py: the unpadded width 96
    differs on an H100); without it they drift by a few bf16 ulps a layer."""
    _, layers, _ = decoder_parts(model)
    for layer in layers:
        layer.__dict__.pop("forward", None)  # the class's forward again
    if not on:
        return
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(COMPILED_TARGET_SHAPES, getattr(torch._dynamo.config, name)))
    for layer in layers:
        layer.forward = torch.compile(layer.forward, options={"emulate_precision_casts": True})  # eager rounding


def _first_tensor(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class HiddenCapture:
    """While active, each forward of ``model`` records ``outputs[layer_id]`` and ``outputs['last']`` ([B, L, H])."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        _, self.layers, self.norm = decoder_parts(model)
        check_layer_ids(layer_ids, len(self.layers))
        self.layer_ids = tuple(layer_ids)
        self.outputs: dict[int | str, torch.Tensor] = {}
        self._handles: list = []

    def _record(self, key: int | str, h: torch.Tensor) -> None:
        self.outputs[key] = h  # [B, L, H]

    def __enter__(self) -> "HiddenCapture":
        for lid in self.layer_ids:
            if lid == -1:  # the input of decoder layer 0 = the embedding output
                self._handles.append(self.layers[0].register_forward_pre_hook(
                    lambda mod, args, kwargs: self._record(-1, args[0] if args else kwargs["hidden_states"]),
                    with_kwargs=True))
            else:
                self._handles.append(self.layers[lid].register_forward_hook(
                    lambda mod, args, out, lid=lid: self._record(lid, _first_tensor(out))))
        self._handles.append(self.norm.register_forward_hook(
            lambda mod, args, out: self._record("last", _first_tensor(out))))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def forward_pad_id(config) -> int:
    """Token id used for right padding (its value never reaches real tokens under the causal mask)."""
    pad_id = getattr(config, "pad_token_id", None)
    return pad_id if isinstance(pad_id, int) else 0


def pad_batch(seqs: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D token tensors -> ``(input_ids [B, L] long, attention_mask [B, L] long)``."""
    width = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, L]
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s
        mask[i, : s.numel()] = 1
    return ids, mask


@torch.inference_mode()
def capture_batch(model: nn.Module, seqs: Sequence[torch.Tensor], layer_ids: Sequence[int],
                  pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the right-padded batch -> ``(aux [B, L, K, H], last [B, L, H])`` in the compute dtype.

    Positions past a sample's length hold padding garbage; callers slice ``[:len]``.
    """
    device = next(model.parameters()).device
    ids, mask = pad_batch(seqs, pad_id)
    padded = any(int(s.numel()) < ids.shape[1] for s in seqs)
    return capture_padded(model, ids.to(device), mask.to(device).bool(), layer_ids, padded)


def unpadded_mask(model: nn.Module) -> dict[str, None] | None:
    """The ``attention_mask`` of an SDPA forward whose rows hold no padding: no mask, so SDPA runs its causal kernel.

    Given ``None``, transformers checks the position ids for packed sequences, a host read in every forward. A
    model whose forward takes its masks precomputed by layer type (``config.layer_types``: Qwen3 and its kind) is
    given ``{"full_attention": None}``, the mask transformers would have built, and skips that check; other models
    (Llama) get ``None`` and pay the read.
    """
    types = getattr(model.config, "layer_types", None)
    return {"full_attention": None} if types and set(types) == {"full_attention"} else None


def capture_padded(model: nn.Module, ids: torch.Tensor, valid: torch.Tensor, layer_ids: Sequence[int],
                   padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``ids [B, W]`` (on the model's device; ``valid [B, W]`` bool: False on right padding) ->
    ``(aux [B, W, K, H], last [B, W, H])``: what the cache stage's :func:`capture_batch` computes, and the online
    path (``cache/online.py``) with it. Runs in the caller's grad mode; reads nothing back to the host.

    ``padded``: whether the batch the cache stage forwarded held padding, which decides the attention path as
    transformers decides it for a 2-D mask (an explicit mask when any row is padded, else the plain causal
    kernel), so a sample forwarded here alone, at the same width, takes the path it took in its cache batch. For
    SDPA targets (``load_target``'s) the 4-D mask is built here from ``valid``, the boolean mask transformers
    builds itself (``causal & padding``), so transformers has no mask to inspect on the host (a device sync per
    forward otherwise); other attention implementations get the 2-D mask.
    """
    base, _, _ = decoder_parts(model)
    width = ids.shape[1]
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        mask = valid.long()  # [B, W]
    elif padded:
        pos = torch.arange(width, device=ids.device)  # [W]
        causal = (pos.unsqueeze(1) >= pos.unsqueeze(0))[None, None]  # [1, 1, W, W]
        mask = causal & valid[:, None, None, :]  # [B, 1, W, W]
    else:
        mask = unpadded_mask(model)  # no row padded: the causal kernel, as transformers picks it for all-ones
    with HiddenCapture(model, layer_ids) as cap:
        base(input_ids=ids, attention_mask=mask, use_cache=False)
    aux = torch.stack([cap.outputs[lid] for lid in layer_ids], dim=2)  # [B, W, K, H]
    return aux, cap.outputs["last"]  # [B, W, K, H], [B, W, H]


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[tuple[int, int]]:
    """Split samples 0..N-1 (in order) into ``[start, end)`` batches whose padded size fits ``batch_tokens``.

    Padded size = count x longest sample; a batch always holds at least one sample. A pure function of
    the lengths, so a resumed run and ``verify_cache`` rebuild exactly the batches of the first run.
    """
    plan, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        wider = max(longest, int(n))
        if i > start and wider * (i - start + 1) > batch_tokens:
            plan.append((start, i))
            start, wider = i, int(n)
        longest = wider
    if len(lengths) > start:
        plan.append((start, len(lengths)))
    return plan


def plan_widths(lengths: Sequence[int], batch_tokens: int) -> tuple[list[int], list[bool]]:
    """``(width [N], padded [N])`` of samples 0..N-1 (store order): the width sample n was padded to in its
    :func:`plan_batches` forward (its batch's longest sample) and whether that forward held padding (a shorter
    sample beside it). A sample's hidden states depend, in their last bits, on that width (attention and softmax
    sum over it), not on the other rows of the batch: forwarded alone at this width and path
    (:func:`capture_padded`), it gets the cache's bits (``cache/online.py``)."""
    widths: list[int] = []
    padded: list[bool] = []
    for start, end in plan_batches(lengths, batch_tokens):
        batch = [int(n) for n in lengths[start:end]]
        width = max(batch)
        widths += [width] * len(batch)
        padded += [min(batch) < width] * len(batch)
    return widths, padded


def nonfinite_rows(aux: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool: positions where any aux layer or the last hidden state holds NaN or inf."""
    bad_aux = ~torch.isfinite(aux).flatten(2).all(dim=-1)  # [B, L]
    return bad_aux | ~torch.isfinite(last).all(dim=-1)  # [B, L]
