"""Export to the serving engines' DSpark layouts, proven against the engines' own code (CPU, float32, tiny Qwen3).

1. round trip: export then import gives bit-identical draft outputs (both layouts, and ``dspark export/import``);
2. ``speculators``' own DSpark model loads the speculators-layout export and gives dspark's block logits (after the
   Markov bias), confidences and greedy block proposal on the same context and target hidden states;
3. vLLM's own speculative-config parser resolves the export (both layouts) to method ``dspark`` with the draft's
   target layer ids, block size and mask id;
4. a DeepSpec-layout checkpoint written here from the documented names (not by dspark's writer) imports and
   matches the same weights loaded natively;
and the refusals: what the engines cannot run is never written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_core.draft.config import DraftConfig
from dspark_core.checkpoint import load_draft, save_draft
from dspark_core.draft.model import DSparkDraft, build_draft
from dspark_core.errors import UserError
from dspark_core.export import export_draft, load_any_draft
from dspark_core.testing import save_tiny_target

S, AUX, MASK, CTX = 7, (1, 3), 259, 9  # block size, aux layers, <|mask|>, context length


def greedy(logits):
    return logits.argmax(-1), torch.softmax(logits, -1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from dspark_core.target import load_target

    path = save_tiny_target(tmp_path_factory.mktemp("target"))
    return path, load_target(path, dtype="float32", attn_implementation="eager")[0]


def make_draft(model, aux=AUX, **over) -> DSparkDraft:
    cfg = DraftConfig(**{"num_draft_layers": 2, "block_size": S, "mask_token_id": MASK, "markov_rank": 8,
                         "layer_style": "qwen3", "num_anchors": 4, **over})
    torch.manual_seed(1)
    draft = build_draft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                        aux_layer_ids=aux)
    with torch.no_grad():  # peaked distributions and a Markov bias that moves the argmax: a wrong weight shows
        for name, p in draft.named_parameters():
            if p.requires_grad and p.dim() == 1:  # norms near 1, biases non-zero
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif p.requires_grad:
                p.normal_(0.0, 0.5 if name.startswith("markov") else 0.2)
    return draft.eval()


@pytest.fixture(scope="module")
def draft(target):
    return make_draft(target[1])


@pytest.fixture(scope="module")
def context(target):
    """Token ids [1, CTX + S + 1] and the target's HF hidden_states (embedding output first)."""
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, CTX + S + 1))
    with torch.no_grad():
        hs = target[1](ids, output_hidden_states=True).hidden_states
    return ids, hs


def propose(draft, ids, hs):
    """dspark's inference: the context 0..CTX-1, anchor at CTX; per-slot logits, tokens, confidences."""
    aux = torch.stack([hs[i + 1] for i in draft.aux_layer_ids], dim=2)[:, :CTX]  # [1, CTX, K, Ht]
    cache = draft.new_context_cache(1, 64)
    draft.extend_context(cache, aux)
    seen = []

    def sample_fn(logits):
        seen.append(logits)
        return greedy(logits)

    out = draft.propose(cache, ids[:, CTX], sample_fn)
    return torch.stack(seen, dim=1), out.tokens, out.confidence  # [1, S, V], [1, S], [1, S]


@pytest.mark.parametrize("layout", ["deepspec", "speculators"])
def test_round_trip_is_bit_identical(target, draft, context, layout, tmp_path):
    export_draft(draft, tmp_path, layout, dtype="float32", target=str(target[0]))
    back = load_any_draft(tmp_path, target[1])
    for (a, b) in zip(propose(draft, *context), propose(back, *context)):
        assert torch.equal(a, b)
    assert "vllm serve" in (tmp_path / "README.md").read_text()


def test_a_damaged_export_is_refused_on_import(target, draft, tmp_path):
    export_draft(draft, tmp_path, "speculators", dtype="float32", target=str(target[0]))
    f = tmp_path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-100:-90] = bytes(10)  # same size, other bytes: only the recorded SHA-256 can tell
    f.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"model.safetensors: SHA-256 differs.*export it again"):
        load_any_draft(tmp_path, target[1])
    f.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(UserError, match=r"model.safetensors: \d+ bytes, manifest.json records"):
        load_any_draft(tmp_path, target[1])


