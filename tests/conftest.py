"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest
import torch

from dspark_core.testing import FAMILIES, tiny_model

# Files whose tests run their CUDA paths when a GPU is there (Triton kernels, CUDA graphs, the static engine,
# draft trees, bf16 training of every variant): `pytest -m gpu` (scripts/gpu_tests.sh) runs them on the device.
GPU_FILES = {"test_kernels.py", "test_kernel_accept.py", "test_static_engine.py", "test_tree.py",
             "test_tree_sampling.py", "test_decoding_target_runner.py", "test_variants_gpu.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in GPU_FILES:
            item.add_marker(pytest.mark.gpu)


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
