"""Batched, bracketed Halley/Newton/bisection for monotone scalar equations, one per row.

Every row solves ``F(t) = 0`` for a non-increasing ``F`` with ``F(lo) >= 0 >= F(hi)``, all rows
in lock-step. Each step is Halley's where ``|F F''/F'^2| <= 1`` (else Newton's) when it stays
inside the bracket, and regula falsi or bisection otherwise, capped at ``max_iter`` evaluations.
:func:`iterate` runs blocks of steps with a host test between them, :func:`run_steps` a fixed
number, :func:`run_while` the provably sufficient :func:`fixed_schedule` for traced code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = [
    "RootResult",
    "SolverState",
    "bit_midpoint",
    "fixed_schedule",
    "iterate",
    "result",
    "run_steps",
    "run_while",
    "start_state",
]

HALLEY_STEPS = 8
"""Halley steps of :func:`fixed_schedule` before its bisection steps (2 to 5 are typical)."""


class RootResult(NamedTuple):
    """Solution of a batch of scalar root-finding problems: the last evaluated iterate of each
    row, whether ``|F(root)| <= tol`` (or the step fell below the resolution), the number of
    evaluations, ``F(root)`` and the evaluation's by-products there."""

    root: torch.Tensor
    converged: torch.Tensor
    iterations: int
    residual: torch.Tensor
    extra: tuple[torch.Tensor, ...] = ()


class SolverState(NamedTuple):
    """The iteration's state, per row: ``t`` the next iterate, ``t_eval`` the last evaluated one
    (with its ``residual`` and ``extra``), ``side`` the end that moved last (Illinois)."""

    t: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    f_lo: torch.Tensor
    f_hi: torch.Tensor
    side: torch.Tensor
    done: torch.Tensor
    skip: torch.Tensor
    t_eval: torch.Tensor
    residual: torch.Tensor
    extra: tuple[torch.Tensor, ...] = ()


Evaluate = Callable[..., tuple[Any, ...]]
"""``evaluate(t, *eval_args)`` returns ``(F, dF, tol)`` or ``(F, dF, tol, curv, *extra)``: the
residual, its derivative in t (<= 0), the tolerance on ``|F|``, optionally the curvature ratio
``F''/F'`` (None: Newton steps) and by-products to keep from the last evaluation."""


def start_state(
    t: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    *,
    f_lo: torch.Tensor | None = None,
    f_hi: torch.Tensor | None = None,
    done: torch.Tensor | None = None,
) -> SolverState:
    """The state before the first evaluation from ``t`` (B,) in the bracket ``[lo, hi]``;
    ``f_lo``, ``f_hi``: ``F`` at the ends (or bounds; None: unknown); ``done``: rows to leave
    alone (not converged)."""
    nan = torch.full_like(t, float("nan"))
    skip = torch.zeros_like(t, dtype=torch.bool) if done is None else done
    return SolverState(
        t,
        lo,
        hi,
        nan if f_lo is None else f_lo,
        nan if f_hi is None else f_hi,
        torch.zeros_like(t),
        skip,
        skip,
        t,
        nan,
    )


def run_steps(
    evaluate: Evaluate,
    state: SolverState,
    eval_args: tuple[Any, ...],
    steps: int,
    *,
    bisect: bool = False,
) -> SolverState:
    """``steps`` evaluations and updates, no host synchronisation; with ``bisect`` each is a bit
    bisection of the bracket (:func:`bit_midpoint`)."""
    for _ in range(steps):
        out = evaluate(state.t, *eval_args)
        F, dF, tol = out[:3]
        curv = out[3] if len(out) > 3 else None
        state = _update(state, F, dF, curv, tol, tuple(out[4:]), bisect)
    return state


def run_while(
    evaluate: Evaluate,
    state: SolverState,
    eval_args: tuple[Any, ...],
    *,
    halley: int,
    bisect: int,
) -> tuple[SolverState, torch.Tensor]:
    """The capped schedule of :func:`fixed_schedule` as ``torch.while_loop`` s, at least one
    evaluation: the state and the evaluation count, a 0-dim int64 tensor."""
    state = run_steps(evaluate, state, eval_args, 1)
    skip = state.skip
    count = torch.ones((), dtype=torch.int64, device=state.t.device)

    def pack(st: SolverState) -> tuple[torch.Tensor, ...]:
        return (st.t, st.lo, st.hi, st.f_lo, st.f_hi, st.side, st.done, st.t_eval, st.residual)

    def unpack(carried: tuple[torch.Tensor, ...]) -> SolverState:
        t, lo, hi, f_lo, f_hi, side, done, t_eval, residual = carried[:9]
        return SolverState(t, lo, hi, f_lo, f_hi, side, done, skip, t_eval, residual, carried[9:])

    for cap, bisecting in ((halley, False), (halley + bisect, True)):

        def cond(i: torch.Tensor, *carried: torch.Tensor, cap: int = cap) -> torch.Tensor:
            return (i < cap) & ~carried[6].all()

        def body(
            i: torch.Tensor, *carried: torch.Tensor, bisecting: bool = bisecting
        ) -> tuple[torch.Tensor, ...]:
            st = run_steps(evaluate, unpack(carried), eval_args, 1, bisect=bisecting)
            # a loop's outputs may not alias its inputs (t_eval is the input t)
            inputs = {id(c) for c in carried}
            out = (*pack(st), *st.extra)
            return (i + 1, *(o.clone() if id(o) in inputs else o for o in out))

        count, *carried = torch.while_loop(cond, body, (count, *pack(state), *state.extra))
        state = unpack(tuple(carried))
    return state, count


