"""method="pav" at the extremes: infinities, far entries, tiny and huge epsilon (the defects KD1,
KD2, KD8, KD9 and KD11 that tests/test_adversarial.py found, as regression tests).

Each runs on both PAV back ends (the C++ kernels and the torch reference). Root causes, for the
record:

- KD1: the derivative in epsilon went through the chain rule of z = x / eps (and of rho * (1/eps)
  for the sort), whose backward forms (z / eps) / eps: once eps**2 underflows, 0 * inf = NaN at a
  derivative of 0. It is now -<J_z^T g, z - z_ref> / eps, on block-relative z.
- KD2: the same chain multiplied the (zero) cotangent of an infinite z by x = inf.
- KD8 / KD9: a row with an infinite z (an infinity in x, or x / eps overflowing) took the plain
  formulas s - v, with v = s - w: at |s| >> |w| that cancels (a rank of 0 beside 1e300 at
  epsilon 1e-18; KL ranks beyond n). The block-relative frame now takes the infinities too.
- KD11: y = s - w overflowed (rho / eps near the cap minus -1.7e308 is +inf, beside -inf from the
  +inf entry: NaN). An infinity in the L2 w is now taken to its limit (the row is that infinity)
  without forming y, and rows of huge magnitude are solved scaled by a power of two.
"""

from __future__ import annotations

import math

import pytest
import torch

from softops import soft_quantile, soft_rank, soft_sort
from softops._core import isotonic
from softops._kernels import backend as kernel_backend
from softops._kernels import set_default_backend
from tests._helpers import built_ops, project

F64 = torch.float64
F32 = torch.float32
INF = math.inf
TINY = 2.3e-308  # just above float64's smallest normal, the least epsilon softops takes there
BACKENDS = ["kernel", "reference"]


def _require_kernel() -> None:
    """Skip where the C++ kernel of PAV is not built (fail under SOFTOPS_REQUIRE_KERNELS=1)."""
    built_ops(isotonic.KERNEL)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test on one PAV back end (the kernel layer's switch chooses)."""
    if request.param == "kernel":
        _require_kernel()
    with kernel_backend(request.param):
        yield request.param


def _grads(fn, x: list[list[float]], eps: float, dtype: torch.dtype = F64):
    """fn(x, epsilon) and the gradients of its finite outputs in x and epsilon (a tensor)."""
    xt = torch.tensor(x, dtype=F64).to(dtype).requires_grad_()
    et = torch.tensor([eps] * len(x), dtype=F64, requires_grad=True)
    out = fn(xt, et)
    g = torch.where(torch.isfinite(out), torch.ones_like(out), 0)
    gx, ge = torch.autograd.grad(out, [xt, et], g, allow_unused=True)
    return out.detach(), gx, ge


# ------------------------------------------------------ the reproducers (tests/test_adversarial.py)


def test_kd1_sort_eps_grad_at_tiny_eps(backend):
    fn = lambda x, e: soft_sort(x, epsilon=e)  # noqa: E731
    out, _, ge = _grads(fn, [[0.0, 1.0, 2.0]], 1e-200)
    assert out.tolist() == [[0.0, 1.0, 2.0]]
    assert ge.tolist() == [0.0]  # the hard limit: 0 (was NaN)


def test_kd2_rank_with_an_infinity_eps_grad(backend):
    fn = lambda x, e: soft_rank(x, epsilon=e)  # noqa: E731
    out, gx, ge = _grads(fn, [[INF, 0.0, 1.0]], 1.0)
    assert out.tolist() == [[3.0, 1.0, 2.0]]
    assert bool(torch.isfinite(gx).all()) and bool(torch.isfinite(ge).all()), (gx, ge)


def test_kd8_l2_rank_beside_a_far_entry(backend):
    out = soft_rank(torch.tensor([[1e300, 0.0, 1.0]], dtype=F64), epsilon=1e-18)
    assert out.tolist() == [[3.0, 1.0, 2.0]]  # was [[3, 1, 0]]


def test_kd9_kl_rank_beside_a_far_entry(backend):
    x = torch.tensor([[-INF, 0.0, 1.0]], dtype=F64)
    out = soft_rank(x, epsilon=1e-16, regularization="kl")
    ulp = 4e-16  # the KL rank is exp(log 3) = 3 + 1 ulp, on finite rows too
    assert ((out >= 1) & (out <= 3 + ulp)).all() and abs(float(out.sum()) - 6) < 1e-6, out
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 3.0]], dtype=F64))  # was 7.39


def test_kd11_sort_with_inf_near_the_largest_value(backend):
    x = torch.tensor([[INF, 0.0, -1.7e308]], dtype=F64)
    out = soft_sort(x, epsilon=TINY, descending=True)
    assert out.tolist() == [[INF, INF, INF]]  # an infinity pulls the l2 row to it (was NaN)
    mirror = soft_sort(-x, epsilon=TINY)
    assert mirror.tolist() == [[-INF, -INF, -INF]]


# ------------------------------------------ ranks in [1, n], summing to n(n+1)/2, at any scale