def test_export_never_replaces_what_is_not_an_export(target, draft, tmp_path):
    """An export replaces its directory whole, so a directory holding anything else (or a file) is refused and
    left as it was; an earlier export (or an empty directory) is replaced."""
    mine = tmp_path / "project"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"project: holds notes.txt, sub, so it is not an earlier export"):
        export_draft(draft, mine, "deepspec")
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "sub").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        export_draft(draft, tmp_path / "file", "speculators")
    (tmp_path / "empty").mkdir()
    for _ in range(2):  # into an empty directory, then over that export
        export_draft(draft, tmp_path / "empty", "speculators")
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["README.md", "config.json", "manifest.json",
                                                                      "model.safetensors"]


def test_bf16_export_is_the_default(target, draft, tmp_path):
    export_draft(draft, tmp_path, "deepspec")
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_cli_export_then_import(target, draft, context, tmp_path):
    from dspark_core.export.run import export_dir, import_dir

    save_draft(tmp_path / "native", draft)
    export_dir(tmp_path / "native", tmp_path / "out", ["deepspec", "speculators"], "float32", target[0])
    import_dir(tmp_path / "out" / "speculators", tmp_path / "back", target[0])
    back = load_draft(tmp_path / "back", target[1])
    for (a, b) in zip(propose(draft, *context), propose(back, *context)):
        assert torch.equal(a, b)


def speculators_proposal(path, target_model, ids, hs):
    """speculators' own DSparkDraftModel on the export at ``path``: per-slot logits after its Markov bias [S, N],
    its greedy block (target ids, through its own d2t), its confidences for the anchor at CTX, and the target id
    of each logit column [N] (eager attention; its own loader and layer ids)."""
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    cfg = DSparkSpeculatorConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = DSparkDraftModel(cfg).eval()
    loaded = model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    assert loaded.unexpected_keys == []  # what it lacks is the verifier's, read from speculators_config.verifier:
    verifier_owned = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    assert set(loaded.missing_keys) == verifier_owned | ({"lm_head.weight"} if not model.use_draft_vocab else set())
    model.load_verifier_weights()
    target_lm = target_model.get_output_embeddings().weight  # [V, Ht]
    columns = torch.arange(model.draft_vocab_size)  # [N] the target id of each draft id
    if model.use_draft_vocab:  # its d2t offsets, and the head rows its loader keeps (the draft's own, as written)
        columns = columns + model.d2t
        assert torch.equal(model.verifier_lm_head.weight, target_lm[model.t2d])
    assert torch.equal(model.lm_head.weight, target_lm[columns])
    T = ids.shape[1]
    aux = torch.cat([hs[j] for j in cfg.aux_hidden_state_layer_ids], dim=-1)  # [1, T, K*Ht]: its own layer ids
    loss_mask = torch.zeros(1, T)
    loss_mask[0, CTX] = 1  # the one anchor it may pick: position CTX
    with torch.no_grad():
        hidden, logits, *_ = model._backbone_forward(aux, ids, loss_mask, hs[-1], torch.zeros_like(ids),
                                                      max_anchors=1)  # [1, S, H], [1, S, V]
        prev, tokens, block_logits, conf = [int(ids[0, CTX])], [], [], []
        for k in range(S):  # greedy, slot by slot: slot k's Markov bias reads the token chosen at k-1
            prev_ids = torch.tensor([prev + [0] * (S - len(prev))])  # [1, S]
            bias = model.markov_head.block_bias(prev_token_ids=prev_ids, hidden_states=hidden.view(1, S, -1))
            slot = logits[0, k] + bias[0, k]  # [V]
            emb = model.markov_head.prev_embeddings(prev_ids)[0, k]  # [r]
            conf.append(torch.sigmoid(model.confidence_head(torch.cat([hidden[0, k], emb]))))
            block_logits.append(slot)
            tokens.append(int(columns[slot.argmax()]))  # a draft id -> its target id
            prev.append(tokens[-1])
    return torch.stack(block_logits), tokens, torch.stack(conf), columns


