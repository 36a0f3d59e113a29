"""The argument checks and row predicates that every method of ``soft_topk_mask`` shares.

``check_mask_options`` validates everything but ``x`` and ``k``, so that ``soft_topk_mask`` and
``softops.nn.SoftTopKMask`` (at construction, under its own name) apply one copy of each rule.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from softops._core.convergence import SINKHORN_MAX_ITER, default_tol
from softops._core.transforms import unreadable
from softops._core.validation import (
    check_bool,
    check_choice,
    check_epsilon,
    check_k,
    check_max_iter,
    check_positive_int,
    check_tol,
    check_unused,
    describe,
    is_integral,
)

__all__ = [
    "MASK_METHODS",
    "PERTURBED_DEFAULT_SAMPLES",
    "PER_ROW_K_METHODS",
    "THRESHOLD_MAX_ITER",
    "MaskOptions",
    "check_generator",
    "check_mask_k",
    "check_mask_options",
    "solver_defaults",
    "unreachable_rows",
]

MASK_METHODS = ("ot", "sinkhorn", "softkmax", "perturbed", "sparse")
THRESHOLD_MAX_ITER = 100
"""Default cap on the evaluations of the threshold solves, "ot" (3 to 6 typical) and "sparse"."""
PER_ROW_K_METHODS = ("ot", "sparse")
"""The methods that take a per-row tensor k (and give gradients in k and epsilon)."""
PERTURBED_DEFAULT_SAMPLES = 100
"""Noise draws of method="perturbed" when ``n_samples`` is None."""


class MaskOptions(NamedTuple):
    """What every backend of ``soft_topk_mask`` receives besides its rows, checked once (the
    defaults filled in; ``k_scalar``: k where it is a number; ``k_int``: k as a count)."""

    op: str
    max_iter: int = 0
    tol: float = 0.0
    k_scalar: float | None = None
    k_int: int = 0
    n_samples: int = PERTURBED_DEFAULT_SAMPLES
    generator: torch.Generator | None = None


def check_mask_options(
    op: str,
    method: Any,
    *,
    largest: Any = True,
    epsilon: Any = None,
    max_iter: Any = None,
    tol: Any = None,
    hard: Any = False,
    n_samples: Any = None,
    generator: Any = None,
) -> tuple[int | None, float | None, int | None]:
    """Check the options of a top-k mask for ``method``: ``(max_iter, tol, n_samples)`` (only
    ``n_samples`` defaulted); arguments ``method`` does not use must be left at None."""
    if epsilon is None and generator is None:
        try:  # plain values, their types in the key (1 == True): checked once per combination
            values = (method, largest, max_iter, tol, hard, n_samples)
            types = (type(method), type(largest), type(max_iter), type(tol), type(hard))
            return _options_once(op, values, (*types, type(n_samples)))
        except TypeError:  # (an unhashable value, or a type refused: checked below, and told)
            pass
    return _check_options(op, method, largest, epsilon, max_iter, tol, hard, n_samples, generator)


@functools.lru_cache(maxsize=64)
def _options_once(op: str, values: tuple[Any, ...], _: tuple[type, ...]) -> tuple[Any, ...]:
    method, largest, max_iter, tol, hard, n_samples = values
    return _check_options(op, method, largest, None, max_iter, tol, hard, n_samples, None)


def _check_options(op: str, method: Any, *args: Any) -> tuple[int | None, float | None, int | None]:
    largest, epsilon, max_iter, tol, hard, n_samples, generator = args
    check_choice(method, MASK_METHODS, op, "method")
    check_bool(largest, op, "largest")
    check_bool(hard, op, "hard")
    if epsilon is not None:  # the op checks it with x (prepare_rows); a layer checks it here
        check_epsilon(epsilon, op)
    if method != "perturbed":
        check_unused(op, method, n_samples=n_samples, generator=generator)
    if method in ("softkmax", "perturbed"):
        check_unused(op, method, max_iter=max_iter, tol=tol)
    elif method == "sparse":  # an exact finite solve: a cap, but no tolerance
        check_unused(op, method, tol=tol)
        check_max_iter(max_iter, 1, op)
    else:
        check_max_iter(max_iter, 1, op)
        check_tol(tol, 0.0, op)
    if method == "perturbed":
        n_samples = check_positive_int(n_samples, op, "n_samples", PERTURBED_DEFAULT_SAMPLES)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"{op}: expected `generator` to be a torch.Generator or None; got {generator!r}."
            )
    return max_iter, tol, n_samples


def check_mask_k(
    op: str,
    k: Any,
    n: int | None,
    method: str,
    *,
    hard: bool = False,
    epsilon: Any = None,
    dtype: torch.dtype | None = None,
) -> tuple[float | torch.Tensor, float | None]:
    """Check ``k`` for ``method``: ``(k, k_scalar)``, k_scalar its value when a number; a k or
    epsilon that requires grad where the method gives it none is refused, not ignored."""
    if type(k) in (int, float) and not isinstance(epsilon, torch.Tensor):
        return _number_k_once(op, k, type(k) is int, n, method, hard, dtype)  # (checked once)
    return _check_mask_k(op, k, n, method, hard, epsilon, dtype)


@functools.lru_cache(maxsize=256)
def _number_k_once(
    op: str, k: float, _: bool, n: int | None, method: str, hard: bool, dtype: torch.dtype | None
) -> tuple[float | torch.Tensor, float | None]:
    return _check_mask_k(op, k, n, method, hard, None, dtype)


def _check_mask_k(op: str, k: Any, *args: Any) -> tuple[float | torch.Tensor, float | None]:
    n, method, hard, epsilon, dtype = args
    k = check_k(k, n, op, dtype=dtype)
    k_scalar: float | None = None
    if not isinstance(k, torch.Tensor):
        k_scalar = k
    elif k.dim() != 0 and method not in PER_ROW_K_METHODS:
        raise ValueError(
            f"{op}: expected a scalar `k` with method={method!r} (a per-row k needs "
            f"method='ot' or 'sparse'); got k of shape {tuple(k.shape)}."
        )
    opaque = isinstance(k, torch.Tensor) and unreadable(k)
    if method in ("softkmax", "perturbed") and opaque:
        # their k is a count, read on the host
        raise ValueError(
            f"{op}: expected `k` as a number, or a plain tensor, with method={method!r} (it "
            "reads k's value); got a tensor batched by vmap, traced by torch.compile or on the "
            "meta device."
        )
    if hard and not opaque and not is_integral(k):
        raise ValueError(f"{op}: hard=True needs an integer k; got k={describe(k)}.")
    if method in ("softkmax", "perturbed") and not is_integral(k):
        raise ValueError(
            f"{op}: expected an integer `k` with method={method!r}; got k={describe(k)}."
        )
    no_grad = {"sinkhorn": ("k", "epsilon"), "softkmax": ("k",), "perturbed": ("k", "epsilon")}
    for name in no_grad.get(method, ()):
        value = k if name == "k" else epsilon
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise ValueError(
                f"{op}: expected a `{name}` that does not require grad with method={method!r} "
                "(use method='ot' or 'sparse' for gradients in k and epsilon); got one that does."
            )
    return k, k_scalar


def solver_defaults(
    method: str, max_iter: int | None, tol: float | None, dtype: torch.dtype
) -> tuple[int, float]:
    """``(max_iter, tol)`` with the documented defaults filled in; (0, 0.0) for the methods
    without a solver."""
    if method in ("softkmax", "perturbed"):
        return 0, 0.0
    if method in ("ot", "sparse"):
        return (THRESHOLD_MAX_ITER if max_iter is None else max_iter), (0.0 if tol is None else tol)
    return (
        SINKHORN_MAX_ITER if max_iter is None else max_iter,
        default_tol(dtype) if tol is None else tol,
    )


def check_generator(generator: torch.Generator | None, device: torch.device, op: str) -> None:
    """A generator must live on the device of x (the same index, when both name one)."""
    if generator is None:
        return
    gd = generator.device
    other_index = None not in (gd.index, device.index) and gd.index != device.index
    if gd.type != device.type or other_index:
        raise ValueError(
            f"{op}: expected `generator` on the device of x ({device}); got a generator on {gd}."
        )


def unreachable_rows(x2: torch.Tensor, k: torch.Tensor | float) -> torch.Tensor:
    """(B,) bool: the rows of x2 (B, n) that cannot hold their k entries (a NaN, more than k
    at ``+inf`` or fewer than k above ``-inf``): NaN by contract."""
    n_pinf = (x2 == math.inf).sum(-1)
    n_above = (x2 > -math.inf).sum(-1)
    return torch.isnan(x2).any(-1) | (n_pinf > k) | (n_above < k)
