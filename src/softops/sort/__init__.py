r"""The sort family: soft_sort, soft_rank, soft_argsort and soft_quantile.

Methods (the static table ``softops.sort._dispatch.METHODS``, one file each): ``"pav"``, the
projection onto the permutahedron (Blondel et al. 2020; sort, rank, quantile; exact, O(n log n));
``"softsort"`` (Prillo and Eisenschlos 2020) and ``"neuralsort"`` (Grover et al. 2019): sort,
rank, argsort; ``"ot"``, entropic optimal transport (Cuturi, Teboul and Vert 2019): all four.

**Epsilon** is the smoothing strength (larger is smoother): a float, or a tensor broadcastable to
the batch shape (``x.shape`` without ``dim``) that receives a gradient; at least the compute
dtype's ``finfo.tiny`` (``ValueError`` below). Its units, with the scaling law for c > 0:

- "pav": torchsort's ``regularization_strength`` (``soft_rank(x, epsilon=e)`` equals
  ``torchsort.soft_rank(x, regularization_strength=e)``): units of x for ranks
  (``soft_rank(c*x, epsilon=c*e) == soft_rank(x, epsilon=e)``), of 1/x for values
  (``soft_sort(c*x, epsilon=e/c) == c*soft_sort(x, epsilon=e)``, and so for ``soft_quantile``);
- "softsort" (l1) and "neuralsort": the temperature :math:`\tau`, units of x
  (``epsilon=c*e``); "softsort" (l2) and "ot": units of x² (``epsilon=c**2*e``).

**Unused arguments.** An argument the chosen method does not use raises ``ValueError`` when it
differs from its default (``soft_sort(x, method="softsort", regularization="kl")``).

**Non-finite inputs.** A NaN gives NaN in its own row only; infinities behave as the limit of
``±inf`` replaced by ``±M``, ``M -> inf`` (equal infinities staying tied):

- "softsort", "neuralsort", "ot": the finite entries are relaxed as the method on those entries
  alone, and the infinities take the ends of the output order. ``soft_rank`` gives an infinite
  entry the mean of its tied hard positions and a finite one :math:`\sum_i (o + i) P'_{ij}`
  (:math:`P'` the finite entries' matrix, ``o`` the infinities before them);
  ``soft_argsort``'s row at an infinite position is uniform over that infinity's columns.
  Infinite entries get a zero gradient. Eagerly this costs one host sync.
- "pav": the projection's own limits; ``soft_rank`` as above. The l2 ``soft_sort`` keeps the
  row's mean, so an infinity pulls the whole row to it, and ``-inf`` with ``+inf`` give NaN; the
  kl one saturates. Finite entries get finite gradients.
- ``soft_quantile`` interpolates the soft sort: an infinite neighbour wins unless its weight is
  0, and ``-inf`` against ``+inf`` gives NaN.

References:
    Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking. ICML 2020.
    arXiv:2002.08871.
    Prillo and Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
    ICML 2020. arXiv:2006.16038.
    Grover, Wang, Zweig and Ermon. Stochastic Optimization of Sorting Networks via Continuous
    Relaxations. ICLR 2019. arXiv:1903.08850.
    Cuturi, Teboul and Vert. Differentiable Ranks and Sorting using Optimal Transport.
    NeurIPS 2019. arXiv:1905.11885.
"""

from __future__ import annotations

from typing import cast

import torch

from softops._core.dims import prepare_rows
from softops._core.straight_through import straight_through
from softops._core.validation import check_bool, check_dim, check_floating, check_q, compute_dtype
from softops.sort._dispatch import (  # the method tuples stay importable from softops.sort
    ARGSORT_METHODS,  # noqa: F401
    DISTANCES,  # noqa: F401
    METHODS,
    QUANTILE_METHODS,  # noqa: F401
    REGULARIZATIONS,  # noqa: F401
    SORT_METHODS,  # noqa: F401
    check_options,
    interpolate,
)
from softops.sort._limits import MaskedBackend, with_limits
from softops.sort._options import MethodOptions

