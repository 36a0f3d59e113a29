"""soft_sort, soft_rank and soft_quantile with method="pav" (Blondel et al. 2020).

The PAV solvers themselves are tested in tests/core/test_isotonic.py.
"""

from __future__ import annotations

import itertools
import math
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck, gradgradcheck

import softops
from softops import soft_quantile, soft_rank, soft_sort
from softops._core import isotonic
from softops._kernels import backend, set_default_backend
from tests._helpers import pav_decreasing

F64 = torch.float64
REGS = ["l2", "kl"]
BACK_ENDS = ["kernel", "reference"]


def _use(back_end: str) -> None:
    """Make ``back_end`` the test's back end; the kernel's tests skip where it is not built (and
    fail under ``SOFTOPS_REQUIRE_KERNELS=1``)."""
    if back_end == "kernel":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            built = isotonic.KERNEL.ops() is not None
        if not built:
            if os.environ.get("SOFTOPS_REQUIRE_KERNELS") == "1":
                pytest.fail("the C++ kernel of PAV is not built (python -m softops._kernels)")
            pytest.skip("the C++ kernel of PAV is not built here (python -m softops._kernels)")
    set_default_backend(back_end)


def _distinct(B: int, n: int, scale: float = 4.0, dtype=F64) -> torch.Tensor:
    """Rows with well-separated entries (a gap of scale/n between neighbours), shuffled."""
    return torch.stack([torch.randperm(n).to(dtype) / n * scale for _ in range(B)])


def _hard_rank(x: torch.Tensor, dim: int = -1, descending: bool = False) -> torch.Tensor:
    return (x.argsort(dim, descending=descending).argsort(dim) + 1).to(x.dtype)


# ------------------------------------------------------------------------------- hard limits


