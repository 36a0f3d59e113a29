r"""The sort family: soft_sort, soft_rank, soft_argsort and soft_quantile.

Each public function validates its arguments once, moves ``dim`` last, flattens the batch to
(B, n) in the compute dtype (float16/bfloat16 are computed in float32) and hands the rows to one
backend:

- ``"pav"`` (``_pav.py``): Blondel et al. 2020, projection onto the permutahedron, exact, O(n log n)
  per row. Sort, rank and quantile.
- ``"softsort"`` (``_softsort.py``): Prillo and Eisenschlos 2020. Sort, rank and argsort.
- ``"neuralsort"`` (``_neuralsort.py``): Grover et al. 2019. Sort, rank and argsort.
- ``"ot"`` (``_ot.py``): Cuturi, Teboul and Vert 2019, entropic optimal transport. Sort, rank,
  argsort and quantile.

Backends are imported when first used, so a method whose module is missing fails on use, with a
``ValueError`` naming it, and never on ``import softops``.

**Unused arguments.** An argument that the chosen method does not use raises ``ValueError`` when
it differs from its default in the signature: ``soft_sort(x, method="softsort",
regularization="kl")`` raises, ``soft_sort(x, method="softsort", regularization="l2")`` does not.

**Non-finite inputs** (DESIGN.md §2: infinities behave as their limits; a NaN gives NaN in its own
row only). The limit is that of the entries at ``±inf`` replaced by ``±M``, ``M -> inf`` (equal
infinities staying tied):

- ``"softsort"``, ``"neuralsort"``, ``"ot"``: the infinite entries decouple. The finite entries of
  a row are relaxed among themselves, exactly as the method on that row's finite entries alone;
  in the output order (ascending unless ``descending``) the ``-inf`` entries come first and the
  ``+inf`` entries last. Hence ``soft_sort`` holds ``-inf`` / ``+inf`` at those positions and the
  finite soft values in between; ``soft_rank`` gives an infinite entry the mean of the hard
  positions of its equal infinities (``n`` for a single ``+inf``, ascending), and a finite entry
  :math:`\sum_i (o + i) P'_{ij}`, with :math:`P'` the matrix of the finite entries and ``o`` the
  number of infinities before them; ``soft_argsort`` has, at the infinite positions, rows that are
  uniform over the columns of that infinity, and elsewhere :math:`P'` on the finite columns and 0
  on the infinite ones. Infinite entries get a zero gradient. This takes one host sync per call
  and, for rows with infinities, one backend call per distinct number of finite entries.
- ``"pav"``: the projection's own limits. ``soft_rank`` is exact as for the other methods (an
  infinite entry gets the mean of the positions of its equal infinities). The l2 ``soft_sort``
  keeps the row's mean, so any infinity pulls the whole row to it (``[1, inf] -> [inf, inf]``);
  with both ``-inf`` and ``+inf`` in a row the limit depends on their rates and the row is NaN.
  The kl ``soft_sort`` saturates instead (an infinity's effect stays bounded). The gradient at an
  infinite entry itself is undefined (it may be NaN); finite entries get finite gradients.
- ``soft_quantile`` interpolates the soft-sorted values as above; an infinite neighbour wins
  unless its interpolation weight is 0, and ``-inf`` against ``+inf`` gives NaN.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from softops._core.dims import flatten_to_2d, row_param
from softops._core.straight_through import straight_through
from softops._core.validation import (
    check_bool,
    check_choice,
    check_dim,
    check_epsilon,
    check_floating,
    check_nonempty,
    check_tol,
    compute_dtype,
)

__all__ = ["soft_argsort", "soft_quantile", "soft_rank", "soft_sort"]

SORT_METHODS = ("pav", "softsort", "neuralsort", "ot")
ARGSORT_METHODS = ("softsort", "neuralsort", "ot")
QUANTILE_METHODS = ("pav", "ot")
REGULARIZATIONS = ("l2", "kl")
DISTANCES = ("l1", "l2")

# The optional arguments each method uses, and their defaults in the public signatures.
_USES = {
    "pav": {"regularization"},
    "softsort": {"distance"},
    "neuralsort": set(),
    "ot": {"max_iter", "tol"},
}
_DEFAULTS = {"regularization": "l2", "distance": "l1", "max_iter": None, "tol": None}


def _backend(method: str, op: str) -> ModuleType:
    try:
        return importlib.import_module(f"._{method}", __name__)
    except ModuleNotFoundError as err:  # pragma: no cover - only in a partial installation
        raise ValueError(
            f"{op}: expected an installed backend for method={method!r}; got {err}."
        ) from err


def _check_method_args(op: str, method: str, **kwargs: Any) -> dict[str, Any]:
    """Reject arguments ``method`` does not use (when not at their default); check the rest."""
    for name, value in kwargs.items():
        default = _DEFAULTS[name]
        at_default = value is default or (isinstance(value, str) and value == default)
        if name not in _USES[method] and not at_default:
            raise ValueError(
                f"{op}: expected `{name}` to be left at its default {default!r} "
                f"(method={method!r} does not use it); got {name}={value!r}."
            )
    used = {name: value for name, value in kwargs.items() if name in _USES[method]}
    if "regularization" in used:
        check_choice(used["regularization"], REGULARIZATIONS, op, "regularization")
    if "distance" in used:
        check_choice(used["distance"], DISTANCES, op, "distance")
    max_iter = used.get("max_iter")
    if max_iter is not None:
        if isinstance(max_iter, bool) or not isinstance(max_iter, int):
            raise TypeError(f"{op}: expected `max_iter` to be an int or None; got {max_iter=!r}.")
        if max_iter < 1:
            raise ValueError(f"{op}: expected `max_iter` >= 1 or None; got {max_iter=!r}.")
    if used.get("tol") is not None:
        check_tol(used["tol"], 0.0, op)
    return used


def _prepare(x: torch.Tensor, dim: int, epsilon: Any, op: str):
    """Validate x, dim and epsilon; return (x2, restore, eps_row, n)."""
    check_floating(x, op)
    d = check_dim(x, dim, op)
    n = check_nonempty(x, d, op)
    epsilon = check_epsilon(epsilon, op)
    cd = compute_dtype(x.dtype)
    x2, restore = flatten_to_2d(x, d)
    x2 = x2.to(cd)
    batch_shape = x.movedim(d, -1).shape[:-1]
    eps_row = row_param(epsilon, batch_shape, op, "epsilon", cd, x.device)
    return x2, restore, eps_row, n


def _limit_group(
    xg: torch.Tensor,
    eg: torch.Tensor,
    descending: bool,
    kind: str,
    call: Callable[..., torch.Tensor],
    m: int,
) -> torch.Tensor:
    """The limit for rows (Bg, n) that hold infinities and exactly ``m`` finite entries each.

    In the limit, entries at ``±inf`` decouple from the finite ones: the finite entries are
    relaxed among themselves (``call`` on the (Bg, m) compacted rows), ``-inf`` entries take the
    first output positions (the last if ``descending``) and ``+inf`` ones the others, tied among
    themselves. See :func:`soft_sort` for the outcome per output.
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
        return out if m == 0 else out.scatter(1, slots, call(xs, eg, None))
    if kind == "rank":
        dt = xg.dtype
        first_neg, first_pos = (n - n_neg, 0 * n_pos) if descending else (0 * n_neg, n - n_pos)
        r_neg = (first_neg + (n_neg + 1) / 2).to(dt)  # tied: the mean of their positions
        r_pos = (first_pos + (n_pos + 1) / 2).to(dt)
        out = torch.where(xd == -math.inf, r_neg.unsqueeze(-1), r_pos.unsqueeze(-1))
        return out if m == 0 else out.scatter(1, fin_idx, call(xs, eg, off.to(dt)))
    # argsort: rows at infinite positions are uniform over the equal infinite columns
    s = torch.sort(xd, dim=-1, descending=descending).values
    same = (s.unsqueeze(-1) == xd.unsqueeze(-2)) & torch.isinf(s).unsqueeze(-1)
    out = same.to(xg.dtype)
    out = out / out.sum(-1, keepdim=True).clamp_min(1)
    if m == 0:
        return out
    p_fin = call(xs, eg, None)  # (Bg, m, m)
    cols = torch.zeros(bsz, m, n, dtype=p_fin.dtype, device=xg.device)
    cols = cols.scatter(2, fin_idx.unsqueeze(1).expand(bsz, m, m), p_fin)
    return out.scatter(1, slots.unsqueeze(-1).expand(bsz, m, n), cols)


