r"""Method "ot" of ``soft_topk_mask``: the exact SOFT top-k, one threshold per row.

With two targets the entropic OT plan of SOFT top-k (Xie et al. 2020, §2) is a sigmoid with one
threshold (the derivation is in the documentation, docs/math.md §1), so the forward pass solves
:math:`\sum_i \sigma((x_i - t)/\varepsilon) = k` for every row of a (B, n) tensor, largest-first,
by bracketed Newton (:mod:`softops._core.rootfind`), and the backward is the closed-form implicit
gradient (``_SoftTopKMaskOT``), O(n) per row:

.. math::

    s_i = A_i (1 - A_i)/\varepsilon, \qquad
    \bar x = s \odot \big(\bar A - \langle s, \bar A\rangle / \textstyle\sum_i s_i\big),
    \qquad \bar k = \langle s, \bar A\rangle / \textstyle\sum_i s_i .

The two row reductions of the backward, ``sum(s)`` and ``<s, g>``, are ``_vjp_terms``; those of
the forward are in ``_evaluate``.

Numerics of the solver (docs/math.md §1.3):

* the row is centred on ``m``, an estimate of the threshold (the midpoint of the k-th and (k+1)-th
  largest for n <= ``EXACT_MAX_N``, of a strided subsample's quantile above it), so that ``t``
  is small and finely resolved even in float32 at tiny epsilon;
* the residual is evaluated from ``u = min(A, 1 - A)`` with the sign split, so it has no
  cancellation (plain ``A.sum() - k`` in float32 resolves k = 9990 of n = 1e4 only to +-0.07);
* the bracket is exact: ``[x_(j) - eps log(k / (j - k)), x_(j') - eps log((k - j' + 1) / (n - k))]``
  with ``j = floor(k) + 1`` and ``j' = ceil(k)`` (for integer k, the lemma of docs/math.md
  §1.3); the subsampled path uses the looser ``[min x, max x] - eps logit(k / n)``;
* the initial iterate is the better of the centre and the large-epsilon guess
  ``mean(x) - eps logit(k / n)``; both evaluations also tighten the bracket;
* infinities need no special treatment in the residual: ``+inf`` counts as selected and ``-inf``
  as not. Rows whose k cannot be met by their finite entries are flagged, not solved.
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import torch

from softops._core.convergence import THRESHOLD_MAX_ITER, warn_not_converged
from softops._core.fused import compile_enabled, maybe_fused
from softops._core.rootfind import bracketed_newton

__all__ = [
    "EXACT_MAX_N",
    "ThresholdState",
    "hard_topk_mask",
    "mask_from_threshold",
    "ot_mask",
    "solve",
]

EXACT_MAX_N = 16384
"""Rows up to this length are bracketed and centred by an exact ``torch.topk`` of k + 1 entries;
longer rows by a strided subsample of about ``SAMPLE_SIZE`` entries (the bracket stays exact)."""
SAMPLE_SIZE = 2048
BLOCK = 3
"""Newton evaluations between two convergence tests (no host sync inside a block)."""
# The cap on Newton evaluations is THRESHOLD_MAX_ITER (100). 3 to 6 are typical; plain bisection
# within the coarse bracket of the subsampled path needs at most about 30 (float32) or 60 (float64).


class ThresholdState(NamedTuple):
    """The solved threshold of each row, ``A = sigmoid(((x - m) - t) / eps)``, with diagnostics.

    ``sel_none``/``sel_all``/``invalid`` are None when no row needs them (all entries finite and
    0 < k < n); otherwise (B,) bool masks of rows that select only their ``+inf`` entries, all
    their non ``-inf`` entries, or that cannot be solved (NaN entries, or k not reachable).
    """

    m: torch.Tensor
    t: torch.Tensor
    converged: torch.Tensor
    iterations: int
    residual: torch.Tensor
    sel_none: torch.Tensor | None
    sel_all: torch.Tensor | None
    invalid: torch.Tensor | None


def _evaluate(
    x: torch.Tensor,
    m: torch.Tensor,
    t: torch.Tensor,
    eps: torch.Tensor,
    k: torch.Tensor,
    tol: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``F = sum A - k``, ``dF/dt`` and the tolerance on ``|F|``, reducing over the last dim.

    ``m``, ``t`` and ``eps`` have a trailing singleton dim; ``k`` has the reduced shape. With ``u =
    min(A, 1 - A)`` the residual is split by sign, so it has no cancellation; the tolerance is the
    rounding of the sums (at least that of min(k, n - k, 1)) plus the change of F over one ulp
    of t, plus the user's ``tol``.
    """
    em = torch.finfo(x.dtype).eps
    z = ((x - m) - t) / eps
    u = torch.sigmoid(-z.abs())
    pos = z > 0
    F = torch.where(pos, -u, u).sum(-1) + (pos.sum(-1, dtype=x.dtype) - k)  # count - k first
    slope = (u * (1 - u)).sum(-1) / eps.squeeze(-1)
    # The sums are of size min(k, n - k) at the root: below 1 the rounding floor follows them, so
    # that a k within rounding of 0 or n (1e-300, say) is still solved to relative precision.
    floor = torch.minimum(k, x.shape[-1] - k).clamp(0, 1)
    # ...down to the subnormal range, where each term is resolved only to the smallest subnormal
    # (k = 5e-324 on a tied row cannot be met more closely than that: no spurious warning).
    subnormal = x.shape[-1] * torch.finfo(x.dtype).smallest_normal * em
    bound = (
        32 * em * torch.maximum(u.sum(-1), floor)
        + 2 * em * slope * t.squeeze(-1).abs()
        + subnormal
        + tol
    )
    return F, -slope, bound


