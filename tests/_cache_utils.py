"""Test helpers of the cache stage's tests: the tiny Qwen3 target with its fingerprint, a regen file of 14 samples,
and the cache settings they are built with (import the fixtures into a test module to use them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_core.target import write_fingerprint
from dspark_core.testing import save_tiny_target, write_regen

LAYERS = (-1, 0, 2, 4)  # tiny targets have 6 decoder layers
# 14 samples, 710 tokens after the cut to 96; batch_tokens 200 makes plan batches of 2-4 samples, unpadded and padded
LENGTHS = [(12, 30), (40, 70), (5, 0), (20, 20), (33, 64), (8, 9), (60, 50), (15, 3), (25, 25), (3, 40),
           (30, 31), (11, 12), (7, 80), (18, 18)]
CACHE = dict(aux_layer_ids=LAYERS, max_length=96, chunk_tokens=256, batch_tokens=200, splits=("train",),
             device="cpu")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    path = save_tiny_target(tmp_path_factory.mktemp("target") / "target", "qwen3")
    write_fingerprint(path)
    return path


@pytest.fixture(scope="module")
def regen(tmp_path_factory) -> Path:
    return write_regen(tmp_path_factory.mktemp("regen") / "train.parquet", LENGTHS)
