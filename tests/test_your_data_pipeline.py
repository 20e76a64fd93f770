"""A researcher's own target and data through DVC, offline, on CPU: a tiny random Qwen3 laid out as a hub repository
in a hub cache (`target.source: hf_hub`), a ShareGPT file and an OpenAI-messages file of two-turn conversations
(system messages too), through `dvc repro` of prepare -> regenerate (both turns answered) -> cache -> train ->
eval_offline -> bench_online (two turns decoded); then the same project switched to `train.hidden_states: online`
and `eval_offline.hidden_states: online` with `dvc exp run`, which trains the same draft bit for bit (CPU, float32)
from a token-only store.

What it checks: data/target holds no weights; every conversation's loss spans are its two answers (or its first,
cut at max_new_tokens, which ends it) and the cache's loss mask is exactly them; eval_offline ran and bench_online decoded both turns of a conversation; the
online run's store has no hidden states, and its draft weights and offline metrics equal the cache run's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from dspark_core.profiles import apply_profile
from dspark_core.testing import save_hub_repo, save_tiny_target

pytestmark = [pytest.mark.slow,  # a whole DAG through DVC
              pytest.mark.workspace("the project's params.yaml: the pipeline under test")]
ROOT = Path(__file__).resolve().parent.parent
DVC = [sys.executable, "-m", "dvc"]
REPO_ID = "tiny-org/tiny-qwen3"

TOPICS = ["rivers", "bread", "chess", "tides", "maps", "owls", "glass", "kites", "bees", "clocks", "ferns", "salt"]


def _sharegpt(i: int, topic: str) -> dict:
    conv = [{"from": "human", "value": f"Tell me one short fact about {topic}."},
            {"from": "gpt", "value": f"Here is a fact about {topic}."},
            {"from": "human", "value": f"Now say why {topic} matter, in a few words."},
            {"from": "gpt", "value": "Because they do."}]
    if i % 2:
        conv.insert(0, {"from": "system", "value": "You answer briefly."})
    return {"id": f"sg{i}", "conversations": conv}


def _openai(i: int, topic: str) -> dict:
    msgs = [{"role": "user", "content": f"Write a line of verse about {topic}."},
            {"role": "assistant", "content": f"A line about {topic}."},
            {"role": "user", "content": [{"type": "text", "text": f"And a second line about {topic}, please."}]}]
    if i % 3 == 0:
        msgs.insert(0, {"role": "system", "content": "You are a poet."})
    return {"id": f"oa{i}", "messages": msgs}


def _stopping_target(path: Path) -> Path:
    """A tiny random target that ends its answers: its EOS row of the LM head 1.5x the row of the token its greedy
    answers to the data's first turns hold most from their fourth token on, so answers of a few tokens stop and
    others run to max_new_tokens (the conversation then ends there)."""
    import torch

    from dspark_core.target import load_target
    from _regen_utils import greedy

    save_tiny_target(path, "qwen3")
    model, tok = load_target(path)
    later: dict[int, int] = {}
    for first in [f"Tell me one short fact about {t}." for t in TOPICS] + [f"Write a line of verse about {t}."
                                                                           for t in TOPICS]:
        text = tok.apply_chat_template([{"role": "user", "content": first}], add_generation_prompt=True,
                                       tokenize=False)
        for t in greedy(model, tok(text, add_special_tokens=False)["input_ids"], 12, -1)[3:]:
            later[t] = later.get(t, 0) + 1
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 1.5 * model.lm_head.weight[max(later, key=later.get)]
    model.save_pretrained(path)
    return path


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


OVERLAY = {
    "target": {"source": "hf_hub", "model": REPO_ID, "revision": "main"},
    "prepare": {"train": ["jsonl:data/sources/sharegpt.jsonl", "jsonl:data/sources/openai.jsonl"],
                "eval_sources": {"math_word": [], "competition_math": [], "code": [],
                                 "chat": ["jsonl:data/sources/openai.jsonl"]},
                "n_train": 8, "n_eval_per_domain": 2},
    "regenerate": {"max_new_tokens": 12, "max_turns": 2, "batch_size": 4},
    "cache": {"aux_layer_ids": [1, 3], "max_length": 256},
    "draft": {"mask_token_id": 259, "num_anchors": 4},   # the tiny tokenizer's <|mask|>
    "draft_vocab": {"report_sizes": [64, 128]},
    "variants": {"baseline": {}},
    "variant_dag": {"scratch": ["baseline"], "warm": {}},
    "bench_online": {"datasets": ["chat"], "max_prompts": 1, "max_new_tokens": 8, "max_turns": 2, "peers": [],
                     "max_len": 512},
}


def _env(hub: Path) -> dict:
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DVC_NO_ANALYTICS="1",
                GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t",
                TQDM_DISABLE="1", PYTHONPATH=str(ROOT))


def _run(cmd: list[str], cwd: Path, env: dict) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)
    if res.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return res.stdout + res.stderr


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A git + DVC project holding this repo's pipeline, the smoke profile, the overlay above and the two files; the
    tiny target only in a hub cache outside it."""
    tmp = tmp_path_factory.mktemp("yourdata")
    hub = tmp / "hub"
    save_hub_repo(hub, REPO_ID, _stopping_target(tmp / "tiny_src"))
    repo = tmp / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "params.yaml", "stages", "dspark_core", "profiles"):
        src = ROOT / name
        (shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir()
         else shutil.copy(src, repo / name))
    apply_profile("smoke", repo / "params.yaml")
    overlay = tmp / "overlay"
    overlay.mkdir()
    (overlay / "yourdata.yaml").write_text(yaml.safe_dump(OVERLAY))
    apply_profile("yourdata", repo / "params.yaml", overlay)
    _write_jsonl(repo / "data/sources/sharegpt.jsonl", [_sharegpt(i, t) for i, t in enumerate(TOPICS)])
    _write_jsonl(repo / "data/sources/openai.jsonl", [_openai(i, t) for i, t in enumerate(TOPICS)])
    (repo / "data" / "prompts_h200").mkdir()   # the h200 snapshot, a dependency of prepare: not used here
    (repo / "data" / "prompts_h200" / "README.md").write_text("not used here\n")
    (repo / ".gitignore").write_text("/data/\n/dvc_plots/\n")
    env = _env(hub)
    _run(["git", "init", "-q"], repo, env)
    _run(DVC + ["init", "-q"], repo, env)
    shutil.copy(ROOT / ".dvcignore", repo / ".dvcignore")
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "your data"], repo, env)
    out = _run(DVC + ["repro", "eval_offline@baseline", "bench_online@baseline"], repo, env)
    yield repo, env, out
    shutil.rmtree(tmp, ignore_errors=True)


