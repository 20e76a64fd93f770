"""DVC stage `dmtd_train@<variant>`: fine-tune the target as a Parallel DMTD model of one variant.

    python stages/dmtd_train.py --variant bidir_refresh
"""

from pathlib import Path

import typer

from dspark_core.dmtd.stage import run_dmtd_train_stage


def main(variant: str = typer.Option(..., help="one of dmtd.variants in params.yaml"),
         params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    run_dmtd_train_stage(params, variant)


if __name__ == "__main__":
    typer.run(main)
