"""The threshold solves of "ot" and "sparse" on rows known by a summary and a reduction.

A row split across processes is known to each by a summary (counts, finite range and sum, and
candidates for the start) and a reduction that totals each evaluation's per-piece sums; given
both, the single-process solvers of ``_ot.py`` and ``_sparse.py`` run unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from softops._core.rootfind import iterate, result
from softops.topk._ot import (
    BLOCK,
    Reduce,
    _evaluate_t,
    _near_rows,
    _polish_rows,
    _row_counts,
    _sample_centre,
    _scale_of,
    _scaling_limit,
    _special_rows,
    _start_exact,
    _start_sampled,
)
from softops.topk._sparse import _ranked_pair, _solve_rows

__all__ = ["RowSummary", "ThresholdRows", "row_stats", "solve_ot_rows", "solve_sparse_rows"]

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every piece's tensor, stacked on a new leading dim (the polish's one exchange)."""


def row_stats(x: torch.Tensor) -> torch.Tensor:
    """(B, 6) float64 statistics of the rows (or pieces of rows) ``x`` (B, n_r): counts of
    finite, ``+inf`` and NaN entries, finite max, finite min, sum of the finite entries."""
    B, n_r = x.shape
    if not n_r:
        empty = torch.tensor([0.0, 0.0, 0.0, -math.inf, math.inf, 0.0], device=x.device)
        return empty.to(torch.float64).expand(B, 6)
    n_fin, n_pinf, n_nan, bottom, total = _row_counts(x)
    top = torch.where(torch.isfinite(x), x, -math.inf).amax(-1)
    return torch.stack((n_fin, n_pinf, n_nan, top, bottom, total), -1).to(torch.float64)


