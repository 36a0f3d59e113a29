r"""Method "sinkhorn" of ``soft_topk_mask``: the paper's algorithm (Xie et al. 2020, §2).

The same n x 2 entropic OT problem as method "ot", with the same epsilon (eps_p = 2 epsilon on the
unnormalised cost :math:`C_{ij} = (x_i - y_j)^2`, targets y = 0, 1 of masses (n - k)/n and k/n),
solved by log-domain Sinkhorn (:mod:`softops._core.sinkhorn`) with a semi-dual Newton polish and
the implicit backward of the converged plan, as in the paper (derived in docs/math.md §2.3). At
convergence it equals "ot"; it differentiates with respect to x only. ``max_iter=200, tol=0``
runs the paper's fixed 200 iterations. The cost is passed in units of epsilon (the plan depends on
x / epsilon only), so the solver sees the same numbers at every scale of x.

Infinities are their limits: the problem is solved with finite stand-ins far beyond the finite
range (``_options.finite_stand_ins``, shared with the sorted top-k), and those entries are then set
to exactly 0 or 1.
"""

from __future__ import annotations

import math

import torch

from softops._core.convergence import warn_not_converged
from softops._core.sinkhorn import sinkhorn_plan
from softops._core.transforms import cannot_branch
from softops.topk._options import finite_stand_ins, unreachable_rows

__all__ = ["sinkhorn_mask"]


def sinkhorn_mask(
    op: str,
    x2: torch.Tensor,
    k_row: torch.Tensor,
    eps_row: torch.Tensor,
    max_iter: int,
    tol: float,
) -> torch.Tensor:
    """The mask A (B, n) of canonical rows; ``k_row`` and ``eps_row`` are constants."""
    dtype = x2.dtype
    n = x2.shape[1]
    # Infinities are their limits: solve with stand-ins far beyond the finite range, then set
    # those entries to exactly 0 or 1. Rows with NaN, or whose k cannot be met, give NaN.
    # Under torch.func, on meta tensors and while tracing there is no value to branch on: every
    # row then takes the masked path below, which leaves a finite row exactly as it is.
    fixed = cannot_branch(x2)
    finite = torch.isfinite(x2)
    all_finite = not fixed and bool(finite.all())
    xs = x2
    if not all_finite:
        # Rows that cannot hold k (or hold a NaN) are NaN by contract: solve a trivial stand-in
        # (all zeros) for them instead, which converges at once, rather than asking Sinkhorn to
        # move mass against a cost 2000 epsilon wide (it would crawl, and warn for nothing).
        bad = unreachable_rows(x2, k_row)
        xs = torch.where(bad[:, None], 0, finite_stand_ins(x2, eps_row))
    # The squared cost (x_i - y_j)^2 / eps_p, eps_p = 2 epsilon, in units of eps_p: the x_i^2 term
    # is a row constant (absorbed by f), y_j^2 and a shift of x by a per-row centre c are column
    # constants (absorbed by g), which leaves C_i0 = 0 and C_i1 = -(x_i - c)/epsilon. The plan
    # depends on x/epsilon only (the documented scaling law), so the solver sees the same numbers
    # at every scale of x: in x's own units the O(1) constant y^2 = 1 swamped an x of 1e-7 in
    # float32. Beyond 1/16 of the dtype's range every entry is already decided (the hard limit),
    # so the scaled scores saturate there instead of overflowing (epsilon can be finfo.tiny).
    big = torch.finfo(dtype).max / 16
    # The centre is the median of the finite entries: with the stand-ins counted, a row that is
    # mostly infinite was centred 2000 epsilon away from its threshold, which Sinkhorn then had
    # to cross in steps of O(1) (it did not converge within 2000 iterations).
    centre = torch.where(finite, xs.detach(), math.nan).nanmedian(-1, keepdim=True).values
    centre = torch.nan_to_num(centre, nan=0.0)
    z = ((xs - centre) / eps_row[:, None]).clamp(-big, big)
    cost = torch.stack((torch.zeros_like(z), -z), -1)
    log_a = torch.full_like(xs, -math.log(n))
    kc = k_row.clamp(0, n)
    log_b = torch.stack([torch.log(n - kc), torch.log(kc)], -1) - math.log(n)
    newton = tol > 0
    ones = torch.ones_like(eps_row)
    plan, result = sinkhorn_plan(cost, log_a, log_b, ones, max_iter, tol, newton=newton)
    warn_not_converged(op, result.converged, max_iter, residual=result.residual, tol=tol)
    A = n * plan[..., 1]
    edge_none, edge_all = k_row <= 0, k_row >= n
    if fixed or bool((edge_none | edge_all).any()):
        A = torch.where(edge_none[:, None], torch.zeros_like(A), A)
        A = torch.where(edge_all[:, None], torch.ones_like(A), A)
    if not all_finite:
        A = torch.where(x2 == math.inf, 1.0, A)
        A = torch.where(x2 == -math.inf, 0.0, A)
        A = A.masked_fill(bad[:, None], math.nan)
    return A
