r"""Sorted SOFT top-k: the k largest (or smallest) entries, in order, by entropic optimal transport.

Xie et al., *Differentiable Top-k Operator with Optimal Transport*, NeurIPS 2020 (arXiv
2002.06504), the sorted variant with k+1 targets; derivations in docs/math.md §2. Deviations from
the paper: ``largest=True`` (the default, as :func:`torch.topk`) applies its operator to ``-x``;
epsilon is in the units of x (``eps_p = 2 epsilon``, never normalised by a batch-wide max); the
cost ``(x_i - j)^2`` is solved as ``-2 j x_i + kappa_j`` with column constants centring it at
the sorted scores' midpoints (the potentials stay O(1)); infinities are solved structurally
(§2.2); long rows on a candidate set with a stated tolerance (§2.4), tested against the full
solve (``_soft_topk(..., reduce=False)``).

Paths (:func:`_path`): the C++ kernel (:class:`_KernelSolve` over ``softops::sorted_topk_solve``
and ``softops::sorted_topk_vjp`` of ``_sorted_kernel.cpp``), the torch solve of the candidate set
(:func:`_torch_solve`, other devices and forward mode), or the full solve (:func:`_full`, whose
Newton-first forward is ``_newton.py``, with :class:`_SortedPlan`).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd import forward_ad

from softops._core.convergence import SINKHORN_MAX_ITER, default_tol, warn_not_converged
from softops._core.dims import prepare_rows
from softops._core.sinkhorn import DET_MIN, implicit_cost_vjp
from softops._core.transforms import apply_function, cannot_branch, own_precision, vmap_rows
from softops._core.validation import check_bool, check_k, check_max_iter, check_tol
from softops._kernels import Kernel, define, kernels_enabled
from softops.topk._newton import NEWTON_FIRST_OP, NEWTON_KERNEL, newton_first, use_kernel

__all__ = ["TopK", "soft_topk"]

_OP = "soft_topk"
F64 = torch.float64


class TopK(NamedTuple):
    """Result of :func:`soft_topk`.

    Attributes:
        values: soft top-k values, x.shape with ``dim`` replaced by k, in ``torch.topk`` order.
        weights: ``values.shape + (n,)``; ``weights[..., j, :]`` is the relaxed one-hot of the
            j-th selected entry (non-negative, sums to 1 over the last axis).
        indices: the indices of the k largest (smallest) entries along ``dim``, in order: those
            of ``torch.topk(x, k, dim, largest)``, equal entries in the order of x (the lower
            index first; torch.topk leaves their order unspecified). int64, no gradient.
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
    As epsilon -> 0 the weights tend to ``one_hot(torch.topk(x, k, dim, largest).indices)``
    (for distinct values).

    **Candidate set** (docs/math.md §2.4): each row is solved on the entries near enough to the
    top that dropping the others moves no weight by more than 1e-7 (float32) or 1e-14 (float64);
    the others get weight and gradient 0. Rows with an infinity or a NaN, ``tol=0``, and calls
    under ``torch.func``, on meta tensors or while tracing solve the full row.

    The forward is semi-dual Newton in float64 from one Sinkhorn update (on the CPU for k <= 32
    in a C++ kernel built by ``python -m softops._kernels``, else in torch); the backward is
    implicit, a k x k SPD Schur-complement solve in float64, O(n k) memory.

    Args:
        x: scores, any shape, floating dtype (float16 and bfloat16 are computed in float32).
        k: an int in [1, n]; ``k = n`` drops the rest target (a soft sort of the row).
        dim: the dimension to select along.
        largest: select the largest (largest first) or the smallest (smallest first).
        epsilon: in x's units (the paper's entropic weight is ``2 * epsilon``), a float or a
            tensor broadcastable to the batch shape, which receives a gradient. Scaling law: the
            values scale with x (``c > 0``), the weights are unchanged.
        max_iter: Sinkhorn iteration cap; None: 2000 (plus at most 30 Newton steps).
        tol: relative L1 marginal tolerance; None: 1e-6 (float32) / 1e-9 (float64). ``tol=0``
            runs exactly ``max_iter`` plain Sinkhorn iterations.

    Returns:
        A :class:`TopK` ``(values, weights, indices)``; a row that does not reach ``tol`` warns.

    Shape:
        - x: ``(*, n, *)`` with n at ``dim``.
        - values, indices: x.shape with ``dim`` replaced by k; weights: ``values.shape + (n,)``.

    Infinities: entries that can never be selected get weight 0, those of the opposite infinity
    are always selected; a row with fewer than k selectable entries, or a NaN, is NaN.

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
    """:func:`soft_topk`; ``reduce=False`` solves every row in full (the candidate set's reference),
    ``kernel=False`` keeps off the C++ kernel."""
    check_bool(largest, _OP, "largest")
    rows = prepare_rows(_OP, x, dim, epsilon)
    n, x2, eps, restore = rows.n, rows.x2, rows.eps, rows.restore  # x2 (B, n), eps (B,)
    k = int(check_k(k, n, _OP, low=1, integer=True))
    cd = x2.dtype
    max_iter = check_max_iter(max_iter, SINKHORN_MAX_ITER, _OP)
    tol = check_tol(tol, default_tol(cd), _OP)

    tensor_eps = isinstance(epsilon, Tensor)
    path = _path(x2, k, n, tol, reduce, kernel)
    if path == "kernel":  # (the kernel finds the indices with the k + 1 largest scores)
        weights, values, converged, residual, clean, indices = _kernel_solve(
            x2, eps, k, largest, max_iter, tol, tensor_eps
        )
    else:
        indices = topk_indices(x2.detach(), k, largest)
        solve = _torch_solve if path == "torch" else _full
        weights, values, converged, residual, clean = solve(
            x2, eps, k, largest, max_iter, tol, tensor_eps
        )

    # (clean: every row converged, read on the host; while traced the solve's operator warned)
    if not clean and not torch.compiler.is_compiling():
        warn_not_converged(_OP, converged, max_iter, residual=residual, tol=tol)

    values = restore(values.to(x.dtype))
    weights = restore(weights.to(x.dtype))
    return TopK(values, weights, restore(indices))


