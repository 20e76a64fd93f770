"""Training on several hosts (``train.nnodes``), on CPU: two torchrun "nodes" on localhost (gloo, one process each,
torchrun's static rendezvous on a free 127.0.0.1 port), each started by the test in its own project folder with its
own copy of the inputs (target, cache), so nothing is shared on disk; driven by the DVC commands of docs/DESIGN.md
"Several processes" (node 0 `dvc repro train@baseline`, node 1 the same stage forced, alone, recording nothing).

- 2 nodes x 1 process train the weights of 1 node x 2 processes, and of 1 process accumulating 2 micro-batches, bit
  for bit;
- node 0 writes every output and records them in its dvc.lock, node 1 writes nothing (its folder holds a damaged
  checkpoint, which any read would refuse);
- killed after a checkpoint and restarted with the same commands, they end with the uninterrupted run's weights
  and curves, node 1 never having read a checkpoint;
- nodes whose params differ both refuse the run; rank 0's results and errors reach every rank (``on_main``,
  ``broadcast_tree``); a time-scheduled run resumes on 2 processes in folders of their own with rank 0's clock,
  optimiser and RNG states; each host's torchrun command.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dspark_core.cache import CacheConfig, build_store
from dspark_core.dist import Nodes, torchrun_command
from dspark_core.target import load_target, read_fingerprint
from dspark_core.testing import save_tiny_target, write_regen

REPO = Path(__file__).resolve().parents[1]
LAYERS = [1, 3]
LENGTHS = [(20, 30), (60, 40), (10, 20), (30, 35), (15, 20), (8, 14), (25, 25), (12, 30)]
CACHE = {"aux_layer_ids": LAYERS, "max_length": 96, "chunk_tokens": 256, "batch_tokens": 512, "device": "cpu"}
PARAMS: dict[str, Any] = {
    "draft": {"num_draft_layers": 1, "block_size": 4, "mask_token_id": 259, "num_anchors": 4, "markov_rank": 8},
    "loss": {},
    # 6 steps of 2 samples (one a process), checkpoints at 2, 4, 6
    "train": {"lr": 3e-3, "warmup_ratio": 0.0, "total_steps": 6, "micro_batch_size": 1, "global_batch_size": 2,
              "checkpoint_every": 2, "keep_checkpoints": 1, "log_every": 1, "precision": "fp32", "seed": 5},
    "variants": {"baseline": {}},
}
FINAL = Path("data/train/baseline/final/model.safetensors")
CKPTS = Path("data/train/baseline/checkpoints")
NODE_ENV = ("NODE_RANK", "PET_NODE_RANK", "SLURM_NODEID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A tiny target and its train cache, laid out as the DAG leaves them (``data/target``, ``data/cache``)."""
    root = tmp_path_factory.mktemp("inputs")
    target = save_tiny_target(root / "data" / "target", "qwen3")
    regen = write_regen(root / "regen" / "train.parquet", LENGTHS)
    model, _ = load_target(target)
    build_store(model, read_fingerprint(target)["fingerprint"], CacheConfig.from_dict(CACHE), regen,
                root / "data" / "cache" / "train.zarr")
    return root


