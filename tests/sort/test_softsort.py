"""The "softsort" backend (Prillo & Eisenschlos 2020): the l1 scans and the l2 chunked path against
the naive n x n formula, hard limits and memory.

Backends take canonical (B, n) input, a (B,) epsilon and MethodOptions; the public API is tested
in test_api.py and tests/test_sort_contract.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import softops
from softops.sort import _chunked, _softsort
from softops.sort._options import MethodOptions
from tests.sort._helpers import (
    hard_ranks,
    reductions,
    row_eps,
    saved_storage_bytes,
    spaced,
    tie_free,
)

F64 = torch.float64
L1, L2 = MethodOptions(distance="l1"), MethodOptions(distance="l2")


def naive_softsort(x, eps, descending, distance):
    u = torch.sort(x, -1, descending=descending).values
    diff = u.unsqueeze(-1) - x.unsqueeze(1)
    d = diff.abs() if distance == "l1" else diff.square()
    p = torch.softmax(-d / eps.view(-1, 1, 1), dim=-1)
    return p


@pytest.fixture
def small_blocks(monkeypatch):
    """Force several row blocks (with a remainder) in the chunked path."""
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", 7 * 3 * 40)


# ------------------------------------------------------------------ equal to the naive n x n


@pytest.mark.parametrize("distance", ["l1", "l2"])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("eps", [0.3, 1.0, 5.0])
def test_equals_naive_forward_and_gradients(distance, descending, eps, small_blocks):
    opts = MethodOptions(distance=distance)
    x = tie_free(3, 40).requires_grad_()
    e = torch.tensor([eps, 0.5 * eps, 2 * eps], dtype=F64, requires_grad=True)
    p_ref = naive_softsort(x, e, descending, distance)
    v_ref, r_ref = reductions(p_ref, x)
    v = _softsort.sort(x, e, descending, opts)
    r = _softsort.rank(x, e, descending, opts)
    p = _softsort.argsort(x, e, descending, opts)
    torch.testing.assert_close(v, v_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(r, r_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(p, p_ref, atol=1e-10, rtol=0)
    gv, gr, gp = torch.randn_like(v), torch.randn_like(r), torch.randn_like(p)
    for out, ref, g in ((v, v_ref, gv), (r, r_ref, gr), (p, p_ref, gp)):
        got = torch.autograd.grad(out, (x, e), g, retain_graph=True)
        want = torch.autograd.grad(ref, (x, e), g, retain_graph=True)
        for a, b in zip(got, want, strict=True):
            scale = max(1.0, b.abs().max().item())
            torch.testing.assert_close(a / scale, b / scale, atol=1e-9, rtol=0)


def test_softsort_l1_scan_large_magnitudes():
    # offset and small epsilon: the float64 scans stay accurate
    x = tie_free(2, 300) + 1000.0
    e = row_eps(2, 0.05)
    v_ref, r_ref = reductions(naive_softsort(x, e, False, "l1"), x)
    torch.testing.assert_close(_softsort.sort(x, e, False, L1), v_ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(_softsort.rank(x, e, False, L1), r_ref, atol=1e-8, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, 1e3]), min_size=1, max_size=25),
    eps=st.sampled_from([0.05, 0.5, 4.0]),
    descending=st.booleans(),
)
def test_softsort_l1_scan_forward_with_ties(values, eps, descending):
    # the forward is continuous at ties: the scans equal the dense formula there too
    x = torch.tensor([values], dtype=F64)
    e = row_eps(1, eps)
    v_ref, r_ref = reductions(naive_softsort(x, e, descending, "l1"), x)
    v, r = _softsort.sort(x, e, descending, L1), _softsort.rank(x, e, descending, L1)
    torch.testing.assert_close(v, v_ref, atol=1e-9, rtol=1e-12)
    torch.testing.assert_close(r, r_ref, atol=1e-9, rtol=1e-12)


def test_softsort_l1_float32_uses_float64_scans():
    # float32 in, float32 out; as accurate as the naive float32 n x n (the scans run in float64)
    x32 = (tie_free(2, 500) + 100.0).float()
    e = row_eps(2, 1e-2)
    v_ref, r_ref = reductions(naive_softsort(x32.double(), e, False, "l1"), x32.double())
    v_naive, r_naive = reductions(naive_softsort(x32, e.float(), False, "l1"), x32)
    v32 = _softsort.sort(x32, e.float(), False, L1)
    r32 = _softsort.rank(x32, e.float(), False, L1)
    assert v32.dtype == r32.dtype == torch.float32
    assert (r32.double() - r_ref).abs().max() <= (r_naive.double() - r_ref).abs().max() + 1e-5
    assert (v32.double() - v_ref).abs().max() <= (v_naive.double() - v_ref).abs().max() + 1e-5
    assert (r32.double() - r_ref).abs().max() < 1e-3


def test_rank_offset_shifts_the_positions():
    # ranks with an offset o are sum_i (o + i) P_ij, on the l1 scans and the l2 chunked path
    x = tie_free(2, 9)
    e = row_eps(2, 0.7)
    off = torch.tensor([2.0, 0.5], dtype=F64)
    for opts in (L1, L2):
        p = naive_softsort(x, e, False, opts.distance)
        want = reductions(p, x)[1] + off.unsqueeze(-1) * p.sum(-2)
        torch.testing.assert_close(_softsort.rank(x, e, False, opts, off), want)


# ------------------------------------------------------------------ hard limit


@pytest.mark.parametrize("opts", [L1, L2], ids=["l1", "l2"])
@pytest.mark.parametrize("descending", [False, True])
def test_hard_limit(opts, descending):
    x = spaced(3, 30)
    e = row_eps(3, 1e-2)
    p = _softsort.argsort(x, e, descending, opts)
    hard = torch.sort(x, -1, descending=descending)
    one_hot = torch.nn.functional.one_hot(hard.indices, 30).to(F64)
    torch.testing.assert_close(p, one_hot, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        _softsort.sort(x, e, descending, opts), hard.values, atol=1e-10, rtol=0
    )
    torch.testing.assert_close(
        _softsort.rank(x, e, descending, opts), hard_ranks(x, descending), atol=1e-10, rtol=0
    )


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        (
            "softsort-l1",
            lambda x, e: _softsort.sort(x, e, False, L1) + _softsort.rank(x, e, False, L1),
        ),
        ("softsort-l2 rank", lambda x, e: _softsort.rank(x, e, False, L2)),
    ],
)
def test_saved_memory_is_linear(name, fn, monkeypatch):
    n = 3000
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", 64 * n)  # 64 rows per block
    x = torch.randn(1, n, requires_grad=True)
    e = row_eps(1, 0.5, dtype=torch.float32)
    saved = saved_storage_bytes(fn, x, e)
    # far below one n x n float32 matrix (36 MB): a few dozen length-n float64 vectors at most
    assert saved < 64 * n * 8, (name, saved)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_l1_values_of_ties_beside_a_far_outlier_are_equal():
    x = torch.tensor([[-1e6, -2.0, -2.0, -2.0, 0.0]], dtype=torch.float64)
    v = softops.soft_sort(x, epsilon=1.0, method="softsort")
    assert (v.diff(dim=-1) >= 0).all()
    torch.testing.assert_close(v[0, 1:4], v[0, 1:2].expand(3), atol=0, rtol=1e-12)


# ------------------------------------------------------------------ local-frame recurrences


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 257, 1000])
def test_linear_recurrence_matches_the_loop(n):
    torch.manual_seed(n)
    a, b = torch.rand(2, 3, n, dtype=F64), torch.rand(2, 3, n, dtype=F64)
    h, ref = torch.zeros(2, 3, dtype=F64), []
    for i in range(n):
        h = a[..., i] * h + b[..., i]
        ref.append(h)
    out = _softsort.linear_recurrence(a, b)
    torch.testing.assert_close(out, torch.stack(ref, -1), atol=0, rtol=1e-13)


def test_linear_recurrence_derivatives_all_orders():
    torch.manual_seed(0)
    a = torch.rand(2, 19, dtype=F64, requires_grad=True)
    b = torch.rand(2, 19, dtype=F64, requires_grad=True)
    f = _softsort.linear_recurrence
    assert torch.autograd.gradcheck(f, (a, b), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, (a, b))


@pytest.mark.parametrize("scale", [1e-200, 1e-8, 1.0, 1e8, 1e200])
@pytest.mark.parametrize("rel_eps", [1e-9, 1e-3, 1.0, 1e3])
@pytest.mark.parametrize("descending", [False, True])
def test_l1_range_ties_and_limits_at_every_scale(scale, rel_eps, descending):
    # a far outlier, a tie of three, and gaps from 1 to 1e7 (all times scale)
    x = torch.tensor([[-3.0, 1.0, 1.0, 1.0, 2.0, 1e7, -1e6]], dtype=F64) * scale
    n = x.shape[-1]
    e = torch.tensor([rel_eps * scale], dtype=F64)
    v, r = _softsort._l1_scan(x, e, descending, values=True, ranks=True)
    assert v is not None and r is not None
    assert ((v >= x.min()) & (v <= x.max())).all()
    assert ((r >= 1) & (r <= n)).all()  # every column sum is 1 or less here (P near I)
    srt = torch.sort(x, -1, descending=descending).values
    tied = (srt == scale).nonzero()[:, 1]
    torch.testing.assert_close(v[0, tied], v[0, tied[:1]].expand(3), atol=0, rtol=1e-12)
    torch.testing.assert_close(r[0, 1:4], r[0, 1:2].expand(3), atol=0, rtol=1e-12)
    if rel_eps <= 1e-3:  # every gap >= 1000 epsilon: the hard limit up to exp(-1000)
        torch.testing.assert_close(v, srt, atol=0, rtol=1e-15)
        hard = hard_ranks(x, descending).to(F64)
        hard[0, 1:4] = hard[0, 1:4].mean()
        torch.testing.assert_close(r, hard, atol=1e-13, rtol=0)


def test_l1_large_span_over_eps_equals_the_naive_formula():
    # span / eps = 1e5: the old single-frame scans lost ~1e-11 relative here; values and
    # gradients must match the (row-wise max-shifted, so accurate) dense formula
    torch.manual_seed(3)
    x = torch.cat((torch.randn(2, 9, dtype=F64) * 3, torch.full((2, 1), -1e5, dtype=F64)), -1)
    x.requires_grad_(True)
    e = torch.tensor([0.7, 2.0], dtype=F64)
    p = naive_softsort(x, e, False, "l1")
    vd = (p @ x.unsqueeze(-1)).squeeze(-1)
    rd = (torch.arange(1, 11, dtype=F64) @ p).squeeze(-2)
    v, r = _softsort._l1_scan(x, e, False, values=True, ranks=True)
    assert v is not None and r is not None
    torch.testing.assert_close(v, vd, atol=1e-11, rtol=1e-13)
    torch.testing.assert_close(r, rd, atol=1e-12, rtol=1e-13)
    g = torch.randn(2, 10, dtype=F64)
    (ga,) = torch.autograd.grad((v * g).sum() + (r * g.flip(-1)).sum(), x)
    (gd,) = torch.autograd.grad((vd * g).sum() + (rd * g.flip(-1)).sum(), x)
    torch.testing.assert_close(ga, gd, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("op", [softops.soft_sort, softops.soft_rank])
def test_l1_second_derivatives(op):
    torch.manual_seed(1)
    x = torch.randn(2, 7, dtype=F64, requires_grad=True)
    e = torch.tensor(0.6, dtype=F64, requires_grad=True)

    def f(x, e):
        return op(x, epsilon=e, method="softsort")

    assert torch.autograd.gradcheck(f, (x, e))
    assert torch.autograd.gradgradcheck(f, (x, e))


def test_l1_forward_mode_and_hessian_under_torch_func():
    torch.manual_seed(2)
    x = torch.randn(6, dtype=F64)

    def f(t):
        return softops.soft_sort(t, epsilon=0.4, method="softsort")

    torch.testing.assert_close(torch.func.jacfwd(f)(x), torch.func.jacrev(f)(x))

    def loss(t):
        return f(t).pow(3).sum()

    h_ref = torch.autograd.functional.hessian(loss, x)
    torch.testing.assert_close(torch.func.hessian(loss)(x), h_ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("distance", ["l1", "l2"])
@pytest.mark.parametrize(
    ("row", "eps", "dtype"),
    [
        ([0.0, 1.0, 2.0, 3.0], 1e-300, F64),  # eps**2 underflows: was 0 * inf = NaN in eps
        ([0.0, 1.0, 2.0, 3.0], 1e-30, torch.float32),
        ([3e38, 0.0, -3e38, 1.0], 1.0, torch.float32),  # (u - x)**2 overflows the dtype
        ([1e300, 0.0, -1e300, 1.0], 1e-10, F64),
    ],
)
def test_gradients_stay_finite_at_extreme_epsilon_and_spans(distance, row, eps, dtype):
    # found by tests/test_adversarial.py
    x = torch.tensor([row], dtype=F64).to(dtype).requires_grad_()
    e = torch.tensor([eps], dtype=F64, requires_grad=True)
    for op in (softops.soft_sort, softops.soft_rank, softops.soft_argsort):
        out = op(x, epsilon=e, method="softsort", distance=distance)
        assert not torch.isnan(out).any(), (op.__name__, out)
        gx, ge = torch.autograd.grad(out, (x, e), torch.ones_like(out))
        assert not torch.isnan(gx).any() and not torch.isnan(ge).any(), (op.__name__, gx, ge)


def test_l2_values_near_the_largest_float32():
    # the scaled frame keeps the l2 distances exact: the middle pair still sees its own gap
    x = torch.tensor([[3e38, 0.0, -3e38, 1.0]], dtype=torch.float32)
    v = softops.soft_sort(x, epsilon=1.0, method="softsort", distance="l2")
    p = torch.softmax(torch.tensor([0.0, -1.0], dtype=F64), -1)
    want = torch.tensor([[-3e38, float(p[1]), float(p[0]), 3e38]], dtype=torch.float32)
    torch.testing.assert_close(v, want)


def test_l1_rank_of_a_single_nan_is_nan():
    # found by tests/test_adversarial.py: with n = 1 the scans have no gap to carry the NaN
    x = torch.tensor([[float("nan")], [2.0]], dtype=F64)
    r = softops.soft_rank(x, method="softsort")
    assert torch.isnan(r[0]).all() and r[1].tolist() == [1.0]


def test_l1_scan_gradient_of_a_wide_row_at_a_wide_epsilon():
    # found by tests/test_adversarial.py: gaps of 1e242 at epsilon 1e241 made the moments'
    # backward pass gap**2 = 1e484 (NaN gradient in epsilon); the scans now run on x / s
    x = torch.tensor([[-1.0, -1.0, -1e69, -1e241, -1e242]], dtype=F64, requires_grad=True)
    e = torch.tensor([1e241], dtype=F64, requires_grad=True)
    for op in (softops.soft_sort, softops.soft_rank):
        out = op(x, epsilon=e, method="softsort")
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=F64)
        gx, ge = torch.autograd.grad(out, (x, e), g)
        assert torch.isfinite(gx).all() and torch.isfinite(ge).all(), (op.__name__, gx, ge)


def test_row_scale_is_a_power_of_two_that_leaves_small_rows_alone():
    eps = torch.ones(4, dtype=torch.float64)
    x = torch.tensor(
        [[0.5, -1.0], [3.0, 100.0], [1e200, -math.inf], [math.nan, 2.0]], dtype=torch.float64
    )
    s = _softsort.row_scale(x, eps, 1.0, 2.0)
    assert s.shape == (4, 1) and not s.requires_grad
    mantissa, _ = torch.frexp(s)
    assert (mantissa == 0.5).all()  # powers of two: x / s is exact
    assert s[0, 0] == 1.0  # max|x| <= 1: x / s is x
    assert 100.0 <= s[1, 0] < 256.0  # as large as max|x| (the backward stays in range)
    # far beyond the range the backward allows: capped so that |x| s / eps stays finite, and at
    # least what keeps the forward's sums of x / s below the dtype's largest value
    fmax = torch.finfo(torch.float64).max
    assert s[2, 0] * 1e200 < fmax and 1e200 / s[2, 0] * 4 * 2.0 < fmax
    assert s[3, 0] == 2.0  # NaN entries are left out: the scale of the finite 2
