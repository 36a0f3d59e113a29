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


def test_unreadable_marks_batched_meta_and_traced_tensors_only():
    from softops._core.transforms import unreadable

    plain_k = torch.tensor(2.0)
    assert not unreadable(plain_k)
    assert unreadable(torch.empty(3, device="meta"))
    seen = {}

    def probe(x):
        seen["batched"] = unreadable(x)
        seen["closed_over"] = unreadable(plain_k)  # a plain tensor inside the transform
        return x

    func.vmap(probe)(torch.ones(4, 2))
    assert seen == {"batched": True, "closed_over": False}
    func.grad(lambda x: (probe(x) * 1.0).sum())(torch.ones(3))
    assert seen == {"batched": False, "closed_over": False}  # grad wrappers stay readable
    func.vmap(lambda x: func.grad(lambda y: probe(y).sum())(x))(torch.ones(2, 3))
    assert seen["batched"] is True  # batched under a grad level