def check_speculators_parity(draft, target_dir, target_model, context, out):
    pytest.importorskip("speculators")
    export_draft(draft, out, "speculators", dtype="float32", target=str(target_dir))
    logits, tokens, conf, columns = speculators_proposal(out, target_model, *context)
    ref_logits, ref_tokens, ref_conf = propose(draft, *context)
    kept = torch.arange(draft.vocab_size) if draft.draft_vocab is None else draft.draft_vocab.d2t  # [N]
    assert torch.equal(columns, kept)
    torch.testing.assert_close(logits, ref_logits[0][:, kept], rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens[0].tolist()
    torch.testing.assert_close(conf, ref_conf[0], rtol=1e-4, atol=1e-5)


def test_speculators_model_class_matches(target, draft, context, tmp_path):
    check_speculators_parity(draft, target[0], target[1], context, tmp_path)


def test_speculators_model_class_matches_on_a_llama_target(tmp_path):
    """The default target family (SmolLM2 is a Llama): the draft's Qwen3 layers on Llama RoPE and norms."""
    from dspark_core.target import load_target

    path = save_tiny_target(tmp_path / "llama", family="llama")
    model = load_target(path, dtype="float32", attn_implementation="eager")[0]
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, CTX + S + 1))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    check_speculators_parity(make_draft(model), path, model, (ids, hs), tmp_path / "out")


@pytest.mark.parametrize("layout", ["deepspec", "speculators"])
def test_vllm_parser_resolves_the_export(target, draft, layout, tmp_path):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    export_draft(draft, tmp_path, layout, dtype="float32", target=str(target[0]))
    tmc = ModelConfig(model=str(target[0]), tokenizer=str(target[0]), dtype="float32", skip_tokenizer_init=True)
    spec = SpeculativeConfig(model=str(tmp_path), target_model_config=tmc, target_parallel_config=ParallelConfig())
    hf = spec.draft_model_config.hf_config
    assert spec.method == "dspark" and spec.num_speculative_tokens == S
    assert spec.draft_model_config.architectures == ["Qwen3DSparkModel"]
    assert list(hf.target_layer_ids) == list(AUX) and hf.mask_token_id == MASK and hf.block_size == S
    assert hf.markov_rank == 8 and hf.markov_head_type == "vanilla" and hf.num_hidden_layers == 2


@pytest.mark.parametrize("layout", ["deepspec", "speculators"])
def test_export_writes_only_the_drafts_qwen3_fields(target, layout, tmp_path):
    """A quantised target's ``quantization_config`` (and any key a Qwen3 config lacks) describes the target, not
    the bf16 draft: never written, so vLLM builds plain layers for the draft."""
    import copy

    draft = make_draft(target[1])
    draft.hf_config = copy.deepcopy(draft.hf_config)
    draft.hf_config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    draft.hf_config.target_only_field = 3
    export_draft(draft, tmp_path, layout, dtype="float32", target=str(target[0]))
    text = (tmp_path / "config.json").read_text()
    assert "quantization_config" not in text and "target_only_field" not in text
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    tmc = ModelConfig(model=str(target[0]), tokenizer=str(target[0]), dtype="float32", skip_tokenizer_init=True)
    spec = SpeculativeConfig(model=str(tmp_path), target_model_config=tmc, target_parallel_config=ParallelConfig())
    assert spec.method == "dspark" and spec.draft_model_config.quantization is None


def test_scaled_rope_is_written_in_both_forms_and_runs_in_speculators(tmp_path):
    """A Llama-3-scaled RoPE target: the export writes ``rope_parameters`` (transformers 5) and the same scaling as
    ``rope_scaling`` (transformers 4 and loaders that read only that), transformers reads the two as one RoPE,
    speculators' model proposes dspark's block with it, and the import reads it back unchanged."""
    from transformers import Qwen3Config

    from dspark_core.target import load_target

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    path = save_tiny_target(tmp_path / "llama", family="llama", rope_parameters={**scaling, "rope_theta": 500000.0})
    model = load_target(path, dtype="float32", attn_implementation="eager")[0]
    draft = make_draft(model)
    export_draft(draft, tmp_path / "ds", "deepspec", dtype="float32", target=str(path))
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["rope_scaling"] == scaling and config["rope_theta"] == 500000.0
    assert config["rope_parameters"] == {**scaling, "rope_theta": 500000.0}
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"}
    assert Qwen3Config(**legacy).rope_parameters == Qwen3Config(**config).rope_parameters == config["rope_parameters"]
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, CTX + S + 1))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    back = load_any_draft(tmp_path / "ds", model)
    for a, b in zip(propose(draft, ids, hs), propose(back, ids, hs)):
        assert torch.equal(a, b)
    check_speculators_parity(draft, path, model, (ids, hs), tmp_path / "spec")


