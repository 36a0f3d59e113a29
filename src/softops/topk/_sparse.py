r"""Method "sparse" of ``soft_topk_mask``: the Euclidean projection onto the capped simplex.

The projection of :math:`x / \varepsilon` onto :math:`\{a : 0 \le a_i \le 1, \sum_i a_i = k\}`
(Blondel et al. 2020; Amos et al. 2019 §3), the counterpart of method "ot" with a quadratic
regulariser (docs/math.md §1.5):

.. math::

    a_i = \mathrm{clip}\big((x_i - t)/\varepsilon,\ 0,\ 1\big), \qquad \textstyle\sum_i a_i = k .

It has exact zeros and ones; its gradients in x, k and epsilon live on the free set
:math:`S = \{0 < a_i < 1\}` (0 where S is empty). The forward is an exact finite Newton method
on the piecewise-linear residual inside an exact bracket (docs/math.md §1.5). Infinities are
exact; NaN or unreachable-k rows are NaN.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from softops._core.convergence import warn_not_converged
from softops._core.transforms import vmap_rows, without_jvp
from softops._kernels import define
from softops.topk._options import MaskOptions
from softops.topk._ot import SMOOTH_START, Reduce, _classify, _fill_special, _row_counts

__all__ = ["GPU_BLOCK", "mask"]

GPU_BLOCK = 4
"""Evaluations between two host tests of "all rows done" off the CPU (none inside a block)."""


def _evaluate(
    x: torch.Tensor,
    m: torch.Tensor,
    u: torch.Tensor,
    inv: torch.Tensor,
    k: torch.Tensor,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, ...]:
    """At ``u`` (B, 1), ``t = m + eps u``: ``r = sum a - k``, the counts of ``z > 0``, ``z >= 0``,
    ``z >= 1`` and ``z > 1`` (``z = (x - m) / eps - u``) as floats, and the sum of ``y`` over the
    free entries, (B,) each in x's dtype; ``reduce`` totals a split row's partial sums."""
    y = (x - m) * inv
    z = y - u
    a = z.clamp(0, 1)
    dt = x.dtype
    sums = (
        a.sum(-1),
        (z > 0).sum(-1, dtype=dt),
        (z >= 0).sum(-1, dtype=dt),
        (z >= 1).sum(-1, dtype=dt),
        (z > 1).sum(-1, dtype=dt),
        torch.where((z > 0) & (z < 1), y, 0).sum(-1),
    )
    if reduce is not None:  # (the residual formed in the reduction's dtype, then x's)
        a_sum, *counts = reduce(sums)
        return ((a_sum - k).to(dt), *(v.to(dt) for v in counts))
    a_sum, pos, pos0, one, one1, sum_y = sums
    return a_sum - k, pos, pos0, one, one1, sum_y


def _row_stats(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row: the counts of finite, ``+inf`` and NaN entries, the largest and smallest finite
    entries, and the sum of the finite ones."""
    n_fin, n_pinf, n_nan, bottom, total = _row_counts(x)
    top = torch.where(torch.isfinite(x), x, -math.inf).amax(-1)
    return n_fin, n_pinf, n_nan, top, bottom, total


def _polish(
    x: torch.Tensor,
    m: torch.Tensor,
    u: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    eps: torch.Tensor,
    exact: torch.Tensor,
    k: torch.Tensor,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, ...]:
    """u again, in closed form on the final piece (``a``'s on ``exact`` rows, else the final
    bracket's): the mask at u and the polished one, their residuals, and |S|."""
    dtype = x.dtype
    y = (x - m) / eps[:, None]
    a = (y - u[:, None]).clamp(0, 1)
    exact2 = exact[:, None]
    above_hi = y - hi[:, None]
    free = torch.where(exact2, (a > 0) & (a < 1), (y > lo[:, None]) & (above_hi < 1))
    ones_mask = torch.where(exact2, a >= 1, above_hi >= 1)
    size = free.sum(-1, dtype=dtype)
    ones = ones_mask.sum(-1, dtype=dtype)
    sum_y = torch.where(free, y, 0).sum(-1)
    a_sum = a.sum(-1)
    if reduce is not None:
        size, ones, sum_y, a_sum = (v.to(dtype) for v in reduce((size, ones, sum_y, a_sum)))
    size1 = size.clamp(min=1)
    u_p = sum_y / size1 - (k - ones) / size1
    a_p = (y - u_p[:, None]).clamp(0, 1)
    a_p_sum = a_p.sum(-1)
    if reduce is not None:
        a_p_sum = reduce((a_p_sum,))[0].to(dtype)
    return a, a_p, a_sum - k, a_p_sum - k, size


