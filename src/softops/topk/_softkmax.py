r"""Method "softkmax" of ``soft_topk_mask`` and the kernel of :func:`softops.soft_kmax`.

The recursive soft-k-max of Su (2019, section "softkmax"): with :math:`x' = x - \min_j x_j` and
:math:`p^{(0)} = 0`, repeat k times

.. math::

    p^{(t)} = p^{(t-1)} + \mathrm{softmax}\big(x' \odot (1 - p^{(t-1)}) / \varepsilon\big),

so each round takes a soft maximum and moves it to the row minimum. Plain autograd through the
rounds; from k = 16 on, segments of about sqrt(k) rounds are checkpointed.

Conditioning: each round's logits depend on the previous rounds through ``-x'/eps``, so near a
tie the gradient grows like ``(max x' / (4 eps))**(k - 1)``. Where that exceeds the dtype's range
(float32: ``x'/eps`` of 1e10 with k = 4) the backward overflows, and can be NaN: the recursion has
no meaningful derivative there.

References:
    Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近 (On smoothing: differentiable approximations
    of non-differentiable functions), section "softkmax". Blog post, kexue.fm, 2019.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from softops._core.transforms import under_functorch
from softops.topk._options import unreachable_rows

__all__ = ["soft_kmax_rows"]

_KMAX_CHECKPOINT_MIN = 16  # from this k on, the backward recomputes segments of rounds


def soft_kmax_rows(x2: torch.Tensor, k: int, eps: torch.Tensor) -> torch.Tensor:
    """The soft-k-max recursion on each row of x2 (B, n); returns p (B, n).

    ``x2`` is in the compute dtype (float32 or float64), ``k`` an int in [0, n] (validated by
    the caller), ``eps`` a (B,) tensor that may require grad. Plain autograd: the backward saves
    about two (B, n) tensors per step, O(k B n) in all, for k < 16; from k = 16 on, segments of
    about sqrt(k) steps are checkpointed (recomputed in the backward), O(sqrt(k) B n).

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
    mn = torch.where(ok, xs, math.inf).amin(-1, keepdim=True)
    mn = torch.where(torch.isfinite(mn), mn, 0)
    # (x - min x)/eps >= 0 on `ok` entries, formed so that the backward never meets an inf
    xp = torch.where(ok, _scaled_difference(xs, mn, _inverse(eps)[:, None]), 0)
    # A range beyond the dtype's (x - min x overflows, or a tiny eps) would make inf * 0 = NaN
    # once an entry is taken (1 - p = 0): saturate at the largest finite value instead.
    xp = xp.clamp(max=torch.finfo(xp.dtype).max)
    # Exclude the entries that are not `ok`, except in rows with none (they are never active,
    # and an all -inf softmax would put NaN where a 0 is wanted).
    excluded = ~ok & ok.any(-1, keepdim=True)
    mask = torch.zeros_like(xp).masked_fill_(excluded, -math.inf)  # additive: saves nothing
    steps = torch.where(bad, 0, k - n_pinf)  # recursion steps per row
    p = xp * 0  # zeros, on the graph (k = 0 still has a (zero) gradient)
    # torch.func transforms refuse checkpointing (its saved-tensor hooks): plain autograd there
    plain = not (torch.is_grad_enabled() and xp.requires_grad) or under_functorch()
    if k < _KMAX_CHECKPOINT_MIN or plain:
        p = _kmax_rounds(xp, mask, steps, p, 0, k)
    else:
        # Segments of about sqrt(k) rounds, recomputed in the backward: the backward keeps
        # O(sqrt(k)) (B, n) tensors instead of O(k), for one more forward pass.
        size = math.isqrt(k - 1) + 1
        for t0 in range(0, k, size):
            p = checkpoint(
                _kmax_rounds, xp, mask, steps, p, t0, min(k, t0 + size), use_reentrant=False
            )
    p = torch.where(pinf, 1.0, p)
    return torch.where(bad[:, None], math.nan, p)


def _inverse(eps: torch.Tensor) -> torch.Tensor:
    """``1/eps`` as ``exp(-log eps)``: the same value, but a backward that never squares eps.

    The backward of ``z / eps`` forms ``(z/eps)/eps``, which overflows at an epsilon far below
    the gaps and turns the zero gradient of a saturated round into ``0 * inf = NaN``; here the
    chain is ``grad * inv`` then ``/ eps``, finite whenever the true derivative is (eps is
    clamped to its dtype's normal range by ``prepare_rows``, so ``1/eps`` is finite).
    """
    return torch.exp(-torch.log(eps))


def _scaled_difference(a: torch.Tensor, b: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``(a - b) * inv`` for finite a, b, with a NaN-free backward: where ``a - b`` overflows
    the dtype it is formed as ``(a/2 - b/2) * (2 inv)`` (finite, or an inf in the product only,
    which the caller saturates)."""
    d = a - b
    ok = torch.isfinite(d)
    direct = torch.where(ok, d, 0) * inv
    halved = (a * 0.5 - b * 0.5) * (inv * 2)
    return torch.where(ok, direct, halved)


def _kmax_rounds(
    xp: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor, p: torch.Tensor, t0: int, t1: int
) -> torch.Tensor:
    """Rounds t0..t1-1 of the recursion; a row runs only its first ``steps`` rounds."""
    for t in range(t0, t1):
        # Saved per round: (1 - p) by the product and q by the softmax (xp is shared).
        q = torch.softmax(xp * (1 - p) + mask, -1)
        p = p + torch.where((t < steps)[:, None], q, 0)
    return p
