"""The log-domain Sinkhorn core (softops._core.sinkhorn): forward, Newton polish, implicit VJP."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import pytest
import torch

import softops
from softops import soft_rank, soft_sort
from softops._core import sinkhorn
from softops._core.sinkhorn import SinkhornResult, log_sinkhorn
from softops.testing import unrolled_sinkhorn
from tests._helpers import saved_bytes, seeded

F64 = torch.float64


# Tiny problems: one intra-op thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def sinkhorn_plan(cost, log_a, log_b, eps, max_iter, tol, newton=False):
    """``(plan, result)`` of the one entry point, positionally (the plan differentiable)."""
    res = log_sinkhorn(cost, log_a, log_b, eps, max_iter=max_iter, tol=tol, newton=newton)
    return res.plan, res


def _problem(bsz: int, n: int, m: int, seed: int = 0, dtype: torch.dtype = F64):
    g = seeded(seed)
    cost = torch.randn(bsz, n, m, generator=g, dtype=dtype)
    log_a = torch.log_softmax(torch.randn(bsz, n, generator=g, dtype=dtype), -1)
    log_b = torch.log_softmax(torch.randn(bsz, m, generator=g, dtype=dtype), -1)
    eps = 0.3 + torch.rand(bsz, generator=g, dtype=dtype)
    return cost, log_a, log_b, eps


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("m", [2, 3, 6])
@pytest.mark.parametrize("iters", [1, 2, 9, 200])
def test_fixed_iterations_match_paper_iterates(m: int, iters: int) -> None:
    cost, log_a, log_b, eps = _problem(3, 17, m, seed=m)
    ref, f_ref, g_ref = unrolled_sinkhorn(cost, log_a, log_b, eps, iters)
    res = log_sinkhorn(cost, log_a, log_b, eps, max_iter=iters, tol=0)
    assert isinstance(res, SinkhornResult)
    assert res.iterations == iters
    torch.testing.assert_close(res.plan, ref, atol=1e-13, rtol=1e-10)
    # potentials agree up to the f/g gauge: compare f_i + g_j
    torch.testing.assert_close(
        res.f[:, :, None] + res.g[:, None, :],
        f_ref[:, :, None] + g_ref[:, None, :],
        atol=1e-9,
        rtol=1e-9,
    )


@pytest.mark.parametrize("m", [2, 5])
@pytest.mark.parametrize("newton", [False, True])
def test_converges_to_marginals(m: int, newton: bool) -> None:
    cost, log_a, log_b, eps = _problem(4, 40, m, seed=1)
    res = log_sinkhorn(cost, log_a, log_b, eps, max_iter=5000, tol=1e-12, newton=newton)
    assert bool(res.converged.all())
    assert float(res.residual.max()) <= 1e-12
    torch.testing.assert_close(res.plan.sum(-1), log_a.exp(), atol=1e-12, rtol=0)
    torch.testing.assert_close(res.plan.sum(-2), log_b.exp(), atol=1e-14, rtol=0)
    # the plan is exp((f + g - C)/eps)
    torch.testing.assert_close(
        res.plan,
        torch.exp((res.f[:, :, None] + res.g[:, None, :] - cost) / eps[:, None, None]),
        atol=1e-14,
        rtol=1e-9,
    )


def test_newton_polish_small_epsilon() -> None:
    cost, log_a, log_b, _ = _problem(3, 30, 4, seed=2)
    eps = torch.full((3,), 0.02, dtype=F64)
    plain = log_sinkhorn(cost, log_a, log_b, eps, max_iter=200_000, tol=1e-12)
    polished = log_sinkhorn(cost, log_a, log_b, eps, max_iter=200_000, tol=1e-12, newton=True)
    assert bool(plain.converged.all()) and bool(polished.converged.all())
    assert polished.iterations < plain.iterations
    torch.testing.assert_close(polished.plan, plain.plan, atol=1e-10, rtol=0)


def test_tol_zero_runs_exactly_max_iter_and_reports() -> None:
    cost, log_a, log_b, eps = _problem(2, 10, 2)
    res = log_sinkhorn(cost, log_a, log_b, eps, max_iter=37, tol=0, newton=True)
    assert res.iterations == 37
    assert res.residual.shape == (2,) and res.converged.dtype == torch.bool


def test_not_converged_is_reported() -> None:
    cost, log_a, log_b, _ = _problem(2, 30, 3, seed=3)
    eps = torch.full((2,), 0.01, dtype=F64)
    res = log_sinkhorn(cost, log_a, log_b, eps, max_iter=20, tol=1e-12)
    assert not bool(res.converged.any())
    assert bool((res.residual > 1e-12).all())
    assert res.iterations == 20


def test_nan_row_isolated_and_no_hang() -> None:
    cost, log_a, log_b, eps = _problem(3, 25, 3, seed=4)
    bad = cost.clone()
    bad[1, 7, 2] = math.nan
    for newton in (False, True):
        res = log_sinkhorn(bad, log_a, log_b, eps, max_iter=100_000, tol=1e-12, newton=newton)
        assert res.iterations < 100_000
        assert bool(res.plan[1].isnan().all()) and bool(res.f[1].isnan().all())
        assert not bool(res.converged[1]) and bool(res.converged[[0, 2]].all())
        ok = log_sinkhorn(cost, log_a, log_b, eps, max_iter=100_000, tol=1e-12, newton=newton)
        torch.testing.assert_close(res.plan[[0, 2]], ok.plan[[0, 2]], atol=0, rtol=0)


def test_rows_are_independent() -> None:
    cost, log_a, log_b, eps = _problem(4, 30, 4, seed=5)
    res = log_sinkhorn(cost, log_a, log_b, eps, max_iter=5000, tol=1e-11, newton=True)
    scaled = cost.clone()
    scaled[2] *= 50.0
    res2 = log_sinkhorn(scaled, log_a, log_b, eps, max_iter=5000, tol=1e-11, newton=True)
    keep = [0, 1, 3]
    torch.testing.assert_close(res2.plan[keep], res.plan[keep], atol=1e-15, rtol=0)
    alone = log_sinkhorn(cost[2:3], log_a[2:3], log_b[2:3], eps[2:3], max_iter=5000, tol=1e-11)
    torch.testing.assert_close(alone.plan[0], res.plan[2], atol=1e-11, rtol=0)


@pytest.mark.parametrize("masses", [(0.5, 0.0, 0.5), (0.0, 1.0), (1.0, 0.0)])
def test_zero_mass_columns(masses: tuple[float, ...]) -> None:
    """A target of mass 0 (e.g. k = 0 or k = n in the mask) gets an exactly empty column."""
    m = len(masses)
    cost, log_a, _, eps = _problem(2, 9, m, seed=60)
    cost.requires_grad_(True)
    log_b = torch.tensor(masses, dtype=F64).log().expand(2, m)
    for newton in (False, True):
        plan, res = sinkhorn_plan(cost, log_a, log_b, eps, 1000, 1e-12, newton)
        assert bool(res.converged.all())
        torch.testing.assert_close(plan.sum(-2), log_b.exp(), atol=1e-14, rtol=0)
        empty = [j for j, b in enumerate(masses) if b == 0]
        assert float(plan.detach()[..., empty].abs().max()) == 0.0
    assert torch.autograd.gradcheck(
        lambda c: sinkhorn_plan(c, log_a, log_b, eps, 10_000, 1e-14, True)[0], (cost,)
    )


def test_two_targets_plan_is_the_sigmoid_mask() -> None:
    """m=2, targets (0, 1): n*Gamma[:, 1] = sigmoid((x - t)/eps), sum = k (docs/math.md §1.2)."""
    g = seeded(6)
    bsz, n = 3, 50
    x = torch.randn(bsz, n, generator=g, dtype=F64)
    ks = torch.tensor([1.0, 10.0, 49.0], dtype=F64)
    epsilon = torch.tensor([0.05, 0.2, 1.0], dtype=F64)
    y = torch.tensor([0.0, 1.0], dtype=F64)
    cost = -2 * x[..., None] * y + y**2  # (x - y)^2 without the x^2 row constant
    log_a = torch.full((bsz, n), -math.log(n), dtype=F64)
    log_b = torch.stack((torch.log((n - ks) / n), torch.log(ks / n)), dim=-1)
    res = log_sinkhorn(cost, log_a, log_b, 2 * epsilon, max_iter=100_000, tol=1e-13, newton=True)
    assert bool(res.converged.all())
    mask = n * res.plan[..., 1]
    # threshold t: sum_i sigmoid((x_i - t)/eps) = k, by float64 bisection
    lo = x.min(-1).values - 50 * epsilon
    hi = x.max(-1).values + 50 * epsilon
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        high = torch.sigmoid((x - mid[:, None]) / epsilon[:, None]).sum(-1) > ks
        lo = torch.where(high, mid, lo)
        hi = torch.where(high, hi, mid)
    t = 0.5 * (lo + hi)
    expected = torch.sigmoid((x - t[:, None]) / epsilon[:, None])
    torch.testing.assert_close(mask, expected, atol=1e-9, rtol=0)
    torch.testing.assert_close(mask.sum(-1), ks, atol=1e-9, rtol=0)


def test_float32_reaches_default_tolerance() -> None:
    cost, log_a, log_b, eps = _problem(4, 2000, 2, seed=7, dtype=torch.float32)
    res = log_sinkhorn(cost, log_a, log_b, eps, max_iter=2000, tol=1e-6)
    assert bool(res.converged.all())
    assert res.plan.dtype == torch.float32


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_gradcheck_implicit_plan(m: int) -> None:
    cost, log_a, log_b, eps = _problem(2, 7, m, seed=10 + m)
    cost.requires_grad_(True)

    def fn(c: torch.Tensor) -> torch.Tensor:
        return sinkhorn_plan(c, log_a, log_b, eps, 100_000, 1e-14, True)[0]

    assert torch.autograd.gradcheck(fn, (cost,), atol=1e-7, rtol=1e-5)


def test_gradgradcheck_implicit_plan() -> None:
    cost, log_a, log_b, eps = _problem(1, 6, 3, seed=20)
    cost.requires_grad_(True)

    def fn(c: torch.Tensor) -> torch.Tensor:
        return sinkhorn_plan(c, log_a, log_b, eps, 100_000, 1e-14, True)[0]

    assert torch.autograd.gradgradcheck(fn, (cost,), atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("m", [2, 4])
def test_implicit_vjp_matches_unrolled_autograd(m: int) -> None:
    cost, log_a, log_b, eps = _problem(3, 20, m, seed=30 + m)
    cost.requires_grad_(True)
    weight = torch.randn(3, 20, m, generator=seeded(1), dtype=F64)
    plan, res = sinkhorn_plan(cost, log_a, log_b, eps, 100_000, 1e-14, True)
    assert bool(res.converged.all())
    (g_impl,) = torch.autograd.grad((plan * weight).sum(), cost)
    ref, _, _ = unrolled_sinkhorn(cost, log_a, log_b, eps, 800)
    (g_ref,) = torch.autograd.grad((ref * weight).sum(), cost)
    torch.testing.assert_close(plan, ref, atol=1e-13, rtol=0)
    torch.testing.assert_close(g_impl, g_ref, atol=1e-10, rtol=1e-8)


def test_saved_memory_does_not_grow_with_iterations() -> None:
    cost, log_a, log_b, eps = _problem(2, 200, 3, seed=40)
    cost.requires_grad_(True)

    def run(iters: int):
        return lambda: sinkhorn_plan(cost, log_a, log_b, eps, iters, 0.0)[0]

    b50, b500 = saved_bytes(run(50)), saved_bytes(run(500))
    assert b50 == b500
    assert b50 <= cost.numel() * 8 + 1024  # the plan and epsilon only
    unrolled = saved_bytes(lambda: unrolled_sinkhorn(cost, log_a, log_b, eps, 50))
    assert unrolled > 50 * b50


# ------------------------------------------------------------------- issue 9: near-permutation


def _near_permutation_plan() -> torch.Tensor:
    """P (1, m, n) of the first issue-9 repro: two rows one-hot to 2.7e-16, the third to 1e-34."""
    off = [2.714318e-16, 4.992624e-116, 5.687081e-34]
    p = torch.tensor(
        [[1.0, off[0], off[1]], [off[0], 1.0, off[2]], [off[1], off[2], 1.0]], dtype=F64
    )
    return (p / p.sum(0)).unsqueeze(0)


def test_reduced_schur_is_accurate_when_nearly_a_permutation():
    """K's diagonal is the sum of its off-diagonal magnitudes plus the (tiny) coupling to the
    last column, to full relative precision: the old ``diag + g - g`` form made K indefinite."""
    p = _near_permutation_plan()
    w = torch.full((1, 3), 1.0 / 3, dtype=F64)
    kmat = sinkhorn._reduced_schur(p, w)[0]
    ground = (w[0] * p[0, :2] * p[0, 2]).sum(-1)
    off = kmat.abs().sum(-1) - kmat.diagonal()
    torch.testing.assert_close(kmat.diagonal(), off + ground, rtol=1e-14, atol=0)
    assert float(torch.linalg.eigvalsh(kmat).min()) >= 0.0


def test_implicit_vjp_near_permutation_gradcheck():
    """Costs that make the plan a permutation to ~1e-16: the implicit VJP passes gradcheck."""
    g = seeded(907)
    n = 4
    x = 10 * torch.randn(2, n, generator=g, dtype=F64)
    y = torch.sort(x, -1).values
    cost = ((x.unsqueeze(-1) - y.unsqueeze(1)) ** 2).requires_grad_(True)
    log_a = torch.full((2, n), -math.log(n), dtype=F64)
    eps = torch.full((2,), 0.25, dtype=F64)

    def fn(c: torch.Tensor) -> torch.Tensor:
        return sinkhorn_plan(c, log_a, log_a, eps, 100_000, 1e-14, True)[0]

    assert float(fn(cost).detach().amax(-1).min()) > 0.25 - 1e-4  # nearly a permutation

    assert torch.autograd.gradcheck(fn, (cost,), atol=1e-7, rtol=1e-5)


def test_newton_gradient_is_free_of_cancellation():
    """b - c near a permutation, against exact rational arithmetic on the same float64 plan
    (each row's home entry taken as 1 minus the others, as the identity assumes): the direct
    difference keeps only rounding noise, the split form every digit."""
    leak = [3e-16, 1e-20, 7e-30]  # source i keeps 1 - leak_i at home i, sends leak_i to i + 1
    m = n = 3
    p = torch.zeros(1, m, n, dtype=F64)
    for i, d in enumerate(leak):
        p[0, i, i], p[0, (i + 1) % m, i] = 1 - d, d
    a = torch.full((1, n), 1.0 / n, dtype=F64)
    b = a.clone()
    top, home = sinkhorn._homes(p, a)
    got = sinkhorn._mass_gap(p, a, b, top, home)[0]
    exact = []
    for j in range(m):
        total = Fraction(0)
        for i in range(n):
            pij = Fraction(float(p[0, j, i]))
            if j == i:  # the home entry: 1 minus the others
                pij = 1 - sum(Fraction(float(p[0, r, i])) for r in range(m) if r != i)
            total += Fraction(float(a[0, i])) * pij
        exact.append(float(Fraction(float(b[0, j])) - total))
    want = torch.tensor(exact, dtype=F64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    assert float(want.abs().min()) < 1e-20  # imbalances far below the rounding of the masses
    direct = b[0] - torch.linalg.vecdot(p, a.unsqueeze(1))[0]
    assert float(((direct - want) / want).abs().max()) >= 1.0  # lost: what the split avoids


_CRAWL_X = [
    7.264558092660464, 7.1713784757639365, 2.22717487813839, 7.320108758111252,
    10.93251193557891, 8.377119212625107, 4.846612119832686, 12.889198960227551,
    5.48773476946437, 9.995168816757406, 3.963679614748021, 2.0832359086521457,
    5.494150851994496, 11.643005487670086, 11.977270360596469,
]  # fmt: skip


def _crawl_problem(bsz: int = 1):
    """Large sweep case: 15 points onto 5 unit-spaced targets at epsilon 2.3e-5, 1e-3 of the
    smallest gap: the solution's potentials lie ~1e6 (in units of epsilon) from the start."""
    x = torch.tensor(_CRAWL_X, dtype=F64)
    cost = ((x[:, None] - torch.arange(5, dtype=F64)) ** 2 / 2.349275238106227e-05).expand(
        bsz, 15, 5
    )
    log_a = torch.full((bsz, 15), -math.log(15), dtype=F64)
    log_b = torch.full((bsz, 5), -math.log(5), dtype=F64)
    return cost, log_a, log_b, torch.ones(bsz, dtype=F64)


def test_epsilon_scaling_ends_the_crawl(monkeypatch):
    """Plain Sinkhorn moves the potentials by O(1) per iteration and does not converge in 1e5
    iterations; the rows still above the Newton switch after ANNEAL_AFTER iterations are
    annealed and converge within the default budget."""
    cost, log_a, log_b, ones = _crawl_problem()
    res = log_sinkhorn(cost, log_a, log_b, ones, max_iter=2000, tol=1e-12, newton=True)
    assert bool(res.converged.all()) and res.iterations < 1000
    torch.testing.assert_close(res.plan.sum(-1), log_a.exp(), atol=1e-12, rtol=0)
    monkeypatch.setattr(sinkhorn, "ANNEAL_AFTER", 10**9)  # plain Sinkhorn, then Newton
    plain = log_sinkhorn(cost, log_a, log_b, ones, max_iter=5000, tol=1e-12, newton=True)
    assert not bool(plain.converged.any()) and float(plain.residual.min()) > 0.1


def test_epsilon_scaling_keeps_rows_independent():
    """A crawling row beside fast ones: every row equals its own solve (rows that converge
    within ANNEAL_AFTER iterations are untouched, the annealed row's stages are its own)."""
    crawl = _crawl_problem()
    easy = _problem(2, 15, 5, seed=98)
    batch = [torch.cat((e, c)) for e, c in zip(easy, crawl, strict=True)]
    res = log_sinkhorn(*batch, max_iter=2000, tol=1e-12, newton=True)
    assert bool(res.converged.all())
    for i in range(3):
        one = log_sinkhorn(*(t[i : i + 1] for t in batch), max_iter=2000, tol=1e-12, newton=True)
        torch.testing.assert_close(res.plan[i : i + 1], one.plan, atol=0, rtol=0)


# ------------------------------------------------------------- torch.func, forward mode, meta


def _plan_fn(log_a: torch.Tensor, log_b: torch.Tensor, eps: torch.Tensor):
    return lambda c: sinkhorn_plan(c, log_a, log_b, eps, 100_000, 1e-14, True)[0]


def _near_permutation_problem(n: int = 4, seed: int = 907):
    """Squared cost onto the sorted row at epsilon 0.25: the plan is a permutation to ~1e-16."""
    x = 10 * torch.randn(2, n, generator=seeded(seed), dtype=F64)
    y = torch.sort(x, -1).values
    cost = (x.unsqueeze(-1) - y.unsqueeze(1)) ** 2
    log_a = torch.full((2, n), -math.log(n), dtype=F64)
    return cost, log_a, log_a, torch.full((2,), 0.25, dtype=F64)


def test_plan_jacobian_is_symmetric() -> None:
    """The plan is the gradient of the concave OT value in the cost, so dGamma/dC is a Hessian:
    symmetric and negative semi-definite (docs/math.md §6). The jvp rests on this."""
    cost, log_a, log_b, eps = _problem(1, 5, 3, seed=60)
    jac = torch.func.jacrev(_plan_fn(log_a, log_b, eps))(cost).reshape(15, 15)
    torch.testing.assert_close(jac, jac.T, atol=1e-12, rtol=0)
    assert float(torch.linalg.eigvalsh(jac).max()) < 1e-12


def _one_hot_like_problem(n: int = 5, seed: int = 63):
    """Unit gaps at epsilon 0.05: every plan row is one-hot to ~1e-8, the Jacobian ~1e-7."""
    x = torch.arange(n, dtype=F64) + 0.1 * torch.rand(2, n, generator=seeded(seed), dtype=F64)
    x = x[:, torch.randperm(n, generator=seeded(seed))]
    y = torch.sort(x, -1).values
    cost = (x.unsqueeze(-1) - y.unsqueeze(1)) ** 2
    log_a = torch.full((2, n), -math.log(n), dtype=F64)
    return cost, log_a, log_a, torch.full((2,), 0.05, dtype=F64)


@pytest.mark.parametrize("one_hot_like", [False, True])
def test_jvp_equals_jacobian_and_central_differences(one_hot_like: bool) -> None:
    if one_hot_like:
        cost, log_a, log_b, eps = _one_hot_like_problem()
        # h: the plan's rounding (1e-17) over h stays far below the Jacobian (3e-8); the
        # truncation error (h^2 times derivatives that grow as 1/epsilon) is the 1e-5 left
        h, fd_tol = 1e-4, 1e-4
    else:
        cost, log_a, log_b, eps = _problem(2, 6, 4, seed=61)
        h, fd_tol = 1e-6, 1e-8
    fn = _plan_fn(log_a, log_b, eps)
    plan = fn(cost)
    if one_hot_like:
        n = cost.shape[1]
        assert float(plan.amax(-1).min()) > (1 - 1e-6) / n
    tangent = torch.randn(cost.shape, generator=seeded(62), dtype=F64)
    out, jvp = torch.func.jvp(fn, (cost,), (tangent,))
    torch.testing.assert_close(out, plan, atol=0, rtol=0)
    scale = float(jvp.abs().max())
    assert scale > (1e-9 if one_hot_like else 1e-2)  # a real tangent, not an all-zero one
    jac = torch.func.jacrev(fn)(cost).reshape(out.numel(), -1)
    want = jac @ tangent.reshape(-1)
    torch.testing.assert_close(jvp.reshape(-1), want, atol=1e-10 * scale, rtol=0)
    fd = (fn(cost + h * tangent) - fn(cost - h * tangent)) / (2 * h)
    torch.testing.assert_close(jvp, fd, atol=fd_tol * scale, rtol=0)
    torch.testing.assert_close(torch.func.jacfwd(fn)(cost).reshape_as(jac), jac)


@pytest.mark.parametrize("m", [2, 3, 5])
def test_gradcheck_forward_mode(m: int) -> None:
    cost, log_a, log_b, eps = _problem(2, 6, m, seed=70 + m)
    cost.requires_grad_(True)
    assert torch.autograd.gradcheck(
        _plan_fn(log_a, log_b, eps), (cost,), atol=1e-7, rtol=1e-5, check_forward_ad=True
    )


def test_gradcheck_forward_mode_near_permutation() -> None:
    cost, log_a, log_b, eps = _near_permutation_problem()
    cost.requires_grad_(True)
    assert torch.autograd.gradcheck(
        _plan_fn(log_a, log_b, eps), (cost,), atol=1e-7, rtol=1e-5, check_forward_ad=True
    )


def test_dual_tensor_forward_ad() -> None:
    """Plain forward AD (dual tensors) goes through the same jvp."""
    cost, log_a, log_b, eps = _problem(2, 5, 3, seed=80)
    fn = _plan_fn(log_a, log_b, eps)
    tangent = torch.randn(cost.shape, generator=seeded(81), dtype=F64)
    with torch.autograd.forward_ad.dual_level():
        out = fn(torch.autograd.forward_ad.make_dual(cost, tangent))
        dual = torch.autograd.forward_ad.unpack_dual(out).tangent
    torch.testing.assert_close(dual, torch.func.jvp(fn, (cost,), (tangent,))[1])


def test_vmap_equals_the_batched_call_and_nests() -> None:
    cost, log_a, log_b, eps = _problem(12, 7, 3, seed=90)
    cost[5, 2, 1] = math.nan  # a NaN row stays NaN under vmap too, and alone
    fn = _plan_fn(log_a, log_b, eps)
    ref = fn(cost)

    def one(c, la, lb, e):
        return sinkhorn_plan(c, la, lb, e, 100_000, 1e-14, True)[0]

    shape = (3, 4)
    args = [t.reshape(*shape, *t.shape[1:]) for t in (cost, log_a, log_b, eps)]
    out = torch.func.vmap(one)(*args)  # each slice is a (4, ...) batch
    torch.testing.assert_close(out.reshape(ref.shape), ref, atol=0, rtol=0, equal_nan=True)
    nested = torch.func.vmap(torch.func.vmap(lambda *a: one(*(t[None] for t in a))[0]))(*args)
    torch.testing.assert_close(nested.reshape(ref.shape), ref, atol=0, rtol=0, equal_nan=True)
    assert bool(torch.isnan(ref[5]).all()) and bool(torch.isfinite(ref[[4, 6]]).all())
    # marginals without a vmapped dimension are shared by every slice
    shared = torch.func.vmap(lambda c: one(c, log_a[:4], log_b[:4], eps[:4]))(args[0])
    torch.testing.assert_close(shared[2], one(args[0][2], log_a[:4], log_b[:4], eps[:4]))


def test_vmap_of_grad_and_of_jvp_equal_the_loop() -> None:
    """The backward (and the jvp) then see batched plans: the Cholesky fallback check reads
    through the wrappers instead of branching on a batched tensor."""
    cost, log_a, log_b, eps = _problem(2, 6, 3, seed=95)
    fn = _plan_fn(log_a, log_b, eps)
    costs = cost + 0.3 * torch.randn((4, *cost.shape), generator=seeded(96), dtype=F64)
    weight = torch.randn(cost.shape, generator=seeded(97), dtype=F64)

    def loss(c):
        return (fn(c) * weight).sum()

    grads = torch.func.vmap(torch.func.grad(loss))(costs)
    tangents = torch.func.vmap(lambda c: torch.func.jvp(fn, (c,), (weight,))[1])(costs)
    for i in range(4):
        torch.testing.assert_close(grads[i], torch.func.grad(loss)(costs[i]))
        torch.testing.assert_close(tangents[i], torch.func.jvp(fn, (costs[i],), (weight,))[1])
    # the same linear map: <weight, J dC> = <J weight, dC> with dC = weight
    torch.testing.assert_close((tangents * weight).sum((1, 2, 3)), (grads * weight).sum((1, 2, 3)))


def test_any_set_reads_through_vmap() -> None:
    flags = torch.tensor([[False, False], [False, True]])
    seen = []

    def probe(row):
        seen.append(sinkhorn._any_set(row))
        return row

    torch.func.vmap(probe)(flags)
    assert seen == [True]  # one slice has a set flag: the fallback is computed for all
    assert sinkhorn._any_set(torch.zeros(3, dtype=torch.bool, device="meta"))
    assert not sinkhorn._any_set(torch.zeros(3, dtype=torch.bool))


@pytest.mark.parametrize("newton", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_meta_tensors_give_shapes_without_solving(newton: bool, dtype: torch.dtype) -> None:
    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    res = log_sinkhorn(
        meta(3, 7, 4), meta(3, 7), meta(3, 4), meta(3), max_iter=50, tol=1e-9, newton=newton
    )
    assert res.iterations == 0
    for t, shape in zip(res[:3], [(3, 7), (3, 4), (3, 7, 4)], strict=True):
        assert t.device.type == "meta" and t.shape == shape and t.dtype == dtype
    assert res.converged.shape == (3,) and res.converged.dtype == torch.bool
    cost = meta(3, 7, 4).requires_grad_(True)
    plan, _ = sinkhorn_plan(cost, meta(3, 7), meta(3, 4), meta(3), 50, 1e-9, newton)
    (grad,) = torch.autograd.grad(plan.sum(), cost)
    assert grad.device.type == "meta" and grad.shape == cost.shape


def test_forward_over_reverse_hessian() -> None:
    """jvp of grad (the backward run on dual tensors) equals the reverse-mode Hessian."""
    cost, log_a, log_b, eps = _problem(2, 5, 3, seed=99)
    weight = torch.randn(cost.shape, generator=seeded(100), dtype=F64)
    fn = _plan_fn(log_a, log_b, eps)

    def loss(c):
        return (fn(c) * weight).sum()

    tangent = torch.randn(cost.shape, generator=seeded(101), dtype=F64)
    _, hvp = torch.func.jvp(torch.func.grad(loss), (cost,), (tangent,))
    hess = torch.func.jacrev(torch.func.grad(loss))(cost).reshape(cost.numel(), -1)
    assert float(hess.abs().max()) > 1e-2
    torch.testing.assert_close(hvp.reshape(-1), hess @ tangent.reshape(-1), atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(
        torch.func.jacfwd(torch.func.jacrev(loss))(cost).reshape_as(hess), hess
    )


def test_attach_epsilon_keeps_the_value_and_gives_the_epsilon_gradient():
    base = torch.tensor([[0.0, 2.0, math.inf], [1e100, -3.0, 0.5]], dtype=torch.float64)
    for eps0 in (0.7, 1e-200):  # at 1e-200, eps**2 underflows: C / eps**2 would be inf or NaN
        eps = torch.tensor([[eps0], [2 * eps0]], dtype=torch.float64, requires_grad=True)
        scaled = (base * eps0) / eps.detach()
        out = sinkhorn.attach_epsilon(scaled, eps)
        assert torch.equal(out, scaled)  # the same value, infinities included
        g = torch.tensor([[1.0, -2.0, 5.0], [0.5, 1.0, 3.0]], dtype=torch.float64)
        (ge,) = torch.autograd.grad(out, eps, g)
        finite = torch.isfinite(scaled)
        # d(C/eps)/deps = -(C/eps)/eps, infinite costs being constants
        want = -(torch.where(finite, g * scaled, 0)).sum(-1, keepdim=True) / eps.detach()
        torch.testing.assert_close(ge, want)
        assert torch.isfinite(ge).all()


@pytest.mark.parametrize("eps0", [0.7, 3e-3])
def test_attach_epsilon_has_the_derivatives_of_cost_over_epsilon_to_second_order(eps0: float):
    """Value, gradient and Hessian in (C, eps) equal those of the plain ``C / eps`` (where it
    does not overflow), including the terms d/dC d/deps and d2/deps2 that a detached copy of
    ``C / eps`` in the epsilon chain dropped (issue 23)."""
    g = torch.Generator().manual_seed(23)
    cost = torch.randn(2, 3, 4, generator=g, dtype=F64)
    cost[1, 2, 0] = math.inf  # a constant: no gradient reaches epsilon through it
    eps = eps0 * (1 + torch.rand(2, 1, 1, generator=g, dtype=F64))
    w = torch.randn(2, 3, 4, generator=g, dtype=F64)
    finite = torch.isfinite(cost)

    def loss(attach: bool):
        def f(c: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
            if attach:
                out = sinkhorn.attach_epsilon(torch.where(finite, c, math.inf) / e.detach(), e)
            else:  # the reference, its infinite entry a constant
                out = torch.where(finite, c / e, math.inf)
            return (w * torch.where(finite, torch.sin(out * eps0), 0)).sum()

        return f

    c0 = torch.where(finite, cost, 0.0)
    assert torch.equal(loss(True)(c0, eps), loss(False)(c0, eps))
    got = torch.autograd.functional.hessian(loss(True), (c0, eps))
    want = torch.autograd.functional.hessian(loss(False), (c0, eps))
    assert float(want[0][1].abs().max()) > 1e-3 and float(want[1][1].abs().max()) > 1e-3
    for got_row, want_row in zip(got, want, strict=True):
        for h, h_ref in zip(got_row, want_row, strict=True):
            torch.testing.assert_close(h, h_ref, atol=1e-10, rtol=1e-10)
            assert torch.isfinite(h).all()


@pytest.mark.parametrize("op", ["soft_sort", "soft_rank"])
def test_the_ot_sort_through_attach_epsilon_has_second_derivatives_in_x_and_epsilon(op: str):
    """The OT sort's cost ``(x_i - y_j)^2 / eps`` goes through :func:`attach_epsilon` too: its
    double backward in epsilon (and mixed in x, epsilon) was wrong for the same reason."""
    g = torch.Generator().manual_seed(231)
    x = torch.randn(2, 4, generator=g, dtype=F64, requires_grad=True)
    eps = torch.tensor([0.5, 0.8], dtype=F64, requires_grad=True)

    def fn(z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        fn_op = soft_sort if op == "soft_sort" else soft_rank
        return fn_op(z, epsilon=e, method="ot", tol=1e-13, max_iter=100_000)

    assert torch.autograd.gradgradcheck(fn, (x, eps))


# --------------------------------------------------------------------------- closed-form backward


@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("scale", [0.05, 1.0, 20.0])
def test_closed_form_vjp_equals_the_cholesky_path(m: int, scale: float) -> None:
    """For m <= 3 the Cramer solve of the grounded Laplacian gives the Cholesky path's VJP
    (nearly one-hot plans at a large cost scale included)."""
    cost, log_a, log_b, eps = _problem(6, 15, m, seed=30 + m)
    res = log_sinkhorn(cost * scale, log_a, log_b, eps, max_iter=100_000, tol=1e-13, newton=True)
    grad = torch.randn(res.plan.shape, generator=seeded(5), dtype=F64)
    ref = sinkhorn.implicit_cost_vjp(res.plan, grad, eps)
    out = sinkhorn.implicit_cost_vjp(res.plan, grad, eps, closed_form=True)
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-12 * ref.abs().max().item())


def test_closed_form_vjp_rows_without_coupling_take_the_cholesky_path() -> None:
    """A row whose K is singular (column 0 with no coupling left) gets the Cholesky path's
    pseudo-inverse answer, finite; the other rows keep the closed form's, bit for bit."""
    cost, log_a, log_b, eps = _problem(3, 8, 3, seed=7)
    res = log_sinkhorn(cost, log_a, log_b, eps, max_iter=100_000, tol=1e-13, newton=True)
    plan = res.plan.clone()
    plan[1, :, 0] = 0.0
    plan[1, 0] = torch.tensor([0.2, 0.0, 0.0], dtype=F64)  # column 0 alone on row 0
    grad = torch.randn(plan.shape, generator=seeded(6), dtype=F64)
    out = sinkhorn.implicit_cost_vjp(plan, grad, eps, closed_form=True)
    ref = sinkhorn._cholesky_vjp(plan, grad, eps)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1], ref[1], atol=0, rtol=0)
    alone = sinkhorn.implicit_cost_vjp(plan[[0, 2]], grad[[0, 2]], eps[[0, 2]], closed_form=True)
    torch.testing.assert_close(out[[0, 2]], alone, atol=0, rtol=0)


def test_closed_form_vjp_double_backward_equals_the_cholesky_path() -> None:
    """The closed form is written with differentiable ops: its own gradient (in the plan and in
    the incoming gradient) equals the Cholesky path's."""
    cost, log_a, log_b, eps = _problem(2, 7, 3, seed=8)
    res = log_sinkhorn(cost, log_a, log_b, eps, max_iter=100_000, tol=1e-13, newton=True)
    w = torch.randn(res.plan.shape, generator=seeded(9), dtype=F64)
    grads = []
    for closed in (False, True):
        plan = res.plan.clone().requires_grad_()
        grad = torch.randn(plan.shape, generator=seeded(10), dtype=F64).requires_grad_()
        out = sinkhorn.implicit_cost_vjp(plan, grad, eps, closed_form=closed)
        grads.append(torch.autograd.grad((out * w).sum(), (plan, grad)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("newton", [False, True])
def test_columns_of_subnormal_mass(dtype, m, newton):
    """(KD17) Column masses at and below the smallest normal number (down to a few subnormal
    ulps): the linear column sums of the loop rounded to 0 (``sigmoid`` gives 0 below
    ``1 / finfo.max``), ``log 0`` sent the column's potential to ``+inf`` and the plan to NaN.
    Sums at or below the safe level are taken in log space, and subnormal plan entries are
    formed there: every row converges and its columns carry their masses."""
    from softops.solvers import sinkhorn as solve

    tiny = torch.finfo(dtype).tiny
    g = seeded(17)
    for small in (tiny, tiny / 4, tiny / 16, tiny * 2.0**-20, tiny * 2**10):
        for cost in (torch.zeros(2, 5, m), torch.rand(2, 5, m, generator=g)):
            b = torch.full((2, m), small, dtype=F64)
            b[:, 0] = 1 - (m - 1) * small
            res = solve(
                cost.to(dtype),
                torch.full((2, 5), 0.2, dtype=dtype),
                b.to(dtype),
                1.0,
                newton=newton,
            )
            assert res.converged.all() and not res.plan.isnan().any(), (small, res.plan)
            cols = res.plan.double().sum(-2)[:, 1:]
            # a subnormal column holds its mass to the resolution of its entries
            ulp = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
            want = b.to(dtype).double()[:, 1:]
            tol = (1e-5 if dtype == torch.float32 else 1e-12) * want + 5 * 5 * ulp
            assert ((cols - want).abs() <= tol).all(), (small, cols, want)


# ------------------------------------------------------------ the shared linear algebra and op glue


def test_spd_factor_and_solve_equal_a_dense_solve_across_scales():
    # an SPD K whose diagonal spans 1e-12 .. 1e12 (what Jacobi equilibration is for)
    g = seeded(3)
    a = torch.randn(4, 3, 3, generator=g, dtype=F64)
    d = torch.tensor([1e-12, 1.0, 1e12], dtype=F64).sqrt()
    kmat = d[:, None] * (a @ a.mT + 3 * torch.eye(3, dtype=F64)) * d[None, :]
    rhs = torch.randn(4, 3, generator=g, dtype=F64)
    factor = sinkhorn.spd_factor(kmat)
    assert (factor[2] == 0).all()
    want = torch.linalg.solve(kmat, rhs)
    torch.testing.assert_close(sinkhorn.spd_solve(factor, rhs), want, rtol=1e-8, atol=0)


def test_cyclic_couplings_and_laplacian_solve_equal_the_grounded_laplacian():
    g = seeded(4)
    for m in (2, 3):
        p = torch.softmax(torch.randn(5, m, 7, generator=g, dtype=F64), 1)  # (B, m, n)
        w = torch.rand(5, 7, 1, generator=g, dtype=F64)
        cyc = sinkhorn.cyclic_couplings(p, w)
        for j in range(m):
            want = (w[:, :, 0] * p[:, j] * p[:, (j + 1) % m]).sum(-1)
            torch.testing.assert_close(cyc[:, j, 0], want)
        # the Laplacian of the couplings, grounded at the last column
        lap = torch.zeros(5, m, m, dtype=F64)
        for j in range(m if m == 3 else 1):
            i, k = j, (j + 1) % m
            c = cyc[:, j, 0]
            lap[:, i, i] += c
            lap[:, k, k] += c
            lap[:, i, k] -= c
            lap[:, k, i] -= c
        kmat = lap[:, : m - 1, : m - 1]
        rhs = torch.randn(5, m - 1, 1, generator=g, dtype=F64)
        sol, det = sinkhorn.laplacian_solve(cyc, rhs)
        torch.testing.assert_close(sol, torch.linalg.solve(kmat, rhs))
        torch.testing.assert_close(det[:, 0, 0], torch.linalg.det(kmat))


@pytest.mark.parametrize("potentials", [True, False])
def test_op_outputs_match_fake_outputs(potentials):
    # the real outputs of a Sinkhorn-type operator have the shapes, dtypes and strides its fake
    # implementation declares (torch.library checks this when tracing)
    cost = torch.rand(3, 5, 2, dtype=F64)
    log_a = torch.full((3, 5), -math.log(5), dtype=F64)
    log_b = torch.full((3, 2), -math.log(2), dtype=F64)
    res = log_sinkhorn(cost, log_a, log_b, torch.full((3,), 0.5, dtype=F64), max_iter=50, tol=0)
    real = sinkhorn.op_outputs(res, False, potentials)
    fake = sinkhorn.fake_outputs(cost, potentials)
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.dtype) == (f.shape, f.dtype)
        assert r.numel() == 0 or r.stride() == f.stride()  # (strides of an empty one are moot)
    assert real[-1].item() is False and real[-2].item() == res.iterations
    assert all(
        t.dtype == torch.float32 for t in sinkhorn.fake_outputs(cost, True, torch.float32)[:3]
    )


def test_warn_unless_clean_names_its_caller_only_when_a_row_may_not_have_converged():
    res = SinkhornResult(
        torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1, 1), torch.tensor([True, False]),
        7, torch.tensor([0.0, 0.5]),
    )  # fmt: skip
    with pytest.warns(softops.ConvergenceWarning, match="^myop: "):
        sinkhorn.warn_unless_clean("myop", res, False, 7, 1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sinkhorn.warn_unless_clean("", res, False, 7, 1e-6)  # no caller: no warning
        sinkhorn.warn_unless_clean("myop", res, True, 7, 1e-6)  # known clean: no warning
