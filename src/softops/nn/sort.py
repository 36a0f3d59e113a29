"""Modules for the sort family: each holds the arguments of the function of its name.

Each Module checks its arguments at construction, under its own name (what needs the data, such
as ``k <= n``, on the forward call), and stores them, not learned; an argument the method does
not use must stay at its default. The function (:func:`softops.soft_sort`, ...) has the math, the
methods and the units of ``epsilon``; ``forward(x)`` equals it.
"""

from __future__ import annotations

from typing import Any

import torch

from softops._core.validation import check_bool, check_dim, check_epsilon, check_q
from softops.sort import check_options, soft_argsort, soft_quantile, soft_rank, soft_sort

__all__ = ["SoftArgsort", "SoftQuantile", "SoftRank", "SoftSort"]


def _options_repr(**kwargs: Any) -> str:
    """``", name=value"`` for each option that differs from its default (given as a pair)."""
    return "".join(
        f", {name}={value!r}" for name, (value, default) in kwargs.items() if value != default
    )


class _SortLike(torch.nn.Module):
    _kind = "sort"

    def __init__(
        self,
        *,
        dim: int = -1,
        descending: bool = False,
        epsilon: float | torch.Tensor = 1.0,
        method: str = "pav",
        regularization: str = "l2",
        distance: str = "l1",
        max_iter: int | None = None,
        tol: float | None = None,
    ) -> None:
        op = type(self).__name__
        check_options(
            op,
            method,
            self._kind,
            regularization=regularization,
            distance=distance,
            max_iter=max_iter,
            tol=tol,
        )
        check_dim(None, dim, op)
        check_bool(descending, op, "descending")
        check_epsilon(epsilon, op)
        super().__init__()
        self.dim, self.descending, self.epsilon, self.method = dim, descending, epsilon, method
        self.regularization, self.distance = regularization, distance
        self.max_iter, self.tol = max_iter, tol

    def _kwargs(self) -> dict[str, Any]:
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
        rest = _options_repr(
            regularization=(self.regularization, "l2"),
            distance=(self.distance, "l1"),
            max_iter=(self.max_iter, None),
            tol=(self.tol, None),
        )
        return (
            f"dim={self.dim}, descending={self.descending}, epsilon={self.epsilon}, "
            f"method={self.method!r}{rest}"
        )


class SoftSort(_SortLike):
    """A Module that applies :func:`softops.soft_sort` along ``dim``.

    Args:
        dim: the dimension to sort along.
        descending: sort in descending order.
        epsilon: the smoothing strength; larger is smoother.
        method: "pav" (default), "softsort", "neuralsort" or "ot".
        regularization: "pav": "l2" (default) or "kl".
        distance: "softsort": "l1" (default) or "l2".
        max_iter: "ot": the iteration cap (None: its default).
        tol: "ot": the stopping tolerance (None: its default).

    Shape:
        - input: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Example:
        >>> layer = SoftSort(epsilon=0.1)
        >>> layer
        SoftSort(dim=-1, descending=False, epsilon=0.1, method='pav')
        >>> layer(torch.tensor([[3.0, 1.0, 2.0]]))
        tensor([[1., 2., 3.]])
    """

    _kind = "sort"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_sort(x, **self._kwargs())


class SoftRank(_SortLike):
    """A Module that applies :func:`softops.soft_rank` (1-based ranks) along ``dim``.

    Args:
        dim: the dimension to rank along.
        descending: rank 1 for the largest entry (default: for the smallest).
        epsilon: the smoothing strength; larger is smoother.
        method: "pav" (default), "softsort", "neuralsort" or "ot".
        regularization: "pav": "l2" (default) or "kl".
        distance: "softsort": "l1" (default) or "l2".
        max_iter: "ot": the iteration cap (None: its default).
        tol: "ot": the stopping tolerance (None: its default).

    Shape:
        - input: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Example:
        >>> layer = SoftRank(epsilon=0.1, descending=True)
        >>> layer
        SoftRank(dim=-1, descending=True, epsilon=0.1, method='pav')
        >>> layer(torch.tensor([[3.0, 1.0, 2.0]]))
        tensor([[1., 3., 2.]])
        >>> SoftRank(regularization="kl")
        SoftRank(dim=-1, descending=False, epsilon=1.0, method='pav', regularization='kl')
    """

    _kind = "rank"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_rank(x, **self._kwargs())


