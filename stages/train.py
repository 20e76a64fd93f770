"""DVC stage `train@<variant>`: train the DSpark draft of one variant on the train cache.

    python stages/train.py --variant baseline
    torchrun --nproc_per_node 8 stages/train.py --variant baseline     # several processes / GPUs
"""

from pathlib import Path
from typing import Optional

import typer

from dspark_core.dist import shutdown_distributed
from dspark_core.draft.stage import run_train_stage


def main(variant: str = typer.Option("baseline", help="a key of `variants` in params.yaml"),
         params: Path = typer.Option(Path("params.yaml"), help="params file"),
         time_budget_s: Optional[float] = typer.Option(
             None, "--time-budget-s", help="stop (checkpoint + export) after the step that passes this many seconds"),
         ) -> None:
    try:
        run_train_stage(params, variant, time_budget_s=time_budget_s)
    finally:
        shutdown_distributed()  # torchrun: leave the process group


if __name__ == "__main__":
    typer.run(main)
