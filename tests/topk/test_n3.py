"""soft_topk_mask(method="n3"): the logit-space relaxation of kNN selection (Plötz & Roth 2018)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from softops import soft_topk_mask
from softops.bench.model import count_saved_bytes
from softops.topk import _n3 as n3_mod
from softops.topk._n3 import n3_mask_rows
from tests._helpers import fd_gap, hard_topk_mask, saved_bytes, seeded

F64 = torch.float64
inf, nan = math.inf, math.nan


def n3(x: torch.Tensor, k: int, **kw) -> torch.Tensor:
    return soft_topk_mask(x, k, method="n3", **kw)


def reference_n3(row: torch.Tensor, k: int, eps: float | torch.Tensor) -> torch.Tensor:
    """The recursion on one finite 1-D row, written out plainly (autograd, log1p(-w)).

    Only for rows where no weight comes within rounding of 1 (log1p(-w) loses 1 - w there).
    """
    z = row / eps
    A = torch.zeros_like(row)
    for _ in range(k):
        w = torch.softmax(z, -1)
        A = A + w
        z = z + torch.log1p(-w)
    return A


def mp_n3(row: list[float], k: int, eps: float) -> list[float]:
    """The recursion in 60-digit arithmetic (mpmath), for the regimes where w rounds to 1."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(60):
        z = [mpmath.mpf(v) / mpmath.mpf(eps) for v in row]
        A = [mpmath.mpf(0)] * len(row)
        for _ in range(k):
            top = max(z)
            e = [mpmath.exp(v - top) for v in z]
            s = sum(e)
            w = [v / s for v in e]
            A = [a + b for a, b in zip(A, w, strict=True)]
            z = [v + mpmath.log(1 - u) for v, u in zip(z, w, strict=True)]
        return [float(a) for a in A]


# ------------------------------------------------------------------- the recursion itself


@pytest.mark.parametrize(("n", "k", "eps"), [(7, 3, 0.5), (12, 1, 0.2), (12, 11, 1.0), (9, 9, 2.0)])
def test_equals_the_plain_reference_values_and_gradients(n, k, eps):
    x = torch.randn(4, n, dtype=F64, generator=seeded(n + k), requires_grad=True)
    e = torch.tensor(eps, dtype=F64, requires_grad=True)
    A = n3(x, k, epsilon=e)
    ref = torch.stack([reference_n3(r, k, e) for r in x])
    torch.testing.assert_close(A, ref, atol=1e-12, rtol=0)
    g = torch.randn_like(A)
    got = torch.autograd.grad(A, (x, e), g)
    want = torch.autograd.grad(ref, (x, e), g)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    assert abs(float(got[0].sum())) < 1e-9  # shift invariance: the gradient sums to 0


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_largest_false_is_the_mask_of_minus_x_and_dim_is_a_loop(dim):
    x = torch.randn(5, 7, dtype=F64, generator=seeded(12))
    A = n3(x, 3, dim=dim, largest=False, epsilon=0.4)
    torch.testing.assert_close(A, n3(-x, 3, dim=dim, epsilon=0.4), atol=0, rtol=0)
    rows = x.movedim(dim, -1).reshape(-1, x.shape[dim])
    ref = torch.stack([reference_n3(-r, 3, 0.4) for r in rows])
    torch.testing.assert_close(A.movedim(dim, -1).reshape(rows.shape), ref, atol=1e-12, rtol=0)
    # the private row kernel is what the op calls
    eps_row = torch.full((rows.shape[0],), 0.4, dtype=F64)
    assert torch.equal(n3_mask_rows(-rows, 3, eps_row), A.movedim(dim, -1).reshape(rows.shape))


def test_rounds_are_probability_vectors_sum_k_float32_large():
    x = torch.randn(8, 300, generator=seeded(5))
    for k in (1, 37, 150):
        for eps in (1e-3, 0.1, 10.0):
            A = n3(x, k, epsilon=eps)
            torch.testing.assert_close(A.sum(-1), torch.full((8,), float(k)), rtol=1e-5, atol=0)
            assert bool((A >= 0).all())


