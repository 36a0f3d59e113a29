r"""Method "sinkhorn" of ``soft_topk_mask``: the paper's algorithm (Xie et al. 2020, §2).

The n x 2 entropic OT problem of method "ot", with the same epsilon, solved by the log-domain
Sinkhorn of :mod:`softops._core.sinkhorn` (Newton polish, implicit backward; docs/math.md §2.3).
At convergence it equals "ot"; it differentiates in x only. ``max_iter=200, tol=0`` runs the
paper's fixed 200 iterations. The cost is in units of epsilon, centred on the threshold's region
(docs/math.md §1.7); infinities are their limits.
"""

from __future__ import annotations

import math

import torch

from softops._core.sinkhorn import log_sinkhorn
from softops._core.transforms import cannot_branch
from softops.topk._options import MaskOptions, unreachable_rows

__all__ = ["mask"]


def mask(
    x2: torch.Tensor, k_row: torch.Tensor, eps_row: torch.Tensor, opts: MaskOptions
) -> torch.Tensor:
    """The mask A (B, n) of canonical rows; ``k_row`` and ``eps_row`` are constants."""
    op, max_iter, tol = opts.op, opts.max_iter, opts.tol
    k_row, eps_row = k_row.detach(), eps_row.detach()
    dtype = x2.dtype
    n = x2.shape[1]
    # solve on the finite entries, then set the infinite ones to 0 or 1; where nothing can be
    # read, every row takes the masked path (which leaves a finite row as it is)
    fixed = cannot_branch(x2)
    finite = torch.isfinite(x2)
    all_finite = not fixed and bool(finite.all())
    big = torch.finfo(dtype).max / 16
    log_n = math.log(n)
    if all_finite:
        xs, log_a, k_fin = x2, torch.full_like(x2, -log_n), k_row
        n_fin: torch.Tensor | float = float(n)
        trivial = None
    else:
        # the finite entries onto targets of masses (n_fin - k_fin)/n and k_fin/n; the rows that
        # are NaN or at k_fin = 0 or n_fin solve a trivial problem that converges at once
        bad = unreachable_rows(x2, k_row)
        n_fin = finite.sum(-1).to(dtype)
        k_fin = k_row - (x2 == math.inf).sum(-1).to(dtype)
        trivial = bad | (k_fin <= 0) | (k_fin >= n_fin)
        live = finite & ~trivial[:, None]
        xs = torch.where(live, x2, 0)
        log_a = torch.full_like(x2, -log_n).masked_fill(~(live | trivial[:, None]), -math.inf)
        k_fin = torch.where(trivial, 0.5 * n, k_fin)
        n_fin = torch.where(trivial, float(n), n_fin)
    # C_i0 = 0, C_i1 = -(x_i - c)/epsilon, c the threshold's region (docs/math.md §1.7), its two
    # entries from a descending sort of the live entries (no host read)
    live = torch.ones_like(x2, dtype=torch.bool) if trivial is None else log_a > -math.inf
    ranked = torch.where(live, xs, -math.inf).detach().sort(-1, descending=True).values
    ranks = torch.stack((torch.ceil(k_fin), torch.floor(k_fin) + 1), -1).clamp(1, n)
    pair = ranked.gather(-1, ranks.long() - 1)
    pair = torch.where(torch.isfinite(pair), pair, 0)  # (trivial rows: no live entry)
    centre = torch.add(0.5 * pair[:, :1], pair[:, 1:], alpha=0.5)
    z = ((0.5 * xs - 0.5 * centre) / (0.5 * eps_row[:, None])).clamp(-big, big)
    if trivial is not None:
        z = torch.where(log_a > -math.inf, z, 0)  # placeholders of the infinite entries
    cost = torch.stack((torch.zeros_like(z), -z), -1)
    kc = k_fin.clamp(0, n)
    log_b = torch.stack([torch.log(n_fin - kc), torch.log(kc)], -1) - log_n
    newton = tol > 0
    ones = torch.ones_like(eps_row)
    # the solve warns (naming op) where rows did not converge, also while traced
    plan = log_sinkhorn(
        cost, log_a, log_b, ones, max_iter=max_iter, tol=tol, newton=newton, caller=op
    ).plan
    A = n * plan[..., 1]
    edge_none, edge_all = k_row <= 0, k_row >= n
    if fixed or bool((edge_none | edge_all).any()):
        A = torch.where(edge_none[:, None], torch.zeros_like(A), A)
        A = torch.where(edge_all[:, None], torch.ones_like(A), A)
    if not all_finite:
        none_fin, all_fin = k_fin_rows(x2, k_row)
        A = torch.where(none_fin[:, None] & finite, 0.0, A)
        A = torch.where(all_fin[:, None] & finite, 1.0, A)
        A = torch.where(x2 == math.inf, 1.0, A)
        A = torch.where(x2 == -math.inf, 0.0, A)
        A = A.masked_fill(bad[:, None], math.nan)
    return A


def k_fin_rows(x2: torch.Tensor, k_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) bool: rows whose finite entries are all unselected (k = #(+inf)) or all selected
    (k = #(+inf) + #finite)."""
    k_fin = k_row - (x2 == math.inf).sum(-1).to(x2.dtype)
    return k_fin <= 0, k_fin >= torch.isfinite(x2).sum(-1).to(x2.dtype)
