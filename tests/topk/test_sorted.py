"""Tests for the sorted SOFT top-k (softops.topk._sorted.soft_topk)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import softops
from softops import TopK, soft_topk
from softops.testing import unrolled_sinkhorn, unrolled_sorted_topk
from softops.topk._sorted import _soft_topk, topk_indices
from tests._helpers import saved_bytes, seeded

F64 = torch.float64


# Tiny problems: one intra-op thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize(("n", "k", "eps"), [(12, 3, 0.5), (20, 1, 0.3), (9, 9, 0.4)])
def test_matches_unrolled_reference_forward_and_backward(n, k, eps, largest) -> None:
    g = seeded(n + k)
    x = torch.randn(3, n, generator=g, dtype=F64, requires_grad=True)
    out = soft_topk(x, k, epsilon=eps, largest=largest, tol=1e-14, max_iter=100_000)
    ref_v, ref_w = unrolled_sorted_topk(x, k, epsilon=eps, n_iter=500, largest=largest)
    torch.testing.assert_close(out.weights, ref_w, atol=1e-11, rtol=0)
    torch.testing.assert_close(out.values, ref_v, atol=1e-11, rtol=0)
    gv = torch.randn(3, k, generator=g, dtype=F64)
    gw = torch.randn(3, k, n, generator=g, dtype=F64)
    (g_impl,) = torch.autograd.grad((out.values * gv).sum() + (out.weights * gw).sum(), x)
    (g_ref,) = torch.autograd.grad((ref_v * gv).sum() + (ref_w * gw).sum(), x)
    torch.testing.assert_close(g_impl, g_ref, atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize(("n", "k", "eps"), [(6, 1, 1.0), (10, 3, 0.5), (15, 4, 0.3), (7, 7, 0.6)])
def test_gradcheck_values_and_weights(n: int, k: int, eps: float) -> None:
    x = torch.randn(2, n, generator=seeded(n), dtype=F64, requires_grad=True)

    def fn(inp: torch.Tensor):
        out = soft_topk(inp, k, epsilon=eps, tol=1e-14, max_iter=100_000)
        return out.values, out.weights

    assert torch.autograd.gradcheck(fn, (x,), atol=1e-7, rtol=1e-5)


def test_gradcheck_epsilon_tensor() -> None:
    x = torch.randn(2, 8, generator=seeded(3), dtype=F64)
    eps = torch.tensor([0.4, 0.9], dtype=F64, requires_grad=True)

    def fn(e: torch.Tensor):
        return soft_topk(x, 3, epsilon=e, tol=1e-14, max_iter=100_000).values

    assert torch.autograd.gradcheck(fn, (eps,), atol=1e-7, rtol=1e-5)


def test_invariants_and_order() -> None:
    x = torch.randn(5, 40, generator=seeded(4), dtype=F64)
    for largest in (True, False):
        out = soft_topk(x, 6, epsilon=0.2, largest=largest)
        assert isinstance(out, TopK)
        assert out.values.shape == (5, 6) and out.weights.shape == (5, 6, 40)
        assert bool((out.weights >= 0).all())
        torch.testing.assert_close(out.weights.sum(-1), torch.ones(5, 6, dtype=F64))
        # columns over j: sum_j n Gamma_ij <= n * mu_i = 1, up to the L1 tolerance n * tol
        assert float(out.weights.sum(-2).max()) <= 1 + 40 * 1e-9
        diffs = out.values.diff(dim=-1)
        assert bool((diffs < 0).all()) if largest else bool((diffs > 0).all())
        torch.testing.assert_close(out.values, (out.weights @ x.unsqueeze(-1)).squeeze(-1))
        assert out.indices.dtype == torch.int64
        assert torch.equal(out.indices, torch.topk(x, 6, -1, largest, sorted=True).indices)
        lo, hi = x.min(-1, keepdim=True).values, x.max(-1, keepdim=True).values
        assert bool(((out.values >= lo) & (out.values <= hi)).all())


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_hard_limit(largest: bool, dtype: torch.dtype) -> None:
    g = seeded(5)
    x = torch.stack([torch.randperm(30, generator=g) for _ in range(4)]).to(dtype) * 0.5
    hard = torch.topk(x, 5, -1, largest, sorted=True)
    out = soft_topk(x, 5, largest=largest, epsilon=0.005)
    onehot = torch.nn.functional.one_hot(hard.indices, 30).to(dtype)
    atol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out.weights, onehot, atol=atol, rtol=0)
    torch.testing.assert_close(out.values, hard.values, atol=atol * 10, rtol=0)


def test_scaling_law_and_orientation() -> None:
    x = torch.randn(3, 25, generator=seeded(6), dtype=F64)
    out = soft_topk(x, 4, epsilon=0.3)
    scaled = soft_topk(7.0 * x, 4, epsilon=2.1)
    torch.testing.assert_close(scaled.values, 7.0 * out.values)
    torch.testing.assert_close(scaled.weights, out.weights)
    smallest = soft_topk(-x, 4, epsilon=0.3, largest=False)
    torch.testing.assert_close(smallest.values, -out.values)
    torch.testing.assert_close(smallest.weights, out.weights)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_any_dim_equals_loop_over_rows(dim: int) -> None:
    x = torch.randn(4, 6, 5, generator=seeded(7), dtype=F64)
    k = 3
    out = soft_topk(x, k, dim=dim, epsilon=0.25)
    d = dim % 3
    n = x.shape[d]
    exp_shape = list(x.shape)
    exp_shape[d] = k
    assert out.values.shape == tuple(exp_shape)
    assert out.weights.shape == (*exp_shape, n)
    assert out.indices.shape == tuple(exp_shape)
    moved = x.movedim(d, -1)
    vals = out.values.movedim(d, -1)
    wts = out.weights.movedim(d, -2)
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in moved.shape[:-1]]):
        row = moved[tuple(idx)]
        single = soft_topk(row, k, epsilon=0.25)
        torch.testing.assert_close(vals[tuple(idx)], single.values, atol=1e-12, rtol=0)
        torch.testing.assert_close(wts[tuple(idx)], single.weights, atol=1e-12, rtol=0)


def test_rows_are_independent() -> None:
    x = torch.randn(4, 30, generator=seeded(8), dtype=F64)
    out = soft_topk(x, 5, epsilon=0.2)
    x2 = x.clone()
    x2[1] *= 100.0
    out2 = soft_topk(x2, 5, epsilon=0.2)
    keep = [0, 2, 3]
    torch.testing.assert_close(out2.values[keep], out.values[keep], atol=0, rtol=0)
    torch.testing.assert_close(out2.weights[keep], out.weights[keep], atol=0, rtol=0)


def test_nan_row_isolated_no_hang() -> None:
    x = torch.randn(3, 20, generator=seeded(9), dtype=F64, requires_grad=True)
    bad = x.detach().clone()
    bad[1, 4] = math.nan
    bad.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN row is not a convergence failure
        out = soft_topk(bad, 4, epsilon=0.3, max_iter=100_000)
    assert bool(out.values[1].isnan().all()) and bool(out.weights[1].isnan().all())
    ref = soft_topk(x, 4, epsilon=0.3)
    torch.testing.assert_close(out.values[[0, 2]], ref.values[[0, 2]], atol=0, rtol=0)
    out.values.sum().backward()
    assert bool(torch.isfinite(bad.grad[[0, 2]]).all())


def test_minus_inf_is_never_selected() -> None:
    x = torch.randn(2, 12, generator=seeded(10), dtype=F64)
    masked = x.clone()
    masked[:, [2, 7]] = -math.inf
    keep = [i for i in range(12) if i not in (2, 7)]
    out = soft_topk(masked, 3, epsilon=0.3)
    assert bool(torch.isfinite(out.values).all())
    assert float(out.weights[..., [2, 7]].abs().max()) == 0.0
    # equals the problem on the finite entries with the rest mass including the masked ones
    ref_v2, ref_w2 = _solve_with_extra_rest(x[:, keep], 3, 0.3, extra=2)
    torch.testing.assert_close(out.weights[..., keep], ref_w2, atol=1e-9, rtol=0)
    torch.testing.assert_close(out.values, ref_v2, atol=1e-9, rtol=0)
    # +inf is always selected, first; -inf entries of the same row still get weight 0
    both = masked.clone()
    both[:, 5] = math.inf
    out = soft_topk(both, 3, epsilon=0.3)
    assert bool((out.values[:, 0] == math.inf).all()) and bool(out.values[:, 1:].isfinite().all())
    torch.testing.assert_close(out.weights[:, 0, 5], torch.ones(2, dtype=F64))
    # too few selectable entries: NaN in that row only
    few = x.clone()
    few[0, 2:] = -math.inf
    out = soft_topk(few, 3, epsilon=0.3)
    assert bool(out.values[0].isnan().all()) and bool(torch.isfinite(out.values[1]).all())


def _solve_with_extra_rest(x: torch.Tensor, k: int, epsilon: float, extra: int):
    """Reference for masked entries: n' finite sources, each of mass 1/n with n = n' + extra."""
    bsz, nf = x.shape
    n = nf + extra
    s = -x
    y = torch.arange(k + 1, dtype=x.dtype)
    cost = (s[:, :, None] - y) ** 2
    log_mu = torch.full((bsz, nf), -math.log(n), dtype=x.dtype)
    log_nu = torch.tensor([1 / n] * k + [(nf - k) / n], dtype=x.dtype).log().expand(bsz, -1)
    plan = unrolled_sinkhorn(cost, log_mu, log_nu, 2 * epsilon, 1000).plan
    weights = n * plan[..., :k].transpose(1, 2)
    return torch.bmm(weights, x.unsqueeze(-1)).squeeze(-1), weights


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_dtypes(dtype: torch.dtype) -> None:
    x = torch.randn(3, 50, generator=seeded(11)).to(dtype).requires_grad_(True)
    out = soft_topk(x, 4, epsilon=0.3)
    assert out.values.dtype == dtype and out.weights.dtype == dtype
    ref = soft_topk(x.detach().double(), 4, epsilon=0.3)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.values.double(), ref.values, atol=tol, rtol=tol)
    out.values.sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype


def test_k_equals_n_is_a_soft_sort() -> None:
    x = torch.randn(2, 8, generator=seeded(12), dtype=F64)
    out = soft_topk(x, 8, epsilon=0.05)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 8, dtype=F64))
    torch.testing.assert_close(out.weights.sum(-2), torch.ones(2, 8, dtype=F64))
    assert bool((out.values.diff(dim=-1) < 0).all())
    one = soft_topk(x[:, :1], 1)
    torch.testing.assert_close(one.values, x[:, :1])


def test_not_converged_warns_once() -> None:
    x = torch.randn(4, 30, generator=seeded(13), dtype=F64)
    with pytest.warns(
        softops.ConvergenceWarning, match=r"did not converge within max_iter=5 \(tol=1e-30"
    ) as record:
        soft_topk(x, 5, epsilon=0.05, max_iter=5, tol=1e-30)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        soft_topk(x, 5, epsilon=0.05, max_iter=3, tol=0)  # fixed iterations: no warning


# --------------------------------------------------------------------------- memory


def test_saved_memory_independent_of_iterations() -> None:
    x = torch.randn(4, 200, generator=seeded(14), dtype=F64, requires_grad=True)
    k = 4

    def run(iters: int):
        return lambda: soft_topk(x, k, epsilon=0.3, max_iter=iters, tol=0)

    b50, b500 = saved_bytes(run(50)), saved_bytes(run(500))
    assert b50 == b500
    # the plan (B, n, k+1), the weights (B, k, n) and x, plus small state
    assert b50 <= 8 * (4 * 200 * (2 * k + 2)) + 4096
    unrolled = saved_bytes(lambda: unrolled_sorted_topk(x, k, epsilon=0.3, n_iter=200))
    assert unrolled > 100 * b50


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "kwargs", "err", "match"),
    [
        ((torch.zeros(5), 0), {}, ValueError, "got k=0"),
        ((torch.zeros(5), 6), {}, ValueError, "got k=6"),
        ((torch.zeros(5), 1.5), {}, TypeError, "got k=1.5"),
        ((torch.zeros(5, dtype=torch.int64), 2), {}, TypeError, "dtype=torch.int64"),
        ((torch.zeros(5), 2), {"dim": 1}, ValueError, "got dim=1"),
        ((torch.zeros(3, 0), 1), {}, ValueError, r"x.shape\[1\] = 0"),
        ((torch.zeros(5), 2), {"epsilon": 0.0}, ValueError, "epsilon=0.0"),
        ((torch.zeros(5), 2), {"epsilon": -1.0}, ValueError, "epsilon=-1.0"),
        ((torch.zeros(5), 2), {"largest": 1}, TypeError, "largest=1"),
        ((torch.zeros(5), 2), {"max_iter": 0}, ValueError, "max_iter"),
        ((torch.zeros(5), 2), {"tol": -0.5}, ValueError, "tol=-0.5"),
        ((torch.zeros(2, 5), 2), {"epsilon": torch.ones(3)}, ValueError, r"shape \(3,\)"),
    ],
)
def test_errors(args, kwargs, err, match) -> None:
    with pytest.raises(err, match=match):
        soft_topk(*args, **kwargs)


# --------------------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None)
@given(
    values=st.lists(st.integers(-3, 3), min_size=4, max_size=12),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    k=st.integers(1, 4),
)
def test_property_ties_and_magnitudes(values: list[int], scale: float, k: int) -> None:
    x = torch.tensor(values, dtype=F64) * scale
    k = min(k, x.numel())
    out = soft_topk(x, k, epsilon=0.1 * scale)
    assert bool(torch.isfinite(out.weights).all())
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(k, dtype=F64), atol=1e-7, rtol=0)
    assert bool((out.values.diff() <= 1e-9 * scale).all())
    assert float(out.values.max()) <= float(x.max()) + 1e-9 * scale


@pytest.mark.slow
@pytest.mark.parametrize("n", [100, 3000])
@pytest.mark.parametrize("k", [1, 8, 32])
@pytest.mark.parametrize("eps", [1.0, 0.1, 0.01, 1e-3])
def test_float32_grid_converges_and_matches_float64(n: int, k: int, eps: float) -> None:
    x = torch.randn(4, n, generator=seeded(n + k), dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = soft_topk(x, k, epsilon=eps)
        out = soft_topk(x.float(), k, epsilon=eps)
    assert bool(torch.isfinite(out.weights).all())
    # float32 resolves the plan to about k * ulp(x) / epsilon
    tol = max(1e-4, 1e-6 * k / eps)
    torch.testing.assert_close(out.values.double(), ref.values, atol=tol, rtol=0)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(4, k), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- issue 9: near-hard


def _fd_check(fn, x: torch.Tensor, h: float, g: torch.Generator) -> float:
    """Relative gap between autograd and a central difference of a random projection of fn."""
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    ct = torch.randn(out.shape, generator=g, dtype=F64)
    (grad,) = torch.autograd.grad((out * ct).sum(), x)
    v = torch.randn(x.shape, generator=g, dtype=F64)
    with torch.no_grad():
        up, down = x + h * v, x - h * v
        # The step actually taken: x + h v is rounded, and where |x| / h reaches 1e12 (tied
        # scores of size 10 at epsilon 1e-6) that rounding is 1e-5 of the step itself.
        v = (up - down) / (2 * h)
        fd = ((fn(up) - fn(down)) * ct).sum() / (2 * h)
    scale = float((grad.abs() * v.abs()).sum()) + float(ct.abs().sum())
    return abs(float((grad * v).sum() - fd)) / scale


def _topk_flat(k: int, eps: float):
    def fn(z: torch.Tensor) -> torch.Tensor:
        out = soft_topk(z, k, epsilon=eps, tol=1e-12, max_iter=100_000)
        return torch.cat((out.values.flatten(), out.weights.flatten()))

    return fn


@pytest.mark.parametrize(
    ("x", "eps", "expected"),
    [
        ([8.484407704117139, 1.3158435545009128, -13.994095672036792], 0.1, [1.0, 0.0, 0.0]),
        (
            [-4.023659142230008, -4.204560644752284, 1.508048549624597, 2.969139099857415],
            0.0501447,
            [0.0, 0.0, -6.3889e-06, 1.0],
        ),
    ],
)
def test_one_hot_gradient_regressions(x, eps, expected) -> None:
    """Issue 9: the Schur solve gave -102.9 and -56 here (an indefinite, cancelled K)."""
    xt = torch.tensor(x, dtype=F64, requires_grad=True)
    (grad,) = torch.autograd.grad(soft_topk(xt, 2, epsilon=eps).values[0], xt)
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=F64), atol=1e-8, rtol=1e-3)
    assert torch.autograd.gradcheck(_topk_flat(2, eps), (xt,))


def test_decoupled_blocks_converge_regression() -> None:
    """Large sweep case: k = n at epsilon 0.07, the columns in two blocks coupled at 1e-18.
    Newton's gradient b - c, formed directly, carried 1e-16 of rounding on the blocks' balance,
    so the step moved one block by 33 units, Armijo refused it at every length and 100 000
    Sinkhorn iterations then stalled at a residual of 3e-12 (tol 1e-12)."""
    x = torch.tensor(
        [
            -1.0527139578192142,
            2.330521849573172,
            -16.37683107744432,
            -3.4783475417645855,
            -13.075124308034088,
            0.5714962093058755,
            -9.414238576176384,
            10.766105280199909,
        ],
        dtype=F64,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = soft_topk(x, 8, epsilon=0.07310554794504241, tol=1e-12, max_iter=100_000)
    torch.testing.assert_close(out.values, torch.sort(x, descending=True).values, atol=1e-4, rtol=0)


def _near_hard_case(g: torch.Generator, n_max: int) -> tuple[torch.Tensor, int, float, float]:
    """A one-hot-like, tied or multi-scale row, k, and epsilon in 1e-3..10 times the top gap."""
    n = int(torch.randint(2, n_max + 1, (1,), generator=g))
    k = int(torch.randint(1, n + 1, (1,), generator=g))
    kind = int(torch.randint(3, (1,), generator=g))
    x = 10 * torch.randn(n, generator=g, dtype=F64)
    if kind == 1:  # exact ties
        x = x[torch.randint(n, (n,), generator=g)]
    elif kind == 2:
        x = x * 10 ** float(2 * torch.rand(1, generator=g) - 1)
    top = torch.sort(x, descending=True).values[: k + 1]
    gaps = top[:-1] - top[1:]
    gaps = gaps[gaps > 0]
    gap = float(gaps.min()) if gaps.numel() else 1.0
    eps = gap * 10 ** float(4 * torch.rand(1, generator=g) - 3)
    return x, k, eps, min(gap, eps)


def _sweep(cases: int, seed: int, n_max: int) -> None:
    g = seeded(seed)
    worst = 0.0
    for _ in range(cases):
        x, k, eps, scale = _near_hard_case(g, n_max)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            err = _fd_check(_topk_flat(k, eps), x, 1e-5 * scale, g)
        assert err < 1e-6, (x.tolist(), k, eps, err)
        worst = max(worst, err)


def test_near_hard_gradients_sweep() -> None:
    """Autograd equals central differences, values and weights, across epsilon/gap in 1e-3..10."""
    _sweep(60, 901, 8)


@pytest.mark.slow
def test_near_hard_gradients_sweep_large() -> None:
    """Issue 9: one case stalled at 3e-12 (test_decoupled_blocks_converge_regression), one
    missed the central difference by 1.6e-5 because x + h v rounds (tied scores of 11 at
    epsilon 2.7e-6); both pass, every case to 1e-6."""
    _sweep(1500, 902, 16)


def test_nan_row_wins_over_inf() -> None:
    """Issue 9: a NaN makes its row NaN even when the row holds +inf; other rows unaffected."""
    x = torch.tensor(
        [[1.0, math.nan, math.inf, 0.5], [1.0, 2.0, 3.0, 0.5], [math.inf, 0.0, 1.0, -math.inf]],
        dtype=F64,
    )
    for largest in (True, False):
        xs = x if largest else -x
        out = soft_topk(xs, 2, epsilon=0.1, largest=largest)
        assert bool(out.values[0].isnan().all()) and bool(out.weights[0].isnan().all())
        assert bool(torch.isfinite(out.weights[1:]).all())
        assert bool(torch.isfinite(out.values[1]).all())
        assert float(out.values[2, 0]) == (math.inf if largest else -math.inf)


def test_float32_far_outlier_matches_float64() -> None:
    """Issue 9: an entry 1e8 away from the rest gave O(0.1) errors in float32 (cost offsets)."""
    x = torch.tensor([[0.0, 0.3, 1.0, 0.7, 1e8], [0.0, 0.3, 1.0, 0.7, -1e8]], dtype=F64)
    for largest in (True, False):
        ref = soft_topk(x, 3, epsilon=0.1, largest=largest)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = soft_topk(x.float(), 3, epsilon=0.1, largest=largest)
        torch.testing.assert_close(out.weights.double(), ref.weights, atol=1e-5, rtol=0)
        finite = ref.values.abs() < 1e3
        torch.testing.assert_close(
            out.values.double()[finite], ref.values[finite], atol=1e-5, rtol=0
        )


# ------------------------------------------------------ torch.func, forward mode, meta tensors

_INF_ROWS = torch.tensor(
    [
        [0.3, math.inf, -1.0, -math.inf, math.inf, 2.0, 0.7],
        [0.3, 1.0, -1.0, 0.5, 4.0, 2.0, 0.7],
        [math.inf, math.inf, -math.inf, math.inf, -math.inf, math.inf, math.inf],  # all +inf
        [0.3, math.nan, -1.0, 0.5, math.inf, 2.0, 0.7],
        [-math.inf, -math.inf, -math.inf, -math.inf, 0.1, -math.inf, 0.7],  # too few for k = 3
    ],
    dtype=F64,
)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_vmap_equals_the_loop_with_infinities_and_nan(largest: bool, k: int) -> None:
    """Under vmap every row takes the full solve, the path of rows with infinities: the same
    outputs as the full solve of each row, and within the solver's tolerance of the candidate-set
    solve that an eager finite row takes (docs/math.md §2.4)."""
    x = _INF_ROWS if largest else -_INF_ROWS

    def fn(z, reduce=True):
        out = _soft_topk(z, k, epsilon=0.3, largest=largest, tol=1e-12, reduce=reduce)
        return out.values, out.weights, out.indices

    got = torch.func.vmap(fn)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(x.shape[0]):
            for a, b in zip(got, fn(x[i], reduce=False), strict=True):
                torch.testing.assert_close(a[i], b, atol=0, rtol=0, equal_nan=True)
            for a, b in zip(got, fn(x[i]), strict=True):
                torch.testing.assert_close(a[i], b, atol=1e-10, rtol=0, equal_nan=True)
    sure = math.inf if largest else -math.inf
    assert bool((got[0][2] == sure).all()) and bool(got[0][3].isnan().all())
    assert bool(torch.isfinite(got[1][1]).all())
    assert bool(got[0][4].isnan().all()) == (k == 3)


def test_vmap_of_grad_equals_the_loop() -> None:
    x = torch.randn(4, 9, generator=seeded(30), dtype=F64)
    x[1, 3] = -math.inf
    w = torch.linspace(-1.0, 1.0, 3, dtype=F64)

    def loss(z):
        return (soft_topk(z, 3, epsilon=0.3, tol=1e-12).values * w).sum()

    grads = torch.func.vmap(torch.func.grad(loss))(x)
    for i in range(4):
        z = x[i].clone().requires_grad_(True)
        (ref,) = torch.autograd.grad(loss(z), z)
        torch.testing.assert_close(grads[i], ref, atol=1e-12, rtol=1e-10)
    assert float(grads[1, 3]) == 0.0


@pytest.mark.parametrize(("n", "k"), [(6, 2), (5, 5)])
def test_gradcheck_forward_mode(n: int, k: int) -> None:
    x = torch.randn(2, n, generator=seeded(31), dtype=F64, requires_grad=True)
    eps = torch.tensor([0.4, 0.7], dtype=F64, requires_grad=True)

    def fn(z, e):
        out = soft_topk(z, k, epsilon=e, tol=1e-12, max_iter=100_000)
        return out.values, out.weights

    assert torch.autograd.gradcheck(fn, (x, eps), check_forward_ad=True)


@pytest.mark.parametrize(("n", "k"), [(9, 2), (6, 1), (7, 4), (5, 5)])
def test_double_backward_in_x_and_epsilon(n: int, k: int) -> None:
    """Second derivatives, the mixed ones in x and epsilon included (the backward differentiates
    the cost in units of epsilon as a function of both)."""
    x = torch.randn(3, n, generator=seeded(32 + n), dtype=F64, requires_grad=True)
    eps = torch.tensor([0.05, 0.3, 2.0], dtype=F64, requires_grad=True)

    def fn(z, e):
        out = soft_topk(z, k, epsilon=e, tol=1e-13, max_iter=100_000)
        return out.values, out.weights

    assert torch.autograd.gradgradcheck(fn, (x, eps), atol=1e-6, rtol=1e-5)


def test_jvp_with_infinities_equals_the_jacobian() -> None:
    x = _INF_ROWS[0]
    v = torch.linspace(-1.0, 1.0, 7, dtype=F64)
    v = torch.where(torch.isfinite(x), v, 0.0)

    def fn(z):
        return soft_topk(z, 3, epsilon=0.3, tol=1e-12).weights

    _, tangent = torch.func.jvp(fn, (x,), (v,))
    jac = torch.func.jacrev(fn)(x)
    torch.testing.assert_close(tangent, jac @ v, atol=1e-12, rtol=1e-10)
    assert float(tangent.abs().max()) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
def test_meta_tensors_give_the_shapes(dtype: torch.dtype) -> None:
    x = torch.empty(2, 9, 4, dtype=dtype, device="meta")
    out = soft_topk(x, 3, dim=1, epsilon=0.3)
    assert out.values.shape == (2, 3, 4) and out.weights.shape == (2, 3, 4, 9)
    assert out.indices.shape == (2, 3, 4) and out.indices.dtype == torch.int64
    assert out.values.dtype == dtype and out.weights.dtype == dtype
    assert all(t.device.type == "meta" for t in out)


@pytest.mark.parametrize("largest", [True, False])
def test_topk_indices_are_a_stable_sorts(largest):
    # the reference back end's indices: torch.topk's where no equal entries meet the top k, a
    # stable sort's (equal entries in the order of the row; NaN above every number) where they do
    nan, inf = math.nan, math.inf
    x = torch.tensor(
        [
            [0.3, 1.0, -2.0, 0.7, 5.0, -1.0],  # distinct
            [1.0, 2.0, 2.0, 0.0, 2.0, -1.0],  # ties inside and at the k-th
            [0.0, -0.0, 0.0, 1.0, -1.0, 0.0],  # signed zeros are equal
            [nan, 1.0, nan, -inf, inf, 0.0],  # NaN and infinities
            [3.0, 3.0, 3.0, 3.0, 3.0, 3.0],  # a constant row
        ]
    )
    for k in (1, 3, 6):
        got = topk_indices(x, k, largest)
        want = torch.sort(x, dim=-1, descending=largest, stable=True).indices[:, :k]
        assert torch.equal(got, want), (k, got, want)
        assert torch.equal(got[0], torch.topk(x[0], k, largest=largest).indices)
