"""Move the working dim last and flatten the batch to (B, n), and back.

``prepare_rows`` is the one preamble of every public op: validate ``x``, ``dim`` and ``epsilon``,
move ``dim`` last, flatten to (B, n) in the compute dtype, broadcast epsilon per row, and hand back
the function that restores the shape.

Epsilon below the compute dtype's ``finfo.tiny`` is refused; above ``finfo.max`` (every op's
large-epsilon limit) it is clamped, with a zero gradient. Unreadable tensors are clamped to
``[finfo.tiny, finfo.max]`` unchecked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from softops._core.validation import (
    check_dim,
    check_epsilon,
    check_floating,
    check_nonempty,
    compute_dtype,
)
from softops._kernels import plain_eager

__all__ = ["Rows", "constant_row", "flatten_to_2d", "prepare_rows", "row_param"]


def flatten_to_2d(
    x: torch.Tensor, dim: int
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Return ``x`` as a (B, n) tensor with ``dim`` last, and the inverse, which takes a (B, n')
    or (B, n', m) tensor and puts the n' axis back at ``dim``."""
    if x.dim() == 2 and dim == 1:  # already canonical: nothing to undo
        return x, _identity
    moved = x if dim == x.dim() - 1 else x.movedim(dim, -1)
    batch_shape = moved.shape[:-1]
    x2 = moved.reshape(batch_shape.numel(), moved.shape[-1])  # (not -1: n may be 0)

    def restore(y: torch.Tensor) -> torch.Tensor:
        extra = y.shape[2:]
        y = y.reshape(*batch_shape, y.shape[1], *extra)
        return y if len(batch_shape) == dim else y.movedim(len(batch_shape), dim)

    return x2, restore


def _identity(y: torch.Tensor) -> torch.Tensor:
    return y


def row_param(
    value: float | torch.Tensor,
    batch_shape: torch.Size,
    op: str,
    name: str,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Broadcast a scalar or a tensor parameter (to ``batch_shape``) to one value per row: (B,)."""
    if not isinstance(value, torch.Tensor):
        if not torch.compiler.is_compiling():  # one fill (a small op's time is its op count)
            return torch.full((batch_shape.numel(),), value, dtype=dtype, device=device)
        value = torch.tensor(value, dtype=dtype, device=device)  # (no guard on the batch size)
    value = value.to(dtype=dtype, device=device)
    try:
        value = value.expand(batch_shape)
    except RuntimeError:
        raise ValueError(
            f"{op}: expected `{name}` to be a scalar or broadcastable to the batch shape "
            f"{tuple(batch_shape)} (x.shape without dim); got shape {tuple(value.shape)}."
        ) from None
    return value.reshape(-1)


class Rows(NamedTuple):
    """The canonical form of an op's input: x2 (B, n) with ``dim`` last and eps (B,) in the
    compute dtype, ``restore`` (as :func:`flatten_to_2d`'s), ``dim`` normalised, ``n`` and the
    ``batch_shape`` (x.shape without ``dim``)."""

    x2: torch.Tensor
    eps: torch.Tensor
    restore: Callable[[torch.Tensor], torch.Tensor]
    dim: int
    n: int
    batch_shape: torch.Size

    def param(self, value: float | torch.Tensor, op: str, name: str) -> torch.Tensor:
        """Another per-row parameter (k, say), broadcast like epsilon: shape (B,)."""
        return row_param(value, self.batch_shape, op, name, self.x2.dtype, self.x2.device)


_SHARED_ROWS = 4096
"""The most rows whose constant row :func:`constant_row` keeps."""


def constant_row(x2: torch.Tensor, value: float, dtype: torch.dtype) -> torch.Tensor:
    """(B,) filled with ``value`` for the rows x2 (an epsilon, a number k), made once per
    (B, value, dtype, device) in an eager call on plain data with at most ``_SHARED_ROWS`` rows
    (no op writes into such a row)."""
    rows = x2.shape[0]
    if isinstance(rows, int) and rows <= _SHARED_ROWS and plain_eager(x2):
        return _constant_row(rows, value, dtype, x2.device)
    return torch.full((rows,), value, dtype=dtype, device=x2.device)


@functools.lru_cache(maxsize=64)
def _constant_row(
    rows: int, value: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    with torch.inference_mode(False):  # (an inference tensor could not be saved for backward)
        return torch.full((rows,), value, dtype=dtype, device=device)


_FINFO = {t: torch.finfo(t) for t in (torch.float32, torch.float64)}
"""``torch.finfo`` of the usual compute dtypes, made once."""


def prepare_rows(op: str, x: torch.Tensor, dim: int, epsilon: float | torch.Tensor) -> Rows:
    """Validate ``x``, ``dim`` and ``epsilon`` and return the :class:`Rows` form of ``x``, with
    epsilon clamped to the compute dtype's largest finite value."""
    # (the usual call first: float32 or float64 rows (B, n) along the last dim, a float epsilon
    # in [tiny, max]: nothing to move, check or clamp; a small op's time is its fixed cost)
    if type(epsilon) is float and type(dim) is int and (dim == -1 or dim == 1):
        usual = _FINFO.get(x.dtype) if isinstance(x, torch.Tensor) else None
        if usual is not None and x.dim() == 2 and x.shape[1] and usual.tiny <= epsilon <= usual.max:
            eps = constant_row(x, epsilon, x.dtype)
            return Rows(x, eps, _identity, 1, x.shape[1], x.shape[:1])
    check_floating(x, op)
    d = check_dim(x, dim, op)
    n = check_nonempty(x, d, op)
    cd = compute_dtype(x.dtype)
    x2, restore = flatten_to_2d(x, d)
    batch_shape = x.shape[:d] if d == x.dim() - 1 else torch.Size(x.shape[:d] + x.shape[d + 1 :])
    epsilon = check_epsilon(epsilon, op, dtype=x.dtype)
    fi = _FINFO.get(cd) or torch.finfo(cd)
    if isinstance(epsilon, torch.Tensor):
        eps = row_param(epsilon, batch_shape, op, "epsilon", cd, x.device)
        eps = eps.clamp(fi.tiny, fi.max)
    else:  # a Python float (>= fi.tiny, checked): clamp on the host, one fill
        eps = constant_row(x2, min(epsilon, fi.max), cd)
    return Rows(x2 if x2.dtype == cd else x2.to(cd), eps, restore, d, n, batch_shape)
