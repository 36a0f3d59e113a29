"""The "ot" backend (Cuturi et al. 2019): invariants, hard limits, the quantile read off its soft
sort, and the non-convergence warning (it names the public op and uses the solver defaults)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.autograd import gradcheck

import softops
from softops import soft_quantile, soft_rank, soft_sort
from softops._core import sinkhorn
from softops._core.convergence import ConvergenceWarning
from softops.sort import _ot
from softops.sort._dispatch import interpolate
from softops.sort._options import MethodOptions
from tests._helpers import fd_gap
from tests.sort._helpers import hard_ranks, row_eps, spaced, tie_free

F64 = torch.float64
TIGHT = MethodOptions(tol=1e-12)


@pytest.mark.parametrize("descending", [False, True])
def test_hard_limit(descending):
    x = spaced(3, 30)
    e = row_eps(3, 1e-2)
    p = _ot.argsort(x, e, descending, TIGHT)
    hard = torch.sort(x, -1, descending=descending)
    one_hot = torch.nn.functional.one_hot(hard.indices, 30).to(F64)
    torch.testing.assert_close(p, one_hot, atol=1e-12, rtol=0)
    torch.testing.assert_close(_ot.sort(x, e, descending, TIGHT), hard.values, atol=1e-10, rtol=0)
    torch.testing.assert_close(
        _ot.rank(x, e, descending, TIGHT), hard_ranks(x, descending), atol=1e-10, rtol=0
    )


def test_doubly_stochastic_and_rank_sum():
    n = 20
    x = tie_free(3, n)
    e = row_eps(3, 0.5)
    p = _ot.argsort(x, e, False, TIGHT)
    torch.testing.assert_close(p.sum(-2), torch.ones(3, n, dtype=F64), atol=1e-9, rtol=0)
    r = _ot.rank(x, e, False, TIGHT)
    torch.testing.assert_close(r.sum(-1), torch.full((3,), n * (n + 1) / 2, dtype=F64))
    assert ((r >= 1 - 1e-9) & (r <= n + 1e-9)).all()
    torch.testing.assert_close(p @ x.unsqueeze(-1), _ot.sort(x, e, False, TIGHT).unsqueeze(-1))


def test_rank_offset_shifts_the_positions():
    x = tie_free(2, 8)
    e = row_eps(2, 0.5)
    off = torch.tensor([3.0, 1.0], dtype=F64)
    p = _ot.argsort(x, e, False, TIGHT)
    want = _ot.rank(x, e, False, TIGHT) + off.unsqueeze(-1) * p.sum(-2)
    torch.testing.assert_close(_ot.rank(x, e, False, TIGHT, off), want)


def test_scaling_law_and_shift():
    x = tie_free(2, 20)
    e = row_eps(2, 0.4)
    v = _ot.sort(x, e, False, TIGHT)
    torch.testing.assert_close(_ot.sort(2 * x, 4 * e, False, TIGHT), 2 * v)
    torch.testing.assert_close(_ot.sort(x + 5.0, e, False, TIGHT), v + 5.0)


# ------------------------------------------------------------------ quantile (interpolated)


def test_gradcheck_quantile():
    x = tie_free(2, 6, scale=1.0).requires_grad_()
    e = torch.tensor([0.5, 0.3], dtype=F64, requires_grad=True)
    q = torch.tensor([0.1, 0.5, 0.77], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, q, e: interpolate(_ot.sort(x, e, False, TIGHT), q), (x, q, e))


def test_quantile_hard_limit_is_torch_quantile():
    x = spaced(2, 25)
    q = torch.tensor([0.0, 0.13, 0.5, 0.9, 1.0], dtype=F64)
    got = soft_quantile(x, q, epsilon=1e-2, method="ot")
    torch.testing.assert_close(got, torch.quantile(x, q, dim=-1), atol=1e-10, rtol=0)


# ------------------------------------------------------------------ convergence


def test_warns_when_not_converged_naming_the_public_op(monkeypatch):
    monkeypatch.setattr(sinkhorn, "NEWTON_MAX_STEPS", 0)  # plain Sinkhorn, too few iterations
    x = tie_free(2, 30, scale=1.0)
    for fn, op in ((soft_sort, "soft_sort"), (soft_rank, "soft_rank")):
        with pytest.warns(ConvergenceWarning, match=rf"^{op}: 2 of 2 rows did not converge") as rec:
            fn(x, epsilon=0.1, method="ot", max_iter=3)
        assert "max_iter=3 (tol=1e-09," in str(rec[0].message)
        assert rec[0].filename == __file__  # attributed to the caller's line
    with pytest.warns(ConvergenceWarning, match=r"^soft_quantile: "):
        soft_quantile(x, 0.5, epsilon=1e-3, method="ot")
    assert issubclass(softops.ConvergenceWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        soft_sort(x, epsilon=0.1, method="ot", max_iter=3, tol=0)  # exactly max_iter: no warning


def test_default_tol_follows_the_compute_dtype(monkeypatch):
    """tol=None is softops._core.convergence.default_tol: 1e-9 in float64, 1e-6 below."""
    monkeypatch.setattr(sinkhorn, "NEWTON_MAX_STEPS", 0)
    x = tie_free(1, 30, scale=1.0)
    for dtype, tol in ((F64, "1e-09"), (torch.float32, "1e-06"), (torch.float16, "1e-06")):
        with pytest.warns(ConvergenceWarning, match=rf"max_iter=3 \(tol={tol},"):
            soft_sort(x.to(dtype), epsilon=0.1, method="ot", max_iter=3)


def test_default_max_iter_is_the_sinkhorn_cap(monkeypatch):
    monkeypatch.setattr(sinkhorn, "NEWTON_MAX_STEPS", 0)
    x = tie_free(1, 30, scale=1.0)
    with pytest.warns(ConvergenceWarning, match=r"max_iter=2000 "):
        _ot.sort(x, row_eps(1, 1e-3), False, MethodOptions(tol=1e-14, op="soft_sort"))


# --------------------------------------------------------------------------- issue 9: near-hard


def test_rank_near_permutation_regression():
    """Issue 9: autograd gave [-7.4e-2, 7.4e-2, 0] against central differences [-3.4e-6, ...]."""
    x = torch.tensor([-4.154701970719735, -1.7626870419453091, 5.193348969088463], dtype=F64)
    x.requires_grad_(True)
    w = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    r = soft_rank(x, epsilon=0.3781265552997255, method="ot", tol=1e-13, max_iter=100_000)
    (grad,) = torch.autograd.grad((r * w).sum(), x)
    torch.testing.assert_close(
        grad, torch.tensor([-3.3928e-6, 3.3928e-6, 0.0], dtype=F64), atol=1e-9, rtol=0
    )


_OT_OPS = {
    "sort": lambda z, e: soft_sort(z, epsilon=e, method="ot", tol=1e-12, max_iter=100_000),
    "rank": lambda z, e: soft_rank(z, epsilon=e, method="ot", tol=1e-12, max_iter=100_000),
    "argsort": lambda z, e: softops.soft_argsort(
        z, epsilon=e, method="ot", tol=1e-12, max_iter=100_000
    ),
    "quantile": lambda z, e: soft_quantile(
        z, torch.tensor([0.2, 0.5, 0.9], dtype=F64), epsilon=e, method="ot"
    ),
}


def _ot_sweep(cases: int, seed: int, n_max: int) -> None:
    """Near-permutation plans: epsilon (units of x^2) in 1e-2..10 times the squared top gap,
    on spread and nearly tied rows (exact ties are kinks of the sorted targets, not smooth)."""
    g = torch.Generator().manual_seed(seed)
    for c in range(cases):
        n = int(torch.randint(2, n_max + 1, (1,), generator=g))
        x = 5 * torch.randn(n, generator=g, dtype=F64)
        if c % 2:
            x = x[torch.randint(n, (n,), generator=g)]
            x = x + 1e-2 * torch.randn(n, generator=g, dtype=F64)
        gap = float(torch.sort(x).values.diff().min())
        eps = gap**2 * 10 ** float(3 * torch.rand(1, generator=g) - 2)
        name = list(_OT_OPS)[c % len(_OT_OPS)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            err = fd_gap(lambda z, op=_OT_OPS[name], e=eps: op(z, e), x, 1e-4 * gap, g)
        assert err < 1e-5, (name, x.tolist(), eps, err)


def test_near_permutation_gradients_sweep():
    _ot_sweep(32, 903, 6)


@pytest.mark.slow
def test_near_permutation_gradients_sweep_large():
    """Issue 9: two cases stalled short of tol (a quantile at 2e-7 within 2000 iterations, a
    rank at 4e-9 within 100 000) until Newton's gradient was formed without cancellation."""
    _ot_sweep(600, 904, 12)


