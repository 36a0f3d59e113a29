"""softops.solvers: the public solvers with their diagnostics (topk_threshold, sinkhorn)."""

from __future__ import annotations

import math

import pytest
import torch

from softops import soft_topk_mask
from softops.solvers import sinkhorn, topk_threshold
from tests._helpers import exact_plan_derivative, fd_gap, seeded

F64 = torch.float64


def test_topk_threshold_diagnostics():
    x = torch.randn(3, 50, 4, dtype=F64)
    res = topk_threshold(x, 10, 0.2, dim=1)
    assert res.threshold.shape == (3, 4)
    assert bool(res.converged.all()) and 1 <= res.iterations <= 10
    assert float(res.residual.abs().max()) < 1e-10
    A = torch.sigmoid((x - res.threshold[:, None]) / 0.2)
    torch.testing.assert_close(A, soft_topk_mask(x, 10, dim=1, epsilon=0.2))
    small = topk_threshold(x, 10, 0.2, dim=1, largest=False)
    B = torch.sigmoid((small.threshold[:, None] - x) / 0.2)
    torch.testing.assert_close(B, soft_topk_mask(x, 10, dim=1, epsilon=0.2, largest=False))


def _contract_mask(x: torch.Tensor, t: torch.Tensor, eps: float, largest: bool) -> torch.Tensor:
    """The contract ``sigmoid((x - t) / eps)`` (``(t - x)`` with ``largest=False``), the entries
    of x at the first infinity above every threshold, those at the other below it (rows (B, n),
    thresholds (B,)); NaN where t is NaN."""
    z, tt = (x, t) if largest else (-x, -t)
    mask = torch.sigmoid((torch.where(torch.isinf(z), 0, z) - tt[:, None]) / eps)
    mask = torch.where(z == math.inf, 1.0, torch.where(z == -math.inf, 0.0, mask))
    return mask.masked_fill(torch.isnan(t)[:, None], math.nan)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("largest", [True, False])
def test_topk_threshold_gives_the_mask_by_its_contract_at_the_limits(dtype, largest) -> None:
    """Rows at k -> 0 and k -> n (k, less the entries at the first infinity, 0 or the count of
    the others in the dtype: a tiny k rounds to 0 in float32), rows without a finite entry and
    rows whose k cannot be met, next to ordinary rows: the contract formula at the returned
    threshold is soft_topk_mask's mask, and the threshold says which limit the row is at."""
    inf, nan = math.inf, math.nan
    sign = 1.0 if largest else -1.0  # the first infinity (always selected) is sign * inf
    n = 5
    g = seeded(230)
    base = torch.randn(10, n, generator=g, dtype=F64)
    base[2, 1] = base[3, 0] = base[4, 3] = sign * inf
    base[3, 4] = -sign * inf
    base[5] = torch.tensor([inf, -inf, inf, -inf, -inf]) * sign
    base[6, 2] = nan
    base[7, :3] = sign * inf
    base[9, 0] = -sign * inf
    # 0 in float32 (k = 0 in float64, which has no such k: a Python float that rounds to 0
    # there is 0 already)
    tiny = 1.2960526166650304e-67 if dtype == torch.float32 else 0.0
    below_n = n - 1e-9  # n in float32
    k = torch.tensor([tiny, below_n, 1.0, 1.0, 4.0, 2.0, 2.0, 2.0, 2.5, 4.0], dtype=F64)
    # rows: 0 tiny k, 1 k below n, 2 k = #first-infinity, 3 the same with the other infinity,
    # 4 k = n - #other-infinity, 5 no finite entry, 6 NaN, 7 k below #first-infinity,
    # 8 ordinary, 9 k = n - #other-infinity
    kd = k.to(dtype).double()
    first = (base == sign * inf).sum(-1).double()
    other = (base == -sign * inf).sum(-1).double()
    finite = n - first - other
    invalid = torch.isnan(base).any(-1) | (kd < first) | (kd - first > finite)
    at_none = ~invalid & (kd - first <= 0)
    at_all = ~invalid & (kd - first >= finite)
    x = base.to(dtype)
    layouts = [  # (x, k, dim, back to (10, n) rows)
        (x, k.to(dtype), 1, lambda v: v),
        (x.T, k.to(dtype), 0, lambda v: v.T if v.dim() == 2 else v),
        (
            x.T.reshape(n, 2, 5),
            k.to(dtype).reshape(2, 5),
            -3,
            lambda v: v.reshape(n, 10).T if v.dim() == 3 else v.reshape(10),
        ),
    ]
    for xin, kin, d, rows in layouts:
        res = topk_threshold(xin, kin, 0.3, dim=d, largest=largest)
        mask = rows(soft_topk_mask(xin, kin, epsilon=0.3, dim=d, largest=largest))
        t, conv, resid = (rows(v) for v in (res.threshold, res.converged, res.residual))
        assert t.dtype == dtype
        torch.testing.assert_close(_contract_mask(x, t, 0.3, largest), mask, equal_nan=True)
        want = torch.where(at_none, sign * inf, torch.where(at_all, -sign * inf, 0.0))
        want = torch.where(at_none & at_all, 0.0, want).masked_fill(invalid, nan)
        limits = at_none | at_all | invalid
        torch.testing.assert_close(t[limits], want[limits].to(dtype), equal_nan=True)
        assert torch.isfinite(t[~limits]).all()
        assert torch.equal(conv, ~invalid) and torch.isnan(resid[invalid]).all()
        assert bool((resid[at_none | at_all] == 0).all())
    assert bool(at_none[0]) and bool(at_all[1]) == (dtype == torch.float32)


