"""The C++ kernels of the Newton-first Sinkhorn solve and of the sorted top-k plan's backward
(softops/topk/_newton_kernel.cpp: the operators ``softops::newton_first`` and
``softops::sorted_plan_vjp``) against the batched torch code they stand in for, and the rules that
choose between them.

The kernel is built ahead of time (``python -m softops._kernels``). Where it is not built these
tests skip, unless ``SOFTOPS_REQUIRE_KERNELS=1`` (CI sets it), where they fail."""

from __future__ import annotations

import math

import pytest
import torch

import softops
from softops._core import sinkhorn
from softops._kernels import set_default_backend
from softops.topk import _newton, _sorted
from tests._helpers import built_ops, seeded

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def ops():
    """The kernel's operators (``torch.ops.softops_newton``), the kernel back end on."""
    built = built_ops(_newton.NEWTON_KERNEL)
    set_default_backend("kernel")
    return built


def _sorted_problem(bsz: int, n: int, k: int, eps: float, seed: int = 0, ties: bool = False):
    """The sorted top-k's centred cost (B, n, k+1) in units of epsilon, as soft_topk forms it."""
    g = seeded(seed)
    x = torch.randn(bsz, n, generator=g, dtype=F64)
    if ties:
        x = (x * 2).round() / 2
    m = k + 1 if k < n else k
    low = x.sort(-1).values[:, :m]
    beta = 0.5 * (low[:, :-1] + low[:, 1:])
    j = torch.arange(m, dtype=F64)
    kappa = torch.nn.functional.pad(beta.cumsum(-1), (1, 0))
    cost = (-(j * x.unsqueeze(-1)) + kappa.unsqueeze(1)) / eps
    log_a = torch.full((bsz, n), -math.log(n), dtype=F64)
    nu = [1 / n] * k + ([(n - k) / n] if k < n else [])
    log_b = torch.tensor(nu, dtype=F64).log().expand(bsz, m).contiguous()
    return cost, log_a, log_b, torch.ones(bsz, dtype=F64)


def _both(cost, log_a, log_b, eps, max_iter=2000, tol=1e-9, potentials=True):
    args = (cost, log_a, log_b, eps, max_iter, tol, potentials)
    plan, f, g, converged, residual, iterations, clean = _newton.NEWTON_FIRST_OP(*args, "")
    fast = (sinkhorn.SinkhornResult(f, g, plan, converged, int(iterations), residual), bool(clean))
    ref = _newton._newton_first_torch(*args)
    return fast, ref


def _assert_same(fast, ref, atol=1e-13, potentials=True):
    (a, clean_a), (b, clean_b) = fast, ref
    assert clean_a == clean_b
    torch.testing.assert_close(a.plan, b.plan, rtol=0, atol=atol, equal_nan=True)
    assert torch.equal(a.converged, b.converged)
    torch.testing.assert_close(a.residual, b.residual, rtol=0, atol=1e-12, equal_nan=True)
    if potentials:  # (on tied scores some potentials barely move the plan: not compared there)
        torch.testing.assert_close(a.f, b.f, rtol=0, atol=1e-8, equal_nan=True)
        torch.testing.assert_close(a.g, b.g, rtol=0, atol=1e-8, equal_nan=True)


@pytest.mark.parametrize(
    ("bsz", "n", "k", "eps"),
    [
        (16, 18, 2, 0.1),  # the beam step
        (8, 18, 1, 0.05),  # m = 2: the closed form
        (8, 30, 4, 0.3),  # m = 5: the Cholesky
        (4, 100, 8, 0.02),
        (4, 9, 9, 1.0),  # k = n: no rest target
        (6, 12, 3, 5.0),  # epsilon above the spread
        (6, 12, 3, 1e-3),  # far below the gaps: nearly a permutation
    ],
)
@pytest.mark.parametrize("ties", [False, True])
def test_the_kernel_equals_the_torch_solve(ops, bsz, n, k, eps, ties):
    fast, ref = _both(*_sorted_problem(bsz, n, k, eps, seed=n + k, ties=ties))
    _assert_same(fast, ref, potentials=not ties)
    res, clean = fast
    assert clean and bool(res.converged.all())
    assert res.iterations == ref[0].iterations
    # the plan's marginals
    torch.testing.assert_close(res.plan.sum(-1), torch.full((bsz, n), 1 / n, dtype=F64))


