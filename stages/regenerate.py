"""DVC stage `regenerate`: the target answers every prompt (hf / vllm / openai backend), resumably."""
import json
from pathlib import Path

import typer

from dspark_core.data.regenerate import RegenerateConfig, run_regenerate
from dspark_core.errors import run_stage


def main(params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    cfg = RegenerateConfig.load(params, "regenerate")  # regenerate.time_budget_s: answer a random subset in time
    typer.echo(json.dumps(run_regenerate(cfg), indent=1))


if __name__ == "__main__":  # vLLM spawns workers: the engine must be built under this guard
    run_stage(main)  # a user error: one line on stderr, exit status 2
