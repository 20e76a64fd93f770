"""Engram variants (seed 000): the hashed n-gram lookup against its formula, training forward == single-block
inference for each variant, the zero-init equivalences, parameter counts at seed shapes, frozen tables
(engram_build) and the online engine (greedy output identical to AR, with partial acceptance)."""

from __future__ import annotations

import math

import pytest
import torch

from _draft_utils import seed000_param_counts, teacher_forcing
from dspark_core.cache.dataset import CacheCollator
from dspark_core.checkpoint import load_draft, save_draft
from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.draft.config import DraftConfig, EngramConfig
from dspark_core.draft.model import DSparkDraft
from dspark_core.draft.synthetic import items_from_target
from dspark_core.draft.model import build_draft, draft_class
from dspark_core.draft.variants.engram import (EngramTable, build_frozen_table, is_prime, read_frozen_table,
                                               table_primes, write_frozen_table)
from dspark_core.errors import UserError
from dspark_core.testing import tiny_model

AUX = (0, 2, 4)
S = 4
KINDS = ("engram_markov", "engram_mask_gated", "engram_mask_replace")
SMALL = EngramConfig(orders=(1, 2, 3), heads_per_order=2, table_rows=31)


def _cfg(kind: str, **over) -> DraftConfig:
    base = dict(num_draft_layers=2, block_size=S, mask_token_id=259, num_anchors=6, markov_rank=8, kind=kind,
                engram=SMALL)
    return DraftConfig(**{**base, **over})


def _draft(model, kind: str, seed: int = 1, perturb: bool = True, **over):
    torch.manual_seed(seed)
    d = build_draft(_cfg(kind, **over), model.config, model.get_input_embeddings().weight,
                    model.get_output_embeddings().weight, aux_layer_ids=AUX)
    if perturb:  # non-zero gates and W_V, so every Engram path changes the output
        with torch.no_grad():
            for name, p in d.named_parameters():
                if p.requires_grad and name in ("engram_gate", "engram_v.weight"):
                    p.copy_(0.5 * torch.randn_like(p))
    return d.eval()


_ITEMS: dict = {}


def _batch(model, n=3, anchors=4, seed=0):
    key = (model.config.model_type, n, seed)
    if key not in _ITEMS:
        items = items_from_target(model, AUX, n, 5, 19, seed=seed)
        items[1] = {k: v[:-4] for k, v in items[1].items()}  # ragged
        _ITEMS[key] = items
    return add_anchor_fields(CacheCollator(0)(_ITEMS[key]), anchors, S, torch.Generator().manual_seed(seed))


# -- the lookup -------------------------------------------------------------------------------------------
def test_primes_and_hash_against_the_formula():
    cfg = EngramConfig(orders=(2, 3), heads_per_order=3, table_rows=100)
    rows = table_primes(cfg)
    assert rows == [101, 103, 107, 101, 103, 107] and all(is_prime(r) for r in rows)
    table = EngramTable(cfg, 30)
    assert table.widths == [5] * 6 and table.num_params == 5 * sum(rows)
    ids = torch.randint(0, 1000, (2, 9))
    pos = torch.tensor([[-1, 0, 1, 2, 8], [3, 4, 5, 6, 7]])
    bucket, valid = table.buckets(ids, pos)
    for b in range(2):
        for p in range(5):
            t = int(pos[b, p])
            for k, n in enumerate(table.head_orders):
                ok = t - n + 1 >= 0
                assert bool(valid[b, p, k]) == ok
                if ok:
                    want = sum((int(ids[b, t - j]) + 1) * int(table.mult[k, j]) for j in range(n)) % rows[k]
                    assert int(bucket[b, p, k]) == want
    e = table.lookup(ids, pos)  # [2, 5, 30]
    assert torch.equal(e[0, 0], torch.zeros(30))  # no predecessor: zeros
    assert torch.equal(e[0, 1, 5:], torch.zeros(25)) and e[0, 1, :5].abs().sum() == 0  # order 2/3 incomplete
    assert e[1, 0].abs().min() > 0  # every head complete