def test_topk_threshold_issue_23_tiny_k_float32() -> None:
    x = torch.randn(3, 4, 5, generator=seeded(231))
    k = 1.2960526166650304e-67
    res = topk_threshold(x, k, 0.3, dim=-3, largest=False)
    assert bool((res.threshold == -math.inf).all()) and bool(res.converged.all())
    mask = soft_topk_mask(x, k, epsilon=0.3, dim=-3, largest=False)
    assert torch.equal(mask, torch.sigmoid((res.threshold - x) / 0.3))


@pytest.mark.parametrize(
    ("x", "kwargs", "err", "match"),
    [
        ([1.0, 2.0, 3.0], {}, TypeError, "topk_threshold: expected `x` to be a torch.Tensor; got"),
        (torch.tensor([1, 2, 3]), {}, TypeError, r"topk_threshold: .*dtype=torch\.int64"),
        (torch.zeros(3), {"k": 4}, ValueError, "topk_threshold: .*k=4"),
        (torch.zeros(3), {"epsilon": 0.0}, ValueError, "topk_threshold: .*epsilon"),
        (torch.zeros(3), {"dim": 1}, (ValueError, IndexError), "topk_threshold: .*dim"),
        (torch.zeros(3), {"largest": 1}, TypeError, "topk_threshold: .*largest"),
    ],
)
def test_topk_threshold_errors_name_the_op(x, kwargs, err, match) -> None:
    args = {"k": 1, "epsilon": 0.1}
    args.update(kwargs)
    k, eps = args.pop("k"), args.pop("epsilon")
    with pytest.raises(err, match=match):
        topk_threshold(x, k, eps, **args)


def test_public_sinkhorn_batch_dims_and_dtype() -> None:
    g = seeded(50)
    cost = torch.rand(2, 3, 8, 4, generator=g, dtype=F64)
    a = torch.full((8,), 1 / 8, dtype=F64)
    b = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)
    res = sinkhorn(cost, a, b, 0.1)
    assert res.plan.shape == (2, 3, 8, 4) and res.f.shape == (2, 3, 8) and res.g.shape == (2, 3, 4)
    assert res.converged.shape == (2, 3) and bool(res.converged.all())
    flat = sinkhorn(cost.reshape(6, 8, 4)[4], a, b, 0.1)
    torch.testing.assert_close(res.plan[1, 1], flat.plan, atol=1e-14, rtol=0)
    torch.testing.assert_close(res.plan.sum(-2), b.expand(2, 3, 4), atol=1e-14, rtol=0)
    half = sinkhorn(cost.half(), a.half(), b.half(), 0.1)
    assert half.plan.dtype == torch.float16 and half.f.dtype == torch.float16