def _with_limits(
    x2: torch.Tensor,
    eps_row: torch.Tensor,
    descending: bool,
    kind: str,
    call: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``call(x2, eps_row, None)``, with rows holding ``±inf`` (and no NaN) taken to their limit.

    One host sync per call (whether any entry is infinite); rows with infinities are grouped by
    their number of finite entries and each group is one batched call.
    """
    with torch.no_grad():
        inf = torch.isinf(x2)
        special = inf.any(-1) & ~torch.isnan(x2).any(-1)
    try:
        any_special = bool(special.any())
    except RuntimeError:  # under torch.func transforms: no data-dependent branch
        any_special = False
    if not any_special:
        return call(x2, eps_row, None)
    parts, index = [], []
    plain = (~special).nonzero().squeeze(-1)
    if plain.numel():
        parts.append(call(x2[plain], eps_row[plain], None))
        index.append(plain)
    rows = special.nonzero().squeeze(-1)
    n_fin = (~inf[rows]).sum(-1)
    for m in torch.unique(n_fin).tolist():
        r = rows[n_fin == m]
        parts.append(_limit_group(x2[r], eps_row[r], descending, kind, call, m))
        index.append(r)
    idx = torch.cat(index)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    return torch.cat(parts)[inv]


def _interpolate(values: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``torch.quantile``'s linear interpolation of ascending rows ``values`` (B, n) at q (m,).

    Infinite neighbours are taken as limits: the infinite one wins unless its weight is 0, and
    ``-inf`` against ``+inf`` is NaN. Gradients stay finite.
    """
    n = values.shape[-1]
    h = q.to(values.dtype) * (n - 1)
    lo = h.detach().floor().clamp(0, n - 1).long()
    hi = (lo + 1).clamp(max=n - 1)
    frac = h - lo.to(h.dtype)
    v_lo, v_hi = values[:, lo], values[:, hi]
    finite = torch.isfinite(v_lo) & torch.isfinite(v_hi)
    a = torch.where(finite, v_lo, 0.0)
    b = torch.where(finite, v_hi, 0.0)
    lin = a + frac * (b - a)
    return torch.where(finite, lin, torch.where(frac == 0, v_lo, v_lo + v_hi))


def _sort_or_rank(
    op: str,
    kind: str,
    x: torch.Tensor,
    dim: int,
    descending: bool,
    epsilon: Any,
    method: str,
    **kwargs: Any,
) -> torch.Tensor:
    check_choice(method, SORT_METHODS, op, "method")
    used = _check_method_args(op, method, **kwargs)
    check_bool(descending, op, "descending")
    x2, restore, eps_row, _ = _prepare(x, dim, epsilon, op)
    if x2.shape[0] == 0:
        return torch.zeros_like(x)
    fn = getattr(_backend(method, op), kind)
    if method == "pav":  # PAV's own limits (its Function handles infinities)
        y = fn(x2, eps_row, descending, used["regularization"])
        return restore(y).to(x.dtype)
    rank_kw = kind == "rank"

    def call(xs: torch.Tensor, es: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        kw = {"offset": offset} if rank_kw else {}
        if method == "softsort":
            return fn(xs, es, descending, used["distance"], **kw)
        if method == "neuralsort":
            return fn(xs, es, descending, **kw)
        return fn(xs, es, descending, used["max_iter"], used["tol"], **kw)

    y = _with_limits(x2, eps_row, descending, kind, call)
    return restore(y).to(x.dtype)


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
    onto the permutahedron of :math:`\theta` (the convex hull of its permutations), found by
    isotonic regression on the sorted row:

    .. math::

        \mathrm{sort}_\downarrow(\theta) = P_Q(\rho/\varepsilon, \theta)
        = \rho/\varepsilon - v\big(\rho/\varepsilon - \theta_{\downarrow}\big), \qquad
        v(y) = \arg\min_{v_1 \ge \dots \ge v_n} \tfrac12 \|v - y\|^2 ,

    and the ascending one is ``-sort_desc(-x)``. The output is sorted along ``dim``, has the
    mean of x (l2), tends to ``torch.sort(x).values`` as ``epsilon -> 0`` (it is exact once
    every gap between sorted neighbours is below ``1/epsilon``) and to the mean as
    ``epsilon -> inf``.

    Args:
        x: input of any shape, floating dtype (float16 and bfloat16 are computed in float32 and
            cast back).
        dim: the dimension to sort along (negative values count from the end).
        descending: sort in descending order.
        epsilon: the smoothing strength; larger is smoother. A float, or a tensor broadcastable to
            the batch shape (``x.shape`` without ``dim``), which receives a gradient. For "pav" it
            is the paper's :math:`\varepsilon` and torchsort's ``regularization_strength``
            (``soft_sort(x, epsilon=e)`` equals ``torchsort.soft_sort(x,
            regularization_strength=e)``); its units are those of 1/x, with the scaling law
            ``soft_sort(c*x, epsilon=e/c) == c*soft_sort(x, epsilon=e)`` for c > 0 (exact for
            "l2"). For "softsort" (l1) and "neuralsort" it is the temperature :math:`\tau` in
            the units of x (``soft_sort(c*x, epsilon=c*e) == c*soft_sort(x, epsilon=e)``); for
            "softsort" (l2) and "ot" it is in the units of x² (``epsilon=c**2*e``).
        method: "pav" (default; exact projection, O(n log n) per row), "softsort",
            "neuralsort" or "ot". With numba installed (``pip install softops[pav]``), PAV runs
            as a compiled kernel; its first call in a fresh environment compiles it (a few
            seconds, then cached on disk). Without numba, or with ``softops.set_compile(False)``
            / ``SOFTOPS_COMPILE=0``, PAV runs in pure torch, 15 to 60 times slower. CUDA tensors
            make a round trip to the host for the PAV step only.
        regularization: "pav" only: "l2" (Euclidean projection, default) or "kl" (KL
            projection, :math:`P_E(\rho/\varepsilon, \theta)`).
        distance: "softsort" only: "l1" (default) or "l2".
        max_iter: "ot" only: the iteration cap (None: its default).
        tol: "ot" only: the stopping tolerance (None: its default; 0 runs ``max_iter``).

    Returns:
        A tensor with the shape, dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: the same.

    A row holding a NaN gives NaN in that row only; infinities behave as their limits (module
    docstring: for "softsort", "neuralsort" and "ot" a ``+inf`` sorts last with the value
    ``+inf`` and leaves the finite entries as they are without it). An argument the method
    does not use raises ``ValueError`` when it differs from its default (``regularization``
    is "pav" only, ``distance`` "softsort" only, ``max_iter`` and ``tol`` "ot" only).

    Example:
        >>> x = torch.tensor([[3.0, 1.0, 2.0], [0.0, 10.0, 5.0]])
        >>> soft_sort(x, epsilon=0.1)
        tensor([[ 1.,  2.,  3.],
                [ 0.,  5., 10.]])
        >>> soft_sort(x, epsilon=2.0)
        tensor([[1.5000, 2.0000, 2.5000],
                [4.5000, 5.0000, 5.5000]])
        >>> soft_sort(torch.tensor([3.0, float("inf"), 1.0]), epsilon=0.01, method="softsort")
        tensor([1., 3., inf])

    References:
        Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
        ICML 2020. arXiv:2002.08871.
        Prillo and Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
        Grover, Wang, Zweig and Ermon. Stochastic Optimization of Sorting Networks via
        Continuous Relaxations. ICLR 2019. arXiv:1903.08850.
        Cuturi, Teboul and Vert. Differentiable Ranks and Sorting using Optimal Transport.
        NeurIPS 2019. arXiv:1905.11885.
    """
    return _sort_or_rank(
        "soft_sort",
        "sort",
        x,
        dim,
        descending,
        epsilon,
        method,
        regularization=regularization,
        distance=distance,
        max_iter=max_iter,
        tol=tol,
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

    so with the default ``descending=False`` rank 1 is the smallest entry, as in torchsort and
    ``scipy.stats.rankdata``. With ``method="pav"`` (Blondel et al. 2020) the ranks of a row
    :math:`\theta` are the projection of :math:`\theta/\varepsilon` onto the permutahedron of
    :math:`\rho = (n, \dots, 1)`:

    .. math::

        \mathrm{rank}(\theta) = P_Q(\theta/\varepsilon, \rho)
        = \theta/\varepsilon - v(s - \rho)_{\sigma^{-1}}, \qquad
        s = (\theta/\varepsilon)_\sigma \text{ sorted descending},

    with :math:`v` the decreasing isotonic regression, or for ``regularization="kl"``
    :math:`\exp P_E(\theta/\varepsilon, \log\rho)`. Ranks from "pav" lie in [1, n] and sum to
    n(n+1)/2; they are exactly the hard ranks once every gap between sorted neighbours exceeds
    ``epsilon`` (l2), and all tend to (n+1)/2 as ``epsilon -> inf``. Ties share their ranks.

    Args:
        x: input of any shape, floating dtype (float16 and bfloat16 are computed in float32 and
            cast back).
        dim: the dimension to rank along.
        descending: rank 1 for the largest entry instead of the smallest.
        epsilon: the smoothing strength; larger is smoother. A float, or a tensor broadcastable to
            the batch shape, which receives a gradient. For "pav" it is the paper's
            :math:`\varepsilon` and torchsort's ``regularization_strength``, in the units of x:
            ``soft_rank(c*x, epsilon=c*e) == soft_rank(x, epsilon=e)`` for c > 0. "softsort"
            (l1) and "neuralsort": units of x, the same law; "softsort" (l2) and "ot": units
            of x² (``epsilon=c**2*e``).
        method: "pav" (default), "softsort", "neuralsort" or "ot". Only "pav" promises ranks
            in [1, n] that sum to n(n+1)/2. PAV's kernels are as for :func:`soft_sort`.
        regularization: "pav" only: "l2" (default) or "kl".
        distance: "softsort" only: "l1" (default) or "l2".
        max_iter: "ot" only: the iteration cap (None: its default).
        tol: "ot" only: the stopping tolerance (None: its default).

    Returns:
        A tensor with the shape, dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Infinite entries get their limit ranks with every method (a single ``+inf`` gets rank n,
    ascending; equal infinities share their positions; see the module docstring). A row
    holding a NaN gives NaN in that row only. An argument the method does not use raises
    ``ValueError`` when it differs from its default.

    Example:
        >>> x = torch.tensor([[3.0, 1.0, 2.0], [0.0, 10.0, 5.0]])
        >>> soft_rank(x, epsilon=0.1)
        tensor([[3., 1., 2.],
                [1., 3., 2.]])
        >>> soft_rank(x, epsilon=2.0)
        tensor([[2.5000, 1.5000, 2.0000],
                [1.0000, 3.0000, 2.0000]])
        >>> soft_rank(torch.tensor([3.0, float("inf"), 1.0]), epsilon=0.01)
        tensor([2., 3., 1.])

    References:
        Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
        ICML 2020. arXiv:2002.08871.
        Prillo and Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
        Grover, Wang, Zweig and Ermon. Stochastic Optimization of Sorting Networks via
        Continuous Relaxations. ICLR 2019. arXiv:1903.08850.
        Cuturi, Teboul and Vert. Differentiable Ranks and Sorting using Optimal Transport.
        NeurIPS 2019. arXiv:1905.11885.
    """
    return _sort_or_rank(
        "soft_rank",
        "rank",
        x,
        dim,
        descending,
        epsilon,
        method,
        regularization=regularization,
        distance=distance,
        max_iter=max_iter,
        tol=tol,
    )


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
            the OT), larger is smoother; a float or a tensor broadcastable to the batch shape,
            which receives a gradient. Units of x for "softsort" (l1) and "neuralsort", of x²
            for "softsort" (l2) and "ot"; P is unchanged under ``x -> c*x``,
            ``epsilon -> c*epsilon`` (respectively ``c**2*epsilon``), c > 0.
        method: "softsort" (default), "neuralsort" or "ot". "pav" has no permutation matrix
            and raises ``ValueError``.
        distance: "softsort" only: "l1" (default) or "l2".
        hard: straight-through: return the hard permutation matrix, with the gradient of the
            soft one.
        max_iter: "ot" only: the iteration cap (None: its default).
        tol: "ot" only: the stopping tolerance (None: its default).

    Returns:
        A tensor of shape ``x.shape + (n,)``, with the dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: :math:`(*, n, *, n)`.

    Rows of P sum to 1. A NaN gives NaN in its own row only; infinities behave as their limits
    (a row at an infinite position is uniform over the entries equal to that infinity, and
    finite rows put no weight on infinite entries). An argument the method does not use raises
    ``ValueError`` when it differs from its default (``distance`` is "softsort" only,
    ``max_iter`` and ``tol`` "ot" only).

    Example:
        >>> x = torch.tensor([3.0, 1.0, 2.0])
        >>> soft_argsort(x, hard=True)
        tensor([[0., 1., 0.],
                [0., 0., 1.],
                [1., 0., 0.]])
        >>> soft_argsort(x, epsilon=0.1).round(decimals=3)
        tensor([[0., 1., 0.],
                [0., 0., 1.],
                [1., 0., 0.]])

    References:
        Prillo and Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
        Grover, Wang, Zweig and Ermon. Stochastic Optimization of Sorting Networks via
        Continuous Relaxations. ICLR 2019. arXiv:1903.08850.
        Cuturi, Teboul and Vert. Differentiable Ranks and Sorting using Optimal Transport.
        NeurIPS 2019. arXiv:1905.11885.
    """
    op = "soft_argsort"
    if method == "pav":
        raise ValueError(
            f"{op}: expected `method` to be one of {ARGSORT_METHODS} (method='pav' has no "
            f"permutation matrix: it projects onto the permutahedron); got method={method!r}."
        )
    check_choice(method, ARGSORT_METHODS, op, "method")
    used = _check_method_args(op, method, distance=distance, max_iter=max_iter, tol=tol)
    check_bool(descending, op, "descending")
    check_bool(hard, op, "hard")
    x2, restore, eps_row, n = _prepare(x, dim, epsilon, op)
    if x2.shape[0] == 0:
        return x.new_zeros(*x.shape, n)
    fn = _backend(method, op).argsort

    def call(xs: torch.Tensor, es: torch.Tensor, _: Any) -> torch.Tensor:
        if method == "softsort":
            return fn(xs, es, descending, used["distance"])
        if method == "neuralsort":
            return fn(xs, es, descending)
        return fn(xs, es, descending, used["max_iter"], used["tol"])

    P = _with_limits(x2, eps_row, descending, "argsort", call)
    if hard:
        order = torch.argsort(x2.detach(), dim=-1, descending=descending, stable=True)
        P = straight_through(torch.nn.functional.one_hot(order, n), P)
    return restore(P).to(x.dtype)


def _check_q(q: Any, op: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """q as a 0-dim or 1-D tensor of the compute dtype, with every entry in [0, 1]."""
    if isinstance(q, torch.Tensor):
        if not q.dtype.is_floating_point:
            raise TypeError(f"{op}: expected `q` to be a float or a floating tensor; got {q!r}.")
        if q.dim() > 1:
            raise ValueError(
                f"{op}: expected `q` to be a float or a 0-dim or 1-D tensor; got q of shape "
                f"{tuple(q.shape)}."
            )
        qd = q.detach()
        bad = ~((qd >= 0) & (qd <= 1))
        if bool(bad.any()):
            raise ValueError(f"{op}: expected 0 <= `q` <= 1; got q={qd[bad].flatten()[0].item()}.")
        return q.to(dtype=dtype, device=device)
    if isinstance(q, bool) or not isinstance(q, (int, float)):
        raise TypeError(f"{op}: expected `q` to be a float or a tensor; got {q!r}.")
    if not 0 <= q <= 1:
        raise ValueError(f"{op}: expected 0 <= `q` <= 1; got q={q!r}.")
    return torch.tensor(float(q), dtype=dtype, device=device)


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

    For "pav" the quantile is read off the l2 soft sort (see :func:`soft_sort`, same epsilon)
    the way ``torch.quantile`` reads the hard sort: at position :math:`p = q\,(n - 1)`,

    .. math::

        Q_q = s_{\lfloor p \rfloor} + (p - \lfloor p \rfloor)\,
              \big(s_{\lfloor p \rfloor + 1} - s_{\lfloor p \rfloor}\big),

    with :math:`s` the ascending soft sort (0-based). It tends to ``torch.quantile`` as
    ``epsilon -> 0`` and to the mean as ``epsilon -> inf``; a tensor ``q`` receives a gradient.
    "ot" is the quantile of Cuturi et al. 2019 (see ``softops.sort._ot``).

    Args:
        x: input of any shape, floating dtype.
        q: a float in [0, 1], or a 0-dim or 1-D floating tensor of values in [0, 1].
        dim: the dimension to reduce.
        epsilon: the smoothing strength, as for :func:`soft_sort` with the same method: for
            "pav" torchsort's ``regularization_strength`` (units of 1/x,
            ``soft_quantile(c*x, q, epsilon=e/c) == c*soft_quantile(x, q, epsilon=e)``), for
            "ot" units of x² (``epsilon=c**2*e``). A float or a tensor broadcastable to the
            batch shape, which receives a gradient.
        method: "pav" (default) or "ot".
        keepdim: keep the reduced dimension with size 1.

    Returns:
        A tensor with the dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``.
        - output: x's shape without ``dim`` (size 1 there if ``keepdim``); a 1-D ``q`` of
          length m adds a leading dimension of size m, as in ``torch.quantile``.

    A NaN gives NaN in its own row only; infinities behave as their limits (see the module
    docstring).

    Example:
        >>> x = torch.tensor([[3.0, 1.0, 2.0, 4.0], [0.0, 10.0, 5.0, 1.0]])
        >>> soft_quantile(x, 0.5, epsilon=0.01)
        tensor([2.5000, 3.0000])
        >>> soft_quantile(x, torch.tensor([0.25, 0.75]), epsilon=0.01)
        tensor([[1.7500, 0.7500],
                [3.2500, 6.2500]])

    References:
        Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
        ICML 2020. arXiv:2002.08871.
        Cuturi, Teboul and Vert. Differentiable Ranks and Sorting using Optimal Transport.
        NeurIPS 2019. arXiv:1905.11885.
    """
    op = "soft_quantile"
    check_choice(method, QUANTILE_METHODS, op, "method")
    check_bool(keepdim, op, "keepdim")
    check_floating(x, op)
    d = check_dim(x, dim, op)
    qt = _check_q(q, op, compute_dtype(x.dtype), x.device)
    x2, restore, eps_row, _ = _prepare(x, dim, epsilon, op)
    q1 = qt.reshape(-1)
    if x2.shape[0] == 0:
        y = x2.new_zeros(0, q1.shape[0])
    elif method == "pav":
        y = _interpolate(_backend("pav", op).sort(x2, eps_row, False, "l2"), q1)
    else:
        ot = _backend("ot", op)

        def call(xs: torch.Tensor, es: torch.Tensor, _: Any) -> torch.Tensor:
            return ot.sort(xs, es, False, None, None)

        y = _interpolate(_with_limits(x2, eps_row, False, "sort", call), q1)
    out = restore(y).movedim(d, 0)  # (m, *batch)
    if keepdim:
        out = out.unsqueeze(d + 1)
    if qt.dim() == 0:
        out = out.squeeze(0)
    return out.to(x.dtype)
