r"""Smooth maximum and soft argmax: the softmax family (Su 2019).

Su Jianlin's note on smoothing builds every operator here from one identity,

.. math::

    \max_i x_i = \lim_{\varepsilon \to 0^+} \varepsilon \log \sum_i e^{x_i / \varepsilon},

whose right-hand side at a fixed :math:`\varepsilon > 0` is the smooth maximum (logsumexp). Its
gradient, :math:`\mathrm{softmax}(x/\varepsilon)`, relaxes ``one_hot(argmax(x))``; the inner
product of that relaxed one-hot with the indices relaxes ``argmax``; and repeating "take the
soft maximum, then remove it" k times gives the seed's soft-k-max, a relaxed top-k mask, which
lives with its family (:func:`softops.soft_kmax`, in ``softops.topk``).

Conventions shared by every op here, and deviations from the note:

- ``epsilon`` is the note's :math:`1/K`, in the units of x; larger is smoother. It is a positive
  float, or a floating tensor broadcastable to the batch shape (``x.shape`` without ``dim``),
  which receives a gradient; at least ``finfo.tiny`` of the compute dtype, or ``ValueError``.
  Scaling law: the values scale with x (``smooth_max(c*x, epsilon=c*e) == c*smooth_max(x,
  epsilon=e)``, c > 0) and the indices and one-hots are invariant.
- float16 and bfloat16 are computed in float32 and cast back; outputs keep x's dtype and device.
- ``soft_argmax`` is 0-based, like ``torch.argmax`` (the note uses indices 1..n).
- Infinities are their limits: ``-inf`` entries are never selected and ``+inf`` entries always
  are (several share the mass equally); the ``min`` ops mirror this. A row that holds a NaN, or
  has nothing to select, is NaN (``-inf`` for ``smooth_max`` of an all ``-inf`` row) in that
  row only, with a zero gradient, as are the rows with a ``+inf``.

References:
    Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近 (On smoothing: differentiable approximations of
    non-differentiable functions). Blog post, kexue.fm, 2019.
    Bridle. Probabilistic interpretation of feedforward classification network outputs (the
    softmax). Neurocomputing, 1990.
    Boyd and Vandenberghe. Convex Optimization, §3.1.5 (log-sum-exp as a smooth maximum). 2004.
    Bengio, Léonard and Courville. Estimating or propagating gradients through stochastic neurons
    for conditional computation. arXiv:1308.3432, 2013 (the straight-through ``hard=True``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from softops._core.dims import prepare_rows
from softops._core.straight_through import straight_through
from softops._core.validation import check_bool

__all__ = [
    "smooth_max",
    "smooth_min",
    "soft_argmax",
    "soft_argmax_onehot",
    "soft_argmin",
]


# --------------------------------------------------------------------------------- row kernels


def _inverse(eps: torch.Tensor) -> torch.Tensor:
    """``1/eps`` correctly rounded, with the backward of ``exp(-log eps)``, which never squares
    eps (the backward of ``z/eps`` overflows at a tiny eps, giving ``0 * inf = NaN``)."""
    smooth = torch.exp(-torch.log(eps))
    return (1 / eps).detach() + (smooth - smooth.detach())


def _scaled_difference(a: torch.Tensor, b: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``(a - b) * inv`` for finite a, b, with a NaN-free backward: where ``a - b`` overflows
    the dtype (a span of more than its largest finite value) it is formed as
    ``(a/2 - b/2) * (2 inv)``, which is finite or overflows in the product only."""
    d = a - b
    ok = torch.isfinite(d)
    direct = torch.where(ok, d, 0) * inv
    halved = (a * 0.5 - b * 0.5) * (inv * 2)
    return torch.where(ok, direct, halved)