def _far_rows(dtype: torch.dtype, ratio: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows beside a far entry where max |x| / eps = ratio, and their epsilon (B,): a finite far
    entry beside entries soft at eps (gaps ~ eps; only where ratio * eps fits the dtype), and
    +-inf beside entries hard at eps (gaps of ratio * eps, or the dtype's largest values)."""
    fi = torch.finfo(dtype)
    # eps such that both eps and ratio * eps are normal numbers of the dtype
    log_eps = max(math.log10(fi.tiny) + 2, -math.log10(ratio) / 2)
    if log_eps + math.log10(ratio) > math.log10(fi.max) - 1:
        return None
    eps = 10.0**log_eps
    far = ratio * eps
    soft = [0.0, 0.5, 1.0, 1.0, 2.5]  # a tie too
    rows = [
        [far] + [v * eps for v in soft],
        [-far] + [v * eps for v in soft],
        [INF] + [v * far for v in soft],
        [-INF] + [v * far for v in soft],
        [INF, -INF] + [v * far for v in soft[1:]],
        [far, INF] + [v * eps for v in soft[1:]],
    ]
    return torch.tensor(rows, dtype=F64).to(dtype), torch.full((len(rows),), eps, dtype=dtype)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("reg", ["l2", "kl"])
def test_ranks_in_the_permutahedron_beside_a_far_entry(dtype, reg, backend):
    """At |x| / eps from 1e3 to 1e300 (where the dtype can hold it), beside an infinite or a
    finite far entry, ascending and descending: ranks in [1, n] that sum to n(n+1)/2, the far
    entries at their hard ranks."""
    tol = 1e-4 if dtype == F32 else 1e-9
    done = 0
    for k in range(3, 301, 3):
        ratio = 10.0**k
        made = _far_rows(dtype, ratio)
        if made is None:
            continue
        x, eps = made
        n = x.shape[-1]
        for descending in (False, True):
            r = soft_rank(x, epsilon=eps, regularization=reg, descending=descending).double()
            assert bool(torch.isfinite(r).all()), (ratio, r)
            assert bool(((r >= 1 - tol) & (r <= n + tol)).all()), (ratio, descending, r)
            sums = r.sum(-1)
            torch.testing.assert_close(
                sums, torch.full_like(sums, n * (n + 1) / 2), rtol=0, atol=tol * n
            )
            top = (r[:, 0] if not descending else n + 1 - r[:, 0]).tolist()
            assert top[0] == pytest.approx(n) and top[1] == pytest.approx(1.0)  # +-far
            if 2.5 * ratio < torch.finfo(dtype).max:  # (else x / eps overflows: ties at inf)
                assert top[2] == n and top[3] == 1 and top[4] == n  # +-inf
            done += 1
    assert done >= (6 if dtype == F32 else 50)  # float32 holds |x| / eps up to about 1e70


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("reg", ["l2", "kl"])
def test_ranks_beside_an_overflowing_entry(dtype, reg, backend):
    """x / eps beyond the dtype (it becomes an infinity) beside entries at |x| / eps up to 1e300:
    the overflowed entry gets its hard rank, the others their exact ranks (KD8)."""
    fi = torch.finfo(dtype)
    for eps in (10.0 ** (-k) for k in range(3, 40 if dtype == F32 else 300, 3)):
        if eps < fi.tiny:
            continue
        x = torch.tensor([[fi.max / 4, 0.0, 1.0, 2.0, -fi.max / 2]], dtype=dtype)
        r = soft_rank(x, epsilon=eps, regularization=reg)
        want = torch.tensor([[5.0, 2.0, 3.0, 4.0, 1.0]], dtype=dtype)
        torch.testing.assert_close(r, want, rtol=1e-6 if dtype == F32 else 1e-15, atol=0)


# ------------------------------------------------- derivatives in epsilon: finite differences


def _fd_eps(fn, x: torch.Tensor, eps: float, rel: float = 1e-6) -> tuple[torch.Tensor, ...]:
    """d sum(w * fn(x, eps)) / d eps by autograd and by central differences (step rel * eps), with
    w a fixed cotangent (zero where the output is not finite)."""
    g = torch.Generator().manual_seed(5)
    out = fn(x, torch.tensor([eps] * x.shape[0], dtype=x.dtype))
    w = torch.randn(out.shape, generator=g, dtype=x.dtype)
    w = torch.where(torch.isfinite(out), w, 0)
    e = torch.tensor([eps] * x.shape[0], dtype=x.dtype, requires_grad=True)
    ge = torch.autograd.grad((fn(x, e).nan_to_num(posinf=0, neginf=0) * w).sum(), e)[0]
    h = rel * eps

    def total(v: float) -> torch.Tensor:
        o = fn(x, torch.tensor([v] * x.shape[0], dtype=x.dtype))
        return (torch.where(w != 0, o, 0) * w).sum(-1)

    return ge, (total(eps + h) - total(eps - h)) / (2 * h)


@pytest.mark.parametrize("reg", ["l2", "kl"])
@pytest.mark.parametrize("scale", [1e-300, 1e-200, 1e-160, 1.0, 1e150, 1e300])
def test_rank_eps_gradient_matches_differences_at_any_scale(scale, reg, backend):
    """soft_rank(c x, c eps) = soft_rank(x, eps): at c = 1e-200 eps**2 underflows (KD1) and the
    derivative, about n / eps, is finite; pooled blocks and singletons, and an infinity (KD2)."""
    base = torch.tensor(
        [[0.0, 0.4, 1.5, 1.7, 3.0, 0.41], [INF, 0.1, -0.3, 1.2, -INF, 0.15]], dtype=F64
    )
    x = base * scale
    fn = lambda x, e: soft_rank(x, epsilon=e, regularization=reg)  # noqa: E731
    ge, fd = _fd_eps(fn, x, 0.9 * scale)
    assert bool(torch.isfinite(ge).all()), ge
    assert bool((ge != 0).all())  # pooled blocks: a derivative to check
    torch.testing.assert_close(ge, fd, rtol=1e-6, atol=0)
    ge1, _ = _fd_eps(fn, base, 0.9)
    torch.testing.assert_close(ge * scale, ge1, rtol=1e-10, atol=0)  # the scaling law


@pytest.mark.parametrize("reg", ["l2", "kl"])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_eps_gradient_matches_differences(descending, reg, backend):
    """The sort: at a tiny epsilon (1/eps**2 overflows) the hard limit's 0; at moderate ones the
    central differences, beside an infinity too (finite for KL; the L2 row is infinite)."""
    fn = lambda x, e: soft_sort(x, epsilon=e, regularization=reg, descending=descending)  # noqa: E731
    x = torch.tensor([[0.0, 1.0, 2.0, 2.0, 5.0]], dtype=F64)
    for eps in (1e-200, 1e-300):
        ge, fd = _fd_eps(fn, x, eps)
        assert ge.tolist() == [0.0] and fd.tolist() == [0.0]
    x = torch.tensor([[0.0, 0.4, 1.5, 1.7, 3.0, 0.41], [0.3, -0.3, 1.2, 1.0, 0.2, 0.9]], dtype=F64)
    if reg == "kl":
        x[1, 0] = -INF if descending else INF  # the kl sort saturates: finite outputs
    ge, fd = _fd_eps(fn, x, 3.0)  # gaps above 1/eps: pooled blocks
    assert bool((ge != 0).all())
    torch.testing.assert_close(ge, fd, rtol=1e-6, atol=1e-12)


def test_eps_gradient_under_torch_func(backend):
    """grad and vmap in epsilon (the node's jvp and vmap rules carry it) equal autograd."""
    x = torch.tensor([[0.0, 0.4, 1.5, 1.7, 3.0], [INF, 0.1, -0.3, 1.2, 0.15]], dtype=F64)
    w = torch.randn(2, 5, dtype=F64).masked_fill(torch.isinf(x), 0)

    def loss(e: torch.Tensor) -> torch.Tensor:
        return (soft_rank(x, epsilon=e) * w).sum()

    e = torch.tensor([0.7, 1.3], dtype=F64, requires_grad=True)
    want = torch.autograd.grad(loss(e), e)[0]
    torch.testing.assert_close(torch.func.grad(loss)(e.detach()), want)
    torch.testing.assert_close(torch.func.jacfwd(loss)(e.detach()), want)
    batch = torch.stack([e.detach(), 2 * e.detach()])
    per = torch.func.vmap(torch.func.grad(loss))(batch)
    torch.testing.assert_close(per[0], want)


@pytest.mark.parametrize("reg", ["l2", "kl"])
@pytest.mark.parametrize("fn", [soft_rank, soft_sort])
def test_second_derivatives_in_epsilon(fn, reg, backend):
    """gradcheck and gradgradcheck in x and epsilon together, both orders (the derivative in
    epsilon is written in differentiable ops of the cotangent and of x / eps); the rank beside an
    infinity too."""
    from torch.autograd import gradcheck, gradgradcheck

    g = torch.Generator().manual_seed(4)
    x = torch.randperm(8, generator=g).to(F64).reshape(2, 4) / 2
    x = (x + 0.01 * torch.randn(2, 4, generator=g, dtype=F64)).requires_grad_()
    e = torch.tensor([0.4, 1.3], dtype=F64, requires_grad=True)
    for descending in (False, True):

        def f(x, e, descending=descending):
            return fn(x, epsilon=e, regularization=reg, descending=descending)

        assert gradcheck(f, (x, e)) and gradgradcheck(f, (x, e))
    if fn is soft_rank:
        xi = x.detach().clone()
        xi[0, 1] = INF
        assert gradcheck(lambda e: fn(xi, epsilon=e, regularization=reg), (e,))
        assert gradgradcheck(lambda e: fn(xi, epsilon=e, regularization=reg), (e,))


# ------------------------------------------------------------------ sorts of huge magnitude


@pytest.mark.parametrize("reg", ["l2", "kl"])
@pytest.mark.parametrize("eps", [TINY, 1.0, 1e300])
def test_sort_of_a_row_spanning_the_dtype(eps, reg, backend):
    """Rows spanning -1.7e308 .. 1.7e308 (their gaps overflow float64): finite, sorted, within
    the row's range; for L2 the mean is kept (to the rounding of |x| ~ 1e308)."""
    x = torch.tensor([[1.7e308, 0.0, -1.7e308], [1.7e308, -1.7e308, 1.0]], dtype=F64)
    for descending in (False, True):
        s = soft_sort(x, epsilon=eps, regularization=reg, descending=descending)
        assert bool(torch.isfinite(s).all()), s
        d = s.diff(dim=-1)
        assert bool((d <= 0).all() if descending else (d >= 0).all()), s
        assert bool((s <= 1.7e308).all() and (s >= -1.7e308).all())
        if reg == "l2":
            torch.testing.assert_close(s.mean(-1), x.mean(-1), rtol=0, atol=1e-15 * 1.7e308)
    # at epsilon 1: every gap of x is far above 1/epsilon, the relaxed end: mean +- 1/2, +- 1
    if reg == "l2" and eps == 1.0:
        got = soft_sort(x[:1], epsilon=eps)
        torch.testing.assert_close(
            got, torch.tensor([[-1.0, 0.0, 1.0]], dtype=F64), atol=1e293, rtol=0
        )


def test_quantile_beside_infinities_and_huge_values(backend):
    x = torch.tensor([[INF, 0.0, -1.7e308, 2.0]], dtype=F64)
    assert soft_quantile(x, 0.5, epsilon=TINY).tolist() == [INF]


# ----------------------------------------------------------------- the kernels agree, and the VJP


@pytest.mark.parametrize("kl", [False, True])
def test_backends_agree_on_infinite_and_huge_rows(kl):
    _require_kernel()
    rows_s = [
        [INF, INF, 0.5, 0.2, -INF, -INF],
        [INF, 1e18, 0.0, -1.0, -2.0, -INF],
        [3e300, 2e300, 1e300, 0.0, -1e300, -1.7e308],
        [6.0, 5.0, 4.0, 3.0, 2.0, 1.0],
        [6.0, 5.0, math.nan, 3.0, 2.0, 1.0],
    ]
    rows_w = [
        [6.0, 5.0, 4.0, 3.0, 2.0, 1.0],
        [6.0, 5.0, 4.0, 3.0, 2.0, 1.0],
        [1.7e308, 1e300, 0.0, -1.0, -1e300, -1.7e308],
        [INF, 1.0, 0.0, -1.0, -2.0, -1.7e308],
        [6.0, 5.0, 4.0, 3.0, 2.0, 1.0],
    ]
    s, w = torch.tensor(rows_s, dtype=F64), torch.tensor(rows_w, dtype=F64)
    if kl:
        w = torch.where(w > 0, w.log(), w)  # sorted still
    with kernel_backend("kernel"):
        a = project(s, w, kl)
    with kernel_backend("reference"):
        b = project(s, w, kl)
    assert a.finite is False and b.finite is False
    torch.testing.assert_close(a.p, b.p, rtol=1e-14, atol=0, equal_nan=True)
    assert torch.equal(a.block[:4], b.block[:4])
    assert bool(torch.isnan(a.p[4]).all())
    if not kl:
        assert a.p[0].tolist() == [5.5, 5.5, 3.65, 3.35, 1.5, 1.5]  # limits: block means of w
        assert a.p[1].tolist() == [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]  # exact beside them
        assert a.p[3].tolist() == [INF] * 6  # +inf in w pulls the row to it


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("fn", [soft_sort, soft_rank])
def test_fused_eps_gradient_equals_the_torch_form_at_extreme_scales(fn, dtype, monkeypatch):
    """The compiled VJP's epsilon term (``l2_vjp_host_scaled``) against the torch form, where
    z / eps is far from 1 (pooled blocks at x ~ 1e-30 and eps ~ 1e-30; singletons at 1e30)."""
    _require_kernel()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 30, generator=g, dtype=F64)
    cot = torch.randn(4, 30, generator=g, dtype=F64).to(dtype)
    for c in (1e-30, 1.0, 1e30):
        xs = (x * c).to(dtype)
        eps = torch.tensor([0.3, 1.0, 3.0, 1e-3], dtype=F64).mul(c).to(dtype)
        grads = []
        for use in BACKENDS:
            set_default_backend(use)
            e = eps.clone().requires_grad_()
            grads.append(torch.autograd.grad((fn(xs, epsilon=e) * cot).sum(), e)[0])
        tol = 1e-4 if dtype == F32 else 1e-10
        torch.testing.assert_close(
            grads[0], grads[1], rtol=tol, atol=tol * float(grads[1].abs().max())
        )


def test_the_kernel_layer_switches_the_backend_here_too():
    """The fixture's switch is the kernel layer's."""
    with kernel_backend("reference"):
        assert isotonic._host_ops() is None
        assert (
            isotonic.l2_vjp_host_scaled(
                torch.zeros(1, 2), None, None, torch.zeros(1, 2).long(), True, False, None, None, 0
            )
            is None
        )


SUBNORMAL = 5e-324  # float64's smallest subnormal


@pytest.mark.parametrize("eps", [2.2250738585072014e-308, 2.3e-308, 1e-307, 2.0**-1016])
def test_kd18_l2_sort_and_quantile_of_subnormal_rows_at_the_smallest_epsilon(eps, backend):
    """(KD18) Rows of subnormal float64 entries at an epsilon near the smallest normal number:
    rho / epsilon is near the largest float64, so the row is solved scaled by a power of two c
    (its gaps would overflow), and c w, subnormal, lost bits: the sort of [0, 0, 7.9e-322] at
    epsilon = finfo.tiny gave 6.3e-322. The output is now formed in the row's own frame (w_r for
    a singleton block). Every gap of x is far below 1 / epsilon here, so the value is that at
    epsilon = 1e-300 (solved unscaled), the hard sort, exactly."""
    g = torch.Generator().manual_seed(18)
    q = torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=F64)
    ops = (
        lambda v, e: soft_sort(v, epsilon=e),
        lambda v, e: soft_sort(v, epsilon=e, descending=True),
        lambda v, e: soft_quantile(v, q, epsilon=e),
    )
    for n in (2, 3, 5, 8):
        for _ in range(6):
            units = torch.randint(-400, 400, (3, n), generator=g, dtype=torch.int64)
            x = units.to(F64) * SUBNORMAL
            x[0, 0] = x[0, -1]  # a tie
            for fn in ops:
                assert torch.equal(fn(x, eps), fn(x, 1e-300)), (x, fn(x, eps), fn(x, 1e-300))
            assert torch.equal(soft_sort(x, epsilon=eps), x.sort(-1).values)


