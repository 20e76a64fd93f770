"""The multi-tensor AdamW kernel (``dspark_core.kernels.adamw``, ``train.optimizer_kernel``) against its torch
reference and against ``torch.optim.AdamW``; the optimiser's state against torch's (checkpoints resume under
either kernel); the choice and its errors.

Runs where Triton can: on a CUDA device, or on CPU under Triton's interpreter (set here when there is no GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton's CPU interpreter; read when the kernel is defined (first use below)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dspark_core.errors import UserError  # noqa: E402
from dspark_core.kernels import triton_ok  # noqa: E402
from dspark_core.kernels.adamw import BLOCK, adamw_reference_  # noqa: E402
from dspark_core.train.optim import TritonAdamW, optimizer_kernel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_ok(DEVICE), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
SHAPES = [(3,), (BLOCK + 5,), (7, 33), (2 * BLOCK,)]  # a partial block, one past a block, a matrix, exact blocks
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE, dtype)) for s in SHAPES]


def _set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * (1 + step)).to(DEVICE, p.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
def test_kernel_matches_its_reference(dtype, scaled):
    """Three steps of the kernel vs the plain-torch reference, each from the same state (the reference takes
    the kernel's result after each step): float32 to rounding, bf16 storage to one rounding step of bf16."""
    params, ref = _params(dtype), _params(dtype)
    opt = TritonAdamW(params, **HP)
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ref]
    for step in range(1, 4):
        _set_grads(params, step)
        scale = torch.tensor(2.5 * step, device=DEVICE) if scaled else None
        opt.grad_scale = scale
        opt.step()
        del opt.grad_scale
        for p, (m, v), got in zip(ref, states, params):
            g = got.grad
            adamw_reference_(p.data, g, m, v, float(step), lr=HP["lr"], beta1=0.9, beta2=0.95, eps=HP["eps"],
                             weight_decay=HP["weight_decay"], grad_scale=scale)
            tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)  # GPU: FMAs
            torch.testing.assert_close(got.data, p.data, **tol)
            torch.testing.assert_close(opt.state[got]["exp_avg"], m, **tol)
            torch.testing.assert_close(opt.state[got]["exp_avg_sq"], v, **tol)
            p.data.copy_(got.data)  # the next step starts from one state
            m.copy_(opt.state[got]["exp_avg"])
            v.copy_(opt.state[got]["exp_avg_sq"])
    assert all(float(opt.state[p]["step"]) == 3.0 for p in params)


def test_launch_shape_does_not_change_the_update():
    """``block`` / ``num_warps`` (the benchmark's sweep) only re-tile the same per-element update: bitwise equal."""
    from dspark_core.kernels.adamw import adamw_step_

    results = []
    for block, warps in ((BLOCK, 8), (1024, 4)):
        params = _params(torch.bfloat16)
        _set_grads(params, 1)
        ms, vs = [torch.full_like(p, 0.01) for p in params], [torch.full_like(p, 0.02) for p in params]
        steps = [torch.full((), 3.0, device=DEVICE) for _ in params]
        adamw_step_([p.data for p in params], [p.grad for p in params], ms, vs, steps, lr=1e-3, beta1=0.9,
                    beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=torch.tensor(2.0, device=DEVICE),
                    block=block, num_warps=warps)
        results.append([t.clone() for t in [p.data for p in params] + ms + vs])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][0], _params(torch.bfloat16)[0].data)  # the step did move the weights


def _step_both(kw: dict, steps: int, swap_at: int | None = None) -> TritonAdamW:
    """``steps`` steps of TritonAdamW and torch.optim.AdamW (float32, optimiser options ``kw``) on the same
    weights and gradients, the two optimisers' state dicts swapped before step ``swap_at``; the weights compared
    after each step. Returns ours."""
    ours_p, torch_p = _params(torch.float32), _params(torch.float32)
    ours, theirs = TritonAdamW(ours_p, **kw, **HP), torch.optim.AdamW(torch_p, **kw, **HP)
    for step in range(steps):
        if step == swap_at:  # resume each from the other's checkpoint
            a, b = ours.state_dict(), theirs.state_dict()
            ours.load_state_dict(b)
            theirs.load_state_dict(a)
        _set_grads(ours_p, step)
        _set_grads(torch_p, step)
        ours.step()
        theirs.step()
        for a, b in zip(ours_p, torch_p):
            torch.testing.assert_close(a.data, b.data, rtol=2e-6, atol=1e-7)
    return ours


def test_optimizer_matches_torch_adamw_and_shares_its_state():
    """The same trajectory as torch.optim.AdamW, also after the two swap state dicts (checkpoints) mid-run."""
    _step_both({}, steps=4, swap_at=2)


def test_what_the_kernel_does_not_cover_runs_torch_step():
    """amsgrad: TritonAdamW takes torch's own step (the same numbers as torch's AdamW)."""
    ours = _step_both({"amsgrad": True}, steps=2)
    assert all("max_exp_avg_sq" in state for state in ours.state.values())


def test_optimizer_kernel_choice():
    from dspark_core.train.trainer import TrainConfig

    assert optimizer_kernel("torch", DEVICE) == "torch"
    assert optimizer_kernel("triton", DEVICE) == "triton"
    with pytest.raises(UserError, match=r"train.optimizer_kernel must be one of torch, triton; got 'apex'"):
        optimizer_kernel("apex", DEVICE)
    with pytest.raises(UserError, match=r"optimizer_kernel must be one of torch, triton; got 'fused'"):
        TrainConfig.from_dict({"optimizer_kernel": "fused"})
    assert "optimizer_kernel" not in TrainConfig().identity_dict()  # a speed knob: resumes under either


def test_trainer_runs_either_kernel_to_one_trajectory_and_resumes_across_them(tmp_path):
    """The shared trainer (clip + AdamW) under optimizer_kernel torch and triton: the same weights to float32
    rounding; a run checkpointed under triton resumes under torch (the execution key is outside the identity)."""
    from test_trainer import ToyTask, _cfg, _params

    from dspark_core.train.trainer import train

    a = train(ToyTask(), _cfg(tmp_path / "torch", optimizer_kernel="torch"), progress=False)
    b = train(ToyTask(), _cfg(tmp_path / "triton", optimizer_kernel="triton"), progress=False)
    train(ToyTask(), _cfg(tmp_path / "mixed", optimizer_kernel="triton", max_steps=5), progress=False)
    c = train(ToyTask(), _cfg(tmp_path / "mixed", optimizer_kernel="torch"), progress=False)
    assert len(c.history) == 3  # resumed at step 5 of 8
    for (k, va), vb, vc in zip(_params(a.model).items(), _params(b.model).values(), _params(c.model).values()):
        torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(vc, va, rtol=1e-5, atol=1e-6, msg=k)