@pytest.mark.parametrize("layout", ["deepspec", "speculators"])
def test_embedding_output_as_an_aux_layer_exports(target, context, layout, tmp_path):
    """Aux layer -1 (the embedding output): DeepSpec's id -1, speculators' hidden_states index 0; vLLM's parser
    resolves it to target layer -1, speculators' model proposes dspark's block, and the import reads it back."""
    draft = make_draft(target[1], aux=(-1, 3))
    if layout == "speculators":
        check_speculators_parity(draft, target[0], target[1], context, tmp_path)
        assert json.loads((tmp_path / "config.json").read_text())["aux_hidden_state_layer_ids"] == [0, 4]
    else:
        export_draft(draft, tmp_path, layout, dtype="float32", target=str(target[0]))
        assert json.loads((tmp_path / "config.json").read_text())["target_layer_ids"] == [-1, 3]
    back = load_any_draft(tmp_path, target[1])
    assert back.aux_layer_ids == (-1, 3)
    for a, b in zip(propose(draft, *context), propose(back, *context)):
        assert torch.equal(a, b)
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    tmc = ModelConfig(model=str(target[0]), tokenizer=str(target[0]), dtype="float32", skip_tokenizer_init=True)
    spec = SpeculativeConfig(model=str(tmp_path), target_model_config=tmc, target_parallel_config=ParallelConfig())
    assert list(spec.draft_model_config.hf_config.target_layer_ids) == [-1, 3]


