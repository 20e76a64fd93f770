"""Catalogue of bad inputs: each gives ONE clear error naming the param, value or path, raised
by our own checks (never a traceback from deep inside torch / zarr / transformers), and leaves nothing
half-written where the stage writes its outputs.

Every case runs in a fresh project dir laid out as the DAG leaves it (``data/target``, ``data/regen``, the stores in
``data/cache_stores`` linked as ``data/cache/{train,eval}.zarr``, a small ``params.yaml``; tiny random targets),
drives a stage entry (or the
library call it makes) and checks:

- the error is a ``ValueError`` (``ParamsError`` is one) whose one-line text matches the case's regex;
- it was raised in ``dspark_core/`` or ``stages/``;
- no file or folder was created, changed or removed (outside the case's ``may_change`` paths, which hold the
  crash-safe partial state a stage keeps by design), no temp file (``.name.*``) is left, and the case's
  ``absent`` paths (the stage's outputs) do not exist.

The table ``CASES`` is the catalogue: (name, setup, message regex, paths absent afterwards, ...).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import yaml

from dspark_core.cache import CacheConfig, CacheDataset, build_store, run_cache
from dspark_core.cache.build import build_token_store
from dspark_core.cache.home import link_tree, tree_files
from dspark_core.cache.store import open_store
from dspark_core.checkpoint import load_draft, save_draft
from dspark_core.config import ParamsError
from dspark_core.io import git_ignored_dir
from dspark_core.data.prompts import PrepareConfig, Prompt, run_prepare, write_prompts
from dspark_core.data.regenerate import RegenerateConfig, run_regenerate
from dspark_core.bench.online import run_bench_online_stage
from dspark_core.draft import DraftConfig, DSparkDraft
from dspark_core.dmtd.stage import dmtd_configs
from dspark_core.draft.stage import run_eval_offline_stage, run_train_stage
from dspark_core.target import TargetConfig, load_target, read_fingerprint, run_target
from dspark_core.testing import NAN_TOKEN, save_hub_repo, save_tiny_target, write_regen
from dspark_core.variants import merge

REPO = Path(__file__).resolve().parents[1]
LAYERS = [1, 3]  # tiny targets have 6 decoder layers: 5 is the final one
# 6 samples, 298 tokens: two 256-token chunks; the longest (100) is over max_length 96 (truncated)
LENGTHS = [(20, 30), (60, 40), (10, 20), (30, 35), (15, 20), (8, 14)]
N_TOKENS = sum(min(a + b, 96) for a, b in LENGTHS)  # 298
FP = r"[0-9a-f]{16}"
DRAFT = "data/train/baseline/final"
CKPT = "data/train/baseline/checkpoints/step_00000001"
# a train@baseline run stopped after step 1 of 2 (its outputs, and its report folder)
TRAINED = (("trained_out", "data/train/baseline"), ("trained_reports", "reports/train/baseline"))
NOT_UTF8 = b'{"turns": ["Hi"]}\n{"turns": ["caf\xe9 au lait"]}\n'  # latin-1 e-acute in line 2

PARAMS: dict[str, Any] = {
    "target": {"source": "hf_dir", "path": "no/such/hf_dir", "out_dir": "data/target"},
    "prepare": {"train": "jsonl:src.jsonl", "eval_sources": ["jsonl:src.jsonl"], "n_train": 4, "n_eval": 2,
                "out_dir": "data/prompts"},
    "cache": {"aux_layer_ids": LAYERS, "max_length": 96, "chunk_tokens": 256, "batch_tokens": 512, "device": "cpu",
              "splits": ["train"]},
    "draft": {"num_draft_layers": 1, "block_size": 4, "mask_token_id": 259, "num_anchors": 4, "markov_rank": 8},
    "loss": {},
    "train": {"lr": 1.0e-3, "total_steps": 2, "max_steps": 2, "micro_batch_size": 2, "global_batch_size": 2,
              "checkpoint_every": 1, "keep_checkpoints": 1, "log_every": 1, "precision": "fp32"},
    "variants": {"baseline": {}, "small": {"draft": {"markov_rank": 4}}},
    "eval_offline": {"batch_size": 2, "num_anchors": 4},
    "bench_online": {"datasets": ["jsonl:prompts.jsonl"], "max_prompts": 2, "max_new_tokens": 8, "max_len": 256,
                     "peers": [], "device": "cpu", "out_dir": "reports/bench_online"},
    "regenerate": {"backend": "hf", "device": "cpu", "threads": 1, "max_new_tokens": 12, "batch_size": 2,
                   "splits": ["train"]},
}


# -- shared inputs (built once) --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("assets")
    a = {"target": save_tiny_target(root / "target", "qwen3"),
         "other_target": save_tiny_target(root / "other_target", "qwen3", seed=1),
         "shallow_target": save_tiny_target(root / "shallow_target", "qwen3", num_hidden_layers=4),
         "regen": write_regen(root / "regen" / "train.parquet", LENGTHS)}
    model, _ = load_target(a["target"])
    fp = read_fingerprint(a["target"])["fingerprint"]
    cfg = CacheConfig.from_dict(PARAMS["cache"])
    a["store"] = root / "cache" / "train.zarr"
    build_store(model, fp, cfg, a["regen"], a["store"])
    a["token_store"] = root / "token_cache" / "train.zarr"  # the same, token-only (hidden_states: online)
    build_token_store(model.config, fp, cfg, a["regen"], a["token_store"])
    torch.manual_seed(0)
    draft = DSparkDraft(DraftConfig.from_dict(PARAMS["draft"]), model.config, model.get_input_embeddings().weight,
                        model.get_output_embeddings().weight, aux_layer_ids=LAYERS, target_fingerprint=fp)
    a["draft"] = save_draft(root / "draft", draft)
    nan_target = save_tiny_target(root / "nan_target", "qwen3")  # NAN_TOKEN's embedding is NaN
    with torch.no_grad():
        model.model.embed_tokens.weight[NAN_TOKEN] = float("nan")
    model.save_pretrained(nan_target)
    a["nan_target"] = nan_target
    a["nan_regen"] = write_regen(root / "nan_regen" / "train.parquet", LENGTHS, poison=2)
    trained = _stopped_training(root / "trained", a)
    a["trained_out"], a["trained_reports"] = trained / "data/train/baseline", trained / "reports/train/baseline"
    return a


def _stopped_training(root: Path, assets: dict[str, Path]) -> Path:
    """A project whose train@baseline stopped (time budget) after step 1 of 2: a checkpoint to resume from."""
    cwd = Path.cwd()
    Project(root, assets)
    try:
        os.chdir(root)
        run_train_stage(Path("params.yaml"), "baseline", time_budget_s=1e-9)
    finally:
        os.chdir(cwd)
    assert (root / "data/train/baseline/checkpoints/step_00000001/manifest.json").is_file()
    return root


class Project:
    """A project dir as the DAG leaves it after the cache stage; cases edit it before the call under test."""

    def __init__(self, root: Path, assets: dict[str, Path]) -> None:
        self.root, self.assets = root, assets
        shutil.copytree(assets["target"], root / "data" / "target")
        shutil.copytree(assets["regen"].parent, root / "data" / "regen")
        home = git_ignored_dir(root / "data" / "cache_stores")  # the stores, and their links in data/cache
        for split in ("train", "eval"):
            shutil.copytree(assets["store"], home / f"{split}.zarr")
            link_tree(tree_files(home / f"{split}.zarr"), root / "data" / "cache" / f"{split}.zarr")
        (root / "prompts.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n"
                                                    for t in ("What is 2 + 3?", "Name a colour.")))
        self.params()

    def params(self, **over: Any) -> None:
        """params.yaml = PARAMS with ``over`` (section -> mapping) merged in key by key."""
        (self.root / "params.yaml").write_text(yaml.safe_dump(merge(PARAMS, over), sort_keys=False))

    def put(self, asset: str, rel: str) -> Path:
        """Copy an asset dir to ``rel`` (replacing what is there)."""
        dst = self.root / rel
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(self.assets[asset], dst)
        return dst

    def store(self, split: str = "train"):
        return open_store(self.root / "data" / "cache" / f"{split}.zarr", mode="r+")


# -- how cases call the stages ----------------------------------------------------------------------------------
def train(variant: str = "baseline") -> Callable[[], Any]:
    return lambda: run_train_stage(Path("params.yaml"), variant)


def bench(variant: str = "baseline") -> Callable[[], Any]:
    return lambda: run_bench_online_stage("params.yaml", variant)


def eval_offline(variant: str = "baseline") -> Callable[[], Any]:
    return lambda: run_eval_offline_stage(Path("params.yaml"), variant)


def cache(**kw: Any) -> Callable[[], Any]:
    return lambda: run_cache(CacheConfig.load("params.yaml", "cache"), **kw)


def prepare() -> Callable[[], Any]:
    return lambda: run_prepare(PrepareConfig.load("params.yaml", "prepare"))


def invoke_stage(script: str, *args: str):
    """Run ``python stages/<script>.py ARGS`` in this process (typer's runner); returns typer's result."""
    import typer
    from typer.testing import CliRunner

    spec = importlib.util.spec_from_file_location(f"_stage_{script}", REPO / "stages" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    app = typer.Typer()
    app.command()(mod.main)
    return CliRunner().invoke(app, list(args))


def cli(script: str, *args: str) -> Callable[[], Any]:
    """``python stages/<script>.py ARGS`` in this process: re-raises what the command raised."""
    def run() -> None:
        res = invoke_stage(script, *args)
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            raise res.exception
        raise AssertionError(f"exit code {res.exit_code} without an exception: {res.output}")

    return run


# -- setups: edit the project, return the call that must fail ---------------------------------------------------
def params_then(call: Callable[[], Any], **over: Any) -> Callable[[Project], Callable[[], Any]]:
    def setup(p: Project) -> Callable[[], Any]:
        p.params(**over)
        return call
    return setup


def with_draft(call: Callable[[], Any], target: str | None = None, **over: Any):
    """The trained baseline draft in data/train/baseline/final; optionally another target in data/target."""
    def setup(p: Project) -> Callable[[], Any]:
        p.put("draft", "data/train/baseline/final")
        if target is not None:
            p.put(target, "data/target")
        p.params(**over)
        return call
    return setup


TWO_NODES = {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29500", "global_batch_size": 4}


def node_rank_env(env: dict[str, str] | None):
    """``python stages/train.py`` on one of 2 nodes whose rank neither params nor the environment give right:
    ``env`` holds the node-rank variables set (the others unset) while it runs; refused before torchrun starts."""
    from dspark_core.dist import NODE_RANK_ENV

    def setup(p: Project) -> Callable[[], Any]:
        p.params(train=TWO_NODES)
        stage = cli("train", "--variant", "baseline")

        def run() -> None:
            saved = {k: os.environ.pop(k) for k in NODE_RANK_ENV + ("LOCAL_RANK",) if k in os.environ}
            os.environ.update(env or {})
            try:
                stage()
            finally:
                for k in NODE_RANK_ENV:
                    os.environ.pop(k, None)
                os.environ.update(saved)
        return run
    return setup


def foreign_target_for_cache(p: Project):
    p.put("other_target", "data/target")
    return train()


def other_layer_ids_in_eval_cache(p: Project):
    p.put("draft", "data/train/baseline/final")
    p.store("eval").attrs["aux_layer_ids"] = [0, 2]  # as if built with cache.aux_layer_ids [0, 2]
    return eval_offline()


def stale_store_kept(p: Project):  # `python stages/cache.py --keep-stale` after a cache.aux_layer_ids change
    p.params(cache={"aux_layer_ids": [0, 2]})
    return cli("cache", "--keep-stale")


def missing_chunk(p: Project):
    (p.root / "data/cache/train.zarr/aux_hidden/c/1/0/0").unlink()
    return train()


def damaged_chunk(p: Project):
    f = p.root / "data/cache/train.zarr/last_hidden/c/0/0"
    f.write_bytes(f.read_bytes()[:50])
    return train()


def flipped_chunk(call: Callable[[], Any], split: str = "train"):
    """300 bytes flipped inside an aux_hidden chunk (the same size: only its checksum tells)."""
    def setup(p: Project):
        if split == "eval":  # eval_offline reads the trained draft
            p.put("draft", "data/train/baseline/final")
        f = p.root / f"data/cache/{split}.zarr/aux_hidden/c/0/0/0"
        b = bytearray(f.read_bytes())
        for i in range(100, 400):
            b[i] ^= 0x5A
        f.write_bytes(bytes(b))
        return call
    return setup


def damaged_metadata(rel: str):
    """The store's (or one array's) zarr.json cut short, as a full disk or a killed copy leaves it."""
    def setup(p: Project):
        f = p.root / "data/cache/train.zarr" / rel
        f.write_bytes(f.read_bytes()[:40])
        return train()
    return setup


def damaged_regen(how: str):
    """data/regen/train.parquet cut short (``truncate``) or one byte flipped in the middle of its token-id column
    (``flip``: the same size, only the page checksum tells)."""
    def setup(p: Project):
        import pyarrow.parquet as pq

        f = p.root / "data/regen/train.parquet"
        b = bytearray(f.read_bytes())
        if how == "truncate":
            del b[-100:]
        else:
            col = pq.ParquetFile(f).metadata.row_group(0).column(3)  # response_ids
            start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
            b[start + col.total_compressed_size - 3] ^= 0x10  # inside the body of the chunk's last page
        f.write_bytes(bytes(b))
        return cache()
    return setup


def damaged_target_weights(call: Callable[[], Any]):
    """data/target as the target stage leaves it (fingerprint.json recorded), then one byte of its weights flipped
    (the same size: only the recorded weights_sha256 tells)."""
    def setup(p: Project):
        from dspark_core.target import write_fingerprint

        write_fingerprint(p.root / "data/target")
        f = p.root / "data/target/model.safetensors"
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x01
        f.write_bytes(bytes(b))
        return call
    return setup


def changed_params_over_a_stopped_run(**over: Any):
    """A stopped train@baseline run (its checkpoint and curves), then params.yaml changed by ``over``."""
    def setup(p: Project):
        for asset, dst in TRAINED:
            p.put(asset, dst)
        p.params(**over)
        return train()
    return setup


def yaml_syntax(p: Project):
    (p.root / "params.yaml").write_text("train:\n  lr: 1.0e-3\n  total_steps: [2\n")
    return train()


def manifest_says_more(p: Project):
    g = p.store()
    g.attrs["num_samples"] = len(LENGTHS) + 3
    return train()


def incomplete_store(p: Project):
    p.store().attrs.update({"complete": False, "committed_samples": 2})
    return train()


def token_only_store(call: Callable[[], Any], split: str = "train", **over: Any):
    """data/cache/<split>.zarr token-only (the cache stage ran with that split's consumer online), then params
    changed by ``over`` (and the trained draft in place, for eval_offline)."""
    def setup(p: Project):
        p.put("token_store", f"data/cache/{split}.zarr")
        if split == "eval":
            p.put("draft", "data/train/baseline/final")
        p.params(**over)
        return call
    return setup


def little_disk_space(p: Project):
    """No cache yet, and 10 kB free where the stores go: less than their hidden states take uncompressed."""
    from unittest import mock

    no_stores(p)

    def run():
        with mock.patch("shutil.disk_usage", lambda path: shutil._ntuple_diskusage(10**6, 0, 10**4)):
            return cache()()
    return run


def no_cache(p: Project):
    shutil.rmtree(p.root / "data" / "cache")
    return train()


def _poison(p: Project, samples: list[int]) -> None:
    g = p.store()
    offs = g["offsets"][:]
    for n in samples:
        g["aux_hidden"][int(offs[n]) + 1, 0, :] = 0x7FC0  # bf16 NaN bits at the sample's token 1


def nan_in_cache_train(p: Project):
    _poison(p, list(range(len(LENGTHS))))
    return train()


def nan_in_cache_item(p: Project):
    _poison(p, [2])
    return lambda: CacheDataset("data/cache/train.zarr")[2]


def nan_from_target(p: Project):
    p.put("nan_target", "data/target")
    shutil.copy(p.assets["nan_regen"], p.root / "data/regen/train.parquet")
    no_stores(p)
    return cache()


def no_stores(p: Project) -> None:
    """No cache yet: neither the stores nor their links."""
    for rel in ("data/cache", "data/cache_stores"):
        shutil.rmtree(p.root / rel)


def incomplete_store_refused(p: Project) -> None:
    """The store the failed build began stays in the home, half-built (a rerun resumes it); no link is made."""
    assert not (p.root / "data/cache/train.zarr").exists()
    with pytest.raises(ValueError, match=r"data/cache_stores/train.zarr: cache store is incomplete"):
        CacheDataset(p.root / "data/cache_stores/train.zarr")


def regen_rows(lengths: list[tuple[int, int]], **over: Any):
    def setup(p: Project):
        write_regen(p.root / "data/regen/train.parquet", lengths)
        p.params(**over)
        return cache()
    return setup


def regen_spans(spans: dict[int, list[tuple[int, int]]]):
    def setup(p: Project):
        write_regen(p.root / "data/regen/train.parquet", LENGTHS, spans=spans)
        return cache()
    return setup


def regenerate_none(prompts: list[Prompt]):
    def setup(p: Project):
        write_prompts(p.root / "data/prompts/train.parquet", prompts)
        p.params(regenerate={"backend": "none", "max_turns": 2})
        return regenerate()
    return setup


def template_answer_twice(p: Project):
    """A chat template that renders an assistant message twice: no span can be found in it."""
    (p.root / "data/target/chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% if m['role'] == 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    write_prompts(p.root / "data/prompts/train.parquet", [Prompt("q0", "test", ("Hi", "More"))])
    p.params(regenerate={"max_turns": 2})
    return regenerate()


def prepare_from(lines: list[str], **over: Any):
    def setup(p: Project):
        (p.root / "src.jsonl").write_text("".join(line + "\n" for line in lines))
        p.params(prepare=over)
        return prepare()
    return setup


def bench_prompts(lines: list[str], **over: Any):
    def setup(p: Project):
        p.put("draft", "data/train/baseline/final")
        (p.root / "prompts.jsonl").write_text("".join(line + "\n" for line in lines))
        p.params(bench_online=over)
        return bench()
    return setup


def bench_prompt_table(p: Project):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p.put("draft", "data/train/baseline/final")
    (p.root / "data/prompts").mkdir()
    pq.write_table(pa.table({"id": ["a"], "source": ["sharegpt"], "turns": [["hello"]]}),
                   p.root / "data/prompts/eval.parquet")
    p.params(bench_online={"datasets": ["gsm8k"]})
    return bench()


def no_target(call: Callable[[], Any], draft: bool = False):
    def setup(p: Project):
        shutil.rmtree(p.root / "data" / "target")
        if draft:
            p.put("draft", "data/train/baseline/final")
        return call
    return setup


def target_stage_missing_source(p: Project):
    shutil.rmtree(p.root / "data" / "target")
    return lambda: run_target(TargetConfig.load("params.yaml", "target"))


HUB = "org/tiny"


@contextlib.contextmanager
def hub_cache(p: Project):
    """huggingface_hub's cache beside the project (``hf_hub``), offline, while the block runs."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as m:
        m.setattr(constants, "HF_HUB_CACHE", str(p.root.parent / "hf_hub"))
        m.setattr(constants, "HF_HUB_OFFLINE", True)
        yield


def with_hub(p: Project, call: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with hub_cache(p):
            return call()
    return run


def _marker(p: Project) -> Path:
    return p.root.parent / "marker"


def hub_target_stage(model: str, remote_code: bool = False):
    """The target stage on hub id ``model`` (data/target removed first): the tiny target laid out in the hub cache as
    ``org/tiny`` (``remote_code``: its config's auto_map names a .py of the repository that writes a marker file when
    imported); nothing cached for any other id."""
    def setup(p: Project):
        shutil.rmtree(p.root / "data" / "target")
        src = p.assets["target"]
        if remote_code:
            src = shutil.copytree(src, p.root.parent / "remote_src")
            cfg = json.loads((src / "config.json").read_text())
            (src / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoConfig": "marker_code.Config"}}))
            (src / "marker_code.py").write_text(f"open({str(_marker(p))!r}, 'w').write('ran')\n")
        save_hub_repo(p.root.parent / "hf_hub", HUB, src)
        p.params(target={"source": "hf_hub", "model": model})
        return with_hub(p, lambda: run_target(TargetConfig.load("params.yaml", "target")))
    return setup


def no_marker(p: Project) -> None:
    assert not _marker(p).exists(), "the repository's code ran"


def hub_weights_truncated(call: Callable[[], Any]):
    """data/target made by the target stage from ``org/tiny`` in the hub cache, then the weights blob there cut short."""
    def setup(p: Project):
        save_hub_repo(p.root.parent / "hf_hub", HUB, p.assets["target"])
        shutil.rmtree(p.root / "data" / "target")
        with hub_cache(p):
            run_target(TargetConfig(source="hf_hub", model=HUB, out_dir="data/target"))
        blob = next((p.root.parent / "hf_hub").rglob("model.safetensors")).resolve()
        blob.write_bytes(blob.read_bytes()[:-100])
        return with_hub(p, call)
    return setup


def draft_on(target: str):
    """load_draft of the baseline draft on another target (the library call bench_online / eval_offline make)."""
    def setup(p: Project):
        p.put("draft", "data/train/baseline/final")
        p.put(target, "data/target")

        def run():
            model, _ = load_target("data/target")
            return load_draft("data/train/baseline/final", model,
                              expected_fingerprint=read_fingerprint("data/target")["fingerprint"])
        return run
    return setup


def damaged_file(call: Callable[[], Any], rel: str, how: str, copies=(("draft", DRAFT),)):
    """``rel`` truncated by 100 bytes (``how="truncate"``) or one byte flipped inside it (``"flip"``), after each
    asset of ``copies`` (asset, path) was put at its path."""
    def setup(p: Project):
        for asset, dst in copies:
            p.put(asset, dst)
        f = p.root / rel
        b = bytearray(f.read_bytes())
        if how == "truncate":
            del b[-100:]
        else:
            b[-20] ^= 0x01
        f.write_bytes(bytes(b))
        return call
    return setup


class _RunsCode:
    """Unpickling this calls ``exec`` on code that writes the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def pickle_that_runs_code(p: Project):
    """The stopped run's checkpoint in the older layout (state.pt) with a pickle that would run code, its manifest
    rewritten to match (as a checkpoint pulled from a shared remote could be)."""
    from dspark_core.checkpoint import write_manifest

    for asset, dst in TRAINED:
        p.put(asset, dst)
    ckpt = p.root / CKPT
    for name in ("state.json", "state.safetensors"):
        (ckpt / name).unlink()
    torch.save({"step": 1, "scheduler": {}, "rng": {}, "x": _RunsCode(p.root / "ran_code")}, ckpt / "state.pt")
    write_manifest(ckpt, ["model.safetensors", "state.pt"])
    return train()


def regenerate() -> Callable[[], Any]:
    return lambda: run_regenerate(RegenerateConfig.load("params.yaml", "regenerate"))


def prompts_parquet(turns: tuple[str, ...]):
    def setup(p: Project):
        write_prompts(p.root / "data/prompts/train.parquet", [Prompt("q0", "test", ("Say yes.",)),
                                                             Prompt("q1", "test", turns)])
        return regenerate()
    return setup


def raw_file(call: Callable[[Project], Callable[[], Any]], name: str, data: bytes):
    """``name`` holds ``data`` (bytes, e.g. not UTF-8) when ``call``'s setup has run."""
    def setup(p: Project):
        run = call(p)
        (p.root / name).write_bytes(data)
        return run
    return setup


# -- the catalogue ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    setup: Callable[[Project], Callable[[], Any]]
    match: str                                      # regex the message must match (re.search)
    absent: tuple[str, ...] = ()                    # the stage's outputs: must not exist afterwards
    may_change: tuple[str, ...] = ()                # paths whose (crash-safe, resumable) state may differ afterwards
    after: Callable[[Project], None] | None = None  # further checks


TRAIN_OUT = ("data/train/baseline", "reports/train")
BENCH_OUT = ("reports/bench_online",)
EVAL_OUT = ("reports/eval_offline",)
CACHE_OUT = ("reports/cache_stats.json",)
KNOWN = r"\(have: baseline, small\)"

CASES = [
    # 1. unknown variant: names it and lists the known ones
    Case("variant/train_cli", lambda p: cli("train", "--variant", "nope"),
         rf"params.yaml: variants.nope is not defined {KNOWN}", TRAIN_OUT),
    Case("variant/bench_online", with_draft(bench("nope")), rf"params.yaml: variants.nope is not defined {KNOWN}",
         BENCH_OUT),
    Case("variant/eval_offline", with_draft(eval_offline("nope")),
         rf"params.yaml: variants.nope is not defined {KNOWN}", EVAL_OUT),
    Case("variant/bad_section", params_then(train("baseline"), variants={"baseline": {"trian": {"lr": 1.0}}}),
         r"variants.baseline.trian is not a section a variant may override \(draft, loss, train, warm_start\)",
         TRAIN_OUT),
    Case("variant/unknown_override_key", params_then(train("small"), variants={"small": {"draft": {"blocksize": 3}}}),
         r"params.yaml: variants.small.draft.blocksize is not a known parameter \(known: .*\bblock_size\b",
         ("data/train/small", "reports/train")),
    Case("variant/unknown_nested_override_key",
         params_then(train("small"), variants={"small": {"draft": {"engram": {"ordrs": [1]}}}}),
         r"params.yaml: variants.small.draft.engram.ordrs is not a known parameter \(known: .*\borders\b",
         ("data/train/small", "reports/train")),
    # 2. bad param types / values / keys; wrong layer ids
    Case("params/string_for_number", params_then(train(), train={"lr": "fast"}),
         r"params.yaml: train.lr must be a number, got 'fast'", TRAIN_OUT),
    Case("params/string_for_integer", params_then(train(), train={"total_steps": "ten"}),
         r"params.yaml: train.total_steps must be an integer, got 'ten'", TRAIN_OUT),
    Case("params/negative_steps", params_then(train(), train={"max_steps": -3}),
         r"params.yaml: train.max_steps must be in \[1, total_steps=2\]; got -3", TRAIN_OUT),
    Case("params/negative_total_steps", params_then(train(), train={"total_steps": -1, "max_steps": None}),
         r"params.yaml: train.total_steps must be > 0; got -1", TRAIN_OUT),
    Case("params/unknown_key", params_then(train(), train={"lrr": 1.0e-3}),
         r"params.yaml: train.lrr is not a known parameter \(known: .*\blr\b", TRAIN_OUT),
    Case("params/pure_bf16_training", params_then(train(), train={"param_dtype": "bfloat16",
                                                                  "master_dtype": "bfloat16"}),
         r"params.yaml: train.param_dtype: bfloat16 with master_dtype: bfloat16 is pure-bf16 training .*fails the "
         r"golden-curve check .*; set master_dtype: float32 \(bf16 working weights, float32 master weights", TRAIN_OUT),
    Case("params/master_below_weights", params_then(train(), train={"master_dtype": "bfloat16"}),
         r"params.yaml: train.master_dtype: bfloat16 below param_dtype: float32; .* set master_dtype: float32",
         TRAIN_OUT),
    Case("params/variant_override_type",
         params_then(train("small"), variants={"small": {"draft": {"num_anchors": "x"}}}),
         r"params.yaml: draft.num_anchors must be an integer, got 'x'", ("data/train/small", "reports/train")),
    Case("params/bench_zero_new_tokens", with_draft(bench(), bench_online={"max_new_tokens": 0}),
         r"params.yaml: bench_online.max_new_tokens must be > 0; got 0", BENCH_OUT),
    Case("params/bench_small_gemm", with_draft(bench(), bench_online={"small_gemm": "tensor"}),
         r"params.yaml: bench_online.small_gemm must be mma, fma or null; got 'tensor'", BENCH_OUT),
    Case("params/regenerate_vllm_both_ways", params_then(regenerate(), regenerate={"backend": "vllm",
                                                                                  "vllm": {"dtype": "bfloat16"}}),
         r"params.yaml: regenerate.vllm.dtype is given both ways, as regenerate.vllm.dtype and by regenerate.dtype; "
         r"drop it from regenerate.vllm", ("data/regen/parts", "reports/regenerate_stats.json")),
    Case("params/regenerate_vllm_data_parallel",
         params_then(regenerate(), regenerate={"backend": "vllm", "vllm": {"data_parallel_size": 8}}),
         r"params.yaml: regenerate.vllm.data_parallel_size: 8: vLLM's offline engine \(vllm.LLM\) runs one "
         r"data-parallel rank per process", ("data/regen/parts", "reports/regenerate_stats.json")),
    Case("params/cache_type", params_then(cache(), cache={"chunk_tokens": "big"}),
         r"params.yaml: cache.chunk_tokens must be an integer, got 'big'", CACHE_OUT),
    Case("layers/final_layer", params_then(cache(), cache={"aux_layer_ids": [1, 5]}),
         r"cache.aux_layer_ids: 5 is the final decoder layer of this 6-layer target", CACHE_OUT),
    Case("layers/out_of_range", params_then(cache(), cache={"aux_layer_ids": [1, 9]}),
         r"cache.aux_layer_ids: layer id 9 is out of range for a 6-layer target \(allowed -1 .. 4", CACHE_OUT),
    Case("layers/below_embedding", params_then(cache(), cache={"aux_layer_ids": [-2, 1]}),
         r"params.yaml: cache.aux_layer_ids: layer id -2 is out of range", CACHE_OUT),
    Case("layers/duplicate", params_then(cache(), cache={"aux_layer_ids": [1, 1]}),
         r"params.yaml: cache.aux_layer_ids: duplicate layer id\(s\) \[1\]", CACHE_OUT),
    # 3. foreign and truncated caches: name the store
    Case("cache/other_model", foreign_target_for_cache,
         rf"data/cache/train.zarr: cache from another model \(its model_fingerprint is {FP}, the target's is {FP}\)",
         TRAIN_OUT),
    Case("cache/other_layer_ids", other_layer_ids_in_eval_cache,
         r"data/cache/eval.zarr: cache holds aux layers \[0, 2\], the caller expects \[1, 3\]", EVAL_OUT),
    Case("cache/other_settings_kept", stale_store_kept,
         r"data/cache_stores/train.zarr: a cache built with other settings \(aux_layer_ids: stored \[1, 3\], now "
         r"\[0, 2\]\)",
         CACHE_OUT),
    Case("cache/missing_chunk", missing_chunk,
         r"data/cache/train.zarr: truncated cache store: 1 of 2 chunk\(s\) of aux_hidden are missing \(the first holds "
         rf"tokens 256..{N_TOKENS - 1}\)", TRAIN_OUT),
    Case("cache/damaged_chunk", damaged_chunk,
         r"data/cache/train.zarr: sample \d+ \(tokens \d+..\d+\) cannot be read: chunk last_hidden/c/0/0 \(tokens "
         r"0..255\) fails its CRC-32C checksum; the store is damaged; rebuild it with `dvc repro -f cache`",
         TRAIN_OUT),
    Case("cache/flipped_chunk_train", flipped_chunk(train()),
         r"data/cache/train.zarr: sample \d+ \(tokens \d+..\d+\) cannot be read: chunk aux_hidden/c/0/0/0 \(tokens "
         r"0..255\) fails its CRC-32C checksum; the store is damaged", TRAIN_OUT),
    Case("cache/flipped_chunk_eval", flipped_chunk(eval_offline(), "eval"),
         r"data/cache/eval.zarr: sample \d+ \(tokens \d+..\d+\) cannot be read: chunk aux_hidden/c/0/0/0", EVAL_OUT),
    Case("params/device_name", params_then(cache(), cache={"device": "gpu"}),
         r"params.yaml: cache.device must be auto, cpu, cuda or cuda:N; got 'gpu'", CACHE_OUT),
    *([Case("params/cuda_without_a_gpu", params_then(cache(), cache={"device": "cuda"}),
            r"cache.device: 'cuda', but no CUDA device is available here; set it to auto or cpu", CACHE_OUT)]
      if not torch.cuda.is_available() else []),
    Case("params/zero_loss", params_then(train(), loss={"ce_alpha": 0, "l1_alpha": 0, "conf_alpha": 0,
                                                        "rank_alpha": 0}),
         r"params.yaml: loss.ce_alpha, l1_alpha, conf_alpha and rank_alpha are all 0", TRAIN_OUT),
    Case("params/odd_head_dim", params_then(train(), draft={"head_dim": 7}),
         r"params.yaml: draft.head_dim must be even \(RoPE rotates pairs of dimensions\); got 7", TRAIN_OUT),
    Case("params/batch_arithmetic", params_then(train(), train={"global_batch_size": 3}),
         r"params.yaml: train.global_batch_size=3 is not a multiple of nnodes x nproc_per_node x micro_batch_size = "
         r"1 x 1 x 2", TRAIN_OUT),
    Case("params/batch_arithmetic_of_nodes", params_then(train(), train={**TWO_NODES, "global_batch_size": 2}),
         r"params.yaml: train.global_batch_size=2 is not a multiple of nnodes x nproc_per_node x micro_batch_size = "
         r"2 x 1 x 2", TRAIN_OUT),
    Case("params/no_nodes", params_then(train(), train={"nnodes": 0}), r"params.yaml: train.nnodes must be > 0; got 0",
         TRAIN_OUT),
    Case("params/node_rank_past_the_nodes", params_then(train(), train={**TWO_NODES, "node_rank": 2}),
         r"params.yaml: train.node_rank must be in \[0, nnodes=2\) or null \(from the environment: NODE_RANK, "
         r"PET_NODE_RANK, SLURM_NODEID\); got 2", TRAIN_OUT),
    Case("params/no_rdzv_endpoint", params_then(train(), train={"nnodes": 2, "global_batch_size": 4}),
         r"params.yaml: train.rdzv_endpoint is null but nnodes=2: give node 0's host:port", TRAIN_OUT),
    Case("params/rdzv_endpoint_without_port", params_then(train(), train={**TWO_NODES, "rdzv_endpoint": "10.0.0.1"}),
         r"params.yaml: train.rdzv_endpoint must be node 0's host:port \(e.g. 10.0.0.1:29500\); got '10.0.0.1'",
         TRAIN_OUT),
    Case("params/node_rank_nowhere", node_rank_env(None),
         r"train.node_rank is null and none of NODE_RANK, PET_NODE_RANK, SLURM_NODEID is set: this host cannot tell "
         r"its rank among the 2 nodes; export NODE_RANK=<0..1>", TRAIN_OUT),
    Case("params/node_rank_env_not_a_rank", node_rank_env({"SLURM_NODEID": "2"}),
         r"SLURM_NODEID='2' \(this host's node rank\) must be an integer in \[0, 2\) for 2 nodes; fix the variable, "
         r"or set train.node_rank", TRAIN_OUT),
    Case("variant/unknown_kind", params_then(train("small"), variants={"small": {"draft": {"kind": "foo"}}}),
         r"params.yaml: variants.small.draft.kind must be one of baseline, .*; got 'foo'",
         ("data/train/small", "reports/train")),
    Case("params/bench_tree_branch_past_the_block",
         with_draft(bench(), bench_online={"tree_branches": [[8, 1]], "concurrency": [1]}),
         r"bench_online.tree_branches \[\[8, 1\]\]: tree branch \(start 8, length 1\): needs 1 <= start <= 4.*"
         r"fix the \[start, length\] pairs", BENCH_OUT),
    Case("params/bench_tree_at_concurrency_2", with_draft(bench(), bench_online={"tree_branches": [[1, 1]]}),
         r"params.yaml: bench_online.concurrency \[1, 2\] with tree_branches: draft trees are verified at "
         r"concurrency 1 only; set concurrency: \[1\] or tree_branches: \[\]", BENCH_OUT),
    Case("params/bench_levels_on_the_reference_engine",
         with_draft(bench(), bench_online={"engine": "reference", "concurrency": [1, 4]}),
         r"params.yaml: bench_online.concurrency \[1, 4\] with engine: reference: the reference engine decodes one "
         r"request; set engine: auto \(or static\), or concurrency: \[1\]", BENCH_OUT),
    Case("params/bench_tree_with_confidence_cut",
         with_draft(bench(), bench_online={"tree_branches": [[1, 1]], "confidence_threshold": 0.5}),
         r"params.yaml: bench_online.tree_branches with confidence_threshold 0.5: the confidence cut applies to the "
         r"chain only", BENCH_OUT),
    Case("params/not_finite", params_then(train(), train={"lr": float("inf")}),
         r"params.yaml: train.lr must be a finite number, got inf", TRAIN_OUT),
    Case("params/heads_not_a_multiple", params_then(train(), draft={"num_attention_heads": 3}),
         r"draft: num_attention_heads 3 is not a multiple of num_key_value_heads 2; set draft.num_attention_heads",
         TRAIN_OUT),
    Case("params/late_check_keeps_the_older_run", changed_params_over_a_stopped_run(draft={"num_attention_heads": 3}),
         r"num_attention_heads 3 is not a multiple"),  # nothing of the stopped run is cleared (no change at all)
    Case("params/no_params_file", lambda p: lambda: run_train_stage(Path("nope.yaml"), "baseline"),
         r"nope.yaml: params file not found", TRAIN_OUT),
    Case("params/hidden_states", params_then(train(), train={"hidden_states": "disk"}),
         r"params.yaml: train.hidden_states must be one of cache, online; got 'disk'", TRAIN_OUT),
    Case("params/cache_stage_hidden_states", params_then(cli("cache"), eval_offline={"hidden_states": "ram"}),
         r"params.yaml: eval_offline.hidden_states must be one of cache, online; got 'ram'", CACHE_OUT),
    Case("params/dmtd_hidden_states",
         params_then(lambda: dmtd_configs(Path("params.yaml"), "causal_refresh"), dmtd={},
                     dmtd_train={"hidden_states": "online"}),
         r"params.yaml: dmtd_train.hidden_states: DMTD fine-tunes the target on token ids and reads no cached hidden "
         r"states; remove the key \(got 'online'\)"),
    Case("cache/variant_reads_a_token_only_store",
         token_only_store(train(), train={"hidden_states": "online"},
                          variants={"baseline": {"train": {"hidden_states": "cache"}}}),
         r"params.yaml: variants.baseline.train.hidden_states is cache, but data/cache/train.zarr is a token-only "
         r"store \(the cache stage wrote it for train.hidden_states: online; .*set variants.baseline.train."
         r"hidden_states: online, or set train.hidden_states: cache and rerun the cache stage", TRAIN_OUT),
    Case("cache/eval_reads_a_token_only_store", token_only_store(eval_offline(), "eval"),
         r"params.yaml: eval_offline.hidden_states is cache, but data/cache/eval.zarr is a token-only store .*set "
         r"eval_offline.hidden_states: online, or", EVAL_OUT),
    Case("cache/no_disk_space", little_disk_space,
         r"cache: the hidden states of 298 tokens \(train\) take 115.9 kB uncompressed \(389 bytes a token\), but "
         r"\S+ has 10.0 kB free; free some space, or train without a cache: set train.hidden_states: online",
         ("data/cache", "data/cache_stores") + CACHE_OUT),
    Case("cache/damaged_store_metadata", damaged_metadata("zarr.json"),
         r"data/cache/train.zarr: cache store metadata is damaged \(JSONDecodeError.*rebuild the store with "
         r"`dvc repro -f cache`", TRAIN_OUT),
    Case("cache/damaged_array_metadata", damaged_metadata("aux_hidden/zarr.json"),
         r"data/cache/train.zarr: cache store metadata is damaged", TRAIN_OUT),
    Case("cache/regen_truncated", damaged_regen("truncate"),
         r"data/regen/train.parquet: damaged or not a Parquet file \(.*\); rerun the regenerate stage", CACHE_OUT),
    Case("cache/regen_flipped_byte", damaged_regen("flip"),
         r"data/regen/train.parquet: damaged or not a Parquet file \(.*(checksum|CRC).*\); rerun the regenerate",
         CACHE_OUT),
    Case("params/yaml_syntax", yaml_syntax, r"params.yaml: line \d+, column \d+: YAML syntax error", TRAIN_OUT),
    Case("cache/manifest_more_samples", manifest_says_more,
         rf"data/cache/train.zarr: the manifest says 9 samples / {N_TOKENS} tokens, but its offsets hold 6 samples / "
         rf"{N_TOKENS} tokens; the store is truncated",
         TRAIN_OUT),
    Case("cache/incomplete", incomplete_store,
         r"data/cache/train.zarr: cache store is incomplete \(2 of 6 samples written\); rerun the cache stage",
         TRAIN_OUT),
    Case("cache/missing", no_cache, r"data/cache/train.zarr: not a cache store \(no zarr.json\); run the cache stage",
         TRAIN_OUT),
    # 4. NaN hidden states: name the store and the sample
    Case("nan/train_on_cache", nan_in_cache_train,
         r"data/cache/train.zarr: sample \d \(source row \d\) holds NaN/inf hidden states from its token 1", TRAIN_OUT),
    Case("nan/cache_item", nan_in_cache_item,
         r"data/cache/train.zarr: sample 2 \(source row \d\) holds NaN/inf hidden states from its token 1"),
    Case("nan/target_output", nan_from_target,
         r"cache: target hidden states of sample 's002' \(source row 2\) are NaN/inf from token \d+; nothing stored",
         CACHE_OUT, may_change=("data/cache_stores",), after=incomplete_store_refused),
    # 5. empty prompt sets: name the source / param
    Case("empty/prepare_n_train", prepare_from(['{"turns": ["q"]}'], n_train=0),
         r"params.yaml: prepare.n_train must be > 0; got 0", ("data/prompts",)),
    Case("empty/prepare_source", prepare_from([]), r"src.jsonl: the file is empty \(no JSON records\)",
         ("data/prompts",)),
    Case("empty/prepare_all_too_long", prepare_from([json.dumps({"turns": ["x" * 50 + str(i)]}) for i in range(9)],
                                                    max_prompt_chars=20),
         r"prepare: source 'jsonl:src.jsonl' has too few usable prompts .*max_prompt_chars=20.*lower prepare.n_eval",
         ("data/prompts",)),
    Case("empty/bench_no_datasets", with_draft(bench(), bench_online={"datasets": []}),
         r"params.yaml: bench_online.datasets must name at least one dataset", BENCH_OUT),
    Case("empty/bench_empty_jsonl", bench_prompts([]),
         r"bench_online.datasets: 'jsonl:prompts.jsonl' selects no prompt", BENCH_OUT),
    Case("empty/bench_no_such_source", bench_prompt_table,
         r"bench_online.datasets: 'gsm8k' selects no prompt from data/prompts/eval.parquet", BENCH_OUT),
    Case("empty/cache_regen", regen_rows([]), r"data/regen/train.parquet: no rows", CACHE_OUT),
    # 6. prompts longer than the max length: name the value / param
    Case("too_long/cache_on_too_long_error", regen_rows(LENGTHS, cache={"on_too_long": "error"}),
         r"data/regen/train.parquet: row 1 \(id 's001'\) has 100 tokens > cache.max_length=96 "
         r"\(cache.on_too_long=error\)", CACHE_OUT),
    Case("too_long/bench_max_len_warm_up", bench_prompts([json.dumps({"turns": ["What is 2 + 3?"]})], max_len=16),
         r"bench_online.max_len=16 is too small for the warm-up on prompt 0 of dataset 'jsonl:prompts.jsonl': "
         r"\d+ prompt tokens need \d+ positions", BENCH_OUT),
    Case("too_long/bench_max_len_prompt", bench_prompts([json.dumps({"turns": ["Hi"]}),
                                                        json.dumps({"turns": ["y" * 200]})], max_len=128),
         r"bench_online.max_len=128 is too small for prompt 1 \(turn 0\) of dataset 'jsonl:prompts.jsonl': "
         r"2\d\d prompt tokens", BENCH_OUT),
    # 7. missing target dir: name the path
    Case("target/missing_cache", no_target(cache()), r"data/target: target directory not found", CACHE_OUT),
    Case("target/missing_train", no_target(train()), r"data/target: target directory not found", TRAIN_OUT),
    Case("target/missing_bench", no_target(bench(), draft=True), r"data/target: target directory not found", BENCH_OUT),
    Case("target/missing_eval", no_target(eval_offline(), draft=True), r"data/target: target directory not found",
         EVAL_OUT),
    Case("target/damaged_weights_train", damaged_target_weights(train()),
         r"data/target: its weights \(model.safetensors\) no longer hash to the weights_sha256 fingerprint.json "
         r"records \(damaged or replaced\); restore them with `dvc checkout data/target`", TRAIN_OUT),
    Case("target/damaged_weights_cache", damaged_target_weights(cache()),
         r"data/target: its weights \(model.safetensors\) no longer hash", CACHE_OUT),
    Case("target/stage_source_missing", target_stage_missing_source, r"target.path: \S*no/such/hf_dir is not a "
         r"directory", ("data/target",)),
    Case("target/hub_not_in_cache", hub_target_stage("org/none"),
         r"^target.model: org/none \(revision main\) is not in the hub cache \S+ and HF_HUB_OFFLINE=1 forbids "
         r"downloading it; download it first \(`hf download org/none --revision main`\)", ("data/target",)),
    Case("target/hub_remote_code", hub_target_stage(HUB, remote_code=True),
         r"config.json: the model needs its repository's own code \(auto_map \['AutoConfig'\]\), which dspark runs "
         r"only with target.trust_remote_code: true", ("data/target",), after=no_marker),
    Case("target/hub_weights_truncated_train", hub_weights_truncated(train()),
         r"^data/target: weights file model.safetensors in the hub cache \(\S+\) has \d+ bytes, target_info.json "
         r"records \d+ \(a damaged or partial download\); fetch it again with `hf download org/tiny "
         r"model.safetensors --revision [0-9a-f]{40} --force-download`", TRAIN_OUT),
    Case("target/hub_weights_truncated_cache", hub_weights_truncated(cache()),
         r"^data/target: weights file model.safetensors in the hub cache", CACHE_OUT),
    # 8. a draft trained for another target: name both fingerprints and paths
    Case("draft/other_target_bench", with_draft(bench(), target="other_target"),
         rf"data/train/baseline/final/config.json: draft trained on target fingerprint {FP}, the given target "
         rf"\(data/target\) has fingerprint {FP}", BENCH_OUT),
    Case("draft/other_target_eval", with_draft(eval_offline(), target="other_target"),
         rf"data/train/baseline/final/config.json: draft trained on target fingerprint {FP}, the given target "
         rf"\(data/target\) has fingerprint {FP}", EVAL_OUT),
    Case("draft/other_architecture", draft_on("shallow_target"),
         r"data/train/baseline/final/config.json: draft trained for another target: its target.num_hidden_layers is "
         r"6, the given target \(data/target\) has 4"),
    # 9. damaged checkpoints: size / sha256 of manifest.json, checked before a weight is read
    Case("checkpoint/truncated_draft_eval", damaged_file(eval_offline(), f"{DRAFT}/model.safetensors", "truncate"),
         rf"{DRAFT}/model.safetensors: \d+ bytes, manifest.json records \d+ \(truncated or replaced\); retrain the "
         rf"draft or restore {DRAFT} \(`dvc checkout`\)", EVAL_OUT),
    Case("checkpoint/altered_draft_bench", damaged_file(bench(), f"{DRAFT}/model.safetensors", "flip"),
         rf"{DRAFT}/model.safetensors: SHA-256 differs from the one manifest.json records \(the file is damaged\)",
         BENCH_OUT),
    Case("checkpoint/truncated_train_resume", damaged_file(train(), f"{CKPT}/model.safetensors", "truncate", TRAINED),
         rf"{CKPT}/model.safetensors: \d+ bytes, manifest.json records \d+ \(truncated or replaced\); delete {CKPT} "
         r"and point data/train/baseline/checkpoints/latest.json at an earlier step"),
    Case("checkpoint/pickle_that_runs_code", pickle_that_runs_code,
         rf"{CKPT}/state.pt: refused, not a plain training state \(it asks for exec, which could run code\); nothing "
         rf"of it was loaded or run. Restore the checkpoint from a source you trust, or delete {CKPT}",
         ("ran_code",)),
    # 10. empty prompts and prompts that are not UTF-8: refused naming the line (no prompt silently dropped)
    Case("prompt/prepare_empty_turn", prepare_from(['{"turns": ["What is 2 + 3?"]}', '{"turns": ["  "]}']),
         r"src.jsonl:2: field 'turns' must be a non-empty list of non-empty strings, got \"\['  '\]\"",
         ("data/prompts",)),
    Case("prompt/bench_empty_turn", bench_prompts(['{"turns": ["Hi"]}', '{"turns": [""]}']),
         r"prompts.jsonl: line 2: 'turns' must be a non-empty list of non-empty strings", BENCH_OUT),
    Case("prompt/regenerate_empty_turn", prompts_parquet(("",)),
         r"data/prompts/train.parquet: row id='q1' has an empty turn \(\[''\]\); fix the prompts",
         ("reports/regenerate_stats.json", "data/regen/parts")),
    Case("prompt/regenerate_none_without_replies",
         regenerate_none([Prompt("q0", "test", ("Say yes.",), replies=("Yes.",)), Prompt("q1", "test", ("Hi",))]),
         r"data/prompts/train.parquet: row id='q1' has no assistant replies; regenerate.backend: none takes the "
         r"data set's own answers \(give the rows replies, or answer them with a backend: hf, vllm or openai\)",
         ("reports/regenerate_stats.json", "data/regen/parts")),
    Case("template/answer_rendered_twice", template_answer_twice,
         r"data/target: the chat template does not render assistant message 1 once, in place; the answers' loss "
         r"spans cannot be found from it", ("reports/regenerate_stats.json", "data/regen/parts")),
    Case("cache/regen_spans_out_of_order", regen_spans({1: [(70, 80), (10, 20)]}),
         r"data/regen/train.parquet: row 1 \(id 's001'\) has loss spans \[\(70, 80\), \(10, 20\)\] that are not "
         r"ordered, disjoint spans of its 100 tokens; rerun the regenerate stage", CACHE_OUT),
    Case("prompt/prepare_not_utf8", raw_file(prepare_from([]), "src.jsonl", NOT_UTF8),
         r"src.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\); save the file as UTF-8", ("data/prompts",)),
    Case("prompt/prepare_sharegpt_assistant_first",
         prepare_from([json.dumps({"conversations": [{"from": "gpt", "value": "Hi!"},
                                                     {"from": "human", "value": "Hello"}]})]),
         r"src.jsonl:1: conversations\[0\] is an assistant turn before any user turn; accepted records: .*"
         r"; or set prepare.on_bad_record: skip to skip and count such records", ("data/prompts",)),
    Case("prompt/prepare_two_user_turns",
         prepare_from([json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})]),
         r"src.jsonl:1: messages\[0\] and \[1\] are two user turns in a row; accepted records", ("data/prompts",)),
    Case("params/prepare_malformed_hf_name", params_then(prepare(), prepare={"train": "hf:org/na me"}),
         r"params.yaml: prepare.train: malformed source name 'hf:org/na me': use hf:<org>/<name>\[:<config>"
         r"\[:<split>\]\]\[@<revision>\]", ("data/prompts",)),
    Case("params/prepare_holdout_fraction",
         params_then(prepare(), prepare={"train": [{"source": "jsonl:src.jsonl", "holdout": 1.5}]}),
         r"params.yaml: prepare.train: the holdout of 'jsonl:src.jsonl' must be >= 0 and < 1; got 1.5",
         ("data/prompts",)),
    Case("params/prepare_sources_as_keys", params_then(prepare(), prepare={"train_mix": {"jsonl:src.jsonl": 1}}),
         r"params.yaml: prepare.train_mix is not a parameter: .* here: train: \[\{source: 'jsonl:src.jsonl', "
         r"weight: 1\}\]$", ("data/prompts",)),
    Case("prompt/prepare_mostly_bad",
         prepare_from(['{"turns": ["q1"]}', '{"turns": ["q2"', '{"turns": ["q3"]}', "not json"] +
                      [json.dumps({"turns": [f"q{i}"]}) for i in range(4, 12)], on_bad_record="skip"),
         r"^prepare: jsonl:src.jsonl: 2 of 12 records are bad \(bad_json 2; 16.7%\), more than "
         r"prepare.max_bad_fraction 0.1: the source is likely not what it says", ("data/prompts",)),
    Case("prompt/bench_not_utf8", raw_file(bench_prompts([]), "prompts.jsonl", NOT_UTF8),
         r"prompts.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)", BENCH_OUT),
    Case("too_long/cache_prompt_alone", regen_rows([(120, 10)] + LENGTHS, cache={"on_too_long": "error"}),
         r"data/regen/train.parquet: row 0 \(id 's000'\) has 130 tokens > cache.max_length=96", CACHE_OUT),
]


def _tree(root: Path) -> dict[str, tuple]:
    out = {}
    for p in root.rglob("*"):
        st = p.lstat()
        out[str(p.relative_to(root))] = ("dir",) if p.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == q or path.startswith(q + "/") for q in prefixes)