def _evaluate_t(
    t: torch.Tensor,
    x: torch.Tensor,
    m: torch.Tensor,
    eps: torch.Tensor,
    k: torch.Tensor,
    tol: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_evaluate` for a (B,) iterate, the form the root finder calls."""
    return _evaluate(x, m, t[:, None], eps, k, tol)


def _row_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row min, max and sum in one pass (NaN propagates into all three)."""
    return x.amin(-1), x.amax(-1), x.sum(-1)


def _mask(x: torch.Tensor, m: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(((x - m) - t) / eps)


def solve(
    x: torch.Tensor,
    k: torch.Tensor,
    eps: torch.Tensor,
    *,
    max_iter: int = THRESHOLD_MAX_ITER,
    tol: float = 0.0,
    k_scalar: float | None = None,
) -> ThresholdState:
    """Solve the threshold of every row of ``x`` (B, n), largest first.

    Args:
        x: (B, n) floating tensor (float32 or float64), may hold +-inf and NaN.
        k: (B,) target sums, in [0, n].
        eps: (B,) positive temperatures.
        max_iter: cap on evaluations.
        tol: extra absolute tolerance on ``|sum A - k|`` (0: machine precision only).
        k_scalar: the common value of k when it is a Python number (saves a host sync).
    """
    B, n = x.shape
    dtype = x.dtype
    em = torch.finfo(dtype).eps
    if k_scalar is not None and dtype == torch.float32:
        # k is the value the rows hold, rounded to the dtype: a Python k in (0, n) can round to
        # 0 or n (2.99999999 of n = 3 in float32), and the rows then take the limit below.
        k_scalar = struct.unpack("f", struct.pack("f", k_scalar))[0]
    xmin, xmax, xsum = maybe_fused(_row_stats, x)(x)
    all_finite = bool((torch.isfinite(xmin) & torch.isfinite(xmax)).all())
    sel_none: torch.Tensor | None = None
    sel_all: torch.Tensor | None = None
    invalid: torch.Tensor | None = None
    solve_rows: torch.Tensor | None = None  # None: every row is solved (the masks are None too)
    if all_finite:
        k_eff = k
        n_fin = torch.full_like(k, n)
        if not (k_scalar is not None and 0 < k_scalar < n):
            sel_none, sel_all = k <= 0, k >= n
            invalid = torch.zeros_like(sel_none)
            solve_rows = ~(sel_none | sel_all)
        xs = x
    else:
        finite = torch.isfinite(x)
        n_fin = finite.sum(-1).to(dtype)
        k_eff = k - (x == math.inf).sum(-1).to(dtype)
        invalid = torch.isnan(x).any(-1) | (k_eff < 0) | (k_eff > n_fin)
        sel_none = ~invalid & (k_eff == 0)
        sel_all = ~invalid & (k_eff == n_fin)
        solve_rows = ~(invalid | sel_none | sel_all)
        xs = torch.where(finite, x, -math.inf)

    zeros = torch.zeros(B, dtype=dtype, device=x.device)
    if solve_rows is not None and invalid is not None and not bool(solve_rows.any()):
        return ThresholdState(
            zeros,
            zeros,
            ~invalid,
            0,
            zeros.masked_fill(invalid, math.nan),
            sel_none,
            sel_all,
            invalid,
        )
    # Rows that are not solved get a harmless k so that the arithmetic below stays finite.
    kk = k_eff if solve_rows is None else torch.where(solve_rows, k_eff, 0.5 * n_fin.clamp(min=1))
    nn_ = n_fin if solve_rows is None else n_fin.clamp(min=1)
    logit_k = torch.log(kk) - torch.log(nn_ - kk)

    sample = None
    if n <= EXACT_MAX_N or not all_finite:
        j_hi = torch.ceil(kk).clamp(min=1).long()
        j_lo = torch.minimum(torch.floor(kk).long() + 1, nn_.long())
        if k_scalar is not None and all_finite:
            top = min(math.floor(k_scalar) + 1, n)
        else:
            top = int(j_lo.max())
        topv = xs.topk(top, dim=-1).values
        x_hi = topv.gather(-1, (j_hi - 1)[:, None]).squeeze(-1)
        x_lo = topv.gather(-1, (j_lo - 1)[:, None]).squeeze(-1)
        m = 0.5 * (x_hi + x_lo)
        # logs of the numerator and denominator apart: a ratio of a subnormal k (5e-324) and n
        # would round to 0 (log 0 = -inf: an infinite bracket that bisection cannot shrink)
        lo = (x_lo - m) - eps * (torch.log(kk) - torch.log(j_lo.to(dtype) - kk))
        hi = (x_hi - m) - eps * (torch.log(kk - (j_hi - 1).to(dtype)) - torch.log(nn_ - kk))
    else:
        stride = max(n // SAMPLE_SIZE, 1)
        sample = x[:, ::stride]
        ns = sample.shape[-1]
        q = (kk * (ns / n)).round().long().clamp(1, ns - 1)
        top = int(q.max()) + 1 if k_scalar is None else min(round(k_scalar * ns / n), ns - 1) + 1
        top = max(top, 2)
        topv = sample.topk(top, dim=-1).values
        m = 0.5 * (topv.gather(-1, (q - 1)[:, None]) + topv.gather(-1, q[:, None])).squeeze(-1)
        lo = (xmin - m) - eps * logit_k
        hi = (xmax - m) - eps * logit_k
    # Bounds on the residual at the bracket's ends: every entry above lo, none above hi.
    f_lo, f_hi = nn_ - kk, -kk
    if solve_rows is not None:
        m = torch.where(solve_rows, m, zeros)
        lo = torch.where(solve_rows, lo, zeros)
        hi = torch.where(solve_rows, hi, zeros)
    # Widen by one ulp of the scale so that rounding cannot leave the root outside the bracket.
    pad = 4 * em * (lo.abs() + hi.abs() + eps)
    lo, hi = lo - pad, hi + pad

    xmean = xsum / n if all_finite else torch.where(finite, x, 0).sum(-1) / nn_
    t_large = torch.minimum(torch.maximum(xmean - m - eps * logit_k, lo), hi)
    t_mid = torch.minimum(torch.maximum(zeros, lo), hi)

    # The residual counts +inf entries as selected, so it is taken against the total k.
    k_total = kk if all_finite else kk + (k - k_eff)
    evaluate_fn = maybe_fused(_evaluate, x)
    fused = evaluate_fn is not _evaluate
    m2, e2 = m[:, None], eps[:, None]

    t2 = torch.stack((t_mid, t_large), -1)
    if sample is not None:
        # Long rows: pick the better starting point on the subsample (a negligible cost).
        F2 = _evaluate(
            sample[:, None, :],
            m2[..., None],
            t2[..., None],
            e2[..., None],
            (k_total * (sample.shape[-1] / n))[:, None],
            0.0,
        )[0]
        t0 = t2.gather(-1, F2.abs().argmin(-1, keepdim=True)).squeeze(-1)
        first, init_evals = None, 0
    else:
        # Best of two starting points, evaluated in one pass; both tighten the bracket.
        F2, dF2, tol2 = evaluate_fn(
            x[:, None, :], m2[..., None], t2[..., None], e2[..., None], k_total[:, None], tol
        )
        tighter_lo = (F2 > 0) & (t2 >= lo[:, None])
        tighter_hi = (F2 < 0) & (t2 <= hi[:, None])
        lo2 = torch.where(tighter_lo, t2, lo[:, None])
        hi2 = torch.where(tighter_hi, t2, hi[:, None])
        lo, hi = lo2.amax(-1), hi2.amin(-1)
        f_lo = torch.where(tighter_lo, F2, f_lo[:, None]).gather(-1, lo2.argmax(-1, keepdim=True))
        f_hi = torch.where(tighter_hi, F2, f_hi[:, None]).gather(-1, hi2.argmin(-1, keepdim=True))
        f_lo, f_hi = f_lo.squeeze(-1), f_hi.squeeze(-1)
        best = F2.abs().argmin(-1, keepdim=True)
        t0 = t2.gather(-1, best).squeeze(-1)
        first = tuple(v.gather(-1, best).squeeze(-1) for v in (F2, dF2, tol2))
        init_evals = 2
    done = None if solve_rows is None else ~solve_rows
    res = bracketed_newton(
        _evaluate_t,
        t0,
        lo,
        hi,
        max_iter=max(max_iter - init_evals, 1),
        eval_args=(x, m2, e2, k_total, tol),
        done=done,
        f_lo=f_lo,
        f_hi=f_hi,
        first=first,
        # a host test is free on a CPU; elsewhere, or when fused, run blocks without syncs
        block=1 if x.device.type == "cpu" and not fused else BLOCK,
        wrap=lambda fn: maybe_fused(fn, x),
    )
    converged, residual = res.converged, res.residual
    if solve_rows is not None and invalid is not None:
        converged = converged | ~(solve_rows | invalid)
        residual = torch.where(solve_rows, residual, zeros).masked_fill(invalid, math.nan)
    return ThresholdState(
        m, res.root, converged, res.iterations + init_evals, residual, sel_none, sel_all, invalid
    )


def mask_from_threshold(x: torch.Tensor, state: ThresholdState, eps: torch.Tensor) -> torch.Tensor:
    """``sigmoid(((x - m) - t) / eps)`` with the special rows of ``state`` filled in exactly."""
    A = maybe_fused(_mask, x)(x, state.m[:, None], state.t[:, None], eps[:, None])
    if state.invalid is not None and state.sel_none is not None and state.sel_all is not None:
        A = torch.where(state.sel_none[:, None], (x == math.inf).to(x.dtype), A)
        A = torch.where(state.sel_all[:, None], (x > -math.inf).to(x.dtype), A)
        A = A.masked_fill(state.invalid[:, None], math.nan)
    return A


def _vjp_terms(
    A: torch.Tensor, g: torch.Tensor, eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``s = A(1 - A)/eps``, ``sum s`` and ``<s, g>`` per row (one pass when fused)."""
    s = A * (1 - A) / eps
    return s, s.sum(-1, keepdim=True), (s * g).sum(-1, keepdim=True)


def _vjp_x(A: torch.Tensor, g: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    s, ss, sg = _vjp_terms(A, g, eps)
    return s * (g - torch.where(ss > 0, sg / torch.where(ss > 0, ss, 1), 0))


def _k_weights(
    z: torch.Tensor, x: torch.Tensor, e: torch.Tensor, edge: torch.Tensor | None
) -> torch.Tensor:
    r"""``w = s / sum(s)`` per row (``dA/dk``), normalised in the log domain: it never underflows.

    ``log s_i = log sigma(z_i) + log sigma(-z_i) - log eps``: where every ``s_i`` underflows (a
    tiny epsilon, or k within rounding of 0 or n) the weights are still those of the limit. Rows
    whose k is 0 or n (``edge`` +1 or -1) have no finite threshold; there the weights are their
    one-sided limits as ``t -> +inf`` and ``t -> -inf``: ``softmax(x / eps)`` and
    ``softmax(-x / eps)`` over the finite entries. Rows without a finite entry get 0.
    """
    logw = torch.nn.functional.logsigmoid(z) + torch.nn.functional.logsigmoid(-z)
    if edge is not None:
        finite = torch.isfinite(x)
        xf = torch.where(finite, x, 0)
        top = torch.where(finite, x, -math.inf).amax(-1, keepdim=True)
        bottom = torch.where(finite, x, math.inf).amin(-1, keepdim=True)
        up = torch.where(finite, (xf - top.nan_to_num(0, 0, 0)) / e, -math.inf)
        down = torch.where(finite, (bottom.nan_to_num(0, 0, 0) - xf) / e, -math.inf)
        side = edge[:, None]
        logw = torch.where(side > 0, up, torch.where(side < 0, down, logw))
        w = torch.softmax(logw, -1)
        return torch.where(finite.any(-1, keepdim=True) | (side == 0), w, 0)
    return torch.softmax(logw, -1)


class _SoftTopKMaskOT(torch.autograd.Function):
    """A = sigmoid((x - t)/eps) with sum(A) = k per row; the implicit O(n) backward.

    Inputs are canonical: x (B, n) in the compute dtype, k (B,), eps (B,).
    """

    @staticmethod
    def forward(
        x: torch.Tensor,
        k: torch.Tensor,
        eps: torch.Tensor,
        max_iter: int,
        tol: float,
        k_scalar: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        state = solve(x, k, eps, max_iter=max_iter, tol=tol, k_scalar=k_scalar)
        A = mask_from_threshold(x, state, eps)
        # Rows that cannot be solved (NaN, unreachable k) are NaN by contract, not a failure.
        ok = state.converged if state.invalid is None else state.converged | state.invalid
        # Rows at k = 0 (+1) or k = n (-1), counting infinities: the backward's limits in k.
        edge = None
        if state.sel_none is not None and state.sel_all is not None:
            edge = state.sel_none.to(torch.int8) - state.sel_all.to(torch.int8)
        return A, state.m, state.t, ok, edge

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, _, eps = inputs[:3]
        A, m, t, converged, edge = output
        ctx.mark_non_differentiable(m, t, converged)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            ctx.save_for_backward(A, eps, x, m, t, edge)
        else:
            ctx.save_for_backward(A, eps)
        ctx.fused = compile_enabled()  # the backward follows the forward's choice

    @staticmethod
    def backward(ctx: Any, gA: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        A, eps = ctx.saved_tensors[:2]
        e = eps[:, None]
        need_x, need_k, need_eps = ctx.needs_input_grad[:3]
        gx = gk = geps = None
        if not (need_k or need_eps):
            if not torch.is_grad_enabled():
                # The common case: one fused pass for the sums, one for the gradient.
                return maybe_fused(_vjp_x, A, ctx.fused)(A, gA, e), None, None, None, None, None
            return _vjp_x(A, gA, e), None, None, None, None, None
        x, m, t, edge = ctx.saved_tensors[2:]
        s = A * (1 - A) / e
        z = ((x - m[:, None]) - t[:, None]) / e
        w = _k_weights(z, x, e, edge)
        ratio = (w * gA).sum(-1, keepdim=True)
        if need_x:
            gx = s * (gA - ratio)
        if need_k:
            gk = ratio.squeeze(-1)
        if need_eps:
            zc = torch.where(s > 0, z, 0) - (w * torch.where(w > 0, z, 0)).sum(-1, keepdim=True)
            geps = -(gA * s * zc).sum(-1)
        return gx, gk, geps, None, None, None


def ot_mask(
    op: str,
    x2: torch.Tensor,
    k_row: torch.Tensor,
    eps_row: torch.Tensor,
    max_iter: int,
    tol: float,
    k_scalar: float | None,
) -> torch.Tensor:
    """The mask A (B, n) of canonical rows, with the non-convergence warning (no host sync
    beyond the one of the warning's check)."""
    A, _, _, converged, _ = _SoftTopKMaskOT.apply(x2, k_row, eps_row, max_iter, tol, k_scalar)
    warn_not_converged(op, converged, max_iter)
    return A


def hard_topk_mask(x: torch.Tensor, k: torch.Tensor, k_scalar: int | None) -> torch.Tensor:
    """The 0/1 mask of the k largest entries of each row of ``x`` (B, n).

    ``k`` is (B,) with integer values; ``k_scalar`` is its common value when known (one
    ``torch.topk`` instead of a full argsort). Ties are broken as ``torch.topk`` breaks them.
    """
    if k_scalar is not None:
        if k_scalar == 0:
            return torch.zeros_like(x)
        return torch.zeros_like(x).scatter_(-1, x.topk(k_scalar, dim=-1).indices, 1.0)
    order = x.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(x.shape[-1], device=x.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    return (rank < k[:, None]).to(x.dtype)
