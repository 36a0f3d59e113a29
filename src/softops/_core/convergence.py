"""Solver defaults and the one non-convergence warning, shared by every iterative method.

:func:`warn_not_converged` issues :class:`ConvergenceWarning` once per call, attributed to the
first frame outside softops and torch: the user's line, whatever route the call took.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

from softops._core.transforms import plain

__all__ = [
    "SINKHORN_MAX_ITER",
    "ConvergenceWarning",
    "default_tol",
    "warn_not_converged",
]

SINKHORN_MAX_ITER = 2000
"""Default cap on Sinkhorn iterations (the sorted top-k, method="sinkhorn", OT sort, solvers)."""

_SOFTOPS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class ConvergenceWarning(UserWarning):
    """An iterative solver stopped at ``max_iter`` before reaching its tolerance.

    The result and its gradient are approximate. Filter it with
    ``warnings.simplefilter("ignore", softops.ConvergenceWarning)``.
    """


def default_tol(dtype: torch.dtype) -> float:
    """The default relative L1 marginal tolerance of Sinkhorn in the compute dtype ``dtype``."""
    return 1e-9 if dtype == torch.float64 else 1e-6


def _caller_stacklevel() -> int:
    """The ``stacklevel``, counted from :func:`warn_not_converged` (level 1), of the first frame
    outside softops and torch."""
    frame = sys._getframe(1)  # warn_not_converged
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(
        (_SOFTOPS_DIR, _TORCH_DIR)
    ):
        frame = frame.f_back
        level += 1
    return level


def warn_not_converged(
    op: str,
    converged: torch.Tensor,
    max_iter: int,
    *,
    residual: torch.Tensor | None = None,
    tol: float | None = None,
) -> None:
    """Warn once per call when some rows stopped at ``max_iter`` without converging (never with
    ``tol=0``, nor for rows whose ``residual`` is not finite)."""
    if tol is not None and tol <= 0:
        return
    converged = plain(converged)
    if residual is not None:
        residual = plain(residual)
    if converged.device.type == "meta":  # shape inference: there is nothing to report
        return
    bad = ~converged
    if residual is not None:
        bad = bad & torch.isfinite(residual)
    if not bool(bad.any()):
        return
    detail = ""
    if residual is not None:
        worst = residual[bad].max().item()
        detail = f" (tol={tol:g}, worst residual {worst:.3g})" if tol is not None else ""
    warnings.warn(
        f"{op}: {int(bad.sum())} of {bad.numel()} rows did not converge within "
        f"max_iter={max_iter}{detail}; the result and its gradient are approximate. Increase "
        "`max_iter` or `epsilon`.",
        ConvergenceWarning,
        stacklevel=_caller_stacklevel(),
    )
