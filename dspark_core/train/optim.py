"""The trainer's AdamW steps: the kernel (``train.optimizer_kernel``: auto | torch | triton) and the master-weights
optimiser (``train.param_dtype: bfloat16``).

``torch``: ``torch.optim.AdamW`` (fused on CUDA). ``triton``: :class:`TritonAdamW`, the same optimiser whose
step runs ``kernels.adamw`` (a streaming Triton kernel per tensor instead of torch's ``multi_tensor_apply``). A
speed knob, not a hyperparameter: both compute AdamW to float32 rounding and keep one state layout, so it is an
execution key of ``train`` (a checkpoint resumes under either). ``auto`` (the default): ``triton`` on CUDA
(float32 weights: 1.8 ms less of a 60 ms Qwen3-4B-shaped step on an H100; bf16 working weights: a one-pass
master step with no torch counterpart), ``torch`` elsewhere.

:class:`MasterAdamW` keeps float32 master weights and AdamW moments beside the model's bf16 working weights (the
numerics of DeepSpec's ``BF16Optimizer``), with the step fused into one pass per tensor under ``triton``.
"""

from __future__ import annotations

from typing import Any

import torch

from dspark_core.errors import UserError

OPTIMIZER_KERNELS = ("auto", "torch", "triton")


def optimizer_kernel(choice: str, device: torch.device) -> str:
    """``choice`` (``auto``, ``torch`` or ``triton``) resolved on ``device``: triton needs Triton to run there;
    auto is triton on CUDA where Triton imports, else torch."""
    from dspark_core.kernels import triton_ok

    if choice not in OPTIMIZER_KERNELS:
        raise UserError(f"train.optimizer_kernel must be one of {', '.join(OPTIMIZER_KERNELS)}; got {choice!r}")
    if choice == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_ok(device) else "torch"
    if choice == "triton" and not triton_ok(device):
        raise UserError(f"train.optimizer_kernel: triton, but Triton cannot run on {device}; use torch")
    return choice


class TritonAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (its fused state layout: a float32 ``step`` tensor on the parameter's device) whose
    ``step`` runs :func:`dspark_core.kernels.adamw.adamw_step_` per parameter group. Falls back to torch's step
    for what the kernel does not cover (amsgrad, maximize, a tensor lr, a closure, ``found_inf``, sparse or
    non-contiguous tensors). ``grad_scale`` (set by ``trainer.clip_and_step``) divides the gradients inside the
    kernel, as torch's fused step does. A ``capturable`` group (a step recorded in a CUDA graph,
    ``train/step_graph.py``) takes the kernel too: it reads the step counts and ``grad_scale`` on the device and
    from the host only the float hyperparameters, which a recording bakes in as torch's capturable step bakes a
    float lr."""

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
            if group["amsgrad"] or group["maximize"] or group["differentiable"] or torch.is_tensor(group["lr"]):
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


class MasterAdamW(torch.optim.AdamW):
    """AdamW on float32 master copies of low-precision working weights (``train.param_dtype: bfloat16``).

    The model's trainable parameters (the *working* weights, bf16) are what the forward reads, with no per-matmul
    cast, and what the backward writes its gradients to. The optimiser's own parameters are a float32 master copy
    of each, with torch's fused AdamW state for it (float32 ``step``, ``exp_avg``, ``exp_avg_sq``). A step updates
    the master from the working copy's gradient and writes the master, rounded to nearest, back to the working
    copy: an update far below bf16's spacing (lr 3e-4 on a weight near 1, whose bf16 neighbours are 2^-7 apart)
    accumulates in the master instead of vanishing.

    ``kernel``: ``triton`` runs each tensor's step as one pass (``kernels.adamw.adamw_step_(..., working=)``: reads
    the bf16 gradient, the master and the moments, writes them and the working copy); ``torch`` is the reference
    path (the gradients cast to float32, torch's fused AdamW on the masters, the masters copied back), taken too for
    what the kernel does not cover. ``grad_scale`` (set by ``trainer.clip_and_step``) divides the gradients inside
    either. ``state_dict()`` carries the masters as ``master_params`` (by parameter index, torch's numbering), so a
    resumed run continues bit-identically; the two paths share one state layout."""

    def __init__(self, params, *, kernel: str = "torch", master_dtype: torch.dtype = torch.float32,
                 **kw: Any) -> None:
        groups = list(params)
        groups = [dict(g) for g in groups] if groups and isinstance(groups[0], dict) else [{"params": groups}]
        self.working_of: dict[torch.Tensor, torch.nn.Parameter] = {}  # master -> its working weight
        for g in groups:
            masters = []
            for w in g["params"]:
                m = torch.empty_like(w, dtype=master_dtype, memory_format=torch.contiguous_format)
                m.copy_(w.detach())
                self.working_of[m] = w
                masters.append(m)
            g["params"] = masters
        self.kernel = kernel
        super().__init__(groups, fused=True, **kw)

    def _pairs(self) -> list[tuple[dict[str, Any], list[torch.Tensor], list[torch.nn.Parameter]]]:
        """Per group: (group, masters, working weights) of the weights that have a gradient."""
        out = []
        for group in self.param_groups:
            masters = [m for m in group["params"] if self.working_of[m].grad is not None]
            out.append((group, masters, [self.working_of[m] for m in masters]))
        return out

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        pairs = self._pairs()
        if self.kernel == "triton" and self._kernel_covers(pairs):
            self._triton_step(pairs)
        else:
            self._torch_step(pairs)
        return None

    def _kernel_covers(self, pairs) -> bool:
        from dspark_core.kernels.adamw import supported

        for group, masters, working in pairs:
            if group["amsgrad"] or group["maximize"] or group["differentiable"] or torch.is_tensor(group["lr"]) \
                    or getattr(self, "found_inf", None) is not None:
                return False
            if not supported(masters + [w.data for w in working] + [w.grad for w in working]):
                return False
        return True

    def _triton_step(self, pairs) -> None:
        from dspark_core.kernels.adamw import adamw_step_

        scale = getattr(self, "grad_scale", None)
        for group, masters, working in pairs:
            if not masters:
                continue
            for m in masters:
                if not self.state[m]:  # torch's fused layout (the torch path makes the same)
                    self.state[m].update(step=torch.zeros((), dtype=torch.float32, device=m.device),
                                         exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m))
            states = [self.state[m] for m in masters]
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            adamw_step_(masters, [w.grad for w in working], [st["exp_avg"] for st in states],
                        [st["exp_avg_sq"] for st in states], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                        eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=scale,
                        working=[w.data for w in working])

    def _torch_step(self, pairs) -> None:
        """The reference path: float32 gradients on the masters, torch's AdamW (its fused kernel reads
        ``grad_scale``), the masters rounded into the working weights."""
        masters = [m for _, ms, _ in pairs for m in ms]
        for m in masters:
            m.grad = self.working_of[m].grad.to(m.dtype)
        try:
            super().step()
        finally:
            for m in masters:
                m.grad = None
        for m in masters:
            self.working_of[m].data.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the working weights' gradients (the masters never keep one)."""
        for w in self.working_of.values():
            if w.grad is None:
                continue
            if set_to_none:
                w.grad = None
            else:
                w.grad.detach_().zero_()

    def state_dict(self) -> dict[str, Any]:  # noqa: D102
        state = super().state_dict()
        state["master_params"] = [m for g in self.param_groups for m in g["params"]]  # torch's index order
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's state (moments, steps, groups), then the masters, and the working weights from them."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("master_params", None)
        masters = [m for g in self.param_groups for m in g["params"]]
        if saved is None or len(saved) != len(masters):
            raise UserError(f"optimizer state without float32 master weights for the {len(masters)} trainable "
                            "tensors (saved by a run of other numerics, train.param_dtype / master_dtype); delete "
                            "the checkpoints to start over")
        for m, s in zip(masters, saved):
            if tuple(s.shape) != tuple(m.shape):
                raise UserError(f"optimizer state: a master weight of shape {tuple(s.shape)} where the model has "
                                f"{tuple(m.shape)} (another model config); delete the checkpoints to start over")
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for m, s in zip(masters, saved):
                m.copy_(s)
                self.working_of[m].data.copy_(m)