def test_lookup_depends_only_on_the_last_n_tokens():
    table = EngramTable(SMALL, 12)
    a = torch.tensor([[5, 6, 7, 8, 9]])
    b = torch.tensor([[1, 2, 7, 8, 9]])
    torch.testing.assert_close(table.lookup(a, torch.tensor([[4]])), table.lookup(b, torch.tensor([[4]])))
    c = torch.tensor([[1, 2, 3, 8, 9]])  # the 3-gram differs, the 1- and 2-grams agree
    diff = (table.lookup(a, torch.tensor([[4]])) - table.lookup(c, torch.tensor([[4]])))[0, 0]
    assert diff[:8].abs().sum() == 0 and diff[8:].abs().sum() > 0


# -- training forward == single-block inference ------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", KINDS)
def test_training_forward_equals_single_block_inference(family, kind):
    target = tiny_model(family)
    draft = _draft(target, kind)
    batch = _batch(target)
    with torch.no_grad():
        h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"],
                                extras=batch)
        m = draft.markov_features(batch["prev_tokens"], h, batch)
        train_logits = draft.slot_logits(h) + draft.markov_bias(m).float()
        base = DSparkDraft.markov_features(draft, batch["prev_tokens"], h, batch)
    if kind == "engram_markov":
        assert (m - base).abs().max() > 1e-3  # the Engram path is live
    checked = 0
    for b, a in batch["anchor_valid"].nonzero().tolist():
        p = int(batch["anchors"][b, a])
        cache = draft.new_context_cache(batch=1, max_len=64)
        draft.extend_context(cache, batch["aux_hidden"][b:b + 1, :p])
        hist = batch["input_ids"][b:b + 1, max(0, p + 1 - draft.token_history):p + 1]  # what the engine passes
        extras = {"input_ids": hist, "anchors": torch.tensor([[hist.shape[1] - 1]])}
        anchor = batch["input_ids"][b, p].view(1)
        h_inf = draft.forward_block(cache, anchor, extras)[0]  # [S, H]
        torch.testing.assert_close(h_inf, h[b, a], rtol=0, atol=1e-5)
        seen: list = []
        draft.propose(cache, anchor, teacher_forcing(batch["targets"][b, a], seen), extras=extras)
        valid = int(batch["slot_valid"][b, a].sum())
        torch.testing.assert_close(torch.cat(seen)[:valid], train_logits[b, a, :valid], rtol=0, atol=1e-5)
        checked += 1
    assert checked == 12


# -- zero-init equivalences -------------------------------------------------------------------------------
def _baseline_with_same_weights(model, variant):
    torch.manual_seed(0)
    cfg = DraftConfig(**{**variant.cfg.to_dict(), "kind": "baseline", "engram": SMALL})
    base = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                       aux_layer_ids=AUX)
    missing, unexpected = base.load_state_dict(variant.state_dict(), strict=False)
    assert not missing and all(k.startswith("engram_") for k in unexpected)
    return base.eval()


@pytest.mark.parametrize("kind", ["engram_markov", "engram_mask_gated"])
def test_zero_init_equals_baseline(kind):
    target = tiny_model("qwen3")
    draft = _draft(target, kind, perturb=False)
    base = _baseline_with_same_weights(target, draft)
    batch = _batch(target)
    with torch.no_grad():
        h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"],
                                extras=batch)
        hb = base.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
        torch.testing.assert_close(h, hb, rtol=0, atol=0)
        m = draft.markov_features(batch["prev_tokens"], h, batch)
        torch.testing.assert_close(m, base.markov_features(batch["prev_tokens"], hb, None), rtol=0, atol=0)


def test_replace_is_not_the_baseline_and_reads_the_pre_anchor_feature():
    target = tiny_model("qwen3")
    draft = _draft(target, "engram_mask_replace")
    batch = _batch(target)
    x = draft.block_inputs(batch["input_ids"].gather(1, batch["anchors"]), batch)  # [B, A, S, Ht]
    e = draft.engram_table.lookup(batch["input_ids"], batch["anchors"] - 1)
    z = draft.engram_proj(e)
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
    valid = batch["anchor_valid"]
    torch.testing.assert_close(x[valid][:, 1:], z[valid].unsqueeze(1).expand(-1, S - 1, -1), rtol=0, atol=1e-6)
    assert (x[valid][:, 0] == target.get_input_embeddings().weight[batch["input_ids"].gather(1, batch["anchors"])
                                                                   [valid]]).all()