# ------------------------------------------- KD22: ranks whose z = x / eps is beyond the dtype


def _hard_ranks(x: torch.Tensor, descending: bool = False) -> torch.Tensor:
    """1-based ranks, ties at the mean of their positions (float64)."""
    xd = (-x if descending else x).double()
    below = (xd.unsqueeze(-1) > xd.unsqueeze(-2)).sum(-1).double()
    equal = (xd.unsqueeze(-1) == xd.unsqueeze(-2)).sum(-1).double()
    return below + (equal + 1) / 2


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("reg", ["l2", "kl"])
@pytest.mark.parametrize("descending", [False, True])
def test_kd22_ranks_beyond_the_dtype_are_the_hard_ranks(dtype, reg, descending, backend):
    """max |x| / eps beyond the dtype's largest value: z = x / eps overflowed and its entries
    tied at +-inf ([[-8, -4]] at epsilon finfo.tiny gave [[1.5, 1.5]]). Every gap is then far
    wider than n epsilons: the hard ranks, ties at their mean, for rows of several magnitudes and
    both signs; and a row of subnormal magnitude keeps its gaps."""
    fi = torch.finfo(dtype)
    tol = 0.0 if reg == "l2" else 4 * fi.eps
    g = torch.Generator().manual_seed(22)
    rows = [
        torch.tensor([-8.0, -4.0], dtype=F64),
        torch.randn(9, generator=g, dtype=F64),
        torch.tensor([3.0, -1.0, 3.0, 0.0, -0.0, -1.0, 2.5], dtype=F64),  # ties, signed zeros
    ]
    for row in rows:
        for scale in (1.0, 1e6, fi.max / 16):
            x = (row * scale).to(dtype)[None]
            for eps in (fi.tiny, fi.tiny * 2**20):
                if float(x.abs().max()) / eps < fi.max:
                    continue  # (this class: z beyond the dtype)
                r = soft_rank(x, epsilon=eps, regularization=reg, descending=descending)
                # (exactly for L2; KL's exp(log rho) rounds)
                torch.testing.assert_close(r.double(), _hard_ranks(x, descending), rtol=tol, atol=0)
    # and a subnormal row at the smallest epsilon: gaps of 2**-20 epsilons are soft, not lost
    x = torch.tensor([[0.0, 1.0, 2.0**-20, 64.0]], dtype=F64) * fi.tiny
    r = soft_rank(x.to(dtype), epsilon=fi.tiny, regularization=reg, descending=descending)
    want = soft_rank(x / fi.tiny, epsilon=1.0, regularization=reg, descending=descending)
    torch.testing.assert_close(r.double(), want, rtol=1e-6 if dtype == F32 else 1e-14, atol=0)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("reg", ["l2", "kl"])
