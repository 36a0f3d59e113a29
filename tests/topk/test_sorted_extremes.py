"""soft_topk (the sorted SOFT top-k) where the derivative of cost / epsilon in epsilon leaves the
dtype's range: epsilon below 1e-154 (epsilon**2 underflows) and, in float32, costs of 1e30 at a
small epsilon. These were the known defects KD1 (topk) and KD7 (topk) of the adversarial suite;
the reproducers are kept here, with float64 central differences on the regime the repair
opened."""

from __future__ import annotations

import pytest
import torch

import softops

F64 = torch.float64


def _grads(x, k, eps, dtype=F64, **kw):
    xt = torch.tensor(x, dtype=F64).to(dtype).requires_grad_()
    et = torch.tensor([eps] * len(x), dtype=F64, requires_grad=True)
    out = softops.soft_topk(xt, k, epsilon=et, **kw).values
    g = torch.where(torch.isfinite(out), torch.ones_like(out), 0)
    gx, ge = torch.autograd.grad(out, [xt, et], g)
    return out.detach(), gx, ge


def test_kd1_tiny_epsilon_gives_the_hard_limit():
    out, gx, ge = _grads([[0.0, 1.0, 2.0]], 1, 1e-200)
    assert out.tolist() == [[2.0]]
    assert (ge == 0).all() and gx.tolist() == [[0.0, 0.0, 1.0]], (gx, ge)


def test_kd7_float32_cost_of_1e30():
    out, _, ge = _grads([[0.0, 1e30]], 1, 1e-5, torch.float32, largest=False)
    assert out.tolist() == [[0.0]]
    assert (ge == 0).all(), ge


@pytest.mark.parametrize("scale", [1e-160, 1.0, 1e150])
def test_gradients_match_central_differences_at_any_scale(scale):
    # epsilon in the units of x: at 1e-160, epsilon**2 underflows
    x = torch.tensor([[0.0, 1.0, 2.5, 0.4, -1.2]], dtype=F64) * scale
    eps = torch.tensor([0.6], dtype=F64) * scale
    w = torch.tensor([[0.3, -1.0]], dtype=F64)
    dx = torch.tensor([[0.2, -0.1, 0.4, 0.3, -0.5]], dtype=F64) * scale * 1e-5
    de = eps * 1e-5
    xt, et = x.clone().requires_grad_(), eps.clone().requires_grad_()
    out = softops.soft_topk(xt, 2, epsilon=et, tol=1e-13).values
    gx, ge = torch.autograd.grad(out, [xt, et], w)
    analytic = float((gx * dx).sum() + (ge * de).sum())

    def f(t):
        v = softops.soft_topk(x + t * dx, 2, epsilon=eps + t * de, tol=1e-13).values
        return float((v * w).sum())

    central = (f(1.0) - f(-1.0)) / 2
    assert abs(central - analytic) <= 1e-6 * abs(analytic), (central, analytic)


INF = float("inf")


def test_kd5_huge_epsilon_beside_an_infinity():
    x = torch.tensor([[INF, 0.0, 1.0]], dtype=F64)
    out = softops.soft_topk(x, 1, epsilon=1e306, largest=False)
    torch.testing.assert_close(out.values, torch.tensor([[0.5]], dtype=F64))
    torch.testing.assert_close(out.weights, torch.tensor([[[0.0, 0.5, 0.5]]], dtype=F64))


def test_kd6_float32_row_near_the_largest_finite_value():
    x = torch.tensor([[3e38, 0.0, -3e38, 1.0]], dtype=torch.float32)
    out = softops.soft_topk(x, 1, epsilon=1.0)
    assert torch.equal(out.values, x[:, :1]) and out.weights.tolist() == [[[1.0, 0.0, 0.0, 0.0]]]
    # the same problem at a representable scale, in float64
    x64 = torch.tensor([[3e38, 0.0, -3e38, 1.0]], dtype=F64) * 1e270
    out = softops.soft_topk(x64, 2, epsilon=1e308)
    want = softops.soft_topk(x64 * 2.0**-1000, 2, epsilon=1e308 * 2.0**-1000)
    torch.testing.assert_close(out.weights, want.weights, rtol=1e-12, atol=1e-14)


