"""DSpark training objective, computed in vocabulary chunks (no full-vocab fp32 tensor for all slots at once).

Shape legend: B batch, A anchors, S slots, N valid slots, n slots of a chunk, V vocab, Ht target hidden,
H draft hidden, r Markov rank.

Per valid slot i (position weight ``w_i = exp(-j/gamma)``, j the slot index in its block):

- draft logits ``l_i = lm_head(h_i) + W2 u_i`` (u_i: the Markov head type's W2 input, ``draft.markov_block``; the
  features ``m_i`` for a vanilla head) -> ``q_i = softmax(l_i)``; teacher
  ``p_i = softmax(lm_head(last_hidden))`` at the same position (the target's next-token distribution for that slot's token);
- ``CE_i = -log q_i(token)``, ``L1_i = sum_v |q_i - p_i|``, overlap ``a_i = 1 - 0.5 L1_i`` (stop-gradient);
- confidence ``BCE_with_logits(s_i, a_i)``.

Sums returned (the trainer divides by the global denominator ``weight = sum w_i`` over valid slots):
``distill = sum w_i (ce_alpha CE_i + l1_alpha L1_i)`` and ``confidence = sum w_i BCE_i`` (the loss terms),
``ce``, ``l1``, ``conf`` (the same sums, detached, for logging), ``tau_prob`` and ``accept_rate@i``.

Memory: :class:`_ChunkedDistill` walks the N slots ``vocab_chunk_slots`` at a time. For each chunk it
forms the draft and teacher logits [n, V] (float32 accumulation), the per-slot CE / L1, and -- when a
gradient is wanted -- the analytic gradient of ``distill`` w.r.t. the logits, which it immediately pushes
through the LM head and W2 (``[dh ; dm] = G [W_lm ; W2]``, ``dW2 += G^T m``). The Markov bias rides in the
LM-head GEMM (``[h ; m] @ [W_lm ; W2]^T``, the weights concatenated once per step), so the float32 logits
are written once, not re-read and re-written by a second GEMM's epilogue. Only [N, Ht], [N, r] and
[V, r] gradients are kept for backward, so peak memory is a few [n, V] float32 buffers and the LM-head
matmuls run 3 times (2 forward, 1 backward) instead of 5 with per-chunk recomputation. The frozen
LM head gets no gradient. Overlapping blocks share teacher positions: with the collate's ``teacher_rows``
(``anchors.teacher_fields``) a chunk's teacher GEMM covers only the unique positions its slots read (about half
the rows when anchors are dense) and the chunk math reads each slot's teacher row through ``teacher_index``.

A reduced draft vocabulary (``draft.vocab_size``, ``draft/vocab.py``): the draft's logits are over its Vd tokens
only (LM-head rows ``d2t``, W2 [Vd, r]), the teacher's over V; the chunk math sees the teacher's Vd columns of the
draft's tokens [n, Vd] with its logsumexp over all V, and adds the teacher's mass outside them, ``1 - sum p``, to
L1 (q is 0 there), so L1 and the overlap are against the full teacher. A slot whose token is outside the draft vocabulary has no CE term (see
:func:`chunked_distill`).

``loss.teacher_vocab: draft`` (with a reduced draft vocabulary) restricts the teacher to the draft's Vd tokens too,
as the ``speculators`` trainer does: ``p~ = softmax(lm_head(last_hidden)[d2t])`` renormalised over the Vd, so the
teacher GEMM reads Vd LM-head rows instead of V and the chunk math sees [n, Vd]. The trade-off: L1 (and the
overlap, the confidence target, the logged ``tau_prob``) then ignore the teacher's mass outside the draft
vocabulary, ``L1~ = sum_{v in draft} |q_v - p~_v|``, an optimistic distance to the target. eval_offline always
measures against the full teacher.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from dspark_core.draft.anchors import TeacherPlan
from dspark_core.draft.config import LossConfig
from dspark_core.errors import UserError
from dspark_core.metrics import block_metric_sums, overlap_from_l1

PROFILE_RANGE = "dspark.chunked_distill"  # the profiler range around the chunked loss (LM-head GEMMs, chunk math)
_OUT_DTYPE_OK: dict[str, bool] = {}
_compiled_math: Any = None


def slot_weights(slot_valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """slot_valid [..., S] -> exp(-j / gamma) on valid slots, 0 elsewhere (float32)."""
    slots = slot_valid.shape[-1]
    decay = torch.exp(-torch.arange(slots, device=slot_valid.device, dtype=torch.float32) / gamma)  # [S]
    return slot_valid.float() * decay


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 result (bf16 inputs accumulate in fp32; CUDA writes fp32 directly when it can)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _out_dtype_ok(a):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _add_mm_f32_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c += a @ b in place, c float32 (in the GEMM epilogue: no extra [n, V] tensor, when supported)."""
    if a.dtype == torch.float32:
        torch.addmm(c, a, b, out=c)
    elif a.is_cuda and _out_dtype_ok(a):
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    else:
        c += (a @ b).float()