@pytest.fixture
def project(tmp_path, assets, monkeypatch, one_thread) -> Project:
    p = Project(tmp_path / "proj", assets)
    monkeypatch.chdir(p.root)
    return p


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gives_one_clear_error(case: Case, project: Project):
    call = case.setup(project)
    before = _tree(project.root)
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert re.search(case.match, msg), f"message does not match {case.match!r}:\n{msg}"
    assert "\n" not in msg, f"not a one-line message:\n{msg}"
    origin = Path(str(info.traceback[-1].path)).resolve()
    assert any(origin.is_relative_to(REPO / d) for d in ("dspark_core", "stages")), \
        f"raised in {origin}, not by our own checks:\n{msg}"
    after = _tree(project.root)
    changed = sorted(k for k in set(before) | set(after)
                     if before.get(k) != after.get(k) and not _under(k, case.may_change))
    assert not changed, f"left behind / changed: {changed[:10]}"
    temps = [k for k in after if any(part.startswith(".") and part != ".gitignore" for part in Path(k).parts)]
    assert not temps, f"temp files left: {temps}"
    for rel in case.absent:
        assert not (project.root / rel).exists(), rel
    if case.after is not None:
        case.after(project)


def test_catalogue_covers_every_item():
    """Every kind of bad input has cases; names are unique."""
    kinds = {c.name.split("/")[0] for c in CASES}
    assert kinds == {"variant", "params", "layers", "cache", "nan", "empty", "too_long", "target", "draft",
                     "checkpoint", "prompt", "template"}
    assert len({c.name for c in CASES}) == len(CASES)


