"""Losses of docs/design.md §4: hidden-state regression and the KL to the target's distribution.

    KL(p_t || p_s) = Σ_v p_t(v) (log p_t(v) − log p_s(v)),   p_t = softmax(W_lm F_t),  p_s = softmax(W_lm F_s)

with F_t = N_f(H_{i+1}) the target's post-norm feature and F_s = N_o(Ĥ_i) the head's. The vocabulary
projection dominates time and memory (tokens × vocab floats per logit tensor), so `fused_linear_kl`
works in chunks of rows and computes each chunk's gradient in the forward pass (the loss is a sum,
so d loss / d F_s = (softmax(s) − p_t) W_lm is known then): no [N, V] tensor is ever kept for
backward, nothing is recomputed, and peak memory is a few × chunk × V floats whatever N is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def hidden_regression(pred: torch.Tensor, target: torch.Tensor, normed: bool = True,
                      row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over rows of the mean SmoothL1 for [N, H] (each row times `row_weight` [N] when given). `normed`
    compares RMS-normalised vectors: the pre-norm residual stream has a few huge channels that would otherwise
    dominate the loss."""
    if normed:
        pred, target = rms_normalize(pred.float()), rms_normalize(target.float())
    rows = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)
    return (rows if row_weight is None else rows * row_weight.to(rows.dtype)).sum()


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _FusedLinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor,
                student_weight: torch.Tensor | None, student_ids: torch.Tensor | None, chunk_size: int,
                mm_dtype: torch.dtype, softcap: float | None, temperature: float,
                row_weight: torch.Tensor | None):
        w = weight.to(mm_dtype)
        ws = w if student_weight is None else student_weight.to(mm_dtype)
        acc = torch.promote_types(student.dtype, torch.float32)  # softmax arithmetic: fp32 at least
        grad = torch.empty_like(student, dtype=acc) if student.requires_grad else None
        grad_w = (torch.zeros(student_weight.shape, dtype=acc, device=student.device)
                  if student_weight is not None and student_weight.requires_grad else None)
        total = torch.zeros((), dtype=acc, device=student.device)
        hits = torch.empty(student.shape[0], dtype=torch.bool, device=student.device)
        for a in range(0, student.shape[0], chunk_size):
            x = student[a:a + chunk_size].to(mm_dtype)
            s = F.linear(x, ws).to(acc)  # [c, V_s]
            t_full = F.linear(teacher[a:a + chunk_size].to(mm_dtype), w).to(acc)  # [c, V]
            slope = None
            if softcap is not None:  # L = c·tanh(l / c) on both sides; dL/dl = 1 − tanh²(l / c)
                s = s.div_(softcap).tanh_()
                slope = 1 - s * s if (grad is not None or grad_w is not None) else None
                s = s.mul_(softcap)
                t_full = t_full.div_(softcap).tanh_().mul_(softcap)
            if temperature != 1.0:  # the teacher sharpened (< 1) or flattened (> 1); its argmax unchanged
                t_full = t_full.div_(temperature)
            s_top = s.argmax(-1)
            if student_ids is None:
                t = t_full
            else:  # a head over a sub-vocabulary: the teacher restricted to it, agreement in target ids
                t = t_full[:, student_ids]
                s_top = student_ids[s_top]
            hits[a:a + chunk_size] = s_top == t_full.argmax(-1)
            diff = t - s
            m_t, m_s = t.amax(-1, keepdim=True), s.amax(-1, keepdim=True)
            e_t, e_s = t.sub_(m_t).exp_(), s.sub_(m_s).exp_()  # in place: t, s are now exp(· − max)
            z_t, z_s = e_t.sum(-1, keepdim=True), e_s.sum(-1, keepdim=True)
            # Σ p_t (t − s) − lse(t) + lse(s), with lse = log z + max
            kl = (e_t * diff).sum(-1, keepdim=True) / z_t - z_t.log() - m_t + z_s.log() + m_s
            w_rows = None if row_weight is None else row_weight[a:a + chunk_size, None].to(acc)
            total += kl.sum() if w_rows is None else (kl * w_rows).sum()
            if grad is not None or grad_w is not None:
                g_logits = e_s.div_(z_s).sub_(e_t.div_(z_t))  # softmax(s) − p_t
                if w_rows is not None:
                    g_logits = g_logits.mul_(w_rows)
                if slope is not None:
                    g_logits = g_logits.mul_(slope)
                if grad is not None:
                    grad[a:a + chunk_size] = (g_logits.to(mm_dtype) @ ws).to(acc)
                if grad_w is not None:
                    grad_w += (g_logits.to(mm_dtype).T @ x).to(acc)
        ctx.save_for_backward(grad if grad is not None else torch.empty(0),
                              grad_w if grad_w is not None else torch.empty(0))
        ctx.has = (grad is not None, grad_w is not None)
        ctx.dtypes = (student.dtype, student_weight.dtype if student_weight is not None else None)
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, grad_hits):
        grad, grad_w = ctx.saved_tensors
        g_s = (grad * grad_total).to(ctx.dtypes[0]) if ctx.has[0] else None
        g_w = (grad_w * grad_total).to(ctx.dtypes[1]) if ctx.has[1] else None
        return g_s, None, None, g_w, None, None, None, None, None, None


