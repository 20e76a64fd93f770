"""The multi-tensor AdamW kernel (``dspark_core.kernels.adamw``, ``train.optimizer_kernel``) against its torch
reference and against ``torch.optim.AdamW``; the optimiser's state against torch's (checkpoints resume under
either kernel); the choice and its errors. The master-weights step (``MasterAdamW``: float32 master and moments,
bf16 working copy written by the same pass) against its torch reference and the optimiser's torch path.

Runs where Triton can: on a CUDA device, or on CPU under Triton's interpreter (set here when there is no GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton's CPU interpreter; read when the kernel is defined (first use below)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dspark_core.errors import UserError  # noqa: E402
from dspark_core.kernels import triton_ok  # noqa: E402
from dspark_core.kernels.adamw import BLOCK, adamw_reference_, adamw_step_, master_adamw_reference_  # noqa: E402
from dspark_core.train.optim import MasterAdamW, TritonAdamW, optimizer_kernel  # noqa: E402

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


@pytest.mark.parametrize("storage", ["float32", "master"])
def test_launch_shape_does_not_change_the_update(storage):
    """``block`` / ``num_warps`` (the benchmark's sweep) only re-tile the same per-element update: bitwise equal,
    and the update is one the weights can hold, so it moves every one of them: float32 weights in place, or float32
    masters with their bf16 working copies written by the same pass (a bf16 weight near 1 has neighbours 2^-7
    apart, where an lr-1e-3 step would round away and the check would compare two unmoved tensors)."""
    start = _params(torch.float32)
    results = []
    for block, warps in ((BLOCK, 8), (1024, 4)):
        params = [p.detach().clone() for p in start]
        grads = [g.grad for g in _grads_like(params)]
        working = [p.to(torch.bfloat16) for p in params] if storage == "master" else None
        ms, vs = [torch.full_like(p, 0.01) for p in params], [torch.full_like(p, 0.02) for p in params]
        steps = [torch.full((), 3.0, device=DEVICE) for _ in params]
        adamw_step_(params, [g.to(torch.bfloat16) for g in grads] if working else grads, ms, vs, steps, lr=1e-3,
                    beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=torch.tensor(2.0, device=DEVICE),
                    working=working, block=block, num_warps=warps)
        results.append([t.clone() for t in params + ms + vs + (working or [])])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    for before, after in zip(start, results[0]):
        assert bool((after != before).all()), "a weight kept its value: the update was lost"
    if storage == "master":  # the working copies are the new masters rounded to bf16
        n = len(start)
        for master, work in zip(results[0][:n], results[0][3 * n:]):
            assert torch.equal(work, master.to(torch.bfloat16))


def _grads_like(params):
    shadow = [torch.nn.Parameter(p.detach().clone()) for p in params]
    _set_grads(shadow, 1)
    return shadow


@pytest.mark.parametrize("scaled", [False, True])
def test_master_kernel_matches_its_reference(scaled):
    """Three master-weight steps of the kernel (bf16 gradient in; float32 master and moments, bf16 working copy
    out) against the plain-torch reference from the same state: master and moments to float32 rounding, the working
    copy bit for bit the kernel's own master rounded to bf16."""
    masters, ref = _params(torch.float32), _params(torch.float32)
    working = [m.detach().to(torch.bfloat16) for m in masters]
    ref_working = [w.clone() for w in working]
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in masters]
    ref_states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in masters]
    steps = [torch.zeros((), device=DEVICE) for _ in masters]
    for step in range(1, 4):
        grads = [g.grad.to(torch.bfloat16) for g in _grads_like(masters)]
        scale = torch.tensor(2.5 * step, device=DEVICE) if scaled else None
        torch._foreach_add_(steps, 1.0)
        adamw_step_([m.data for m in masters], grads, [m for m, _ in states], [v for _, v in states], steps,
                    lr=HP["lr"], beta1=0.9, beta2=0.95, eps=HP["eps"], weight_decay=HP["weight_decay"],
                    grad_scale=scale, working=working)
        for i, g in enumerate(grads):
            master_adamw_reference_(ref[i].data, ref_working[i], g, *ref_states[i], float(step), lr=HP["lr"],
                                    beta1=0.9, beta2=0.95, eps=HP["eps"], weight_decay=HP["weight_decay"],
                                    grad_scale=scale)
            tol = dict(rtol=2e-6, atol=1e-6)
            torch.testing.assert_close(masters[i].data, ref[i].data, **tol)
            torch.testing.assert_close(states[i][0], ref_states[i][0], **tol)
            torch.testing.assert_close(states[i][1], ref_states[i][1], **tol)
            assert torch.equal(working[i], masters[i].data.to(torch.bfloat16))
            ref[i].data.copy_(masters[i].data)  # the next step starts from one state
            ref_working[i].copy_(working[i])
            ref_states[i][0].copy_(states[i][0])
            ref_states[i][1].copy_(states[i][1])