def _out_dtype_ok(a: torch.Tensor) -> bool:
    """Whether this build has the fp32-output (add)mm for ``a``'s dtype on its device (checked once)."""
    key = f"{a.device}:{a.dtype}"
    if key not in _OUT_DTYPE_OK:
        try:
            x = torch.ones(2, 2, device=a.device, dtype=a.dtype)
            c = torch.ones(2, 2, device=a.device, dtype=torch.float32)
            torch.addmm(c, x, x, out_dtype=torch.float32, out=c)
            _OUT_DTYPE_OK[key] = (torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
                                  and bool((c == 3).all()))
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_OK[key] = False
    return _OUT_DTYPE_OK[key]


def chunk_math(logits: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
               ce_alpha: float, l1_alpha: float, grad_dtype: torch.dtype | None,
               ce_rows: torch.Tensor | None = None, teacher_lse: torch.Tensor | None = None,
               teacher_index: torch.Tensor | None = None):
    """Draft and teacher logits [n, V] float32 -> CE [n], L1 [n] and
    G = d(sum w (ce_alpha c CE + l1_alpha L1)) / d logits [n, V] in ``grad_dtype`` (None: no gradient), with
    c = ``ce_rows`` [n] (1: the row has a CE term, 0: none; None: every row has one). CE is returned for every row.

    ``teacher_lse`` [n] (a reduced draft vocabulary, the teacher full): the columns are the draft's tokens of a
    teacher over more tokens, whose logsumexp this is; p = exp(t - teacher_lse) and L1 adds the teacher's mass
    outside the columns, ``1 - sum p`` (q is 0 there; the gradient has no term from it).

    ``teacher_index`` [n]: row i's teacher is ``teacher[teacher_index[i]]`` (teacher [u, V], teacher_lse [u]:
    positions shared by overlapping blocks, each computed once); None: row i's.

    dCE/dl = q - onehot(t); dL1/dl = q * (s - <q, s>) with s = sign(q - p).
    """
    if teacher_index is not None:
        teacher = teacher.index_select(0, teacher_index)  # [n, V]
        teacher_lse = None if teacher_lse is None else teacher_lse.index_select(0, teacher_index)  # [n]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [n, 1]
    q = torch.exp(logits - lse)  # [n, V]
    if teacher_lse is None:
        p = torch.softmax(teacher, dim=-1)  # [n, V]
    else:
        p = torch.exp(teacher - teacher_lse.unsqueeze(-1))  # [n, V], summing to 1 - the mass outside
    ce = lse.squeeze(-1) - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [n]
    diff = q - p
    l1 = diff.abs().sum(dim=-1)  # [n]
    if teacher_lse is not None:
        l1 = l1 + (1.0 - p.sum(dim=-1)).clamp_min(0.0)
    if grad_dtype is None:
        return ce, l1, None
    sign = torch.sign(diff)
    qs = (q * sign).sum(dim=-1, keepdim=True)  # [n, 1]
    w = weights.unsqueeze(-1)  # [n, 1]
    cw = ce_alpha if ce_rows is None else ce_alpha * ce_rows.unsqueeze(-1)  # the rows' CE weight [n, 1]
    grad = q * (w * (l1_alpha * (sign - qs) + cw))  # [n, V]
    grad = grad.scatter_add(-1, targets.unsqueeze(-1), -cw * w)
    return ce, l1, grad.to(grad_dtype)


LOSS_KERNELS = ("auto", "triton", "compile", "torch")
LOSS_KERNEL = "auto"  # params train.loss_kernel, through set_loss_kernel


def set_loss_kernel(choice: str) -> None:
    """Choose the chunk math's implementation (``train.loss_kernel``; see :func:`loss_kernel`)."""
    global LOSS_KERNEL
    if choice not in LOSS_KERNELS:
        raise UserError(f"train.loss_kernel must be one of {', '.join(LOSS_KERNELS)}; got {choice!r}")
    LOSS_KERNEL = choice