def test_kd22_soft_ranks_among_entries_beyond_the_dtype(dtype, reg, backend):
    """Entries whose z is beyond the dtype beside entries a few epsilons apart: the far ones get
    their hard ranks, the near ones their soft ranks (PAV never pools across a gap wider than
    the span of rho), at every epsilon down to finfo.tiny: the same ranks as at epsilon 1 with
    the far entries a million epsilons away, where nothing overflows."""
    fi = torch.finfo(dtype)
    mid = torch.tensor([0.3, -0.2, 0.35, 1.4], dtype=F64)
    for eps in (fi.tiny, 1e-30, 1e-20):
        if eps < fi.tiny:
            continue
        big = 8.0 * eps * fi.max  # z = big / eps = 8 max: beyond the dtype
        if big > fi.max:
            big = fi.max / 2
        x = torch.tensor([big, -big, *(mid * eps).tolist(), -big / 2], dtype=F64)
        r = soft_rank(x.to(dtype)[None], epsilon=eps, regularization=reg)[0].double()
        assert float(x[0]) / eps > fi.max
        near = torch.tensor([1e6, -1e6, *mid.tolist(), -5e5], dtype=F64)
        want = soft_rank(near[None], epsilon=1.0, regularization=reg)[0]
        torch.testing.assert_close(r, want.double(), rtol=1e-5 if dtype == F32 else 1e-13, atol=0)


