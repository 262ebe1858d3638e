"""The fused chunked KL == the naive full-logits KL, values and gradients; regression basics."""

import pytest
import torch
import torch.nn.functional as F

from train.losses import fused_linear_kl, hidden_regression, naive_kl


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


def test_fused_kl_under_bf16_autocast_is_close():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(500, 32, generator=g) * 0.3
    x = torch.randn(20, 32, generator=g, requires_grad=True)
    t = torch.randn(20, 32, generator=g)
    ref = naive_kl(x, t, lambda z: z @ w.T, lambda z: z @ w.T)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = fused_linear_kl(x, t, w, chunk_size=7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=3e-2, atol=0.5)
    got.backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_kl_zero_when_student_equals_teacher():
    w = torch.randn(50, 8)
    x = torch.randn(10, 8)
    kl, agree = fused_linear_kl(x, x, w, chunk_size=3)
    assert abs(float(kl)) < 1e-4 and int(agree) == 10


def test_hidden_regression_normed_ignores_scale():
    x = torch.randn(5, 8)
    assert float(hidden_regression(3.0 * x, x, normed=True)) < 1e-10
    assert float(hidden_regression(3.0 * x, x, normed=False)) > 0.1
