"""The DSpark stages' glue: params (with the variant's overrides) -> task -> trainer / offline eval.

Paths are fixed by the DAG (dvc.yaml): target ``data/target``, caches ``data/cache/{train,eval}.zarr``,
checkpoints and the final draft under ``data/train/<variant>``, reports under ``reports/``.
"""

from __future__ import annotations

from pathlib import Path

from dspark_core.config import ParamsError
from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.io import sha256_json
from dspark_core.train.trainer import TrainConfig
from dspark_core.variants import section_for_variant

TARGET_DIR = Path("data/target")
CACHE_DIR = Path("data/cache")
TRAIN_DIR = Path("data/train")


def variant_configs(params: Path, variant: str) -> tuple[DraftConfig, LossConfig, TrainConfig]:
    src = str(params)
    draft = DraftConfig.from_dict(section_for_variant(params, "draft", variant), src=src, prefix="draft.")
    loss = LossConfig.from_dict(section_for_variant(params, "loss", variant), src=src, prefix="loss.")
    train_d = section_for_variant(params, "train", variant)
    if "out_dir" in train_d and train_d["out_dir"] != "data/train":
        raise ParamsError(f"{src}: train.out_dir is fixed by dvc.yaml (data/train/<variant>)")
    train_d["out_dir"] = str(TRAIN_DIR / variant)
    train = TrainConfig.from_dict(train_d, src=src, prefix="train.")
    return draft, loss, train


def run_train_stage(params: Path, variant: str, time_budget_s: float | None = None) -> None:
    from dspark_core.cache.dataset import CacheDataset
    from dspark_core.draft.task import DSparkTask
    from dspark_core.train.run import run_training

    draft_cfg, loss_cfg, train_cfg = variant_configs(params, variant)
    task = DSparkTask.from_paths(draft_cfg, loss_cfg, TARGET_DIR, CACHE_DIR / "train.zarr")
    data: CacheDataset = task.train_dataset()  # type: ignore[assignment]
    run_config = {"variant": variant, "draft": draft_cfg.to_dict(), "loss": loss_cfg.to_dict(),
                  "train": train_cfg.to_dict(), "target": task.target_fingerprint,
                  "cache": sha256_json(data.manifest)}
    run_training(task, train_cfg, run_config, Path("reports/train") / variant, time_budget_s=time_budget_s)


def run_eval_offline_stage(params: Path, variant: str) -> dict:
    """Teacher-forced metrics of ``data/train/<variant>/final`` on the eval cache -> reports/eval_offline/."""
    import torch

    from dspark_core.cache.dataset import CacheDataset
    from dspark_core.draft.model import load_draft
    from dspark_core.eval_offline import EvalOfflineConfig, evaluate_offline
    from dspark_core.target import load_target, read_fingerprint

    cfg = EvalOfflineConfig.load(params, "eval_offline")
    draft_dir = TRAIN_DIR / variant / "final"
    if not (draft_dir / "config.json").is_file():
        raise ValueError(f"{draft_dir}: no trained draft; run `dvc repro train@{variant}` first")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, tok = load_target(TARGET_DIR, dtype="float32", device=device)
    fp = read_fingerprint(TARGET_DIR)["fingerprint"]
    draft = load_draft(draft_dir, target, expected_fingerprint=fp).to(device)
    data = CacheDataset(CACHE_DIR / "eval.zarr", expected_fingerprint=fp, expected_layer_ids=draft.aux_layer_ids)
    out = Path("reports/eval_offline")
    return evaluate_offline(draft, data, cfg, metrics_path=out / f"{variant}.json", plots_dir=out / variant,
                            pad_id=tok.pad_token_id or 0, device=device)
