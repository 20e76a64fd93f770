"""Your data through DVC, offline, on CPU, the first three stages only (a tiny random Qwen3 laid out in a hub cache
as the target, conversations with their own replies under data/sources/, `regenerate.backend: none`): what the
README tells a researcher to do with their data, through the DVC commands themselves.

- A data ablation is `dvc exp run -S 'prepare.train=jsonl:data/sources/<file>'` (or a list of `{source, weight}`):
  two experiments on the data, `dvc exp show` lists both with their `prepare.train`, and `dvc metrics diff` on
  the prepare stats moves.
- A file under data/sources/ is a dependency of prepare: changing it reruns prepare.
- A failed target, prepare or regenerate keeps its last good outputs (dvc.yaml's `persist`, the stages' atomic
  writes): after the fix, `dvc repro` finds them up to date and runs nothing.

This file reads the project's dvc.yaml and params.yaml on purpose (the pipeline under test), copied into a
temporary git + DVC repository."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dspark_core.profiles import apply_profile
from dspark_core.testing import save_hub_repo, save_tiny_target

pytestmark = [pytest.mark.slow,
              pytest.mark.workspace("the project's params.yaml: the pipeline under test")]
ROOT = Path(__file__).resolve().parent.parent
DVC = [sys.executable, "-m", "dvc"]
REPO_ID = "tiny-org/tiny-qwen3"
STAGES = ("target", "prepare", "regenerate")
OVERLAY = {
    "target": {"source": "hf_hub", "model": REPO_ID, "revision": "main"},
    "prepare": {"train": "jsonl:data/sources/one_turn.jsonl", "n_train": 6, "n_eval_per_domain": 2,
                "eval_sources": {"math_word": [], "competition_math": [], "code": [],
                                 "chat": ["jsonl:data/sources/held_out.jsonl"]}},
    "regenerate": {"backend": "none", "max_turns": 2},
}


def _conversations(prefix: str, n: int, turns: int) -> list[dict]:
    out = []
    for i in range(n):
        msgs = []
        for t in range(turns):
            msgs += [{"role": "user", "content": f"{prefix} question {i}.{t}?"},
                     {"role": "assistant", "content": f"{prefix} answer {i}.{t}."}]
        out.append({"id": f"{prefix}{i}", "messages": msgs})
    return out


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(cmd: list[str], cwd: Path, env: dict, ok: bool = True) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if ok and res.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    if not ok and not res.returncode:
        raise AssertionError(f"{' '.join(cmd)} did not fail:\n{res.stdout[-4000:]}")
    return res.stdout + res.stderr


def _ran(out: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", out)


def _outputs(repo: Path) -> dict[str, bytes]:
    """Every file the three stages wrote, by path."""
    roots = [repo / "data" / d for d in ("target", "prompts", "regen")]
    files = [f for r in roots for f in sorted(r.rglob("*")) if f.is_file()]
    files += [repo / "reports" / "prepare_stats.json", repo / "reports" / "regenerate_stats.json"]
    return {str(f.relative_to(repo)): f.read_bytes() for f in files}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A git + DVC repo of this project's pipeline with the overlay above, `dvc repro regenerate` done and
    committed."""
    tmp = tmp_path_factory.mktemp("yourdata_dvc")
    hub = tmp / "hub"
    save_hub_repo(hub, REPO_ID, save_tiny_target(tmp / "tiny_src", "qwen3"))
    repo = tmp / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "params.yaml", "stages", "dspark_core"):
        src = ROOT / name
        (shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir()
         else shutil.copy(src, repo / name))
    (tmp / "overlay").mkdir()
    (tmp / "overlay" / "yourdata.yaml").write_text(yaml.safe_dump(OVERLAY))
    apply_profile("yourdata", repo / "params.yaml", tmp / "overlay")
    sources = repo / "data" / "sources"
    _write_jsonl(sources / "one_turn.jsonl", _conversations("a", 10, 1))
    _write_jsonl(sources / "two_turns.jsonl", _conversations("b", 10, 2))
    _write_jsonl(sources / "held_out.jsonl", _conversations("e", 4, 1))
    (repo / "data" / "prompts_h200").mkdir()
    (repo / "data" / "prompts_h200" / "README.md").write_text("the h200 snapshot: not used here\n")
    (repo / ".gitignore").write_text("/data/target\n/data/prompts\n/data/regen\n")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DVC_NO_ANALYTICS="1",
               GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t",
               TQDM_DISABLE="1", PYTHONPATH=str(ROOT), COLUMNS="200")
    _run(["git", "init", "-q"], repo, env)
    _run(DVC + ["init", "-q"], repo, env)
    shutil.copy(ROOT / ".dvcignore", repo / ".dvcignore")
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "your data"], repo, env)
    assert set(_ran(_run(DVC + ["repro", "regenerate"], repo, env))) == set(STAGES)
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "repro"], repo, env)
    yield repo, env
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def clean(project):
    """The project as committed: workspace files and DVC outputs (each test starts from there)."""
    repo, env = project
    _run(["git", "reset", "-q", "--hard"], repo, env)
    _run(DVC + ["checkout", "-q", "--force", *STAGES], repo, env)
    return repo, env