def test_public_sinkhorn_gradients_in_cost_and_epsilon() -> None:
    g = seeded(51)
    cost = torch.rand(2, 6, 3, generator=g, dtype=F64, requires_grad=True)
    eps = torch.tensor([0.4, 0.9], dtype=F64, requires_grad=True)
    a = torch.full((6,), 1 / 6, dtype=F64)
    b = torch.tensor([0.2, 0.3, 0.5], dtype=F64)

    def fn(c: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return sinkhorn(c, a, b, e, max_iter=100_000, tol=1e-14, newton=True).plan

    assert torch.autograd.gradcheck(fn, (cost, eps), atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("newton", [False, True])
@pytest.mark.parametrize("shape", [(4, 1), (1, 3), (3, 2), (5, 3), (2, 4, 3), (6, 5), (2, 3, 7, 4)])
def test_public_sinkhorn_double_backward_in_cost_and_epsilon(shape: tuple, newton: bool) -> None:
    """Second derivatives in (cost, epsilon) against central differences of the gradient.

    The gradient in epsilon was the implicit VJP contracted with a detached copy of C / eps, a
    constant: its derivatives in the cost and in epsilon were missing (issue 23).
    """
    g = seeded(sum(shape) * 10 + newton)
    *batch, n, m = shape
    cost = (3 * torch.rand(*shape, generator=g, dtype=F64)).requires_grad_(True)
    a = torch.rand(*batch, n, generator=g, dtype=F64) + 0.2
    b = torch.rand(m, generator=g, dtype=F64) + 0.2
    b = b / b.sum() * a.sum(-1, keepdim=True)
    eps = (1.5 * torch.rand(batch, generator=g, dtype=F64) + 0.1).requires_grad_(True)

    def fn(c: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return sinkhorn(c, a, b, e, max_iter=100_000, tol=1e-13, newton=newton).plan

    assert torch.autograd.gradgradcheck(fn, (cost, eps))


@pytest.mark.parametrize("newton", [False, True])
def test_public_sinkhorn_double_backward_issue_23_case(newton: bool) -> None:
    cost = torch.tensor(
        [[1.4667950133912273, 0.7288000026702046], [1.834107241671396, 1.752159480933092]],
        dtype=F64,
        requires_grad=True,
    )
    a = torch.tensor([0.5, 0.5], dtype=F64)
    b = torch.tensor([0.5471983381081075, 0.45280166189189247], dtype=F64)
    eps = torch.tensor(0.4481682516392757, dtype=F64, requires_grad=True)

    def fn(c: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return sinkhorn(c, a, b, e, newton=newton).plan

    assert torch.autograd.gradgradcheck(fn, (cost, eps))


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"cost": torch.zeros(4)}, ValueError, r"shape \(4,\)"),
        ({"cost": torch.zeros(3, 2, dtype=torch.int64)}, TypeError, "dtype=torch.int64"),
        ({"a": torch.tensor([0.5, 0.5, 0.0])}, ValueError, r"got a containing 0\.0"),
        ({"a": torch.full((4,), 0.25)}, ValueError, r"got shape \(4,\)"),
        ({"b": torch.tensor([0.3, 0.3])}, ValueError, "b.sum"),
        ({"epsilon": -1.0}, ValueError, "epsilon=-1.0"),
        ({"max_iter": 0}, ValueError, "max_iter"),
        ({"tol": -1.0}, ValueError, "tol=-1.0"),
        ({"b": torch.tensor([0.5, 0.5], requires_grad=True)}, ValueError, "requires_grad"),
    ],
)
def test_public_sinkhorn_errors(kwargs: dict, err: type, match: str) -> None:
    args = {
        "cost": torch.zeros(3, 2),
        "a": torch.full((3,), 1 / 3),
        "b": torch.tensor([0.5, 0.5]),
        "epsilon": 0.1,
    }
    opts = {}
    for key in ("max_iter", "tol"):
        if key in kwargs:
            opts[key] = kwargs.pop(key)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        sinkhorn(args["cost"], args["a"], args["b"], args["epsilon"], **opts)


