"""The C++ kernel of method "ot" (softops/topk/_ot_kernel.cpp) against the torch code it stands
in for on the CPU: the solve, the rows it leaves to that code, its one-pass backward, and the
operators that carry both.

The kernel is built ahead of time (``python -m softops._kernels``, run by scripts/setup.sh). Where
it is not built these tests skip, unless ``SOFTOPS_REQUIRE_KERNELS=1`` (CI sets it), where they
fail."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import softops
from softops._kernels import backend
from softops.topk import _ot
from tests._adversarial_strategies import batches, row_values, typical_gap
from tests._helpers import built_ops, seeded
from tests.topk._row_kernels import assert_merged_solve, assert_transforms_agree, flagged_rows

F64 = torch.float64


@pytest.fixture
def ops():
    """The kernel's operators (``torch.ops.softops_ot``)."""
    return built_ops(_ot.KERNEL)


def _solve_kernel(ops, x, k, eps, max_iter, tol, k_scalar):
    """The CPU solve as the operator runs it: the row kernel, then the torch code's merge."""
    out = ops.threshold_rows(x, k, eps, float(tol), _ot._scaling_limit(x.dtype), max_iter)
    return _ot._solve_kernel(out, x, k, eps, max_iter, tol, k_scalar)


def _rows(b: int, n: int, dtype: torch.dtype, seed: int, layout: str = "normal") -> torch.Tensor:
    x = torch.randn(b, n, generator=seeded(seed), dtype=F64)
    if layout == "ties":
        x = (x * 2).round() / 2
    elif layout == "ascending":
        x = x.sort(-1).values
    elif layout == "descending":
        x = x.sort(-1, descending=True).values
    return x.to(dtype)


def _kernel_solve(ops, x: torch.Tensor, k: float, eps: float) -> tuple:
    b = x.shape[0]
    kt = torch.full((b,), k, dtype=x.dtype)
    et = torch.full((b,), eps, dtype=x.dtype)
    got = _solve_kernel(ops, x, kt, et, 100, 0.0, k)
    want = _ot._solve(x, kt, et, 100, 0.0, k)
    return got, want


