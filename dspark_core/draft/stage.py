"""The DSpark stages' glue: params (with the variant's overrides) -> task -> trainer / offline eval.

Paths are fixed by the DAG (dvc.yaml): target ``data/target``, caches ``data/cache/{train,eval}.zarr``,
checkpoints and the final draft under ``data/train/<variant>``, reports under ``reports/``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark_core.config import ParamsError
from dspark_core.draft.attention import flash_unavailable, set_attention_kernel
from dspark_core.draft.config import DraftConfig, LossConfig, WarmStartConfig
from dspark_core.draft.loss import set_loss_kernel
from dspark_core.errors import UserError
from dspark_core.io import sha256_file, sha256_json
from dspark_core.train.trainer import TrainConfig
from dspark_core.variants import check_variant, check_variant_dag, section_for_variant

TARGET_DIR = Path("data/target")
CACHE_DIR = Path("data/cache")
TRAIN_DIR = Path("data/train")


def variant_configs(params: Path, variant: str) -> tuple[DraftConfig, LossConfig, TrainConfig]:
    src = str(params)
    draft = DraftConfig.from_dict(section_for_variant(params, "draft", variant, cls=DraftConfig), src=src,
                                  prefix="draft.")
    _check_kind(params, variant, draft.kind)
    loss = LossConfig.from_dict(section_for_variant(params, "loss", variant, cls=LossConfig), src=src,
                                prefix="loss.")
    train_d = section_for_variant(params, "train", variant, cls=TrainConfig)
    if "out_dir" in train_d and train_d["out_dir"] != "data/train":
        raise ParamsError(f"{src}: train.out_dir is fixed by dvc.yaml (data/train/<variant>)")
    train_d["out_dir"] = str(TRAIN_DIR / variant)
    train = TrainConfig.from_dict(train_d, src=src, prefix="train.")
    return draft, loss, train


def _check_kind(params: Path, variant: str, kind: str) -> None:
    """``draft.kind`` names a registered draft class; the error names where the kind was set."""
    import importlib

    from dspark_core.draft.model import draft_kinds
    from dspark_core.variants import variant_overrides

    importlib.import_module("dspark_core.draft.variants")  # registers every kind
    if kind not in draft_kinds():
        where = f"variants.{variant}.draft.kind" if "kind" in (variant_overrides(params, variant).get("draft") or {}) \
            else "draft.kind"
        raise ParamsError(f"{params}: {where} must be one of {', '.join(draft_kinds())}; got {kind!r}")


def warm_start_checkpoint(params: Path, variant: str) -> tuple[WarmStartConfig, Path | None, int]:
    """The variant's ``warm_start`` section, the trainer checkpoint dir it starts from (None: from scratch) and that
    checkpoint's step (the curves' offset)."""
    from dspark_core.io import read_json

    warm = WarmStartConfig.from_dict(section_for_variant(params, "warm_start", variant, optional=True,
                                                         cls=WarmStartConfig),
                                     src=str(params), prefix="warm_start.")
    if warm.from_dir is not None:
        src = Path(warm.from_dir)
        if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
            raise UserError(f"{params}: variants.{variant}.warm_start.from_dir {src}: not a saved draft "
                            "(config.json + model.safetensors, as data/train/<variant>/final)")
        return warm, src, 0
    if warm.from_variant is None:
        return warm, None, 0
    if warm.from_variant == variant:
        raise ParamsError(f"{params}: variants.{variant}.warm_start.from_variant names the variant itself")
    root = TRAIN_DIR / warm.from_variant / "checkpoints"
    step = warm.step
    if step is None:
        if not (root / "latest.json").is_file():
            raise UserError(f"warm start of {variant}: {root} has no checkpoint; run `dvc repro "
                            f"train@{warm.from_variant}` first")
        step = int(read_json(root / "latest.json")["step"])
    ckpt = root / f"step_{step:08d}"
    if not (ckpt / "model.safetensors").is_file():
        kept = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
        raise UserError(f"warm start of {variant}: {ckpt} not found (kept: {', '.join(kept) or 'none'}); set "
                        f"warm_start.step to a kept step or retrain {warm.from_variant}")
    return warm, ckpt, step


def check_hidden_states(params: Path, store: Path, mode: str, field: str) -> None:
    """Refuse to read the hidden states of a token-only store (``mode`` cache), naming ``field``, where the mode
    was set (e.g. ``variants.baseline.train.hidden_states``), and what to do. A missing store is its reader's."""
    from dspark_core.cache.store import is_store, read_manifest, token_only

    if mode == "cache" and is_store(store) and token_only(read_manifest(store, require_complete=False)):
        section = field.split(".")[-2]
        raise ParamsError(f"{params}: {field} is cache, but {store} is a token-only store (the cache stage wrote it "
                          f"for {section}.hidden_states: online; it holds no hidden states); set {field}: online, or "
                          f"set {section}.hidden_states: cache and rerun the cache stage (`dvc repro cache`)")