def test_large_epsilon_limit():
    x = torch.randn(3, 8, dtype=F64)
    torch.testing.assert_close(
        soft_sort(x, epsilon=1e8), x.mean(-1, keepdim=True).expand_as(x), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(soft_rank(x, epsilon=1e8), torch.full_like(x, 4.5))


def test_ties_share_ranks():
    x = torch.tensor([[1.0, 3.0, 1.0, 2.0]], dtype=F64)
    torch.testing.assert_close(
        soft_rank(x, epsilon=1e-4), torch.tensor([[1.5, 4, 1.5, 3]], dtype=F64)
    )


def test_epsilon_changes_the_sort():
    # The reference numpy code's precedence slip (arange(n)[::-1] + 1/eps) makes the sort ignore
    # epsilon; rho/eps must not.
    x = torch.randn(2, 6, dtype=F64)
    assert not torch.allclose(soft_sort(x, epsilon=0.1), soft_sort(x, epsilon=10.0))


# -------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("reg", REGS)
@pytest.mark.parametrize("eps", [0.05, 1.0, 20.0])
def test_sort_monotone_and_rank_in_permutahedron(reg, eps):
    x = torch.randn(5, 30, dtype=F64)
    s = soft_sort(x, epsilon=eps, regularization=reg)
    assert (s.diff(dim=-1) >= -1e-12).all()
    assert (
        soft_sort(x, epsilon=eps, regularization=reg, descending=True).diff(dim=-1) <= 1e-12
    ).all()
    r = soft_rank(x, epsilon=eps, regularization=reg)
    n = x.shape[-1]
    assert (r >= 1 - 1e-9).all() and (r <= n + 1e-9).all()
    torch.testing.assert_close(r.sum(-1), torch.full((5,), n * (n + 1) / 2, dtype=F64))
    if reg == "l2":  # the l2 soft sort keeps the mean
        torch.testing.assert_close(s.mean(-1), x.mean(-1))


@pytest.mark.parametrize("c", [0.1, 3.0])
def test_scaling_laws_l2(c):
    x = torch.randn(4, 12, dtype=F64)
    torch.testing.assert_close(soft_sort(c * x, epsilon=0.7 / c), c * soft_sort(x, epsilon=0.7))
    torch.testing.assert_close(soft_rank(c * x, epsilon=0.7 * c), soft_rank(x, epsilon=0.7))


# ---------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("reg", REGS)
@pytest.mark.parametrize("fn", [soft_sort, soft_rank])
def test_gradcheck(fn, reg):
    x = (_distinct(2, 8) + 0.01 * torch.randn(2, 8, dtype=F64)).requires_grad_()
    eps = torch.tensor([0.4, 1.3], dtype=F64, requires_grad=True)  # one per row
    assert gradcheck(lambda x, e: fn(x, epsilon=e, regularization=reg), (x, eps))
    assert gradcheck(lambda x: fn(x, epsilon=0.7, regularization=reg, descending=True), (x,))
    assert gradgradcheck(lambda x: fn(x, epsilon=0.7, regularization=reg), (x,))


def test_vjp_is_block_mean_l2_rank():
    # In sorted coordinates the rank Jacobian is (I - blockdiag(11^T/|B|)) / epsilon.
    x = torch.tensor([0.0, 0.1, 0.2, 5.0], dtype=F64, requires_grad=True)  # one block {0,1,2}
    g = torch.tensor([1.0, 2.0, 6.0, 1.0], dtype=F64)
    (gx,) = torch.autograd.grad(soft_rank(x, epsilon=1.0), x, g)
    torch.testing.assert_close(gx, torch.tensor([-2.0, -1.0, 3.0, 0.0], dtype=F64))


def test_gradient_matches_finite_differences():
    x = torch.randn(3, 10, dtype=F64, requires_grad=True)
    r = soft_rank(x, epsilon=0.8)
    g = torch.randn_like(r)
    (gx,) = torch.autograd.grad(r, x, g)
    # finite differences of the forward, per entry
    h = 1e-6
    fd = torch.zeros_like(x)
    for i in range(3):
        for j in range(10):
            d = torch.zeros_like(x)
            d[i, j] = h
            fd[i, j] = (
                (soft_rank(x + d, epsilon=0.8) - soft_rank(x - d, epsilon=0.8)) * g
            ).sum() / (2 * h)
    torch.testing.assert_close(gx, fd, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------ the brute-force QP


def _project(z, w, kl: bool):
    """argmin over the permutahedron of w (Rado's description) of ||mu - z||^2/2 or KL(mu||e^z)."""
    opt = pytest.importorskip("scipy.optimize")
    import numpy as np

    n = len(z)
    ws = np.sort(w)[::-1]
    cons = [{"type": "eq", "fun": lambda m: m.sum() - ws.sum()}]
    for size in range(1, n):
        for S in itertools.combinations(range(n), size):
            idx = list(S)
            cons.append(
                {
                    "type": "ineq",
                    "fun": lambda m, idx=idx, size=size: ws[:size].sum() - m[idx].sum(),
                }
            )
    if kl:

        def f(m):
            m = np.maximum(m, 1e-300)
            return float((m * (np.log(m) - z) - m).sum())

        def jac(m):
            return np.log(np.maximum(m, 1e-300)) - z
    else:

        def f(m):
            return 0.5 * float(((m - z) ** 2).sum())

        def jac(m):
            return m - z

    x0 = np.full(n, ws.mean())
    bounds = [(1e-12, None)] * n if kl else None
    res = opt.minimize(
        f,
        x0,
        jac=jac,
        constraints=cons,
        method="SLSQP",
        bounds=bounds,
        options={"ftol": 1e-15, "maxiter": 1000},
    )
    return res.x


@pytest.mark.parametrize("seed", range(4))
def test_against_brute_force_qp(seed):
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    n = 3 + seed % 3
    x = torch.randn(n, generator=g, dtype=F64)
    if seed == 1:
        x[1] = x[0]  # a tie
    eps = [0.1, 0.7, 2.0, 10.0][seed]
    rho = np.arange(n, 0, -1, dtype=np.float64)
    xn = x.numpy()
    # rank l2 = P_Q(x/eps, rho); rank kl = exp P_E(x/eps, log rho)
    torch.testing.assert_close(
        soft_rank(x, epsilon=eps),
        torch.from_numpy(_project(xn / eps, rho, False)),
        atol=1e-7,
        rtol=0,
    )
    torch.testing.assert_close(
        soft_rank(x, epsilon=eps, regularization="kl"),
        torch.from_numpy(_project(xn / eps, rho, True)),
        atol=1e-5,
        rtol=0,
    )
    # ascending sort = -P(rho/eps, -x)
    torch.testing.assert_close(
        soft_sort(x, epsilon=eps),
        -torch.from_numpy(_project(rho / eps, -xn, False)),
        atol=1e-7,
        rtol=0,
    )
    kl = np.log(_project(rho / eps, np.exp(-xn), True))
    torch.testing.assert_close(
        soft_sort(x, epsilon=eps, regularization="kl"), -torch.from_numpy(kl), atol=1e-5, rtol=0
    )


# ---------------------------------------------------------------------------------- torchsort


@pytest.mark.parametrize("reg", REGS)
def test_against_torchsort(reg):
    torchsort = pytest.importorskip("torchsort")
    x = torch.randn(4, 20, dtype=F64)
    for e in (0.1, 1.0, 5.0):
        torch.testing.assert_close(
            soft_rank(x, epsilon=e, regularization=reg),
            torchsort.soft_rank(x, regularization=reg, regularization_strength=e),
        )
        torch.testing.assert_close(
            soft_sort(x, epsilon=e, regularization=reg),
            torchsort.soft_sort(x, regularization=reg, regularization_strength=e),
        )


# ---------------------------------------------------------------------------------- quantile


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_quantile_hard_limit_matches_torch(dim, keepdim):
    x = torch.stack([_distinct(4, 9) for _ in range(3)])  # (3, 4, 9) with distinct values per row
    x = (x + torch.arange(3, dtype=F64)[:, None, None] * 10).movedim(-1, dim)
    for q in (
        0.0,
        0.3,
        0.5,
        1.0,
        torch.tensor(0.25, dtype=F64),
        torch.tensor([0.1, 0.5, 0.9], dtype=F64),
    ):
        ref = torch.quantile(x, q, dim=dim, keepdim=keepdim)
        out = soft_quantile(x, q, dim=dim, keepdim=keepdim, epsilon=1e-4)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref)


def test_quantile_gradcheck_and_smoothing():
    x = (_distinct(2, 7) + 0.01 * torch.randn(2, 7, dtype=F64)).requires_grad_()
    q = torch.tensor([0.2, 0.55, 0.85], dtype=F64, requires_grad=True)  # off the grid q(n-1)
    assert gradcheck(lambda x, q: soft_quantile(x, q, epsilon=0.8), (x, q))
    xd = x.detach()
    torch.testing.assert_close(soft_quantile(xd, 0.3, epsilon=1e8), xd.mean(-1), atol=1e-6, rtol=0)
    # it is the l2 soft sort, interpolated at q (n - 1)
    s = soft_sort(xd, epsilon=0.8)
    torch.testing.assert_close(soft_quantile(xd, 0.5, epsilon=0.8), s[:, 3])
    torch.testing.assert_close(soft_quantile(xd, 0.25, epsilon=0.8), 0.5 * (s[:, 1] + s[:, 2]))


def test_the_reference_runs_after_one_warning_where_the_kernel_is_not_built(tmp_path, monkeypatch):
    monkeypatch.setattr(isotonic.KERNEL, "path", lambda: tmp_path / "not-built.so")
    monkeypatch.setattr(isotonic.KERNEL, "_tried", False)
    monkeypatch.setattr(isotonic.KERNEL, "_ops", None)
    x = torch.randn(2, 5, dtype=F64)
    with backend("reference"):
        want = soft_rank(x)
    with pytest.warns(RuntimeWarning, match="softops_isotonic is not built"):
        got = soft_rank(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        soft_rank(x)  # once per process
    monkeypatch.setattr(isotonic.KERNEL, "_tried", False)
    with warnings.catch_warnings(), backend("reference"):
        warnings.simplefilter("error")
        soft_rank(x)  # the reference chosen on purpose is silent


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(-4, 4), min_size=1, max_size=10),
    st.sampled_from([1e-6, 1.0, 1e6]),
    st.sampled_from([1e-3, 1.0, 1e3]),
    st.sampled_from(REGS),
)
def test_invariants_with_ties_and_extreme_magnitudes(values, scale, eps, reg):
    x = torch.tensor([values], dtype=F64) * scale
    n = x.shape[-1]
    r = soft_rank(x, epsilon=eps, regularization=reg)
    assert torch.isfinite(r).all()
    assert (r >= 1 - 1e-6).all() and (r <= n + 1e-6).all()
    torch.testing.assert_close(r.sum(), torch.tensor(n * (n + 1) / 2, dtype=F64))
    s = soft_sort(x, epsilon=eps, regularization=reg)
    assert (s.diff(dim=-1) >= -1e-9 * (1 + s.abs().max())).all()
    # tied inputs get equal ranks
    for i in range(n):
        for j in range(n):
            if values[i] == values[j]:
                torch.testing.assert_close(r[0, i], r[0, j])


