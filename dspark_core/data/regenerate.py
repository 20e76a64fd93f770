"""The ``regenerate`` stage: the target answers every prompt; responses become the training data.

For each split in ``splits`` it reads ``{prompts_dir}/{split}.parquet``, renders ``turns[0]``
(after an optional system prompt) with the target's chat template, generates with the chosen
backend (``hf`` / ``vllm`` / ``openai``) and the sampling params, and writes
``{out_dir}/{split}.parquet`` with columns

    id, source, prompt_ids list<int32>, response_ids list<int32>, prompt_text, response_text,
    backend, finish_reason

``response_ids`` end with an EOS id when the model stopped (``finish_reason == 'stop'``), or hold
exactly ``max_new_tokens`` ids ('length'). ``response_text`` is ``response_ids`` decoded without
special tokens; ``prompt_text`` is the chat-templated prompt.

Resumable: each finished batch is written atomically as a small parquet under
``{out_dir}/parts/{split}/``; a restarted run skips the prompts answered there (parts written under other
settings -- another target, sampling params, system prompt, backend, dtype -- are discarded). The final
parquet is assembled in prompt order at the end and the parts are removed; a final parquet written under the
same settings for the same prompts makes the split a no-op (so ``persist: true`` in dvc.yaml is safe).
``stats_path`` records tokens and tokens/s per split, and ``last_measured`` (new tokens and seconds of the run
that made the split's answers: this run's when it answered any, else the earlier stats file's for the same
answers), so a rerun that kept every answer still says how fast they were made (dvc.yaml keeps the file:
``persist: true``).

Another prompt set (a source added, ``n_train`` raised): the answers of the split's earlier final parquet
that were made under the same settings are kept (``kept_answers`` in the stats) and only the prompts without
one are answered. An answer is kept for a prompt with the same id *and* the same ``prompt_ids`` (a prompt
whose text or chat template changed is answered again). A final parquet of an older version of this stage
(no row key) is kept only for its own prompts; a run on those prompts, or :func:`mark_answers_reusable`,
marks it reusable (checked by its settings key).

Time budget (``run_regenerate(cfg, time_budget_s=...)``, ``stages/regenerate.py --time-budget-s``; off by
default): no new batch starts once that many seconds have passed since the stage started (the batch in
flight finishes; a split with no answered prompt yet still gets one batch). The batches, length-sorted
inside, then run in a seeded random order, so the answered prompts are a random subset of every split's
prompts rather than its longest ones. A split cut short writes its final parquet with the answered
prompts only (prompt order; ``skipped_prompts`` in the stats) and keeps its parts, so a rerun continues
with the rest.

The vLLM backend spawns worker processes: call :func:`run_regenerate` under
``if __name__ == "__main__":``.

Shape legend: B batch, L prompt tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

from dspark_core.config import Section, device_name, non_negative, one_of, positive, require, resolve_device
from dspark_core.data.backends import (BACKENDS, Backend, Generation, Request, SamplingSpec, finalize_response,
                                       request_seed)
from dspark_core.data.prompts import SPLITS, Prompt, read_prompts
from dspark_core.errors import UserError
from dspark_core.io import (atomic_path, parquet_schema, read_json, read_parquet, sha256_file, sha256_json,
                            write_json, write_parquet)

log = logging.getLogger(__name__)

PARTS_DIR = "parts"
META_FILE = "meta.json"
KEY_METADATA = b"dspark_regen_key"          # the settings and the prompts file: the split is done
ROW_KEY_METADATA = b"dspark_regen_row_key"  # the settings alone: each row answers its own prompt
COLUMNS = ("id", "source", "prompt_ids", "response_ids", "prompt_text", "response_text", "backend",
           "finish_reason")


@dataclasses.dataclass(frozen=True)
class RegenerateConfig(Section):
    """params section ``regenerate``."""

    backend: str = "hf"                  # hf | vllm | openai
    temperature: float = 0.7             # 0 = greedy
    top_p: float = 0.8
    top_k: int = 20                      # 0 = off
    max_new_tokens: int = 160
    batch_size: int = 16                 # prompts a batch (and a resumable part)
    seed: int = 0
    system_prompt: str | None = None     # null: the chat template's default
    dtype: str = "float32"               # compute dtype (hf and vllm)
    device: str = "auto"                 # hf backend: auto | cpu | cuda | cuda:N
    threads: int | None = None           # hf backend CPU threads (null: torch's default)
    vllm_gpu_memory_utilization: float = 0.25
    vllm_enforce_eager: bool = False     # skip vLLM's torch.compile warm-up
    openai_base_url: str = "http://127.0.0.1:8000/v1"
    openai_model: str | None = None      # null: the first model the server lists
    openai_api_key_env: str = "OPENAI_API_KEY"  # env var holding the key, if the server wants one
    openai_timeout_s: float = 600.0
    openai_send_token_ids: bool = True   # prompt as token ids (false: as chat-templated text)
    splits: tuple[str, ...] = SPLITS
    target_dir: str = "data/target"
    prompts_dir: str = "data/prompts"
    out_dir: str = "data/regen"
    stats_path: str = "reports/regenerate_stats.json"
    time_budget_s: float | None = None   # start no batch after this many seconds: a random subset is answered

    def validate(self) -> None:
        one_of("backend", self.backend, BACKENDS)
        device_name("device", self.device)
        if self.time_budget_s is not None:
            positive("time_budget_s", self.time_budget_s)
        non_negative("temperature", self.temperature)
        require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1]; got {self.top_p!r}")
        non_negative("top_k", self.top_k)
        positive("max_new_tokens", self.max_new_tokens)
        positive("batch_size", self.batch_size)
        require(0.0 < self.vllm_gpu_memory_utilization <= 1.0,
                f"vllm_gpu_memory_utilization must be in (0, 1]; got {self.vllm_gpu_memory_utilization!r}")
        positive("openai_timeout_s", self.openai_timeout_s)
        if self.threads is not None:
            positive("threads", self.threads)
        require(len(self.splits) > 0, "splits must not be empty")
        for s in self.splits:
            one_of("splits[]", s, SPLITS)
        from dspark_core.target import resolve_dtype

        resolve_dtype(self.dtype)

    @property
    def sampling(self) -> SamplingSpec:
        return SamplingSpec(self.temperature, self.top_p, self.top_k, self.max_new_tokens)


# ----------------------------------------------------------------------------------------------
# prompts -> requests
# ----------------------------------------------------------------------------------------------
def eos_token_ids(tok, target_dir: str | Path) -> list[int]:
    """The tokenizer's EOS first, then any other EOS of ``generation_config.json`` (order kept)."""
    ids: list[int] = []
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    gc = Path(target_dir) / "generation_config.json"
    extra = read_json(gc).get("eos_token_id") if gc.is_file() else None
    for e in extra if isinstance(extra, list) else [extra]:
        if e is not None and int(e) not in ids:
            ids.append(int(e))
    if not ids:
        raise UserError(f"{target_dir}: the target defines no EOS token (tokenizer or generation_config.json)")
    return ids


