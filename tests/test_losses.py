"""The fused chunked KL == the naive full-logits KL, values and gradients; regression basics."""

import pytest
import torch
import torch.nn.functional as F

from train.losses import fused_linear_kl, hidden_regression, naive_kl


pytestmark = pytest.mark.unit


@pytest.mark.parametrize("chunk", [8, 37, 1000])
def test_fused_kl_matches_naive_values_and_grads(chunk):
    """In float64, so the comparison is about the maths, not about summation order."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 300
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    proj = torch.nn.Linear(h, h, dtype=torch.float64)
    x = torch.randn(n, h, generator=g, requires_grad=True, dtype=torch.float64)
    teacher = torch.randn(n, h, generator=g, dtype=torch.float64)
    fn = lambda z: F.linear(z, w)  # noqa: E731

    ref = naive_kl(proj(x), teacher, fn, fn)
    gx_ref, gw_ref = torch.autograd.grad(ref, [x, proj.weight])
    got, agree = fused_linear_kl(proj(x), teacher, w, chunk_size=chunk)
    gx, gw = torch.autograd.grad(2.0 * got, [x, proj.weight])  # a non-unit upstream gradient
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(gx, 2.0 * gx_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, 2.0 * gw_ref, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        expected_agree = (fn(proj(x)).argmax(-1) == fn(teacher).argmax(-1)).sum()
    assert int(agree) == int(expected_agree)
    assert ref > 0



def student_case(seed: int, student: str, n: int, h: int, v: int, n_ids: int, w_scale: float = 1.0):
    """float64 (generator, W [v, h], draft ids or None, the student's own W_s or None, student rows x, teacher
    rows t) for a `student` kind: `frozen` (W itself), `own-weight` (a trainable W_s near W), `sub-vocab` (W_s over
    n_ids of the rows)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * w_scale
    ids = torch.randperm(v, generator=g)[:n_ids] if student == "sub-vocab" else None
    ws = None
    if student != "frozen":
        base = w if ids is None else w[ids]
        ws = (base + 0.3 * torch.randn(base.shape, generator=g, dtype=torch.float64)).requires_grad_()
    x = torch.randn(n, h, generator=g, requires_grad=True, dtype=torch.float64)
    t = torch.randn(n, h, generator=g, dtype=torch.float64)
    return g, w, ids, ws, x, t


@pytest.mark.parametrize("student", ["frozen", "own-weight", "sub-vocab"])
def test_fused_kl_with_logit_softcap_matches_naive_values_and_grads(student):
    """A family with `final_logit_softcapping` c: both sides' logits are c·tanh(l / c), the fused
    backward multiplies by the cap's slope 1 − tanh². float64 against autograd through the capped
    logits. Logits here reach ±15 against c = 2, so the cap changes the KL (asserted)."""
    cap = 2.0
    _, w, ids, ws, x, t = student_case(3, student, n=23, h=12, v=200, n_ids=60, w_scale=2.0)
    capped = lambda z: torch.tanh(z / cap) * cap  # noqa: E731
    sw = w if ws is None else ws
    t_rows = (lambda z: z) if ids is None else (lambda z: z[:, ids])  # noqa: E731
    ref = naive_kl(x, t, lambda z: capped(F.linear(z, sw)), lambda z: t_rows(capped(F.linear(z, w))))
    wrt = [x] if ws is None else [x, ws]
    ref_grads = torch.autograd.grad(ref, wrt)
    got, agree = fused_linear_kl(x, t, w, chunk_size=5, student_weight=ws, student_ids=ids, softcap=cap)
    grads = torch.autograd.grad(3.0 * got, wrt)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-9)
    for got_g, ref_g in zip(grads, ref_grads):
        torch.testing.assert_close(got_g, 3.0 * ref_g, rtol=1e-9, atol=1e-12)
    uncapped, agree_raw = fused_linear_kl(x, t, w, chunk_size=5, student_weight=ws, student_ids=ids)
    assert abs(float(uncapped) - float(got)) > 0.1 * float(got)  # the cap matters here
    assert int(agree) == int(agree_raw)  # tanh is monotone: the same argmax
    with pytest.raises(ValueError, match="softcap"):
        fused_linear_kl(x, t, w, softcap=0.0)

