"""soft_topk_mask(method="sparse"): the projection onto the capped simplex (topk/_sparse.py)."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from softops import soft_topk_mask

F64 = torch.float64


def sparse(x, k, eps, **kw):
    return soft_topk_mask(x, k, epsilon=eps, method="sparse", **kw)


def reference(x: torch.Tensor, k: float, eps: float) -> torch.Tensor:
    """Plain bisection on t (float64, 200 halvings), one row at a time."""
    out = []
    for row in x.to(F64).reshape(-1, x.shape[-1]):
        lo, hi = float(row.min()) - eps, float(row.max())
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if float(((row - mid) / eps).clamp(0, 1).sum()) > k:
                lo = mid
            else:
                hi = mid
        out.append(((row - 0.5 * (lo + hi)) / eps).clamp(0, 1))
    return torch.stack(out).reshape(x.shape)


def test_doc_example_exact_zeros_and_ones():
    x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0])
    a = sparse(x, 3, 2.0)
    assert torch.equal(a, torch.tensor([1.0, 0.0, 0.25, 0.75, 0.0, 1.0]))


@pytest.mark.parametrize("n", [7, 100, 3000])
@pytest.mark.parametrize("eps", [1e-3, 0.1, 1.0, 30.0])
def test_matches_bisection_reference(n, eps):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, generator=g, dtype=F64)
    for k in (0.5, 1, n / 3, n - 1.5):
        a = sparse(x, k, eps)
        torch.testing.assert_close(a, reference(x, k, eps), atol=1e-9, rtol=0)
        torch.testing.assert_close(a.sum(-1), torch.full((4,), float(k), dtype=F64))
        assert ((a == 0) | (a == 1) | ((a > 0) & (a < 1))).all()


def test_scipy_reference():
    optimize = pytest.importorskip("scipy.optimize")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, generator=g, dtype=F64)
    k, eps = 4.3, 0.4

    def residual(t: float) -> float:
        return float(((x - t) / eps).clamp(0, 1).sum()) - k

    t = optimize.brentq(residual, float(x.min()) - eps, float(x.max()), xtol=1e-15)
    torch.testing.assert_close(sparse(x, k, eps), ((x - t) / eps).clamp(0, 1), atol=1e-12, rtol=0)


def test_float32_sum_and_sparsity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 10_000, generator=g)
    a = sparse(x, 100, 0.05)
    torch.testing.assert_close(a.sum(-1), torch.full((8,), 100.0), atol=1e-3, rtol=0)
    assert (a == 0).float().mean() > 0.9 and (a == 1).any()


def test_hard_limit():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 50, generator=g, dtype=F64)
    hard = torch.zeros_like(x).scatter(-1, x.topk(7, -1).indices, 1)
    assert torch.equal(sparse(x, 7, 1e-9), hard)
    small = torch.zeros_like(x).scatter(-1, x.topk(7, -1, largest=False).indices, 1)
    assert torch.equal(sparse(x, 7, 1e-9, largest=False), small)


def test_ties_share_the_mass():
    x = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], dtype=F64)
    torch.testing.assert_close(
        sparse(x, 2, 1e-6), torch.tensor([1, 1 / 3, 1 / 3, 1 / 3, 0, 0], dtype=F64)
    )
    const = torch.full((2, 5), 4.0)
    torch.testing.assert_close(sparse(const, 2, 0.1), torch.full((2, 5), 0.4))


def test_edges_of_k():
    x = torch.randn(3, 6, dtype=F64)
    assert torch.equal(sparse(x, 0, 0.5), torch.zeros_like(x))
    assert torch.equal(sparse(x, 6, 0.5), torch.ones_like(x))


def test_scaling_law_and_dims():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, 3, generator=g, dtype=F64)
    a = sparse(x, 2.5, 0.3, dim=1)
    torch.testing.assert_close(sparse(7.0 * x, 2.5, 2.1, dim=1), a)
    loop = torch.stack([sparse(x[i, :, j], 2.5, 0.3) for i in range(2) for j in range(3)])
    torch.testing.assert_close(a.movedim(1, -1).reshape(6, 9), loop)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_in_float32(dtype):
    x = torch.randn(4, 64)
    a = sparse(x.to(dtype), 5, 0.2)
    assert a.dtype == dtype
    torch.testing.assert_close(a.float(), sparse(x.to(dtype).float(), 5, 0.2).to(dtype).float())


def test_per_row_k():
    x = torch.randn(3, 10, dtype=F64)
    k = torch.tensor([1.0, 2.5, 9.0], dtype=F64)
    a = sparse(x, k, 0.2)
    torch.testing.assert_close(a.sum(-1), k)
    for i in range(3):
        torch.testing.assert_close(a[i], sparse(x[i], float(k[i]), 0.2))


def test_infinities_and_nan():
    inf = math.inf
    x = torch.tensor(
        [
            [inf, 1.0, 2.0, -inf, 0.5],
            [1.0, math.nan, 2.0, 3.0, 4.0],
            [inf, inf, inf, 0.0, 1.0],  # more +inf than k
            [-inf, -inf, -inf, -inf, 1.0],  # fewer than k above -inf
            [inf, inf, 0.0, 1.0, 2.0],  # k = the +inf count
        ]
    )
    x.requires_grad_(True)
    a = sparse(x, 2, 0.5)
    assert torch.equal(a[0], torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0]))
    assert torch.equal(a[4], torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]))
    assert a[1:4].isnan().all()
    (g,) = torch.autograd.grad(a[[0, 4]].sum(), x)
    assert torch.equal(g[[0, 4]], torch.zeros(2, 5))  # (rows 1 to 3 are NaN, like "ot")
    # the limit: -inf equals a very low score, +inf a very high one
    finite = torch.tensor([1e6, 1.0, 2.0, -1e6, 0.5])
    torch.testing.assert_close(
        sparse(torch.tensor([inf, 1.0, 1.6, -inf, 0.5]), 2.2, 0.8),
        sparse(finite.clone().index_fill_(0, torch.tensor([2]), 1.6), 2.2, 0.8),
    )


def test_nan_row_is_confined():
    x = torch.randn(3, 6, dtype=F64, requires_grad=True)
    y = x.detach().clone()
    y[1, 2] = math.nan
    y.requires_grad_(True)
    a = sparse(y, 2, 0.3)
    assert a[1].isnan().all() and not a[[0, 2]].isnan().any()
    torch.testing.assert_close(a[[0, 2]], sparse(x.detach()[[0, 2]], 2, 0.3))
    (g,) = torch.autograd.grad(a[0].sum() + a[2, 0], y)
    assert not g[[0, 2]].isnan().any()


# ------------------------------------------------------------------------------------ gradients
def _away_from_breakpoints(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.linspace(-2, 2, n, dtype=F64)[torch.randperm(n, generator=g)] + 0.01 * torch.randn(
        n, generator=g, dtype=F64
    )


def test_gradcheck_x_k_eps():
    x = torch.stack([_away_from_breakpoints(seed=s) for s in range(3)]).requires_grad_(True)
    k = torch.tensor([2.3, 3.0, 5.6], dtype=F64, requires_grad=True)
    eps = torch.tensor([0.9, 1.3, 2.1], dtype=F64, requires_grad=True)

    def f(x, k, eps):
        return sparse(x, k, eps)

    assert torch.autograd.gradcheck(f, (x, k, eps), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, (x, k, eps))
    k0 = torch.tensor(2.7, dtype=F64, requires_grad=True)
    e0 = torch.tensor(1.1, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x, k0, e0), check_forward_ad=True)


def test_closed_form_jacobian():
    x = _away_from_breakpoints(10, seed=4)
    eps = 1.5
    a = sparse(x, 3.4, eps)
    S = (a > 0) & (a < 1)
    J = torch.autograd.functional.jacobian(lambda v: sparse(v, 3.4, eps), x)
    m = S.sum()
    expected = (torch.eye(10, dtype=F64) - S[None, :].to(F64) / m) / eps * (S[:, None] & S[None, :])
    torch.testing.assert_close(J, expected)
    torch.testing.assert_close(J, J.T)


def central(f, v: torch.Tensor, h: float) -> torch.Tensor:
    cols = []
    for j in range(v.numel()):
        e = torch.zeros_like(v).view(-1)
        e[j] = h
        e = e.view_as(v)
        cols.append((f(v + e) - f(v - e)) / (2 * h))
    return torch.stack(cols, -1)


@pytest.mark.parametrize(
    "x, k, eps",
    [
        ([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], 2.0, 1e-3),  # ties at the boundary
        ([0.1, 0.5, 0.9, 1.3, 1.7], 2.0, 1e-4),  # epsilon far below the gaps: S empty
        ([0.1, 0.5, 0.9, 1.3, 1.7], 2.3, 100.0),  # epsilon far above: everything free
        ([1e8 + 3.0, 1e8 + 1.0, 1e8 - 0.5, 1e8 - 2.0], 1.5, 2.0),  # large |x| / eps
    ],
)
def test_finite_differences_hard_regimes(x, k, eps):
    xt = torch.tensor(x, dtype=F64)
    J = torch.func.jacrev(lambda v: sparse(v, k, eps))(xt)
    h = 1e-4 * min(eps, 1.0)  # piecewise linear: any step that keeps the pieces is exact
    torch.testing.assert_close(J, central(lambda v: sparse(v, k, eps), xt, h), atol=1e-5, rtol=1e-5)
    e = torch.tensor(eps, dtype=F64)
    de = torch.func.jacrev(lambda s: sparse(xt, k, s))(e)
    fd = (sparse(xt, k, eps * (1 + 1e-4)) - sparse(xt, k, eps * (1 - 1e-4))) / (2e-4 * eps)
    torch.testing.assert_close(de, fd, atol=1e-5, rtol=1e-5)
    kt = torch.tensor(k, dtype=F64)
    dk = torch.func.jacrev(lambda s: sparse(xt, s, eps))(kt)
    if ((sparse(xt, k, eps) > 0) & (sparse(xt, k, eps) < 1)).any():
        fdk = (sparse(xt, k + 1e-4, eps) - sparse(xt, k - 1e-4, eps)) / 2e-4
        torch.testing.assert_close(dk, fdk, atol=1e-5, rtol=1e-5)
    else:  # S empty: the gradient is defined as 0
        assert torch.equal(dk, torch.zeros_like(dk))


def test_empty_support_gradient_is_zero():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=F64, requires_grad=True)
    eps = torch.tensor(0.1, dtype=F64, requires_grad=True)
    k = torch.tensor(2.0, dtype=F64, requires_grad=True)
    a = sparse(x, k, eps)
    assert torch.equal(a.detach(), torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=F64))
    gx, gk, ge = torch.autograd.grad((a * torch.arange(4.0, dtype=F64)).sum(), (x, k, eps))
    assert not gx.any() and gk == 0 and ge == 0


def test_vmap_jvp_jacrev():
    x = torch.randn(4, 7, dtype=F64)
    f = lambda v: sparse(v, 2.5, 0.6)  # noqa: E731
    torch.testing.assert_close(torch.func.vmap(f)(x), f(x))
    torch.testing.assert_close(
        torch.func.vmap(torch.func.jacrev(f))(x), torch.func.vmap(torch.func.jacfwd(f))(x)
    )
    t = torch.randn(7, dtype=F64)
    _, dot = torch.func.jvp(f, (x[0],), (t,))
    torch.testing.assert_close(dot, torch.func.jacrev(f)(x[0]) @ t)
    k = torch.tensor([1.0, 2.0, 3.5, 6.0], dtype=F64)
    per_row = torch.func.vmap(lambda v, kk: sparse(v, kk, 0.6))(x, k)
    torch.testing.assert_close(per_row, sparse(x, k, 0.6))


def test_hard_straight_through():
    x = torch.randn(3, 8, dtype=F64, requires_grad=True)
    a = sparse(x, 3, 0.5, hard=True)
    hard = torch.zeros_like(x).scatter(-1, x.detach().topk(3, -1).indices, 1)
    assert torch.equal(a.detach(), hard)
    w = torch.randn(3, 8, dtype=F64)
    (g,) = torch.autograd.grad((a * w).sum(), x)
    (g_soft,) = torch.autograd.grad((sparse(x, 3, 0.5) * w).sum(), x)
    torch.testing.assert_close(g, g_soft)


def test_entmax_budget_bisect_agreement():
    entmax = pytest.importorskip("entmax")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 40, generator=g, dtype=F64)
    # budget_bisect is clip(X - tau, 0, 1) with sum = budget, by bisection: ours at epsilon = 1
    ours = sparse(x, 5, 1.0)
    theirs = entmax.budget_bisect(x, budget=5, n_iter=100, dim=-1)
    torch.testing.assert_close(theirs.to(F64), ours, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------- options
def test_errors():
    x = torch.randn(2, 5)
    with pytest.raises(
        ValueError,
        match=r"^soft_topk_mask: expected `tol` to be left at its default None \(method='sparse' ",
    ):
        sparse(x, 2, 0.1, tol=1e-3)
    with pytest.raises(ValueError, match=r"expected 0 <= `k` <= x.shape\[dim\] \(= 5\); got k=7"):
        sparse(x, 7, 0.1)
    with pytest.raises(
        TypeError,
        match=r"^soft_topk_mask: expected `x` to have a real floating dtype .*torch.int64",
    ):
        sparse(torch.ones(2, 5, dtype=torch.long), 2, 0.1)
    with pytest.raises(ValueError, match=r"hard=True needs an integer k; got k=2.5"):
        sparse(x, 2.5, 0.1, hard=True)


def test_max_iter_cap_warns():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 1000, generator=g)
    with pytest.warns(UserWarning, match="max_iter"):
        sparse(x, 10, 0.01, max_iter=1)


def test_sparse_mask_on_canonical_rows_is_the_capped_simplex_projection():
    import warnings

    import softops
    from softops.topk import METHODS
    from softops.topk._options import MaskOptions

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 9, generator=g, dtype=torch.float64)
    k = torch.tensor([0.5, 1.0, 2.5, 4.0, 8.5], dtype=torch.float64)
    eps = torch.tensor([0.1, 0.5, 1.0, 2.0, 0.3], dtype=torch.float64)
    A = METHODS["sparse"].mask(x, k, eps, MaskOptions("op", 100))
    torch.testing.assert_close(A.sum(-1), k)
    # t by bisection on the residual sum(clip((x - t)/eps, 0, 1)) - k, written out
    lo, hi = (x.amin(-1) - eps).clone(), x.amax(-1).clone()
    for _ in range(200):
        t = (lo + hi) / 2
        r = ((x - t[:, None]) / eps[:, None]).clamp(0, 1).sum(-1) - k
        lo, hi = torch.where(r > 0, t, lo), torch.where(r > 0, hi, t)
    want = ((x - ((lo + hi) / 2)[:, None]) / eps[:, None]).clamp(0, 1)
    torch.testing.assert_close(A, want, atol=1e-12, rtol=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        METHODS["sparse"].mask(
            x, k, eps, MaskOptions("op", 1)
        )  # one evaluation cannot finish every row
    assert any(issubclass(w.category, softops.ConvergenceWarning) for w in caught)


# ------------------------------------------------- rows far beyond their gaps, tiny epsilon


def exact_mask(row: list[float], k: float, eps: float) -> list[float]:
    """The capped-simplex projection in exact rational arithmetic: r(t) = sum clip((x - t) /
    eps, 0, 1) - k is linear between consecutive breakpoints x_i and x_i - eps, so its root is
    found on the first breakpoint interval where r changes sign, with no rounding at all."""
    from fractions import Fraction

    fin = [Fraction(v) for v in row if math.isfinite(v)]
    k_fin = Fraction(k) - sum(v == math.inf for v in row)
    e = Fraction(eps)

    def clip(z: Fraction) -> Fraction:
        return min(max(z, Fraction(0)), Fraction(1))

    def r(t: Fraction) -> Fraction:
        return sum((clip((v - t) / e) for v in fin), Fraction(0)) - k_fin

    points = sorted(set(fin + [v - e for v in fin]))
    t = points[0]
    for a, b in itertools.pairwise(points):
        ra, rb = r(a), r(b)
        if ra >= 0 >= rb:
            t = a if ra == 0 else a + (b - a) * ra / (ra - rb)
            break
    inf = {math.inf: 1.0, -math.inf: 0.0}
    return [inf[v] if v in inf else float(clip((Fraction(v) - t) / e)) for v in row]


def test_entry_far_beyond_the_gaps():
    # (KD15) -1e216 beside -1 and 1: over the whole row's bracket [min x - eps, max x] the
    # secant crept down 216 decades and missed the cap (the mask summed to 3.25, with a warning)
    x = torch.tensor([[-1.0, -1.0, -1.0, -1e216, 1.0, 1e11]], dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = sparse(x, 2, 1.0, largest=False)
    torch.testing.assert_close(a, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 1, 0, 0]], dtype=F64))
    assert a.sum().item() == 2.0


def test_epsilon_near_the_smallest_normal():
    # (KD14) epsilon = finfo(float32).tiny and k = 1e-9 beside two zeros: t = -eps k / 2 is
    # below float32's subnormal spacing, and bisection in the units of x walked down the
    # subnormals (the mask summed to 0.668); solved in units of epsilon it is exact
    x = torch.tensor([[0.0, 0.0, -1.1754943508222875e-38, -1.0]], dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = sparse(x, 1e-9, 1.1754943508222869e-38)
    half = torch.tensor(5e-10, dtype=torch.bfloat16)
    assert torch.equal(a, torch.stack([half, half, half * 0, half * 0])[None])
    a32 = sparse(x.float(), 1e-9, 1.1754943508222869e-38)
    torch.testing.assert_close(a32.sum(), torch.tensor(1e-9), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared_k", [True, False])
def test_far_entries_and_tiny_epsilon_against_exact_arithmetic(dtype, shared_k):
    """Rows of moderate entries beside up to two entries far beyond their gaps (up to the
    dtype's range), infinities, and epsilon from near the smallest normal number to 1e3: the
    mask equals the exact rational projection, and no row warns (the whole-row bracket missed
    k on about 1 row in 10 of these)."""
    g = torch.Generator().manual_seed(11 + shared_k)
    top = math.log10(torch.finfo(dtype).max) - 1
    low = math.log10(torch.finfo(dtype).tiny) + 1
    tol = 1e-12 if dtype == F64 else 1e-5
    for _ in range(40):
        n = int(torch.randint(2, 10, (1,), generator=g))
        x = torch.randn(3, n, generator=g, dtype=F64) * 10.0 ** torch.randint(
            -3, 3, (3, 1), generator=g
        )
        for b in range(3):
            for _ in range(2):
                if torch.rand(1, generator=g) < 0.7:
                    far = float(torch.empty(1, dtype=F64).uniform_(5, top, generator=g))
                    x[b, int(torch.randint(0, n, (1,), generator=g))] = (
                        float(torch.randn(1, generator=g)) * 10.0**far
                    )
            if torch.rand(1, generator=g) < 0.2:
                x[b, int(torch.randint(0, n, (1,), generator=g))] = math.inf if b % 2 else -math.inf
        x = x.to(dtype)
        k = (torch.rand(3, generator=g, dtype=F64) * n).to(dtype)
        if torch.rand(1, generator=g) < 0.3:
            k = k.round()
        if shared_k:
            k = k[:1].expand(3).clone()
        eps = 10.0 ** float(torch.empty(1, dtype=F64).uniform_(low, 3, generator=g))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            a = sparse(x, k, eps)
        for b in range(3):
            row, kb = x[b].double().tolist(), float(k[b])
            n_pinf, n_fin = row.count(math.inf), sum(map(math.isfinite, row))
            if not 0 < kb - n_pinf < n_fin:
                continue
            want = torch.tensor(
                exact_mask(row, kb, float(torch.tensor(eps, dtype=dtype))), dtype=F64
            )
            torch.testing.assert_close(a[b].double(), want, atol=tol * max(1.0, kb), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_root_next_to_the_centre_in_a_few_steps(dtype):
    """(KD16) k = j + delta with delta down to the smallest normal number: the root u = -delta
    (in units of epsilon from the centre x_(j+1)) is far closer to the centre than the start
    (u = -1 on these rows). The Newton step taken as the increment u + r / |S| lost delta to
    the rounding of r = 1 - delta and landed on the centre, the bracket's end; bisection then
    walked down about 100 binades (k = finfo(float32).tiny did not converge within
    max_iter=100). The step in closed form on its piece finds it at once: the mask is exact
    within 8 evaluations."""
    tiny = torch.finfo(dtype).tiny
    deltas = [tiny, 3 * tiny, 1e-37, 1e-30, 1e-20, 1e-10, 1e-4]
    if dtype == F64:
        deltas += [1e-300, 1e-200, 1e-100]
    g = torch.Generator().manual_seed(16)
    rows = [[0.0, 1.0, 2.0], [0.0, 0.5, 1.0, 3.0, 3.25]]
    rows += (torch.randn(4, 6, generator=g, dtype=F64) * 3).tolist()
    for row, delta, j, eps in itertools.product(rows, deltas, (0, 1, 2), (1.0, 0.3, 10.0)):
        x = torch.tensor([row], dtype=dtype)
        k = j + delta
        if float(torch.tensor(k, dtype=dtype)) == j:
            continue  # k is the integer j in this dtype
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            a = sparse(x, k, eps, max_iter=8)
        want = torch.tensor(exact_mask(x[0].double().tolist(), k, eps), dtype=F64)
        # entries within delta of 0 or 1 are resolved relative to delta where j = 0
        tol = (1e-12 if dtype == F64 else 1e-6) * (delta if j == 0 else 1.0)
        torch.testing.assert_close(a[0].double(), want, atol=tol, rtol=0)