__all__ = ["METHODS", "check_options", "soft_argsort", "soft_quantile", "soft_rank", "soft_sort"]
# (``METHODS`` and ``check_options`` are the family's face for softops.nn: not in
# softops.__all__.)


def _relax(
    method: str, kind: str, x2: torch.Tensor, eps: torch.Tensor, desc: bool, opts: MethodOptions
) -> torch.Tensor:
    """The backend's ``kind`` on canonical rows: "pav" with its own limits, the others through
    :func:`with_limits`."""
    backend = METHODS[method]
    if method == "pav":
        return cast("torch.Tensor", getattr(backend, kind)(x2, eps, desc, opts))
    masked = cast("MaskedBackend | None", getattr(backend, "masked", None))
    return with_limits(getattr(backend, kind), kind, x2, eps, desc, opts, masked)


def _sort_or_rank(
    op: str,
    x: torch.Tensor,
    dim: int,
    descending: bool,
    epsilon: float | torch.Tensor,
    method: str,
    regularization: str,
    distance: str,
    max_iter: int | None,
    tol: float | None,
) -> torch.Tensor:
    """``soft_sort`` and ``soft_rank``: check, reshape to rows, relax, restore."""
    kind = op.removeprefix("soft_")
    opts = check_options(
        op,
        method,
        kind,
        regularization=regularization,
        distance=distance,
        max_iter=max_iter,
        tol=tol,
    )
    check_bool(descending, op, "descending")
    rows = prepare_rows(op, x, dim, epsilon)
    if rows.x2.shape[0] == 0:
        return x * 0  # empty, but on the graph like every other output
    return rows.restore(_relax(method, kind, rows.x2, rows.eps, descending, opts)).to(x.dtype)


def soft_sort(
    x: torch.Tensor,
    *,
    dim: int = -1,
    descending: bool = False,
    epsilon: float | torch.Tensor = 1.0,
    method: str = "pav",
    regularization: str = "l2",
    distance: str = "l1",
    max_iter: int | None = None,
    tol: float | None = None,
) -> torch.Tensor:
    r"""Soft sort: a differentiable relaxation of the sorted values along ``dim``.

    The hard operator is::

        torch.sort(x, dim, descending).values

    With ``method="pav"`` (Blondel et al. 2020) the descending soft sort of a row
    :math:`\theta` is the projection of :math:`\rho/\varepsilon`, :math:`\rho = (n, \dots, 1)`,
    onto the permutahedron of :math:`\theta`, found by isotonic regression on the sorted row:

    .. math::

        \mathrm{sort}_\downarrow(\theta) = P_Q(\rho/\varepsilon, \theta)
        = \rho/\varepsilon - v\big(\rho/\varepsilon - \theta_{\downarrow}\big), \qquad
        v(y) = \arg\min_{v_1 \ge \dots \ge v_n} \tfrac12 \|v - y\|^2 ,

    and the ascending one is ``-sort_desc(-x)``. The output is sorted, keeps the mean of x (l2),
    is exact once every gap between sorted neighbours is below ``1/epsilon`` and tends to the
    mean as ``epsilon -> inf``.
    {args}
    Example:
        >>> x = torch.tensor([[3.0, 1.0, 2.0], [0.0, 10.0, 5.0]])
        >>> soft_sort(x, epsilon=0.1)
        tensor([[ 1.,  2.,  3.],
                [ 0.,  5., 10.]])
    """
    return _sort_or_rank(
        "soft_sort", x, dim, descending, epsilon, method, regularization, distance, max_iter, tol
    )