@pytest.mark.parametrize("own_head", [False, True], ids=["frozen-lm-head", "trainable-student-weight"])
def test_fused_kl_under_bf16_autocast_matches_fp32(own_head):
    """Under bf16 autocast the matmuls take bf16 inputs and return bf16 logits (unit roundoff
    u = 2^-8 ≈ 3.9e-3), softmax arithmetic stays fp32. Observed against the fp32 reference, seed 1:
      * KL 62.24 (62.34 with the student weight): error 0.018 (0.027), relative 2.9e-4 (4.3e-4)
        → bound rtol 1e-3 (≈ 0.062), 2-3× the observed error;
      * d/dx: max abs error 2.7e-3 (2.7e-3) on entries up to 0.46 (0.57), relative norm 4.4e-3 (4.9e-3),
        about u → bounds 1e-2 elementwise and 1.5e-2 in relative norm (3-4×);
      * d/dW_s: max abs error 8.4e-3 on entries up to 1.04, relative norm 8.8e-3 (a sum over rows of
        bf16 products) → bounds 3e-2 elementwise and 3e-2 in relative norm (3.4-3.6×).
    A wrong gradient (a missing term, a wrong scale or sign) is off by O(1) in relative norm."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(500, 32, generator=g) * 0.3
    ws = (w + 0.05 * torch.randn(500, 32, generator=g)).requires_grad_() if own_head else None
    x = torch.randn(20, 32, generator=g, requires_grad=True)
    t = torch.randn(20, 32, generator=g)
    student = ws if own_head else w
    ref = naive_kl(x, t, lambda z: F.linear(z, student), lambda z: F.linear(z, w))  # fp32, full logits
    wrt = [x, ws] if own_head else [x]
    ref_grads = torch.autograd.grad(ref, wrt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = fused_linear_kl(x, t, w, chunk_size=7, student_weight=ws)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=0.0)
    grads = torch.autograd.grad(2.0 * got, wrt)  # a non-unit upstream gradient
    bounds = [(1e-2, 1.5e-2), (3e-2, 3e-2)]  # (elementwise, relative norm) for d/dx, d/dW_s
    for got_g, ref_g, (atol, rel) in zip(grads, ref_grads, bounds):
        assert got_g.dtype == torch.float32
        torch.testing.assert_close(got_g, 2.0 * ref_g, rtol=0.0, atol=2.0 * atol)
        assert float((got_g - 2.0 * ref_g).norm() / (2.0 * ref_g).norm()) < rel


def test_kl_zero_when_student_equals_teacher():
    """Identical logits: each row's KL is lse(t) − lse(s) + 0 in fp32, zero up to the rounding of
    log z (observed 0.0 here, 4.8e-7 with other draws: one ulp of an lse ≈ 4); bound 5e-6, 10 rows × 1 ulp."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=g)
    x = torch.randn(10, 8, generator=g)
    kl, agree = fused_linear_kl(x, x, w, chunk_size=3)
    assert abs(float(kl)) < 5e-6 and int(agree) == 10


def test_hidden_regression_normed_ignores_scale():
    x = torch.randn(5, 8)
    assert float(hidden_regression(3.0 * x, x, normed=True)) < 1e-10
    assert float(hidden_regression(3.0 * x, x, normed=False)) > 0.1


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("student", ["frozen", "sub-vocab"])
def test_fused_kl_with_teacher_temperature_matches_naive(temperature, student):
    """`train.module.kl_temperature` T: the teacher is softmax(W F_t / T). float64 against autograd through
    the naive KL with the teacher's logits divided by T, values and gradients; T moves the KL (asserted),
    not the agreement count (the teacher's argmax is T's), and T ≤ 0 is refused."""
    g = torch.Generator().manual_seed(5)
    n, h, v = 29, 12, 150
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    ids = torch.randperm(v, generator=g)[:40] if student == "sub-vocab" else None
    x = torch.randn(n, h, generator=g, requires_grad=True, dtype=torch.float64)
    t = torch.randn(n, h, generator=g, dtype=torch.float64)
    t_rows = (lambda z: z) if ids is None else (lambda z: z[:, ids])  # noqa: E731
    s_fn = (lambda z: F.linear(z, w)) if ids is None else (lambda z: F.linear(z, w[ids]))  # noqa: E731
    ref = naive_kl(x, t, s_fn, lambda z: t_rows(F.linear(z, w)), teacher_temperature=temperature)
    (gx_ref,) = torch.autograd.grad(ref, [x])
    ws = None if ids is None else w[ids]
    got, agree = fused_linear_kl(x, t, w, chunk_size=6, student_weight=ws, student_ids=ids,
                                 teacher_temperature=temperature)
    (gx,) = torch.autograd.grad(2.0 * got, [x])
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(gx, 2.0 * gx_ref, rtol=1e-9, atol=1e-12)
    plain, agree_plain = fused_linear_kl(x, t, w, chunk_size=6, student_weight=ws, student_ids=ids)
    assert abs(float(plain) - float(got)) > 0.05 * float(plain)
    assert int(agree) == int(agree_plain)
    with pytest.raises(ValueError, match="teacher temperature"):
        fused_linear_kl(x, t, w, teacher_temperature=0.0)