def test_two_entries_exceed_one_as_documented():
    # n = k = 2: the second round is (1/2, 1/2) whatever x, so A = (a + 1/2, 3/2 - a)
    for gap, eps in ((0.3, 1.0), (2.0, 0.5), (50.0, 1.0), (1e3, 1e-3)):
        for dtype in (torch.float32, F64):
            x = torch.tensor([gap, 0.0], dtype=dtype)
            a = torch.sigmoid(torch.tensor(gap / eps, dtype=F64))
            want = torch.stack([a + 0.5, 1.5 - a]).to(dtype)
            torch.testing.assert_close(n3(x, 2, epsilon=eps), want, atol=1e-6, rtol=0)
    assert float(n3(torch.tensor([1.0, 0.0]), 2, epsilon=0.1).max()) > 1.49


def test_is_biased_away_from_ot_at_moderate_epsilon():
    x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0], dtype=F64)
    A = n3(x, 3, epsilon=0.5)
    want = torch.tensor([0.984, 0.004, 0.027, 0.189, 0.0005, 1.796], dtype=F64)  # the docstring
    torch.testing.assert_close(A, want, atol=1e-3, rtol=0)
    ot = soft_topk_mask(x, 3, epsilon=0.5)
    assert float(ot[3]) == pytest.approx(0.731, abs=1e-3) and float(A[3]) < 0.2


# ---------------------------------------------------------------------------- the limits


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_small_epsilon_limit_is_not_the_hard_mask(dtype):
    # (k + 1)/2 on the largest entry, (k - 1)/2 on the second, 0 elsewhere; k = 1: the hard one
    x = torch.tensor([[5.0, 2.0, 3.0, 4.0, 1.0, 6.0], [0.1, -3.0, 2.5, 7.0, 6.0, 1.0]])
    x = x.to(dtype)
    for eps in (1e-2, 1e-4, 1e-30):
        torch.testing.assert_close(n3(x, 1, epsilon=eps), hard_topk_mask(x, 1))
        for k in (2, 3, 6):
            want = torch.zeros_like(x)
            top2 = x.topk(2, -1).indices
            want.scatter_(-1, top2[:, :1], (k + 1) / 2).scatter_(-1, top2[:, 1:], (k - 1) / 2)
            torch.testing.assert_close(n3(x, k, epsilon=eps), want, atol=1e-6, rtol=0)


def test_no_jump_where_one_minus_w_rounds_to_zero():
    # log1p(-w) of a rounded w removes an entry outright from gaps of about 37 epsilon (float64),
    # which flips the third-largest entry from ~0 to 1; the kernel keeps to the exact recursion
    x = [5.0, 2.0, 3.0, 4.0, 1.0, 6.0]
    for eps in (0.1, 0.05, 0.03, 0.02, 0.01):
        A = n3(torch.tensor(x, dtype=F64), 3, epsilon=eps)
        torch.testing.assert_close(A, torch.tensor(mp_n3(x, 3, eps), dtype=F64), atol=1e-12, rtol=0)
        naive = reference_n3(torch.tensor(x, dtype=F64), 3, eps)
        if eps <= 0.02:
            assert float(naive[3]) == pytest.approx(1.0) and float(A[3]) < 1e-15
    # mid-regime rows against 60-digit arithmetic, float32 and float64
    for row, k, eps in (([0.0, -1.0, -1.5, -4.0], 3, 0.05), ([3.0, 2.9, 0.0, 2.0], 2, 0.01)):
        want = torch.tensor(mp_n3(row, k, eps), dtype=F64)
        torch.testing.assert_close(n3(torch.tensor(row, dtype=F64), k, epsilon=eps), want)
        got32 = n3(torch.tensor(row), k, epsilon=eps).double()
        torch.testing.assert_close(got32, want, atol=1e-5, rtol=1e-4)


def test_large_epsilon_limit_is_uniform():
    # every round tends to the uniform vector: k/n everywhere
    x = torch.randn(3, 8, dtype=F64, generator=seeded(6))
    torch.testing.assert_close(n3(x, 3, epsilon=1e9), torch.full_like(x, 3 / 8), atol=1e-8, rtol=0)


def test_hard_is_straight_through():
    x = torch.randn(4, 7, dtype=F64, generator=seeded(8), requires_grad=True)
    e = torch.tensor(0.6, dtype=F64, requires_grad=True)
    for largest in (True, False):
        H = n3(x, 3, largest=largest, epsilon=e, hard=True)
        assert torch.equal(H.detach(), hard_topk_mask(x.detach(), 3, largest=largest))
        g = torch.randn_like(H)
        S = n3(x, 3, largest=largest, epsilon=e)
        torch.testing.assert_close(
            torch.autograd.grad(H, (x, e), g), torch.autograd.grad(S, (x, e), g)
        )


