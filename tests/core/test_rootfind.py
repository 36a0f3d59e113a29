"""The batched, bracketed Newton root finder (softops._core.rootfind)."""

from __future__ import annotations

import math

import torch

from softops._core.rootfind import RootResult, iterate, result, start_state

F64 = torch.float64


def bracketed_newton(
    evaluate, t, lo, hi, *, max_iter, eval_args=(), f_lo=None, f_hi=None, done=None, block=1
) -> RootResult:
    """The whole solve: start_state, iterate (host tests every ``block`` evaluations), result."""
    state = start_state(t, lo, hi, f_lo=f_lo, f_hi=f_hi, done=done)
    return result(*iterate(evaluate, state, eval_args, max_iter=max_iter, block=block))


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
