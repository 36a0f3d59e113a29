"""The sharded masks: the start's one all-gather, the single-process solvers of
:mod:`softops.topk` with all-reduced sums, the sharded backward and the sharded hard mask."""

from __future__ import annotations

import math
from typing import Any

import torch

from softops.distributed._group import _MASK, _Comm, _Plan
from softops.topk import (
    SAMPLE_SIZE,
    RowSummary,
    ThresholdRows,
    row_stats,
    side_log_weights,
    solve_ot_rows,
    solve_sparse_rows,
)

EXACT_SHARE = 64
"""The exact candidates may be up to ``1 / EXACT_SHARE`` of the row (else a strided subsample of
about ``SAMPLE_SIZE`` entries per row)."""


# ----------------------------------------------------------------------------- the row start


def _local_top(x: torch.Tensor, depth: int) -> torch.Tensor:
    """The ``depth`` largest entries of each row of the shard, sorted, padded with ``-inf``."""
    B, n_r = x.shape
    out = torch.full((B, depth), -math.inf, dtype=x.dtype, device=x.device)
    if n_r and depth:
        d = min(depth, n_r)
        out[:, :d] = x.topk(d, dim=-1).values
    return out


def _sample_layout(plan: _Plan) -> tuple[int, list[int], list[int]]:
    """The global stride of the subsample, and each rank's first local index and count in it:
    the entries at global positions 0, stride, 2 stride, ... (those of ``x[:, ::stride]``)."""
    stride = max(plan.n // SAMPLE_SIZE, 2)
    offsets, counts = [], []
    for size, start in zip(plan.sizes, plan.starts, strict=True):
        off = (-start) % stride
        offsets.append(off)
        counts.append(max(0, -(-(size - off) // stride)) if size > off else 0)
    return stride, offsets, counts


def _gather_rows(plan: _Plan, x: torch.Tensor) -> tuple[RowSummary, torch.Tensor | None]:
    """The start's one all-gather: every rank's shard statistics and candidates, and with
    ``hard=True`` its ``max k`` largest, (P, B, max k) (else None)."""
    comm, n = plan.comm, plan.n
    B = x.shape[0]
    f64 = torch.float64
    depth = max(min(math.floor(plan.k_max) + 1, n), 1)
    budget = max(SAMPLE_SIZE, n // EXACT_SHARE)
    exact = comm.size * depth <= budget and 2 * depth <= n
    hard_w = int(plan.k_max) if plan.hard else 0
    parts = [row_stats(x)]
    ns = 0
    if exact:
        parts.append(_local_top(x, depth).to(f64))
        width = depth
    else:
        stride, offsets, counts = _sample_layout(plan)
        ns = sum(counts)
        width = max(max(counts), 1)
        sample = torch.full((B, width), -math.inf, dtype=f64, device=x.device)
        mine = counts[comm.rank]
        if mine:
            sample[:, :mine] = x[:, offsets[comm.rank] :: stride].to(f64)
        parts.append(sample)
        if hard_w:
            parts.append(_local_top(x, hard_w).to(f64))
    everything = comm.gather(torch.cat(parts, -1))  # (P, B, 6 + W)
    st = everything[..., :6]
    hard_cand = None
    if hard_w:
        hc = everything[..., 6 : 6 + depth] if exact else everything[..., 6 + width :]
        hard_cand = hc[..., :hard_w].to(x.dtype)
    rows = RowSummary(
        st[..., 0].sum(0),
        st[..., 1].sum(0),
        st[..., 2].sum(0),
        st[..., 3].amax(0),
        st[..., 4].amin(0),
        st[..., 5].sum(0),
        everything[..., 6 : 6 + width].permute(1, 0, 2).reshape(B, -1),
        exact,
        depth,
        ns,
    )
    return rows, hard_cand


def _solve_ot(
    plan: _Plan, x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor
) -> tuple[ThresholdRows, torch.Tensor | None]:
    """The threshold of every sharded row (the single-process solver on the gathered summary),
    and the hard mask (or None)."""
    comm = plan.comm
    many = comm.size > 1
    rows, hard_cand = _gather_rows(plan, x)
    sol = solve_ot_rows(
        x,
        k,
        eps,
        rows,
        n=plan.n,
        k_max=plan.k_max,
        eps_max=plan.eps_max,
        max_iter=plan.max_iter,
        tol=plan.tol,
        reduce=comm.reduce if many else None,
        gather=comm.gather if many else None,
    )
    return sol, _hard(plan, x, k, hard_cand)


# ----------------------------------------------------------------------------- the iteration


def _hard(
    plan: _Plan, x: torch.Tensor, k: torch.Tensor, cand: torch.Tensor | None
) -> torch.Tensor | None:
    """The sharded hard mask when ``hard=True`` (None otherwise)."""
    if not plan.hard:
        return None
    if cand is None:  # k = 0 on every row
        return torch.zeros_like(x)
    return _hard_mask(plan, x, k, cand)


def _no_double_backward(op: str) -> None:
    """Raise where the backward is itself differentiated (``create_graph=True``): its
    collectives are not."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op}: double backward (create_graph=True) is not supported across ranks; "
            "compute the gradient without create_graph, or use softops.soft_topk_mask on one "
            "process."
        )


# ---------------------------------------------------------------------------- method "sparse"


def _solve_sparse(
    plan: _Plan, x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sharded "sparse" mask: this shard's mask, the rows' convergence and the hard mask (or
    None)."""
    rows, hard_cand = _gather_rows(plan, x)
    reduce = plan.comm.reduce if plan.comm.size > 1 else None
    a, converged = solve_sparse_rows(
        x, k, eps, rows, n=plan.n, k_max=plan.k_max, max_iter=plan.max_iter, reduce=reduce
    )
    return a, converged, _hard(plan, x, k, hard_cand)


class _ShardedMaskSparse(torch.autograd.Function):
    """This shard of ``a = clip((x - t)/eps, 0, 1)``, ``sum a = k`` over the concatenated row;
    the closed-form backward on the free entries, its sums all-reduced."""

    @staticmethod
    def forward(
        x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor, plan: _Plan
    ) -> tuple[Any, ...]:
        return _solve_sparse(plan, x.detach(), k.detach(), eps.detach())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, _, eps, plan = inputs
        a, converged, hard = output
        ctx.mark_non_differentiable(*(t for t in (converged, hard) if t is not None))
        ctx.set_materialize_grads(False)
        ctx.comm = plan.comm
        ctx.save_for_backward(a, eps)

    @staticmethod
    def backward(ctx: Any, ga: torch.Tensor | None, *_: Any) -> tuple[torch.Tensor | None, ...]:
        r"""``da_i/dx_j = (delta_ij - 1/|S|)/eps``, ``da_i/dk = 1/|S|``, ``da_i/deps = -(a_i -
        mean_S a)/eps`` on S (0 elsewhere, and everywhere when S is empty)."""
        if ga is None:
            return None, None, None, None
        _no_double_backward(_MASK)
        need_x, need_k, need_eps = ctx.needs_input_grad[:3]
        a, eps = ctx.saved_tensors
        comm: _Comm = ctx.comm
        free = ((a > 0) & (a < 1)).to(a.dtype)
        g = ga * free
        parts = [free.sum(-1), g.sum(-1), (a != a).sum(-1).to(a.dtype)]
        if need_eps:
            af = torch.where(free > 0, a, 0)
            parts += [(g * af).sum(-1), af.sum(-1)]
        glob = comm.sum(torch.stack(parts))
        size = glob[0]
        inv = torch.where(size > 0, 1 / size.clamp(min=1), 0).masked_fill(glob[2] > 0, math.nan)
        mean_g = glob[1] * inv
        e = eps[:, None]
        gx = free * (ga - mean_g[:, None]) / e if need_x else None
        gk = mean_g if need_k else None
        geps = -(glob[3] - mean_g * glob[4]) / eps if need_eps else None
        return gx, gk, geps, None


# ------------------------------------------------------------------------------- hard top-k


def _first_ties(eq: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
    """The first ``take`` (B,) True entries of each row of ``eq`` (B, n_r), by local index."""
    return eq & (eq.cumsum(-1) <= take[:, None])


def _hard_mask(plan: _Plan, x: torch.Tensor, k: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """The 0/1 mask of the k largest entries of the concatenated rows on this shard (ties by the
    global position), from ``cand`` (P, B, W >= max k), every rank's W largest."""
    P, B, W = cand.shape
    kk = k.long()
    merged = cand.permute(1, 0, 2).reshape(B, P * W).topk(W, dim=-1).values
    v = merged.gather(-1, (kk - 1).clamp(0, W - 1)[:, None])  # (B, 1)
    above = (cand > v[None]).sum(-1)  # (P, B)
    ties = (cand == v[None]).sum(-1)
    need = kk - above.sum(0)
    before = ties.cumsum(0) - ties  # the ties of the ranks before each rank
    take = (need - before[plan.comm.rank]).clamp(min=0)
    take = torch.where(kk > 0, take, 0)
    sel = ((x > v) & (kk > 0)[:, None]) | _first_ties(x == v, take)
    return sel.to(x.dtype)


# ------------------------------------------------------------------------------- autograd


class _ShardedMaskOT(torch.autograd.Function):
    """This shard of ``A = sigmoid((x - t)/eps)``, ``sum A = k`` over the concatenated row (then
    outputs without gradient); the implicit backward with its row sums all-reduced."""

    @staticmethod
    def forward(
        x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor, plan: _Plan
    ) -> tuple[Any, ...]:
        sol, hard = _solve_ot(plan, x.detach(), k.detach(), eps.detach())
        converged = sol.converged | sol.invalid  # (NaN rows are NaN by contract: no warning)
        return sol.A, converged, hard, sol.s, sol.aux, sol.edge, sol.ext, sol.scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, k, eps, plan = inputs
        _, converged, hard, s, aux, edge, ext, scale = output
        extras = (converged, hard, s, aux, edge, ext, scale)
        ctx.mark_non_differentiable(*(t for t in extras if t is not None))
        ctx.set_materialize_grads(False)
        ctx.comm = plan.comm
        ctx.save_for_backward(s, aux, eps, x, edge, ext, scale, k)

    @staticmethod
    def backward(ctx: Any, gA: torch.Tensor | None, *_: Any) -> tuple[torch.Tensor | None, ...]:
        if gA is None:
            return None, None, None, None
        _no_double_backward(_MASK)
        need_x, need_k, need_eps = ctx.needs_input_grad[:3]
        s, aux, eps, x, edge, ext, scale, k = ctx.saved_tensors
        comm: _Comm = ctx.comm
        if not (need_k or need_eps):
            local = torch.stack((s.sum(-1), torch.linalg.vecdot(s, gA)))
            ss, sg = comm.sum(local).unbind(0)
            ratio = torch.where(ss > 0, sg / torch.where(ss > 0, ss, 1), 0)
            return s * (gA - ratio[:, None]), None, None, None
        e = eps[:, None] if scale is None else (eps * scale)[:, None]
        xs = x if scale is None else x * scale[:, None]
        off = (xs - aux[:, :1]) - aux[:, 1:2]
        ratio, mean, g1, g2 = _weighted_sums(comm, off, xs, e, s, gA, edge, ext, k, need_eps)
        gx = s * (gA - ratio[:, None]) if need_x else None
        gk = ratio if need_k else None
        geps = -(g1 - mean * g2) / e.squeeze(-1) if need_eps else None
        return gx, gk, geps, None


def _weighted_sums(
    comm: _Comm,
    off: torch.Tensor,
    xs: torch.Tensor,
    e: torch.Tensor,
    s: torch.Tensor,
    g: torch.Tensor,
    edge: torch.Tensor,
    ext: torch.Tensor,
    k: torch.Tensor,
    need_eps: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``<w, g>``, ``<w, off>``, ``sum_live g s off`` and ``sum_live g s`` over the row (live:
    ``s > 0``), ``w = s / sum s`` normalised in the log domain as in the single-process backward
    (:func:`softops.topk.side_log_weights`), each rank's sides shifted by its nearest entries,
    from one all-gather.
    """
    fin_a = torch.isfinite(off)
    side = edge[:, None]
    below = fin_a & ((off <= 0) | (side != 0))  # (edge rows: one side)
    logw, log_u, near_b, near_a = side_log_weights(off, e, below)
    finite = torch.isfinite(xs)
    xf = torch.where(finite, xs, 0)
    top, bottom = ext[:, :1].nan_to_num(0, 0, 0), ext[:, 1:2].nan_to_num(0, 0, 0)
    up = torch.where(finite, (xf - top) / e, -math.inf)
    down = torch.where(finite, (bottom - xf) / e, -math.inf)
    logw = torch.where(side > 0, up, torch.where(side < 0, down, logw))
    live = s > 0
    gs = g * s  # (NaN where s is: a NaN row's gradient in epsilon is NaN)
    parts = []
    for here, near in ((below, near_b), (fin_a & ~below, near_a)):
        w = torch.where(here, torch.exp(logw), 0)
        u = torch.where(here, torch.exp(log_u), 0)
        near = torch.where(side != 0, 0, near)  # (edge rows: weighed from the row's max or min)
        parts += [near.squeeze(-1), w.sum(-1), torch.linalg.vecdot(w, g), u.sum(-1)]
        if need_eps:
            parts.append(torch.linalg.vecdot(w, torch.where(w > 0, off, 0)))
    parts.append((off > 0).sum(-1, dtype=off.dtype))
    if need_eps:
        parts += [(gs * torch.where(live, off, 0)).sum(-1), (gs * live).sum(-1)]
    allp = comm.gather(torch.stack(parts))  # (P, c, B)
    es = e.squeeze(-1)
    c = 5 if need_eps else 4
    sides = []
    for i in (0, c):
        nears = allp[:, i]
        lowest = nears.amin(0)
        factor = torch.where(torch.isfinite(nears), torch.exp(-(nears - lowest) / es), 0)
        sums = [(factor * allp[:, i + j]).sum(0) for j in range(1, c)]
        sides.append((lowest, *sums))
    (near_b, w_b, wg_b, u_b, *wo_b), (near_a, w_a, wg_a, u_a, *wo_a) = sides
    count = allp[:, 2 * c].sum(0)
    nearest = torch.minimum(near_b, near_a)
    balanced = (count == k) & (u_b > 0) & (u_a > 0) & (edge == 0)
    fac_b = torch.where(balanced, 1 / u_b, torch.exp(-(near_b - nearest) / es))
    fac_a = torch.where(balanced, 1 / u_a, torch.exp(-(near_a - nearest) / es))
    fac_b = torch.where(torch.isfinite(near_b) & (w_b > 0), fac_b, 0)
    fac_a = torch.where(torch.isfinite(near_a) & (w_a > 0), fac_a, 0)
    w0 = fac_b * w_b + fac_a * w_a
    some = (ext[:, 2] > 0) | (edge == 0)
    ratio = torch.where(some, (fac_b * wg_b + fac_a * wg_a) / w0, 0)
    if not need_eps:
        return ratio, ratio, ratio, ratio
    mean = torch.where(some, (fac_b * wo_b[0] + fac_a * wo_a[0]) / w0, 0)
    return ratio, mean, allp[:, 2 * c + 1].sum(0), allp[:, 2 * c + 2].sum(0)
