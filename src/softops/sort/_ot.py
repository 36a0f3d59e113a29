r"""Optimal-transport backend: soft sort, rank and argsort by entropic OT.

Reference: M. Cuturi, O. Teboul and J.-P. Vert, *Differentiable Ranks and Sorting using Optimal
Transport*, NeurIPS 2019 (arXiv 1905.11885).

Private backend of :mod:`softops.sort`, with the one backend signature
``sort/rank/argsort(x2, eps, descending, opts, offset=None)`` (``softops.sort._dispatch``):
canonical tensors ``x2`` (B, n) of dtype float32 or float64 and ``eps`` (B,) positive (it may
require grad); no validation. ``opts.max_iter=None`` means
``softops._core.convergence.SINKHORN_MAX_ITER`` and ``opts.tol=None`` means ``default_tol`` of
x2's dtype; ``opts.op`` names the public op in the non-convergence warning.

Formulation (Cuturi et al. 2019, §2 and §3). Each row's n inputs :math:`x_i` (mass 1/n each) are
transported onto n targets :math:`y_j` (mass 1/n each) with the squared cost and entropic weight
:math:`\varepsilon`:

.. math::

    \Gamma = \arg\min_{\Gamma 1 = \frac1n 1,\ \Gamma^\top 1 = \frac1n 1}
        \sum_{ij} \Gamma_{ij} (x_i - y_j)^2
        + \varepsilon \sum_{ij} \Gamma_{ij} (\log \Gamma_{ij} - 1),\qquad
    P = n \Gamma^\top .

Deviations from the paper (the input is never squashed implicitly):

* **Targets.** The paper squashes x (a sigmoid after per-row standardisation) into [0, 1] and
  uses a fixed grid of targets there. Here the targets are the row's own hard-sorted values
  :math:`y = \mathrm{sort}(x)` (ascending). They are part of the function and are
  differentiated (``sort`` is piecewise linear), so the gradient is the exact derivative of the
  map x -> output away from ties. Hence the operator is shift-equivariant, epsilon is in
  **units of x²** (the units of the cost), and the scaling law is
  ``sort(c x, c² e) = c sort(x, e)`` for c > 0 (ranks and P unchanged). As epsilon -> 0 the
  plan tends to the monotone (sorting) assignment, as epsilon -> inf to the uniform plan
  (every soft value tends to the row mean). Epsilon should be compared with the squared gaps
  between neighbouring values.
* **Orientation.** ``descending=False`` (the public default) is ascending; ``descending=True``
  reverses the targets, which is exactly the same OT problem with permuted columns.
* **Outputs** (the paper's :math:`\tilde S` and :math:`\tilde R`): ``P`` is row-stochastic
  **exactly** (the solver's columns are exact), ``sort = P @ x``, and the 1-based ranks are
  :math:`r_i = n \sum_j \Gamma_{ij}\, j = \sum_j P_{ji}\, j`, which lie in [1, n] and sum to
  n(n+1)/2 up to the solver tolerance (the row marginals are met to ``tol``). The public
  ``soft_quantile`` interpolates the soft-sorted values linearly, as :func:`torch.quantile`
  does the hard ones (``softops.sort._dispatch.interpolate``).

Solver (always in float64; outputs are cast back to x2's dtype): the shared log-domain
Sinkhorn of :mod:`softops._core.sinkhorn`, with convergence checked in batches and a semi-dual
Newton polish once the marginal error is below 1e-3 (without it, m = n targets at small epsilon
take many thousands of iterations), and its implicit backward (a Schur-complement Cholesky solve
of size n - 1 in float64), so memory does not grow with the iteration count. A row that does not
reach ``tol`` within ``max_iter`` iterations raises a ``softops.ConvergenceWarning``
(a ``UserWarning``) naming the public op: gradients are only as accurate as the forward.
Epsilon gets its gradient through the scaled cost ``C / epsilon``, formed as ``((x - y) r)^2``
with ``r = eps^{-1/2}`` so that neither it nor its backward overflows where the true values do
not (:func:`_cost`).

Cost and limits: each Sinkhorn iteration is O(B n²) time, the plan is (B, n, n) float64, and
each Newton step or backward solve is O(B n³) (a float64 Cholesky of size n - 1). This backend
is meant for n up to a few thousand. Measured (1 thread, float32 input, N(0, 1) rows, default
tol): B=8, n=500: forward 0.9 s / 1.9 s and forward+backward 1.2 s / 2.3 s at epsilon 1 / 0.1;
B=1, epsilon 0.1: forward 1.5 s at n=1000 and 4.4 s at n=2000 (backward 0.2 s / 1.3 s). Small
epsilon (relative to the squared gaps) needs more iterations.

Non-finite inputs: a NaN, or an infinity, gives NaN in its own row only in ``sort``, ``rank``
and ``argsort``; the public layer (:mod:`softops.sort`) takes infinities to their limits before
calling them (eagerly on compacted rows). :func:`masked` is the same limit without branching, for
``torch.func`` transforms and meta tensors: the infinite entries and their targets carry no mass
(docs/math.md §6.2).

``torch.func``: vmap solves the vmapped slices as more rows of one batch, forward mode (jvp,
jacfwd) runs the implicit solve on the tangent (the plan's Jacobian in the cost is symmetric,
docs/math.md §6.1), and meta tensors give the output shape without solving.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from softops._core.convergence import SINKHORN_MAX_ITER, default_tol
from softops._core.sinkhorn import SinkhornResult, attach_epsilon, sinkhorn_plan
from softops.sort._chunked import convex_combination, positions, small_rows
from softops.sort._options import MethodOptions

__all__ = ["argsort", "masked", "rank", "sort"]


def _plan(
    x2: Tensor, eps: Tensor, opts: MethodOptions, limits: bool = False
) -> tuple[Tensor, SinkhornResult]:
    """The (B, n, n) float64 plan P = n Gamma^T (rows = targets in ascending order), diagnostics.

    The solve runs in float64 whatever x2's dtype (in float32 the cost ``(x - y)^2 / epsilon``
    loses the digits that small epsilon needs, and the hybrid solver then stalls).

    With ``limits``, rows may hold ``±inf`` (or NaN): those entries get no mass, nor do the
    targets at their sorted positions, so the finite entries are transported onto the sorted
    finite values exactly as the row of its finite entries alone would be (the masses are those
    of the compacted row times m/n, which leaves the plan unchanged), and every entry of P in an
    infinite row or column is exactly 0. A row without finite entries solves a uniform stand-in.
    """
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
    gamma, res = sinkhorn_plan(cost, log_a, log_b, ones, max_iter, tol, newton=True, caller=opts.op)
    return gamma.transpose(1, 2) * n, res


def _cost(x: Tensor, y: Tensor, eps: Tensor) -> Tensor:
    r"""The cost in units of epsilon, ``C_ij = (x_i - y_j)^2 / eps`` (B, n, n), as
    ``((x_i - y_j) r)^2`` with ``r = eps^{-1/2}``, differentiable in x, y and eps.

    ``(x - y)^2 / eps`` overflowed where ``(x - y)^2`` does (1e155 in float64) although C may
    not, and autograd through it formed ``(C / eps) / eps`` in the backward (inf at epsilon
    < 1e-154, or on a wide row), which turned the zero cost gradient of an entry the plan does
    not use into ``0 * inf = NaN``. Here ``r`` is a constant in the backward and the gradient in
    epsilon is ``-<grad, C> / eps`` (:func:`softops._core.sinkhorn.attach_epsilon`); an entry
    whose ``(x - y) r`` overflows has the constant cost ``inf`` (no mass), so no gradient meets
    its infinite factors.
    """
    r = torch.rsqrt(eps.detach()).view(-1, 1, 1)
    diff = x.unsqueeze(-1) - y.unsqueeze(1)
    with torch.no_grad():
        ok = ~torch.isinf(diff * r)  # (a NaN stays NaN: its row is NaN)
    d = torch.where(ok, diff, 0) * r
    return attach_epsilon(torch.where(ok, d.square(), math.inf), eps.view(-1, 1, 1))


def masked(kind: str, x2: Tensor, eps: Tensor, descending: bool, opts: MethodOptions) -> Tensor:
    """``kind`` ("sort", "rank" or "argsort") of rows that may hold ``±inf``, at their limit.

    The limit of ``softops.sort._limits`` (the finite entries are sorted among themselves, the
    infinities take the ends, tied among themselves) by masks alone: one solve on the full rows
    whose infinite entries and targets carry no mass (:func:`_plan`), no host sync and no
    data-dependent control flow, so it runs under ``torch.func`` transforms and on meta tensors.
    On a row without infinities it is exactly the plain op. Rows with a NaN are not special-cased
    here (their finite entries are solved; the caller makes the row NaN).
    """
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
    r"""OT soft sort: a relaxation of ``torch.sort(x, -1, descending).values``.

    .. math::

        v_j = n \sum_i \Gamma_{ij}\, x_i,

    the barycentre of the inputs transported to the j-th target (Cuturi et al.'s
    :math:`\tilde S`), with :math:`\Gamma` the entropic plan onto the sorted values
    (module docstring), differentiated through both the plan and
    the targets.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) entropic weight :math:`\varepsilon` > 0, in units of x².
        descending: sort in descending order.
        opts: ``opts.max_iter``, the Sinkhorn iteration cap (None: ``SINKHORN_MAX_ITER``);
            ``opts.tol``, the relative L1 marginal tolerance (None: ``default_tol``; 0 runs
            exactly ``max_iter`` iterations); ``opts.op``, the op named by the warning.
        offset: unused (the one backend signature).

    Returns:
        (B, n) soft-sorted values, in x2's dtype (each a convex combination of the row).

    References:
        M. Cuturi, O. Teboul, J.-P. Vert. Differentiable Ranks and Sorting using Optimal
        Transport. NeurIPS 2019. arXiv:1905.11885.
    """
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
    r"""OT soft ranks: a relaxation of the 1-based ``argsort(argsort(x, -1, descending)) + 1``.

    .. math::

        r_i = n \sum_j \Gamma_{ij}\, \mathrm{pos}_j,\qquad
        \mathrm{pos}_j = j \ (\text{ascending}),\ n + 1 - j \ (\text{descending}),

    Cuturi et al.'s :math:`\tilde R = n^2\,\Gamma \bar b` with :math:`\bar b` the cumulated
    target masses. In [1, n]; the ranks sum to n(n+1)/2 up to the solver tolerance.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) entropic weight :math:`\varepsilon` > 0, in units of x².
        descending: rank 1 for the largest instead of the smallest.
        opts: the solver options, as for :func:`sort`.
        offset: optional (B,) shift of the positions (used by the public layer for infinities).

    Returns:
        (B, n) soft ranks, in x2's dtype.

    References:
        M. Cuturi, O. Teboul, J.-P. Vert. Differentiable Ranks and Sorting using Optimal
        Transport. NeurIPS 2019. arXiv:1905.11885.
    """
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
    r"""The OT sorting matrix: row j relaxes ``one_hot(argsort(x, -1, descending)[j])``.

    .. math::

        P_{ji} = n\, \Gamma_{ij}.

    Rows sum to 1 exactly (non-negative); columns sum to 1 up to the solver tolerance, so P is
    (nearly) doubly stochastic. ``P @ x`` equals :func:`sort`.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) entropic weight :math:`\varepsilon` > 0, in units of x².
        descending: rows in descending order of x.
        opts: the solver options, as for :func:`sort`.
        offset: unused (the one backend signature).

    Returns:
        (B, n, n) P, in x2's dtype.

    References:
        M. Cuturi, O. Teboul, J.-P. Vert. Differentiable Ranks and Sorting using Optimal
        Transport. NeurIPS 2019. arXiv:1905.11885.
    """
    p, _ = _plan(x2, eps, opts)
    p = p.to(x2.dtype)
    return p.flip(1) if descending else p
