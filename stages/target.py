"""DVC stage `target`: resolve the target model into a plain bf16 safetensors HF dir + fingerprint."""
import json
from pathlib import Path

import typer

from dspark_core.errors import run_stage
from dspark_core.target import TargetConfig, run_target


def main(params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    typer.echo(json.dumps(run_target(TargetConfig.load(params, "target")), indent=1))


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
