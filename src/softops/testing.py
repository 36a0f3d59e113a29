r"""Testing utilities: the reference implementations and measurements that tests and
benchmarks share (as :mod:`torch.testing` is for torch).

The references solve entropic optimal transport between sources of masses :math:`a` and targets
of masses :math:`b`, one problem per batch row,

.. math::

    \Gamma^\star = \arg\min_{\Gamma \ge 0,\ \Gamma 1 = a,\ \Gamma^\top 1 = b}
    \langle C, \Gamma\rangle + \varepsilon \sum_{ij} \Gamma_{ij}(\log \Gamma_{ij} - 1),

by a fixed number of log-domain Sinkhorn iterations recorded by plain autograd: gradients exact
for the returned iterate, memory growing with the iterations. The library's implicit backwards
are checked against them. The entropy weight of the top-k problems is twice the library's
``epsilon`` (Xie et al. 2020); the masses of the sources are 1/n.

:func:`count_saved_bytes` counts the memory a forward saves for its backward; :func:`backend`
runs a block on the compiled kernels or on the torch reference (:func:`kernels_enabled`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from softops._core.sinkhorn import implicit_cost_vjp
from softops._kernels import backend, kernels_enabled

__all__ = [
    "SINKHORN_ITERS",
    "UnrolledSinkhorn",
    "backend",
    "count_saved_bytes",
    "kernels_enabled",
    "paper_sinkhorn_topk_mask",
    "unrolled_ot_sort",
    "unrolled_sinkhorn",
    "unrolled_sinkhorn_topk_mask",
    "unrolled_sorted_topk",
]

SINKHORN_ITERS = 200
"""The paper's fixed number of Sinkhorn iterations."""


class UnrolledSinkhorn(NamedTuple):
    """The state after the last iteration of :func:`unrolled_sinkhorn`.

    Attributes:
        plan: (..., n, m) transport plan; its columns are exact (the last update is g's).
        f: (..., n) source potentials.
        g: (..., m) target potentials.
    """

    plan: Tensor
    f: Tensor
    g: Tensor


def unrolled_sinkhorn(
    cost: Tensor,
    log_a: Tensor | float,
    log_b: Tensor | float,
    epsilon: Tensor | float,
    n_iter: int,
) -> UnrolledSinkhorn:
    r"""``n_iter`` log-domain Sinkhorn iterations from zero potentials, recorded by autograd.

    .. math::

        f \leftarrow \varepsilon \log a - \varepsilon \operatorname{LSE}_j((g - C)/\varepsilon),
        \quad
        g \leftarrow \varepsilon \log b - \varepsilon \operatorname{LSE}_i((f - C)/\varepsilon),
        \quad \Gamma = \exp((f + g - C)/\varepsilon).

    No convergence test; gradients flow to every tensor argument through every iteration.

    Args:
        cost: (..., n, m) cost matrices.
        log_a, log_b: log masses, broadcastable to (..., n) and (..., m) (floats when uniform).
        epsilon: the entropy weight in units of the cost: a float or a (...,) tensor.
        n_iter: the number of iterations (0 returns the plan of zero potentials).

    Returns:
        ``UnrolledSinkhorn(plan, f, g)``.

    Example:
        >>> import math, torch
        >>> from softops.testing import unrolled_sinkhorn
        >>> cost = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [4.0, 1.0]]], dtype=torch.float64)
        >>> log_b = torch.tensor([math.log(2 / 3), math.log(1 / 3)], dtype=torch.float64)
        >>> plan, f, g = unrolled_sinkhorn(cost, -math.log(3), log_b, 0.5, 300)
        >>> [round(v, 6) for v in plan.sum(-1)[0].tolist()]  # rows: a = 1/3 each
        [0.333333, 0.333333, 0.333333]
        >>> [round(v, 6) for v in plan.sum(-2)[0].tolist()]  # columns: b, exact
        [0.666667, 0.333333]
    """
    log_a = torch.as_tensor(log_a, dtype=cost.dtype, device=cost.device)
    log_b = torch.as_tensor(log_b, dtype=cost.dtype, device=cost.device)
    eps = torch.as_tensor(epsilon, dtype=cost.dtype, device=cost.device)
    e = eps.unsqueeze(-1) if eps.dim() else eps  # broadcasts against a potential
    e_cost = e.unsqueeze(-1) if eps.dim() else eps  # broadcasts against the cost
    f = cost.new_zeros(cost.shape[:-1])
    g = cost.new_zeros(cost.shape[:-2] + cost.shape[-1:])
    for _ in range(n_iter):
        f = e * log_a - e * torch.logsumexp((g.unsqueeze(-2) - cost) / e_cost, dim=-1)
        g = e * log_b - e * torch.logsumexp((f.unsqueeze(-1) - cost) / e_cost, dim=-2)
    plan = torch.exp((f.unsqueeze(-1) + g.unsqueeze(-2) - cost) / e_cost)
    return UnrolledSinkhorn(plan, f, g)