def loss_kernel(device: torch.device) -> str:
    """Which implementation of the chunk math runs: ``LOSS_KERNEL`` (auto | triton | compile | torch), where
    auto = the Triton kernels on CUDA when Triton imports, else torch.compile on CUDA, else eager torch.

    A speed knob, not a hyperparameter: every choice computes the same numbers (tests), so it is an execution
    key of ``train`` (a checkpoint resumes under any choice)."""
    from dspark_core.kernels import triton_ok

    choice = LOSS_KERNEL
    if choice == "auto":
        if device.type != "cuda":
            return "torch"
        return "triton" if triton_ok(device) else "compile"
    if choice == "triton" and not triton_ok(device):
        raise UserError(f"train.loss_kernel: triton, but Triton cannot run on {device}; use auto")
    return choice


def _math_fn(device: torch.device):
    """The chunk math for ``device`` (see :func:`loss_kernel`). It is memory-bound: a dozen passes over [n, V].
    The compiled variant uses dynamic shapes: the last chunk's size varies from step to step."""
    global _compiled_math
    kind = loss_kernel(device)
    if kind == "triton":
        from dspark_core.kernels.distill import chunk_math_triton

        return chunk_math_triton
    if kind == "compile":
        if _compiled_math is None:
            _compiled_math = torch.compile(chunk_math, dynamic=True)
        return _compiled_math
    return chunk_math


class _ChunkedDistill(torch.autograd.Function):
    """See the module docstring. Outputs ``distill`` [] (differentiable), ``ce`` [N], ``l1`` [N] (detached)."""

    @staticmethod
    def forward(ctx, head_h, markov, w2, lm_w, teacher_h, targets, weights, ce_alpha, l1_alpha, chunk,
                cdtype, with_grad, d2t, ce_rows, teacher_draft, teacher_index, plan):
        n_slots = head_h.shape[0]
        dev = head_h.device
        with torch.autocast(dev.type, enabled=False):
            w_lm = lm_w.to(cdtype)  # [V, Ht] (no copy when already cdtype)
            w_dr = w_lm if d2t is None else w_lm.index_select(0, d2t)  # the draft's head rows [Vd, Ht]
            w_teach = w_dr if teacher_draft else w_lm  # the teacher's rows [Vd, Ht] | [V, Ht]
            outside = d2t is not None and not teacher_draft  # the full teacher beside a reduced draft
            ht = head_h.shape[1]
            if markov is not None:  # lm_head(h) + W2 m as one GEMM [h ; m] @ [W_lm ; W2]^T: one pass over [n, V]
                w_in = torch.cat([w_dr, w2.to(cdtype)], dim=1)  # [Vd, Ht + r]
                x_in = torch.cat([head_h.to(cdtype), markov.to(cdtype)], dim=1)  # [N, Ht + r]
            else:
                w_in, x_in = w_dr, head_h  # [Vd, Ht], [N, Ht]
            ce = torch.empty(n_slots, device=dev)
            l1 = torch.empty(n_slots, device=dev)
            d_in = torch.empty(n_slots, w_in.shape[1], device=dev) if with_grad else None  # [N, Ht (+ r)]
            d_w2 = torch.zeros(w2.shape, device=dev) if with_grad and markov is not None else None  # [V, r]
            math = _math_fn(dev)
            for s in range(0, n_slots, chunk):
                e = min(n_slots, s + chunk)
                logits = mm_f32(x_in[s:e].to(cdtype), w_in.t())  # [n, Vd]
                t_lo, t_hi = (s, e) if plan is None else plan.rows(s, e)  # the teacher rows these slots read
                t_idx = None if plan is None else teacher_index[s:e] - t_lo  # [n] a slot's row among them
                teacher = mm_f32(teacher_h[t_lo:t_hi].to(cdtype), w_teach.t())  # [u, V] | [u, Vd]
                t_lse = None
                if outside:  # the full teacher's lse [u] and its draft-vocabulary columns [u, Vd]
                    t_lse, teacher = torch.logsumexp(teacher, dim=-1), teacher.index_select(1, d2t)
                rows = None if ce_rows is None else ce_rows[s:e]  # [n] 0: a token outside the draft vocabulary
                ce_c, l1[s:e], g = math(logits, teacher, targets[s:e], weights[s:e], ce_alpha, l1_alpha,
                                        cdtype if with_grad else None, rows, t_lse, t_idx)
                ce[s:e] = ce_c if rows is None else torch.where(rows > 0, ce_c, 0.0)  # no CE term: reported 0
                del logits, teacher
                if with_grad:
                    d_in[s:e] = mm_f32(g, w_in)  # [dh ; dm]
                    if markov is not None:
                        _add_mm_f32_(d_w2, g.t(), x_in[s:e, ht:])  # dW2 += G^T m in the GEMM epilogue
            d_head = d_in[:, :ht] if with_grad else None  # [N, Ht]
            d_mk = d_in[:, ht:] if with_grad and markov is not None else None  # [N, r]
            distill = (weights * (ce_alpha * ce + l1_alpha * l1)).sum()
        ctx.save_for_backward(d_head, d_mk, d_w2)
        ctx.dtypes = (head_h.dtype, None if markov is None else markov.dtype, None if w2 is None else w2.dtype)
        ctx.mark_non_differentiable(ce, l1)
        return distill, ce, l1

    @staticmethod
    def backward(ctx, g_distill, _g_ce, _g_l1):
        d_head, d_mk, d_w2 = ctx.saved_tensors
        if d_head is None:
            raise RuntimeError("_ChunkedDistill: backward without gradients computed in forward")
        h_dt, m_dt, w2_dt = ctx.dtypes
        grad_h = (g_distill * d_head).to(h_dt)
        grad_m = (g_distill * d_mk).to(m_dt) if d_mk is not None and ctx.needs_input_grad[1] else None
        grad_w2 = (g_distill * d_w2).to(w2_dt) if d_w2 is not None and ctx.needs_input_grad[2] else None
        return (grad_h, grad_m, grad_w2) + (None,) * 14