def iterate(
    evaluate: Evaluate,
    state: SolverState,
    eval_args: tuple[Any, ...],
    *,
    max_iter: int,
    evaluations: int = 0,
    block: int = 1,
) -> tuple[SolverState, int]:
    """Blocks of :func:`run_steps`, tested on the host between them, until every row is done or
    ``max_iter`` evaluations are spent: the state and the number of evaluations."""
    if state.t.device.type == "meta":
        return state, evaluations
    while evaluations < max_iter and not bool(state.done.all()):
        steps = min(block, max_iter - evaluations)
        state = run_steps(evaluate, state, eval_args, steps)
        evaluations += steps
    return state, evaluations


def result(state: SolverState, evaluations: int) -> RootResult:
    """The :class:`RootResult` of a state after ``evaluations`` evaluations."""
    converged = state.done & ~state.skip & (state.residual == state.residual)
    return RootResult(state.t_eval, converged, evaluations, state.residual, state.extra)


def fixed_schedule(dtype: torch.dtype, max_iter: int) -> tuple[int, int]:
    """``(halley, bisect)`` step counts of a sync-free solve that provably converges (``bits``
    bit bisections leave two adjacent floats), cut to fit ``max_iter``."""
    bits = torch.finfo(dtype).bits
    halley = min(HALLEY_STEPS, max_iter)
    return halley, min(bits, max_iter - halley)


_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


def _flip(bits: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude bits to integers that sort as the floats do, and back (an involution)."""
    info = torch.iinfo(bits.dtype)
    return bits ^ ((bits >> (info.bits - 1)) & info.max)


def bit_midpoint(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The float halfway between ``lo <= hi`` in the order of the representable floats (``lo``
    where they are equal or adjacent; -0.0 and +0.0 count as two adjacent floats)."""
    itype = _INT[lo.dtype]
    a, b = _flip(lo.view(itype)), _flip(hi.view(itype))
    mid = (a >> 1) + (b >> 1) + (a & b & 1)  # floor((a + b) / 2) without overflow
    return _flip(mid).view(lo.dtype)


def _update(
    state: SolverState,
    F: torch.Tensor,
    dF: torch.Tensor,
    curv: torch.Tensor | None,
    tol: torch.Tensor,
    extra: tuple[torch.Tensor, ...],
    bisect: bool,
) -> SolverState:
    """One safeguarded step, given ``F(t)``: tighten the bracket and pick the next iterate."""
    t, lo, hi, f_lo, f_hi, side, done, skip, _, residual, _ = state
    residual = torch.where(skip, residual, F)
    done = done | (F.abs() <= tol)
    up, down = F > 0, F < 0
    # Illinois: when the same end is replaced twice in a row, halve the other end's residual.
    f_hi = torch.where(up & (side > 0), 0.5 * f_hi, f_hi)
    f_lo = torch.where(down & (side < 0), 0.5 * f_lo, f_lo)
    lo, f_lo = torch.where(up, t, lo), torch.where(up, F, f_lo)
    hi, f_hi = torch.where(down, t, hi), torch.where(down, F, f_hi)
    side = up.to(t.dtype) - down.to(t.dtype)
    if bisect:
        step = bit_midpoint(lo, hi)
    else:
        newton = F / dF  # dF = 0 gives +-inf or nan, which the bracket test rejects
        if curv is not None:
            # Halley: the Newton step over 1 - L/2, L = F F''/F'^2, where |L| <= 1 (else Newton's)
            L = newton * curv
            newton = newton / torch.where(L.abs() <= 1, 1 - 0.5 * L, 1.0)
        step = t - newton
        # (a derivative that overflowed, F' = -inf where epsilon is within n / finfo.max of 0 in
        # t's units, gives a Newton step of 0: no step, not the resolution limit below)
        inside = (step >= lo) & (step <= hi) & dF.isfinite()
        secant = lo + (hi - lo) * (f_lo / (f_lo - f_hi))
        secant_ok = (secant > lo) & (secant < hi)  # nan (unknown ends) fails
        fallback = torch.where(secant_ok, secant, 0.5 * (lo + hi))
        step = torch.where(inside, step, fallback)
    # Resolution limit: the step rounds to t, or the bracket has shrunk to a few ulps of t, or to
    # two adjacent floats (near 0, where a few ulps of the ends are far below one of the scale).
    ulp = torch.finfo(t.dtype).eps
    width = hi - lo
    collapsed = (width <= 4 * ulp * torch.maximum(lo.abs(), hi.abs())) & width.isfinite()
    collapsed = collapsed | (torch.nextafter(lo, hi) >= hi)
    done = done | (step == t) | collapsed
    # A done row keeps its iterate, so its by-products of this evaluation are those of t_eval.
    return SolverState(
        torch.where(done, t, step), lo, hi, f_lo, f_hi, side, done, skip, t, residual, extra
    )
