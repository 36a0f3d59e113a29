"""soft_topk_mask with method="ot" (the default) and hard=True; the threshold solver."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import func
from torch.autograd import gradcheck, gradgradcheck

import softops
from softops import soft_topk_mask
from softops._core import rootfind
from softops.solvers import topk_threshold
from softops.testing import unrolled_sinkhorn_topk_mask
from softops.topk import _ot
from softops.topk._ot import hard_topk_mask as hard_mask_kernel
from softops.topk._ot import solve
from tests._helpers import hard_topk_mask, mask_at_threshold

F64 = torch.float64


def _distinct(B: int, n: int, dtype=F64) -> torch.Tensor:
    """Rows with well-separated entries (a gap of at least 1/n between any two)."""
    return torch.stack([torch.randperm(n).to(dtype) / n * 4 for _ in range(B)])


# ----------------------------------------------------------------------------- reference values


def test_reproduces_official_demo():
    # The official notebook: scores [5,2,3,4,1,6], k=3, the k smallest, paper eps 5e-2 on a cost
    # normalised by max C = 36, i.e. epsilon = 0.05 * 36 / 2 = 0.9 in our units.
    x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0], dtype=F64, requires_grad=True)
    A = soft_topk_mask(x, 3, epsilon=0.9, largest=False)
    expected = torch.tensor(
        [0.15886910, 0.84113090, 0.63542356, 0.36457644, 0.94146310, 0.05853690]
    )
    torch.testing.assert_close(A.detach(), expected.to(F64), atol=1e-7, rtol=0)
    (A[1] + A[2] + A[3]).backward()
    grad = torch.tensor([0.10541585, -0.04306151, -0.07465184, -0.07465144, 0.04347444, 0.04347456])
    torch.testing.assert_close(x.grad, grad.to(F64), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("n", "k", "eps"), [(7, 3, 0.5), (40, 1, 0.2), (40, 39, 0.2), (60, 12, 1.0)]
)
def test_equals_converged_sinkhorn_and_its_autograd(n, k, eps):
    x = torch.randn(3, n, dtype=F64, requires_grad=True)
    ref = unrolled_sinkhorn_topk_mask(x, k, eps, n_iter=3000)
    A = soft_topk_mask(x, k, epsilon=eps)
    torch.testing.assert_close(A, ref, atol=1e-10, rtol=0)
    g = torch.randn_like(A)
    (gx,) = torch.autograd.grad(A, x, g)
    (gref,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(gx, gref, atol=1e-9, rtol=0)


# ----------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    ("n", "k", "eps"), [(7, 3, 0.5), (50, 1, 0.1), (50, 49, 0.1), (30, 15, 3.0)]
)
def test_gradcheck_x_k_epsilon(n, k, eps):
    x = torch.randn(2, n, dtype=F64, requires_grad=True)
    kt = torch.tensor(float(k), dtype=F64, requires_grad=True)
    et = torch.tensor(eps, dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, k, e: soft_topk_mask(x, k, epsilon=e), (x, kt, et))
    assert gradgradcheck(lambda x: soft_topk_mask(x, k, epsilon=eps), (x,))


def test_gradcheck_per_row_k_and_epsilon_any_dim():
    x = torch.randn(3, 9, 2, dtype=F64, requires_grad=True)
    k = torch.tensor([[2.0, 3.5], [1.0, 8.0], [4.0, 4.25]], dtype=F64, requires_grad=True)
    e = torch.tensor([[0.3], [1.0], [0.7]], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, k, e: soft_topk_mask(x, k, dim=1, epsilon=e), (x, k, e))


def test_gradient_is_zero_not_nan_in_the_hard_limit():
    x = torch.tensor([[3.0, 1.0, 2.0, 0.0]], dtype=F64, requires_grad=True)
    A = soft_topk_mask(x, 2, epsilon=1e-300)
    assert torch.equal(A.detach(), torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=F64))
    (g,) = torch.autograd.grad(A.sum() + (A * torch.arange(4.0)).sum(), x)
    assert torch.equal(g, torch.zeros_like(g))


def test_hard_straight_through():
    x = torch.randn(4, 10, dtype=F64, requires_grad=True)
    A = soft_topk_mask(x, 3, epsilon=0.5, hard=True)
    assert torch.equal(A.detach(), hard_topk_mask(x.detach(), 3))
    g = torch.randn_like(A)
    (gh,) = torch.autograd.grad(A, x, g)
    (gs,) = torch.autograd.grad(soft_topk_mask(x, 3, epsilon=0.5), x, g)
    torch.testing.assert_close(gh, gs)
    per_row = torch.tensor([1.0, 2.0, 3.0, 9.0], dtype=F64)
    H = soft_topk_mask(x, per_row, epsilon=0.5, hard=True)
    assert H.sum(-1).tolist() == per_row.tolist()
    assert torch.equal(H[0], hard_topk_mask(x[0].detach(), 1))
    with pytest.raises(ValueError, match=r"hard=True needs an integer k; got k=2.5"):
        soft_topk_mask(x, 2.5, hard=True)


# ---------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(
    ("n", "k"), [(10, 3), (1000, 10), (1000, 990), (20000, 200), (20000, 10000)]
)
@pytest.mark.parametrize("eps", [10.0, 1.0, 0.1, 1e-3, 1e-6])
def test_in_unit_interval_and_sums_to_k(dtype, n, k, eps):
    x = torch.randn(8, n, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # must converge within the default cap
        A = soft_topk_mask(x, k, epsilon=eps)
    assert A.dtype == dtype
    assert bool(((A >= 0) & (A <= 1)).all())
    rel = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(
        A.double().sum(-1), torch.full((8,), float(k), dtype=F64), rtol=rel, atol=0
    )


def test_permutation_equivariant_and_shift_invariant():
    x = torch.randn(5, 30, dtype=F64)
    perm = torch.randperm(30)
    A = soft_topk_mask(x, 7, epsilon=0.3)
    torch.testing.assert_close(soft_topk_mask(x[:, perm], 7, epsilon=0.3), A[:, perm])
    torch.testing.assert_close(soft_topk_mask(x + 123.25, 7, epsilon=0.3), A, atol=1e-10, rtol=0)
    # scaling law: soft_topk_mask(c x, epsilon=c e) == soft_topk_mask(x, epsilon=e)
    torch.testing.assert_close(soft_topk_mask(4 * x, 7, epsilon=1.2), A, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_any_dim_equals_loop_over_rows(dim):
    x = torch.randn(4, 6, 5, dtype=F64)
    A = soft_topk_mask(x, 2.5, dim=dim, epsilon=0.4)
    xm = x.movedim(dim, -1)
    rows = xm.reshape(-1, xm.shape[-1])
    looped = torch.stack([soft_topk_mask(r, 2.5, epsilon=0.4) for r in rows]).reshape(xm.shape)
    torch.testing.assert_close(A, looped.movedim(-1, dim))
    torch.testing.assert_close(A.sum(dim), torch.full_like(A.sum(dim), 2.5))


def test_reaches_hard_mask_as_epsilon_goes_to_zero():
    x = _distinct(6, 50)
    hard = hard_topk_mask(x, 10)
    errs = [
        float((soft_topk_mask(x, 10, epsilon=e) - hard).abs().max()) for e in (1.0, 0.1, 0.01, 1e-3)
    ]
    assert errs == sorted(errs, reverse=True)
    assert errs[-1] < 1e-8
    lo = soft_topk_mask(x, 10, epsilon=1e-3, largest=False)
    torch.testing.assert_close(lo, hard_topk_mask(x, 10, largest=False), atol=1e-8, rtol=0)


def test_largest_false_is_largest_of_negated():
    x = torch.randn(3, 20, dtype=F64)
    torch.testing.assert_close(soft_topk_mask(x, 4, largest=False), soft_topk_mask(-x, 4))


def test_ties_share_mass_at_tiny_epsilon_in_float32():
    x = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    A = soft_topk_mask(x, 2, epsilon=1e-6)
    torch.testing.assert_close(A, torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3, 0.0, 0.0]))
    # all-equal rows: k/n everywhere, finite gradient
    y = torch.zeros(1, 8, dtype=F64, requires_grad=True)
    B = soft_topk_mask(y, 3, epsilon=0.1)
    torch.testing.assert_close(B, torch.full_like(B, 3 / 8))
    (g,) = torch.autograd.grad((B * torch.arange(8.0)).sum(), y)
    assert bool(torch.isfinite(g).all())


def test_rows_are_independent():
    # The official implementation divides the cost by a batch-wide max: scaling one row changes
    # the others. Here rows never interact.
    x = torch.randn(4, 25, dtype=F64)
    A = soft_topk_mask(x, 5, epsilon=0.2)
    x2 = x.clone()
    x2[0] *= 1000
    A2 = soft_topk_mask(x2, 5, epsilon=0.2)
    assert torch.equal(A2[1:], A[1:])


def test_k_edges_and_fractional_k():
    x = torch.randn(3, 11, dtype=F64, requires_grad=True)
    assert torch.equal(soft_topk_mask(x, 0), torch.zeros_like(x))
    assert torch.equal(soft_topk_mask(x, 11), torch.ones_like(x))
    (g,) = torch.autograd.grad(soft_topk_mask(x, 11).sum(), x, allow_unused=True)
    assert g is None or torch.equal(g, torch.zeros_like(x))
    A = soft_topk_mask(x, 3.7, epsilon=0.5)
    torch.testing.assert_close(A.sum(-1), torch.full((3,), 3.7, dtype=F64))


def test_per_row_k_and_gradient_in_k():
    x = torch.randn(2, 3, 12, dtype=F64)
    k = torch.tensor([[1.0, 5.0, 11.5], [0.0, 12.0, 6.0]], dtype=F64)
    A = soft_topk_mask(x, k, epsilon=0.3)
    torch.testing.assert_close(A.sum(-1), k)
    # dA/dk = s / sum(s): increasing k by dk adds exactly dk of mass
    kt = torch.tensor(4.0, dtype=F64, requires_grad=True)
    (gk,) = torch.autograd.grad(soft_topk_mask(x, kt, epsilon=0.3).sum(), kt)
    torch.testing.assert_close(gk, torch.tensor(6.0, dtype=F64))


# -------------------------------------------------------------------------- special values


def test_nan_row_stays_in_its_row():
    x = torch.randn(3, 10, dtype=F64, requires_grad=True)
    with torch.no_grad():
        x[1, 4] = math.nan
    A = soft_topk_mask(x, 3, epsilon=0.2)
    assert bool(torch.isnan(A[1]).all())
    assert bool(torch.isfinite(A[[0, 2]]).all())
    torch.testing.assert_close(A[[0, 2]], soft_topk_mask(x[[0, 2]].detach(), 3, epsilon=0.2))
    (g,) = torch.autograd.grad(A[[0, 2]].pow(2).sum(), x)
    assert bool(torch.isfinite(g[[0, 2]]).all())


def test_infinities_behave_as_their_limits():
    inf = math.inf
    x = torch.tensor(
        [
            [1.0, -inf, 3.0, 2.0, -inf, 0.5],  # -inf never selected
            [inf, 1.0, 2.0, 0.0, -1.0, 3.0],  # +inf always selected
            [-inf, -inf, -inf, 1.0, 2.0, 3.0],  # exactly k finite: all of them
            [inf, inf, inf, inf, 1.0, 2.0],  # more +inf than k: cannot hold
            [-inf, -inf, -inf, -inf, -inf, 2.0],  # fewer than k above -inf: cannot hold
            [inf, inf, inf, 1.0, 2.0, -inf],  # exactly k at +inf
        ],
        dtype=F64,
        requires_grad=True,
    )
    A = soft_topk_mask(x, 3, epsilon=0.1)
    ref0 = soft_topk_mask(torch.tensor([1.0, 3.0, 2.0, 0.5], dtype=F64), 3, epsilon=0.1)
    torch.testing.assert_close(A[0, [0, 2, 3, 5]], ref0)
    assert A[0, 1] == 0 and A[0, 4] == 0
    assert A[1, 0] == 1
    torch.testing.assert_close(A[1, 1:].sum(), torch.tensor(2.0, dtype=F64))
    assert A[2].tolist() == [0, 0, 0, 1, 1, 1]
    assert bool(torch.isnan(A[3]).all()) and bool(torch.isnan(A[4]).all())
    assert A[5].tolist() == [1, 1, 1, 0, 0, 0]
    (g,) = torch.autograd.grad((A[[0, 1, 2, 5]] * torch.randn(4, 6, dtype=F64)).sum(), x)
    assert bool(torch.isfinite(g[[0, 1, 2, 5]]).all())
    assert g[0, 1] == 0 and g[1, 0] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    x = torch.randn(4, 1000)
    A = soft_topk_mask(x.to(dtype), 100, epsilon=0.1)
    assert A.dtype == dtype
    ref = soft_topk_mask(x.to(dtype).float(), 100, epsilon=0.1)
    torch.testing.assert_close(A.float(), ref, atol=4e-3, rtol=0)
    xr = x.to(dtype).requires_grad_()
    soft_topk_mask(xr, 100).sum().backward()
    assert xr.grad.dtype == dtype


def test_very_long_rows():
    x = torch.randn(1, 10_000_000)
    A = soft_topk_mask(x, 1000, epsilon=0.01)
    assert abs(float(A.double().sum()) - 1000) < 1000 * 1e-5
    torch.testing.assert_close(
        A[0].topk(1000).indices.sort().values, x[0].topk(1000).indices.sort().values
    )


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 40),
    data=st.data(),
    scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e3, 1e20]),
    eps_rel=st.sampled_from([1e-6, 1e-2, 1.0, 100.0]),
)
def test_property_sum_bounds_and_no_nan(n, data, scale, eps_rel):
    # ties (integers in a small range), extreme magnitudes, temperatures across 8 decades
    vals = data.draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))
    k = data.draw(st.floats(0.0, float(n)))
    x = torch.tensor(vals, dtype=F64) * scale
    A = soft_topk_mask(x, k, epsilon=eps_rel * scale)
    assert bool(torch.isfinite(A).all())
    assert bool(((A >= 0) & (A <= 1)).all())
    assert abs(float(A.sum()) - k) <= 1e-8 * max(k, 1)
    # monotone in x: a larger score never gets less mass
    order = x.argsort()
    assert bool((A[order].diff() >= -1e-12).all())


# -------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"k": 7}, ValueError, r"expected 0 <= `k` <= x.shape\[dim\] \(= 5\); got k=7"),
        ({"k": -1}, ValueError, r"got k=-1"),
        ({"k": torch.tensor([1.0, 6.0])}, ValueError, r"got k=6"),
        (
            {"k": 2, "epsilon": 0.0},
            ValueError,
            r"expected `epsilon` > 0 and finite; got epsilon=0.0",
        ),
        ({"k": 2, "epsilon": -1.0}, ValueError, r"got epsilon=-1.0"),
        ({"k": 2, "epsilon": torch.tensor([0.1, -2.0])}, ValueError, r"got epsilon=-2.0"),
        ({"k": 2, "dim": 2}, ValueError, r"expected `dim` in \[-2, 1\].*got dim=2"),
        ({"k": 2, "method": "bogus"}, ValueError, r"got method='bogus'"),
        ({"k": "2"}, TypeError, r"expected `k` to be a number; got '2'"),
        ({"k": 2, "max_iter": 0}, ValueError, r"got max_iter=0"),
        ({"k": 2, "tol": -1.0}, ValueError, r"got tol=-1.0"),
        ({"k": torch.ones(3)}, ValueError, r"broadcastable to the batch shape \(2,\)"),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, exc, match):
    x = torch.randn(2, 5)
    with pytest.raises(exc, match=match):
        soft_topk_mask(x, **kwargs)


def test_bad_dtype_and_empty_dim():
    with pytest.raises(TypeError, match=r"real floating dtype.*got dtype=torch.int64"):
        soft_topk_mask(torch.arange(5), 2)
    with pytest.raises(ValueError, match=r"non-empty `dim`; got x.shape\[1\] = 0"):
        soft_topk_mask(torch.zeros(3, 0), 0)
    with pytest.raises(TypeError, match=r"expected `x` to be a torch.Tensor; got list"):
        soft_topk_mask([1.0, 2.0], 1)


def test_empty_batch_is_fine():
    x = torch.zeros(0, 5)
    assert soft_topk_mask(x, 2).shape == (0, 5)


def test_not_converged_warns():
    x = torch.randn(4, 100, dtype=F64)
    with pytest.warns(softops.ConvergenceWarning, match=r"did not converge within max_iter=2"):
        soft_topk_mask(x, 10, epsilon=0.5, max_iter=2)


@pytest.mark.parametrize("method", ["ot", "sinkhorn", "softkmax", "perturbed"])
def test_empty_batch_stays_on_the_graph(method: str) -> None:
    x = torch.empty(0, 5, requires_grad=True)
    A = soft_topk_mask(x, 2, method=method)
    assert A.shape == (0, 5) and A.requires_grad
    A.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 5)


# ------------------------------------------------------------------ solver and hard mask (_ot)


def test_hard_topk_mask_scalar_and_per_row_k():
    x = torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]])
    assert hard_mask_kernel(x, torch.tensor([1.0, 2.0]), None).tolist() == [[1, 0, 0], [0, 1, 1]]
    assert torch.equal(
        hard_mask_kernel(x, torch.tensor([2.0, 2.0]), 2), torch.tensor([[1.0, 0, 1], [0, 1, 1]])
    )


def test_solve_long_rows_take_the_subsampled_path_and_match_the_exact_one():
    x = torch.randn(3, 40_000, dtype=F64)
    k = torch.full((3,), 400.0, dtype=F64)
    eps = torch.full((3,), 0.05, dtype=F64)
    state = solve(x, k, eps, k_scalar=400.0)
    assert bool(state.converged.all()) and state.iterations <= 12
    A = mask_at_threshold(x, state, eps)
    torch.testing.assert_close(A.sum(-1), k, atol=1e-9, rtol=0)
    # the same rows solved exactly (centre and bracket from the full top-k) give the same mask
    short = solve(x[:, :16_000], k, eps, k_scalar=400.0)
    assert bool(short.converged.all())


def test_solve_reports_unsolvable_rows():
    x = torch.tensor([[math.nan, 1.0, 2.0], [math.inf, math.inf, 0.0], [1.0, 2.0, 3.0]], dtype=F64)
    k = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
    state = solve(x, k, torch.full((3,), 0.1, dtype=F64))
    assert state.invalid.tolist() == [True, True, False]
    assert state.converged.tolist() == [False, False, True]
    assert math.isnan(state.residual[0]) and math.isnan(state.residual[1])


# ----------------------------------------------------------------------------- k at 0 and n


def _edge_fd(x, k, e, n_out, which, h):
    """Central (or, at an end of [0, n], one-sided) FD of <A, w> in x, k or epsilon, float64."""
    w = torch.arange(1, n_out + 1, dtype=F64)

    def f(xv, kv, ev):
        return float((soft_topk_mask(xv, kv, epsilon=ev) * w).sum().detach())

    if which == "x":
        out = torch.zeros_like(x)
        for j in range(x.numel()):
            d = torch.zeros_like(x)
            d[j] = h
            out[j] = (f(x + d, k, e) - f(x - d, k, e)) / (2 * h)
        return out
    if which == "k":
        n = x.numel()
        lo, hi = max(k - h, 0.0), min(k + h, float(n))
        return torch.tensor((f(x, hi, e) - f(x, lo, e)) / (hi - lo), dtype=F64)
    return torch.tensor((f(x, k, e + h) - f(x, k, e - h)) / (2 * h), dtype=F64)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("delta", [1e-300, 1e-100, 1e-30, 1e-12, 1e-8, 1e-5, 1e-3])
@pytest.mark.parametrize("near_n", [False, True])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_k_within_rounding_of_0_or_n(dtype, delta, near_n, as_tensor):
    # A real k in (0, n) that rounds to 0 or n in the compute dtype takes the limit (no NaN, no
    # warning), and its gradients in x, k and epsilon are finite and match finite differences
    # (in k, one-sided at the ends of [0, n]: the limits of dA/dk there are softmax(+-x/eps)).
    x64 = torch.tensor([0.3, -1.2, 0.8], dtype=F64)
    n = 3
    k = n - delta if near_n else delta
    e = 0.5
    x = x64.to(dtype).requires_grad_()
    kt = torch.tensor(k, dtype=dtype, requires_grad=True)
    et = torch.tensor(e, dtype=dtype, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A = soft_topk_mask(x, kt if as_tensor else k, epsilon=et)
    assert torch.isfinite(A).all()
    limit = torch.ones(n) if near_n else torch.zeros(n)
    torch.testing.assert_close(A.detach().double(), limit.double(), atol=2 * delta, rtol=0)
    w = torch.arange(1, n + 1, dtype=dtype)
    inputs = (x, kt, et) if as_tensor else (x, et)
    grads = torch.autograd.grad((A * w).sum(), inputs)
    assert all(torch.isfinite(g).all() for g in grads)
    # The reference: float64 finite differences at the k the compute dtype holds.
    k_held = float(torch.tensor(k, dtype=dtype).double())
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == F64 else dict(atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(grads[0].double(), _edge_fd(x64, k_held, e, n, "x", 1e-6), **tol)
    torch.testing.assert_close(grads[-1].double(), _edge_fd(x64, k_held, e, n, "eps", 1e-6), **tol)
    if as_tensor:
        h = min(1e-7, k_held / 4) if 0 < k_held < n / 2 else 1e-7
        torch.testing.assert_close(grads[1].double(), _edge_fd(x64, k_held, e, n, "k", h), **tol)


@pytest.mark.parametrize("k", [0.0, 3.0])
def test_k_gradient_at_the_ends_is_the_one_sided_limit(k):
    # At k = 0 the mask is ~ k softmax(x/eps), at k = n it is ~ 1 - (n - k) softmax(-x/eps):
    # the derivative in k is that softmax (it was 0: s underflows), also with infinities.
    x = torch.tensor([0.3, -1.2, 0.8], dtype=F64)
    kt = torch.tensor(k, dtype=F64, requires_grad=True)
    g = torch.randn(3, dtype=F64)
    (gk,) = torch.autograd.grad((soft_topk_mask(x, kt, epsilon=0.5) * g).sum(), kt)
    sign = 1 if k == 0 else -1
    torch.testing.assert_close(gk, (torch.softmax(sign * x / 0.5, -1) * g).sum())
    xi = torch.tensor([0.3, -1.2, 0.8, math.inf, -math.inf], dtype=F64)
    kt = torch.tensor(k + 1, dtype=F64, requires_grad=True)
    g = torch.cat((g, torch.tensor([5.0, 7.0], dtype=F64)))
    (gk,) = torch.autograd.grad((soft_topk_mask(xi, kt, epsilon=0.5) * g).sum(), kt)
    torch.testing.assert_close(gk, (torch.softmax(sign * x / 0.5, -1) * g[:3]).sum())


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_k_gradient_survives_underflow_of_s(dtype):
    # Gaps of 1 at epsilon 1e-3: every s_i underflows, but dA/dk = s / sum(s) is the limit
    # (shared between the two entries at the threshold), not 0.
    x = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=dtype)
    kt = torch.tensor(2.0, dtype=dtype, requires_grad=True)
    (gk,) = torch.autograd.grad(soft_topk_mask(x, kt, epsilon=1e-3)[1], kt)
    assert abs(float(gk) - 0.5) < 1e-3


@pytest.mark.parametrize("row", [[0.0, 1e-20], [0.0, 0.0], [3.0, -1.0, 2.0]])
@pytest.mark.parametrize("k", [5e-324, 1e-322])
def test_subnormal_k_converges_without_warning(row, k):
    # The bracket's logs are taken apart (log k - log(n - k)): as a ratio, k / n of the smallest
    # subnormal rounds to 0 and the bracket became infinite (711 evaluations instead of 2).
    x = torch.tensor([row], dtype=F64)
    eps = 1e-6 * float(x.abs().max().clamp(min=1e-20))
    with warnings.catch_warnings():
        warnings.simplefilter("error", softops.ConvergenceWarning)
        A = soft_topk_mask(x, k, epsilon=eps)
    res = topk_threshold(x, k, eps)
    assert bool(res.converged.all()) and res.iterations <= 10
    assert float(A.sum()) == pytest.approx(0.0, abs=1e-300) and bool((A >= 0).all())


# ------------------------------------------------------------------ forward mode (the jvp rule)


def _rows_with_edges() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows at k = 0, k = n, with +-inf entries (k counting them), and plain per-row k."""
    inf = math.inf
    x = torch.tensor(
        [
            [0.3, -1.2, 0.8, 2.0, -0.4],
            [0.3, -1.2, 0.8, 2.0, -0.4],
            [1.5, -0.2, 0.9, -2.1, 0.4],
            [0.7, inf, -0.5, 1.1, -inf],
            [0.2, 0.25, -0.9, 1.4, 0.6],
            [inf, 0.1, -0.3, -inf, 2.2],
        ],
        dtype=F64,
    )
    k = torch.tensor([0.0, 5.0, 2.5, 2.0, 1.0, 1.0], dtype=F64)  # row 5: only its +inf
    eps = torch.tensor([0.5, 0.7, 0.3, 0.4, 1.3, 0.6], dtype=F64)
    return x, k, eps


