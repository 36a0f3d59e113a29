"""Public solvers with diagnostics: the numerical cores behind the ops, as NamedTuples.

Each solver returns its solution together with ``(converged, iterations, residual)``. The ops built
on them (``soft_topk``, ``soft_topk_mask``, ...) call the private cores directly.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from softops._core.convergence import SINKHORN_MAX_ITER, default_tol
from softops._core.dims import prepare_rows, row_param
from softops._core.sinkhorn import SinkhornResult, attach_epsilon, log_sinkhorn
from softops._core.transforms import plain, under_functorch
from softops._core.validation import (
    check_bool,
    check_epsilon,
    check_floating,
    check_k,
    check_max_iter,
    check_tol,
    compute_dtype,
)
from softops.topk import THRESHOLD_MAX_ITER, solve_threshold, threshold_values

__all__ = ["SinkhornResult", "ThresholdResult", "sinkhorn", "topk_threshold"]


def _values(t: Tensor) -> Tensor | None:
    """``t``'s values for an input check (every vmapped slice at once); None where Python cannot
    see them (meta tensors, tracing): the check is then skipped."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return None
    return plain(t.detach())


def _check_marginal(
    value: object, name: str, shape: tuple[int, ...], op: str, dtype: torch.dtype
) -> Tensor:
    """A positive, finite marginal broadcastable to ``shape`` (batch + (n,)), as ``dtype``."""
    t = check_floating(value, op, name)
    if t.requires_grad:
        raise ValueError(
            f"{op}: expected `{name}` not to require grad (gradients with respect to the "
            f"marginals are not implemented; detach it); got a tensor with requires_grad=True."
        )
    if t.dim() == 0 or t.shape[-1] != shape[-1]:
        raise ValueError(
            f"{op}: expected `{name}` of shape (..., {shape[-1]}) broadcastable to {shape}; "
            f"got shape {tuple(t.shape)}."
        )
    try:
        t = t.expand(shape)
    except RuntimeError:
        raise ValueError(
            f"{op}: expected `{name}` broadcastable to {shape}; got shape {tuple(t.shape)}."
        ) from None
    values = _values(t)
    if values is not None:
        bad = ~(values > 0) | ~torch.isfinite(values)
        if bool(bad.any()):
            raise ValueError(
                f"{op}: expected `{name}` > 0 and finite; got {name} containing "
                f"{values[bad].flatten()[0].item()}."
            )
    return t.to(dtype)