@pytest.mark.parametrize("student", ["frozen", "own-weight", "sub-vocab"])
def test_fused_kl_with_row_weights_matches_naive_values_and_grads(student):
    """`row_weight` (training's `offpolicy_weight`): Σ_i w_i KL_i and its gradient, against autograd through the
    naive full-logits KL with the same weights, in float64; a row of weight 0 is the row left out; agreement still
    counts every row, and `per_row_agree` gives the rows' hits themselves. A weight per row or an error."""
    n, h = 29, 12
    g, w, ids, ws, x, t = student_case(5, student, n=n, h=h, v=150, n_ids=50)
    rw = torch.rand(n, generator=g, dtype=torch.float64)
    rw[::4] = 0.0
    sw = w if ws is None else ws
    t_rows = (lambda z: z) if ids is None else (lambda z: z[:, ids])  # noqa: E731
    s_fn, t_fn = (lambda z: F.linear(z, sw)), (lambda z: t_rows(F.linear(z, w)))  # noqa: E731
    wrt = [x] if ws is None else [x, ws]
    ref = naive_kl(x, t, s_fn, t_fn, row_weight=rw)
    ref_grads = torch.autograd.grad(ref, wrt)
    got, hits = fused_linear_kl(x, t, w, chunk_size=6, student_weight=ws, student_ids=ids, row_weight=rw,
                                per_row_agree=True)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-9)
    for got_g, ref_g in zip(torch.autograd.grad(2.0 * got, wrt), ref_grads):
        torch.testing.assert_close(got_g, 2.0 * ref_g, rtol=1e-9, atol=1e-12)
    plain, agree = fused_linear_kl(x, t, w, chunk_size=6, student_weight=ws, student_ids=ids)
    assert float(got) < float(plain)  # the weights are < 1: a smaller sum, not the unweighted one
    assert hits.dtype == torch.bool and hits.shape == (n,) and int(hits.sum()) == int(agree)
    with torch.no_grad():
        s_top = s_fn(x).argmax(-1) if ids is None else ids[s_fn(x).argmax(-1)]
        torch.testing.assert_close(hits, s_top == F.linear(t, w).argmax(-1), atol=0, rtol=0)
    keep = rw > 0  # weight 0 = the row left out, values and gradients
    dropped, _ = fused_linear_kl(x[keep], t[keep], w, chunk_size=6, student_weight=ws, student_ids=ids,
                                 row_weight=rw[keep])
    torch.testing.assert_close(dropped, got, rtol=1e-10, atol=1e-9)
    ones, _ = fused_linear_kl(x, t, w, chunk_size=6, student_weight=ws, student_ids=ids,
                              row_weight=torch.ones(n, dtype=torch.float64))
    torch.testing.assert_close(ones, plain, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"row_weight of shape \(28,\)"):
        fused_linear_kl(x, t, w, row_weight=rw[1:])
    torch.testing.assert_close(hidden_regression(x, t, row_weight=rw),
                               (F.smooth_l1_loss(F.rms_norm(x, (h,), eps=1e-6), F.rms_norm(t, (h,), eps=1e-6),
                                                 reduction="none").mean(-1) * rw).sum(), rtol=1e-5, atol=1e-7,
                               check_dtype=False)  # hidden_regression computes in float32
