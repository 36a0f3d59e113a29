"""The private core used by every op: root finder, reshaping, validation, straight-through, fused
switch and the threshold solver's edge cases."""

from __future__ import annotations

import math

import pytest
import torch

import softops
from softops._core import fused
from softops._core.dims import flatten_to_2d, row_param
from softops._core.rootfind import bracketed_newton
from softops._core.straight_through import hard_topk_mask, straight_through
from softops._core.threshold import mask_from_threshold, solve
from softops._core.validation import (
    check_bool,
    check_choice,
    check_dim,
    check_epsilon,
    check_floating,
    check_k,
    check_max_iter,
    check_nonempty,
    check_tol,
    check_unused,
    compute_dtype,
)

F64 = torch.float64


# ------------------------------------------------------------------------------- root finder


def _cubic(t: torch.Tensor, c: torch.Tensor):
    """F(t) = c - t^3, decreasing."""
    return c - t**3, -3 * t**2, torch.full_like(t, 1e-12)


def _staircase(t: torch.Tensor, steps: torch.Tensor):
    """A counting function with zero derivative almost everywhere: #(steps > t) - 2.5.

    It never reaches the tolerance, so the solver must stop on the bracket collapsing onto the
    jump at 1.3."""
    F = (steps > t[:, None]).sum(-1).to(t.dtype) - 2.5
    return F, torch.zeros_like(t), torch.full_like(t, 0.4)


def test_bracketed_newton_solves_each_row_and_skips_masked_rows():
    c = torch.tensor([8.0, -27.0, 0.001, 5.0], dtype=F64)
    lo, hi = torch.full_like(c, -10.0), torch.full_like(c, 10.0)
    skip = torch.tensor([False, False, False, True])
    res = bracketed_newton(
        _cubic, torch.zeros_like(c), lo, hi, max_iter=100, eval_args=(c,), done=skip
    )
    torch.testing.assert_close(res.root[:3], c[:3].sign() * c[:3].abs() ** (1 / 3))
    assert res.converged.tolist() == [True, True, True, False]
    assert res.root[3] == 0 and math.isnan(res.residual[3])
    assert res.iterations < 60


def test_bracketed_newton_falls_back_when_the_derivative_vanishes_and_respects_the_cap():
    steps = torch.tensor([[0.1, 0.7, 1.3, 4.0, 9.0]], dtype=F64)
    one = torch.ones(1, dtype=F64)
    res = bracketed_newton(
        _staircase,
        0 * one,
        -one,
        10 * one,
        max_iter=60,
        eval_args=(steps,),
        f_lo=4.5 * one,
        f_hi=-2.5 * one,
    )
    assert bool(res.converged.all()) and abs(float(res.root) - 1.3) < 1e-12
    capped = bracketed_newton(_staircase, 0 * one, -one, 10 * one, max_iter=1, eval_args=(steps,))
    assert capped.iterations == 1 and not bool(capped.converged.all())
    blocked = bracketed_newton(
        _staircase, 0 * one, -one, 10 * one, max_iter=60, eval_args=(steps,), block=3
    )
    assert bool(blocked.converged.all()) and blocked.iterations % 3 == 0


# -------------------------------------------------------------------------------- reshaping


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


def test_row_param_broadcasts_and_rejects():
    shape = torch.Size([2, 3])
    assert row_param(0.5, shape, "op", "k", F64, torch.device("cpu")).tolist() == [0.5] * 6
    per_row = row_param(torch.tensor([[1.0], [2.0]]), shape, "op", "k", F64, torch.device("cpu"))
    assert per_row.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match=r"op: expected `k` to be a scalar or broadcastable"):
        row_param(torch.ones(4), shape, "op", "k", F64, torch.device("cpu"))


# ------------------------------------------------------------------------------- validation