def chat_prompt(tok, user_turn: str, system_prompt: str | None = None) -> tuple[str, list[int]]:
    """``(text, ids)`` of one user turn rendered with the chat template, ready for the answer."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
    messages.append({"role": "user", "content": user_turn})
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, list(tok(text, add_special_tokens=False)["input_ids"])


def build_requests(prompts: Sequence[Prompt], tok, system_prompt: str | None, seed: int) -> list[Request]:
    out = []
    for p in prompts:
        text, ids = chat_prompt(tok, p.turns[0], system_prompt)
        out.append(Request(p.id, tuple(ids), text, request_seed(seed, p.id)))
    return out


def check_lengths(requests: Sequence[Request], max_new_tokens: int, max_positions: int | None, where: str) -> None:
    """Every prompt plus its answer must fit the model's positions."""
    if max_positions is None:
        return
    for r in requests:
        if len(r.prompt_ids) + max_new_tokens > max_positions:
            raise UserError(f"{where}: prompt id={r.id!r} has {len(r.prompt_ids)} tokens; with max_new_tokens="
                            f"{max_new_tokens} it exceeds the target's {max_positions} positions "
                            f"(lower prepare.max_prompt_chars or regenerate.max_new_tokens)")


# ----------------------------------------------------------------------------------------------
# parquet rows and resumable parts
# ----------------------------------------------------------------------------------------------
def _schema():
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("source", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                      ("response_ids", pa.list_(pa.int32())), ("prompt_text", pa.string()),
                      ("response_text", pa.string()), ("backend", pa.string()), ("finish_reason", pa.string())])


