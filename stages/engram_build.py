"""DVC stage `engram_build`: the frozen Engram n-gram table (params `draft.engram`) from the train cache's token
ids and the target's embedding. Variants with `draft.engram.source: frozen` train on it."""

from pathlib import Path

import typer

from dspark_core.draft.stage import run_engram_build_stage
from dspark_core.errors import run_stage


def main(params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    stats = run_engram_build_stage(params)
    print(f"engram_build: {stats['params']:,} table entries ({stats['bytes'] / 2**20:.1f} MiB) from "
          f"{stats['tokens']:,} tokens")


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
