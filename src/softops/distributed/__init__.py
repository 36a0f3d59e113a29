r"""Sharded soft top-k over ``torch.distributed``: rows split along ``dim`` across the ranks.

Each rank holds a shard ``x_r`` of every row (shards of any length, empty ones included); the
row is their concatenation in rank order, :math:`x = (x_0, \dots, x_{P-1})`, of length
:math:`n = \sum_r n_r`. The SOFT top-k mask is a sigmoid with one threshold per row
(docs/math.md §1),

.. math::

    A_i = \sigma\big((x_i - t)/\varepsilon\big), \qquad
    F(t) = \sum_r \sum_{i \in r} \sigma\big((x_i - t)/\varepsilon\big) - k = 0,

so the ranks need only agree on t: the sharded op *is* the single-process solver
(``softops.topk.solve_ot_rows`` and ``solve_sparse_rows``) with its row sums all-reduced, started
from one all-gather of each shard's statistics and candidates; no rank sees another's entries.
docs/distributed.md gives the collectives per call and the gradient semantics (the backward is
that of ``L = sum_r L_r(A_r)``).

Collectives are ``all_reduce`` with SUM, so every backend runs them; a header checked on every
rank makes inconsistent calls raise everywhere instead of hanging. Without a process group the
op runs as a world of one unless ``WORLD_SIZE`` > 1, which raises. Not supported: double
backward (it raises), forward mode, ``torch.func`` and ``torch.compile`` tracing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from softops._core.convergence import warn_not_converged
from softops._core.straight_through import straight_through
from softops.distributed._group import _MASK, _THRESHOLD, _TOPK, METHODS, _prepare
from softops.distributed._mask import _ShardedMaskOT, _ShardedMaskSparse, _solve_ot
from softops.distributed._topk import _Route, _sharded_topk
from softops.solvers import ThresholdResult, threshold_result
from softops.topk import SAMPLE_SIZE

__all__ = [
    "METHODS",
    "SAMPLE_SIZE",
    "ShardedTopK",
    "ThresholdResult",
    "soft_topk_mask",
    "topk",
    "topk_threshold",
]


def soft_topk_mask(
    x_local: torch.Tensor,
    k: int | float | torch.Tensor,
    *,
    group: Any = None,
    dim: int = -1,
    largest: bool = True,
    epsilon: float | torch.Tensor = 0.1,
    method: str = "ot",
    max_iter: int | None = None,
    tol: float | None = None,
    hard: bool = False,
) -> torch.Tensor:
    r"""This rank's part of the soft top-k mask of rows sharded along ``dim`` across a group.

    The hard operator, on the concatenated row ``x = torch.cat(shards, dim)`` (shards in rank
    order), is::

        torch.zeros_like(x).scatter(dim, x.topk(k, dim, largest).indices, 1)

    and the result equals ``softops.soft_topk_mask(x, k, ...)`` on the concatenated row (the
    module's formula), restricted to this rank's shard (to rounding, gradients included).

    Call it on every rank of the group, with the same k, epsilon and options and the shards of
    the same rows: ``2 + iterations`` collectives of O(B) per forward, one per backward.

    Args:
        x_local: this rank's shard, floating dtype; its ``dim`` may differ across ranks and be
            empty, every other dim must agree.
        k: the global number to select, as in the single-process op, the same on every rank.
        group: the process group (None: the default group, or a world of one).
        dim: the sharded dimension to select along.
        largest: select the largest (default) or the smallest entries.
        epsilon: the temperature, in x's units, as in the single-process op.
        method: ``"ot"`` (default) or ``"sparse"``, as in the single-process op.
        max_iter: cap on evaluations of the row sums (None: 100; each is one all-reduce).
        tol: "ot" only: extra absolute tolerance on ``|sum A - k|`` (None: machine precision).
        hard: straight-through: the exact hard mask of the concatenated row (ties broken by
            the global position), with the soft gradient. Needs an integer k.

    Returns:
        This rank's part of the mask: the shape, dtype and device of ``x_local``. Its gradient
        in x is this rank's slice of the single-process one; in k and epsilon, the full one.

    Example:
        >>> x = torch.tensor([[5.0, 2.0, 3.0]])  # one rank: the whole row
        >>> soft_topk_mask(x, 1, epsilon=1e-3)
        tensor([[1., 0., 0.]])

    References:
        Xie et al. Differentiable Top-k Operator with Optimal Transport. NeurIPS 2020.
        Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking. ICML
        2020 (the capped-simplex projection, "sparse").
    """
    op = _MASK
    local, plan = _prepare(
        op, group, x_local, k, dim, epsilon, method, largest, hard, max_iter, tol
    )
    if local.x2.shape[0] == 0:
        return x_local * 0
    if method == "sparse":
        out = _ShardedMaskSparse.apply(local.x2, local.k_row, local.eps_row, plan)
        A, converged, hard_mask = out
    else:
        out = _ShardedMaskOT.apply(local.x2, local.k_row, local.eps_row, plan)
        A, converged, hard_mask = out[0], out[1], out[2]
    warn_not_converged(op, converged, plan.max_iter)
    if hard_mask is not None:
        A = straight_through(hard_mask, A)
    return local.restore(A).to(x_local.dtype)


def topk_threshold(
    x_local: torch.Tensor,
    k: int | float | torch.Tensor,
    epsilon: float | torch.Tensor,
    *,
    group: Any = None,
    dim: int = -1,
    largest: bool = True,
    max_iter: int | None = None,
    tol: float | None = None,
) -> ThresholdResult:
    r"""The threshold t of :func:`soft_topk_mask` (method "ot") of each sharded row, with the
    solver's diagnostics: the sharded :func:`softops.solvers.topk_threshold`.

    Solves :math:`\sum_r \sum_{i \in r} \sigma((x_i - t)/\varepsilon) = k`; every rank returns
    the same result, after ``2 + iterations`` collectives. Not differentiable.

    Args:
        x_local: this rank's shard, as in :func:`soft_topk_mask`.
        k: the global number to select.
        epsilon: the temperature, in the units of x.
        group: the process group (None: the default group).
        dim: the sharded dimension.
        largest: select the largest (default) or the smallest.
        max_iter: cap on evaluations (None: 100).
        tol: extra absolute tolerance on ``|sum A - k|`` (None: machine precision only).

    Returns:
        A :class:`softops.solvers.ThresholdResult`, with the limits' and the NaN rows' contract
        of :func:`softops.solvers.topk_threshold` (a NaN on any rank makes the row NaN).

    Example:
        >>> res = topk_threshold(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, 0.1)
        >>> res.threshold, bool(res.converged)
        (tensor(1.5000), True)
    """
    op = _THRESHOLD
    local, plan = _prepare(op, group, x_local, k, dim, epsilon, "ot", largest, False, max_iter, tol)
    shape = local.batch_shape
    if local.x2.shape[0] == 0:
        empty = torch.zeros(shape, dtype=x_local.dtype, device=x_local.device)
        return ThresholdResult(empty, empty.bool(), 0, empty)
    sol = _solve_ot(plan, local.x2.detach(), local.k_row.detach(), local.eps_row.detach())[0]
    return threshold_result(sol.aux[:, 0] + sol.aux[:, 1], sol, largest, shape, x_local.dtype)


class ShardedTopK(NamedTuple):
    """The global top-k of sharded rows, on every rank: x.shape with ``dim`` replaced by k.

    Attributes:
        values: the k largest (or smallest) entries of each concatenated row, sorted.
        indices: their positions in the concatenated row (int64).
        ranks: the rank that holds each (int64).
        local_indices: their positions in that rank's shard (int64).
    """

    values: torch.Tensor
    indices: torch.Tensor
    ranks: torch.Tensor
    local_indices: torch.Tensor


def topk(
    x_local: torch.Tensor,
    k: int,
    *,
    group: Any = None,
    dim: int = -1,
    largest: bool = True,
) -> ShardedTopK:
    r"""``torch.topk`` of rows sharded along ``dim``: the global k best, with their owners.

    The hard operator, on the concatenated row ``x = torch.cat(shards, dim)``, is
    ``x.topk(k, dim, largest, sorted=True)``, ties broken by the global position. Each rank's
    own k best are all-gathered: two collectives, ``P k`` values per row. NaN counts as the
    largest, as in ``torch.topk``.

    Args:
        x_local: this rank's shard (any shape, floating dtype; its ``dim`` may be empty).
        k: an int in [0, n], n the length of ``dim`` summed over the group.
        group: the process group (None: the default group).
        dim: the sharded dimension.
        largest: the largest (default) or the smallest entries.

    Returns:
        A :class:`ShardedTopK`, identical on every rank. ``values`` passes its gradient to the
        entries each rank holds, without communication.

    Example:
        >>> topk(torch.tensor([[5.0, 2.0, 6.0]]), 2)
        ShardedTopK(values=tensor([[6., 5.]]), indices=tensor([[2, 0]]), ranks=tensor([[0, 0]]), local_indices=tensor([[2, 0]]))
    """  # noqa: E501
    op = _TOPK
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{op}: expected `k` to be an int; got {k!r}.")
    local, plan = _prepare(op, group, x_local, k, dim, 1.0, "ot", largest, False, None, None)
    x2 = local.x2
    values, index, owner, where = _sharded_topk(plan, x2.detach(), k, largest)
    if x2.requires_grad and k:
        values = _Route.apply(x2, values, owner == plan.comm.rank, where)
    values = values if largest else -values
    restore = local.restore
    return ShardedTopK(
        restore(values).to(x_local.dtype),
        restore(index),
        restore(owner),
        restore(where),
    )
