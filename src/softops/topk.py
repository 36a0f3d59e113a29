r"""Differentiable top-k: the SOFT top-k mask, and the selection matrix of a hard ``torch.topk``.

SOFT top-k (Xie et al., NeurIPS 2020) casts top-k as entropic optimal transport of the n scores,
each of mass 1/n, onto two targets y = 0 and y = 1 of masses (n - k)/n and k/n, with cost
:math:`C_{ij} = (x_i - y_j)^2` and entropy weight :math:`\varepsilon_p`. With two targets the
optimal plan is a sigmoid with a single threshold (MATH.md §1.2):

.. math::

    A_i = n\,\Gamma_{i1} = \sigma\big((x_i - t)/\varepsilon\big), \qquad
    \textstyle\sum_i A_i = k, \qquad \varepsilon = \varepsilon_p / 2,

so ``method="ot"`` solves one scalar equation per row instead of running Sinkhorn, and its
backward pass is the closed-form implicit gradient, O(n).

Deviations from the paper's notation: the library selects the **largest** entries (the paper and
its code select the smallest), epsilon is in the units of x (the paper divides the cost by its
maximum), and every row is solved on its own (the official code divides by a batch-wide maximum,
so one row changes the others).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from softops._core import threshold as _threshold
from softops._core.dims import flatten_to_2d, row_param
from softops._core.fused import compile_enabled, maybe_fused
from softops._core.straight_through import hard_topk_mask, straight_through
from softops._core.validation import (
    check_bool,
    check_choice,
    check_dim,
    check_epsilon,
    check_floating,
    check_k,
    check_max_iter,
    check_nonempty,
    check_tol,
    check_unused,
    compute_dtype,
)
from softops._sorted_topk import TopK, soft_topk

__all__ = ["TopK", "soft_topk", "soft_topk_mask", "topk_selection_matrix"]

MASK_METHODS = ("ot", "sinkhorn", "softkmax", "perturbed")
_PERTURBED_DEFAULT_SAMPLES = 100


def _vjp_terms(
    A: torch.Tensor, g: torch.Tensor, eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``s = A(1 - A)/eps``, ``sum s`` and ``<s, g>`` per row (one pass when fused)."""
    s = A * (1 - A) / eps
    return s, s.sum(-1, keepdim=True), (s * g).sum(-1, keepdim=True)