def test_public_sinkhorn_under_vmap_equals_the_loop() -> None:
    g = seeded(52)
    cost = torch.rand(4, 3, 6, 2, generator=g, dtype=F64)
    a = torch.rand(4, 6, generator=g, dtype=F64) + 0.1
    a = a / a.sum(-1, keepdim=True)
    b = torch.tensor([0.3, 0.7], dtype=F64)

    def plan(c, aa):
        return sinkhorn(c, aa, b, 0.5, tol=1e-12).plan

    got = torch.func.vmap(plan)(cost, a)
    for i in range(4):
        torch.testing.assert_close(got[i], plan(cost[i], a[i]), atol=0, rtol=0)
    moved = torch.func.vmap(plan, in_dims=(1, 0))(cost.transpose(0, 1).contiguous(), a)
    torch.testing.assert_close(moved, got, atol=0, rtol=0)
    # an invalid slice raises as in a loop
    bad = a.clone()
    bad[2, 3] = 0.0
    with pytest.raises(ValueError, match=r"got a containing 0\.0"):
        torch.func.vmap(plan)(cost, bad)
    with pytest.raises(ValueError, match=r"a\.sum\(\) and b\.sum\(\) 0\.0909 apart"):
        torch.func.vmap(plan)(cost, a * 1.1)


