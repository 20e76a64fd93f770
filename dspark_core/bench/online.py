"""Online speculative decoding benchmark (library of the stage ``bench_online``).

For every dataset of eval prompts, each prompt is decoded twice through the same ``TargetRunner``:
plain AR (``ARDecoder``) and speculative with the trained draft (``bench_online.engine``: the reference
``SpeculativeDecoder``, or greedy ``StaticSpeculativeDecoder`` whose cycle runs as CUDA graphs), and per dataset
(and ``overall``) the metrics are:

- ``mal``: mean tokens committed per cycle, bonus included;
- ``accept_rate@i`` (i = 0 .. S-1, slot 0 = the first proposed token, as in ``eval_offline``): among the
  cycles that proposed slot i, the fraction whose slot i was accepted; ``cond_accept_rate@i``: the same
  among cycles that also accepted every slot before i (the online analogue of the offline per-slot rate);
- ``draft_ms`` / ``verify_ms`` / ``cycle_ms``: mean per cycle (draft = propose + context update; the static
  engine times the two parts on every 16th cycle only, and its context update is part of verify);
- ``tokens_per_s`` / ``ar_tokens_per_s`` / ``speedup``: decode throughput after the prefill (sum of
  tokens / sum of decode seconds), speculative vs AR, the same target code path;
- ``proposal_length_hist`` (counts of 0 .. S proposed tokens), ``mean_proposal_length``;
- ``identical``: greedy speculative output token-for-token equal to AR on every prompt (None when sampling);
- ``online_modes`` (drafts with ``online_modes()``, i.e. Draft Memory, when ``compare_online_modes``): the same
  prompts decoded again in each other mode (chained vs first-stage memory): mal, identical, tokens_per_s, cycle_ms;
- ``at_temperature`` (``bench_online.also_temperatures``, e.g. [0.7] beside a greedy run): the same prompts
  decoded again, AR and speculative, sampling at each of these temperatures (exact rejection sampling; the engine
  ``bench_online.engine`` resolves to, static on CUDA for a chain): mal, accept_rate@0, tokens_per_s,
  ar_tokens_per_s, speedup, cycle_ms, engine -- per dataset and overall; with kernels (``ar_all_modes``) also
  the fastest sampled AR of all small-GEMM modes and ``speedup_vs_fastest_ar`` at that temperature;
- ``concurrency`` (``bench_online.concurrency``, e.g. [1, 4, 16, 64]): at each level c, a target runner of c request
  rows and the fast engine on it (``StaticSpeculativeDecoder.serve``: c requests at once, a row taking the next
  request when its own ends), speculative (``bench_online.proposal``: fixed | confidence) and AR (``draft=None``,
  the same rows and step), every dataset's requests turn by turn in waves;
  ``metrics[name]["concurrency"][str(c)]`` = mal, tokens_per_s (total), request_tokens_per_s, cycle_ms,
  ar_tokens_per_s, speedup over the AR at the same concurrency (at c = 1 over the fastest AR the run measured at
  one request), mean_active_rows, mean_verify_tokens, identical, identical_to_alone, ...
  (``dspark_core.bench.concurrency``);
- ``peers`` (optional): Hugging Face ``generate`` greedy, assisted generation (``assistant_model``) and
  prompt-lookup decoding (``prompt_lookup_num_tokens``) on the same prompts: tokens/s, and whether the
  greedy text equals our AR output.

Writes the metrics JSON (atomic) and PNG plots (Agg backend). Datasets: a domain (``math_word``,
``competition_math``, ``code``, ``chat``; ``gsm8k`` is an alias of ``math_word``) selects the prepare stage's
eval prompts of that domain (its ``domain`` column; older files without it: by source, ``DATASET_SOURCES``), a
source name selects itself, and ``jsonl:<path>`` reads any JSONL file of records with a ``turns`` list (and an
optional ``system``). A conversation is decoded turn by turn up to ``max_turns`` of its user turns, each later turn
after the speculative answers of the earlier ones, under its own system message (the prompts' ``system``
column), else ``bench_online.system_prompt``.

Shape legend: S block size, V vocab.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from dspark_core.bench.concurrency import (LevelRun, alone_tokens, ar_at_one_request, merge_runs,
                                          summarize_level)
from dspark_core.bench.peers import PEERS, peer_comparison, truncated_assistant
from dspark_core.bench.plots import plot_metrics
from dspark_core.config import (Section, device_name, non_negative, one_of, positive, require,
                                resolve_device as torch_device)
from dspark_core.data.sources import utf8_line
from dspark_core.errors import UserError
from dspark_core.io import write_json
from dspark_core.decoding.ar import ARDecoder
from dspark_core.decoding.common import BudgetError
from dspark_core.decoding.engine import SpeculativeDecoder
from dspark_core.decoding.rows import PROPOSALS
from dspark_core.decoding.sampling import SamplingParams
from dspark_core.decoding.static_draft import static_draft_problem
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.decoding.types import GenerationResult

DOMAINS = ("math_word", "competition_math", "code", "chat")   # prepare's domains (dspark_core/data/sources.py)
DATASET_ALIASES = {"gsm8k": "math_word"}
# prompts files written before prepare's `domain` column: the sources of each domain
DATASET_SOURCES = {"math_word": ("gsm8k_symbolic", "gsm8k_test", "gsm_symbolic_variants"),
                   "competition_math": ("aime2025", "project_euler"), "code": ("humaneval", "codeio"),
                   "chat": ("sharegpt",)}
JSONL_PREFIX = "jsonl:"
ENGINES = ("auto", "reference", "static")
TIME_EVERY = 16  # the static engine times draft / verify separately on every 16th cycle
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchOnlineConfig(Section):
    """Params section ``bench_online``."""

    datasets: tuple[str, ...] = ("gsm8k", "chat")
    max_prompts: int = 8                  # per dataset
    max_new_tokens: int = 96
    max_turns: int = 1                    # turns of each conversation fed (later turns see our own answers)
    temperature: float = 0.0              # 0 = greedy (identity with AR checked)
    also_temperatures: tuple[float, ...] = ()  # decode again sampling at each (e.g. 0.7): metrics["at_temperature"]
    top_p: float = 1.0
    top_k: int = 0
    confidence_threshold: float = 0.0     # cut a proposal at the first slot below it (0 = off)
    seed: int = 0
    system_prompt: str | None = None
    max_len: int = 2048                   # static KV cache positions (prompt + answer + one block)
    device: str = "auto"                  # auto: cuda when available
    dtype: str = "auto"                   # auto: bfloat16 on cuda, float32 on cpu
    cuda_graph: bool | None = None        # None: on for cuda
    compile: bool = False                 # torch.compile the decoder layer (GPU)
    kernels: bool | None = None           # the Triton decode step (GPU); None: on for cuda where it applies
    small_gemm: str | None = None         # mma | fma (kernels.linear); None: mma where it applies
    kernel_config_store: str | None = "~/.cache/dspark/kernel_configs"  # tuned tiles per device + target
    kernel_configs: str | None = None     # a pinned tile table (kernels.tuning.save_kernel_configs); wins over the store
    batch_invariant: bool = True          # kernels: each token of a verify summed as in a one-token step
    tune_kernels: bool = True             # kernels: time the tile candidates per shape (False: the first one)
    fma_tiles: bool = False               # kernels, mma mode: the tuner also times the FMA tiles
    ar_all_modes: bool = True             # with kernels: AR again in the other small-GEMM mode (fastest AR)
    engine: str = "auto"                  # reference | static | auto (static for greedy on cuda where it applies)
    tree_branches: tuple[tuple[int, ...], ...] = ()  # draft-tree branches [start, length] (decoding/tree.py)
    concurrency: tuple[int, ...] = (1, 2)  # request rows served at once: a row of metrics per level ([]: none)
    proposal: str = "fixed"               # the levels' verify: fixed (every row its block) | confidence (scheduled)
    verify_budget: int | None = None      # proposal confidence: at most this many tokens a verify step (None: any)
    min_gain: float = 0.0                 # proposal confidence: never verify a draft token predicted below it
    num_threads: int | None = None        # CPU threads for torch (None: torch's default)
    peers: tuple[str, ...] = ("hf_generate", "assisted", "prompt_lookup")
    peers_variants: tuple[str, ...] = ("baseline",)  # variants whose bench runs the peers (draft-independent)
    prompt_lookup_num_tokens: int = 10
    assistant_dir: str | None = None      # HF dir of the assisted-generation peer; None: truncated target
    assistant_layers: int = 4             # layers of the truncated-target assistant
    compare_online_modes: bool = True    # a draft with online modes (draft_memory): decode again in each other mode
    prompts_path: str = "data/prompts/eval.parquet"
    out_dir: str = "reports/bench_online"

    def validate(self) -> None:
        require(len(self.datasets) > 0, "datasets must name at least one dataset")
        device_name("device", self.device)
        one_of("dtype", self.dtype, ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"))
        positive("max_prompts", self.max_prompts)
        positive("max_new_tokens", self.max_new_tokens)
        positive("max_turns", self.max_turns)
        positive("max_len", self.max_len)
        SamplingParams(self.temperature, self.top_p, self.top_k)  # raises ValueError on bad values
        for t in self.also_temperatures:
            require(isinstance(t, (int, float)) and t > 0,
                    f"also_temperatures: {t!r} is not a temperature > 0 (the main run is the greedy one)")
        require(0.0 <= self.confidence_threshold <= 1.0,
                f"confidence_threshold must be in [0, 1]; got {self.confidence_threshold}")
        non_negative("seed", self.seed)
        for p in self.peers:
            require(p in PEERS, f"peers: unknown peer {p!r} (known: {', '.join(PEERS)})")
        positive("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens)
        positive("assistant_layers", self.assistant_layers)
        require(self.engine in ENGINES, f"engine must be one of {', '.join(ENGINES)}; got {self.engine!r}")
        for b in self.tree_branches:
            require(len(b) == 2 and min(b) >= 1, f"tree_branches: {list(b)} is not a [start >= 1, length >= 1] pair")
        require(not (self.tree_branches and self.confidence_threshold > 0),
                f"tree_branches with confidence_threshold {self.confidence_threshold}: the confidence cut applies to "
                "the chain only; set confidence_threshold: 0 or tree_branches: []")
        self._validate_levels()
        if self.num_threads is not None:
            positive("num_threads", self.num_threads)
        if self.small_gemm is not None:
            require(self.small_gemm in ("mma", "fma"), f"small_gemm must be mma, fma or null; got {self.small_gemm!r}")

    def _validate_levels(self) -> None:
        levels = self.concurrency
        for c in levels:
            require(c >= 1, f"concurrency: {c} is not a number of request rows >= 1 (e.g. [1, 4, 16, 64])")
        require(len(set(levels)) == len(levels), f"concurrency: {list(levels)} names a level twice")
        one_of("proposal", self.proposal, PROPOSALS)
        many = [c for c in levels if c > 1]
        require(not (many and self.engine == "reference"),
                f"concurrency {list(levels)} with engine: reference: the reference engine decodes one request; "
                "set engine: auto (or static), or concurrency: [1]")
        require(not (many and self.tree_branches),
                f"concurrency {list(levels)} with tree_branches: draft trees are verified at concurrency 1 only; "
                "set concurrency: [1] or tree_branches: []")
        conf = self.proposal == "confidence"
        require(conf or (self.verify_budget is None and self.min_gain == 0.0),
                "verify_budget and min_gain size the verify of proposal: confidence; set proposal: confidence, "
                "or verify_budget: null and min_gain: 0")
        if self.verify_budget is not None:
            require(self.verify_budget >= max(levels, default=1),
                    f"verify_budget {self.verify_budget} is below concurrency {max(levels, default=1)} (every row "
                    "verifies its anchor); raise it or set it to null")
        require(0.0 <= self.min_gain <= 1.0, f"min_gain must be in [0, 1] (a predicted acceptance); got {self.min_gain}")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


# -- prompts ----------------------------------------------------------------------------------------
class Conversation(list):
    """A conversation to decode: the list of its user turns, carrying its own system message (``system``, None:
    ``bench_online.system_prompt``). Equal to the plain list of its turns."""

    def __init__(self, turns: Sequence[str] = (), system: str | None = None):
        super().__init__(turns)
        self.system = system


def _conversation(row: dict[str, Any]) -> Conversation:
    return Conversation(row["turns"], row.get("system"))


def load_prompt_sets(prompts_path: str | Path, datasets: Sequence[str],
                     max_prompts: int) -> dict[str, list[Conversation]]:
    """Conversations (lists of user turns with their system message) per dataset, the first ``max_prompts`` of
    each, in file order."""
    sets: dict[str, list[Conversation]] = {}
    rows: list[dict[str, Any]] | None = None
    for name in datasets:
        if name.startswith(JSONL_PREFIX):
            convs = [_conversation(r) for r in read_jsonl_prompts(Path(name[len(JSONL_PREFIX):]))]
        else:
            rows = rows if rows is not None else _read_prompt_table(Path(prompts_path))
            domain = DATASET_ALIASES.get(name, name)
            if domain in DOMAINS:
                convs = [_conversation(r) for r in rows if _row_domain(r) == domain]
            else:
                convs = [_conversation(r) for r in rows if r["source"] == name]
        if not convs:
            aliases = ", ".join(f"{a} (= {d})" for a, d in DATASET_ALIASES.items())
            raise UserError(f"bench_online.datasets: {name!r} selects no prompt from {prompts_path} "
                            f"(known names: {', '.join(DOMAINS)}, {aliases}, a source name, or jsonl:<path>)")
        sets[name] = convs[:max_prompts]
    return sets


def _row_domain(row: dict[str, Any]) -> str | None:
    """A prompt's domain: its ``domain`` field, else the domain of its source (files written before the column)."""
    if row.get("domain"):
        return row["domain"]
    return next((d for d, sources in DATASET_SOURCES.items() if row["source"] in sources), None)


