"""DVC stage `prepare`: collect prompts into a weighted training mix and per-domain held-out eval sets (disjoint,
checked), written as train / eval parquet files."""
import json
from collections import Counter
from pathlib import Path

import typer

from dspark_core.data.prompts import PrepareConfig, read_prompts, run_prepare
from dspark_core.errors import run_stage


def main(params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    cfg = PrepareConfig.load(params, "prepare")
    sizes = run_prepare(cfg)
    by_domain = {split: dict(sorted(Counter(f"{p.domain}/{p.source}" for p in
                                            read_prompts(Path(cfg.out_dir) / f"{split}.parquet")).items()))
                 for split in sizes}
    typer.echo(json.dumps({**sizes, "by_domain": by_domain}, indent=1))


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
