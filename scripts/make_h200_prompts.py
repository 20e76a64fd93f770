"""Build the prompt snapshot of the H200 SmolLM2 run (scripts/h200_spec_run.sh) from the packaged data sets.

The device has none of the data packages (ShareGPT alone is a 125 MB JSON), so the prompts are saved here once,
one JSONL file per registry source (``dspark_core/data/sources.py``; records ``{"id", "domain", "group"?,
"turns"}``), and travel with the repo. ``prepare`` reads them instead of the packages when
``prepare.snapshot_dir`` names the folder (profiles/h200_smollm2.yaml): the same ``train`` weights, the same
per-domain ``eval_sources``, the same eval-only refusals and overlap check as with the packages.

    python scripts/make_h200_prompts.py            # -> data/prompts_h200/<source>.jsonl, split.json

=========================  ================  ===========================================================
file                       domain            prompts
=========================  ================  ===========================================================
gsm_symbolic_variants      math_word         GSM-Symbolic variants of 70 templates (eng + eng_metric)
gsm8k_symbolic (eval)      math_word         the GSM8K test questions of the 30 other templates
project_euler              competition_math  Project Euler 1-330, text-only
aime2025 (eval)            competition_math  AIME 2025 I + II (30)
codeio                     code              CodeI/O tasks (reasoning-gym) as code requests
humaneval (eval)           code              HumanEval (164)
sharegpt                   chat              ShareGPT first user turns, mostly ASCII (train and held-out
                                             eval drawn from it, disjoint)
=========================  ================  ===========================================================

``more/`` (train-only ``jsonl:`` sources, gzip): ``gsm_symbolic_variants_more`` (variants ``--variants`` ..
``--variants + --more-variants - 1``) and ``sharegpt_more`` (the next ``--more-sharegpt`` prompts of the same
ShareGPT pool). Files of their own: a longer registry file would be shuffled anew by ``prepare`` and so change
its draws, eval sets included.

The GSM split (seeded, deterministic): the package's 100 GSM-Symbolic templates, each made from one GSM8K *test*
problem (``id_orig`` = its test index), are shuffled with ``--seed``; ``--eval-templates`` (30) are held out and
only their original questions are saved for ``gsm8k_symbolic`` (eval-only). Training never sees a held-out template
in any form (not its question, not a variant, not its metric version), and no GSM8K test question at all: the
variants file holds up to ``--variants`` symbolic variants (new names and numbers) of each other template and
language, minus any equal to an original. ``eval_gsm8k.jsonl`` repeats the 30 held-out questions for
``benchmarks/bench_decode.py --prompts``. Each record's ``group`` names its upstream problem, so ``prepare``
checks that no evaluated problem is trained on. Texts carry the default instructions (``split.json`` records
them as ``read_options``; ``prepare`` refuses other settings).

Everything is seeded and machine-independent (the variant sampler of ``dspark_core.data.sources`` has no time-outs).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_core.data.prompts import candidate_pool, check_no_overlap  # noqa: E402
from dspark_core.data.sources import (GSM_GROUP, GSM_LANGS, REGISTRY, GsmVariantSampler, Prompt,  # noqa: E402
                                      ReadOptions, gsm_instruction, iter_aime2025, iter_codeio, iter_humaneval,
                                      iter_project_euler, iter_sharegpt, load_gsm_templates, normalize_text,
                                      write_snapshot)


def gsm_prompt(question: str, instr: str) -> str:
    return question.strip() + "\n" + instr


def mostly_ascii(text: str, min_ratio: float = 0.97) -> bool:
    return sum(c.isascii() for c in text) >= min_ratio * len(text)


def gsm_variants(template, i: int, lang: str, ks: range, source: str, args, instr: str, sampler, seen: set,
                 originals: set) -> list[Prompt]:
    """Variants k in ``ks`` of train template ``i`` in ``lang``, none equal (in normalised text) to a variant
    already drawn (``seen``, updated) or to a GSM8K test question (``originals``), verbatim or nearly."""
    out = []
    for k in ks:
        q = sampler.sample(template, random.Random(f"{args.seed}:{lang}:{i}:{k}"))
        key = None if q is None else normalize_text(q)
        if key is None or key in seen or key in originals:
            continue
        seen.add(key)
        out.append(Prompt(f"{source}:{lang}:{i}:{k}", source, (gsm_prompt(q, instr),), "math_word",
                          GSM_GROUP.format(i)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "data" / "prompts_h200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-templates", type=int, default=30)
    ap.add_argument("--variants", type=int, default=24, help="symbolic variants per train template and language")
    ap.add_argument("--sharegpt", type=int, default=4600, help="ShareGPT prompts saved (train + held-out eval)")
    ap.add_argument("--more-variants", type=int, default=36,
                    help="train-only file more/gsm_symbolic_variants_more.jsonl.gz: variants k = variants .. "
                         "variants + this - 1 of each train template and language")
    ap.add_argument("--more-sharegpt", type=int, default=4000,
                    help="train-only file more/sharegpt_more.jsonl.gz: the next ShareGPT prompts of the same pool")
    ap.add_argument("--max-chars", type=int, default=1200, help="longest ShareGPT prompt kept")
    ap.add_argument("--max-prompt-chars", type=int, default=1500,
                    help="longest code / competition prompt kept (the profile's prepare.max_prompt_chars)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    templates = load_gsm_templates()
    instr = gsm_instruction()
    ids = sorted(templates["eng"])
    if set(ids) != set(templates["eng_metric"]):
        raise SystemExit("eng and eng_metric templates differ in id_orig")
    order = ids[:]
    random.Random(args.seed).shuffle(order)
    eval_ids, train_ids = sorted(order[: args.eval_templates]), sorted(order[args.eval_templates:])

    opts = ReadOptions()  # the default instructions
    pools: dict[str, list[Prompt]] = {}
    pools["gsm8k_symbolic"] = [Prompt(f"gsm8k_symbolic:{i}", "gsm8k_symbolic",
                                      (gsm_prompt(templates["eng"][i].question, instr),), "math_word",
                                      GSM_GROUP.format(i)) for i in eval_ids]
    originals = {normalize_text(templates[lang][i].question) for lang in GSM_LANGS for i in ids}

    sampler = GsmVariantSampler()
    math, extra, seen, dead = [], [], set(), []
    first, later = range(args.variants), range(args.variants, args.variants + args.more_variants)
    for ks, name, out in ((first, "gsm_symbolic_variants", math), (later, "gsm_symbolic_variants_more", extra)):
        for i in train_ids:  # every template's first variants before any later one (the order `seen` grows in)
            for lang in GSM_LANGS:
                got = gsm_variants(templates[lang][i], i, lang, ks, name, args, instr, sampler, seen, originals)
                if not got and ks is first:
                    dead.append(f"{lang}/{i}")
                out += got
    pools["gsm_symbolic_variants"] = math
    more = {"gsm_symbolic_variants_more": extra}
    gsm_s = time.perf_counter() - t0

    chat = candidate_pool((p for p in iter_sharegpt() if mostly_ascii(p.turns[0])), args.max_chars,
                          limit=4 * (args.sharegpt + args.more_sharegpt), seed=args.seed)
    pools["sharegpt"] = chat[: args.sharegpt]
    more["sharegpt_more"] = chat[args.sharegpt: args.sharegpt + args.more_sharegpt]
    short = args.max_prompt_chars
    pools["codeio"] = [p for p in iter_codeio() if len(p.turns[0]) <= short]
    pools["humaneval"] = list(iter_humaneval())
    pools["project_euler"] = [p for p in iter_project_euler(opts.competition_instruction) if len(p.turns[0]) <= short]
    pools["aime2025"] = list(iter_aime2025(opts.competition_instruction))

    # the guarantees, checked on what is written: no eval-only prompt or evaluated problem in a training pool
    train = [p for name, ps in pools.items() if not REGISTRY[name].eval_only for p in ps]
    train += [p for ps in more.values() for p in ps]
    evals = [p for name, ps in pools.items() if REGISTRY[name].eval_only for p in ps]
    check_no_overlap(train, evals)
    eval_questions = {normalize_text(templates[lang][i].question) for lang in GSM_LANGS for i in eval_ids}
    assert not any(q in normalize_text(p.turns[0]) for q in eval_questions for p in train), "eval question in train"
    for name, ps in pools.items():
        assert len({p.id for p in ps}) == len(ps), name
        assert all(p.domain == REGISTRY[name].domain and p.source == name for p in ps), name

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for stale in args.out_dir.glob("*.jsonl"):  # files of earlier layouts (train_prompts.jsonl held test questions)
        stale.unlink()
    for name, ps in pools.items():
        write_snapshot(args.out_dir / f"{name}.jsonl", ps)
    (args.out_dir / "more").mkdir(exist_ok=True)
    for name, ps in more.items():  # jsonl: sources (the reader names ids by the file)
        write_snapshot(args.out_dir / "more" / f"{name}.jsonl.gz", ps, bare_ids=True)
    (args.out_dir / "eval_gsm8k.jsonl").write_text(  # for benchmarks/bench_decode.py --prompts
        "".join(json.dumps({"id": f"gsm8k_test_{p.id.split(':')[1]}", "turns": list(p.turns)}, ensure_ascii=False)
                + "\n" for p in pools["gsm8k_symbolic"]))
    info = {"seed": args.seed, "read_options": {"gsm8k_instruction": opts.gsm8k_instruction,
                                                "competition_instruction": opts.competition_instruction},
            "eval_template_ids_orig": eval_ids, "train_template_ids_orig": train_ids,
            "variants_per_template_and_lang": args.variants, "templates_without_variants": dead,
            "sources": {name: len(ps) for name, ps in pools.items()},
            "more_variants_per_template_and_lang": args.more_variants, "more_sharegpt": args.more_sharegpt,
            "more": {f"more/{name}.jsonl.gz": len(ps) for name, ps in more.items()}}
    (args.out_dir / "split.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info["sources"] | info["more"], indent=1), f"\n(gsm generation {gsm_s:.1f} s)")


if __name__ == "__main__":
    main()
