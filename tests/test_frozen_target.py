"""The draft's own RMSNorm / gated MLP / RoPE against transformers' modules (bit-identical), and the frozen target
(config.json + embedding + LM head read without transformers) against the full HF load: same tensors, same pad id,
the same draft built on either."""

import json

import pytest
import torch

from dspark_core import ops
from dspark_core.draft.config import DraftConfig
from dspark_core.draft.model import build_draft
from dspark_core.frozen_target import FrozenTarget, load_frozen_target, read_model_config
from dspark_core.target import load_target
from dspark_core.testing import save_tiny_target, tiny_config

FAMILY_PREFIX = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}


def _hf_module(family: str, name: str):
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(mod, FAMILY_PREFIX[family] + name)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_modules_match_transformers_bit_for_bit(family, dtype):
    cfg = tiny_config(family)
    torch.manual_seed(0)
    x = torch.randn(2, 5, cfg.hidden_size).to(dtype)  # [B, T, H]
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 100, 1000]])  # [B, T]

    hf_norm, norm = _hf_module(family, "RMSNorm")(cfg.hidden_size, eps=cfg.rms_norm_eps), ops.RMSNorm(
        cfg.hidden_size, eps=cfg.rms_norm_eps)
    with torch.no_grad():
        hf_norm.weight.normal_()
    norm.load_state_dict(hf_norm.state_dict())
    assert torch.equal(norm.to(dtype)(x), hf_norm.to(dtype)(x))

    hf_mlp = _hf_module(family, "MLP")(cfg).to(dtype)
    mlp = ops.GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act).to(dtype)
    mlp.load_state_dict(hf_mlp.state_dict())  # same parameter names
    assert torch.equal(mlp(x), hf_mlp(x))

    hf_rope = _hf_module(family, "RotaryEmbedding")(config=cfg)
    rope = ops.rotary_embedding(cfg)
    assert isinstance(rope, ops.RotaryEmbedding)
    for got, want in zip(rope(x, pos), hf_rope(x, pos)):
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)


def test_scaled_rope_goes_to_transformers(tmp_path):
    """A scaled rope type (llama3) is transformers' own table, from an HF config and from config.json alike."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    cfg = tiny_config("llama", rope_scaling=scaling)
    save_tiny_target(tmp_path, "llama", rope_scaling=scaling)
    x, pos = torch.zeros(1), torch.arange(0, 600, 7).unsqueeze(0)  # [1, T]
    want = _hf_module("llama", "RotaryEmbedding")(config=cfg)(x, pos)
    for config in (cfg, read_model_config(tmp_path)):
        rope = ops.rotary_embedding(config)
        assert not isinstance(rope, ops.RotaryEmbedding) and rope.rope_type == "llama3"
        assert all(torch.equal(a, b) for a, b in zip(rope(x, pos), want))


@pytest.fixture(scope="module", params=[("llama", True), ("qwen3", False)], ids=["llama-tied", "qwen3-untied"])
def target_dir(request, tmp_path_factory):
    family, tied = request.param
    return save_tiny_target(tmp_path_factory.mktemp(family) / "target", family, tie_word_embeddings=tied)


def test_frozen_target_matches_the_hf_load(target_dir):
    model, tok = load_target(target_dir)
    frozen, pad_id = load_frozen_target(target_dir)
    assert isinstance(frozen, FrozenTarget) and pad_id == tok.pad_token_id is not None
    for get in ("get_input_embeddings", "get_output_embeddings"):
        assert torch.equal(getattr(frozen, get)().weight, getattr(model, get)().weight)
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert (frozen.get_input_embeddings().weight is frozen.get_output_embeddings().weight) == tied
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias"):
        assert getattr(frozen.config, key) == getattr(model.config, key), key
    assert ops.rope_settings(frozen.config) == ops.rope_settings(model.config)


def test_a_draft_on_the_frozen_target_is_the_draft_on_the_hf_target(target_dir):
    model, _ = load_target(target_dir)
    frozen, _ = load_frozen_target(target_dir)
    cfg = DraftConfig(num_draft_layers=2, block_size=4, mask_token_id=259, markov_rank=8)
    drafts = []
    for target in (model, frozen):
        torch.manual_seed(3)
        drafts.append(build_draft(cfg, target.config, target.get_input_embeddings().weight,
                                  target.get_output_embeddings().weight, aux_layer_ids=[0, 2]))
    a, b = drafts
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 12))  # [B, L]
    aux = torch.randn(2, 12, 2, model.config.hidden_size)  # [B, L, K, Ht]
    anchors, valid = torch.tensor([[3, 7], [5, 9]]), torch.ones(2, 2, dtype=torch.bool)  # [B, A]
    h = a.forward_train(ids, aux, anchors, valid)  # [B, A, S, H]
    assert torch.equal(h, b.forward_train(ids, aux, anchors, valid))
    assert torch.equal(a.slot_logits(h), b.slot_logits(h))


def test_an_incomplete_config_goes_through_transformers(target_dir, tmp_path):
    import shutil

    d = tmp_path / "target"
    shutil.copytree(target_dir, d)
    raw = json.loads((d / "config.json").read_text())
    del raw["rms_norm_eps"]
    (d / "config.json").write_text(json.dumps(raw))
    assert read_model_config(d) is None
    model, pad_id = load_frozen_target(d)
    assert not isinstance(model, FrozenTarget) and pad_id is not None


def test_a_transformers_4_config_gets_rope_parameters(target_dir, tmp_path):
    raw = json.loads((target_dir / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw.update(rope_theta=rope["rope_theta"], rope_scaling=None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = read_model_config(tmp_path)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    assert not hasattr(cfg, "rope_theta") and not hasattr(cfg, "rope_scaling")
