"""The solver defaults and the one non-convergence warning (softops._core.convergence)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import softops
from softops._core.convergence import (
    SINKHORN_MAX_ITER,
    ConvergenceWarning,
    default_tol,
    warn_not_converged,
)

F64 = torch.float64


def test_defaults():
    assert default_tol(F64) == 1e-9
    assert default_tol(torch.float32) == default_tol(torch.float16) == 1e-6
    assert SINKHORN_MAX_ITER == 2000
    assert issubclass(ConvergenceWarning, UserWarning)
    assert softops.ConvergenceWarning is ConvergenceWarning


def test_warns_only_for_finite_unconverged_rows():
    conv = torch.tensor([True, False, False])
    res = torch.tensor([0.0, 0.5, math.nan])
    with pytest.warns(
        ConvergenceWarning,
        match=r"^op: 1 of 3 rows did not converge within max_iter=3 \(tol=0.1, worst residual "
        r"0.5\); the result and its gradient are approximate",
    ):
        warn_not_converged("op", conv, 3, residual=res, tol=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # a NaN row is NaN by contract; tol=0 asks for exactly max_iter iterations
        warn_not_converged("op", torch.tensor([False]), 3, residual=torch.tensor([math.nan]), tol=1)
        warn_not_converged("op", torch.tensor([False]), 3, residual=torch.tensor([0.5]), tol=0.0)
        warn_not_converged("op", torch.tensor([True, True]), 3)
    with pytest.warns(ConvergenceWarning, match=r"^op: 2 of 2 rows did not converge within"):
        warn_not_converged("op", torch.tensor([False, False]), 3)


ROUTES = {
    "ot": lambda x: softops.soft_topk_mask(x, 5, epsilon=0.5, max_iter=1),
    "sinkhorn": lambda x: softops.soft_topk_mask(
        x, 5, method="sinkhorn", epsilon=1e-4, max_iter=3, tol=1e-30
    ),
    "soft_topk": lambda x: softops.soft_topk(x, 5, epsilon=0.05, max_iter=5, tol=1e-30),
    "sort-ot": lambda x: softops.soft_sort(x, method="ot", epsilon=0.1, max_iter=3, tol=1e-30),
    "rank-ot": lambda x: softops.soft_rank(x, method="ot", epsilon=0.1, max_iter=3, tol=1e-30),
}


@pytest.mark.parametrize("route", ROUTES)
def test_one_category_attributed_to_the_callers_line(route):
    """Every solver route warns with one category, and the warning names this file's line."""
    x = torch.randn(4, 40, dtype=F64, generator=torch.Generator().manual_seed(3)) * 10
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ROUTES[route](x)
    caught = [w for w in record if issubclass(w.category, ConvergenceWarning)]
    assert len(caught) == 1, [str(w.message) for w in record]
    assert caught[0].filename == __file__
