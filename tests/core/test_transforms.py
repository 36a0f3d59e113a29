"""softops._core.transforms: detecting an active torch.func transform."""

from __future__ import annotations

import torch
from torch import func

from softops._core.transforms import under_functorch


def test_under_functorch_only_inside_a_transform():
    assert not under_functorch()
    seen = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append(under_functorch())
        return t.sum()

    func.grad(probe)(torch.ones(3))
    func.vmap(probe)(torch.ones(2, 3))
    assert seen == [True, True]
    assert not under_functorch()