# -- the variants' formulas on a 4-wide example, written out by hand ------------------------------------------------
# Every head row holds one vector, so the feature is known without the hash: e = [1, -2] (order 1) ++ [0.5, 3]
# (order 2) where both n-grams are complete, [1, -2, 0, 0] at position 0 (no bigram), zeros at position -1.
E_FULL, E_UNIGRAM = [1.0, -2.0, 0.5, 3.0], [1.0, -2.0, 0.0, 0.0]
HAND_ENGRAM = EngramConfig(orders=(1, 2), heads_per_order=1, table_rows=5)


def _rms(v: list[float]) -> list[float]:
    """N: x / sqrt(mean(x^2) + 1e-6), no affine."""
    scale = 1.0 / math.sqrt(sum(x * x for x in v) / len(v) + 1e-6)
    return [x * scale for x in v]


def _matvec(w: list[list[float]], x: list[float]) -> list[float]:
    return [sum(a * b for a, b in zip(row, x)) for row in w]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _hand_draft(kind: str):
    """A 4-wide target (vocab 8, MASK = token 7), r = 2, block of 3, tables filled with E_FULL's halves."""
    model = tiny_model("qwen3", vocab_size=8, hidden_size=4, intermediate_size=8, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=2, num_hidden_layers=3, eos_token_id=None, pad_token_id=None)
    cfg = DraftConfig(num_draft_layers=1, block_size=3, mask_token_id=7, num_anchors=2, markov_rank=2, kind=kind,
                      engram=HAND_ENGRAM)
    d = build_draft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                    aux_layer_ids=(0, 1)).eval()
    with torch.no_grad():
        d.engram_table.tables[0].weight.copy_(torch.tensor([E_FULL[:2]] * 5))
        d.engram_table.tables[1].weight.copy_(torch.tensor([E_FULL[2:]] * 5))
    return d


def _set(param: torch.Tensor, values) -> None:
    with torch.no_grad():
        param.copy_(torch.tensor(values, dtype=param.dtype))


HAND_IDS = torch.tensor([[3, 5, 2, 6, 1, 4]])  # [1, L]


def test_engram_markov_gate_by_hand():
    """m_i = W1[t_{i-1}] + g_i v_i, q = N(W_Q N(h)), k = N(W_K N(e)), v = W_V N(e), s = q.k / sqrt(r),
    g = sigmoid(sign(s) sqrt(max(|s|, 1e-6))), against plain arithmetic at two anchors (one at position 0)."""
    d = _hand_draft("engram_markov")
    w_q, w_k, w_v = [[1.0, 0.0, 2.0, -1.0], [0.5, 1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0, 2.0], [1.0, 0.0, -1.0, 0.0]], \
        [[0.5, -1.0, 0.0, 1.0], [2.0, 0.0, 1.0, 0.0]]
    _set(d.engram_q.weight, w_q)
    _set(d.engram_k.weight, w_k)
    _set(d.engram_v.weight, w_v)
    w1 = [[0.1 * t, -0.2 * t] for t in range(8)]
    _set(d.markov.w1.weight, w1)
    anchors = torch.tensor([[0, 3]])  # [1, A]
    prev = torch.tensor([[[3, 5, 2], [6, 1, 4]]])  # [1, A, S]: t_0 = the anchor, then the reference tokens
    hidden = torch.tensor([[[[3.0, -1.0, 0.5, 2.0], [-2.0, 1.0, 3.0, 0.0], [0.2, 0.4, -3.0, 1.0]],
                            [[1.0, 1.0, 1.0, -1.0], [0.0, -2.0, 4.0, 1.0], [5.0, 0.0, 0.0, -1.0]]]])
    with torch.no_grad():
        got = d.markov_features(prev, hidden, {"input_ids": HAND_IDS, "anchors": anchors})  # [1, A, S, r]
    signs = set()
    for a in range(2):
        for i in range(3):
            e = E_UNIGRAM if int(anchors[0, a]) + i == 0 else E_FULL  # the prefix ending at t_{i-1}
            e_bar = _rms(e)
            q = _rms(_matvec(w_q, _rms(hidden[0, a, i].tolist())))
            k = _rms(_matvec(w_k, e_bar))
            v = _matvec(w_v, e_bar)
            s = sum(x * y for x, y in zip(q, k)) / math.sqrt(2)
            g = _sigmoid(math.copysign(math.sqrt(max(abs(s), 1e-6)), s))
            want = [w1[int(prev[0, a, i])][c] + g * v[c] for c in range(2)]
            torch.testing.assert_close(got[0, a, i], torch.tensor(want), rtol=1e-5, atol=1e-6)
            signs.add(s > 0)
    assert signs == {True, False}  # both branches of sign(s) are exercised