# n: rows solved a vector of rows at a time (n <= 128: one vector or less, more), rows solved a
# row at a time with a tail after the vectors, longer than the candidate buffer and than the
# torch code's exact bracket (which subsamples beyond EXACT_MAX_N); k: the order statistics from
# the largest (k <= 64), the smallest (n - k < 64) and nth_element (or the sorting network)
CASES = [
    (b, n, k)
    for b, n in ((3, 7), (8, 100), (4, 300), (2, 1003), (1, 20_000))
    for k in (1.0, 3.0, 3.5, 0.5 * n, n - 3.0, n - 0.25)
    if k < n
]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("layout", ["normal", "ties", "ascending", "descending"])
@pytest.mark.parametrize("eps", [1e-2, 0.3, 10.0])
@pytest.mark.parametrize(("b", "n", "k"), CASES)
def test_the_kernel_solves_as_the_torch_code(ops, dtype, layout, eps, b, n, k):
    x = _rows(b, n, dtype, seed=n + b, layout=layout)
    got, want = _kernel_solve(ops, x, k, eps)
    # the same arithmetic in the rows' dtype, the sums in double: roots within the tolerance
    # of each other, so masks within a few ulps and the backward's weights within the change
    # of s over that difference of t
    tol = 1e-12 if dtype == F64 else 2e-6
    if n > _ot.EXACT_MAX_N:  # the torch code brackets a subsample there: another iterate path
        tol *= 2
    torch.testing.assert_close(got[1], want[1], atol=tol, rtol=0)
    torch.testing.assert_close(got[2], want[2], atol=tol * 20 / eps, rtol=50 * tol)
    torch.testing.assert_close(got[3][:, 2], want[3][:, 2], atol=0, rtol=50 * tol)
    assert got[0].converged.all()
    sums = got[1].double().sum(-1)
    assert (sums - k).abs().max() <= (want[1].double().sum(-1) - k).abs().max() + n * tol
    assert got[0].iterations <= (8 if n <= _ot.EXACT_MAX_N else 24)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_long_rows_are_evaluated_in_chunks_alike_on_any_count_of_threads(ops, dtype):
    # A row of more than 2 * 2**15 entries is evaluated in chunks whose sums are added in order,
    # spread over the threads where the row is alone (B = 1) and in turn in a task of the rows'
    # parallel_for (B = 2): the torch code's roots and masks, the same bits on one thread and on
    # two, and the same row alone or beside another; a row near the hard limit (epsilon far
    # below the gaps) is polished and written anew through the same chunks
    n = 300_001  # (a partial last chunk and a partial last vector)
    x = _rows(2, n, dtype, seed=21)
    tol = 2e-12 if dtype == F64 else 4e-6
    for k, eps in ((10.0, 1.0), (0.5 * n, 0.3), (7.0, 1e-9)):
        got, want = _kernel_solve(ops, x, k, eps)
        torch.testing.assert_close(got[1], want[1], atol=tol, rtol=0)
        torch.testing.assert_close(got[3][:, 2], want[3][:, 2], atol=0, rtol=1e3 * tol)
        assert got[0].converged.all()
        kt, et = torch.full((2,), k, dtype=dtype), torch.full((2,), eps, dtype=dtype)
        limit = _ot._scaling_limit(dtype)
        outs = []
        threads = torch.get_num_threads()
        try:
            for count, rows in ((1, 1), (2, 1), (2, 2)):
                torch.set_num_threads(count)
                outs.append(ops.threshold_rows(x[:rows], kt[:rows], et[:rows], 0.0, limit, 100))
        finally:
            torch.set_num_threads(threads)
        for out in outs[1:]:
            for a, b in zip(outs[0][:3], out[:3], strict=True):
                assert torch.equal(a, b[:1])
    # the gradients in x, k and epsilon through the operator, from s and the sums of the chunks,
    # are the torch code's
    g = torch.randn(2, n, generator=seeded(22), dtype=dtype)
    results = []
    for name in ("kernel", "reference"):
        with backend(name):
            xt = x.clone().requires_grad_()
            kt = torch.tensor([10.0, 0.5 * n], dtype=dtype, requires_grad=True)
            et = torch.tensor([1.0, 0.3], dtype=dtype, requires_grad=True)
            A = softops.soft_topk_mask(xt, kt, epsilon=et)
            results.append(torch.autograd.grad(A, [xt, kt, et], g))
    for a, w in zip(*results, strict=True):
        scale = max(float(w.abs().max()), 1.0)
        torch.testing.assert_close(a, w, atol=10 * tol * scale, rtol=10 * tol)


def test_the_kernel_takes_its_exponentials_from_the_rows(ops):
    # A threshold far from the centre (|t| / eps beyond the factored range, the large-epsilon
    # start) and entries far below it (E subnormal) take the direct exp: the masks still agree.
    x = _rows(4, 300, torch.float32, seed=4)
    x[0] *= 40  # |x - m| / eps up to ~1e3: E subnormal or 0 on most of the row
    x[1, :150] += 30  # the centre m is far from the large-epsilon start
    for eps in (0.05, 2.0, 40.0):
        got, want = _kernel_solve(ops, x, 150.0, eps)
        torch.testing.assert_close(got[1], want[1], atol=2e-6, rtol=0)


def test_rows_the_kernel_leaves_are_solved_by_the_torch_code(ops):
    x, k, eps = flagged_rows()
    limit = _ot._scaling_limit(F64)
    *_, scale, status, evaluations, left, at_limit = ops.threshold_rows(x, k, eps, 0.0, limit, 100)
    # (the near-hard row, 5, is polished by the kernel itself: see the test of such rows; rows 3
    # and 6 are at their limits k = n_fin and k = 0, filled: 4 and 2)
    assert status.tolist() == [0, 1, 1, 4, 1, 0, 2] and left == 3 and at_limit == 2
    assert (scale == 1).all() and 1 <= evaluations <= 8
    got = _solve_kernel(ops, x, k, eps, 100, 0.0, None)
    assert_merged_solve(got, _ot._solve(x, k, eps, 100, 0.0, None))
    # and through the operator, whatever the back end
    for name in ("kernel", "reference"):
        with backend(name):
            A = softops.soft_topk_mask(x, k, epsilon=eps)
        torch.testing.assert_close(A, got[1], equal_nan=True, atol=1e-14, rtol=0)


