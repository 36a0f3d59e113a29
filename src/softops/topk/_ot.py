r"""Method "ot" of ``soft_topk_mask``: the exact SOFT top-k, one threshold per row.

With two targets the entropic OT plan of SOFT top-k (Xie et al. 2020) is a sigmoid with one
threshold (docs/math.md §1.2), so the forward pass solves
:math:`\sum_i \sigma((x_i - t)/\varepsilon) = k` for every row of a (B, n) tensor, largest
first, by bracketed Halley steps (:mod:`softops._core.rootfind`; the bracket, the centring, the
cancellation-free residual and the log-domain polish near the hard limit are docs/math.md §1.3),
and the backward is the closed-form implicit gradient (``_SoftTopKMaskOT``, §1.4), O(n) per row:

.. math::

    s_i = A_i (1 - A_i)/\varepsilon, \qquad w = s / \textstyle\sum_i s_i, \qquad
    \bar x = s \odot \big(\bar A - \langle w, \bar A\rangle\big), \qquad
    \bar k = \langle w, \bar A\rangle .

The solve is the operator ``softops::ot_threshold`` (not differentiable, opaque to traced
code; a C++ kernel on the CPU, this module's torch code elsewhere and for the rows the kernel
leaves); the autograd Function carries the implicit gradient. Infinities are their limits; rows
whose k cannot be met are NaN.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.autograd import forward_ad

from softops._core.convergence import warn_not_converged
from softops._core.rootfind import (
    SolverState,
    fixed_schedule,
    iterate,
    result,
    run_steps,
    run_while,
    start_state,
)
from softops._core.transforms import apply_function, under_functorch, vmap_rows, without_jvp
from softops._kernels import Kernel, define
from softops.topk._options import THRESHOLD_MAX_ITER, MaskOptions

__all__ = [
    "EXACT_MAX_N",
    "ThresholdState",
    "balance_parts",
    "balance_step",
    "hard_topk_mask",
    "mask",
    "near_hard",
    "polish",
    "side_log_weights",
    "solve",
    "threshold_values",
]

EXACT_MAX_N = 16384
"""Rows up to this length are bracketed and centred by an exact ``torch.topk`` of k + 1 entries;
longer rows by a strided subsample of about ``SAMPLE_SIZE`` entries (the bracket stays exact)."""
SAMPLE_SIZE = 2048
FIRST_BLOCK = {torch.float32: 3, torch.float64: 4}
"""Evaluations before the first convergence test off the CPU (typical counts)."""
BLOCK = 2
"""Evaluations between two later convergence tests off the CPU (the CPU tests after each)."""
SMOOTH_START = 8
"""Start from the large-epsilon guess where ``SMOOTH_START * eps >= max x - min x``."""
SCALE_BITS = 40
"""Rows whose epsilon exceeds ``finfo.max / 2**SCALE_BITS`` are solved on ``(x c, eps c)`` for a
power of two ``c < 1`` (docs/math.md §1.3, "At the ends of the range")."""


@functools.lru_cache(maxsize=8)
def _scaling_limit(dtype: torch.dtype) -> float:
    """``finfo.max / 2**SCALE_BITS`` (once per dtype)."""
    return torch.finfo(dtype).max * 2.0**-SCALE_BITS


class ThresholdState(NamedTuple):
    """The solved threshold of each row, ``A = sigmoid(((x - m) - t) / eps)``, with diagnostics.

    ``t`` is the last evaluated iterate, whose ``sum A - k`` is ``residual``. ``sel_none``,
    ``sel_all``, ``invalid``: None when every row is regular, else (B,) masks of the rows that
    select only their ``+inf`` entries, all but their ``-inf`` ones, or that cannot be solved.
    ``scale``: None, or (B,) powers of two ``c`` where rows were solved on ``(x c, eps c)``
    (``m`` and ``t`` in those units).
    """

    m: torch.Tensor
    t: torch.Tensor
    converged: torch.Tensor
    iterations: int
    residual: torch.Tensor
    sel_none: torch.Tensor | None
    sel_all: torch.Tensor | None
    invalid: torch.Tensor | None
    scale: torch.Tensor | None = None


class _Prep(NamedTuple):
    """What the iteration needs of the rows: (B,) tensors (``m2`` (B, 1))."""

    m2: torch.Tensor
    k_total: torch.Tensor  # the residual's target: k, with the +inf entries counted
    solve_rows: torch.Tensor
    sel_none: torch.Tensor
    sel_all: torch.Tensor
    invalid: torch.Tensor


Reduce = Callable[[tuple[torch.Tensor, ...]], Sequence[torch.Tensor]]
"""How an evaluation totals its (B,) partial sums over the pieces of a row, in order (None: the
row is whole here; ``softops.distributed``: one all-reduce), possibly in a wider dtype."""


def _evaluate(
    x: torch.Tensor,
    m: torch.Tensor,
    t: torch.Tensor,
    eps: torch.Tensor,
    k: torch.Tensor,
    tol: float | torch.Tensor,
    reduce: Reduce | None = None,
    n: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """``F = sum A - k`` (without cancellation, docs/math.md §1.3), ``dF/dt``, the tolerance on
    ``|F|``, ``F''/F'``, ``A``, ``s = A (1 - A) / eps``, ``sum s`` (``inf`` where 0) and the count
    above t. Where ``x`` is a shard, ``reduce`` totals the row sums and ``n`` is the row's length.
    """
    em = torch.finfo(x.dtype).eps
    inv = 1 / eps  # per row: one division a row instead of one an entry
    z = ((x - m) - t) * inv
    u = torch.sigmoid(-z.abs())
    pos = z > 0
    d = u * (1 - u)
    c = (1 - 2 * u) * d  # (1 - 2A) d up to the sign of z
    sums: tuple[torch.Tensor, ...] = (
        torch.where(pos, -u, u).sum(-1),
        pos.sum(-1, dtype=x.dtype),
        d.sum(-1),
        torch.where(pos, -c, c).sum(-1),
        u.sum(-1),
    )
    if reduce is not None:
        sums = tuple(reduce(sums))
    signed, count, d_sum, c_sum, u_sum = sums
    F = signed + (count - k)  # count - k first
    e = eps.squeeze(-1)
    slope = d_sum / e
    curv = -c_sum / d_sum / e
    n = x.shape[-1] if n is None else n
    # the rounding floor follows sums below 1 (a k within rounding of 0 or n), down to where the
    # sigmoid flushes to 0 (each term resolved to about 1 / finfo.max)
    floor = torch.minimum(k, n - k).clamp(0, 1)
    flush = n / torch.finfo(x.dtype).max
    bound = 32 * em * torch.maximum(u_sum, floor) + 2 * em * slope * t.squeeze(-1).abs()
    bound = bound + flush + tol
    den = torch.where(slope > 0, slope, math.inf)  # <s, g> / den: 0 where every s is 0
    rows: tuple[torch.Tensor, ...] = (F, -slope, bound, curv, den, count)
    if F.dtype != x.dtype:  # (a reduction in a wider dtype)
        rows = tuple(v.to(x.dtype) for v in rows)
    F, dF, bound, curv, den, count = rows
    return F, dF, bound, curv, torch.where(pos, 1 - u, u), d * inv, den, count


def _evaluate_t(
    t: torch.Tensor,
    x: torch.Tensor,
    m: torch.Tensor,
    eps: torch.Tensor,
    k: torch.Tensor,
    tol: float | torch.Tensor,
    reduce: Reduce | None = None,
    n: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`_evaluate` for a (B,) iterate, the form the root finder calls."""
    return _evaluate(x, m, t[:, None], eps, k, tol, reduce, n)


