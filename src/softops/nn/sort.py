"""Modules for the sort family; each stores its arguments and calls the functional op."""

from __future__ import annotations

import torch

from ..sort import soft_argsort, soft_quantile, soft_rank, soft_sort

__all__ = ["SoftArgsort", "SoftQuantile", "SoftRank", "SoftSort"]


class _SortLike(torch.nn.Module):
    def __init__(
        self,
        *,
        dim: int = -1,
        descending: bool = False,
        epsilon: float = 1.0,
        method: str = "pav",
        regularization: str = "l2",
        distance: str = "l1",
        max_iter: int | None = None,
        tol: float | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.descending, self.epsilon, self.method = dim, descending, epsilon, method
        self.regularization, self.distance = regularization, distance
        self.max_iter, self.tol = max_iter, tol

    def _kwargs(self) -> dict:
        return {
            "dim": self.dim,
            "descending": self.descending,
            "epsilon": self.epsilon,
            "method": self.method,
            "regularization": self.regularization,
            "distance": self.distance,
            "max_iter": self.max_iter,
            "tol": self.tol,
        }

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, descending={self.descending}, epsilon={self.epsilon}, "
            f"method={self.method!r}"
        )


class SoftSort(_SortLike):
    """Module form of :func:`softops.soft_sort`; the arguments are stored, not learned.

    Example:
        >>> SoftSort(epsilon=0.1)(torch.tensor([[3.0, 1.0, 2.0]]))
        tensor([[1., 2., 3.]])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_sort(x, **self._kwargs())


class SoftRank(_SortLike):
    """Module form of :func:`softops.soft_rank`; the arguments are stored, not learned.

    Example:
        >>> SoftRank(epsilon=0.1)(torch.tensor([[3.0, 1.0, 2.0]]))
        tensor([[3., 1., 2.]])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_rank(x, **self._kwargs())


class SoftArgsort(torch.nn.Module):
    """Module form of :func:`softops.soft_argsort`; returns x.shape + (n,)."""

    def __init__(
        self,
        *,
        dim: int = -1,
        descending: bool = False,
        epsilon: float = 1.0,
        method: str = "softsort",
        distance: str = "l1",
        hard: bool = False,
        max_iter: int | None = None,
        tol: float | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.descending, self.epsilon, self.method = dim, descending, epsilon, method
        self.distance, self.hard, self.max_iter, self.tol = distance, hard, max_iter, tol

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_argsort(
            x,
            dim=self.dim,
            descending=self.descending,
            epsilon=self.epsilon,
            method=self.method,
            distance=self.distance,
            hard=self.hard,
            max_iter=self.max_iter,
            tol=self.tol,
        )

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, descending={self.descending}, epsilon={self.epsilon}, "
            f"method={self.method!r}, hard={self.hard}"
        )


class SoftQuantile(torch.nn.Module):
    """Module form of :func:`softops.soft_quantile`; ``q`` is stored (a float or a 1-D tensor).

    Example:
        >>> SoftQuantile(0.5, epsilon=0.01)(torch.tensor([[3.0, 1.0, 2.0, 4.0]]))
        tensor([2.5000])
    """

    def __init__(
        self,
        q: float | torch.Tensor,
        *,
        dim: int = -1,
        epsilon: float = 1.0,
        method: str = "pav",
        keepdim: bool = False,
    ) -> None:
        super().__init__()
        self.q, self.dim, self.epsilon, self.method, self.keepdim = q, dim, epsilon, method, keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_quantile(
            x, self.q, dim=self.dim, epsilon=self.epsilon, method=self.method, keepdim=self.keepdim
        )

    def extra_repr(self) -> str:
        return f"q={self.q}, dim={self.dim}, epsilon={self.epsilon}, method={self.method!r}"