def _write_rows(path: Path, rows: list[dict], key: str | None = None, row_key: str | None = None) -> None:
    import pyarrow as pa

    meta = {k: v.encode() for k, v in ((KEY_METADATA, key), (ROW_KEY_METADATA, row_key)) if v}
    schema = _schema().with_metadata(meta) if meta else _schema()
    table = pa.Table.from_pylist(rows, schema=schema)
    with atomic_path(path, ".parquet") as tmp:
        write_parquet(table, tmp)


PART_FIX = "delete the file and rerun the regenerate stage (it answers those prompts again)"


def _read_rows(path: Path) -> list[dict]:
    return read_parquet(path, fix=PART_FIX).to_pylist()


def _file_key(path: Path, name: bytes = KEY_METADATA) -> str | None:
    meta = parquet_schema(path, fix=PART_FIX).metadata or {}
    return meta.get(name, b"").decode() or None


def _answered(rows: list[dict], requests: Sequence[Request]) -> dict[str, dict]:
    """{id: row} of the rows that answer one of ``requests``: the same id and the same prompt ids (the first
    such row of an id wins)."""
    want = {r.id: list(r.prompt_ids) for r in requests}
    out: dict[str, dict] = {}
    for row in rows:
        rid = row["id"]
        if rid in want and rid not in out and list(row["prompt_ids"]) == want[rid]:
            out[rid] = row
    return out


class PartStore:
    """Finished batches of one split, one atomically written parquet each, tied to a settings key (the row key:
    parts stay valid when the prompt set changes; the rows are matched to the prompts when read)."""

    def __init__(self, root: Path, key: str):
        self.root, self.key = root, key
        meta = root / META_FILE
        if root.exists() and (not meta.is_file() or read_json(meta).get("key") != key):
            log.warning("%s: parts were written under other settings; discarding them", root)
            shutil.rmtree(root)
        if not root.exists():
            write_json(meta, {"key": key})

    def _files(self) -> list[Path]:
        return sorted(self.root.glob("part-*.parquet"))

    def rows(self) -> list[dict]:
        return [row for f in self._files() for row in _read_rows(f)]

    def write(self, rows: list[dict]) -> None:
        files = self._files()
        n = int(files[-1].stem.split("-")[1]) + 1 if files else 0
        _write_rows(self.root / f"part-{n:05d}.parquet", rows)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _row(req: Request, source: str, gen: Generation, backend: str, tok) -> dict:
    return {"id": req.id, "source": source, "prompt_ids": list(req.prompt_ids),
            "response_ids": gen.response_ids, "prompt_text": req.prompt_text,
            "response_text": tok.decode(gen.response_ids, skip_special_tokens=True),
            "backend": backend, "finish_reason": gen.finish_reason}


# ----------------------------------------------------------------------------------------------
# backends
# ----------------------------------------------------------------------------------------------
def make_backend(cfg: RegenerateConfig, tok, eos_ids: Sequence[int], max_model_len: int) -> Backend:
    """Build the backend named by ``cfg.backend`` (vLLM: call under a ``__main__`` guard)."""
    if cfg.backend == "hf":
        from dspark_core.data.backends.hf_backend import HFBackend

        return HFBackend(cfg.target_dir, cfg.sampling, eos_ids, dtype=cfg.dtype, device=str(resolve_device(cfg.device, "regenerate.device")),
                         threads=cfg.threads)
    if cfg.backend == "vllm":
        from dspark_core.data.backends.vllm_backend import VLLMBackend

        return VLLMBackend(cfg.target_dir, cfg.sampling, dtype=cfg.dtype, seed=cfg.seed,
                           gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, max_model_len=max_model_len,
                           enforce_eager=cfg.vllm_enforce_eager)
    from dspark_core.data.backends.openai_backend import OpenAIBackend

    return OpenAIBackend(cfg.openai_base_url, cfg.openai_model, cfg.sampling, tok,
                         api_key_env=cfg.openai_api_key_env, timeout_s=cfg.openai_timeout_s,
                         send_token_ids=cfg.openai_send_token_ids, concurrency=cfg.batch_size)


