"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest
import torch

from dspark_core.testing import FAMILIES, tiny_model


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
