"""Modules for the smoothing family, each holding the arguments of the function of its name
(the wrappers' contract: :mod:`softops.nn`)."""

from __future__ import annotations

import torch

from softops._core.validation import check_bool, check_dim, check_epsilon, check_k
from softops.nn._module import ArgsModule
from softops.smooth import smooth_max, smooth_min, soft_argmax, soft_argmax_onehot, soft_argmin
from softops.topk import soft_kmax

__all__ = [
    "SmoothMax",
    "SmoothMin",
    "SoftArgmax",
    "SoftArgmaxOneHot",
    "SoftArgmin",
    "SoftKMax",
]


class _Reduction(ArgsModule):
    """Shared checks and storage of the reductions along ``dim`` (max, min, argmax, argmin)."""

    _fields = ("dim", "keepdim", "epsilon")

    def __init__(
        self, *, dim: int = -1, keepdim: bool = False, epsilon: float | torch.Tensor = 1.0
    ) -> None:
        op = type(self).__name__
        check_dim(None, dim, op)
        check_bool(keepdim, op, "keepdim")
        check_epsilon(epsilon, op)
        super().__init__()
        self.dim, self.keepdim, self.epsilon = dim, keepdim, epsilon


class SmoothMax(_Reduction):
    """A Module that applies :func:`softops.smooth_max` along ``dim``: the smooth maximum.

    Args:
        dim, keepdim, epsilon: as for the function.

    Example:
        >>> layer = SmoothMax(dim=0, epsilon=0.5)
        >>> layer
        SmoothMax(dim=0, keepdim=False, epsilon=0.5)
        >>> layer(torch.tensor([[1.0, 0.0], [3.0, 0.0]])).round(decimals=4)
        tensor([3.0091, 0.3466])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return smooth_max(x, **self._kwargs())


class SmoothMin(_Reduction):
    """A Module that applies :func:`softops.smooth_min` along ``dim``: the smooth minimum.

    Args:
        dim, keepdim, epsilon: as for the function.

    Example:
        >>> layer = SmoothMin(epsilon=0.5)
        >>> layer
        SmoothMin(dim=-1, keepdim=False, epsilon=0.5)
        >>> layer(torch.tensor([[1.0, 0.0], [3.0, 0.0]])).round(decimals=4)
        tensor([-0.0635, -0.0012])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return smooth_min(x, **self._kwargs())


class SoftArgmax(_Reduction):
    """A Module that applies :func:`softops.soft_argmax`: the expected index of the max.

    Args:
        dim, keepdim, epsilon: as for the function.

    Example:
        >>> layer = SoftArgmax(epsilon=0.1)
        >>> layer
        SoftArgmax(dim=-1, keepdim=False, epsilon=0.1)
        >>> layer(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 5.0]])).round(decimals=4)
        tensor([1., 2.])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_argmax(x, **self._kwargs())


class SoftArgmin(_Reduction):
    """A Module that applies :func:`softops.soft_argmin`: the expected index of the min.

    Args:
        dim, keepdim, epsilon: as for the function.

    Example:
        >>> layer = SoftArgmin(epsilon=0.1, keepdim=True)
        >>> layer
        SoftArgmin(dim=-1, keepdim=True, epsilon=0.1)
        >>> layer(torch.tensor([[0.0, 2.0, 2.0], [5.0, 5.0, 0.0]])).round(decimals=3)
        tensor([[0.],
                [2.]])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_argmin(x, **self._kwargs())


class SoftArgmaxOneHot(ArgsModule):
    """A Module that applies :func:`softops.soft_argmax_onehot` (a softmax) along ``dim``.

    Args:
        dim, epsilon, hard: as for the function.

    Example:
        >>> layer = SoftArgmaxOneHot(epsilon=0.5, hard=True)
        >>> layer
        SoftArgmaxOneHot(dim=-1, epsilon=0.5, hard=True)
        >>> layer(torch.tensor([0.2, 1.0, 0.7]))
        tensor([0., 1., 0.])
    """

    _fields = ("dim", "epsilon", "hard")

    def __init__(
        self, *, dim: int = -1, epsilon: float | torch.Tensor = 1.0, hard: bool = False
    ) -> None:
        op = type(self).__name__
        check_dim(None, dim, op)
        check_epsilon(epsilon, op)
        check_bool(hard, op, "hard")
        super().__init__()
        self.dim, self.epsilon, self.hard = dim, epsilon, hard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_argmax_onehot(x, **self._kwargs())


class SoftKMax(ArgsModule):
    """A Module that applies :func:`softops.soft_kmax` (the recursive soft-k-max) along ``dim``.

    Args:
        k, dim, epsilon: as for the function (``k`` an int >= 0).

    Example:
        >>> layer = SoftKMax(2, epsilon=0.1)
        >>> layer
        SoftKMax(k=2, dim=-1, epsilon=0.1)
        >>> layer(torch.tensor([[0.1, 0.9, 0.5, 0.0]])).round(decimals=3)
        tensor([[0.0200, 0.9900, 0.9830, 0.0070]])
    """

    _fields, _args = ("k", "dim", "epsilon"), ("k",)

    def __init__(self, k: int, *, dim: int = -1, epsilon: float | torch.Tensor = 1.0) -> None:
        op = type(self).__name__
        check_k(k, None, op, integer=True)
        check_dim(None, dim, op)
        check_epsilon(epsilon, op)
        super().__init__()
        self.k, self.dim, self.epsilon = k, dim, epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_kmax(x, self.k, **self._kwargs())