def test_params_error_is_a_value_error():
    assert issubclass(ParamsError, ValueError)  # so every case can expect a ValueError


def test_verify_lists_damaged_chunks(project: Project):
    """``dspark cache verify``'s checksum pass finds a chunk whose bytes were flipped (same size) and is not ok."""
    from dspark_core.cache.verify import verify_cache

    flipped_chunk(lambda: None)(project)
    report = verify_cache("data/cache/train.zarr", "data/target", n_samples=0)
    assert not report["ok"]
    assert [b["chunk"] for b in report["chunks"]["bad"]] == ["aux_hidden/c/0/0/0"]
    clean = verify_cache("data/cache/eval.zarr", "data/target", n_samples=0)
    assert clean["ok"] and clean["chunks"]["bad"] == [] and clean["chunks"]["checked"] > 0


def test_prompt_over_max_length_is_cut_and_counted(project: Project):
    """The default ``cache.on_too_long: truncate`` keeps a sample longer than ``cache.max_length`` cut to it and
    counts it in the stats. ``long_conversations: split`` (the default) keeps its answer whole with the prompt's
    tail; ``truncate`` keeps its head: one whose prompt alone fills max_length has no response token left and is
    counted as such (its loss mask is empty, so it trains nothing), its answer's tokens as lost."""
    regen_rows([(120, 10)] + LENGTHS)(project)
    no_stores(project)
    stats = cache()()
    assert stats["truncated_samples"] == 2 and stats["no_response_samples"] == 0  # rows 0 (130) and 2 (100)
    ds = CacheDataset("data/cache/train.zarr")
    assert sorted(int(ds[n]["loss_mask"].sum()) for n in range(len(ds)) if len(ds[n]["input_ids"]) == 96) == [10, 40]
    assert (stats["answers_cut"], stats["answer_tokens_lost"]) == (0, 0)
    project.params(cache={"long_conversations": "truncate"})
    stats = cache(rebuild_stale=True)()
    assert stats["truncated_samples"] == 2 and stats["no_response_samples"] == 1
    assert (stats["answers_cut"], stats["answer_tokens_lost"]) == (2, 10 + 4)
    ds = CacheDataset("data/cache/train.zarr")
    cut = [ds[n] for n in range(len(ds)) if not ds[n]["loss_mask"].any()]
    assert len(cut) == 1 and cut[0]["input_ids"].shape[0] == 96


