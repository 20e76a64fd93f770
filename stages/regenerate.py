"""DVC stage `regenerate`: the target answers every prompt (hf / vllm / openai backend), resumably."""
import json
from pathlib import Path
from typing import Optional

import typer

from dspark_core.data.regenerate import RegenerateConfig, run_regenerate


def main(params: Path = typer.Option(Path("params.yaml"), help="params file"),
         time_budget_s: Optional[float] = typer.Option(
             None, "--time-budget-s", help="start no batch after this many seconds; answer a random subset")) -> None:
    cfg = RegenerateConfig.load(params, "regenerate")
    typer.echo(json.dumps(run_regenerate(cfg, time_budget_s=time_budget_s), indent=1))


if __name__ == "__main__":  # vLLM spawns workers: the engine must be built under this guard
    typer.run(main)
