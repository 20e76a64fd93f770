"""DVC stage `dmtd_eval@<variant>`: perplexity, GSM8K accuracy and decode tokens/s of one DMTD variant beside the target.

    python stages/dmtd_eval.py --variant bidir_refresh
"""

from pathlib import Path

import typer

from dspark_core.dmtd.stage import run_dmtd_eval_stage
from dspark_core.errors import run_stage


def main(variant: str = typer.Option(..., help="one of dmtd.variants in params.yaml"),
         params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    run_dmtd_eval_stage(params, variant)


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
