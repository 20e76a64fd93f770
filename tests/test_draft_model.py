"""DSpark draft model: training forward == single-block inference forward, flex == dense, family details,
seed configurations on the meta device, save/load, the variant K/V hook."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _draft_utils import teacher_forcing
from dspark_core.cache.dataset import CacheCollator
from dspark_core.checkpoint import load_draft, save_draft
from dspark_core.draft.anchors import add_anchor_fields
from dspark_core.draft.config import DraftConfig
from dspark_core.draft.model import DSparkDraft, ExtraKV
from dspark_core.draft.synthetic import items_from_target
from dspark_core.testing import tiny_model

AUX = (0, 2, 4)
S = 4
ROOT = Path(__file__).resolve().parents[1]


def _draft(model, seed: int = 1, **over) -> DSparkDraft:
    torch.manual_seed(seed)
    cfg = DraftConfig(**{**dict(num_draft_layers=2, block_size=S, mask_token_id=259, num_anchors=6, markov_rank=8),
                         **over})
    d = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                    aux_layer_ids=AUX)
    with torch.no_grad():  # non-trivial norm weights, so a missing or misplaced norm shows up
        for name, p in d.named_parameters():
            if p.requires_grad and p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
            elif p.requires_grad:
                p.mul_(5.0)
    return d.eval()


_ITEMS: dict = {}


def _batch(model, n=3, prompt=5, response=19, anchors=4, seed=0):
    key = (model.config.model_type, model.config.hidden_size, n, prompt, response, seed)
    if key not in _ITEMS:  # sampling from the target is the slow part; reuse across tests
        items = items_from_target(model, AUX, n, prompt, response, seed=seed)
        items[1] = {k: v[:-4] for k, v in items[1].items()}  # ragged: padding in the batch
        _ITEMS[key] = items
    return add_anchor_fields(CacheCollator(0)(_ITEMS[key]), anchors, S, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,over", [("qwen3", {}), ("llama", {}), ("qwen2", {}),
                                         ("qwen3", {"hidden_size": 48, "num_attention_heads": 6, "head_dim": 8}),
                                         ("llama", {"layer_style": "qwen3"}), ("qwen2", {"layer_style": "qwen3"}),
                                         ("qwen3", {"markov_head": "gated"}), ("qwen3", {"markov_head": "rnn"}),
                                         ("llama", {"markov_head": "rnn", "hidden_size": 48,
                                                    "num_attention_heads": 6, "head_dim": 8})])
def test_training_forward_equals_single_block_inference(family, over):
    target = tiny_model(family)
    draft = _draft(target, **over)
    batch = _batch(target)
    with torch.no_grad():
        h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
        train_logits = draft.slot_logits(h)  # [B, A, S, V]
        m = draft.markov_features(batch["prev_tokens"], h, None)
        train_markov = train_logits + draft.markov_bias(draft.markov_block(m, h)).float()  # teacher-forced slots
        train_conf = torch.sigmoid(draft.confidence_logits(h, m))
    checked = 0
    for b, a in batch["anchor_valid"].nonzero().tolist():
        p = int(batch["anchors"][b, a])
        cache = draft.new_context_cache(batch=1, max_len=64)
        split = p // 2  # extend in two pieces, like prefill + a cycle
        draft.extend_context(cache, batch["aux_hidden"][b:b + 1, :split])
        draft.extend_context(cache, batch["aux_hidden"][b:b + 1, split:p])
        assert cache.length == p
        anchor = batch["input_ids"][b, p].view(1)
        h_inf = draft.forward_block(cache, anchor)[0]  # [S, H]
        torch.testing.assert_close(h_inf, h[b, a], rtol=0, atol=1e-5)
        torch.testing.assert_close(draft.slot_logits(h_inf), train_logits[b, a], rtol=0, atol=1e-5)
        seen: list = []
        prop = draft.propose(cache, anchor, teacher_forcing(batch["targets"][b, a], seen))
        valid = int(batch["slot_valid"][b, a].sum())  # Markov inputs are the reference tokens on valid slots
        torch.testing.assert_close(torch.cat(seen)[:valid], train_markov[b, a, :valid], rtol=0, atol=1e-5)
        torch.testing.assert_close(prop.confidence[0, :valid], train_conf[b, a, :valid], rtol=0, atol=1e-5)
        assert prop.num_tokens == S and cache.length == p  # propose leaves the context alone
        checked += 1
    assert checked == 12


def test_flex_attention_matches_dense_on_cpu():
    # flex_attention runs (unfused, forward only) on CPU: same outputs as the dense SDPA path.
    target = tiny_model("qwen3")
    draft = _draft(target)
    batch = _batch(target)
    args = (batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
    outs = {}
    with torch.no_grad():
        for backend in ("dense", "flex"):
            draft.attention_backend = backend
            outs[backend] = draft.forward_train(*args)[batch["anchor_valid"]]
    torch.testing.assert_close(outs["flex"], outs["dense"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_padded_context_bucket_changes_nothing(backend):
    # The compiled GPU path pads the context to CONTEXT_BUCKET positions; the padding is never attended.
    target = tiny_model("qwen3")
    draft = _draft(target)
    draft.attention_backend = backend
    batch = _batch(target)
    args = (batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
    with torch.no_grad():
        plain = draft.forward_train(*args)
        draft.context_bucket = 16
        padded = draft.forward_train(*args)
    assert batch["input_ids"].shape[1] % 16 != 0
    valid = batch["anchor_valid"]
    torch.testing.assert_close(padded[valid], plain[valid], rtol=0, atol=1e-5)


def test_family_details_mirror_the_target():
    q3, q2, ll = (_draft(tiny_model(f)) for f in ("qwen3", "qwen2", "llama"))
    att = lambda d: d.layers[0].self_attn  # noqa: E731
    assert att(q3).q_norm is not None and att(q3).k_norm is not None and att(q3).q_proj.bias is None
    assert att(q2).q_norm is None and att(q2).q_proj.bias is not None and att(q2).o_proj.bias is None
    assert att(ll).q_norm is None and att(ll).q_proj.bias is None
    assert ll.layers[0].mlp.gate_proj.bias is None  # Llama's mlp_bias: False
    ll_bias = _draft(tiny_model("llama", mlp_bias=True))
    assert ll_bias.layers[0].mlp.gate_proj.bias is not None and ll_bias.layers[0].mlp.down_proj.bias is not None
    frozen = {n for n, p in q3.named_parameters() if not p.requires_grad}
    assert frozen == {"lm_head_weight", "embed_tokens_weight"}


def test_qwen3_layer_style_on_every_family():
    """layer_style qwen3: Qwen3 layers (q/k RMSNorm, attention_bias on all four projections) on any target; on a
    Qwen3 target it is the target style itself (same weights, same outputs)."""
    for family in ("llama", "qwen2"):
        att = _draft(tiny_model(family), layer_style="qwen3").layers[0].self_attn
        assert att.q_norm is not None and att.k_norm is not None and att.q_proj.bias is None
        assert att.o_proj.bias is None
    target = tiny_model("qwen3")
    a, b = _draft(target), _draft(target, layer_style="qwen3")
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    batch = _batch(target)
    with torch.no_grad():
        ha = a.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
        hb = b.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
    assert torch.equal(ha, hb)


def test_learned_mask_when_no_spare_token(tmp_path):
    target = tiny_model("llama")
    for mask_id in (None, 10_000):
        d = _draft(target, mask_token_id=mask_id)
        assert d.mask_token_id is None and d.mask_embedding is not None and d.mask_embedding.requires_grad
    d = _draft(target, mask_token_id=259)
    assert d.mask_embedding is None
    torch.testing.assert_close(d.mask_vector(), target.get_input_embeddings().weight[259])
    save_draft(tmp_path / "learned", _draft(target, mask_token_id=None))
    import json
    assert json.loads((tmp_path / "learned" / "config.json").read_text())["mask"] == {"token_id": None,
                                                                                     "learned": True}


def test_save_load_roundtrip_and_checks(tmp_path):
    target = tiny_model("qwen3")
    draft = _draft(target)
    draft.target_fingerprint = "abc"
    save_draft(tmp_path / "d", draft)
    loaded = load_draft(tmp_path / "d", target, expected_fingerprint="abc")
    batch = _batch(target)
    args = (batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_train(*args), draft.forward_train(*args), rtol=0, atol=0)
    with pytest.raises(ValueError, match="fingerprint|trained on target"):
        load_draft(tmp_path / "d", target, expected_fingerprint="other")
    with pytest.raises(ValueError, match="target.hidden_size"):
        load_draft(tmp_path / "d", tiny_model("qwen3", hidden_size=32))
    with pytest.raises(ValueError, match="config.json"):
        load_draft(tmp_path / "nothing", target)
    with pytest.raises(ValueError, match="differs"):
        save_draft(tmp_path / "e", draft, DraftConfig(num_draft_layers=3))


def test_bad_inputs_raise_value_errors():
    target = tiny_model("qwen3")
    with pytest.raises(ValueError, match="final layer"):
        DSparkDraft(DraftConfig(), target.config, target.get_input_embeddings().weight,
                    target.get_output_embeddings().weight, aux_layer_ids=[0, 5])
    with pytest.raises(ValueError, match="strictly increasing"):
        DSparkDraft(DraftConfig(), target.config, target.get_input_embeddings().weight,
                    target.get_output_embeddings().weight, aux_layer_ids=[2, 1])
    draft = _draft(target)
    cache = draft.new_context_cache(batch=1, max_len=8)
    with pytest.raises(ValueError, match="aux_hidden must be"):
        draft.extend_context(cache, torch.zeros(1, 2, 2, 64))
    with pytest.raises(ValueError, match="max_len"):
        draft.extend_context(cache, torch.zeros(1, 9, 3, 64))
    draft.extend_context(cache, torch.zeros(1, 5, 3, 64))
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(6)
    cache.truncate(3)
    assert cache.length == 3
    with pytest.raises(ValueError, match="confidence_threshold"):
        draft.propose(cache, torch.tensor([1]), lambda x: (x.argmax(-1), x.softmax(-1)), confidence_threshold=2.0)


def test_confidence_threshold_cuts_the_proposal():
    target = tiny_model("qwen3")
    draft = _draft(target)
    batch = _batch(target)
    cache = draft.new_context_cache(batch=1, max_len=64)
    draft.extend_context(cache, batch["aux_hidden"][:1, :10])
    greedy = lambda x: (x.argmax(-1), torch.softmax(x, -1))  # noqa: E731
    full = draft.propose(cache, torch.tensor([7]), greedy)
    conf = full.confidence[0]
    thr = float(conf.sort().values[S // 2]) + 1e-6  # some slot is below it
    cut = draft.propose(cache, torch.tensor([7]), greedy, confidence_threshold=thr)
    expect = int((conf < thr).nonzero()[0])
    assert cut.num_tokens == expect and cut.tokens.shape == (1, expect) and cut.probs.shape[:2] == (1, expect)
    torch.testing.assert_close(cut.tokens, full.tokens[:, :expect])


def test_confidence_cut_is_strictly_below_and_the_earliest_over_the_batch():
    """A slot whose confidence equals the threshold is kept (the cut is at the first slot strictly below it), and
    a batch of several rows is cut at the earliest row's cut (rows share one block length)."""
    target = tiny_model("qwen3")
    draft = _draft(target)
    batch = _batch(target)
    greedy = lambda x: (x.argmax(-1), torch.softmax(x, -1))  # noqa: E731
    one = draft.new_context_cache(batch=1, max_len=64)
    draft.extend_context(one, batch["aux_hidden"][:1, :10])
    lowest = float(draft.propose(one, torch.tensor([7]), greedy).confidence.min())
    assert draft.propose(one, torch.tensor([7]), greedy, confidence_threshold=lowest).num_tokens == S
    two = draft.new_context_cache(batch=2, max_len=64)
    draft.extend_context(two, batch["aux_hidden"][:2, :10])
    full = draft.propose(two, torch.tensor([7, 9]), greedy)
    conf = full.confidence  # [2, S]
    for thr in (float(conf[0].sort().values[S // 2]) + 1e-6, float(conf[1].sort().values[S // 2]) + 1e-6):
        cut = draft.propose(two, torch.tensor([7, 9]), greedy, confidence_threshold=thr)
        first = [int((row < thr).nonzero()[0]) if bool((row < thr).any()) else S for row in conf]
        assert cut.num_tokens == min(first) and cut.tokens.shape == (2, min(first))
        torch.testing.assert_close(cut.tokens, full.tokens[:, :min(first)])


class MemoryDraft(DSparkDraft):
    """A stand-in for Draft Memory: batch key ``memory`` [B, A, M, H] is owned by each block (hook 3)."""

    def extra_kv(self, extras, anchors, anchor_valid):
        mem = extras["memory"]  # [B, A, M, H]
        b, a, m, h = mem.shape
        pos = anchors.unsqueeze(-1) + 1 + torch.arange(m)  # [B, A, M]
        owner = torch.arange(a).view(1, a, 1).expand(b, a, m)
        return ExtraKV(states=mem.reshape(b, a * m, h), positions=pos.reshape(b, -1), owner=owner.reshape(b, -1))


def test_extra_kv_hook_training_equals_inference():
    target = tiny_model("qwen3")
    base = _draft(target)
    draft = MemoryDraft(base.cfg, target.config, target.get_input_embeddings().weight,
                        target.get_output_embeddings().weight, aux_layer_ids=AUX)
    draft.load_state_dict(base.state_dict())
    draft.eval()
    batch = _batch(target)
    bsz, na = batch["anchors"].shape
    memory = torch.randn(bsz, na, 2, 64)
    with torch.no_grad():
        h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"],
                                extras={"memory": memory})
        h0 = base.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"])
    assert (h - h0).abs().max() > 1e-3  # the memory is read
    for b, a in batch["anchor_valid"].nonzero().tolist()[:6]:
        p = int(batch["anchors"][b, a])
        cache = draft.new_context_cache(batch=1, max_len=64)
        draft.extend_context(cache, batch["aux_hidden"][b:b + 1, :p])
        mem = {"memory": memory[b:b + 1, a:a + 1]}  # the block's own memory only
        h_inf = draft.forward_block(cache, batch["input_ids"][b, p].view(1), extras=mem)
        torch.testing.assert_close(h_inf[0], h[b, a], rtol=0, atol=1e-5)


def _seed_draft(cfg: DraftConfig, target_cfg, aux):
    with torch.device("meta"):
        w = torch.empty(target_cfg.vocab_size, target_cfg.hidden_size)
        return DSparkDraft(cfg, target_cfg, w, w, aux_layer_ids=aux)


def _profile(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "profiles" / name).read_text())


def test_seed000_draft_parameter_count_on_meta():
    from transformers import Qwen3Config

    prof = _profile("seed000_table.yaml")
    cfg = DraftConfig.from_dict(prof["draft"])
    # Seed 000's target (Qwen3.8-Flash-Next): hidden 2560, Qwen3 vocabulary 151936, aux layers 45-47
    # (so at least 49 layers; the count does not depend on the depth).
    target_cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, num_hidden_layers=64, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, intermediate_size=9728, tie_word_embeddings=True)
    draft = _seed_draft(cfg, target_cfg, prof["cache"]["aux_layer_ids"])
    hid, ffn, heads_q, heads_kv, hd, vocab, rank = 2560, 9728, 24, 2, 256, 151936, 256
    w_aux = 3 * hid * hid + hid  # W_aux 7680 -> 2560 (no bias) + its RMSNorm
    attn = hid * heads_q * hd + 2 * hid * heads_kv * hd + heads_q * hd * hid + 2 * hd  # q, k, v, o (no bias) + q/k norm
    mlp = 3 * hid * ffn  # gate, up, down
    layer = attn + mlp + 2 * hid  # + input / post-attention RMSNorm
    markov = vocab * rank + rank * vocab  # W1, W2
    conf = (hid + rank) + 1  # w_c, b_c
    expected = w_aux + 3 * layer + hid + markov + conf  # + final RMSNorm
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert trainable == expected == 423_846_145
    assert draft.fc.weight.shape == (2560, 7680) and draft.embed_proj is None and draft.head_proj is None
    assert draft.confidence.proj.weight.shape == (1, 2816)


