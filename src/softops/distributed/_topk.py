"""The sharded hard ``topk``: each rank's own k best, one all-gather, the same merge on every
rank; its gradient goes to the entries this rank holds."""

from __future__ import annotations

import math
from typing import Any

import torch

from softops.distributed._group import _Plan
from softops.distributed._mask import _first_ties


def _sharded_topk(
    plan: _Plan, x: torch.Tensor, k: int, nan_first: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, k) values, global indices, owners and local indices of the global top-k (NaN first or
    last, value descending, global position ascending) from one all-gather."""
    comm = plan.comm
    B, n_r = x.shape
    P = comm.size
    f64 = torch.float64
    dev = x.device
    w = min(k, n_r)
    local_idx = torch.full((B, k), -1, dtype=torch.long, device=dev)
    vals = torch.full((B, k), -math.inf, dtype=f64, device=dev)
    if w:
        sel = _local_topk(x, w, nan_first)
        pos = torch.arange(n_r, device=dev).expand(B, n_r)
        chosen = torch.where(sel, pos, n_r + pos).topk(w, dim=-1, largest=False).values
        local_idx[:, :w] = chosen
        vals[:, :w] = x.gather(-1, chosen).to(f64)
    gidx = torch.where(local_idx >= 0, local_idx + plan.starts[comm.rank], -1).to(f64)
    allp = comm.gather(torch.stack((vals, gidx)))  # (P, 2, B, k)
    cv = allp[:, 0].permute(1, 0, 2).reshape(B, P * k)
    ci = allp[:, 1].permute(1, 0, 2).reshape(B, P * k)
    src = torch.arange(P, device=dev).repeat_interleave(k).expand(B, P * k)
    # lexicographic by stable sorts, the least significant key first: global index, value
    # (NaN as -inf), NaN first or last, the real candidates before the padding
    for key in ("index", "value", "nan", "padding"):
        if key == "index":
            order = ci.argsort(dim=-1, stable=True)
        elif key == "value":
            order = cv.nan_to_num(nan=-math.inf).argsort(dim=-1, descending=True, stable=True)
        elif key == "nan":
            order = (cv != cv).to(torch.int8).argsort(dim=-1, descending=nan_first, stable=True)
        else:
            order = (ci < 0).to(torch.int8).argsort(dim=-1, stable=True)
        cv, ci, src = cv.gather(-1, order), ci.gather(-1, order), src.gather(-1, order)
    gi = ci[:, :k].long()
    owner = src[:, :k]
    starts = torch.tensor(plan.starts, device=dev)
    return cv[:, :k].to(x.dtype), gi, owner, gi - starts[owner]


def _local_topk(x: torch.Tensor, w: int, nan_first: bool) -> torch.Tensor:
    """The mask of the ``w <= n_r`` first entries of each row of the shard in the order of
    :func:`_sharded_topk` (NaN first or last, value descending, index ascending)."""
    nan = x != x
    xm = torch.where(nan, -math.inf, x)
    ranked = xm.topk(w, dim=-1).values  # (NaN as -inf)
    if nan_first:
        sel_nan = _first_ties(nan, torch.full_like(ranked[:, 0], w, dtype=torch.long))
        left = w - sel_nan.sum(-1)  # the non-NaN entries to take
    else:
        sel_nan = torch.zeros_like(nan)
        left = torch.full_like(ranked[:, 0], w, dtype=torch.long)
    v = ranked.gather(-1, (left - 1).clamp(min=0)[:, None])
    above = ~nan & (xm > v) & (left > 0)[:, None]
    ties = ~nan & (xm == v) & (left > 0)[:, None]
    sel = sel_nan | above | _first_ties(ties, left - above.sum(-1))
    if not nan_first:  # NaN fill what the real entries cannot
        sel = sel | _first_ties(nan, w - sel.sum(-1))
    return sel


class _Route(torch.autograd.Function):
    """``values`` with a backward that passes each value's gradient to this shard's entry when
    this rank holds it (a scatter-add, no communication)."""

    @staticmethod
    def forward(
        x: torch.Tensor, values: torch.Tensor, mine: torch.Tensor, where: torch.Tensor
    ) -> torch.Tensor:
        return values.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, _, mine, where = inputs
        ctx.save_for_backward(mine, where)
        ctx.shape = x.shape

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        mine, where = ctx.saved_tensors
        gx = g.new_zeros(ctx.shape)
        if gx.shape[-1]:  # (an empty shard holds none of them)
            gx.scatter_add_(-1, torch.where(mine, where, 0), torch.where(mine, g, 0))
        return gx, None, None, None
