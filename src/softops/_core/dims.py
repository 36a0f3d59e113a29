"""Move the working dim last and flatten the batch to (B, n), and back."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["flatten_to_2d", "row_param"]


def flatten_to_2d(
    x: torch.Tensor, dim: int
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Return ``x`` as a (B, n) tensor with ``dim`` last, and a function that undoes it.

    The inverse takes a (B, n') tensor (n' may differ from n, e.g. k) or a (B, n', m) tensor and
    restores the batch shape, putting the n' axis back at ``dim`` (trailing axes stay last).
    """
    moved = x if dim == x.dim() - 1 else x.movedim(dim, -1)
    batch_shape = moved.shape[:-1]
    x2 = moved.reshape(-1, moved.shape[-1])

    def restore(y: torch.Tensor) -> torch.Tensor:
        extra = y.shape[2:]
        y = y.reshape(*batch_shape, y.shape[1], *extra)
        return y if len(batch_shape) == dim else y.movedim(len(batch_shape), dim)

    return x2, restore


def row_param(
    value: float | torch.Tensor,
    batch_shape: torch.Size,
    op: str,
    name: str,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Broadcast a scalar or a tensor parameter to one value per row: shape (B,).

    A tensor must broadcast to ``batch_shape`` (the shape of x without ``dim``).
    """
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, dtype=dtype, device=device)
    else:
        value = value.to(dtype=dtype, device=device)
    try:
        value = value.expand(batch_shape)
    except RuntimeError:
        raise ValueError(
            f"{op}: expected `{name}` to be a scalar or broadcastable to the batch shape "
            f"{tuple(batch_shape)} (x.shape without dim); got shape {tuple(value.shape)}."
        ) from None
    return value.reshape(-1)
