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
* Long rows are solved on a candidate set (docs/math.md §2.4): the entries far below the
  (k+1)-th score get weight 0, which moves no weight by more than a stated tolerance; the full
  solve (``_soft_topk(..., reduce=False)``) is the reference it is tested against.

Paths: :func:`_path` chooses the numba kernels (:class:`_KernelSolve`: the candidate set, the
solve and the backward per row), the torch solve of the candidate set (:func:`_torch_solve`,
other devices and forward mode) or the full solve (:func:`_full`, the solve this module had
before the candidate set, with its :class:`_SortedPlan`).
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd import forward_ad

from softops._core.convergence import SINKHORN_MAX_ITER, default_tol, warn_not_converged
from softops._core.dims import prepare_rows
from softops._core.sinkhorn import (
    DET_MIN,
    HAVE_NUMBA,
    implicit_cost_vjp,
    log_sinkhorn_checked,
    numba_kernels,
    use_numba,
)
from softops._core.transforms import apply_function, cannot_branch, own_precision, vmap_rows
from softops._core.validation import check_bool, check_k, check_max_iter, check_tol
from softops._kernels import kernels_enabled

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

    **Candidate set** (docs/math.md §2.4). An entry whose score lies g epsilons below the
    (k+1)-th largest has at most ``k exp(-g)`` weight on the first k targets, so each row is
    solved on its candidates only: the entries near enough to the top that dropping the others
    moves no weight by more than ``tau`` (1e-7 where x is computed in float32, 1e-14 in float64),
    the others having weight exactly 0 and their rows of the plan on the rest target. The
    candidates' problem is that of the sub-row (the rest target's mass is the candidates' count
    less k), each target's weights still sum to 1, and the gradient is that of the candidates'
    problem: **0 at the entries outside the set** (up to the tolerance: their weights and
    derivatives carry the factor ``exp(-g)``). Where epsilon is large against the spread of the
    scores the set is the whole row. Rows with an infinity or a NaN, ``tol=0``, and every call
    under ``torch.func`` transforms, on meta tensors or while tracing, solve the full row.

    The forward pass is semi-dual Newton in float64 from one Sinkhorn update of the centred start
    (the plain start far below the gaps). On the CPU, where numba is installed
    (``pip install 'softops[pav]'``) and k <= 32, the candidate set and the solve run as numba
    kernels, without an exponential per entry and target (compiled on the first call, then cached
    on disk); rows the kernel does not finish, and other devices, are solved in torch (log-domain
    Sinkhorn to a relative L1 marginal error of 1e-3, then Newton). The backward pass is implicit
    differentiation through a k x k SPD (Schur complement) solve in float64 (in closed form for
    k <= 2, else Cholesky), so memory is O(n k) whatever the iteration count; double backward
    recomputes the forward in torch.

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
    return _soft_topk(x, k, dim, largest, epsilon, max_iter, tol)


def _soft_topk(
    x: Tensor,
    k: int,
    dim: int = -1,
    largest: bool = True,
    epsilon: float | Tensor = 0.1,
    max_iter: int | None = None,
    tol: float | None = None,
    reduce: bool = True,
    kernel: bool = True,
) -> TopK:
    """:func:`soft_topk`; ``reduce=False`` solves every row in full (no candidate set: the
    reference the candidate-set path is tested against), ``kernel=False`` keeps off the numba
    kernel (the candidate set is then chosen and solved in torch)."""
    check_bool(largest, _OP, "largest")
    rows = prepare_rows(_OP, x, dim, epsilon)
    n, x2, eps, restore = rows.n, rows.x2, rows.eps, rows.restore  # x2 (B, n), eps (B,)
    k = int(check_k(k, n, _OP, low=1, integer=True))
    cd = x2.dtype
    max_iter = check_max_iter(max_iter, SINKHORN_MAX_ITER, _OP)
    tol = check_tol(tol, default_tol(cd), _OP)

    indices = torch.topk(x.detach(), k, dim=rows.dim, largest=largest, sorted=True).indices
    tensor_eps = isinstance(epsilon, Tensor)
    path = _path(x2, k, n, tol, reduce, kernel)
    if path == "kernel":
        weights, values, converged, residual, clean = _kernel_solve(
            x2, eps, k, largest, max_iter, tol, tensor_eps
        )
    elif path == "torch":
        weights, values, converged, residual, clean = _torch_solve(
            x2, eps, k, largest, max_iter, tol, tensor_eps
        )
    else:
        weights, values, converged, residual, clean = _full(
            x2, eps, k, largest, max_iter, tol, tensor_eps
        )

    if not clean:  # the solver read on the host whether every row converged
        warn_not_converged(_OP, converged, max_iter, residual=residual, tol=tol)

    values = restore(values.to(x.dtype))
    weights = restore(weights.to(x.dtype))
    return TopK(values, weights, indices)