def test_jvp_equals_the_transposed_backward_with_edges_and_infinities():
    # Forward mode (the jvp rule) against reverse mode (the backward), column by column, in x,
    # k and epsilon: rows at k = 0 and k = n (the one-sided limits in k), +-inf entries, a row
    # that selects only its +inf entry. The Jacobian in x is also symmetric.
    x, k, eps = _rows_with_edges()

    def fn(x, k, e):
        return soft_topk_mask(x, k, epsilon=e)

    fwd = torch.autograd.functional.jacobian(
        fn, (x, k, eps), strategy="forward-mode", vectorize=True
    )
    rev = torch.autograd.functional.jacobian(fn, (x, k, eps))
    for a, b in zip(fwd, rev, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    jx = fwd[0]
    for i in range(x.shape[0]):
        block = jx[i, :, i, :]
        torch.testing.assert_close(block, block.T, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(block.sum(-1), torch.zeros(5, dtype=F64), atol=1e-12, rtol=0)
    # the k-column of a row is dA/dk, which sums to 1 (sum A = k), also at k = 0 and k = n and
    # on row 5 (k = 1 = its +inf entry: the limit in k is a softmax over its finite entries)
    jk = torch.stack([fwd[1][i, :, i] for i in range(x.shape[0])])
    torch.testing.assert_close(jk.sum(-1), torch.ones(x.shape[0], dtype=F64), atol=1e-12, rtol=0)
    # the epsilon-column sums to 0 (sum A = k whatever epsilon)
    je = torch.stack([fwd[2][i, :, i] for i in range(x.shape[0])])
    torch.testing.assert_close(je.sum(-1), torch.zeros(x.shape[0], dtype=F64), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("n", "k", "eps"), [(7, 3, 0.5), (30, 1, 0.1), (30, 29, 0.2), (20, 6.5, 3.0)]
)
def test_gradcheck_forward_mode_per_row_k_and_epsilon(n, k, eps):
    # float64 central differences against the jvp (check_forward_ad) and the backward together,
    # in x, a per-row k and a per-row epsilon.
    x = torch.randn(3, n, dtype=F64, requires_grad=True)
    kt = torch.tensor(
        [k, max(k - 0.5, 0.5), min(k + 0.75, n - 0.25)], dtype=F64, requires_grad=True
    )
    et = torch.tensor([eps, 2 * eps, 0.5 * eps], dtype=F64, requires_grad=True)
    assert gradcheck(
        lambda x, k, e: soft_topk_mask(x, k, epsilon=e),
        (x, kt, et),
        check_forward_ad=True,
        check_backward_ad=True,
        check_undefined_grad=False,
    )


def test_func_jvp_in_each_input_and_jacfwd_with_a_tensor_k():
    x, k, eps = _rows_with_edges()
    v = torch.linspace(-1.0, 1.0, x.numel(), dtype=F64).reshape(x.shape)
    v = torch.where(torch.isfinite(x), v, 0)

    def fn(x, k, e):
        return soft_topk_mask(x, k, epsilon=e)

    out, tangent = func.jvp(fn, (x, k, eps), (v, torch.ones_like(k), 0.1 * torch.ones_like(eps)))
    torch.testing.assert_close(out, fn(x, k, eps))
    jac = torch.autograd.functional.jacobian(fn, (x, k, eps))
    want = (
        torch.einsum("bnij,ij->bn", jac[0], v)
        + torch.einsum("bni,i->bn", jac[1], torch.ones_like(k))
        + torch.einsum("bni,i->bn", jac[2], 0.1 * torch.ones_like(eps))
    )
    torch.testing.assert_close(tangent, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        func.jacfwd(fn, argnums=1)(x, k, eps), jac[1], rtol=1e-10, atol=1e-12
    )


# ------------------------------------------------------------------- torch.func: vmap, meta


def test_vmap_over_x_k_and_epsilon_equals_the_loop():
    x = torch.randn(4, 3, 9, dtype=F64)
    k = torch.tensor(
        [[1.0, 2.5, 8.0], [0.0, 9.0, 3.0], [4.0, 4.0, 4.0], [2.0, 1.5, 7.5]], dtype=F64
    )
    e = torch.tensor([0.2, 0.5, 1.0, 3.0], dtype=F64)

    def fn(x, k, e):
        return soft_topk_mask(x, k, epsilon=e)

    out = func.vmap(fn)(x, k, e)
    loop = torch.stack([fn(x[i], k[i], e[i]) for i in range(4)])
    torch.testing.assert_close(out, loop, rtol=1e-12, atol=1e-12)
    # k alone, x shared; and a straight-through mask with a batched integer k
    ks = torch.tensor([1.0, 3.0, 5.0], dtype=F64)
    out = func.vmap(lambda kk: soft_topk_mask(x[0], kk, epsilon=0.3, hard=True))(ks)
    assert out.sum(-1).tolist() == [[1.0] * 3, [3.0] * 3, [5.0] * 3]
    with pytest.raises(ValueError, match=r"hard=True needs an integer k"):
        func.vmap(lambda kk: soft_topk_mask(x[0], kk, epsilon=0.3, hard=True))(ks + 0.5)


def test_grad_in_k_and_epsilon_under_func_equals_autograd():
    x, k, eps = _rows_with_edges()
    w = torch.arange(30, dtype=F64).reshape(x.shape) / 7
    w = torch.where(torch.isfinite(x), w, 0)

    def loss(k, e):
        return (soft_topk_mask(x, k, epsilon=e) * w).sum()

    gk, ge = func.grad(loss, argnums=(0, 1))(k, eps)
    kr, er = k.clone().requires_grad_(), eps.clone().requires_grad_()
    rk, re = torch.autograd.grad(loss(kr, er), (kr, er))
    torch.testing.assert_close(gk, rk, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ge, re, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, F64])
def test_meta_tensors_give_the_shape_without_solving(dtype):
    x = torch.empty(5, 7, 3, dtype=dtype, device="meta")
    out = soft_topk_mask(x, 2, dim=1, epsilon=0.7)
    assert out.device.type == "meta" and out.shape == x.shape and out.dtype == dtype
    k = torch.empty(5, 3, dtype=F64, device="meta")
    out = soft_topk_mask(x, k, dim=1, epsilon=torch.empty((), device="meta"))
    assert out.device.type == "meta" and out.shape == x.shape
    state = solve(
        x.flatten(0, 1).to(F64),
        torch.empty(35, dtype=F64, device="meta"),
        torch.empty(35, dtype=F64, device="meta"),
    )
    assert state.t.device.type == "meta" and state.iterations == 0 and state.t.shape == (35,)


# ------------------------------------------------------------ the solver's schedule and speed


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_typical_solves_take_at_most_four_evaluations(dtype):
    # Halley steps from one start (the centre, or the large-epsilon guess): 2 to 4 evaluations
    # where best-of-two Newton took 4 to 8 (the per-call cost of the op is mostly these passes).
    x = torch.randn(64, 1000, dtype=dtype, generator=torch.Generator().manual_seed(5))
    for k in (10.0, 500.0, 990.0):
        for eps in (1.0, 0.1, 1e-2, 1e-3):
            kt, et = torch.full((64,), k, dtype=dtype), torch.full((64,), eps, dtype=dtype)
            state = solve(x, kt, et, k_scalar=k)
            assert bool(state.converged.all())
            assert state.iterations <= (4 if dtype == torch.float32 else 5), (k, eps)


def test_bit_midpoint_halves_the_floats_in_the_bracket():
    for dtype, itype in ((torch.float32, torch.int32), (F64, torch.int64)):
        fi = torch.finfo(dtype)
        lo = torch.tensor([-1.0, 1.0, -3.0, 0.0, -fi.tiny, 2.0, -fi.max, 1e-30], dtype=dtype)
        hi = torch.tensor([1.0, 2.0, -2.0, 1.0, fi.tiny, 2.0, fi.max, 1e30], dtype=dtype)
        mid = rootfind.bit_midpoint(lo, hi)
        assert bool(((mid >= lo) & (mid <= hi)).all())

        def key(v: torch.Tensor, itype: torch.dtype = itype) -> torch.Tensor:
            """The order of the floats, as integers (-0.0 just below +0.0)."""
            b = v.view(itype).to(torch.float64)
            return torch.where(b < 0, -(b - torch.iinfo(itype).min) - 1, b)

        a, b, m = key(lo), key(hi), key(mid)
        slack = 1 + 1e-12 * (b - a)  # float64 keys are exact for float32, rounded for float64
        assert bool(((m - a) <= (b - a) / 2 + slack).all())
        assert bool(((b - m) <= (b - a) / 2 + slack).all())
        assert mid[1] == 1.5 and mid[2] == -2.5 and mid[5] == 2.0
        # adjacent floats: the midpoint is the lower one
        nxt = torch.nextafter(lo, hi)
        assert torch.equal(rootfind.bit_midpoint(lo, nxt)[:4], lo[:4])


def _hard_rows(dtype):
    """Rows that stress the root finder: ties at the threshold, a staircase at a tiny epsilon,
    scales far apart, a subnormal k, a k within rounding of n, a fractional k."""
    tiny = torch.finfo(dtype).tiny
    rows = [
        ([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], 2.0, 1e-6),
        ([0.1, 0.7, 1.3, 4.0, 9.0, -2.0], 2.5, 1e-9),
        ([1e20, -1e20, 3.0, 2.0, 1.0, 0.0], 3.0, 1.0),
        ([0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 5e-324 if dtype == F64 else 1e-40, 1e-20),
        ([5.0, 4.0, 3.0, 2.0, 1.0, 0.0], 6.0 - 1e-7, 0.3),
        ([1e-30, 2e-30, 3e-30, 4e-30, 5e-30, 6e-30], 1.5, 1e-31),
        ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 3.0, 100 * tiny),
    ]
    x = torch.tensor([r[0] for r in rows], dtype=dtype)
    k = torch.tensor([r[1] for r in rows], dtype=dtype)
    e = torch.tensor([r[2] for r in rows], dtype=dtype).clamp(min=tiny)
    return x, k, e


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_bit_bisection_alone_reaches_every_root_within_the_bits_of_the_dtype(dtype):
    # The guarantee of the traced schedule: from the exact bracket, bit bisections alone (no
    # Halley step at all) finish every row within finfo.bits evaluations, and agree with the
    # adaptive solve.
    x, k, e = _hard_rows(dtype)
    prep, state = _ot._prepare_exact(x, k, e, x.shape[-1])
    args = (x, prep.m2, e[:, None], prep.k_total, 0.0)
    bits = torch.finfo(dtype).bits
    done = rootfind.run_steps(_ot._evaluate_t, state, args, bits, bisect=True)
    assert bool(done.done.all())
    short = rootfind.run_steps(_ot._evaluate_t, state, args, 8, bisect=True)
    assert not bool(short.done.all())  # the test is not vacuous: 8 bisections do not suffice
    A = _ot._fill_special(done.extra[0], x, prep.sel_none, prep.sel_all, prep.invalid)
    ref = soft_topk_mask(x, k, epsilon=e)
    atol = 1e-5 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(A, ref, atol=atol, rtol=0)
    assert rootfind.fixed_schedule(dtype, 100) == (rootfind.HALLEY_STEPS, bits)
    assert rootfind.fixed_schedule(dtype, 5) == (5, 0)


# ------------------------------------------------------------------- torch.compile and export


class _Scorer(torch.nn.Module):
    """A tiny inference model: a linear score, its soft top-3 mask as gates."""

    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(12, 12, dtype=torch.float32)
        self.mask = softops.nn.SoftTopKMask(3, epsilon=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mask(self.score(x)) * x


def test_export_of_a_model_using_the_mask_equals_eager():
    # torch.export keeps the solve as the operator softops::ot_threshold; about 5 s.
    torch.manual_seed(3)
    model = _Scorer().eval()
    x = torch.randn(5, 12)
    with torch.no_grad():
        # a dynamic batch: no guard on the size of x
        batch = torch.export.Dim("batch")
        exported = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
        for inputs in (x, 4 * torch.randn(9, 12), torch.randn(3, 12).round()):  # ties too
            torch.testing.assert_close(exported.module()(inputs), model(inputs))
    # the solve is one opaque operator of torch's registry in the exported graph
    assert any("softops.ot_threshold" in str(node.target) for node in exported.graph.nodes)


@pytest.mark.slow
def test_torch_compile_values_and_gradients_and_fullgraph_inference():
    x = torch.randn(6, 40, dtype=F64, requires_grad=True)
    k = torch.tensor([1.0, 4.0, 7.5, 20.0, 39.0, 0.0], dtype=F64, requires_grad=True)
    g = torch.randn(6, 40, dtype=F64)

    def fn(x, k):
        return soft_topk_mask(x, k, epsilon=0.3)

    compiled = torch.compile(fn)  # with gradients: the Function behind a graph break
    out = compiled(x, k)
    grads = torch.autograd.grad(out, (x, k), g)
    want = torch.autograd.grad(fn(x, k), (x, k), g)
    torch.testing.assert_close(out, fn(x, k))
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        full = torch.compile(fn, fullgraph=True)(x.detach(), k.detach())
    torch.testing.assert_close(full, fn(x, k).detach(), atol=1e-12, rtol=0)


def test_side_log_weights_are_the_logs_of_u_1_minus_u_and_u_shifted_per_side():
    from softops.topk import side_log_weights

    off = torch.tensor(
        [[-3.0, -0.5, 0.25, 2.0, math.inf, -math.inf], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]],
        dtype=torch.float64,
    )
    below = off < 0
    e = torch.tensor([[0.7], [0.3]], dtype=torch.float64)
    logw, logu, near_below, near_above = side_log_weights(off, e, below)
    fin = torch.isfinite(off)
    want_below = torch.tensor([[0.5], [math.inf]], dtype=torch.float64)  # an empty side: inf
    want_above = torch.tensor([[0.25], [1.0]], dtype=torch.float64)
    torch.testing.assert_close(near_below, want_below, rtol=0, atol=0)
    torch.testing.assert_close(near_above, want_above, rtol=0, atol=0)
    shift = torch.where(below, want_below, want_above)
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    u = torch.sigmoid(-off.abs() / e)
    lift = (shift / e).expand_as(off)[fin]
    torch.testing.assert_close(logw[fin] - lift, (u * (1 - u)).log()[fin])
    torch.testing.assert_close(logu[fin] - lift, u.log()[fin])
    assert (logw[~fin] == -math.inf).all() and (logu[~fin] == -math.inf).all()
    # far below the gaps nothing underflows: each side's nearest entry keeps log weight about 0
    tiny = torch.full((2, 1), 1e-300, dtype=torch.float64)
    logw, logu, *_ = side_log_weights(off, tiny, below)
    assert torch.isfinite(logw[fin]).all() and logw[fin].max() == 0.0
    assert logw[0, 1] == 0.0 and logw[0, 2] == 0.0 and logw[1, 0] == 0.0


def test_threshold_values_give_the_limits_of_the_rows_that_are_not_solved():
    from softops.topk import threshold_values

    t = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    scale = torch.tensor([2.0, 2.0, 4.0, 1.0, 0.5], dtype=torch.float64)
    none = torch.tensor([False, True, False, True, False])
    every = torch.tensor([False, False, True, True, False])
    invalid = torch.tensor([False, False, False, False, True])
    got = threshold_values(t, scale, none, every, invalid)
    want = torch.tensor([0.5, math.inf, -math.inf, 0.0, math.nan], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # without the classification, the solved thresholds in the units of x only
    torch.testing.assert_close(threshold_values(t, scale, None, None, None), t / scale)
    torch.testing.assert_close(threshold_values(t, None, None, None, None), t)
