r"""Differentiable top-k: the SOFT top-k mask, and the selection matrix of a hard ``torch.topk``.

SOFT top-k (Xie et al., NeurIPS 2020) casts top-k as entropic optimal transport of the n scores,
each of mass 1/n, onto two targets y = 0 and y = 1 of masses (n - k)/n and k/n, with cost
:math:`C_{ij} = (x_i - y_j)^2` and entropy weight :math:`\varepsilon_p`. With two targets the
optimal plan is a sigmoid with a single threshold (derived in docs/math.md §1):

.. math::

    A_i = n\,\Gamma_{i1} = \sigma\big((x_i - t)/\varepsilon\big), \qquad
    \textstyle\sum_i A_i = k, \qquad \varepsilon = \varepsilon_p / 2,

so ``method="ot"`` solves one scalar equation per row, with a closed-form O(n) backward.
Unlike the paper, the library selects the **largest** entries, epsilon is in the units of x, and
every row is solved on its own. One backend file per method in :data:`METHODS`, each
``mask(x2, k, eps, opts)`` on canonical (B, n) rows, largest first.
"""

from __future__ import annotations

from types import ModuleType

import torch

from softops._core.dims import constant_row, prepare_rows
from softops._core.straight_through import straight_through
from softops._core.transforms import cannot_branch, plain, under_functorch
from softops._core.validation import check_k
from softops.topk import _ot, _perturbed, _sinkhorn, _softkmax, _sparse
from softops.topk._options import (
    MASK_METHODS,
    THRESHOLD_MAX_ITER,
    MaskOptions,
    check_generator,
    check_mask_k,
    check_mask_options,
    solver_defaults,
)
from softops.topk._ot import (
    SAMPLE_SIZE,
    ThresholdState,
    hard_topk_mask,
    side_log_weights,
    threshold_values,
)
from softops.topk._ot import solve as solve_threshold
from softops.topk._softkmax import soft_kmax_rows
from softops.topk._sorted import TopK, soft_topk
from softops.topk._summary import (
    RowSummary,
    ThresholdRows,
    row_stats,
    solve_ot_rows,
    solve_sparse_rows,
)

__all__ = [
    "MASK_METHODS",
    "METHODS",
    "SAMPLE_SIZE",
    "THRESHOLD_MAX_ITER",
    "RowSummary",
    "ThresholdRows",
    "ThresholdState",
    "TopK",
    "check_mask_k",
    "check_mask_options",
    "row_stats",
    "side_log_weights",
    "soft_kmax",
    "soft_topk",
    "soft_topk_mask",
    "solve_ot_rows",
    "solve_sparse_rows",
    "solve_threshold",
    "threshold_values",
    "topk_selection_matrix",
]
# besides the ops, the solvers and checks that softops.solvers, nn and distributed use

METHODS: dict[str, ModuleType] = {
    "ot": _ot,
    "sinkhorn": _sinkhorn,
    "softkmax": _softkmax,
    "perturbed": _perturbed,
    "sparse": _sparse,
}
"""Method name -> backend module of :func:`soft_topk_mask` (``mask(x2, k, eps, opts)``)."""


