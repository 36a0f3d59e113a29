r"""Optimal-transport backend (Cuturi, Teboul and Vert, NeurIPS 2019, arXiv:1905.11885): soft sort,
rank and argsort by entropic OT (docs/math.md §4).

A backend of :mod:`softops.sort` (the one signature of ``softops.sort._dispatch``; no
validation); ``opts.max_iter`` / ``opts.tol`` None mean ``SINKHORN_MAX_ITER`` / ``default_tol``
of x2's dtype. Each row's n inputs (mass 1/n) are transported onto n targets (mass 1/n) with the
squared cost and entropic weight :math:`\varepsilon`:

.. math::

    \Gamma = \arg\min_{\Gamma 1 = \frac1n 1,\ \Gamma^\top 1 = \frac1n 1}
        \sum_{ij} \Gamma_{ij} (x_i - y_j)^2
        + \varepsilon \sum_{ij} \Gamma_{ij} (\log \Gamma_{ij} - 1),\qquad
    P = n \Gamma^\top .

Unlike the paper (which squashes x into [0, 1] onto a fixed grid), the targets are the row's own
sorted values :math:`y = \mathrm{sort}(x)`, differentiated too: the operator is
shift-equivariant and epsilon is in units of x². P is row-stochastic exactly, ``sort = P @ x``,
and the ranks :math:`r_i = \sum_j P_{ji}\, j` lie in [1, n] and sum to n(n+1)/2 up to ``tol``.

The solve is the shared log-domain Sinkhorn of :mod:`softops._core.sinkhorn` in float64, with a
semi-dual Newton polish and the implicit backward (memory independent of the iteration count).
An iteration is O(B n²), a Newton step or backward O(B n³): meant for n up to a few thousand.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from softops._core.convergence import SINKHORN_MAX_ITER, default_tol
from softops._core.sinkhorn import SinkhornResult, attach_epsilon, log_sinkhorn
from softops.sort._chunked import convex_combination, positions, small_rows
from softops.sort._options import MethodOptions

__all__ = ["argsort", "masked", "rank", "sort"]


def _plan(
    x2: Tensor, eps: Tensor, opts: MethodOptions, limits: bool = False
) -> tuple[Tensor, SinkhornResult]:
    """The (B, n, n) float64 plan P = n Gamma^T (rows: ascending targets) and the diagnostics;
    with ``limits``, the non-finite entries and their targets carry no mass."""
    bsz, n = x2.shape
    max_iter = SINKHORN_MAX_ITER if opts.max_iter is None else opts.max_iter
    tol = default_tol(x2.dtype) if opts.tol is None else opts.tol
    x64 = x2.double()
    y = torch.sort(x64, dim=-1).values
    log_a = torch.full((bsz, n), -math.log(n), dtype=torch.float64, device=x2.device)
    log_b = log_a
    if limits:
        src, dst = torch.isfinite(x64), torch.isfinite(y)
        none = ~src.any(-1, keepdim=True)
        x64 = torch.where(src, x64, 0.0)
        y = torch.where(dst, y, 0.0)
        log_a = torch.where(src | none, log_a, -math.inf)
        log_b = torch.where(dst | none, log_b, -math.inf)
    cost = _cost(x64, y, eps.double())
    ones = torch.ones((bsz,), dtype=torch.float64, device=x2.device)
    # the solve warns (naming opts.op) where rows did not converge, also while traced
    res = log_sinkhorn(
        cost, log_a, log_b, ones, max_iter=max_iter, tol=tol, newton=True, caller=opts.op
    )
    return res.plan.transpose(1, 2) * n, res


def _cost(x: Tensor, y: Tensor, eps: Tensor) -> Tensor:
    r"""The cost in units of epsilon, ``C_ij = ((x_i - y_j) r)^2``, ``r = eps^{-1/2}`` (B, n, n),
    without overflow where C is finite (docs/math.md §4)."""
    r = torch.rsqrt(eps.detach()).view(-1, 1, 1)
    diff = x.unsqueeze(-1) - y.unsqueeze(1)
    with torch.no_grad():
        ok = ~torch.isinf(diff * r)  # (a NaN stays NaN: its row is NaN)
    d = torch.where(ok, diff, 0) * r
    return attach_epsilon(torch.where(ok, d.square(), math.inf), eps.view(-1, 1, 1))


def masked(kind: str, x2: Tensor, eps: Tensor, descending: bool, opts: MethodOptions) -> Tensor:
    """``kind`` of rows that may hold ``±inf``, at their limit, by masks alone (``_limits``): one
    solve whose infinite entries and targets carry no mass."""
    n = x2.shape[-1]
    p, _ = _plan(x2, eps, opts, limits=True)  # (B, n, n), rows: ascending targets
    xd = x2.detach().double()
    y = torch.sort(xd, dim=-1).values  # the hard sort: ±inf at the ends, NaN last
    if kind == "sort":
        xf = torch.where(torch.isfinite(xd), x2.double(), 0.0)
        v = convex_combination(p, xf, small_rows(xf))
        v = torch.where(torch.isfinite(y), v, y).to(x2.dtype)
        return v.flip(-1) if descending else v
    if kind == "rank":
        pos = positions(n, descending, p.dtype, p.device)
        r = torch.matmul(pos, p)  # finite entries: their full-row positions, o + 1 .. o + m
        n_neg = (xd == -math.inf).sum(-1, keepdim=True).to(p.dtype)
        n_pos = (xd == math.inf).sum(-1, keepdim=True).to(p.dtype)
        r_neg, r_pos = (n_neg + 1) / 2, n - (n_pos - 1) / 2  # the mean of their tied positions
        if descending:
            r_neg, r_pos = n + 1 - r_neg, n + 1 - r_pos
        r = torch.where(xd == -math.inf, r_neg, torch.where(xd == math.inf, r_pos, r))
        return r.to(x2.dtype)
    # argsort: a row at an infinite position is uniform over the entries of that infinity
    same = (y.unsqueeze(-1) == xd.unsqueeze(-2)) & torch.isinf(y).unsqueeze(-1)
    tied = same.to(p.dtype)
    tied = tied / tied.sum(-1, keepdim=True).clamp_min(1)
    p = torch.where(torch.isfinite(y).unsqueeze(-1), p, tied).to(x2.dtype)
    return p.flip(1) if descending else p


def sort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""OT soft sort :math:`v_j = n \sum_i \Gamma_{ij} x_i`, (B, n) in x2's dtype."""
    p, _ = _plan(x2, eps, opts)
    x64 = x2.double()
    v = convex_combination(p, x64, small_rows(x64)).to(x2.dtype)
    return v.flip(-1) if descending else v


def rank(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""OT soft ranks :math:`r_i = n \sum_j \Gamma_{ij} (\mathrm{pos}_j + \mathrm{offset})`."""
    n = x2.shape[-1]
    p, _ = _plan(x2, eps, opts)
    pos = positions(n, descending, p.dtype, p.device)
    if offset is None:
        return torch.matmul(pos, p).to(x2.dtype)
    pos = pos + offset.to(p.dtype).unsqueeze(-1)
    return torch.matmul(pos.unsqueeze(1), p).squeeze(1).to(x2.dtype)


def argsort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""The OT sorting matrix :math:`P_{ji} = n \Gamma_{ij}` (B, n, n) in x2's dtype."""
    p, _ = _plan(x2, eps, opts)
    p = p.to(x2.dtype)
    return p.flip(1) if descending else p