# ------------------------------------------------------------------------------ invariants


def test_shift_invariance_and_permutation_equivariance():
    x = torch.randn(3, 9, dtype=F64, generator=seeded(9))
    A = n3(x, 4, epsilon=0.3)
    for c, tol in ((-7.0, 1e-14), (1e3, 1e-12), (1e8, 1e-6)):  # x + c rounds to ulp(c)
        torch.testing.assert_close(n3(x + c, 4, epsilon=0.3), A, atol=tol, rtol=0)
    perm = torch.randperm(9, generator=seeded(10))
    torch.testing.assert_close(n3(x[:, perm], 4, epsilon=0.3), A[:, perm], atol=1e-14, rtol=0)
    torch.testing.assert_close(n3(3 * x, 4, epsilon=0.9), A, atol=1e-14, rtol=0)


def test_tied_entries_get_equal_mass():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [4.0, 4.0, 0, 0, 0]])
    for eps in (1e-3, 0.5, 10.0):
        A = n3(x.double(), 3, epsilon=eps)
        torch.testing.assert_close(A[0, [1, 2, 4]], A[0, [2, 4, 1]], atol=1e-12, rtol=0)
        torch.testing.assert_close(A[1], torch.full((5,), 0.6, dtype=F64), atol=1e-12, rtol=0)
        torch.testing.assert_close(A[2, 0], A[2, 1], atol=1e-12, rtol=0)


def test_jacobian_is_bounded_by_k_over_two_epsilon():
    # ||dA/dx||_inf <= k / (2 eps) at every epsilon (module docstring); softkmax has no such bound
    from torch.func import jacrev

    g = seeded(11)
    for trial in range(30):
        n = 2 + trial % 9
        k = 1 + trial % n
        x = torch.randn(n, dtype=F64, generator=g) * (1 + trial % 4) ** 2
        if trial % 3 == 0:
            x = x.round()  # ties
        for eps in (1e-3, 0.1, 1.0, 30.0):
            J = jacrev(lambda t, k=k, eps=eps: n3(t, k, epsilon=eps))(x)
            assert float(J.abs().sum(-1).max()) <= k / (2 * eps) * (1 + 1e-9), (x, k, eps)


# --------------------------------------------------------------------------- derivatives


def test_gradcheck_and_gradgradcheck_float64():
    x = (torch.randn(3, 6, dtype=F64, generator=seeded(13)) * 1.5).requires_grad_()
    e = torch.tensor([0.3, 0.7, 2.0], dtype=F64, requires_grad=True)
    for k in (0, 1, 3, 6):
        assert gradcheck(lambda x, e, k=k: n3(x, k, epsilon=e), (x, e))
    assert gradgradcheck(lambda x, e: n3(x, 3, epsilon=e), (x, e))
    # ties (the largest two) and a near one-hot row
    y = torch.tensor([[2.0, 2.0, 0.5, -1.0], [9.0, 0.0, 0.5, 0.2]], dtype=F64, requires_grad=True)
    assert gradcheck(lambda y: n3(y, 2, epsilon=0.4), (y,))
    assert gradgradcheck(lambda y: n3(y, 2, epsilon=0.4), (y,))


@pytest.mark.parametrize(
    ("row", "eps"),
    [
        ([2.0, 0.0, -1.0, 0.5, -3.0], 1 / 30),  # near one-hot: w within 1e-13 of 1
        ([1.0, 1.0, 1.0, -0.5, 2.0], 0.3),  # ties
        ([1.0, 1.0 + 1e-9, 3.0, 0.0, 3.0 - 1e-9], 0.2),  # near-ties
        ([0.3, -0.2, 0.1, 0.0, 0.25], 1e3),  # epsilon far above the gaps
        ([4.0, 0.0, 2.0, 1.0, 3.0], 5e-3),  # epsilon far below the gaps
        ([1e6, 1e6 + 0.5, 1e6 - 0.25, 1e6 + 0.1, 1e6 - 1.0], 0.1),  # large |x| / eps
    ],
)
def test_central_differences_in_hard_regimes(row, eps):
    x = torch.tensor([row], dtype=F64)
    g = seeded(14)
    gap = 1e-5 * eps  # the step, small against epsilon (the scale of the derivative)
    for k in (1, 2, 4):
        assert fd_gap(lambda t, k=k: n3(t, k, epsilon=eps), x, gap, g) < 1e-6, k
        # and in epsilon
        e = torch.tensor(eps, dtype=F64, requires_grad=True)
        out = n3(x, k, epsilon=e)
        ct = torch.randn(out.shape, generator=g, dtype=F64)
        (ge,) = torch.autograd.grad((out * ct).sum(), e)
        h = 1e-6 * eps
        fd = ((n3(x, k, epsilon=eps + h) - n3(x, k, epsilon=eps - h)) * ct).sum() / (2 * h)
        assert abs(float(ge - fd)) <= 1e-6 * (float(ct.abs().sum()) / eps + abs(float(ge))), k