def _row_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row min, max and sum in one pass (NaN propagates into all three)."""
    return x.amin(-1), x.amax(-1), x.sum(-1)


def _mask(x: torch.Tensor, m: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(((x - m) - t) / eps)


def _pad(lo: torch.Tensor, hi: torch.Tensor, eps: torch.Tensor):
    """Widen the bracket by a few ulps of the scale, within the finite range (an infinite end
    has no midpoint)."""
    fi = torch.finfo(lo.dtype)
    em, big = fi.eps, fi.max
    pad = 4 * em * (lo.abs() + hi.abs() + eps)
    return (lo - pad).clamp(min=-big), (hi + pad).clamp(max=big)


def _scale(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Per row, the power of two ``c`` of the solve on ``(x c, eps c)``: 1 where epsilon is within
    the scaling limit, else the largest ``c`` that brings epsilon and the half span below it."""
    finite = torch.isfinite(x)
    top = torch.where(finite, x, -math.inf).amax(-1)
    bottom = torch.where(finite, x, math.inf).amin(-1)
    return _scale_of(top, bottom, eps)


def _scale_of(top: torch.Tensor, bottom: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """:func:`_scale` from the rows' largest and smallest finite entries (B,)."""
    limit = _scaling_limit(eps.dtype)
    half = torch.where(top >= bottom, 0.5 * top - 0.5 * bottom, 0)  # (NaN rows: 0)
    size = torch.maximum(torch.nan_to_num(half, nan=0.0), eps)
    exponent = torch.frexp(size / limit).exponent
    c = torch.ldexp(torch.ones_like(eps), -exponent.clamp(min=0))
    return torch.where(eps > limit, c, 1)


POLISH_STEPS = 6
"""Cap on the log-domain Newton steps of a near-hard row (:func:`polish`; 1 or 2 typical)."""
NEAR_HARD = 32
"""Rows with ``sum u (1 - u) < NEAR_HARD * sqrt(finfo.eps)`` at the solution are near the hard
limit and polished (:func:`polish`)."""


def near_hard(d_sum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows whose ``sum u (1 - u)`` (B,) is below the near-hard limit (``NEAR_HARD``)."""
    return d_sum < NEAR_HARD * math.sqrt(torch.finfo(dtype).eps)


def balance_parts(off: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    r"""The six (B,) sums behind :func:`balance_step`, stacked (6, B), of the offsets ``off``
    (B, n): per side of t, its nearest distance ``a`` and the sums of ``u`` and ``u (1 - u)``
    shifted by ``exp(a / eps)`` (no underflow)."""
    B, n = off.shape
    a = off.abs()
    below = (off <= 0) & torch.isfinite(off)
    parts = []
    for side in (below, (off > 0) & torch.isfinite(off)):
        if n:
            near = torch.where(side, a, math.inf).amin(-1, keepdim=True)
        else:
            near = torch.full((B, 1), math.inf, dtype=off.dtype, device=off.device)
        shift = torch.where(torch.isfinite(near), near, 0)
        af = torch.where(side, a, shift)
        # log u + near/eps = -(a - near)/eps - softplus(-a/eps)
        term = torch.where(
            side, torch.exp(-((af - shift) / e) - torch.nn.functional.softplus(-(af / e))), 0
        )
        parts += [near.squeeze(-1), term.sum(-1), (term * torch.sigmoid(af / e)).sum(-1)]
    return torch.stack(parts)


def balance_step(
    parts: torch.Tensor, eps: torch.Tensor, c_below: torch.Tensor, c_above: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The log-domain Newton step on ``G = log L - log R`` (docs/math.md §1.3) from every
    shard's :func:`balance_parts` (P, 6, B): ``H = eps G``, ``t' - t`` (NaN where a side is
    empty) and the distances ``a_b``, ``a_a`` to the nearest entries."""
    out = []
    for i in (0, 3):
        nears = parts[:, i]
        lowest = nears.amin(0)
        factor = torch.where(torch.isfinite(nears), torch.exp(-(nears - lowest) / eps), 0)
        out += [lowest, (factor * parts[:, i + 1]).sum(0), (factor * parts[:, i + 2]).sum(0)]
    a_b, ub, db, a_a, ua, da = out
    sides = []
    for a, u, d, c in ((a_b, ub, db, c_below), (a_a, ua, da, c_above)):
        # eps log(u e^{-a/eps} + c), and D / L = d / (u + c e^{a/eps}) (0 once e^{a/eps} overflows)
        with_c = eps * torch.logaddexp(torch.log(u) - a / eps, torch.log(c))
        log_side = torch.where(c > 0, with_c, eps * torch.log(u) - a)
        grow = torch.where(c > 0, c * torch.exp(torch.where(c > 0, a, 0) / eps), 0)
        sides.append((log_side, d / (u + grow)))
    H = sides[0][0] - sides[1][0]
    return H, H / (sides[0][1] + sides[1][1]), a_b, a_a


def polish(
    balance: Any,
    t: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    eps: torch.Tensor,
    rows: torch.Tensor,
    gap: torch.Tensor,
) -> torch.Tensor:
    """Re-solve in the log domain the thresholds ``t`` (B,) of the near-hard ``rows``;
    ``balance(t)``: every shard's :func:`balance_parts`."""
    ulp = torch.finfo(t.dtype).eps
    c_below, c_above = gap.clamp(min=0).to(t.dtype), (-gap).clamp(min=0).to(t.dtype)
    active = rows
    for _ in range(POLISH_STEPS):
        H, step, a_b, a_a = balance_step(balance(t), eps, c_below, c_above)
        lo = torch.where(H > 0, t, torch.maximum(lo, t - a_b))
        hi = torch.where(H < 0, t, torch.minimum(hi, t + a_a))
        new = t + step
        new = torch.where((new >= lo) & (new <= hi), new, 0.5 * lo + 0.5 * hi)
        ok = active & torch.isfinite(new) & (H != 0)
        new = torch.where(ok, new, t)
        small = (new - t).abs() <= torch.maximum(2 * ulp * t.abs(), 2**-20 * eps)
        t = new
        active = ok & ~small
        if not bool(active.any()):
            break
    return t


def _row_counts(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row of ``x`` (B, n), n >= 1: the counts of finite, ``+inf`` and NaN entries (floats),
    the smallest finite entry (``inf``: none) and the sum of the finite ones."""
    dtype = x.dtype
    finite = torch.isfinite(x)
    n_fin = finite.sum(-1, dtype=dtype)
    n_pinf = (x == math.inf).sum(-1, dtype=dtype)
    n_nan = (x != x).sum(-1, dtype=dtype)
    bottom = torch.where(finite, x, math.inf).amin(-1)
    total = torch.where(finite, x, 0).sum(-1)
    return n_fin, n_pinf, n_nan, bottom, total


def _classify(
    k: torch.Tensor, n_fin: torch.Tensor, n_pinf: torch.Tensor, n_nan: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per row: ``kk`` (k' where solved, else half the count), ``k_eff`` (k less the ``+inf``
    count), the finite count (>= 1), ``solve_rows``, ``sel_none``, ``sel_all``, ``invalid``."""
    k_eff = k - n_pinf
    invalid = (n_nan > 0) | (k_eff < 0) | (k_eff > n_fin)
    sel_none = ~invalid & (k_eff <= 0)
    sel_all = ~invalid & (k_eff >= n_fin)
    solve_rows = ~(invalid | sel_none | sel_all)
    nn_ = n_fin.clamp(min=1)
    kk = torch.where(solve_rows, k_eff, 0.5 * nn_)
    return kk, k_eff, nn_, solve_rows, sel_none, sel_all, invalid


def _prepare_exact(
    x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor, top: int
) -> tuple[_Prep, SolverState]:
    """Row counts, the exact bracket from a ``topk`` of ``top >= floor(max k) + 1`` entries
    (clamped to n), and the start; branch-free."""
    counts = _row_counts(x)
    return _start_exact(k, eps, x.topk(top, dim=-1).values, *counts)


def _start_exact(
    k: torch.Tensor,
    eps: torch.Tensor,
    topv: torch.Tensor,
    n_fin: torch.Tensor,
    n_pinf: torch.Tensor,
    n_nan: torch.Tensor,
    bottom: torch.Tensor,
    total: torch.Tensor,
) -> tuple[_Prep, SolverState]:
    """:func:`_prepare_exact` from the whole row's :func:`_row_counts` and ``topv`` (B, top), its
    ``top`` largest entries in descending order."""
    top = topv.shape[-1]
    kk, k_eff, nn_, solve_rows, sel_none, sel_all, invalid = _classify(k, n_fin, n_pinf, n_nan)
    # the j-th largest finite entry is at n_pinf + j - 1 of the topk (no masked copy of x)
    j_hi = torch.ceil(kk).clamp(min=1)
    j_lo = torch.minimum(torch.floor(kk) + 1, nn_).clamp(min=1)

    def entry(j: torch.Tensor) -> torch.Tensor:
        index = (n_pinf + j - 1).clamp(0, top - 1).long()
        return topv.gather(-1, index[:, None]).squeeze(-1)

    x_hi, x_lo = entry(j_hi), entry(j_lo)
    zeros = torch.zeros_like(kk)
    m = torch.where(solve_rows, torch.add(0.5 * x_hi, x_lo, alpha=0.5), zeros)  # no overflow
    # logs of the numerator and denominator apart (a ratio of a subnormal k and n rounds to 0)
    lo = (x_lo - m) - eps * (torch.log(kk) - torch.log(j_lo - kk))
    hi = (x_hi - m) - eps * (torch.log(kk - (j_hi - 1)) - torch.log(nn_ - kk))
    lo, hi = _pad(torch.where(solve_rows, lo, zeros), torch.where(solve_rows, hi, zeros), eps)
    # The start: the centre, or the large-epsilon guess where epsilon is large for the row.
    xmean = total / nn_
    spread = entry(torch.ones_like(kk)) - bottom
    t_large = xmean - m - eps * (torch.log(kk) - torch.log(nn_ - kk))
    t0 = torch.where(SMOOTH_START * eps >= spread, t_large, zeros)
    t0 = torch.minimum(torch.maximum(t0, lo), hi)
    # bounds on the residual at the bracket's ends (against the total k, +inf entries counted)
    state = start_state(t0, lo, hi, f_lo=nn_ - kk, f_hi=-kk, done=~solve_rows)
    prep = _Prep(m[:, None], kk + (k - k_eff), solve_rows, sel_none, sel_all, invalid)
    return prep, state


def _sample_centre(
    sample: torch.Tensor,
    k: torch.Tensor,
    n: int,
    ns: int,
    top: int,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The midpoint of the subsample's q-th and (q+1)-th largest, ``q ~ k ns / n`` in [1, top -
    1] (``sample`` holds ``ns`` entries, then ``-inf``), clamped to ``bounds`` where given."""
    q = (k * (ns / n)).round().long().clamp(1, max(top - 1, 1))
    topv = sample.topk(top, dim=-1).values
    at, nxt = q - 1, q if top > 1 else q - 1
    m = torch.add(0.5 * topv.gather(-1, at[:, None]), topv.gather(-1, nxt[:, None]), alpha=0.5)
    m = m.squeeze(-1)
    if bounds is not None:
        m = torch.minimum(torch.maximum(m.nan_to_num(0.0), bounds[0]), bounds[1])
    return m


def _start_sampled(
    k: torch.Tensor,
    eps: torch.Tensor,
    n: int,
    sample: torch.Tensor,
    ns: int,
    top: int,
    xmin: torch.Tensor,
    xmax: torch.Tensor,
    total: torch.Tensor,
    counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[_Prep, SolverState]:
    """Long rows: centred on a subsample's quantile (:func:`_sample_centre`), with the bracket
    ``[min x, max x] - eps logit(k / n)``; ``counts``: None where every entry is finite."""
    if counts is None:
        sel_none, sel_all = k <= 0, k >= n
        solve_rows = ~(sel_none | sel_all)
        kk = k_total = torch.where(solve_rows, k, 0.5 * n)
        invalid = torch.zeros_like(solve_rows)
        nn_: float | torch.Tensor = n
    else:
        kk, k_eff, nn_, solve_rows, sel_none, sel_all, invalid = _classify(k, *counts)
        k_total = kk + (k - k_eff)
    logit_k = torch.log(kk) - torch.log(nn_ - kk)
    zeros = torch.zeros_like(kk)
    m = _sample_centre(sample, k_total, n, ns, top, None if counts is None else (xmin, xmax))
    m = torch.where(solve_rows, m, zeros)
    lo = torch.where(solve_rows, (xmin - m) - eps * logit_k, zeros)
    hi = torch.where(solve_rows, (xmax - m) - eps * logit_k, zeros)
    lo, hi = _pad(lo, hi, eps)
    # (the sum of a long row near the largest finite value can be inf - inf: then the centre)
    t_large = torch.nan_to_num(total / nn_ - m - eps * logit_k, nan=0.0)
    t_large = torch.minimum(torch.maximum(t_large, lo), hi)
    t2 = torch.stack((torch.minimum(torch.maximum(zeros, lo), hi), t_large), -1)
    F2 = _evaluate(
        sample[:, None, :],
        m[:, None, None],
        t2[..., None],
        eps[:, None, None],
        k_total[:, None] * (ns / n),
        0.0,
    )[0]
    t0 = t2.gather(-1, F2.abs().argmin(-1, keepdim=True)).squeeze(-1)
    state = start_state(t0, lo, hi, f_lo=nn_ - kk, f_hi=-kk, done=~solve_rows)
    return _Prep(m[:, None], k_total, solve_rows, sel_none, sel_all, invalid), state


def _start(
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    tol: float,
    top: int,
    steps: int,
    bisect: int = 0,
    stride: int = 0,
    row_stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    loop: bool = False,
) -> tuple[_Prep, SolverState, torch.Tensor, torch.Tensor]:
    """The preparation and the first ``steps`` Halley steps (``loop``: the capped schedule, for
    traced code), the flags the host reads, and the convergence."""
    if stride and row_stats is not None:
        sample = x[:, ::stride]
        n, ns = x.shape[-1], sample.shape[-1]
        prep, state = _start_sampled(k, eps, n, sample, ns, top, *row_stats)
    else:
        prep, state = _prepare_exact(x, k, eps, top)
    if loop:
        # a loop takes tensors, not (symbolic) floats, from its surroundings
        tol_t = torch.full((), tol, dtype=x.dtype, device=x.device)
        args_t = (x, prep.m2, eps[:, None], prep.k_total, tol_t)
        state = run_while(_evaluate_t, state, args_t, halley=steps, bisect=bisect)[0]
    else:
        args = (x, prep.m2, eps[:, None], prep.k_total, tol)
        state = run_steps(_evaluate_t, state, args, steps)
    ordinary = eps <= _scaling_limit(x.dtype)
    far = ~_near_rows(state, prep, eps) if state.extra else ordinary
    flags = torch.stack((state.done, prep.solve_rows, ordinary, far)).all(-1)
    return prep, state, flags, result(state, 0).converged


def _near_rows(state: SolverState, prep: _Prep, eps: torch.Tensor) -> torch.Tensor:
    """The converged rows near the hard limit at the last evaluation (:func:`near_hard`)."""
    den = state.extra[2]
    d_sum = torch.where(den < math.inf, den * eps, 0)
    return prep.solve_rows & state.done & near_hard(d_sum, den.dtype)


def _polish_rows(
    x: torch.Tensor,
    prep: _Prep,
    eps: torch.Tensor,
    state: SolverState,
    rows: torch.Tensor,
    tol: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`polish` of ``rows``: the new thresholds (B,) and :func:`_evaluate` there; ``gather``
    stacks every shard's :func:`balance_parts` where the row is split."""
    e2 = eps[:, None]
    gap = state.extra[3] - prep.k_total

    def balance(t: torch.Tensor) -> torch.Tensor:
        parts = balance_parts((x - prep.m2) - t[:, None], e2)
        return parts[None] if gather is None else gather(parts)

    t = polish(balance, state.t_eval, state.lo, state.hi, eps, rows, gap)
    return t, _evaluate(x, prep.m2, t[:, None], e2, prep.k_total, tol)


KERNEL = Kernel("softops_ot", Path(__file__).with_name("_ot_kernel.cpp"))
"""The CPU row kernel of the solve and of the backward in x."""


def _solve_kernel(
    solved: tuple[Any, ...],
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    max_iter: int,
    tol: float,
    k_scalar: float | None,
) -> tuple[ThresholdState, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """:func:`_solve` from the CPU row kernel's outputs ``solved`` (``threshold_rows``); the
    rows it left (a NaN or ``+inf``, a huge epsilon, an unreachable k, capped) are solved by the
    torch code and merged."""
    B = x.shape[0]
    A, s, aux, residual, _, status, evaluations, n_left, n_limit = solved
    converged = torch.ones(B, dtype=torch.bool, device=x.device)  # (a capped row is left)
    # the kernel's status: 0 solved, 1 left, else the limits (2: k = 0, 4: k = n_fin)
    sel_none = sel_all = invalid = None
    if n_limit or n_left:
        sel_none, sel_all = (status & 2) > 0, (status & 4) > 0
        invalid = torch.zeros_like(sel_none)
    if not n_left:
        m, t, _ = aux.unbind(1)
        state = ThresholdState(m, t, converged, evaluations, residual, sel_none, sel_all, invalid)
        return state, A, s, aux, True
    idx = (status == 1).nonzero().squeeze(-1)
    sub, A_r, s_r, aux_r, all_ok = _solve(x[idx], k[idx], eps[idx], max_iter, tol, k_scalar)
    A[idx], s[idx] = A_r, s_r
    aux[idx], residual[idx] = aux_r, sub.residual  # (the kernel's own tensors)
    m, t, _ = aux.unbind(1)
    converged[idx] = sub.converged
    limits: list[torch.Tensor] = []
    for whole, part in ((sel_none, sub.sel_none), (sel_all, sub.sel_all), (invalid, sub.invalid)):
        assert whole is not None  # (set above: some row is left)
        if part is not None:
            whole[idx] = part
        limits.append(whole)
    scale = None
    if sub.scale is not None:
        scale = torch.ones(B, dtype=x.dtype, device=x.device)
        scale[idx] = sub.scale
    sel_none, sel_all, invalid = limits
    iterations = max(evaluations, sub.iterations)
    state = ThresholdState(m, t, converged, iterations, residual, sel_none, sel_all, invalid, scale)
    return state, A, s, aux, all_ok


def _solve(
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    max_iter: int,
    tol: float,
    k_scalar: float | None,
) -> tuple[ThresholdState, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """:func:`solve`, the mask ``A``, ``s = A (1 - A) / eps``, ``aux`` (B, 3): m, t and ``sum s``
    (``inf`` where 0), and whether every row is known on the host to have converged."""
    n = x.shape[-1]
    dtype = x.dtype
    traced = torch.compiler.is_compiling()
    meta = x.device.type == "meta"
    # (not differentiated: the Function has the implicit backward)
    x, k, eps, tol = x.detach(), k.detach(), eps.detach(), tol or 0
    if k_scalar is not None and dtype == torch.float32:
        # the value the rows hold: a Python k in (0, n) can round to 0 or n in float32
        k_scalar = struct.unpack("f", struct.pack("f", k_scalar))[0]
    if k_scalar is not None:
        top = min(math.floor(k_scalar) + 1, n)
    elif traced or meta:
        top = n  # no host read of k: the whole row (a sort)
    else:
        top = min(int(k.max()) + 1, n) if k.numel() else 1
    top = max(top, 1)
    stride, stats = 0, None
    if n > EXACT_MAX_N and not (traced or meta):
        stats = _row_stats(x)
        if bool((torch.isfinite(stats[0]) & torch.isfinite(stats[1])).all()):
            stride = max(n // SAMPLE_SIZE, 1)
            ns = -(-n // stride)
            if k_scalar is not None:
                q_max = min(max(round(k_scalar * ns / n), 1), ns - 1)
            else:
                q_max = int((k.max() * (ns / n)).round().clamp(1, ns - 1))
            top = q_max + 1
    scale = None
    if traced or meta:  # no host read: every row is scaled (by 1 but where epsilon is huge)
        scale = _scale(x, eps)
        x, eps = x * scale[:, None], eps * scale
    if traced:
        steps, bisect = fixed_schedule(dtype, max_iter)
    elif meta:
        steps, bisect = 0, 0
    else:  # the eager path on a CPU tests after every evaluation (a host test is free there)
        host = x.device.type == "cpu"
        steps, bisect = min(1 if host else FIRST_BLOCK.get(dtype, 3), max_iter), 0
    prep, state, flags, converged = _start(
        x, k, eps, tol, top, steps, bisect, stride, stats, traced
    )
    evaluations = steps + bisect
    far, near = True, None  # no row near the hard limit (known on the host)
    if traced or meta:
        all_done, regular = False, False
    else:
        all_done, regular, ordinary, far = flags.tolist()
        if not ordinary:  # rare: solve again on (x c, eps c): the same mask, every offset in range
            scale = _scale(x, eps)
            x, eps = x * scale[:, None], eps * scale
            stats = None if stats is None else _row_stats(x)
            prep, state, flags, converged = _start(
                x, k, eps, tol, top, steps, bisect, stride, stats, traced
            )
            all_done, regular, _, far = flags.tolist()
    if not (traced or all_done):  # (on meta tensors, iterate returns at once)
        block = 1 if x.device.type == "cpu" else BLOCK
        args = (x, prep.m2, eps[:, None], prep.k_total, tol)
        state, evaluations = iterate(
            _evaluate_t, state, args, max_iter=max_iter, evaluations=evaluations, block=block
        )
        converged = result(state, evaluations).converged
        near = _near_rows(state, prep, eps) if state.extra else None
        far = near is None or not bool(near.any())
    m, root, residual = prep.m2.squeeze(-1), state.t_eval, state.residual
    if not far:  # (eager only) F cannot place t in its gap there; the gradients need it placed
        if near is None:  # (known from the start's flags)
            near = _near_rows(state, prep, eps)
        root, (residual, *_, A, w, w_sum, _) = _polish_rows(x, prep, eps, state, near, tol)
    elif state.extra:
        A, w, w_sum = state.extra[:3]
    else:  # meta tensors: nothing was evaluated
        A = _mask(x, prep.m2, root[:, None], eps[:, None])
        w = A * (1 - A) / eps[:, None]
        w_sum = w.sum(-1)
        w_sum = torch.where(w_sum > 0, w_sum, math.inf)
    if scale is not None:  # s = A (1 - A) / eps in the units of the caller's x
        w, w_sum = w * scale[:, None], w_sum * scale
    if regular:
        # every row done and none skipped: converged (a residual is finite on finite rows)
        out = ThresholdState(m, root, converged, evaluations, residual, None, None, None, scale)
        return out, A, w, torch.stack((m, root, w_sum), -1), all_done
    A, w, w_sum, residual, converged = _special_rows(prep, x, A, w, w_sum, residual, converged)
    out = ThresholdState(
        m, root, converged, evaluations, residual, prep.sel_none, prep.sel_all, prep.invalid, scale
    )
    return out, A, w, torch.stack((m, root, w_sum), -1), False


def _special_rows(
    prep: _Prep,
    x: torch.Tensor,
    A: torch.Tensor,
    w: torch.Tensor,
    w_sum: torch.Tensor,
    residual: torch.Tensor,
    converged: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The rows that are not solved, in the solve's outputs: filled exactly (``s`` 0, residual 0,
    converged), or NaN where they cannot be solved (not converged)."""
    solve_rows, invalid = prep.solve_rows, prep.invalid
    converged = converged | ~(solve_rows | invalid)
    residual = torch.where(solve_rows, residual, 0).masked_fill(invalid, math.nan)
    A = _fill_special(A, x, prep.sel_none, prep.sel_all, invalid)
    w = torch.where(solve_rows[:, None], w, 0).masked_fill(invalid[:, None], math.nan)
    w_sum = torch.where(solve_rows, w_sum, math.inf).masked_fill(invalid, math.nan)
    return A, w, w_sum, residual, converged


def solve(
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    *,
    max_iter: int = THRESHOLD_MAX_ITER,
    tol: float = 0.0,
    k_scalar: float | None = None,
) -> ThresholdState:
    """Solve the threshold of every row of ``x`` (B, n), largest first, for k (B,) in [0, n] and
    eps (B,) > 0; ``tol``: extra absolute tolerance on ``|sum A - k|``; ``k_scalar``: the common
    value of k when it is a Python number (saves a host sync)."""
    return _solve(x, k, eps, max_iter, tol, k_scalar)[0]


def _threshold_outputs(
    caller: str,
    max_iter: int,
    solved: tuple[ThresholdState, torch.Tensor, torch.Tensor, torch.Tensor, bool],
) -> tuple[torch.Tensor, ...]:
    """The operator's outputs, after the warning: A, s, aux, the rows at k = 0 (+1) or k = n (-1)
    (int8; no finite entry: +1), and the rows' scale (1 where not scaled)."""
    state, A, s, aux, all_ok = solved
    if not all_ok:  # rows that cannot be solved (NaN, unreachable k) are NaN by contract
        ok = state.converged if state.invalid is None else state.converged | state.invalid
        warn_not_converged(caller, ok, max_iter)
    B = A.shape[0]
    if state.sel_none is not None and state.sel_all is not None:
        edge = state.sel_none.to(torch.int8) - (state.sel_all & ~state.sel_none).to(torch.int8)
    else:
        edge = torch.zeros(B, dtype=torch.int8, device=A.device)
    scale = state.scale
    if scale is None:
        scale = torch.ones(B, dtype=A.dtype, device=A.device)
    return A, s, aux, edge, scale


def _threshold_reference(
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    max_iter: int,
    tol: float,
    k_scalar: float | None,
    caller: str,
) -> tuple[torch.Tensor, ...]:
    return _threshold_outputs(caller, max_iter, _solve(x, k, eps, max_iter, tol, k_scalar))


def _threshold_cpu(
    ops: Any,
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    max_iter: int,
    tol: float,
    k_scalar: float | None,
    caller: str,
) -> tuple[torch.Tensor, ...]:
    out = ops.threshold_rows(x, k, eps, float(tol), _scaling_limit(x.dtype), max_iter)
    A, s, aux, _, scale, status, _, n_left, n_limit = out
    if not (n_left or n_limit):  # every row solved: edge 0 (the status) and scale 1 as they are
        return A, s, aux, status, scale
    solved = _solve_kernel(out, x, k, eps, max_iter, tol, k_scalar)
    return _threshold_outputs(caller, max_iter, solved)


def _threshold_fake(x: torch.Tensor, *_: Any) -> tuple[torch.Tensor, ...]:
    B = x.shape[0]
    return (
        torch.empty_like(x),
        torch.empty_like(x),
        x.new_empty((B, 3)),
        x.new_empty((B,), dtype=torch.int8),
        x.new_empty((B,)),
    )


THRESHOLD_OP: Any = define(
    "softops::ot_threshold",
    "(Tensor x, Tensor k, Tensor eps, int max_iter, float tol, float? k_scalar, str caller)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    reference=_threshold_reference,
    fake=_threshold_fake,
    vmap=lambda info, in_dims, *args: vmap_rows(THRESHOLD_OP, info, in_dims, *args),
    cpu=_threshold_cpu,
    kernel=KERNEL,
)
"""The solve as an operator: (x, k, eps, max_iter, tol, k_scalar, caller) -> (A, s, aux, edge,
scale) (:func:`_threshold_outputs`); not differentiable."""


def threshold_values(
    t: torch.Tensor,
    scale: torch.Tensor | None,
    sel_none: torch.Tensor | None,
    sel_all: torch.Tensor | None,
    invalid: torch.Tensor | None,
) -> torch.Tensor:
    """The solved thresholds ``t`` (``m + t``) in the units of x; the rows that are not solved
    take the limits' (``+-inf``, 0 without a finite entry, NaN where k cannot be met)."""
    if scale is not None:
        t = t / scale
    if sel_none is None or sel_all is None or invalid is None:
        return t
    inf = torch.full_like(t, math.inf)
    t = torch.where(sel_none, inf, torch.where(sel_all, -inf, t))
    t = torch.where(sel_none & sel_all, 0.0, t)
    return t.masked_fill(invalid, math.nan)


def _fill_special(
    A: torch.Tensor,
    x: torch.Tensor,
    sel_none: torch.Tensor,
    sel_all: torch.Tensor,
    invalid: torch.Tensor,
) -> torch.Tensor:
    """The rows that are not solved, exactly: their +inf entries, all but -inf, or NaN."""
    A = torch.where(sel_none[:, None], (x == math.inf).to(x.dtype), A)
    A = torch.where(sel_all[:, None], (x > -math.inf).to(x.dtype), A)
    return A.masked_fill(invalid[:, None], math.nan)


def _vjp_x(A: torch.Tensor, g: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The backward in x as a differentiable function of ``A`` (double backward)."""
    s = A * (1 - A) / eps
    ss, sg = s.sum(-1, keepdim=True), (s * g).sum(-1, keepdim=True)
    return s * (g - torch.where(ss > 0, sg / torch.where(ss > 0, ss, 1), 0))


def _vjp_formula(s: torch.Tensor, aux: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``s * (g - <s, g> / sum s)``, ``sum s`` the last column of ``aux`` (``inf``: 0 there)."""
    return (g - torch.linalg.vecdot(s, g).unsqueeze(-1) / aux[:, 2:]) * s


def _vjp_cpu(ops: Any, s: torch.Tensor, aux: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if g.dtype != s.dtype or aux.dtype != s.dtype or not s.is_contiguous():
        return _vjp_formula(s, aux, g)
    return ops.vjp_rows(s, aux, g)  # one pass; an expanded g (a sum's gradient) is not copied


VJP_OP: Any = define(
    "softops::ot_vjp_rows",
    "(Tensor s, Tensor aux, Tensor g) -> Tensor",
    reference=_vjp_formula,
    fake=lambda s, aux, g: torch.empty_like(s),
    vmap=lambda info, in_dims, *args: vmap_rows(VJP_OP, info, in_dims, *args),
    cpu=_vjp_cpu,
    kernel=KERNEL,
)
"""The plain backward in x, ``s * (g - <s, g> / sum s)``, as an operator (not differentiable:
double backward uses the formula on the differentiable A)."""


def _offsets(
    x: torch.Tensor, aux: torch.Tensor, eps: torch.Tensor, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The solve's offsets ``(x - m) - t`` (B, n) and epsilon (B, 1), in its units."""
    if scale is not None:
        x, eps = x * scale[:, None], eps * scale[:, None]
    return (x - aux[:, :1]) - aux[:, 1:2], eps


def _offsets_differentiable(
    x: torch.Tensor,
    k: torch.Tensor,
    aux: torch.Tensor,
    eps: torch.Tensor,
    scale: torch.Tensor | None,
    A: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    r""":func:`_offsets` for double backward: the same values, with the threshold's first
    derivative ``dt = (<s, dx> - dk - <s, z> deps) / sum s`` on the graph."""
    X, E = (x, eps) if scale is None else (x * scale[:, None], eps * scale[:, None])
    Xc, Ec, Ac = X.detach(), E.detach(), A.detach()
    off0 = (Xc - aux[:, :1]) - aux[:, 1:2]
    s = Ac * (1 - Ac) / Ec
    live = s > 0
    z = torch.where(live, torch.where(live, off0, 0) / Ec, 0)
    dx = torch.where(torch.isfinite(Xc), X - Xc, 0)
    num = (s * dx).sum(-1, keepdim=True) - (s * z).sum(-1, keepdim=True) * (E - Ec)
    num = num - (k - k.detach())[:, None].to(num.dtype)
    ss = s.sum(-1, keepdim=True)
    dt = torch.where(ss > 0, num / torch.where(ss > 0, ss, 1), 0)
    return (X - aux[:, :1]) - (aux[:, 1:2] + dt), E


def side_log_weights(
    off: torch.Tensor, e: torch.Tensor, below: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``log u (1 - u)`` and ``log u`` (``u = sigmoid(-|off| / eps)``) of the offsets ``off``
    (B, n), each side of t (``below``, the rest) shifted by its nearest entry's ``|off| / eps``
    (no underflow); and the sides' nearest ``|off|`` (B, 1) (``inf``: an empty side)."""
    B, n = off.shape
    a = off.abs()
    fin = torch.isfinite(a)
    nears = [
        torch.where(side, a, math.inf).amin(-1, keepdim=True)
        if n
        else torch.full((B, 1), math.inf, dtype=off.dtype, device=off.device)
        for side in (below, fin & ~below)
    ]
    shift = torch.where(below, nears[0], nears[1])
    shift = torch.where(torch.isfinite(shift), shift, 0)
    # infinite offsets weigh 0; the double where keeps them out of the arithmetic, whose
    # derivative in epsilon (double backward) would be 0 * inf there
    af = torch.where(fin, a, shift)
    inner = -((af - shift) / e)
    sp = torch.nn.functional.softplus(-(af / e))
    logw = torch.where(fin, inner - 2 * sp, -math.inf)
    return logw, torch.where(fin, inner - sp, -math.inf), nears[0], nears[1]


def _k_weights(
    off: torch.Tensor,
    x: torch.Tensor,
    e: torch.Tensor,
    edge: torch.Tensor | None,
    k: torch.Tensor,
) -> torch.Tensor:
    r"""``w = s / sum(s)`` per row (``dA/dk``), normalised in the log domain (docs/math.md §1.4):
    each side relative to its nearest entry, the sides by the root's condition where the count
    above t is k; rows at k = 0 or n (``edge``) take the limits ``softmax(+-x / eps)``."""
    below = (off <= 0) & torch.isfinite(off)
    logw, log_u, near_b, near_a = side_log_weights(off, e, below)
    near_b = torch.where(torch.isfinite(near_b), near_b, 0)  # (an empty side)
    near_a = torch.where(torch.isfinite(near_a), near_a, 0)
    lu_b = torch.logsumexp(torch.where(below, log_u, -math.inf), -1, keepdim=True)
    lu_a = torch.logsumexp(torch.where(below, -math.inf, log_u), -1, keepdim=True)
    nearest = torch.minimum(near_b, near_a)
    # the root's condition U_a = U_b + (P - k): the sides' ratio is 1 + (P - k) / U_b, exactly 1
    # where the count P above t is k, and its derivatives (double backward) are those of that
    # identity: 0 along x and epsilon, -1 / U_b along k
    gap = (off > 0).sum(-1, keepdim=True, dtype=off.dtype) - k[:, None].to(off.dtype)
    balanced = (gap == 0) & torch.isfinite(lu_b) & torch.isfinite(lu_a)
    u_b = torch.exp(lu_b - torch.where(balanced, near_b, 0) / e)
    ratio = torch.log1p(torch.where(balanced, gap, 0) / torch.where(u_b > 0, u_b, 1))
    side_b = torch.where(balanced, -lu_b, -((near_b - nearest) / e))
    side_a = torch.where(balanced, ratio - lu_a, -((near_a - nearest) / e))
    logw = logw + torch.where(below, side_b, side_a)
    if edge is not None:
        finite = torch.isfinite(x)
        xf = torch.where(finite, x, 0)
        top = torch.where(finite, x, -math.inf).amax(-1, keepdim=True)
        bottom = torch.where(finite, x, math.inf).amin(-1, keepdim=True)
        up = torch.where(finite, (xf - top.nan_to_num(0, 0, 0)) / e, -math.inf)
        down = torch.where(finite, (bottom.nan_to_num(0, 0, 0) - xf) / e, -math.inf)
        side = edge[:, None]
        some = finite.any(-1, keepdim=True)
        logw = torch.where(side > 0, up, torch.where(side < 0, down, logw))
        w = torch.softmax(torch.where(some | (side == 0), logw, 0), -1)
        return torch.where(some | (side == 0), w, 0)
    return torch.softmax(logw, -1)


def _centred_z(
    off: torch.Tensor, e: torch.Tensor, s: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    r"""``z - <w, z>`` (``z = off / eps``) where ``s > 0``, else 0 (``dA/deps = -s (z - <w, z>)``),
    formed before dividing by epsilon (docs/math.md §1.4)."""
    mean = (w * torch.where(w > 0, off, 0)).sum(-1, keepdim=True)
    live = s > 0
    return torch.where(live, (torch.where(live, off, 0) - mean) / e, 0)


class _SoftTopKMaskOT(torch.autograd.Function):
    """A = sigmoid((x - t)/eps) with sum(A) = k per row (canonical rows, the outputs of
    :data:`THRESHOLD_OP`); the implicit O(n) backward and jvp."""

    @staticmethod
    def forward(
        x: torch.Tensor,
        k: torch.Tensor,
        eps: torch.Tensor,
        max_iter: int,
        tol: float,
        k_scalar: float | None,
        caller: str,
    ) -> tuple[torch.Tensor, ...]:
        return THRESHOLD_OP(x, k, eps, max_iter, tol, k_scalar, caller)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, k, eps = inputs[:3]
        A, s, aux, edge, scale = output
        ctx.mark_non_differentiable(s, aux, edge, scale)
        ctx.set_materialize_grads(False)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            ctx.save_for_backward(A, s, aux, eps, x, edge, scale, k)
        else:
            ctx.save_for_backward(A, s, aux, eps)
        ctx.save_for_forward(A, s, aux, eps, x, edge, scale, k)

    @staticmethod
    def backward(ctx: Any, gA: torch.Tensor | None, *_: Any) -> tuple[torch.Tensor | None, ...]:
        need_x, need_k, need_eps = ctx.needs_input_grad[:3]
        if gA is None:
            return None, None, None, None, None, None, None
        saved = ctx.saved_tensors
        A, s, aux, eps = saved[:4]
        if not (need_k or need_eps):
            if torch.is_grad_enabled():  # double backward: differentiable in A
                return _vjp_x(A, gA, eps[:, None]), None, None, None, None, None, None
            return VJP_OP(s, aux, gA), None, None, None, None, None, None
        x, edge, scale, k = saved[4:]
        e = eps[:, None]
        gx = gk = geps = None
        if torch.is_grad_enabled():  # double backward: s differentiable in A, t in (x, k, eps)
            s = A * (1 - A) / e
            off, es = _offsets_differentiable(x, k, aux, e, scale, A)
        else:
            off, es = _offsets(x, aux, e, scale)
        w = _k_weights(off, x, es, edge, k)
        ratio = (w * gA).sum(-1, keepdim=True)
        if need_x:
            gx = s * (gA - ratio)
        if need_k:
            gk = ratio.squeeze(-1)
        if need_eps:
            geps = -(gA * s * _centred_z(off, es, s, w)).sum(-1)
        return gx, gk, geps, None, None, None, None

    @staticmethod
    def jvp(
        ctx: Any,
        dx: torch.Tensor | None,
        dk: torch.Tensor | None,
        deps: torch.Tensor | None,
        *_: Any,
    ) -> tuple[torch.Tensor | None, ...]:
        r"""``dA = s * (u - <w, u>) + w dk`` with ``u = dx - z deps`` (the backward's transpose)."""
        A, s, aux, eps, x, edge, scale, k = ctx.saved_tensors
        if dk is None and deps is None:
            dA = torch.zeros_like(A) if dx is None else _vjp_formula(s, aux, dx)  # J = J^T
            return dA, None, None, None, None
        off, es = _offsets(x, aux, eps[:, None], scale)
        w = _k_weights(off, x, es, edge, k)
        dA = torch.zeros_like(A)
        if dx is not None:
            dA = s * (dx - (w * dx).sum(-1, keepdim=True))
        if deps is not None:
            dA = dA - s * _centred_z(off, es, s, w) * deps[:, None]
        if dk is not None:
            dA = dA + w * dk[:, None]
        return dA, None, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_rows(_SoftTopKMaskOT, info, in_dims, *args)


_SoftTopKMaskOTTraced = without_jvp(_SoftTopKMaskOT)


def mask(
    x2: torch.Tensor, k_row: torch.Tensor, eps_row: torch.Tensor, opts: MaskOptions
) -> torch.Tensor:
    """The mask A (B, n) of canonical rows, with the non-convergence warning."""
    args = (x2, k_row, eps_row, opts.max_iter, opts.tol, opts.k_scalar, opts.op)
    grads = torch.is_grad_enabled() and (
        x2.requires_grad or k_row.requires_grad or eps_row.requires_grad
    )
    if torch.compiler.is_compiling():
        return _SoftTopKMaskOTTraced.apply(*args)[0] if grads else THRESHOLD_OP(*args)[0]
    if grads or under_functorch() or forward_ad._current_level >= 0:
        return apply_function(_SoftTopKMaskOT, *args)[0]
    return THRESHOLD_OP(*args)[0]


def hard_topk_mask(x: torch.Tensor, k: torch.Tensor, k_scalar: int | None) -> torch.Tensor:
    """The 0/1 mask of the k (B,) largest entries of each row of ``x`` (B, n), ties as
    ``torch.topk``; ``k_scalar``: k's common value where known (no argsort)."""
    if k_scalar is not None:
        if k_scalar == 0:
            return torch.zeros_like(x)
        return torch.zeros_like(x).scatter_(-1, x.topk(k_scalar, dim=-1).indices, 1.0)
    order = x.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(x.shape[-1], device=x.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    return (rank < k[:, None]).to(x.dtype)
