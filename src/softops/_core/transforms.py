"""``torch.func`` support shared by the ops.

Under a ``torch.func`` transform, meta tensors or ``torch.compile`` tracing, Python cannot
branch on tensor values; the ops ask here (:func:`under_functorch`, :func:`cannot_branch`,
:func:`unreadable`) and take their branch-free path. :func:`vmap_rows` folds a vmapped dim into
the rows of a row-wise Function.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = [
    "apply_function",
    "cannot_branch",
    "own_precision",
    "plain",
    "under_functorch",
    "unreadable",
    "vmap_rows",
    "without_jvp",
]

_functorch = torch._C._functorch


def under_functorch() -> bool:
    """True inside a ``torch.func`` transform."""
    return _functorch.maybe_current_level() is not None


def apply_function(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)`` for a Function whose ``forward`` has no default arguments,
    without ``Function.apply``'s signature binding where no transform or tracing is active."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)  # type: ignore[misc]


def cannot_branch(t: torch.Tensor) -> bool:
    """True where a data-dependent Python branch on ``t`` is impossible or a graph break."""
    return under_functorch() or t.device.type == "meta" or torch.compiler.is_compiling()


def unreadable(t: torch.Tensor) -> bool:
    """True where Python cannot read ``t``'s values: batched by ``vmap`` (at any level), a meta
    tensor, or any tensor while ``torch.compile`` traces (a plain tensor closed over is not)."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return True
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            return True
        t = _functorch.get_unwrapped(t)
    return False


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its functorch wrappers: every vmapped slice at once, for reductions (any,
    sum, max) only, never for a value that is returned."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def vmap_rows(function: Any, info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    """The ``vmap`` rule of a row-wise ``autograd.Function`` (or operator) whose tensor arguments
    lead with the rows B: the vmapped dim is merged into B, and tensor outputs split back."""
    size = info.batch_size
    merged = []
    rows = None  # B, the rows of one slice (unflattening by -1 fails on an empty vmapped dim)
    for arg, dim in zip(args, in_dims, strict=True):
        if isinstance(arg, torch.Tensor):
            if dim is None:
                arg = arg.expand(size, *arg.shape)
            else:
                arg = arg.movedim(dim, 0)
            rows = arg.shape[1] if rows is None else rows
            arg = arg.flatten(0, 1)
        merged.append(arg)
    out = function.apply(*merged) if hasattr(function, "apply") else function(*merged)
    single = not isinstance(out, tuple)
    outs = (out,) if single else out
    results = tuple(
        o.unflatten(0, (size, rows if rows is not None else -1))
        if isinstance(o, torch.Tensor)
        else o
        for o in outs
    )
    dims = tuple(0 if isinstance(o, torch.Tensor) else None for o in outs)
    if single:
        return results[0], dims[0]
    return results, dims


def without_jvp(function: Any) -> Any:
    """The row-wise Function ``function`` for traced code: torch 2.13's dynamo rejects a custom
    ``jvp``."""

    class Traced(function):
        jvp = torch.autograd.Function.jvp

        @staticmethod
        def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
            return vmap_rows(Traced, info, in_dims, *args)

    Traced.__name__ = Traced.__qualname__ = f"{function.__name__}Traced"
    return Traced


def own_precision(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Autocast disabled on ``t``'s device when it is enabled there; otherwise a no-op."""
    kind = t.device.type
    try:
        enabled = torch.is_autocast_enabled(kind)
    except (RuntimeError, ValueError):  # a device type autocast does not know (meta, ...)
        return contextlib.nullcontext()
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(kind, enabled=False)