def _scaled_rows(
    x2: torch.Tensor, eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, m, pinf, nan_row, dead_row)``: ``y = (x2 - m)/eps`` per row with m the detached
    row maximum; rows with a NaN, a ``+inf`` or no finite entry get ``y = 0`` (their answer is
    fixed by the caller; the double-where trick keeps infinities out of the backward)."""
    finite = torch.isfinite(x2)
    pinf = x2 == math.inf
    nan_row = torch.isnan(x2).any(-1)
    dead_row = (x2 == -math.inf).all(-1)
    special = nan_row | dead_row | pinf.any(-1)
    m = torch.where(finite, x2, -math.inf).amax(-1).detach()
    m = torch.where(special, 0, m)
    xs = torch.where(finite, x2, 0)
    y = _scaled_difference(xs, m[:, None], _inverse(eps)[:, None])
    y = torch.where(finite, y, -math.inf)
    y = torch.where(special[:, None], 0, y)
    return y, m, pinf, nan_row, dead_row


def _softmax_rows(x2: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``softmax(x2/eps)`` per row (B, n), with infinities as their limits."""
    y, _, pinf, nan_row, dead_row = _scaled_rows(x2, eps)
    p = torch.softmax(y, -1)
    n_pinf = pinf.sum(-1, keepdim=True)
    fill = pinf.to(p.dtype) / n_pinf.clamp_min(1)
    fill = torch.where((nan_row | dead_row)[:, None], math.nan, fill)
    special = (nan_row | dead_row | (n_pinf[:, 0] > 0))[:, None]
    return torch.where(special, fill, p)