def _edit_params(repo: Path, section: str, **values) -> None:
    doc = yaml.safe_load((repo / "params.yaml").read_text())
    doc[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def test_a_data_ablation_is_dvc_exp_run_set_param(clean):
    """Two experiments on the data, each one `-S prepare.train=...`: one file (a source name), then a mix of two
    files (a list of {source, weight}). `dvc exp show` lists both with their data; `dvc metrics diff` on the prepare
    stats moves (the second file's conversations have two turns)."""
    repo, env = clean
    mix = "[{source:'jsonl:data/sources/one_turn.jsonl',weight:1},{source:jsonl:data/sources/two_turns.jsonl,weight:2}]"
    ran = {name: _ran(_run(DVC + ["exp", "run", "-n", name, "-S", f"prepare.train={value}", "prepare"], repo, env))
           for name, value in (("one", "jsonl:data/sources/one_turn.jsonl"), ("mix", mix))}
    assert ran == {"one": [], "mix": ["prepare"]}   # `one` is the committed data: its outputs are there already
    rows = list(csv.DictReader(io.StringIO(_run(DVC + ["exp", "show", "--csv", "--drop", ".*", "--keep",
                                                       "Experiment|prepare.train"], repo, env))))
    got = {r["Experiment"]: r["prepare.train"] for r in rows if r["Experiment"]}
    assert got["one"] == "jsonl:data/sources/one_turn.jsonl"
    assert yaml.safe_load(got["mix"]) == [{"source": "jsonl:data/sources/one_turn.jsonl", "weight": 1},
                                          {"source": "jsonl:data/sources/two_turns.jsonl", "weight": 2}]
    diff = json.loads(_run(DVC + ["metrics", "diff", "one", "mix", "--targets", "reports/prepare_stats.json",
                                  "--json"], repo, env))["reports/prepare_stats.json"]
    assert diff["train.turns"] == {"old": 6, "new": 10, "diff": 4}
    assert diff["train.multi_turn"] == {"old": 0, "new": 4, "diff": 4}
    stats = json.loads((repo / "reports" / "prepare_stats.json").read_text())   # the workspace: the last one's
    assert stats["train"]["by_domain"] == {"chat/jsonl:data/sources/one_turn.jsonl": 2,
                                           "chat/jsonl:data/sources/two_turns.jsonl": 4}


def test_a_changed_data_file_reruns_prepare(clean):
    """data/sources/ is a dependency of prepare: a changed file reruns it (and a file elsewhere is named)."""
    repo, env = clean
    assert "up to date" in _run(DVC + ["status", "prepare"], repo, env)
    _write_jsonl(repo / "data/sources/one_turn.jsonl", _conversations("a", 10, 1) + _conversations("c", 2, 1))
    assert "data/sources" in _run(DVC + ["status", "prepare"], repo, env)
    assert _ran(_run(DVC + ["repro", "prepare"], repo, env)) == ["prepare"]
    _write_jsonl(repo / "elsewhere.jsonl", _conversations("x", 10, 1))
    _edit_params(repo, "prepare", train="jsonl:elsewhere.jsonl")
    out = _run(DVC + ["repro", "prepare"], repo, env)
    assert "prepare: jsonl:elsewhere.jsonl reads elsewhere.jsonl, which is no dependency of the prepare stage" in out


def _fails_then_resumes(repo: Path, env: dict, stage: str, error: str, restore) -> None:
    """`dvc repro <stage>` fails with ``error`` on one line and leaves every output as it was; after ``restore()``
    (the fix) `dvc repro` finds them up to date and runs nothing."""
    before = _outputs(repo)
    out = _run(DVC + ["repro", stage], repo, env, ok=False)
    assert re.search(rf"^error: {error}", out, re.M), out[-3000:]
    assert _outputs(repo) == before
    restore()
    assert _ran(_run(DVC + ["repro", "regenerate"], repo, env)) == []
    assert _outputs(repo) == before


def test_a_failed_prepare_keeps_its_prompts_and_stats(clean):
    repo, env = clean
    good = (repo / "data/sources/one_turn.jsonl").read_bytes()
    with (repo / "data/sources/one_turn.jsonl").open("a") as fh:
        fh.write(json.dumps({"messages": [{"role": "assistant", "content": "I start"}]}) + "\n")
    _fails_then_resumes(repo, env, "prepare", r"data/sources/one_turn.jsonl:11: messages\[0\] is an assistant turn",
                        lambda: (repo / "data/sources/one_turn.jsonl").write_bytes(good))


def test_a_failed_target_keeps_the_last_target(clean):
    repo, env = clean
    _edit_params(repo, "target", model="tiny-org/no-such-model")
    _fails_then_resumes(repo, env, "target", r"target.model: tiny-org/no-such-model \(revision main\) is not in the "
                        "hub cache", lambda: _run(["git", "checkout", "-q", "params.yaml"], repo, env))


def test_a_failed_regenerate_keeps_its_answers(clean):
    repo, env = clean
    _edit_params(repo, "regenerate", backend="openai", openai_base_url="http://127.0.0.1:9/v1", openai_timeout_s=5)
    _fails_then_resumes(repo, env, "regenerate", r"GET http://127.0.0.1:9/v1/models: .*Connection refused",
                        lambda: _run(["git", "checkout", "-q", "params.yaml"], repo, env))