def test_seed004_qwen3_4b_draft_on_meta():
    from transformers import Qwen3Config

    prof = _profile("seed004_qwen3_4b.yaml")
    target_cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, intermediate_size=9728, tie_word_embeddings=True)
    draft = _seed_draft(DraftConfig.from_dict(prof["draft"]), target_cfg, prof["cache"]["aux_layer_ids"])
    assert len(draft.layers) == 5 and draft.fc.weight.shape == (2560, 5 * 2560)
    attn = draft.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (32, 8, 128)
    assert draft.mask_token_id == 151669 and draft.tied_embeddings


@pytest.mark.parametrize("name", ["seed004_qwen3_4b.yaml", "seed000_table.yaml"])
def test_seed_profiles_are_valid_sections(name):
    from dspark_core.draft.config import LossConfig
    from dspark_core.train.trainer import TrainConfig

    prof = _profile(name)
    assert set(prof) >= {"draft", "loss", "cache", "train"}
    DraftConfig.from_dict(prof["draft"], src=name, prefix="draft.")
    loss = LossConfig.from_dict(prof["loss"], src=name, prefix="loss.")
    assert (loss.ce_alpha, loss.l1_alpha, loss.conf_alpha, loss.decay_gamma) == (0.1, 0.9, 1.0, 4.0)
    train = TrainConfig.from_dict(prof["train"], src=name, prefix="train.")
    if name == "seed000_table.yaml":
        assert (train.lr, train.total_steps, train.stop_step, train.checkpoint_every) == (3e-4, 26040, 2604, 651)
        assert train.grad_accum(world_size=4) == 32 and train.seed == 42


def test_context_features_under_autocast_skip_the_fp32_round_trip():
    """fp32 weights under bf16 autocast (the trainer's mixed precision): bf16 cache states go to fc as they are,
    the same output and fc gradient to the bit as upcasting them first (autocast casts them straight back)."""
    target = tiny_model("qwen3")
    draft = _draft(target)
    aux = torch.randn(2, 9, len(AUX), target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    aux = aux.to(torch.bfloat16)
    outs = []
    for ref in (True, False):
        draft.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = (draft.hidden_norm(draft.fc(aux.flatten(2).float())) if ref else draft.context_features(aux))
        y.float().square().sum().backward()
        outs.append((y.detach(), draft.fc.weight.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