@pytest.mark.parametrize(
    ("row", "eps", "dtype"),
    [
        ([0.0, 1.0, 2.0, 3.0], 1e-30, torch.float32),  # eps**2 underflows
        ([0.0, 1.0, 2.0, 3.0], 1e-300, F64),
        ([1e300, 0.0, -1e300, 1.0], 1e-10, F64),  # (x - max x) / eps saturates
        ([3e38, 0.0, -3e38, 1.0], 1.0, torch.float32),  # x - max x overflows the dtype
    ],
)
def test_gradients_stay_finite_at_extremes(row, eps, dtype):
    x = torch.tensor([row], dtype=F64).to(dtype).requires_grad_()
    e = torch.tensor([eps], dtype=F64, requires_grad=True)
    for k in (1, 2, 4):
        out = n3(x, k, epsilon=e)
        torch.testing.assert_close(out.double().sum(-1), torch.full((1,), float(k), dtype=F64))
        gx, ge = torch.autograd.grad(out, (x, e), torch.randn_like(out))
        assert not torch.isnan(gx).any() and not torch.isnan(ge).any(), (k, gx, ge)
        # finite within the documented bounds: |dA/dx| <= k / (2 eps), |dA/deps| <= that
        # times span / eps (the rounding error of a backward is a fraction of them)
        big = torch.finfo(dtype).max
        span = max(row) - min(row)
        assert torch.isfinite(gx).all() == (k / (2 * eps) < big), (k, gx)
        if span * k / (2 * eps) / eps < big:
            assert torch.isfinite(ge).all(), (k, ge)


