r"""Smooth maximum, soft argmax and soft-k-max: the softmax family of seed 002.

Su Jianlin's note on smoothing (seed 002) builds every operator here from one identity,

.. math::

    \max_i x_i = \lim_{\varepsilon \to 0^+} \varepsilon \log \sum_i e^{x_i / \varepsilon},

whose right-hand side at a fixed :math:`\varepsilon > 0` is the smooth maximum (logsumexp). Its
gradient, :math:`\mathrm{softmax}(x/\varepsilon)`, relaxes ``one_hot(argmax(x))``; the inner
product of that relaxed one-hot with the indices relaxes ``argmax``; and repeating "take the
soft maximum, then remove it" k times gives the seed's soft-k-max, a relaxed top-k mask.

Conventions and deviations from the note:

- The note writes the temperature as :math:`1/K` (it mostly uses K = 1); here it is ``epsilon``
  in the units of x, and larger is smoother.
- ``soft_argmax`` is 0-based, like ``torch.argmax`` (the note uses indices 1..n).
- Infinities follow the library-wide masking convention (DESIGN §2): ``-inf`` entries are never
  selected and ``+inf`` entries always are. For the softmax-based ops this is the limit; for
  ``soft_kmax`` it is a convention, since the recursion's own limits are degenerate (see there).

References:
    Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近 (On smoothing: differentiable approximations of
    non-differentiable functions). Blog post, kexue.fm, 2019 (seed 002).
    Bridle. Probabilistic interpretation of feedforward classification network outputs (the
    softmax). Neurocomputing, 1990.
    Boyd and Vandenberghe. Convex Optimization, §3.1.5 (log-sum-exp as a smooth maximum). 2004.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from softops._core.dims import flatten_to_2d, row_param
from softops._core.straight_through import straight_through
from softops._core.validation import (
    check_bool,
    check_dim,
    check_epsilon,
    check_floating,
    check_k,
    check_nonempty,
    compute_dtype,
)

__all__ = [
    "smooth_max",
    "smooth_min",
    "soft_argmax",
    "soft_argmax_onehot",
    "soft_argmin",
    "soft_kmax",
]


# --------------------------------------------------------------------------------- row kernels


def _scaled_rows(
    x2: torch.Tensor, eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shift and scale each row of x2 (B, n) for a softmax, with infinities as their limits.

    Returns ``(y, m, pinf, nan_row, dead_row)``: ``y = (x - m)/eps`` with ``m`` the (detached)
    row maximum, ``-inf`` at ``-inf`` entries; ``pinf`` marks the ``+inf`` entries; ``nan_row``
    the rows holding a NaN and ``dead_row`` the rows that are entirely ``-inf``. Rows that hold
    a NaN or a ``+inf``, and dead rows, are "special": their answer is fixed by the caller, and
    their ``y`` is 0 so that neither the values nor the gradients of the plain path see an
    infinity (the double-where trick: no 0 * inf in the backward).
    """
    finite = torch.isfinite(x2)
    pinf = x2 == math.inf
    nan_row = torch.isnan(x2).any(-1)
    dead_row = (x2 == -math.inf).all(-1)
    special = nan_row | dead_row | pinf.any(-1)
    m = torch.where(finite, x2, -math.inf).amax(-1).detach()
    m = torch.where(special, 0, m)
    xs = torch.where(finite, x2, 0)
    y = (xs - m[:, None]) / eps[:, None]
    y = torch.where(finite, y, -math.inf)
    y = torch.where(special[:, None], 0, y)
    return y, m, pinf, nan_row, dead_row


