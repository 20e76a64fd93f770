"""DVC stage `report`: reports/summary.md, comparison plots and the headline metrics by concern (reports/metrics/)."""

from pathlib import Path

import typer

from dspark_core.errors import run_stage
from dspark_core.report import run_report


def main(params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    run_report(params)


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
