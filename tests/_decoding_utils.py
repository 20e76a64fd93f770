"""Helpers shared by the tests of dspark_core.decoding: a one-thread fixture, the kernel tuner off, and a chi-square
goodness of fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and do not stall when the CPU is shared); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def untuned_kernels(monkeypatch):
    """The kernel tuner off: every product on its first candidate. What the decoding tests check (greedy identity,
    the sampled distribution) must hold for any fixed configuration; each kernel family is checked on its own in
    test_kernels.py, the tuner in test_tuner_times_from_dram_copies. Tuning ~50 candidates for each tiny shape
    made the GPU runs outlast their budget (H200: test_static_engine.py printed nothing in 320 s with the tuner on
    and passed in 101 s with it off; test_tree.py's kernel cases ran past 100 s each)."""
    from dspark_core.kernels import triton_ok, tuning

    if triton_ok("cuda" if torch.cuda.is_available() else "cpu"):
        monkeypatch.setattr(tuning, "TUNE", False)


def chisquare_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """p-value of ``samples`` (cell ids) against the cell probabilities ``probs``.

    A cell of probability 0 must never be observed (asserted; then dropped); cells expected fewer than
    5 times are pooled into one."""
    from scipy.stats import chisquare  # imported here: the GPU machine runs the runner tests without scipy

    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    observed = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    impossible = probs == 0
    assert observed[impossible].sum() == 0, f"sampled impossible cells {np.nonzero(impossible & (observed > 0))}"
    observed, expected = observed[~impossible], probs[~impossible] * len(samples)
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(observed, expected).pvalue)


@torch.no_grad()
def exact_marginals(model: torch.nn.Module, prompt, params, new: int, chunk: int = 4096) -> list[torch.Tensor]:
    """The target's processed distribution of each of its first ``new`` sampled tokens after ``prompt``,
    marginalised over the tokens before it: [new] x [V] float64, by enumerating every prefix of nonzero probability
    (plain HF forwards in float32, no KV cache: tiny models)."""
    from dspark_core.decoding.sampling import logits_to_probs

    dev = next(model.parameters()).device
    prefixes = torch.tensor([list(prompt)], device=dev)  # [R, L]
    mass = torch.ones(1, dtype=torch.float64, device=dev)  # [R]
    out = []
    for _ in range(new):
        nxt = torch.cat([logits_to_probs(model(prefixes[i:i + chunk]).logits[:, -1], params).double()
                         for i in range(0, len(prefixes), chunk)])  # [R, V]
        joint = mass[:, None] * nxt  # [R, V]
        out.append(joint.sum(0).cpu())
        row, tok = joint.nonzero(as_tuple=True)
        prefixes = torch.cat([prefixes[row], tok[:, None]], dim=1)
        mass = joint[row, tok]
    return out


@torch.no_grad()
def greedy_continuations(model: torch.nn.Module, prompts, max_new_tokens: int) -> list[list[int]]:
    """The target's own greedy continuation of each prompt (plain HF forwards, no KV cache: tiny models)."""
    device = next(model.parameters()).device
    out = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], device=device)  # [1, L]
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        out.append(ids[0, len(prompt):].tolist())
    return out


def fit_draft_to_target(draft, model: torch.nn.Module, prompts, continuations, steps: int, lr: float = 1e-2,
                        num_anchors: int = 16, seed: int = 0):
    """Train ``draft`` (a DSparkDraft, in place; returned in eval mode) ``steps`` AdamW steps of its own loss
    (``DSparkTask``: distillation from the target's distributions + confidence) on the target's own outputs:
    ``prompts[i] + continuations[i]``, loss on the continuation. A few steps make a draft that agrees with the
    target part of the time -- the greedy engine then accepts some proposals and rolls back others -- where a
    random draft is (almost) never right. Runs on the model's device; the draft must be there too."""
    import dataclasses

    from dspark_core.draft.config import LossConfig
    from dspark_core.draft.synthetic import target_features
    from dspark_core.draft.task import DSparkTask, DSparkTrainModel
    from dspark_core.train.trainer import _combine as combine_loss

    device = next(model.parameters()).device
    items = []
    for prompt, cont in zip(prompts, continuations, strict=True):
        ids = torch.tensor([list(prompt) + list(cont)], device=device)  # [1, L]
        aux, last = target_features(model, ids, draft.aux_layer_ids)  # [1, L, K, Ht], [1, L, Ht]
        items.append({"input_ids": ids[0].cpu(), "loss_mask": torch.arange(ids.shape[1]) >= len(prompt),
                      "aux_hidden": aux[0].cpu(), "last_hidden": last[0].cpu()})
    cfg = dataclasses.replace(draft.cfg, num_anchors=num_anchors)  # more blocks per step (training only)
    task = DSparkTask(cfg, LossConfig(), target_config=model.config,
                      embed_weight=model.get_input_embeddings().weight.detach(),
                      lm_head_weight=model.get_output_embeddings().weight.detach(),
                      aux_layer_ids=draft.aux_layer_ids, train_data=items, collator=_pad_items)
    train_model = DSparkTrainModel(draft, LossConfig()).train()
    opt = torch.optim.AdamW([p for p in train_model.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        gens = [torch.Generator().manual_seed(seed * 100_003 + step * len(items) + i) for i in range(len(items))]
        batch = task.collate(items, gens)
        combine_loss(task, task.forward_sums(train_model, batch), task.denominators(batch)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return draft.eval()


def _pad_items(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad cache-format items into a batch, as ``CacheCollator(0)`` does (which imports the cache store,
    whose zarr the GPU machine may lack)."""
    lengths = torch.tensor([len(it["input_ids"]) for it in items])  # [B]
    width = int(lengths.max())
    out = {"input_ids": torch.zeros(len(items), width, dtype=torch.long),  # [B, L]
           "loss_mask": torch.zeros(len(items), width, dtype=torch.bool),  # [B, L]
           "attention_mask": torch.arange(width)[None] < lengths[:, None],  # [B, L]
           "aux_hidden": items[0]["aux_hidden"].new_zeros(len(items), width, *items[0]["aux_hidden"].shape[1:]),
           "last_hidden": items[0]["last_hidden"].new_zeros(len(items), width, *items[0]["last_hidden"].shape[1:]),
           "lengths": lengths}
    for i, it in enumerate(items):
        for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            out[key][i, : len(it[key])] = it[key]
    return out


def assert_partial_acceptance(res, block_size: int) -> None:
    """Greedy speculative run ``res`` (a GenerationResult) exercised both paths: 1 < MAL < block_size + 1 (some
    draft tokens accepted, not every block), and some cycle rejected a proposed token (a rollback)."""
    mal = res.mean_accepted_length
    assert 1.0 < mal < block_size + 1, f"MAL {mal:.3f} not in (1, {block_size + 1}): {res.accepted_per_cycle}"
    assert any(a < n for a, n in zip(res.accepted_per_cycle, res.proposal_lengths)), "no cycle rejected a token"