@pytest.mark.parametrize("name", ["kernel", "reference"])
def test_a_capped_row_warns_once_on_either_back_end(ops, name):
    x = _rows(64, 1000, torch.float32, seed=2)
    with backend(name), pytest.warns(softops.ConvergenceWarning, match="max_iter=1"):
        softops.soft_topk_mask(x, 5, epsilon=0.3, max_iter=1)
    with backend(name), warnings.catch_warnings():
        warnings.simplefilter("error")
        softops.soft_topk_mask(x, 5, epsilon=0.3)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_gradients_are_the_same_with_and_without_the_kernel(ops, dtype):
    x = _rows(40, 1000, dtype, seed=3)
    x[7] *= 30  # near one-hot entries
    x[9] = (x[9] * 2).round()  # ties
    g = torch.randn(40, 1000, generator=seeded(4), dtype=dtype)
    k = torch.linspace(1.0, 999.0, 40, dtype=dtype)
    eps = torch.logspace(-2, 1, 40, dtype=dtype)
    results = []
    for name in ("kernel", "reference"):
        with backend(name):
            xt = x.clone().requires_grad_()
            kt, et = k.clone().requires_grad_(), eps.clone().requires_grad_()
            A = softops.soft_topk_mask(xt, kt, epsilon=et)
            (gx_only,) = torch.autograd.grad(softops.soft_topk_mask(xt, 10, epsilon=0.1), xt, g)
            loss = softops.soft_topk_mask(xt, 10, epsilon=0.1).sum()  # the expanded gradient
            (g_sum,) = torch.autograd.grad(loss, xt)
            results.append((A.detach(), *torch.autograd.grad(A, [xt, kt, et], g), gx_only, g_sum))
    tol = 1e-11 if dtype == F64 else 3e-5
    for a, w in zip(*results, strict=True):
        scale = max(float(w.abs().max()), 1.0)
        torch.testing.assert_close(a, w, atol=tol * scale, rtol=tol)


def test_double_backward_and_forward_mode_with_the_kernel(ops):
    x = _rows(33, 1000, F64, seed=6).requires_grad_()
    v = torch.randn(33, 1000, generator=seeded(7), dtype=F64)

    def f(z):
        return softops.soft_topk_mask(z, 12, epsilon=0.2)

    (gx,) = torch.autograd.grad((f(x) ** 2).sum(), x, create_graph=True)
    (hv,) = torch.autograd.grad(gx, x, v)
    with torch.no_grad():  # the Hessian-vector product by central differences of the gradient
        h = 1e-5

        def grad_at(z):
            zt = z.clone().requires_grad_()
            with torch.enable_grad():
                return torch.autograd.grad((f(zt) ** 2).sum(), zt)[0]

        fd = (grad_at(x + h * v) - grad_at(x - h * v)) / (2 * h)
    torch.testing.assert_close(hv, fd, atol=1e-6 * float(fd.abs().max()), rtol=1e-5)
    _, jv = torch.func.jvp(f, (x.detach(),), (v,))
    with torch.no_grad():
        fd = (f(x + 1e-6 * v) - f(x - 1e-6 * v)) / 2e-6
    torch.testing.assert_close(jv, fd, atol=1e-7, rtol=1e-6)


def test_the_backward_in_x_is_one_pass_of_the_formula(ops):
    s = torch.rand(5, 300, generator=seeded(1), dtype=F64)
    den = s.sum(-1, keepdim=True)
    den[1] = math.inf  # every s of the row 0: the mean is 0
    den[2] = math.nan  # a row that cannot be solved
    g = torch.randn(5, 300, generator=seeded(2), dtype=F64)

    def formula(gg):
        return (gg - torch.linalg.vecdot(s, gg).unsqueeze(-1) / den) * s

    for gg in (g, g.t().contiguous().t(), g[:, :1].expand(5, 300)):
        torch.testing.assert_close(ops.vjp_rows(s, den, gg), formula(gg), equal_nan=True)
    assert torch.isnan(ops.vjp_rows(s, den, g)[2]).all()
    torch.testing.assert_close(ops.vjp_rows(s, den.squeeze(-1), g), formula(g), equal_nan=True)
    aux = torch.cat((torch.randn(5, 2, dtype=F64), den), -1)  # the forward's: den is its last
    torch.testing.assert_close(ops.vjp_rows(s, aux, g), formula(g), equal_nan=True)
    with pytest.raises(RuntimeError, match="vjp_rows: s must be contiguous"):
        ops.vjp_rows(s, den, g.float())
    # the operator: the kernel on the CPU, the formula as its reference, the same values
    aux3 = torch.cat((torch.randn(5, 2, dtype=F64), den), -1)
    for name in ("kernel", "reference"):
        with backend(name):
            torch.testing.assert_close(_ot.VJP_OP(s, aux3, g), formula(g), equal_nan=True)


