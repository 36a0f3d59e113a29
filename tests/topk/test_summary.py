"""softops.topk.solve_ot_rows / solve_sparse_rows: the threshold solves of rows known by a
summary and a reduction (what softops.distributed runs with an all-reduce: tests/distributed
checks the sharded ops). With the whole row and the identity reduction they are the
single-process ops, on either start (the row's largest entries, or a strided subsample)."""

from __future__ import annotations

import math

import pytest
import torch

import softops
from softops.topk import RowSummary, row_stats, solve_ot_rows, solve_sparse_rows
from tests._helpers import seeded

F64 = torch.float64


def _summary(x: torch.Tensor, k_max: float, exact: bool) -> RowSummary:
    """The summary of whole rows: their k_max + 1 largest, or a stride-3 subsample."""
    st = row_stats(x)
    if exact:
        depth = math.floor(k_max) + 1
        cand, ns = x.topk(depth, dim=-1).values.to(F64), 0
    else:
        depth, cand = 0, x[:, ::3].to(F64)
        ns = cand.shape[1]
    return RowSummary(*st.unbind(-1), cand, exact, depth, ns)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("method", ["ot", "sparse"])
def test_whole_rows_with_the_identity_reduction_are_the_single_process_op(exact, method):
    g = seeded(3)
    x = torch.randn(5, 40, generator=g, dtype=F64)
    x[1, 3] = math.inf
    x[2, 7] = -math.inf
    k = torch.tensor([1.0, 3.0, 2.5, 10.0, 39.0], dtype=F64)
    eps = torch.tensor([0.1, 1.0, 0.01, 0.3, 2.0], dtype=F64)
    ref = softops.soft_topk_mask(x, k, epsilon=eps, method=method)
    rows = _summary(x, float(k.max()), exact)
    if method == "ot":
        sol = solve_ot_rows(
            x, k, eps, rows, n=40, k_max=float(k.max()), eps_max=2.0, max_iter=100, tol=0.0
        )
        assert bool(sol.converged.all())
        out = sol.A
    else:
        out, converged = solve_sparse_rows(
            x, k, eps, rows, n=40, k_max=float(k.max()), max_iter=100
        )
        assert bool(converged.all())
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