def soft_topk_mask(
    x: torch.Tensor,
    k: int | float | torch.Tensor,
    *,
    dim: int = -1,
    largest: bool = True,
    epsilon: float | torch.Tensor = 0.1,
    method: str = "ot",
    max_iter: int | None = None,
    tol: float | None = None,
    hard: bool = False,
    n_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""Soft top-k mask: a differentiable relaxation of the 0/1 indicator of the k largest entries.

    The hard operator is::

        torch.zeros_like(x).scatter(dim, x.topk(k, dim, largest).indices, 1)

    SOFT top-k (Xie et al. 2020), entropic optimal transport onto two targets, is exactly a
    sigmoid with one threshold ``t`` per row:

    .. math::

        A_i = \sigma\!\left(\frac{x_i - t}{\varepsilon}\right), \qquad \sum_i A_i = k .

    Values lie in [0, 1] and sum to k along ``dim``; as ``epsilon -> 0`` the mask tends to the
    hard one where the k-th and (k+1)-th largest differ (ties share the mass). The methods are
    compared in the table of docs/topk.md.

    Args:
        x: scores, any shape, floating dtype (float16 and bfloat16 are computed in float32).
        k: how many to select, in [0, n], possibly fractional: a number; a 0-dim tensor, which
            receives a gradient; or, for "ot" and "sparse", a tensor broadcastable to the batch
            shape (``x.shape`` without ``dim``) for a per-row k.
        dim: the dimension to select along.
        largest: select the largest (default) or the smallest entries.
        epsilon: the temperature :math:`\varepsilon` in x's units (the paper's
            :math:`\varepsilon_p = 2\varepsilon`, on an unnormalised cost); larger is smoother.
            A float or a tensor broadcastable to the batch shape, which receives a gradient.
            Scaling law: ``soft_topk_mask(c*x, k, epsilon=c*e) == soft_topk_mask(x, k,
            epsilon=e)`` for c > 0.
        method: ``"ot"`` (default): t solved exactly by bracketed Halley steps, closed-form
            implicit backward in x, k and epsilon. ``"sinkhorn"``: the paper's log-domain
            Sinkhorn on the same n x 2 problem (its normalised ``eps_paper`` is ``epsilon =
            eps_paper * max_i C_i / 2``), equal to "ot" at convergence, differentiable in x.
            ``"softkmax"``: Su's recursion (:func:`soft_kmax`), biased and unclipped.
            ``"perturbed"``: the mean hard mask of ``x + epsilon * Z`` over ``n_samples``
            Gaussian draws (Berthet et al. 2020), Monte-Carlo backward. These two need an
            integer k and differentiate in x (softkmax also epsilon). ``"sparse"``: the
            projection ``clip((x - t)/epsilon, 0, 1)`` onto the capped simplex (docs/math.md
            §1.5), exact zeros and ones, with the inputs, units and gradients of "ot".
        max_iter: iteration cap (None: 100 evaluations for "ot" and "sparse", 2000 Sinkhorn
            iterations; ``max_iter=200, tol=0`` runs the paper's fixed 200, on the cost in
            units of epsilon).
        tol: for "ot", an absolute tolerance on ``|sum(A) - k|`` besides machine precision; for
            "sinkhorn", the L1 marginal error (None: 1e-6 in float32, 1e-9 in float64; 0 runs
            ``max_iter``). A row that does not converge warns. "sparse" takes none.
        hard: straight-through: the hard mask, with the soft one's gradient; needs an integer k.
        n_samples: "perturbed" only: the number of draws (None: 100); each entry's standard
            error is at most ``0.5 / sqrt(n_samples)``.
        generator: "perturbed" only: a ``torch.Generator`` on x's device (None: seeded from
            the global generator).

    Returns:
        A tensor with the shape, dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Infinities are their limits: ``-inf`` is never selected and ``+inf`` always is (with
    ``largest=True``), which is how attention masks keys. A row that cannot hold its k entries,
    or holds a NaN, is NaN in that row only.

    Example:
        >>> x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0])
        >>> soft_topk_mask(x, 3, epsilon=0.5).round(decimals=3)
        tensor([0.9530, 0.0470, 0.2690, 0.7310, 0.0070, 0.9930])
        >>> soft_topk_mask(x, 3, epsilon=2.0, method="sparse")  # exact zeros and ones
        tensor([1.0000, 0.0000, 0.2500, 0.7500, 0.0000, 1.0000])

    References:
        Xie, Dai, Chen, Dai, Zhao, Zha, Wei and Pfister. Differentiable Top-k Operator with
        Optimal Transport. NeurIPS 2020. arXiv:2002.06504.
        Amos, Koltun and Kolter. The Limited Multi-Label Projection Layer. arXiv:1906.08707.
        Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking. ICML
        2020 (the capped-simplex projection, "sparse").
    """
    op = "soft_topk_mask"
    max_iter, tol, n_samples = check_mask_options(
        op,
        method,
        largest=largest,
        max_iter=max_iter,
        tol=tol,
        hard=hard,
        n_samples=n_samples,
        generator=generator,
    )
    rows = prepare_rows(op, x, dim, epsilon)
    functorch = under_functorch()
    if functorch and isinstance(k, torch.Tensor) and method in ("ot", "sparse"):
        # a batched k: its integrality (hard=True) read from every vmapped slice at once
        k_scalar = check_mask_k(op, plain(k).detach(), rows.n, method, hard=hard, dtype=x.dtype)[1]
    else:
        k, k_scalar = check_mask_k(op, k, rows.n, method, hard=hard, epsilon=epsilon, dtype=x.dtype)
    if method == "perturbed":
        check_generator(generator, x.device, op)

    x2 = rows.x2 if largest else -rows.x2
    if isinstance(k, torch.Tensor) or torch.compiler.is_compiling():
        k_row = rows.param(k, op, "k")
    else:  # a number: its row made once per (B, k, dtype, device), as epsilon's
        k_row = constant_row(x2, k, x2.dtype)
    if x2.shape[0] == 0:
        return x * 0  # empty, but on the graph like every other output
    cap, tolerance = solver_defaults(method, max_iter, tol, x2.dtype)
    # softkmax and perturbed read k as a count (check_mask_k: an integer, readable)
    count = int(k) if method in ("softkmax", "perturbed") else 0
    opts = MaskOptions(op, cap, tolerance, k_scalar, count, n_samples or 0, generator)
    A = METHODS[method].mask(x2, k_row, rows.eps, opts)

    if hard:
        k_hard = None if k_scalar is None else int(k_scalar)
        if isinstance(k, torch.Tensor) and k.dim() == 0 and not cannot_branch(k):
            k_hard = int(k.detach())  # (else no single value to read: the per-row path)
        A = straight_through(hard_topk_mask(x2.detach(), k_row.detach(), k_hard), A)
    A = rows.restore(A)
    return A if A.dtype == x.dtype else A.to(x.dtype)


def soft_kmax(
    x: torch.Tensor,
    k: int,
    *,
    dim: int = -1,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Soft-k-max: a relaxed top-k mask built by k rounds of "soft max, then remove it" (Su 2019).

    The hard operator is::

        torch.zeros_like(x).scatter(dim, x.topk(k, dim).indices, 1)

    With :math:`x' = x - \min_j x_j \ge 0` along ``dim`` and :math:`p^{(0)} = 0`:

    .. math::

        q^{(t)} = \mathrm{softmax}\!\left(\frac{x' \odot (1 - p^{(t-1)})}{\varepsilon}\right),
        \qquad p^{(t)} = p^{(t-1)} + q^{(t)}, \qquad t = 1, \dots, k,

    and the result is :math:`p^{(k)}`: entries >= 0 summing to k. It is biased and **not
    clipped**: an entry can exceed 1 where the k-th largest ties with the row minimum (k = n,
    say); at moderate epsilon it differs from ``soft_topk_mask(method="ot")``
    (docs/smoothing.md). It tends to the hard mask as ``epsilon -> 0`` where the k-th largest is
    distinct from the (k+1)-th and from the row minimum. Infinities follow
    :func:`soft_topk_mask`'s convention (a ``+inf`` entry takes one round and gets exactly 1).

    Args:
        x: scores, any shape, floating dtype (float16 and bfloat16 are computed in float32).
        k: the number of rounds, an int in [0, n].
        dim: the dimension to select along.
        epsilon: the temperature, in x's units, a float or a tensor broadcastable to the batch
            shape (receives a gradient). Scaling law: ``soft_kmax(c*x, k, epsilon=c*e) ==
            soft_kmax(x, k, epsilon=e)`` for c > 0; invariant to adding a constant.

    Returns:
        A tensor with the shape, dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Cost: O(k n) time per row; memory O(k B n), checkpointed from k = 16 on (O(sqrt(k) B n)).

    Example:
        >>> x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0])
        >>> soft_kmax(x, 3).round(decimals=4)
        tensor([0.8189, 0.1711, 0.3903, 0.6545, 0.0657, 0.8996])
        >>> soft_kmax(x, 6, epsilon=1e-2).round(decimals=4)  # k = n: not clipped
        tensor([1.1667, 1.1667, 1.1667, 1.1667, 0.1667, 1.1667])

    References:
        Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近 (On smoothing: differentiable
        approximations of non-differentiable functions), section "softkmax". kexue.fm, 2019.
    """
    op = "soft_kmax"
    rows = prepare_rows(op, x, dim, epsilon)
    k_int = int(check_k(k, rows.n, op, integer=True))
    return rows.restore(soft_kmax_rows(rows.x2, k_int, rows.eps)).to(x.dtype)