def test_saturates_instead_of_overflowing():
    x = torch.tensor([[0.0, 1e30, -5.0]])  # (x - max x)/eps overflows float32
    assert torch.equal(n3(x, 1, epsilon=1e-9), torch.tensor([[0.0, 1.0, 0.0]]))
    # the two saturated entries tie, and the second round shares with them both
    torch.testing.assert_close(n3(x, 2, epsilon=1e-9), torch.tensor([[1.0, 4.0, 1.0]]) / 3)
    # within the range they stay apart: the second round goes to the runner-up
    x = torch.tensor([[0.0, 1e10, -5.0]], dtype=F64)
    assert torch.equal(n3(x, 2, epsilon=1e-9), torch.tensor([[0.5, 1.5, 0.0]], dtype=F64))
    y = torch.tensor([[3e38, -3e38, 0.0]])  # x - max x itself overflows
    assert torch.equal(n3(y, 1, epsilon=1.0), torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.equal(n3(y, 3, epsilon=1.0), torch.tensor([[2.0, 0.0, 1.0]]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("epsilon", [1e-50, 1e-320, 1e39, 1e300])
def test_epsilon_outside_the_dtype_takes_the_limit(epsilon, dtype):
    # epsilon clamped to the compute dtype's normal range (prepare_rows): the eps -> 0 limit
    # ((k + 1)/2 and (k - 1)/2 on the top two) or the uniform k/n, never NaN
    x = torch.tensor([0.3, -1.2, 0.8, 2.0, -0.4], dtype=dtype, requires_grad=True)
    out = n3(x, 2, epsilon=epsilon)
    assert out.dtype == dtype and torch.isfinite(out).all()
    want = [0.0, 0.0, 0.5, 1.5, 0.0] if epsilon < 1 else [0.4] * 5
    tol = 1e-6 if dtype in (torch.float32, F64) else 1e-2
    torch.testing.assert_close(
        out.detach().double(), torch.tensor(want, dtype=F64), atol=tol, rtol=0
    )
    (g,) = torch.autograd.grad(out, x, torch.linspace(-1, 1, 5, dtype=dtype))
    assert not torch.isnan(g).any()


def test_k_zero_is_zero_with_a_gradient():
    x = torch.randn(2, 5, dtype=F64, requires_grad=True)
    A = n3(x, 0)
    assert torch.equal(A, torch.zeros_like(x))
    (g,) = torch.autograd.grad(A.sum(), x)
    assert torch.equal(g, torch.zeros_like(x))


# ---------------------------------------------------------------------- non-finite input


def test_infinities_and_nan_rows():
    x = torch.tensor(
        [
            [1.0, -inf, 3.0, 2.0, -inf, 0.5],  # -inf never selected
            [inf, 1.0, 2.0, 0.0, -1.0, 3.0],  # +inf always selected, uses one round
            [-inf, -inf, -inf, 1.0, 2.0, 3.0],  # exactly k above -inf
            [inf, inf, inf, inf, 1.0, 2.0],  # more +inf than k: NaN
            [-inf, -inf, -inf, -inf, -inf, 2.0],  # fewer than k above -inf: NaN
            [inf, inf, inf, 1.0, 2.0, -inf],  # exactly k at +inf
            [inf, inf, -inf, 1.0, -inf, -inf],  # one finite entry for the one round left
            [1.0, nan, 0.0, 2.0, 3.0, 4.0],  # NaN
        ],
        dtype=F64,
        requires_grad=True,
    )
    A = n3(x, 3, epsilon=0.5)
    ref0 = reference_n3(torch.tensor([1.0, 3.0, 2.0, 0.5], dtype=F64), 3, 0.5)
    torch.testing.assert_close(A[0, [0, 2, 3, 5]], ref0)
    assert A[0, 1] == 0 and A[0, 4] == 0
    ref1 = reference_n3(torch.tensor([1.0, 2.0, 0.0, -1.0, 3.0], dtype=F64), 2, 0.5)
    assert A[1, 0] == 1
    torch.testing.assert_close(A[1, 1:], ref1)
    torch.testing.assert_close(A[2, 3:], reference_n3(x[2, 3:].detach(), 3, 0.5))
    assert A[2, :3].tolist() == [0.0] * 3
    for r in (3, 4, 7):
        assert bool(torch.isnan(A[r]).all())
    assert A[5].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert A[6].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    ok = [0, 1, 2, 5, 6]
    assert float(A[ok].detach().sum()) == pytest.approx(15)
    (g,) = torch.autograd.grad(A.nan_to_num().pow(2).sum(), x)
    assert bool(torch.isfinite(g).all())
    assert torch.equal(g[[3, 4, 7]], torch.zeros(3, 6, dtype=F64))  # NaN rows: zero gradient
    At = n3(x.detach().T, 3, dim=0, epsilon=0.5)
    torch.testing.assert_close(At.T, A.detach(), equal_nan=True)
    # largest=False: the roles of +inf and -inf swap
    torch.testing.assert_close(n3(-x.detach(), 3, largest=False, epsilon=0.5), A, equal_nan=True)


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        (
            (2.5,),
            {},
            ValueError,
            "soft_topk_mask: expected an integer `k` with method='n3'; got k=2.5.",
        ),
        (
            (6,),
            {},
            ValueError,
            "soft_topk_mask: expected 0 <= `k` <= x.shape[dim] (= 5); got k=6.",
        ),
        ((-1,), {}, ValueError, "got k=-1."),
        (
            (torch.tensor([1.0, 2.0]),),
            {},
            ValueError,
            "soft_topk_mask: expected a scalar `k` with method='n3' (a per-row k needs "
            "method='ot'); got k of shape (2,).",
        ),
        (
            (torch.tensor(2.0, requires_grad=True),),
            {},
            ValueError,
            "soft_topk_mask: expected a `k` that does not require grad with method='n3' (use "
            "method='ot' for gradients in k and epsilon); got one that does.",
        ),
        ((2,), {"epsilon": 0.0}, ValueError, "got epsilon=0.0."),
        ((2,), {"epsilon": -1.0}, ValueError, "got epsilon=-1.0."),
        ((2,), {"hard": True}, None, None),
        ((1.5,), {"hard": True}, ValueError, "hard=True needs an integer k; got k=1.5."),
    ]
    + [
        (
            (2,),
            {name: value},
            ValueError,
            f"soft_topk_mask: expected `{name}` to be left at its default None (method='n3' "
            "does not use it)",
        )
        for name, value in (
            ("max_iter", 10),
            ("tol", 1e-3),
            ("n_samples", 10),
            ("generator", torch.Generator()),
        )
    ],
)
def test_errors(args, kwargs, exc, match):
    x = torch.randn(2, 5)
    if exc is None:
        n3(x, *args, **kwargs)
        return
    with pytest.raises(exc, match=re.escape(match)):
        n3(x, *args, **kwargs)


def test_errors_on_x():
    with pytest.raises(TypeError, match=r"^soft_topk_mask: expected .*got dtype=torch\.int64\.$"):
        n3(torch.zeros(2, 5, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=re.escape("got x.shape[1] = 0")):
        n3(torch.randn(2, 0), 0)
    eps = torch.tensor(0.5, requires_grad=True)  # n3 differentiates in epsilon: accepted
    assert n3(torch.randn(2, 5), 2, epsilon=eps).requires_grad


# ------------------------------------------------------ checkpointing and torch transforms


def test_checkpointed_backward_equals_plain_autograd(monkeypatch) -> None:
    x = torch.randn(2, 30, dtype=F64, generator=seeded(3), requires_grad=True)
    eps = torch.tensor([0.4, 0.7], dtype=F64, requires_grad=True)
    w = torch.randn(2, 30, dtype=F64, generator=seeded(4))

    def run() -> tuple[torch.Tensor, ...]:
        A = n3(x, 20, epsilon=eps)
        return (A, *torch.autograd.grad((A * w).sum(), (x, eps)))

    checkpointed = run()
    checkpointed_bytes = saved_bytes(lambda: n3(x, 20, epsilon=eps))
    monkeypatch.setattr(n3_mod, "_N3_CHECKPOINT_MIN", 10**9)
    plain = run()
    plain_bytes = saved_bytes(lambda: n3(x, 20, epsilon=eps))
    for a, b in zip(checkpointed, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    assert checkpointed_bytes < plain_bytes / 3  # 5 segment boundaries against 20 rounds
    monkeypatch.undo()
    assert gradcheck(lambda t: n3(t, 17, epsilon=0.5), (x.detach()[:1, :20].requires_grad_(),))


def test_memory_is_linear_in_k_below_the_checkpoints():
    x = torch.randn(4, 50, requires_grad=True)
    row = x.numel() * 4  # one (B, n) float32 tensor

    def distinct(k: int) -> int:
        return count_saved_bytes(lambda t: n3(t, k), x)[1]

    per_round = (distinct(12) - distinct(4)) / 8
    assert 3 * row <= per_round <= 5 * row  # "about four (B, n) tensors per round"
    assert distinct(32) < 2 * distinct(8)  # checkpointed from k = 16


def test_torch_func_transforms() -> None:
    from torch import func

    x = torch.randn(3, 30, dtype=F64, generator=seeded(41))
    for k in (3, 20):  # 20: checkpointed eagerly, plain autograd under a transform

        def loss(t, k=k):
            return n3(t, k, epsilon=0.5).pow(2).sum()

        xx = x.clone().requires_grad_()
        (ref,) = torch.autograd.grad(loss(xx), xx)
        torch.testing.assert_close(func.grad(loss)(x), ref, atol=1e-12, rtol=0)
        per_row = func.vmap(lambda r, k=k: n3(r, k, epsilon=0.5))(x)
        torch.testing.assert_close(per_row, n3(x, k, epsilon=0.5), atol=1e-14, rtol=0)
        jac = func.jacrev(lambda t, k=k: n3(t, k, epsilon=0.5))(x[0])
        torch.testing.assert_close(func.jacfwd(lambda t, k=k: n3(t, k, epsilon=0.5))(x[0]), jac)
        torch.testing.assert_close(jac.sum(1), torch.zeros(30, dtype=F64), atol=1e-10, rtol=0)
        v = torch.randn(30, dtype=F64, generator=seeded(42))
        _, tangent = func.jvp(lambda t, k=k: n3(t, k, epsilon=0.5), (x[0],), (v,))
        torch.testing.assert_close(tangent, jac @ v)
    e = torch.tensor(0.5, dtype=F64)
    ge = func.grad(lambda e: n3(x, 4, epsilon=e).pow(2).sum())(e)
    ee = e.clone().requires_grad_()
    (ref,) = torch.autograd.grad(n3(x, 4, epsilon=ee).pow(2).sum(), ee)
    torch.testing.assert_close(ge, ref)


def test_meta_tensors() -> None:
    x = torch.randn(3, 7, device="meta", requires_grad=True)
    A = n3(x, 4, epsilon=0.5)
    assert A.shape == (3, 7) and A.device.type == "meta"
    A.sum().backward()
    assert x.grad is not None and x.grad.shape == (3, 7)
