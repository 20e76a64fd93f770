"""Programmatic dependent launch (PDL) for the decode-step kernels: the launch options and the device-side
wait / release each kernel calls (``gdc_wait``, ``gdc_launch_dependents``), or nothing where PDL is absent.
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _pdl_supported() -> bool:
    """Programmatic dependent launch (Hopper+): each kernel is launched while the previous one drains and
    waits (``gdc_wait``, first thing) for it to finish; hides launch latency between the small kernels.
    On wherever the device and Triton support it."""
    if INTERPRET or not torch.cuda.is_available():
        return False
    try:
        import dataclasses

        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

        has_option = any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))
        return has_option and torch.cuda.get_device_capability()[0] >= 9
    except Exception:  # noqa: BLE001 - any missing piece: launch without PDL
        return False


PDL = _pdl_supported()
if PDL:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
else:  # never traced: every use sits under ``if PDL_ON:`` (a constexpr False)
    gdc_launch_dependents = gdc_wait = None
_LAUNCH = {"launch_pdl": True} if PDL else {}
# Weight prefetch across kernels: each product kernel lets the next one launch first thing
# (``gdc_launch_dependents``), and loads its first weight block *before* ``gdc_wait``: weights are constants, so
# that read may overlap the previous kernel, which is where a launch-bound step (SmolLM2: 30 layers x 7 small
# kernels) spends its time. The sums are the same either way (False: wait first, release after the K loop;
# the kernel tests compare the two bit for bit).
PDL_PREFETCH = True