def test_kd22_backends_agree_beyond_the_dtype():
    """The kernel and the torch reference form z in the same frame: the same ranks, bit for
    bit, on rows beyond the dtype, with infinities, ties and gaps at the frame's bound."""
    _require_kernel()
    x = torch.tensor(
        [
            [1e300, 1e-300, 2e-300, 2.5e-300, -1e300, INF, 3e-300, -INF],
            [-8.0, -4.0, 0.0, 5e-309, 1e-308, 8e-308, 1e308, -1e308],
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        ],
        dtype=F64,
    )
    for reg in ("l2", "kl"):
        for desc in (False, True):
            for eps in (1e-300, 2.3e-308, 1e-10, 1.0, 3.0):
                out = {}
                for use in BACKENDS:
                    with kernel_backend(use):
                        out[use] = soft_rank(x, epsilon=eps, regularization=reg, descending=desc)
                assert torch.equal(out["kernel"], out["reference"]), (reg, desc, eps, out)
                assert bool((out["kernel"] >= 1).all() and (out["kernel"] <= 8).all())


@pytest.mark.parametrize("reg", ["l2", "kl"])
def test_kd22_gradients_beyond_the_dtype(reg, backend):
    """Derivatives where z is beyond float64: gradcheck of the rank in units of epsilon (x =
    a * S, eps = e * S, beside entries at 1e300, -1e300 and -5e299, so that |x| / eps is 1e440
    or more), and
    gradgradcheck where the second derivatives in the units of x (about 1 / S**2) are finite;
    the far entries are blocks of their own, the near ones get the derivatives of the same row
    with the far entries a million epsilons away; and the epsilon derivative against central
    differences at S = 1e-300."""
    far = torch.tensor([1e300, -1e300, -5e299], dtype=F64)
    a = torch.tensor([0.3, -0.2, 0.35, 1.4], dtype=F64, requires_grad=True)
    e = torch.tensor([0.7], dtype=F64, requires_grad=True)
    for S in (1e-300, 1e-140):

        def fn(a, e, S=S):
            x = torch.cat((far[:1], a * S, far[1:]))[None]
            return soft_rank(x, epsilon=e * S, regularization=reg)  # (-1e300 and -5e299 apart)

        assert torch.autograd.gradcheck(fn, (a, e))
        if S > 1e-150:  # (1 / S**2 within float64)
            assert torch.autograd.gradgradcheck(fn, (a, e))
        r = fn(a, e)[0]
        ga, ge = torch.autograd.grad(r[1:5].sum() + r[2], (a, e))
        near = torch.cat((torch.tensor([1e6]), a, torch.tensor([-1e6, -5e5])))
        r1 = soft_rank(near[None], epsilon=e, regularization=reg)[0]
        ga1, ge1 = torch.autograd.grad(r1[1:5].sum() + r1[2], (a, e))
        torch.testing.assert_close(r.detach(), r1.detach(), rtol=1e-13, atol=0)
        torch.testing.assert_close(ga, ga1, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ge, ge1, rtol=1e-10, atol=1e-12)
    S = 1e-300
    x = torch.cat((far[:1], a.detach() * S, far[1:]))[None]
    fn2 = lambda x, e: soft_rank(x, epsilon=e, regularization=reg)  # noqa: E731
    gex, fd = _fd_eps(fn2, x, 0.7 * S)
    assert bool((gex != 0).all())
    torch.testing.assert_close(gex, fd, rtol=1e-6, atol=0)


