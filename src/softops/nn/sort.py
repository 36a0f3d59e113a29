"""Modules for the sort family, each holding the arguments of the function of its name (the
wrappers' contract: :mod:`softops.nn`)."""

from __future__ import annotations

import torch

from softops._core.validation import check_bool, check_dim, check_epsilon, check_q
from softops.nn._module import ArgsModule
from softops.sort import check_options, soft_argsort, soft_quantile, soft_rank, soft_sort

__all__ = ["SoftArgsort", "SoftQuantile", "SoftRank", "SoftSort"]


_OT = (("max_iter", None), ("tol", None))  # the "ot" options and their defaults


class _SortLike(ArgsModule):
    _kind: str
    _optional = (("regularization", "l2"), ("distance", "l1"), *_OT)
    _fields = ("dim", "descending", "epsilon", "method", *dict(_optional))

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


class SoftSort(_SortLike):
    """A Module that applies :func:`softops.soft_sort` along ``dim``.

    Args:
        dim, descending, epsilon, method, regularization, distance, max_iter, tol: as for the
            function.

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
        dim, descending, epsilon, method, regularization, distance, max_iter, tol: as for the
            function.

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


class SoftArgsort(ArgsModule):
    """A Module that applies :func:`softops.soft_argsort` (a soft permutation matrix).

    Args:
        dim, descending, epsilon, method, distance, hard, max_iter, tol: as for the function.

    Example:
        >>> layer = SoftArgsort(hard=True)
        >>> layer
        SoftArgsort(dim=-1, descending=False, epsilon=1.0, method='softsort', hard=True)
        >>> layer(torch.tensor([3.0, 1.0, 2.0]))
        tensor([[0., 1., 0.],
                [0., 0., 1.],
                [1., 0., 0.]])
    """

    _optional = (("distance", "l1"), *_OT)
    _fields = ("dim", "descending", "epsilon", "method", "hard", *dict(_optional))

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
        return soft_argsort(x, **self._kwargs())


class SoftQuantile(ArgsModule):
    """A Module that applies :func:`softops.soft_quantile` at the stored ``q`` along ``dim``.

    Args:
        q, dim, epsilon, method, keepdim: as for the function (``q`` stored as given).

    Example:
        >>> layer = SoftQuantile(0.5, epsilon=0.01)
        >>> layer
        SoftQuantile(q=0.5, dim=-1, epsilon=0.01, method='pav')
        >>> layer(torch.tensor([[3.0, 1.0, 2.0, 4.0]]))
        tensor([2.5000])
    """

    _fields, _args = ("q", "dim", "epsilon", "method", "keepdim"), ("q",)
    _optional = (("keepdim", False),)

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
        return soft_quantile(x, self.q, **self._kwargs())
