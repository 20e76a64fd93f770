"""DVC stage `cache`: one target forward per sample -> data/cache/{split}.zarr (+ reports/cache_stats.json)."""
from pathlib import Path

import typer

from dspark_core.cache import CacheConfig, run_cache


def main(params: Path = typer.Option(Path("params.yaml"), help="params file"),
         force: bool = typer.Option(False, "--force", help="rebuild stores made with other settings/model/source")
         ) -> None:
    run_cache(CacheConfig.load(params, "cache"), force=force)


if __name__ == "__main__":
    typer.run(main)
