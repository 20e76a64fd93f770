"""Triton kernels for the GPU fast paths (decode step of the target, fused distillation loss).

Importing this package never imports Triton; :func:`triton_ok` says whether the kernels can run on a
tensor's device: on CUDA when Triton imports, or anywhere under ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, which the kernel tests use on machines without a GPU). Every kernel has a plain-torch
reference next to it and a test against that reference (``tests/test_kernels.py``).
"""

from __future__ import annotations

import os

import torch


def triton_ok(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on ``device``."""
    device = torch.device(device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpret:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