def test_the_kernel_refuses_malformed_arguments(ops):
    x = torch.zeros(3, 10)
    with pytest.raises(RuntimeError, match="k and eps must be"):
        ops.threshold_rows(x, torch.zeros(2), torch.ones(3), 0.0, 1e30, 10)
    with pytest.raises(RuntimeError, match="must have x's dtype"):
        ops.threshold_rows(x, torch.zeros(3, dtype=F64), torch.ones(3), 0.0, 1e30, 10)
    A, s, aux, residual, *_, evaluations, left, at_limit = ops.threshold_rows(
        torch.zeros(0, 10), torch.zeros(0), torch.ones(0), 0.0, 1e30, 10
    )
    assert A.shape == s.shape == (0, 10) and aux.shape == (0, 3) and residual.shape == (0,)
    assert evaluations == left == at_limit == 0
    # rows of no entry are left to the torch code
    *_, status, evaluations, left, at_limit = ops.threshold_rows(
        torch.zeros(2, 0), torch.zeros(2), torch.ones(2), 0.0, 1e30, 10
    )
    assert status.tolist() == [1, 1] and (evaluations, left, at_limit) == (0, 2, 0)


def test_vmap_and_grad_transforms_agree_with_the_plain_call(ops):
    x = _rows(40, 1000, F64, seed=5)
    assert_transforms_agree(x)


def _assert_drawn_rows_solve_as_the_torch_code(ops, data, x: torch.Tensor) -> None:
    """Draw a k anywhere in [0, n] and an epsilon from 1e-8 to 1e8 of the typical gap per row of
    ``x``; the kernel's merged solve equals the torch code's (NaN in NaN rows only)."""
    b, n = x.shape
    dtype = x.dtype
    k = torch.tensor(
        [data.draw(st.floats(0.0, float(n), allow_nan=False)) for _ in range(b)], dtype=dtype
    )
    gap = typical_gap(x)
    eps = (
        torch.tensor([10.0 ** data.draw(st.floats(-8.0, 8.0)) * gap for _ in range(b)], dtype=F64)
        .clamp(torch.finfo(dtype).tiny, torch.finfo(dtype).max)
        .to(dtype)
    )
    got = _solve_kernel(ops, x, k, eps, 100, 0.0, None)
    want = _ot._solve(x, k, eps, 100, 0.0, None)
    torch.testing.assert_close(got[1], want[1], equal_nan=True, atol=1e-5, rtol=0)
    assert torch.equal(got[1].isnan().any(-1), x.isnan().any(-1) | want[1].isnan().any(-1))
    assert torch.equal(got[0].converged, want[0].converged)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@settings(
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_adversarial_rows_solve_as_the_torch_code(ops, dtype, data):
    # ties, +-1e30, denormals, the dtype's extremes, +-inf and NaN, gaps over 600 decades, k
    # anywhere in [0, n] and epsilon from 1e-8 to 1e8 of the typical gap: the kernel solves what
    # it can as the torch code does and leaves it the rest (merged: the same masks, NaN in NaN
    # rows only)
    x = data.draw(batches(dtype, n_min=1, n_max=40))
    _assert_drawn_rows_solve_as_the_torch_code(ops, data, x)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n", [8, 40, 200])  # vectors of rows (two ways), a row at a time
def test_rows_near_the_hard_limit_are_polished_by_the_kernel(ops, dtype, n):
    # Far below the gaps every u is small: F's tolerance leaves t loose in its gap, where the
    # gradients in k and epsilon still depend on it, so t is polished in the log domain. The
    # kernel polishes such rows itself (none left to the torch code) to the torch code's t, mask
    # and gradients; down to the hard limit, where every |z| overflows.
    b = 37
    x = _rows(b, n, dtype, seed=11)
    k = (torch.arange(b) % (n - 1) + 1).to(dtype)
    eps = torch.logspace(-4, -30, b, dtype=F64).to(dtype)
    limit = _ot._scaling_limit(dtype)
    *_, status, _, left, _ = ops.threshold_rows(x, k, eps, 0.0, limit, 100)
    assert left == 0 and not status.any()
    got = _solve_kernel(ops, x, k, eps, 100, 0.0, None)
    want = _ot._solve(x, k, eps, 100, 0.0, None)
    den = want[3][:, 2]
    assert _ot.near_hard(torch.where(den < math.inf, den * eps, 0), dtype).all()
    assert got[0].converged.all() and got[4]
    tol = 1e-14 if dtype == F64 else 1e-6
    torch.testing.assert_close(got[0].t, want[0].t, atol=tol, rtol=0)
    torch.testing.assert_close(got[0].m, want[0].m, atol=0, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=tol, rtol=0)
    torch.testing.assert_close(got[3][:, 2], den, atol=0, rtol=1e3 * tol)
    torch.testing.assert_close(got[0].residual, want[0].residual, atol=tol, rtol=0)
    g = torch.randn(b, n, generator=seeded(12), dtype=dtype)
    results = []
    for name in ("kernel", "reference"):
        with backend(name):
            xt, kt, et = (v.clone().requires_grad_() for v in (x, k, eps))
            A = softops.soft_topk_mask(xt, kt, epsilon=et)
            results.append((A.detach(), *torch.autograd.grad(A, [xt, kt, et], g)))
    for a, w in zip(*results, strict=True):
        scale = max(float(w.abs().max()), 1.0)
        torch.testing.assert_close(a, w, atol=tol * scale, rtol=1e3 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 15, 16, 17, 31, 32, 64, 100, 128, 129])
