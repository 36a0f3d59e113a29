r"""SoftSort backend: ``P = softmax(-d(sort(x), x) / epsilon)`` row-wise.

Reference: S. Prillo and J. Eisenschlos, *SoftSort: A Continuous Relaxation for the argsort
Operator*, ICML 2020 (arXiv 2006.16038).

Private backend of :mod:`softops.sort`, with the one backend signature
``sort/rank/argsort(x2, eps, descending, opts, offset=None)`` (``softops.sort._dispatch``):
canonical tensors ``x2`` (B, n) of dtype float32 or float64 and ``eps`` (B,) positive (it may
require grad), ``opts.distance`` "l1" or "l2"; no validation.

Deviations from the paper's notation (Prillo & Eisenschlos 2020, §3, where
:math:`\mathrm{SoftSort}^d_\tau(s) = \mathrm{softmax}(-d(\mathrm{sort}(s)\,1^\top,
1\,s^\top)/\tau)`):

* The paper's temperature :math:`\tau` is ``epsilon``, in the units of x for ``distance="l1"``
  and of x² for ``distance="l2"``. Scaling laws: ``sort(c x, c e) = c sort(x, e)`` (l1) and
  ``sort(c x, c² e) = c sort(x, e)`` (l2), for c > 0; ranks and P are unchanged.
* The paper sorts in descending order. Here ``descending=False`` (the default of the public API)
  uses ``sort(x)`` ascending, so ``P @ x`` is ascending; ``descending=True`` flips the rows of P.
* Soft ranks use the estimator :math:`r_j = \sum_i i\,P_{ij}` (1-based positions i of the output
  order; rank 1 is the smallest when ``descending=False``). P is row-stochastic only, so the
  column weights :math:`\sum_i P_{ij}` are not 1 and r is **not confined to** [1, n], nor do the
  ranks sum to n(n+1)/2. As epsilon -> 0 (distinct values) r tends to the hard 1-based ranks.

Algorithms:

* **l1, values and ranks: exact O(n log n) time, O(n) memory** (not in the paper, which forms
  the n x n matrix). The Laplace kernel :math:`k(a, b) = e^{-|a-b|/\varepsilon}` is
  semiseparable: with u = sort(x) ascending and weights :math:`w \ge 0`,

  .. math::

      \sum_j w_j e^{-|u_i-u_j|/\varepsilon}
        = e^{-u_i/\varepsilon} \sum_{j \le i} w_j e^{u_j/\varepsilon}
        + e^{u_i/\varepsilon} \sum_{j > i} w_j e^{-u_j/\varepsilon},

  i.e. one forward and one (exclusive) reverse ``logcumsumexp``. The rows of P sit exactly at the
  points u, so the normalisers :math:`Z_i`, the values (weights ``u - min u + 1 > 0``, then
  ``P u = (min u - 1) + P(u - min u + 1)``) and the ranks (weights ``pos_i / Z_i`` evaluated at
  the points u, then un-sorted) are a handful of scans. The scans run in float64 on centred
  inputs (their relative cancellation error is about machine-eps x max|u|/epsilon; in float32
  rank errors reach 0.6). The values carry that error times the row's span, about
  1e-16 (span/epsilon) span in absolute terms: tied entries beside an outlier 1e6 away (epsilon
  1) come out 3e-5 apart, a known limit of the single global frame. The exclusive scan is
  padded with a huge negative *finite* number (``-inf`` would give NaN gradients), and the
  backward is plain autograd. At exact ties SoftSort is not
  differentiable (|.| at its kink); this path and the dense formula pick different subgradients
  there, and agree everywhere else.
* **l2 values and ranks, and the full P** (``argsort``, any distance): rows of P are processed
  in checkpointed blocks by :func:`softops.sort._chunked.chunked_rows` (at most
  ``BLOCK_ELEMENTS`` entries at once), so the peak extra memory is O(B n block) instead of
  O(B n²) (besides the (B, n, n) output of ``argsort`` itself).

Non-finite inputs: a NaN gives NaN in its own row only. Rows containing ``±inf`` give NaN here
(an infinite sorted value has no finite distance to itself); the public layer
(:mod:`softops.sort`) takes them to their limits before calling this backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from softops.sort._chunked import chunked_rows, positions
from softops.sort._options import MethodOptions

__all__ = ["argsort", "rank", "sort"]

_PAD = -1e300  # exclusive-scan padding: exp(_PAD - anything finite) == 0, and finite gradients


def _laplace_lse(a: Tensor, logw: Tensor) -> Tensor:
    """``log sum_j w_j exp(-|a_i - a_j|)`` for sorted ``a`` (B, n), exactly, by two scans."""
    left = torch.logcumsumexp(a + logw, dim=-1) - a
    rev = torch.logcumsumexp((logw - a).flip(-1), dim=-1).flip(-1)  # j >= i
    pad = torch.full_like(rev[:, :1], _PAD)
    right = torch.cat((rev[:, 1:], pad), dim=-1) + a  # j > i
    return torch.logaddexp(left, right)


def _l1_scan(
    x2: Tensor,
    epsilon: Tensor,
    descending: bool,
    values: bool,
    ranks: bool,
    offset: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Values and/or ranks of l1 SoftSort by the semiseparable scans (float64)."""
    n = x2.shape[-1]
    u, perm = torch.sort(x2.double(), dim=-1)
    with torch.no_grad():
        lo, hi = u[:, :1], u[:, -1:]
        centre = 0.5 * (lo + hi)
    eps = epsilon.double().unsqueeze(-1)
    a = (u - centre) / eps
    log_z = _laplace_lse(a, torch.zeros_like(a))
    out_v = out_r = None
    if values:
        shifted = u - lo + 1.0  # >= 1: strictly positive weights, no log 0
        v = (_laplace_lse(a, shifted.log()) - log_z).exp() + (lo - 1.0)
        out_v = (v.flip(-1) if descending else v).to(x2.dtype)
    if ranks:
        pos = positions(n, descending, torch.float64, x2.device)
        if offset is not None:
            pos = pos + offset.double().unsqueeze(-1)
        r_sorted = _laplace_lse(a, pos.log() - log_z).exp()
        r = torch.zeros_like(r_sorted).scatter(-1, perm, r_sorted)
        out_r = r.to(x2.dtype)
    return out_v, out_r


