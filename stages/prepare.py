"""DVC stage `prepare`: collect prompts into disjoint train / eval parquet files."""
import json
from pathlib import Path

import typer

from dspark_core.data.prompts import PrepareConfig, run_prepare


def main(params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    typer.echo(json.dumps(run_prepare(PrepareConfig.load(params, "prepare")), indent=1))


if __name__ == "__main__":
    typer.run(main)