# ------------------------------------------------------ torch.func, forward mode, meta tensors

INF, NAN = float("inf"), float("nan")
LIMIT_ROWS = torch.tensor(
    [
        [0.3, INF, -1.0, -INF, INF, 2.0, 0.7],  # both signs, tied +inf
        [0.3, 1.0, -1.0, 0.5, 4.0, 2.0, 0.7],  # finite
        [INF, INF, -INF, INF, -INF, INF, INF],  # no finite entry
        [0.3, NAN, -1.0, 0.5, INF, 2.0, 0.7],  # NaN wins
        [0.3, 1.0, -1.0, 0.5, INF, 2.0, 0.7],  # +inf last: the gauge column is empty
        [-INF, 1.0, -INF, 0.5, 0.1, -INF, 0.7],  # tied -inf
        [-INF, -INF, -INF, -INF, 0.1, -INF, INF],  # one finite entry
    ],
    dtype=F64,
)


def _same(out: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert torch.equal(out[~fin & ~torch.isnan(ref)], ref[~fin & ~torch.isnan(ref)])
    torch.testing.assert_close(out[fin], ref[fin], atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["sort", "rank", "argsort"])
@pytest.mark.parametrize("descending", [False, True])
def test_masked_limit_equals_the_eager_limit(kind, descending):
    """Under vmap the OT backend has no branch to take: its masked form (infinite entries and
    their targets carry no mass) gives the eager limits, NaN rows included."""
    fn = {"sort": soft_sort, "rank": soft_rank, "argsort": softops.soft_argsort}[kind]

    def op(z):
        return fn(z, epsilon=0.3, method="ot", descending=descending, tol=1e-12)

    ref = op(LIMIT_ROWS)
    assert bool(torch.isnan(ref[3]).all()) and not bool(torch.isnan(ref[[0, 1, 2, 4, 5, 6]]).any())
    _same(torch.func.vmap(op)(LIMIT_ROWS), ref, atol=1e-10)
    # the backend directly, on every row at once (the NaN row aside: the caller makes it NaN)
    rows = LIMIT_ROWS[[0, 1, 2, 4, 5, 6]]
    direct = _ot.masked(kind, rows, row_eps(6, 0.3), descending, TIGHT)
    _same(direct, ref[[0, 1, 2, 4, 5, 6]], atol=1e-10)


@pytest.mark.parametrize("kind", ["sort", "rank", "argsort"])
def test_masked_on_finite_rows_is_the_plain_op(kind):
    x = tie_free(3, 9)
    e = row_eps(3, 0.5)
    plain = getattr(_ot, kind)(x, e, True, TIGHT)
    assert torch.equal(_ot.masked(kind, x, e, True, TIGHT), plain)


def test_masked_limit_gradients_under_vmap():
    """vmap(grad) equals the eager gradient on rows with infinities; infinite entries get 0."""
    rows = LIMIT_ROWS[[0, 1, 4, 5]]
    w = torch.linspace(-1.0, 2.0, 7, dtype=F64)

    def loss(z):
        return (soft_rank(z, epsilon=0.3, method="ot", tol=1e-12) * w).sum() + (
            soft_sort(z, epsilon=0.3, method="ot", tol=1e-12) * w.flip(0)
        ).sum()

    grads = torch.func.vmap(torch.func.grad(loss))(rows)
    x = rows.clone().requires_grad_(True)
    (eager,) = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(grads, eager, atol=1e-9, rtol=1e-7)
    assert bool((grads[~torch.isfinite(rows)] == 0).all())
    assert float(grads[torch.isfinite(rows)].abs().max()) > 1e-3


@pytest.mark.parametrize("kind", ["sort", "rank", "argsort"])
def test_gradcheck_forward_mode(kind):
    x = tie_free(2, 5, scale=1.0).requires_grad_(True)
    e = torch.tensor([0.5, 0.3], dtype=F64, requires_grad=True)
    fn = getattr(_ot, kind)
    assert gradcheck(lambda x, e: fn(x, e, False, TIGHT), (x, e), check_forward_ad=True)


def test_forward_mode_with_infinities():
    """jvp through the masked limit (under torch.func) equals jacrev times the tangent."""
    rows = LIMIT_ROWS[[0, 4]]
    v = torch.linspace(-1.0, 1.0, 7, dtype=F64)

    def op(z):
        return soft_rank(z, epsilon=0.3, method="ot", tol=1e-12)

    for row in rows:
        _, tangent = torch.func.jvp(op, (row,), (v,))
        jac = torch.func.jacrev(op)(row)
        torch.testing.assert_close(tangent, jac @ v, atol=1e-10, rtol=1e-8)
        assert bool((jac[:, ~torch.isfinite(row)] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_meta_tensors_give_the_shape(dtype):
    x = torch.empty(2, 3, 7, dtype=dtype, device="meta")
    for fn in (soft_sort, soft_rank, softops.soft_argsort):
        out = fn(x, epsilon=0.3, method="ot", dim=1)
        want = (2, 3, 7, 3) if fn is softops.soft_argsort else (2, 3, 7)
        assert out.device.type == "meta" and out.shape == want and out.dtype == dtype
    q = soft_quantile(x, torch.tensor([0.1, 0.9], dtype=dtype), epsilon=0.3, method="ot")
    assert q.device.type == "meta" and q.shape == (2, 2, 3) and q.dtype == dtype