def soft_rank(
    x: torch.Tensor,
    *,
    dim: int = -1,
    descending: bool = False,
    epsilon: float | torch.Tensor = 1.0,
    method: str = "pav",
    regularization: str = "l2",
    distance: str = "l1",
    max_iter: int | None = None,
    tol: float | None = None,
) -> torch.Tensor:
    r"""Soft rank: a differentiable relaxation of the 1-based ranks along ``dim``.

    The hard operator is::

        x.argsort(dim, descending).argsort(dim) + 1

    so rank 1 is the smallest entry by default, as in torchsort and ``scipy.stats.rankdata``.
    With ``method="pav"`` (Blondel et al. 2020) the ranks of a row :math:`\theta` are the
    projection of :math:`\theta/\varepsilon` onto the permutahedron of
    :math:`\rho = (n, \dots, 1)`:

    .. math::

        \mathrm{rank}(\theta) = P_Q(\theta/\varepsilon, \rho)
        = \theta/\varepsilon - v(s - \rho)_{\sigma^{-1}}, \qquad
        s = (\theta/\varepsilon)_\sigma \text{ sorted descending},

    with :math:`v` the decreasing isotonic regression, or for ``regularization="kl"``
    :math:`\exp P_E(\theta/\varepsilon, \log\rho)`. Ranks from "pav" lie in [1, n], sum to
    n(n+1)/2, are exact once every gap between sorted neighbours exceeds ``epsilon`` (l2) and
    tend to (n+1)/2 as ``epsilon -> inf``; the other methods' ranks are estimates.
    {args}
    Example:
        >>> x = torch.tensor([[3.0, 1.0, 2.0], [0.0, 10.0, 5.0]])
        >>> soft_rank(x, epsilon=0.1)
        tensor([[3., 1., 2.],
                [1., 3., 2.]])
        >>> soft_rank(torch.tensor([3.0, float("inf"), 1.0]), epsilon=0.01)
        tensor([2., 3., 1.])
    """
    return _sort_or_rank(
        "soft_rank", x, dim, descending, epsilon, method, regularization, distance, max_iter, tol
    )


_SORT_ARGS = r"""
    Args:
        x: input of any shape, floating dtype.
        dim: the dimension to sort (or rank) along.
        descending: descending order (for ranks: rank 1 for the largest entry).
        epsilon: the smoothing strength, larger is smoother: a float, or a tensor broadcastable
            to the batch shape. Units and scaling law: the module docstring.
        method: "pav" (default; exact projection, O(n log n) per row), "softsort",
            "neuralsort" or "ot".
        regularization: "pav" only: "l2" (Euclidean projection, default) or "kl".
        distance: "softsort" only: "l1" (default) or "l2".
        max_iter: "ot" only: the iteration cap (None: its default).
        tol: "ot" only: the stopping tolerance (None: its default; 0 runs ``max_iter``).

    Returns:
        A tensor with the shape, dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: the same.

"""

for _fn in (soft_sort, soft_rank):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ = _fn.__doc__.replace("    {args}\n", _SORT_ARGS)


def soft_argsort(
    x: torch.Tensor,
    *,
    dim: int = -1,
    descending: bool = False,
    epsilon: float | torch.Tensor = 1.0,
    method: str = "softsort",
    distance: str = "l1",
    hard: bool = False,
    max_iter: int | None = None,
    tol: float | None = None,
) -> torch.Tensor:
    r"""Soft argsort: a row-stochastic relaxation of the permutation matrix that sorts ``x``.

    The hard operator is::

        torch.nn.functional.one_hot(torch.argsort(x, dim, descending), n)

    with the one-hot axis last: row i of the output approximates ``one_hot(argsort(x)[i])``, so
    ``P @ x`` (along ``dim``) approximates the sorted values. For "softsort":

    .. math::

        P_{ij} = \mathrm{softmax}_j\big(-d(x_{[i]}, x_j)/\varepsilon\big),

    where :math:`x_{[i]}` is the i-th sorted value and d is ``distance``.

    Args:
        x: input of any shape, floating dtype.
        dim: the dimension to sort along.
        descending: sort in descending order.
        epsilon: the temperature (:math:`\tau` of SoftSort/NeuralSort, :math:`\varepsilon` of
            the OT), larger is smoother; a float or a tensor broadcastable to the batch shape.
        method: "softsort" (default), "neuralsort" or "ot" ("pav" has no permutation matrix).
        distance: "softsort" only: "l1" (default) or "l2".
        hard: straight-through: the hard permutation matrix forward, the soft gradient backward.
        max_iter: "ot" only: the iteration cap (None: its default).
        tol: "ot" only: the stopping tolerance (None: its default).

    Returns:
        A tensor of shape ``x.shape + (n,)``, with the dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: :math:`(*, n, *, n)`.

    Example:
        >>> x = torch.tensor([3.0, 1.0, 2.0])
        >>> soft_argsort(x, hard=True)
        tensor([[0., 1., 0.],
                [0., 0., 1.],
                [1., 0., 0.]])
    """
    op = "soft_argsort"
    opts = check_options(op, method, "argsort", distance=distance, max_iter=max_iter, tol=tol)
    check_bool(descending, op, "descending")
    check_bool(hard, op, "hard")
    rows = prepare_rows(op, x, dim, epsilon)
    x2, eps, n = rows.x2, rows.eps, rows.n
    if x2.shape[0] == 0:
        return (x * 0).unsqueeze(-1).expand(*x.shape, n)  # empty, on the graph
    P = _relax(method, "argsort", x2, eps, descending, opts)
    if hard:
        order = torch.argsort(x2.detach(), dim=-1, descending=descending, stable=True)
        P = straight_through(torch.nn.functional.one_hot(order, n), P)
    return rows.restore(P).to(x.dtype)


