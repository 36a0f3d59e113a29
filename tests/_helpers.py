"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import torch


def seeded(seed: int = 0) -> torch.Generator:
    """A fresh CPU generator with a fixed seed."""
    return torch.Generator().manual_seed(seed)


def saved_bytes(fn) -> int:
    """Bytes of every tensor that ``fn()`` saves for backward, each save counted.

    A tensor saved by several nodes counts each time, which is what tests of "saves the same
    buffer once per round" need; :func:`softops.bench.model.count_saved_bytes` counts each storage
    once, which is what stays alive.
    """
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def hard_topk_mask(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True) -> torch.Tensor:
    """The hard operator that soft_topk_mask relaxes, written as in its docstring."""
    return torch.zeros_like(x).scatter(dim, x.topk(k, dim, largest).indices, 1)


def fd_gap(fn, x: torch.Tensor, h: float, g: torch.Generator) -> float:
    """Relative gap between autograd and a central difference of a random projection of fn."""
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    ct = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((out * ct).sum(), x)
    v = torch.randn(x.shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        xp, xm = x + h * v, x - h * v
        fd = ((fn(xp) - fn(xm)) * ct).sum() / (2 * h)
    # the step actually taken: x +- h v rounds, most where |x| is far above h
    step = (xp - xm) / (2 * h)
    scale = float((grad.abs() * step.abs()).sum()) + float(ct.abs().sum())
    return abs(float((grad * step).sum() - fd)) / scale