def cache_identity(manifest: dict) -> str:
    """The hash of a store's manifest that a training run's resume identity records: without ``hidden_states``, so
    a token-only store and the store with hidden states of the same content (same tokens, target, compute dtype,
    batch plan, aux dtype: the same states online) are one identity, and switching ``train.hidden_states`` resumes
    the run."""
    return sha256_json({k: v for k, v in manifest.items() if k != "hidden_states"})


def run_train_stage(params: Path, variant: str, time_budget_s: float | None = None) -> None:
    from dspark_core.cache.dataset import CacheDataset
    from dspark_core.draft.task import task_class
    from dspark_core.train.run import run_training
    from dspark_core.variants import variant_overrides

    check_variant_dag(params)
    draft_cfg, loss_cfg, train_cfg = variant_configs(params, variant)
    set_loss_kernel(train_cfg.loss_kernel)
    kernel = set_attention_kernel(train_cfg.attention_kernel)
    if train_cfg.attention_kernel == "auto" and torch.cuda.is_available():  # which kernels a GPU run trains with
        why = flash_unavailable()
        print(f"train.attention_kernel auto: {kernel}" + (f" ({why})" if why else ""))
    warm, ckpt, offset = warm_start_checkpoint(params, variant)
    overridden = "hidden_states" in (variant_overrides(params, variant).get("train") or {})
    check_hidden_states(params, CACHE_DIR / "train.zarr", train_cfg.hidden_states,
                        f"variants.{variant}.train.hidden_states" if overridden else "train.hidden_states")
    task = task_class(draft_cfg.kind).from_paths(draft_cfg, loss_cfg, TARGET_DIR, CACHE_DIR / "train.zarr",
                                                 init_checkpoint=ckpt, freeze_base=warm.freeze_base,
                                                 hidden_states=train_cfg.hidden_states,
                                                 target_compile=train_cfg.target_compile)
    data: CacheDataset = task.train_dataset()  # type: ignore[assignment]
    run_config = {"variant": variant, "draft": draft_cfg.identity_dict(), "loss": loss_cfg.to_dict(),
                  "train": train_cfg.identity_dict(), "target": task.target_fingerprint,
                  "cache": cache_identity(data.manifest)}
    if ckpt is not None:
        run_config["warm_start"] = {**warm.to_dict(), "checkpoint": str(ckpt), "step": offset,
                                    "weights_sha256": sha256_file(ckpt / "model.safetensors")}
    result = run_training(task, train_cfg, run_config, Path("reports/train") / variant, time_budget_s=time_budget_s,
                          log_step_offset=offset)
    write_param_counts(result.model, Path("reports/train") / variant / "model.json", variant)


def write_param_counts(model, path: Path, variant: str) -> dict:
    """Print and write the draft's parameter counts: trainable draft weights, the variant's own (seed 000's
    counts) and the Engram table (not a draft parameter; its own line)."""
    from dspark_core.dist import init_distributed
    from dspark_core.draft.variants import param_counts
    from dspark_core.io import write_json

    draft = getattr(getattr(model, "module", model), "draft", model)
    counts = {"kind": draft.cfg.kind, **param_counts(draft)}
    if init_distributed().is_main:
        print(f"train@{variant}: {counts['kind']} draft, {counts['draft']:,} trainable parameters "
              f"({counts['variant']:,} of the variant); Engram table {counts['engram_table']:,} entries")
        write_json(path, counts)
    return counts


def _trained_draft_dir(variant: str) -> Path:
    draft_dir = TRAIN_DIR / variant / "final"
    if not (draft_dir / "config.json").is_file():
        raise UserError(f"{draft_dir}: no trained draft; run `dvc repro train@{variant}` first")
    return draft_dir