# ----------------------------------------------------------------------------------------------
# the stage
# ----------------------------------------------------------------------------------------------
def _settings(cfg: RegenerateConfig, fingerprint: str) -> dict:
    """What an answer depends on besides its prompt: target, template inputs, sampling, backend, dtype."""
    return {"target": fingerprint, "sampling": dataclasses.asdict(cfg.sampling), "seed": cfg.seed,
            "system_prompt": cfg.system_prompt, "backend": cfg.backend, "dtype": cfg.dtype}


def _settings_key(cfg: RegenerateConfig, fingerprint: str, prompts_file: Path) -> str:
    """What makes a split's final file current: the settings and the prompts file."""
    return sha256_json({**_settings(cfg, fingerprint), "prompts": sha256_file(prompts_file)})[:16]


def _row_key(cfg: RegenerateConfig, fingerprint: str) -> str:
    """What makes one answer valid, whatever the other prompts are: the settings alone (the prompt itself is
    checked row by row, see :func:`_answered`)."""
    return sha256_json(_settings(cfg, fingerprint))[:16]


def generate_split(requests: Sequence[Request], sources: dict[str, str], store: PartStore,
                   get_backend: Callable[[], Backend], tok, eos_ids: Sequence[int], cfg: RegenerateConfig,
                   desc: str = "regenerate", deadline: float | None = None) -> dict:
    """Generate every request whose id is not in ``store`` yet, one part a batch. Returns counters.

    ``deadline`` (a ``time.perf_counter()`` value): start no batch after it, except a split's first when
    it has no answered prompt yet; the batches then run in a seeded random order (``stopped_early`` in the
    counters when some were left)."""
    from tqdm.auto import tqdm

    done = set(_answered(store.rows(), requests))
    todo = sorted((r for r in requests if r.id not in done), key=lambda r: -len(r.prompt_ids))
    stats = {"generated": 0, "new_tokens": 0, "seconds": 0.0, "stopped_early": False}
    if not todo:
        return stats
    batches = [todo[start:start + cfg.batch_size] for start in range(0, len(todo), cfg.batch_size)]
    if deadline is not None:
        random.Random(cfg.seed).shuffle(batches)
    backend = get_backend()
    with tqdm(total=len(requests), initial=len(requests) - len(todo), desc=desc, unit="prompt") as bar:
        for batch in batches:
            if deadline is not None and (stats["generated"] or done) and time.perf_counter() >= deadline:
                stats["stopped_early"] = True
                log.warning("regenerate: time budget reached; %d of %d prompts of %s left unanswered",
                            len(requests) - bar.n, len(requests), desc)
                break
            t0 = time.perf_counter()
            gens = backend.generate(batch)
            stats["seconds"] += time.perf_counter() - t0
            rows = []
            for req, g in zip(batch, gens):
                ids, reason = finalize_response(g.response_ids, g.finish_reason, eos_ids, cfg.max_new_tokens)
                rows.append(_row(req, sources[req.id], Generation(ids, reason), backend.name, tok))
                stats["new_tokens"] += len(ids)
            store.write(rows)
            stats["generated"] += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(stats['seconds'], 1e-9):.1f}", refresh=False)
    return stats


def assemble(requests: Sequence[Request], rows: list[dict], path: Path, key: str, row_key: str | None = None,
             allow_missing: bool = False) -> list[dict]:
    """Write the split's rows in prompt order to ``path`` (atomic); every request must have a row unless
    ``allow_missing`` (a run cut by its time budget: the answered ones, at least one)."""
    by_id = _answered(rows, requests)
    missing = [r.id for r in requests if r.id not in by_id]
    if missing and (not allow_missing or len(missing) == len(requests)):
        raise RuntimeError(f"{path}: {len(missing)} prompts have no generation (first: {missing[0]!r})")
    ordered = [by_id[r.id] for r in requests if r.id in by_id]
    _write_rows(path, ordered, key, row_key)
    return ordered


def keep_earlier_answers(final: Path, row_key: str, requests: Sequence[Request], store: PartStore) -> int:
    """The answers in an earlier final parquet of the split that were made under the same settings (its row key)
    and answer one of ``requests`` go into ``store`` as one part (those it has not already); returns how many."""
    if not final.is_file() or _file_key(final, ROW_KEY_METADATA) != row_key:
        return 0
    have = _answered(store.rows(), requests)
    rows = [row for rid, row in _answered(_read_rows(final), requests).items() if rid not in have]
    if rows:
        store.write(rows)
        log.info("regenerate: %d answers of %s kept for the new prompt set", len(rows), final)
    return len(rows)


