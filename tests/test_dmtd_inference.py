"""Cached DMTD inference: logits at every position equal the teacher-forced training forward (every variant,
every prompt length mod tau), the merged 2*tau refresh forward equals the two-phase reference, the caches hold
exactly the seed's K/V, the seed's 8-slot block mask, generation / sampling / stop tokens, the AR baseline (the
target runner) = HF."""

from __future__ import annotations

import pytest
import torch

from dspark_core.dmtd.config import VARIANTS
from dspark_core.dmtd.evaluate import ar_decoder, decode_speed
from dspark_core.dmtd.inference import DMTDDecoder
from dspark_core.dmtd.layers import attend_dense, layer_out, layer_qkv, rope
from dspark_core.dmtd.model import DMTDModel, default_positions
from dspark_core.decoding.sampling import SamplingParams

TAU, P, MASK = 4, 4, 259
ATOL = 2e-5


pytestmark = pytest.mark.usefixtures("one_thread")



def dmtd(lm, variant, tau=TAU, p=P) -> DMTDModel:
    return DMTDModel(lm, p, tau, MASK, variant).eval()


def seq(batch, n, seed=0):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


# -- the core exactness test ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_logits_equal_teacher_forced_every_prompt_residue(lms, family, variant):
    m = dmtd(lms[family], variant)
    x = seq(1, 19, seed=3)  # ends mid-cycle too
    with torch.no_grad():
        ref = m.logits(x)
    dec = DMTDDecoder(m, 24)
    for n in range(1, 2 * TAU + 1):  # every residue mod tau, prompts inside and past the first cycle
        got = dec.score(x[:, :n], x[:, n:])
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0, msg=f"prompt length {n}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_exact_with_other_tau_split_batch_and_qwen2(lms, variant):
    m = dmtd(lms["qwen2"], variant, tau=3, p=2)
    x = seq(2, 14, seed=4)
    with torch.no_grad():
        ref = m.logits(x)
    dec = DMTDDecoder(m, 14, batch_size=2)
    for n in (2, 4, 6):
        torch.testing.assert_close(dec.score(x[:, :n], x[:, n:]), ref, atol=ATOL, rtol=0)


def test_other_variant_cache_does_not_match(lms):
    """Sensitivity: decoding with another variant's cache semantics breaks exactness."""
    x = seq(1, 16, seed=5)
    for a in VARIANTS:
        with torch.no_grad():
            ref = dmtd(lms["qwen3"], a).logits(x)
        for b in VARIANTS:
            if a != b:
                got = DMTDDecoder(dmtd(lms["qwen3"], b), 16).score(x[:, :5], x[:, 5:])
                assert (got - ref).abs().max() > 1e-3, (a, b)


def test_decoder_reuse_leaves_no_stale_state(lms):
    m = dmtd(lms["llama"], "bidir_refresh")
    dec = DMTDDecoder(m, 32)
    dec.generate(seq(1, 9, seed=6), 20)
    x = seq(1, 13, seed=7)
    torch.testing.assert_close(dec.score(x[:, :3], x[:, 3:]), DMTDDecoder(m, 32).score(x[:, :3], x[:, 3:]),
                               atol=0, rtol=0)


# -- the merged refresh forward equals the two-phase reference --------------------------------------
def _block_forward(m: DMTDModel, ids, pos, hist_k, hist_v, block_mask):
    """Reference: ``ids [1, n]`` at ``pos`` through the P layers attending [history ; block] per layer,
    ``block_mask [n, n]`` inside the block, all history visible. Returns output and the block's K/V."""
    x = m.embed(ids)
    cos, sin = rope(m.lm.model.rotary_emb, x, pos)
    new_k, new_v = [], []
    for i, layer in enumerate(m.parallel_layers):
        q, k, v = layer_qkv(layer, x, cos, sin)
        keys, vals = torch.cat([hist_k[i], k], 2), torch.cat([hist_v[i], v], 2)
        mask = torch.cat([torch.ones(ids.shape[1], hist_k[i].shape[2], dtype=torch.bool), block_mask], 1)
        x = layer_out(layer, x, attend_dense(q, keys, vals, mask[None, None], layer.self_attn.scaling))
        new_k.append(k)
        new_v.append(v)
    return x, new_k, new_v


