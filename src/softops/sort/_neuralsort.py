r"""NeuralSort backend (Grover, Wang, Zweig and Ermon, ICLR 2019, arXiv:1903.08850): the unimodal
row-stochastic relaxation

.. math::

    P_{ij} = \operatorname{softmax}_j\!\Big(\frac{c_i x_j - \sum_l |x_j - x_l|}{\varepsilon}\Big),
    \qquad c_i = 2i - n - 1 \ (\text{ascending}), \ n + 1 - 2i \ (\text{descending}),

values ``P @ x`` and ranks :math:`r_j = \sum_i i\,P_{ij}` (not confined to [1, n]).

A backend of :mod:`softops.sort` (the one signature of ``softops.sort._dispatch``; ``opts``
unused; no validation). The paper's :math:`\hat P_{\max}` is ``descending=True``. The logits are
formed relative to each row's argmax from the gaps of the sorted row (:func:`_gap_logits`,
docs/math.md §3), so they carry the rounding of the gaps, not of ``n * span``; the O(n²) softmax
runs in checkpointed row blocks. The gaps are scaled by a power of two (:func:`_frame`) and one
factor ``-s / eps`` (:func:`_ratio`: below the dtype's largest value, times exact powers of two
where ``s / eps`` is beyond it), so no pass forms ``eps**2`` or overflows before the derivative
does, and no gap is scaled short at a tiny epsilon (KD28).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from softops.sort._chunked import chunked_rows
from softops.sort._limits import infinity_kind, limit_logits
from softops.sort._options import MethodOptions
from softops.sort._softsort import row_scale

__all__ = ["argsort", "rank", "sort"]


def _ratio(eps: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``s / eps`` (B,) as ``q * t1 * t2``: ``q = scaled_inverse(eps, s / 2**j)`` below the
    dtype's largest value (unsaturated), and the detached powers of two ``t1 * t2 = 2**j`` (each
    finite; j = 0 where ``s / eps`` fits, so that q is ``scaled_inverse(eps, s)`` there)."""
    dt = eps.dtype
    top = math.frexp(torch.finfo(dt).max)[1] - 1  # the dtype's largest power of two
    with torch.no_grad():
        # log2(s / eps) in float64, where neither overflows; j leaves q two binades below max
        log2_ratio = torch.log2(scale.view(-1).double()) - torch.log2(eps.detach().double())
        # (j <= 2 top: s <= 2**top and 1 / eps < 2**(2 top) for a positive eps of the dtype)
        j = torch.ceil(log2_ratio - (top - 2)).clamp(min=0.0, max=2.0 * top)
        j1 = j.clamp(max=top)
        t1, t2 = torch.exp2(j1).to(dt), torch.exp2(j - j1).to(dt)
    # scaled_inverse's form and cap (reached at epsilon 0 alone)
    log_q = torch.log(scale.view(-1).to(dt)) - torch.log(eps) - (j * math.log(2.0)).to(dt)
    return torch.exp(log_q.clamp(max=math.log(torch.finfo(dt).max) - 1e-3)), t1, t2


