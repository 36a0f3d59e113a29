"""soft_topk_mask(method="ot") at the ends of the range: rows without a finite entry, offsets
``x - t`` beyond the dtype's range (a huge epsilon, rows near ``finfo.max``), and ``|x - t| /
eps`` beyond it (the hard limit). These were the known defects KD3, KD4 and KD10 of the
adversarial suite; each reproducer is kept here, with float64 finite differences on the regimes
the repair opened (the scaled solve of ``softops.topk._ot.SCALE_BITS``)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import softops
from softops.solvers import topk_threshold
from softops.topk._ot import SCALE_BITS, mask_from_threshold, solve

F64 = torch.float64
INF = math.inf


def _grads(x, k, eps, dtype=F64, **kw):
    xt = torch.tensor(x, dtype=F64).to(dtype).requires_grad_()
    et = torch.tensor([eps] * len(x), dtype=F64, requires_grad=True)
    kt = torch.tensor(float(k), dtype=F64, requires_grad=True)
    out = softops.soft_topk_mask(xt, kt, epsilon=et, **kw)
    g = torch.where(torch.isfinite(out), torch.ones_like(out), 0)
    gx, gk, ge = torch.autograd.grad(out, [xt, kt, et], g)
    return out.detach(), gx, gk, ge


def test_kd3_row_without_a_finite_entry_has_zero_gradients():
    out, gx, gk, ge = _grads([[INF, -INF]], 1, 1.0)
    assert out.tolist() == [[1.0, 0.0]]
    assert (gx == 0).all() and (ge == 0).all() and gk == 0, (gx, gk, ge)


def test_kd4_offsets_over_epsilon_beyond_the_range_give_the_hard_limit():
    out, gx, gk, ge = _grads([[1e300, 0.0, 1.0]], 1, 1e-10)
    assert out.tolist() == [[1.0, 0.0, 0.0]]
    assert (gx == 0).all() and (ge == 0).all(), (gx, ge)
    # d(sum A)/dk = 1: the weights in k are a distribution (on the entries nearest t)
    torch.testing.assert_close(gk, torch.tensor(1.0, dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_kd4_saturated_rows_weights_in_k_are_on_the_entries_nearest_the_threshold(dtype):
    # every s underflows; the weights are the limit: softmax(-|x - t| / eps) -> the nearest
    x = torch.tensor([[3.0, 2.0, -5.0, 0.0, 7.0]], dtype=dtype)
    k = torch.tensor(2.0, dtype=F64, requires_grad=True)
    A = softops.soft_topk_mask(x, k, epsilon=1e-30 if dtype == F64 else 1e-20)
    (gk,) = torch.autograd.grad(A, k, torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]], dtype=dtype))
    assert A.tolist() == [[1.0, 0.0, 0.0, 0.0, 1.0]]
    # t is halfway between 3 and 2: the mass of k goes to them, half each
    torch.testing.assert_close(gk.double(), torch.tensor(0.5, dtype=F64))


def test_kd10_near_the_largest_finite_value():
    x = torch.tensor([[0.0] * 7 + [1.7e308]], dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", softops.ConvergenceWarning)
        out = softops.soft_topk_mask(x, 1, epsilon=1e308, largest=False)
    # the same problem at a representable scale
    c = 2.0**-1000
    want = softops.soft_topk_mask(x * c, 1, epsilon=1e308 * c, largest=False)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-15)
    assert abs(float(out.sum()) - 1) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_rows_spanning_more_than_the_range(dtype):
    big = torch.finfo(dtype).max
    x = torch.tensor([[big, -big, 0.0, big / 3], [big, big, -big, -big]], dtype=dtype)
    for eps in (1e-3, 1.0, big / 2**20, big / 4, big):
        for k in (1, 1.5, 2, 3):
            xt = x.clone().requires_grad_()
            et = torch.full((2,), eps, dtype=F64, requires_grad=True)
            A = softops.soft_topk_mask(xt, k, epsilon=et)
            assert not torch.isnan(A).any(), (eps, k, A)
            torch.testing.assert_close(
                A.double().sum(-1), torch.full((2,), float(k), dtype=F64), rtol=1e-5, atol=1e-5
            )
            gx, ge = torch.autograd.grad(A, [xt, et], torch.randn(A.shape, dtype=dtype))
            assert not torch.isnan(gx).any() and not torch.isnan(ge).any(), (eps, k, gx, ge)


def test_scaled_solve_equals_the_problem_at_a_representable_scale():
    # epsilon beyond finfo.max / 2**SCALE_BITS: solved on (x c, eps c); outputs and gradients
    # equal those of the same problem scaled by 2**-1000 by hand (gradients scale alike)
    c = 2.0**-1000
    x = torch.tensor([[0.3, 1.0, 2.2, -0.5, 1.1], [1.7, -0.2, 0.9, 0.0, -3.0]], dtype=F64) * 1e307
    eps = torch.tensor([0.7e307, 2.0e307], dtype=F64)
    assert bool((eps > torch.finfo(F64).max * 2.0**-SCALE_BITS).all())
    k = torch.tensor([2.0, 2.5], dtype=F64)
    outs = []
    for scale in (1.0, c):
        xt = (x * scale).requires_grad_()
        et = (eps * scale).requires_grad_()
        kt = k.clone().requires_grad_()
        A = softops.soft_topk_mask(xt, kt, epsilon=et)
        g = torch.arange(10, dtype=F64).reshape(2, 5).sin()
        gx, gk, ge = torch.autograd.grad(A, [xt, kt, et], g)
        outs.append((A, gx * scale, gk, ge * scale))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_scaled_solve_gradients_match_central_differences():
    x = torch.tensor([[0.3, 1.0, 2.2, -0.5, 1.1]], dtype=F64) * 1e307
    eps = torch.tensor([0.9e307], dtype=F64)
    k = torch.tensor([2.0], dtype=F64)
    w = torch.tensor([[0.3, -1.0, 0.5, 2.0, -0.7]], dtype=F64)
    xt, et, kt = (v.clone().requires_grad_() for v in (x, eps, k))
    A = softops.soft_topk_mask(xt, kt, epsilon=et)
    gx, gk, ge = torch.autograd.grad(A, [xt, kt, et], w)
    dx = torch.tensor([[0.2, -0.1, 0.4, 0.3, -0.5]], dtype=F64) * 1e307 * 1e-5
    de, dk = eps * 1e-5, torch.tensor([1e-5], dtype=F64)

    def f(t):
        return float(
            (softops.soft_topk_mask(x + t * dx, k + t * dk, epsilon=eps + t * de) * w).sum()
        )

    central = (f(1.0) - f(-1.0)) / 2
    analytic = float((gx * dx).sum() + (gk * dk).sum() + (ge * de).sum())
    assert abs(central - analytic) <= 1e-8 * abs(analytic) + 1e-12, (central, analytic)


def test_solver_reports_the_threshold_of_a_scaled_row():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=F64) * 1e300
    eps = torch.tensor([1e300], dtype=F64)
    k = torch.tensor([2.0], dtype=F64)
    state = solve(x, k, eps, k_scalar=2.0)
    assert state.scale is not None and bool(state.converged.all())
    A = mask_from_threshold(x, state, eps)
    torch.testing.assert_close(A.sum(-1), k)
    res = topk_threshold(x, 2, 1e300)
    torch.testing.assert_close(res.threshold, torch.tensor([1.5e300], dtype=F64))
    # rows at an ordinary epsilon are not scaled
    assert solve(x / 1e300, k, eps / 1e300, k_scalar=2.0).scale is None


def test_saturated_rows_central_differences_in_epsilon_are_zero():
    # the hard limit: the mask does not move with epsilon, nor does the gradient claim it does
    x = torch.tensor([[1e300, 0.0, 1.0, -2e300]], dtype=F64)
    out, gx, _, ge = _grads(x.tolist(), 2, 1e-5)
    for e in (1e-5 * (1 - 1e-5), 1e-5 * (1 + 1e-5)):
        assert torch.equal(softops.soft_topk_mask(x, 2, epsilon=e), out)
    assert (ge == 0).all() and (gx == 0).all()


def test_jvp_in_the_saturated_and_scaled_regimes_matches_the_backward():
    for x, eps in (([[1e300, 0.0, 1.0]], 1e-10), ([[0.0] * 3 + [1.7e308]], 1e308)):
        xt = torch.tensor(x, dtype=F64)
        et = torch.tensor([eps], dtype=F64)
        k = torch.tensor([1.0], dtype=F64)

        def fn(x_, k_, e_):
            return softops.soft_topk_mask(x_, k_.squeeze(-1)[..., None], epsilon=e_)

        dx = torch.full_like(xt, eps * 1e-3)
        dk = torch.tensor([0.1], dtype=F64)
        de = et * 0.01
        _, tangent = torch.func.jvp(fn, (xt, k, et), (dx, dk, de))
        assert not torch.isnan(tangent).any(), tangent
        out, vjp = torch.func.vjp(fn, xt, k, et)
        g = torch.ones_like(out)
        gx, gk, ge = vjp(g)
        want = (gx * dx).sum() + (gk * dk).sum() + (ge * de).sum()
        torch.testing.assert_close((tangent * g).sum(), want, rtol=1e-9, atol=1e-12)
