"""Seed profiles apply cleanly to params.yaml and give valid sections; `args` round-trips through YAML."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from dspark_core.draft.stage import variant_configs
from dspark_core.dmtd.config import DMTDConfig
from dspark_core.data.prompts import PrepareConfig
from dspark_core.profiles import WHOLE_VALUES, apply_profile, available, exp_run_args, leaves, load_profile

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.workspace("the project's params.yaml: every profile applies to it")


@pytest.mark.parametrize("name", available())
def test_profile_applies_and_validates(name, tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    text_before = params.read_text()
    apply_profile(name, params)
    doc = yaml.safe_load(params.read_text())
    for key, value in leaves(load_profile(name)):
        cur = doc
        for part in key.split("."):
            cur = cur[part]
        assert cur == value, key
    assert "# dspark: every hyperparameter" in params.read_text()  # comments kept
    assert params.read_text() != text_before or not list(leaves(load_profile(name)))
    variant_configs(params, "baseline")  # draft / loss / train still valid
    DMTDConfig.load(params, "dmtd")


def _parse_overrides(args: list[str]) -> dict:
    """What `dvc exp run` makes of the -S arguments: Hydra's override parser, which DVC uses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert args[::2] == ["-S"] * (len(args) // 2) and all(" " not in a for a in args)
    out = {}
    for o in OverridesParser.create().parse_overrides(args[1::2]):
        out[(o.type.name, o.key_or_group)] = o.value()
    return out


@pytest.mark.parametrize("name", available())
def test_exp_run_args_parse_back(name):
    parsed = _parse_overrides(exp_run_args(name))
    for key, value in leaves(load_profile(name)):
        if key in WHOLE_VALUES:  # deleted, then added whole (DVC would merge a mapping into params.yaml's)
            assert ("DEL", key) in parsed
            got = parsed[("ADD", key)]
            assert got == value, key
            assert yaml.safe_load(yaml.safe_dump(got)) == got
        else:
            assert parsed[("CHANGE", key)] == value, key


def test_unknown_profile_key_is_refused(tmp_path):
    (tmp_path / "bad.yaml").write_text("train:\n  lrr: 1.0\n")
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    with pytest.raises(ValueError, match="train.lrr"):
        apply_profile("bad", params, profiles_dir=tmp_path)


def test_a_mix_is_replaced_whole(tmp_path):
    """prepare.train is a list: a profile's mix replaces params.yaml's (no source of it is kept), in the profile's
    order (the order the sources are drawn in), also as a `dvc exp run -S` argument, which replaces the list."""
    (tmp_path / "mix.yaml").write_text("prepare:\n  train:\n    - {source: codeio, weight: 2}\n"
                                       "    - {source: 'jsonl:data/sources/my.v2.jsonl.gz', weight: 1, holdout: 0.1}\n")
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    assert len(yaml.safe_load(params.read_text())["prepare"]["train"]) > 2
    apply_profile("mix", params, profiles_dir=tmp_path)
    want = [{"source": "codeio", "weight": 2}, {"source": "jsonl:data/sources/my.v2.jsonl.gz", "weight": 1,
                                                 "holdout": 0.1}]
    assert yaml.safe_load(params.read_text())["prepare"]["train"] == want
    args = exp_run_args("mix", profiles_dir=tmp_path)
    assert args == ["-S", "prepare.train=[{source:'codeio',weight:2},"
                          "{source:'jsonl:data/sources/my.v2.jsonl.gz',weight:1,holdout:0.1}]"]
    assert _parse_overrides(args)[("CHANGE", "prepare.train")] == want
    cfg = PrepareConfig.from_dict({"train": want})
    assert cfg.mix() == [("codeio", 2), ("jsonl:data/sources/my.v2.jsonl.gz", 1)]  # prepare reads the list
    assert cfg.holdouts() == {"jsonl:data/sources/my.v2.jsonl.gz": 0.1}


@pytest.mark.parametrize("name", [None, *available()])
def test_every_variant_of_every_profile_uses_the_frozen_engram_table(name, tmp_path):
    """The targets have no Engram module, so the table is the frozen one engram_build makes; trainable is an
    ablation a user asks for, never a default."""
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    if name is not None:
        apply_profile(name, params)
    variants = yaml.safe_load(params.read_text())["variants"]
    for variant in [v for v in variants if isinstance(variants[v], dict)] or ["baseline"]:
        draft, _, _ = variant_configs(params, variant)
        assert draft.engram.source == "frozen", (name, variant)


def test_profiles_applied_in_turn_keep_params_yaml_valid(tmp_path):
    """A list a first profile set, emptied by a second (a mapping likewise): the line keeps its comment and the next
    key its own line (ruamel dropped the comment token with a replaced list and joined the following key onto the
    line: a params.yaml no stage could read)."""
    (tmp_path / "a.yaml").write_text("bench_online:\n  peers: [hf_generate]\nvariant_dag:\n  warm: {x: baseline}\n")
    (tmp_path / "b.yaml").write_text("bench_online:\n  peers: []\nvariant_dag:\n  warm: {}\n")
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    apply_profile("a", params, profiles_dir=tmp_path)
    apply_profile("b", params, profiles_dir=tmp_path)
    doc = yaml.safe_load(params.read_text())
    assert doc["bench_online"]["peers"] == [] and doc["variant_dag"]["warm"] == {}
    assert doc["bench_online"]["prompt_lookup_num_tokens"] == 10  # the key after it, on its own line
    line = next(ln for ln in params.read_text().splitlines() if ln.strip().startswith("peers:"))
    assert "# transformers' generate" in line


def test_the_seed_recipe_skips_bad_records_and_holds_out_five_percent():
    """seed004 reads 1.3M conversations from the hub: a malformed record or a line that is not JSON is skipped and
    counted (prepare.max_bad_fraction stops a source that is mostly bad), not the end of the run."""
    prep = load_profile("seed004_qwen3_4b")["prepare"]
    cfg = PrepareConfig.from_dict(prep)
    assert cfg.on_bad_record == "skip" and cfg.max_bad_fraction == 0.1
    assert cfg.mix() == [("hf:mlabonne/open-perfectblend", 1)]
    assert cfg.holdouts() == {"hf:mlabonne/open-perfectblend": 0.05}
