"""soft_topk_mask(method="sinkhorn"): the paper's algorithm on the same problem as "ot"."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

from softops import soft_topk_mask
from softops.bench.references import unrolled_sinkhorn_topk_mask

F64 = torch.float64


@pytest.mark.parametrize(
    ("n", "k", "eps"), [(10, 3, 0.5), (200, 20, 0.1), (200, 199, 0.3), (1000, 10, 1.0)]
)
def test_agrees_with_ot_at_convergence(n, k, eps):
    x = torch.randn(4, n, dtype=F64)
    A = soft_topk_mask(x, k, epsilon=eps, method="sinkhorn")
    torch.testing.assert_close(A, soft_topk_mask(x, k, epsilon=eps), atol=1e-6, rtol=0)
    torch.testing.assert_close(A.sum(-1), torch.full((4,), float(k), dtype=F64), atol=1e-6, rtol=0)


def test_gradient_agrees_with_ot_and_gradcheck():
    x = torch.randn(3, 12, dtype=F64, requires_grad=True)
    g = torch.randn(3, 12, dtype=F64)
    (gs,) = torch.autograd.grad(soft_topk_mask(x, 4, epsilon=0.4, method="sinkhorn"), x, g)
    (go,) = torch.autograd.grad(soft_topk_mask(x, 4, epsilon=0.4), x, g)
    torch.testing.assert_close(gs, go, atol=1e-7, rtol=0)
    assert gradcheck(lambda x: soft_topk_mask(x, 4, epsilon=0.4, method="sinkhorn"), (x,))


def test_paper_fixed_iterations_equal_unrolled_sinkhorn():
    # max_iter=200, tol=0 runs exactly the paper's 200 iterations (not necessarily converged).
    x = torch.randn(2, 30, dtype=F64)
    A = soft_topk_mask(x, 5, epsilon=0.05, method="sinkhorn", max_iter=200, tol=0)
    ref = unrolled_sinkhorn_topk_mask(x, 5, 0.05, n_iter=200)
    torch.testing.assert_close(A, ref, atol=1e-9, rtol=0)


def test_rows_independent_nan_and_infinities():
    x = torch.randn(4, 9, dtype=F64)
    A = soft_topk_mask(x, 3, epsilon=0.2, method="sinkhorn")
    x2 = x.clone()
    x2[0] *= 100
    x2[1, 2] = math.nan
    x2[2, 0], x2[2, 5] = math.inf, -math.inf
    B = soft_topk_mask(x2, 3, epsilon=0.2, method="sinkhorn")
    torch.testing.assert_close(B[3], A[3], atol=1e-12, rtol=0)
    assert bool(torch.isnan(B[1]).all())
    assert B[2, 0] == 1 and B[2, 5] == 0
    torch.testing.assert_close(B[2], soft_topk_mask(x2[2], 3, epsilon=0.2), atol=1e-6, rtol=0)


def test_float32_and_errors():
    x = torch.randn(2, 50)
    A = soft_topk_mask(x, 5, epsilon=0.1, method="sinkhorn")
    assert A.dtype == torch.float32
    torch.testing.assert_close(A, soft_topk_mask(x, 5, epsilon=0.1), atol=1e-4, rtol=0)
    k = torch.tensor(2.0, requires_grad=True)
    with pytest.raises(
        ValueError, match=r"expected a `k` that does not require grad with method='sinkhorn'"
    ):
        soft_topk_mask(x, k, method="sinkhorn")
    with pytest.raises(ValueError, match=r"expected a scalar `k` with method=.*method='ot'"):
        soft_topk_mask(x, torch.tensor([1.0, 2.0]), method="sinkhorn")