def soft_quantile(
    x: torch.Tensor,
    q: float | torch.Tensor,
    *,
    dim: int = -1,
    epsilon: float | torch.Tensor = 1.0,
    method: str = "pav",
    keepdim: bool = False,
) -> torch.Tensor:
    r"""Soft quantile: a differentiable relaxation of ``torch.quantile`` (linear interpolation).

    The hard operator is::

        torch.quantile(x, q, dim, keepdim)

    It is read off the ascending soft sort :math:`s` (:func:`soft_sort`, l2 for "pav", same
    epsilon) as ``torch.quantile`` reads the hard one: at position :math:`p = q\,(n - 1)`,

    .. math::

        Q_q = s_{\lfloor p \rfloor} + (p - \lfloor p \rfloor)\,
              \big(s_{\lfloor p \rfloor + 1} - s_{\lfloor p \rfloor}\big),

    (0-based). It tends to the mean as ``epsilon -> inf``; a tensor ``q`` receives a gradient.

    Args:
        x: input of any shape, floating dtype.
        q: a float in [0, 1], or a 0-dim or 1-D floating tensor of values in [0, 1].
        dim: the dimension to reduce.
        epsilon: the smoothing strength, as for :func:`soft_sort` with the same method.
        method: "pav" (default) or "ot".
        keepdim: keep the reduced dimension with size 1.

    Returns:
        A tensor with the dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``.
        - output: x's shape without ``dim`` (size 1 there if ``keepdim``); a 1-D ``q`` of
          length m adds a leading dimension of size m, as in ``torch.quantile``.

    Example:
        >>> x = torch.tensor([[3.0, 1.0, 2.0, 4.0], [0.0, 10.0, 5.0, 1.0]])
        >>> soft_quantile(x, 0.5, epsilon=0.01)
        tensor([2.5000, 3.0000])
        >>> soft_quantile(x, torch.tensor([0.25, 0.75]), epsilon=0.01)
        tensor([[1.7500, 0.7500],
                [3.2500, 6.2500]])
    """
    op = "soft_quantile"
    opts = check_options(op, method, "quantile")
    check_bool(keepdim, op, "keepdim")
    check_floating(x, op)
    d = check_dim(x, dim, op)
    qt = check_q(q, op, compute_dtype(x.dtype), x.device)
    rows = prepare_rows(op, x, dim, epsilon)
    x2, eps = rows.x2, rows.eps
    q1 = qt.reshape(-1)
    if x2.shape[0] == 0:
        y = x2[:, :1] * 0 + q1 * 0  # (0, len(q)): empty, on the graph of x and q
    else:
        y = interpolate(_relax(method, "sort", x2, eps, False, opts), q1)
    out = rows.restore(y).movedim(d, 0)  # (m, *batch)
    if keepdim:
        out = out.unsqueeze(d + 1)
    if qt.dim() == 0:
        out = out.squeeze(0)
    return out.to(x.dtype)
