"""The sort family's public API: exports, empty input, dispatch, per-row epsilon."""

from __future__ import annotations

import pytest
import torch

import softops
from softops import soft_quantile, soft_rank, soft_sort

F64 = torch.float64


def _backend(method: str):
    return pytest.importorskip(f"softops.sort._{method}")


def test_exports():
    for name in ("soft_sort", "soft_rank", "soft_argsort", "soft_quantile"):
        assert name in softops.__all__ and callable(getattr(softops, name))
    for name in ("SoftSort", "SoftRank", "SoftArgsort", "SoftQuantile"):
        assert name in softops.nn.__all__


# Errors, shapes for every dim, dtypes, hard limits and straight-through argsort: see the
# registry-driven tests/test_sort_contract.py.


# ------------------------------------------------------------------------------ shapes, dims


def test_empty_batch_and_single_entry():
    x = torch.randn(0, 4)
    assert soft_sort(x).shape == (0, 4) and soft_rank(x).shape == (0, 4)
    assert soft_quantile(x, torch.tensor([0.1, 0.2])).shape == (2, 0)
    one = torch.tensor([[2.5]])
    assert soft_sort(one).item() == 2.5 and soft_rank(one).item() == 1.0
    assert soft_quantile(one, 0.3).item() == 2.5


def test_quantile_ot_dispatch():
    ot = _backend("ot")
    x = torch.randn(3, 6, dtype=F64)
    q = torch.tensor([0.2, 0.7], dtype=F64)
    out = soft_quantile(x, q, epsilon=0.1, method="ot")
    assert out.shape == (2, 3)
    eps = torch.full((3,), 0.1, dtype=F64)
    torch.testing.assert_close(out, ot.quantile(x, q, eps).T)


def test_per_row_epsilon_broadcasts_over_the_batch():
    x = torch.randn(2, 3, 6, dtype=F64)
    eps = torch.tensor([[0.5], [2.0]], dtype=F64)  # (2, 1) against the batch shape (2, 3)
    y = soft_rank(x, epsilon=eps)
    torch.testing.assert_close(y[1], soft_rank(x[1], epsilon=2.0))
    with pytest.raises(ValueError, match="broadcastable"):
        soft_rank(x, epsilon=torch.ones(4, dtype=F64))
