r"""Infinities as limits for the "softsort", "neuralsort" and "ot" sort methods.

The contract of the sort family is that an input at ``±inf`` behaves as the limit of a large
finite value: the entries at ``±inf`` are replaced by ``±M`` and ``M -> inf`` (equal infinities
staying tied). For these three methods the limit decouples the infinite entries from the finite
ones. For SoftSort and OT, the kernel between a target value u and an entry x decays with their
distance (``exp(-|u - x|/eps)``, ``exp(-(u - x)²/eps)``), so as ``M -> inf`` an entry at ``±M``
gets weight 0 in the row of every finite target, and the rows of the targets at ``±M`` put all
their weight on the entries there. NeuralSort's logits ``(c_i x_j - sum_l |x_j - x_l|)/eps``
separate in the same way, by O(M): an entry at ``+M`` wins only the last rows; and the ``M``
terms shift the finite entries' coefficients to exactly those of the compacted row (one ``+M``
turns ``c_i = 2i - n - 1`` into ``c_i + 1 = 2i - (n - 1) - 1``). What remains is:

- the finite entries of a row, relaxed among themselves: the method applied to that row's finite
  entries alone, the (Bg, m) compacted rows;
- in the output order (ascending unless ``descending``), the ``-inf`` entries first and the
  ``+inf`` entries last, tied among themselves.

Per output kind this gives:

- ``sort``: ``-inf`` / ``+inf`` at those positions, the finite soft values in between;
- ``rank``: an infinite entry gets the mean of the hard positions of its equal infinities (``n``
  for a single ``+inf``, ascending). A finite entry gets :math:`\sum_i (o + i) P'_{ij}`, where
  :math:`P'` is the matrix of the finite entries and ``o`` is the number of infinities before
  them (the backends' ``offset``);
- ``argsort``: the rows at infinite positions are uniform over the columns of that infinity. The
  other rows are :math:`P'` on the finite columns and 0 on the infinite ones.

Infinite entries get a zero gradient. The check costs one host sync per call. Rows with
infinities cost one backend call per distinct number of finite entries. Under ``torch.func``
transforms (``vmap``, ``grad``, ...), on meta tensors and under ``torch.compile`` that
data-dependent branch is impossible; every backend then runs its ``masked`` formulation of the
same limit on every row. For SoftSort and NeuralSort: rows and
columns carry a kind (-inf, finite, +inf), finite rows see the finite columns only (with the
compacted row's coefficients for NeuralSort) at their full-row positions, and an infinite row is
uniform over its own infinity. For "ot": infinite entries and the targets at their positions get
zero mass (``softops.sort._ot.masked``). "pav" does not come here: it takes the
projection's own limits (see ``softops.sort._pav``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from softops._core.transforms import cannot_branch
from softops.sort._options import MethodOptions

__all__ = ["limit_group", "with_limits"]

Backend = Callable[..., torch.Tensor]
"""A backend kind with the one signature ``fn(x2, eps, descending, opts, offset=None)``."""

MaskedBackend = Callable[[str, torch.Tensor, torch.Tensor, bool, MethodOptions], torch.Tensor]
"""A backend's ``masked(kind, x2, eps, descending, opts)``: the same limit on rows that may hold
``±inf``, by masks alone (no data-dependent control flow; used under ``torch.func``)."""


def _on_graph(out: torch.Tensor, xg: torch.Tensor, eg: torch.Tensor) -> torch.Tensor:
    """``out`` plus an exact zero that depends on ``xg`` and ``eg``: rows without finite entries
    have a constant limit, but their output must stay on the graph (zero gradients, like
    ``x * 0`` for an empty batch). The infinite entries are masked out first (``inf * 0`` is
    NaN)."""
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
    """The limit for rows (Bg, n) that hold infinities and exactly ``m`` finite entries each.

    In the limit, entries at ``±inf`` decouple from the finite ones: the finite entries are
    relaxed among themselves (``fn`` on the (Bg, m) compacted rows), ``-inf`` entries take the
    first output positions (the last if ``descending``) and ``+inf`` ones the others, tied among
    themselves (module docstring).
    """
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
    """``fn(x2, eps, descending, opts)``, with rows holding ``±inf`` (and no NaN) taken to their
    limit; ``kind`` ("sort", "rank" or "argsort") says which of ``fn``'s outputs it is.

    Eagerly: one host sync per call (whether any entry is infinite); rows with infinities are
    grouped by their number of finite entries and each group is one batched call. Under
    ``torch.func`` transforms, on meta tensors and under ``torch.compile``, where a
    data-dependent branch is impossible, the backend's ``masked`` formulation of the same limit
    runs on every row (module docstring); a backend without one gets NaN in rows with
    infinities there.
    """
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