# -- the command line: exit status 2 and one line; kill -9 then the same command resumes to the same bytes -----
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def _start(root: Path, *argv: str) -> subprocess.Popen:
    """``python ARGV`` in ``root``; its stderr goes to ``<root>.stderr`` (a file: a pipe nobody reads while the
    process runs could fill up and stall it)."""
    with open(_stderr(root), "w") as err:
        return subprocess.Popen([sys.executable, *argv], cwd=root, env=ENV, stdout=subprocess.DEVNULL, stderr=err)


def _stderr(root: Path) -> Path:
    return root.with_name(f"{root.name}.stderr")


def test_user_error_exits_2_with_one_line(tmp_path, assets):
    """``python stages/eval_offline.py`` on a truncated draft: status 2, one ``error:`` line on stderr naming the
    file, no traceback (every stage runs under the same ``run_stage``; the in-process cases cover the messages)."""
    p = Project(tmp_path / "proj", assets)
    damaged_file(None, f"{DRAFT}/model.safetensors", "truncate")(p)
    before = _tree(p.root)
    proc = _start(p.root, str(REPO / "stages" / "eval_offline.py"), "--variant", "baseline")
    proc.wait(timeout=300)
    err = _stderr(p.root).read_text()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, err[-2000:]
    assert len(errors) == 1, err[-2000:]
    assert re.search(rf"^error: {DRAFT}/model.safetensors: \d+ bytes, manifest.json records \d+ \(truncated or "
                     r"replaced\); retrain the draft", errors[0]), errors[0]
    assert "Traceback" not in err, err[-2000:]
    assert _tree(p.root) == before


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


