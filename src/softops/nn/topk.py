"""Modules for the top-k family: each holds the arguments of the function of its name.

Each Module checks its arguments at construction, under its own name (what needs the data, such
as ``k <= n``, on the forward call), and stores them, not learned; an argument the method does
not use must stay at its default. The function (:func:`softops.soft_topk_mask`, ...) has the
math, the methods and the units of ``epsilon``; ``forward(x)`` equals it.
"""

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
from softops.topk import TopK, check_mask_k, check_mask_options, soft_topk, soft_topk_mask

__all__ = ["SoftTopK", "SoftTopKMask"]


class SoftTopKMask(torch.nn.Module):
    """A Module that applies :func:`softops.soft_topk_mask` along ``dim``.

    A module holding a ``generator`` pickles (and deep-copies) the generator's device and state;
    the copy draws from a new generator in that state, not from the original.

    Args:
        k: the number of entries to select: a number >= 0, or a tensor (see the function).
        dim: the dimension to select along.
        largest: select the largest (True) or the smallest entries.
        epsilon: the smoothing strength, in the units of x; larger is smoother.
        method: "ot" (default), "sinkhorn", "softkmax", "perturbed" or "sparse" (the
            capped-simplex projection: exact zeros and ones).
        max_iter: "ot", "sinkhorn" and "sparse": the iteration cap (None: the method's
            default).
        tol: "ot" and "sinkhorn": the stopping tolerance (None: the method's default).
        hard: straight-through: the hard mask forward, the soft gradient backward.
        n_samples: "perturbed": the number of noise draws (None: 100).
        generator: "perturbed": the generator of the noise draws.

    Shape:
        - input: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Example:
        >>> layer = SoftTopKMask(2, epsilon=0.1)
        >>> layer
        SoftTopKMask(k=2, dim=-1, largest=True, epsilon=0.1, method='ot', hard=False)
        >>> layer(torch.tensor([[0.1, 0.9, 0.5, 0.0]])).round(decimals=3)
        tensor([[0.1020, 0.9970, 0.8610, 0.0400]])
    """

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
        rest = _non_default(
            max_iter=self.max_iter,
            tol=self.tol,
            n_samples=self.n_samples,
            generator=None if self.generator is None else _GeneratorRepr(self.generator),
        )
        return (
            f"k={self.k}, dim={self.dim}, largest={self.largest}, epsilon={self.epsilon}, "
            f"method={self.method!r}, hard={self.hard}{rest}"
        )

    def __getstate__(self) -> dict[str, Any]:
        # torch.Generator does not pickle: keep its device and state instead.
        state = self.__dict__.copy()
        generator = state.get("generator")
        if generator is not None:
            state["generator"] = _PickledGenerator(str(generator.device), generator.get_state())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        generator = state.get("generator")
        if isinstance(generator, _PickledGenerator):
            state = {**state, "generator": generator.restore()}
        super().__setstate__(state)


class SoftTopK(torch.nn.Module):
    """A Module that applies :func:`softops.soft_topk` (the sorted soft top-k) along ``dim``.

    Args:
        k: the number of entries to select, an int >= 1.
        dim: the dimension to select along.
        largest: select the largest (True, largest first) or the smallest (smallest first).
        epsilon: the smoothing strength, in the units of x; larger is smoother.
        max_iter: the Sinkhorn iteration cap (None: the function's default).
        tol: the Sinkhorn stopping tolerance (None: the function's default).

    Shape:
        - input: :math:`(*, n, *)` with n at ``dim``; output: a :class:`softops.TopK` of
          ``values`` and ``indices`` of x.shape with ``dim`` replaced by k, and ``weights`` of
          ``values.shape + (n,)``.

    Example:
        >>> layer = SoftTopK(2, epsilon=0.01)
        >>> layer
        SoftTopK(k=2, dim=-1, largest=True, epsilon=0.01)
        >>> out = layer(torch.tensor([[0.1, 0.9, 0.5, 0.0]]))
        >>> out.values.round(decimals=3), out.indices
        (tensor([[0.9000, 0.5000]]), tensor([[1, 2]]))
    """

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
        rest = _non_default(max_iter=self.max_iter, tol=self.tol)
        return f"k={self.k}, dim={self.dim}, largest={self.largest}, epsilon={self.epsilon}{rest}"


def _non_default(**kwargs: Any) -> str:
    """``", name=value"`` for each argument that is not None (its default)."""
    return "".join(f", {name}={value!r}" for name, value in kwargs.items() if value is not None)


class _GeneratorRepr:
    def __init__(self, generator: torch.Generator) -> None:
        self.device = generator.device

    def __repr__(self) -> str:
        return f"torch.Generator(device={str(self.device)!r})"


class _PickledGenerator:
    """A torch.Generator as its device and state (a generator itself does not pickle)."""

    def __init__(self, device: str, state: torch.Tensor) -> None:
        self.device, self.state = device, state

    def restore(self) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.set_state(self.state)
        return generator