def _spans(row: dict) -> list[tuple[int, int]]:
    return list(zip(row["span_starts"], row["span_ends"]))


def test_hub_target_keeps_its_weights_out_of_the_project(project):
    repo, _, out = project
    assert {"target", "prepare", "regenerate", "cache", "train@baseline", "eval_offline@baseline",
            "bench_online@baseline"} <= set(_ran(out))
    assert not list((repo / "data/target").glob("*.safetensors"))
    info = json.loads((repo / "data/target/target_info.json").read_text())
    assert info["source"] == "hf_hub" and info["model"] == REPO_ID and len(info["commit"]) == 40
    assert json.loads((repo / "data/target/fingerprint.json").read_text())["commit"] == info["commit"]


def test_two_turn_conversations_train_on_both_answers(project):
    import pyarrow.parquet as pq
    import zarr

    repo, _, _ = project
    prompts = pq.read_table(repo / "data/prompts/train.parquet").to_pylist()
    assert len(prompts) == 8 and {p["source"] for p in prompts} == {"jsonl:data/sources/sharegpt.jsonl",
                                                                     "jsonl:data/sources/openai.jsonl"}
    assert all(len(p["turns"]) == 2 and len(p["replies"]) >= 1 for p in prompts)
    assert any(p["system"] for p in prompts) and any(p["system"] is None for p in prompts)
    rows = pq.read_table(repo / "data/regen/train.parquet").to_pylist()
    two = [r for r in rows if r["num_turns"] == 2]
    assert len(two) >= 4 and all(r["finish_reasons"] == ["length"] for r in rows if r["num_turns"] != 2)
    stats = json.loads((repo / "reports/regenerate_stats.json").read_text())["splits"]["train"]
    assert stats["turns_dropped"] == len(rows) - len(two)   # a cut first answer ends its conversation
    for r in two:
        spans = _spans(r)
        n = len(r["prompt_ids"]) + len(r["response_ids"])
        assert len(spans) == 2 and spans[0][0] == len(r["prompt_ids"]) and spans[0][1] < spans[1][0] <= n
        assert spans[1][1] == n  # the last answer ends the sample (its EOS included when it stopped)
    store = zarr.open_group(str(repo / "data/cache/train.zarr"), mode="r")
    offsets, order = np.asarray(store["offsets"][:]), np.asarray(store["source_index"][:])
    ids, mask = np.asarray(store["input_ids"][:]), np.asarray(store["loss_mask"][:])
    made: dict[int, list[tuple[list[int], list[int]]]] = {}   # {row: [(tokens, loss mask)]}, shortest first
    for n in sorted(range(len(order)), key=lambda n: offsets[n + 1] - offsets[n]):
        made.setdefault(int(order[n]), []).append((ids[offsets[n]:offsets[n + 1]].tolist(),
                                                   mask[offsets[n]:offsets[n + 1]].tolist()))
    for row, r in enumerate(rows):
        seq = r["prompt_ids"] + r["response_ids"]
        spans = _spans(r)
        if len(made[row]) == 2:   # the history does not hold answer 1 as generated: it ends a sample of its own
            own = seq[:r["turn_prefix"][0]] + r["turn_tails"][0]
            a, b = r["turn_span_starts"][0], r["turn_span_ends"][0]
            assert made[row][0] == (own, [int(a <= i < b) for i in range(len(own))])
            spans = spans[1:]
        assert made[row][-1] == (seq, [int(any(a <= i < b for a, b in spans)) for i in range(len(seq))])
    assert "aux_hidden" in store.array_keys()