def test_rows_the_kernel_does_not_solve_take_the_torch_solve(ops):
    cost, log_a, log_b, eps = _sorted_problem(5, 10, 2, 0.2, seed=3)
    cost[1, 4, 0] = math.nan  # a NaN row: NaN, in that row only
    log_a[2, 0] = -math.inf  # a zero row mass: not a regular row for the kernel
    log_a[2] = log_a[2] - torch.logsumexp(log_a[2], 0)
    log_b[3, 0] = -math.inf  # a zero column mass
    log_b[3] = log_b[3] - torch.logsumexp(log_b[3], 0)
    fast, ref = _both(cost, log_a, log_b, eps)
    _assert_same(fast, ref)
    plan = fast[0].plan
    assert torch.isnan(plan[1]).all() and not torch.isnan(plan[[0, 2, 3, 4]]).any()
    assert bool(fast[0].converged[[0, 2, 3, 4]].all())
    assert float(plan[2, 0].abs().max()) == 0.0 and float(plan[3, :, 0].abs().max()) == 0.0


def test_rows_left_above_tol_are_finished_like_the_torch_solve(ops):
    # one Newton step allowed: the rows it leaves above tol are solved from the start (hybrid)
    cost, log_a, log_b, eps = _sorted_problem(6, 20, 3, 0.05, seed=5)
    fast, ref = _both(cost, log_a, log_b, eps, max_iter=1, tol=1e-12)
    _assert_same(fast, ref)
    assert not fast[1]
    fast, ref = _both(cost, log_a, log_b, eps, max_iter=3000, tol=1e-15)
    _assert_same(fast, ref, atol=1e-12)


def test_a_step_that_does_not_lower_the_bound_stops_the_row(ops):
    # two columns with no coupling left (eps far below the gaps: P is a permutation up to
    # underflow): det K = 0, the step is NaN and the row keeps its start, as in torch
    cost, log_a, log_b, eps = _sorted_problem(3, 8, 2, 1e-300, seed=7)
    fast, ref = _both(cost, log_a, log_b, eps)
    _assert_same(fast, ref)


@pytest.mark.parametrize("k", [1, 2, 3, 6, 13])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_soft_topk_is_the_same_with_and_without_the_kernels(ops, k, dtype):
    """Forward and backward (the kernel's VJP: closed form for k <= 2, the refined Cholesky
    above), in x and epsilon, from near-hard to smooth rows."""
    g = seeded(11 + k)
    x = torch.randn(2, 5, 13, generator=g, dtype=F64).to(dtype).requires_grad_()
    eps = torch.tensor([0.01, 0.1, 0.4, 1.0, 3.0], dtype=dtype).expand(2, 5).requires_grad_()
    w = torch.linspace(-1.0, 2.0, k, dtype=dtype)
    out = {}
    for use in (False, True):
        set_default_backend("kernel" if use else "reference")
        res = softops.soft_topk(x, k, epsilon=eps)
        loss = (res.values * w).sum() + (res.weights**2 * torch.arange(13.0)).sum()
        out[use] = (res.values, res.weights, *torch.autograd.grad(loss, (x, eps)))
    tol = 1e-10 if dtype == F64 else 1e-5
    for a, b in zip(out[True], out[False], strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _full(x, k, **kw):
    """``soft_topk`` solved on whole rows (no candidate set): the path these kernels serve."""
    return _sorted._soft_topk(x, k, reduce=False, **kw)


def test_rows_the_kernel_vjp_leaves_take_the_torch_vjp(ops, monkeypatch):
    # a NaN row and a row with a column that has no coupling left (a singular K: det below
    # DET_MIN) are redone in torch; the other rows keep the kernel's gradient
    x = torch.tensor(
        [[3.0, 1.0, 0.2, -1.0], [0.0, math.nan, 1.0, 2.0], [40.0, 20.0, 0.0, -20.0]], dtype=F64
    ).requires_grad_()
    eps = torch.tensor([0.5, 0.5, 0.02], dtype=F64)
    calls = []
    real = _sorted._torch_vjp

    def spy(plan, *args):
        calls.append(plan.shape[0])
        return real(plan, *args)

    monkeypatch.setattr(_sorted, "_torch_vjp", spy)
    res = _full(x, 2, epsilon=eps)
    (grad,) = torch.autograd.grad(res.values.sum() + res.weights[..., 0].sum(), x)
    assert calls == [2]  # the NaN row and the decoupled one
    set_default_backend("reference")
    res = _full(x, 2, epsilon=eps)
    (ref,) = torch.autograd.grad(res.values.sum() + res.weights[..., 0].sum(), x)
    torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-14, equal_nan=True)
    assert torch.isnan(grad[1]).all() and torch.isfinite(grad[[0, 2]]).all()


