"""DVC stage `bench_online@<variant>`: the real propose -> verify -> update loop of the trained draft on the eval
prompts: MAL, accept_rate@i, draft/verify ms per cycle, tokens/s, speedup over AR on the same target code path,
the same at each `bench_online.concurrency` level (requests served that many at once, speedup over AR on the same
request rows), and the peers (transformers' generate, assisted generation, prompt lookup)."""

from pathlib import Path

import typer

from dspark_core.bench.online import run_bench_online_stage
from dspark_core.errors import run_stage


def main(variant: str = typer.Option("baseline", help="a key of `variants` in params.yaml"),
         params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    run_bench_online_stage(params, variant)


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
