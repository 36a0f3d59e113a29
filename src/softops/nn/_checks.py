"""The two construction-time checks that need the input in the functional ops.

``dim`` and ``k`` are checked by the functional ops against ``x`` (``dim`` in range, ``k <= n``).
A Module is built before it sees ``x``, so at construction it checks what does not depend on
it: the type of ``dim``, and the type and sign of ``k``; the rest is checked on the forward
call. Every other argument goes through the families' own validators, under the Module's name.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from softops._core.validation import check_k

__all__ = ["check_dim_type", "check_k_sign"]


def check_dim_type(dim: Any, op: str) -> int:
    """``dim`` must be an int (its range is checked with x, on the forward call)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: expected `dim` to be an int; got {dim!r}.")
    return dim


def check_k_sign(
    k: Any, op: str, *, low: float = 0, integer: bool = False, allow_tensor: bool = True
) -> None:
    """``k`` of the types :func:`softops._core.validation.check_k` accepts, and ``k >= low``.

    The upper bound ``k <= x.shape[dim]`` is checked with x, on the forward call. A tensor ``k``
    is checked once, here (one host sync).
    """
    value = None
    if isinstance(k, (int, float)) and not isinstance(k, bool) and not k >= low:
        value = k
    elif (
        isinstance(k, torch.Tensor)
        and k.dtype != torch.bool
        and not k.is_complex()
        and k.numel()
        and bool((bad := ~(k.detach() >= low)).any())
    ):
        value = k.detach()[bad].flatten()[0].item()
    if value is not None:
        raise ValueError(
            f"{op}: expected `k` >= {low:g} (and <= x.shape[dim], checked on the forward call); "
            f"got k={value:g}."
        )
    # The type rules (int or float, integer, tensor) are check_k's; n is not known yet.
    check_k(k, math.inf, op, low=low, integer=integer, allow_tensor=allow_tensor)  # type: ignore[arg-type]
