"""Reshaping to (B, n) and back, per-row parameters and the one preamble (softops._core.dims)."""

from __future__ import annotations

import math

import pytest
import torch

from softops._core.dims import flatten_to_2d, prepare_rows, row_param

F64 = torch.float64


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_flatten_to_2d_round_trip_and_new_lengths(dim):
    x = torch.randn(2, 3, 4)
    x2, restore = flatten_to_2d(x, dim)
    assert x2.shape == (x.numel() // x.shape[dim], x.shape[dim])
    assert torch.equal(restore(x2), x)
    y = restore(x2[:, :1])  # a new length along dim (e.g. k)
    assert y.shape[dim] == 1 and torch.equal(y, x.narrow(dim, 0, 1))
    w = restore(x2[:, :2, None].expand(-1, -1, 5))  # a trailing axis stays last
    assert w.shape == (*x.narrow(dim, 0, 2).shape, 5)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_flatten_to_2d_of_an_empty_dim(dim):
    # an empty shard along dim (the sharded ops): B rows of 0 entries, not an ambiguous reshape
    shape = [2, 3, 4]
    shape[dim] = 0
    x = torch.zeros(shape)
    x2, restore = flatten_to_2d(x, dim)
    assert x2.shape == (math.prod(shape[:dim] + shape[dim + 1 :]), 0)
    assert restore(x2).shape == x.shape


def test_row_param_broadcasts_and_rejects():
    shape = torch.Size([2, 3])
    assert row_param(0.5, shape, "op", "k", F64, torch.device("cpu")).tolist() == [0.5] * 6
    per_row = row_param(torch.tensor([[1.0], [2.0]]), shape, "op", "k", F64, torch.device("cpu"))
    assert per_row.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match=r"op: expected `k` to be a scalar or broadcastable"):
        row_param(torch.ones(4), shape, "op", "k", F64, torch.device("cpu"))


def test_prepare_rows_moves_dim_last_in_the_compute_dtype_and_restores():
    x = torch.randn(2, 5, 3, dtype=torch.float16)
    rows = prepare_rows("op", x, 1, torch.tensor([[0.5], [2.0]]))
    assert rows.x2.shape == (6, 5) and rows.x2.dtype == torch.float32
    assert rows.dim == 1 and rows.n == 5 and rows.batch_shape == (2, 3)
    assert rows.eps.tolist() == [0.5] * 3 + [2.0] * 3
    assert torch.equal(rows.restore(rows.x2).to(x.dtype), x)
    assert rows.param(2, "op", "k").tolist() == [2.0] * 6


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        (
            (torch.zeros(3, dtype=torch.int64), -1, 1.0),
            TypeError,
            r"^op: expected `x` to have a real",
        ),
        ((torch.zeros(2, 3), 2, 1.0), ValueError, r"^op: expected `dim` in \[-2, 1\]"),
        ((torch.zeros(2, 0), -1, 1.0), ValueError, r"^op: expected a non-empty `dim`"),
        ((torch.zeros(2, 3), -1, 0.0), ValueError, r"^op: expected `epsilon` > 0 and finite; got"),
        ((torch.zeros(2, 3), -1, torch.ones(3)), ValueError, r"^op: expected `epsilon` to be a sc"),
    ],
)
def test_prepare_rows_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        prepare_rows("op", *args)


# ---------------------------------------------------------------- epsilon beyond the dtype's range

_X = [0.3, -1.2, 0.8, 2.0, -0.4]
_HARD_MASK = [0.0, 0.0, 1.0, 1.0, 0.0]  # k = 2