def _final_is_current(path: Path, key: str, requests: Sequence[Request]) -> bool:
    if not path.is_file() or _file_key(path) != key:
        return False
    return read_parquet(path, ["id"], fix=PART_FIX).column("id").to_pylist() == [r.id for r in requests]


def _plans(cfg: RegenerateConfig):
    """(tokenizer, target fingerprint, {split: (requests, {id: source}, settings key)}) of the prompts files."""
    from transformers import AutoTokenizer

    from dspark_core.target import read_fingerprint, validate_hf_dir

    model_cfg = validate_hf_dir(cfg.target_dir)
    fingerprint = read_fingerprint(cfg.target_dir)["fingerprint"]
    tok = AutoTokenizer.from_pretrained(cfg.target_dir, local_files_only=True)
    plans = {}
    for split in cfg.splits:
        prompts_file = Path(cfg.prompts_dir) / f"{split}.parquet"
        prompts = read_prompts(prompts_file)
        if not prompts:
            raise UserError(f"{prompts_file}: no prompts")
        requests = build_requests(prompts, tok, cfg.system_prompt, cfg.seed)
        check_lengths(requests, cfg.max_new_tokens, model_cfg.get("max_position_embeddings"), str(prompts_file))
        plans[split] = (requests, {p.id: p.source for p in prompts}, _settings_key(cfg, fingerprint, prompts_file))
    return tok, fingerprint, plans


def mark_answers_reusable(cfg: RegenerateConfig) -> dict[str, str]:
    """Answers of an older version of this stage (a final parquet without a row key) for another prompt set: each
    split whose final parquet is current for the prompts in ``cfg.prompts_dir`` -- checked by its settings key --
    gets the row key, so that a run on a new prompt set keeps its answers. Answers nothing, loads no model, leaves
    a file that is not current as it is. Returns ``{split: what was found}``."""
    _, fingerprint, plans = _plans(cfg)
    row_key = _row_key(cfg, fingerprint)
    found = {}
    for split, (requests, _, key) in plans.items():
        final = Path(cfg.out_dir) / f"{split}.parquet"
        if not _final_is_current(final, key, requests):
            found[split] = "not current for these prompts: left as it is"
        elif _file_key(final, ROW_KEY_METADATA) == row_key:
            found[split] = "reusable already"
        else:
            _write_rows(final, _read_rows(final), key, row_key)
            found[split] = "marked reusable"
        log.info("regenerate: %s: %s", final, found[split])
    return found


def run_regenerate(cfg: RegenerateConfig, time_budget_s: float | None = None) -> dict:
    """The ``regenerate`` stage. Returns (and writes to ``stats_path``) per-split counters.

    ``time_budget_s``: start no batch after that many seconds from now (see the module docstring)."""
    time_budget_s = cfg.time_budget_s if time_budget_s is None else time_budget_s
    if time_budget_s is not None and not time_budget_s > 0:
        raise UserError(f"regenerate: time budget must be > 0 seconds; got {time_budget_s!r}")
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s

    tok, fingerprint, plans = _plans(cfg)
    eos_ids = eos_token_ids(tok, cfg.target_dir)
    out_dir = Path(cfg.out_dir)
    row_key = _row_key(cfg, fingerprint)

    longest = max(len(r.prompt_ids) for reqs, _, _ in plans.values() for r in reqs)
    backend: list[Backend] = []

    def get_backend() -> Backend:
        if not backend:
            backend.append(make_backend(cfg, tok, eos_ids, max_model_len=longest + cfg.max_new_tokens))
        return backend[0]

    earlier = _earlier_stats(cfg.stats_path)
    stats: dict = {"backend": cfg.backend, "target_fingerprint": fingerprint, "splits": {}}
    try:
        for split, (requests, sources, key) in plans.items():
            final = out_dir / f"{split}.parquet"
            if _final_is_current(final, key, requests):
                log.info("regenerate: %s is up to date", final)
                rows, counters = _read_rows(final), {"generated": 0, "new_tokens": 0, "seconds": 0.0, "kept": 0}
                if _file_key(final, ROW_KEY_METADATA) != row_key:  # an older stage's file, checked by its key:
                    _write_rows(final, rows, key, row_key)           # reusable for another prompt set now
            else:
                store = PartStore(out_dir / PARTS_DIR / split, row_key)
                kept = keep_earlier_answers(final, row_key, requests, store)
                counters = generate_split(requests, sources, store, get_backend, tok, eos_ids, cfg,
                                          desc=f"regenerate {split}", deadline=deadline)
                counters["kept"] = kept
                rows = assemble(requests, store.rows(), final, key, row_key,
                                allow_missing=counters["stopped_early"])
                if len(rows) == len(requests):
                    store.remove()
            stats["splits"][split] = split_stats = _split_stats(rows, counters, len(requests))
            measured = _last_measured(split_stats, (earlier.get("splits") or {}).get(split), earlier, stats)
            if measured:
                split_stats["last_measured"] = measured
    finally:
        for b in backend:
            b.close()
    _remove_if_empty(out_dir / PARTS_DIR)
    write_json(cfg.stats_path, stats)
    return stats