def test_validation_messages_name_the_value():
    x = torch.zeros(2, 3)
    assert check_floating(x, "op") is x
    assert compute_dtype(torch.bfloat16) == torch.float32 and compute_dtype(F64) == F64
    assert check_dim(x, -1, "op") == 1 and check_nonempty(x, 1, "op") == 3
    assert check_epsilon(2, "op") == 2.0 and check_k(1.5, 3, "op") == 1.5
    assert check_k(2, 3, "op", low=1, integer=True) == 2
    assert check_choice("a", ("a", "b"), "op", "m") == "a"
    assert check_max_iter(None, 7, "op") == 7 and check_tol(None, 0.5, "op") == 0.5
    check_unused("op", "m", a=None)
    with pytest.raises(TypeError, match=r"op: expected `k` to be an int; got k=1.5"):
        check_k(1.5, 3, "op", integer=True)
    with pytest.raises(
        ValueError, match=r"op: expected 1 <= `k` <= x.shape\[dim\] \(= 3\); got k=0"
    ):
        check_k(0, 3, "op", low=1)
    with pytest.raises(ValueError, match=r"op: expected `epsilon` > 0 and finite; got epsilon=inf"):
        check_epsilon(math.inf, "op")
    with pytest.raises(ValueError, match=r"op: `b` is not used by method='m'; got b=3"):
        check_unused("op", "m", b=3)
    with pytest.raises(ValueError, match=r"op: expected `m` to be one of \('a',\); got m='c'"):
        check_choice("c", ("a",), "op", "m")
    with pytest.raises(ValueError, match=r"op: expected `dim` in \[-2, 1\]"):
        check_dim(x, 5, "op")
    with pytest.raises(ValueError, match=r"op: expected `max_iter` to be a positive int"):
        check_max_iter(-2, 7, "op")
    with pytest.raises(ValueError, match=r"op: expected `tol` >= 0 or None; got tol=-1"):
        check_tol(-1, 0.5, "op")


# ------------------------------------------------------------------------ straight-through


def test_straight_through_and_hard_mask():
    x = torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]], requires_grad=True)
    soft = x.softmax(-1)
    hard = hard_topk_mask(x.detach(), torch.tensor([1.0, 2.0]), None)
    assert hard.tolist() == [[1, 0, 0], [0, 1, 1]]
    assert torch.equal(
        hard_topk_mask(x.detach(), torch.tensor([2.0, 2.0]), 2),
        torch.tensor([[1.0, 0, 1], [0, 1, 1]]),
    )
    out = straight_through(hard, soft)
    assert torch.equal(out.detach(), hard)
    g = torch.randn(2, 3)
    (a,) = torch.autograd.grad(out, x, g, retain_graph=True)
    (b,) = torch.autograd.grad(soft, x, g)
    torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------ fused switch


def test_fused_switch_and_threshold():
    softops.set_compile(True)
    assert fused.compile_enabled()
    small = torch.zeros(4, 4)
    assert fused.maybe_fused(torch.sin, small) is torch.sin  # below FUSED_MIN_NUMEL: eager
    assert fused.maybe_fused(torch.sin, torch.zeros(fused.FUSED_MIN_NUMEL), False) is torch.sin
    softops.set_compile(False)
    assert not fused.compile_enabled()
    assert fused.maybe_fused(torch.sin, torch.zeros(fused.FUSED_MIN_NUMEL)) is torch.sin
    with pytest.raises(TypeError, match=r"set_compile: expected a bool; got 1"):
        softops.set_compile(1)


# ----------------------------------------------------------------------- threshold solver


def test_solve_long_rows_take_the_subsampled_path_and_match_the_exact_one():
    x = torch.randn(3, 40_000, dtype=F64)
    k = torch.full((3,), 400.0, dtype=F64)
    eps = torch.full((3,), 0.05, dtype=F64)
    state = solve(x, k, eps, k_scalar=400.0)
    assert bool(state.converged.all()) and state.iterations <= 12
    A = mask_from_threshold(x, state, eps)
    torch.testing.assert_close(A.sum(-1), k, atol=1e-9, rtol=0)
    # the same rows solved exactly (centre and bracket from the full top-k) give the same mask
    short = solve(x[:, :16_000], k, eps, k_scalar=400.0)
    assert bool(short.converged.all())


def test_solve_reports_unsolvable_rows():
    x = torch.tensor([[math.nan, 1.0, 2.0], [math.inf, math.inf, 0.0], [1.0, 2.0, 3.0]], dtype=F64)
    k = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
    state = solve(x, k, torch.full((3,), 0.1, dtype=F64))
    assert state.invalid.tolist() == [True, True, False]
    assert state.converged.tolist() == [False, False, True]
    assert math.isnan(state.residual[0]) and math.isnan(state.residual[1])


def test_check_bool() -> None:
    assert check_bool(True, "op", "flag") is True and check_bool(False, "op", "flag") is False
    for bad in (1, 0, "yes", None, torch.tensor(True)):
        with pytest.raises(TypeError, match=r"^op: expected `flag` to be a bool; got "):
            check_bool(bad, "op", "flag")