def _full(
    x2: Tensor,
    eps: Tensor,
    k: int,
    largest: bool,
    max_iter: int,
    tol: float,
    tensor_eps: bool,
    log_a: Tensor | None = None,
    log_b: Tensor | None = None,
    finite: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """The full solve of every row of x2 (B, n) (docs/math.md §2.2): ``(weights (B, k, n),
    values (B, k), converged, residual, clean)``, weights and values in x2's dtype.

    ``log_a`` (B, n) and ``log_b`` (B, k+1) replace the uniform masses (the candidate-set
    problem of :func:`_reduced_reference`: entries of zero mass, a smaller rest); ``finite``
    says that x2 is known to hold no infinity and no entry near the largest finite value (no
    host read for it). ``tensor_eps``: epsilon is a tensor (its gradient and tangent are formed).
    """
    n = x2.shape[1]
    cd = x2.dtype
    bsz = x2.shape[0]
    # Under torch.func, on meta tensors and while tracing there is no value to branch on: every
    # row then takes the path of rows with infinities, which leaves a finite row as it is.
    m = k + 1 if k < n else k
    # One host read in the common case: rows with an infinity, or an entry within 64 m of the
    # largest finite value (scaled below), are the only ones with |x| above that limit.
    no_values = cannot_branch(x2)
    limit = torch.finfo(cd).max / (64 * m)
    unusual = not finite and (no_values or bool((x2.detach().abs() > limit).any()))
    has_inf = unusual and (no_values or bool(torch.isinf(x2.detach()).any()))

    # Paper orientation: the smallest s are selected, smallest first. The solve runs in float64
    # (its cost, marginals and plan); the weights are cast back to the compute dtype.
    f64 = torch.float64
    # Rows without an unusual entry are solved in the units of x2: for ``largest`` the
    # orientation is folded into the column constants and the cost's slope below (``neg``:
    # s = -x2 is never formed); the other paths form s.
    neg = largest and not unusual
    s = -x2 if largest and unusual else x2
    if log_a is None or log_b is None:
        log_a = torch.full((bsz, n), -math.log(n), dtype=f64, device=x2.device)
        log_nu = [-math.log(n)] * k + ([math.log((n - k) / n)] if k < n else [])
        log_b = torch.tensor(log_nu, dtype=f64, device=x2.device).expand(bsz, m)
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
        j = torch.arange(m, device=x2.device)
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
    with torch.no_grad():  # the cost in units of epsilon (its gradients are _SortedPlan's)
        scaled = accurate / eps_eff.detach()[:, None, None]
    # a float epsilon has no gradient or tangent: the scaled cost is then not kept for them
    weights, _, converged, residual, clean = apply_function(
        _SortedPlan, s, eps_eff, scaled, log_a, log_b, neg, k, max_iter, tol, tensor_eps
    )
    if has_inf:
        # the sure entries (tied) share the first c targets: 1/#(-inf) each
        weights = torch.where(trivial[:, None, None], 0, weights)
        first = torch.arange(k, device=x2.device)[None, :, None] < c_eff[:, None, None]
        share = (1 / n_sure.clamp(min=1).to(cd))[:, None, None]
        weights = torch.where(first & sure[:, None, :], share, weights)
        values = _values_with_infinities(weights, x2, largest)
        weights = torch.where(selectable[:, None, None], weights, math.nan)
        values = torch.where(selectable[:, None], values, math.nan)
    else:
        with own_precision(x2):
            values = torch.bmm(weights, x2.unsqueeze(-1)).squeeze(-1)  # (B, k)

    return weights, values, converged, residual, clean


# --------------------------------------------------------------------------- the candidate set

_TAU_64 = 1e-14
"""Tolerance of the candidate set on the weights in float64 (absolute; a weight is at most 1)."""
_TAU_32 = 1e-7
"""The same for float32 (and float16/bfloat16, which are computed in float32)."""
_BINS_PER_UNIT = 4.0
"""Resolution of the histogram of the gaps below the (k+1)-th score, in bins per epsilon."""
_KERNEL_MAX_K = 32
"""Largest k the numba kernel solves (larger k: the candidate set in torch, the torch solve)."""
_KERNEL_STEPS = 24
"""Newton steps of the kernel per row (rows it leaves above ``tol`` take the torch solve)."""
_KERNEL_HALVINGS = 4
"""Step halvings the kernel tries when a full Newton step does not lower the residual bound."""


def _candidate_tolerance(dtype: torch.dtype) -> float:
    """The tolerance ``tau`` of the candidate set for a compute dtype (docs/math.md §2.4): the
    weights of the candidate-set solve are those of the full solve within ``tau``."""
    return _TAU_64 if dtype == torch.float64 else _TAU_32


@functools.lru_cache(maxsize=64)
def _bin_weights(n: int, k: int, tau: float) -> Tensor:
    """:func:`_bins`' weights as a float64 tensor (cached: the kernel's argument)."""
    return torch.tensor(_bins(n, k, tau)[1], dtype=torch.float64)


def _bins(n: int, k: int, tau: float) -> tuple[int, list[float]]:
    """``(nb, weight)``: the number of histogram bins of the gaps d (in units of epsilon below the
    (k+1)-th score) and the bound ``weight[b]`` on exp(-d) in bin b: bin 0 holds d <= 0, bin b
    in 1..nb-1 holds ``(b-1)/bpu < d <= b/bpu``, bin nb every larger gap (``weight[nb]`` is
    below ``tau / (2 k n)``, so those entries are never needed)."""
    far = math.log(2.0 * k * max(n, 2) / tau)
    nb = math.ceil(far * _BINS_PER_UNIT) + 2
    weight = [1.0] + [math.exp(-(b - 1) / _BINS_PER_UNIT) for b in range(1, nb + 1)]
    return nb, weight


def _path(x2: Tensor, k: int, n: int, tol: float, reduce: bool, kernel: bool) -> str:
    """Which solve takes the rows: ``"kernel"`` (candidate set and solve in numba, CPU),
    ``"torch"`` (candidate set chosen in torch, solved by :func:`_full`) or ``"full"`` (every
    row in full: under ``torch.func`` transforms, on meta tensors, while tracing, with ``tol=0``
    (the paper's fixed iterations) and where no candidate set can drop an entry)."""
    if not reduce or tol <= 0 or n == 1 or x2.shape[0] == 0 or cannot_branch(x2):
        return "full"
    if forward_ad._current_level >= 0:  # forward mode: the Functions with a jvp
        return "torch" if k < n else "full"
    if kernel and k <= _KERNEL_MAX_K and x2.device.type == "cpu" and _kernels() is not None:
        return "kernel"
    return "torch" if k < n else "full"


def _select_torch(
    x2: Tensor, eps: Tensor, k: int, largest: bool, tau: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate set of every row (docs/math.md §2.4), in torch: ``(cand, count, bad)``,
    ``cand`` (B, m) the indices of the candidates of each row in its first ``count`` places,
    ``bad`` (B,) the rows with an entry that is not finite or near the largest finite value
    (solved in full)."""
    bsz, n = x2.shape
    f64 = torch.float64
    y = x2.detach().to(f64)
    if not largest:
        y = -y
    limit = torch.finfo(x2.dtype).max / (64 * (k + 1))
    bad = ~(y.abs() <= limit).all(-1)
    y = torch.where(bad[:, None], 0.0, y)
    yk = torch.topk(y, k + 1, dim=-1, sorted=True).values[:, k:]
    inv = 1.0 / eps.detach().to(f64)
    d = (yk - y) * inv[:, None]
    nb, weight = _bins(n, k, tau)
    b = torch.ceil(d * _BINS_PER_UNIT).clamp(0, nb).long()
    hist = torch.zeros(bsz, nb + 1, dtype=f64, device=x2.device)
    hist.scatter_add_(1, b, torch.ones_like(d))
    bound = hist * torch.tensor(weight, dtype=f64, device=x2.device)
    # tail[c] = k * (the bound of the bins >= c); the cut is the least c >= 1 with tail <= tau
    tail = bound.flip(1).cumsum(1).flip(1) * k
    ok = tail[:, 1:] <= tau  # cut c = 1..nb
    cut = torch.where(ok.any(1), ok.long().argmax(1) + 1, nb + 1)
    cut = torch.where(ok[:, -1], cut, nb + 1)
    inside = b < cut[:, None]
    count = inside.sum(-1)
    m = int(count.max()) if bsz else 0
    key = torch.where(inside, y, -math.inf)  # the candidates first, then padding
    cand = torch.topk(key, max(m, 1), dim=-1, sorted=True).indices
    return cand, count, bad


def _reduced_reference(
    x2: Tensor,
    eps: Tensor,
    cand: Tensor,
    count: Tensor,
    k: int,
    largest: bool,
    max_iter: int,
    tol: float,
    tensor_eps: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """The candidate-set problem of every row solved by :func:`_full` (differentiable): the
    candidates ``cand[:, :count]`` of mass 1/n each, the first k targets of mass 1/n, the rest
    of mass (count - k)/n; the weights scattered back to (B, k, n) (0 off the candidates).
    Rows with fewer candidates than ``cand`` has columns are padded with entries of zero mass."""
    bsz, n = x2.shape
    mm = cand.shape[1]
    f64 = torch.float64
    valid = torch.arange(mm, device=x2.device) < count[:, None]
    xr = x2.gather(1, cand)
    if not bool(valid.all()):
        # padding: zero mass, at the row's least selectable candidate (inside its range)
        xd = xr.detach()
        far = torch.where(valid, xd, math.inf if largest else -math.inf)
        fill = far.amin(-1, keepdim=True) if largest else far.amax(-1, keepdim=True)
        xr = torch.where(valid, xr, fill)
    # masses 1/mm (the weights are mm times the plan: each candidate's row sums to 1)
    log_a = torch.full((bsz, mm), -math.log(mm), dtype=f64, device=x2.device)
    log_a = log_a.masked_fill(~valid, -math.inf)
    rest = torch.log((count - k).to(f64) / mm)
    first = torch.full((bsz, k), -math.log(mm), dtype=f64, device=x2.device)
    log_b = torch.cat((first, rest[:, None]), 1)
    wr, values, converged, residual, clean = _full(
        xr, eps, k, largest, max_iter, tol, tensor_eps, log_a, log_b, finite=True
    )
    index = cand.unsqueeze(1).expand(bsz, k, mm)
    weights = x2.new_zeros((bsz, k, n)).scatter_add(2, index, wr.to(x2.dtype))
    return weights, values, converged, residual, clean


def _torch_solve(
    x2: Tensor, eps: Tensor, k: int, largest: bool, max_iter: int, tol: float, tensor_eps: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """The candidate-set solve in torch (:func:`_select_torch`, :func:`_reduced_reference`);
    rows with an infinity, a NaN or an entry near the largest finite value are solved in full."""
    cand, count, bad = _select_torch(x2, eps, k, largest, _candidate_tolerance(x2.dtype))
    if bool(bad.all()):
        return _full(x2, eps, k, largest, max_iter, tol, tensor_eps)
    good = (~bad).nonzero().squeeze(1)
    weights, values, converged, residual, clean = _reduced_reference(
        x2[good], eps[good], cand[good], count[good], k, largest, max_iter, tol, tensor_eps
    )
    if good.numel() == x2.shape[0]:
        return weights, values, converged, residual, clean
    return _merge_full_rows(
        x2,
        eps,
        k,
        largest,
        max_iter,
        tol,
        tensor_eps,
        good,
        bad,
        (weights, values, converged, residual, clean),
    )


def _merge_full_rows(
    x2: Tensor,
    eps: Tensor,
    k: int,
    largest: bool,
    max_iter: int,
    tol: float,
    tensor_eps: bool,
    good: Tensor | None,
    bad: Tensor,
    part: tuple[Tensor, Tensor, Tensor, Tensor, bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """The results of the rows ``good`` (``part``; None: ``part`` holds every row already) and
    the full solve of the rows ``bad``, merged into (B, ...) (differentiable)."""
    bsz, n = x2.shape
    rows = bad.nonzero().squeeze(1)
    wb, vb, cb, rb, clean_b = _full(x2[rows], eps[rows], k, largest, max_iter, tol, tensor_eps)
    w, v, c, r, clean = part
    if good is not None:
        shape_w, shape_v = (bsz, k, n), (bsz, k)
        w = w.new_zeros(shape_w).index_put((good,), w)
        v = v.new_zeros(shape_v).index_put((good,), v)
        c = c.new_zeros(bsz).index_put((good,), c)
        r = r.new_zeros(bsz).index_put((good,), r.to(r.dtype))
    weights = w.index_put((rows,), wb.to(w.dtype))
    values = v.index_put((rows,), vb.to(v.dtype))
    converged = c.index_put((rows,), cb.to(c.dtype))
    residual = r.index_put((rows,), rb.to(r.dtype))
    return weights, values, converged, residual, clean and clean_b


def _kernel_solve(
    x2: Tensor, eps: Tensor, k: int, largest: bool, max_iter: int, tol: float, tensor_eps: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """The candidate set and its solve by the numba kernels (:class:`_KernelSolve`); rows with
    an infinity, a NaN or an entry near the largest finite value are solved in full."""
    kern = _kernels()
    bsz, n = x2.shape
    xd = x2.detach()
    if not xd.is_contiguous():
        xd = xd.contiguous()
    e64 = eps.detach().to(torch.float64).contiguous()
    tau = _candidate_tolerance(x2.dtype)
    kk = k + 1 if k < n else k
    top = torch.empty((bsz, kk), dtype=torch.float64)
    cut = torch.empty(bsz, dtype=torch.int64)
    count = torch.empty(bsz, dtype=torch.int64)
    flag = torch.empty(bsz, dtype=torch.int8)
    limit = torch.finfo(x2.dtype).max / (64 * kk)
    most, flagged = kern.select(
        xd.numpy(),
        e64.numpy(),
        largest,
        k,
        tau,
        _BINS_PER_UNIT,
        limit,
        torch.finfo(x2.dtype).max / 64,
        _bin_weights(n, k, tau).numpy(),
        top.numpy(),
        cut.numpy(),
        count.numpy(),
        flag.numpy(),
    )
    sel = (xd, e64, top, cut, count, flag, most)
    out = _KernelSolve.apply(x2, eps, k, largest, max_iter, tol, tensor_eps, sel)
    weights, values, converged, residual = out[0], out[1], out[2], out[3]
    # (the kernel reads the rows it leaves over: clean unless one was and did not converge)
    clean = out[4] if bsz else True
    if flagged:
        bad = flag != 0
        return _merge_full_rows(
            x2,
            eps,
            k,
            largest,
            max_iter,
            tol,
            tensor_eps,
            None,
            bad,
            (weights, values, converged, residual, clean),
        )
    return weights, values, converged, residual, clean


class _KernelSolve(torch.autograd.Function):
    """``(x2, eps) -> (weights, values, converged, residual, clean)`` by the numba kernels:
    each row's candidate set (from ``sel``, the output of the selection kernel), its Newton
    solve, the weights written at the candidates (B, k, n) and the values (B, k); the backward
    is the kernel's implicit VJP, in x and epsilon. ``clean``: every row converged.

    Rows the kernel leaves above ``tol`` are solved by :func:`_reduced_reference` (the same
    candidate set, the torch solver), and their gradients are formed by autograd through it; so
    are the rows whose VJP the kernel finds singular, and every row when the backward itself is
    differentiated (``create_graph``: double backward recomputes the forward in torch). Rows
    flagged by the selection (an infinity, a NaN) are left at 0 (the caller solves them)."""

    @staticmethod
    def forward(
        ctx: Any,
        x2: Tensor,
        eps: Tensor,
        k: int,
        largest: bool,
        max_iter: int,
        tol: float,
        tensor_eps: bool,
        sel: tuple[Tensor, ...],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
        kern = _kernels()
        xd, e64, top, cut, count, flag, most = sel
        bsz, n = x2.shape
        f64 = torch.float64
        big = k + 1 if k < n else k
        # one spare column (the collection appends without a branch); padding: no mass
        mm = max(int(most), 1)
        cand = torch.zeros((bsz, mm + 1), dtype=torch.int64)
        weights = x2.new_zeros((bsz, k, n))
        v64 = torch.zeros((bsz, k), dtype=f64)
        vv = torch.empty((bsz, big), dtype=f64)
        rr = torch.empty((bsz, big), dtype=f64)
        cc = torch.empty(bsz, dtype=f64)
        err = torch.zeros(bsz, dtype=f64)
        status = torch.empty(bsz, dtype=torch.int8)
        left = kern.solve(
            xd.numpy(),
            e64.numpy(),
            largest,
            k,
            top.numpy(),
            cut.numpy(),
            count.numpy(),
            flag.numpy(),
            _BINS_PER_UNIT,
            float(tol),
            min(_KERNEL_STEPS, max_iter),
            _KERNEL_HALVINGS,
            cand.numpy(),
            weights.numpy(),
            v64.numpy(),
            vv.numpy(),
            rr.numpy(),
            cc.numpy(),
            err.numpy(),
            status.numpy(),
        )
        values = v64.to(x2.dtype)
        converged = status == 0
        clean = True
        if left:  # rows the kernel left above tol: the torch solve
            rows = (status == 1).nonzero().squeeze(1)
            with torch.no_grad():
                wr, vr, cr, res_r, _ = _reduced_reference(
                    x2[rows], eps[rows], cand[rows], count[rows], k, largest, max_iter, tol, False
                )
            weights[rows] = wr
            values[rows] = vr.to(values.dtype)
            converged[rows] = cr
            err[rows] = res_r.to(f64)
            clean = bool(cr.all())
        ctx.save_for_backward(x2, eps)
        ctx.state = (e64, top, cand, count, vv, rr, cc, status)
        ctx.settings = (k, largest, max_iter, tol, tensor_eps)
        ctx.left = left
        ctx.mark_non_differentiable(converged, err)
        return weights, values, converged, err, clean

    @staticmethod
    def backward(
        ctx: Any, grad_w: Tensor | None, grad_v: Tensor | None, *_: Any
    ) -> tuple[Tensor | None, ...]:
        nones = (None,) * 6
        x2, eps = ctx.saved_tensors
        need_x, need_eps = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_w is None and grad_v is None) or not (need_x or need_eps):
            return (None, None, *nones)
        e64, top, cand, count, vv, rr, cc, status = ctx.state
        k, largest = ctx.settings[0], ctx.settings[1]
        bsz, n = x2.shape
        if torch.is_grad_enabled():  # a differentiable backward: recompute in torch
            rows = (status != 2).nonzero().squeeze(1)
            gx, geps = _recompute_grads(ctx, x2, eps, rows, grad_w, grad_v, True)
            return (gx if need_x else None, geps if need_eps else None, *nones)
        kern = _kernels()
        f64 = torch.float64
        gx = x2.new_zeros((bsz, n))
        geps = torch.zeros(bsz, dtype=f64)
        safe = torch.ones(bsz, dtype=torch.bool)
        gv = grad_v.to(f64).contiguous() if grad_v is not None else torch.zeros((bsz, k), dtype=f64)
        gw = grad_w.contiguous() if grad_w is not None else x2.new_empty((0, 1, 1))
        unsafe = kern.vjp(
            x2.detach().contiguous().numpy(),
            e64.numpy(),
            largest,
            k,
            top.numpy(),
            cand.numpy(),
            count.numpy(),
            vv.numpy(),
            rr.numpy(),
            cc.numpy(),
            status.numpy(),
            gv.numpy(),
            gw.detach().numpy(),
            bool(need_eps),
            DET_MIN,
            gx.numpy(),
            geps.numpy(),
            safe.numpy(),
        )
        if unsafe or ctx.left:
            rows = ((status == 1) | ~safe).nonzero().squeeze(1)
            sub_x, sub_e = _recompute_grads(ctx, x2, eps, rows, grad_w, grad_v, False)
            if sub_x is not None:
                gx[rows] = sub_x[rows]
            if sub_e is not None:
                geps[rows] = sub_e[rows].to(f64)
        return (gx if need_x else None, geps.to(eps.dtype) if need_eps else None, *nones)


def _recompute_grads(
    ctx: Any,
    x2: Tensor,
    eps: Tensor,
    rows: Tensor,
    grad_w: Tensor | None,
    grad_v: Tensor | None,
    create_graph: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """The gradients (B, n) and (B,) of the rows ``rows`` of a :class:`_KernelSolve` (0 in the
    other rows) by autograd through :func:`_reduced_reference` on the same candidate sets;
    with ``create_graph`` the result is differentiable in x2 and eps (double backward)."""
    _, _, cand, count, _, _, _, _ = ctx.state
    k, largest, max_iter, tol, tensor_eps = ctx.settings
    need_x, need_eps = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    with torch.enable_grad():
        xs = x2 if create_graph else x2.detach().requires_grad_(need_x)
        es = eps if create_graph else eps.detach().requires_grad_(need_eps)
        w, v, _, _, _ = _reduced_reference(
            xs[rows], es[rows], cand[rows], count[rows], k, largest, max_iter, tol, tensor_eps
        )
        outs, gouts = [], []
        if grad_w is not None:
            outs.append(w)
            gouts.append(grad_w[rows])
        if grad_v is not None:
            outs.append(v)
            gouts.append(grad_v[rows].to(v.dtype))
        inputs = [t for t, need in ((xs, need_x), (es, need_eps)) if need]
        grads = torch.autograd.grad(
            outs, inputs, gouts, create_graph=create_graph, allow_unused=True
        )
    it = iter(grads)
    gx = next(it) if need_x else None
    geps = next(it) if need_eps else None
    if gx is None and need_x:
        gx = torch.zeros_like(x2)
    if geps is None and need_eps:
        geps = torch.zeros_like(eps)
    return gx, geps


# --------------------------------------------------------------------------- numba kernels
#
# Compiled on first use by :func:`_kernels` (numba is optional and slow to import); the
# functions below are plain Python until then. ``np`` is bound to numpy at that point.

np: Any = None
_NUMBA: dict[str, Any] = {}
_NUMBA_LOCK = threading.Lock()
_FAR = 600.0
_F64_TINY = sys.float_info.min
_F64_EPS = sys.float_info.epsilon


def _kernels() -> Any:
    """The compiled kernels (select, solve, vjp), or None where numba is not installed or the
    kernel back end is off (:mod:`softops._kernels`)."""
    if not (HAVE_NUMBA and kernels_enabled()) or torch.compiler.is_compiling():
        return None
    if "kernels" not in _NUMBA:
        with _NUMBA_LOCK:  # (compiling rebinds this module's helpers: once, one thread)
            if "kernels" not in _NUMBA:
                _NUMBA["kernels"] = _compile_kernels()
    return _NUMBA["kernels"]


def _compile_kernels() -> Any:
    global np
    try:
        import numba
        import numpy
    except ImportError:  # pragma: no cover - numba is installed with numpy
        return None
    np = numpy
    g = globals()
    plain = numba.njit(cache=True, nogil=True)
    # reassociation lets the sums over the entries vectorise (not in the centring, whose
    # order of subtraction is what keeps it free of cancellation)
    fast = numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
    g["_nb_exp"] = numba.njit(cache=True, nogil=True, fastmath={"contract"})(g["_nb_exp"])
    for name in ("_nb_eval", "_nb_laplacian_solve", "_nb_prepare", "_nb_centred", "_nb_state"):
        g[name] = plain(g[name])
    for name in ("_nb_eval_vec", "_nb_couplings"):
        g[name] = fast(g[name])
    return SimpleNamespace(
        select=plain(_nb_select_rows), solve=plain(_nb_solve_rows), vjp=plain(_nb_vjp_rows)
    )


def _nb_eval(
    yc, e, ie, far, h, m, big, bmid, c, inv_eps, v, rho, irho, q, p, bref, gap
):  # pragma: no cover - compiled
    """The row-normalised plan P (big, m) at the column states v into p, entry by entry (any
    order); ``gap = b - c`` formed relative to each entry's home column h (its hard rank) as
    sums of small terms; returns ``sum_j |gap_j|``. Entries far from the centre (``far``), and
    all entries where a column factor is out of range, take one exponential per target."""
    rowexp = False
    for j in range(big - 1):
        a = v[j + 1] - v[j] + (bmid[j] - c) * inv_eps
        if not abs(a) <= _FAR:
            rowexp = True
            rho[j] = 0.0
            irho[j] = 0.0
        else:
            rho[j] = math.exp(a)
            irho[j] = math.exp(-a)
    for j in range(big):
        gap[j] = bref[j]
    for i in range(m):
        hi = h[i]
        q[hi] = 1.0
        if rowexp or far[i]:
            yi = yc[i]
            t = 0.0
            for j in range(hi, big - 1):
                t += v[j + 1] - v[j] + (bmid[j] - yi) * inv_eps
                q[j + 1] = math.exp(t)
            t = 0.0
            for j in range(hi - 1, -1, -1):
                t -= v[j + 1] - v[j] + (bmid[j] - yi) * inv_eps
                q[j] = math.exp(t)
        else:
            ei = e[i]
            iei = ie[i]
            for j in range(hi, big - 1):
                q[j + 1] = q[j] * (ei * rho[j])
            for j in range(hi - 1, -1, -1):
                q[j] = q[j + 1] * (iei * irho[j])
        tot = 0.0
        for j in range(big):
            tot += q[j]
        inv = 1.0 / tot
        off = 0.0
        for j in range(big):
            pj = q[j] * inv
            p[j, i] = pj
            if j != hi:
                off += pj
                gap[j] -= pj
        gap[hi] += off
    l1 = 0.0
    for j in range(big):
        l1 += abs(gap[j])
    return l1


def _nb_eval_vec(
    e, ie, gs, m, big, bmid, c, inv_eps, v, rho, irho, p, tot, off, colsum, offsum, bref, gap
):  # pragma: no cover - compiled
    """:func:`_nb_eval` without exponentials, for entries sorted by home (entries ``gs[t]`` to
    ``gs[t+1]`` have home t), in loops over ranges of entries (vectorised): from the home,
    ``q_(j+1) = q_j e_i rho_j`` upward (the entries whose home is at most j, a prefix) and
    ``q_(j-1) = q_j ie_i irho_(j-1)`` downward (a suffix). Returns inf where a column factor is
    out of range (the caller then takes :func:`_nb_eval`). (A range that does not start at 0 is
    a slice looped from 0: numba's check for negative indices keeps the other from
    vectorising.)"""
    for j in range(big - 1):
        a = v[j + 1] - v[j] + (bmid[j] - c) * inv_eps
        if not abs(a) <= _FAR:
            return math.inf
        rho[j] = math.exp(a)
        irho[j] = math.exp(-a)
    for t in range(big):
        row = p[t, gs[t] : gs[t + 1]]
        for i in range(row.shape[0]):
            row[i] = 1.0
    for j in range(big - 1):
        f = rho[j]
        src = p[j]
        dst = p[j + 1]
        for i in range(gs[j + 1]):
            dst[i] = src[i] * (e[i] * f)
    for j in range(big - 2, -1, -1):
        f = irho[j]
        g = gs[j + 1]
        src = p[j + 1, g:m]
        dst = p[j, g:m]
        fac = ie[g:m]
        for i in range(m - g):
            dst[i] = src[i] * (fac[i] * f)
    for i in range(m):
        tot[i] = p[0, i]
    for j in range(1, big):
        pj = p[j]
        for i in range(m):
            tot[i] += pj[i]
    for i in range(m):
        tot[i] = 1.0 / tot[i]
        off[i] = 0.0
    for j in range(big):
        g0 = gs[j]
        g1 = gs[j + 1]
        pj = p[j]
        acc = 0.0
        for i in range(g0):
            q = pj[i] * tot[i]
            pj[i] = q
            off[i] += q
            acc += q
        mid = p[j, g0:g1]
        tmid = tot[g0:g1]
        for i in range(g1 - g0):
            mid[i] = mid[i] * tmid[i]
        hi = p[j, g1:m]
        thi = tot[g1:m]
        ohi = off[g1:m]
        for i in range(m - g1):
            q = hi[i] * thi[i]
            hi[i] = q
            ohi[i] += q
            acc += q
        colsum[j] = acc
    for t in range(big):
        grp = off[gs[t] : gs[t + 1]]
        acc = 0.0
        for i in range(grp.shape[0]):
            acc += grp[i]
        offsum[t] = acc
    l1 = 0.0
    for j in range(big):
        g = bref[j] - colsum[j] + offsum[j]
        gap[j] = g
        l1 += abs(g)
    return l1


def _nb_state(
    fast,
    yc,
    e,
    ie,
    far,
    h,
    gs,
    m,
    big,
    bmid,
    c,
    inv_eps,
    v,
    rho,
    irho,
    q,
    p,
    tot,
    off,
    colsum,
    offsum,
    bref,
    gap,
):  # pragma: no cover - compiled
    """The plan and gap at v: :func:`_nb_eval_vec` where it applies, else :func:`_nb_eval`."""
    if fast:
        l1 = _nb_eval_vec(
            e,
            ie,
            gs,
            m,
            big,
            bmid,
            c,
            inv_eps,
            v,
            rho,
            irho,
            p,
            tot,
            off,
            colsum,
            offsum,
            bref,
            gap,
        )
        if l1 < math.inf:
            return l1
    return _nb_eval(yc, e, ie, far, h, m, big, bmid, c, inv_eps, v, rho, irho, q, p, bref, gap)


def _nb_couplings(p, a, weighted, m, big, w):  # pragma: no cover - compiled
    """``w[j, l] = sum_i a_i P_ji P_li`` (j != l; ``a = 1`` unless ``weighted``)."""
    for j in range(big):
        for o in range(j + 1, big):
            acc = 0.0
            if weighted:
                for i in range(m):
                    acc += a[i] * p[j, i] * p[o, i]
            else:
                for i in range(m):
                    acc += p[j, i] * p[o, i]
            w[j, o] = acc
            w[o, j] = acc


def _nb_laplacian_solve(w, big, rhs, kmat, chol, scale, ybuf, out):  # pragma: no cover - compiled
    """``out = K^-1 rhs`` for the Laplacian K of the couplings w grounded at one column (0
    there; the last, for big = 3 the most coupled one), as ``_sinkhorn_numba._direction``: for
    big <= 3 by Cramer's rule (returns det K; out NaN where it is not positive), else by the
    Jacobi-equilibrated Cholesky: without jitter where it is well conditioned (returns 2),
    else with a relative jitter, retried once larger (returns the least squared pivot, in
    (0, 1]: refine; or 0 with out NaN). ``rhs`` holds every column (the ground's entry is not
    read)."""
    m1 = big - 1
    for j in range(big):
        out[j] = 0.0
    if big == 2:
        w01 = w[0, 1]
        out[0] = rhs[0] / w01 if w01 > 0 else math.nan
        return w01
    if big == 3:
        # grounded at the column of the largest coupling (any ground gives the same solution up
        # to a constant, which the callers' centring removes): grounded at a column coupled by
        # 1e-100, the other two would come out as 1e90 values whose difference is all that
        # matters, lost to the rounding of their right-hand side
        tot0 = w[0, 1] + w[0, 2]
        tot1 = w[0, 1] + w[1, 2]
        tot2 = w[0, 2] + w[1, 2]
        g = 2
        if tot0 > tot1 and tot0 > tot2:
            g = 0
        elif tot1 > tot2:
            g = 1
        a = 0 if g != 0 else 1
        b = 2 if g != 2 else 1
        wab = w[a, b]
        wag = w[a, g]
        wbg = w[b, g]
        det = wab * (wag + wbg) + wag * wbg
        if not det > 0:
            out[0] = math.nan
            out[1] = math.nan
            return det
        ra = rhs[a]
        rb = rhs[b]
        out[a] = (wab * (ra + rb) + wbg * ra) / det
        out[b] = (wab * (ra + rb) + wag * rb) / det
        out[g] = 0.0
        return det
    for j in range(m1):
        d = 0.0
        for col in range(big):
            if col != j:
                d += w[j, col]
        kmat[j, j] = d
        for col in range(m1):
            if col != j:
                kmat[j, col] = -w[j, col]
    for j in range(m1):
        d = kmat[j, j]
        scale[j] = 1.0 / math.sqrt(d) if d > 0 else 1.0
    # first without jitter: where the least squared pivot of the equilibrated factor is at
    # least 1e-2 the solve is as accurate as it gets (returns 2); else with a relative jitter
    # of a few units of rounding, retried once larger (returns the least squared pivot, in
    # (0, 1]: the caller refines)
    for attempt in range(3):
        tau = 0.0 if attempt == 0 else (16.0 * max(m1, 4) * _F64_EPS if attempt == 1 else 1e-10)
        ok = True
        least = 1.0
        for j in range(m1):
            for col in range(j + 1):
                acc = kmat[j, col] * scale[j] * scale[col] + (tau if j == col else 0.0)
                for s in range(col):
                    acc -= chol[j, s] * chol[col, s]
                if j == col:
                    if not acc > 0:
                        ok = False
                        break
                    chol[j, j] = math.sqrt(acc)
                    least = min(least, acc)
                else:
                    chol[j, col] = acc / chol[col, col]
            if not ok:
                break
        if ok and (attempt > 0 or least >= 1e-2):
            for j in range(m1):
                acc = rhs[j] * scale[j]
                for s in range(j):
                    acc -= chol[j, s] * ybuf[s]
                ybuf[j] = acc / chol[j, j]
            for j in range(m1 - 1, -1, -1):
                acc = ybuf[j]
                for s in range(j + 1, m1):
                    acc -= chol[s, j] * out[s]
                out[j] = acc / chol[j, j]
            for j in range(m1):
                out[j] *= scale[j]
            return 2.0 if attempt == 0 else least
    for j in range(m1):
        out[j] = math.nan
    return 0.0


def _nb_prepare(
    x,
    row,
    cand,
    m,
    tot,
    sign,
    top,
    k,
    big,
    inv_eps,
    regroup,
    yc,
    bmid,
    h,
    gs,
    hbuf,
    ibuf,
    e,
    ie,
    far,
    bref,
    bcol,
):  # pragma: no cover - compiled
    """The candidate problem of a row: the scores ``yc`` in the selection's orientation, the
    midpoints ``bmid`` of the top k+1, each candidate's home h (its hard rank), the masses
    (``bref``: b less the homes' count, for the gap), the centre c and the factors
    ``e = exp((c - y)/eps)``, ``ie = 1/e`` (``tot`` is scratch). The candidates are sorted by
    home, ``gs[t]`` the
    first of home t: with ``regroup`` ``cand[row, :m]`` is reordered so (a counting sort, which
    keeps the order within a home), else it is taken to be in that order already. Returns
    ``(c, fast)``: fast is False where some candidate is far from the centre (its factors would
    overflow: the row takes :func:`_nb_eval`)."""
    for t in range(big - 1):
        bmid[t] = 0.5 * top[row, t] + 0.5 * top[row, t + 1]
    for t in range(big + 1):
        gs[t] = 0
    last = bmid[big - 2] if big > 1 else math.inf
    for i in range(m):
        yi = sign * float(x[row, cand[row, i]])
        tot[i] = yi  # (scratch) the scores in the candidates' order
        if yi <= last:  # most candidates: on the rest (or the last target)
            hi = big - 1
        else:
            hi = 0
            while bmid[hi] > yi:
                hi += 1
        hbuf[i] = hi
        gs[hi + 1] += 1
    for t in range(big):
        gs[t + 1] += gs[t]
    if regroup:
        for t in range(big):
            bref[t] = gs[t]  # (scratch) the next place of home t
        for i in range(m):
            pos = int(bref[hbuf[i]])
            bref[hbuf[i]] += 1.0
            ibuf[pos] = cand[row, i]
            yc[pos] = tot[i]
        for i in range(m):
            cand[row, i] = ibuf[i]
    else:
        for i in range(m):
            yc[i] = tot[i]
    ymin = math.inf
    for t in range(big):
        for i in range(gs[t], gs[t + 1]):
            h[i] = t
    for i in range(m):
        ymin = min(ymin, yc[i])
    for t in range(big):
        bcol[t] = 1.0
    if big > k:
        bcol[k] = m - k
    for t in range(big):
        bref[t] = bcol[t] - (gs[t + 1] - gs[t])
    c = 0.5 * top[row, 0] + 0.5 * ymin
    zmax = 0.0
    for i in range(m):
        z = (c - yc[i]) * inv_eps
        e[i] = z
        zmax = max(zmax, abs(z))
    fast = zmax <= _FAR
    if fast:
        _nb_exp(e, e, hbuf, m)
        for i in range(m):
            ie[i] = 1.0 / e[i]
            far[i] = False
    else:
        for i in range(m):
            z = e[i]
            if abs(z) <= _FAR:
                ez = math.exp(z)
                e[i] = ez
                ie[i] = 1.0 / ez
                far[i] = False
            else:
                e[i] = 0.0
                ie[i] = 0.0
                far[i] = True
    return c, fast


def _nb_exp(z, out, bits, m):  # pragma: no cover - compiled
    """``out = exp(z)`` for ``|z| <= 700``, vectorised (numba's exp is a call per entry): Cody-Waite
    reduction ``z = n ln 2 + r``, the degree-13 Taylor polynomial of ``e^r`` (``|r| <= ln 2 / 2``),
    and ``2^n`` built in the exponent bits (``bits``: int64 scratch); within one unit of rounding
    of the exponential."""
    for i in range(m):
        zi = z[i]
        nf = math.floor(zi * 1.4426950408889634 + 0.5)
        r = (zi - nf * 6.93147180369123816490e-01) - nf * 1.90821492927058770002e-10
        q = 1.6059043836821613e-10
        q = q * r + 2.08767569878681e-09
        q = q * r + 2.505210838544172e-08
        q = q * r + 2.755731922398589e-07
        q = q * r + 2.7557319223985893e-06
        q = q * r + 2.48015873015873e-05
        q = q * r + 0.0001984126984126984
        q = q * r + 0.001388888888888889
        q = q * r + 0.008333333333333333
        q = q * r + 0.041666666666666664
        q = q * r + 0.16666666666666666
        q = q * r + 0.5
        q = q * r + 1.0
        q = q * r + 1.0
        out[i] = q
        bits[i] = (np.int64(nf) + 1023) << 52
    scale = bits[:m].view(np.float64)
    for i in range(m):
        out[i] *= scale[i]


def _nb_select_rows(
    x, eps, largest, k, tau, bpu, limit, span_max, weight, top, cut, count, flag
):  # pragma: no cover - compiled
    """Per row of x (B, n): its k+1 largest scores (k if k = n) in the orientation of
    ``largest`` into top (B, k+1), descending, and its candidate set (docs/math.md §2.4): the
    entries whose gap d below the (k+1)-th, in units of epsilon, falls in a histogram bin below
    ``cut`` (bins of 1/bpu, bin 0 for d <= 0; ``weight[b]`` bounds exp(-d) in bin b), the cut
    the least that keeps k times the bound of the dropped bins within tau; their number into
    count. flag 1: the row has an entry that is not finite or beyond ``limit``, or a span over
    epsilon beyond ``span_max`` (solved in full; cut and count 0)."""
    bsz, n = x.shape
    kk = top.shape[1]
    nb = weight.shape[0] - 1
    hist = np.zeros((4, nb + 1), dtype=np.int64)
    sign = 1.0 if largest else -1.0
    for row in range(bsz):
        for t in range(kk):
            top[row, t] = -math.inf
        low = -math.inf
        ymin = math.inf
        bad = False
        for i in range(n):
            yi = sign * float(x[row, i])
            if not abs(yi) <= limit:
                bad = True
            if yi < ymin:
                ymin = yi
            if yi > low:
                t = kk - 1
                while t > 0 and top[row, t - 1] < yi:
                    top[row, t] = top[row, t - 1]
                    t -= 1
                top[row, t] = yi
                low = top[row, kk - 1]
        inv_eps = 1.0 / eps[row]
        if not bad and not (top[row, 0] - ymin) * kk * inv_eps <= span_max:
            bad = True
        flag[row] = 1 if bad else 0
        if bad:
            cut[row] = 0
            count[row] = 0
            continue
        if k >= n:
            cut[row] = nb + 1
            count[row] = n
            continue
        yk = top[row, k]
        for r in range(4):
            for b in range(nb + 1):
                hist[r, b] = 0
        nbf = float(nb)
        for i in range(n):
            t = (yk - sign * float(x[row, i])) * inv_eps * bpu
            b = int(min(max(math.ceil(t), 0.0), nbf))
            hist[i & 3, b] += 1
        # drop the bins from the farthest while k times their bound stays within tau
        acc = 0.0
        c = nb + 1
        while c > 1:
            cnt = hist[0, c - 1] + hist[1, c - 1] + hist[2, c - 1] + hist[3, c - 1]
            add = cnt * weight[c - 1]
            if k * (acc + add) > tau:
                break
            acc += add
            c -= 1
        total = 0
        for b in range(c):
            total += hist[0, b] + hist[1, b] + hist[2, b] + hist[3, b]
        cut[row] = c
        count[row] = total
    most = 0
    flagged = 0
    for row in range(bsz):
        most = max(most, count[row])
        flagged += flag[row]
    return most, flagged


def _nb_solve_rows(
    x,
    eps,
    largest,
    k,
    top,
    cut,
    count,
    flag,
    bpu,
    tol,
    max_steps,
    halvings,
    cand,
    w_out,
    v_out,
    vv,
    rr,
    cc,
    err_out,
    status,
):  # pragma: no cover - compiled
    """The candidate problem of every row that is not flagged: its candidates into cand
    (B, m_max); semi-dual Newton from one Sinkhorn update of v = 0 (full steps,
    halved while they do not lower ``sum_j |b_j - c_j|``), as ``_sinkhorn_numba``; the
    column-exact plan's weights into w_out (B, k, n) at the candidates (w_out is zero
    elsewhere), the values into v_out (B, k), the final states v and ratios ``(b - c)/c``
    (B, big) and the centre (B,) for the backward, the relative L1 row residual into err_out.
    status: 0 converged, 1 not (the caller solves the row another way), 2 flagged."""
    bsz, n = x.shape
    mcap = cand.shape[1]
    big = vv.shape[1]
    sign = 1.0 if largest else -1.0
    yc = np.empty(mcap)
    e = np.empty(mcap)
    ie = np.empty(mcap)
    far = np.empty(mcap, dtype=np.bool_)
    h = np.empty(mcap, dtype=np.int64)
    hbuf = np.empty(mcap, dtype=np.int64)
    ibuf = np.empty(mcap, dtype=np.int64)
    gs = np.empty(big + 1, dtype=np.int64)
    off = np.empty(mcap)
    tot = np.empty(mcap)
    p = np.empty((big, mcap))
    p_new = np.empty((big, mcap))
    q = np.empty(big)
    colsum = np.empty(big)
    offsum = np.empty(big)
    bmid = np.empty(big)
    rho = np.empty(big)
    irho = np.empty(big)
    bcol = np.empty(big)
    bref = np.empty(big + 1)
    gap = np.empty(big)
    gap_new = np.empty(big)
    v = np.empty(big)
    v_new = np.empty(big)
    delta = np.empty(big)
    w = np.empty((big, big))
    m1 = max(big - 1, 1)
    kmat = np.empty((m1, m1))
    chol = np.empty((m1, m1))
    scale = np.empty(m1)
    ybuf = np.empty(m1)
    ones = np.empty(0)
    left = 0
    for row in range(bsz):
        if flag[row] != 0:
            status[row] = 2
            continue
        m = count[row]
        inv_eps = 1.0 / eps[row]
        if k >= n:
            for i in range(n):
                cand[row, i] = i
        else:
            # the bins below the cut: ceil(t) < cut, i.e. t <= cut - 1 (the selection's t);
            # appended without a branch (cand has one spare column)
            yk = top[row, k]
            lim = cut[row] - 1.0
            j = 0
            for i in range(n):
                t = (yk - sign * float(x[row, i])) * inv_eps * bpu
                cand[row, j] = i
                j += 1 if t <= lim and j < m else 0
        c, fast = _nb_prepare(
            x,
            row,
            cand,
            m,
            tot,
            sign,
            top,
            k,
            big,
            inv_eps,
            True,
            yc,
            bmid,
            h,
            gs,
            hbuf,
            ibuf,
            e,
            ie,
            far,
            bref,
            bcol,
        )
        # One evaluation site: phase 0 evaluates v = 0 (the hard assignment) for the start, one
        # Sinkhorn column update of it; phase 1 evaluates the start; phase 2 a Newton step,
        # halved while it does not lower sum_j |b_j - c_j|.
        for t in range(big):
            v_new[t] = 0.0
        tol_mass = tol * m
        steps = 0
        phase = 0
        step = 1.0
        tries = 0
        l1 = math.inf
        while True:
            l1_new = _nb_state(
                fast,
                yc,
                e,
                ie,
                far,
                h,
                gs,
                m,
                big,
                bmid,
                c,
                inv_eps,
                v_new,
                rho,
                irho,
                q,
                p_new,
                tot,
                off,
                colsum,
                offsum,
                bref,
                gap_new,
            )
            if phase == 0:
                for t in range(big):
                    col = 0.0
                    for i in range(m):
                        col += p_new[t, i]
                    v_new[t] = math.log(bcol[t]) - math.log(max(col, _F64_TINY))
                phase = 1
                continue
            if phase == 2 and not l1_new < l1:
                tries += 1
                if tries > halvings:
                    break  # no step lowers the bound: the row keeps its state
                step *= 0.5
                for t in range(big):
                    v_new[t] = v[t] + step * delta[t]
                continue
            p, p_new = p_new, p
            gap, gap_new = gap_new, gap
            v, v_new = v_new, v
            l1 = l1_new
            if not l1 > tol_mass or steps >= max_steps:
                break
            _nb_couplings(p, ones, False, m, big, w)
            ok = _nb_laplacian_solve(w, big, gap, kmat, chol, scale, ybuf, delta)
            steps += 1
            if not ok > 0:
                break
            phase = 2
            step = 1.0
            tries = 0
            for t in range(big):
                v_new[t] = v[t] + delta[t]
        for t in range(big):
            rr[row, t] = gap[t] / max(bcol[t] - gap[t], _F64_TINY)
            vv[row, t] = v[t]
        # the row residual of the column-exact plan, sum_i |sum_t P_ti r_t| / m
        for i in range(m):
            tot[i] = 0.0
        for t in range(big):
            rt = rr[row, t]
            pt = p[t]
            for i in range(m):
                tot[i] += pt[i] * rt
        err = 0.0
        for i in range(m):
            err += abs(tot[i])
        err /= m
        err_out[row] = err
        cc[row] = c
        status[row] = 0 if err <= tol else 1
        left += status[row]
        # the weights (scattered to the candidates) and the values (x = sign y)
        for t in range(k):
            f = 1.0 + rr[row, t]
            pt = p[t]
            acc = 0.0
            for i in range(m):
                wt = pt[i] * f
                pt[i] = wt
                acc += wt * yc[i]
            v_out[row, t] = sign * acc
            for i in range(m):
                w_out[row, t, cand[row, i]] = pt[i]
    return left


def _nb_centred(
    gam, inv_mu, gb, beta, sb, sg, home, m, big, out, ref, mean
):  # pragma: no cover - compiled
    """``u_ji - sum_l P_li u_li`` into out (big, m) for ``u_ji = sb beta_j + sg gb_ji`` and the
    row-normalised plan ``P = gam * inv_mu``, each entry first shifted by its value at its home
    (its largest P): without cancellation for nearly one-hot entries (``ref`` and ``mean`` are
    scratch (m,))."""
    for i in range(m):
        hi = home[i]
        ref[i] = sb * beta[hi] + sg * gb[hi, i]
        mean[i] = 0.0
    for j in range(big):
        bj = sb * beta[j]
        for i in range(m):
            d = (bj + sg * gb[j, i]) - ref[i]
            out[j, i] = d
            mean[i] += gam[j, i] * d
    for i in range(m):
        mean[i] *= inv_mu[i]
    for j in range(big):
        for i in range(m):
            out[j, i] -= mean[i]


def _nb_vjp_rows(
    x,
    eps,
    largest,
    k,
    top,
    cand,
    count,
    vv,
    rr,
    cc,
    status,
    gv,
    gw,
    need_eps,
    det_min,
    gx,
    geps,
    safe,
):  # pragma: no cover - compiled
    """The implicit VJP (docs/math.md §2.3) of every row solved by the kernel (status 0), for
    the cotangents gv (B, k) of the values and gw (B, k, n) of the weights (gw empty: none):
    the plan is recomputed from the saved states (the same arithmetic as the forward); the
    gradient in x at the candidates into gx (0 elsewhere: gx comes zeroed), in epsilon into
    geps where ``need_eps``. K is solved as ``_sinkhorn_numba.sorted_vjp_rows`` does (closed
    form for big <= 3, refined Cholesky above); safe[row] False where it is singular (the caller
    redoes the row)."""
    bsz = x.shape[0]
    mcap = cand.shape[1]
    big = vv.shape[1]
    sign = 1.0 if largest else -1.0
    has_gw = gw.shape[0] == bsz
    yc = np.empty(mcap)
    e = np.empty(mcap)
    ie = np.empty(mcap)
    far = np.empty(mcap, dtype=np.bool_)
    h = np.empty(mcap, dtype=np.int64)
    hbuf = np.empty(mcap, dtype=np.int64)
    ibuf = np.empty(mcap, dtype=np.int64)
    gs = np.empty(big + 1, dtype=np.int64)
    off = np.empty(mcap)
    home = np.empty(mcap, dtype=np.int64)
    tot = np.empty(mcap)
    p = np.empty((big, mcap))
    gb = np.empty((big, mcap))
    cen = np.empty((big, mcap))
    mu = np.empty(mcap)
    inv_mu = np.empty(mcap)
    best = np.empty(mcap)
    xc = np.empty(mcap)
    ref = np.empty(mcap)
    mean = np.empty(mcap)
    acc_y = np.empty(mcap)
    direct = np.empty(mcap)
    q = np.empty(big)
    colsum = np.empty(big)
    offsum = np.empty(big)
    bmid = np.empty(big)
    rho = np.empty(big)
    irho = np.empty(big)
    bcol = np.empty(big)
    bref = np.empty(big + 1)
    gap = np.empty(big)
    v = np.empty(big)
    rhs = np.empty(big)
    beta = np.empty(big)
    stepv = np.empty(big)
    w = np.empty((big, big))
    m1 = max(big - 1, 1)
    kmat = np.empty((m1, m1))
    chol = np.empty((m1, m1))
    scale = np.empty(m1)
    ybuf = np.empty(m1)
    for row in range(bsz):
        if status[row] != 0:
            continue
        m = count[row]
        inv_eps = 1.0 / eps[row]
        _, fast = _nb_prepare(
            x,
            row,
            cand,
            m,
            tot,
            sign,
            top,
            k,
            big,
            inv_eps,
            False,
            yc,
            bmid,
            h,
            gs,
            hbuf,
            ibuf,
            e,
            ie,
            far,
            bref,
            bcol,
        )
        c = cc[row]
        for t in range(big):
            v[t] = vv[row, t]
        _nb_state(
            fast,
            yc,
            e,
            ie,
            far,
            h,
            gs,
            m,
            big,
            bmid,
            c,
            inv_eps,
            v,
            rho,
            irho,
            q,
            p,
            tot,
            off,
            colsum,
            offsum,
            bref,
            gap,
        )
        # the column-exact plan gam (in place of p), its row sums mu and each entry's largest
        # column (home: the centring's reference); loops over the targets, each over the
        # entries (vectorised); the row-normalised plan is gam / mu, formed where it is used
        gam = p
        for i in range(m):
            mu[i] = 0.0
            xc[i] = float(x[row, cand[row, i]])
        for t in range(big):
            f = 1.0 + rr[row, t]
            for i in range(m):
                g = gam[t, i] * f
                gam[t, i] = g
                mu[i] += g
        for i in range(m):
            inv_mu[i] = 1.0 / max(mu[i], _F64_TINY)
            home[i] = 0
            best[i] = -1.0
        for t in range(big):
            for i in range(m):
                if gam[t, i] > best[i]:
                    best[i] = gam[t, i]
                    home[i] = t
        # the cotangent of the plan: gv_t x_i (values) and gw[t, i] (weights), rest 0
        for t in range(big):
            if t < k:
                gt = gv[row, t]
                for i in range(m):
                    gb[t, i] = gt * xc[i]
                if has_gw:
                    for i in range(m):
                        gb[t, i] += float(gw[row, t, cand[row, i]])
            else:
                for i in range(m):
                    gb[t, i] = 0.0
        for t in range(big):
            beta[t] = 0.0
        _nb_centred(gam, inv_mu, gb, beta, 0.0, 1.0, home, m, big, cen, ref, mean)
        for t in range(big):
            acc = 0.0
            for i in range(m):
                acc += gam[t, i] * cen[t, i]
            rhs[t] = acc
        _nb_couplings(gam, inv_mu, True, m, big, w)
        det = _nb_laplacian_solve(w, big, rhs, kmat, chol, scale, ybuf, beta)
        # one refinement against the exactly formed residual where the solve took the jitter
        if big > 3 and 0 < det <= 1.0:
            _nb_centred(gam, inv_mu, gb, beta, -1.0, 1.0, home, m, big, cen, ref, mean)
            for t in range(big):
                acc = 0.0
                for i in range(m):
                    acc += gam[t, i] * cen[t, i]
                rhs[t] = acc
            _nb_laplacian_solve(w, big, rhs, kmat, chol, scale, ybuf, stepv)
            for t in range(big):
                beta[t] += stepv[t]
        ok = det > det_min if big <= 3 else det > 0
        for t in range(big):
            ok = ok and math.isfinite(beta[t])
        safe[row] = ok
        if not ok:
            continue
        _nb_centred(gam, inv_mu, gb, beta, 1.0, -1.0, home, m, big, cen, ref, mean)
        # d values / d y through the plan (slopes t / eps) and directly (the weights)
        for i in range(m):
            acc_y[i] = 0.0
            direct[i] = 0.0
        for t in range(big):
            ft = float(t)
            gt = gv[row, t] if t < k else 0.0
            for i in range(m):
                g = gam[t, i]
                acc_y[i] += ft * g * cen[t, i]
                direct[i] += g * gt
        g_e = 0.0
        for i in range(m):
            gy = acc_y[i] * inv_eps
            g_e += (yc[i] - c) * gy
            gx[row, cand[row, i]] = sign * gy + direct[i]
        geps[row] = -g_e * inv_eps if need_eps else 0.0
    unsafe = 0
    for row in range(bsz):
        unsafe += 0 if safe[row] else 1
    return unsafe


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
