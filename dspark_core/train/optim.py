"""The trainer's AdamW step kernels (``train.optimizer_kernel``: torch | triton).

``torch``: ``torch.optim.AdamW`` (fused on CUDA). ``triton``: :class:`TritonAdamW`, the same optimiser whose
step runs ``kernels.adamw`` (a streaming Triton kernel per tensor instead of torch's ``multi_tensor_apply``). A
speed knob, not a hyperparameter: both compute AdamW to float32 rounding and keep one state layout, so it is an
execution key of ``train`` (a checkpoint resumes under either).
"""

from __future__ import annotations

from typing import Any

import torch

from dspark_core.errors import UserError

OPTIMIZER_KERNELS = ("torch", "triton")


def optimizer_kernel(choice: str, device: torch.device) -> str:
    """``choice`` (``torch`` or ``triton``) checked against ``device``: triton needs Triton to run there."""
    from dspark_core.kernels import triton_ok

    if choice not in OPTIMIZER_KERNELS:
        raise UserError(f"train.optimizer_kernel must be one of {', '.join(OPTIMIZER_KERNELS)}; got {choice!r}")
    if choice == "triton" and not triton_ok(device):
        raise UserError(f"train.optimizer_kernel: triton, but Triton cannot run on {device}; use torch")
    return choice


class TritonAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (its fused state layout: a float32 ``step`` tensor on the parameter's device) whose
    ``step`` runs :func:`dspark_core.kernels.adamw.adamw_step_` per parameter group. Falls back to torch's step
    for what the kernel does not cover (amsgrad, maximize, capturable, a tensor lr, a closure, ``found_inf``,
    sparse or non-contiguous tensors). ``grad_scale`` (set by
    ``trainer.clip_and_step``) divides the gradients inside the kernel, as torch's fused step does."""

    def __init__(self, params, **kw: Any) -> None:
        super().__init__(params, fused=True, **kw)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        plans = None if closure is not None or getattr(self, "found_inf", None) is not None else self._plans()
        if plans is None:
            return super().step(closure)
        from dspark_core.kernels.adamw import adamw_step_

        scale = getattr(self, "grad_scale", None)
        for group, lists in plans:
            if not lists[0]:
                continue
            params, grads, ms, vs, steps = lists
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            adamw_step_(params, grads, ms, vs, steps, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], grad_scale=scale)
        return None

    def _plans(self) -> list | None:
        """Per group: (group, [params, grads, exp_avgs, exp_avg_sqs, steps]) with state made where missing; None
        when some group needs torch's own step."""
        from dspark_core.kernels.adamw import supported

        plans = []
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"] \
                    or torch.is_tensor(group["lr"]):
                return None
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    return None
                if not self.state[p]:  # torch's fused layout
                    self.state[p].update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                                         exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                         exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
            lists = [params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                     [self.state[p]["exp_avg_sq"] for p in params], [self.state[p]["step"] for p in params]]
            if not supported([t for ts in lists[:4] for t in ts]) or any(
                    s.dtype != torch.float32 or s.device != p.device for s, p in zip(lists[4], params)):
                return None
            plans.append((group, lists))
        return plans
