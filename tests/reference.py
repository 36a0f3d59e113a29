"""Plain-autograd references for the custom autograd Functions (unrolled, no implicit tricks)."""

from __future__ import annotations

import math

import torch


def unrolled_sinkhorn_topk_mask(
    x: torch.Tensor, k: float, epsilon: float, iters: int
) -> torch.Tensor:
    """SOFT top-k by log-domain Sinkhorn on the n x 2 problem, differentiated by plain autograd.

    x: (B, n). Targets y = (0, 1) with masses ((n - k)/n, k/n), cost (x_i - y_j)^2, eps_p = 2 eps.
    Returns A = n * Gamma[:, 1] (the k largest, library orientation).
    """
    B, n = x.shape
    y = torch.tensor([0.0, 1.0], dtype=x.dtype)
    C = (x[:, :, None] - y) ** 2
    eps_p = 2 * epsilon
    log_mu = torch.full((B, n), -math.log(n), dtype=x.dtype)
    log_nu = torch.tensor([math.log((n - k) / n), math.log(k / n)], dtype=x.dtype).expand(B, 2)
    f = torch.zeros(B, n, dtype=x.dtype)
    g = torch.zeros(B, 2, dtype=x.dtype)
    for _ in range(iters):
        f = eps_p * log_mu - eps_p * torch.logsumexp((g[:, None, :] - C) / eps_p, dim=2)
        g = eps_p * log_nu - eps_p * torch.logsumexp((f[:, :, None] - C) / eps_p, dim=1)
    log_plan = (f[:, :, None] + g[:, None, :] - C) / eps_p
    return n * log_plan[..., 1].exp()


def hard_topk_mask(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True) -> torch.Tensor:
    """The hard operator that soft_topk_mask relaxes, written as in its docstring."""
    return torch.zeros_like(x).scatter(dim, x.topk(k, dim, largest).indices, 1)
