"""The straight-through estimator (softops._core.straight_through)."""

from __future__ import annotations

import torch

from softops._core.straight_through import straight_through


def test_straight_through_forward_is_hard_backward_is_soft():
    x = torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]], requires_grad=True)
    soft = x.softmax(-1)
    hard = torch.tensor([[1.0, 0, 0], [0, 1, 1]])
    out = straight_through(hard, soft)
    assert torch.equal(out.detach(), hard)
    g = torch.randn(2, 3)
    (a,) = torch.autograd.grad(out, x, g, retain_graph=True)
    (b,) = torch.autograd.grad(soft, x, g)
    torch.testing.assert_close(a, b)