def run_eval_offline_stage(params: Path, variant: str) -> dict:
    """Teacher-forced metrics of ``data/train/<variant>/final`` on the eval cache -> reports/eval_offline/. A draft
    with extra anchor sets (Draft Memory's post-error anchors) also gets ``eval_offline.reference``'s draft measured
    on them."""
    import torch

    from dspark_core.cache.dataset import CacheDataset
    from dspark_core.checkpoint import load_draft
    from dspark_core.draft.eval_offline import EvalOfflineConfig, evaluate_offline
    from dspark_core.frozen_target import load_frozen_target
    from dspark_core.target import read_fingerprint

    cfg = EvalOfflineConfig.load(params, "eval_offline")
    check_variant(params, variant)
    draft_dir = _trained_draft_dir(variant)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, pad_id = load_frozen_target(TARGET_DIR, dtype="float32", device=device)  # embedding, LM head
    fp = read_fingerprint(TARGET_DIR)["fingerprint"]
    draft = load_draft(draft_dir, target, expected_fingerprint=fp).to(device)
    reference = None
    if len(draft.offline_anchor_set_names) > 1:
        check_variant(params, cfg.reference)
        reference = load_draft(_trained_draft_dir(cfg.reference), target, expected_fingerprint=fp).to(device)
    store = CACHE_DIR / "eval.zarr"
    check_hidden_states(params, store, cfg.hidden_states, "eval_offline.hidden_states")
    data = CacheDataset(store, expected_fingerprint=fp, expected_layer_ids=draft.aux_layer_ids,
                        hidden_states=cfg.hidden_states)
    online = {}
    if cfg.hidden_states == "online":  # the target run here, its states as the store's reader gives them
        from dspark_core.cache.online import OnlineCollator, OnlineTarget

        target_states = OnlineTarget.load(TARGET_DIR, data.manifest, device, data.dtype, compiled=cfg.target_compile)
        online = {"collator": OnlineCollator(pad_id or 0), "fill_hidden": target_states.fill}
    out = Path("reports/eval_offline")
    return evaluate_offline(draft, data, cfg, metrics_path=out / f"{variant}.json", plots_dir=out / variant,
                            pad_id=pad_id or 0, device=device, reference=reference, **online)


ENGRAM_DIR = Path("data/engram")


def run_engram_build_stage(params: Path) -> dict:
    """Stage ``engram_build``: the frozen Engram table (``draft.engram``) from the train cache's token ids and the
    target's embedding -> ``draft.engram.table_path``; its size -> reports/engram_table.json."""
    import numpy as np
    from tqdm.auto import tqdm

    from dspark_core.cache.store import open_store, read_manifest
    from dspark_core.draft.variants.engram import EngramTable, build_frozen_table, write_frozen_table
    from dspark_core.frozen_target import load_frozen_target
    from dspark_core.io import write_json
    from dspark_core.target import read_fingerprint

    cfg = DraftConfig.load(params, "draft")
    eng = cfg.engram
    if Path(eng.table_path).parent != ENGRAM_DIR:
        raise ParamsError(f"{params}: draft.engram.table_path must lie in {ENGRAM_DIR}/ (the stage's output in "
                          f"dvc.yaml); got {eng.table_path}")
    model, _ = load_frozen_target(TARGET_DIR)
    fp = read_fingerprint(TARGET_DIR)["fingerprint"]
    store = CACHE_DIR / "train.zarr"
    manifest = read_manifest(store)
    if manifest["model_fingerprint"] != fp:
        raise UserError(f"{store}: cache from another model; rebuild the cache stage")
    group = open_store(store)
    ids, offsets = np.asarray(group["input_ids"][:]), np.asarray(group["offsets"][:])
    samples = (ids[offsets[n]:offsets[n + 1]] for n in range(len(offsets) - 1))
    dim = cfg.hidden_size or model.config.hidden_size
    embed = model.get_input_embeddings().weight.detach().float()
    weights = build_frozen_table(eng, dim, tqdm(samples, total=len(offsets) - 1, desc="engram_build", unit="sample"),
                                 embed)
    layout = EngramTable(eng, dim).layout()
    stats = {"samples": len(offsets) - 1, "tokens": int(offsets[-1]), "params": sum(w.numel() for w in weights),
             "bytes": sum(w.numel() * w.element_size() for w in weights),
             "rows_hit": [int((w.abs().sum(-1) > 0).sum()) for w in weights], **layout}
    write_frozen_table(eng.table_path, weights, layout, fp, stats)
    write_json(Path("reports/engram_table.json"), stats)
    return stats
