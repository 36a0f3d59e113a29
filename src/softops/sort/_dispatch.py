r"""The sort family's wiring: which method serves which op, its options, and quantile interpolation.

``METHODS`` maps a method name to its backend module, each with the one signature
``sort/rank/argsort(x2, eps, descending, opts, offset=None)`` on canonical rows: ``x2`` (B, n)
float32 or float64, ``eps`` (B,) positive, ``opts`` a :class:`MethodOptions`, ``offset`` an
optional (B,) shift of the rank positions (``softops.sort._limits``); no validation; a NaN gives
NaN in its own row, an infinity NaN too but for "pav" (the public layer takes it to its limit,
through a backend's ``masked(kind, x2, eps, descending, opts)`` where it cannot branch). "pav"
has no ``argsort``; :func:`interpolate` reads every quantile off the soft sort.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from softops._core.convergence import SINKHORN_MAX_ITER
from softops._core.validation import check_choice, check_max_iter, check_tol, check_unused
from softops.sort import _neuralsort, _ot, _pav, _softsort
from softops.sort._options import MethodOptions

__all__ = [
    "ARGSORT_METHODS",
    "DISTANCES",
    "METHODS",
    "QUANTILE_METHODS",
    "REGULARIZATIONS",
    "SORT_METHODS",
    "MethodOptions",
    "check_options",
    "interpolate",
]

METHODS: dict[str, ModuleType] = {
    "pav": _pav,
    "softsort": _softsort,
    "neuralsort": _neuralsort,
    "ot": _ot,
}
"""Method name -> backend module (``sort``/``rank``/``argsort`` with the one signature)."""

SORT_METHODS = ("pav", "softsort", "neuralsort", "ot")
"""The methods of ``soft_sort`` and ``soft_rank``."""
ARGSORT_METHODS = ("softsort", "neuralsort", "ot")
"""The methods of ``soft_argsort`` ("pav" has no permutation matrix)."""
QUANTILE_METHODS = ("pav", "ot")
"""The methods of ``soft_quantile``."""
REGULARIZATIONS = ("l2", "kl")
"""``regularization`` of "pav"."""
DISTANCES = ("l1", "l2")
"""``distance`` of "softsort"."""

_KIND_METHODS = {
    "sort": SORT_METHODS,
    "rank": SORT_METHODS,
    "argsort": ARGSORT_METHODS,
    "quantile": QUANTILE_METHODS,
}
# The optional arguments each method uses (their defaults: MethodOptions', the public ones).
_USES = {
    "pav": ("regularization",),
    "softsort": ("distance",),
    "neuralsort": (),
    "ot": ("max_iter", "tol"),
}
_DEFAULTS: dict[str, Any] = MethodOptions()._asdict()


def check_options(
    op: str,
    method: str,
    kind: str,
    *,
    regularization: str = "l2",
    distance: str = "l1",
    max_iter: int | None = None,
    tol: float | None = None,
) -> MethodOptions:
    """Check ``method`` for ``kind`` ("sort", "rank", "argsort" or "quantile") and its options,
    unused ones at their defaults; errors open with ``op``. Accepted arguments are remembered (an
    LRU cache, per value and type), so a repeated call skips the checks."""
    args = (op, method, kind, regularization, distance, max_iter, tol)
    try:
        hash(args)
    except TypeError:  # (an unhashable argument, refused by the checks or not: checked as is)
        return _check_options(*args)
    return _checked_options(*args)


def _check_options(
    op: str,
    method: str,
    kind: str,
    regularization: str,
    distance: str,
    max_iter: int | None,
    tol: float | None,
) -> MethodOptions:
    check_choice(kind, _KIND_METHODS, op, "kind")
    if kind == "argsort" and method == "pav":
        raise ValueError(
            f"{op}: expected `method` to be one of {ARGSORT_METHODS} (method='pav' has no "
            f"permutation matrix: it projects onto the permutahedron); got method={method!r}."
        )
    check_choice(method, _KIND_METHODS[kind], op, "method")
    given = {
        "regularization": regularization,
        "distance": distance,
        "max_iter": max_iter,
        "tol": tol,
    }
    uses = _USES[method]
    check_unused(op, method, _DEFAULTS, **{k: v for k, v in given.items() if k not in uses})
    if "regularization" in uses:
        check_choice(regularization, REGULARIZATIONS, op, "regularization")
    if "distance" in uses:
        check_choice(distance, DISTANCES, op, "distance")
    if "max_iter" in uses and max_iter is not None:
        check_max_iter(max_iter, SINKHORN_MAX_ITER, op)
    if "tol" in uses and tol is not None:
        tol = check_tol(tol, 0.0, op)
    return MethodOptions(regularization, distance, max_iter, tol, op)


_checked_options = functools.lru_cache(maxsize=256, typed=True)(_check_options)
"""``_check_options`` remembered for hashable arguments (``check_options``)."""


def interpolate(values: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r"""``torch.quantile``'s linear interpolation of ascending rows ``values`` (B, n) at q (m,),
    (B, m); infinite neighbours as limits (module docstring of :mod:`softops.sort`)."""
    n = values.shape[-1]
    h = q.to(values.dtype) * (n - 1)
    lo = h.detach().floor().clamp(0, n - 1).long()
    hi = (lo + 1).clamp(max=n - 1)
    frac = h - lo.to(h.dtype)
    v_lo, v_hi = values[:, lo], values[:, hi]
    finite = torch.isfinite(v_lo) & torch.isfinite(v_hi)
    a = torch.where(finite, v_lo, 0.0)
    b = torch.where(finite, v_hi, 0.0)
    # b - a overflows on a row spanning more than the dtype's range (bf16 +-3.4e38 in float32):
    # there the convex combination, whose terms stay in range (the double where keeps the
    # overflowed difference out of the backward)
    d = b - a
    ok = torch.isfinite(d)
    lin = torch.where(ok, a + frac * torch.where(ok, d, 0.0), a * (1 - frac) + b * frac)
    return torch.where(finite, lin, torch.where(frac == 0, v_lo, v_lo + v_hi))