def _split_stats(rows: list[dict], counters: dict, num_requests: int | None = None) -> dict:
    secs = counters["seconds"]
    out = {
        "prompts": len(rows),
        "response_tokens": sum(len(r["response_ids"]) for r in rows),
        "finish_stop": sum(r["finish_reason"] == "stop" for r in rows),
        "finish_length": sum(r["finish_reason"] == "length" for r in rows),
        "generated_now": counters["generated"],
        "kept_answers": counters.get("kept", 0),  # from the split's earlier final file (another prompt set)
        "new_tokens_now": counters["new_tokens"],
        "generate_seconds": round(secs, 3),
        "tokens_per_s": round(counters["new_tokens"] / secs, 2) if secs > 0 else None,
    }
    if num_requests is not None and num_requests > len(rows):
        out["skipped_prompts"] = num_requests - len(rows)  # left by a time budget
    return out


def _earlier_stats(path: str | Path) -> dict:
    """The stats file an earlier run left ({} if none or unreadable: it only carries a throughput figure)."""
    try:
        doc = read_json(path)
    except (FileNotFoundError, UserError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _last_measured(now: dict, before: dict | None, earlier: dict, stats: dict) -> dict | None:
    """``{new_tokens, generate_seconds, tokens_per_s}`` of the run that made a split's answers: this run's when it
    generated any; else the earlier stats' split figure (its ``last_measured``, or its own generation) when that
    run had the same backend and target and ended with the same prompts and response tokens -- the same answers.
    None when nothing was ever measured for them."""
    if now["new_tokens_now"] and now["generate_seconds"]:
        return {"new_tokens": now["new_tokens_now"], "generate_seconds": now["generate_seconds"],
                "tokens_per_s": now["tokens_per_s"]}
    before = before if isinstance(before, dict) else {}
    same_run = all(earlier.get(k) == stats[k] for k in ("backend", "target_fingerprint"))
    same_answers = all(before.get(k) == now[k] for k in ("prompts", "response_tokens"))
    if not (same_run and same_answers):
        return None
    last = before.get("last_measured") or {"new_tokens": before.get("new_tokens_now"),
                                             "generate_seconds": before.get("generate_seconds"),
                                             "tokens_per_s": before.get("tokens_per_s")}
    tokens, seconds = last.get("new_tokens"), last.get("generate_seconds")
    if not (isinstance(tokens, int) and isinstance(seconds, (int, float)) and tokens > 0 and seconds > 0):
        return None
    return {"new_tokens": tokens, "generate_seconds": seconds, "tokens_per_s": last.get("tokens_per_s")}


def _remove_if_empty(path: Path) -> None:
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()


def read_regen(path: str | Path) -> list[dict]:
    """Rows of a regenerate parquet (dicts with the :data:`COLUMNS` keys)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: regenerate output not found (run the regenerate stage)")
    rows = _read_rows(path)
    if rows and set(COLUMNS) - set(rows[0]):
        raise UserError(f"{path}: missing columns {sorted(set(COLUMNS) - set(rows[0]))}")
    return rows


__all__ = ["RegenerateConfig", "run_regenerate", "mark_answers_reusable", "chat_prompt", "build_requests",
           "eos_token_ids", "make_backend", "generate_split", "PartStore", "read_regen", "COLUMNS"]
