r"""Method "softkmax" of ``soft_topk_mask`` and the kernel of :func:`softops.soft_kmax`.

The recursive soft-k-max of Su (2019, the reference of :func:`softops.soft_kmax`): with
:math:`x' = x - \min_j x_j` and :math:`p^{(0)} = 0`, repeat k times

.. math::

    p^{(t)} = p^{(t-1)} + \mathrm{softmax}\big(x' \odot (1 - p^{(t-1)}) / \varepsilon\big).

Plain autograd through the rounds; from k = 16 on, segments of about sqrt(k) rounds are
checkpointed. The logits are formed relative to each round's top entry (docs/math.md §1.8). Near
a tie the gradient grows like ``(max x' / (4 eps))**(k - 1)``: beyond the dtype's range the
backward overflows.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from softops._core.transforms import under_functorch
from softops.topk._options import MaskOptions, unreachable_rows

__all__ = ["mask", "soft_kmax_rows"]

_KMAX_CHECKPOINT_MIN = 16  # from this k on, the backward recomputes segments of rounds


def mask(
    x2: torch.Tensor, k_row: torch.Tensor, eps: torch.Tensor, opts: MaskOptions
) -> torch.Tensor:
    """The backend entry of ``soft_topk_mask``: :func:`soft_kmax_rows` with k = ``opts.k_int``."""
    return soft_kmax_rows(x2, opts.k_int, eps)


def soft_kmax_rows(x2: torch.Tensor, k: int, eps: torch.Tensor) -> torch.Tensor:
    """The soft-k-max recursion on each row of x2 (B, n) (k in [0, n], eps (B,)): p (B, n).

    ``+inf`` entries are 1 and each uses one of the k steps, ``-inf`` entries are 0 and take no
    part; a row whose k cannot be met (or with a NaN) is NaN, with a zero gradient.
    """
    finite = torch.isfinite(x2)
    pinf = x2 == math.inf
    n_pinf = pinf.sum(-1)
    bad = unreachable_rows(x2, k)
    ok = finite & ~bad[:, None]  # the entries that run the recursion
    # Double where: entries that are not `ok` never reach an arithmetic op with a gradient.
    xs = torch.where(ok, x2, 0)
    fmax = torch.finfo(x2.dtype).max
    hi = torch.where(ok, xs, -math.inf).amax(-1, keepdim=True)
    mn = torch.where(ok, xs, math.inf).amin(-1, keepdim=True)
    mn = torch.where(torch.isfinite(mn), mn, 0)
    # a power of two per row that keeps every difference finite: 1/8 where the span is huge
    wide = (hi - mn > fmax / 8).detach()
    h = torch.where(wide, 0.125, 1.0).to(x2.dtype)
    xh, mh = xs * h, mn * h
    a = torch.where(ok, xh - mh, 0)  # (x - min x) h >= 0
    # exclude the entries that are not `ok`, except in rows with none (no all -inf softmax)
    excluded = ~ok & ok.any(-1, keepdim=True)
    mask = torch.zeros_like(xs).masked_fill_(excluded, -math.inf)  # additive: saves nothing
    scale = (_inverse(eps[:, None]), 1 / h, _unit_ratio(eps[:, None]))
    steps = torch.where(bad, 0, k - n_pinf)  # recursion steps per row
    p = a * 0 + scale[2] * 0  # zeros, on the graph of x and eps (k = 0: a zero gradient)
    # torch.func transforms refuse checkpointing (its saved-tensor hooks): plain autograd there
    grad = xs.requires_grad or eps.requires_grad
    plain = not (torch.is_grad_enabled() and grad) or under_functorch()
    if k < _KMAX_CHECKPOINT_MIN or plain:
        p = _kmax_rounds(xh, a, mh, mask, *scale, steps, p, 0, k)
    else:
        # segments of about sqrt(k) rounds, recomputed in the backward (O(sqrt(k) B n) memory)
        size = math.isqrt(k - 1) + 1
        for t0 in range(0, k, size):
            p = checkpoint(
                _kmax_rounds, xh, a, mh, mask, *scale, steps, p, t0, min(k, t0 + size),
                use_reentrant=False,
            )  # fmt: skip
    p = torch.where(pinf, 1.0, p)
    return torch.where(bad[:, None], math.nan, p)


def _inverse(eps: torch.Tensor) -> torch.Tensor:
    """``1/eps``, correctly rounded and detached: the logits' derivative in eps is carried by
    :func:`_unit_ratio`."""
    return (1 / eps).detach()


def _unit_ratio(eps: torch.Tensor) -> torch.Tensor:
    """``eps0 / eps - 1`` at ``eps0 = eps``: exactly 0, with every derivative of ``1/eps``
    relative to its value, never squaring eps; the logits' eps derivative goes through it in
    their own units (docs/math.md §1.8)."""
    log = torch.log(eps)
    return torch.exp(log.detach() - log) - 1


def _kmax_rounds(
    xh: torch.Tensor,
    a: torch.Tensor,
    mh: torch.Tensor,
    mask: torch.Tensor,
    inv: torch.Tensor,
    hinv: torch.Tensor,
    ratio: torch.Tensor,
    steps: torch.Tensor,
    p: torch.Tensor,
    t0: int,
    t1: int,
) -> torch.Tensor:
    """Rounds t0..t1-1 of the recursion (a row runs only its first ``steps`` rounds), the logits
    relative to each round's top entry j (docs/math.md §1.8)."""
    for t in range(t0, t1):
        ap = a * p  # saves p (a is shared)
        w = a - ap
        with torch.no_grad():
            top = p <= 0.5
            j = (w + mask).argmax(-1, keepdim=True)
            # j's terms are a row constant, without derivative; `mh - mh.detach()` (exactly 0)
            # puts back the derivative in min x that a = x - min x takes
            xj, aj, pj = xh.gather(-1, j), a.gather(-1, j), p.gather(-1, j)
            apj = aj * pj
            wj = aj - apj
        d = torch.where(top, (xh - xj) - ap + apj, w - (wj - (mh - mh.detach())))  # saves `top`
        with torch.no_grad():  # rounding may leave an entry a hair above j: d <= 0 after this
            dmax = (d + mask).amax(-1, keepdim=True)
            # and the excluded entries (mask -inf) to 0, whose d is unbounded (no +inf + -inf)
            off = torch.where(mask < 0, d - dmax, 0)
        z = (d - dmax - off) * inv * hinv  # <= 0; -inf where it overflows (weight 0)
        if ratio.requires_grad:  # the eps derivative in the logits' units (_unit_ratio)
            # -max in place of -inf, whose product with the ratio (0) would be NaN
            finite = torch.where(z > -math.inf, z, -torch.finfo(z.dtype).max)
            z = z + finite * ratio  # saves `finite`, as the product with 1/eps saved d - dmax - off
        z = z + mask
        q = torch.softmax(z, -1)  # saves q
        p = p + q * (t < steps)[:, None]  # (a (B, 1) factor: cheaper than a where)
    return p