@pytest.mark.parametrize("reg", REGS)
def test_torch_func_vmap_and_grad(reg):
    x = torch.randn(4, 3, 6, dtype=F64)
    for fn in (soft_sort, soft_rank):
        out = torch.func.vmap(lambda t, fn=fn: fn(t, epsilon=0.5, regularization=reg))(x)
        torch.testing.assert_close(out, fn(x, epsilon=0.5, regularization=reg))

        def loss(t, fn=fn):
            return (fn(t, epsilon=0.5, regularization=reg) * torch.arange(6.0)).sum()

        xr = x.clone().requires_grad_()
        loss(xr).backward()
        torch.testing.assert_close(torch.func.grad(loss)(x), xr.grad)
        jac = torch.func.vmap(torch.func.jacrev(lambda t, fn=fn: fn(t, regularization=reg)))(x[0])
        assert jac.shape == (3, 6, 6)


# ------------------------------------------------- precision at every scale (the hardening issue)

SCALES = [1e-8, 1e-4, 1.0, 1e4, 1e8]
DTYPES = [torch.float32, F64]


def _spread(n: int, scale: float, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A shuffled row with gaps between scale and 2 scale (an offset far larger than the gaps)."""
    g = torch.Generator().manual_seed(seed)
    steps = 1.0 + torch.rand(n, generator=g, dtype=F64)
    values = (steps.cumsum(0) + 3.0 * n) * scale
    return values[torch.randperm(n, generator=g)].to(dtype)


def test_issue_examples_are_exact():
    torch.testing.assert_close(
        soft_rank(torch.tensor([1e8, 2e8, 3e8]), epsilon=1.0), torch.tensor([1.0, 2.0, 3.0])
    )
    torch.testing.assert_close(
        soft_rank(torch.tensor([0.3, -1.2, 0.8]), epsilon=1e-8), torch.tensor([2.0, 1.0, 3.0])
    )
    x = torch.tensor([0.75, 0.32, 0.99, 0.27, 0.94])
    assert torch.equal(soft_sort(x, epsilon=1e-6), x.sort().values)
    from softops.losses import ndcg_loss

    loss = ndcg_loss(torch.tensor([[1e8, 2e8, 3e8]]), torch.tensor([[0.0, 1.0, 2.0]]))
    assert torch.isfinite(loss).all()


@pytest.mark.parametrize("back_end", BACK_ENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_hard_limits_exact_at_every_scale(scale, dtype, back_end, monkeypatch):
    _use(back_end)
    n = 12
    x = torch.stack([_spread(n, scale, dtype, seed) for seed in range(3)])
    x[2] = -x[2]
    # every gap exceeds epsilon: exactly the hard ranks (l2), to float rounding (kl)
    hard = _hard_rank(x)
    assert torch.equal(soft_rank(x, epsilon=1e-3 * scale), hard)
    assert torch.equal(soft_rank(x, epsilon=1e-3 * scale, descending=True), n + 1 - hard)
    torch.testing.assert_close(soft_rank(x, epsilon=1e-3 * scale, regularization="kl"), hard)
    # every gap below 1/epsilon: exactly sorted (l2 and kl)
    eps = 1e-3 / (scale * n)
    for reg in REGS:
        assert torch.equal(soft_sort(x, epsilon=eps, regularization=reg), x.sort(-1).values)
        s = soft_sort(x, epsilon=eps, regularization=reg, descending=True)
        assert torch.equal(s, x.sort(-1, descending=True).values)
    # epsilon far above the gaps: ranks (n + 1) / 2, l2 values the mean
    r = soft_rank(x, epsilon=1e9 * scale * n)
    torch.testing.assert_close(r, torch.full_like(x, (n + 1) / 2))
    mean = x.to(F64).mean(-1, keepdim=True).expand_as(x).to(dtype)
    torch.testing.assert_close(soft_sort(x, epsilon=1e9 / scale), mean)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 9),
    log_scale=st.floats(-8, 8),
    log_ratio=st.floats(-10, 10),
    reg=st.sampled_from(REGS),
    f32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_ranks_stay_in_the_permutahedron(n, log_scale, log_ratio, reg, f32, seed):
    dtype = torch.float32 if f32 else F64
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, n, generator=g, dtype=F64) * 10**log_scale).to(dtype)
    x[1] = x[1].round(decimals=1) + 10**log_scale * 1e3  # ties, far from 0
    r = soft_rank(x, epsilon=10 ** (log_scale + log_ratio), regularization=reg)
    tol = 1e-5 if f32 else 1e-12
    assert (r >= 1 - tol * n).all() and (r <= n + tol * n).all(), r
    torch.testing.assert_close(
        r.sum(-1).to(F64), torch.full((2,), n * (n + 1) / 2, dtype=F64), rtol=tol, atol=0
    )
    s = soft_sort(x, epsilon=10 ** (log_ratio - log_scale), regularization=reg)
    assert (s.diff(dim=-1) >= 0).all(), s
    lo, hi = x.min(-1, keepdim=True).values, x.max(-1, keepdim=True).values
    assert ((s >= lo) & (s <= hi)).all()


@pytest.mark.parametrize("eps", [0.05, 0.7, 5.0])  # relative to the gaps (about 0.7)
@pytest.mark.parametrize("reg", REGS)
@pytest.mark.parametrize("scale", [1e-6, 1e6])
def test_gradcheck_at_extreme_scales(reg, scale, eps):
    base = _distinct(2, 6) + 0.01 * torch.randn(2, 6, dtype=F64)
    x = (base * scale).requires_grad_()
    h = 1e-6 * scale  # the finite-difference step, at the inputs' scale
    rank = soft_rank(x, epsilon=eps * scale, regularization=reg)
    assert gradcheck(
        lambda x: soft_rank(x, epsilon=eps * scale, regularization=reg) * scale, (x,), eps=h
    )
    sort = soft_sort(x, epsilon=eps / scale, regularization=reg)
    assert gradcheck(lambda x: soft_sort(x, epsilon=eps / scale, regularization=reg), (x,), eps=h)
    assert torch.isfinite(rank).all() and torch.isfinite(sort).all()


def test_agrees_with_the_plain_formula_where_it_was_accurate():
    """At moderate scales the old formulation, s - v with v fitted to s - w, was accurate."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 40, generator=g, dtype=F64)
    for eps in [0.03, 0.3, 3.0]:
        z = x / eps
        s = z.sort(-1, descending=True).values
        rho = torch.arange(40, 0, -1, dtype=F64)
        v = torch.tensor([pav_decreasing(row)[0] for row in (s - rho).tolist()], dtype=F64)
        old = torch.empty_like(s).scatter(1, z.argsort(-1, descending=True), s - v)
        torch.testing.assert_close(soft_rank(x, epsilon=eps), old, rtol=0, atol=1e-10)
        a = rho / eps
        theta = (-x).sort(-1, descending=True).values  # ascending sort = -P(rho/eps, sort(-x))
        v = torch.tensor([pav_decreasing(row)[0] for row in (a - theta).tolist()], dtype=F64)
        torch.testing.assert_close(soft_sort(x, epsilon=eps), v - a, rtol=0, atol=1e-10)


def test_kl_sort_with_minus_inf_has_finite_gradients():
    inf = math.inf
    rows = [[1.0, 2.0, -inf, 0.5], [-inf, -inf, 3.0, 0.0], [1.0, -inf, -inf, -inf]]
    for row in rows:
        for descending in (False, True):
            x = torch.tensor([row], dtype=F64, requires_grad=True)
            y = soft_sort(x, epsilon=0.5, regularization="kl", descending=descending)
            # a loss that stays finite on -inf outputs
            loss = (torch.exp(y) * torch.arange(1.0, 5.0, dtype=F64)).sum()
            (gx,) = torch.autograd.grad(loss, x)
            assert torch.isfinite(gx).all(), (row, descending, gx)
    # and a -inf entry leaves the finite entries' gradients as without it, in the descending sort
    x = torch.tensor([[1.0, 2.0, 0.5, -inf]], dtype=F64, requires_grad=True)
    y = soft_sort(x, epsilon=0.5, regularization="kl", descending=True)
    (gx,) = torch.autograd.grad(y[:, :3].sum(), x)
    assert torch.isfinite(gx).all()


# ------------------------------------------------------- forward mode (jvp) and meta tensors


def _pooled_rows(kl: bool, w_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (descending) s (3, 7) and w (w_rows, 7) whose projection pools several blocks of
    two and more entries, with a tie in s (inside a block: w strictly decreases)."""
    g = torch.Generator().manual_seed(11)
    s = (torch.randn(3, 7, generator=g, dtype=F64) * 2.0).sort(-1, descending=True).values
    s[1, 3] = s[1, 2]
    w = torch.arange(7, 0, -1, dtype=F64).expand(w_rows, 7).clone()
    w = w + 0.1 * torch.rand(w_rows, 7, generator=g, dtype=F64).sort(-1, descending=True).values
    return s, (w.log() if kl else w)


@pytest.mark.parametrize("back_end", BACK_ENDS)
@pytest.mark.parametrize("layout", ["rank", "rank-exp", "sort", "sort-negated"])
@pytest.mark.parametrize("w_rows", [1, 3])
@pytest.mark.parametrize("kl", [False, True], ids=["l2", "kl"])
def test_projection_jvp_is_the_jacobian_applied_to_the_tangent(
    kl, w_rows, layout, back_end, monkeypatch
):
    """The node's jvp against jacrev and central differences, in z, in w and in epsilon, for each
    use: z sorted in the node (rank; in exp space, the KL rank exp P_E(z, log w)) or w (sort;
    negated, -P(z, -w): the ascending sort); z = u / eps (the rank) or u * (1/eps) (the sort)."""
    from softops.sort._pav import _Mode, _Permutahedron

    if layout == "rank-exp" and not kl:
        pytest.skip("exp space is the KL rank's")
    _use(back_end)
    exp_space = layout == "rank-exp"
    s, w = _pooled_rows(kl and not exp_space, w_rows)
    g = torch.Generator().manual_seed(3)
    ds = torch.randn(s.shape, generator=g, dtype=F64)
    ds[1, 3] = ds[1, 2]  # keep the tie along the tangent
    dw = torch.randn(w.shape, generator=g, dtype=F64)
    eps = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    de = torch.randn(3, generator=g, dtype=F64)
    if layout.startswith("rank"):  # z shuffled (sorted in the node), w sorted
        perm = torch.stack([torch.randperm(7, generator=g) for _ in range(3)])
        z, dz = s.gather(1, perm), ds.gather(1, perm)
        mode = _Mode(kl, sort_z=True, sort_w=False, exp_space=exp_space)
    else:  # z sorted, w shuffled (sorted in the node); no tie in w
        perm = torch.randperm(7, generator=g).expand(w_rows, 7)
        s, ds = s[[0, 2, 2]], ds[[0, 2, 2]]
        z, dz = s, ds
        mode = _Mode(kl, sort_z=False, sort_w=True, negate=layout == "sort-negated", inv=True)
        w, dw = w.gather(1, perm), dw.gather(1, perm)
    u = z * eps[:, None] if not mode.inv else z / eps[:, None]  # the blocks of z at eps

    def p(u, w, e):
        return _Permutahedron.apply(u, w, e, mode)[0]

    block = _Permutahedron.apply(u, w, eps, mode)[3]
    sizes = torch.zeros_like(z).scatter_add(1, block, torch.ones_like(z))
    assert (sizes >= 2).any() and (sizes == 1).any()  # pooled blocks and singletons
    args, tangents = (u, w, eps), (dz, dw, de)
    out, tangent = torch.func.jvp(p, args, tangents)
    torch.testing.assert_close(out, p(*args), rtol=0, atol=0)
    jac = torch.func.jacrev(p, argnums=(0, 1, 2))(*args)  # (3, 7, 3, 7), (3, 7, w_rows, 7), ...
    want = sum(torch.einsum("bi...,...->bi", j, t) for j, t in zip(jac, tangents, strict=True))
    torch.testing.assert_close(tangent, want, rtol=1e-12, atol=1e-12)
    h = 1e-6  # central differences: the blocks and the orders do not change within h
    plus = [a + h * t for a, t in zip(args, tangents, strict=True)]
    minus = [a - h * t for a, t in zip(args, tangents, strict=True)]
    fd = (p(*plus) - p(*minus)) / (2 * h)
    torch.testing.assert_close(tangent, fd, rtol=0, atol=1e-8)
    # each tangent alone, and jacfwd equals jacrev
    for i in range(3):
        alone = [None, None, None]
        alone[i] = tangents[i]

        def pi(a, i=i):
            return p(*[a if k == i else args[k] for k in range(3)])

        torch.testing.assert_close(
            torch.func.jvp(pi, (args[i],), (tangents[i],))[1],
            torch.einsum("bi...,...->bi", jac[i], tangents[i]),
        )
    jf = torch.func.jacfwd(p, argnums=(0, 1, 2))(*args)
    for a, b in zip(jf, jac, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # in sorted coordinates, the l2 Jacobian in s (I - block mean) is symmetric; the KL one,
    # I - 1 softmax(s_B)^T, is not
    if layout.startswith("sort"):
        jz = jac[0] * eps[:, None, None, None]  # d/du = d/dz * (1/eps): back to z
        symmetric = [torch.allclose(jz[b, :, b, :], jz[b, :, b, :].T) for b in range(3)]
        assert all(symmetric) if not kl else not all(symmetric)


@pytest.mark.parametrize("reg", REGS)
def test_derivatives_at_the_limits_are_zero_and_agree(reg):
    """Infinite entries (set to their limit) and NaN rows get zero derivatives, in both modes;
    the finite entries of such rows keep theirs."""
    inf = math.inf
    x = torch.tensor(
        [[0.3, inf, -0.2, inf, 0.6], [-inf, 0.5, 1.5, 0.1, 0.2], [0.1, math.nan, 1.0, 2.0, 3.0]],
        dtype=F64,
    )
    for fn in (soft_rank, soft_sort):
        f = lambda t, fn=fn: fn(t, epsilon=0.9, regularization=reg)  # noqa: E731
        rev = torch.func.jacrev(f)(x)
        fwd = torch.func.jacfwd(f)(x)
        assert bool(rev.isfinite().all()) and bool(fwd.isfinite().all())
        torch.testing.assert_close(rev, fwd, rtol=1e-12, atol=1e-12)
        assert bool((rev[2] == 0).all()) and bool((rev[:, :, 2] == 0).all())  # the NaN row
        if fn is soft_rank:  # the infinite entries are their limits: no derivative in or out
            for b, j in ((0, 1), (0, 3), (1, 0)):
                assert bool((rev[b, j] == 0).all()) and bool((rev[b, :, b, j] == 0).all())
            assert bool((rev[0, 0, 0, [0, 2, 4]] != 0).any())


@pytest.mark.parametrize("reg", REGS)
@pytest.mark.parametrize("fn", [soft_sort, soft_rank])
def test_forward_ad_gradcheck_with_ties_and_blocks(fn, reg):
    # Row 0 at epsilon 0.8 pools the tied pair (3.4, 3.4) inside a block of the sort (a rank
    # always pools tied entries) next to singletons, so the map is differentiable at the tie.
    x = torch.tensor([[0.0, 0.2, 0.4, 3.4, 3.4, 6.6, 6.8, 7.0]], dtype=F64)
    x = torch.cat([x[:, torch.randperm(8)], _distinct(1, 8) + 0.01 * torch.randn(1, 8, dtype=F64)])
    x.requires_grad_()
    eps = torch.tensor([0.8, 1.3], dtype=F64, requires_grad=True)
    for descending in (False, True):
        assert gradcheck(
            lambda x, e, d=descending: fn(x, epsilon=e, regularization=reg, descending=d),
            (x, eps),
            check_forward_ad=True,
            check_batched_forward_grad=True,
        )


def test_quantile_forward_ad_gradcheck():
    x = (_distinct(2, 7) + 0.01 * torch.randn(2, 7, dtype=F64)).requires_grad_()
    q = torch.tensor([0.2, 0.55], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, q: soft_quantile(x, q, epsilon=0.8), (x, q), check_forward_ad=True)


@pytest.mark.parametrize("back_end", BACK_ENDS)
def test_meta_tensors_give_the_shape_without_data(back_end, monkeypatch):
    _use(back_end)

    def no_kernel(*args, **kwargs):
        raise AssertionError("a PAV kernel ran on meta tensors")

    monkeypatch.setattr(isotonic, "PERMUTAHEDRON_OP", no_kernel)
    monkeypatch.setattr(isotonic, "_torch_project_gaps", no_kernel)
    for dtype in (torch.float16, torch.float32, F64):
        x = torch.empty(3, 5, 4, dtype=dtype, device="meta")
        for reg in REGS:
            for fn in (soft_sort, soft_rank):
                for dim, descending in ((1, False), (-1, True)):
                    out = fn(x, dim=dim, epsilon=0.7, regularization=reg, descending=descending)
                    assert out.device.type == "meta"
                    assert out.shape == x.shape and out.dtype == dtype
        q = torch.tensor([0.1, 0.5], dtype=dtype)  # the levels are checked on the host
        out = soft_quantile(x, q, dim=1, epsilon=0.7)
        assert out.device.type == "meta" and out.shape == (2, 3, 4) and out.dtype == dtype
    # through autograd too: a meta forward records a graph, the backward gives meta gradients
    x = torch.empty(2, 6, dtype=F64, device="meta", requires_grad=True)
    (gx,) = torch.autograd.grad(soft_rank(x, epsilon=0.7, regularization="kl").sum(), x)
    assert gx.device.type == "meta" and gx.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("fn", [soft_sort, soft_rank])
def test_fused_l2_backward_equals_the_torch_form(fn, dtype):
    """With the kernel, the l2 backward is one compiled pass (the kernel's l2_vjp) unless the
    graph of the gradient is wanted; it gives the torch form's gradients, in x and in
    epsilon."""
    _use("kernel")
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(6, 40, generator=g, dtype=F64) * 3).to(dtype)
    x[2, 5] = x[2, 7]  # a tie
    eps = torch.tensor([0.3, 1.0, 2.0, 0.05, 7.0, 1.5], dtype=dtype)
    w = torch.randn(6, 40, generator=g, dtype=F64).to(dtype)

    def grads(back_end: str, create_graph: bool = False):
        set_default_backend(back_end)
        xr, er = x.clone().requires_grad_(), eps.clone().requires_grad_()
        out = [fn(xr, epsilon=er, descending=d) for d in (False, True)]
        loss = sum(((o * w) ** 2).sum() for o in out)  # a cotangent that is not constant
        with torch.profiler.profile() as prof:  # the kernel's passes, as the dispatcher saw them
            got = torch.autograd.grad(loss, (xr, er), create_graph=create_graph)
        passes = sum(e.count for e in prof.key_averages() if e.key == "softops_isotonic::l2_vjp")
        return got, passes

    fused, passes = grads("kernel")
    assert passes == 2  # the fused pass ran, once per call
    plain, _ = grads("reference")
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    twice, passes = grads("kernel", create_graph=True)  # the gradient's graph: the torch form
    assert passes == 0 and twice[0].requires_grad
    for a, b in zip(twice, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("fn", [softops.soft_rank, softops.soft_sort])
def test_rho_made_once_serves_inference_mode_and_autograd_alike(fn):
    """rho = (n, ..., 1) is made once per (n, dtype, device) in eager calls: made first under
    inference mode, it must still be a tensor that autograd can save (a fresh size, n = 37)."""
    with torch.inference_mode():
        first = fn(torch.randn(2, 37, dtype=torch.float64))
    x = torch.randn(2, 37, dtype=torch.float64, requires_grad=True)
    fn(x).sum().backward()
    assert first.shape == (2, 37) and x.grad is not None and torch.isfinite(x.grad).all()
