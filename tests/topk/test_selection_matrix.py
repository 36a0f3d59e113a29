"""topk_selection_matrix: the 0/1 matrix through which a hard torch.topk passes gradients."""

from __future__ import annotations

import pytest
import torch

from softops import topk_selection_matrix

F64 = torch.float64


def test_selection_matrix_reproduces_torch_topk_gradients():
    W = torch.randn(8, 6, dtype=F64)
    x1 = torch.randn(6, dtype=F64, requires_grad=True)
    W1 = W.clone().requires_grad_()
    torch.topk(W1 @ x1, 3).values.pow(2).sum().backward()
    x2 = x1.detach().clone().requires_grad_()
    W2 = W.clone().requires_grad_()
    y = W2 @ x2
    Wk = topk_selection_matrix(torch.topk(y.detach(), 3).indices, 8).to(F64)
    (Wk @ y).pow(2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(W1.grad, W2.grad)
    assert Wk.shape == (3, 8) and torch.equal(Wk.sum(-1), torch.ones(3, dtype=F64))


def test_selection_matrix_errors_and_batch():
    idx = torch.tensor([[0, 2], [1, 1]])
    W = topk_selection_matrix(idx, 3)
    assert W.shape == (2, 2, 3) and W[1, 0, 1] == 1 and W[0, 1, 2] == 1
    with pytest.raises(ValueError, match=r"indices in \[0, n\) = \[0, 2\); got values in \[0, 2\]"):
        topk_selection_matrix(idx, 2)
    with pytest.raises(TypeError, match=r"integer tensor of indices"):
        topk_selection_matrix(idx.float(), 3)
