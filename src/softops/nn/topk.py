"""Modules for the top-k family, each holding the arguments of the function of its name (the
wrappers' contract: :mod:`softops.nn`)."""

from __future__ import annotations

from typing import Any

import torch

from softops._core.validation import (
    check_bool,
    check_dim,
    check_epsilon,
    check_k,
    check_max_iter,
    check_tol,
)
from softops.nn._module import ArgsModule
from softops.topk import TopK, check_mask_k, check_mask_options, soft_topk, soft_topk_mask

__all__ = ["SoftTopK", "SoftTopKMask"]


class SoftTopKMask(ArgsModule):
    """A Module that applies :func:`softops.soft_topk_mask` along ``dim``.

    A ``generator`` pickles (and deep-copies) as its device and state: the copy draws from a new
    generator in that state.

    Args:
        k, dim, largest, epsilon, method, max_iter, tol, hard, n_samples, generator: as for the
            function.

    Example:
        >>> layer = SoftTopKMask(2, epsilon=0.1)
        >>> layer
        SoftTopKMask(k=2, dim=-1, largest=True, epsilon=0.1, method='ot', hard=False)
        >>> layer(torch.tensor([[0.1, 0.9, 0.5, 0.0]])).round(decimals=3)
        tensor([[0.1020, 0.9970, 0.8610, 0.0400]])
    """

    _optional = (("max_iter", None), ("tol", None), ("n_samples", None), ("generator", None))
    _fields = ("k", "dim", "largest", "epsilon", "method", "hard", *dict(_optional))
    _args = ("k",)

    def __init__(
        self,
        k: int | float | torch.Tensor,
        *,
        dim: int = -1,
        largest: bool = True,
        epsilon: float | torch.Tensor = 0.1,
        method: str = "ot",
        max_iter: int | None = None,
        tol: float | None = None,
        hard: bool = False,
        n_samples: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        op = type(self).__name__
        check_mask_options(
            op,
            method,
            largest=largest,
            epsilon=epsilon,
            max_iter=max_iter,
            tol=tol,
            hard=hard,
            n_samples=n_samples,
            generator=generator,
        )
        check_mask_k(op, k, None, method, hard=hard, epsilon=epsilon)
        check_dim(None, dim, op)
        super().__init__()
        self.k, self.dim, self.largest, self.epsilon = k, dim, largest, epsilon
        self.method, self.max_iter, self.tol, self.hard = method, max_iter, tol, hard
        self.n_samples, self.generator = n_samples, generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_topk_mask(x, self.k, **self._kwargs())

    def _repr_value(self, name: str) -> Any:
        value = getattr(self, name)
        return _PickledGenerator(value) if name == "generator" and value is not None else value

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if state.get("generator") is not None:
            state["generator"] = _PickledGenerator(state["generator"])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        generator = state.get("generator")
        if isinstance(generator, _PickledGenerator):
            state = {**state, "generator": generator.restore()}
        super().__setstate__(state)


class SoftTopK(ArgsModule):
    """A Module that applies :func:`softops.soft_topk` (the sorted soft top-k) along ``dim``.

    Args:
        k, dim, largest, epsilon, max_iter, tol: as for the function (``k`` an int >= 1).

    Example:
        >>> layer = SoftTopK(2, epsilon=0.01)
        >>> layer
        SoftTopK(k=2, dim=-1, largest=True, epsilon=0.01)
        >>> out = layer(torch.tensor([[0.1, 0.9, 0.5, 0.0]]))
        >>> out.values.round(decimals=3), out.indices
        (tensor([[0.9000, 0.5000]]), tensor([[1, 2]]))
    """

    _optional = (("max_iter", None), ("tol", None))
    _fields, _args = ("k", "dim", "largest", "epsilon", *dict(_optional)), ("k",)

    def __init__(
        self,
        k: int,
        *,
        dim: int = -1,
        largest: bool = True,
        epsilon: float | torch.Tensor = 0.1,
        max_iter: int | None = None,
        tol: float | None = None,
    ) -> None:
        op = type(self).__name__
        check_k(k, None, op, low=1, integer=True)
        check_dim(None, dim, op)
        check_bool(largest, op, "largest")
        check_epsilon(epsilon, op)
        check_max_iter(max_iter, 1, op)  # None stays None: the default depends on x's dtype
        check_tol(tol, 0.0, op)
        super().__init__()
        self.k, self.dim, self.largest, self.epsilon = k, dim, largest, epsilon
        self.max_iter, self.tol = max_iter, tol

    def forward(self, x: torch.Tensor) -> TopK:
        return soft_topk(x, self.k, **self._kwargs())


class _PickledGenerator:
    """A torch.Generator as its device and state (a generator does not pickle), with its repr."""

    def __init__(self, generator: torch.Generator) -> None:
        self.device, self.state = str(generator.device), generator.get_state()

    def __repr__(self) -> str:
        return f"torch.Generator(device={self.device!r})"

    def restore(self) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.set_state(self.state)
        return generator