def _read_prompt_table(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"bench_online.prompts_path: {path} not found (run the prepare stage)")
    if path.suffix == ".jsonl":
        return read_jsonl_prompts(path)
    from dspark_core.io import parquet_schema, read_parquet

    fix = "rerun the prepare stage (`dvc repro -f prepare`)"
    names = parquet_schema(path, fix).names
    rows = read_parquet(path, [c for c in ("source", "domain", "turns", "system") if c in names], fix).to_pylist()
    return rows


def read_jsonl_prompts(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"{path}: JSONL prompt file not found")
    out = []
    # split on "\n" only: str.splitlines() also splits inside strings holding U+2028 / U+0085 (valid JSON)
    for i, raw in enumerate(path.read_bytes().split(b"\n")):
        line = utf8_line(raw, path, i + 1)
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path}: line {i + 1}: not JSON ({e})") from e
        turns = rec.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise UserError(f"{path}: line {i + 1}: 'turns' must be a non-empty list of non-empty strings, "
                            f"got {str(turns)[:80]!r}")
        system = rec.get("system")
        if system is not None and not isinstance(system, str):
            raise UserError(f"{path}: line {i + 1}: 'system' must be a string, got {str(system)[:80]!r}")
        out.append({"source": rec.get("source", path.stem), "domain": rec.get("domain"), "turns": turns,
                    "system": system})
    return out


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def stop_ids_of(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids of the generation config and the tokenizer."""
    ids: set[int] = set()
    for src in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if src is None:
            continue
        ids.update([src] if isinstance(src, int) else list(src))
    return sorted(ids)


# -- one dataset ----------------------------------------------------------------------------------
@dataclass
class DatasetRun:
    """Per-generation records of one dataset (one generation per conversation turn)."""

    prompts: list[list[int]] = field(default_factory=list)
    spec: list[GenerationResult] = field(default_factory=list)
    ar: list[GenerationResult] = field(default_factory=list)


def decode_dataset(conversations: Sequence[Sequence[str]], tokenizer: Any, spec: SpeculativeDecoder, ar: ARDecoder,
                   cfg: BenchOnlineConfig, stop_ids: Sequence[int], desc: str = "") -> DatasetRun:
    """AR and speculative decoding of every turn (up to ``max_turns``); later turns carry the speculative answer
    forward. A conversation's own system message (:class:`Conversation`) wins over ``cfg.system_prompt``."""
    from tqdm.auto import tqdm

    run = DatasetRun()
    for c, turns in enumerate(tqdm(conversations, desc=desc or "bench_online", leave=False)):
        messages = opening(turns, cfg)
        for t, turn in enumerate(turns[: cfg.max_turns]):
            messages.append({"role": "user", "content": turn})
            prompt = chat_ids(tokenizer, messages)
            run.prompts.append(prompt)
            with max_len_named(cfg, f"prompt {c} (turn {t}) of dataset {desc!r}"):
                run.ar.append(ar.generate(prompt, cfg.max_new_tokens, stop_ids))
                run.spec.append(spec.generate(prompt, cfg.max_new_tokens, stop_ids))
            answer = tokenizer.decode(run.spec[-1].tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
    return run


def opening(turns: Sequence[str], cfg: BenchOnlineConfig) -> list[dict[str, str]]:
    """The messages before a conversation's first turn: its own system message (:class:`Conversation`), else
    ``cfg.system_prompt``, else none."""
    system = getattr(turns, "system", None)
    system = cfg.system_prompt if system is None else system
    return [{"role": "system", "content": system}] if system else []


@contextlib.contextmanager
def max_len_named(cfg: BenchOnlineConfig, what: str):
    """Re-raise a generation that does not fit the static caches as an error naming ``bench_online.max_len``."""
    try:
        yield
    except BudgetError as e:
        raise UserError(f"bench_online.max_len={cfg.max_len} is too small for {what}: {e.prompt_len} prompt tokens "
                        f"need {e.need} positions with bench_online.max_new_tokens={cfg.max_new_tokens} and the "
                        f"lookahead; raise bench_online.max_len (or shorten the prompts)") from None


def summarize(run: DatasetRun, block_size: int, greedy: bool) -> dict[str, Any]:
    """The metrics of one dataset's (or all datasets') generations; see the module docstring."""
    spec, ar = run.spec, run.ar
    accepted = [a for r in spec for a in r.accepted_per_cycle]
    proposed = [n for r in spec for n in r.proposal_lengths]
    cycles = len(accepted)
    out: dict[str, Any] = {"num_generations": len(spec), "new_tokens": sum(len(r.tokens) for r in spec),
                           "cycles": cycles, "mal": sum(a + 1 for a in accepted) / cycles if cycles else None}
    for i in range(block_size):
        offered = sum(n > i for n in proposed)
        reached = sum(n > i and a >= i for a, n in zip(accepted, proposed))
        hits = sum(a > i for a in accepted)
        out[f"accept_rate@{i}"] = hits / offered if offered else None
        out[f"cond_accept_rate@{i}"] = hits / reached if reached else None
    out["mean_proposal_length"] = sum(proposed) / cycles if cycles else None
    out["proposal_length_hist"] = {str(k): sum(n == k for n in proposed) for k in range(block_size + 1)}
    draft_s = [t for r in spec for t in r.draft_s]  # every cycle (reference engine) or the timed ones (static)
    verify_s = [t for r in spec for t in r.verify_s]
    out["draft_ms"] = 1e3 * sum(draft_s) / len(draft_s) if draft_s else None
    out["verify_ms"] = 1e3 * sum(verify_s) / len(verify_s) if verify_s else None
    out["cycle_ms"] = 1e3 * sum(r.decode_s for r in spec) / cycles if cycles else None
    out["tokens_per_s"] = _throughput(spec)
    out["ar_tokens_per_s"] = _throughput(ar)
    out["speedup"] = (out["tokens_per_s"] / out["ar_tokens_per_s"]
                      if out["tokens_per_s"] and out["ar_tokens_per_s"] else None)
    out["prefill_ms"] = 1e3 * sum(r.prefill_s for r in spec) / len(spec) if spec else None
    out["identical"] = all(s.tokens == a.tokens for s, a in zip(spec, ar)) if greedy else None
    return out


def _throughput(results: Sequence[GenerationResult]) -> float | None:
    tokens = sum(max(len(r.tokens) - 1, 0) for r in results)
    seconds = sum(r.decode_s for r in results)
    return tokens / seconds if seconds > 0 else None


# -- the stage ---------------------------------------------------------------------------------------
TARGET_DIR = Path("data/target")  # fixed by the DAG (dvc.yaml), as in dspark_core.draft.stage
TRAIN_DIR = Path("data/train")


def run_bench_online_stage(params: str | Path, variant: str) -> dict[str, Any]:
    """Stage ``bench_online@<variant>``: the draft ``data/train/<variant>/final`` on ``data/target``;
    metrics -> ``<out_dir>/<variant>.json``, plots -> ``<out_dir>/<variant>/``."""
    from dspark_core.target import read_fingerprint
    from dspark_core.variants import check_variant

    cfg = BenchOnlineConfig.load(params, "bench_online")
    check_variant(params, variant)
    draft_dir = TRAIN_DIR / variant / "final"
    if not (draft_dir / "config.json").is_file():
        raise UserError(f"{draft_dir}: no trained draft of variant {variant!r} (run `dvc repro train@{variant}`)")
    sets = load_prompt_sets(cfg.prompts_path, cfg.datasets, cfg.max_prompts)
    if variant not in cfg.peers_variants:  # the peers do not depend on the draft: measured once
        cfg = cfg.replace(peers=())
    out = Path(cfg.out_dir)
    return run_bench_online(TARGET_DIR, draft_dir, sets, cfg, out_json=out / f"{variant}.json",
                            plots_dir=out / variant, expected_fingerprint=read_fingerprint(TARGET_DIR)["fingerprint"])


# -- the whole benchmark ------------------------------------------------------------------------------
def resolve_device(cfg: BenchOnlineConfig) -> tuple[torch.device, torch.dtype, bool]:
    from dspark_core.target import resolve_dtype

    device = torch_device(cfg.device, "bench_online.device")
    dtype = resolve_dtype(cfg.dtype) if cfg.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    graphs = cfg.cuda_graph if cfg.cuda_graph is not None else device.type == "cuda"
    if graphs and device.type != "cuda":
        raise UserError("bench_online.cuda_graph: true needs a CUDA device")
    return device, dtype, graphs


def _resolve_kernels(cfg: BenchOnlineConfig, model: torch.nn.Module, device: torch.device) -> bool:
    """``bench_online.kernels``: None = the Triton decode step on CUDA where it applies; True insists (with the
    reason when it cannot); False never."""
    from dspark_core.decoding.target_runner import kernels_problem

    if cfg.kernels is False:
        return False
    if device.type != "cuda":
        if cfg.kernels:
            raise UserError("bench_online.kernels: true needs a CUDA device")
        return False
    problem = kernels_problem(model)
    if problem and cfg.kernels:
        raise UserError(f"bench_online.kernels: true, but {problem}")
    return problem is None


def _add_variant_timers(metrics: dict[str, Any], runs: dict[str, Any], timers: dict[str, dict[str, float]]) -> None:
    """``<timer>_ms_per_cycle`` and ``<timer>_share_of_cycle`` (of draft + verify time) per dataset and overall."""
    totals: dict[str, float] = {}
    all_cycle_s, all_cycles = 0.0, 0
    for name, run in runs.items():
        cycle_s = sum(sum(r.draft_s) + sum(r.verify_s) for r in run.spec)
        cycles = sum(r.cycles for r in run.spec)
        all_cycle_s, all_cycles = all_cycle_s + cycle_s, all_cycles + cycles
        for key, sec in timers[name].items():
            totals[key] = totals.get(key, 0.0) + sec
            metrics[name][f"{key}_ms_per_cycle"] = 1e3 * sec / max(cycles, 1)
            metrics[name][f"{key}_share_of_cycle"] = sec / cycle_s if cycle_s > 0 else None
    for key, sec in totals.items():
        metrics["overall"][f"{key}_ms_per_cycle"] = 1e3 * sec / max(all_cycles, 1)
        metrics["overall"][f"{key}_share_of_cycle"] = sec / all_cycle_s if all_cycle_s > 0 else None


def resolve_engine(name: str, sampling: SamplingParams, draft: Any, device: torch.device,
                   tree: bool = False) -> str:
    """``bench_online.engine``: "static" (the device-side cycle: greedy, or sampling along a chain; baseline
    draft hooks), "reference" (``SpeculativeDecoder``: any sampling, any variant), or "auto": static on CUDA where
    it applies (greedy, or sampling along a chain: its CUDA-graph sampling cycle passes the chi-square test against
    the target's distribution on an H200), else reference. Asking for "static" where it cannot run is a ValueError with the reason."""
    if name == "reference":
        return name
    problem = static_draft_problem(draft)
    if not sampling.greedy and tree:
        problem = f"temperature {sampling.temperature} with tree_branches (the static engine's trees are greedy)"
    if name == "static":
        if problem:
            raise UserError(f"bench_online.engine: static, but {problem}")
        return name
    return "static" if device.type == "cuda" and problem is None else "reference"


def make_runner(model: torch.nn.Module, cfg: "BenchOnlineConfig", aux_layer_ids: Sequence[int], block: int,
                graphs: bool, kernels: bool, batch_size: int = 1) -> TargetRunner:
    """The target runner of the benchmark: static caches of ``max_len`` for ``batch_size`` request rows, graphs of
    up to a verify step."""
    return TargetRunner(model, max_len=cfg.max_len, aux_layer_ids=aux_layer_ids, compile=cfg.compile,
                        cuda_graph=graphs, graph_max_tokens=block + 1, kernels=kernels, batch_size=batch_size)


def check_tree(cfg: "BenchOnlineConfig", draft: Any) -> None:
    """``bench_online.tree_branches`` against the draft (its block size, a variant that cannot run a tree): one
    error naming the param, before any engine is built."""
    from dspark_core.decoding.tree import TreeLayout, parse_branches
    from dspark_core.decoding.tree_sampling import tree_draft_problem

    if not cfg.tree_branches:
        return
    where = f"bench_online.tree_branches {[list(b) for b in cfg.tree_branches]}"
    try:
        TreeLayout(int(draft.block_size), parse_branches(cfg.tree_branches))
    except ValueError as e:
        raise UserError(f"{where}: {e}; fix the [start, length] pairs or set tree_branches: []") from None
    problem = tree_draft_problem(draft)
    if problem:
        kind = getattr(getattr(draft, "cfg", None), "kind", type(draft).__name__)
        raise UserError(f"{where}: {problem}; set tree_branches: [] for draft.kind {kind!r}")


def make_engine(engine: str, runner: TargetRunner, draft: Any, cfg: "BenchOnlineConfig"):
    """The speculative decoder named by ``engine`` (see :func:`resolve_engine`)."""
    check_tree(cfg, draft)
    if engine == "static":
        from dspark_core.decoding.static_engine import StaticSpeculativeDecoder

        return StaticSpeculativeDecoder(runner, draft, confidence_threshold=cfg.confidence_threshold,
                                        time_every=TIME_EVERY, tree_branches=cfg.tree_branches,
                                        sampling=cfg.sampling, seed=cfg.seed)
    return SpeculativeDecoder(runner, draft, block_size=int(draft.block_size),
                              confidence_threshold=cfg.confidence_threshold, sampling=cfg.sampling, seed=cfg.seed,
                              tree_branches=cfg.tree_branches)  # a tree: greedy or sampling (tree_sampling.py)


def run_bench_online(target_dir: str | Path, draft_dir: str | Path, prompt_sets: dict[str, list[list[str]]],
                     cfg: BenchOnlineConfig, *, out_json: str | Path | None = None,
                     plots_dir: str | Path | None = None, expected_fingerprint: str | None = None) -> dict[str, Any]:
    """Benchmark the draft in ``draft_dir`` on the target in ``target_dir``; returns (and writes) the metrics."""
    from dspark_core.checkpoint import load_draft
    from dspark_core.target import load_target

    device, dtype, graphs = resolve_device(cfg)
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    model, tokenizer = load_target(target_dir, dtype=dtype, device=device)
    draft = load_draft(draft_dir, model, expected_fingerprint=expected_fingerprint)
    block = int(draft.block_size)
    kernels = _resolve_kernels(cfg, model, device)
    kernel_setup = setup_kernels(cfg, target_dir, device) if kernels else {}
    runner = make_runner(model, cfg, draft.aux_layer_ids, block, graphs, kernels)
    engine = resolve_engine(cfg.engine, cfg.sampling, draft, device, tree=bool(cfg.tree_branches))
    spec = make_engine(engine, runner, draft, cfg)
    ar = ARDecoder(runner, sampling=cfg.sampling, seed=cfg.seed)
    stops = stop_ids_of(model, tokenizer)
    if device.type == "cuda":
        _warm_up(prompt_sets, tokenizer, spec, ar, stops, cfg)
    else:
        _warm_up(prompt_sets, tokenizer, spec, ar, stops, cfg, new_tokens=(2, 2), prompt_tokens=16)
    runs, timers = {}, {}
    for name, convs in prompt_sets.items():
        draft.set_variant_timing(True)  # a variant's own online work (e.g. the Engram lookup), timed per dataset
        runs[name] = decode_dataset(convs, tokenizer, spec, ar, cfg, stops, desc=name)
        timers[name] = draft.variant_timers()
        draft.set_variant_timing(False)
    greedy = cfg.sampling.greedy
    metrics: dict[str, Any] = {name: summarize(run, block, greedy) for name, run in runs.items()}
    metrics["overall"] = summarize(_merge(runs.values()), block, greedy)
    _add_variant_timers(metrics, runs, timers)
    if cfg.compare_online_modes:
        compare_online_modes(draft, spec, runs, metrics, cfg, stops, block)
    for temp in cfg.also_temperatures:
        hot_cfg = cfg.replace(temperature=float(temp))
        hot_runs = at_temperature(metrics, runner, draft, hot_cfg, prompt_sets, tokenizer, stops, block, device)
        if kernels and cfg.ar_all_modes:  # the sampled speedup against the fastest sampled AR too
            key = f"{hot_cfg.temperature:g}"
            rows = {name: metrics[name]["at_temperature"][key] for name in [*hot_runs, "overall"]}
            by_mode = ar_in_other_modes(model, hot_cfg, hot_runs, stops, runner.aux_layer_ids, block, graphs)
            add_fastest_ar(rows, by_mode)
    if kernels and cfg.ar_all_modes:
        by_mode = ar_in_other_modes(model, cfg, runs, stops, runner.aux_layer_ids, block, graphs)
        add_fastest_ar(metrics, by_mode)
    proposal, proposal_note = level_proposal(cfg, draft)
    if cfg.concurrency:
        if proposal_note:
            log.warning(proposal_note)
        levels = serve_levels(model, draft, cfg, prompt_sets, tokenizer, stops, graphs, kernels)
        add_levels(metrics, levels, runs, proposal, greedy)
    if cfg.peers and greedy:
        assistant = _assistant(cfg, model) if "assisted" in cfg.peers else None
        for name, run in runs.items():
            metrics[name]["peers"] = peer_comparison(
                model, run.prompts, [r.tokens for r in run.ar], cfg.max_new_tokens, stops, cfg.peers, assistant,
                cfg.prompt_lookup_num_tokens, tokenizer.pad_token_id)
    metrics["setup"] = {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "cuda_graph": graphs,
                        "kernels": kernels, **kernel_setup, "engine": engine,
                        "static_engine_problem": static_draft_problem(draft),  # why a fallback to reference
                        "draft_kind": draft.cfg.kind, "online_mode": getattr(draft, "online_mode", None),
                        "num_threads": torch.get_num_threads(),
                        "compile": cfg.compile, "block_size": block, "aux_layer_ids": list(draft.aux_layer_ids),
                        "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                        "confidence_threshold": cfg.confidence_threshold, "max_new_tokens": cfg.max_new_tokens,
                        "tree_branches": [list(b) for b in cfg.tree_branches],
                        "concurrency": list(cfg.concurrency), "proposal": proposal, "proposal_note": proposal_note,
                        "verify_budget": cfg.verify_budget, "min_gain": cfg.min_gain,
                        "level_kernels": {str(c): level_kernels(kernels, c, cfg.batch_invariant)
                                          for c in cfg.concurrency}}
    if kernels:
        from dspark_core.kernels.tuning import close_config_store, kernel_configs

        metrics["setup"]["kernel_configs"] = kernel_configs(device)["configs"]
        close_config_store()
    if out_json is not None:
        write_json(out_json, metrics)
    if plots_dir is not None:
        plot_metrics(metrics, Path(plots_dir), block)
    return metrics


TEMPERATURE_KEYS = ("mal", "accept_rate@0", "tokens_per_s", "ar_tokens_per_s", "speedup", "cycle_ms")


def at_temperature(metrics: dict[str, Any], runner: TargetRunner, draft: Any, cfg: BenchOnlineConfig,
                   prompt_sets: dict[str, list[list[str]]], tokenizer: Any, stops: Sequence[int], block: int,
                   device: torch.device) -> dict[str, DatasetRun]:
    """Decode every dataset again, AR and speculative, sampling at ``cfg.temperature`` (same runner, the engine
    ``bench_online.engine`` names: auto / static = the device-side sampling cycle on CUDA; a tree run's sampling
    pass uses the reference engine: the static engine's trees are greedy).
    ``metrics[name]["at_temperature"][str(T)]`` = ``TEMPERATURE_KEYS`` + engine; returns the runs (their AR in
    the other small-GEMM mode gives the fastest sampled AR, ``add_fastest_ar``)."""
    name = "reference" if cfg.tree_branches else cfg.engine  # the static engine's trees are greedy
    engine = resolve_engine(name, cfg.sampling, draft, device)
    spec = make_engine(engine, runner, draft, cfg)
    ar = ARDecoder(runner, sampling=cfg.sampling, seed=cfg.seed)
    runs = {name: decode_dataset(convs, tokenizer, spec, ar, cfg, stops, desc=f"{name} T={cfg.temperature:g}")
            for name, convs in prompt_sets.items()}
    for name, run in [*runs.items(), ("overall", _merge(runs.values()))]:
        row = summarize(run, block, greedy=False)
        metrics[name].setdefault("at_temperature", {})[f"{cfg.temperature:g}"] = {
            **{k: row.get(k) for k in TEMPERATURE_KEYS}, "engine": engine}
    return runs


def setup_kernels(cfg: BenchOnlineConfig, target_dir: str | Path, device: torch.device) -> dict[str, Any]:
    """The small-GEMM mode (``bench_online.small_gemm``; mma where it applies) and the config store: the tiles
    tuned for this target on this device, pinned from the store file when an earlier run made it, and
    added to it otherwise -- so every run sums in the same order (the bits of mma-mode outputs)."""
    from dspark_core.kernels import linear, tuning
    from dspark_core.target import read_fingerprint

    if cfg.small_gemm is not None:
        linear.set_small_gemm(cfg.small_gemm)
    linear.set_batch_invariant(cfg.batch_invariant)
    tuning.set_tuning(cfg.tune_kernels)
    tuning.set_fma_tiles(cfg.fma_tiles)
    out: dict[str, Any] = {"small_gemm": linear.resolve_small_gemm(device), "kernel_config_file": None}
    if cfg.kernel_configs:
        try:
            pins = tuning.pin_kernel_configs(Path(cfg.kernel_configs).expanduser(), device)
        except ValueError as e:  # names the file and what is wrong with it
            raise UserError(f"bench_online.kernel_configs: {e}; set it to null to tune") from None
        out["kernel_configs_file_pinned"] = len(pins)
    if cfg.kernel_config_store:
        fingerprint = read_fingerprint(target_dir)["fingerprint"]
        path = tuning.kernel_store_path(cfg.kernel_config_store, device, fingerprint)
        pins = tuning.use_config_store(path, device, fingerprint)
        out.update(kernel_config_file=str(path), kernel_configs_pinned=len(pins))
    return out


def ar_in_other_modes(model: torch.nn.Module, cfg: BenchOnlineConfig, runs: dict[str, DatasetRun],
                      stops: Sequence[int], aux_layer_ids: Sequence[int], block: int,
                      graphs: bool) -> dict[str, dict[str, list[GenerationResult]]]:
    """AR decoding of the same prompts in each other small-GEMM mode that applies (kernels on): the generations
    per dataset and mode, the current mode's from ``runs``. Every speedup is then also reported against the fastest
    AR of all modes: a mode that makes the verify cheap may make the AR step slow."""
    from dspark_core.kernels import linear

    main = linear.SMALL_GEMM
    device = next(model.parameters()).device
    by_mode = {name: {main: run.ar} for name, run in runs.items()}
    for mode in linear.SMALL_GEMM_MODES:
        if mode == main or (mode == "mma" and linear.small_gemm_problem(device)):
            continue
        linear.set_small_gemm(mode)
        try:
            runner = make_runner(model, cfg, aux_layer_ids, block, graphs, kernels=True)
            ar = ARDecoder(runner, sampling=cfg.sampling, seed=cfg.seed)
            first = next(iter(runs.values())).prompts[0]
            ar.generate(first, min(16, cfg.max_new_tokens), stops)  # warm-up: tuning + graph capture
            for name, run in runs.items():
                by_mode[name][mode] = [ar.generate(p, cfg.max_new_tokens, stops) for p in run.prompts]
            del ar, runner
        finally:
            linear.set_small_gemm(main)
    return by_mode


def add_fastest_ar(metrics: dict[str, Any], by_mode: dict[str, dict[str, list[GenerationResult]]]) -> None:
    """``ar_tokens_per_s_by_mode``, ``fastest_ar_mode``, ``fastest_ar_tokens_per_s`` and
    ``speedup_vs_fastest_ar`` per dataset and overall (all datasets' generations, like ``tokens_per_s``), into
    ``metrics[name]`` (the greedy rows, or a temperature's ``at_temperature`` rows with that temperature's AR)."""
    def put(row: dict[str, Any], results: dict[str, list[GenerationResult]]) -> None:
        rates = {m: _throughput(r) for m, r in results.items()}
        known = {m: v for m, v in rates.items() if v}
        if not known:
            return
        fastest = max(known, key=known.get)
        row.update(ar_tokens_per_s_by_mode=rates, fastest_ar_mode=fastest, fastest_ar_tokens_per_s=known[fastest],
                   speedup_vs_fastest_ar=row["tokens_per_s"] / known[fastest] if row.get("tokens_per_s") else None)

    for name, results in by_mode.items():
        put(metrics[name], results)
    modes = {m for results in by_mode.values() for m in results}
    put(metrics["overall"], {m: [g for results in by_mode.values() for g in results.get(m, [])] for m in modes})


def compare_online_modes(draft: Any, spec: Any, runs: dict[str, DatasetRun], metrics: dict[str, Any],
                         cfg: BenchOnlineConfig, stops: Sequence[int], block: int) -> None:
    """For a draft with ``online_modes()`` (Draft Memory: ``chained`` | ``first_stage`` memory), decode the same
    prompts again in every other mode; ``metrics[name]['online_modes'][mode]`` = mal, identical, tokens_per_s,
    cycle_ms (the main run's mode included). Nothing for drafts without modes."""
    modes = getattr(draft, "online_modes", lambda: ())()
    if len(modes) < 2:
        return
    main = draft.online_mode
    keys = ("mal", "identical", "tokens_per_s", "cycle_ms")
    alt_runs: dict[str, dict[str, DatasetRun]] = {}
    try:
        for mode in (m for m in modes if m != main):
            draft.set_online_mode(mode)
            alt_runs[mode] = {name: DatasetRun(prompts=run.prompts, ar=run.ar,
                                               spec=[spec.generate(p, cfg.max_new_tokens, stops) for p in run.prompts])
                              for name, run in runs.items()}
    finally:
        draft.set_online_mode(main)
    greedy = cfg.sampling.greedy
    for name in metrics:
        if name == "setup":
            continue
        rows = {main: {k: metrics[name][k] for k in keys}}
        for mode, mode_runs in alt_runs.items():
            run = mode_runs[name] if name in mode_runs else _merge(mode_runs.values())
            s = summarize(run, block, greedy)
            rows[mode] = {k: s[k] for k in keys}
        metrics[name]["online_modes"] = rows


# -- concurrency levels ------------------------------------------------------------------------------
def level_kernels(kernels: bool, concurrency: int, batch_invariant: bool = True) -> bool:
    """Whether the target runner of a concurrency level runs the Triton decode kernels (``kernels``: the run's
    choice at one request). At more request rows only when ``batch_invariant``: each row's tokens then sum as in a
    one-token step of that row alone (greedy rows equal their prompts decoded alone, bit for bit); otherwise torch
    ops, faster at many rows. What the exact mode costs at each level: benchmarks/bench_concurrency.py."""
    return kernels and (concurrency == 1 or batch_invariant)


def level_proposal(cfg: BenchOnlineConfig, draft: Any) -> tuple[str, str | None]:
    """The levels' ``proposal`` for this draft and, where it differs from ``bench_online.proposal``, why: a draft
    without a confidence head (dflash) has nothing to schedule by and verifies fixed blocks."""
    if cfg.proposal == "confidence" and getattr(draft, "confidence", None) is None:
        kind = getattr(getattr(draft, "cfg", None), "kind", type(draft).__name__)
        return "fixed", (f"bench_online.proposal: confidence, but draft.kind {kind!r} has no confidence head "
                         "(draft.confidence_head: false): its levels verify fixed blocks")
    return cfg.proposal, None


def level_engines(runner: TargetRunner, draft: Any, cfg: BenchOnlineConfig, proposal: str) -> tuple[Any, Any]:
    """The speculative engine and the AR engine (``draft=None``) of one level, on the same request rows, their
    requests capped alike at the cache's end (one ``reserve``). An engine that refuses the setup: one line naming
    the params."""
    from dspark_core.decoding.static_engine import StaticSpeculativeDecoder

    reserve = 2 * (int(draft.block_size) + 1)
    try:
        spec = StaticSpeculativeDecoder(runner, draft, sampling=cfg.sampling, seed=cfg.seed,
                                        confidence_threshold=cfg.confidence_threshold,
                                        tree_branches=cfg.tree_branches, proposal=proposal,
                                        verify_budget=cfg.verify_budget, min_gain=cfg.min_gain, reserve=reserve,
                                        time_every=TIME_EVERY)
        ar = StaticSpeculativeDecoder(runner, None, sampling=cfg.sampling, seed=cfg.seed, reserve=reserve)
    except ValueError as e:
        raise UserError(f"bench_online.concurrency {list(cfg.concurrency)} (level {runner.batch_size}): {e}") from None
    return spec, ar


def serve_waves(conversations: Sequence[Sequence[str]], tokenizer: Any, spec: Any, ar: Any, cfg: BenchOnlineConfig,
                stop_ids: Sequence[int], what: str) -> LevelRun:
    """Every conversation's turns (up to ``max_turns``) served in waves, speculative and AR: wave t holds the t-th
    turn of every conversation that has one, after the speculative answers of its earlier turns."""
    histories = [opening(turns, cfg) for turns in conversations]
    run = LevelRun()
    for t in range(cfg.max_turns):
        live = [i for i, turns in enumerate(conversations) if t < len(turns)]
        if not live:
            break
        prompts = []
        for i in live:
            histories[i].append({"role": "user", "content": conversations[i][t]})
            prompts.append(chat_ids(tokenizer, histories[i]))
        with max_len_named(cfg, f"turn {t} of {what}"):
            batch = spec.serve(prompts, cfg.max_new_tokens, stop_ids, strict=True)
            run.ar.append(ar.serve(prompts, cfg.max_new_tokens, stop_ids, strict=True))
        for i, res in zip(live, batch.results):
            histories[i].append({"role": "assistant", "content": tokenizer.decode(res.tokens, skip_special_tokens=True)})
        run.prompts += prompts
        run.spec.append(batch)
    return run


def _warm_up_level(prompt_sets, tokenizer, engines: Sequence[Any], cfg: BenchOnlineConfig, stops,
                   concurrency: int, cuda: bool) -> None:
    """Serve a few tokens first, so that graph capture, kernel tuning and the confidence schedule's cost
    measurement are not timed: on CUDA every row busy with the first dataset's first turns; on CPU (nothing to
    capture) one request on 16 tokens of a prompt."""
    name, convs = next(iter(prompt_sets.items()))
    prompts = [chat_ids(tokenizer, opening(c, cfg) + [{"role": "user", "content": c[0]}]) for c in convs]
    prompts = [prompts[i % len(prompts)] for i in range(concurrency)] if cuda else [prompts[0][:16]]
    with max_len_named(cfg, f"the warm-up at concurrency {concurrency} on dataset {name!r}"):
        for engine in engines:
            engine.serve(prompts, 8 if cuda else 2, stops, strict=True)


def serve_levels(model: torch.nn.Module, draft: Any, cfg: BenchOnlineConfig, prompt_sets, tokenizer: Any,
                 stops: Sequence[int], graphs: bool, kernels: bool) -> dict[int, dict[str, LevelRun]]:
    """Every dataset at every ``bench_online.concurrency`` level: a runner of that many request rows, the
    speculative and the AR engine on it (:func:`level_engines`); {level: {dataset: run}}."""
    from tqdm.auto import tqdm

    block, cuda = int(draft.block_size), next(model.parameters()).is_cuda
    proposal, _ = level_proposal(cfg, draft)
    out: dict[int, dict[str, LevelRun]] = {}
    bar = tqdm(total=len(cfg.concurrency) * len(prompt_sets), desc="concurrency", leave=False)
    for c in cfg.concurrency:
        runner = make_runner(model, cfg, draft.aux_layer_ids, block, graphs, level_kernels(kernels, c, cfg.batch_invariant),
                             batch_size=c)
        spec, ar = level_engines(runner, draft, cfg, proposal)
        _warm_up_level(prompt_sets, tokenizer, (spec, ar), cfg, stops, c, cuda)
        out[c] = {}
        for name, convs in prompt_sets.items():
            bar.set_postfix_str(f"c={c} {name}")
            out[c][name] = serve_waves(convs, tokenizer, spec, ar, cfg, stops, f"dataset {name!r} at concurrency {c}")
            bar.update()
        del spec, ar, runner
        if cuda:
            torch.cuda.empty_cache()
    bar.close()
    return out


def add_levels(metrics: dict[str, Any], levels: dict[int, dict[str, LevelRun]], runs: dict[str, DatasetRun],
               proposal: str, greedy: bool) -> None:
    """``metrics[name]["concurrency"][str(c)]`` per dataset and overall (:func:`summarize_level`). A prompt decoded
    alone: its AR output at concurrency 1 (the level-1 row's; without that level, the main run's)."""
    for name in [*runs, "overall"]:
        by_level = {c: sets[name] if name in sets else merge_runs(list(sets.values())) for c, sets in levels.items()}
        if 1 in by_level:
            one = by_level[1]
            alone = alone_tokens(one.prompts, [r.tokens for b in one.ar for r in b.results])
        else:
            main = runs[name] if name in runs else _merge(runs.values())
            alone = alone_tokens(main.prompts, [r.tokens for r in main.ar])
        metrics[name]["concurrency"] = {
            str(c): summarize_level(run, proposal, greedy, alone, ar_at_one_request(metrics[name]) if c == 1 else None)
            for c, run in by_level.items()}


def _warm_up(prompt_sets, tokenizer, spec: SpeculativeDecoder, ar: ARDecoder, stops,
             cfg: BenchOnlineConfig, new_tokens: tuple[int, int] = (8, 16), prompt_tokens: int | None = None) -> None:
    """One short generation of each kind first (``new_tokens``: AR, speculative), so CUDA graphs / lazy inits are
    not timed. On CPU there are no graphs to capture: one step of each on the prompt's first ``prompt_tokens``
    tokens is enough (a full prefill would only add untimed work)."""
    name, convs = next(iter(prompt_sets.items()))
    prompt = chat_ids(tokenizer, [{"role": "user", "content": convs[0][0]}])[:prompt_tokens]
    with max_len_named(cfg, f"the warm-up on prompt 0 of dataset {name!r}"):
        ar.generate(prompt, new_tokens[0], stops)
        spec.generate(prompt, new_tokens[1], stops)


def _merge(runs) -> DatasetRun:
    return merge_runs(list(runs), DatasetRun())


def _assistant(cfg: BenchOnlineConfig, model: torch.nn.Module) -> torch.nn.Module:
    if cfg.assistant_dir:
        from dspark_core.target import load_target

        first = next(model.parameters())
        return load_target(cfg.assistant_dir, dtype=first.dtype, device=first.device)[0]
    return truncated_assistant(model, cfg.assistant_layers)