def chunked_distill(head_h: torch.Tensor, markov: torch.Tensor | None, w2: torch.Tensor | None,
                    lm_w: torch.Tensor, teacher_h: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                    ce_alpha: float, l1_alpha: float, chunk_slots: int, d2t: torch.Tensor | None = None,
                    teacher_vocab: str = "full", teacher_index: torch.Tensor | None = None,
                    plan: TeacherPlan | None = None):
    """(distill [], ce [N], l1 [N]) for head_h [N, Ht] (draft states the LM head reads), markov [N, r] with
    w2 [Vd, r] (or None, None), lm_w [V, Ht] frozen, teacher_h [N, Ht], targets [N], weights [N].

    ``teacher_index`` [N] with its ``plan`` (``anchors.teacher_fields``): teacher_h holds U unique positions
    [U, Ht] and slot i reads row ``teacher_index[i]``; a chunk's teacher GEMM covers only the rows its slots read.

    ``d2t`` [Vd] (a reduced draft vocabulary, ``draft/vocab.py``): the draft's logits are over the LM head's rows
    ``d2t`` and ``targets`` are draft ids (-1: outside the draft vocabulary); the teacher stays the full
    vocabulary's: ``L1 = sum_{v in draft} |q_v - p_v| + p(outside)`` (q is 0 outside), so the overlap
    ``1 - L1 / 2`` is the acceptance probability against the target. A slot whose token is outside the draft
    vocabulary has no CE term (reported CE 0); its L1 term stays. ``d2t`` None: Vd = V, draft ids = target ids.

    ``teacher_vocab`` ``draft``: the teacher over the ``d2t`` rows only, renormalised there (``L1 = sum_{v in
    draft} |q_v - p~_v|``, see the module docstring); with ``d2t`` None it is the ``full`` loss (no-op).

    Matmuls run in the autocast dtype when autocast is on, else in ``lm_w``'s dtype; softmax math in fp32.
    """
    if (markov is None) != (w2 is None):
        raise ValueError("chunked_distill: give both markov and w2, or neither")
    if lm_w.requires_grad:
        raise ValueError("chunked_distill: the LM head must be frozen (requires_grad=False)")
    if (teacher_index is None) != (plan is None) or (plan is not None and len(plan) != head_h.shape[0]):
        raise ValueError("chunked_distill: teacher_index and plan go together, one entry per slot")
    if teacher_vocab not in ("full", "draft"):
        raise ValueError(f"chunked_distill: teacher_vocab must be full or draft; got {teacher_vocab!r}")
    dev = head_h.device
    cdtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else lm_w.dtype
    inputs = [t for t in (head_h, markov, w2) if t is not None]
    with_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    ce_rows = None
    if d2t is not None:  # on the device (no host read): 0 where the token is outside the draft vocabulary
        ce_rows = (targets >= 0).float()  # [N]
        targets = targets.clamp(min=0)
    with torch.profiler.record_function(PROFILE_RANGE):  # names the loss's kernels in a profile (bench_train_step)
        return _ChunkedDistill.apply(head_h, markov, w2, lm_w, teacher_h, targets, weights.float(), float(ce_alpha),
                                     float(l1_alpha), int(chunk_slots), cdtype, with_grad, d2t, ce_rows,
                                     teacher_vocab == "draft" and d2t is not None, teacher_index, plan)


