"""DMTD evaluation: held-out perplexity, GSM8K accuracy, decode tokens/s -- each beside the plain model.

- ``perplexity(model, rows)``: teacher-forced next-token CE over the supervised tokens of packed rows
  (``DMTDModel`` for DMTD, ``PlainModel`` for the unmodified target; same rows, same tokens).
- ``gsm8k_accuracy(decoder, tokenizer, items)``: greedy (or sampled) generation through a cached
  decoder, the last ``\\boxed{...}`` (else the last number) compared with the item's answer.
- ``decode_speed(decoder, prompts)``: decoded tokens / decode seconds (the prefill and the first token it gives
  excluded), for a ``DMTDDecoder`` or the project's AR decoder (``decoding.ar.ARDecoder`` over a ``TargetRunner``).
- ``ar_decoder(lm, max_len, mode)``: that AR decoder in one of the target runner's modes (``AR_MODES``: Triton
  kernels in each small-GEMM family, torch.compile, eager; CUDA graphs on a GPU); ``fastest_ar_speed`` times every
  mode that applies on the device and keeps the fastest, the AR a DMTD speedup is counted against.
- ``evaluate_variant(...)``: all three for one trained variant, as one JSON-ready dict.

Shape legend: B rows, L tokens.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any, Sequence

import torch

from dspark_core.dmtd.inference import CachedDecoder
from dspark_core.dmtd.model import StackModel
from dspark_core.decoding.ar import ARDecoder
from dspark_core.decoding.sampling import SamplingParams
from dspark_core.decoding.target_runner import TargetRunner, kernels_problem

# The target runner's AR modes: (kernels, small-GEMM family, torch.compile). CUDA graphs on wherever CUDA is.
AR_MODES = {"kernels_mma": (True, "mma", False), "kernels_fma": (True, "fma", False), "compile": (False, None, True),
            "eager": (False, None, False)}

GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@torch.no_grad()
def perplexity(model: StackModel, rows: list[dict[str, torch.Tensor]], batch_size: int = 4,
               progress: bool = False, desc: str = "perplexity") -> dict[str, float]:
    """``{"nll", "ppl", "token_acc", "tokens"}`` over the supervised tokens of ``rows``."""
    from dspark_core.dmtd.data import collate_rows  # (pyarrow) only here: the GPU benchmark imports this module

    device = next(model.parameters()).device
    ce = hits = tokens = 0.0
    starts = range(0, len(rows), batch_size)
    if progress:
        from tqdm.auto import tqdm
        starts = tqdm(starts, desc=desc, unit="batch")
    for s in starts:
        batch = {k: v.to(device) for k, v in collate_rows(rows[s: s + batch_size]).items()}
        sums = model(**batch)
        ce += float(sums["ce"])
        hits += float(sums["token_acc"])
        tokens += float((batch["labels"] != -100).sum())
    if tokens == 0:
        raise ValueError("perplexity: the rows hold no supervised token")
    nll = ce / tokens
    return {"nll": nll, "ppl": math.exp(nll), "token_acc": hits / tokens, "tokens": int(tokens)}


def _to_number(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


def extract_answer(text: str) -> float | None:
    """The number in the last ``\\boxed{...}``, else the last number of ``text``; None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        nums = _NUMBER.findall(boxed)
        if nums:
            return _to_number(nums[-1])
    nums = _NUMBER.findall(text)
    return _to_number(nums[-1]) if nums else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return text[i:]


