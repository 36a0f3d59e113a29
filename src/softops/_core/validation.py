"""Argument checks shared by every public op.

Every message follows ``"<op>: expected <what>; got <value>."`` so that users see both the contract
and what they passed. Nothing here imports from the rest of softops.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Iterable
from typing import Any

import torch

from softops._core.transforms import cannot_branch, unreadable

__all__ = [
    "SMALLEST_K",
    "as_number",
    "check_bool",
    "check_choice",
    "check_dim",
    "check_epsilon",
    "check_floating",
    "check_k",
    "check_max_iter",
    "check_nonempty",
    "check_positive_int",
    "check_q",
    "check_tol",
    "check_unused",
    "compute_dtype",
    "describe",
    "is_integral",
    "smallest_epsilon",
]


def as_number(value: Any) -> Any:
    """``value`` as a Python int or float when it is a real number (numpy's scalars and 0-dim
    arrays included, numpy not imported), else unchanged (bools too), for the caller to refuse."""
    kind = type(value)
    if kind is float or kind is int or kind is bool or kind is torch.Tensor:  # (the usual case)
        return value
    if isinstance(value, (bool, torch.Tensor)):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        item = value.item()  # a 0-dim array, or a numpy scalar: its Python value
        return item if isinstance(item, (int, float)) and not isinstance(item, bool) else value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def check_floating(x: Any, op: str, name: str = "x") -> torch.Tensor:
    """Return ``x`` if it is a real floating-point tensor, else raise ``TypeError``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected `{name}` to be a torch.Tensor; got {type(x).__name__}.")
    if not x.dtype.is_floating_point or x.is_complex():
        raise TypeError(
            f"{op}: expected `{name}` to have a real floating dtype (float16, bfloat16, float32 or "
            f"float64); got dtype={x.dtype}."
        )
    return x


def check_real(x: Any, op: str, name: str) -> torch.Tensor:
    """Return ``x`` if it is a tensor of a real floating or integer dtype (targets, relevance),
    else raise ``TypeError``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected `{name}` to be a torch.Tensor; got {type(x).__name__}.")
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(
            f"{op}: expected `{name}` to have a real floating or integer dtype; "
            f"got dtype={x.dtype}."
        )
    return x


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in: float16 and bfloat16 are promoted to float32."""
    known = _COMPUTE.get(dtype)
    return torch.promote_types(dtype, torch.float32) if known is None else known


_COMPUTE = {t: torch.promote_types(t, torch.float32) for t in (torch.float32, torch.float64)}
_COMPUTE.update({torch.float16: torch.float32, torch.bfloat16: torch.float32})