def _sorted_frame(
    u: Tensor, ratio: tuple[Tensor, Tensor, Tensor], keep: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The frame of ``_gap_logits`` for ascending rows u: ``-s / eps`` (``ratio``, from
    :func:`_ratio`) times the gaps (0 where ``keep`` is False), and the same of the next gaps,
    reversed."""
    g = u[:, 1:] - u[:, :-1]
    if keep is not None:
        g = torch.where(keep[:, 1:] & keep[:, :-1], g, 0.0)
    q, t1, t2 = (r.view(-1, 1) for r in ratio)
    # the gaps times q (one rounding), then by the powers of two (exact, or beyond max: a gap
    # whose logit overflows is at the hard limit anyway); at most -max: a zero weight times it
    # is 0, where -inf would give NaN; the sums may reach -inf, which the softmax takes to 0
    g = (g * -q * t1 * t2).clamp(min=-torch.finfo(g.dtype).max)
    zero = u[:, :1] * 0  # (0, or NaN in a NaN row: a row of one entry has no gap to carry it)
    return torch.cat((zero, g), -1), torch.cat((g, zero), -1).flip(-1)


def _gap_logits(i0: Tensor, g: Tensor, g_next_rev: Tensor) -> Tensor:
    r"""(B, b, n) logits ``(t_ik - t_ii0) / epsilon`` at the sorted positions k, for the rows whose
    argmax is at the sorted position ``i0`` (the cumulative sums of docs/math.md §3)."""
    n = g.shape[-1]
    d = torch.arange(n, device=g.device) - i0.unsqueeze(-1)  # (b, n) or (B, b, n): m - i0
    up = (torch.where(d > 0, 2 * d - 1, 0).to(g.dtype) * g.unsqueeze(1)).cumsum(-1)
    # sum over m in [k + 1, i0] of |2 (m - i0) - 1| g_m: at k, g_(k+1) with the weight
    # 2 (i0 - k) - 1 for k < i0; summed from i0 down, on the reversed row
    w = torch.where(d < 0, -1 - 2 * d, 0).flip(-1).to(g.dtype)
    down = (w * g_next_rev.unsqueeze(1)).cumsum(-1).flip(-1)
    return up + down


def _unsort(
    r: Tensor | None, p: Tensor | None, where: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """Ranks and P from sorted column order back to the columns' own (``where``: sorted places)."""
    if r is not None:
        r = r.gather(-1, where)
    if p is not None:
        p = p.gather(-1, where.unsqueeze(1).expand(-1, p.shape[1], -1))
    return r, p


def _frame(xc: Tensor, eps: Tensor) -> Tensor:
    """The detached power-of-two scale s >= 1 (B, 1) of the centred rows (``row_scale``)."""
    return row_scale(xc, eps, 1.0, 3.0 * xc.shape[-1])


def _run(
    x2: Tensor,
    epsilon: Tensor,
    descending: bool,
    *,
    values: bool = False,
    ranks: bool = False,
    matrix: bool = False,
    offset: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    n = x2.shape[-1]
    with torch.no_grad():
        centre = 0.5 * x2.amax(-1, keepdim=True) + 0.5 * x2.amin(-1, keepdim=True)
        centre = torch.where(torch.isfinite(centre), centre, 0.0)
    # the scale s of the centred row (no overflow, hence no inf in the backward), put back into
    # s / eps; the gaps are those of x / s itself (exact: a power of two; centring would round
    # them on the size of the span)
    eps = epsilon.to(x2.dtype)
    scale = _frame(x2.detach() - centre, eps)
    # logits of the columns in sorted order
    u, perm = torch.sort(x2 / scale, dim=-1, stable=True)
    frame = _sorted_frame(u, _ratio(eps, scale))
    v, r, p = chunked_rows(  # the row parameter: the argmax's sorted position (ascending rows)
        _gap_logits,
        torch.arange(n, device=x2.device),
        x2.gather(-1, perm),
        frame,
        descending,
        values=values,
        ranks=ranks,
        matrix=matrix,
        offset=offset,
    )
    places = torch.arange(n, device=x2.device).expand_as(perm)
    return (v, *_unsort(r, p, torch.zeros_like(perm).scatter(-1, perm, places)))


def _masked_logits(rp: Tensor, g: Tensor, g_next_rev: Tensor, kind_u: Tensor) -> Tensor:
    """The compacted row's :func:`_gap_logits` at the limit with infinities (``limit_logits``)."""
    return limit_logits(rp[1], kind_u, _gap_logits(rp[0].long(), g, g_next_rev))


def masked(kind: str, x2: Tensor, eps: Tensor, descending: bool, opts: MethodOptions) -> Tensor:
    """``kind`` of rows that may hold ``±inf``, at their limit, by masks alone (``_limits``): the
    finite entries get the compacted row's logits (gaps 0 beside an infinity), at the positions
    of the full row."""
    n = x2.shape[-1]
    dt = x2.dtype
    xd = x2.detach()
    kind_x = infinity_kind(xd)
    fin = kind_x == 0
    n_neg = (kind_x < 0).sum(-1, keepdim=True)
    m = fin.sum(-1, keepdim=True)
    with torch.no_grad():
        lo = torch.where(fin, xd, math.inf).amin(-1, keepdim=True)
        hi = torch.where(fin, xd, -math.inf).amax(-1, keepdim=True)
        centre = torch.where(m > 0, 0.5 * lo + 0.5 * hi, 0.0)
    scale = _frame(torch.where(fin, xd - centre, 0.0), eps.to(dt))  # over the finite entries
    xcz = torch.where(fin, x2 / scale, 0.0)  # (the gaps are those of x / s: no centring)
    # sorted by xd (-inf first, +inf last), the gaps between finite entries only
    perm = torch.sort(xd, dim=-1, stable=True).indices
    fin_u = fin.gather(-1, perm)
    frame = _sorted_frame(xcz.gather(-1, perm), _ratio(eps.to(dt), scale), fin_u)
    i = torch.arange(1, n + 1, dtype=dt, device=x2.device)  # ascending output positions
    kind_r = torch.where(i <= n_neg.to(dt), -1.0, torch.where(i > (n_neg + m).to(dt), 1.0, 0.0))
    v, r, p = chunked_rows(
        _masked_logits,
        torch.stack(((i - 1).expand_as(kind_r), kind_r.to(dt))),
        torch.where(fin, x2, 0.0).gather(-1, perm),
        (*frame, kind_x.gather(-1, perm)),
        descending,
        values=kind == "sort",
        ranks=kind == "rank",
        matrix=kind == "argsort",
    )
    places = torch.arange(n, device=x2.device).expand_as(perm)
    r, p = _unsort(r, p, torch.zeros_like(perm).scatter(-1, perm, places))
    if kind == "sort":
        srt = torch.sort(xd, dim=-1, descending=descending).values
        return torch.where(torch.isinf(srt), srt, cast(Tensor, v))
    return cast(Tensor, r if kind == "rank" else p)


def sort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""NeuralSort values ``P @ x``, (B, n) in x2's dtype (sorted values as epsilon -> 0)."""
    return cast(Tensor, _run(x2, eps, descending, values=True)[0])


def rank(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""NeuralSort ranks :math:`r_j = \sum_i (i + \mathrm{offset})\,P_{ij}` (B, n), x2's dtype."""
    return cast(Tensor, _run(x2, eps, descending, ranks=True, offset=offset)[1])


def argsort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""The (B, n, n) unimodal row-stochastic NeuralSort matrix P, in x2's dtype."""
    return cast(Tensor, _run(x2, eps, descending, matrix=True)[2])
