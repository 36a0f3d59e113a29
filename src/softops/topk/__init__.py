r"""Differentiable top-k: the SOFT top-k mask, and the selection matrix of a hard ``torch.topk``.

SOFT top-k (Xie et al., NeurIPS 2020) casts top-k as entropic optimal transport of the n scores,
each of mass 1/n, onto two targets y = 0 and y = 1 of masses (n - k)/n and k/n, with cost
:math:`C_{ij} = (x_i - y_j)^2` and entropy weight :math:`\varepsilon_p`. With two targets the
optimal plan is a sigmoid with a single threshold (derived in docs/math.md §1):

.. math::

    A_i = n\,\Gamma_{i1} = \sigma\big((x_i - t)/\varepsilon\big), \qquad
    \textstyle\sum_i A_i = k, \qquad \varepsilon = \varepsilon_p / 2,

so ``method="ot"`` solves one scalar equation per row instead of running Sinkhorn, and its
backward pass is the closed-form implicit gradient, O(n).

Deviations from the paper's notation: the library selects the **largest** entries (the paper and
its code select the smallest), epsilon is in the units of x (the paper divides the cost by its
maximum), and every row is solved on its own (the official code divides by a batch-wide maximum,
so one row changes the others).

Layout: one file per method of :func:`soft_topk_mask`, listed in :data:`METHODS`, each with the
one backend signature ``mask(x2, k, eps, opts)`` on canonical rows (x2 (B, n) in the compute
dtype, largest first; k and eps (B,); opts a :class:`~softops.topk._options.MaskOptions`); the
sorted top-k :func:`soft_topk` in ``_sorted.py`` (its Newton-first solve in ``_newton.py``); the
checks every method shares in ``_options.py``. This module validates, reshapes once to (B, n)
and makes one call into the method's file.
"""

from __future__ import annotations

from types import ModuleType

import torch

