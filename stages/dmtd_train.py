"""DVC stage `dmtd_train@<variant>`: fine-tune the target as a Parallel DMTD model of one variant.

    python stages/dmtd_train.py --variant bidir_refresh
    # dmtd_train.nproc_per_node > 1 or nnodes > 1: re-launches itself under torchrun (see stages/train.py)
"""

import sys
from pathlib import Path

import typer

from dspark_core.dist import relaunch_under_torchrun, shutdown_distributed
from dspark_core.dmtd.stage import dmtd_configs, run_dmtd_train_stage
from dspark_core.errors import run_stage


def main(variant: str = typer.Option(..., help="one of dmtd.variants in params.yaml"),
         params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    cfg = dmtd_configs(params, variant)[1]
    relaunch_under_torchrun(cfg.nproc_per_node, sys.argv, cfg.nodes("dmtd_train"))
    try:
        run_dmtd_train_stage(params, variant)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
