"""Straight-through estimators: the hard result forward, the soft gradient backward."""

from __future__ import annotations

import torch

__all__ = ["hard_topk_mask", "straight_through"]


def straight_through(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """Return a tensor equal to ``hard`` whose gradient is that of ``soft``."""
    return hard.to(soft.dtype) + (soft - soft.detach())


def hard_topk_mask(x: torch.Tensor, k: torch.Tensor, k_scalar: int | None) -> torch.Tensor:
    """The 0/1 mask of the k largest entries of each row of ``x`` (B, n).

    ``k`` is (B,) with integer values; ``k_scalar`` is its common value when known (one
    ``torch.topk`` instead of a full argsort). Ties are broken as ``torch.topk`` breaks them.
    """
    if k_scalar is not None:
        if k_scalar == 0:
            return torch.zeros_like(x)
        return torch.zeros_like(x).scatter_(-1, x.topk(k_scalar, dim=-1).indices, 1.0)
    order = x.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(x.shape[-1], device=x.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    return (rank < k[:, None]).to(x.dtype)
