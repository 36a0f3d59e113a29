"""smooth_max/min, soft_argmax/argmin and soft_argmax_onehot (Su 2019)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck, gradgradcheck

import softops
from softops import soft_kmax
from softops.smooth import smooth_max, smooth_min, soft_argmax, soft_argmax_onehot, soft_argmin
from tests._helpers import seeded

F64 = torch.float64
inf, nan = math.inf, math.nan

REDUCTIONS = [smooth_max, smooth_min, soft_argmax, soft_argmin]


def _hard_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros_like(x).scatter(-1, x.topk(k, -1).indices, 1)


def _distinct(B: int, n: int, seed: int = 0) -> torch.Tensor:
    """Rows of distinct entries, a gap of at least 4/n between any two."""
    g = seeded(seed)
    return torch.stack([torch.randperm(n, generator=g).to(F64) / n * 4 for _ in range(B)])


def _call(op, x, **kw):
    return op(x, 3, **kw) if op is soft_kmax else op(x, **kw)


ALL_OPS = [*REDUCTIONS, soft_argmax_onehot, soft_kmax]


# ----------------------------------------------------------------------------- reference values


def test_closed_forms():
    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64)
    e = 0.7
    torch.testing.assert_close(smooth_max(x, epsilon=e), e * torch.logsumexp(x / e, -1))
    torch.testing.assert_close(smooth_min(x, epsilon=e), -e * torch.logsumexp(-x / e, -1))
    p = torch.softmax(x / e, -1)
    torch.testing.assert_close(soft_argmax_onehot(x, epsilon=e), p)
    torch.testing.assert_close(soft_argmax(x, epsilon=e), (p * torch.arange(3.0)).sum(-1).double())
    q = torch.softmax(-x / e, -1)
    torch.testing.assert_close(soft_argmin(x, epsilon=e), (q * torch.arange(3.0)).sum(-1).double())
    # k = 1 is a single softmax of the shifted row: the onehot relaxation
    torch.testing.assert_close(soft_kmax(x, 1, epsilon=e), p)


# ----------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda f: f.__name__)
def test_gradcheck_x_and_per_row_epsilon(op):
    x = torch.randn(3, 6, 2, dtype=F64, generator=seeded(1), requires_grad=True)
    e = torch.tensor([[0.5], [1.3], [0.8]], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, e: _call(op, x, dim=1, epsilon=e), (x, e))


@pytest.mark.parametrize("op", [smooth_max, soft_argmax, soft_kmax], ids=lambda f: f.__name__)
def test_gradgradcheck(op):
    x = torch.randn(2, 5, dtype=F64, generator=seeded(2), requires_grad=True)
    e = torch.tensor(0.6, dtype=F64, requires_grad=True)
    assert gradgradcheck(lambda x, e: _call(op, x, epsilon=e), (x, e))


def test_gradients_of_the_closed_forms():
    x = torch.randn(3, 7, dtype=F64, generator=seeded(3), requires_grad=True)
    e = 0.4
    (g,) = torch.autograd.grad(smooth_max(x, epsilon=e).sum(), x)
    torch.testing.assert_close(g, torch.softmax(x / e, -1).detach())
    # d/d(eps) of smooth_max is the entropy of the softmax
    et = torch.tensor(e, dtype=F64, requires_grad=True)
    (ge,) = torch.autograd.grad(smooth_max(x.detach(), epsilon=et).sum(), et)
    p = torch.softmax(x.detach() / e, -1)
    torch.testing.assert_close(ge, -(p * p.log()).sum())


def test_hard_onehot_straight_through():
    x = torch.randn(4, 9, dtype=F64, generator=seeded(4), requires_grad=True)
    H = soft_argmax_onehot(x, epsilon=0.5, hard=True)
    assert torch.equal(H.detach(), F.one_hot(x.argmax(-1), 9).to(F64))
    g = torch.randn_like(H)
    (gh,) = torch.autograd.grad(H, x, g)
    (gs,) = torch.autograd.grad(soft_argmax_onehot(x, epsilon=0.5), x, g)
    torch.testing.assert_close(gh, gs)
    Hd = soft_argmax_onehot(x.detach().T, dim=0, hard=True)
    assert torch.equal(Hd, F.one_hot(x.detach().T.argmax(0), 9).movedim(-1, 0).to(F64))


# ---------------------------------------------------------------------------------- invariants


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    data=st.data(),
    scale=st.sampled_from([1e-3, 1.0, 1e4]),
    eps_rel=st.sampled_from([1e-6, 1e-2, 1.0, 100.0]),
)
def test_property_bounds(n, data, scale, eps_rel):
    # ties (integers in a small range), magnitudes over 7 decades, temperatures over 8
    vals = data.draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))
    k = data.draw(st.integers(0, n))
    x = torch.tensor(vals, dtype=F64) * scale
    e = eps_rel * scale
    sm = smooth_max(x, epsilon=e)
    assert x.max() <= sm <= x.max() + e * math.log(n) * (1 + 1e-12) + 1e-12 * scale
    sn = smooth_min(x, epsilon=e)
    assert x.min() - e * math.log(n) * (1 + 1e-12) - 1e-12 * scale <= sn <= x.min()
    for a in (soft_argmax(x, epsilon=e), soft_argmin(x, epsilon=e)):
        assert -1e-12 <= float(a) <= (n - 1) * (1 + 1e-12)
    p = soft_argmax_onehot(x, epsilon=e)
    assert bool((p >= 0).all()) and abs(float(p.sum()) - 1) < 1e-12
    P = soft_kmax(x, k, epsilon=e)
    assert bool(torch.isfinite(P).all()) and bool((P >= 0).all())
    assert abs(float(P.sum()) - k) <= 1e-9 * max(k, 1)


def test_hard_limits_as_epsilon_goes_to_zero():
    x = _distinct(6, 20)
    xs = x[:, :7]
    for op, hard in [
        (smooth_max, x.amax(-1)),
        (smooth_min, x.amin(-1)),
        (soft_argmax, x.argmax(-1).to(F64)),
        (soft_argmin, x.argmin(-1).to(F64)),
        (soft_argmax_onehot, F.one_hot(x.argmax(-1), 20).to(F64)),
    ]:
        errs = [float((op(x, epsilon=e) - hard).abs().max()) for e in (1.0, 0.1, 1e-3)]
        assert errs == sorted(errs, reverse=True), op.__name__
        assert errs[-1] < 1e-10, op.__name__
    # k < n and the k-th largest is above the minimum. (The error is not monotone at large
    # epsilon: for k = 6 it is larger at 0.1 than at 1.0, entries being 0.2 apart.)
    for k in (1, 3, 6):
        errs = [
            float((soft_kmax(xs, k, epsilon=e) - _hard_topk(xs, k)).abs().max())
            for e in (0.1, 1e-2, 1e-3)
        ]
        assert errs == sorted(errs, reverse=True)
        assert errs[-1] < 1e-10
    xt = _distinct(20, 6, seed=1).T  # distinct along dim 0
    H = soft_kmax(xt, 5, dim=0, epsilon=1e-3)
    torch.testing.assert_close(H, _hard_topk(xt.T, 5).T, atol=1e-10, rtol=0)


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda f: f.__name__)
def test_scaling_law_and_shift(op):
    x = torch.randn(3, 8, dtype=F64, generator=seeded(6))
    y = _call(op, x, epsilon=0.3)
    c = 4.0
    homogeneous = op in (smooth_max, smooth_min)
    torch.testing.assert_close(_call(op, c * x, epsilon=c * 0.3), c * y if homogeneous else y)
    shifted = _call(op, x + 12.5, epsilon=0.3)
    torch.testing.assert_close(shifted, y + 12.5 if homogeneous else y)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
@pytest.mark.parametrize("op", ALL_OPS, ids=lambda f: f.__name__)
def test_any_dim_equals_loop_over_rows(op, dim):
    x = torch.randn(4, 6, 5, dtype=F64, generator=seeded(7))
    out = _call(op, x, dim=dim, epsilon=0.4)
    xm = x.movedim(dim, -1)
    rows = xm.reshape(-1, xm.shape[-1])
    looped = torch.stack([_call(op, r, epsilon=0.4) for r in rows])
    if op in REDUCTIONS:
        torch.testing.assert_close(out, looped.reshape(xm.shape[:-1]))
        kept = _call(op, x, dim=dim, keepdim=True, epsilon=0.4)
        assert kept.shape == x.amax(dim, keepdim=True).shape
        torch.testing.assert_close(kept.squeeze(dim), out)
    else:
        torch.testing.assert_close(out, looped.reshape(xm.shape).movedim(-1, dim))


def test_per_row_epsilon_broadcasts_to_batch_shape():
    x = torch.randn(2, 3, 7, dtype=F64, generator=seeded(8))
    e = torch.tensor([[0.2, 0.5, 1.0], [2.0, 0.3, 0.7]], dtype=F64)
    for op in ALL_OPS:
        out = _call(op, x, epsilon=e)
        for i in range(2):
            for j in range(3):
                torch.testing.assert_close(out[i, j], _call(op, x[i, j], epsilon=float(e[i, j])))
    # a column of epsilons along dim 0 with dim=1
    col = torch.tensor([[0.3], [0.9]], dtype=F64)
    sm = smooth_max(x, dim=1, epsilon=col)
    torch.testing.assert_close(sm[1], smooth_max(x[1], dim=0, epsilon=0.9))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("op", ALL_OPS, ids=lambda f: f.__name__)
def test_dtype_and_device_preserved(op, dtype):
    x = torch.randn(3, 10, generator=seeded(9)).to(dtype)
    out = _call(op, x, epsilon=0.5)
    assert out.dtype == dtype and out.device == x.device
    if dtype in (torch.float16, torch.bfloat16):  # computed in float32, then cast back
        assert torch.equal(out, _call(op, x.float(), epsilon=0.5).to(dtype))


def test_fp16_gradient_and_empty_batch():
    x = torch.randn(3, 10, generator=seeded(10)).half().requires_grad_()
    P = soft_kmax(x, 4, epsilon=0.5)
    (g,) = torch.autograd.grad(P.float().pow(2).sum(), x)
    assert g.dtype == torch.float16 and bool(torch.isfinite(g).all())
    for op in ALL_OPS:
        out = _call(op, torch.zeros(0, 5))
        assert out.shape == ((0,) if op in REDUCTIONS else (0, 5))


# --------------------------------------------------------------------------- infinities and NaN


def test_smooth_max_infinities():
    x = torch.tensor(
        [[1.0, -inf, 2.0], [1.0, inf, 2.0], [-inf, -inf, -inf], [inf, inf, -inf], [nan, 1.0, 2.0]],
        dtype=F64,
        requires_grad=True,
    )
    v = smooth_max(x, epsilon=0.5)
    torch.testing.assert_close(v[0], smooth_max(torch.tensor([1.0, 2.0], dtype=F64), epsilon=0.5))
    assert v[1] == inf and v[2] == -inf and v[3] == inf and bool(torch.isnan(v[4]))
    w = smooth_min(-x, epsilon=0.5)
    assert w[1] == -inf and w[2] == inf and bool(torch.isnan(w[4]))
    (g,) = torch.autograd.grad(v[0], x)
    assert bool(torch.isfinite(g).all()) and g[0, 1] == 0
    torch.testing.assert_close(g[0, [0, 2]], torch.softmax(torch.tensor([2.0, 4.0]), 0).double())
    assert torch.equal(g[1:], torch.zeros_like(g[1:]))


def test_softmax_ops_infinities():
    x = torch.tensor(
        [
            [1.0, -inf, 2.0, 0.0],  # -inf gets 0
            [inf, 1.0, inf, 0.0],  # +inf entries share the mass
            [-inf, -inf, -inf, -inf],  # nothing to select: NaN
            [-inf, 3.0, -inf, -inf],  # a single finite entry: 1
        ],
        dtype=F64,
    )
    P = soft_argmax_onehot(x, epsilon=0.5)
    fin = torch.softmax(torch.tensor([1.0, 2.0, 0.0], dtype=F64) / 0.5, 0)
    torch.testing.assert_close(P[0], torch.stack([fin[0], fin.new_zeros(()), fin[1], fin[2]]))
    assert P[1].tolist() == [0.5, 0.0, 0.5, 0.0]
    assert bool(torch.isnan(P[2]).all())
    assert P[3].tolist() == [0.0, 1.0, 0.0, 0.0]
    a = soft_argmax(x, epsilon=0.5)
    assert a[1] == 1.0 and bool(torch.isnan(a[2])) and a[3] == 1.0  # mean of indices 0 and 2
    assert bool(torch.isnan(soft_argmin(-x)[2])) and soft_argmin(-x)[1] == 1.0
    H = soft_argmax_onehot(x, epsilon=0.5, hard=True)
    assert H[1].tolist() == [1.0, 0.0, 0.0, 0.0] and bool(torch.isnan(H[2]).all())


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda f: f.__name__)
def test_nan_stays_in_its_row(op):
    x = torch.randn(3, 8, dtype=F64, generator=seeded(11), requires_grad=True)
    with torch.no_grad():
        x[1, 4] = nan
    e = torch.tensor(0.7, dtype=F64, requires_grad=True)  # shared by all rows
    out = _call(op, x, epsilon=e)
    assert bool(torch.isnan(out[1]).all())
    assert bool(torch.isfinite(out[[0, 2]]).all())
    torch.testing.assert_close(out[[0, 2]], _call(op, x[[0, 2]].detach(), epsilon=0.7))
    gx, ge = torch.autograd.grad(out[[0, 2]].pow(2).sum(), (x, e), retain_graph=True)
    assert bool(torch.isfinite(gx).all()) and bool(torch.isfinite(ge))
    gx, ge = torch.autograd.grad(out.nan_to_num().sum(), (x, e))  # the NaN row's own gradient
    assert bool(torch.isfinite(gx).all()) and bool(torch.isfinite(ge))


# ---------------------------------------------------------------- soft_topk_mask(method="softkmax")


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda f: f.__name__)
def test_common_errors(op):
    name = op.__name__
    x = torch.randn(2, 5)
    with pytest.raises(TypeError, match=rf"{name}: expected `x` to have a real floating dtype"):
        _call(op, torch.arange(5))
    with pytest.raises(TypeError, match=rf"{name}: expected `x` to be a torch.Tensor; got list"):
        _call(op, [1.0, 2.0, 3.0])
    with pytest.raises(
        ValueError, match=rf"{name}: expected a non-empty `dim`; got x.shape\[1\] = 0"
    ):
        _call(op, torch.zeros(2, 0))
    with pytest.raises(
        ValueError, match=r"expected `dim` in \[-2, 1\] for x of shape \(2, 5\); got dim=2"
    ):
        _call(op, x, dim=2)
    with pytest.raises(TypeError, match=r"expected `dim` to be an int; got 1.0"):
        _call(op, x, dim=1.0)
    with pytest.raises(ValueError, match=r"at least 1 dimension; got a 0-dim tensor"):
        _call(op, torch.tensor(1.0))
    for bad in (0.0, -1.0, inf, nan):
        with pytest.raises(
            ValueError, match=rf"{name}: expected `epsilon` > 0 and finite; got epsilon="
        ):
            _call(op, x, epsilon=bad)
    with pytest.raises(ValueError, match=r"got epsilon=-0.5"):
        _call(op, x, epsilon=torch.tensor([0.5, -0.5]))
    with pytest.raises(TypeError, match=r"expected `epsilon` to be a float or a tensor; got '1'"):
        _call(op, x, epsilon="1")
    with pytest.raises(
        ValueError, match=r"broadcastable to the batch shape \(2,\).*got shape \(3,\)"
    ):
        _call(op, x, epsilon=torch.ones(3))
    with pytest.raises(TypeError, match=r"positional argument"):
        op(x, 3, -1) if op is soft_kmax else op(x, -1)


def test_flag_errors():
    x = torch.randn(2, 5)
    for op in REDUCTIONS:
        with pytest.raises(
            TypeError, match=rf"{op.__name__}: expected `keepdim` to be a bool; got keepdim=1"
        ):
            op(x, keepdim=1)
    with pytest.raises(
        TypeError, match=r"soft_argmax_onehot: expected `hard` to be a bool; got hard='y'"
    ):
        soft_argmax_onehot(x, hard="y")


# -------------------------------------------------------------------------------------- modules


# ------------------------------------------------ gradients at the extremes (adversarial suite)


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("row", "eps", "dtype"),
    [
        ([0.0, 1.0, 2.0, 3.0], 1e-30, torch.float32),  # eps**2 underflows: was 0 * inf = NaN
        ([0.0, 1.0, 2.0, 3.0], 1e-300, F64),
        ([inf, 0.0, 1e30, 1e-30], 1e-30, torch.float32),  # a +inf row: its plain path overflows
        ([1e300, 0.0, -1e300, 1.0], 1e-10, F64),
        ([3e38, 0.0, -3e38, 1.0], 1.0, torch.float32),  # x - max x overflows the dtype
    ],
)
def test_gradients_stay_finite_at_extreme_epsilon_and_spans(op, row, eps, dtype):
    x = torch.tensor([row], dtype=F64).to(dtype).requires_grad_()
    e = torch.tensor([eps], dtype=F64, requires_grad=True)
    out = _call(op, x, epsilon=e)
    g = torch.where(torch.isfinite(out), torch.ones_like(out), 0)
    gx, ge = torch.autograd.grad(out, (x, e), g)
    assert not torch.isnan(gx).any() and not torch.isnan(ge).any(), (gx, ge)
    if row == [0.0, 1.0, 2.0, 3.0]:  # the hard limit: saturated, epsilon has no effect
        assert (ge == 0).all()


def test_span_beyond_the_dtype_is_exact():
    # x - max x overflows float32 at -3e38 - 3e38; formed as (x/2 - m/2) * (2/eps) instead
    x = torch.tensor([1.5e38, -3e38, 1.4e38], dtype=torch.float32)
    e = 1e38
    ref = torch.softmax(x.double() / e, -1)
    torch.testing.assert_close(soft_argmax_onehot(x, epsilon=e).double(), ref, rtol=1e-4, atol=0)
    want = e * torch.logsumexp(x.double() / e, -1)
    torch.testing.assert_close(smooth_max(x, epsilon=e).double(), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("op", ["soft_argmax", "soft_argmin", "smooth_max", "soft_argmax_onehot"])
def test_kd27_one_over_epsilon_is_correctly_rounded_at_any_scale(op):
    """KD27 (found by the slow adversarial profile): 1/eps was exp(-log eps), whose rounding
    (about |log eps| units) every logit carried: soft_argmax(float32 [[8 tiny, 0]],
    epsilon=tiny) was 3.3534181e-4 where float64 gives 3.3535013e-4. Rows whose x / eps is
    exact (multiples of epsilon, a power of two) now give float64's values to float32's rounding
    at every scale of epsilon, and the same values at each scale (the scaling law)."""
    fn = getattr(softops, op)
    base = torch.tensor([[8.0, 0.0, -3.0, 5.5], [1.0, 2.0, 0.25, -7.0]], dtype=torch.float64)
    want = fn(base, epsilon=1.0)
    for eps in (torch.finfo(torch.float32).tiny, 2.0**-100, 2.0**60):
        x = (base * eps).float()
        out = fn(x, epsilon=eps)
        if op == "smooth_max":
            out = out.double() / eps
        torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=1e-9)