# ----------------------------- KD24: sorts whose rho / eps is beyond the dtype (no cap on 1 / eps)


def _sort_rows(fi: torch.finfo) -> list[torch.Tensor]:
    """Rows for the sort at a tiny epsilon: the reproducer's tiny entries beside one near
    max / (4 n), random rows, ties and signed zeros, all in float64."""
    g = torch.Generator().manual_seed(24)
    return [
        torch.tensor([5e-39, 2e-39, -3e37], dtype=F64) * (fi.tiny / torch.finfo(F32).tiny),
        torch.randn(9, generator=g, dtype=F64),
        torch.tensor([3.0, -1.0, 3.0, 0.0, -0.0, -1.0, 2.5], dtype=F64),
        torch.tensor([1.0, -1.0, 2.0**-30, -(2.0**-40), 0.5], dtype=F64),
    ]


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("reg", ["l2", "kl"])
@pytest.mark.parametrize("descending", [False, True])
def test_kd24_sorts_at_a_tiny_epsilon_are_the_hard_sorts(dtype, reg, descending, backend):
    """rho / eps beyond the dtype's largest value, every gap of x below 1 / eps: the hard sort,
    bit for bit, also where a gap of x reaches max / (4 n), the cap that 1 / eps had
    (soft_sort([[5e-39, 2e-39, -3e37]], epsilon=finfo(float32).tiny) was [[-2.92e37, -8.2e35,
    5e-39]]); and soft_quantile "pav" at those rows is the hard quantile of the sorted row."""
    fi = torch.finfo(dtype)
    for row in _sort_rows(fi):
        n = row.shape[-1]  # (rows spanning up to +-max: KD25, below)
        for scale in (1.0, 2.0**20, 2.0**-10 / fi.tiny, fi.max / (8 * n)):
            x = (row * scale / row.abs().max()).to(dtype)[None]
            span = float(x.double().max() - x.double().min())
            for eps in (fi.tiny, fi.tiny * 2**10):
                if not span * (1 + 1e-3) < 1 / eps:
                    continue  # (this class: the sort is hard)
                s = soft_sort(x, epsilon=eps, regularization=reg, descending=descending)
                want = x.sort(-1, descending=descending).values
                assert torch.equal(s, want), (row, scale, eps, s, want)
                if not descending and reg == "l2":  # (the quantile reads the l2 sort)
                    q = soft_quantile(x, 0.5, epsilon=eps)
                    hard = torch.quantile(x.double(), 0.5, dim=-1)
                    torch.testing.assert_close(q.double(), hard, rtol=2 * fi.eps, atol=0)


def test_kd24_the_reproducer_in_float32_is_the_float64_sort(backend):
    tiny = torch.finfo(F32).tiny
    x = torch.tensor([[5e-39, 2e-39, -3e37]])
    for reg in ("l2", "kl"):
        out = soft_sort(x, epsilon=tiny, regularization=reg)
        assert torch.equal(out, x.sort(-1).values), out
        want = soft_sort(x.double(), epsilon=tiny, regularization=reg).float()
        assert torch.equal(out, want)


@pytest.mark.parametrize("reg", ["l2", "kl"])
def test_kd24_soft_sorts_where_gaps_of_x_reach_one_over_eps(reg, backend):
    """float32 rows whose gaps straddle 1 / eps at eps = finfo(float32).tiny (1 / eps = 8.5e37,
    beyond the old cap max / (4 n)): soft there, the float64 sort of the same x and eps (which
    nothing bounds); for L2 also the scaling law P(rho / eps, x) = P(rho c / eps, c x) / c at
    c = 2**-120, where every number is ordinary."""
    tiny = torch.finfo(F32).tiny
    x = torch.tensor(
        [[3e37, -3e37, 1e38, 2e-39], [2.5e38, -2.5e38, 0.0, 1e37], [8e37, 0.0, -9e37, 4e37]]
    )
    s = soft_sort(x, epsilon=tiny, regularization=reg)
    assert not torch.equal(s, x.sort(-1).values)  # (soft: some gaps of x exceed 1 / eps)
    want = soft_sort(x.double(), epsilon=tiny, regularization=reg)
    torch.testing.assert_close(s.double(), want, rtol=1e-6, atol=0)
    if reg == "l2":
        c = 2.0**-120
        law = soft_sort(x.double() * c, epsilon=tiny / c, regularization=reg) / c
        torch.testing.assert_close(s.double(), law, rtol=1e-6, atol=0)
        torch.testing.assert_close(s.double().sum(-1), x.double().sum(-1), rtol=1e-6, atol=0)


def test_kd24_backends_agree_on_sorts_at_a_tiny_epsilon():
    """The kernel and the torch reference form the sort's z in the same frame: the same sorts
    and quantiles, bit for bit, at and around the frame's bound, with infinities and ties."""
    _require_kernel()
    x = torch.tensor(
        [
            [5e-39, 2e-39, -3e37, 1e38, -1e38, 0.0, 2e-39, 3e38],
            [3e38, -3e38, 0.0, 1.0, -1.0, 2.0, 8e37, -8e37],
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
            [INF, 1e38, 0.0, -1e38, 2e-39, -INF, 5.0, 5.0],
        ]
    )
    for dtype in (F32, F64):
        tiny = torch.finfo(dtype).tiny
        for reg in ("l2", "kl"):
            for desc in (False, True):
                for eps in (tiny, 1.2e-38, 1e-37, 1e-30, 1.0):
                    if eps < tiny:
                        continue
                    out = {}
                    for use in BACKENDS:
                        with kernel_backend(use):
                            xs = x.to(dtype)
                            out[use] = (
                                soft_sort(xs, epsilon=eps, regularization=reg, descending=desc),
                                soft_quantile(xs, torch.tensor([0.1, 0.5]), epsilon=eps),
                            )
                    for a, b in zip(out["kernel"], out["reference"], strict=True):
                        assert torch.equal(a.nan_to_num(), b.nan_to_num()), (dtype, reg, desc, eps)


