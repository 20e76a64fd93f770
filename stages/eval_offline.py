"""DVC stage `eval_offline@<variant>`: teacher-forced tau_prob, accept_rate@i, CE and confidence calibration
of the trained draft on the held-out cache (reports/eval_offline/<variant>.json + plots)."""

from pathlib import Path

import typer

from dspark_core.draft.stage import run_eval_offline_stage
from dspark_core.errors import run_stage


def main(variant: str = typer.Option("baseline", help="a key of `variants` in params.yaml"),
         params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    run_eval_offline_stage(params, variant)


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
