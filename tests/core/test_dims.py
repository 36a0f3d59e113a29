"""Reshaping to (B, n) and back, per-row parameters and the one preamble (softops._core.dims)."""

from __future__ import annotations

import math

import pytest
import torch

import softops
from softops._core.dims import _SHARED_ROWS, constant_row, flatten_to_2d, prepare_rows, row_param

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


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("dim", [-1, 1])
def test_the_usual_call_takes_the_rows_as_the_general_path_forms_them(dtype, dim):
    # float rows (B, n) along the last dim with a float epsilon in [tiny, max] skip the checks
    # that cannot fail there: the same Rows as the general path (epsilon as a numpy float takes
    # it), x itself, no copy
    np = pytest.importorskip("numpy")
    fi = torch.finfo(dtype)
    x = torch.randn(3, 5, dtype=dtype, requires_grad=True)
    for eps in (0.25, fi.tiny, fi.max):
        fast = prepare_rows("op", x, dim, eps)
        general = prepare_rows("op", x, dim, np.float64(eps))
        assert fast.x2 is x and general.x2 is x
        assert torch.equal(fast.eps, general.eps) and fast.eps.dtype == dtype
        assert (fast.dim, fast.n, fast.batch_shape) == (general.dim, general.n, general.batch_shape)
        y = torch.randn(3, 2, dtype=dtype)
        assert torch.equal(fast.restore(y), general.restore(y))
    # the calls it does not take still check, move and clamp
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` > 0 and finite"):
        prepare_rows("op", x, dim, math.inf)
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` > 0 and finite"):
        prepare_rows("op", x, dim, math.nan)
    assert prepare_rows("op", x.detach().T.contiguous(), 0, 0.5).x2.shape == (3, 5)


# ---------------------------------------------------------------- epsilon beyond the dtype
# (every public op at such an epsilon: tests/test_contract.py::test_epsilon_outside_the_dtype)


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


def test_constant_row_is_made_once_per_key_and_never_written():
    # a number's row (an epsilon, a number k) is one cached tensor per (B, value, dtype, device)
    # in an eager call on plain data with at most _SHARED_ROWS rows, a fresh one otherwise; the
    # ops that take it never write into it
    x2 = torch.randn(5, 7)
    row = constant_row(x2, 0.25, F64)
    assert (
        row.shape == (5,)
        and row.dtype == F64
        and torch.equal(row, torch.full((5,), 0.25, dtype=F64))
    )
    assert constant_row(torch.zeros(5, 3), 0.25, F64) is row  # (B, value, dtype, device) only
    for other in (
        constant_row(x2, 0.5, F64),
        constant_row(x2, 0.25, torch.float32),
        constant_row(x2[:4], 0.25, F64),
    ):
        assert other is not row
    many = torch.zeros(_SHARED_ROWS + 1, 2)
    big = constant_row(many, 3.0, F64)
    assert big is not constant_row(many, 3.0, F64)  # (past the shared size: made per call)
    assert torch.equal(big, torch.full((_SHARED_ROWS + 1,), 3.0, dtype=F64))
    # under a transform the row is made per call, as a plain tensor of the batch's rows
    rows = torch.func.vmap(lambda t: constant_row(t, 0.25, F64).sum())(torch.randn(3, 5, 7))
    assert torch.equal(rows, torch.full((3,), 1.25, dtype=F64))
    # an op with a number epsilon and a number k leaves the cached rows as they were
    x = torch.randn(5, 7, dtype=F64, requires_grad=True)
    eps_row, k_row = constant_row(x, 0.1, F64), constant_row(x, 3, F64)
    softops.soft_topk_mask(x, 3, epsilon=0.1, method="ot").sum().backward()
    softops.soft_topk(x, 3, epsilon=0.1).values.sum().backward()
    assert torch.equal(eps_row, torch.full((5,), 0.1, dtype=F64))
    assert torch.equal(k_row, torch.full((5,), 3.0, dtype=F64))
