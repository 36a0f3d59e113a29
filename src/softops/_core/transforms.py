"""``torch.func`` support shared by the ops.

* :func:`under_functorch`: whether a ``torch.func`` transform (vmap, grad, jacrev, jvp, ...) is
  active. Under a transform, data-dependent Python branches are impossible (a batched tensor has
  no single value to branch on) and saved-tensor hooks, hence ``torch.utils.checkpoint``, are
  refused. The ops ask here and take their transform-safe path: a masked formulation instead of a
  branch, plain autograd instead of recomputed blocks.
* :func:`cannot_branch`: whether the values of ``t`` are unavailable to Python (a ``torch.func``
  transform, meta tensors, or ``torch.compile``/``torch.export`` tracing): the ops then take their
  branch-free formulation instead of one host sync per call.
* :func:`unreadable`: whether Python cannot read one tensor's values (batched by vmap, meta, or
  traced): a count such as softkmax's k must then be a number.
* :func:`plain`: the values under every functorch wrapper of a tensor, for host-side diagnostics
  only (a convergence warning counts rows; it never feeds a result).
* :func:`vmap_rows`: the ``vmap`` rule of an ``autograd.Function`` whose tensor inputs and outputs
  all lead with the row dimension (every solver of softops works on independent rows): the
  vmapped dimension is folded into the rows, the Function runs once on the plain tensors, and the
  outputs are unfolded again. The solvers' own loops and convergence checks then run on real
  values, exactly as for a batch.
* :func:`apply_function`: ``Function.apply`` without the signature binding it runs on every call
  (``inspect.signature``, tens of microseconds: a large part of a small op's time) to fill in
  defaults, which the ops' Functions do not have; under a transform or while tracing, where torch
  handles ``Function.apply`` itself, it is ``Function.apply``.
* :func:`own_precision`: a context that turns ``torch.autocast`` off around an op's matrix
  products, so the op keeps its own precision rules (float16 and bfloat16 computed in float32,
  other dtypes in their own) instead of autocast's bfloat16 matmuls.
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
]

_functorch = torch._C._functorch


def under_functorch() -> bool:
    """True inside a ``torch.func`` transform."""
    return _functorch.maybe_current_level() is not None


def apply_function(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)`` for a Function whose ``forward`` has no default arguments.

    Outside ``torch.func`` transforms and ``torch.compile`` tracing it calls the C++ ``apply``
    directly, skipping the per-call ``inspect.signature`` binding of ``Function.apply`` (which
    only fills in defaults); there the results are the same.
    """
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)  # type: ignore[misc]


def cannot_branch(t: torch.Tensor) -> bool:
    """True where a data-dependent Python branch on ``t`` is impossible or a graph break."""
    return under_functorch() or t.device.type == "meta" or torch.compiler.is_compiling()


def unreadable(t: torch.Tensor) -> bool:
    """True where Python cannot read ``t``'s values: a tensor batched by ``vmap`` (at any level
    of its functorch wrappers), a meta tensor, or any tensor while ``torch.compile`` traces.
    A plain tensor used inside a transform (a k or epsilon closed over) stays readable."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return True
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            return True
        t = _functorch.get_unwrapped(t)
    return False


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its functorch wrappers (batched, grad or dual levels).

    The result holds every vmapped slice at once, in some layout: use it for reductions (any,
    sum, max), never for a value that is returned.
    """
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def vmap_rows(function: Any, info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    """The ``vmap`` staticmethod of a row-wise ``autograd.Function``, or the vmap rule of a
    row-wise operator (``function`` is then the operator, called as is).

    Every tensor argument of ``function.apply`` must lead with the row dimension B; non-tensor
    arguments (solver settings) pass through. Batched tensors have their vmapped dimension moved
    in front of B and merged with it; tensors that are not batched are expanded to every slice.
    Tensor outputs, which also lead with B, are split back into (batch_size, B, ...) with
    ``out_dims`` 0; non-tensor outputs (iteration counts) are returned once, with ``out_dims``
    None, and hold the value of the merged call.

    Use it as ``vmap = staticmethod(functools.partial(vmap_rows, ThisFunction))``-like glue::

        @staticmethod
        def vmap(info, in_dims, *args):
            return vmap_rows(ThisFunction, info, in_dims, *args)
    """
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