def _order_statistics(x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``ceil(k)``-th and the ``(floor(k) + 1)``-th largest entries of each row (B,), ranks
    clamped to [1, n], from a topk of the side of the row that needs fewer entries."""
    n = x.shape[-1]
    k_max, k_min = torch.stack((k.max(), k.min())).tolist()
    deep, shallow = min(math.floor(k_max) + 1, n), min(n - math.ceil(k_min) + 1, n)
    largest = deep <= shallow
    depth = max(deep if largest else shallow, 1)
    if k_max == k_min:
        v = x.topk(depth, dim=-1, largest=largest, sorted=False).values
        # largest: depth = floor(k) + 1, whose entry is the smallest of v; ceil(k) is one
        # shallower for an integer k. Smallest: depth = n - ceil(k) + 1, the mirror image.
        end = v.amin(-1) if largest else v.amax(-1)
        if math.ceil(k_max) == math.floor(k_max) + 1 or depth < 2:
            return end, end
        nxt = v.topk(2, dim=-1, largest=not largest).values[:, 1]
        return (nxt, end) if largest else (end, nxt)
    return _ranked_pair(x.topk(depth, dim=-1, largest=largest).values, k, n, largest)


def _ranked_pair(
    ranked: torch.Tensor, k: torch.Tensor, n: int, largest: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_order_statistics` from ``ranked`` (B, depth), each row's largest entries in
    descending order (else its smallest, ascending), deep enough to hold both ranks."""
    depth = ranked.shape[-1]
    ranks = torch.stack((torch.ceil(k), torch.floor(k) + 1), -1).clamp(1, n)
    index = ranks - 1 if largest else n - ranks
    pair = ranked.gather(-1, index.clamp(0, depth - 1).long())
    return pair[:, 0], pair[:, 1]


def _solve(
    x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor, max_iter: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mask of every row of ``x`` (B, n), and the (B,) convergence flags (None: all rows)."""
    if x.device.type == "meta" or x.numel() == 0:  # nothing to solve, no value to test
        return torch.empty_like(x), None
    # the exact bracket [x_(j) - eps, x_(j')] from two order statistics (docs/math.md §1.5)
    stats = _row_stats(x)
    x_hi, x_lo = _order_statistics(x, k)
    return _solve_rows(x, k, eps, max_iter, stats, x_hi, x_lo)


def _solve_rows(
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    max_iter: int,
    stats: tuple[torch.Tensor, ...],
    centre: torch.Tensor,
    x_lo: torch.Tensor | None,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_solve` from the rows' statistics and order statistics (the exact bracket), or,
    with ``x_lo`` None, any finite centre and the bracket over the row's range."""
    dtype = x.dtype
    n_fin, n_pinf, n_nan, top, bottom, total = stats
    kk, _, n_fin1, solve_rows, sel_none, sel_all, invalid = _classify(k, n_fin, n_pinf, n_nan)
    zeros = torch.zeros_like(k)
    j_lo = torch.floor(kk) + 1
    j_hi = torch.ceil(kk).clamp(min=1)
    # the solve is on u = (t - m) / eps, centred on m = x_(j'): t resolved relative to epsilon
    big = torch.finfo(dtype).max
    m = torch.where(solve_rows, centre, zeros)
    inv = 1 / eps
    if x_lo is not None:
        y_lo = torch.where(solve_rows, (x_lo - m) * inv, zeros)
        hi = zeros
        r_lo = torch.where(solve_rows, j_lo - kk, 1)  # bounds on the residual at the ends
        r_hi = torch.where(solve_rows, (j_hi - 1) - kk, -1)
    else:
        y_lo = torch.where(solve_rows, (bottom - m) * inv, zeros)
        hi = torch.where(solve_rows, ((top - m) * inv).clamp(max=big), zeros)
        r_lo = torch.where(solve_rows, n_fin1 - kk, 1)
        r_hi = torch.where(solve_rows, -kk, -1)
    # (one float below: y - 1 can round up; the far end of a gap beyond the range is -max)
    lo = torch.nextafter(y_lo - 1, torch.full_like(y_lo, -math.inf)).clamp(min=-big)
    # Start: where epsilon is large for the row, the large-epsilon guess (every finite entry
    # free), mean(y) - k' / n_fin; else the small-epsilon one (x_(j') alone free), -(k' - j' + 1).
    u_large = ((total / n_fin1 - m) * inv - kk / n_fin1).nan_to_num(0.0)  # (inf - inf: 0)
    u_small = (j_hi - 1) - kk
    u = torch.where(SMOOTH_START * eps >= top - bottom, u_large, u_small)
    u = torch.where(solve_rows, torch.minimum(torch.maximum(u, lo), hi), zeros)
    m2, inv2 = m[:, None], inv[:, None]
    done = ~solve_rows
    newton = torch.zeros_like(done)
    exact = torch.zeros_like(done)  # rows stopped on the root's piece (not by resolution)
    side = torch.zeros_like(k)  # the side of the last bracket update (Illinois)
    want_pos = want_one = zeros
    evaluate = _evaluate
    block = 1 if x.device.type == "cpu" else GPU_BLOCK
    for i in range(max_iter):
        r, pos, pos0, one, one1, sum_y = evaluate(x, m2, u[:, None], inv2, k, reduce)
        # Exact stop: the step's piece was right (the iterate is its root), or r is 0.
        exact = exact | (~done & ((newton & (pos == want_pos) & (one == want_one)) | (r == 0)))
        done = done | exact
        if i == max_iter - 1 or ((i + 1) % block == 0 and bool(done.all())):
            break
        up = r > 0
        # The linear piece on the side of the step: entries at a breakpoint join it.
        want_pos = torch.where(up, pos, pos0)
        want_one = torch.where(up, one1, one)
        free = want_pos - want_one
        below, above = up & ~done, (r < 0) & ~done
        # Illinois: the end that stays twice in a row has its residual halved.
        r_lo = torch.where(below, r, torch.where(above & (side < 0), 0.5 * r_lo, r_lo))
        r_hi = torch.where(above, r, torch.where(below & (side > 0), 0.5 * r_hi, r_hi))
        lo = torch.where(below, u, lo)
        hi = torch.where(above, u, hi)
        side = torch.where(below, 1.0, torch.where(above, -1.0, side))
        # the piece's root in closed form, mean_S(y) - (k - |U|) / |S| (the entries at the
        # breakpoint that joins S have y = u + 1 going up, y = u going down)
        joins = torch.where(up, (one - one1) * (u + 1), (pos0 - pos) * u)
        step = (sum_y + joins - (k - want_one)) / free.clamp(min=1)
        newton = (free > 0) & (step > lo) & (step < hi)
        secant = lo + (hi - lo) * (r_lo / (r_lo - r_hi))
        mid = 0.5 * lo + 0.5 * hi
        secant = torch.where((secant > lo) & (secant < hi), secant, mid)
        u_new = torch.where(newton, step, secant)
        # No representable point left between the ends: u is as close as the dtype allows.
        done = done | (u_new == u) | (u_new <= lo) | (u_new >= hi)
        u = torch.where(done, u, u_new)
    a, a_p, r, r_p, size = _polish(x, m2, u, lo, hi, eps, exact, k, reduce)
    take = solve_rows & (size > 0) & (exact | (r_p.abs() <= r.abs()))
    all_taken, all_done, regular = torch.stack((take.all(), done.all(), solve_rows.all())).tolist()
    a = a_p if all_taken else torch.where(take[:, None], a_p, a)
    converged: torch.Tensor | None = None if all_done else done
    if not regular:
        a = _fill_special(a, x, sel_none, sel_all, invalid)
    return a, converged


def _free(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The free entries ``0 < a < 1`` as a float mask, and ``1 / |S|`` per row (B, 1), 0 where
    S is empty; NaN rows keep their NaN (the mask is NaN there)."""
    nan = a != a
    free = ((a > 0) & (a < 1)).to(a.dtype)
    size = free.sum(-1, keepdim=True)
    inv = torch.where(size > 0, 1 / size.clamp(min=1), 0)
    inv = inv.masked_fill(nan.any(-1, keepdim=True), math.nan)
    return free, inv


def _solve_and_warn(
    x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor, max_iter: int, caller: str
) -> torch.Tensor:
    """The reference of the operator ``sparse_threshold``: the mask, after the warning."""
    a, converged = _solve(x, k, eps, max_iter)
    if converged is not None:
        warn_not_converged(caller, converged, max_iter)
    return a


SOLVE_OP: Any = define(
    "softops::sparse_threshold",
    "(Tensor x, Tensor k, Tensor eps, int max_iter, str caller) -> Tensor",
    reference=_solve_and_warn,
    fake=lambda x, k, eps, max_iter, caller: torch.empty_like(x),
    vmap=lambda info, in_dims, *args: vmap_rows(SOLVE_OP, info, in_dims, *args),
)
"""The solve as an operator (not differentiable): (x, k, eps, max_iter, caller) -> the mask."""


class _SparseTopKMask(torch.autograd.Function):
    """``a = clip((x - t)/eps, 0, 1)`` with ``sum a = k`` per canonical row; closed-form
    backward and jvp."""

    @staticmethod
    def forward(
        x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor, max_iter: int, caller: str
    ) -> torch.Tensor:
        return SOLVE_OP(x, k, eps, max_iter, caller)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        a = output
        ctx.set_materialize_grads(False)
        eps = inputs[2]
        # a is saved as an output: double backward differentiates through it (in epsilon).
        ctx.save_for_backward(a, eps)
        ctx.save_for_forward(a, eps)

    @staticmethod
    def backward(ctx: Any, ga: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if ga is None:
            return None, None, None, None, None
        need_x, need_k, need_eps = ctx.needs_input_grad[:3]
        a, eps = ctx.saved_tensors
        free, inv = _free(a.detach())
        e = eps[:, None]
        g = ga * free
        mean_g = g.sum(-1, keepdim=True) * inv
        gx = gk = geps = None
        if need_x:
            gx = free * (ga - mean_g) / e
        if need_k:
            gk = mean_g.squeeze(-1)
        if need_eps:
            af = torch.where(free > 0, a, 0)
            geps = -((g - free * mean_g) * af).sum(-1) / eps
        return gx, gk, geps, None, None

    @staticmethod
    def jvp(
        ctx: Any,
        dx: torch.Tensor | None,
        dk: torch.Tensor | None,
        deps: torch.Tensor | None,
        *_: Any,
    ) -> torch.Tensor:
        """``da = [S] ((dx - mean_S dx) / eps - (a - mean_S a) deps / eps + dk / |S|)``: the
        Jacobian in x is symmetric, so the part in x is the backward's map."""
        a, eps = ctx.saved_tensors
        free, inv = _free(a)
        e = eps[:, None]
        da = torch.zeros_like(a)
        if dx is not None:
            da = free * (dx - (free * dx).sum(-1, keepdim=True) * inv) / e
        if deps is not None:
            af = torch.where(free > 0, a, 0)
            da = da - free * (af - af.sum(-1, keepdim=True) * inv) * (deps[:, None] / e)
        if dk is not None:
            da = da + free * inv * dk[:, None]
        return da

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_rows(_SparseTopKMask, info, in_dims, *args)


_SparseTopKMaskTraced = without_jvp(_SparseTopKMask)


def mask(
    x2: torch.Tensor, k_row: torch.Tensor, eps_row: torch.Tensor, opts: MaskOptions
) -> torch.Tensor:
    """The mask (B, n) of canonical rows, largest first, with the non-convergence warning."""
    args = (x2, k_row, eps_row, opts.max_iter, opts.op)
    if torch.compiler.is_compiling():
        return _SparseTopKMaskTraced.apply(*args)
    return _SparseTopKMask.apply(*args)