def topk_indices(x2: Tensor, k: int, largest: bool) -> Tensor:
    """The indices (B, k) int64 of the k largest (smallest) entries of each row of x2 (B, n), in
    order, equal entries in the order of the row (NaN above every number, as in torch.topk):
    torch.topk's, with the rows where equal entries meet the top k sorted stably."""
    top = torch.topk(x2, k, dim=-1, largest=largest, sorted=True)
    if cannot_branch(x2):  # no values to branch on: every row sorted
        return torch.sort(x2, dim=-1, descending=largest, stable=True).indices[:, :k]
    vals = top.values
    last = vals[:, -1:]
    # ties within the top k, an entry equal to the k-th left out, or a NaN (not equal to itself)
    tied = (vals[:, 1:] == vals[:, :-1]).any(-1) | ((x2 == last).sum(-1) > (vals == last).sum(-1))
    tied |= torch.isnan(vals).any(-1)
    if not bool(tied.any()):
        return top.indices
    rows = tied.nonzero().squeeze(1)
    stable = torch.sort(x2[rows], dim=-1, descending=largest, stable=True).indices[:, :k]
    return top.indices.index_put((rows,), stable)


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
    values (B, k), converged, residual, clean)`` in x2's dtype. ``log_a``, ``log_b``: other
    masses (the candidate set's); ``finite``: x2 is known to need no range or infinity handling."""
    bsz, n = x2.shape
    cd = x2.dtype
    m = k + 1 if k < n else k
    # One host read: only rows with an infinity or an entry near finfo.max exceed the limit.
    # With no value to branch on, every row takes the infinity path (a no-op on a finite row).
    no_values = cannot_branch(x2)
    limit = torch.finfo(cd).max / (64 * m)
    unusual = not finite and (no_values or bool((x2.detach().abs() > limit).any()))
    has_inf = unusual and (no_values or bool(torch.isinf(x2.detach()).any()))

    # The paper selects the smallest s; the solve is in float64. ``neg``: s = -x2 is folded into
    # the cost's slopes and column constants instead of formed.
    f64 = torch.float64
    neg = largest and not unusual
    s = -x2 if largest and unusual else x2
    if log_a is None or log_b is None:
        log_a = torch.full((bsz, n), -math.log(n), dtype=f64, device=x2.device)
        log_nu = [-math.log(n)] * k + ([math.log((n - k) / n)] if k < n else [])
        log_b = torch.tensor(log_nu, dtype=f64, device=x2.device).expand(bsz, m)
    if has_inf:
        # Infinities by structure (docs/math.md §2.2): the finite entries are solved, the first
        # c = min(#(-inf), k) targets empty. NaN rows, rows with fewer than k selectable entries
        # and rows with no finite entry solve a stand-in (zeros) whose plan is discarded.
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
    # Rows near finfo.max are solved at (c s, c eps), c a power of two (docs/math.md §2.2).
    if unusual:
        with torch.no_grad():
            mag = s.detach().abs().amax(-1)
            exponent = torch.frexp(torch.nan_to_num(mag, nan=0.0) / limit).exponent.clamp(min=0)
            scale = torch.ldexp(torch.ones_like(mag), -exponent)
        s = s * scale[:, None]
        eps = eps * scale

    eps_eff, scaled = _scaled_cost(s, eps, k, neg, cd)
    weights, _, converged, residual, clean = apply_function(
        _SortedPlanTraced if torch.compiler.is_compiling() else _SortedPlan,
        *(s, eps_eff, scaled, log_a, log_b, neg, k, max_iter, tol, tensor_eps),
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


def _scaled_cost(
    s: Tensor, eps: Tensor, k: int, neg: bool, cd: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The effective epsilon (B,) float64 and the cost in its units ``scaled`` (B, m, n), a
    constant, of the scores s (B, n): centred at the midpoints and shifted to each entry's home
    column, as two one-signed partial sums (docs/math.md §2.2). ``cd``: the compute dtype."""
    n = s.shape[1]
    m = k + 1 if k < n else k
    f64 = torch.float64
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
        # far below the gaps every entry is decided: floor epsilon so cost / epsilon stays in range
        floor = accurate.amax(dim=(1, 2)) / (torch.finfo(cd).max / 16)
    eps_eff = torch.maximum(eps.to(f64), floor)
    with torch.no_grad():  # the cost in units of epsilon (its gradients are _SortedPlan's)
        scaled = accurate / eps_eff.detach()[:, None, None]
    return eps_eff, scaled


# --------------------------------------------------------------------------- the candidate set

_TAU_64 = 1e-14
"""Tolerance of the candidate set on the weights in float64 (absolute; a weight is at most 1)."""
_TAU_32 = 1e-7
"""The same for float32 (and float16/bfloat16, which are computed in float32)."""
_BINS_PER_UNIT = 4.0
"""Resolution of the histogram of the gaps below the (k+1)-th score, in bins per epsilon."""
_KERNEL_MAX_K = 32
"""Largest k the kernel solves (larger k: the candidate set in torch, the torch solve)."""
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


@functools.lru_cache(maxsize=64)
def _bins(n: int, k: int, tau: float) -> tuple[int, tuple[float, ...]]:
    """``(nb, weight)``: the histogram bins of the gaps d below the (k+1)-th score, in epsilon
    (bin 0: d <= 0, bin b: ``(b-1)/bpu < d <= b/bpu``, bin nb: the rest, never needed), and the
    bound ``weight[b]`` on an entry's weight on the first k targets in each, ``sum_{r=1..k}
    e^{-r d} = -expm1(-k d) / expm1(d)`` at the bin's least d (Lemma 2; at most 1, a row's mass).
    The last bin's bound is below ``1 / expm1(far) = tau / (2 n)``, whatever k."""
    far = math.log1p(2.0 * max(n, 2) / tau)
    nb = math.ceil(far * _BINS_PER_UNIT) + 2
    low = [(b - 1) / _BINS_PER_UNIT for b in range(1, nb + 1)]
    weight = (1.0, *(min(1.0, -math.expm1(-k * d) / math.expm1(d)) if d > 0 else 1.0 for d in low))
    return nb, weight


def _path(x2: Tensor, k: int, n: int, tol: float, reduce: bool, kernel: bool) -> str:
    """Which solve takes the rows: ``"kernel"`` (the C++ kernel, CPU, where built and enabled),
    ``"torch"`` (the candidate set in torch) or ``"full"`` (no candidate set: transforms, meta
    tensors, tracing, ``tol=0``, or nothing to drop)."""
    if not reduce or tol <= 0 or n == 1 or x2.shape[0] == 0 or cannot_branch(x2):
        return "full"
    if forward_ad._current_level >= 0:  # forward mode: the Functions with a jvp
        return "torch" if k < n else "full"
    if (
        kernel
        and k <= _KERNEL_MAX_K
        and x2.device.type == "cpu"
        and x2.dtype in _KERNEL_DTYPES
        and kernels_enabled()
        and KERNEL.ops() is not None
    ):
        return "kernel"
    return "torch" if k < n else "full"


def _select_rows(x2: Tensor, eps: Tensor, k: int, largest: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate set of every row (docs/math.md §2.4), in torch: ``(cand, count, bad)``,
    ``cand`` (B, m) the indices of the candidates of each row in its first ``count`` places,
    ``bad`` (B,) the rows with an entry that is not finite or near the largest finite value
    (solved in full). For k = n every entry is a candidate."""
    bsz, n = x2.shape
    f64 = torch.float64
    if k == n:
        bad = ~(x2.detach().abs() <= torch.finfo(x2.dtype).max / (64 * k)).all(-1)
        cand = torch.arange(n, device=x2.device).expand(bsz, n)
        return cand, torch.full((bsz,), n, device=x2.device), bad
    tau = _candidate_tolerance(x2.dtype)
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
    # tail[c] = the bound of the bins >= c; the cut is the least c >= 1 with tail <= tau
    tail = bound.flip(1).cumsum(1).flip(1)
    ok = tail[:, 1:] <= tau  # cut c = 1..nb
    cut = torch.where(ok.any(1), ok.long().argmax(1) + 1, nb + 1)
    cut = torch.where(ok[:, -1], cut, nb + 1)
    inside = b < cut[:, None]
    count = inside.sum(-1)
    m = int(count.max()) if bsz else 0
    key = torch.where(inside, y, -math.inf)  # the candidates first, then padding
    cand = torch.topk(key, max(m, 1), dim=-1, sorted=True).indices
    return cand, count, bad


def _candidate_problem(
    x2: Tensor, cand: Tensor, count: Tensor, k: int, largest: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The candidates' problem: ``(xr (B, mm), log_a, log_b, valid (B, mm))`` (padding: no mass)."""
    bsz = x2.shape[0]
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
    first = torch.full((bsz, k), -math.log(mm), dtype=f64, device=x2.device)
    if k < mm:
        rest = torch.log((count - k).to(f64) / mm)
        log_b = torch.cat((first, rest[:, None]), 1)
    else:  # k = n: no rest target (as in the full solve)
        log_b = first
    return xr, log_a, log_b, valid


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
    """The candidate-set problem of every row solved by :func:`_full` (differentiable), the
    weights scattered back to (B, k, n) (0 off the candidates)."""
    bsz, n = x2.shape
    mm = cand.shape[1]
    xr, log_a, log_b, _ = _candidate_problem(x2, cand, count, k, largest)
    wr, values, converged, residual, clean = _full(
        xr, eps, k, largest, max_iter, tol, tensor_eps, log_a, log_b, finite=True
    )
    index = cand.unsqueeze(1).expand(bsz, k, mm)
    weights = x2.new_zeros((bsz, k, n)).scatter_add(2, index, wr.to(x2.dtype))
    return weights, values, converged, residual, clean


def _torch_solve(
    x2: Tensor, eps: Tensor, k: int, largest: bool, max_iter: int, tol: float, tensor_eps: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """The candidate-set solve in torch (:func:`_select_rows`, :func:`_reduced_reference`);
    rows with an infinity, a NaN or an entry near the largest finite value are solved in full."""
    cand, count, bad = _select_rows(x2, eps, k, largest)
    if bool(bad.all()):
        return _full(x2, eps, k, largest, max_iter, tol, tensor_eps)
    good = (~bad).nonzero().squeeze(1)
    weights, values, converged, residual, clean = _reduced_reference(
        x2[good], eps[good], cand[good], count[good], k, largest, max_iter, tol, tensor_eps
    )
    if good.numel() == x2.shape[0]:
        return weights, values, converged, residual, clean
    part = (weights, values, converged, residual, clean)
    return _merge_full_rows(part, good, bad, x2, eps, k, largest, max_iter, tol, tensor_eps)


def _merge_full_rows(
    part: tuple[Tensor, Tensor, Tensor, Tensor, bool],
    good: Tensor | None,
    bad: Tensor,
    x2: Tensor,
    eps: Tensor,
    *settings: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """``part`` (the rows ``good``; None: every row) with the rows ``bad`` solved by :func:`_full`
    (``settings``: its k, largest, max_iter, tol and tensor_eps) merged in (differentiable)."""
    bsz, n = x2.shape
    k = settings[0]
    rows = bad.nonzero().squeeze(1)
    wb, vb, cb, rb, clean_b = _full(x2[rows], eps[rows], *settings)
    w, v, c, r, clean = part
    if good is not None:
        w = w.new_zeros((bsz, k, n)).index_put((good,), w)
        v = v.new_zeros((bsz, k)).index_put((good,), v)
        c = c.new_zeros(bsz).index_put((good,), c)
        r = r.new_zeros(bsz).index_put((good,), r)
    weights = w.index_put((rows,), wb.to(w.dtype))
    values = v.index_put((rows,), vb.to(v.dtype))
    converged = c.index_put((rows,), cb.to(c.dtype))
    residual = r.index_put((rows,), rb.to(r.dtype))
    return weights, values, converged, residual, clean and clean_b


KERNEL = Kernel("softops_sorted", Path(__file__).with_name("_sorted_kernel.cpp"))
"""The CPU row kernels of the candidate-set solve and its backward."""

_KERNEL_DTYPES = (torch.float32, torch.float64)


def _state_width(k: int, n: int) -> int:
    """Columns of the kernel's per-row state (three per target, four more)."""
    big = k + 1 if k < n else k
    return 3 * big + 4


def _candidate_rows(
    x2: Tensor, eps: Tensor, k: int, largest: bool, max_iter: int, tol: float, tensor_eps: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate-set solve of finite rows in torch, differentiable: ``(weights (B, k, n),
    values (B, k), residual (B,))``."""
    cand, count, _ = _select_rows(x2, eps, k, largest)
    w, v, _, res, _ = _reduced_reference(
        x2, eps, cand, count, k, largest, max_iter, tol, tensor_eps
    )
    return w, v, res.to(torch.float64)


def _solve_reference(
    x: Tensor, eps: Tensor, k: int, largest: bool, max_iter: int, tol: float
) -> tuple[Tensor, ...]:
    """The operator ``sorted_topk_solve`` in torch (status 1 or 2; no kernel state)."""
    bsz, n = x.shape
    f64 = torch.float64
    x, eps = x.detach(), eps.detach()
    bad = _select_rows(x, eps, k, largest)[2]
    weights, values = x.new_zeros((bsz, k, n)), x.new_zeros((bsz, k))
    err = torch.full((bsz,), math.inf, dtype=f64, device=x.device)
    status = torch.where(bad, 2, 1).to(torch.int8)
    state = torch.zeros((bsz, _state_width(k, n)), dtype=f64, device=x.device)
    good = (~bad).nonzero().squeeze(1)
    _solve_rows_torch((weights, values, err), good, x, eps, k, largest, max_iter, tol, False)
    return weights, values, err, status, state, topk_indices(x, k, largest)


def _solve_rows_torch(
    out: tuple[Tensor, Tensor, Tensor], rows: Tensor, x: Tensor, eps: Tensor, *settings: Any
) -> None:
    """Sets the rows ``rows`` of the solve's weights, values and residual by :func:`_candidate_rows`
    (``settings``: its k, largest, max_iter, tol and tensor_eps)."""
    if rows.numel():
        with torch.no_grad():
            w, v, res = _candidate_rows(x[rows], eps[rows], *settings)
        out[0][rows], out[1][rows], out[2][rows] = w, v.to(out[1].dtype), res


def _solve_cpu(
    ops: Any, x: Tensor, eps: Tensor, k: int, largest: bool, max_iter: int, tol: float
) -> tuple[Tensor, ...]:
    """The operator ``sorted_topk_solve`` by the kernel; rows it leaves above ``tol`` in torch."""
    if x.dtype not in _KERNEL_DTYPES:
        return _solve_reference(x, eps, k, largest, max_iter, tol)
    bsz, n = x.shape
    tau = _candidate_tolerance(x.dtype)
    big = k + 1 if k < n else k
    top = torch.finfo(x.dtype).max
    weights, values, err, status, state, indices = ops.solve_rows(
        x.detach(),
        eps.detach(),
        largest,
        k,
        tau,
        _BINS_PER_UNIT,
        top / (64 * big),
        top / 64,
        _bin_weights(n, k, tau),
        float(tol),
        min(_KERNEL_STEPS, max_iter),
        _KERNEL_HALVINGS,
    )
    if bsz and int(status.max()) >= 1:
        left = (status == 1).nonzero().squeeze(1)
        x, eps = x.detach(), eps.detach()
        _solve_rows_torch((weights, values, err), left, x, eps, k, largest, max_iter, tol, False)
        bad = (status == 2).nonzero().squeeze(1)
        if bad.numel():  # (the kernel sets no indices there)
            indices[bad] = topk_indices(x[bad].detach(), k, largest)
    return weights, values, err, status, state, indices


def _solve_fake(
    x: Tensor, eps: Tensor, k: int, largest: bool, max_iter: int, tol: float
) -> tuple[Tensor, ...]:
    bsz, n = x.shape
    f64 = torch.float64
    return (
        x.new_empty((bsz, k, n)),
        x.new_empty((bsz, k)),
        x.new_empty((bsz,), dtype=f64),
        x.new_empty((bsz,), dtype=torch.int8),
        x.new_empty((bsz, _state_width(k, n)), dtype=f64),
        x.new_empty((bsz, k), dtype=torch.int64),
    )


def _solve_vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    return vmap_rows(SOLVE_OP, info, in_dims, *args)


SOLVE_OP = define(
    "softops::sorted_topk_solve",
    "(Tensor x, Tensor eps, int k, bool largest, int max_iter, float tol)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    reference=_solve_reference,
    fake=_solve_fake,
    vmap=_solve_vmap,
    cpu=_solve_cpu,
    kernel=KERNEL,
)
"""The candidate-set solve of rows (x (B, n), eps (B,), k, largest, max_iter, tol) -> (weights
(B, k, n), values (B, k), residual (B,) float64, status (B,) int8 (0: by the kernel, 1: in torch,
2: left to the caller, zeros), the kernel's state for the backward, indices (B, k) int64). Not
differentiable (:class:`_KernelSolve` carries the gradient)."""


def _candidate_vjp(
    x2: Tensor,
    eps: Tensor,
    gv: Tensor | None,
    gw: Tensor | None,
    k: int,
    largest: bool,
    max_iter: int,
    tol: float,
    need_eps: bool,
) -> tuple[Tensor, Tensor]:
    """The VJP of :func:`_candidate_rows` for the cotangents gv (B, k) and gw (B, k, n), formed
    without autograd: ``(gx (B, n) in x2's dtype, geps (B,) float64, 0 unless need_eps)``."""
    bsz, n = x2.shape
    f64 = torch.float64
    with torch.no_grad():
        x2, eps = x2.detach(), eps.detach()
        cand, count, _ = _select_rows(x2, eps, k, largest)
        xr, log_a, log_b, valid = _candidate_problem(x2, cand, count, k, largest)
        mm = xr.shape[1]
        eps_eff, scaled = _scaled_cost(xr, eps, k, largest, x2.dtype)
        weights, plan = _SortedPlan.forward(
            xr, eps_eff, scaled, log_a, log_b, largest, k, max_iter, tol, need_eps
        )[:2]
        # the cotangent of the weights (B, k, mm): gw at the candidates and gv x (values = W x)
        g_w = torch.zeros((bsz, k, mm), dtype=f64, device=x2.device)
        if gw is not None:
            g_w += gw.gather(2, cand.unsqueeze(1).expand(bsz, k, mm)).to(f64)
        if gv is not None:
            g_w += gv.to(f64).unsqueeze(-1) * xr.to(f64).unsqueeze(1)
        grad_s, grad_eps = _torch_vjp(plan, g_w, None, eps_eff, scaled, xr, largest, need_eps)
        if gv is not None:  # the values' direct term, W^T gv
            grad_s = grad_s + (weights.to(f64) * gv.to(f64).unsqueeze(-1)).sum(1)
        grad_s = torch.where(valid, grad_s, 0.0)
        gx = torch.zeros((bsz, n), dtype=f64, device=x2.device).scatter_add(1, cand, grad_s)
        geps = torch.zeros(bsz, dtype=f64, device=x2.device)
        if need_eps and grad_eps is not None:  # eps_eff = max(eps, a floor)
            geps = torch.where(eps_eff == eps.to(f64), grad_eps, 0.0)
    return gx.to(x2.dtype), geps


def _vjp_rows_torch(
    gx: Tensor,
    geps: Tensor,
    rows: Tensor,
    x: Tensor,
    eps: Tensor,
    gv: Tensor | None,
    gw: Tensor | None,
    *settings: Any,
) -> tuple[Tensor, Tensor]:
    """``(gx, geps)`` with the rows ``rows`` set by :func:`_candidate_vjp` (``settings``: its k,
    largest, max_iter, tol and need_eps)."""
    if rows.numel():
        gv, gw = (None if g is None else g[rows] for g in (gv, gw))
        gx[rows], geps[rows] = _candidate_vjp(x[rows], eps[rows], gv, gw, *settings)
    return gx, geps


def _vjp_reference(
    x: Tensor,
    eps: Tensor,
    state: Tensor,
    status: Tensor,
    gv: Tensor | None,
    gw: Tensor | None,
    k: int,
    largest: bool,
    max_iter: int,
    tol: float,
    need_eps: bool,
) -> tuple[Tensor, Tensor]:
    """The operator ``sorted_topk_vjp`` in torch (:func:`_candidate_vjp`; 0 in rows of status 2)."""
    gx, geps = x.new_zeros(x.shape), torch.zeros(x.shape[0], dtype=F64, device=x.device)
    rows = (status != 2).nonzero().squeeze(1)
    return _vjp_rows_torch(gx, geps, rows, x, eps, gv, gw, k, largest, max_iter, tol, need_eps)


def _vjp_cpu(
    ops: Any,
    x: Tensor,
    eps: Tensor,
    state: Tensor,
    status: Tensor,
    gv: Tensor | None,
    gw: Tensor | None,
    k: int,
    largest: bool,
    max_iter: int,
    tol: float,
    need_eps: bool,
) -> tuple[Tensor, Tensor]:
    """The operator ``sorted_topk_vjp`` by the kernel; status-1 and singular rows in torch."""
    if x.dtype not in _KERNEL_DTYPES:
        return _vjp_reference(x, eps, state, status, gv, gw, k, largest, max_iter, tol, need_eps)
    n = x.shape[1]
    empty = x.new_empty(0)
    gx, geps, safe = ops.vjp_rows(
        x.detach(),
        eps.detach(),
        largest,
        k,
        _BINS_PER_UNIT,
        _bins(n, k, _candidate_tolerance(x.dtype))[0],
        state,
        status,
        empty if gv is None else gv.detach(),
        empty if gw is None else gw.detach(),
        need_eps,
        DET_MIN,
    )
    if x.shape[0] and not bool(safe.all()):  # (safe is false in the rows of status 1 too)
        rows = (~safe).nonzero().squeeze(1)
        args = (k, largest, max_iter, tol, need_eps)
        gx, geps = _vjp_rows_torch(gx, geps, rows, x, eps, gv, gw, *args)
    return gx, geps


def _vjp_fake(x: Tensor, eps: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty((x.shape[0],), dtype=F64)


def _vjp_vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    return vmap_rows(VJP_OP, info, in_dims, *args)


VJP_OP = define(
    "softops::sorted_topk_vjp",
    "(Tensor x, Tensor eps, Tensor state, Tensor status, Tensor? gv, Tensor? gw, int k,"
    " bool largest, int max_iter, float tol, bool need_eps) -> (Tensor, Tensor)",
    reference=_vjp_reference,
    fake=_vjp_fake,
    vmap=_vjp_vmap,
    cpu=_vjp_cpu,
    kernel=KERNEL,
)
"""The implicit VJP of :data:`SOLVE_OP` for the cotangents gv (B, k), gw (B, k, n) (either None)
-> (the gradients in x (B, n) and epsilon (B,) float64, 0 in rows of status 2); not
differentiable."""


def _kernel_solve(
    x2: Tensor, eps: Tensor, k: int, largest: bool, max_iter: int, tol: float, tensor_eps: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool, Tensor]:
    """The solve by the kernel (:class:`_KernelSolve`), rows of status 2 in full; plus indices."""
    out = apply_function(_KernelSolve, x2, eps, k, largest, max_iter, tol)
    weights, values, err, status, indices = out[0], out[1], out[2], out[3], out[5]
    smax = int(status.max()) if x2.shape[0] else 0
    if smax == 0:  # every row solved by the kernel, within tol
        return weights, values, torch.ones_like(status, dtype=torch.bool), err, True, indices
    converged = err <= tol
    clean = bool(converged[status == 1].all())
    if smax == 2:
        part = (weights, values, converged, err, clean)
        merged = _merge_full_rows(
            part, None, status == 2, x2, eps, k, largest, max_iter, tol, tensor_eps
        )
        return (*merged, indices)
    return weights, values, converged, err, clean, indices


class _KernelSolve(torch.autograd.Function):
    """:data:`SOLVE_OP` with :data:`VJP_OP` as its backward; a backward with a graph (double
    backward) is autograd through the torch solve. Rows of status 2 are the caller's."""

    @staticmethod
    def forward(
        x2: Tensor, eps: Tensor, k: int, largest: bool, max_iter: int, tol: float
    ) -> tuple[Tensor, ...]:
        return SOLVE_OP(x2.detach(), eps.detach(), k, largest, max_iter, tol)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x2, eps, k, largest, max_iter, tol = inputs
        _, _, err, status, state, indices = output
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(err, status, state, indices)
        ctx.save_for_backward(x2, eps, state, status)
        ctx.settings = (k, largest, max_iter, tol)

    @staticmethod
    def backward(
        ctx: Any, grad_w: Tensor | None, grad_v: Tensor | None, *_: Any
    ) -> tuple[Tensor | None, ...]:
        nones = (None,) * 4
        x2, eps, state, status = ctx.saved_tensors
        need_x, need_eps = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_w is None and grad_v is None) or not (need_x or need_eps):
            return (None, None, *nones)
        if torch.is_grad_enabled():  # a differentiable backward: autograd through the torch solve
            rows = (status != 2).nonzero().squeeze(1)
            k, largest, max_iter, tol = ctx.settings
            with torch.enable_grad():
                w, v, _res = _candidate_rows(
                    x2[rows], eps[rows], k, largest, max_iter, tol, need_eps
                )
                pairs = [(o, g[rows]) for o, g in ((w, grad_w), (v, grad_v)) if g is not None]
                inputs = [t for t, need in ((x2, need_x), (eps, need_eps)) if need]
                outs, gouts = [o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs]
                grads = torch.autograd.grad(
                    outs, inputs, gouts, create_graph=True, allow_unused=True
                )
            found = zip(inputs, grads, strict=True)
            it = (torch.zeros_like(t) if g is None else g for t, g in found)
            return (next(it) if need_x else None, next(it) if need_eps else None, *nones)
        gx, geps = VJP_OP(
            x2.detach(), eps.detach(), state, status, grad_v, grad_w, *ctx.settings, bool(need_eps)
        )
        return (gx if need_x else None, geps.to(eps.dtype) if need_eps else None, *nones)


class _SortedPlan(torch.autograd.Function):
    """``(s, eps) -> (weights, plan, converged, residual, clean)``: the OT solve, differentiable
    in s and epsilon. The backward is one implicit VJP of the plan for the cost ``scaled`` (in
    units of epsilon) and two contractions of it; ``plan`` is an output for double backward."""

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
        problem = (scaled.transpose(1, 2), log_a, log_b, torch.ones_like(eps), max_iter, tol)
        if torch.compiler.is_compiling():
            # one operator, opaque to dynamo, that warns itself: nothing is read on the host
            out = NEWTON_FIRST_OP(*problem, False, _OP)
            plan, converged, residual, clean = out[0], out[3], out[4], False
        else:
            res, clean = newton_first(*problem, False)
            plan, converged, residual = res.plan, res.converged, res.residual  # plan (B, n, m)
        weights = (plan[:, :, :k] * plan.shape[1]).to(s.dtype).transpose(1, 2)
        return weights, plan, converged, residual, clean

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
        # operator sorted_plan_vjp (the C++ kernel; the rows it leaves, a singular system, in
        # torch); all others the torch code.
        if grad_plan is None and not torch.is_grad_enabled() and use_kernel(plan, n, m):
            assert grad_w is not None
            costs = scaled if need_eps else plan.new_empty((0, 1, 1))
            grad_s, g_eps = PLAN_VJP_OP(plan, grad_w, eps, costs, ctx.neg, bool(need_eps))
            grad_eps = g_eps if need_eps else None
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


class _SortedPlanTraced(_SortedPlan):
    """The same Function for traced code: torch 2.13's dynamo rejects a custom ``jvp``."""

    jvp = torch.autograd.Function.jvp  # type: ignore[assignment]

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_rows(_SortedPlanTraced, info, in_dims, *args)


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
    """The backward of :class:`_SortedPlan` in torch, differentiable: the gradients in s (B, n),
    float64, and, with ``need_eps``, in epsilon (B,)."""
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


def _plan_vjp_reference(
    plan: Tensor, grad_w: Tensor, eps: Tensor, scaled: Tensor, neg: bool, need_eps: bool
) -> tuple[Tensor, Tensor]:
    """The operator ``sorted_plan_vjp`` in torch (:func:`_torch_vjp`), grad_eps 0 unless
    ``need_eps``."""
    s = plan.new_zeros(plan.shape[:2])  # (its value does not enter: only its derivative does)
    grad_s, grad_eps = _torch_vjp(plan, grad_w, None, eps, scaled, s, neg, need_eps)
    if grad_eps is None:
        grad_eps = plan.new_zeros(plan.shape[0])
    return grad_s, grad_eps


def _plan_vjp_cpu(
    ops: Any, plan: Tensor, grad_w: Tensor, eps: Tensor, scaled: Tensor, neg: bool, need_eps: bool
) -> tuple[Tensor, Tensor]:
    """The operator ``sorted_plan_vjp`` by the row kernel; singular rows by the torch code."""
    bsz, n, m = plan.shape
    pm = plan.detach().transpose(1, 2)  # (B, m, n): the solver's buffer, no copy
    gm = pm.new_zeros((bsz, m, n))
    gm[:, : grad_w.shape[1]] = grad_w.detach() * n
    slopes = _slopes(m, neg, pm).squeeze(-1)
    costs = scaled.detach() if need_eps else pm.new_empty((0, 1, 1))
    grad_s, grad_eps, safe = ops.sorted_vjp_rows(pm, gm, costs, slopes, eps.detach(), DET_MIN)
    if bsz and not bool(safe.all()):
        rows = ~safe
        sub = _plan_vjp_reference(
            plan[rows], grad_w[rows], eps[rows], scaled[rows] if need_eps else scaled, neg, need_eps
        )
        grad_s[rows], grad_eps[rows] = sub[0], sub[1]
    return grad_s, grad_eps


def _plan_vjp_fake(
    plan: Tensor, grad_w: Tensor, eps: Tensor, scaled: Tensor, neg: bool, need_eps: bool
) -> tuple[Tensor, Tensor]:
    return plan.new_empty(plan.shape[:2]), plan.new_empty(plan.shape[:1])


PLAN_VJP_OP = define(
    "softops::sorted_plan_vjp",
    "(Tensor plan, Tensor grad_w, Tensor eps, Tensor scaled, bool neg, bool need_eps)"
    " -> (Tensor, Tensor)",
    reference=_plan_vjp_reference,
    fake=_plan_vjp_fake,
    cpu=_plan_vjp_cpu,
    kernel=NEWTON_KERNEL,
)
"""The backward of :class:`_SortedPlan` for a cotangent of its weights, not differentiated again:
(the gradients in the scores (B, n) and in epsilon (B,)), float64."""


def _slopes(m: int, neg: bool, like: Tensor) -> Tensor:
    """The cost's slopes in the scores, ``+-j`` for j = 0..m-1, as an (m, 1) column of ``like``'s
    dtype and device."""
    j = torch.arange(m, dtype=like.dtype, device=like.device)
    return (j if neg else -j).unsqueeze(-1)


def _finite_costs(scaled: Tensor) -> Tensor:
    """``scaled`` (B, m, n) as (B, n, m), its infinite entries (no mass: constants) set to 0."""
    return torch.where(torch.isinf(scaled), 0, scaled).transpose(1, 2)


def _values_with_infinities(weights: Tensor, x2: Tensor, largest: bool) -> Tensor:
    """``weights @ x`` for rows with infinities: the first c values are the c always-selected
    infinities, the others (zero weight) contribute 0, not NaN."""
    xd = x2.detach()
    finite_x = torch.where(torch.isinf(xd), 0.0, x2)
    with own_precision(x2):
        values = torch.bmm(weights, finite_x.unsqueeze(-1)).squeeze(-1)
    sure = math.inf if largest else -math.inf
    count = (xd == sure).sum(-1, keepdim=True)  # (B, 1)
    j = torch.arange(values.shape[-1], device=values.device)
    return torch.where(j < count, sure, values)