from softops._core.dims import prepare_rows
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
from softops.topk._ot import SAMPLE_SIZE, ThresholdState, hard_topk_mask
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
    "soft_kmax",
    "soft_topk",
    "soft_topk_mask",
    "solve_ot_rows",
    "solve_sparse_rows",
    "solve_threshold",
    "topk_selection_matrix",
]
# Besides the ops, the family's face for softops.solvers, softops.nn and softops.distributed
# (not in softops.__all__): the threshold solvers (on whole rows, or on pieces of rows known by
# a RowSummary and a reduction), their defaults and the checks of a mask's options.

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

    SOFT top-k (Xie et al. 2020) is the entropic optimal transport of the entries of ``x`` onto
    two targets; with two targets its plan is exactly a sigmoid with one threshold ``t`` per row:

    .. math::

        A_i = \sigma\!\left(\frac{x_i - t}{\varepsilon}\right), \qquad \sum_i A_i = k .

    Values lie in [0, 1] and sum to k along ``dim``. As ``epsilon -> 0`` the mask tends to the hard
    one on rows whose k-th and (k+1)-th largest entries differ (tied entries share the mass).

    Args:
        x: scores, any shape, floating dtype. float16 and bfloat16 are computed in float32 and the
            result is cast back.
        k: how many entries to select: an int or a float in [0, n] (k = 0 gives zeros, k = n
            ones, a fractional k is allowed); a 0-dim tensor, which receives a gradient; or, for
            ``method="ot"`` and ``"sparse"``, a tensor broadcastable to the batch shape
            (``x.shape`` without ``dim``) for a per-row k.
        dim: the dimension to select along.
        largest: select the largest (default) or the smallest entries.
        epsilon: the temperature, in the units of x (:math:`\varepsilon`; the paper's
            :math:`\varepsilon_p = 2\varepsilon` on an unnormalised cost). Larger is smoother.
            A float, or a tensor (scalar or broadcastable to the batch shape) that receives a
            gradient. Scaling law: ``soft_topk_mask(c*x, k, epsilon=c*e) == soft_topk_mask(x, k,
            epsilon=e)`` for c > 0.
        method: ``"ot"`` (default) solves for t exactly by bracketed Halley steps (Newton's where
            Halley's would overshoot), O(n) per evaluation, 2 to 5 evaluations, with the
            closed-form implicit backward. ``"sinkhorn"`` runs the paper's algorithm,
            log-domain Sinkhorn on the same n x 2 problem with the same epsilon, with an
            implicit backward; it equals "ot" at convergence and differentiates
            with respect to x only. The paper normalises the cost by its maximum; its epsilon
            ``eps_paper`` corresponds to ``epsilon = eps_paper * max_i C_i / 2`` per row, where
            ``max_i C_i = max_i max(x_i^2, (x_i - 1)^2)`` for the paper's orientation.
            ``"softkmax"`` is the recursion of Su (2019) (see :func:`softops.soft_kmax`): k
            softmaxes, plain autograd, O(k n) time; it is biased, and it is not clipped, so an
            entry can exceed 1 where the k-th largest ties with the row minimum (k = n, say).
            ``"perturbed"`` is the perturbed optimizer of Berthet et al. (2020): the mean of the
            hard mask of ``x + epsilon * Z`` over ``n_samples`` Gaussian draws Z, with the
            Monte-Carlo Jacobian estimate on the same draws as its backward (O(B n) memory; the
            noise is regenerated, never stored). Both need an integer k, and differentiate with
            respect to x (softkmax also epsilon), not k.
            ``"sparse"`` is the Euclidean projection of ``x / epsilon`` onto the capped simplex
            :math:`\{0 \le a \le 1, \sum a = k\}`, ``a = clip((x - t)/epsilon, 0, 1)`` (the
            counterpart of "ot" with a quadratic regulariser, docs/math.md §1.5): exact zeros
            and ones, so attention and routing can skip work. t is solved exactly by a finite
            Newton method (1 to 13 evaluations, O(n) each); the backward is closed form on the
            free entries (gradient 0 where none is free). Like "ot" it takes a per-row k,
            differentiates in x, k and epsilon, and has the same units and scaling law.
        max_iter: cap on iterations. None: 100 Newton evaluations for "ot" (3 to 6 are typical)
            and for "sparse" (1 to 13);
            2000 Sinkhorn iterations for "sinkhorn". ``max_iter=200, tol=0`` with "sinkhorn"
            runs the paper's fixed 200 iterations (on the cost in units of epsilon, so that the
            scaling law holds; an iterate that has not converged depends on that choice of
            gauge, and differs from one on the paper's unnormalised cost).
        tol: stopping tolerance. For "ot", an absolute tolerance on ``|sum(A) - k|`` added to the
            machine-precision one (None: machine precision). For "sinkhorn", the L1 error of the
            row marginals (None: 1e-6 in float32, 1e-9 in float64; 0 runs exactly ``max_iter``
            iterations). A row that does not converge within ``max_iter`` raises a warning.
            "sparse" takes no ``tol``: its solve stops exactly, on the root's linear piece.
        hard: straight-through: return the hard mask, with the gradient of the soft one. Needs
            an integer k.
        n_samples: for ``"perturbed"`` only: the number of noise draws (None: 100). The
            standard error of each entry is at most ``0.5 / sqrt(n_samples)``.
        generator: for ``"perturbed"`` only: a ``torch.Generator`` on x's device, for
            reproducible draws (None: a seed is drawn from the global generator, so
            ``torch.manual_seed`` also makes it reproducible).

    Returns:
        A tensor with the shape, dtype and device of ``x``.

    Shape:
        - x: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Infinities behave as their limits: ``-inf`` is never selected and ``+inf`` always is (with
    ``largest=True``), which is how attention masks keys. A row that cannot hold its k entries
    (more than k entries at ``+inf``, or fewer than k above ``-inf``) and a row holding a NaN give
    NaN in that row only.

    Example:
        >>> x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0])
        >>> soft_topk_mask(x, 3, epsilon=0.5).round(decimals=3)
        tensor([0.9530, 0.0470, 0.2690, 0.7310, 0.0070, 0.9930])
        >>> soft_topk_mask(x, 3, epsilon=1e-3)
        tensor([1., 0., 0., 1., 0., 1.])
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
        # A batched k has no single value to test: its integrality (hard=True) is read from every
        # vmapped slice at once; "ot" and "sparse" have no rule on the shape of k or its grad.
        k_scalar = check_mask_k(op, plain(k).detach(), rows.n, method, hard=hard, dtype=x.dtype)[1]
    else:
        k, k_scalar = check_mask_k(op, k, rows.n, method, hard=hard, epsilon=epsilon, dtype=x.dtype)
    if method == "perturbed":
        check_generator(generator, x.device, op)

    x2 = rows.x2 if largest else -rows.x2
    k_row = rows.param(k, op, "k")
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

    and the result is :math:`p^{(k)}`. Each round is a softmax, so the entries sum to k exactly.
    Replacing each softmax by ``one_hot(argmax)`` shows the idea: select the maximum, zero it
    (it becomes the row minimum after the shift), and repeat.

    **Not clipped.** Entries are >= 0 but can exceed 1: where the k-th largest entry ties with
    the row minimum (for example k = n, or k - 1 entries above many equal minima), the last
    rounds find nothing above the minimum and spread their mass over the already-selected
    entries too. With distinct entries and k = n, as ``epsilon -> 0`` the n - 1 largest tend to
    1 + 1/n and the minimum to 1/n. On rows where k < n, the top k entries are distinct, the
    k-th largest is strictly above the (k+1)-th and above the row minimum, it tends to the hard
    top-k mask as ``epsilon -> 0``, at every scale: each round's logits are formed relative to
    its top entry, so where ``(x - min x)/epsilon`` is beyond the dtype's largest finite value
    only the entries far below the top overflow (to weight 0), and none tie.

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
        >>> W = topk_selection_matrix(y.topk(2).indices, 4)
        >>> W
        tensor([[0., 1., 0., 0.],
                [0., 0., 0., 1.]])
        >>> W @ y
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
