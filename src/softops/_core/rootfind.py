"""Batched, bracketed Newton/bisection for monotone scalar equations, one per row.

Every row solves ``F(t) = 0`` for a non-increasing ``F`` with ``F(lo) >= 0 >= F(hi)``. All rows
advance in lock-step (no Python loop over rows). Each step is Newton's when it stays inside the
current bracket (compared inclusively: after the bracket update ``t`` is itself an endpoint) and a
bisection of the bracket otherwise, so the iteration always makes progress and always stops:
it is capped at ``max_iter`` evaluations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["RootResult", "bracketed_newton"]


class RootResult(NamedTuple):
    """Solution of a batch of scalar root-finding problems.

    Attributes:
        root: (B,) the last iterate of each row.
        converged: (B,) bool: ``|F(root)| <= tol``, or the step fell below the resolution.
        iterations: number of evaluations of ``F`` (the same for all rows).
        residual: (B,) ``F(root)``.
    """

    root: torch.Tensor
    converged: torch.Tensor
    iterations: int
    residual: torch.Tensor


Evaluate = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def bracketed_newton(
    evaluate: Evaluate,
    t: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    *,
    max_iter: int,
    eval_args: tuple[Any, ...] = (),
    f_lo: torch.Tensor | None = None,
    f_hi: torch.Tensor | None = None,
    done: torch.Tensor | None = None,
    block: int = 1,
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> RootResult:
    """Solve ``F(t) = 0`` per row by safeguarded Newton.

    A Newton step is taken when it lands inside the current bracket (inclusively). Otherwise the
    step is regula falsi with the Illinois modification between the bracket's ends, when their
    residuals (or bounds on them) are known, and bisection when they are not. For the counting
    functions of top-k at a tiny temperature, where the derivative vanishes between entries, the
    secant step is an interpolation search and needs far fewer steps than bisection.

    Steps run in blocks of ``block`` evaluations with no host synchronisation inside a block;
    ``all(done)`` is tested between blocks. Rows that are done keep their iterate, so a block that
    overshoots convergence changes nothing but the evaluation count.

    Args:
        evaluate: a pure function mapping ``(t, *eval_args)``, t (B,), to ``(F, dF, tol)``, each
            (B,): the residual, its derivative in t (<= 0) and the tolerance on ``|F|`` below
            which the row counts as solved. Pass a module-level function: blocks are cached per
            function, so that ``wrap`` (e.g. compilation) happens once.
        t: (B,) initial iterate, inside ``[lo, hi]``.
        lo, hi: (B,) bracket with ``F(lo) >= 0 >= F(hi)``.
        max_iter: cap on evaluations.
        eval_args: the extra arguments of ``evaluate``.
        f_lo, f_hi: (B,) ``F(lo)`` and ``F(hi)``, or upper bounds on their magnitudes; ``nan``
            or None where unknown.
        done: (B,) rows to leave alone (e.g. NaN rows); they count as not converged.
        block: evaluations between two host-side convergence tests.
        first: ``evaluate(t)`` when the caller already has it (it is not evaluated again and not
            counted in ``iterations``).
        wrap: applied to each block function (pure tensor code), e.g. to compile it.

    Returns:
        A :class:`RootResult`.
    """
    nan = torch.full_like(t, float("nan"))
    f_lo = nan if f_lo is None else f_lo
    f_hi = nan if f_hi is None else f_hi
    skip = torch.zeros_like(t, dtype=torch.bool) if done is None else done.clone()
    done = skip.clone()
    residual = nan
    side = torch.zeros_like(t)
    state: tuple[torch.Tensor, ...] = (t, lo, hi, f_lo, f_hi, side, done, residual)
    if first is not None:
        state = _update(t, *first, lo, hi, f_lo, f_hi, side, done, skip, residual)
    iterations = 0
    while iterations < max_iter and not bool(state[6].all()):
        steps = min(block, max_iter - iterations)
        run = _block(evaluate, steps)
        state = (run if wrap is None else wrap(run))(skip, eval_args, *state)
        iterations += steps
    t, done, residual = state[0], state[6], state[7]
    converged = done & ~skip & (residual == residual)
    return RootResult(t, converged, iterations, residual)


@functools.cache
def _block(evaluate: Evaluate, steps: int) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``steps`` evaluations and updates as one pure function (one stable object per key)."""

    def run(skip: torch.Tensor, eval_args: tuple[Any, ...], *state: torch.Tensor):
        t, lo, hi, f_lo, f_hi, side, done, residual = state
        for _ in range(steps):
            F, dF, tol = evaluate(t, *eval_args)
            t, lo, hi, f_lo, f_hi, side, done, residual = _update(
                t, F, dF, tol, lo, hi, f_lo, f_hi, side, done, skip, residual
            )
        return t, lo, hi, f_lo, f_hi, side, done, residual

    return run


def _update(
    t: torch.Tensor,
    F: torch.Tensor,
    dF: torch.Tensor,
    tol: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    f_lo: torch.Tensor,
    f_hi: torch.Tensor,
    side: torch.Tensor,
    done: torch.Tensor,
    skip: torch.Tensor,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """One safeguarded step, given ``F(t)``: tighten the bracket and pick the next iterate."""
    residual = torch.where(skip, residual, F)
    done = done | (F.abs() <= tol)
    up, down = F > 0, F < 0
    # Illinois: when the same end is replaced twice in a row, halve the other end's residual.
    f_hi = torch.where(up & (side > 0), 0.5 * f_hi, f_hi)
    f_lo = torch.where(down & (side < 0), 0.5 * f_lo, f_lo)
    lo, f_lo = torch.where(up, t, lo), torch.where(up, F, f_lo)
    hi, f_hi = torch.where(down, t, hi), torch.where(down, F, f_hi)
    side = up.to(t.dtype) - down.to(t.dtype)
    step = t - F / dF  # dF = 0 gives +-inf or nan, which the bracket test rejects
    inside = (step >= lo) & (step <= hi)
    secant = lo + (hi - lo) * (f_lo / (f_lo - f_hi))
    secant_ok = (secant > lo) & (secant < hi)  # nan (unknown ends) fails
    fallback = torch.where(secant_ok, secant, 0.5 * (lo + hi))
    step = torch.where(inside, step, fallback)
    # Resolution limit: the step rounds to t, or the bracket has shrunk to a few ulps of t.
    ulp = torch.finfo(t.dtype).eps
    width = hi - lo
    collapsed = (width <= 4 * ulp * torch.maximum(lo.abs(), hi.abs())) & width.isfinite()
    done = done | (step == t) | collapsed
    t = torch.where(done, t, step)
    return t, lo, hi, f_lo, f_hi, side, done, residual
