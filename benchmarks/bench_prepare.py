"""The ``prepare`` stage over a big chat source: records per second and peak memory against the source's size.

Generates a synthetic source of ShareGPT ``conversations`` and OpenAI ``messages`` records (mixed in one file:
from / value and role / content keys, system messages, 1-4 user turns with their replies, text-part contents in
the JSONL file, ~1% tool conversations, ~0.5% repeated first turns) as JSONL and as Parquet, at several sizes
(each a prefix of the largest), then runs the ``prepare`` stage on each in a process of its own:

- ``kept``: a fixed training set (``--n-train``) drawn from the records outside a 5% holdout, ``--n-eval`` eval
  prompts from the held-out 5% (``hf:``-style DeepSpec split): the memory should stay flat as the source grows;
- ``all``: ``n_train: null``, every usable record outside the holdout trained on: the memory follows the records
  kept.

``--formats hf`` reads the Parquet file as a local data set folder in the hub's layout (``hf:<folder>``, through
``datasets.load_dataset(..., streaming=True)``), the path a hub data set such as PerfectBlend takes.

Each run reports its seconds (the whole stage: read, draw, leak check, Parquet written), the source records read
per second (of wall time, and of the process's CPU time, which a shared machine disturbs less) and the
process's peak RSS. The machine's load average is recorded before and after (the machine may
be shared). Results: a table on stdout and JSON (``--out``, default ``reports/bench/prepare_cpu.json``)::

    python benchmarks/bench_prepare.py                              # 250k, 500k, 1M records; JSONL and Parquet
    python benchmarks/bench_prepare.py --sizes 20000 --formats jsonl --out /tmp/p.json   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "de", "va", "qu", "ber", "ton", "gal", "fre", "sy",
             "an", "el", "is", "or", "um", "ix", "zo", "pra", "ct", "ing", "tion", "al")
TOOL_SHARE = 0.01
REPEAT_SHARE = 0.005


def _vocabulary(rng: random.Random, n: int = 20000) -> list[str]:
    words = {"".join(rng.choice(SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))) for _ in range(n)}
    return sorted(words)


class RecordMaker:
    """Synthetic chat records, made in order from one seeded stream (so every size is a prefix of the largest).
    A text is a few fragments of a fixed pool (3-30 random words each): unique in practice, made fast."""

    def __init__(self, seed: int = 0, fragments: int = 100_000):
        rng = random.Random(seed)
        vocab = _vocabulary(rng)
        self.fragments = [" ".join(rng.choices(vocab, k=rng.randint(3, 30))) for _ in range(fragments)]
        self.rng = random.Random(seed + 1)
        self.recent: list[str] = []     # earlier first turns, to repeat a few

    def _text(self, parts: int) -> str:
        rng = self.rng
        return " ".join(rng.choices(self.fragments, k=parts)).capitalize() + rng.choice(("?", ".", "!", " please."))

    def record(self, i: int) -> dict:
        """Record ``i`` (the next one): ShareGPT or OpenAI, 1-4 user turns and their replies."""
        rng = self.rng
        n_turns = rng.choices((1, 2, 3, 4), weights=(50, 25, 15, 10))[0]
        users = [self._text(2) for _ in range(n_turns)]
        if self.recent and rng.random() < REPEAT_SHARE:   # a first turn seen before
            users[0] = rng.choice(self.recent)
        elif len(self.recent) < 1000:
            self.recent.append(users[0])
        replies = [self._text(rng.randint(2, 9)) for _ in range(n_turns)]
        system = self._text(1) if rng.random() < 0.2 else None
        tool = rng.random() < TOOL_SHARE
        parts = rng.random() < 0.2
        rec: dict = {} if rng.random() < 0.5 else {"id": f"c{i:08d}"}
        if rng.random() < 0.55:   # ShareGPT
            msgs = [{"from": "system", "value": system}] if system else []
            for u, r in zip(users, replies):
                msgs += [{"from": "human", "value": u}, {"from": "gpt", "value": r}]
            if tool:
                msgs.insert(2 if system else 1, {"from": "function_call", "value": "{\"name\": \"f\"}"})
            rec["conversations"] = msgs
        else:                     # OpenAI (text parts: JSONL only, a Parquet column holds one content type)
            msgs = [{"role": "system", "content": system}] if system else []
            for u, r in zip(users, replies):
                msgs += [{"role": "user", "content": [{"type": "text", "text": u}] if parts else u},
                         {"role": "assistant", "content": r}]
            if tool:
                msgs.append({"role": "tool", "content": "42"})
            rec["messages"] = msgs
        return rec


def _flat_content(msgs: list[dict] | None) -> list[dict] | None:
    if msgs is None:
        return None
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in msgs]


def write_sources(folder: Path, sizes: list[int], formats: list[str], seed: int = 0) -> dict[tuple[str, int], Path]:
    """The source files of every (format, size): each a prefix of one stream of records (Parquet: row groups of
    50,000 rows; its OpenAI contents as plain strings)."""
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    maker = RecordMaker(seed)
    out: dict[tuple[str, int], Path] = {}
    top = max(sizes)
    handles = {n: (folder / f"chat_{n}.jsonl").open("wb") for n in sizes} if "jsonl" in formats else {}
    writers: dict[int, pq.ParquetWriter] = {}
    schema = pa.schema([("id", pa.string()),
                        ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
                        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    rows: list[dict] = []
    for i in range(top):
        rec = maker.record(i)
        if "jsonl" in formats:
            line = orjson.dumps(rec) + b"\n"
            for n, fh in handles.items():
                if i < n:
                    fh.write(line)
        if "parquet" in formats or "hf" in formats:
            rows.append({"id": rec.get("id"), "conversations": rec.get("conversations"),
                         "messages": _flat_content(rec.get("messages"))})
            if len(rows) == 50_000 or i == top - 1:
                table = pa.Table.from_pylist(rows, schema=schema)
                start = i + 1 - len(rows)
                for n in sizes:
                    if start < n:
                        if n not in writers:
                            writers[n] = pq.ParquetWriter(folder / f"chat_{n}.parquet", schema)
                        writers[n].write_table(table.slice(0, n - start))
                rows = []
    for fh in handles.values():
        fh.close()
    for w in writers.values():
        w.close()
    for fmt in formats:
        for n in sizes:
            out[(fmt, n)] = folder / f"chat_{n}.{fmt}"
            if fmt == "hf":   # the Parquet file as a local data set folder in the hub's layout
                (folder / f"hf_{n}" / "data").mkdir(parents=True)
                (folder / f"hf_{n}" / "data" / "train-00000-of-00001.parquet").symlink_to(folder / f"chat_{n}.parquet")
                out[(fmt, n)] = folder / f"hf_{n}"
    return out


def kept_sources(folder: Path, sizes: list[int], formats: list[str]) -> dict[tuple[str, int], Path]:
    """:func:`write_sources` into ``folder``, unless it holds them already (its ``sources.json`` names these sizes
    and formats, or more)."""
    want = {"sizes": sizes, "formats": formats, "seed": 0}
    marker = folder / "sources.json"
    if marker.is_file():
        have = json.loads(marker.read_text())
        if have["seed"] == 0 and set(sizes) <= set(have["sizes"]) and set(formats) <= set(have["formats"]):
            return {(f, n): folder / (f"hf_{n}" if f == "hf" else f"chat_{n}.{f}") for f in formats for n in sizes}
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"{folder}: not empty and not a source folder of these sizes and formats")
    folder.mkdir(parents=True, exist_ok=True)
    files = write_sources(folder, sizes, formats)
    marker.write_text(json.dumps(want))
    return files


def prepare_params(source: str, mode: str, n_train: int, n_eval: int, out_dir: Path) -> dict:
    return {"train": [{"source": source, "weight": 1, "holdout": 0.05}], "eval_sources": {"chat": [source]},
            "n_train": None if mode == "all" else n_train, "n_eval_per_domain": n_eval, "max_prompt_chars": 1500,
            "seed": 0, "out_dir": str(out_dir)}


def run_one(params: dict) -> dict:
    """Run the stage in this process; return its seconds, peak RSS and stats."""
    from dspark_core.data.prompts import PrepareConfig, run_prepare

    cfg = PrepareConfig.from_dict(params)
    stats: dict = {}
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    run_prepare(cfg, stats)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    src = next(iter(stats["sources"].values()))
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "read": src["records"],
            "held_out": src["held_out"], "train": stats["train"]["prompts"], "eval": stats["eval"]["prompts"],
            "skipped": src["skipped"], "passes": src["passes"], "peak_rss_mib": round(after.ru_maxrss / 1024, 1)}


def _child(params: dict, tmp: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp / "hf_datasets_cache")}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(params)], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="250000,500000,1000000", help="source records, comma-separated")
    ap.add_argument("--formats", default="jsonl,parquet", help="jsonl, parquet, hf (the Parquet file as a local "
                                                                "data set folder read through datasets)")
    ap.add_argument("--modes", default="kept,all", help="kept (a fixed --n-train), all (n_train: null)")
    ap.add_argument("--n-train", type=int, default=20000)
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--sources", type=Path, default=None,
                    help="a folder to write the sources to and keep (reused when it holds these sizes and formats; "
                         "default: a temp dir, removed)")
    ap.add_argument("--out", type=Path, default=REPO / "reports/bench/prepare_cpu.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(run_one(json.loads(args.child))))
        return
    sizes = sorted(int(s) for s in args.sizes.split(","))
    formats = args.formats.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        src_dir = args.sources or tmp_path / "sources"
        t0 = time.perf_counter()
        files = kept_sources(src_dir, sizes, formats)
        gen_s = time.perf_counter() - t0
        load_before = os.getloadavg()
        rows = []
        print(f"sources written in {gen_s:.0f} s; load average {load_before[0]:.2f}")
        print(f"{'format':8} {'records':>9} {'mode':5} {'train':>8} {'eval':>5} {'seconds':>8} {'records/s':>10} "
              f"{'records/cpu-s':>13} {'peak RSS MiB':>12}")
        for fmt in formats:
            for n in sizes:
                for mode in args.modes.split(","):
                    source = f"{fmt}:{files[(fmt, n)]}"
                    res = _child(prepare_params(source, mode, args.n_train, args.n_eval, tmp_path / "out"), tmp_path)
                    size = src_dir / f"chat_{n}.{'parquet' if fmt == 'hf' else fmt}"
                    row = {"format": fmt, "source_records": n, "source_mib": round(size.stat().st_size / 2**20, 1),
                           "mode": mode, **res, "records_per_s": round(res["read"] / res["seconds"]),
                           "records_per_cpu_s": round(res["read"] / res["cpu_seconds"])}
                    rows.append(row)
                    print(f"{fmt:8} {n:>9} {mode:5} {res['train']:>8} {res['eval']:>5} {res['seconds']:>8.1f} "
                          f"{row['records_per_s']:>10} {row['records_per_cpu_s']:>13} {res['peak_rss_mib']:>12.0f}",
                          flush=True)
        load_after = os.getloadavg()
    report = {"command": "python " + " ".join([Path(sys.argv[0]).relative_to(REPO).as_posix()
                                                if Path(sys.argv[0]).is_absolute() else sys.argv[0],
                                                *sys.argv[1:]]),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                          "load_average_before": [round(x, 2) for x in load_before],
                          "load_average_after": [round(x, 2) for x in load_after]},
              "n_train": args.n_train, "n_eval": args.n_eval, "holdout": 0.05, "generate_seconds": round(gen_s, 1),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