def test_short_rows_are_solved_a_vector_of_rows_at_a_time(ops, dtype, n):
    # Rows of up to 128 entries are solved one row per vector lane: rows of their own k and
    # epsilon (the order statistics by insertion from either end, or by sorting), the last group
    # partial (37 rows), and special rows among the lanes, which are left to the torch code
    # (merged: its values), as are capped rows, or filled at their limit (k = 0 or n); n = 129, a
    # row at a time, for comparison.
    b = 37
    x = _rows(b, n, dtype, seed=n)
    gen = seeded(n + 100)
    k = torch.rand(b, generator=gen, dtype=F64) * n
    k[::2] = k[::2].ceil()
    k = k.clamp(min(0.5, n / 4), n - min(0.5, n / 4)).to(dtype)
    eps = (10 ** (torch.rand(b, generator=gen, dtype=F64) * 5 - 3)).to(dtype)
    x[9] = 0.25  # every entry tied
    x[10] *= 1e-30  # entries near the smallest normal
    x[3, 0] = math.inf
    x[4, n - 1] = math.nan
    k[5], k[6] = 0.0, float(n)
    eps[7] = 1e300 if dtype == F64 else 1e37
    special = [3, 4, 5, 6, 7]
    limit = _ot._scaling_limit(dtype)
    *_, scale, status, evaluations, left, at_limit = ops.threshold_rows(x, k, eps, 0.0, limit, 100)
    assert status.nonzero().squeeze(-1).tolist() == special
    assert status[special].tolist() == [1, 1, 2, 4, 1] and (left, at_limit) == (3, 2)
    assert (scale == 1).all() and 1 <= evaluations <= 8
    got = _solve_kernel(ops, x, k, eps, 100, 0.0, None)
    want = _ot._solve(x, k, eps, 100, 0.0, None)
    tol = 1e-12 if dtype == F64 else 2e-6
    torch.testing.assert_close(got[1], want[1], atol=tol, rtol=0, equal_nan=True)
    torch.testing.assert_close(got[3][:, 2], want[3][:, 2], atol=0, rtol=50 * tol, equal_nan=True)
    for name in ("m", "converged", "sel_none", "sel_all", "invalid", "scale"):
        assert torch.equal(getattr(got[0], name), getattr(want[0], name)), name
    sums = got[1].double().sum(-1)
    ok = torch.ones(b, dtype=torch.bool)
    ok[special] = False
    assert ((sums - k.double())[ok].abs() <= n * tol + 1e-6 * k.double()[ok]).all()
    # one evaluation: the rows it does not settle are left as capped, the merged solve is the
    # torch code's
    *_, status, evaluations, left, _ = ops.threshold_rows(x, k, eps, 0.0, limit, 1)
    assert evaluations == 1 and left >= 3 and status[special].tolist() == [1, 1, 2, 4, 1]
    got = _solve_kernel(ops, x, k, eps, 1, 0.0, None)
    want = _ot._solve(x, k, eps, 1, 0.0, None)
    torch.testing.assert_close(got[1], want[1], atol=tol, rtol=0, equal_nan=True)
    assert torch.equal(got[0].converged, want[0].converged)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@settings(
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_adversarial_groups_of_short_rows_solve_as_the_torch_code(ops, dtype, data):
    # up to 40 adversarial rows of one length at most 130: whole groups of lanes and a partial
    # one, each lane a row of its own values, k and epsilon (see the test above this one)
    n = data.draw(st.integers(1, 130))
    b = data.draw(st.integers(1, 40))
    x = torch.tensor([data.draw(row_values(dtype, n)) for _ in range(b)], dtype=F64).to(dtype)
    _assert_drawn_rows_solve_as_the_torch_code(ops, data, x)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n", [40, 300])  # a vector of rows at a time, a row at a time
def test_masked_rows_are_solved_by_the_kernel_as_by_the_torch_code(ops, dtype, n):
    # rows whose only non-finite entries are -inf (attention's masked keys), k at most their
    # count of finite entries n_fin: the kernel solves them on their finite entries, in one pass
    # (each -inf weighs exactly 0), or fills them at k = n_fin; the rest stay with the torch code
    x = _rows(12, n, dtype, seed=21)
    keys = torch.tensor([40, 39, 30, 20, 10, 5, 3, 2, 6, 6, 6, 8]) * (n // 40)
    valid = torch.arange(n) < keys[:, None]
    x = x.masked_fill(~valid, -math.inf)
    x[3] = x[3].flip(0)  # the -inf entries lead the row
    x[9, 0] = math.inf  # a +inf entry: left
    x[10, 1] = math.nan  # a NaN: left
    k = torch.tensor([8, 8, 8, 8, 4, 2, 1, 1.5, 6, 3, 3, 7.5], dtype=dtype)
    k[8] = float(keys[8])  # k = n_fin: the limit
    eps = torch.full((12,), 0.2, dtype=dtype)
    eps[11] = torch.finfo(dtype).max / 4  # beyond the scaling limit: left (scaled)
    limit = _ot._scaling_limit(dtype)
    *_, status, _, left, at_limit = ops.threshold_rows(x, k, eps, 0.0, limit, 100)
    assert status.tolist() == [0] * 8 + [4, 1, 1, 1] and (left, at_limit) == (3, 1)
    got = _solve_kernel(ops, x, k, eps, 100, 0.0, None)
    want = _ot._solve(x, k, eps, 100, 0.0, None)
    tol = 1e-12 if dtype == F64 else 2e-6
    torch.testing.assert_close(got[1], want[1], equal_nan=True, atol=tol, rtol=0)
    torch.testing.assert_close(got[2], want[2], equal_nan=True, atol=tol * 50, rtol=50 * tol)
    torch.testing.assert_close(got[3][:, 2], want[3][:, 2], equal_nan=True, atol=0, rtol=50 * tol)
    for name in ("converged", "sel_none", "sel_all", "invalid"):
        assert torch.equal(getattr(got[0], name), getattr(want[0], name)), name
    masked = (x == -math.inf) & ~x.isnan().any(-1, keepdim=True)  # (the NaN row is NaN)
    assert torch.equal(got[1][masked], torch.zeros_like(got[1][masked]))
    assert torch.equal(got[2][masked], torch.zeros_like(got[2][masked]))
    # gradients in x, k and epsilon through the operator, on both back ends
    g = torch.randn(12, n, generator=seeded(22), dtype=dtype)
    grads = []
    for name in ("kernel", "reference"):
        with backend(name):
            xt = x.clone().requires_grad_()
            kt, et = k.clone().requires_grad_(), eps.clone().requires_grad_()
            A = softops.soft_topk_mask(xt, kt, epsilon=et)
            grads.append(torch.autograd.grad(A, (xt, kt, et), g))
    for a, b in zip(*grads, strict=True):
        scale = max(float(b.nan_to_num().abs().max()), 1.0)
        torch.testing.assert_close(a, b, equal_nan=True, atol=tol * 100 * scale, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n", [40, 300])  # a vector of rows at a time, a row at a time
@pytest.mark.parametrize("pad", ["right", "left", "both"])
def test_padded_rows_are_solved_on_the_window_of_their_keys(ops, dtype, n, pad):
    # padding masks whole columns (-inf in every row): the kernel solves on the window between
    # the first and last entries that are not -inf, with -inf entries inside it too (causal),
    # and writes 0 outside it; rows of no key at k = 0 are filled, as the torch code fills them
    b = 37
    x = _rows(b, n, dtype, seed=41)
    lo, hi = {"right": (0, n - n // 4), "left": (n // 3, n), "both": (n // 5, n - n // 6)}[pad]
    cols = torch.arange(n)
    keep = (cols >= lo) & (cols < hi)
    causal = cols[None, :] <= lo + torch.arange(b)[:, None] * (hi - lo) // b
    x = x.masked_fill(~(keep & causal), -math.inf)
    x[5] = -math.inf  # no key at all
    n_fin = (x > -math.inf).sum(-1)
    k = n_fin.clamp(max=6).to(dtype) - torch.rand(b, generator=seeded(42), dtype=F64).to(dtype)
    k = k.clamp(min=0)
    k[5] = 0.0
    k[7] = float(n_fin[7])  # at k = n_fin
    eps = (10 ** (torch.rand(b, generator=seeded(43), dtype=F64) * 3 - 2)).to(dtype)
    limit = _ot._scaling_limit(dtype)
    *_, status, _, left, _ = ops.threshold_rows(x, k, eps, 0.0, limit, 100)
    assert left == 0 and status[5] == 6 and status[7] == 4
    got = _solve_kernel(ops, x, k, eps, 100, 0.0, None)
    want = _ot._solve(x, k, eps, 100, 0.0, None)
    tol = 1e-12 if dtype == F64 else 2e-6
    torch.testing.assert_close(got[1], want[1], atol=tol, rtol=0)
    torch.testing.assert_close(got[2], want[2], atol=tol * 500, rtol=50 * tol)
    torch.testing.assert_close(got[3][:, 2], want[3][:, 2], atol=0, rtol=50 * tol)
    for name in ("m", "converged", "sel_none", "sel_all", "invalid"):
        torch.testing.assert_close(getattr(got[0], name), getattr(want[0], name), atol=0, rtol=0)
    masked = x == -math.inf
    assert not got[1][masked].any() and not got[2][masked].any()
    sums = got[1].double().sum(-1)
    assert ((sums - k.double()).abs() <= n * tol + 1e-6 * k.double()).all()


def test_a_masked_row_beside_the_dtypes_extremes_is_solved_on_its_finite_entries(ops):
    # an entry of -1e30 (float32) holds the threshold when k = n_fin - 0.5: the -inf entries take
    # no part (no finite stand-in for them, which could round onto that entry)
    x = torch.tensor([[2.0, 1.0, 0.5, -1e30, -math.inf, -math.inf]])
    k = torch.tensor([3.5])
    eps = torch.tensor([0.3])
    assert ops.threshold_rows(x, k, eps, 0.0, _ot._scaling_limit(x.dtype), 100)[5].item() == 0
    got = _solve_kernel(ops, x, k, eps, 100, 0.0, None)
    want = _ot._solve(x, k, eps, 100, 0.0, None)
    torch.testing.assert_close(got[1], want[1], atol=2e-6, rtol=0)
    assert abs(float(got[1].sum()) - 3.5) < 1e-5 and float(got[1][0, 3]) > 0.4


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_causal_rows_at_k_equal_to_their_keys_are_the_limit_on_either_back_end(dtype):
    # a causal row with at most k valid keys is at k = n_fin: its mask is exactly 1 on the keys
    # and 0 on the -inf ones, with no gradient in x or epsilon, and its gradient in k is the
    # one-sided limit softmax(-x / eps) over the keys; the kernel (which fills such rows at their
    # limit) and the torch code (the limit by construction) agree
    n = 12
    x = _rows(n, n, dtype, seed=31)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = x.masked_fill(~causal, -math.inf)
    k = causal.sum(-1).clamp(max=5).to(dtype)  # rows 0-4: k = their keys
    eps = torch.full((n,), 0.3, dtype=dtype)
    g = torch.randn(n, n, generator=seeded(32), dtype=dtype)
    out = _mask_and_grads_on_both_back_ends(x, k, eps, g)
    for A, gx, gk, ge in out.values():
        assert torch.equal(A[:5], causal[:5].to(dtype))
        assert torch.equal(gx[:5], torch.zeros_like(gx[:5])) and torch.equal(ge[:5], ge[:5] * 0)
        keys = x[:5].masked_fill(~causal[:5], math.inf)
        want = (torch.softmax(-keys / 0.3, -1) * g[:5]).sum(-1)
        tol = 1e-10 if dtype == F64 else 2e-5
        torch.testing.assert_close(gk[:5], want, rtol=5 * tol, atol=tol)
    for a, b in zip(out["kernel"], out["reference"], strict=True):
        torch.testing.assert_close(a, b, atol=tol * max(float(b.abs().max()), 1.0), rtol=1e-4)


def _mask_and_grads_on_both_back_ends(x, k, eps, g):
    """{back end: (mask, its vjp with g in x, k and epsilon)} for the kernel and the reference."""
    out = {}
    for name in ("kernel", "reference"):
        with backend(name):
            xt = x.clone().requires_grad_()
            kt, et = k.clone().requires_grad_(), eps.clone().requires_grad_()
            A = softops.soft_topk_mask(xt, kt, epsilon=et)
            out[name] = (A.detach(), *torch.autograd.grad(A, (xt, kt, et), g))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n", [12, 300])  # a vector of rows at a time, a row at a time
def test_rows_at_k_zero_are_the_limit_on_either_back_end(ops, dtype, n):
    # k = 0 (with and without masked entries): the mask is exactly 0, with no gradient in x or
    # epsilon, and the gradient in k is the one-sided limit softmax(x / eps) over the finite
    # entries; the kernel (which fills such rows) and the torch code agree
    b = 6
    x = _rows(b, n, dtype, seed=51)
    x[1, n // 2 :] = -math.inf
    x[2, : n // 3] = -math.inf
    k = torch.zeros(b, dtype=dtype)
    eps = torch.full((b,), 0.4, dtype=dtype)
    limit = _ot._scaling_limit(dtype)
    assert ops.threshold_rows(x, k, eps, 0.0, limit, 100)[5].tolist() == [2] * b
    g = torch.randn(b, n, generator=seeded(52), dtype=dtype)
    out = _mask_and_grads_on_both_back_ends(x, k, eps, g)
    tol = 1e-10 if dtype == F64 else 2e-5
    for A, gx, gk, ge in out.values():
        assert not A.any() and not gx.any() and not ge.any()
        want = (torch.softmax(x / 0.4, -1) * g).sum(-1)  # (-inf entries: weight 0)
        torch.testing.assert_close(gk, want, rtol=5 * tol, atol=tol)
    for a, w in zip(out["kernel"], out["reference"], strict=True):
        torch.testing.assert_close(a, w, atol=tol, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("limit_row", [False, True])
def test_operator_returns_the_kernel_outputs_as_they_are_where_every_row_is_solved(
    ops, dtype, limit_row
):
    # where no row is left or at a limit of k, the CPU operator hands back the kernel's A, s and
    # aux, its status as the edge (0) and its scale (1); they are those of the merged path
    x = _rows(9, 8, dtype, 11)
    k = torch.full((9,), 3.0, dtype=dtype)
    if limit_row:
        k[4] = 0.0  # (at a limit: the merged path, whose edge marks the row)
    eps = torch.linspace(0.05, 2.0, 9, dtype=dtype)
    with backend("kernel"):
        out = _ot.THRESHOLD_OP(x, k, eps, 100, 0.0, None, "op")
    merged = _ot._threshold_outputs("op", 100, _solve_kernel(ops, x, k, eps, 100, 0.0, None))
    for got, want in zip(out, merged, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert out[3].dtype == torch.int8 and out[3].tolist() == [0] * 4 + [limit_row] + [0] * 4
    assert out[4].dtype == dtype and (out[4] == 1).all()
