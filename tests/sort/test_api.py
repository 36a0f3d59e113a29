"""The sort family's public API: exports, empty input, dispatch, per-row epsilon."""

from __future__ import annotations

import pytest
import torch

import softops
import softops.sort
from softops import soft_argsort, soft_quantile, soft_rank, soft_sort
from softops.sort import _dispatch, _ot
from softops.sort._dispatch import interpolate
from softops.sort._options import MethodOptions

F64 = torch.float64


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
    x = torch.randn(3, 6, dtype=F64)
    q = torch.tensor([0.2, 0.7], dtype=F64)
    out = soft_quantile(x, q, epsilon=0.1, method="ot")
    assert out.shape == (2, 3)
    eps = torch.full((3,), 0.1, dtype=F64)
    values = _ot.sort(x, eps, False, MethodOptions(op="soft_quantile"))
    torch.testing.assert_close(out, interpolate(values, q).T)


def test_method_tuples_importable_from_softops_sort():
    for name in ("SORT_METHODS", "ARGSORT_METHODS", "QUANTILE_METHODS", "REGULARIZATIONS"):
        assert getattr(softops.sort, name) is getattr(_dispatch, name)
    assert softops.sort.DISTANCES is _dispatch.DISTANCES
    assert softops.sort.SORT_METHODS == ("pav", "softsort", "neuralsort", "ot")


@pytest.mark.parametrize("method", ["pav", "softsort", "neuralsort", "ot"])
def test_each_op_calls_its_backend(method, monkeypatch):
    """soft_sort/soft_rank/soft_argsort reach METHODS[method].<kind> with the one signature."""
    backend = _dispatch.METHODS[method]
    calls = []
    for kind in ("sort", "rank", "argsort"):
        if not hasattr(backend, kind):
            continue
        real = getattr(backend, kind)

        def spy(x2, eps, descending, opts, offset=None, kind=kind, real=real):
            calls.append((kind, x2.shape, eps.shape, descending, opts))
            return real(x2, eps, descending, opts, offset)

        monkeypatch.setattr(backend, kind, spy)
    x = torch.randn(2, 3, 4, dtype=F64)
    soft_sort(x, method=method, descending=True)
    soft_rank(x, method=method, dim=1)
    if method != "pav":
        soft_argsort(x, method=method)
    kinds = [c[0] for c in calls]
    assert kinds == (["sort", "rank"] if method == "pav" else ["sort", "rank", "argsort"])
    assert calls[0][1:4] == ((6, 4), (6,), True)
    assert calls[1][1] == (8, 3)  # dim=1 moved last
    assert all(isinstance(c[4], MethodOptions) for c in calls)
    assert [c[4].op for c in calls][:2] == ["soft_sort", "soft_rank"]


def test_per_row_epsilon_broadcasts_over_the_batch():
    x = torch.randn(2, 3, 6, dtype=F64)
    eps = torch.tensor([[0.5], [2.0]], dtype=F64)  # (2, 1) against the batch shape (2, 3)
    y = soft_rank(x, epsilon=eps)
    torch.testing.assert_close(y[1], soft_rank(x[1], epsilon=2.0))
    with pytest.raises(ValueError, match="broadcastable"):
        soft_rank(x, epsilon=torch.ones(4, dtype=F64))
