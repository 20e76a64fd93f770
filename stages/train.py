"""DVC stage `train@<variant>`: train the DSpark draft of one variant on the train cache.

    python stages/train.py --variant baseline      # what dvc.yaml runs
    # train.nproc_per_node: 8 (params.yaml, or `dvc exp run -S train.nproc_per_node=8`): the same command
    # re-launches itself as `torchrun --nproc_per_node 8 stages/train.py --variant baseline`
    # train.nnodes: 2 (+ train.rdzv_endpoint: node 0's host:port): every host runs the same command, its node rank
    # from NODE_RANK (or train.node_rank); each re-launches itself as `torchrun --nnodes 2 --node-rank R ...`
    # train.time_budget_s: stop (checkpoint + export) after the step that passes that many seconds
"""

import sys
from pathlib import Path

import typer

from dspark_core.dist import relaunch_under_torchrun, shutdown_distributed
from dspark_core.draft.stage import run_train_stage, variant_configs
from dspark_core.errors import run_stage


def main(variant: str = typer.Option("baseline", help="a key of `variants` in params.yaml"),
         params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    # train.nproc_per_node > 1 or nnodes > 1: this process becomes `torchrun --nproc-per-node N stages/train.py ...`
    cfg = variant_configs(params, variant)[2]
    relaunch_under_torchrun(cfg.nproc_per_node, sys.argv, cfg.nodes("train"))
    try:
        run_train_stage(params, variant)
    finally:
        shutdown_distributed()  # torchrun: leave the process group


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