def gold_answer(answer: Any) -> float:
    """A GSM8K gold answer (number, ``'18'``, or a solution ending in ``#### 18``) as a number."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer)
    text = str(answer)
    if "####" in text:
        text = text.split("####")[-1]
    value = extract_answer(text)
    if value is None:
        raise ValueError(f"GSM8K item: answer {answer!r} holds no number")
    return value


def item_prompt_ids(item: dict, tokenizer) -> list[int]:
    """Token ids of a GSM8K item: its ``prompt_ids``, else its ``question`` / first of ``turns`` through the
    chat template (the boxed-answer instruction is appended to a bare question)."""
    if "prompt_ids" in item:
        return [int(t) for t in item["prompt_ids"]]
    if "turns" in item:
        text = item["turns"][0]
    elif "question" in item:
        text = item["question"]
        if "\\boxed" not in text:
            text += GSM8K_SUFFIX
    else:
        raise ValueError(f"GSM8K item needs prompt_ids, question or turns; got keys {sorted(item)}")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def gsm8k_accuracy(decoder: CachedDecoder, tokenizer, items: Sequence[dict], max_new_tokens: int,
                   sampling: SamplingParams = SamplingParams(), stop_token_ids: Sequence[int] | None = None,
                   generator: torch.Generator | None = None, progress: bool = False,
                   desc: str = "gsm8k") -> dict[str, Any]:
    """Accuracy of ``decoder`` on ``items`` (dicts with an ``answer`` and a prompt, see ``item_prompt_ids``)."""
    if not items:
        raise ValueError("gsm8k_accuracy: no items given")
    stops = list(stop_token_ids) if stop_token_ids is not None else [tokenizer.eos_token_id]
    records, correct = [], 0
    it = items
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(items, desc=desc, unit="item")
    for item in it:
        if "answer" not in item:
            raise ValueError(f"GSM8K item has no 'answer' (keys {sorted(item)})")
        gold = gold_answer(item["answer"])
        prompt = torch.tensor([item_prompt_ids(item, tokenizer)], dtype=torch.long)
        room = _room(decoder)
        budget = min(max_new_tokens, room - prompt.shape[1])
        if budget < 1:
            raise ValueError(f"GSM8K prompt of {prompt.shape[1]} tokens leaves no room in max_len={room}")
        if isinstance(decoder, ARDecoder):  # its sampling rule and generator were set when it was built
            tokens = decoder.generate(prompt, budget, stops).tokens
        else:
            tokens = decoder.generate(prompt, budget, sampling, stops, generator).tokens[0]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        pred = extract_answer(text)
        ok = pred is not None and math.isclose(pred, gold, rel_tol=0, abs_tol=1e-6)
        correct += ok
        records.append({"id": item.get("id"), "answer": gold, "predicted": pred, "correct": ok, "completion": text})
    return {"accuracy": correct / len(items), "correct": correct, "total": len(items), "records": records}


def _room(decoder) -> int:
    """Positions a generation may fill (the AR decoder's target keeps one position of lookahead)."""
    return decoder.target.max_len - 1 if isinstance(decoder, ARDecoder) else decoder.max_len


def _timed(decoder, prompt: torch.Tensor, max_new_tokens: int) -> tuple[int, float, float]:
    """Greedy decode without stop tokens -> (decoded tokens after the prefill's first, decode s, prefill s)."""
    if isinstance(decoder, ARDecoder):
        out = decoder.generate(prompt, max_new_tokens)
        return len(out.tokens) - 1, out.decode_s, out.prefill_s
    out = decoder.generate(prompt, max_new_tokens)
    return out.num_new_tokens - 1, out.decode_s, out.prefill_s


def decode_speed(decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 warmup: bool = True, warmup_tokens: int = 8, warmup_prompt_tokens: int | None = None
                 ) -> dict[str, float]:
    """Greedy decode of each prompt for exactly ``max_new_tokens`` (no stop tokens) by a ``DMTDDecoder`` or an
    ``ARDecoder``: tokens/s = tokens decoded after the prefill's first one / decode seconds (both count the same
    steps: one forward per token after the first), after an untimed generation of ``warmup_tokens`` on the first
    prompt (CUDA graphs, lazy inits; on its first ``warmup_prompt_tokens`` tokens where given)."""
    if not prompts:
        raise ValueError("decode_speed: no prompts given")
    if max_new_tokens < 2:
        raise ValueError(f"decode_speed needs max_new_tokens >= 2 (the first token comes from the prefill); "
                         f"got {max_new_tokens}")
    if warmup:
        _timed(decoder, torch.tensor([list(prompts[0])[:warmup_prompt_tokens]]),
               max(2, min(warmup_tokens, max_new_tokens)))
    tokens, seconds, prefill = 0, 0.0, 0.0
    for p in prompts:
        n, dt, pt = _timed(decoder, torch.tensor([list(p)]), max_new_tokens)
        tokens, seconds, prefill = tokens + n, seconds + dt, prefill + pt
    return {"tokens_per_s": tokens / seconds, "new_tokens": tokens + len(prompts), "decode_s": seconds,
            "prefill_s": prefill}


def ar_modes(lm: torch.nn.Module) -> list[str]:
    """The ``AR_MODES`` that apply to ``lm`` on its device: on CUDA the kernel families where the kernels apply
    (mma where bf16 tensor cores exist), compile and eager; elsewhere eager."""
    from dspark_core.kernels.linear import small_gemm_problem

    device = next(lm.parameters()).device
    if device.type != "cuda":
        return ["eager"]
    modes = []
    if kernels_problem(lm) is None:
        modes += (["kernels_mma"] if small_gemm_problem(device) is None else []) + ["kernels_fma"]
    return modes + ["compile", "eager"]


def ar_decoder(lm: torch.nn.Module, max_len: int, mode: str = "eager", sampling: SamplingParams | None = None,
               seed: int = 0) -> ARDecoder:
    """The project's AR decoder over a ``TargetRunner`` of ``lm`` in ``mode`` (``AR_MODES``; CUDA graphs on a
    GPU), with room for ``max_len`` positions. Kernel modes launch (and capture) in their small-GEMM family."""
    if mode not in AR_MODES:
        raise ValueError(f"AR mode must be one of {', '.join(AR_MODES)}; got {mode!r}")
    kernels, _, compile_ = AR_MODES[mode]
    cuda = next(lm.parameters()).device.type == "cuda"
    runner = TargetRunner(lm, max_len=max_len + 1, kernels=kernels, compile=compile_, cuda_graph=cuda)
    return ARDecoder(runner, sampling=sampling, seed=seed)


def ar_speed(lm: torch.nn.Module, mode: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             max_len: int, warmup_prompt_tokens: int | None = None) -> dict[str, float]:
    """``decode_speed`` of the AR decoder in ``mode`` (built, timed, released)."""
    from contextlib import nullcontext

    from dspark_core.kernels.linear import small_gemm

    gemm = AR_MODES[mode][1]
    with small_gemm(gemm) if gemm else nullcontext():
        return decode_speed(ar_decoder(lm, max_len, mode), prompts, max_new_tokens,
                            warmup_prompt_tokens=warmup_prompt_tokens)


def fastest_ar_speed(lm: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_len: int,
                     modes: Sequence[str] | None = None, warmup_prompt_tokens: int | None = None) -> dict[str, Any]:
    """Every AR mode (default: ``ar_modes(lm)``) timed in this process -> ``{"modes": {mode: speed}, "fastest":
    mode, "tokens_per_s": its tokens/s}``."""
    rows = {m: ar_speed(lm, m, prompts, max_new_tokens, max_len, warmup_prompt_tokens)
            for m in (modes or ar_modes(lm))}
    best = max(rows, key=lambda m: rows[m]["tokens_per_s"])
    return {"modes": rows, "fastest": best, "tokens_per_s": rows[best]["tokens_per_s"]}


def evaluate_variant(cfg, variant: str, checkpoint_dir, gsm8k_items: Sequence[dict], device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32, progress: bool = True) -> dict[str, Any]:
    """Perplexity, GSM8K accuracy and decode speed of a trained variant beside the unmodified target.

    ``cfg`` is the ``dmtd`` section (:class:`DMTDConfig`); ``checkpoint_dir`` is the trainer's ``out_dir`` (its
    latest checkpoint is used) or one checkpoint step folder; ``gsm8k_items`` are dicts with an ``answer`` and
    ``prompt_ids``, ``question`` or ``turns``."""
    from dspark_core.dmtd.inference import DMTDDecoder
    from dspark_core.dmtd.model import PlainModel, load_weights, DMTDModel
    from dspark_core.dmtd.task import DMTDTask
    from dspark_core.target import load_target

    ev = cfg.eval
    device = torch.device(device)
    task = DMTDTask(cfg, variant)
    rows = task.eval_dataset()
    items = list(gsm8k_items)[: ev.max_items] if ev.max_items else list(gsm8k_items)
    base_lm, tok = load_target(cfg.target_dir, dtype=dtype, device=device)
    plain = PlainModel(base_lm).eval()
    tuned_lm = copy.deepcopy(base_lm)  # the same weights, its own copy (DMTDModel takes over its modules)
    dmtd = DMTDModel.from_config(tuned_lm, cfg, variant).eval()
    load_weights(dmtd, checkpoint_dir)
    sampling = SamplingParams(ev.temperature, ev.top_p, ev.top_k)
    gen = torch.Generator(device=device).manual_seed(ev.seed)
    longest = max([len(item_prompt_ids(i, tok)) for i in items] + [1])
    max_len = longest + max(ev.max_new_tokens, ev.speed_new_tokens)
    out: dict[str, Any] = {"variant": variant, "tau": cfg.tau, "num_parallel_layers": cfg.num_parallel_layers}
    out["perplexity"] = {"dmtd": perplexity(dmtd, rows, ev.batch_size, progress, f"ppl {variant}"),
                         "target": perplexity(plain, rows, ev.batch_size, progress, "ppl target")}
    dmtd_dec = DMTDDecoder(dmtd, max_len, graph=ev.graph)
    target_dec = ar_decoder(base_lm, max_len, ar_modes(base_lm)[0], sampling, ev.seed)
    out["gsm8k"] = {
        "dmtd": gsm8k_accuracy(dmtd_dec, tok, items, ev.max_new_tokens, sampling, generator=gen, progress=progress,
                               desc=f"gsm8k {variant}"),
        "target": gsm8k_accuracy(target_dec, tok, items, ev.max_new_tokens, sampling, progress=progress,
                                 desc="gsm8k target"),
    }
    del target_dec
    prompts = [item_prompt_ids(i, tok) for i in items[: ev.speed_prompts]]
    # CPU: no graphs to capture, one cycle on the prompt's first 16 tokens warms the caches
    warm, warm_prompt = (8, None) if device.type == "cuda" else (cfg.tau, 16)
    dmtd_speed = decode_speed(dmtd_dec, prompts, ev.speed_new_tokens, warmup_tokens=warm,
                              warmup_prompt_tokens=warm_prompt)
    ar = fastest_ar_speed(dmtd.lm, prompts, ev.speed_new_tokens, max_len,  # the fastest AR of the same weights
                          warmup_prompt_tokens=warm_prompt)
    speedup = dmtd_speed["tokens_per_s"] / ar["tokens_per_s"]
    out["speed"] = {"dmtd": {**dmtd_speed, "kernels": dmtd_dec.kernels}, "ar": ar, "speedup": speedup,
                    "speedup_vs_fastest_ar": speedup, "device": str(device)}
    return out
