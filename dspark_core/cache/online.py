"""The target run by the consumer of a split (``train.hidden_states`` / ``eval_offline.hidden_states: online``):
each batch's aux-layer and final normalised hidden states computed in the training (or evaluation) process, equal
to what the cache stage would have stored and :class:`~dspark_core.cache.dataset.CacheDataset` would have read.

Shape legend: B rows of a batch, L row length, G samples of one target forward, W its width, K aux layers,
H hidden.

The cache stage forwards samples in the batches of ``capture.plan_batches`` (store order, ``batch_tokens``), and a
sample's hidden states change in their last bits with the width of the padded batch it is forwarded in (attention
and softmax sum over it), not with the other rows. So a sample read online carries the width and the padding of
its cache-stage batch (``capture.plan_widths``: ``forward_width``, ``forward_padded``); :class:`OnlineTarget`
forwards each group of a batch's samples that share them at that width with :func:`capture.capture_padded` (the
cache stage's own forward and hooks; ``padded`` keeps the attention path of the cache batch), then rounds the
states through the store's encoding (:func:`store.roundtrip_hidden`: bf16, or fp8 e4m3 with its per-token scale).
The target is loaded in the store's compute dtype, frozen, and run under no_grad with autocast off (the trainer's
bf16 autocast does not reach it).

What is equal where: on the CPU in float32 (and bf16 there), the bits of the cache, for bf16 and fp8 aux stores
(tests/test_online.py). On a GPU the same code runs, but matrix and attention kernels may be chosen by the batch's
row count, so a sample forwarded with other rows than in the cache stage may differ in its last bits; the draft
trains on the target's states either way.

Nothing here reads a device tensor on the host: the groups are a host-side plan (:class:`TargetForwards`), the
padded ids and masks are built on the device, so the trainer can queue the target's forward of the next step while
the draft's optimiser step still runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from dspark_core.cache.capture import capture_padded, check_layer_ids, compile_layers, forward_pad_id
from dspark_core.cache.dataset import CacheCollator
from dspark_core.cache.store import roundtrip_hidden
from dspark_core.errors import UserError

PLAN_KEY = "target_forwards"  # the batch key of a TargetForwards (collate) -> aux_hidden / last_hidden (fill)


class TargetForwards:
    """The target forwards of one batch, on the host: ``groups``, a tuple of ``(width, padded, members)``, with
    ``members`` the ``(row, start, length)`` of each sample forwarded in it (where its tokens lie in the batch:
    ``input_ids[row, start:start + length]``). A plain object, not a tensor: batch movers, pinning and DDP's input
    scatter leave it on the host as it is (like ``anchors.TeacherPlan``)."""

    __slots__ = ("groups",)

    def __init__(self, groups: Sequence[tuple[int, bool, Sequence[tuple[int, int, int]]]]) -> None:
        self.groups = tuple((int(w), bool(p), tuple((int(r), int(s), int(n)) for r, s, n in m)) for w, p, m in groups)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TargetForwards) and self.groups == other.groups

    def __repr__(self) -> str:
        return f"TargetForwards({self.groups!r})"


def target_forwards(items: Sequence[dict[str, Any]], places: Sequence[tuple[int, int]],
                    lengths: Sequence[int] | None = None) -> TargetForwards:
    """The forwards of a batch of online items (``CacheDataset(hidden_states="online")``): the items grouped by
    their cache-stage forward (``forward_width``, ``forward_padded``), in order of first appearance; ``places``: the
    ``(row, start)`` of each item in the batch; ``lengths``: its tokens there (default: all of the item's)."""
    groups: dict[tuple[int, bool], list[tuple[int, int, int]]] = {}
    for i, (item, (row, start)) in enumerate(zip(items, places)):
        if "forward_width" not in item:
            raise ValueError("target_forwards: an item without forward_width (read the store with "
                             "CacheDataset(hidden_states='online'))")
        n = len(item["input_ids"]) if lengths is None else int(lengths[i])
        groups.setdefault((int(item["forward_width"]), bool(item["forward_padded"])), []).append((row, start, n))
    return TargetForwards([(w, p, m) for (w, p), m in groups.items()])


class OnlineCollator(CacheCollator):
    """:class:`CacheCollator` over online items (no hidden states), plus the batch's :class:`TargetForwards`
    (one sample a row, from position 0) for :meth:`OnlineTarget.fill`."""

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        out = super().__call__(items)
        out[PLAN_KEY] = target_forwards(items, [(i, 0) for i in range(len(items))], out["lengths"].tolist())
        return out


class OnlineTarget:
    """A frozen target that fills batches with their hidden states as a store of ``aux_dtype`` and its reader
    (``dtype``) would give them (module docstring). ``model``: a HF ``*ForCausalLM`` on its device, in the compute
    dtype of the store; ``layer_ids``: the store's aux layers."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int], aux_dtype: str,
                 dtype: torch.dtype = torch.float32, pad_id: int | None = None, compiled: bool = True) -> None:
        check_layer_ids(layer_ids, model.config.num_hidden_layers)
        self.model = model.eval().requires_grad_(False)
        self.layer_ids, self.aux_dtype, self.dtype = tuple(layer_ids), aux_dtype, dtype
        self.pad_id = forward_pad_id(model.config) if pad_id is None else int(pad_id)
        self.device = next(model.parameters()).device
        self.hidden_size = int(model.config.hidden_size)
        self.set_compiled(compiled)

    def set_compiled(self, on: bool) -> None:
        """The target's decoder layers under torch.compile (``capture.compile_layers``) where it runs on a GPU and
        ``on``; eager on the CPU (the cache's bits) or when off."""
        self.compiled = bool(on) and self.device.type == "cuda"
        compile_layers(self.model, self.compiled)

    @classmethod
    def load(cls, target_dir: str | Path, manifest: dict[str, Any], device: str | torch.device,
             dtype: torch.dtype = torch.float32, compiled: bool = True) -> "OnlineTarget":
        """The target of ``target_dir`` on ``device`` for a store of ``manifest`` (its compute dtype, aux layers
        and aux dtype); refuses a target other than the store's."""
        from dspark_core.target import load_target, read_fingerprint

        fingerprint = read_fingerprint(target_dir)["fingerprint"]
        if fingerprint != manifest["model_fingerprint"]:
            raise UserError(f"{target_dir}: target fingerprint {fingerprint}, but the cache store was made for "
                            f"{manifest['model_fingerprint']}; rerun the cache stage")
        model, _ = load_target(target_dir, dtype=manifest["compute_dtype"], device=device)
        return cls(model, manifest["aux_layer_ids"], manifest["aux_dtype"], dtype, compiled=compiled)

    def fill(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` (on the target's device, with its :class:`TargetForwards`) plus ``aux_hidden [B, L, K, H]`` and
        ``last_hidden [B, L, H]`` in ``dtype``, zeros where no sample lies (padding), the plan dropped."""
        plan = batch.get(PLAN_KEY)
        if not isinstance(plan, TargetForwards):
            raise ValueError(f"OnlineTarget.fill: the batch has no {PLAN_KEY} (collate it from online items)")
        ids = batch["input_ids"]  # [B, L]
        if ids.device != self.device:
            raise ValueError(f"OnlineTarget.fill: batch on {ids.device}, the target on {self.device}")
        rows, length = ids.shape
        aux_out = torch.zeros((rows, length, len(self.layer_ids), self.hidden_size), dtype=self.dtype,
                              device=ids.device)  # [B, L, K, H]
        last_out = torch.zeros((rows, length, self.hidden_size), dtype=self.dtype, device=ids.device)  # [B, L, H]
        with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):
            for width, padded, members in plan.groups:
                aux, last = self.forward(ids, width, padded, members)  # [G, W, K, H], [G, W, H]
                for g, (row, start, n) in enumerate(members):
                    aux_out[row, start:start + n] = aux[g, :n]
                    last_out[row, start:start + n] = last[g, :n]
        out = {k: v for k, v in batch.items() if k != PLAN_KEY}
        out.update(aux_hidden=aux_out, last_hidden=last_out)
        return out

    def forward(self, ids: torch.Tensor, width: int, padded: bool,
                members: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward of ``members`` of ``ids [B, L]``, each right-padded to ``width`` -> ``(aux [G, W, K, H],
        last [G, W, H])`` as the store's reader gives them (garbage past each sample's length)."""
        group = torch.full((len(members), width), self.pad_id, dtype=torch.long, device=ids.device)  # [G, W]
        valid = torch.zeros((len(members), width), dtype=torch.bool, device=ids.device)  # [G, W]
        for g, (row, start, n) in enumerate(members):
            group[g, :n] = ids[row, start:start + n]
            valid[g, :n] = True
        aux, last = capture_padded(self.model, group, valid, self.layer_ids, padded)  # compute dtype
        return roundtrip_hidden(aux, last, self.aux_dtype, self.dtype)
