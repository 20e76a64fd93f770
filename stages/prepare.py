"""DVC stage `prepare`: collect conversations into a weighted training mix and per-domain held-out eval sets
(disjoint, checked), written as train / eval parquet files, with their stats."""
import json
from pathlib import Path

import typer

from dspark_core.data.prompts import PrepareConfig, run_prepare, warn_untracked_files
from dspark_core.errors import run_stage


def main(params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    cfg = PrepareConfig.load(params, "prepare")
    warn_untracked_files(cfg)  # a file DVC does not track for this stage: a change to it reruns nothing
    stats: dict = {}
    sizes = run_prepare(cfg, stats)
    by_domain = {split: stats[split]["by_domain"] for split in sizes}
    typer.echo(json.dumps({**sizes, "by_domain": by_domain, "sources": stats["sources"]}, indent=1))


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