def test_kd12_infinities_never_round_onto_the_row():
    x = torch.tensor([[INF, 1.0, 1.0, 1.0]], dtype=F64)
    top = softops.soft_topk(x, 1, epsilon=1e-20, largest=False)
    want = torch.tensor([[0.0, 1 / 3, 1 / 3, 1 / 3]], dtype=F64)
    torch.testing.assert_close(top.weights[:, 0], want)


@pytest.mark.parametrize("largest", [True, False])
def test_infinities_are_solved_on_the_finite_entries(largest):
    # the row with infinities equals its finite entries alone, with k less the sure ones
    sure = INF if largest else -INF
    x = torch.tensor([[sure, 0.3, -sure, 1.2, -0.4, sure, 2.0]], dtype=F64)
    for k in (1, 2, 3, 4, 5):
        out = softops.soft_topk(x, k, epsilon=0.3, largest=largest, tol=1e-12)
        c = min(2, k)
        assert bool((out.values[:, :c] == sure).all())
        # the sure entries share the first c targets
        torch.testing.assert_close(
            out.weights[0, :c][:, [0, 5]], torch.full((c, 2), 0.5, dtype=F64)
        )
        if k > c:
            # targets c.. are the finite problem (k - c targets of mass 1/n, the rest
            # (n_fin - (k - c))/n): finite values, in order
            assert torch.isfinite(out.values[:, c:]).all()
            vals = out.values[0, c:]
            assert (
                bool((vals[:-1] >= vals[1:]).all())
                if largest
                else bool((vals[:-1] <= vals[1:]).all())
            )
        assert bool((out.weights[0][:, [2]] == 0).all())  # the never-selected infinity
        torch.testing.assert_close(out.weights.sum(-1), torch.ones(1, k, dtype=F64))


def test_gradients_with_infinities_match_central_differences():
    x = torch.tensor([[INF, 0.3, -INF, 1.2, -0.4, 2.0]], dtype=F64)
    eps = torch.tensor([0.4], dtype=F64)
    w = torch.tensor([[0.0, 0.7, -1.1]], dtype=F64)
    dx = torch.tensor([[0.0, 0.2, 0.0, -0.4, 0.3, 0.1]], dtype=F64) * 1e-5
    de = eps * 1e-5
    xt, et = x.clone().requires_grad_(), eps.clone().requires_grad_()
    out = softops.soft_topk(xt, 3, epsilon=et, tol=1e-13).values
    gx, ge = torch.autograd.grad(out, [xt, et], w)
    assert gx[0, 0] == 0 and gx[0, 2] == 0
    analytic = float((gx * dx).sum() + (ge * de).sum())

    def f(t):
        v = softops.soft_topk(x + t * dx, 3, epsilon=eps + t * de, tol=1e-13).values
        return float((torch.where(w != 0, v, 0) * w).sum())

    central = (f(1.0) - f(-1.0)) / 2
    assert abs(central - analytic) <= 1e-6 * abs(analytic), (central, analytic)


def test_a_row_with_infinities_is_its_finite_row_with_k_less_the_sure_ones():
    x = torch.tensor([[-INF, 0.3, INF, 1.2, -0.4, INF, 2.0]], dtype=F64)
    finite = torch.tensor([[0.3, 1.2, -0.4, 2.0]], dtype=F64)
    for k in (3, 4, 5):
        out = softops.soft_topk(x, k, epsilon=0.3, tol=1e-12)
        alone = softops.soft_topk(finite, k - 2, epsilon=0.3, tol=1e-12)
        torch.testing.assert_close(out.weights[:, 2:][..., [1, 3, 4, 6]], alone.weights)
        torch.testing.assert_close(out.values[:, 2:], alone.values)
