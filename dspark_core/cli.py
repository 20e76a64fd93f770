"""The ``dspark`` command line: tools around the DVC pipeline (the stages themselves run from dvc.yaml).

    dspark profile list | apply NAME | args NAME | check NAME   # check: every stage's params + the DAG, no download
    dspark cache verify data/cache/eval.zarr --target data/target -n 4
    dspark cache info data/cache/train.zarr
    dspark stages list | run TARGET...    # dvc.yaml's commands without DVC (a machine where DVC is not installed)
    dspark export data/train/baseline/final OUT --layout deepspec   # to a serving engine's DSpark layout
    dspark import PUBLISHED_DRAFT OUT                               # a DeepSpec / speculators draft -> dspark's
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
profile_app = typer.Typer(no_args_is_help=True, help="Seed profiles (the seeds' large-model settings).")
cache_app = typer.Typer(no_args_is_help=True, help="Hidden-state cache tools.")
app.add_typer(profile_app, name="profile")
stages_app = typer.Typer(no_args_is_help=True, help="dvc.yaml's stage commands without DVC.")
app.add_typer(cache_app, name="cache")
app.add_typer(stages_app, name="stages")


@profile_app.command("list")
def profile_list() -> None:
    """Print the available profiles and their description."""
    import yaml

    from dspark_core.profiles import PROFILES_DIR, available

    for name in available():
        desc = (yaml.safe_load((PROFILES_DIR / f"{name}.yaml").read_text()) or {}).get("description", "")
        typer.echo(f"{name:28s} {desc}")


@profile_app.command("apply")
def profile_apply(name: str, params: Path = typer.Option(Path("params.yaml"))) -> None:
    """Write profile NAME into params.yaml (comments kept)."""
    from dspark_core.profiles import apply_profile

    changed = apply_profile(name, params)
    typer.echo(f"{params}: {len(changed)} values changed" + (": " + ", ".join(changed) if changed else ""))


@profile_app.command("args")
def profile_args(name: str) -> None:
    """Print `-S key=value ...` for `dvc exp run $(dspark profile args NAME)`."""
    from dspark_core.profiles import exp_run_args

    typer.echo(" ".join(exp_run_args(name)))


@profile_app.command("check")
def profile_check(name: str, params: Path = typer.Option(Path("params.yaml")),
                  samples: int = typer.Option(None, help="samples the cache will hold (default: the prepare sizes)"),
                  tokens_per_sample: int = typer.Option(None, help="mean tokens a sample (default: cache.max_length, "
                                                                     "an upper bound)"),
                  tokens: int = typer.Option(None, help="tokens the cache will hold (instead of the two above)")) -> None:
    """Check profile NAME stage by stage and its DAG, downloading nothing; list what the pipeline would download
    and estimate the hidden-state cache's bytes."""
    from dspark_core.profile_check import check_profile

    report = check_profile(name, params, samples=samples, tokens_per_sample=tokens_per_sample, tokens=tokens)
    for line in report.lines:
        typer.echo(line)
    for line in report.warnings:
        typer.echo(f"warning: {line}")
    for line in report.problems:
        typer.echo(f"problem: {line}", err=True)
    typer.echo(f"profile {name}: " + ("ok" if not report.problems else f"{len(report.problems)} problem(s)"))
    if report.problems:
        raise typer.Exit(1)


@cache_app.command("verify")
def cache_verify(store: Path, target: Path = typer.Option(Path("data/target")),
                 n: int = typer.Option(4, "-n", help="samples to recompute (0: chunk checksums only)"),
                 seed: int = 0) -> None:
    """Check every chunk's checksum of STORE, recompute N random samples with the target and compare."""
    from dspark_core.cache.store import REBUILD_HINT, describe_bad_chunks
    from dspark_core.cache.verify import verify_cache

    report = verify_cache(store, target, n_samples=n, seed=seed)
    typer.echo(json.dumps(report, indent=2, default=str))
    bad = report["chunks"]["bad"]
    if bad:
        typer.echo(f"{store}: {len(bad)} of {report['chunks']['checked']} chunk(s) damaged: "
                   f"{describe_bad_chunks(bad)}; {REBUILD_HINT}", err=True)
    if not report.get("ok", False):
        raise typer.Exit(1)


@cache_app.command("info")
def cache_info(store: Path) -> None:
    """Print the manifest of a cache store."""
    from dspark_core.cache.store import open_store

    typer.echo(json.dumps(dict(open_store(store).attrs), indent=2, default=str))


@stages_app.command("list")
def stages_list(targets: list[str] = typer.Argument(None, help="stages (and what they depend on); none: all"),
                params: Path = typer.Option(Path("params.yaml"))) -> None:
    """Print the commands `dvc repro TARGET...` would run (all of them: no cache here), in order."""
    from dspark_core.pipeline import load_stages, plan, run

    run(plan(load_stages("dvc.yaml", params), targets or []), params, dry=True)


@stages_app.command("run")
def stages_run(targets: list[str] = typer.Argument(None, help="stages (and what they depend on); none: all"),
               params: Path = typer.Option(Path("params.yaml")),
               only: bool = typer.Option(False, "--only", help="the targets alone, not their ancestors")) -> None:
    """Run dvc.yaml's commands for TARGET... and their ancestors, in DAG order (like `dvc repro`, no cache)."""
    from dspark_core.pipeline import load_stages, plan, run

    stages = load_stages("dvc.yaml", params)
    order = [s for s in stages if s.name in targets] if only else plan(stages, targets or [])
    if only and len(order) != len(set(targets)):
        plan(stages, targets)  # raises on the unknown names
    for name, seconds in run(order, params):
        typer.echo(f"{name}\t{seconds}")


@app.command("export")
def export_cmd(draft_dir: Path, out_dir: Path,
               layout: str = typer.Option(..., help="deepspec (Qwen3DSparkModel: vLLM, SGLang, ...) | speculators"),
               dtype: str = typer.Option("bfloat16", help="bfloat16 | float16 | float32"),
               target: Path = typer.Option(Path("data/target"), help="the target the draft was trained on"),
               verifier: str = typer.Option(None, help="the target's name recorded in the export (speculators' "
                                            "verifier, the serve command), e.g. its hub id; default: a hub target's id, "
                                            "else --target")
               ) -> None:
    """Write a trained draft as config.json + model.safetensors + README.md (the serve command) in LAYOUT."""
    from dspark_core.export.run import export_dir

    variant = draft_dir.parent.name if draft_dir.name == "final" else draft_dir.name  # data/train/<variant>/final
    for out in export_dir(draft_dir, out_dir, [layout], dtype, target, variant=variant, subdirs=False,
                          verifier=verifier):
        typer.echo(f"exported {draft_dir} -> {out} ({layout}, {dtype})")


@app.command("import")
def import_cmd(src_dir: Path, out_dir: Path,
               target: Path = typer.Option(Path("data/target"), help="the draft's target")) -> None:
    """Read a DeepSpec- or speculators-layout draft and save it as a dspark draft (for eval_offline / bench_online)."""
    from dspark_core.export.run import import_dir

    typer.echo(f"imported {src_dir} -> {import_dir(src_dir, out_dir, target)}")


def main() -> None:
    """The ``dspark`` entry point: a user error is one line on stderr and exit status 2."""
    from dspark_core.errors import run_stage

    run_stage(app)


if __name__ == "__main__":
    main()
