r"""Row-chunked, checkpointed reductions of a row-softmax matrix ``P = softmax(logits)``.

Shared by the SoftSort (l2, and the full P) and NeuralSort backends: rows of P in blocks of at
most ``BLOCK_ELEMENTS`` entries, each under non-reentrant checkpointing, so the peak extra memory
is O(B n block) instead of O(B n²). Without a gradient, or under ``torch.func`` transforms (which
do not support checkpointing's saved-tensor hooks), the blocks run as plain ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from softops._core.transforms import cannot_branch, own_precision, under_functorch

__all__ = ["BLOCK_ELEMENTS", "chunked_rows", "convex_combination", "positions", "small_rows"]

BLOCK_ELEMENTS = 1 << 20
"""Entries (B x rows x n) of P formed at once (4 MiB per float32 temporary); a block holds
``clamp(BLOCK_ELEMENTS // (B n), 1, n)`` rows."""


def positions(n: int, descending: bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """1-based output positions of the rows of the ascending P, in the requested orientation."""
    pos = torch.arange(1, n + 1, dtype=dtype, device=device)
    return pos.flip(0) if descending else pos


def small_rows(x2: Tensor) -> Tensor | None:
    """(B, 1) the power-of-two exponent that brings each row's largest finite magnitude into
    [1/2, 1), on the rows where it is below ``finfo.tiny / finfo.eps`` (0 elsewhere), for
    :func:`convex_combination`; None where no row is that small (one host read; under
    ``torch.func`` and while tracing every row gets its exponent)."""
    fi = torch.finfo(x2.dtype)
    x = x2.detach()
    big = torch.where(torch.isfinite(x), x.abs(), 0).amax(-1, keepdim=True)
    small = (big > 0) & (big < fi.tiny / fi.eps)
    if not cannot_branch(x) and not bool(small.any()):
        return None
    return torch.where(small, torch.frexp(big).exponent, 0)


def convex_combination(p: Tensor, x: Tensor, exponent: Tensor | None) -> Tensor:
    """``sum_j p_ij x_j`` (B, b) for weights ``p`` (B, b, n) and rows ``x`` (B, n), exact to one
    rounding at every scale of x: rows of subnormal entries (``exponent`` from
    :func:`small_rows`) are combined scaled by ``2**-exponent`` and scaled back once (their
    products would round to the subnormal grid), with the plain combination's derivatives."""
    v = torch.linalg.vecdot(p, x.unsqueeze(1))
    if exponent is None:
        return v
    e = exponent.to(torch.int32)
    scaled = torch.ldexp(
        torch.linalg.vecdot(p.detach(), torch.ldexp(x.detach(), -e).unsqueeze(1)), e
    )
    fix = (scaled - v.detach()).to(v.dtype)
    return v + torch.where(torch.isfinite(fix), fix, 0)


def _rows_per_block(bsz: int, n: int) -> int:
    return max(1, min(n, BLOCK_ELEMENTS // max(1, bsz * n)))


def _needs_graph(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def chunked_rows(
    block_logits: Callable[..., Tensor],
    row_param: Tensor,
    x2: Tensor,
    extra: tuple[Tensor, ...],
    descending: bool,
    *,
    values: bool = False,
    ranks: bool = False,
    matrix: bool = False,
    offset: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Row-chunked, checkpointed ``P = softmax(logits)`` reductions.

    ``block_logits(row_param_block, *extra)`` returns the (B, b, n) logits of the rows whose
    per-row parameter (a (B, b) or (b,) slice of ``row_param`` along its last dim) is given, in
    the ascending orientation (row i is the i-th smallest). Returns ``(values, ranks, P)`` in the
    requested orientation, each None unless asked for: ``values = P @ x``, ``ranks_j = sum_i
    pos_i P_ij`` (``pos`` the 1-based output positions, plus ``offset`` (B,) when given) and ``P``
    itself (B, n, n). Extra memory is O(block) per block kept by autograd.
    """
    bsz, n = x2.shape
    rows = _rows_per_block(bsz, n)
    exponent = small_rows(x2) if values else None
    pos = positions(n, descending, x2.dtype, x2.device)
    if offset is not None:
        pos = pos + offset.to(x2.dtype).unsqueeze(-1)  # (B, n)
    functorch = under_functorch()
    use_ckpt = _needs_graph(x2, row_param, *extra) and not functorch
    p_blocks: list[Tensor] = []  # under torch.func: no in-place writes into p_out
    v_blocks: list[Tensor] = []
    r_sum: Tensor | None = None
    p_out: Tensor | None = None
    if matrix and not functorch:
        p_out = torch.empty((bsz, n, n), dtype=x2.dtype, device=x2.device)

    def run(rp: Tensor, xx: Tensor, pp: Tensor, *ex: Tensor) -> tuple[Tensor, ...]:
        p = torch.softmax(block_logits(rp, *ex), dim=-1)  # (B, b, n)
        outs: list[Tensor] = []
        with own_precision(p):  # autocast would run these products in bfloat16
            if values:
                outs.append(convex_combination(p, xx, exponent))  # (B, b)
            if ranks:
                if pp.dim() == 1:
                    outs.append(torch.matmul(pp, p))  # (B, n)
                else:
                    outs.append(torch.matmul(pp.unsqueeze(1), p).squeeze(1))
        if matrix:
            outs.append(p)
        return tuple(outs)

    for start in range(0, n, rows):
        stop = min(n, start + rows)
        rp = row_param[..., start:stop]
        pp = pos[..., start:stop]
        if use_ckpt:
            outs = checkpoint(run, rp, x2, pp, *extra, use_reentrant=False)
        else:
            outs = run(rp, x2, pp, *extra)
        parts = iter(outs)
        if values:
            v_blocks.append(next(parts))
        if ranks:
            r_blk = next(parts)
            r_sum = r_blk if r_sum is None else r_sum + r_blk
        if matrix and p_out is None:
            p_blocks.append(next(parts))
        elif matrix and p_out is not None:
            if descending:  # output row n-1-i is ascending row i
                p_out[:, n - stop : n - start] = next(parts).flip(1)
            else:
                p_out[:, start:stop] = next(parts)
    if p_blocks:
        p_out = torch.cat(p_blocks, dim=1)
        p_out = p_out.flip(1) if descending else p_out
    out_v = torch.cat(v_blocks, dim=-1) if values else None
    if out_v is not None and descending:
        out_v = out_v.flip(-1)
    return out_v, r_sum, p_out