def _epsilon_ops():
    """Every public op that takes epsilon, from softops.__all__, with its hard (epsilon -> 0)
    value on _X where the op has one, and whether its value grows with epsilon (smooth_max)."""
    import softops

    x = torch.tensor(_X, dtype=F64)
    srt = x.sort().values
    ranks = x.argsort().argsort().to(F64) + 1
    ops = {
        "smooth_max": (lambda x, e: softops.smooth_max(x, epsilon=e), x.max()),
        "smooth_min": (lambda x, e: softops.smooth_min(x, epsilon=e), x.min()),
        "soft_argmax": (lambda x, e: softops.soft_argmax(x, epsilon=e), torch.tensor(3.0)),
        "soft_argmin": (lambda x, e: softops.soft_argmin(x, epsilon=e), torch.tensor(1.0)),
        "soft_argmax_onehot": (
            lambda x, e: softops.soft_argmax_onehot(x, epsilon=e),
            torch.tensor([0.0, 0, 0, 1, 0]),
        ),
        "soft_kmax": (lambda x, e: softops.soft_kmax(x, 2, epsilon=e), torch.tensor(_HARD_MASK)),
        "soft_topk": (lambda x, e: softops.soft_topk(x, 2, epsilon=e).values, x.topk(2).values),
        "soft_sort": (lambda x, e: softops.soft_sort(x, epsilon=e), srt),
        "soft_rank": (lambda x, e: softops.soft_rank(x, epsilon=e), ranks),
        "soft_argsort": (lambda x, e: softops.soft_argsort(x, epsilon=e), None),
        "soft_quantile": (lambda x, e: softops.soft_quantile(x, 0.5, epsilon=e), None),
    }
    for method in ("ot", "sinkhorn", "softkmax", "perturbed", "sparse"):
        ops[f"soft_topk_mask[{method}]"] = (
            lambda x, e, m=method: softops.soft_topk_mask(x, 2, epsilon=e, method=m),
            torch.tensor(_HARD_MASK),
        )
    public = {name.split("[")[0] for name in ops}
    import inspect

    takes_epsilon = {
        name
        for name in softops.__all__
        if inspect.isfunction(getattr(softops, name))
        and "epsilon" in inspect.signature(getattr(softops, name)).parameters
    }
    assert takes_epsilon <= public, takes_epsilon - public  # a new op must be listed here
    return ops


_OPS = _epsilon_ops()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("epsilon", [1e-50, 1e-320, 1e39, 1e300])
@pytest.mark.parametrize("name", sorted(_OPS))
def test_epsilon_outside_the_dtype_takes_the_limit(name, epsilon, dtype):
    # epsilon is a valid positive float that the compute dtype cannot hold: above its largest
    # finite value every op takes its limit, never NaN; below its smallest normal number (it
    # underflows to 0, or is a subnormal) every op refuses it (softops._core.validation).
    import warnings

    fn, hard = _OPS[name]
    x = torch.tensor(_X, dtype=dtype, requires_grad=True)
    tiny = torch.finfo(torch.promote_types(dtype, torch.float32)).tiny
    if epsilon < tiny:
        with pytest.raises(ValueError, match=r": expected `epsilon` >= [0-9.e+-]+ \(the smal"):
            fn(x, epsilon)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a convergence note at the limit is not the point here
        out = fn(x, epsilon)
    assert out.dtype == dtype
    grows = name in ("smooth_max", "smooth_min")  # the value is max + O(epsilon log n)
    if grows and epsilon > 1:
        assert not out.isnan().any()
    else:
        assert torch.isfinite(out).all(), out
    if epsilon < 1 and hard is not None:
        tol = 1e-6 if dtype == F64 else 1e-2
        torch.testing.assert_close(out.detach().double(), hard.double(), atol=tol, rtol=tol)
    if epsilon > 1 and name.startswith("soft_topk_mask") and "kmax" not in name:
        if "perturbed" not in name:
            uniform = torch.full((5,), 0.4, dtype=F64)
            tol = 1e-6 if dtype in (torch.float32, F64) else 1e-2
            torch.testing.assert_close(out.detach().double(), uniform, atol=tol, rtol=0)
    if dtype in (torch.float32, F64) and out.requires_grad:
        (g,) = torch.autograd.grad(out.sum(), x)
        assert not g.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_epsilon_is_clamped_to_the_largest_and_refused_below_the_smallest_normal(dtype):
    fi = torch.finfo(dtype)
    x = torch.zeros(2, 3, dtype=dtype)
    assert prepare_rows("op", x, -1, fi.tiny).eps.tolist() == [fi.tiny] * 2
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` >= .*; got epsilon=1e-320\.$"):
        prepare_rows("op", x, -1, 1e-320)
    assert prepare_rows("op", x, -1, 1e300 if dtype != F64 else 1e308).eps.min() <= fi.max
    e = torch.tensor([1e-30, 1e39], dtype=F64, requires_grad=True)
    rows = prepare_rows("op", x, -1, e)
    assert torch.isfinite(rows.eps).all() and (rows.eps > 0).all()
    (g,) = torch.autograd.grad(rows.eps.sum(), e)
    # 1e39 is beyond float32 (a zero gradient: the limit's); float64 holds both
    assert g.tolist() == ([1.0, 0.0] if dtype == torch.float32 else [1.0, 1.0])
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` >= "):
        prepare_rows(
            "op", x, -1, torch.tensor([1e-30, 1e-40 if dtype != F64 else 1e-310], dtype=F64)
        )