def _topk_mask_problem(x: Tensor, k: float) -> tuple[Tensor, float, Tensor]:
    """Cost (..., n, 2) and log masses of the top-k mask problem: targets (0, 1)."""
    n = x.shape[-1]
    y = torch.tensor([0.0, 1.0], dtype=x.dtype, device=x.device)
    log_b = torch.tensor([math.log((n - k) / n), math.log(k / n)], dtype=x.dtype, device=x.device)
    return (x.unsqueeze(-1) - y) ** 2, -math.log(n), log_b


def unrolled_sinkhorn_topk_mask(x: Tensor, k: float, epsilon: float, n_iter: int) -> Tensor:
    r"""SOFT top-k mask by :func:`unrolled_sinkhorn` on the n x 2 problem (plain autograd).

    Targets :math:`y = (0, 1)` of masses ((n-k)/n, k/n), cost :math:`C_{ij} = (x_i - y_j)^2`:
    the mask is :math:`A = n\,\Gamma_{:, 1}`, of the shape of ``x`` (..., n), summing to k.
    ``epsilon`` is the library's temperature, 0 < k < n.

    Example:
        >>> import torch, softops
        >>> from softops.testing import unrolled_sinkhorn_topk_mask
        >>> x = torch.tensor([[3.0, 1.0, 2.0, 0.0]], dtype=torch.float64)
        >>> mask = unrolled_sinkhorn_topk_mask(x, 2, 0.2, 1000)
        >>> mask.round(decimals=3)
        tensor([[0.9990, 0.0760, 0.9240, 0.0010]], dtype=torch.float64)
        >>> torch.allclose(mask, softops.soft_topk_mask(x, 2, epsilon=0.2))  # converged
        True
    """
    cost, log_a, log_b = _topk_mask_problem(x, k)
    plan = unrolled_sinkhorn(cost, log_a, log_b, 2.0 * epsilon, n_iter).plan
    return x.shape[-1] * plan[..., 1]


def unrolled_sorted_topk(
    x: Tensor,
    k: int,
    *,
    epsilon: float,
    n_iter: int = SINKHORN_ITERS,
    largest: bool = True,
) -> tuple[Tensor, Tensor]:
    r"""Sorted SOFT top-k by :func:`unrolled_sinkhorn` (plain autograd through every iteration).

    The reference of :func:`softops.soft_topk` (Xie et al. 2020, Sec. 3): scores ``x`` (B, n)
    go to targets :math:`y_j = j`, k of mass 1/n and a last ("the rest", dropped when k = n) of
    mass (n-k)/n, for the cost :math:`(s_i - y_j)^2`, :math:`s = -x` for the largest and
    :math:`s = x` for the smallest. Memory grows as O(B n k n_iter).

    Returns:
        ``(values, weights)``: values (B, k) in the order of ``torch.topk``, and weights
        (B, k, n), row j the relaxed one-hot ``n * Gamma[:, j]`` of the (j+1)-th selected entry.

    Example:
        >>> import torch, softops
        >>> from softops.testing import unrolled_sorted_topk
        >>> x = torch.tensor([[0.0, 3.0, 1.0, 2.0]], dtype=torch.float64)
        >>> values, weights = unrolled_sorted_topk(x, 2, epsilon=0.2, n_iter=1000)
        >>> values.round(decimals=3), weights.shape
        (tensor([[2.9270, 1.9990]], dtype=torch.float64), torch.Size([1, 2, 4]))
        >>> torch.allclose(weights, softops.soft_topk(x, 2, epsilon=0.2).weights)  # converged
        True
    """
    n = x.shape[-1]
    m = k + 1 if k < n else k
    s = -x if largest else x
    y = torch.arange(m, dtype=x.dtype, device=x.device)
    log_b = torch.full((m,), -math.log(n), dtype=x.dtype, device=x.device)
    if k < n:
        log_b[-1] = math.log((n - k) / n)
    cost = (s.unsqueeze(-1) - y) ** 2  # (B, n, m)
    plan = unrolled_sinkhorn(cost, -math.log(n), log_b, 2.0 * epsilon, n_iter).plan
    weights = (n * plan[..., :k]).transpose(-2, -1)  # (B, k, n)
    values = (weights @ x.unsqueeze(-1)).squeeze(-1)
    return values, weights