def _valid_slot_index(batch: Mapping[str, torch.Tensor]):
    """(b [N], a [N], j [N]) of the valid slots, in ``slot_valid.nonzero()`` order."""
    if "slot_index" in batch:  # precomputed by the collate (no device sync)
        return tuple(batch["slot_index"].to(batch["slot_valid"].device).unbind(0))
    return batch["slot_valid"].bool().nonzero(as_tuple=True)


def slot_outputs(draft, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor], cfg: LossConfig,
                 extras: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Per valid slot (``slot_valid.nonzero()`` order): weights, distill sum, ce, l1, overlap a, conf logits.

    hidden [B, A, S, H] from ``draft.forward_train``; batch holds anchors, slot_valid, targets,
    prev_tokens [B, A, S] and last_hidden [B, L, Ht].
    """
    b, a, j = _valid_slot_index(batch)
    weights = slot_weights(batch["slot_valid"], cfg.decay_gamma)[b, a, j]  # [N]
    h = hidden[b, a, j]  # [N, H]
    m_all = draft.markov_features(batch["prev_tokens"], hidden, extras)  # [B, A, S, r] | None
    m = m_all[b, a, j] if m_all is not None else None  # [N, r]
    u = draft.markov_block(m_all, hidden)[b, a, j] if m_all is not None else None  # [N, r] W2's input
    plan = batch.get("teacher_plan")  # the collate's unique teacher positions (anchors.teacher_fields)
    if plan is not None and len(plan) == b.shape[0]:
        rows, t_index = batch["teacher_rows"], batch["teacher_index"]  # [2, U], [N]
        mine = rows.index_select(1, t_index)  # [2, N] each slot's (row, position) as the collate saw it
        torch._assert_async(((mine[0] == b) & (mine[1] == batch["anchors"][b, a] + j)).all(),  # no host read
                            "the batch's teacher_rows were made for other anchors: a hook that moves anchors must "
                            "drop anchors.TEACHER_KEYS")
        teacher = batch["last_hidden"][rows[0], rows[1]]  # [U, Ht]
    else:
        plan = t_index = None
        teacher = batch["last_hidden"][b, batch["anchors"][b, a] + j]  # [N, Ht]
    w2 = draft.markov.w2.weight if m is not None else None
    vocab = getattr(draft, "draft_vocab", None)  # a reduced draft vocabulary (draft/vocab.py) or None
    targets = batch["targets"][b, a, j]  # [N] target ids
    distill, ce, l1 = chunked_distill(draft.head_states(h), u, w2, draft.lm_head_weight, teacher,
                                      targets if vocab is None else vocab.to_draft(targets), weights, cfg.ce_alpha,
                                      cfg.l1_alpha, cfg.vocab_chunk_slots, None if vocab is None else vocab.d2t,
                                      cfg.teacher_vocab, t_index, plan)
    return {"weights": weights, "distill": distill, "ce": ce, "l1": l1, "overlap": overlap_from_l1(l1),
            "conf_logits": draft.confidence_logits(h, m), "index": torch.stack([b, a, j])}


def dspark_sums(draft, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor], cfg: LossConfig,
                extras: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Loss numerators and metric numerators of one micro-batch (see the module docstring)."""
    out = slot_outputs(draft, hidden, batch, cfg, extras)
    w, a = out["weights"], out["overlap"]
    sums = {"distill": out["distill"], "ce": (w * out["ce"]).sum(), "l1": (w * out["l1"]).sum()}
    if out["conf_logits"] is not None:
        bce = F.binary_cross_entropy_with_logits(out["conf_logits"], a, reduction="none")  # [N]
        sums["confidence"] = (w * bce).sum()
        sums["conf"] = sums["confidence"].detach()
    a_full = torch.zeros(batch["slot_valid"].shape, device=a.device)  # [B, A, S]
    a_full[tuple(out["index"])] = a
    tau, acc = block_metric_sums(a_full, batch["slot_valid"])
    sums["tau_prob"] = tau
    for i in range(acc.shape[0]):
        sums[f"accept_rate@{i}"] = acc[i]
    return sums