@pytest.mark.parametrize("variant", ["causal_refresh", "bidir_refresh"])
def test_merged_refresh_forward_equals_two_phase(lms, variant):
    m = dmtd(lms["qwen3"], variant)
    x = seq(1, 12, seed=8)
    dec = DMTDDecoder(m, 16)
    dec.prefill(x[:, :6])  # prompt cycle [4..7] is current: C_P holds real 0..3
    hist_k = [dec.p_cache.k[i][:, :, :4].clone() for i in range(P)]
    hist_v = [dec.p_cache.v[i][:, :, :4].clone() for i in range(P)]
    dec.tokens[:, 6:9] = x[:, 6:9]
    dec._start_cycle(8)  # ONE forward: [x4..x7 | x8, M, M, M]
    with torch.no_grad():
        causal = torch.ones(4, 4, dtype=torch.bool).tril()
        # phase A: refresh the previous cycle's real tokens, causal, appended to the cache
        _, ak, av = _block_forward(m, x[:, 4:8], torch.arange(4, 8)[None], hist_k, hist_v, causal)
        full_k = [torch.cat([h, k], 2) for h, k in zip(hist_k, ak)]
        full_v = [torch.cat([h, v], 2) for h, v in zip(hist_v, av)]
        # phase B: the shadow block against the refreshed cache, not appended
        block = torch.tensor([[x[0, 8].item(), MASK, MASK, MASK]])
        inner = torch.ones(4, 4, dtype=torch.bool) if variant == "bidir_refresh" else causal
        shadow, _, _ = _block_forward(m, block, torch.arange(8, 12)[None], full_k, full_v, inner)
    torch.testing.assert_close(dec.shadow, shadow, atol=ATOL, rtol=0)
    for i in range(P):
        torch.testing.assert_close(dec.p_cache.k[i][:, :, :8], full_k[i], atol=ATOL, rtol=0)
        torch.testing.assert_close(dec.p_cache.v[i][:, :, :8], full_v[i], atol=ATOL, rtol=0)


