"""Straight-through estimators: the hard result forward, the soft gradient backward."""

from __future__ import annotations

import torch

__all__ = ["straight_through"]


def straight_through(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """Return a tensor equal to ``hard`` whose gradient is that of ``soft``."""
    return hard.to(soft.dtype) + (soft - soft.detach())
