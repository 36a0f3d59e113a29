"""soft_sort / soft_rank / soft_argsort(method="ot") where the cost in units of epsilon, or its
derivative in epsilon, leaves the dtype's range: epsilon below 1e-154 (epsilon**2 underflows),
wide rows ((x_i - x_j)**2 / eps**2 overflows) and costs (x_i - x_j)**2 beyond 1e308. These were
the known defects KD1 (ot) and KD7 (ot) of the adversarial suite; the reproducers are kept here,
with float64 central differences on the regimes the repair opened."""

from __future__ import annotations

import pytest
import torch

import softops

F64 = torch.float64


def _grads(x, eps, op=softops.soft_sort):
    xt = torch.tensor(x, dtype=F64, requires_grad=True)
    et = torch.tensor([eps] * len(x), dtype=F64, requires_grad=True)
    out = op(xt, epsilon=et, method="ot")
    g = torch.where(torch.isfinite(out), torch.ones_like(out), 0)
    gx, ge = torch.autograd.grad(out, [xt, et], g)
    return out.detach(), gx, ge


def test_kd1_tiny_epsilon_gives_the_hard_limit():
    out, gx, ge = _grads([[0.0, 1.0, 2.0]], 1e-200)
    assert out.tolist() == [[0.0, 1.0, 2.0]]
    assert (ge == 0).all() and torch.equal(gx, torch.ones_like(gx)), (gx, ge)


def test_kd1_wide_row():
    out, _, ge = _grads([[0.0, 1e100]], 1e-60)
    assert out.tolist() == [[0.0, 1e100]]
    assert (ge == 0).all(), ge


def test_kd7_cost_beyond_the_range():
    out, gx, ge = _grads([[0.0, 1e155]], 1.0)
    assert out.tolist() == [[0.0, 1e155]]
    assert (ge == 0).all() and not torch.isnan(gx).any(), (gx, ge)


@pytest.mark.parametrize("op", [softops.soft_rank, softops.soft_argsort])
def test_ranks_and_plans_at_the_extremes_have_finite_gradients(op):
    for x, eps in (
        ([[0.0, 1.0, 2.0]], 1e-200),
        ([[0.0, 1e100, -3e100]], 1e-60),
        ([[0.0, 1e155, 2.0]], 1.0),
    ):
        out, gx, ge = _grads(x, eps, op)
        assert not torch.isnan(out).any() and not torch.isnan(gx).any(), (x, out, gx)
        assert (ge == 0).all(), (x, ge)


def _central(x, eps, dx, de, w):
    xt, et = x.clone().requires_grad_(), eps.clone().requires_grad_()
    out = softops.soft_sort(xt, epsilon=et, method="ot", tol=1e-13)
    gx, ge = torch.autograd.grad(out, [xt, et], w)
    analytic = float((gx * dx).sum() + (ge * de).sum())

    def f(t):
        v = softops.soft_sort(x + t * dx, epsilon=eps + t * de, method="ot", tol=1e-13)
        return float((v * w).sum())

    return (f(1.0) - f(-1.0)) / 2, analytic


@pytest.mark.parametrize(
    "scale, eps",
    [
        (1e-150, 1e-300),  # epsilon**2 underflows; the cost is O(1) in its units
        (1e154, 1e308),  # (x_i - x_j)**2 overflows; the cost is O(1) in its units
        (1.0, 1.0),
    ],
)
def test_gradients_match_central_differences_where_eps_squared_or_the_cost_leave_the_range(
    scale, eps
):
    x = torch.tensor([[0.0, 1.0, 2.5, 0.4]], dtype=F64) * scale
    e = torch.tensor([eps * 0.8], dtype=F64)
    w = torch.tensor([[0.3, -1.0, 0.5, 2.0]], dtype=F64)
    dx = torch.tensor([[0.2, -0.1, 0.4, 0.3]], dtype=F64) * scale * 1e-5
    de = e * 1e-5
    central, analytic = _central(x, e, dx, de, w)
    size = abs(analytic) + 1e-300
    assert abs(central - analytic) <= 1e-6 * size, (central, analytic)


@pytest.mark.parametrize(
    "kw",
    [
        {"method": "ot"},
        {"method": "softsort", "distance": "l2"},
        {"method": "neuralsort"},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kd19_sort_of_subnormal_rows_is_a_convex_combination(kw, dtype):
    """(KD19) The sorted values ``P @ x`` of a row of subnormal entries: every product
    ``P_ij x_j`` rounded to the dtype's absolute grid, so a constant row of 5e-323 came back
    3.5e-323 (outside [min x, max x]). The combination is now formed on the row scaled by a
    power of two and scaled back once. At every epsilon the op takes (from the smallest normal
    number, far above the squared gaps) the value is the row's mean up to about gap**2 /
    epsilon, nothing in the dtype: the output equals the exact mean to one subnormal ulp, and a
    constant row comes back exactly."""
    fi = torch.finfo(dtype)
    ulp = fi.smallest_normal * fi.eps  # the smallest subnormal
    g = torch.Generator().manual_seed(19)
    for n in (1, 2, 5, 7):
        const = torch.full((2, n), 10 * ulp, dtype=F64).to(dtype)
        assert torch.equal(softops.soft_sort(const, epsilon=1.0, **kw), const)
        units = torch.randint(-300, 300, (3, n), generator=g).to(F64)
        x = (units * ulp).to(dtype)
        mean = units.mean(-1, keepdim=True) * ulp
        for eps in (fi.smallest_normal, 1e-30, 1.0):
            got = softops.soft_sort(x, epsilon=eps, **kw).double()
            assert ((got - mean).abs() <= ulp).all(), (x, got, mean)
            lo, hi = x.double().amin(-1, keepdim=True), x.double().amax(-1, keepdim=True)
            assert ((got >= lo) & (got <= hi)).all(), (x, got)