def check_dim(x: torch.Tensor | None, dim: Any, op: str) -> int:
    """Normalise ``dim`` to a non-negative int for ``x``, or raise (``x=None``: the type only)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: expected `dim` to be an int; got {dim!r}.")
    if x is None:
        return dim
    ndim = x.dim()
    if ndim == 0:
        raise ValueError(f"{op}: expected `x` with at least 1 dimension; got a 0-dim tensor.")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{op}: expected `dim` in [{-ndim}, {ndim - 1}] for x of shape {tuple(x.shape)}; "
            f"got dim={dim}."
        )
    return dim % ndim


def check_nonempty(x: torch.Tensor, dim: int, op: str) -> int:
    """Return ``x.shape[dim]``; raise if it is 0."""
    n = x.shape[dim]
    if n == 0:
        raise ValueError(
            f"{op}: expected a non-empty `dim`; got x.shape[{dim}] = 0 (x.shape={tuple(x.shape)})."
        )
    return n


def smallest_epsilon(dtype: torch.dtype) -> float:
    """The smallest epsilon an op on an x of ``dtype`` accepts: ``finfo.tiny`` of x's compute
    dtype (a subnormal epsilon's rounding exceeds the dtype's relative rounding)."""
    tiny = _TINY.get(dtype)
    return torch.finfo(compute_dtype(dtype)).tiny if tiny is None else tiny


_TINY = {t: torch.finfo(compute_dtype(t)).tiny for t in _COMPUTE}


def _epsilon_error(op: str, name: str, value: float, dtype: torch.dtype | None) -> ValueError:
    if dtype is not None and value > 0 and math.isfinite(value):
        cd = compute_dtype(dtype)
        where = "" if cd == dtype else f", the compute dtype of x of dtype {_name(dtype)}"
        return ValueError(
            f"{op}: expected `{name}` >= {smallest_epsilon(dtype):.8g} (the smallest normal "
            f"{_name(cd)}{where}; a smaller epsilon is subnormal or 0 there); got {name}={value!r}."
        )
    return ValueError(f"{op}: expected `{name}` > 0 and finite; got {name}={value}.")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_epsilon(
    epsilon: Any, op: str, name: str = "epsilon", *, dtype: torch.dtype | None = None
) -> float | torch.Tensor:
    """Check that ``epsilon`` is a positive finite float or a floating tensor with positive
    entries, at least :func:`smallest_epsilon` of ``dtype`` where given; tensors eagerly only."""
    tiny = 0.0 if dtype is None else smallest_epsilon(dtype)
    if isinstance(epsilon, torch.Tensor):
        if not epsilon.dtype.is_floating_point:
            raise TypeError(
                f"{op}: expected `{name}` to be a float or a floating tensor; "
                f"got a tensor of dtype={epsilon.dtype}."
            )
        if epsilon.numel() == 0:
            raise ValueError(f"{op}: expected a non-empty `{name}`; got an empty tensor.")
        if cannot_branch(epsilon):
            return epsilon
        e = epsilon.detach()
        bad = ~(e > 0) | ~torch.isfinite(e)
        if tiny:
            bad |= e < tiny
        if bool(bad.any()):
            raise _epsilon_error(op, name, e[bad].flatten()[0].item(), dtype)
        return epsilon
    epsilon = as_number(epsilon)
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise TypeError(f"{op}: expected `{name}` to be a float or a tensor; got {epsilon!r}.")
    if not (epsilon > 0 and math.isfinite(epsilon)) or _held(epsilon, tiny) < tiny:
        raise _epsilon_error(op, name, epsilon, dtype)
    return float(epsilon)


def _held(value: float, tiny: float) -> float:
    """``value`` as the compute dtype holds it, near ``tiny`` (a Python float just below float32's
    smallest normal number can round to it: then it is that number, and accepted)."""
    if value < tiny and tiny == _F32_TINY:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    return value


_F32_TINY = torch.finfo(torch.float32).tiny


SMALLEST_K = torch.finfo(torch.float32).tiny
"""Where x's dtype is not known (a layer's check at construction), a k below this (the smallest
normal float32) is its limit k -> 0."""


def check_k(
    k: Any,
    n: int | None,
    op: str,
    *,
    low: float = 0,
    integer: bool = False,
    allow_tensor: bool = True,
    dtype: torch.dtype | None = None,
) -> float | torch.Tensor:
    """Check ``low <= k <= n`` (``n=None``: ``k >= low``) for an int, a float (unless
    ``integer``) or a tensor (eagerly). A k below the compute dtype's smallest normal number is
    its limit k -> 0 and returned as 0 (a tensor's gradient passes through)."""
    what = "an int" if integer else "a number"
    high = math.inf if n is None else n
    smallest = SMALLEST_K if dtype is None else torch.finfo(compute_dtype(dtype)).tiny

    def out_of_range(value: str) -> ValueError:
        if n is None:
            return ValueError(f"{op}: expected `k` >= {low:g}; got k={value}.")
        return ValueError(f"{op}: expected {low:g} <= `k` <= x.shape[dim] (= {n}); got k={value}.")

    if isinstance(k, torch.Tensor):
        if k.dtype == torch.bool or k.is_complex():
            raise TypeError(f"{op}: expected `k` to be {what}; got a tensor of dtype={k.dtype}.")
        if not allow_tensor or integer:
            if k.numel() == 1 and not k.requires_grad and not k.dtype.is_floating_point:
                k = int(k.item())
            else:
                raise TypeError(f"{op}: expected `k` to be {what}; got a tensor {k!r}.")
        else:
            if cannot_branch(k) or not k.numel():
                return k
            kd = k.detach()
            bad = ~((kd >= low) & (kd <= high))
            tiny = (kd > 0) & (kd < smallest)
            any_bad, any_tiny = torch.stack((bad.any(), tiny.any())).tolist()  # one sync
            if any_bad:
                raise out_of_range(f"{kd[bad].flatten()[0].item():g}")
            if any_tiny:
                k = torch.where(tiny, k - kd, k)  # 0, with the gradient of k
            return k
    k = as_number(k)
    if isinstance(k, bool) or not isinstance(k, (int, float)):
        raise TypeError(f"{op}: expected `k` to be {what}; got {k!r}.")
    if integer and not float(k).is_integer():
        raise TypeError(f"{op}: expected `k` to be an int; got k={k!r}.")
    if not (low <= k <= high):
        raise out_of_range(repr(k))
    if integer:
        return int(k)
    return 0.0 if 0 < k < smallest else k


def check_bool(value: Any, op: str, name: str) -> bool:
    """Return ``value`` if it is a bool, else raise ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: expected `{name}` to be a bool; got {name}={value!r}.")
    return value


def check_choice(value: Any, choices: Iterable[str], op: str, name: str) -> str:
    """Check that ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{op}: expected `{name}` to be one of {choices}; got {name}={value!r}.")
    return value


def check_positive_int(value: Any, op: str, name: str, default: int | None = None) -> int:
    """``None`` means ``default`` (when one is given); otherwise an int >= 1."""
    if value is None and default is not None:
        return default
    value = as_number(value)
    if isinstance(value, bool) or not isinstance(value, int):
        what = "a positive int or None" if default is not None else "a positive int"
        raise TypeError(f"{op}: expected `{name}` to be {what}; got {name}={value!r}.")
    if value < 1:
        raise ValueError(f"{op}: expected `{name}` >= 1; got {name}={value!r}.")
    return value


def check_max_iter(max_iter: Any, default: int, op: str) -> int:
    """``None`` means ``default``; otherwise a positive int (the one ``max_iter`` check)."""
    return check_positive_int(max_iter, op, "max_iter", default)


def check_tol(tol: Any, default: float, op: str) -> float:
    """``None`` means ``default``; otherwise a float >= 0 (0 runs exactly ``max_iter`` steps)."""
    if tol is None:
        return default
    tol = as_number(tol)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise TypeError(f"{op}: expected `tol` to be a float >= 0 or None; got tol={tol!r}.")
    if not tol >= 0:
        raise ValueError(f"{op}: expected `tol` >= 0 or None; got tol={tol!r}.")
    return float(tol)


def check_unused(
    op: str, method: str, defaults: dict[str, Any] | None = None, **kwargs: Any
) -> None:
    """The one unused-argument rule: an argument that ``method`` does not use must be left at its
    default (None unless ``defaults`` says otherwise); anything else raises ``ValueError``."""
    defaults = defaults or {}
    for name, value in kwargs.items():
        default = defaults.get(name)
        at_default = value is default or (isinstance(value, str) and value == default)
        if not at_default:
            raise ValueError(
                f"{op}: expected `{name}` to be left at its default {default!r} (method="
                f"{method!r} does not use it); got {name}={value!r}."
            )


def check_q(q: Any, op: str, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """q as a 0-dim or 1-D tensor of ``dtype``, with every entry in [0, 1]."""
    if isinstance(q, torch.Tensor):
        if not q.dtype.is_floating_point:
            raise TypeError(f"{op}: expected `q` to be a float or a floating tensor; got {q!r}.")
        if q.dim() > 1:
            raise ValueError(
                f"{op}: expected `q` to be a float or a 0-dim or 1-D tensor; got q of shape "
                f"{tuple(q.shape)}."
            )
        qd = q.detach()
        bad = ~((qd >= 0) & (qd <= 1))
        if not cannot_branch(qd) and bool(bad.any()):  # eagerly only, as for epsilon
            raise ValueError(f"{op}: expected 0 <= `q` <= 1; got q={qd[bad].flatten()[0].item()}.")
        return q.to(dtype=dtype, device=device)
    q = as_number(q)
    if isinstance(q, bool) or not isinstance(q, (int, float)):
        raise TypeError(f"{op}: expected `q` to be a float or a tensor; got {q!r}.")
    if not 0 <= q <= 1:
        raise ValueError(f"{op}: expected 0 <= `q` <= 1; got q={q!r}.")
    return torch.tensor(float(q), dtype=dtype, device=device)


def check_row_counts(counts: torch.Tensor, minimum: int, op: str, what: str) -> None:
    """Raise ``ValueError`` naming the first row whose count (``counts`` (B,)) is below
    ``minimum``; nothing where the counts cannot be read."""
    if not counts.numel() or unreadable(counts):
        return
    short = counts < minimum
    if bool(short.any()):
        row = int(short.nonzero()[0, 0])
        raise ValueError(
            f"{op}: every row needs at least {minimum} {what}; row {row} has {int(counts[row])}."
        )


def is_integral(k: Any) -> bool:
    """Whether every value of ``k`` (a number or a tensor) is a whole number."""
    if isinstance(k, torch.Tensor):
        kd = k.detach()
        return bool((kd == kd.round()).all())
    return float(k).is_integer()


def describe(k: Any) -> str:
    """``k`` for an error message: its value, or the shape of a non-scalar tensor."""
    if isinstance(k, torch.Tensor):
        return f"tensor of shape {tuple(k.shape)}" if k.dim() else f"{float(k):g}"
    return f"{k!r}"