@pytest.mark.parametrize("reg", ["l2", "kl"])
def test_kd24_gradients_at_huge_x_over_eps(reg, backend):
    """Derivatives of the sort where |x| / eps is huge: float64 at x = a S, eps = e / S (S =
    2**300, |x| / eps ~ 1e180; rows soft), gradcheck and gradgradcheck in the units of x, the
    L2 scaling law, and the epsilon derivative against central differences; float32 rows whose
    gaps straddle 1 / eps at eps = finfo(float32).tiny (rho / eps beyond float32, the old cap
    max / (4 n) below some gaps), x-gradients equal to float64's; and a float64 hard sort at
    eps = finfo.tiny, the identity through the sort in x and 0 in epsilon, second order too."""
    S = 2.0**300
    a = torch.tensor([0.3, -0.2, 1.35, 1.4, -2.0], dtype=F64, requires_grad=True)
    e = torch.tensor([0.7], dtype=F64, requires_grad=True)

    def fn(a, e):
        return soft_sort(a[None] * S, epsilon=e / S, regularization=reg) / S

    assert torch.autograd.gradcheck(fn, (a, e))
    assert torch.autograd.gradgradcheck(fn, (a, e))
    if reg == "l2":
        torch.testing.assert_close(fn(a, e), soft_sort(a[None], epsilon=e), rtol=1e-13, atol=0)
    x = (a.detach() * S)[None]
    fn2 = lambda x, e: soft_sort(x, epsilon=e, regularization=reg)  # noqa: E731
    gex, fd = _fd_eps(fn2, x, 0.7 / S)
    assert bool((gex != 0).all())
    torch.testing.assert_close(gex, fd, rtol=1e-6, atol=0)
    # float32 at its smallest epsilon: the x-gradients of float64 on the same x and epsilon
    tiny = torch.finfo(F32).tiny
    x32 = torch.tensor([[3e37, -3e37, 1e38, 2e-39], [8e37, 0.0, -9e37, 4e37]], requires_grad=True)
    x64 = x32.detach().double().requires_grad_()
    w = torch.randn(2, 4, generator=torch.Generator().manual_seed(3), dtype=F64)
    (g32,) = torch.autograd.grad((soft_sort(x32, epsilon=tiny, regularization=reg) * w).sum(), x32)
    (g64,) = torch.autograd.grad((soft_sort(x64, epsilon=tiny, regularization=reg) * w).sum(), x64)
    torch.testing.assert_close(g32.double(), g64, rtol=1e-5, atol=1e-6)
    # float64, hard at its smallest epsilon
    xh = torch.tensor([[3.0, -1.0, 2.5, 7.0]], dtype=F64, requires_grad=True)
    eh = torch.tensor([TINY * 4], dtype=F64, requires_grad=True)
    out = soft_sort(xh, epsilon=eh, regularization=reg)
    gx, ge = torch.autograd.grad((out * w[:1]).sum(), (xh, eh), create_graph=True)
    assert torch.equal(gx, w[:1].gather(1, xh.argsort(-1).argsort(-1)))
    assert float(ge.detach()) == 0.0
    assert torch.autograd.gradgradcheck(
        lambda x: soft_sort(x, epsilon=TINY * 4, regularization=reg), (xh,)
    )


# ------------------ KD25: rows spanning up to +-max at a tiny epsilon (the projection on gaps)


