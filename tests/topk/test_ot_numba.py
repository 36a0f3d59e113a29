"""The numba kernel of method "ot" (softops.topk._ot_numba) against the batched torch code it
stands in for on small CPU problems, the rows it leaves to that code, and the rule that chooses."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import softops
from softops.topk import _ot
from tests._helpers import seeded
from tests.topk._row_kernels import assert_merged_solve, assert_transforms_agree, flagged_rows

pytest.importorskip("numba")

F64 = torch.float64


@pytest.fixture
def numba_on(monkeypatch):
    """The numba path enabled (the test run turns compilation off, which also turns it off)."""
    monkeypatch.setattr(_ot, "compile_enabled", lambda: True)


def _rows(b: int, n: int, dtype: torch.dtype, seed: int, ties: bool = False) -> torch.Tensor:
    x = torch.randn(b, n, generator=seeded(seed), dtype=F64)
    if ties:
        x = (x * 2).round() / 2
    return x.to(dtype)


CASES = [
    (b, n, k, eps, ties)
    for b, n in ((1, 1000), (8, 100), (3, 7))
    for k in (1.0, 3.0, 3.5)
    for eps in (1e-2, 0.3, 10.0)
    for ties in (False, True)
]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("b", "n", "k", "eps", "ties"), CASES)
def test_the_kernel_solves_as_the_torch_code(numba_on, dtype, b, n, k, eps, ties):
    x = _rows(b, n, dtype, seed=n + b, ties=ties)
    kt = torch.full((b,), k, dtype=dtype)
    et = torch.full((b,), eps, dtype=dtype)
    assert _ot.use_numba(x)
    got = _ot._solve(x, kt, et, 100, 0.0, k)
    want = _ot._solve(x, kt, et, 100, 0.0, k, False)
    # the kernel runs in float64: in float32 it is the more exact of the two
    tol = 1e-13 if dtype == F64 else 3e-6
    for a, w in zip(got[1:4], want[1:4], strict=True):
        scale = float(w.abs().max()) if torch.isfinite(w).all() else 1.0
        torch.testing.assert_close(a, w, atol=tol * max(scale, 1.0), rtol=tol)
    assert got[0].converged.all()
    assert got[1].sum(-1).sub(k).abs().max() <= (1e-12 if dtype == F64 else 1e-5) * n
    assert got[0].iterations <= 8


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_gradients_are_the_same_with_and_without_the_kernel(monkeypatch, dtype):
    x = _rows(4, 60, dtype, seed=3)
    g = torch.randn(4, 60, generator=seeded(4), dtype=dtype)
    grads = []
    for use in (True, False):
        monkeypatch.setattr(_ot, "compile_enabled", lambda use=use: use)
        xt = x.clone().requires_grad_()
        kt = torch.tensor([1.0, 2.5, 10.0, 59.0], dtype=dtype, requires_grad=True)
        et = torch.tensor([0.05, 0.3, 1.0, 4.0], dtype=dtype, requires_grad=True)
        A = softops.soft_topk_mask(xt, kt, epsilon=et)
        grads.append((A.detach(), *torch.autograd.grad(A, [xt, kt, et], g)))
    tol = 1e-12 if dtype == F64 else 2e-5
    for a, w in zip(*grads, strict=True):
        torch.testing.assert_close(a, w, atol=tol, rtol=tol)
    xt = x.to(F64).requires_grad_()
    monkeypatch.setattr(_ot, "compile_enabled", lambda: True)
    assert torch.autograd.gradcheck(lambda v: softops.soft_topk_mask(v, 7, epsilon=0.2), (xt,))


def test_rows_the_kernel_leaves_are_solved_by_the_torch_code(numba_on):
    x, k, eps = flagged_rows()
    A, s, out = np.empty(x.shape), np.empty(x.shape), np.empty((7, 6))
    _ot._numba_kernels().threshold_rows(
        x.numpy(), k.numpy(), eps.numpy(), 0.0, _ot._scaling_limit(F64), 100, A, s, out
    )
    assert out[:, 5].tolist() == [0, 1, 1, 1, 1, 1, 1]
    got = _ot._solve(x, k, eps, 100, 0.0, None)
    assert_merged_solve(got, _ot._solve(x, k, eps, 100, 0.0, None, False))


def test_a_row_the_kernel_caps_warns_as_the_torch_code(numba_on):
    x = _rows(2, 50, torch.float32, seed=2)
    with pytest.warns(softops.ConvergenceWarning, match="max_iter=1"):
        softops.soft_topk_mask(x, 5, epsilon=0.3, max_iter=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        softops.soft_topk_mask(x, 5, epsilon=0.3)


def test_the_rule_that_chooses_the_kernel(numba_on, monkeypatch):
    assert _ot.use_numba(torch.zeros(1, 1000))
    assert _ot.use_numba(torch.zeros(8, 4000 - 1))
    assert not _ot.use_numba(torch.zeros(64, 1000))  # the fused path's size
    assert not _ot.use_numba(torch.zeros(2, 10, device="meta"))
    monkeypatch.setattr(_ot, "compile_enabled", lambda: False)
    assert not _ot.use_numba(torch.zeros(1, 1000))


def test_vmap_and_grad_transforms_take_the_torch_code_and_agree(numba_on):
    x = _rows(3, 30, F64, seed=5)
    assert_transforms_agree(x)
