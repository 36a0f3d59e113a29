"""Helpers shared by the sort backend tests (canonical (B, n) rows, naive references)."""

from __future__ import annotations

import torch

F64 = torch.float64


def tie_free(B: int, n: int, scale: float = 3.0, dtype=F64) -> torch.Tensor:
    """Random rows without ties (N(0, scale²) in float64: ties have probability 0)."""
    return torch.randn(B, n, dtype=dtype) * scale


def spaced(B: int, n: int, dtype=F64) -> torch.Tensor:
    """Rows that are random permutations of 0..n-1 (unit gaps), for hard limits."""
    return torch.stack([torch.randperm(n) for _ in range(B)]).to(dtype)


def row_eps(B: int, value: float, dtype=F64) -> torch.Tensor:
    """A (B,) epsilon, as the backends take it."""
    return torch.full((B,), value, dtype=dtype)


def hard_ranks(x: torch.Tensor, descending: bool) -> torch.Tensor:
    """1-based hard ranks along the last dim."""
    return torch.argsort(torch.argsort(x, -1, descending=descending), -1).to(x.dtype) + 1


def reductions(p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``P @ x`` and ranks ``sum_i i P_ij`` of a dense (B, n, n) P."""
    n = x.shape[-1]
    pos = torch.arange(1, n + 1, dtype=x.dtype)
    return (p @ x.unsqueeze(-1)).squeeze(-1), torch.matmul(pos, p)


def saved_storage_bytes(fn, x: torch.Tensor, e: torch.Tensor) -> int:
    """Bytes of the distinct storages that ``fn(x, e)`` saves for backward (outside checkpointed
    blocks); then runs the backward, which must recompute the blocks fine."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x, e)
    out.sum().backward()
    return sum(seen.values())
