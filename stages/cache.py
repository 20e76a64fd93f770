"""DVC stage `cache`: one target forward per sample -> data/cache_stores/{split}.zarr, linked (hard links) as
data/cache/{split}.zarr, the DVC output (+ reports/cache_stats.json).

A split whose consumer runs the target itself (train.hidden_states / eval_offline.hidden_states: online) reads a
kept store with hidden states, else gets a token-only store (no forward, no hidden states)."""

import sys
from pathlib import Path

import typer

from dspark_core.cache import CacheConfig, run_cache
from dspark_core.cache.build import consumer_hidden_states
from dspark_core.dist import relaunch_under_torchrun, shutdown_distributed
from dspark_core.errors import run_stage


def main(params: Path = typer.Option(Path("params.yaml"), help="params file"),
         force: bool = typer.Option(False, "--force", help="rebuild the stores from scratch"),
         keep_stale: bool = typer.Option(False, "--keep-stale",
                                         help="refuse (instead of rebuild) stores made with other settings/model/source"),
         ) -> None:
    # Under DVC a params change reruns this stage: the stores in cache.store_dir that no longer match are rebuilt,
    # the others kept (a killed run's resumed); data/cache links them again.
    cfg = CacheConfig.load(params, "cache")
    hidden_states = consumer_hidden_states(params)  # {split: cache | online}: token-only stores for online
    relaunch_under_torchrun(cfg.nproc_per_node, sys.argv)  # cache.nproc_per_node > 1: one store shard a rank
    try:
        run_cache(cfg, force=force, rebuild_stale=not keep_stale, hidden_states=hidden_states)
    finally:
        shutdown_distributed()  # torchrun: leave the process group


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
