r"""SoftSort backend (Prillo and Eisenschlos, ICML 2020, arXiv:2006.16038):
``P = softmax(-d(sort(x), x) / epsilon)`` row-wise, ``d`` the l1 or l2 distance.

A backend of :mod:`softops.sort` (the one signature of ``softops.sort._dispatch``; no
validation). ``descending=False`` sorts ascending (the paper sorts descending). The soft ranks
:math:`r_j = \sum_i i\,P_{ij}` are estimates: P is only row-stochastic.

l1 values and ranks are exact in O(n log n) time and O(n) memory, by local-frame recurrences on
the semiseparable Laplace kernel run as a parallel scan with an adjoint-scan backward
(docs/math.md §3); gaps beyond 800 epsilon decouple exactly. l2 and the full P are formed in
checkpointed row blocks (:func:`softops.sort._chunked.chunked_rows`). The dense kernels work on
``x / s`` (:func:`row_scale`): the backward of a softmax reduction passes ``|x|**2`` and
``|x| / eps``, which overflow long before the derivative does, and in that frame they do not; no
``eps**2`` is ever formed. So the gradients are finite wherever the derivative is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from softops.sort._chunked import chunked_rows, positions
from softops.sort._limits import infinity_kind, limit_logits
from softops.sort._options import MethodOptions

__all__ = ["argsort", "rank", "row_scale", "scaled_inverse", "sort"]

_SCAN_BLOCK = 32
"""Steps per block of the two-level scan (:func:`_scan_forward`)."""

_GAP_CAP = 800.0
"""exp(-800) == 0 in float64: gaps beyond 800 epsilon decouple exactly."""


def _strands(t: Tensor, nb: int, blk: int) -> Tensor:
    """(..., n) -> (..., blk, nb) contiguous, row j holding step j of every block; zero-padded."""
    n = t.shape[-1]
    full = n // blk
    out = t.new_zeros(*t.shape[:-1], blk, nb)
    view = out.transpose(-1, -2)  # (..., nb, blk)
    view[..., :full, :] = t[..., : full * blk].unflatten(-1, (full, blk))
    if n > full * blk:
        view[..., full, : n - full * blk] = t[..., full * blk :]
    return out


def _scan_forward(a: Tensor, b: Tensor) -> Tensor:
    """``h_i = a_i h_{i-1} + b_i`` along the last dim (``h_{-1} = 0``), without a graph: within
    blocks of interleaved strands, then the block ends recursively (log depth), then a fix-up."""
    n = a.shape[-1]
    blk = _SCAN_BLOCK
    if n <= blk:
        h = b.clone()
        for j in range(1, n):  # in place on views: no temporaries, no write-back copies
            h[..., j].addcmul_(a[..., j], h[..., j - 1])
        return h
    nb = -(-n // blk)
    h, prod = _strands(b, nb, blk), _strands(a, nb, blk)
    for j in range(1, blk):  # in place on views: no temporaries, no write-back copies
        h[..., j, :].addcmul_(prod[..., j, :], h[..., j - 1, :])
        prod[..., j, :].mul_(prod[..., j - 1, :])
    ends = _scan_forward(prod[..., -1, :], h[..., -1, :])  # h at the end of every block
    h.addcmul_(prod, _shift_right(ends).unsqueeze(-2))
    return h.transpose(-1, -2).flatten(-2)[..., :n]


def _shift_right(t: Tensor) -> Tensor:
    """``t_{i-1}`` at i (0 at i = 0)."""
    return torch.nn.functional.pad(t[..., :-1], (1, 0))


def _shift_left(t: Tensor) -> Tensor:
    """``t_{i+1}`` at i (0 at i = n - 1)."""
    return torch.nn.functional.pad(t[..., 1:], (0, 1))


class _Recurrence(torch.autograd.Function):
    """``h_i = a_i h_{i-1} + b_i``; its backward, the adjoint recurrence, is differentiable again.
    No forward mode (so ``torch.compile`` traces it); :class:`_LinearRecurrence` adds it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor) -> Tensor:
        return _scan_forward(a, b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        a, _ = inputs
        ctx.save_for_backward(a, output)
        ctx.save_for_forward(a, output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        a, h = ctx.saved_tensors
        lam = linear_recurrence(_shift_left(a).flip(-1), grad.flip(-1)).flip(-1)
        return lam * _shift_right(h), lam


class _LinearRecurrence(_Recurrence):
    """:class:`_Recurrence` with forward mode: ``h'_i = a_i h'_{i-1} + (a'_i h_{i-1} + b'_i)``."""

    @staticmethod
    def jvp(ctx: Any, a_t: Tensor | None, b_t: Tensor | None) -> Tensor:
        a, h = ctx.saved_tensors
        src = torch.zeros_like(h)
        if a_t is not None:
            src = src + a_t * _shift_right(h)
        if b_t is not None:
            src = src + b_t
        return linear_recurrence(a, src)


def linear_recurrence(a: Tensor, b: Tensor) -> Tensor:
    """``h_i = a_i h_{i-1} + b_i`` along the last dim, ``h_{-1} = 0``: stable for ``a`` in [0, 1]
    and ``b >= 0``, O(n) autograd memory, differentiable any number of times."""
    if torch.compiler.is_compiling():
        return cast(Tensor, _Recurrence.apply(a, b))
    return cast(Tensor, _LinearRecurrence.apply(a, b))


def _l1_scan(
    x2: Tensor,
    epsilon: Tensor,
    descending: bool,
    values: bool,
    ranks: bool,
    offset: Tensor | None = None,
    masked: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Values and/or ranks of l1 SoftSort by local-frame recurrences, in float64 (docs/math.md §3);
    ``masked``: rows may hold ``±inf`` (decay 0 across a block of equal infinities, 1 inside)."""
    n = x2.shape[-1]
    u, perm = torch.sort(x2.double(), dim=-1)
    # The scans run on u / s (row_scale): gaps, moments and their gradients stay the size of
    # x / s, and s / eps (one factor, exp-log) takes the scale back.
    eps = epsilon.double()
    scale = row_scale(u, eps, 1.0, 2.0)  # over the finite entries
    q = scaled_inverse(eps, scale, 1.0).unsqueeze(-1)  # s / eps
    cap = _GAP_CAP * torch.exp(torch.log(eps).unsqueeze(-1) - torch.log(scale))  # 800 eps / s
    if masked:
        fin = torch.isfinite(u)
        u_inf = u
        u = torch.where(fin, u, 0.0)
        us = u / scale
        raw = us[:, 1:] - us[:, :-1]
        fin2 = fin[:, 1:] & fin[:, :-1]
        same = u_inf[:, 1:] == u_inf[:, :-1]
        raw = torch.where(fin2, raw, torch.where(same, 0.0, cap))
    else:
        us = u / scale
        raw = us[:, 1:] - us[:, :-1]
    # gaps >= 0, capped where exp(-gap/eps) is 0 in float64 anyway (finite gradients there)
    gap = torch.minimum(raw, cap)
    # in [0, 1]: the kernel's decay from one point to the next (gap / eps <= 800)
    dec = torch.exp(-gap * q)
    a_fwd = torch.nn.functional.pad(dec, (1, 0))  # d_i, i = 0..n-1 (d_0 = 0)
    a_rev = torch.nn.functional.pad(dec.flip(-1), (1, 0))  # the same, right to left
    a2 = torch.stack((a_fwd, a_rev))

    def both(b_left: Tensor, b_right: Tensor) -> tuple[Tensor, Tensor]:
        """Inclusive left and right sums: h_i = b_i + d_i h_{i-1}, and its mirror."""
        h = linear_recurrence(a2, torch.stack((b_left, b_right.flip(-1))))
        return h[0], h[1].flip(-1)

    ones = torch.ones_like(u)
    left, right_inc = both(ones, ones)  # sum_{j<=i} k_ij, sum_{j>=i} k_ij
    right = _shift_left(right_inc) * torch.nn.functional.pad(dec, (0, 1))  # sum_{j>i} k_ij
    z = left + right  # >= 1
    out_v = out_r = None
    if values:
        # first moments sum_{j<i} k_ij (u_i - u_j) and sum_{j>i} k_ij (u_j - u_i), by
        # M^L_i = d_i (gap_i L_{i-1} + M^L_{i-1}) and its mirror (in the units of u / s)
        w = dec * gap
        m_left, m_right = both(
            torch.nn.functional.pad(w * left[:, :-1], (1, 0)),
            torch.nn.functional.pad(w * right_inc[:, 1:], (0, 1)),
        )
        v = (us + (m_right - m_left) / z) * scale
        if masked:  # the finite ones are a mean of the finite entries; infinities stay
            lo = torch.where(fin, u, math.inf).amin(-1, keepdim=True)
            hi = torch.where(fin, u, -math.inf).amax(-1, keepdim=True)
            v = torch.where(fin, torch.minimum(torch.maximum(v, lo), hi), u_inf)
        else:
            v = torch.minimum(torch.maximum(v, u[:, :1]), u[:, -1:])  # a mean: rounding only
        out_v = (v.flip(-1) if descending else v).to(x2.dtype)
    if ranks:
        pos = positions(n, descending, torch.float64, x2.device)
        if offset is not None:
            pos = pos + offset.double().unsqueeze(-1)
        wts = pos / z  # column sums sum_i (pos_i / Z_i) k_ij, evaluated at the points u_j
        c_left, c_right_inc = both(wts, wts)
        r_sorted = c_left + _shift_left(c_right_inc) * torch.nn.functional.pad(dec, (0, 1))
        if not masked:  # a row of one NaN has no gap to carry it: NaN rows stay NaN
            r_sorted = r_sorted + u[:, :1] * 0
        r = torch.zeros_like(r_sorted).scatter(-1, perm, r_sorted)
        out_r = r.to(x2.dtype)
    return out_v, out_r


def row_scale(x2: Tensor, eps: Tensor, power: float, spread: float) -> Tensor:
    """A detached power of two s >= 1 (B, 1) per row (module docstring): up to ``max|x|`` while
    ``|x| s / eps**power`` stays below ``finfo.max / 2**10 / n``; 1 where ``max|x| <= 1``."""
    with torch.no_grad():
        xd = x2.detach()
        fmax = torch.finfo(xd.dtype).max
        mag = torch.where(torch.isfinite(xd), xd.abs(), 0.0).amax(-1, keepdim=True).double()
        e = eps.detach().double().view(-1, 1)
        # in log2, where nothing overflows: low (the forward), high (the backward), mag
        low = torch.log2(mag.clamp(min=1.0)) + math.log2(4.0 * spread / fmax)
        high = (
            math.log2(fmax / (2.0**10 * xd.shape[-1]))
            + power * torch.log2(e)
            - torch.log2(mag.clamp(min=1.0))
        )
        want = torch.minimum(torch.log2(mag.clamp(min=1.0)), high).clamp(min=0.0)
        want = torch.maximum(want, low)
        top = math.frexp(fmax)[1] - 1  # the dtype's largest power of two
        exponent = torch.ceil(want).clamp(max=top)
    return torch.exp2(exponent).to(xd.dtype)


def scaled_inverse(eps: Tensor, scale: Tensor, power: float = 1.0) -> Tensor:
    """``scale / eps**power`` (B,) as ``exp(log s - p log eps)``, saturated below ``finfo.max``."""
    top = math.log(torch.finfo(eps.dtype).max) - 1e-3  # exp(top) < finfo.max, by 0.1%
    log_ratio = torch.log(scale.view(-1).to(eps.dtype)) - power * torch.log(eps)
    return torch.exp(log_ratio.clamp(max=top))


def _distance_logits(distance: str) -> Callable[..., Tensor]:
    def logits(u_blk: Tensor, xs: Tensor, q: Tensor) -> Tensor:
        """``-d(u, x)/eps`` from ``u/s, x/s`` and ``q = s/eps`` (l1) or ``s/sqrt(eps)`` (l2);
        ``(u - x) q`` clipped at ``sqrt(finfo.max)`` (the weight is 0 beyond it either way)."""
        diff = u_blk.unsqueeze(-1) - xs.unsqueeze(1)  # (B, b, n)
        qv = q.view(-1, 1, 1)
        if distance == "l1":
            return diff.abs() * -qv
        root = math.sqrt(torch.finfo(diff.dtype).max)
        return (diff * qv).clamp(-root, root).square().neg()

    return logits


def _power(distance: str) -> float:
    """The power of eps in q (:func:`_distance_logits`)."""
    return 1.0 if distance == "l1" else 0.5


def _masked_logits(distance: str) -> Callable[..., Tensor]:
    """:func:`_distance_logits` at the limit with infinities (:func:`limit_logits`)."""
    base = _distance_logits(distance)

    def logits(rp: Tensor, xz: Tensor, q: Tensor, kind_x: Tensor) -> Tensor:
        return limit_logits(rp[1], kind_x, base(rp[0], xz, q))

    return logits


def _blocked(
    x2: Tensor,
    epsilon: Tensor,
    descending: bool,
    distance: str,
    *,
    values: bool = False,
    ranks: bool = False,
    matrix: bool = False,
    offset: Tensor | None = None,
    masked: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Values, ranks and/or P in checkpointed row blocks; ``masked``: rows may hold ``±inf``,
    taken to their limit by masks alone."""
    # The sorted values by a gather, not ``torch.sort(x2).values``: the same gradient, but
    # torch.compile (torch 2.13, inductor) gets the gradient of the latter wrong when x2 also
    # enters the graph directly, as it does here (the slow torch.compile test of the contract).
    u = x2.gather(-1, torch.sort(x2.detach(), dim=-1).indices)
    # distances of x / s (no overflow, hence no inf in the backward), with s put back into q
    eps = epsilon.to(x2.dtype)
    scale = row_scale(x2, eps, _power(distance), 2.0)  # over the finite entries
    q = scaled_inverse(eps, scale, _power(distance))
    extra: tuple[Tensor, ...]
    if masked:  # finite rows see the finite columns only (:func:`_masked_logits`)
        kind_u, kind_x = infinity_kind(u.detach()), infinity_kind(x2.detach())
        logits = _masked_logits(distance)
        rows = torch.stack((torch.where(kind_u == 0, u / scale, 0.0), kind_u))
        xs = torch.where(kind_x == 0, x2, 0.0)
        extra = (torch.where(kind_x == 0, x2 / scale, 0.0), q, kind_x)
    else:
        logits, rows, xs, extra = _distance_logits(distance), u / scale, x2, (x2 / scale, q)
    v, r, p = chunked_rows(
        logits,
        rows,
        xs,
        extra,
        descending,
        values=values,
        ranks=ranks,
        matrix=matrix,
        offset=offset,
    )
    if masked and v is not None:
        srt = torch.sort(x2.detach(), dim=-1, descending=descending).values
        v = torch.where(torch.isinf(srt), srt, v)
    return v, r, p


def masked(kind: str, x2: Tensor, eps: Tensor, descending: bool, opts: MethodOptions) -> Tensor:
    """``kind`` of rows that may hold ``±inf``, at their limit, by masks alone (``_limits``)."""
    if kind != "argsort" and opts.distance == "l1":
        v, r = _l1_scan(x2, eps, descending, kind == "sort", kind == "rank", masked=True)
        return cast(Tensor, v if kind == "sort" else r)
    v, r, p = _blocked(
        x2,
        eps,
        descending,
        opts.distance,
        values=kind == "sort",
        ranks=kind == "rank",
        matrix=kind == "argsort",
        masked=True,
    )
    return cast(Tensor, {"sort": v, "rank": r, "argsort": p}[kind])


def sort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""SoftSort values ``P @ x``, (B, n) in x2's dtype."""
    if opts.distance == "l1":
        v, _ = _l1_scan(x2, eps, descending, values=True, ranks=False)
    else:
        v, _, _ = _blocked(x2, eps, descending, opts.distance, values=True)
    return cast(Tensor, v)


def rank(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""SoftSort ranks :math:`r_j = \sum_i (i + \mathrm{offset})\,P_{ij}`, (B, n) in x2's dtype."""
    if opts.distance == "l1":
        _, r = _l1_scan(x2, eps, descending, values=False, ranks=True, offset=offset)
    else:
        _, r, _ = _blocked(x2, eps, descending, opts.distance, ranks=True, offset=offset)
    return cast(Tensor, r)


def argsort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""The (B, n, n) row-stochastic SoftSort matrix P, in checkpointed row blocks."""
    _, _, p = _blocked(x2, eps, descending, opts.distance, matrix=True)
    return cast(Tensor, p)
