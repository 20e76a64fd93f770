"""Run a training stage end to end: stale-checkpoint check, dvclive, the trainer, export, final metrics.

Shared by ``stages/train.py`` (DSpark variants) and ``stages/dmtd_train.py`` (DMTD variants).

The stage's output folder is DVC-``persist``ed so a killed run resumes from its last checkpoint. A run
whose configuration (params + input fingerprints) differs from the one that wrote the checkpoints must
not resume from them: ``run_config.json`` records it, and a mismatch starts over (with a message).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dspark_core.io import read_json, sha256_json, write_json
from dspark_core.train.trainer import TrainConfig, TrainResult, train


def _prepare_out_dir(out_dir: Path, run_config: dict[str, Any]) -> bool:
    """Return True when checkpoints of this very configuration exist (resume)."""
    rc = out_dir / "run_config.json"
    want = sha256_json(run_config)
    if rc.is_file() and read_json(rc).get("hash") == want:
        return (out_dir / "checkpoints" / "latest.json").is_file()
    if out_dir.exists() and any(out_dir.iterdir()):
        print(f"{out_dir}: configuration changed since the last run; starting over")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(rc, {"hash": want, "config": run_config})
    return False


def run_training(task: Any, cfg: TrainConfig, run_config: dict[str, Any], report_dir: str | Path) -> TrainResult:
    """Train ``task`` into ``cfg.out_dir`` (checkpoints + ``final/``), curves and metrics into ``report_dir``."""
    from dvclive import Live

    from dspark_core.train.trainer import init_distributed

    out_dir = Path(cfg.out_dir)
    d = init_distributed()
    resume = _prepare_out_dir(out_dir, run_config) if d.is_main else True
    if d.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
    live = Live(dir=str(report_dir), resume=resume, save_dvc_exp=False, dvcyaml=None, report=None) if d.is_main else None
    if live is not None:
        live.log_params({"run_config_hash": sha256_json(run_config)})
    result = train(task, cfg, live=live)
    if d.is_main and hasattr(task, "export"):  # DMTD: the last checkpoint is the model
        task.export(result.model, out_dir / "final")
        if live is not None:
            live.end()
    return result