def _distance_logits(distance: str) -> Callable[..., Tensor]:
    def logits(u_blk: Tensor, x2: Tensor, eps: Tensor) -> Tensor:
        diff = u_blk.unsqueeze(-1) - x2.unsqueeze(1)  # (B, b, n)
        d = diff.abs() if distance == "l1" else diff.square()
        return d / -eps.view(-1, 1, 1)

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
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    # The sorted values by a gather, not ``torch.sort(x2).values``: the same gradient, but
    # torch.compile (torch 2.13, inductor) gets the gradient of the latter wrong when x2 also
    # enters the graph directly, as it does here (the slow torch.compile test of the contract).
    u = x2.gather(-1, torch.sort(x2.detach(), dim=-1).indices)
    eps = epsilon.to(x2.dtype)
    return chunked_rows(
        _distance_logits(distance),
        u,
        x2,
        (x2, eps),
        descending,
        values=values,
        ranks=ranks,
        matrix=matrix,
        offset=offset,
    )


def sort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""SoftSort values ``P @ x``: a relaxation of ``torch.sort(x, -1, descending).values``.

    .. math::

        P_{ij} = \frac{\exp(-d(\hat x_i, x_j)/\varepsilon)}
                      {\sum_l \exp(-d(\hat x_i, x_l)/\varepsilon)},\qquad
        v_i = \sum_j P_{ij} x_j,

    with :math:`\hat x = \mathrm{sort}(x)` (ascending unless ``descending``) and
    :math:`d(a, b) = |a - b|` ("l1") or :math:`(a - b)^2` ("l2"). l1 is exact in O(n log n) time
    and O(n) memory (semiseparable scans in float64); l2 is row-chunked with checkpointing.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) temperature :math:`\tau` > 0, in units of x (l1) or x² (l2).
        descending: sort in descending order.
        opts: ``opts.distance`` is "l1" or "l2".
        offset: unused (the one backend signature).

    Returns:
        (B, n) soft-sorted values, in x2's dtype. They tend to the hard sorted values as
        epsilon -> 0 and to the row mean as epsilon -> inf.

    References:
        S. Prillo, J. Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
    """
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
    r"""SoftSort ranks: a relaxation of the 1-based ``argsort(argsort(x, -1, descending)) + 1``.

    .. math::

        r_j = \sum_{i=1}^n i\, P_{ij},\qquad
        P_{ij} = \operatorname{softmax}_j\!\big(-d(\hat x_i, x_j)/\varepsilon\big),

    where :math:`\hat x` is ``sort(x)`` in the requested order (rank 1 is the smallest when
    ``descending=False``). This column-weighted estimator is not confined to [1, n] (P is only
    row-stochastic); it tends to the hard ranks as epsilon -> 0 for distinct values.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) temperature :math:`\tau` > 0, in units of x (l1) or x² (l2).
        descending: rank 1 for the largest instead of the smallest.
        opts: ``opts.distance`` is "l1" (exact O(n log n)) or "l2" (row-chunked, O(n²) time).
        offset: optional (B,) shift of the positions i (the public layer uses it for the entries
            that precede a row's finite ones when it takes infinities to their limits).

    Returns:
        (B, n) soft ranks, in x2's dtype.

    References:
        S. Prillo, J. Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
    """
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
    r"""The SoftSort matrix P: row i relaxes ``one_hot(argsort(x, -1, descending)[i])``.

    .. math::

        P_{ij} = \frac{\exp(-d(\hat x_i, x_j)/\varepsilon)}
                      {\sum_l \exp(-d(\hat x_i, x_l)/\varepsilon)}.

    P is row-stochastic and ``P @ x`` equals :func:`sort`. Computed row-chunked with
    checkpointing, so besides the (B, n, n) output autograd keeps O(B n) per block.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) temperature :math:`\tau` > 0, in units of x (l1) or x² (l2).
        descending: rows in descending order of x.
        opts: ``opts.distance`` is "l1" or "l2".
        offset: unused (the one backend signature).

    Returns:
        (B, n, n) row-stochastic P, in x2's dtype.

    References:
        S. Prillo, J. Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
    """
    _, _, p = _blocked(x2, eps, descending, opts.distance, matrix=True)
    return cast(Tensor, p)