def fused_linear_kl(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor,
                    chunk_size: int = 512, student_weight: torch.Tensor | None = None,
                    student_ids: torch.Tensor | None = None, softcap: float | None = None,
                    teacher_temperature: float = 1.0, row_weight: torch.Tensor | None = None,
                    per_row_agree: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over rows of KL(softmax(W teacher) || softmax(W_s student)) and the count of top-1
    agreements, for post-norm features [N, H] and the target's frozen projection W [V, H].

    W_s defaults to W. A head with its own (trainable) projection passes it as `student_weight`
    [V_s, H] and gets its gradient too; with a sub-vocabulary (EAGLE-3's draft vocabulary) it also
    passes `student_ids` [V_s], the target ids of its rows: the teacher is then W restricted to those
    rows (renormalised over them) and agreement compares target ids with the teacher's full argmax.
    `softcap` c: both sides' logits are the target family's capped c·tanh(l / c) (Gemma 2 style
    `final_logit_softcapping`; heads/base.py `TiedTarget.cap_logits`), and the gradient carries the
    cap's slope. `teacher_temperature` T: the teacher is softmax(logits / T) (T < 1 sharpens it towards its
    argmax, T → 0 is cross-entropy on the target's greedy token; agreement is unchanged). `row_weight` [N]: each
    row's KL (and its gradient) times its weight (agreement still counts every row). `per_row_agree`: the
    agreements as a [N] bool tensor (row i: the student's top-1 is the teacher's) instead of their count. Matmuls run in the
    autocast dtype when autocast is on (bf16 on CPU/GPU), softmax arithmetic in fp32."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"logit softcap {softcap!r}: expected a positive number or None")
    if not teacher_temperature > 0:
        raise ValueError(f"teacher temperature {teacher_temperature!r}: expected a positive number")
    sw = student_weight if student_weight is not None and student_weight is not weight else None
    if row_weight is not None and row_weight.shape != student.shape[:1]:
        raise ValueError(f"row_weight of shape {tuple(row_weight.shape)}: expected one weight per row, "
                         f"({student.shape[0]},)")
    total, hits = _FusedLinearKL.apply(student, teacher.detach(), weight.detach(), sw, student_ids, chunk_size,
                                       _matmul_dtype(student), None if softcap is None else float(softcap),
                                       float(teacher_temperature), None if row_weight is None else row_weight.detach())
    return total, (hits if per_row_agree else hits.sum())


def naive_kl(student: torch.Tensor, teacher: torch.Tensor, student_logits_fn: Callable,
             teacher_logits_fn: Callable, teacher_temperature: float = 1.0,
             row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: full [N, V] logits at once, autograd through everything (what the fused loss must equal)."""
    s = student_logits_fn(student)
    t = teacher_logits_fn(teacher) / teacher_temperature
    acc = torch.promote_types(s.dtype, torch.float32)
    s, t = s.to(acc), t.to(acc)
    rows = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return (rows if row_weight is None else rows * row_weight.to(acc)).sum()


@torch.no_grad()
def greedy_inputs(head, hidden: torch.Tensor, ids: torch.Tensor, chunk_size: int = 512) -> torch.Tensor:
    """[B, T-1] bool: at column j, whether token t_{j+1} is the target's greedy choice after position j,
    argmax W_lm N_f(H_j) — read from the stored states, no target run. A row of depth d whose inputs
    t_{i+1..i+d} all are is one the engine meets when the target decodes greedily (`offpolicy_weight`)."""
    b, t, h = hidden.shape
    flat = hidden[:, :-1].reshape(-1, h)
    top = torch.empty(flat.shape[0], dtype=torch.long, device=hidden.device)
    for a in range(0, flat.shape[0], chunk_size):
        top[a:a + chunk_size] = head.tied.teacher_logits(flat[a:a + chunk_size]).argmax(-1)
    return top.view(b, t - 1) == ids[:, 1:]


def depth_terms(head, preds: torch.Tensor, teacher: torch.Tensor, depth: int, normed: bool = True,
                chunk_size: int = 512, teacher_temperature: float = 1.0, row_weight: torch.Tensor | None = None,
                per_row_agree: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training loss's terms for head states `preds` [N, H] at draft depth `depth` against the target
    states `teacher` [N, H] they estimate (H_{i+d}): (Σ hidden regression — 0 for heads without one
    (eagle3, medusa) —, Σ KL to the target's distribution, top-1 agreements). Sums over the N rows. The
    one definition the training step, the held-out scores and in-loop validation all use (the scores at the
    teacher's own temperature 1; training at `train.module.kl_temperature`). `row_weight` [N]: weighted sums
    (training's `offpolicy_weight`); agreements count every row (`per_row_agree`: one bool per row)."""
    reg_target = head.regression_target(teacher)
    reg = (hidden_regression(preds, reg_target, normed, row_weight) if reg_target is not None
           else preds.new_zeros((), dtype=torch.float32))
    kl, agree = fused_linear_kl(head.features(preds, depth), head.tied.final_norm(teacher), head.tied.lm_head,
                                chunk_size, student_weight=head.lm_head_weight, student_ids=head.draft_ids,
                                softcap=head.tied.conventions.logit_softcap, teacher_temperature=teacher_temperature,
                                row_weight=row_weight, per_row_agree=per_row_agree)
    return reg, kl, agree