KILLED = {  # stage -> (params over PARAMS, outputs removed first, what must be on disk when it is killed)
    "regenerate": ({}, ("data/regen",), "data/regen/parts/train/part-00000.parquet"),
    "cache": ({"cache": {"batch_tokens": 100}}, ("data/cache", "data/cache_stores"),
              "data/cache_stores/train.zarr/zarr.json"),
    "train": ({"train": {"total_steps": 4, "max_steps": 4}}, (), "data/train/baseline/checkpoints/latest.json"),
}


def _run_stage(stage: str) -> None:
    """``python stages/<stage>.py`` (in this process: the interpreter start is the slow part here); it must succeed."""
    res = invoke_stage(stage)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    assert res.exit_code == 0, res.output


def _kill_project(root: Path, assets: dict[str, Path], stage: str) -> Project:
    over, remove, _ = KILLED[stage]
    p = Project(root, assets)
    p.params(**over)
    for rel in remove:
        shutil.rmtree(p.root / rel)
    write_prompts(p.root / "data/prompts/train.parquet",
                  [Prompt(f"q{i}", "test", (f"Question {i}: name {i + 2} colours.",)) for i in range(6)])
    return p


def _compared(stage: str, root: Path) -> dict[str, bytes]:
    if stage == "regenerate":
        return {"train.parquet": (root / "data/regen/train.parquet").read_bytes()}
    if stage == "cache":
        return _files(root / "data/cache/train.zarr")
    return _files(root / DRAFT)