def _softmax_rows(x2: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``softmax(x2/eps)`` per row (B, n), with infinities as their limits.

    ``-inf`` entries get 0; ``+inf`` entries share the mass equally (the others get 0); a row
    that holds a NaN, or is entirely ``-inf``, is NaN. Those rows have a zero gradient.
    """
    y, _, pinf, nan_row, dead_row = _scaled_rows(x2, eps)
    p = torch.softmax(y, -1)
    n_pinf = pinf.sum(-1, keepdim=True)
    fill = pinf.to(p.dtype) / n_pinf.clamp_min(1)
    fill = torch.where((nan_row | dead_row)[:, None], math.nan, fill)
    special = (nan_row | dead_row | (n_pinf[:, 0] > 0))[:, None]
    return torch.where(special, fill, p)


def _smooth_max_rows(x2: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``eps * logsumexp(x2/eps)`` per row: (B, n) -> (B,), with infinities as their limits.

    Computed as ``m + eps * logsumexp((x - m)/eps)`` with m the row maximum, so the result is
    never below the maximum (the sum inside the log is at least 1).
    """
    y, m, pinf, nan_row, dead_row = _scaled_rows(x2, eps)
    v = m + eps * torch.logsumexp(y, -1)
    has_pinf = pinf.any(-1)
    fill = torch.where(has_pinf, math.inf, -math.inf)
    fill = torch.where(nan_row, math.nan, fill)
    return torch.where(nan_row | dead_row | has_pinf, fill, v)


def _soft_kmax_rows(x2: torch.Tensor, k: int, eps: torch.Tensor) -> torch.Tensor:
    """The soft-k-max recursion of seed 002 on each row of x2 (B, n); returns p (B, n).

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
    n_fin = finite.sum(-1)
    bad = torch.isnan(x2).any(-1) | (n_pinf > k) | (n_pinf + n_fin < k)
    ok = finite & ~bad[:, None]  # the entries that run the recursion
    # Double where: entries that are not `ok` never reach an arithmetic op with a gradient.
    xs = torch.where(ok, x2, 0)
    mn = torch.where(ok, xs, math.inf).amin(-1, keepdim=True)
    mn = torch.where(torch.isfinite(mn), mn, 0)
    xp = torch.where(ok, (xs - mn) / eps[:, None], 0)  # (x - min x)/eps >= 0 on `ok` entries
    # A range beyond the dtype's (x - min x overflows, or a tiny eps) would make inf * 0 = NaN
    # once an entry is taken (1 - p = 0): saturate at the largest finite value instead.
    xp = xp.clamp(max=torch.finfo(xp.dtype).max)
    # Exclude the entries that are not `ok`, except in rows with none (they are never active,
    # and an all -inf softmax would put NaN where a 0 is wanted).
    excluded = ~ok & ok.any(-1, keepdim=True)
    mask = torch.zeros_like(xp).masked_fill_(excluded, -math.inf)  # additive: saves nothing
    steps = torch.where(bad, 0, k - n_pinf)  # recursion steps per row
    p = xp * 0  # zeros, on the graph (k = 0 still has a (zero) gradient)
    if k < _KMAX_CHECKPOINT_MIN or not (torch.is_grad_enabled() and xp.requires_grad):
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


_KMAX_CHECKPOINT_MIN = 16  # from this k on, the backward recomputes segments of rounds


def _kmax_rounds(
    xp: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor, p: torch.Tensor, t0: int, t1: int
) -> torch.Tensor:
    """Rounds t0..t1-1 of the recursion; a row runs only its first ``steps`` rounds."""
    for t in range(t0, t1):
        # Saved per round: (1 - p) by the product and q by the softmax (xp is shared).
        q = torch.softmax(xp * (1 - p) + mask, -1)
        p = p + torch.where((t < steps)[:, None], q, 0)
    return p


# ------------------------------------------------------------------------------------ helpers


def _prepare(
    op: str, x: torch.Tensor, dim: int, epsilon: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, Callable[[torch.Tensor], torch.Tensor]]:
    """Validate and flatten: returns ``(x2, eps_row, d, restore)`` with x2 (B, n) in the compute
    dtype and eps_row (B,)."""
    check_floating(x, op)
    d = check_dim(x, dim, op)
    check_nonempty(x, d, op)
    epsilon = check_epsilon(epsilon, op)
    cd = compute_dtype(x.dtype)
    x2, restore = flatten_to_2d(x, d)
    batch_shape = x.movedim(d, -1).shape[:-1]
    eps_row = row_param(epsilon, batch_shape, op, "epsilon", cd, x.device)
    return x2.to(cd), eps_row, d, restore


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
    x2, eps_row, d, restore = _prepare(op, x, dim, epsilon)
    out = restore(rows(x2, eps_row)[:, None])
    if not keepdim:
        out = out.squeeze(d)
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

    with gradient :math:`\mathrm{softmax}(x/\varepsilon)` (see :func:`soft_argmax_onehot`). It is
    convex, and it tends to the maximum as ``epsilon -> 0``; the lower bound holds exactly in
    floating point (it is computed as :math:`m + \varepsilon \log \sum_i e^{(x_i - m)/\varepsilon}`
    with m the maximum).

    Args:
        x: any shape, floating dtype. float16 and bfloat16 are computed in float32 and the
            result is cast back.
        dim: the dimension to reduce (negative values count from the end).
        keepdim: keep ``dim`` with size 1, as ``torch.amax`` does.
        epsilon: the temperature :math:`\varepsilon` (the seed's :math:`1/K`), in the units of
            x; larger is smoother. A positive float, or a floating tensor broadcastable to the
            batch shape (``x.shape`` without ``dim``), which receives a gradient. Scaling law:
            ``smooth_max(c*x, epsilon=c*e) == c * smooth_max(x, epsilon=e)`` for c > 0.

    Returns:
        The smooth maximum, with the dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``.
        - output: x's shape without ``dim`` (with ``dim`` of size 1 if ``keepdim``).

    Infinities are their limits: a ``+inf`` entry gives ``+inf``, ``-inf`` entries add nothing,
    and a row that is entirely ``-inf`` gives ``-inf``. A NaN gives NaN in its own row only.
    Those rows (with a ``+inf``, a NaN, or no entry above ``-inf``) have a zero gradient.

    Example:
        >>> x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> smooth_max(x).round(decimals=4)
        tensor([3.4076, 4.0360])
        >>> smooth_max(x, epsilon=1e-3, keepdim=True)
        tensor([[3.],
                [4.]])

    References:
        Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近. kexue.fm, 2019 (seed 002).
        Boyd and Vandenberghe. Convex Optimization, §3.1.5. 2004.
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

    Args:
        x: any shape, floating dtype (float16 and bfloat16 are computed in float32).
        dim: the dimension to reduce.
        keepdim: keep ``dim`` with size 1.
        epsilon: the temperature, in the units of x; larger is smoother. A positive float, or a
            floating tensor broadcastable to the batch shape, which receives a gradient.
            Scaling law: ``smooth_min(c*x, epsilon=c*e) == c * smooth_min(x, epsilon=e)``, c > 0.

    Returns:
        The smooth minimum, with the dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``.
        - output: x's shape without ``dim`` (with ``dim`` of size 1 if ``keepdim``).

    Infinities mirror :func:`smooth_max`: a ``-inf`` entry gives ``-inf``, ``+inf`` entries add
    nothing, and a row that is entirely ``+inf`` gives ``+inf``. A NaN gives NaN in its row.

    Example:
        >>> smooth_min(torch.tensor([1.0, 2.0, 3.0])).round(decimals=4)
        tensor(0.5924)

    References:
        Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近. kexue.fm, 2019 (seed 002).
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

    As ``epsilon -> 0`` it tends to the index of the maximum where that is unique (tied maxima
    give the mean of their indices). For large ``epsilon`` it tends to (n - 1)/2, not to an
    index: it is an estimate of the position, not a selection.

    Args:
        x: any shape, floating dtype (float16 and bfloat16 are computed in float32; note that
            float16 cannot hold every index above 2048).
        dim: the dimension to reduce.
        keepdim: keep ``dim`` with size 1.
        epsilon: the temperature, in the units of x; larger is smoother. A positive float, or a
            floating tensor broadcastable to the batch shape, which receives a gradient.
            Scaling law: ``soft_argmax(c*x, epsilon=c*e) == soft_argmax(x, epsilon=e)``, c > 0.

    Returns:
        The soft index, with the dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``.
        - output: x's shape without ``dim`` (with ``dim`` of size 1 if ``keepdim``).

    Infinities are their limits: ``-inf`` entries get weight 0, and ``+inf`` entries share the
    weight equally, so the result is the mean of their indices. A row that is entirely ``-inf``
    (nothing can be selected) or holds a NaN gives NaN in that row only, with a zero gradient.

    Example:
        >>> x = torch.tensor([0.0, 3.0, 1.0, 2.0])
        >>> soft_argmax(x).round(decimals=4)
        tensor(1.5289)
        >>> soft_argmax(x, epsilon=1e-3)
        tensor(1.)

    References:
        Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近. kexue.fm, 2019 (seed 002).
        Bridle. Probabilistic interpretation of feedforward classification network outputs.
        Neurocomputing, 1990 (the softmax).
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

    Args:
        x: any shape, floating dtype (float16 and bfloat16 are computed in float32).
        dim: the dimension to reduce.
        keepdim: keep ``dim`` with size 1.
        epsilon: the temperature, in the units of x; larger is smoother. A positive float, or a
            floating tensor broadcastable to the batch shape, which receives a gradient.
            Scaling law: ``soft_argmin(c*x, epsilon=c*e) == soft_argmin(x, epsilon=e)``, c > 0.

    Returns:
        The soft index, with the dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``.
        - output: x's shape without ``dim`` (with ``dim`` of size 1 if ``keepdim``).

    Infinities mirror :func:`soft_argmax`: ``+inf`` entries get weight 0 and ``-inf`` entries
    share it; a row that is entirely ``+inf`` or holds a NaN gives NaN.

    Example:
        >>> soft_argmin(torch.tensor([0.0, 3.0, 1.0, 2.0]), epsilon=1e-3)
        tensor(0.)

    References:
        Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近. kexue.fm, 2019 (seed 002).
    """
    return _reduce("soft_argmin", x, dim, keepdim, epsilon, lambda x2, e: _argmax_rows(-x2, e))


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

    the gradient of :func:`smooth_max`. Values are in [0, 1] and sum to 1 along ``dim``; as
    ``epsilon -> 0`` they tend to the hard one-hot where the maximum is unique (tied maxima
    share the mass).

    Args:
        x: any shape, floating dtype (float16 and bfloat16 are computed in float32).
        dim: the dimension of the categories.
        epsilon: the temperature, in the units of x; larger is smoother. A positive float, or a
            floating tensor broadcastable to the batch shape (``x.shape`` without ``dim``),
            which receives a gradient. Scaling law: ``soft_argmax_onehot(c*x, epsilon=c*e) ==
            soft_argmax_onehot(x, epsilon=e)`` for c > 0.
        hard: straight-through: the forward returns the hard one-hot exactly (ties broken as
            ``torch.argmax`` breaks them), the backward the gradient of the softmax.

    Returns:
        A tensor with the shape, dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Infinities are their limits: ``-inf`` entries get 0, ``+inf`` entries share the mass
    equally (the others get 0). A row that is entirely ``-inf`` (nothing can be selected) or
    holds a NaN gives NaN in that row only, with a zero gradient.

    Example:
        >>> x = torch.tensor([0.0, 3.0, 1.0, 2.0])
        >>> soft_argmax_onehot(x).round(decimals=4)
        tensor([0.0321, 0.6439, 0.0871, 0.2369])
        >>> soft_argmax_onehot(x, hard=True)
        tensor([0., 1., 0., 0.])

    References:
        Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近. kexue.fm, 2019 (seed 002).
        Bridle. Probabilistic interpretation of feedforward classification network outputs.
        Neurocomputing, 1990.
        Bengio, Léonard and Courville. Estimating or propagating gradients through stochastic
        neurons for conditional computation. arXiv:1308.3432, 2013 (straight-through).
    """
    op = "soft_argmax_onehot"
    check_bool(hard, op, "hard")
    x2, eps_row, _, restore = _prepare(op, x, dim, epsilon)
    p = _softmax_rows(x2, eps_row)
    if hard:
        one_hot = torch.zeros_like(x2).scatter_(-1, x2.detach().argmax(-1, keepdim=True), 1.0)
        p = straight_through(one_hot, p)
    return restore(p).to(x.dtype)


def soft_kmax(
    x: torch.Tensor,
    k: int,
    *,
    dim: int = -1,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Soft-k-max (seed 002): a relaxed top-k mask built by k rounds of "soft max, then remove it".

    The hard operator is::

        torch.zeros_like(x).scatter(dim, x.topk(k, dim).indices, 1)

    With :math:`x' = x - \min_j x_j \ge 0` along ``dim`` and :math:`p^{(0)} = 0`:

    .. math::

        q^{(t)} = \mathrm{softmax}\!\left(\frac{x' \odot (1 - p^{(t-1)})}{\varepsilon}\right),
        \qquad p^{(t)} = p^{(t-1)} + q^{(t)}, \qquad t = 1, \dots, k,

    and the result is :math:`p^{(k)}`. Each round is a softmax, so the entries sum to k exactly.
    Replacing each softmax by ``one_hot(argmax)`` shows the idea: select the maximum, zero it
    (it becomes the row minimum after the shift), and repeat.

    **Not clipped.** Entries are >= 0 but can exceed 1: where the k-th largest entry ties with
    the row minimum (for example k = n, or k - 1 entries above many equal minima), the last
    rounds find nothing above the minimum and spread their mass over the already-selected
    entries too. With distinct entries and k = n, as ``epsilon -> 0`` the n - 1 largest tend to
    1 + 1/n and the minimum to 1/n. On rows where k < n, the top k entries are distinct, the
    k-th largest is strictly above the (k+1)-th and above the row minimum, it tends to the hard
    top-k mask as ``epsilon -> 0``. Input ranges beyond the dtype's (``(x - min x)/epsilon`` over
    its largest finite value) saturate there, and entries that saturate tie.

    **Bias.** This is the sequential relaxation "take the max, then zero it", not a projection
    onto :math:`\{0 \le p \le 1, \sum_i p_i = k\}`: at the same epsilon it differs from
    ``soft_topk_mask(x, k, method="ot")``, a sigmoid with one threshold and values in [0, 1].
    A round removes an entry by scaling its shifted score by :math:`1 - p_i`, i.e. by moving it
    towards the row minimum, so an entry's mass depends on its distance to the minimum and on
    the entries picked before it, and at moderate epsilon the selected entries stay further from
    1: for ``x = [5, 2, 3, 4, 1, 6]``, k = 3 and epsilon = 0.5 the largest entry gets 0.891
    here and 0.993 with "ot".

    Args:
        x: scores, any shape, floating dtype. float16 and bfloat16 are computed in float32 and
            the result is cast back.
        k: the number of rounds (entries to select): an int in [0, n]; k = 0 gives zeros.
        dim: the dimension to select along.
        epsilon: the temperature, in the units of x; larger is smoother. A positive float, or a
            floating tensor broadcastable to the batch shape (``x.shape`` without ``dim``),
            which receives a gradient. Scaling law: ``soft_kmax(c*x, k, epsilon=c*e) ==
            soft_kmax(x, k, epsilon=e)`` for c > 0. It is also invariant to adding a constant.

    Returns:
        A tensor with the shape, dtype and device of ``x``; entries >= 0, summing to k along
        ``dim``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Cost: O(k n) time per row. The backward is plain autograd through the k rounds: for k < 16
    it saves about two (B, n) tensors per round, O(k B n) memory (B the number of rows); from
    k = 16 on, segments of about sqrt(k) rounds are checkpointed and recomputed in the backward,
    O(sqrt(k) B n) memory for one more forward pass. For large k prefer
    ``soft_topk_mask(method="ot")`` (O(B n) memory, O(n) per Newton step).

    Infinities follow the masking convention of :func:`softops.soft_topk_mask`: a ``+inf``
    entry is always selected (value exactly 1) and uses one of the k rounds; ``-inf`` entries
    are never selected (value 0) and take no part in the minimum or the softmax; the remaining
    rounds run over the finite entries. A row with more than k entries at ``+inf``, fewer than k
    entries above ``-inf``, or a NaN, gives NaN in that row only, with a zero gradient. (This is
    a convention, not the pointwise limit of the recursion, which degenerates: a ``-inf`` would
    become the minimum and push every other entry to ``+inf``, giving the hard mask.)

    Example:
        >>> x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0])
        >>> soft_kmax(x, 3).round(decimals=4)
        tensor([0.8189, 0.1711, 0.3903, 0.6545, 0.0657, 0.8996])
        >>> soft_kmax(x, 3, epsilon=1e-3)
        tensor([1., 0., 0., 1., 0., 1.])
        >>> soft_kmax(x, 6, epsilon=1e-2).round(decimals=4)  # k = n: not clipped
        tensor([1.1667, 1.1667, 1.1667, 1.1667, 0.1667, 1.1667])

    References:
        Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近 (section "softkmax"). kexue.fm, 2019
        (seed 002).
    """
    op = "soft_kmax"
    x2, eps_row, _, restore = _prepare(op, x, dim, epsilon)
    k_int = int(check_k(k, x2.shape[-1], op, integer=True))
    return restore(_soft_kmax_rows(x2, k_int, eps_row)).to(x.dtype)