class RowSummary(NamedTuple):
    """What the solvers' start needs of each whole row (float64, (B,) but ``cand``)."""

    n_fin: torch.Tensor
    n_pinf: torch.Tensor
    n_nan: torch.Tensor
    top: torch.Tensor  # the largest finite entry (-inf: none)
    bottom: torch.Tensor  # the smallest finite entry (inf: none)
    total: torch.Tensor  # the sum of the finite entries
    cand: torch.Tensor  # (B, W): candidates, -inf padded
    exact: bool  # cand holds the row's ``depth`` largest (else a strided subsample)
    depth: int
    ns: int  # the subsample's size (else 0)

    def stats(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """n_fin, n_pinf, n_nan, max, min and sum in ``dtype``."""
        return tuple(
            v.to(dtype)
            for v in (self.n_fin, self.n_pinf, self.n_nan, self.top, self.bottom, self.total)
        )

    def sample_top(self, n: int, k_max: float) -> int:
        """The depth of the subsample's order statistics (``_ot._sample_centre``)."""
        ns = self.ns
        return min(max(round(k_max * ns / n), 1), ns - 1) + 1 if ns > 1 else 1


class ThresholdRows(NamedTuple):
    """The "ot" solve of every row: this piece's mask and backward weights, and per-row data."""

    A: torch.Tensor  # (B, n_r)
    s: torch.Tensor  # (B, n_r): A (1 - A) / eps, in the caller's units
    aux: torch.Tensor  # (B, 2): the centre m and the threshold t less m (solve units)
    edge: torch.Tensor  # (B,) int8: +1 rows at k' = 0, -1 rows at k' = n_fin, 0 else
    ext: torch.Tensor  # (B, 3): finite max, finite min, finite count (solve units)
    scale: torch.Tensor | None  # the power of two of rows solved on (x c, eps c)
    converged: torch.Tensor  # (B,) bool: filled rows have, rows that cannot be solved have not
    residual: torch.Tensor
    iterations: int
    sel_none: torch.Tensor  # (B,) bool: the rows at k' = 0 (as ``_ot.ThresholdState``)
    sel_all: torch.Tensor  # ... at k' = n_fin (a row without a finite entry is at both)
    invalid: torch.Tensor  # ... that cannot be solved (NaN)


def solve_ot_rows(
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    rows: RowSummary,
    *,
    n: int,
    k_max: float,
    eps_max: float,
    max_iter: int,
    tol: float,
    reduce: Reduce | None = None,
    gather: Gather | None = None,
) -> ThresholdRows:
    """Method "ot" on the piece ``x`` (B, n_r) of rows of length ``n``, largest first (``reduce``
    and ``gather`` None where the row is whole here)."""
    scale = None
    if eps_max > _scaling_limit(x.dtype):  # epsilon near finfo.max: solve (x c, eps c)
        scale = _scale_of(rows.top.to(x.dtype), rows.bottom.to(x.dtype), eps)
        c = scale.to(torch.float64)
        rows = rows._replace(
            top=rows.top * c,
            bottom=rows.bottom * c,
            total=rows.total * c,
            cand=rows.cand * c[:, None],
        )
        x, eps = x * scale[:, None], eps * scale
    n_fin, n_pinf, n_nan, top, bottom, total = rows.stats(x.dtype)
    if rows.exact:
        topv = rows.cand.topk(rows.depth, dim=-1).values.to(x.dtype)  # the row's largest
        prep, state = _start_exact(k, eps, topv, n_fin, n_pinf, n_nan, bottom, total)
    else:
        sample, q_top = rows.cand.to(x.dtype), rows.sample_top(n, k_max)
        counts = (n_fin, n_pinf, n_nan)
        prep, state = _start_sampled(k, eps, n, sample, rows.ns, q_top, bottom, top, total, counts)
    block = 1 if x.device.type == "cpu" else BLOCK
    args = (x, prep.m2, eps[:, None], prep.k_total, tol, reduce, n)
    state, evaluations = iterate(_evaluate_t, state, args, max_iter=max_iter, block=block)
    converged = result(state, evaluations).converged
    t = state.t_eval
    if state.extra:
        A, s, den = state.extra[:3]
        near = _near_rows(state, prep, eps)
        if bool(near.any()):  # (a host test every piece makes alike: on reduced sums)
            t, polished = _polish_rows(x, prep, eps, state, near, tol, gather)
            A, s = polished[4:6]
    else:  # every row is filled: nothing was evaluated
        A, s = torch.zeros_like(x), torch.zeros_like(x)
        den = torch.full_like(t, math.inf)
    A, s, _, residual, converged = _special_rows(prep, x, A, s, den, state.residual, converged)
    if scale is not None:  # s in the caller's units
        s = s * scale[:, None]
    sel_none, sel_all = prep.sel_none, prep.sel_all
    edge = sel_none.to(torch.int8) - (sel_all & ~sel_none).to(torch.int8)
    aux = torch.stack((prep.m2.squeeze(-1), t), -1)
    ext = torch.stack((rows.top, rows.bottom, rows.n_fin), -1).to(x.dtype)
    return ThresholdRows(
        A, s, aux, edge, ext, scale, converged, residual, evaluations, sel_none, sel_all,
        prep.invalid,
    )  # fmt: skip


def solve_sparse_rows(
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    rows: RowSummary,
    *,
    n: int,
    k_max: float,
    max_iter: int,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Method "sparse" on the piece ``x`` (B, n_r): ``(a, converged)``."""
    stats = rows.stats(x.dtype)
    if rows.exact:
        topv = rows.cand.topk(rows.depth, dim=-1).values.to(x.dtype)
        centre, x_lo = _ranked_pair(topv, k, n)
    else:
        sample, q_top = rows.cand.to(x.dtype), rows.sample_top(n, k_max)
        centre = _sample_centre(sample, k, n, rows.ns, q_top, (stats[4], stats[3]))
        x_lo = None
    a, converged = _solve_rows(x, k, eps, max_iter, stats, centre, x_lo, reduce)
    if converged is None:
        converged = torch.ones_like(k, dtype=torch.bool)
    return a, converged
