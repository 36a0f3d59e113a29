"""soft_topk_mask(method="ot"): second derivatives in x, k and epsilon together (the backward's
threshold carries its first derivative on the graph), with infinities and scaled rows."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradgradcheck

from softops import soft_topk_mask
from tests._helpers import seeded

F64 = torch.float64


def _x() -> torch.Tensor:
    return torch.randn(4, 5, generator=seeded(0), dtype=F64)


@pytest.mark.parametrize("k", [2.0, 2.3])
def test_second_derivatives_in_x_k_and_epsilon(k):
    x = _x().requires_grad_(True)
    kt = torch.tensor(k, dtype=F64, requires_grad=True)
    e = torch.tensor(0.6, dtype=F64, requires_grad=True)
    assert gradgradcheck(lambda x, k, e: soft_topk_mask(x, k, epsilon=e), (x, kt, e))
    assert gradgradcheck(lambda e: soft_topk_mask(x.detach(), k, epsilon=e), (e,))
    assert gradgradcheck(lambda k: soft_topk_mask(x.detach(), k, epsilon=0.6), (kt,))


def test_second_derivatives_per_row_k_and_epsilon():
    x = _x().requires_grad_(True)
    k = torch.tensor([1.5, 2.0, 3.0, 2.5], dtype=F64, requires_grad=True)
    e = torch.tensor([0.3, 0.6, 1.0, 2.0], dtype=F64, requires_grad=True)
    assert gradgradcheck(lambda x, k, e: soft_topk_mask(x, k, epsilon=e), (x, k, e))


def test_second_derivatives_with_infinities_and_on_a_scaled_row():
    x = _x()
    x[0, 1], x[1, 2] = math.inf, -math.inf
    e = torch.tensor(0.6, dtype=F64, requires_grad=True)
    xi = x.clone().requires_grad_(True)
    assert gradgradcheck(lambda x, e: soft_topk_mask(x, 2, epsilon=e), (xi, e))
    big = (_x() * 1e200).requires_grad_(True)
    eb = torch.tensor(0.6e200, dtype=F64, requires_grad=True)
    assert gradgradcheck(lambda x, e: soft_topk_mask(x, 2, epsilon=e), (big, eb))
