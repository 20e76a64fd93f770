"""Helpers shared by the tests of dspark_core.decoding: a one-thread fixture and a chi-square goodness of fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and do not stall when the CPU is shared); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chisquare_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """p-value of ``samples`` (cell ids) against the cell probabilities ``probs``.

    A cell of probability 0 must never be observed (asserted; then dropped); cells expected fewer than
    5 times are pooled into one."""
    from scipy.stats import chisquare  # imported here: the GPU machine runs the runner tests without scipy

    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    observed = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    impossible = probs == 0
    assert observed[impossible].sum() == 0, f"sampled impossible cells {np.nonzero(impossible & (observed > 0))}"
    observed, expected = observed[~impossible], probs[~impossible] * len(samples)
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(observed, expected).pvalue)