def test_public_sinkhorn_forward_mode_and_meta() -> None:
    g = seeded(53)
    cost = torch.rand(2, 5, 3, generator=g, dtype=F64, requires_grad=True)
    eps = torch.tensor([0.4, 0.9], dtype=F64, requires_grad=True)
    a = torch.full((5,), 1 / 5, dtype=F64)
    b = torch.tensor([0.2, 0.3, 0.5], dtype=F64)

    def fn(c: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return sinkhorn(c, a, b, e, max_iter=100_000, tol=1e-14, newton=True).plan

    assert torch.autograd.gradcheck(fn, (cost, eps), check_forward_ad=True)
    meta = sinkhorn(cost.detach().to("meta").float(), a.to("meta"), b.to("meta"), 0.4)
    assert meta.plan.device.type == "meta" and meta.plan.shape == (2, 5, 3)
    assert meta.plan.dtype == torch.float32 and meta.converged.shape == (2,)


def _near_permutation_sweep(cases: int, seed: int, n_max: int) -> None:
    """solvers.sinkhorn (squared cost onto m unit-spaced targets) and the "sinkhorn" mask, with
    epsilon from 1e-3 to 10 times the smallest gap, on spread and tied rows: nearly one-hot plans.
    """
    g = seeded(seed)
    for c in range(cases):
        n = int(torch.randint(2, n_max + 1, (1,), generator=g))
        k = int(torch.randint(1, n, (1,), generator=g)) if n > 1 else 1
        x = (n - 1) * torch.rand(n, generator=g, dtype=F64)
        if c % 2:
            x = x[torch.randint(n, (n,), generator=g)]
        srt = torch.sort(x).values.diff()
        gap = float(srt[srt > 0].min()) if bool((srt > 0).any()) else 1.0
        eps = gap * 10 ** float(4 * torch.rand(1, generator=g) - 3)
        m = min(k + 1, n)
        y = torch.arange(m, dtype=F64)
        a = torch.full((n,), 1.0 / n, dtype=F64)
        b = torch.full((m,), 1.0 / m, dtype=F64)

        def plan(z, y=y, a=a, b=b, eps=eps):
            cost = (z[:, None] - y) ** 2
            return sinkhorn(cost, a, b, eps, tol=1e-12, max_iter=100_000, newton=True).plan

        def mask(z, k=k, eps=eps):
            return soft_topk_mask(z, k, epsilon=eps, method="sinkhorn", tol=1e-12, max_iter=100_000)

        scale = min(gap, eps)
        state = g.get_state()
        if fd_gap(plan, x, 1e-5 * scale, g) >= 1e-5:
            # float64 central differences cannot resolve plans whose cost over epsilon reaches
            # 1e9 (their exponents are fixed to about 1e-7): the same projection of the
            # gradient against the derivative in 80-digit arithmetic
            ref = torch.Generator().set_state(state)
            ct = torch.randn((n, m), generator=ref, dtype=F64)
            v = torch.randn(n, generator=ref, dtype=F64)
            z = x.clone().requires_grad_(True)
            res = sinkhorn(
                (z[:, None] - y) ** 2, a, b, eps, tol=1e-12, max_iter=100_000, newton=True
            )
            (grad,) = torch.autograd.grad((res.plan * ct).sum(), z)
            exact = exact_plan_derivative(x, m, eps, res.g.detach(), ct, v)
            size = float((grad.abs() * v.abs()).sum()) + float(ct.abs().sum())
            assert abs(float(grad @ v) - exact) / size < 1e-8, (x.tolist(), m, eps)
        assert fd_gap(mask, x, 1e-5 * scale, g) < 1e-5, (x.tolist(), k, eps)


def test_sinkhorn_near_permutation_gradients_sweep():
    _near_permutation_sweep(8, 905, 6)


@pytest.mark.slow
def test_sinkhorn_near_permutation_gradients_sweep_large():
    """Before epsilon scaling, the sinkhorn mask did not converge either (within 1e5
    iterations) where its threshold crosses a gap of ~1e4 epsilon: cases 30, 90, 510, 514 and
    519 of this grid, among others. Nine plans of this grid (epsilon 2e-7 to 2e-4, C/epsilon up
    to 9e8) need the 80-digit reference; the gradient agrees with it to 3e-10 or better."""
    _near_permutation_sweep(1000, 906, 16)


@pytest.mark.parametrize("eps", [0.5, 0.05])
def test_the_80_digit_reference_derivative_equals_autograd_where_float64_suffices(eps):
    g = seeded(907)
    x = 3 * torch.rand(5, generator=g, dtype=F64)
    m = 3
    y = torch.arange(m, dtype=F64)
    a, b = torch.full((5,), 0.2, dtype=F64), torch.full((m,), 1 / 3, dtype=F64)
    ct = torch.randn((5, m), generator=g, dtype=F64)
    v = torch.randn(5, generator=g, dtype=F64)
    z = x.clone().requires_grad_(True)
    res = sinkhorn((z[:, None] - y) ** 2, a, b, eps, tol=1e-14, max_iter=100_000, newton=True)
    (grad,) = torch.autograd.grad((res.plan * ct).sum(), z)
    exact = exact_plan_derivative(x, m, eps, res.g.detach(), ct, v)
    assert abs(float(grad @ v) - exact) <= 1e-10 * (1 + abs(exact)), (float(grad @ v), exact)


def test_sinkhorn_gradient_in_a_tiny_epsilon_is_finite():
    # the backward of cost / eps squared epsilon: NaN once eps**2 underflows (eps < 1e-154)
    x = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    cost = (x[:, None] - x[None, :]) ** 2
    eps = torch.tensor(1e-200, dtype=torch.float64, requires_grad=True)
    a = torch.full((3,), 1 / 3, dtype=torch.float64)
    res = sinkhorn(cost, a, a, eps)
    (g,) = torch.autograd.grad((res.plan * torch.arange(9.0).reshape(3, 3)).sum(), eps)
    assert g == 0, g


def test_threshold_result_puts_a_solve_in_the_callers_direction_shape_and_dtype():
    """(solvers.threshold_result: the one tail of topk_threshold and its sharded form.)"""
    from types import SimpleNamespace

    from softops.solvers import threshold_result

    f64 = torch.float64
    solve = SimpleNamespace(
        scale=torch.tensor([2.0, 2.0, 4.0, 1.0], dtype=f64),
        sel_none=torch.tensor([False, True, False, False]),
        sel_all=torch.tensor([False, False, True, False]),
        invalid=torch.tensor([False, False, False, True]),
        converged=torch.tensor([True, True, False, True]),
        iterations=7,
        residual=torch.tensor([1e-9, 0.0, 0.5, 0.0], dtype=f64),
    )
    t = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=f64)
    shape = torch.Size([2, 2])
    res = threshold_result(t, solve, True, shape, torch.float32)
    want = torch.tensor([[0.5, math.inf], [-math.inf, math.nan]])
    torch.testing.assert_close(res.threshold, want, rtol=0, atol=0, equal_nan=True)
    assert res.threshold.dtype == torch.float32 and res.residual.dtype == torch.float32
    assert res.converged.tolist() == [[True, True], [False, True]] and res.iterations == 7
    assert res.residual.shape == shape and res.residual[1, 0] == 0.5
    # largest=False: the canonical rows were -x, so the threshold is negated (limits swap)
    low = threshold_result(t, solve, False, shape, torch.float64).threshold
    torch.testing.assert_close(low, -want.double(), rtol=0, atol=0, equal_nan=True)
