r"""Method "softkmax" of ``soft_topk_mask`` and the kernel of :func:`softops.soft_kmax`.

The recursive soft-k-max of Su (2019): with :math:`x' = x - \min_j x_j` and :math:`p^{(0)} = 0`,
repeat k times

.. math::

    p^{(t)} = p^{(t-1)} + \mathrm{softmax}\big(x' \odot (1 - p^{(t-1)}) / \varepsilon\big).

Plain autograd through the rounds; from k = 16 on, segments of about sqrt(k) rounds are
checkpointed. Each round's logits are formed relative to its top entry, in the units of x before
the correctly rounded ``1/eps`` scales them, so they neither carry the rounding of the span nor
saturate where ``x'/eps`` overflows. Near a tie the gradient grows like
``(max x' / (4 eps))**(k - 1)``: where that exceeds the dtype's range the recursion has no
meaningful derivative and the backward overflows.

References:
    Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近 (On smoothing: differentiable approximations
    of non-differentiable functions), section "softkmax". Blog post, kexue.fm, 2019.
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
    """The soft-k-max recursion on each row of x2 (B, n); returns p (B, n).

    ``x2`` is in the compute dtype (float32 or float64), ``k`` an int in [0, n] (validated by
    the caller), ``eps`` a (B,) tensor that may require grad. Plain autograd: the backward saves
    about two (B, n) tensors per step (p and q, three when eps requires grad) and a bool one,
    O(k B n) in all, for k < 16; from k = 16 on, segments of about sqrt(k) steps are
    checkpointed (recomputed in the backward), O(sqrt(k) B n).

    Infinities: ``+inf`` entries are 1 and each uses one of the k steps, ``-inf`` entries are 0
    and take no part (neither in the minimum nor in the softmax); the remaining ``k - #(+inf)``
    steps run over the finite entries. A row with a NaN, more than k entries at ``+inf``, or
    fewer than k entries above ``-inf`` is NaN, with a zero gradient.
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
    # A power of two per row (exact, detached) that keeps every difference the rounds form
    # finite: 1, or 1/8 where the row's span exceeds finfo.max / 8 (the logits are hard there).
    wide = (hi - mn > fmax / 8).detach()
    h = torch.where(wide, 0.125, 1.0).to(x2.dtype)
    xh, mh = xs * h, mn * h
    a = torch.where(ok, xh - mh, 0)  # (x - min x) h >= 0
    # Exclude the entries that are not `ok`, except in rows with none (they are never active,
    # and an all -inf softmax would put NaN where a 0 is wanted).
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
        # Segments of about sqrt(k) rounds, recomputed in the backward: the backward keeps
        # O(sqrt(k)) (B, n) tensors instead of O(k), for one more forward pass.
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
    relative to its value (``-1/eps``, ``2/eps**2``, ...), formed as ``exp(-log eps)`` so that
    eps is never squared.

    A logit is ``z = u / eps`` with ``u`` in the units of x. Differentiated as a product, its
    eps derivative takes ``sum(gz * u)``, the cotangent in the units of the logits times ``u``,
    which overflows where the recursion's cotangent grows (like ``(span / eps)**(k - 2)`` near a
    tie) while the derivative itself is small. Written as ``z0 + z0 * (eps0 / eps - 1)`` with
    ``z0 = u / eps0``, it takes ``sum(gz * z0)`` instead, in the units of the derivative.
    """
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
    """Rounds t0..t1-1 of the recursion; a row runs only its first ``steps`` rounds.

    Each round's logits ``w/eps``, ``w = (x - min x)(1 - p)``, are formed relative to the
    round's top entry j (softmax is shift-invariant), as the difference ``d = w - w_j`` in the
    units of x, times ``1/eps``:

    - for an entry not yet half taken (``p <= 1/2``), ``d = (x - x_j) - a p + a_j p_j`` with
      ``a = x - min x``: the entries near the top carry the rounding of their own gaps and
      weights, not of the span from the row minimum (KD21);
    - for one more than half taken, ``d = a (1 - p) - w_j``: exact where the entry is taken
      (``p = 1``: it is back at the minimum; ``x - x_j - a`` would carry the rounding of a
      span).

    An entry far below the top gets at most a logit that overflows to ``-inf`` (weight 0),
    never a saturation that ties entries at the top (KD20). ``d`` is finite (``h`` keeps it
    within the dtype) and at most 0 (0 at the excluded entries, whose ``-inf`` comes from the
    mask: their own d is unbounded, and scaled it overflowed to ``+inf``, NaN beside the mask,
    KD26), so no logit is NaN or ``+inf``, and a ``-inf`` one gets a
    zero gradient without a NaN (its weight is 0, and ``d`` and ``1/eps`` are finite).
    """
    for t in range(t0, t1):
        ap = a * p  # saves p (a is shared)
        w = a - ap
        with torch.no_grad():
            top = p <= 0.5
            # the round's top entry, to the rounding of the span: then d is formed to that of
            # the gaps near the top (their distances to j), and the shift below makes d <= 0
            j = (w + mask).argmax(-1, keepdim=True)
            # The terms of j are a constant of the row, which the softmax does not see, so they
            # carry no derivative (of any order): both branches are x - a p + a constant, the
            # second through `m - m.detach()` (exactly 0), which puts back the derivative in
            # min x that a = x - min x takes from it.
            xj, aj, pj = xh.gather(-1, j), a.gather(-1, j), p.gather(-1, j)
            apj = aj * pj
            wj = aj - apj
        d = torch.where(top, (xh - xj) - ap + apj, w - (wj - (mh - mh.detach())))  # saves `top`
        with torch.no_grad():  # rounding may leave an entry a hair above j: d <= 0 after this
            dmax = (d + mask).amax(-1, keepdim=True)
            # and the excluded entries (mask -inf) to 0: their d is not bounded by dmax (a p_j a_j
            # far above x_j), and d * (1/eps) overflowed to +inf there, +inf + -inf = NaN
            off = torch.where(mask < 0, d - dmax, 0)
            # and a logit that would overflow to -inf (weight 0 either way) to -max / 2, so that
            # the eps term below is 0, not -inf * 0
            floor = -torch.finfo(d.dtype).max / 2 / (inv * hinv)
            off = off + (d - dmax - off - floor).clamp(max=0)
        z = (d - dmax - off) * (inv * hinv)  # <= 0 and finite
        if ratio.requires_grad:  # the eps derivative in the logits' units (_unit_ratio)
            z = z + z * ratio  # saves z, as the product with 1/eps saved d - dmax - off
        z = z + mask
        q = torch.softmax(z, -1)  # saves q
        p = p + q * (t < steps)[:, None]  # (a (B, 1) factor: cheaper than a where)
    return p