def sinkhorn(
    cost: Tensor,
    a: Tensor,
    b: Tensor,
    epsilon: float | Tensor,
    *,
    max_iter: int | None = None,
    tol: float | None = None,
    newton: bool = False,
) -> SinkhornResult:
    r"""Entropic optimal transport by log-domain Sinkhorn, batched, with diagnostics.

    Solves, for every batch row independently,

    .. math::

        \Gamma = \arg\min_{\Gamma \ge 0,\ \Gamma 1 = a,\ \Gamma^\top 1 = b}
            \langle C, \Gamma \rangle + \varepsilon \sum_{ij} \Gamma_{ij} (\log\Gamma_{ij} - 1),
        \qquad \Gamma_{ij} = e^{(f_i + g_j - C_{ij})/\varepsilon}.

    One iteration is a row (f) update then a column (g) update, as in the SOFT top-k paper's code
    (``max_iter=200, tol=0`` reproduces its fixed 200 iterations); tuned for few targets m. The
    plan is differentiable in ``cost`` and ``epsilon`` (not ``a``, ``b``) by implicit
    differentiation: the gradient of the *converged* plan (check ``converged``).

    Args:
        cost: (*, n, m) cost matrix C (float16/bfloat16 are computed in float32).
        a: (*, n) positive row marginals (broadcastable).
        b: (*, m) positive column marginals (broadcastable), of ``a``'s total mass to within the
            square root of machine epsilon (then rescaled to it exactly).
        epsilon: entropic regularisation > 0 in the units of the cost; a float or a tensor
            broadcastable to ``cost.shape[:-2]``.
        max_iter: iteration cap; None means 2000.
        tol: on the relative L1 row-marginal error, checked every 10 iterations; None means
            1e-6 (float32) / 1e-9 (float64); ``0`` runs exactly ``max_iter`` iterations.
        newton: below an error of 1e-3, finish with damped semi-dual Newton steps (faster at
            small epsilon); ignored when ``tol=0``.

    Returns:
        :class:`SinkhornResult` ``(f, g, plan, converged, iterations, residual)``, in the dtype
        of ``cost``; ``iterations`` is the maximum over rows (a 0-dim tensor under
        ``torch.compile``). A row with a NaN is NaN, ``converged=False``, alone.

    Shape:
        - cost: ``(*, n, m)``; a, f: ``(*, n)``; b, g: ``(*, m)``; plan: ``(*, n, m)``.

    Example:
        >>> import torch
        >>> from softops.solvers import sinkhorn
        >>> x = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64)
        >>> cost = (x[:, None] - torch.tensor([0.0, 3.0], dtype=torch.float64)) ** 2
        >>> res = sinkhorn(cost, torch.full((4,), 0.25), torch.tensor([0.5, 0.5]), 0.5)
        >>> res.plan.sum(0)
        tensor([0.5000, 0.5000], dtype=torch.float64)

    References:
        M. Cuturi. Sinkhorn Distances: Lightspeed Computation of Optimal Transport. NeurIPS 2013.
        Y. Xie et al. Differentiable Top-k Operator with Optimal Transport. NeurIPS 2020.
        arXiv:2002.06504.
    """
    op = "sinkhorn"
    check_floating(cost, op, "cost")
    if cost.dim() < 2 or cost.shape[-1] == 0 or cost.shape[-2] == 0:
        raise ValueError(
            f"{op}: expected `cost` of shape (*, n, m) with n, m >= 1; "
            f"got shape {tuple(cost.shape)}."
        )
    check_bool(newton, op, "newton")
    epsilon = check_epsilon(epsilon, op, dtype=cost.dtype)
    cd = compute_dtype(cost.dtype)
    max_iter = check_max_iter(max_iter, SINKHORN_MAX_ITER, op)
    tol = check_tol(tol, default_tol(cd), op)

    batch_shape = cost.shape[:-2]
    n, m = cost.shape[-2], cost.shape[-1]
    a_t = _check_marginal(a, "a", (*batch_shape, n), op, cd)
    b_t = _check_marginal(b, "b", (*batch_shape, m), op, cd)
    sa, sb = a_t.sum(-1), b_t.sum(-1)
    rtol = max(torch.finfo(a.dtype).eps, torch.finfo(b.dtype).eps) ** 0.5
    gap = (sa - sb).abs() / torch.maximum(sa, sb)  # relative, per row
    gaps = _values(gap)
    if gaps is not None and bool((gaps > rtol).any()):
        if not under_functorch():
            i = int((gap > rtol).flatten().nonzero()[0, 0])
            got = f"a.sum()={sa.flatten()[i].item():.10g} and b.sum()={sb.flatten()[i].item():.10g}"
        else:  # under torch.func: the worst slice
            got = f"a.sum() and b.sum() {gaps.max().item():.3g} apart (relative)"
        raise ValueError(
            f"{op}: expected `a` and `b` with the same total mass (relative tolerance {rtol:g}); "
            f"got {got}."
        )

    b_t = b_t * (sa / sb).unsqueeze(-1)  # equal totals in the working precision

    c2 = cost.to(cd).reshape(-1, n, m)
    bsz = c2.shape[0]
    eps = row_param(epsilon, batch_shape, op, "epsilon", cd, cost.device)  # (B,)
    ones = torch.ones_like(eps)
    # Solve the scaled problem (cost/epsilon, 1); its gradient in epsilon is -<grad, cost/eps>/eps
    # (attach_epsilon: autograd through cost/eps squares epsilon, NaN below 1e-154).
    res = log_sinkhorn(
        attach_epsilon(c2 / eps.detach()[:, None, None], eps[:, None, None]),
        a_t.reshape(bsz, n).log(),
        b_t.reshape(bsz, m).log(),
        ones.detach(),
        max_iter=max_iter,
        tol=tol,
        newton=newton,
    )
    plan = res.plan
    eps_d = eps.detach()[:, None]
    out = cost.dtype
    return SinkhornResult(
        f=(res.f * eps_d).to(out).reshape(*batch_shape, n),
        g=(res.g * eps_d).to(out).reshape(*batch_shape, m),
        plan=plan.to(out).reshape(*batch_shape, n, m),
        converged=res.converged.reshape(batch_shape),
        iterations=res.iterations,
        residual=res.residual.reshape(batch_shape),
    )