def _master_pair(kernel: str):
    """bf16 working weights (as a model holds them) and a MasterAdamW over them."""
    working = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params(torch.float32)]
    return working, MasterAdamW(working, kernel=kernel, **HP)


def test_master_optimizer_kernel_and_torch_paths_agree_and_share_state():
    """MasterAdamW's one-pass Triton step and its torch path (float32 gradient, torch's fused AdamW, copy back):
    the same masters to float32 rounding and the same working weights over four steps with a clip factor, also
    after the two swap state dicts mid-run (a checkpoint resumes under either kernel)."""
    (wa, a), (wb, b) = _master_pair("triton"), _master_pair("torch")
    for step in range(4):
        if step == 2:
            sa, sb = a.state_dict(), b.state_dict()
            a.load_state_dict(sb)
            b.load_state_dict(sa)
        for ws in (wa, wb):
            _set_grads(ws, step)
        for opt in (a, b):
            opt.grad_scale = torch.tensor(1.5, device=DEVICE)
            opt.step()
            del opt.grad_scale
            opt.zero_grad()
        assert all(w.grad is None for w in wa + wb)
        for ma, mb in zip(a.state_dict()["master_params"], b.state_dict()["master_params"]):
            torch.testing.assert_close(ma, mb, rtol=2e-6, atol=1e-7)
        for x, y, m in zip(wa, wb, a.state_dict()["master_params"]):
            assert torch.equal(x.data, m.to(torch.bfloat16))
            torch.testing.assert_close(x.data, y.data, rtol=2 ** -7, atol=0)  # at most one bf16 step apart
    st = a.state_dict()["state"][0]
    assert st["exp_avg"].dtype == torch.float32 and float(st["step"]) == 4.0


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


def test_capturable_groups_take_the_kernel(monkeypatch):
    """A step recorded in a CUDA graph marks its groups ``capturable``: TritonAdamW and MasterAdamW still run the
    Triton kernel there (torch's own step would raise here) and give the non-capturable trajectory to the bit."""
    def refuse(*a, **k):
        raise AssertionError("torch's AdamW step ran")

    plain_p, cap_p = _params(torch.float32), _params(torch.float32)
    plain, cap = TritonAdamW(plain_p, **HP), TritonAdamW(cap_p, **HP)
    (w_plain, m_plain), (w_cap, m_cap) = _master_pair("triton"), _master_pair("triton")
    for opt in (cap, m_cap):
        for group in opt.param_groups:
            group["capturable"] = True
    monkeypatch.setattr(torch.optim.AdamW, "step", refuse)
    for step in range(3):
        for ps in (plain_p, cap_p, w_plain, w_cap):
            _set_grads(ps, step)
        for opt in (plain, cap, m_plain, m_cap):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(plain_p, cap_p))
        assert all(torch.equal(a, b) for a, b in zip(w_plain, w_cap))


def test_optimizer_kernel_choice():
    from dspark_core.train.trainer import TrainConfig

    assert optimizer_kernel("torch", DEVICE) == "torch"
    assert optimizer_kernel("triton", DEVICE) == "triton"
    assert optimizer_kernel("auto", DEVICE) == ("triton" if DEVICE.type == "cuda" else "torch")
    assert optimizer_kernel("auto", torch.device("cpu")) == "torch"  # the CPU: torch's AdamW
    with pytest.raises(UserError, match=r"train.optimizer_kernel must be one of auto, torch, triton; got 'apex'"):
        optimizer_kernel("apex", DEVICE)
    with pytest.raises(UserError, match=r"optimizer_kernel must be one of auto, torch, triton; got 'fused'"):
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


def test_trainer_master_weights_under_either_kernel_and_resumed_across_them(tmp_path):
    """The trainer with bf16 working weights and float32 masters (param_dtype bfloat16): the Triton one-pass step
    and the torch path train the same weights, and a run checkpointed under triton resumes under torch to the same
    end (the masters travel in the checkpoint)."""
    from test_trainer import ToyTask, _cfg, _params

    from dspark_core.train.trainer import train

    kw = dict(param_dtype="bfloat16", lr=3e-2)
    a = train(ToyTask(), _cfg(tmp_path / "torch", optimizer_kernel="torch", **kw), progress=False)
    b = train(ToyTask(), _cfg(tmp_path / "triton", optimizer_kernel="triton", **kw), progress=False)
    train(ToyTask(), _cfg(tmp_path / "mixed", optimizer_kernel="triton", max_steps=5, **kw), progress=False)
    c = train(ToyTask(), _cfg(tmp_path / "mixed", optimizer_kernel="torch", **kw), progress=False)
    assert len(c.history) == 3 and all(p.dtype == torch.bfloat16 for p in a.model.parameters())
    for (k, va), vb, vc in zip(_params(a.model).items(), _params(b.model).values(), _params(c.model).values()):
        torch.testing.assert_close(vb, va, rtol=2 ** -7, atol=1e-3, msg=k)  # a bf16 step or two apart
        torch.testing.assert_close(vc, va, rtol=2 ** -7, atol=1e-3, msg=k)