def topk_selection_matrix(indices: torch.Tensor, n: int) -> torch.Tensor:
    r"""The 0/1 selection matrix :math:`W_k` of a hard top-k: how gradients pass ``torch.topk``.

    ``torch.topk(y, k).values`` equals ``topk_selection_matrix(indices, n) @ y`` and passes the
    same gradients: one to each selected entry, none to the others, and none through the indices.
    So a hard top-k cannot move an entry into or out of the selected set; the soft ops can.

    Args:
        indices: integer tensor of shape (..., k), for example ``torch.topk(y, k).indices``.
        n: the length of the dimension the indices point into.

    Returns:
        A float32 tensor of shape (..., k, n) with ``W[..., j, indices[..., j]] = 1``.

    Example:
        >>> y = torch.tensor([0.3, 2.0, -1.0, 0.7])
        >>> topk_selection_matrix(y.topk(2).indices, 4) @ y
        tensor([2.0000, 0.7000])
    """
    op = "topk_selection_matrix"
    if (
        not isinstance(indices, torch.Tensor)
        or indices.dtype.is_floating_point
        or (indices.dtype == torch.bool or indices.is_complex())
    ):
        raise TypeError(f"{op}: expected an integer tensor of indices; got {indices!r}.")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{op}: expected `n` to be a positive int; got n={n!r}.")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= n):
        raise ValueError(
            f"{op}: expected indices in [0, n) = [0, {n}); got values in "
            f"[{int(indices.min())}, {int(indices.max())}]."
        )
    W = torch.zeros(*indices.shape, n, device=indices.device)
    return W.scatter_(-1, indices.long().unsqueeze(-1), 1.0)
