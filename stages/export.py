"""DVC stage `export@<variant>`: the trained draft data/train/<variant>/final written in the serving engines'
DSpark layouts (params `export.layouts`: deepspec, speculators) to data/export/<variant>/<layout>/, each with
config.json, model.safetensors and a README.md holding the `vllm serve` command."""

from pathlib import Path

import typer

from dspark_core.errors import run_stage
from dspark_core.export.run import run_export_stage


def main(variant: str = typer.Option("baseline", help="an entry of `export.variants` in params.yaml"),
         params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    for out in run_export_stage(params, variant):
        print(f"export@{variant}: {out}")


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