def test_engram_mask_gated_input_by_hand():
    """Slot j >= 1: E(MASK) + tanh(theta_j) N(P e_{a-1}) (the norm after the projection); the anchor: E(x_a)."""
    d = _hand_draft("engram_mask_gated")
    p = [[1.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0], [-1.0, 0.0, 3.0, 0.0], [0.0, 0.0, 1.0, 1.0]]
    _set(d.engram_proj.weight, p)
    _set(d.engram_gate, [0.7, -1.3])
    emb = [[float(t), 1.0, -float(t), 0.5] for t in range(8)]
    _set(d.embedding_matrix(), emb)
    anchors = torch.tensor([[2, 4]])  # e_{a-1} at positions 1 and 3: both n-grams complete
    with torch.no_grad():
        x = d.block_inputs(HAND_IDS.gather(1, anchors), {"input_ids": HAND_IDS, "anchors": anchors})  # [1, A, S, 4]
    z = _rms(_matvec(p, E_FULL))
    for a in range(2):
        anchor_tok = int(HAND_IDS[0, anchors[0, a]])
        torch.testing.assert_close(x[0, a, 0], torch.tensor(emb[anchor_tok]), rtol=0, atol=0)
        for j, theta in ((1, 0.7), (2, -1.3)):
            want = [emb[7][c] + math.tanh(theta) * z[c] for c in range(4)]
            torch.testing.assert_close(x[0, a, j], torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_engram_mask_replace_input_by_hand():
    """Slots 1..S-1 = N(P e_{a-1}), no MASK embedding and no gate; the anchor keeps E(x_a)."""
    d = _hand_draft("engram_mask_replace")
    p = [[0.0, 1.0, 1.0, 0.0], [2.0, 0.0, 0.0, -1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    _set(d.engram_proj.weight, p)
    emb = [[1.0, float(t), 0.0, -2.0] for t in range(8)]
    _set(d.embedding_matrix(), emb)
    anchors = torch.tensor([[1, 5]])  # e_{a-1} at 0 (unigram only) and at 4
    with torch.no_grad():
        x = d.block_inputs(HAND_IDS.gather(1, anchors), {"input_ids": HAND_IDS, "anchors": anchors})
    for a, e in ((0, E_UNIGRAM), (1, E_FULL)):
        torch.testing.assert_close(x[0, a, 0], torch.tensor(emb[int(HAND_IDS[0, anchors[0, a]])]), rtol=0, atol=0)
        z = _rms(_matvec(p, e))
        for j in (1, 2):
            torch.testing.assert_close(x[0, a, j], torch.tensor(z), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_no_predecessor_gives_the_zero_feature(kind):
    """An anchor at the first token (training batch, and the engine's first cycle on a one-token prompt) and an
    invalid block read e_{a-1} = 0: the MASK slots are E(MASK) (gated) or 0 (replace). An anchor at the answer
    start reads the prompt's last token like any other predecessor (the engine's history holds the prompt)."""
    d = _hand_draft(kind)
    train = {"input_ids": HAND_IDS, "anchors": torch.tensor([[0, 2, 4]]),
             "anchor_valid": torch.tensor([[True, True, False]])}
    first_cycle = {"input_ids": HAND_IDS[:, :1], "anchors": torch.tensor([[0]])}  # one-token prompt
    for extras in (train, first_cycle):
        anchor_tok = extras["input_ids"].gather(1, extras["anchors"])
        e = d.pre_anchor_features(anchor_tok, extras)  # [1, A, H]
        assert torch.equal(e[0, 0], torch.zeros(4))
        if kind == "engram_markov":
            continue
        x = d.block_inputs(anchor_tok, extras)  # [1, A, S, 4]
        mask_row = d.embedding_matrix()[7] if kind == "engram_mask_gated" else torch.zeros(4)
        assert torch.equal(x[0, 0, 1:], mask_row.expand(2, 4))
    e = d.pre_anchor_features(HAND_IDS.gather(1, train["anchors"]), train)
    torch.testing.assert_close(e[0, 1], torch.tensor(E_FULL))  # answer start at 2: the prompt's tokens 0, 1
    assert torch.equal(e[0, 2], torch.zeros(4))  # an invalid block
    if kind == "engram_markov":  # e_{i-1} = 0 only before the sequence: slot 0 of an anchor at 0 reads e(t_0)
        feats = d.prev_features(torch.zeros(1, 1, 3, dtype=torch.long), {"input_ids": HAND_IDS,
                                                                         "anchors": torch.tensor([[0]])})
        torch.testing.assert_close(feats[0, 0], torch.tensor([E_UNIGRAM, E_FULL, E_FULL]))


# -- parameter counts at seed shapes ------------------------------------------------------------------------
def test_seed000_parameter_counts():
    want = {"engram_markov": 3 * 2560 * 256, "engram_mask_gated": 2560 ** 2 + 6,
            "engram_mask_replace": 2560 ** 2}
    assert list(want.values()) == [1_966_080, 6_553_606, 6_553_600]
    for kind, n in want.items():
        base, counts = seed000_param_counts(kind)
        assert counts["variant"] == n
        assert counts["draft"] - base["draft"] == n  # the table is not a draft parameter
        assert counts["engram_table"] == sum(table_primes(EngramConfig())) * 640


# -- frozen tables ------------------------------------------------------------------------------------------
def test_frozen_table_is_the_mean_next_embedding(tmp_path):
    cfg = EngramConfig(orders=(1, 2), heads_per_order=1, table_rows=7, source="frozen")
    embed = torch.randn(20, 6)
    samples = [torch.tensor([1, 2, 3, 1, 2, 4]), torch.tensor([2, 3])]
    weights = build_frozen_table(cfg, 4, samples, embed)
    table = EngramTable(cfg, 4)
    g = torch.Generator().manual_seed(cfg.hash_seed + 1)
    for k, w in enumerate(table.widths):  # brute force: every bucket's mean next embedding, projected
        proj = torch.randn(6, w, generator=g, dtype=torch.float64) / 6 ** 0.5
        acc: dict[int, list] = {}
        for ids in samples:
            bucket, valid = table.buckets(ids.view(1, -1), torch.arange(len(ids) - 1).view(1, -1))
            for t in range(len(ids) - 1):
                if valid[0, t, k]:
                    acc.setdefault(int(bucket[0, t, k]), []).append(embed[ids[t + 1]].double())
        want = torch.zeros(table.rows[k], w, dtype=torch.float64)
        for r, vs in acc.items():
            want[r] = torch.stack(vs).mean(0) @ proj
        torch.testing.assert_close(weights[k], want.float())
    path = tmp_path / "t.safetensors"
    write_frozen_table(str(path), weights, table.layout(), "fp-a", {"samples": 2})
    back = read_frozen_table(str(path), table.layout(), "fp-a")
    assert all(torch.equal(a, b) for a, b in zip(back, weights))
    with pytest.raises(ValueError, match="another target"):
        read_frozen_table(str(path), table.layout(), "fp-b")
    other = EngramTable(EngramConfig(orders=(1, 2), heads_per_order=1, table_rows=11), 4).layout()
    with pytest.raises(ValueError, match="rows differ"):
        read_frozen_table(str(path), other, "fp-a")
    with pytest.raises(ValueError, match="engram_build"):
        read_frozen_table(str(tmp_path / "missing.safetensors"), table.layout(), None)
    raw = bytearray(path.read_bytes())  # one flipped byte in the last table's data: its recorded SHA-256 tells
    raw[-3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=rf"t.safetensors: table_{len(weights) - 1} differs from the SHA-256 .*"
                                        r"damaged.*engram_build"):
        read_frozen_table(str(path), table.layout(), "fp-a")
    path.write_bytes(bytes(raw[:-100]))  # cut short
    with pytest.raises(UserError, match=r"t.safetensors: not a readable safetensors file .*engram_build"):
        read_frozen_table(str(path), table.layout(), "fp-a")


def test_frozen_draft_loads_its_table_and_trains_nothing_of_it(tmp_path):
    target = tiny_model("qwen3")
    path = tmp_path / "table.safetensors"
    eng = EngramConfig(orders=(1, 2, 3), heads_per_order=2, table_rows=31, source="frozen", table_path=str(path))
    d = build_draft(_cfg("engram_mask_gated", engram=eng), target.config, target.get_input_embeddings().weight,
                    target.get_output_embeddings().weight, aux_layer_ids=AUX)
    weights = build_frozen_table(eng, d.hidden_size, [torch.randint(0, 200, (40,))],
                                 target.get_input_embeddings().weight.detach())
    write_frozen_table(str(path), weights, d.engram_table.layout(), None, {})
    d.load_frozen_sources()
    assert all(torch.equal(t.weight, w) for t, w in zip(d.engram_table.tables, weights))
    assert not any(p.requires_grad for p in d.engram_table.parameters())
    save_draft(tmp_path / "draft", d)  # the checkpoint carries the table: eval / bench need no table file
    path.unlink()
    back = load_draft(tmp_path / "draft", target)
    assert type(back).__name__ == "EngramMaskGatedDraft"
    assert all(torch.equal(t.weight, w) for t, w in zip(back.engram_table.tables, weights))


def test_bad_engram_params_are_named():
    from dspark_core.config import ParamsError

    with pytest.raises(ParamsError, match="draft.kind must be one of baseline, engram_markov.*; got 'engram'"):
        draft_class(DraftConfig.from_dict({"kind": "engram"}, prefix="draft.").kind)
    with pytest.raises(ParamsError, match="draft.engram.orders must be strictly increasing"):
        DraftConfig.from_dict({"engram": {"orders": [3, 2]}}, prefix="draft.")
    with pytest.raises(ParamsError, match="draft.engram.source must be one of"):
        DraftConfig.from_dict({"engram": {"source": "file"}}, prefix="draft.")
    with pytest.raises(ParamsError, match="sparse: true needs source: trainable"):
        DraftConfig.from_dict({"engram": {"source": "frozen", "sparse": True}}, prefix="draft.")
    target = tiny_model("qwen3")
    d = _draft(target, "engram_mask_gated")
    cache = d.new_context_cache(batch=1, max_len=16)
    with pytest.raises(ValueError, match="pass extras with 'input_ids'"):
        d.forward_block(cache, torch.tensor([3]))


# -- online: the reference engine --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_online_greedy_identical_to_ar_with_partial_acceptance(kind, one_thread):
    """A 16-token vocabulary makes a random draft right often enough for partial acceptances; the engine
    passes the committed ids through the anchor, which the variant's lookups read."""
    from dspark_core.decoding.ar import ARDecoder
    from dspark_core.decoding.engine import SpeculativeDecoder
    from dspark_core.decoding.target_runner import TargetRunner

    model = tiny_model("qwen3", vocab_size=16, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    cfg = DraftConfig(num_draft_layers=1, block_size=S, mask_token_id=None, num_anchors=4, markov_rank=8, kind=kind,
                      engram=SMALL)
    draft = build_draft(cfg, model.config, model.get_input_embeddings().weight,
                        model.get_output_embeddings().weight, aux_layer_ids=(0, 2, 4)).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name in ("engram_gate", "engram_v.weight"):
                p.copy_(torch.randn_like(p))
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ar = ARDecoder(runner).generate(prompt, 40)
    seen, committed = [], list(prompt)
    inner = draft.propose

    def spy(cache, anchor, sample_fn, threshold=0.0, extras=None):
        seen.append((extras["input_ids"][0].tolist(), int(extras["anchors"][0, 0]), cache.length))
        return inner(cache, anchor, sample_fn, threshold, extras=extras)

    draft.propose = spy
    cycles = []
    spec = SpeculativeDecoder(runner, draft, block_size=S, on_cycle=cycles.append)
    res = spec.generate(prompt, 40)
    assert res.tokens == ar.tokens
    assert 1.0 < res.mean_accepted_length < S + 1
    assert any(c.num_accepted < c.num_proposed for c in cycles) and any(c.num_accepted > 0 for c in cycles)
    committed += ar.tokens
    for ids, anchor_idx, p in seen:  # the last token_history ids through the anchor at position p
        assert ids == committed[max(0, p + 1 - draft.token_history):p + 1] and anchor_idx == len(ids) - 1
