"""Modules for the smoothing family (seed 002); they hold arguments, the math is in
:mod:`softops.smooth`."""

from __future__ import annotations

import torch

from softops.smooth import (
    smooth_max,
    smooth_min,
    soft_argmax,
    soft_argmax_onehot,
    soft_argmin,
    soft_kmax,
)

__all__ = [
    "SmoothMax",
    "SmoothMin",
    "SoftArgmax",
    "SoftArgmaxOneHot",
    "SoftArgmin",
    "SoftKMax",
]


class _Reduction(torch.nn.Module):
    """Shared storage for the reductions along ``dim`` (max, min, argmax, argmin)."""

    def __init__(
        self, *, dim: int = -1, keepdim: bool = False, epsilon: float | torch.Tensor = 1.0
    ) -> None:
        super().__init__()
        self.dim, self.keepdim, self.epsilon = dim, keepdim, epsilon

    def extra_repr(self) -> str:
        return f"dim={self.dim}, keepdim={self.keepdim}, epsilon={self.epsilon}"


class SmoothMax(_Reduction):
    """Module form of :func:`softops.smooth_max`; the arguments are stored, not learned.

    Example:
        >>> layer = SmoothMax(dim=0, epsilon=0.5)
        >>> layer
        SmoothMax(dim=0, keepdim=False, epsilon=0.5)
        >>> layer(torch.tensor([[1.0, 0.0], [3.0, 0.0]])).round(decimals=4)
        tensor([3.0091, 0.3466])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return smooth_max(x, dim=self.dim, keepdim=self.keepdim, epsilon=self.epsilon)


class SmoothMin(_Reduction):
    """Module form of :func:`softops.smooth_min`; the arguments are stored, not learned."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return smooth_min(x, dim=self.dim, keepdim=self.keepdim, epsilon=self.epsilon)


class SoftArgmax(_Reduction):
    """Module form of :func:`softops.soft_argmax`; the arguments are stored, not learned."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_argmax(x, dim=self.dim, keepdim=self.keepdim, epsilon=self.epsilon)


class SoftArgmin(_Reduction):
    """Module form of :func:`softops.soft_argmin`; the arguments are stored, not learned."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_argmin(x, dim=self.dim, keepdim=self.keepdim, epsilon=self.epsilon)


class SoftArgmaxOneHot(torch.nn.Module):
    """Module form of :func:`softops.soft_argmax_onehot`; the arguments are stored, not learned.

    Example:
        >>> layer = SoftArgmaxOneHot(epsilon=0.5, hard=True)
        >>> layer
        SoftArgmaxOneHot(dim=-1, epsilon=0.5, hard=True)
        >>> layer(torch.tensor([0.2, 1.0, 0.7]))
        tensor([0., 1., 0.])
    """

    def __init__(
        self, *, dim: int = -1, epsilon: float | torch.Tensor = 1.0, hard: bool = False
    ) -> None:
        super().__init__()
        self.dim, self.epsilon, self.hard = dim, epsilon, hard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_argmax_onehot(x, dim=self.dim, epsilon=self.epsilon, hard=self.hard)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, epsilon={self.epsilon}, hard={self.hard}"


class SoftKMax(torch.nn.Module):
    """Module form of :func:`softops.soft_kmax`; the arguments are stored, not learned.

    Example:
        >>> layer = SoftKMax(2, epsilon=0.1)
        >>> layer
        SoftKMax(k=2, dim=-1, epsilon=0.1)
        >>> layer(torch.tensor([[0.1, 0.9, 0.5, 0.0]])).round(decimals=3)
        tensor([[0.0200, 0.9900, 0.9830, 0.0070]])
    """

    def __init__(self, k: int, *, dim: int = -1, epsilon: float | torch.Tensor = 1.0) -> None:
        super().__init__()
        self.k, self.dim, self.epsilon = k, dim, epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_kmax(x, self.k, dim=self.dim, epsilon=self.epsilon)

    def extra_repr(self) -> str:
        return f"k={self.k}, dim={self.dim}, epsilon={self.epsilon}"
