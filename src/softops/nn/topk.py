"""Modules for the top-k family."""

from __future__ import annotations

import torch

from softops.topk import soft_topk, soft_topk_mask

__all__ = ["SoftTopK", "SoftTopKMask"]


class SoftTopKMask(torch.nn.Module):
    """Module form of :func:`softops.soft_topk_mask`; the arguments are stored, not learned.

    Example:
        >>> layer = SoftTopKMask(2, epsilon=0.1)
        >>> layer(torch.tensor([[0.1, 0.9, 0.5, 0.0]])).round(decimals=3)
        tensor([[0.1020, 0.9970, 0.8610, 0.0400]])
    """

    def __init__(
        self,
        k: int | float,
        *,
        dim: int = -1,
        largest: bool = True,
        epsilon: float = 0.1,
        method: str = "ot",
        max_iter: int | None = None,
        tol: float | None = None,
        hard: bool = False,
        n_samples: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.k, self.dim, self.largest, self.epsilon = k, dim, largest, epsilon
        self.method, self.max_iter, self.tol, self.hard = method, max_iter, tol, hard
        self.n_samples, self.generator = n_samples, generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_topk_mask(
            x,
            self.k,
            dim=self.dim,
            largest=self.largest,
            epsilon=self.epsilon,
            method=self.method,
            max_iter=self.max_iter,
            tol=self.tol,
            hard=self.hard,
            n_samples=self.n_samples,
            generator=self.generator,
        )

    def extra_repr(self) -> str:
        extra = "" if self.n_samples is None else f", n_samples={self.n_samples}"
        return (
            f"k={self.k}, dim={self.dim}, largest={self.largest}, epsilon={self.epsilon}, "
            f"method={self.method!r}, hard={self.hard}{extra}"
        )


class SoftTopK(torch.nn.Module):
    """Module form of :func:`softops.soft_topk` (sorted SOFT top-k); returns a ``TopK`` tuple."""

    def __init__(
        self,
        k: int,
        *,
        dim: int = -1,
        largest: bool = True,
        epsilon: float = 0.1,
        max_iter: int | None = None,
        tol: float | None = None,
    ) -> None:
        super().__init__()
        self.k, self.dim, self.largest, self.epsilon = k, dim, largest, epsilon
        self.max_iter, self.tol = max_iter, tol

    def forward(self, x: torch.Tensor):  # -> softops.TopK
        return soft_topk(
            x,
            self.k,
            dim=self.dim,
            largest=self.largest,
            epsilon=self.epsilon,
            max_iter=self.max_iter,
            tol=self.tol,
        )

    def extra_repr(self) -> str:
        return f"k={self.k}, dim={self.dim}, largest={self.largest}, epsilon={self.epsilon}"