def test_kill_9_then_the_same_command_resumes_to_the_same_bytes(tmp_path, assets, monkeypatch, one_thread):
    """regenerate, cache and train, each killed with SIGKILL once part of its output is written
    (``tests/_paused_stage.py`` holds the command there), then the same command again: the output is byte for byte
    that of an uninterrupted run (regenerate's final parquet, every file of the cache store, the exported draft)."""
    procs = {}
    for stage in KILLED:  # start the three at once: their interpreters start while the references run here
        p = _kill_project(tmp_path / f"killed_{stage}", assets, stage)
        procs[stage] = (p, _start(p.root, str(REPO / "tests" / "_paused_stage.py"), str(tmp_path / f"{stage}.held"),
                                  stage), tmp_path / f"{stage}.held")
    try:
        refs = {}
        for stage in KILLED:
            ref = _kill_project(tmp_path / f"ref_{stage}", assets, stage)
            monkeypatch.chdir(ref.root)
            _run_stage(stage)
            refs[stage] = _compared(stage, ref.root)
        for stage, (p, proc, held) in procs.items():
            deadline = time.monotonic() + 300
            while not held.exists():
                assert proc.poll() is None, f"{stage} ended unheld: {_stderr(p.root).read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"{stage} was not held in 300 s"
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            assert (p.root / KILLED[stage][2]).is_file(), stage  # part of the output was written
            monkeypatch.chdir(p.root)
            _run_stage(stage)
            got = _compared(stage, p.root)
            assert got.keys() == refs[stage].keys(), stage
            assert [k for k in got if got[k] != refs[stage][k]] == [], stage
    finally:
        for _, proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