class ThresholdResult(NamedTuple):
    """The SOFT top-k threshold of each row, with the solver's diagnostics.

    Attributes:
        threshold: x.shape without ``dim``, in the units of x. The mask is
            ``sigmoid((x - threshold) / epsilon)`` (``largest=True``) or
            ``sigmoid((threshold - x) / epsilon)`` (``largest=False``); ``±inf`` on rows at the
            limit k -> 0 or k -> n, NaN where k cannot be met (:func:`topk_threshold`).
        converged: bool, same shape: ``|sum(A) - k|`` reached machine precision (or ``tol``).
        iterations: the number of Newton evaluations (the same for every row).
        residual: ``sum(A) - k`` at the returned threshold, same shape.
    """

    threshold: torch.Tensor
    converged: torch.Tensor
    iterations: int
    residual: torch.Tensor


def topk_threshold(
    x: torch.Tensor,
    k: int | float | torch.Tensor,
    epsilon: float | torch.Tensor,
    *,
    dim: int = -1,
    largest: bool = True,
    max_iter: int | None = None,
    tol: float | None = None,
) -> ThresholdResult:
    r"""Solve :math:`\sum_i \sigma((x_i - t)/\varepsilon) = k` for the threshold t of each row.

    The solver behind ``soft_topk_mask(method="ot")``, with its diagnostics; not
    differentiable. The mask is ``sigmoid((x - threshold) / epsilon)`` (``largest=True``): rows
    at the limit k -> 0 get ``+inf``, at k -> n ``-inf``, rows without a finite entry 0; rows
    whose k cannot be met (or with a NaN) get NaN, ``converged=False``.

    Args:
        x: scores, any shape, floating dtype.
        k: number to select, as in :func:`soft_topk_mask`.
        epsilon: temperature, as in :func:`soft_topk_mask`.
        dim: dimension to select along.
        largest: select the largest (default) or the smallest.
        max_iter: cap on Newton evaluations (None: 100).
        tol: extra absolute tolerance on ``|sum(A) - k|`` (None: machine precision only).

    Returns:
        A :class:`ThresholdResult`.

    Example:
        >>> res = topk_threshold(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, 0.1)
        >>> res.threshold, bool(res.converged)
        (tensor(1.5000), True)
    """
    op = "topk_threshold"
    check_floating(x, op)
    check_bool(largest, op, "largest")
    rows = prepare_rows(op, x.detach(), dim, epsilon)
    k = check_k(k, rows.n, op, dtype=x.dtype)
    max_iter = check_max_iter(max_iter, THRESHOLD_MAX_ITER, op)
    tol = check_tol(tol, 0.0, op)
    x2 = rows.x2 if largest else -rows.x2
    k_row = rows.param(k, op, "k").detach()
    eps_row = rows.eps.detach()
    state = solve_threshold(
        x2,
        k_row,
        eps_row,
        max_iter=max_iter,
        tol=tol,
        k_scalar=None if isinstance(k, torch.Tensor) else k,
    )
    return threshold_result(state.m + state.t, state, largest, rows.batch_shape, x.dtype)


def threshold_result(
    t: Tensor, solve: Any, largest: bool, shape: torch.Size, dtype: torch.dtype
) -> ThresholdResult:
    """The result of a threshold solve (``solve``: its scale, limits and diagnostics) at its
    threshold ``t`` (B,) of the canonical rows, in the caller's direction, shape and dtype."""
    t = threshold_values(t, solve.scale, solve.sel_none, solve.sel_all, solve.invalid)
    t = t if largest else -t
    return ThresholdResult(
        t.reshape(shape).to(dtype),
        solve.converged.reshape(shape),
        solve.iterations,
        solve.residual.reshape(shape).to(dtype),
    )