def unrolled_ot_sort(x: Tensor, epsilon: float, n_iter: int) -> tuple[Tensor, Tensor]:
    r"""Soft sort and soft ranks by optimal transport (Cuturi et al. 2019), unrolled.

    The problem of ``soft_sort(x, method="ot")`` and ``soft_rank(x, method="ot")``: the n
    entries of a row, mass 1/n each, are transported onto the row's own hard-sorted values
    :math:`y = \mathrm{sort}(x)` (ascending, mass 1/n each; differentiated, as the library does),
    for the cost :math:`C_{ij} = (x_i - y_j)^2` and entropy weight :math:`\varepsilon` (units of
    x²). With :math:`P = n \Gamma^\top`, the values are :math:`P x` and the 1-based ranks
    :math:`r_i = n \sum_j \Gamma_{ij}\, j`, each (B, n). Memory grows as O(B n² n_iter).

    Example:
        >>> import torch, softops
        >>> from softops.testing import unrolled_ot_sort
        >>> x = torch.tensor([[0.3, -1.0, 2.0, 0.5]], dtype=torch.float64)
        >>> values, ranks = unrolled_ot_sort(x, 0.5, 2000)
        >>> torch.allclose(values, softops.soft_sort(x, epsilon=0.5, method="ot"))
        True
        >>> torch.allclose(ranks, softops.soft_rank(x, epsilon=0.5, method="ot"))
        True
    """
    n = x.shape[-1]
    y = torch.sort(x, dim=-1).values
    cost = (x.unsqueeze(-1) - y.unsqueeze(-2)) ** 2  # (B, n sources, n targets)
    plan = unrolled_sinkhorn(cost, -math.log(n), -math.log(n), epsilon, n_iter).plan
    values = n * (plan.transpose(-2, -1) @ x.unsqueeze(-1)).squeeze(-1)
    positions = torch.arange(1, n + 1, dtype=x.dtype, device=x.device)
    ranks = n * (plan * positions).sum(-1)
    return values, ranks


class _PaperSinkhorn(torch.autograd.Function):
    """The official SOFT top-k as written: (B, n, 2) cost, logsumexp over the 2 targets, fixed
    iterations, implicit (KKT) backward (the library runs the m=2 update as one sigmoid)."""

    @staticmethod
    def forward(ctx: Any, cost: Tensor, log_b: Tensor, eps_p: float, n_iter: int) -> Tensor:
        plan = unrolled_sinkhorn(cost, -math.log(cost.shape[-2]), log_b, eps_p, n_iter).plan
        ctx.save_for_backward(plan)
        ctx.eps_p = eps_p
        return plan

    @staticmethod
    def backward(ctx: Any, grad_plan: Tensor) -> tuple[Tensor | None, ...]:
        (plan,) = ctx.saved_tensors
        eps = torch.full((plan.shape[0],), ctx.eps_p, dtype=plan.dtype, device=plan.device)
        return implicit_cost_vjp(plan, grad_plan, eps), None, None, None


def paper_sinkhorn_topk_mask(
    x: Tensor, k: float, *, epsilon: float, n_iter: int = SINKHORN_ITERS
) -> Tensor:
    """SOFT top-k mask by the paper's algorithm as the official code lays it out (a reference).

    The problem of :func:`unrolled_sinkhorn_topk_mask` on ``x`` (B, n), ``n_iter`` iterations
    without autograd, then the implicit backward of the plan (exact only at convergence).
    """
    cost, _, log_b = _topk_mask_problem(x, k)
    plan = _PaperSinkhorn.apply(cost, log_b, 2.0 * epsilon, n_iter)
    return x.shape[-1] * plan[..., 1]


def count_saved_bytes(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, int]:
    """Run ``fn(x)`` and count the bytes it saves for backward.

    Each distinct storage counts once, at its whole size (what stays alive); the storage of
    ``x`` is left out. Returns ``(fn(x), bytes)``.

    Example:
        >>> import torch
        >>> from softops.testing import count_saved_bytes
        >>> x = torch.randn(3, 5, requires_grad=True)
        >>> count_saved_bytes(torch.sin, x)[1]  # sin saves only its input
        0
        >>> count_saved_bytes(lambda t: (3 * t).exp(), x)[1]  # exp saves its output
        60
    """
    excluded = {_storage_key(x)}
    seen: dict[Any, int] = {}
    # Every packed tensor is held until the count ends: a temporary saved by a node the graph
    # later drops would otherwise free its storage, and a later save could reuse the address
    # and be taken for the same storage (a count that depends on the allocator's state).
    held: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        held.append(t)
        key = _storage_key(t)
        if key not in excluded:
            try:
                nbytes = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                nbytes = t.numel() * t.element_size()
            seen[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    held.clear()
    return out, sum(seen.values())


def _storage_key(t: Tensor) -> Any:
    """What identifies the storage of ``t``: its device and address (its ``id`` when empty)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        ptr = 0
    return (str(t.device), ptr) if ptr else ("id", id(t))  # (empty storages all have address 0)