def documented_deepspec_checkpoint(draft, target_path, out):
    """A DeepSpec-layout directory written from the layout's documented names, without dspark's writer."""
    tc = json.loads((target_path / "config.json").read_text())
    config = {**tc, "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "num_hidden_layers": 2,
              "num_target_layers": tc["num_hidden_layers"], "block_size": S, "mask_token_id": MASK,
              "target_layer_ids": list(AUX), "markov_rank": 8, "markov_head_type": "vanilla",
              "enable_confidence_head": True, "confidence_head_with_markov": True, "num_anchors": 4,
              "tie_word_embeddings": False}
    w = {"fc.weight": draft.fc.weight, "hidden_norm.weight": draft.hidden_norm.weight,
         "norm.weight": draft.norm.weight, "markov_head.markov_w1.weight": draft.markov.w1.weight,
         "markov_head.markov_w2.weight": draft.markov.w2.weight,
         "confidence_head.proj.weight": draft.confidence.proj.weight,
         "confidence_head.proj.bias": draft.confidence.proj.bias,
         "embed_tokens.weight": draft.embedding_matrix(), "lm_head.weight": draft.lm_head_weight}
    for i, layer in enumerate(draft.layers):
        a = layer.self_attn
        parts = {"input_layernorm": layer.input_layernorm, "post_attention_layernorm": layer.post_attention_layernorm,
                 "self_attn.q_proj": a.q_proj, "self_attn.k_proj": a.k_proj, "self_attn.v_proj": a.v_proj,
                 "self_attn.o_proj": a.o_proj, "self_attn.q_norm": a.q_norm, "self_attn.k_norm": a.k_norm,
                 "mlp.gate_proj": layer.mlp.gate_proj, "mlp.up_proj": layer.mlp.up_proj,
                 "mlp.down_proj": layer.mlp.down_proj}
        w.update({f"layers.{i}.{name}.weight": mod.weight for name, mod in parts.items()})
    out.mkdir()
    save_file({k: v.detach().clone().contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_documented_deepspec_checkpoint_matches_native(target, draft, context, tmp_path):
    foreign = load_any_draft(documented_deepspec_checkpoint(draft, target[0], tmp_path / "ds"), target[1])
    native = load_draft(save_draft(tmp_path / "native", draft), target[1])
    for (a, b) in zip(propose(native, *context), propose(foreign, *context)):
        assert torch.equal(a, b)


def test_foreign_draft_for_another_target_is_refused(target, draft, tmp_path):
    path = documented_deepspec_checkpoint(draft, target[0], tmp_path / "ds")
    config = json.loads((path / "config.json").read_text())
    for key, value, word in (("vocab_size", 512, "vocab_size"), ("hidden_size", 32, "hidden_size"),
                             ("target_layer_ids", [1, 5], "target layer ids"),
                             ("layer_types", ["sliding_attention", "full_attention"], "layer_types"),
                             ("is_causal", True, "causal"),
                             ("rope_parameters", {"rope_type": "default", "rope_theta": 1234.0}, "RoPE"),
                             ("rms_norm_eps", 0.1, "rms_norm_eps"), ("hidden_act", "gelu", "hidden_act")):
        (path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(UserError, match=word):
            load_any_draft(path, target[1])
    rope = {**config["rope_parameters"], "mscale_all_dim": 0}  # a key another transformers version writes
    (path / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    load_any_draft(path, target[1])  # the same RoPE: imported
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(str(path / "model.safetensors"))
    for name in ("embed_tokens.weight", "lm_head.weight"):  # the target's copies: another target's rows
        other = {**weights, name: weights[name] * 1.5}
        save_file(other, str(path / "model.safetensors"))
        with pytest.raises(UserError, match=f"{name}.*not the given target's"):
            load_any_draft(path, target[1])
    save_file(weights, str(path / "model.safetensors"))
    load_any_draft(path, target[1])


@pytest.mark.parametrize("over, words", [
    ({"kind": "engram_markov"}, "engram_markov"),
    ({"kind": "draft_memory"}, "draft_memory"),
    ({"kind": "reranker"}, "reranker"),
    ({"mask_token_id": None}, "learned mask vector.*mask_token_id"),
    ({"hidden_size": 32}, "32 wide"),
    ({"layer_style": "target"}, None),
    ({"markov_head": "none", "confidence_with_markov": False}, "markov_head 'none'"),
    ({"markov_head": "gated"}, "markov_head 'gated'.*vanilla Markov head only"),
    ({"markov_head": "rnn"}, "markov_head 'rnn'"),
])
def test_refusals_name_the_variant(target, over, words, tmp_path):
    draft = make_draft(target[1], **over)
    if words is None:  # a Qwen3 target's own layers are Qwen3's: exportable
        export_draft(draft, tmp_path, "deepspec")
        return
    for layout in ("deepspec", "speculators"):
        with pytest.raises(UserError, match=words):
            export_draft(draft, tmp_path / layout, layout)
        assert not (tmp_path / layout).exists()


def test_llama_draft_needs_qwen3_layers(tmp_path):
    from dspark_core.testing import tiny_model

    llama = tiny_model("llama")
    with pytest.raises(UserError, match="layer_style: qwen3"):
        export_draft(make_draft(llama, layer_style="target"), tmp_path, "deepspec")
    export_draft(make_draft(llama), tmp_path, "deepspec")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3"


@pytest.mark.parametrize("layout", ["deepspec", "speculators"])
def test_warm_start_from_an_engine_layout(target, draft, layout, tmp_path):
    from dspark_core.draft.config import LossConfig
    from dspark_core.draft.task import DSparkTrainModel, load_warm_start

    export_draft(draft, tmp_path, layout, dtype="float32")
    model = target[1]
    fresh = build_draft(draft.cfg, model.config, model.get_input_embeddings().weight,
                        model.get_output_embeddings().weight, aux_layer_ids=AUX)
    load_warm_start(DSparkTrainModel(fresh, LossConfig()), tmp_path, target_fingerprint="another")
    for (k, v), (k2, v2) in zip(sorted(draft.state_dict().items()), sorted(fresh.state_dict().items())):
        assert k == k2 and torch.equal(v, v2), k
    other = build_draft(draft.cfg, model.config, model.get_input_embeddings().weight,
                        model.get_output_embeddings().weight, aux_layer_ids=(1, 2))
    with pytest.raises(UserError, match="target layer ids"):
        load_warm_start(DSparkTrainModel(other, LossConfig()), tmp_path)


def _export_project(root: Path, target, draft) -> Path:
    import shutil

    shutil.copytree(target[0], root / "data/target")
    save_draft(root / "data/train/baseline/final", draft)
    (root / "params.yaml").write_text("export: {variants: [baseline], layouts: [deepspec, speculators], "
                                      "dtype: float32}\n")
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_kill_9_in_export_then_the_same_command_gives_the_same_bytes(target, draft, tmp_path, monkeypatch):
    """``stages/export.py`` killed with SIGKILL between its two layouts (``tests/_paused_stage.py`` holds it there):
    the finished layout is whole, the other absent, and the same command then writes what an uninterrupted run does."""
    import signal
    import subprocess
    import sys
    import time

    from dspark_core.export.run import run_export_stage

    repo = Path(__file__).resolve().parents[1]
    killed = _export_project(tmp_path / "killed", target, draft)
    held = tmp_path / "held"
    proc = subprocess.Popen([sys.executable, str(repo / "tests/_paused_stage.py"), str(held), "export"],
                            cwd=killed, env={**os.environ, "PYTHONPATH": str(repo)}, stderr=subprocess.PIPE)
    try:
        ref = _export_project(tmp_path / "ref", target, draft)
        monkeypatch.chdir(ref)
        run_export_stage(Path("params.yaml"), "baseline")
        deadline = time.monotonic() + 300
        while not held.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "export was not held in 300 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    out = killed / "data/export/baseline"
    finished = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # temp dirs aside
    assert finished == ["deepspec"]  # the speculators layout: none, not half
    load_any_draft(out / "deepspec", target[1])  # the finished one passes its manifest
    monkeypatch.chdir(killed)
    run_export_stage(Path("params.yaml"), "baseline")
    got, want = _files(killed / "data/export"), _files(ref / "data/export")  # the killed run's temp dir gone too
    assert got.keys() == want.keys()
    assert [k for k in got if got[k] != want[k]] == []


def test_export_stage_writes_every_layout(target, draft, tmp_path, monkeypatch):
    import shutil

    from dspark_core.config import ParamsError
    from dspark_core.export.run import run_export_stage

    monkeypatch.chdir(tmp_path)
    shutil.copytree(target[0], "data/target")
    save_draft("data/train/baseline/final", draft)
    Path("params.yaml").write_text("export: {variants: [baseline], layouts: [deepspec, speculators], "
                                   "dtype: float32}\n")
    run_export_stage(Path("params.yaml"), "baseline")
    for layout in ("deepspec", "speculators"):
        back = load_any_draft(f"data/export/baseline/{layout}", target[1])
        assert torch.equal(back.fc.weight, draft.fc.weight)
        assert "vllm serve data/target" in Path(f"data/export/baseline/{layout}/README.md").read_text()
    Path("params.yaml").write_text("export: {layouts: [speculators], dtype: float32, verifier: Org/Target-8B}\n")
    run_export_stage(Path("params.yaml"), "baseline")
    config = json.loads(Path("data/export/baseline/speculators/config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "Org/Target-8B"
    assert "vllm serve Org/Target-8B" in Path("data/export/baseline/speculators/README.md").read_text()
    with pytest.raises(ParamsError, match="does not list 'reranker_joint'"):
        run_export_stage(Path("params.yaml"), "reranker_joint")
    Path("params.yaml").write_text("export: {layouts: [eagle3]}\n")
    with pytest.raises(ParamsError, match="layouts"):
        run_export_stage(Path("params.yaml"), "baseline")
    Path("params.yaml").write_text("export: {unsupported: ignore}\n")
    with pytest.raises(ParamsError, match="export.unsupported must be one of skip, error"):
        run_export_stage(Path("params.yaml"), "baseline")


# -- a reduced draft vocabulary (draft.vocab_size N): speculators' d2t / t2d, its own head rows, W2 with N rows --
N = 100


def make_reduced_draft(model, n: int = N, seed: int = 4) -> DSparkDraft:
    draft = make_draft(model, vocab_size=n)
    ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:n].sort().values
    draft.draft_vocab.set_ids(ids)  # [N] ascending target ids, as the draft_vocab stage's top_ids gives
    return draft


@pytest.fixture(scope="module")
def reduced(target):
    return make_reduced_draft(target[1])


def test_speculators_loads_a_reduced_vocabulary_and_proposes_the_same_block(target, reduced, context, tmp_path):
    check_speculators_parity(reduced, target[0], target[1], context, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    v = target[1].config.vocab_size
    assert config["draft_vocab_size"] == N and config["transformer_layer_config"]["vocab_size"] == v
    w = load_file(str(tmp_path / "model.safetensors"))
    d2t = reduced.draft_vocab.d2t
    assert w["d2t"].dtype == torch.int64 and torch.equal(w["d2t"] + torch.arange(N), d2t)  # offsets
    assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (v,) and torch.equal(w["t2d"].nonzero().flatten(), d2t)
    assert w["lm_head.weight"].shape == (N, 64) and torch.equal(w["lm_head.weight"], target[1].lm_head.weight[d2t])
    assert w["markov_head.markov_w2.weight"].shape == (N, 8) and w["markov_head.markov_w1.weight"].shape == (v, 8)
    assert not any(k.startswith("draft_vocab") for k in w) and "embed_tokens.weight" not in w


def test_reduced_vocabulary_round_trip_and_warm_start(target, reduced, context, tmp_path):
    from dspark_core.draft.config import LossConfig
    from dspark_core.draft.task import DSparkTrainModel, load_warm_start

    export_draft(reduced, tmp_path, "speculators", dtype="float32", target=str(target[0]))
    back = load_any_draft(tmp_path, target[1])
    assert back.cfg.vocab_size == N and torch.equal(back.draft_vocab.d2t, reduced.draft_vocab.d2t)
    assert torch.equal(back.draft_vocab.t2d, reduced.draft_vocab.t2d)
    for (a, b) in zip(propose(reduced, *context), propose(back, *context)):
        assert torch.equal(a, b)
    model = target[1]
    fresh = make_draft(model, vocab_size=N)  # placeholder maps 0 .. N-1: the export's replace them
    load_warm_start(DSparkTrainModel(fresh, LossConfig()), tmp_path, target_fingerprint="another")
    for (k, v), (k2, v2) in zip(sorted(reduced.state_dict().items()), sorted(fresh.state_dict().items())):
        assert k == k2 and torch.equal(v, v2), k
    with pytest.raises(UserError, match="draft vocabulary 100, this run's draft.vocab_size is null"):
        load_warm_start(DSparkTrainModel(make_draft(model), LossConfig()), tmp_path)


def test_reduced_vocabulary_refused_by_deepspec_and_when_its_maps_or_head_disagree(target, reduced, tmp_path):
    with pytest.raises(UserError, match="reduced draft vocabulary.*deepspec layout has no d2t / t2d.*--layout "
                                        "speculators"):
        export_draft(reduced, tmp_path / "ds", "deepspec")
    assert not (tmp_path / "ds").exists()
    out = export_draft(reduced, tmp_path / "sp", "speculators", dtype="float32")
    w = load_file(str(out / "model.safetensors"))
    (out / "manifest.json").unlink()  # as a published draft without dspark's manifest: read as it is
    for key, change, words in (("lm_head.weight", lambda t: t.index_fill(0, torch.tensor([3]), 0.5),
                                "lm_head.weight .100, 64. is not the given target's LM head rows at d2t"),
                               ("d2t", lambda t: t.index_fill(0, torch.tensor([3]), 0),
                                "d2t / t2d are not one draft vocabulary")):
        save_file({**w, key: change(w[key])}, str(out / "model.safetensors"))
        with pytest.raises(UserError, match=words):
            load_any_draft(out, target[1])
    save_file({k: v for k, v in w.items() if k != "t2d"}, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="only one of d2t / t2d"):
        load_any_draft(out, target[1])


def test_vllm_parser_resolves_a_reduced_export(target, reduced, tmp_path):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    export_draft(reduced, tmp_path, "speculators", dtype="float32", target=str(target[0]))
    tmc = ModelConfig(model=str(target[0]), tokenizer=str(target[0]), dtype="float32", skip_tokenizer_init=True)
    spec = SpeculativeConfig(model=str(tmp_path), target_model_config=tmc, target_parallel_config=ParallelConfig())
    hf = spec.draft_model_config.hf_config
    assert spec.method == "dspark" and hf.draft_vocab_size == N and hf.vocab_size == target[1].config.vocab_size


def test_speculators_own_loader_and_writer_round_trip_a_reduced_export(target, reduced, context, tmp_path):
    """speculators' ``from_pretrained`` keeps the export's reduced head and maps; what its ``save_pretrained``
    writes back imports into the same dspark draft."""
    pytest.importorskip("speculators")
    from speculators.models.dspark import DSparkDraftModel

    export_draft(reduced, tmp_path / "sp", "speculators", dtype="float32", target=str(target[0]))
    theirs = DSparkDraftModel.from_pretrained(str(tmp_path / "sp"))
    d2t = reduced.draft_vocab.d2t
    assert torch.equal(theirs.d2t + torch.arange(N), d2t) and torch.equal(theirs.t2d, reduced.draft_vocab.t2d >= 0)
    assert torch.equal(theirs.lm_head.weight, target[1].lm_head.weight[d2t])
    theirs.save_pretrained(str(tmp_path / "resaved"))
    back = load_any_draft(tmp_path / "resaved", target[1])
    assert back.cfg.vocab_size == N
    for (a, b) in zip(propose(reduced, *context), propose(back, *context)):
        assert torch.equal(a, b)


def test_export_stage_skips_a_layout_that_cannot_run_the_draft(target, reduced, tmp_path, monkeypatch, capsys):
    """``export.unsupported: skip`` (the default): a reduced-vocabulary draft (as ``dvc exp run -S
    draft.vocab_size=N`` trains) is written in the speculators layout, and deepspec/SKIPPED.txt says why;
    ``error`` fails the stage with the same reason."""
    import shutil

    from dspark_core.export.run import run_export_stage

    monkeypatch.chdir(tmp_path)
    shutil.copytree(target[0], "data/target")
    save_draft("data/train/baseline/final", reduced)
    Path("params.yaml").write_text("export: {dtype: float32}\n")
    out = run_export_stage(Path("params.yaml"), "baseline")
    assert [p.name for p in out] == ["deepspec", "speculators"]
    assert sorted(p.name for p in Path("data/export/baseline/deepspec").iterdir()) == ["SKIPPED.txt"]
    assert "reduced draft vocabulary" in Path("data/export/baseline/deepspec/SKIPPED.txt").read_text()
    assert "skipped: export --layout deepspec" in capsys.readouterr().err
    assert load_any_draft("data/export/baseline/speculators", target[1]).cfg.vocab_size == N
    Path("params.yaml").write_text("export: {dtype: float32, unsupported: error}\n")
    with pytest.raises(UserError, match="reduced draft vocabulary"):
        run_export_stage(Path("params.yaml"), "baseline")


def test_cli_export_then_import_of_a_reduced_draft(target, reduced, context, tmp_path):
    from dspark_core.export.run import export_dir, import_dir

    save_draft(tmp_path / "native", reduced)
    with pytest.raises(UserError, match=r"export.layouts: \[speculators\]"):
        export_dir(tmp_path / "native", tmp_path / "out", ["deepspec"], "float32", target[0])
    export_dir(tmp_path / "native", tmp_path / "out", ["speculators"], "float32", target[0])
    import_dir(tmp_path / "out" / "speculators", tmp_path / "back", target[0])
    back = load_draft(tmp_path / "back", target[1])
    assert back.cfg.vocab_size == N and torch.equal(back.draft_vocab.d2t, reduced.draft_vocab.d2t)
    for (a, b) in zip(propose(reduced, *context), propose(back, *context)):
        assert torch.equal(a, b)


def test_identity_maps_of_a_full_vocabulary_import_as_no_maps(target, draft, context, tmp_path):
    """A full-vocabulary speculators draft that stores d2t / t2d anyway (zero offsets, every id kept) is the
    full-vocabulary draft: it imports without a draft vocabulary and proposes the same block."""
    out = export_draft(draft, tmp_path, "speculators", dtype="float32", target=str(target[0]))
    v = target[1].config.vocab_size
    w = load_file(str(out / "model.safetensors"))
    save_file({**w, "d2t": torch.zeros(v, dtype=torch.int64), "t2d": torch.ones(v, dtype=torch.bool)},
              str(out / "model.safetensors"))
    (out / "manifest.json").unlink()  # as a published draft: read as it is
    back = load_any_draft(out, target[1])
    assert back.cfg.vocab_size is None and getattr(back, "draft_vocab", None) is None
    for (a, b) in zip(propose(draft, *context), propose(back, *context)):
        assert torch.equal(a, b)