def _project(root: Path, inputs: Path, **train: Any) -> Path:
    """A project folder of its own: a copy of the inputs and params.yaml (PARAMS, ``train`` merged in)."""
    import shutil

    shutil.copytree(inputs / "data", root / "data")
    params = {**PARAMS, "train": {**PARAMS["train"], **train}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(node_rank: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NODE_ENV}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", DVC_NO_ANALYTICS="1")
    if node_rank is not None:
        env["NODE_RANK"] = str(node_rank)  # what a cluster sets; params.yaml is the same on both nodes
    return env


def _start(cwd: Path, argv: list[str], node_rank: int | None = None) -> subprocess.Popen:
    """``python ARGV`` in ``cwd``, its output to ``<cwd>.out`` beside it (no pipe to fill)."""
    with (cwd.parent / f"{cwd.name}.out").open("w") as out:
        proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, env=_env(node_rank), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    proc.out = cwd.parent / f"{cwd.name}.out"  # type: ignore[attr-defined]
    return proc


def _finish(procs: list[subprocess.Popen]) -> None:
    """Wait for ``procs``; each must succeed."""
    for i, (p, out) in enumerate(zip(procs, _wait(procs))):
        assert p.returncode == 0, f"process {i} failed ({p.returncode}):\n{out[-4000:]}"


def _wait(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """The output of each of ``procs`` once it has ended; past ``timeout`` every process of theirs is killed."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        outs = _kill(procs)
    return outs


def _kill(procs: list[subprocess.Popen]) -> list[str]:
    """SIGKILL to every process of ``procs`` still running and their descendants (torchrun starts its workers in
    sessions of their own); their outputs."""
    for pid in [pid for p in procs if p.poll() is None for pid in _process_tree(p.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()
    return [p.out.read_text() for p in procs]


STAGE = [str(REPO / "stages" / "train.py"), "--variant", "baseline"]  # dvc.yaml's command


# docs/DESIGN.md "Several processes": node 0 runs the stage as usual; the others run it whatever DVC thinks of it
# (--force, as node 0 does), alone (--single-item), and record nothing (--allow-missing: the outputs are node 0's)
REPRO = {0: ["-m", "dvc", "repro", "train@baseline"],
         1: ["-m", "dvc", "repro", "--single-item", "--force", "--allow-missing", "--no-commit", "train@baseline"]}


def _dvc_project(root: Path) -> Path:
    """``root`` as a DVC project whose dvc.yaml holds dvc.yaml's train stage for ``baseline`` (its command, params
    and outputs; deps: the inputs, as the other stages leave them)."""
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]
    do = stage["do"]
    do["cmd"] = do["cmd"].replace("python stages/", f"{sys.executable} {REPO}/stages/")
    do["deps"] = ["data/target", "data/cache/train.zarr"]
    do["params"] = [p for p in do["params"] if p != "variant_dag"]
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {**stage, "foreach": ["baseline"]}}}))
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, env=_env(), check=True)
    return root


def _repro_two_nodes(node0: Path, node1: Path) -> None:
    """The DVC commands of the protocol on both nodes at once."""
    _finish([_start(node0, REPRO[0], node_rank=0), _start(node1, REPRO[1], node_rank=1)])


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` but DVC's own records (``.dvc/``, ``dvc.lock``): size and mtime."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file() and p.parts[len(root.parts)] != ".dvc" and p.name != "dvc.lock"}


def _weights(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(root / FINAL))


def _decoy(node: Path) -> None:
    """A damaged checkpoint where node 1 would find one if it read its own disk: any read refuses it."""
    _decoy_at(node / CKPTS)


def _decoy_at(ckpt_root: Path) -> None:
    ckpt_root.mkdir(parents=True)
    (ckpt_root / "latest.json").write_text("{not json")


@pytest.fixture(scope="module")
def two_nodes(inputs, tmp_path_factory) -> tuple[Path, Path, dict[str, tuple[int, int]]]:
    """An uninterrupted run on 2 nodes x 1 process through DVC: node 0's and node 1's folders, and node 1's files
    before it."""
    root, port = tmp_path_factory.mktemp("two_nodes"), _port()
    node0, node1 = (_dvc_project(_project(root / f"node{r}", inputs, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}"))
                    for r in range(2))
    _decoy(node1)
    before = _files(node1)
    _repro_two_nodes(node0, node1)
    return node0, node1, before


def test_node_0_writes_every_output_and_node_1_nothing(two_nodes):
    node0, node1, before = two_nodes
    assert _files(node1) == before  # not a file written, nor its damaged checkpoint read (a read would refuse it)
    for out in ("data/train/baseline/run_config.json", FINAL, CKPTS / "step_00000006/model.safetensors",
                "reports/train/baseline/model.json", "reports/train/baseline/metrics.json"):
        assert (node0 / out).is_file(), out
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=node0, env=_env(), capture_output=True,
                            text=True, check=True).stdout
    assert "up to date" in status, status  # node 0's dvc.lock records the run and its outputs
    outs = yaml.safe_load((node0 / "dvc.lock").read_text())["stages"]["train@baseline"]["outs"]
    assert all("md5" in out for out in outs) and len(outs) == 4, outs
    loss = [float(r.split("\t")[1]) for r in _curve(node0)[1:]]
    assert len(loss) == 6 and loss[-1] < loss[0]  # it trained


def test_two_nodes_train_the_weights_of_one_node(two_nodes, tmp_path, inputs, monkeypatch, one_thread):
    """2 nodes x 1 process == 1 node x 2 processes, bit for bit: the same global ranks hold the same samples and
    gloo sums the same two gradients. == 1 process accumulating 2 micro-batches, bit for bit too on one thread:
    each micro-batch is one sample either way, and a sum of two gradients does not depend on its order (DDP's
    scaling by the world size and its average are exact powers of two). With more micro-batches a step, or other
    thread counts, the sums' order differs and the weights agree to float rounding only (1e-6 here when the
    1-process run used 2 threads; AdamW's division by sqrt(v) + eps magnifies a small gradient's rounding)."""
    two = _weights(two_nodes[0])
    one = _project(tmp_path / "one", inputs, nproc_per_node=2)  # 1 node x 2 processes
    _finish([_start(one, STAGE)])
    accum = _project(tmp_path / "accum", inputs)  # 1 process, 2 micro-batches accumulated
    monkeypatch.chdir(accum)
    from dspark_core.draft.stage import run_train_stage

    run_train_stage(Path("params.yaml"), "baseline")
    for name, ref in (("1 node x 2 processes", _weights(one)), ("1 process", _weights(accum))):
        assert ref.keys() == two.keys()
        for k in ref:
            assert torch.equal(two[k], ref[k]), f"{name}: {k}"


def _curve(node: Path) -> list[str]:
    return (node / "reports/train/baseline/plots/metrics/train/loss.tsv").read_text().splitlines()


def _held_two_nodes(node0: Path, node1: Path, marker: Path) -> None:
    """Both nodes under torchrun at once, node 0 held as it is about to write its second checkpoint
    (``tests/_paused_stage.py``), then both killed (SIGKILL to every process of both launches)."""
    port = _port()
    held = [str(REPO / "tests" / "_paused_stage.py"), str(marker), "train", "--variant", "baseline"]
    procs = [_start(node, torchrun_command(1, held, Nodes(2, rank, "127.0.0.1", port)))
             for rank, node in ((0, node0), (1, node1))]
    deadline = time.monotonic() + 300
    try:
        while not marker.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.2)
    finally:
        outs = _kill(procs)
    assert marker.exists(), [out[-3000:] for out in outs]  # node 0 reached its second checkpoint


def _process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def test_two_nodes_killed_after_a_checkpoint_resume_to_the_uninterrupted_weights(two_nodes, tmp_path, inputs):
    node0, node1 = (_dvc_project(_project(tmp_path / f"node{r}", inputs, nnodes=2, rdzv_endpoint="127.0.0.1:1"))
                    for r in range(2))
    _decoy(node1)
    before = _files(node1)
    _held_two_nodes(node0, node1, tmp_path / "held")
    assert sorted(p.name for p in (node0 / CKPTS).glob("step_*")) == ["step_00000002"]
    assert not (node0 / FINAL).exists()
    port = _port()
    for node in (node0, node1):  # an execution key: the checkpoint still resumes
        _params(node, rdzv_endpoint=f"127.0.0.1:{port}")
    before["params.yaml"] = _files(node1)["params.yaml"]
    _repro_two_nodes(node0, node1)  # the same commands again
    assert _files(node1) == before  # node 1 read no checkpoint (its damaged one would fail) and wrote nothing
    resumed, uninterrupted = _weights(node0), _weights(two_nodes[0])
    for k in uninterrupted:
        assert torch.equal(resumed[k], uninterrupted[k]), k
    assert _curve(node0) == _curve(two_nodes[0])  # the curves continued once, with the same losses


def _params(node: Path, **train: Any) -> None:
    params = yaml.safe_load((node / "params.yaml").read_text())
    params["train"].update(train)
    (node / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_nodes_that_disagree_on_the_run_both_refuse_it(tmp_path, inputs):
    """Node 1's params differ (its copy of params.yaml lacks an ablation node 0 has): each node reads its own
    inputs, so they would train silently wrong steps; both refuse with one error line, and nothing is written."""
    port = _port()
    node0 = _project(tmp_path / "node0", inputs, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}", lr=1e-3)
    node1 = _project(tmp_path / "node1", inputs, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}")
    before = [_files(node0), _files(node1)]
    procs = [_start(node0, STAGE, node_rank=0), _start(node1, STAGE, node_rank=1)]
    for p, out in zip(procs, _wait(procs)):
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert p.returncode != 0 and errors == [
            "error: train: global rank 1 differs from global rank 0 in train (each host reads its own copy): give "
            "every node node 0's code and params (the same git commit) and inputs (`dvc pull` of the stage's deps), "
            "then rerun"], out[-3000:]
    assert [_files(node0), _files(node1)] == before


def _collectives(rank: int, port: int, out: str) -> None:
    """One of 2 gloo processes: on_main's result and errors, broadcast_tree's copy of rank 0's tree."""
    import random

    from dspark_core.dist import broadcast_tree, init_distributed, on_main
    from dspark_core.errors import UserError

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    d = init_distributed()
    seen: dict[str, Any] = {"value": on_main(d, lambda: {"step": 3, "rank": d.rank})}
    for kind, exc in (("user", UserError("checkpoints/latest.json: not valid JSON; delete it")),
                      ("bug", KeyError("optimizer"))):
        def fail():
            assert d.is_main, "only rank 0 runs fn"
            raise exc
        try:
            on_main(d, fail)
        except Exception as e:  # noqa: BLE001
            seen[kind] = (type(e).__name__, str(e))
    g = torch.Generator().manual_seed(0)
    tree = {"w": torch.randn(3, 4, generator=g).bfloat16(), "opt": [torch.arange(5), 2.5, "adamw"],
            "flags": (torch.tensor([True, False]), None), "rng": random.Random(1).getstate(), "empty": {}}
    seen["tree"] = broadcast_tree(tree if d.is_main else None, d, torch.device("cpu"))
    seen["sent"] = tree
    torch.save(seen, Path(out) / f"rank{rank}.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


def test_on_main_and_broadcast_tree_give_rank_0s_result_and_errors_to_every_rank(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_collectives, args=(_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["value"] == r1["value"] == {"step": 3, "rank": 0}
    assert r0["user"] == r1["user"] == ("UserError", "checkpoints/latest.json: not valid JSON; delete it")
    assert r0["bug"] == ("KeyError", "'optimizer'") and r1["bug"] == ("RuntimeError",
                                                                      "global rank 0 failed: KeyError: 'optimizer'")
    sent, got = r0["sent"], r1["tree"]
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], sent["w"])
    assert torch.equal(got["opt"][0], sent["opt"][0]) and got["opt"][1:] == [2.5, "adamw"]
    assert isinstance(got["flags"], tuple) and torch.equal(got["flags"][0], sent["flags"][0])
    assert got["flags"][1] is None
    assert got["rng"] == sent["rng"] and got["empty"] == {}


def _noisy_task():
    """test_trainer's ToyTask whose forward adds noise drawn from torch's global generator (as dropout would): a
    rank that resumed with other RNG states than the checkpoint's trains other steps."""
    from test_trainer import ToyTask

    class NoisyTask(ToyTask):
        def forward_sums(self, model, batch):
            return super().forward_sums(model, {**batch, "x": batch["x"] + 0.05 * torch.randn(batch["x"].shape)})

    return NoisyTask()


def _timed_resume(rank: int, port: int, root: str) -> None:
    """One of 2 gloo processes, each in a folder of its own (rank 1's holds a damaged checkpoint where it would look
    if it read its own disk): a time-scheduled run killed during step 12 (the last checkpoint 10) and resumed, and an
    uninterrupted one; every rank's lrs and weights saved."""
    from test_trainer import _cfg, _FakeClock, _params

    from dspark_core.train import trainer

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    os.chdir(Path(root) / f"rank{rank}")
    cfg = {name: _cfg(Path(name), total_steps=100, checkpoint_every=5, lr_schedule="time", time_budget_s=42.0)
           for name in ("full", "killed")}
    trainer._now = _FakeClock()
    full = trainer.train(_noisy_task(), cfg["full"], progress=False)
    trainer._now = _FakeClock(crash_at=26)  # during step 12, on both ranks
    try:
        trainer.train(_noisy_task(), cfg["killed"], progress=False)
    except KeyboardInterrupt:
        pass
    trainer._now = _FakeClock()
    rest = trainer.train(_noisy_task(), cfg["killed"], progress=False)
    torch.save({run: {"lr": [h["lr"] for h in res.history], "params": _params(res.model)}
                for run, res in (("full", full), ("rest", rest))}, "result.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


def test_time_scheduled_run_resumes_on_two_processes_from_rank_0s_checkpoint(tmp_path):
    """The resumed state reaches rank 1 by broadcast, with the time schedule's clock (seconds spent, its origin) and
    the RNG states (the task draws noise from them): both ranks continue at step 10 with the uninterrupted run's
    lrs and end with its weights, rank 1 never having read a checkpoint of its own."""
    import torch.multiprocessing as mp

    for r in range(2):
        (tmp_path / f"rank{r}").mkdir()
    _decoy_at(tmp_path / "rank1" / "killed" / "checkpoints")
    mp.start_processes(_timed_resume, args=(_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}" / "result.pt") for r in range(2)]
    want = ranks[0]["full"]["lr"]
    assert len(want) == 21 and ranks[0]["rest"]["lr"] == ranks[1]["rest"]["lr"] == want[10:]
    for run in ranks:
        for k, v in ranks[0]["full"]["params"].items():
            assert torch.equal(run["rest"]["params"][k], v), k
    assert not (tmp_path / "rank1" / "full").exists()  # rank 1 wrote no checkpoint
    assert sorted(p.name for p in (tmp_path / "rank1" / "killed").rglob("*")) == ["checkpoints", "latest.json"]


def test_each_host_gets_torchruns_static_rendezvous_with_its_node_rank(monkeypatch):
    """The torchrun command of a host (parsed by torchrun's own parser): node 0's endpoint, this host's rank from
    train.node_rank, else NODE_RANK, PET_NODE_RANK, SLURM_NODEID in this order; one host stays --standalone."""
    from torch.distributed.run import config_from_args, get_args_parser

    from dspark_core.train.trainer import TrainConfig

    for k in NODE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))  # torchrun's parse sets it
    cfg = TrainConfig.from_dict({"nnodes": 2, "nproc_per_node": 4, "rdzv_endpoint": "10.0.0.1:29500",
                                 "micro_batch_size": 1, "global_batch_size": 8})
    monkeypatch.setenv("SLURM_NODEID", "0")
    monkeypatch.setenv("PET_NODE_RANK", "1")
    assert cfg.nodes().resolved() == Nodes(2, 1, "10.0.0.1", 29500, "train.node_rank")
    assert cfg.replace(node_rank=0).nodes().resolved().rank == 0  # an explicit rank wins
    monkeypatch.setenv("NODE_RANK", "0")
    cmd = torchrun_command(4, ["stages/train.py", "--variant", "baseline"], cfg.nodes().resolved())
    assert cmd[:2] == ["-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(cmd[2:])
    config, script, script_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 4)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.rdzv_configs["rank"]) == ("static", "10.0.0.1:29500", 0)
    assert script_args[-3:] == ["stages/train.py", "--variant", "baseline"]  # after `python -u`
    assert torchrun_command(2, ["x.py"]) == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                             "x.py"]
    ipv6 = cfg.replace(rdzv_endpoint="[fd00::1]:29500").nodes()
    assert (ipv6.host, ipv6.port) == ("[fd00::1]", 29500)