def test_soft_topk_gradcheck_through_the_kernel(ops):
    g = seeded(12)
    x = torch.randn(3, 9, generator=g, dtype=F64, requires_grad=True)
    eps = torch.tensor([0.05, 0.3, 2.0], dtype=F64, requires_grad=True)

    def fn(t, e):
        res = softops.soft_topk(t, 2, epsilon=e)
        return res.values, res.weights

    assert torch.autograd.gradcheck(fn, (x, eps))
    assert torch.autograd.gradgradcheck(fn, (x, eps))


def test_the_kernel_is_used_only_where_it_applies(ops, monkeypatch):
    calls = []
    real = _newton.NEWTON_FIRST_OP

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(_newton, "NEWTON_FIRST_OP", spy)
    x = torch.randn(4, 18, dtype=F64)
    ref = _full(x, 2, epsilon=0.1).weights
    assert calls == [(4, 18, 3)]
    # vmap folds its dimension into the rows: the kernel solves the plain rows
    out = torch.func.vmap(lambda t: _full(t, 2, epsilon=0.1).weights)(x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    assert calls == [(4, 18, 3)] * 2
    # a problem above the work limit: the torch solve
    monkeypatch.setattr(_newton, "KERNEL_MAX_WORK", 18 * 9 - 1)
    _full(x, 2, epsilon=0.1)
    # the reference back end: the torch solve
    monkeypatch.setattr(_newton, "KERNEL_MAX_WORK", 1 << 17)
    set_default_backend("reference")
    _full(x, 2, epsilon=0.1)
    assert calls == [(4, 18, 3)] * 2


def test_use_kernel_and_newton_first(ops):
    t = torch.zeros(2, 18, 3, dtype=F64)
    assert _newton.use_kernel(t, 18, 3)
    assert not _newton.use_kernel(t, 18, 3 * 10**3)  # above KERNEL_MAX_WORK
    assert not _newton.use_kernel(t.to("meta"), 18, 3)
    assert not torch.func.vmap(lambda r: torch.tensor(_newton.use_kernel(r, 18, 3)))(t).any()
    cost, log_a, log_b, eps = _sorted_problem(4, 18, 2, 0.1, seed=21)
    res, clean = _newton.newton_first(cost, log_a, log_b, eps, 2000, 1e-9, False)
    assert clean is True and bool(res.converged.all())
    torch.testing.assert_close(res.plan.sum(-1), torch.full((4, 18), 1 / 18, dtype=F64))


def test_the_kernels_directly(ops):
    """newton_first_rows flags an irregular row (NaN error) and solves the others;
    sorted_vjp_rows equals the torch implicit VJP contracted with the slopes."""
    cost, log_a, log_b, _ = _sorted_problem(3, 10, 2, 0.2, seed=22)
    s = cost.transpose(1, 2).contiguous()  # (B, m, n), already in units of epsilon
    log_a[2, 0] = -math.inf
    plan, _, _, err, steps = ops.newton_first_rows(s, log_a, log_b, 1e-9, 12)
    assert bool((err[:2] <= 1e-9).all()) and math.isnan(float(err[2])) and int(steps[2]) == 0
    torch.testing.assert_close(plan[:2].sum(1), torch.full((2, 10), 0.1, dtype=F64))
    p = plan[:2].transpose(1, 2)  # (B, n, m)
    grad = torch.randn(p.shape, generator=seeded(23), dtype=F64)
    ones = torch.ones(2, dtype=F64)
    ref = sinkhorn.implicit_cost_vjp(p, grad, ones, True)
    slopes = torch.arange(3, dtype=F64)
    gs, ge, safe = ops.sorted_vjp_rows(
        plan[:2], grad.transpose(1, 2), s[:2], slopes, ones, sinkhorn.DET_MIN
    )
    assert bool(safe.all())
    torch.testing.assert_close(gs, ref @ slopes, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        ge, -(ref * s[:2].transpose(1, 2)).sum((1, 2)), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("back_end", ["kernel", "reference"])
def test_the_operators_pass_opcheck_on_either_back_end(ops, back_end):
    cost, log_a, log_b, eps = _sorted_problem(3, 10, 2, 0.2, seed=24)
    from softops._kernels import backend

    with backend(back_end):
        for potentials in (True, False):
            torch.library.opcheck(
                _newton.NEWTON_FIRST_OP.overload,
                (cost, log_a, log_b, eps, 100, 1e-9, potentials, ""),
            )
        plan = _newton.NEWTON_FIRST_OP(cost, log_a, log_b, eps, 100, 1e-9, False, "")[0]
        grad_w = torch.randn(3, 2, 10, generator=seeded(25), dtype=F64)
        scaled = cost.transpose(1, 2).contiguous()
        for need_eps in (True, False):
            args = (plan, grad_w, eps, scaled, True, need_eps)
            torch.library.opcheck(_sorted.PLAN_VJP_OP.overload, args)