def test_eval_and_two_turn_decoding_ran(project):
    repo, _, _ = project
    off = json.loads((repo / "reports/eval_offline/baseline.json").read_text())
    assert 1.0 <= off["tau_prob"] <= 7.0
    on = json.loads((repo / "reports/bench_online/baseline.json").read_text())["overall"]
    assert on["num_generations"] == 2 and on["new_tokens"] > 0  # one conversation, both turns decoded
    # (greedy output equal to AR with draft tokens accepted is the decoding tests' claim: this 2-step draft of a
    # random target accepts next to nothing, so an equality here would say little)


def test_online_hidden_states_train_the_same_draft(project):
    """The switch to online, its stores with hidden states deleted first (as a user freeing their disk does; kept,
    online would read their tokens): the cache stage writes token-only stores, train and eval_offline run the
    target themselves; the weights and the offline metrics equal the cache run's (the run starts afresh: its
    outputs are removed first, so nothing is resumed)."""
    repo, env, _ = project
    weights = repo / "data/train/baseline/final/model.safetensors"
    before = weights.read_bytes()
    metrics_before = json.loads((repo / "reports/eval_offline/baseline.json").read_text())
    shutil.rmtree(repo / "data/train/baseline")
    for split in ("train", "eval"):
        shutil.rmtree(repo / "data/cache_stores" / f"{split}.zarr")
    out = _run(DVC + ["exp", "run", "-n", "online", "-S", "train.hidden_states=online", "-S",
                      "eval_offline.hidden_states=online", "eval_offline@baseline"], repo, env)
    assert {"cache", "train@baseline", "eval_offline@baseline"} <= set(_ran(out))
    import zarr

    store = zarr.open_group(str(repo / "data/cache/train.zarr"), mode="r")
    assert "aux_hidden" not in store.array_keys() and "last_hidden" not in store.array_keys()
    assert weights.read_bytes() == before
    after = json.loads((repo / "reports/eval_offline/baseline.json").read_text())
    for key in ("tau_prob", "accept_rate@0", "ce"):
        assert after[key] == metrics_before[key], key


def _ran(out: str) -> list[str]:
    import re

    return re.findall(r"Running stage '([^']+)'", out)