class SoftArgsort(torch.nn.Module):
    """A Module that applies :func:`softops.soft_argsort` (a soft permutation matrix).

    Args:
        dim: the dimension to sort along.
        descending: rows of the matrix in descending order of x.
        epsilon: the temperature; larger is smoother.
        method: "softsort" (default), "neuralsort" or "ot".
        distance: "softsort": "l1" (default) or "l2".
        hard: straight-through: the hard permutation matrix forward, the soft gradient backward.
        max_iter: "ot": the iteration cap (None: its default).
        tol: "ot": the stopping tolerance (None: its default).

    Shape:
        - input: :math:`(*, n, *)` with n at ``dim``; output: :math:`(*, n, *, n)`.

    Example:
        >>> layer = SoftArgsort(hard=True)
        >>> layer
        SoftArgsort(dim=-1, descending=False, epsilon=1.0, method='softsort', hard=True)
        >>> layer(torch.tensor([3.0, 1.0, 2.0]))
        tensor([[0., 1., 0.],
                [0., 0., 1.],
                [1., 0., 0.]])
    """

    def __init__(
        self,
        *,
        dim: int = -1,
        descending: bool = False,
        epsilon: float | torch.Tensor = 1.0,
        method: str = "softsort",
        distance: str = "l1",
        hard: bool = False,
        max_iter: int | None = None,
        tol: float | None = None,
    ) -> None:
        op = type(self).__name__
        check_options(op, method, "argsort", distance=distance, max_iter=max_iter, tol=tol)
        check_dim(None, dim, op)
        check_bool(descending, op, "descending")
        check_bool(hard, op, "hard")
        check_epsilon(epsilon, op)
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
        rest = _options_repr(
            distance=(self.distance, "l1"), max_iter=(self.max_iter, None), tol=(self.tol, None)
        )
        return (
            f"dim={self.dim}, descending={self.descending}, epsilon={self.epsilon}, "
            f"method={self.method!r}, hard={self.hard}{rest}"
        )


class SoftQuantile(torch.nn.Module):
    """A Module that applies :func:`softops.soft_quantile` at the stored ``q`` along ``dim``.

    Args:
        q: a float in [0, 1], or a 1-D tensor of them (which adds a leading dim).
        dim: the dimension to reduce.
        epsilon: the smoothing strength, as for :func:`softops.soft_sort` with the same method.
        method: "pav" (default) or "ot".
        keepdim: keep the reduced dimension, with size 1.

    Shape:
        - input: :math:`(*, n, *)`; output: without ``dim`` (a 1-D q adds a leading dim).

    Example:
        >>> layer = SoftQuantile(0.5, epsilon=0.01)
        >>> layer
        SoftQuantile(q=0.5, dim=-1, epsilon=0.01, method='pav')
        >>> layer(torch.tensor([[3.0, 1.0, 2.0, 4.0]]))
        tensor([2.5000])
    """

    def __init__(
        self,
        q: float | torch.Tensor,
        *,
        dim: int = -1,
        epsilon: float | torch.Tensor = 1.0,
        method: str = "pav",
        keepdim: bool = False,
    ) -> None:
        op = type(self).__name__
        check_options(op, method, "quantile")
        dtype, device = (
            (q.dtype, q.device) if isinstance(q, torch.Tensor) else (torch.float64, None)
        )
        check_q(q, op, dtype, device)  # q is stored as given, not converted
        check_dim(None, dim, op)
        check_epsilon(epsilon, op)
        check_bool(keepdim, op, "keepdim")
        super().__init__()
        self.q, self.dim, self.epsilon, self.method, self.keepdim = q, dim, epsilon, method, keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_quantile(
            x, self.q, dim=self.dim, epsilon=self.epsilon, method=self.method, keepdim=self.keepdim
        )

    def extra_repr(self) -> str:
        rest = _options_repr(keepdim=(self.keepdim, False))
        return f"q={self.q}, dim={self.dim}, epsilon={self.epsilon}, method={self.method!r}{rest}"
