r"""Sorted SOFT top-k: the k largest (or smallest) entries, in order, by entropic optimal transport.

Reference: Xie, Dai, Chen, Dai, Zhao, Zha, Wei and Pfister, *Differentiable Top-k Operator with
Optimal Transport*, NeurIPS 2020 (arXiv 2002.06504), sorted variant with k+1 anchors.

Deviations from the paper's notation (the derivations are in docs/math.md §2):

* Orientation: the paper selects the **smallest** entries, smallest first. ``largest=True`` (the
  default, as in :func:`torch.topk`) applies the paper's operator to ``-x``, so the outputs are in
  ``torch.topk`` order (largest first).
* epsilon is in units of x: the paper's entropic weight on the unnormalised cost is
  ``eps_p = 2 * epsilon`` (never normalised by a batch-wide max).
* The cost ``(x_i - j)^2`` is solved in the equivalent form ``-2 j x_i + kappa_j``: ``x_i^2`` is a
  per-row constant (absorbed by f_i) and the per-column constants kappa_j (absorbed by g_j) are
  chosen from the sorted scores so that the potentials stay O(1). The plan is unchanged; the
  potentials are small, which lets float32 reach a 1e-6 marginal error.
* Infinities are solved structurally (docs/math.md §2.2): the sure entries fill the first
  ``c = min(#sure, k)`` targets (shared equally), the others none, and Sinkhorn runs on the finite
  entries with those targets empty; rows near ``finfo.max`` are solved at a power-of-two scale
  (the problem is invariant under ``(x, eps) -> (c x, c eps)``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from softops._core.convergence import SINKHORN_MAX_ITER, default_tol, warn_not_converged
from softops._core.dims import prepare_rows
from softops._core.sinkhorn import (
    DET_MIN,
    implicit_cost_vjp,
    log_sinkhorn_checked,
    numba_kernels,
    use_numba,
)
from softops._core.transforms import apply_function, cannot_branch, own_precision, vmap_rows
from softops._core.validation import check_bool, check_k, check_max_iter, check_tol

__all__ = ["TopK", "soft_topk"]

_OP = "soft_topk"


class TopK(NamedTuple):
    """Result of :func:`soft_topk`.

    Attributes:
        values: soft top-k values, x.shape with ``dim`` replaced by k, in ``torch.topk`` order.
        weights: ``values.shape + (n,)``; ``weights[..., j, :]`` is the relaxed one-hot of the
            j-th selected entry (non-negative, sums to 1 over the last axis).
        indices: ``torch.topk(x, k, dim, largest).indices`` (int64, no gradient).
    """

    values: Tensor
    weights: Tensor
    indices: Tensor


def soft_topk(
    x: Tensor,
    k: int,
    *,
    dim: int = -1,
    largest: bool = True,
    epsilon: float | Tensor = 0.1,
    max_iter: int | None = None,
    tol: float | None = None,
) -> TopK:
    r"""Sorted SOFT top-k: a differentiable, ordered relaxation of :func:`torch.topk`.

    Relaxes ``torch.topk(x, k, dim, largest, sorted=True)``. Along ``dim`` (n entries) each row is
    transported (entropic OT, Sinkhorn) onto k+1 unit-spaced targets ``y_j = j``, ``j = 0..k``:
    the first k targets receive mass 1/n each and the last ("rest") target (n-k)/n. Target j takes
    the j-th selected entry, so ``weights[..., j, :] = n * Gamma[:, j]`` is a soft one-hot of it
    and ``values = weights @ x``.

    .. math::

        \Gamma = \arg\min_{\Gamma 1 = \frac1n 1,\ \Gamma^\top 1 = \nu}
            \sum_{ij} \Gamma_{ij} (s_i - j)^2 + 2\varepsilon \sum_{ij} \Gamma_{ij}
            (\log \Gamma_{ij} - 1),
        \qquad \nu = (\tfrac1n, \dots, \tfrac1n, \tfrac{n-k}n),

    with :math:`s = -x` for ``largest=True`` and :math:`s = x` otherwise; then
    :math:`W_{j,i} = n\Gamma_{ij}` (:math:`j < k`) and :math:`v_j = \sum_i W_{j,i} x_i`.

    The forward pass is semi-dual Newton in float64 from one Sinkhorn update of the centred start
    (rows it does not finish are solved by log-domain Sinkhorn to a relative L1 marginal error of
    1e-3, then Newton); on the CPU, small problems (``n (k+1)^2`` up to about 1.3e5) run it as one
    numba kernel where numba is installed (``pip install 'softops[pav]'``). The backward pass is
    implicit differentiation through a k x k SPD (Schur complement) solve in float64 (in closed
    form for k <= 2, else Cholesky), so memory is O(n k) whatever the iteration count.

    **epsilon** (the paper's entropic weight is ``2 * epsilon``) is in the units of x: the soft
    boundary between two adjacent ranks has the width of a sigmoid of temperature epsilon, as in
    ``soft_topk_mask``. Scaling law: ``soft_topk(c * x, k, epsilon=c * e).values = c *
    soft_topk(x, k, epsilon=e).values`` for ``c > 0``; weights are unchanged. As epsilon -> 0 the
    weights tend to ``one_hot(torch.topk(x, k, dim, largest).indices)`` (for distinct values).
    Small epsilon (relative to the gaps between the top scores) needs more Sinkhorn iterations.

    Args:
        x: input scores (any number of batch dims). float16/bfloat16 are computed in float32.
        k: number of entries to select, an int in [1, n]. ``k = n`` drops the rest target (a soft
            sort of the whole row).
        dim: the dim to select along; negative values allowed.
        largest: select the largest (True, largest first) or the smallest (False, smallest first).
        epsilon: smoothing strength > 0 in units of x; a float or a tensor broadcastable to the
            batch shape (x.shape without ``dim``); a tensor gets a gradient.
        max_iter: Sinkhorn iteration cap; None means 2000 (plus at most 30 Newton steps).
        tol: relative L1 marginal tolerance; None means 1e-6 (float32) / 1e-9 (float64).
            ``tol=0`` runs exactly ``max_iter`` plain Sinkhorn iterations (no Newton, no warning).

    Returns:
        A :class:`TopK` ``(values, weights, indices)``. If a row does not reach ``tol`` within
        ``max_iter`` iterations a ``UserWarning`` is issued (once per call); the result is
        returned anyway.

    Shape:
        - x: ``(*, n, *)`` with n at ``dim``.
        - values: x.shape with ``dim`` replaced by k.
        - weights: ``values.shape + (n,)``.
        - indices: as values (int64).

    Notes:
        Non-finite scores: entries that can never be selected (``-inf`` for ``largest=True``,
        ``+inf`` otherwise) get weight 0 and do not change the others; entries of the opposite
        infinity are always selected (their values are infinite). A row with fewer than k
        selectable entries, or with a NaN, gives NaN in that row only. ``x``'s own gradient is
        the implicit one; ``epsilon`` (tensor) also gets a gradient.

    Example:
        >>> import torch
        >>> from softops import soft_topk
        >>> x = torch.tensor([0.0, 3.0, 1.0, 2.0])
        >>> out = soft_topk(x, 2, epsilon=0.05)
        >>> out.values
        tensor([3.0000, 2.0000])
        >>> out.weights.round(decimals=3)
        tensor([[0., 1., 0., 0.],
                [0., 0., 0., 1.]])
        >>> out.indices
        tensor([1, 3])
        >>> torch.topk(x, 2, -1, True, sorted=True).values  # the hard op
        tensor([3., 2.])

    References:
        Y. Xie, H. Dai, M. Chen, B. Dai, T. Zhao, H. Zha, W. Wei, T. Pfister. Differentiable Top-k
        Operator with Optimal Transport. NeurIPS 2020. arXiv:2002.06504.
    """
    check_bool(largest, _OP, "largest")
    rows = prepare_rows(_OP, x, dim, epsilon)
    n, x2, eps, restore = rows.n, rows.x2, rows.eps, rows.restore  # x2 (B, n), eps (B,)
    k = int(check_k(k, n, _OP, low=1, integer=True))
    cd = x2.dtype
    max_iter = check_max_iter(max_iter, SINKHORN_MAX_ITER, _OP)
    tol = check_tol(tol, default_tol(cd), _OP)

    indices = torch.topk(x.detach(), k, dim=rows.dim, largest=largest, sorted=True).indices
    bsz = x2.shape[0]
    # Under torch.func, on meta tensors and while tracing there is no value to branch on: every
    # row then takes the path of rows with infinities, which leaves a finite row as it is.
    m = k + 1 if k < n else k
    # One host read in the common case: rows with an infinity, or an entry within 64 m of the
    # largest finite value (scaled below), are the only ones with |x| above that limit.
    no_values = cannot_branch(x2)
    limit = torch.finfo(cd).max / (64 * m)
    unusual = no_values or bool((x2.detach().abs() > limit).any())
    has_inf = unusual and (no_values or bool(torch.isinf(x2.detach()).any()))

    # Paper orientation: the smallest s are selected, smallest first. The solve runs in float64
    # (its cost, marginals and plan); the weights are cast back to the compute dtype.
    f64 = torch.float64
    # Rows without an unusual entry are solved in the units of x2: for ``largest`` the
    # orientation is folded into the column constants and the cost's slope below (``neg``:
    # s = -x2 is never formed); the other paths form s.
    neg = largest and not unusual
    s = -x2 if largest and unusual else x2
    log_a = torch.full((bsz, n), -math.log(n), dtype=f64, device=x.device)
    log_nu = [-math.log(n)] * k + ([math.log((n - k) / n)] if k < n else [])
    log_b = torch.tensor(log_nu, dtype=f64, device=x.device).expand(bsz, m)
    if has_inf:
        # Infinities are their limits, by structure: -inf (in s) is always selected and fills
        # the first targets, +inf never is; the problem is solved on the finite entries, the
        # infinite ones carrying no mass (their costs are placeholders within the finite range)
        # and the first c = min(#(-inf), k) targets none. (Finite stand-ins beyond the range
        # rounded onto the row at a small epsilon, and overflowed at a huge one.) Rows with
        # fewer than k selectable entries, or a NaN, are NaN; they, and rows without a finite
        # entry, solve a uniform stand-in (zeros), whose plan is discarded.
        sd = s.detach()
        fin = torch.isfinite(sd)
        sure, never = sd == -math.inf, sd == math.inf
        selectable = ((~never).sum(-1) >= k) & ~torch.isnan(sd).any(-1)
        n_sure = sure.sum(-1)
        n_fin = fin.sum(-1)
        trivial = ~selectable | (n_fin == 0)
        c_eff = n_sure.clamp(max=k)
        fmin = torch.where(fin, sd, math.inf).amin(-1, keepdim=True)
        fmax = torch.where(fin, sd, -math.inf).amax(-1, keepdim=True)
        s = torch.where(sure, fmin, torch.where(never, fmax, s))
        s = torch.where(trivial[:, None], 0, s)
        log_a = log_a.masked_fill(~(fin | trivial[:, None]), -math.inf)
        j = torch.arange(m, device=x.device)
        log_fin = torch.where(j < c_eff[:, None], -math.inf, log_b)
        if k < n:  # the rest: the finite entries left out (exactly n - k on a finite row)
            rest = n_fin - (k - c_eff)
            log_rest = torch.log(rest.double() / n)
            log_rest = torch.where(rest == n - k, log_b[:, k], log_rest)
            log_fin = torch.where(j == k, log_rest[:, None], log_fin)
        log_b = torch.where(trivial[:, None], log_b, log_fin)
    # Centred (by the column constants below) and scaled: the problem is invariant under (s, eps)
    # -> (c s, c eps); rows whose finite entries come within 64 m of the largest finite value
    # are solved at c a power of two that brings them below it (the partial sums of the costs
    # are then finite; a row near finfo.max gave NaN), other rows at c = 1.
    if unusual:
        with torch.no_grad():
            mag = s.detach().abs().amax(-1)
            exponent = torch.frexp(torch.nan_to_num(mag, nan=0.0) / limit).exponent.clamp(min=0)
            scale = torch.ldexp(torch.ones_like(mag), -exponent)
        s = s * scale[:, None]
        eps = eps * scale

    # Cost / eps_p with eps_p = 2 epsilon: -(j s_i - sum_{l<j} beta_l)/epsilon, where beta_l is the
    # midpoint between the (l+1)-th and (l+2)-th smallest s (detached constants): column constants
    # do not change the plan, and they keep the potentials O(1). Each row is then shifted by its
    # own cost at its "home" column j_i = #{l: beta_l < s_i} (a row constant, absorbed by f_i):
    #   C_ij - C_ij_i = -sum_{j_i <= l < j} (s_i - beta_l)   (j > j_i),
    #                 = +sum_{j <= l < j_i} (s_i - beta_l)   (j < j_i),
    # two one-signed partial sums, so every cost keeps full relative precision and the smallest
    # is 0. Formed as one cumsum over all l, the far-away midpoints (an entry 1e8 away from the
    # rest) would add a common offset that the dtype cannot carry next to the O(1) differences.
    # Layout (B, m, n), in float64 (the differences s_i - beta_l of float32 numbers are exact).
    with torch.no_grad():
        sd = s.detach().to(f64)  # -s with ``neg``; detached: no_grad keeps forward-mode tangents
        low = torch.topk(sd, min(k + 1, n), dim=-1, largest=neg, sorted=True).values
        beta = (low[:, : m - 1] + low[:, 1:m]) * 0.5  # (B, m-1), exact in float64; -beta (neg)
        if neg:
            dd = beta.unsqueeze(-1) - sd.unsqueeze(1)  # (B, m-1, n): s_i - beta_l
        else:
            dd = sd.unsqueeze(1) - beta.unsqueeze(-1)
        pad = torch.nn.functional.pad
        up = pad(dd.clamp_max(0.0), (0, 0, 1, 0)).cumsum(1)  # sum_{l<j} of the negative ones
        down = pad(dd.clamp_min(0.0), (0, 0, 0, 1)).flip(1).cumsum(1).flip(1)  # l >= j, > 0
        accurate = down - up  # (B, m, n), >= 0
        # At an epsilon far below the gaps (cost / epsilon beyond the range of the compute
        # dtype) every entry is already decided: floor epsilon per row so that the scaled cost
        # stays within 1/16 of that range, as when the cost was formed in that dtype (a (B,)
        # floor, so nothing more is saved for backward).
        floor = accurate.amax(dim=(1, 2)) / (torch.finfo(cd).max / 16)
    eps_eff = torch.maximum(eps.to(f64), floor)
    tensor_eps = isinstance(epsilon, Tensor)
    with torch.no_grad():  # the cost in units of epsilon (its gradients are _SortedPlan's)
        scaled = accurate / eps_eff.detach()[:, None, None]
    # a float epsilon has no gradient or tangent: the scaled cost is then not kept for them
    weights, _, converged, residual, clean = apply_function(
        _SortedPlan, s, eps_eff, scaled, log_a, log_b, neg, k, max_iter, tol, tensor_eps
    )
    if has_inf:
        # the sure entries (tied) share the first c targets: 1/#(-inf) each
        weights = torch.where(trivial[:, None, None], 0, weights)
        first = torch.arange(k, device=x.device)[None, :, None] < c_eff[:, None, None]
        share = (1 / n_sure.clamp(min=1).to(cd))[:, None, None]
        weights = torch.where(first & sure[:, None, :], share, weights)
        values = _values_with_infinities(weights, x2, largest)
        weights = torch.where(selectable[:, None, None], weights, math.nan)
        values = torch.where(selectable[:, None], values, math.nan)
    else:
        with own_precision(x2):
            values = torch.bmm(weights, x2.unsqueeze(-1)).squeeze(-1)  # (B, k)

    if not clean:  # the solver read on the host whether every row converged
        warn_not_converged(_OP, converged, max_iter, residual=residual, tol=tol)

    values = restore(values.to(x.dtype))
    weights = restore(weights.to(x.dtype))
    return TopK(values, weights, indices)


class _SortedPlan(torch.autograd.Function):
    r"""``(s, eps) -> (weights, plan, converged, residual, clean)``: the sorted top-k's OT solve,
    differentiable in the scores and epsilon in one node.

    The cost is ``C_ij = slope_j s_i + c_ij`` (``slope_j = -j`` in the paper's orientation,
    ``+j`` in units of x with ``neg``; the constants c_ij centre it), given by its values in
    units of epsilon, ``scaled = C / eps`` (B, m, n), a constant: the plan depends on the scores
    s (B, n) and on epsilon (B,) only through it, with :math:`\partial (C/\varepsilon)_{ij} /
    \partial s_i = \mathrm{slope}_j/\varepsilon` and :math:`\partial (C/\varepsilon) /
    \partial\varepsilon = -(C/\varepsilon)/\varepsilon`. So the backward is one implicit
    VJP of the plan (:func:`~softops._core.sinkhorn.implicit_cost_vjp`, in units of epsilon)
    and two contractions of it: ``sum_j slope_j G_ij / eps`` and ``-<G, C/eps> / eps`` (the
    infinite costs of entries without mass are constants). Formed that way the chain through
    ``1 / eps`` never squares epsilon (which overflowed below 1e-154).

    ``tensor_eps`` False says that epsilon has neither a gradient nor a tangent (a float
    epsilon), so ``scaled`` is not saved. ``weights = n plan[:, :, :k]`` (B, k, n), in the dtype
    of s; ``plan`` (B, n, m) is the float64 plan, an output too so that double backward reaches
    the plan through this node (the torch backward is formed from the saved plan by
    differentiable operations). Without a graph of the backward, small CPU problems take the
    numba kernel ``sorted_vjp_rows`` (the same solve and contractions; the rows it cannot solve
    safely are redone in torch). ``converged`` and ``residual`` are not differentiable;
    ``clean`` is True where the solver read on the host that every row converged. Forward mode
    applies the same (symmetric) implicit map to the tangent of the scaled cost; ``vmap`` folds
    the vmapped dimension into the rows.
    """

    @staticmethod
    def forward(
        s: Tensor,
        eps: Tensor,
        scaled: Tensor,
        log_a: Tensor,
        log_b: Tensor,
        neg: bool,
        k: int,
        max_iter: int,
        tol: float,
        tensor_eps: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
        res, clean = log_sinkhorn_checked(
            scaled.transpose(1, 2),
            log_a,
            log_b,
            torch.ones_like(eps),
            max_iter=max_iter,
            tol=tol,
            newton=True,
            newton_first=True,
            potentials=False,
        )
        plan = res.plan  # (B, n, m), float64
        weights = (plan[:, :, :k] * plan.shape[1]).to(s.dtype).transpose(1, 2)
        return weights, plan, res.converged, res.residual, clean

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        eps, scaled = inputs[1], inputs[2]
        ctx.neg, ctx.k, ctx.dtype = inputs[5], inputs[6], inputs[0].dtype
        _, plan, converged, residual, _ = output
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(converged, residual)
        s = inputs[0]
        if not inputs[9]:  # epsilon has no gradient or tangent: C / eps is not needed
            s, scaled = s.new_empty(0), scaled.new_empty(0)
        ctx.save_for_backward(plan, eps, scaled, s)
        ctx.save_for_forward(plan, eps, scaled)

    @staticmethod
    def backward(
        ctx: Any, grad_w: Tensor | None, grad_plan: Tensor | None, *_: Any
    ) -> tuple[Tensor | None, ...]:
        nones: tuple[None, ...] = (None,) * 8
        if grad_w is None and grad_plan is None:
            return (None, None, *nones)
        plan, eps, scaled, s = ctx.saved_tensors
        need_s, need_eps = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, m = plan.shape[1], plan.shape[2]
        # Without a graph of the backward (no double backward) small CPU problems take the
        # numba kernel; the rows it leaves (a singular system) and all others the torch code.
        if grad_plan is None and not torch.is_grad_enabled() and use_numba(plan, n, m):
            assert grad_w is not None
            grad_s, grad_eps, safe = _numba_vjp(plan, grad_w, eps, scaled, ctx.neg, need_eps)
            if not bool(safe.all()):
                rows = ~safe
                sub = _torch_vjp(
                    plan[rows],
                    grad_w[rows],
                    None,
                    eps[rows],
                    scaled[rows] if need_eps else scaled,
                    s[rows] if need_eps else s,
                    ctx.neg,
                    need_eps,
                )
                grad_s[rows] = sub[0]
                if grad_eps is not None and sub[1] is not None:
                    grad_eps[rows] = sub[1]
        else:
            grad_s, grad_eps = _torch_vjp(
                plan, grad_w, grad_plan, eps, scaled, s, ctx.neg, need_eps
            )
        return (grad_s.to(ctx.dtype) if need_s else None, grad_eps if need_eps else None, *nones)

    @staticmethod
    def jvp(
        ctx: Any, s_t: Tensor | None, eps_t: Tensor | None, *_: Any
    ) -> tuple[Tensor | None, ...]:
        plan, eps, scaled = ctx.saved_tensors
        n, m = plan.shape[1], plan.shape[2]
        tangent = torch.zeros_like(plan)  # of the scaled cost, (B, n, m)
        if s_t is not None:
            slopes = _slopes(m, ctx.neg, plan).squeeze(-1)
            tangent = tangent + (s_t.to(plan.dtype) / eps[:, None])[:, :, None] * slopes
        if eps_t is not None:
            tangent = tangent - _finite_costs(scaled) * (eps_t / eps)[:, None, None]
        plan_t = implicit_cost_vjp(plan, tangent, torch.ones_like(eps), True)
        weights_t = (plan_t[:, :, : ctx.k] * n).to(ctx.dtype).transpose(1, 2)
        return weights_t, plan_t, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_rows(_SortedPlan, info, in_dims, *args)


def _torch_vjp(
    plan: Tensor,
    grad_w: Tensor | None,
    grad_plan: Tensor | None,
    eps: Tensor,
    scaled: Tensor,
    s: Tensor,
    neg: bool,
    need_eps: bool,
) -> tuple[Tensor, Tensor | None]:
    """The backward of :class:`_SortedPlan` in torch, differentiable (double backward): the
    gradients in s (B, n), float64, and, with ``need_eps``, in epsilon (B,)."""
    n, m = plan.shape[1], plan.shape[2]
    grad = torch.zeros_like(plan) if grad_plan is None else grad_plan.to(plan.dtype)
    if grad_w is not None:
        g = grad_w.transpose(1, 2).to(plan.dtype) * n  # (B, n, k)
        grad = grad + torch.nn.functional.pad(g, (0, m - g.shape[2]))
    g_scaled = implicit_cost_vjp(plan, grad, torch.ones_like(eps), True)  # (B, n, m)
    slopes = _slopes(m, neg, plan)
    grad_s = (g_scaled @ slopes).squeeze(-1) / eps[:, None]
    grad_eps = None
    if need_eps:
        # C / eps as a function of s and eps (its value is ``scaled``), for double backward
        costs = _finite_costs(scaled) * (eps.detach() / eps)[:, None, None]
        ds = (s - s.detach()).to(plan.dtype) / eps[:, None]
        costs = costs + ds[:, :, None] * slopes.squeeze(-1)
        grad_eps = -(g_scaled * costs).sum((1, 2)) / eps
    return grad_s, grad_eps


def _numba_vjp(
    plan: Tensor, grad_w: Tensor, eps: Tensor, scaled: Tensor, neg: bool, need_eps: bool
) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`_torch_vjp` (for a cotangent of the weights only) by the numba kernel
    ``sorted_vjp_rows``: ``(grad_s, grad_eps, safe)``, where the rows not ``safe`` are to be
    redone in torch."""
    bsz, n, m = plan.shape
    f64 = torch.float64
    pm = plan.detach().transpose(1, 2).contiguous()  # (B, m, n): the solver's buffer, no copy
    gm = pm.new_zeros((bsz, m, n))
    gm[:, : grad_w.shape[1]] = grad_w.detach() * n
    slopes = _slopes(m, neg, pm).squeeze(-1)
    costs = scaled.detach().contiguous() if need_eps else pm.new_empty((0, 1, 1))
    grad_s = pm.new_empty((bsz, n))
    grad_eps = pm.new_empty(bsz)
    safe = torch.empty(bsz, dtype=torch.bool)
    numba_kernels().sorted_vjp_rows(
        pm.numpy(),
        gm.numpy(),
        costs.numpy(),
        slopes.numpy(),
        eps.detach().to(f64).contiguous().numpy(),
        DET_MIN,
        grad_s.numpy(),
        grad_eps.numpy(),
        safe.numpy(),
    )
    return grad_s, grad_eps if need_eps else None, safe


def _slopes(m: int, neg: bool, like: Tensor) -> Tensor:
    """The cost's slopes in the scores, ``+-j`` for j = 0..m-1, as an (m, 1) column of ``like``'s
    dtype and device."""
    j = torch.arange(m, dtype=like.dtype, device=like.device)
    return (j if neg else -j).unsqueeze(-1)


def _finite_costs(scaled: Tensor) -> Tensor:
    """``scaled`` (B, m, n) as (B, n, m), its infinite entries (no mass: constants) set to 0."""
    return torch.where(torch.isinf(scaled), 0, scaled).transpose(1, 2)


def _values_with_infinities(weights: Tensor, x2: Tensor, largest: bool) -> Tensor:
    """``weights @ x`` for rows with infinite scores.

    The c always-selected infinities (``+inf`` for ``largest``) fill the first c targets, whose
    values are that infinity; the other infinities have zero weight and contribute 0 (not NaN).
    """
    xd = x2.detach()
    finite_x = torch.where(torch.isinf(xd), 0.0, x2)
    with own_precision(x2):
        values = torch.bmm(weights, finite_x.unsqueeze(-1)).squeeze(-1)
    sure = math.inf if largest else -math.inf
    count = (xd == sure).sum(-1, keepdim=True)  # (B, 1)
    j = torch.arange(values.shape[-1], device=values.device)
    return torch.where(j < count, sure, values)