def _smooth_max_rows(x2: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``m + eps * logsumexp((x2 - m)/eps)`` per row, (B, n) -> (B,): never below the max."""
    y, m, pinf, nan_row, dead_row = _scaled_rows(x2, eps)
    v = m + eps * torch.logsumexp(y, -1)
    has_pinf = pinf.any(-1)
    fill = torch.where(has_pinf, math.inf, -math.inf)
    fill = torch.where(nan_row, math.nan, fill)
    return torch.where(nan_row | dead_row | has_pinf, fill, v)


# ------------------------------------------------------------------------------------ helpers


def _reduce(
    op: str,
    x: torch.Tensor,
    dim: int,
    keepdim: bool,
    epsilon: float | torch.Tensor,
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],  # (B, n), (B,) -> (B,)
) -> torch.Tensor:
    """A reduction along ``dim``: validate, flatten, apply ``rows``, restore the shape."""
    check_bool(keepdim, op, "keepdim")
    r = prepare_rows(op, x, dim, epsilon)
    out = r.restore(rows(r.x2, r.eps)[:, None])
    if not keepdim:
        out = out.squeeze(r.dim)
    return out.to(x.dtype)


def _argmax_rows(x2: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    idx = torch.arange(x2.shape[-1], dtype=x2.dtype, device=x2.device)
    return (_softmax_rows(x2, eps) * idx).sum(-1)


# ------------------------------------------------------------------------------------- public


def smooth_max(
    x: torch.Tensor,
    *,
    dim: int = -1,
    keepdim: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Smooth maximum (log-sum-exp): a differentiable relaxation of the maximum along ``dim``.

    The hard operator is::

        x.amax(dim, keepdim)

    .. math::

        \operatorname{smooth\_max}_\varepsilon(x)
            = \varepsilon \log \sum_{i=1}^{n} e^{x_i / \varepsilon}
            \in \Big[\max_i x_i,\; \max_i x_i + \varepsilon \log n\Big],

    convex, with gradient :math:`\mathrm{softmax}(x/\varepsilon)`; the lower bound holds
    exactly in floating point. Conventions (epsilon, dtypes, infinities): the module docstring.
    {args}
    Example:
        >>> x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> smooth_max(x).round(decimals=4)
        tensor([3.4076, 4.0360])
    """
    return _reduce("smooth_max", x, dim, keepdim, epsilon, _smooth_max_rows)


def smooth_min(
    x: torch.Tensor,
    *,
    dim: int = -1,
    keepdim: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Smooth minimum: ``-smooth_max(-x)``, a differentiable relaxation of the minimum.

    The hard operator is::

        x.amin(dim, keepdim)

    .. math::

        \operatorname{smooth\_min}_\varepsilon(x)
            = -\varepsilon \log \sum_{i=1}^{n} e^{-x_i / \varepsilon}
            \in \Big[\min_i x_i - \varepsilon \log n,\; \min_i x_i\Big].
    {args}
    Example:
        >>> smooth_min(torch.tensor([1.0, 2.0, 3.0])).round(decimals=4)
        tensor(0.5924)
    """
    return _reduce("smooth_min", x, dim, keepdim, epsilon, lambda x2, e: -_smooth_max_rows(-x2, e))


def soft_argmax(
    x: torch.Tensor,
    *,
    dim: int = -1,
    keepdim: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Soft argmax: the expected index under ``softmax(x/epsilon)``, a float, 0-based.

    The hard operator is (on rows with a unique maximum)::

        x.argmax(dim, keepdim).to(x.dtype)

    .. math::

        \operatorname{soft\_argmax}_\varepsilon(x) = \sum_{i=0}^{n-1} i \,
            \mathrm{softmax}(x/\varepsilon)_i \in [0, n - 1].

    Tied maxima give the mean of their indices; a large ``epsilon`` tends to (n - 1)/2: it
    estimates a position, it does not select one (float16 cannot hold every index above 2048).
    {args}
    Example:
        >>> x = torch.tensor([0.0, 3.0, 1.0, 2.0])
        >>> soft_argmax(x).round(decimals=4)
        tensor(1.5289)
    """
    return _reduce("soft_argmax", x, dim, keepdim, epsilon, _argmax_rows)


def soft_argmin(
    x: torch.Tensor,
    *,
    dim: int = -1,
    keepdim: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Soft argmin: ``soft_argmax(-x)``, the expected index under ``softmax(-x/epsilon)``.

    The hard operator is (on rows with a unique minimum)::

        x.argmin(dim, keepdim).to(x.dtype)

    .. math::

        \operatorname{soft\_argmin}_\varepsilon(x) = \sum_{i=0}^{n-1} i \,
            \mathrm{softmax}(-x/\varepsilon)_i \in [0, n - 1].
    {args}
    Example:
        >>> soft_argmin(torch.tensor([0.0, 3.0, 1.0, 2.0]), epsilon=1e-3)
        tensor(0.)
    """
    return _reduce("soft_argmin", x, dim, keepdim, epsilon, lambda x2, e: _argmax_rows(-x2, e))


_REDUCTION_ARGS = r"""
    Args:
        x: any shape, floating dtype.
        dim: the dimension to reduce.
        keepdim: keep ``dim`` with size 1, as ``torch.amax`` does.
        epsilon: the temperature :math:`\varepsilon` (the note's :math:`1/K`), in x's units
            (the module docstring).

    Returns:
        The reduction (a value, or a soft index), with the dtype and device of ``x``.

    Shape:
        x: :math:`(*, n, *)` with n at ``dim``; output: without ``dim`` (size 1 if ``keepdim``).

"""

for _fn in (smooth_max, smooth_min, soft_argmax, soft_argmin):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ = _fn.__doc__.replace("    {args}\n", _REDUCTION_ARGS)


def soft_argmax_onehot(
    x: torch.Tensor,
    *,
    dim: int = -1,
    epsilon: float | torch.Tensor = 1.0,
    hard: bool = False,
) -> torch.Tensor:
    r"""Relaxed one-hot of the argmax: ``softmax(x/epsilon)`` along ``dim``.

    The hard operator is::

        torch.nn.functional.one_hot(x.argmax(dim), n).movedim(-1, dim).to(x.dtype)

    .. math::

        \operatorname{soft\_argmax\_onehot}_\varepsilon(x)_i
            = \frac{e^{x_i/\varepsilon}}{\sum_j e^{x_j/\varepsilon}},

    the gradient of :func:`smooth_max`: in [0, 1], summing to 1 along ``dim``; tied maxima
    share the mass in the limit.

    Args:
        x: any shape, floating dtype.
        dim: the dimension of the categories.
        epsilon: the temperature, in x's units (the module docstring).
        hard: straight-through: the forward is the hard one-hot (ties broken as
            ``torch.argmax`` breaks them), the backward the softmax's gradient.

    Returns:
        A tensor with the shape of ``x``.

    Shape:
        x: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Example:
        >>> x = torch.tensor([0.0, 3.0, 1.0, 2.0])
        >>> soft_argmax_onehot(x).round(decimals=4)
        tensor([0.0321, 0.6439, 0.0871, 0.2369])
    """
    op = "soft_argmax_onehot"
    check_bool(hard, op, "hard")
    rows = prepare_rows(op, x, dim, epsilon)
    x2 = rows.x2
    p = _softmax_rows(x2, rows.eps)
    if hard:
        one_hot = torch.zeros_like(x2).scatter_(-1, x2.detach().argmax(-1, keepdim=True), 1.0)
        p = straight_through(one_hot, p)
    return rows.restore(p).to(x.dtype)