def _spanning_rows(fi: torch.finfo) -> list[torch.Tensor]:
    """Rows whose span reaches up to 2 max (float64's span overflows) with every gap of x below
    1 / eps at eps = finfo.tiny (so the sort is hard there, and the ranks are at any epsilon
    below the smallest gap): the reproducer's ends beside small entries, evenly spread rows
    from -max to max, and a shuffled one with ties and signed zeros near 0."""
    g = torch.Generator().manual_seed(25)
    even = torch.linspace(-1.0, 1.0, 11, dtype=F64) * fi.max
    mixed = torch.cat((even * 0.99, torch.tensor([0.0, -0.0, 1.0, 1.0, -2.5], dtype=F64)))
    return [
        torch.tensor([1e307, -1e307, 0.0, 1.0, 2.0, 3.0], dtype=F64) * (fi.max / 1.7e308),
        even,
        even[torch.randperm(11, generator=g)],
        mixed[torch.randperm(mixed.shape[0], generator=g)],
    ]


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("reg", ["l2", "kl"])
@pytest.mark.parametrize("descending", [False, True])
def test_kd25_rows_spanning_the_dtype_at_a_tiny_epsilon_are_hard(dtype, reg, descending, backend):
    """Rows spanning up to +-max at epsilon = finfo.tiny, every gap of x below 1 / eps: the hard
    sort (bit for bit), the hard ranks (ties at their mean) and the hard quantiles. Before, the
    frame set n runs of z = rho / eps G = 2 span + 2 n apart, which double cannot hold beyond a
    span of about max / (8 n), and capped 1 / eps at max / (4 n) there instead:
    soft_sort([[1e307, -1e307, 0, 1, 2, 3]], epsilon=finfo(float64).tiny) gave [[-8.7e306,
    -1.3e306, 1, 2, 1.3e306, 8.7e306]]. The projection now runs on the gaps of z, and no block
    spans more than the span of x. Gradients: finite, the identity through the sort, 0 for the
    ranks and 0 in epsilon."""
    fi = torch.finfo(dtype)
    eps = fi.tiny
    tol = 0.0 if reg == "l2" else 4 * fi.eps
    for row in _spanning_rows(fi):
        x = row.to(dtype)[None]
        xd = x.double()
        gaps = xd.sort(-1).values.diff(dim=-1)
        assert float(gaps.max()) < 1 / eps  # (this class: the sort is hard)
        s = soft_sort(x, epsilon=eps, regularization=reg, descending=descending)
        assert torch.equal(s, x.sort(-1, descending=descending).values), (row, s)
        r = soft_rank(x, epsilon=eps, regularization=reg, descending=descending)
        torch.testing.assert_close(r.double(), _hard_ranks(x, descending), rtol=tol, atol=0)
        if not descending and reg == "l2":  # (the quantile reads the l2 sort)
            qs = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=dtype)
            q = soft_quantile(x, qs, epsilon=eps)
            hard = torch.quantile(xd, qs.double(), dim=-1)
            torch.testing.assert_close(q.double(), hard, rtol=2 * fi.eps, atol=0)
        # derivatives, on rows without ties (where the hard sort's permutation is unique)
        if bool((gaps > 0).all()):
            xg = x.clone().requires_grad_()
            e = torch.tensor([eps], dtype=dtype, requires_grad=True)
            w = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
            out = soft_sort(xg, epsilon=e, regularization=reg, descending=descending)
            gx, ge = torch.autograd.grad((out * w).sum(), (xg, e))
            perm = x.argsort(-1, descending=descending)
            assert torch.equal(gx, w.gather(1, perm.argsort(-1))), gx
            assert float(ge) == 0.0
            out = soft_rank(xg, epsilon=e, regularization=reg, descending=descending)
            gx, ge = torch.autograd.grad((out * w).sum(), (xg, e))
            assert bool((gx == 0).all()) and float(ge) == 0.0, (gx, ge)


@pytest.mark.parametrize("reg", ["l2", "kl"])
def test_kd25_soft_sorts_of_rows_spanning_float64(reg, backend):
    """float64 rows spanning up to +-max whose gaps straddle 1 / eps (eps = finfo.tiny, and
    above): soft, monotone, finite with finite gradients in x (not NaN in eps); for L2 the
    scaling law
    P(rho / eps, x) = P(rho c / eps, c x) / c at c = 2**-600, where every number is ordinary,
    and the row's mean kept."""
    fi = torch.finfo(F64)
    x = torch.tensor(
        [
            [1e308, -1e308, 0.0, 1.0, 5e307, -6e307],
            [fi.max, -fi.max, 0.0, 1e307, -2e307, 3.0],
            [1.5e308, 1.0e308, 0.9e308, -1.7e308, 2.0, -1e307],
        ],
        dtype=F64,
    )
    c = 2.0**-600
    for eps in (fi.tiny, fi.tiny * 2**10, 1e-300):
        xg = x.clone().requires_grad_()
        e = torch.full((3,), eps, dtype=F64, requires_grad=True)
        s = soft_sort(xg, epsilon=e, regularization=reg)
        assert bool(torch.isfinite(s).all()), s
        assert bool((s.diff(dim=-1) >= 0).all()), s
        gx, ge = torch.autograd.grad((s * torch.linspace(-1, 1, 6, dtype=F64)).sum(), (xg, e))
        # (the derivative in eps, about span / eps, is itself beyond double here: +-inf)
        assert bool(torch.isfinite(gx).all() and not torch.isnan(ge).any()), (gx, ge)
        if reg == "l2":
            law = soft_sort(x * c, epsilon=eps / c) / c
            torch.testing.assert_close(s.detach(), law, rtol=1e-12, atol=0)
            mean = (s.detach() / 8).sum(-1)  # (the sum of x itself overflows)
            torch.testing.assert_close(mean, (x / 8).sum(-1), rtol=0, atol=1e-14 * fi.max)
    assert not torch.equal(soft_sort(x, epsilon=fi.tiny), x.sort(-1).values)  # (soft)


def test_kd25_backends_agree_on_rows_spanning_float64():
    """The kernel and the torch reference run the same PAV on the same gaps: the same sorts,
    ranks and quantiles, bit for bit, on rows spanning up to +-max, with infinities and ties."""
    _require_kernel()
    fi = torch.finfo(F64)
    x = torch.tensor(
        [
            [1e307, -1e307, 0.0, 1.0, 2.0, 3.0, 3.0, -0.0],
            [fi.max, -fi.max, 0.0, 1e307, -2e307, 3.0, 8e307, -8e307],
            [INF, 1e308, 0.0, -1e308, 2e-300, -INF, 5.0, 5.0],
            [1.5e308, 1.0e308, 0.9e308, -1.7e308, 2.0, -1e307, 1e-310, 0.0],
        ],
        dtype=F64,
    )
    for reg in ("l2", "kl"):
        for desc in (False, True):
            for eps in (fi.tiny, 1e-307, 1e-300, 1.0, 1e300):
                out = {}
                for use in BACKENDS:
                    with kernel_backend(use):
                        out[use] = (
                            soft_sort(x, epsilon=eps, regularization=reg, descending=desc),
                            soft_rank(x, epsilon=eps, regularization=reg, descending=desc),
                            soft_quantile(x, torch.tensor([0.1, 0.5], dtype=F64), epsilon=eps),
                        )
                for a, b in zip(out["kernel"], out["reference"], strict=True):
                    assert torch.equal(a.nan_to_num(), b.nan_to_num()), (reg, desc, eps, a, b)
