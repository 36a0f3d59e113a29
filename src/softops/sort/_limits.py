r"""Infinities as limits for the "softsort", "neuralsort" and "ot" sort methods.

The contract is :mod:`softops.sort`'s. For these methods the limit decouples: as ``M -> inf`` an
entry at ``±M`` gets weight 0 in the row of every finite target, so the finite entries are
relaxed as the method on them alone (a rank offset by the infinities before them, the backends'
``offset``). :func:`with_limits` finds the rows with infinities (one host sync) and calls the
backend once per distinct count of finite entries, on the compacted rows; where that branch is
impossible (``torch.func``, meta tensors, compile) every row goes through the backend's
``masked`` form of the same limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from softops._core.transforms import cannot_branch
from softops.sort._options import MethodOptions

__all__ = ["infinity_kind", "limit_group", "limit_logits", "with_limits"]

Backend = Callable[..., torch.Tensor]
"""A backend kind with the one signature ``fn(x2, eps, descending, opts, offset=None)``."""

MaskedBackend = Callable[[str, torch.Tensor, torch.Tensor, bool, MethodOptions], torch.Tensor]
"""A backend's ``masked(kind, x2, eps, descending, opts)``: the same limit on rows that may hold
``±inf``, by masks alone (no data-dependent control flow; used under ``torch.func``)."""


def infinity_kind(t: torch.Tensor) -> torch.Tensor:
    """-1, 0, +1 for -inf, finite, +inf (in t's dtype)."""
    return torch.where(torch.isinf(t), torch.sign(t), 0.0).to(t.dtype)


def limit_logits(
    kind_row: torch.Tensor, kind_col: torch.Tensor, finite: torch.Tensor
) -> torch.Tensor:
    """Logits (B, b, n) of the limit with infinities: ``finite`` between finite rows and columns,
    an infinite row uniform over the columns of its own infinity, -inf elsewhere (the kinds of
    :func:`infinity_kind`, rows (B, b) or (b,), columns (B, n))."""
    k_row, k_col = kind_row.unsqueeze(-1), kind_col.unsqueeze(1)
    inner = torch.where(k_row == k_col, 0.0, -math.inf).to(finite.dtype)
    return torch.where((k_row == 0) & (k_col == 0), finite, inner)


def _on_graph(out: torch.Tensor, xg: torch.Tensor, eg: torch.Tensor) -> torch.Tensor:
    """``out`` plus an exact zero on the graph of ``xg`` and ``eg`` (rows without finite entries
    have a constant limit, but stay on the graph)."""
    zero = torch.where(torch.isfinite(xg), xg, 0.0).sum(-1) * 0 + eg * 0  # (Bg,)
    return out + zero.to(out.dtype).view(-1, *([1] * (out.dim() - 1)))


def limit_group(
    fn: Backend,
    kind: str,
    xg: torch.Tensor,
    eg: torch.Tensor,
    descending: bool,
    opts: MethodOptions,
    m: int,
) -> torch.Tensor:
    """The limit for rows (Bg, n) that hold infinities and exactly ``m`` finite entries each:
    ``fn`` on the (Bg, m) compacted rows, the infinities at the ends, tied among themselves."""
    bsz, n = xg.shape
    xd = xg.detach()
    n_neg = (xd == -math.inf).sum(-1)
    n_pos = (xd == math.inf).sum(-1)
    off = n_pos if descending else n_neg  # output positions before the finite block
    # the column indices of the finite entries, in their original order
    fin_idx = torch.argsort((~torch.isfinite(xd)).to(torch.int8), dim=-1, stable=True)[:, :m]
    slots = off.unsqueeze(-1) + torch.arange(m, device=xg.device)  # their output positions
    xs = xg.gather(1, fin_idx)
    if kind == "sort":
        out = torch.sort(xd, dim=-1, descending=descending).values  # ±inf in place
        if m == 0:
            return _on_graph(out, xg, eg)
        return out.scatter(1, slots, fn(xs, eg, descending, opts))
    if kind == "rank":
        dt = xg.dtype
        first_neg, first_pos = (n - n_neg, 0 * n_pos) if descending else (0 * n_neg, n - n_pos)
        r_neg = (first_neg + (n_neg + 1) / 2).to(dt)  # tied: the mean of their positions
        r_pos = (first_pos + (n_pos + 1) / 2).to(dt)
        out = torch.where(xd == -math.inf, r_neg.unsqueeze(-1), r_pos.unsqueeze(-1))
        if m == 0:
            return _on_graph(out, xg, eg)
        return out.scatter(1, fin_idx, fn(xs, eg, descending, opts, offset=off.to(dt)))
    # argsort: rows at infinite positions are uniform over the equal infinite columns
    s = torch.sort(xd, dim=-1, descending=descending).values
    same = (s.unsqueeze(-1) == xd.unsqueeze(-2)) & torch.isinf(s).unsqueeze(-1)
    out = same.to(xg.dtype)
    out = out / out.sum(-1, keepdim=True).clamp_min(1)
    if m == 0:
        return _on_graph(out, xg, eg)
    p_fin = fn(xs, eg, descending, opts)  # (Bg, m, m)
    cols = torch.zeros(bsz, m, n, dtype=p_fin.dtype, device=xg.device)
    cols = cols.scatter(2, fin_idx.unsqueeze(1).expand(bsz, m, m), p_fin)
    return out.scatter(1, slots.unsqueeze(-1).expand(bsz, m, n), cols)


def with_limits(
    fn: Backend,
    kind: str,
    x2: torch.Tensor,
    eps: torch.Tensor,
    descending: bool,
    opts: MethodOptions,
    masked: MaskedBackend | None = None,
) -> torch.Tensor:
    """``fn(x2, eps, descending, opts)`` (``kind``: "sort", "rank" or "argsort"), with rows
    holding ``±inf`` (and no NaN) taken to their limit (module docstring)."""
    with torch.no_grad():
        inf = torch.isinf(x2)
        special = inf.any(-1) & ~torch.isnan(x2).any(-1)
    if cannot_branch(x2):  # no data to branch on (torch.func, meta, compile)
        if masked is None:
            return fn(x2, eps, descending, opts)
        out = masked(kind, x2, eps, descending, opts)
        nan_rows = torch.isnan(x2).any(-1)
        nan_term = torch.where(nan_rows, math.nan, 0.0).to(out.dtype)  # NaN rows stay NaN
        return out + nan_term.view(-1, *([1] * (out.dim() - 1)))
    if not bool(special.any()):
        return fn(x2, eps, descending, opts)
    parts, index = [], []
    plain = (~special).nonzero().squeeze(-1)
    if plain.numel():
        parts.append(fn(x2[plain], eps[plain], descending, opts))
        index.append(plain)
    rows = special.nonzero().squeeze(-1)
    n_fin = (~inf[rows]).sum(-1)
    for m in torch.unique(n_fin).tolist():
        r = rows[n_fin == m]
        parts.append(limit_group(fn, kind, x2[r], eps[r], descending, opts, m))
        index.append(r)
    idx = torch.cat(index)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    return torch.cat(parts)[inv]