# -- cache contents ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_caches_hold_the_seeds_kv(lms, variant):
    """Refresh C_P = real K/V of completed cycles; norefresh C_P = every shadow K/V; C_S = real tokens."""
    m = dmtd(lms["qwen3"], variant)
    x = seq(1, 15, seed=9)
    dec = DMTDDecoder(m, 16)
    dec.score(x[:, :5], x[:, 5:])
    pos, doc = default_positions(x, None, None)
    lay = m.layout(x, pos, doc, complete_cycles=True, tail_multiple=1)
    p_kv, s_kv = {}, {}
    with torch.no_grad():
        p_out = m.parallel_hidden(lay, kv_sink=lambda i, k, v: p_kv.__setitem__(i, (k, v)))
        h = p_out[:, lay.shadow_start: lay.shadow_start + 15]
        m.sequential_hidden(x, pos, doc, h, kv_sink=lambda i, k, v: s_kv.__setitem__(i, (k, v)))
    last_head = TAU * (14 // TAU)  # 12
    if m.rule.refresh:
        want_slots, n_slots = torch.arange(last_head), last_head  # real stream = first 15 slots
    else:
        want_slots, n_slots = torch.arange(last_head + TAU), last_head + TAU  # shadow main + tail, by position
    for i, (k, v) in p_kv.items():
        torch.testing.assert_close(dec.p_cache.k[i][:, :, :n_slots], k[:, :, want_slots], atol=ATOL, rtol=0)
        torch.testing.assert_close(dec.p_cache.v[i][:, :, :n_slots], v[:, :, want_slots], atol=ATOL, rtol=0)
    for i, (k, v) in s_kv.items():
        torch.testing.assert_close(dec.s_cache.k[i][:, :, :15], k, atol=ATOL, rtol=0)


# -- the seed's 8-slot block mask (7.3) -----------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_cycle_step_mask_is_the_seeds_table(lms, variant):
    dec = DMTDDecoder(dmtd(lms["qwen3"], variant), 16)
    dec._pos.fill_(8)
    q_pos, write, mask = dec.cycle_layout()
    mask = mask[0, 0]
    bidir = variant.startswith("bidir")
    inner = torch.ones(4, 4, dtype=torch.bool) if bidir else torch.ones(4, 4, dtype=torch.bool).tril()
    causal4 = torch.ones(4, 4, dtype=torch.bool).tril()
    if dec.rule.refresh:
        assert q_pos.tolist() == list(range(4, 12)) and write.tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
        old, refresh, future, scratch = mask[:, :4], mask[:, 4:8], mask[:, 8:16], mask[:, 16:]
        assert old.all()                                            # persistent real history R0..R3
        assert torch.equal(refresh[:4], causal4) and refresh[4:].all()  # refresh real: causal / all
        assert not scratch[:4].any() and torch.equal(scratch[4:], inner)  # x: real never sees shadow
        assert not future.any()
    else:
        assert q_pos.tolist() == list(range(8, 12)) and write.tolist() == [8, 9, 10, 11]
        assert mask[:, :8].all() and not mask[:, 12:].any()         # history shadow K/V, nothing later
        assert torch.equal(mask[:, 8:12], inner)


# -- generation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_follows_teacher_forced_argmax(lms, variant):
    m = dmtd(lms["llama"], variant)
    prompt = seq(1, 7, seed=10)
    out = DMTDDecoder(m, 32).generate(prompt, 14)
    full = torch.cat([prompt, torch.tensor([out.tokens[0]])], 1)
    with torch.no_grad():
        pred = m.logits(full).argmax(-1)[0, 6:-1]
    assert pred.tolist() == out.tokens[0]
    assert out.num_new_tokens == 14 and out.tokens_per_s > 0


def test_ar_baseline_is_the_target_runner_and_equals_hf_greedy(lms):
    lm = lms["qwen3"]
    prompt = seq(1, 6, seed=11)
    ar = ar_decoder(lm, 32)
    ours = ar.generate(prompt, 12).tokens
    with torch.no_grad():
        hf = lm.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == hf[0, 6:].tolist()
    speed = decode_speed(ar, [prompt[0].tolist()], 5, warmup=False)
    assert speed["new_tokens"] == 5 and speed["tokens_per_s"] > 0


def test_sampling_is_seeded_and_top_k_1_is_greedy(lms):
    dec = DMTDDecoder(dmtd(lms["qwen3"], "causal_refresh"), 32)
    prompt = seq(1, 5, seed=12)
    greedy = dec.generate(prompt, 10).tokens
    assert dec.generate(prompt, 10, SamplingParams(temperature=0.9, top_k=1)).tokens == greedy
    s = SamplingParams(temperature=1.5, top_p=0.95)
    a = dec.generate(prompt, 10, s, generator=torch.Generator().manual_seed(1)).tokens
    b = dec.generate(prompt, 10, s, generator=torch.Generator().manual_seed(1)).tokens
    c = dec.generate(prompt, 10, s, generator=torch.Generator().manual_seed(2)).tokens
    assert a == b and a != c


def test_stop_tokens_cut_the_output(lms):
    dec = DMTDDecoder(dmtd(lms["qwen3"], "bidir_norefresh"), 40)
    prompt = seq(1, 5, seed=13)
    full = dec.generate(prompt, 16).tokens[0]
    stop = full[6]
    first = full.index(stop)
    out = dec.generate(prompt, 16, stop_token_ids=[stop])
    assert out.tokens[0] == full[: first + 1]


def test_bad_decoder_input(lms):
    dec = DMTDDecoder(dmtd(lms["qwen3"], "causal_refresh"), 8)
    with pytest.raises(ValueError, match="max_len=8"):
        dec.generate(seq(1, 6), 4)
    with pytest.raises(ValueError, match="at least one token"):
        dec.generate(torch.zeros(1, 0, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="B=1"):
        dec.generate(seq(2, 3), 2)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DMTDDecoder(dmtd(lms["qwen3"], "causal_refresh"), 8, graph="cuda_graph")
