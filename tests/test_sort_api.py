"""The sort family's public API: validation, dispatch, shapes, unused arguments, Modules."""

from __future__ import annotations

import re

import pytest
import torch

import softops
from softops import soft_argsort, soft_quantile, soft_rank, soft_sort

F64 = torch.float64


def _backend(method: str):
    return pytest.importorskip(f"softops.sort._{method}")


def test_exports():
    for name in ("soft_sort", "soft_rank", "soft_argsort", "soft_quantile"):
        assert name in softops.__all__ and callable(getattr(softops, name))
    for name in ("SoftSort", "SoftRank", "SoftArgsort", "SoftQuantile"):
        assert name in softops.nn.__all__


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("fn", [soft_sort, soft_rank])
def test_errors_sort_and_rank(fn):
    x = torch.randn(2, 5)
    op = fn.__name__
    with pytest.raises(ValueError, match=f"{op}.*method='bogus'"):
        fn(x, method="bogus")
    with pytest.raises(ValueError, match="regularization='l3'"):
        fn(x, regularization="l3")
    with pytest.raises(
        ValueError, match="`distance` is not used by method='pav'; got distance='l2'"
    ):
        fn(x, distance="l2")
    with pytest.raises(ValueError, match="`max_iter` is not used by method='pav'; got max_iter=5"):
        fn(x, max_iter=5)
    with pytest.raises(
        ValueError, match=re.escape("`tol` is not used by method='pav'; got tol=0.1")
    ):
        fn(x, tol=0.1)
    with pytest.raises(ValueError, match=re.escape("epsilon=0.0")):
        fn(x, epsilon=0.0)
    with pytest.raises(ValueError, match=re.escape("epsilon=-1.0")):
        fn(x, epsilon=torch.tensor([1.0, -1.0]))
    with pytest.raises(TypeError, match=re.escape("torch.int64")):
        fn(torch.arange(5))
    with pytest.raises(ValueError, match="dim=2"):
        fn(x, dim=2)
    with pytest.raises(ValueError, match=re.escape("x.shape[1] = 0")):
        fn(torch.randn(2, 0))
    with pytest.raises(TypeError, match="descending"):
        fn(x, descending=1)
    # an argument at its default is fine whatever the method
    fn(x, method="pav", distance="l1", max_iter=None, tol=None)


def test_unused_arguments_for_the_other_methods():
    x = torch.randn(2, 5)
    with pytest.raises(
        ValueError,
        match="`regularization` is not used by method='softsort'; got regularization='kl'",
    ):
        soft_sort(x, method="softsort", regularization="kl")
    with pytest.raises(
        ValueError, match="`distance` is not used by method='neuralsort'; got distance='l2'"
    ):
        soft_rank(x, method="neuralsort", distance="l2")
    with pytest.raises(
        ValueError, match="`max_iter` is not used by method='softsort'; got max_iter=3"
    ):
        soft_argsort(x, method="softsort", max_iter=3)
    with pytest.raises(ValueError, match="`distance` is not used by method='ot'"):
        soft_argsort(x, method="ot", distance="l2")
    with pytest.raises(ValueError, match="distance='l7'"):
        soft_sort(x, method="softsort", distance="l7")
    with pytest.raises(ValueError, match="`max_iter` to be a positive int or None; got 0"):
        soft_sort(x, method="ot", max_iter=0)
    with pytest.raises(ValueError, match="tol=-1"):
        soft_rank(x, method="ot", tol=-1)


def test_errors_argsort():
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="soft_argsort: method='pav' has no permutation matrix"):
        soft_argsort(x, method="pav")
    with pytest.raises(ValueError, match="method='bogus'"):
        soft_argsort(x, method="bogus")
    with pytest.raises(TypeError, match="hard"):
        soft_argsort(x, hard="yes")
    with pytest.raises(TypeError, match="int32"):
        soft_argsort(torch.arange(4, dtype=torch.int32))


def test_errors_quantile():
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match=re.escape("q=1.5")):
        soft_quantile(x, 1.5)
    with pytest.raises(ValueError, match=re.escape("q=-0.25")):
        soft_quantile(x, torch.tensor([0.5, -0.25]))
    with pytest.raises(ValueError, match=re.escape("q of shape (1, 2)")):
        soft_quantile(x, torch.tensor([[0.5, 0.2]]))
    with pytest.raises(TypeError, match="`q`"):
        soft_quantile(x, "half")
    with pytest.raises(ValueError, match="method='softsort'"):
        soft_quantile(x, 0.5, method="softsort")
    with pytest.raises(ValueError, match="epsilon=0"):
        soft_quantile(x, 0.5, epsilon=0)
    with pytest.raises(TypeError, match=re.escape("torch.int64")):
        soft_quantile(torch.arange(5), 0.5)


# ------------------------------------------------------------------------------ shapes, dims


def test_empty_batch_and_single_entry():
    x = torch.randn(0, 4)
    assert soft_sort(x).shape == (0, 4) and soft_rank(x).shape == (0, 4)
    assert soft_quantile(x, torch.tensor([0.1, 0.2])).shape == (2, 0)
    one = torch.tensor([[2.5]])
    assert soft_sort(one).item() == 2.5 and soft_rank(one).item() == 1.0
    assert soft_quantile(one, 0.3).item() == 2.5


@pytest.mark.parametrize("method", ["pav", "softsort", "neuralsort", "ot"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shapes_dtype_and_hard_limit_all_methods(method, dim):
    if method != "pav":
        _backend(method)
    x = torch.randperm(24).to(F64).reshape(2, 3, 4) / 4
    eps = {"pav": 1e-4, "softsort": 1e-3, "neuralsort": 1e-3, "ot": 1e-3}[method]
    s = soft_sort(x, dim=dim, epsilon=eps, method=method)
    r = soft_rank(x, dim=dim, epsilon=eps, method=method, descending=True)
    assert s.shape == x.shape and s.dtype == F64
    torch.testing.assert_close(s, torch.sort(x, dim).values, atol=1e-3, rtol=0)
    ref = (x.argsort(dim, descending=True).argsort(dim) + 1).to(F64)
    torch.testing.assert_close(r, ref, atol=1e-3, rtol=0)
    x32 = x.float()
    assert soft_sort(x32, dim=dim, epsilon=eps, method=method).dtype == torch.float32


@pytest.mark.parametrize("method", ["softsort", "neuralsort", "ot"])
def test_argsort_shapes_and_hard(method):
    _backend(method)
    x = torch.randn(3, 5, 2, dtype=F64, requires_grad=True)
    P = soft_argsort(x, dim=1, epsilon=0.5, method=method)
    assert P.shape == (3, 5, 2, 5)
    torch.testing.assert_close(P.sum(-1), torch.ones(3, 5, 2, dtype=F64), atol=1e-6, rtol=0)
    H = soft_argsort(x, dim=1, epsilon=0.5, method=method, hard=True, descending=True)
    order = x.detach().argsort(1, descending=True)
    ref = torch.nn.functional.one_hot(order, 5).to(F64)
    torch.testing.assert_close(H.detach(), ref)
    # straight-through: the gradient is the soft one
    g = torch.randn_like(H)
    (gh,) = torch.autograd.grad(H, x, g)
    (gs,) = torch.autograd.grad(
        soft_argsort(x, dim=1, epsilon=0.5, method=method, descending=True), x, g
    )
    torch.testing.assert_close(gh, gs)
    layer = softops.nn.SoftArgsort(dim=1, epsilon=0.5, method=method)
    torch.testing.assert_close(layer(x), P)


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