def _vjp_x(A: torch.Tensor, g: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    s, ss, sg = _vjp_terms(A, g, eps)
    return s * (g - torch.where(ss > 0, sg / torch.where(ss > 0, ss, 1), 0))


class _SoftTopKMaskOT(torch.autograd.Function):
    """A = sigmoid((x - t)/eps) with sum(A) = k per row; the implicit O(n) backward.

    Inputs are canonical: x (B, n) in the compute dtype, k (B,), eps (B,).
    """

    @staticmethod
    def forward(
        x: torch.Tensor,
        k: torch.Tensor,
        eps: torch.Tensor,
        max_iter: int,
        tol: float,
        k_scalar: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        state = _threshold.solve(x, k, eps, max_iter=max_iter, tol=tol, k_scalar=k_scalar)
        A = _threshold.mask_from_threshold(x, state, eps)
        # Rows that cannot be solved (NaN, unreachable k) are NaN by contract, not a failure.
        ok = state.converged if state.invalid is None else state.converged | state.invalid
        return A, state.m, state.t, ok

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, _, eps = inputs[:3]
        A, m, t, converged = output
        ctx.mark_non_differentiable(m, t, converged)
        if ctx.needs_input_grad[2]:
            ctx.save_for_backward(A, eps, x, m, t)
        else:
            ctx.save_for_backward(A, eps)
        ctx.fused = compile_enabled()  # the backward follows the forward's choice

    @staticmethod
    def backward(ctx: Any, gA: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        A, eps = ctx.saved_tensors[:2]
        e = eps[:, None]
        need_x, need_k, need_eps = ctx.needs_input_grad[:3]
        gx = gk = geps = None
        if need_x and not (need_k or need_eps) and not torch.is_grad_enabled():
            # The common case: one fused pass for the sums, one for the gradient.
            return maybe_fused(_vjp_x, A, ctx.fused)(A, gA, e), None, None, None, None, None
        s, ss, sg = _vjp_terms(A, gA, e)
        pos = ss > 0
        inv = torch.where(pos, 1 / torch.where(pos, ss, 1), 0)
        ratio = sg * inv
        if need_x:
            gx = s * (gA - ratio)
        if need_k:
            gk = ratio.squeeze(-1)
        if need_eps:
            x, m, t = ctx.saved_tensors[2:]
            z = ((x - m[:, None]) - t[:, None]) / e
            z = torch.where(s > 0, z, 0)
            zc = z - (s * z).sum(-1, keepdim=True) * inv
            geps = -(gA * s * zc).sum(-1)
        return gx, gk, geps, None, None, None


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
            ``method="ot"``, a tensor broadcastable to the batch shape (``x.shape`` without
            ``dim``) for a per-row k.
        dim: the dimension to select along.
        largest: select the largest (default) or the smallest entries.
        epsilon: the temperature, in the units of x (:math:`\varepsilon`; the paper's
            :math:`\varepsilon_p = 2\varepsilon` on an unnormalised cost). Larger is smoother.
            A float, or a tensor (scalar or broadcastable to the batch shape) that receives a
            gradient. Scaling law: ``soft_topk_mask(c*x, k, epsilon=c*e) == soft_topk_mask(x, k,
            epsilon=e)`` for c > 0.
        method: ``"ot"`` (default) solves for t exactly by bracketed Newton, O(n) per evaluation,
            3 to 6 evaluations, with the closed-form implicit backward. ``"sinkhorn"`` runs the
            paper's algorithm, log-domain Sinkhorn on the same n x 2 problem with the same
            epsilon, with an implicit backward; it equals "ot" at convergence and differentiates
            with respect to x only. The paper normalises the cost by its maximum; its epsilon
            ``eps_paper`` corresponds to ``epsilon = eps_paper * max_i C_i / 2`` per row, where
            ``max_i C_i = max_i max(x_i^2, (x_i - 1)^2)`` for the paper's orientation.
            ``"softkmax"`` is the recursion of seed 002 (see :func:`softops.soft_kmax`): k
            softmaxes, plain autograd, O(k n) time; it is biased, and it is not clipped, so an
            entry can exceed 1 where the k-th largest ties with the row minimum (k = n, say).
            ``"perturbed"`` is the perturbed optimizer of Berthet et al. (2020): the mean of the
            hard mask of ``x + epsilon * Z`` over ``n_samples`` Gaussian draws Z, whose backward
            is the Monte-Carlo Jacobian estimate ``E[mask(x + eps Z) Z^T] / eps`` on the same
            draws (O(B n) memory; the noise is regenerated, never stored). Both need an integer
            k, and differentiate with respect to x (softkmax also epsilon), not k.
        max_iter: cap on iterations. None: 100 Newton evaluations for "ot" (3 to 6 are typical);
            2000 Sinkhorn iterations for "sinkhorn". ``max_iter=200, tol=0`` with "sinkhorn"
            reproduces the paper's fixed 200 iterations.
        tol: stopping tolerance. For "ot", an absolute tolerance on ``|sum(A) - k|`` added to the
            machine-precision one (None: machine precision). For "sinkhorn", the L1 error of the
            row marginals (None: 1e-6 in float32, 1e-9 in float64; 0 runs exactly ``max_iter``
            iterations). A row that does not converge within ``max_iter`` raises a warning.
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

    References:
        Xie, Dai, Chen, Dai, Zhao, Zha, Wei and Pfister. Differentiable Top-k Operator with
        Optimal Transport. NeurIPS 2020. arXiv:2002.06504.
        Amos, Koltun and Kolter. The Limited Multi-Label Projection Layer. arXiv:1906.08707.
    """
    op = "soft_topk_mask"
    check_floating(x, op)
    d = check_dim(x, dim, op)
    n = check_nonempty(x, d, op)
    check_choice(method, MASK_METHODS, op, "method")
    epsilon = check_epsilon(epsilon, op)
    k = check_k(k, n, op)
    check_bool(hard, op, "hard")
    check_bool(largest, op, "largest")
    k_scalar: float | None = None
    if not isinstance(k, torch.Tensor):
        k_scalar = k
    elif k.dim() != 0 and method != "ot":
        raise ValueError(
            f"{op}: expected a scalar `k` with method={method!r} (a per-row k needs "
            f"method='ot'); got k of shape {tuple(k.shape)}."
        )
    if hard and not _is_integral(k):
        raise ValueError(f"{op}: hard=True needs an integer k; got k={_describe(k)}.")
    if method != "perturbed":
        check_unused(op, method, n_samples=n_samples, generator=generator)
    if method in ("softkmax", "perturbed"):
        check_unused(op, method, max_iter=max_iter, tol=tol)
        if not _is_integral(k):
            raise ValueError(
                f"{op}: expected an integer `k` with method={method!r}; got k={_describe(k)}."
            )
        no_grad = (("k", k), ("epsilon", epsilon)) if method == "perturbed" else (("k", k),)
        for name, value in no_grad:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise ValueError(
                    f"{op}: expected a `{name}` that does not require grad with "
                    f"method={method!r} (use method='ot' for gradients in k and epsilon); got "
                    "one that does."
                )
        k_int = int(k.detach()) if isinstance(k, torch.Tensor) else int(k)
        if method == "perturbed":
            n_samples = _check_n_samples(n_samples, op)
            _check_generator(generator, x.device, op)

    cd = compute_dtype(x.dtype)
    x2, restore = flatten_to_2d(x, d)
    x2 = x2.to(cd)
    if not largest:
        x2 = -x2
    batch_shape = x.movedim(d, -1).shape[:-1]
    k_row = row_param(k, batch_shape, op, "k", cd, x.device)
    eps_row = row_param(epsilon, batch_shape, op, "epsilon", cd, x.device)
    if x2.shape[0] == 0:
        return x * 0  # empty, but on the graph like every other output

    if method == "ot":
        max_iter = check_max_iter(max_iter, _threshold.DEFAULT_MAX_ITER, op)
        tol = check_tol(tol, 0.0, op)
        A, _, _, converged = _SoftTopKMaskOT.apply(x2, k_row, eps_row, max_iter, tol, k_scalar)
        _warn_not_converged(op, converged, max_iter)
    elif method == "sinkhorn":
        A = _sinkhorn_mask(op, x2, k_row, eps_row, k, epsilon, max_iter, tol)
    elif method == "softkmax":
        from softops.smooth import _soft_kmax_rows

        A = _soft_kmax_rows(x2, k_int, eps_row)
    else:
        from softops._core.perturbed import perturbed_topk_mask

        A = perturbed_topk_mask(x2, k_int, eps_row.detach(), n_samples, generator)

    if hard:
        k_hard = None if k_scalar is None else int(k_scalar)
        if isinstance(k, torch.Tensor) and k.dim() == 0:
            k_hard = int(k.detach())
        A = straight_through(hard_topk_mask(x2.detach(), k_row.detach(), k_hard), A)
    return restore(A).to(x.dtype)


def _sinkhorn_mask(
    op: str,
    x2: torch.Tensor,
    k_row: torch.Tensor,
    eps_row: torch.Tensor,
    k: Any,
    epsilon: Any,
    max_iter: int | None,
    tol: float | None,
) -> torch.Tensor:
    """method="sinkhorn": the paper's n x 2 log-domain Sinkhorn with the implicit backward."""
    from softops._core.sinkhorn import sinkhorn_plan

    for name, value in (("k", k), ("epsilon", epsilon)):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise ValueError(
                f"{op}: method='sinkhorn' differentiates with respect to x only; got `{name}` "
                "that requires grad (use method='ot' for gradients in k and epsilon)."
            )
    dtype = x2.dtype
    max_iter = check_max_iter(max_iter, 2000, op)
    tol = check_tol(tol, 1e-6 if dtype == torch.float32 else 1e-9, op)
    n = x2.shape[1]
    k_row, eps_row = k_row.detach(), eps_row.detach()
    # Infinities are their limits: solve with stand-ins far beyond the finite range, then set
    # those entries to exactly 0 or 1. Rows with NaN, or whose k cannot be met, give NaN.
    finite = torch.isfinite(x2)
    all_finite = bool(finite.all())
    xs = x2
    if not all_finite:
        fin_min = torch.where(finite, x2, math.inf).amin(-1, keepdim=True)
        fin_max = torch.where(finite, x2, -math.inf).amax(-1, keepdim=True)
        fin_min = torch.where(torch.isfinite(fin_min), fin_min, 0)
        fin_max = torch.where(torch.isfinite(fin_max), fin_max, 0)
        reach = (fin_max - fin_min) + 100 * eps_row[:, None]
        xs = torch.where(x2 == math.inf, fin_max + reach, x2)
        xs = torch.where(x2 == -math.inf, fin_min - reach, xs)
        xs = torch.where(torch.isnan(x2), 0, xs)
    targets = torch.tensor([0.0, 1.0], dtype=dtype, device=x2.device)
    # Squared cost with the x_i^2 term dropped (absorbed by the row potential): same plan.
    cost = -2 * xs[:, :, None] * targets + targets**2
    log_a = torch.full_like(xs, -math.log(n))
    kc = k_row.clamp(0, n)
    log_b = torch.stack([torch.log(n - kc), torch.log(kc)], -1) - math.log(n)
    newton = tol > 0
    plan, result = sinkhorn_plan(cost, log_a, log_b, 2 * eps_row, max_iter, tol, newton=newton)
    _warn_not_converged(op, result.converged, max_iter, tol > 0)
    A = n * plan[..., 1]
    edge_none, edge_all = k_row <= 0, k_row >= n
    if bool((edge_none | edge_all).any()):
        A = torch.where(edge_none[:, None], torch.zeros_like(A), A)
        A = torch.where(edge_all[:, None], torch.ones_like(A), A)
    if not all_finite:
        A = torch.where(x2 == math.inf, 1.0, A)
        A = torch.where(x2 == -math.inf, 0.0, A)
        n_fin = finite.sum(-1)
        n_pinf = (x2 == math.inf).sum(-1)
        bad = torch.isnan(x2).any(-1) | (n_pinf > k_row) | (n_pinf + n_fin < k_row)
        A = A.masked_fill(bad[:, None], math.nan)
    return A


def _check_n_samples(n_samples: Any, op: str) -> int:
    if n_samples is None:
        return _PERTURBED_DEFAULT_SAMPLES
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(
            f"{op}: expected `n_samples` to be a positive int or None; got n_samples={n_samples!r}."
        )
    return n_samples


def _check_generator(generator: Any, device: torch.device, op: str) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{op}: expected `generator` to be a torch.Generator or None; got {generator!r}."
        )
    gd = generator.device
    other_index = None not in (gd.index, device.index) and gd.index != device.index
    if gd.type != device.type or other_index:
        raise ValueError(
            f"{op}: expected `generator` on the device of x ({device}); got a generator on {gd}."
        )


def _is_integral(k: Any) -> bool:
    if isinstance(k, torch.Tensor):
        kd = k.detach()
        return bool((kd == kd.round()).all())
    return float(k).is_integer()


def _describe(k: Any) -> str:
    if isinstance(k, torch.Tensor):
        return f"tensor of shape {tuple(k.shape)}" if k.dim() else f"{float(k):g}"
    return f"{k!r}"


def _warn_not_converged(
    op: str, converged: torch.Tensor, max_iter: int, active: bool = True
) -> None:
    if active and not bool(converged.all()):
        bad = int((~converged).sum())
        warnings.warn(
            f"{op}: {bad} of {converged.numel()} rows did not converge within max_iter="
            f"{max_iter}; the result and its gradient are approximate. Raise `max_iter`.",
            RuntimeWarning,
            stacklevel=3,
        )


def topk_selection_matrix(indices: torch.Tensor, n: int) -> torch.Tensor:
    r"""The 0/1 selection matrix :math:`W_k` of a hard top-k, as in seed 003.

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
