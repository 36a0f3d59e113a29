r"""Batched log-domain Sinkhorn for n x m problems with a small m, and its implicit backward.

Problem (one per batch row, rows fully independent):

.. math::

    \Gamma^\star = \arg\min_{\Gamma \ge 0,\ \Gamma 1 = a,\ \Gamma^\top 1 = b}
    \langle C, \Gamma\rangle + \varepsilon \sum_{ij} \Gamma_{ij}(\log \Gamma_{ij} - 1),
    \qquad \Gamma_{ij} = \exp((f_i + g_j - C_{ij})/\varepsilon).

Public (inside softops) entry points:

* ``log_sinkhorn(cost, log_a, log_b, epsilon, *, max_iter, tol, newton=False,
  newton_first=False, potentials=True) -> SinkhornResult`` runs without autograd. ``cost`` is
  (B, n, m), ``log_a`` (B, n), ``log_b`` (B, m), ``epsilon`` a (B,) tensor (one value per row).
  ``potentials=False`` leaves ``f`` and ``g`` empty (B, 0), for callers that use the plan only.
* ``sinkhorn_plan(cost, log_a, log_b, epsilon, max_iter, tol, newton=False, newton_first=False,
  potentials=True) -> tuple[Tensor, SinkhornResult]`` returns ``(plan, result)`` where ``plan``
  (B, n, m) is differentiable with respect to ``cost`` through the implicit Function
  ``SinkhornPlanFunction`` (``result.plan`` is the same tensor; ``result.f``/``result.g``
  carry no gradient).
  ``log_a``, ``log_b`` and ``epsilon`` are treated as constants: no gradient flows to them.
  Callers that need a gradient in epsilon pass ``cost / epsilon`` with ``epsilon = 1``.

Conventions and choices:

* **Iteration.** One iteration is the pair (row update of f, column update of g), as in the SOFT
  paper's code (Xie et al. 2020, arXiv 2002.06504). The returned plan is the state after the last
  g-update, so its **columns are exact** and ``residual`` is the L1 error of its row sums, relative
  to the total mass: ``sum_i |sum_j Gamma_ij - a_i| / sum_i a_i``. With ``tol=0`` exactly
  ``max_iter`` iterations run (``max_iter=200, tol=0`` is the paper's fixed 200 iterations).
* **Internal form.** The row update is implicit: with v = g/epsilon and scaled cost
  S = C/epsilon, ``Gamma = diag(a) softmax_j(v_j - S_ij) diag(b/c)`` with c the column sums of
  ``diag(a) softmax``. The loop only updates v (B, m): ``v += log b - log c``. The layout is
  (B, m, n) so that the sums over n are contiguous; for m = 2 the softmax is one ``sigmoid``.
  The first column update is done fully in log space (it may see underflowing columns); after an
  exact column update every column sum is at least ``b_j min_i a_i / sum b``, so later updates
  cannot underflow.
* **Convergence** is checked every ``CHECK_EVERY`` iterations, batched (one host sync per check).
  Converged rows are frozen and removed from the working set, so a row's result does not depend on
  the other rows. A row whose residual is NaN/inf stops at once; its outputs are NaN.
* **Epsilon scaling** (``tol > 0``): Sinkhorn moves each potential by O(1) (in units of
  epsilon) per iteration, so at an epsilon far below the gaps of the cost it crawls (1e5
  iterations did not reach 1e-3). Rows still above the tolerance (or the Newton switch) after
  ``ANNEAL_AFTER`` iterations are solved again from their epsilon times their scaled-cost span
  over ``ANNEAL_SPAN`` down to their own, by factors of about ``ANNEAL_FACTOR``, each stage
  warm-started from the last (Kosowsky and Yuille 1994; Schmitzer 2019), and kept where
  that lowers their residual. Other rows are untouched.
* **Newton polish** (``newton=True`` and ``tol > 0``): Sinkhorn runs until the residual is at most
  ``max(tol, NEWTON_SWITCH)``; then semi-dual Newton on the reduced (m-1) x (m-1) SPD system
  (gauge: the last v is fixed) with Armijo backtracking, at most ``NEWTON_MAX_STEPS`` steps. Each
  row keeps the state of smallest residual seen (Newton never makes it worse), and rows Newton
  did not finish go back to Sinkhorn for the rest of the ``max_iter`` budget. The polish, that
  fallback and the final plan run in float64 (the bulk of the iterations stays in the input
  dtype): in float32 the residual of a plan with many targets has a floor near 1e-6. The
  gradient ``b - c`` and the Armijo gain are formed relative to each row's home column (its
  largest entry), as sums of small products: near a permutation the direct difference keeps
  only the rounding of the O(1) masses, and on nearly decoupled blocks of columns that noise
  drove steps Armijo could never accept.
* **Newton first** (``newton_first=True``, the sorted top-k): for costs whose column constants
  make v = 0 a close start (the sorted top-k's cost centred at the midpoints of the sorted
  scores, where v = 0 is the hard assignment), semi-dual Newton runs at once, in float64, all
  rows in lock-step, from one Sinkhorn column update of v = 0 (also the solution as epsilon ->
  infinity). Each state is one ``softmax`` over m (layout (B, m, n), contiguous) and ``b - c``
  formed relative to each row's reference column (its cheapest one, fixed at the start) as
  sums of small products; for m <= 3 the Newton system is the grounded Laplacian of the
  couplings ``w_jl = sum_i a_i P_ij P_il``, solved by Cramer's rule (its adjugate and
  determinant are sums of products: no cancellation), larger m by the Cholesky of
  :func:`_factor`. A row stops when its bound ``sum_j |b_j - c_j| / sum_i a_i`` on the residual
  is at most ``tol``, or when a step does not lower it (that row keeps its state); one host
  read per step. Rows left above ``tol`` are solved from the start by the hybrid path below.
  On the sorted top-k (standard normal scores or log-probabilities, epsilon 0.1 to 1) three
  steps reach 1e-6. On the CPU, for rows of at most ``KERNEL_MAX_WORK`` entries ``n m^2``, the
  same solve runs row by row in a C++ kernel (``_newton_kernel.cpp``, the operator
  ``softops::newton_first`` of :mod:`softops._kernels`, where it is built and the kernel back end
  is on), with the same arithmetic and stopping rule: a small batch (a beam step's (64, 18, 3))
  is a few hundred tensor operations of a few microseconds each in torch, one call there. The
  rows it leaves (not converged, a zero mass, a NaN) go to the torch code.
* **Backward** (docs/math.md §2.3). With P = diag(1/mu) Gamma (mu the row sums of the saved
  plan), u = Gbar - beta (beta_m = 0) and ``centred(u)_ij = u_ij - sum_l P_il u_il``, the cost
  gradient is ``Cbar = -Gamma * centred(u) / epsilon`` where beta (m-1) makes the first m-1
  column sums of Cbar vanish: ``K beta = sum_i Gamma_ij centred(Gbar)_ij`` with
  ``K = diag(nu_<) - Gamma_<^T diag(1/mu) Gamma_<`` (the same system as alpha/beta of §2.3,
  rewritten). When the plan is nearly a permutation, K and that right-hand side are both of the
  size of the off-dominant plan entries (1e-16 and below), and the textbook forms
  ``nu_j - sum_i Gamma_ij^2/mu_i`` and ``wc - Gamma^T (w/mu)`` are differences of O(1) numbers:
  they keep only rounding noise, and K even came out indefinite (its Cholesky then failed
  silently), which gave O(10-100) gradient errors with a converged forward. So every quantity is
  formed without cancellation: K's off-diagonals are products, its diagonal
  ``sum_i Gamma_ij sum_{l != j} P_il``; ``centred`` shifts each nearly one-hot row by its value at
  the dominant entry first, so its mean correction is a sum of small products. K (a grounded
  graph Laplacian: diagonally dominant, its diagonal spanning many orders of magnitude) is then
  Jacobi-equilibrated before the float64 Cholesky, with a relative jitter of a few ulps per column
  (a jitter relative to max diag K wipes out the small columns); one step of iterative refinement
  with the accurately formed residual removes the jitter's effect in the determined directions,
  and the directions it leaves undetermined (columns with no coupling left) change Cbar only by
  their tiny coupling (pseudo-inverse behaviour). Only the plan (B, n, m) and epsilon (B,) are
  saved, so memory does not grow with the number of iterations. The backward is written with
  differentiable torch ops, so double backward works.
* **Closed-form backward** (the ``newton_first`` path, m <= 3): K is the grounded Laplacian of
  ``w_jl = sum_i Gamma_ij P_il`` and is solved by Cramer's rule, whose adjugate and determinant
  are sums of products of the couplings: exact up to rounding whatever K's conditioning, so no
  jitter or refinement. Rows whose ``det K`` is not a normal number well above underflow (a
  column with no coupling left) take the Cholesky path above, row by row.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._C import _functorch

from softops._core.convergence import warn_not_converged
from softops._core.transforms import apply_function, plain, vmap_rows
from softops._kernels import Kernel, define, kernels_enabled

__all__ = [
    "CHECK_EVERY",
    "DET_MIN",
    "NEWTON_FIRST_STEPS",
    "NEWTON_MAX_STEPS",
    "NEWTON_SWITCH",
    "SinkhornPlanFunction",
    "SinkhornResult",
    "attach_epsilon",
    "log_sinkhorn",
    "log_sinkhorn_checked",
    "sinkhorn_plan",
    "sinkhorn_plan_checked",
    "use_kernel",
]

CHECK_EVERY = 10
"""Iterations between two batched convergence checks."""
NEWTON_SWITCH = 1e-3
"""Residual below which Sinkhorn hands over to Newton."""
NEWTON_MAX_STEPS = 30
"""Cap on Newton steps per polish phase."""
NEWTON_FIRST_STEPS = 12
"""Cap on the steps of a Newton solve started at the caller's warm start (``newton_first``)."""
ANNEAL_AFTER = 10 * CHECK_EVERY
"""Iterations after which a converging solve anneals the rows still above the Newton switch."""
ANNEAL_SPAN = 16.0
"""Scaled-cost span of a row at the first (largest) epsilon of its annealing."""
ANNEAL_FACTOR = 4.0
"""Ratio of the epsilons of two consecutive annealing stages."""
_ARMIJO_MAX_HALVINGS = 30
_ARMIJO_SIGMA = 1e-4
_JITTER_ULPS = 16.0
_JITTER_RETRY = 1e-10
_REFINE_STEPS = 1
DET_MIN = 2.0**-960
"""Smallest det K (about 1e-289) that :func:`_closed_form_vjp` solves in closed form."""


class SinkhornResult(NamedTuple):
    """Solution of a batch of entropic OT problems, with diagnostics.

    Attributes:
        f: (B, n) row potentials, in the units of the cost.
        g: (B, m) column potentials, in the units of the cost.
        plan: (B, n, m) transport plan ``exp((f_i + g_j - C_ij)/epsilon)``; columns exact.
        converged: (B,) bool, ``residual <= tol`` (False for NaN rows).
        iterations: Sinkhorn iterations plus Newton steps run by the solver (max over rows).
        residual: (B,) relative L1 row-marginal error of ``plan``.
    """

    f: Tensor
    g: Tensor
    plan: Tensor
    converged: Tensor
    iterations: int
    residual: Tensor


class _Problem(NamedTuple):
    """Scaled problem data for the working set of rows (internal layout (B, m, n))."""

    s: Tensor  # (B, m, n) cost / epsilon
    d: Tensor | None  # (B, n) s[:, 1] - s[:, 0] when m == 2
    log_a: Tensor  # (B, n)
    a: Tensor  # (B, n)
    a_sum: Tensor  # (B,)
    log_b: Tensor  # (B, m)
    sign: Tensor | None  # (B, 1) +1 where column 1 has the smaller mass, else -1 (m == 2)
    empty: Tensor  # (B, m) columns of zero mass (log_b = -inf): their plan column is 0

    def to(self, dtype: torch.dtype) -> _Problem:
        if self.s.dtype == dtype:
            return self
        return _Problem._make(
            t if t is None or t.dtype == torch.bool else t.to(dtype) for t in self
        )

    def select(self, keep: Tensor) -> _Problem:
        return _Problem(
            self.s[keep],
            None if self.d is None else self.d[keep],
            self.log_a[keep],
            self.a[keep],
            self.a_sum[keep],
            self.log_b[keep],
            None if self.sign is None else self.sign[keep],
            self.empty[keep],
        )


def _make_problem(cost: Tensor, log_a: Tensor, log_b: Tensor, epsilon: Tensor) -> _Problem:
    bsz, n, m = cost.shape
    s = torch.empty((bsz, m, n), dtype=cost.dtype, device=cost.device)
    s.copy_(cost.transpose(1, 2))
    s.div_(epsilon.to(cost.dtype).reshape(bsz, 1, 1))
    log_a = log_a.to(cost.dtype)
    log_b = log_b.to(cost.dtype)
    a = log_a.exp()
    d = sign = None
    if m == 2:
        d = s[:, 1] - s[:, 0]
        sign = torch.where(log_b[:, 1:2] <= log_b[:, 0:1], 1.0, -1.0).to(cost.dtype)
    return _Problem(s, d, log_a, a, a.sum(-1), log_b, sign, torch.isneginf(log_b))


def _log_ratio(prob: _Problem, log_c: Tensor) -> Tensor:
    """``log(b/c)``, with -inf (not NaN) for the zero-mass columns."""
    return torch.where(prob.empty, -math.inf, prob.log_b - log_c)


def _shifted(prob: _Problem, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(S - M, M)`` for ``S_ji = v_j - s_ji`` and ``M_i = max_j S_ji`` (M of shape (B, 1, n)).

    Written with plain reductions: ``torch.softmax`` over a non-last dim opens a parallel region
    even for tiny inputs, which is slow on a busy machine.
    """
    shifted = v.unsqueeze(-1) - prob.s
    mx = shifted.amax(1, keepdim=True)
    return shifted.sub_(mx), mx


def _exp_and_sum(prob: _Problem, v: Tensor, floor: float | None = None) -> tuple[Tensor, Tensor]:
    """``(E, Z)`` with ``E = exp(S - M)`` (B, m, n) and ``Z = sum_j E`` (B, n).

    With ``floor``, ``S - M`` is clamped below at it first, which keeps the hot loop out of
    subnormal numbers (slow on CPUs); the entries it changes are below 1e-26 relative to the row.
    """
    shifted, _ = _shifted(prob, v)
    if floor is not None:
        shifted.clamp_min_(floor)
    e = shifted.exp_()
    return e, e.sum(1)


def _loop_floor(dtype: torch.dtype) -> float:
    return 0.7 * math.log(torch.finfo(dtype).tiny)


def _probs(prob: _Problem, v: Tensor) -> Tensor:
    """Row softmax ``P_ij = softmax_j(v_j - s_ij)`` in (B, m, n) layout, full relative precision."""
    if prob.d is not None:
        z = (v[:, 1:2] - v[:, 0:1]) - prob.d
        p = torch.empty_like(prob.s)
        torch.sigmoid(z, out=p[:, 1])
        torch.sigmoid(z.neg_(), out=p[:, 0])
        return p
    e, z = _exp_and_sum(prob, v)
    return e.div_(z.unsqueeze(1))


def _row_lse(prob: _Problem, v: Tensor) -> Tensor:
    """``LSE_j(v_j - s_ij)``, shape (B, n)."""
    if prob.d is not None:
        return torch.logaddexp(v[:, 0:1] - prob.s[:, 0], v[:, 1:2] - prob.s[:, 1])
    shifted, mx = _shifted(prob, v)
    return mx.squeeze(1) + shifted.exp_().sum(1).log()


def _log_probs(prob: _Problem, v: Tensor) -> Tensor:
    """``log P_ij`` (B, m, n), fully in log space (robust to underflow)."""
    if prob.d is not None:
        z = (v[:, 1:2] - v[:, 0:1]) - prob.d
        return torch.stack(
            (torch.nn.functional.logsigmoid(-z), torch.nn.functional.logsigmoid(z)), dim=1
        )
    shifted, _ = _shifted(prob, v)
    return shifted.sub_(shifted.exp().sum(1, keepdim=True).log())


def _log_col_sums_exact(prob: _Problem, v: Tensor, log_p: Tensor | None = None) -> Tensor:
    """``log c_j = LSE_i(log a_i + log P_ij)`` fully in log space (robust to underflow)."""
    if log_p is None:
        log_p = _log_probs(prob, v)
    return torch.logsumexp(log_p + prob.log_a.unsqueeze(1), dim=-1)


SAFE_COLUMN = 2.0**30
"""Column sums above ``finfo.tiny * SAFE_COLUMN`` are formed in linear space; at or below it
their logarithm is taken from the log-space sums (:func:`_log_col_sums_exact`)."""


def _safe_level(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).tiny * SAFE_COLUMN


def _fragile(prob: _Problem) -> bool:
    """Whether a column sum of some row can fall to ``_safe_level`` in the loop (one host read).

    After an exact column update every column sum is at least ``b_j min_i a_i / sum_i a_i``
    (the row masses of the plan are at most its total), so a row whose smallest nonzero masses
    keep that bound above the level never needs the log-space sums in the loop. A column of
    subnormal mass (``soft_topk_mask(method="sinkhorn")`` at ``k < n finfo.tiny``) does: its
    linear sum rounds to a few subnormal ulps, or to 0 (``sigmoid`` gives 0 below
    ``1 / finfo.max``), and ``log 0`` sent its potential to ``+inf`` and the plan to NaN."""
    log_b = torch.where(prob.empty, math.inf, prob.log_b).amin(-1)
    log_a = torch.where(torch.isneginf(prob.log_a), math.inf, prob.log_a).amin(-1)
    bound = log_b + log_a - prob.a_sum.log()
    return _any_set(bound <= math.log(_safe_level(prob.s.dtype)))


def _safe_log_col_sums(
    prob: _Problem, v: Tensor, c: Tensor, exact_log_c: Tensor | None = None
) -> Tensor:
    """``log c`` of the linear column sums ``c`` (B, m) at ``v``, with the log-space sums
    (``exact_log_c``, computed here where none is given and some sum needs it) wherever ``c`` is
    at or below the safe level: there the linear sum has lost its relative precision to the
    subnormal range, or is 0."""
    log_c = c.log()
    low = c <= _safe_level(c.dtype)
    if exact_log_c is None:
        if not _any_set(low):
            return log_c
        exact_log_c = _log_col_sums_exact(prob, v)
    return torch.where(low, exact_log_c, log_c)


def _fast_log_col_sums(prob: _Problem, v: Tensor, buf: Tensor, fragile: bool = False) -> Tensor:
    """log column sums for the hot loop (one sigmoid pass when m = 2). With ``fragile``
    (:func:`_fragile`) the sums at or below the safe level are taken from the log-space ones, and
    the general path's floor (which would raise them) is off."""
    if fragile:
        if prob.d is not None and prob.sign is not None:
            c = _fast_log_col_sums(prob, v, buf).exp()
        else:
            e, z = _exp_and_sum(prob, v)
            c = torch.linalg.vecdot(e, (prob.a / z).unsqueeze(1))
        return torch.where(c <= _safe_level(c.dtype), _log_col_sums_exact(prob, v), c.log())
    if prob.d is not None and prob.sign is not None:
        # Compute the column whose target mass is smaller directly and the other by subtraction:
        # near the solution the latter is at least half the total, so no precision is lost.
        torch.sub(v[:, 1:2] - v[:, 0:1], prob.d, out=buf)
        buf.mul_(prob.sign)
        torch.sigmoid(buf, out=buf)
        c_small = torch.linalg.vecdot(buf, prob.a)
        c_big = prob.a_sum - c_small
        small1 = prob.sign[:, 0] > 0
        c1 = torch.where(small1, c_small, c_big)
        c0 = torch.where(small1, c_big, c_small)
        return torch.stack((c0, c1), dim=-1).log()
    e, z = _exp_and_sum(prob, v, _loop_floor(v.dtype))
    return torch.linalg.vecdot(e, (prob.a / z).unsqueeze(1)).log()


def _check(prob: _Problem, v: Tensor, exact_log_c: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Return ``(log_c, err)`` at the state ``v``.

    ``err`` is the relative L1 row error of the column-exact plan ``diag(a) P diag(b/c)``.
    """
    p = _probs(prob, v)
    c = torch.linalg.vecdot(p, prob.a.unsqueeze(1))
    log_c = _safe_log_col_sums(prob, v, c, exact_log_c)
    r = _log_ratio(prob, log_c).exp()
    row = torch.linalg.vecdot(p, r.unsqueeze(-1), dim=1)  # (B, n): sum_j P_ij r_j
    err = torch.linalg.vecdot((row - 1).abs(), prob.a) / prob.a_sum
    return log_c, err


def _sinkhorn_loop(
    prob: _Problem, v: Tensor, max_iter: int, tol: float
) -> tuple[Tensor, Tensor, int]:
    """Run Sinkhorn from ``v``; return (v per row, err per row (NaN if unchecked), iterations).

    Each returned v is the state at which the row stopped (before its would-be next update).
    """
    bsz = v.shape[0]
    out_v = v.clone()
    out_err = torch.full((bsz,), math.nan, dtype=v.dtype, device=v.device)
    idx = torch.arange(bsz, device=v.device)
    cur, cv = prob, v
    buf = torch.empty_like(prob.a)
    fragile = max_iter > 1 and _fragile(prob)
    it = 0
    for it in range(1, max_iter + 1):
        last = it == max_iter
        check = tol > 0 and (it % CHECK_EVERY == 0 or last)
        if last and not check:
            break
        if check:
            log_c, err = _check(cur, cv, _log_col_sums_exact(cur, cv) if it == 1 else None)
            done = ~(err > tol) | last  # NaN residual stops the row
            n_done = int(done.sum())
            if n_done:
                rows = idx[done]
                out_v[rows] = cv[done]
                out_err[rows] = err[done]
                if n_done == idx.numel():
                    idx = idx[:0]
                    break
                keep = ~done
                idx, cur, cv, log_c = idx[keep], cur.select(keep), cv[keep], log_c[keep]
        elif it == 1:
            log_c = _log_col_sums_exact(cur, cv)
        else:
            if buf.shape != cur.a.shape:
                buf = torch.empty_like(cur.a)
            log_c = _fast_log_col_sums(cur, cv, buf, fragile)
        cv = cv + _log_ratio(cur, log_c)
    if idx.numel():
        out_v[idx] = cv
    return out_v, out_err, it


def _scaled(prob: _Problem, lam: Tensor) -> _Problem:
    """The problem at ``lam`` (B,) times its epsilon: the scaled cost divided by ``lam``."""
    return prob._replace(
        s=prob.s / lam[:, None, None], d=None if prob.d is None else prob.d / lam[:, None]
    )


def _anneal(prob: _Problem, v: Tensor, max_iter: int) -> tuple[Tensor, int]:
    """Warm start by epsilon scaling; return (v, iterations used).

    Each row whose scaled cost spans more than ``ANNEAL_SPAN`` is solved, loosely, at epsilons
    ``lam * epsilon`` that fall geometrically (by about ``ANNEAL_FACTOR``) from the one where its
    span is ``ANNEAL_SPAN`` down to its own, each stage warm-started from the last (the
    potential in cost units, ``lam * v``, carries over). Each stage runs Sinkhorn to the Newton
    switch residual, within ``max_iter // 20`` iterations, and the stages together use at most
    half of ``max_iter``. A row's stages depend on its own cost only (rows with fewer stages
    join later). NaN rows do not anneal.
    """
    s = prob.s
    big = torch.where(torch.isfinite(s), s, -math.inf).amax(dim=(1, 2))
    small = torch.where(torch.isfinite(s), s, math.inf).amin(dim=(1, 2))
    lam0 = ((big - small) / ANNEAL_SPAN).nan_to_num(nan=1.0, posinf=1.0, neginf=1.0)
    lam0 = lam0.clamp_min(1.0).double()
    stages = torch.ceil(lam0.log() / math.log(ANNEAL_FACTOR)).long()  # 0 where lam0 == 1
    n_stages = int(stages.max())
    cap = max(CHECK_EVERY, max_iter // 20)
    used = 0
    for t in range(n_stages):
        left = max_iter // 2 - used
        if left <= 1:
            break
        j = t - (n_stages - stages)  # the row's own stage index; < 0: not started
        active = j >= 0
        rows = active.nonzero().squeeze(-1)
        # lam0 ** (1 - j / stages): from lam0 at j = 0 to lam0 ** (1 / stages) <= FACTOR
        frac = 1.0 - j[rows].to(lam0.dtype) / stages[rows].to(lam0.dtype)
        lam = lam0[rows].pow(frac).to(v.dtype)
        sub = _scaled(prob.select(active), lam)
        w, _, it = _sinkhorn_loop(sub, v[rows] / lam[:, None], min(cap, left), NEWTON_SWITCH)
        v = v.index_copy(0, rows, w * lam[:, None])
        used += it
    return v, used


def _sinkhorn_or_anneal(
    prob: _Problem, v: Tensor, max_iter: int, tol: float
) -> tuple[Tensor, Tensor, int]:
    """:func:`_sinkhorn_loop` for a converging solve (``tol > 0``), with epsilon scaling for the
    rows that crawl; the same returns.

    Sinkhorn moves each potential by O(1) (in units of epsilon) per iteration, so a row whose
    solution lies a scaled-cost span far beyond that from the start (epsilon far below the gaps
    of the cost) crawls: 1e5 iterations did not reach the Newton switch. The rows still above
    ``tol`` after ``ANNEAL_AFTER`` iterations are therefore solved again from a cold start by
    :func:`_anneal` (kept only where that lowers their residual), then Sinkhorn resumes for the
    rest of the budget. Rows that converge within ``ANNEAL_AFTER`` iterations are untouched:
    annealing is no universal warm start (a cost far wider than the rest of its row, such as an
    outlier 1e9 epsilon away, gives coarse stages whose potentials the fine ones cannot undo in
    float32), so it only runs where plain Sinkhorn already failed.
    """
    first = min(max_iter, ANNEAL_AFTER)
    v, err, iters = _sinkhorn_loop(prob, v, first, tol)
    slow = err > tol  # NaN rows are not slow: they stop at once
    if first == max_iter or not bool(slow.any()):
        return v, err, iters
    sub = prob.select(slow)
    v_slow, err_slow = v[slow], err[slow]
    w, used = _anneal(sub, torch.zeros_like(v_slow), max_iter - iters)
    iters += used
    _, err_w = _check(sub, w)
    better = err_w < err_slow
    v_slow = torch.where(better[:, None], w, v_slow)
    err_slow = torch.where(better, err_w, err_slow)
    if max_iter - iters > 1:
        v_slow, err_slow, it = _sinkhorn_loop(sub, v_slow, max_iter - iters, tol)
        iters += it
    v[slow], err[slow] = v_slow, err_slow
    return v, err, iters


def _newton(prob: _Problem, v: Tensor, tol: float) -> tuple[Tensor, Tensor, int]:
    """Semi-dual Newton with Armijo steps; return (best v, its err, steps) per row.

    Each row returns the state of smallest residual among those evaluated (the start included),
    so Newton never makes a row worse.
    """
    bsz, m, _ = prob.s.shape
    out_v = v.clone()
    out_err = torch.full((bsz,), math.nan, dtype=v.dtype, device=v.device)
    idx = torch.arange(bsz, device=v.device)
    cur, cv = prob, v
    steps = 0
    for step in range(NEWTON_MAX_STEPS + 1):
        p = _probs(cur, cv)
        c = torch.linalg.vecdot(p, cur.a.unsqueeze(1))
        log_c = _safe_log_col_sums(cur, cv, c)
        r = _log_ratio(cur, log_c).exp()
        row = torch.linalg.vecdot(p, r.unsqueeze(-1), dim=1)
        err = torch.linalg.vecdot((row - 1).abs(), cur.a) / cur.a_sum
        old = out_err[idx]
        best = (err < old) | torch.isnan(old)  # keep the best state seen (step 0 included)
        out_v[idx] = torch.where(best[:, None], cv, out_v[idx])
        out_err[idx] = torch.where(best, err, old)
        done = ~(err > tol)
        if step == NEWTON_MAX_STEPS or bool(done.all()):
            break
        steps = step + 1
        # Reduced Newton system in float64: K delta = (b - c)_<.
        pd = p.double()
        a64 = cur.a.double()
        b64 = cur.log_b.double().exp()
        top, home = _homes(pd, a64)
        grad = _mass_gap(pd, a64, b64, top, home)
        factor = _factor(_reduced_schur(pd, a64))
        delta = _solve(factor, grad[:, : m - 1])
        slope = (grad[:, : m - 1] * delta).sum(-1)
        ok_sys = (factor[2] == 0) & torch.isfinite(slope) & (slope > 0)
        delta = torch.cat((delta, torch.zeros_like(delta[:, :1])), dim=-1)
        # Armijo on the exact dual increase, computed without cancellation: with each row taken
        # relative to its home column h(i) (its largest entry),
        #   Psi(v + D) - Psi(v) = sum_j D_j (b_j - home_j)
        #                         - sum_i a_i log1p(sum_j P_ij expm1(D_j - D_h(i))).
        # (The plain form <D, b> - sum_i a_i log1p(sum_j P_ij expm1(D_j)) subtracts two numbers
        # of the size of D: a large step along a weakly coupled direction drowned the gain.)
        t = torch.ones_like(slope)
        accepted = torch.zeros_like(ok_sys)
        for _ in range(_ARMIJO_MAX_HALVINGS):
            step_v = t[:, None] * delta
            step_home = (top * step_v.unsqueeze(-1)).sum(1, keepdim=True)  # (B, 1, n)
            inner = (pd * torch.expm1(step_v.unsqueeze(-1) - step_home)).sum(1)
            gain = (step_v * (b64 - home)).sum(-1) - torch.linalg.vecdot(torch.log1p(inner), a64)
            ok = ok_sys & ~accepted & torch.isfinite(gain) & (gain >= _ARMIJO_SIGMA * t * slope)
            accepted = accepted | ok
            if bool((accepted | ~ok_sys).all()):
                break
            t = torch.where(accepted, t, t * 0.5)
        stalled = ~accepted
        new_v = cv + torch.where(accepted[:, None], t[:, None] * delta, 0.0).to(cv.dtype)
        keep = ~(done | stalled)
        if not bool(keep.any()):
            break
        idx, cur, cv = idx[keep], cur.select(keep), new_v[keep]
    return out_v, out_err, steps


def _homes(p: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """``(top, home)``: ``top`` (B, m, n) is 1 at each row's largest entry of P (its home column),
    ``home`` (B, m) the mass ``sum_{i: h(i) = j} a_i`` of the rows at home in column j."""
    top = torch.nn.functional.one_hot(p.max(1).indices, p.shape[1]).transpose(1, 2).to(p.dtype)
    return top, torch.linalg.vecdot(top, a.unsqueeze(1))


def _mass_gap(p: Tensor, a: Tensor, b: Tensor, top: Tensor, home: Tensor) -> Tensor:
    """``b - c`` (B, m) with ``c_j = sum_i a_i P_ij``, without cancellation (the Newton gradient).

    Near a permutation, c and b are O(1) numbers that agree to far below their rounding, and
    ``b - c`` formed directly keeps that rounding: on a nearly decoupled block of columns its
    noise (1e-16) drove a Newton step of 30 units along the block's weak direction, which Armijo
    then rejected at every length. Splitting each row at its home column h(i),
    ``b_j - c_j = (b_j - home_j) + sum_{h(i) = j} a_i (1 - P_ij) - sum_{h(i) != j} a_i P_ij``,
    with ``1 - P_ij`` formed as the sum of the other entries of the row: every term is a sum of
    small products, and ``b_j - home_j`` is exactly 0 where the masses are equal (sort, top-k).
    """
    rest = ((1.0 - top) * p).sum(1, keepdim=True)  # (B, 1, n): mass of each row off its home
    flow = torch.where(top > 0, -rest, p)  # (B, m, n): -(1 - P_ij) at home, P_ij elsewhere
    return (b - home) - torch.linalg.vecdot(flow, a.unsqueeze(1))


def _reduced_schur(p: Tensor, w: Tensor) -> Tensor:
    """``K = sum_i w_i (diag(P_i) - P_i P_i^T)`` restricted to the first m-1 columns (no jitter).

    ``p`` (B, m, n) has rows ``P_i`` summing to 1 over m; ``w`` (B, n) > 0. This is
    ``diag(nu_<) - Gamma_<^T diag(1/mu) Gamma_<`` for ``Gamma = diag(w) P``. Every entry is formed
    with full relative precision, also when P is nearly one-hot (small epsilon): the off-diagonal
    entries are sums of products ``-w_i P_ij P_il``, and the diagonal is formed directly as
    ``sum_i w_i P_ij sum_{l != j} P_il`` (never as ``nu_j - sum_i w_i P_ij^2``, which cancels).
    Differentiable (almost everywhere).
    """
    m = p.shape[1]
    ps = p[:, : m - 1]
    # sum_{l != j} P_il: 1 - P_ij when P_ij <= 1/2 (no cancellation); for the (at most one)
    # entry above 1/2, the sum of the other entries of its row, which are exactly those <= 1/2.
    big = ps > 0.5
    rest = torch.where(p > 0.5, 0.0, p).sum(1, keepdim=True)
    others = torch.where(big, rest, 1.0 - ps)
    diag = torch.linalg.vecdot(ps * others, w.unsqueeze(1))  # (B, m-1)
    gram = (ps * w.unsqueeze(1)) @ ps.transpose(1, 2)
    eye = torch.eye(m - 1, dtype=torch.bool, device=p.device)
    return torch.where(eye, torch.diag_embed(diag), -gram)


def _factor(kmat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Cholesky factor of the Jacobi-equilibrated ``D^-1/2 K D^-1/2 + tau I``.

    Returns ``(chol, scale, info)`` with ``scale = D^-1/2`` (1 where ``K_jj = 0``, an empty or
    frozen column whose row of K is zero too). The relative jitter ``tau`` is ``_JITTER_ULPS`` units
    of rounding per column (rows whose factorisation still fails are refactored with
    ``_JITTER_RETRY``). Equilibration makes the jitter act on every column in proportion to its own
    diagonal, whatever the spread of the diagonal (it spans many orders of magnitude when some
    columns are nearly one-hot and others hold ties).
    """
    m1 = kmat.shape[-1]
    d = kmat.detach().diagonal(dim1=-2, dim2=-1)
    scale = torch.where(d > 0, d.rsqrt(), 1.0)
    ks = kmat * scale.unsqueeze(-1) * scale.unsqueeze(-2)
    eye = torch.eye(m1, dtype=kmat.dtype, device=kmat.device)
    tau = _JITTER_ULPS * max(m1, 4) * torch.finfo(kmat.dtype).eps
    chol, info = torch.linalg.cholesky_ex(ks + tau * eye)
    if _any_set(info != 0):
        chol2, info2 = torch.linalg.cholesky_ex(ks + _JITTER_RETRY * eye)
        bad = info != 0
        chol = torch.where(bad[:, None, None], chol2, chol)
        info = torch.where(bad, info2, info)
    return chol, scale, info


def _any_set(flags: Tensor) -> bool:
    """Whether any flag is set, read through ``torch.func`` wrappers (all vmapped slices at once).

    It only chooses whether a per-row fallback is computed at all; the rows then take it through
    ``torch.where``, so every row's result is the same whichever the answer. True on meta tensors
    (no values: compute the fallback too, which costs nothing there).
    """
    if torch.compiler.is_compiling():  # no value to read: compute the fallback (as on meta)
        return True
    flags = plain(flags)
    return flags.device.type == "meta" or bool(flags.any())


def _solve(factor: tuple[Tensor, Tensor, Tensor], rhs: Tensor) -> Tensor:
    """``K^-1 rhs`` (B, m-1) with a factor from :func:`_factor`."""
    chol, scale, _ = factor
    return scale * torch.cholesky_solve((scale * rhs).unsqueeze(-1), chol).squeeze(-1)


def _centered(p: Tensor, u: Tensor, top: Tensor) -> Tensor:
    """``u_ij - sum_l P_il u_il`` (layout (B, m, n), centring over m) without cancellation.

    ``top`` (B, m, n) is 1 at the entry of a row whose P exceeds 1/2 (at most one), else 0. Such a
    row is first shifted by its value there, so that its weighted mean is a sum over the *other*,
    small entries only: for a nearly one-hot row that correction keeps its full relative
    precision, where ``u - P.u`` would cancel to rounding noise. Rows without such an entry have
    no weight above 1/2 and are centred directly (``(1 - P_ij) u_ij`` dominates, no cancellation).
    """
    h = u - (top * u).sum(1, keepdim=True)
    return h - (p * h).sum(1, keepdim=True)


def _finalize(
    prob: _Problem, v: Tensor, epsilon: Tensor, tol: float, iterations: int
) -> SinkhornResult:
    """Column-exact plan, potentials and diagnostics at the states ``v``."""
    log_p = _log_probs(prob, v)
    exact = _log_col_sums_exact(prob, v, log_p)
    log_c, err = _check(prob, v, exact)
    p = _probs(prob, v)
    log_r = _log_ratio(prob, log_c)
    plan = p * ((prob.a.unsqueeze(1)) * log_r.exp().unsqueeze(-1))  # (B, m, n)
    # Subnormal entries of P (a column of subnormal mass; the sigmoid gives 0 below
    # 1 / finfo.max) are formed in log space.
    low = p < torch.finfo(p.dtype).tiny
    if _any_set(low):
        log_plan = log_p + prob.log_a.unsqueeze(1) + log_r.unsqueeze(-1)
        plan = torch.where(low, log_plan.exp(), plan)
    eps = epsilon.to(v.dtype)
    f = (prob.log_a - _row_lse(prob, v)) * eps[:, None]
    g = (v + _log_ratio(prob, log_c)) * eps[:, None]
    converged = err <= tol
    bad = ~torch.isfinite(err)
    plan = torch.where(bad[:, None, None], math.nan, plan)
    f = torch.where(bad[:, None], math.nan, f)
    g = torch.where(bad[:, None], math.nan, g)
    return SinkhornResult(f, g, plan.transpose(1, 2), converged, iterations, err)


def log_sinkhorn(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    *,
    max_iter: int,
    tol: float,
    newton: bool = False,
    newton_first: bool = False,
    potentials: bool = True,
) -> SinkhornResult:
    """Solve a batch of entropic OT problems (no autograd).

    Args:
        cost: (B, n, m) floating cost; computation happens in its dtype (callers upcast).
        log_a: (B, n) log row marginals.
        log_b: (B, m) log column marginals (same total mass as ``a``).
        epsilon: (B,) positive regularisation, in the units of the cost.
        max_iter: cap on Sinkhorn iterations (a Newton polish adds at most ``NEWTON_MAX_STEPS``).
        tol: relative L1 marginal tolerance; ``0`` runs exactly ``max_iter`` iterations.
        newton: polish with semi-dual Newton once the residual is below ``NEWTON_SWITCH``.
        newton_first: with ``newton`` (and ``tol > 0``), start with semi-dual Newton at g = 0
            (see :func:`_newton_first`); for costs whose column constants make g = 0 a close
            start, such as the centred cost of the sorted top-k. Rows it does not finish are
            solved from the start as without it.
        potentials: form f and g; without, they are empty (B, 0) tensors (for callers that
            only use the plan).

    Returns:
        A :class:`SinkhornResult`; ``plan`` is a (B, n, m) view of a (B, m, n) buffer.
    """
    return _log_sinkhorn(
        cost, log_a, log_b, epsilon, max_iter, tol, newton, newton_first, potentials
    )[0]


def log_sinkhorn_checked(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    *,
    max_iter: int,
    tol: float,
    newton: bool = False,
    newton_first: bool = False,
    potentials: bool = True,
) -> tuple[SinkhornResult, bool]:
    """:func:`log_sinkhorn` and whether every row is known to have converged: True only where
    the solver already read that on the host (a convergence warning then has nothing to
    report); False says nothing (check ``result.converged``)."""
    return _log_sinkhorn(
        cost, log_a, log_b, epsilon, max_iter, tol, newton, newton_first, potentials
    )


def _log_sinkhorn(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    newton: bool,
    newton_first: bool,
    potentials: bool,
) -> tuple[SinkhornResult, bool]:
    """:func:`log_sinkhorn` and whether every row is known to have converged (True only where
    the solver already read that on the host; False says nothing)."""
    clean = False
    with torch.no_grad():
        cost = cost.detach()
        bsz, n, m = cost.shape
        use_newton = newton and tol > 0 and m > 1
        trivial = bsz == 0 or n == 0 or cost.device.type == "meta"
        if use_newton and newton_first and not trivial:
            res, clean = _newton_first(
                cost, log_a.detach(), log_b.detach(), epsilon.detach(), max_iter, tol, potentials
            )
        else:
            prob = _make_problem(cost, log_a.detach(), log_b.detach(), epsilon.detach())
            v = torch.zeros((bsz, m), dtype=cost.dtype, device=cost.device)
            if trivial:
                # Nothing to iterate (meta tensors: shape inference, no values to loop on).
                return _finalize(prob, v, epsilon, tol, 0), clean
            prob, v, iters = _hybrid(prob, v, max_iter, tol, use_newton)
            res = _finalize(prob, v, epsilon, tol, iters)
            if not potentials:
                res = res._replace(f=res.f[:, :0], g=res.g[:, :0])
        dt = cost.dtype
        if res.plan.dtype == dt:
            return res, clean
        res = res._replace(
            f=res.f.to(dt), g=res.g.to(dt), plan=res.plan.to(dt), residual=res.residual.to(dt)
        )
        return res, clean


def _hybrid(
    prob: _Problem, v: Tensor, max_iter: int, tol: float, use_newton: bool
) -> tuple[_Problem, Tensor, int]:
    """Sinkhorn from ``v`` (with epsilon scaling), then, with ``use_newton``, the Newton polish
    and its Sinkhorn fallback; return (the problem, the final states, iterations), the problem
    and the states in float64 after a polish."""
    m = prob.s.shape[1]
    tol1 = max(tol, NEWTON_SWITCH) if use_newton else tol
    if tol > 0 and m > 1:  # a converging solve (tol = 0 runs the plain fixed iterations)
        v, err, iters = _sinkhorn_or_anneal(prob, v, max_iter, tol1)
    else:
        v, err, iters = _sinkhorn_loop(prob, v, max_iter, tol1)
    if not use_newton:
        return prob, v, iters
    # Polish, fallback and final plan in float64: in float32 the marginal error of a plan with
    # many targets has a floor near the default tolerance (m roundings per row).
    prob, v = prob.to(torch.float64), v.double()
    todo = torch.isfinite(err)  # rows already below tol stop at Newton's first check
    if bool(todo.any()):
        v_sub, err_sub, steps = _newton(prob.select(todo), v[todo], tol)
        v[todo] = v_sub
        err = err.double()
        err[todo] = err_sub
        iters += steps
        left = max_iter - iters
        todo2 = err > tol
        if left > 0 and bool(todo2.any()):
            v2, _, it2 = _sinkhorn_loop(prob.select(todo2), v[todo2], left, tol)
            v[todo2] = v2
            iters += it2
    return prob, v, iters


class _Semidual(NamedTuple):
    """Data of a :func:`_newton_first` solve: float64, layout (B, m, n), each row on its own.

    Column vectors (b, v, the gap b - c) are (B, m, 1) and per-row scalars (B, 1, 1), so that
    they broadcast against the (B, m, n) plan without reshapes.
    """

    s: Tensor  # (B, m, n) cost / epsilon
    log_a: Tensor  # (B, n)
    a_row: Tensor  # (B, 1, n) row masses a_i
    a_col: Tensor  # (B, n, 1) the same, as a column
    a_sum: Tensor  # (B, 1, 1)
    b: Tensor  # (B, m, 1) column masses
    ref: Tensor  # (B, m, n) 1 at each row's reference column r(i), else 0
    off_ref: Tensor  # (B, m, n) 1 - ref
    b_ref: Tensor  # (B, m, 1) b_j - sum_{r(i) = j} a_i, exact (0 where the masses match)
    tol_mass: Tensor  # (B, 1, 1) tol * sum_i a_i: the stopping level of ``l1``


class _NewtonState(NamedTuple):
    """The semi-dual at the states v (B, m, 1) of :func:`_newton_first`."""

    p: Tensor  # (B, m, n) P_ij = softmax_j(v_j - s_ij)
    gap: Tensor  # (B, m, 1) b - c with c_j = sum_i a_i P_ij: the gradient of the semi-dual
    l1: Tensor  # (B, 1, 1) sum_j |b_j - c_j|, which bounds sum_i a_i times the residual


def _semidual(
    cost: Tensor, log_a: Tensor, log_b: Tensor, epsilon: Tensor, tol: float
) -> tuple[_Semidual, Tensor]:
    """The :class:`_Semidual` of the problem and the start ``v = log b - log c(0)`` (B, m, 1).

    The start is one Sinkhorn column update of v = 0; the reference column of row i is its
    largest entry at v = 0 (its cheapest column: for the sorted top-k's centred cost, its hard
    assignment).
    """
    f64 = torch.float64
    # (B, m, n) in that memory order, so that every reduction over m runs over contiguous rows
    # (``to`` would keep a transposed layout)
    s = cost.new_empty(cost.transpose(1, 2).shape, dtype=f64)
    torch.div(cost.transpose(1, 2), epsilon.to(f64).reshape(-1, 1, 1), out=s)
    # both marginals from their logarithms in float64 (``a`` rounded in a narrower dtype and
    # ``b`` in float64 differ in total mass at the narrower rounding, a residual floor there)
    log_a64, log_b64 = log_a.to(f64), log_b.to(f64).unsqueeze(-1)
    a, b = log_a64.exp(), log_b64.exp()
    a_col = a.unsqueeze(-1)
    c0 = torch.bmm(torch.softmax(s.neg(), 1), a_col)
    v = log_b64 - c0.clamp_min_(torch.finfo(f64).tiny).log_()  # -inf at zero mass
    ref = torch.zeros_like(s).scatter_(1, s.min(1, keepdim=True).indices, 1.0)
    b_ref = torch.baddbmm(b, ref, a_col, alpha=-1.0)
    a_sum = a.sum(-1).reshape(-1, 1, 1)
    sd = _Semidual(s, log_a64, a.unsqueeze(1), a_col, a_sum, b, ref, 1.0 - ref, b_ref, tol * a_sum)
    return sd, v


def _newton_state(sd: _Semidual, v: Tensor) -> _NewtonState:
    """The :class:`_NewtonState` at ``v`` (B, m, 1).

    ``P`` is one ``softmax`` (its entries keep their relative precision: it takes out each
    row's maximum first). ``b - c`` is formed relative to each row's reference column r(i), as
    sums of small
    products: ``P_ij - [j = r(i)]`` is ``P_ij`` off the reference column and ``-sum_{l != r(i)}
    P_il`` on it, so ``b_j - c_j = (b_j - sum_{r(i) = j} a_i) - sum_i a_i (P_ij - [j = r(i)])``
    keeps its relative precision when the rows are nearly one-hot at their reference column
    (as at a small epsilon). Formed directly, ``b - c`` keeps only the rounding of the O(1)
    masses there, and on nearly decoupled blocks of columns that noise drove steps that never
    lowered the residual.
    """
    p = torch.softmax(v - sd.s, 1)
    off = p * sd.off_ref
    flow = off.addcmul_(sd.ref, off.sum(1, keepdim=True), value=-1.0)  # P - [j = r(i)]
    gap = torch.baddbmm(sd.b_ref, flow, sd.a_col, alpha=-1.0)
    return _NewtonState(p, gap, gap.abs().sum((1, 2), keepdim=True))


def _residual(sd: _Semidual, state: _NewtonState) -> tuple[Tensor, Tensor]:
    """``(ratio, err)``: ``ratio = (b - c) / c`` (B, m, 1) (0 in the columns of zero mass) and
    the relative L1 row error (B, 1, 1) of the column-exact plan ``diag(a) P diag(b / c)``,
    ``err = sum_i a_i |sum_j P_ij (b_j - c_j) / c_j| / sum_i a_i`` (no difference of O(1)
    numbers). By the triangle inequality ``err <= sum_j |b_j - c_j| / sum_i a_i`` (the state's
    ``l1`` over the total mass)."""
    gap = state.gap
    ratio = gap / (sd.b - gap).clamp_min_(torch.finfo(gap.dtype).tiny)
    dev = torch.bmm(ratio.transpose(1, 2), state.p)  # (B, 1, n): row sums of the plan / a, - 1
    return ratio, torch.bmm(dev.abs_(), sd.a_col).div_(sd.a_sum)


def _newton_direction(sd: _Semidual, state: _NewtonState) -> Tensor:
    """The reduced Newton step (B, m, 1) (gauge: the last v fixed), ``K delta_< = (b - c)_<``.

    ``K = sum_i a_i (diag(P_i) - P_i P_i^T)`` restricted to the first m-1 columns is the graph
    Laplacian of the couplings ``w_jl = sum_i a_i P_ij P_il`` (j != l), grounded at the last
    column: ``K_jl = -w_jl`` and ``K_jj = sum_{l != j} w_jl``. Formed that way every entry is a
    sum of products (``K_jj`` is never ``nu_j - sum_i a_i P_ij^2``, which cancels when P is nearly
    one-hot). For m = 2 and m = 3 the system is solved in closed form (:func:`_laplacian_solve`);
    larger systems go through the equilibrated Cholesky of :func:`_factor`. A step that fails is
    not finite.
    """
    p = state.p
    m = p.shape[1]
    grad = state.gap[:, : m - 1]
    if m <= 3:
        delta = _laplacian_solve(_cyclic_couplings(p, sd.a_col), grad)[0]
    else:
        w = torch.bmm(p * sd.a_row, p.transpose(1, 2))  # (B, m, m)
        eye = torch.eye(m, dtype=torch.bool, device=p.device)
        w_off = w.masked_fill(eye, 0.0)
        kmat = (torch.diag_embed(w_off.sum(-1)) - w_off)[:, : m - 1, : m - 1]
        factor = _factor(kmat)
        ok = (factor[2] == 0)[:, None, None]
        delta = torch.where(ok, _solve(factor, grad.squeeze(-1)).unsqueeze(-1), math.nan)
    return torch.nn.functional.pad(delta, (0, 0, 0, 1))


def _cyclic_couplings(p: Tensor, weight: Tensor) -> Tensor:
    """``W_j = sum_i weight_i P_ij P_i(j+1 mod m)`` (B, m, 1) for P (B, m, n), weight (B, n, 1):
    for m = 3 the couplings ``(w01, w12, w20)`` of all pairs, for m = 2 ``(w01, w01)``."""
    return torch.bmm(p * p.roll(-1, 1), weight)


def _laplacian_solve(cyc: Tensor, rhs: Tensor) -> tuple[Tensor, Tensor]:
    """``(K^-1 rhs, det K)`` ((B, m-1, 1), (B, 1, 1)) for the grounded Laplacian K of the
    couplings ``cyc`` (B, m, 1) of :func:`_cyclic_couplings`, m = 2 or 3, in closed form
    (Cramer's rule).

    m = 2: ``K = w01``. m = 3: ``K = [[w01 + w20, -w01], [-w01, w01 + w12]]``, whose adjugate
    and determinant ``w01 (w12 + w20) + w12 w20`` are sums of products of the couplings (no
    cancellation, whatever the conditioning): ``K^-1 rhs = (w01 (r0 + r1) + (w12 r0, w20 r1))
    / det``. Not finite where K is singular (a column with no coupling left).
    """
    w01 = cyc[:, :1]
    if cyc.shape[1] == 2:
        return rhs / w01, w01
    other = cyc[:, 1:]  # (w12, w20): in the order of rhs, the coupling of the other column
    det = torch.addcmul(other.prod(1, keepdim=True), w01, other.sum(1, keepdim=True))
    num = torch.addcmul(w01 * rhs.sum(1, keepdim=True), other, rhs)
    return num / det, det


def _newton_first(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    potentials: bool = True,
) -> tuple[SinkhornResult, bool]:
    """:func:`_newton_first_torch`, or on small CPU problems the operator ``softops::newton_first``
    (the same solve row by row in the C++ kernel, the rows it leaves in torch)."""
    if use_kernel(cost, cost.shape[1], cost.shape[2]):
        plan, f, g, converged, residual, iterations, clean = NEWTON_FIRST_OP(
            cost, log_a, log_b, epsilon, max_iter, tol, potentials
        )
        res = SinkhornResult(f, g, plan, converged, int(iterations), residual)
        return res, bool(clean)
    return _newton_first_torch(cost, log_a, log_b, epsilon, max_iter, tol, potentials)


KERNEL_MAX_WORK = 1 << 17
"""Largest ``n m^2`` per row that :func:`_newton_first` solves with the kernel: above it the
batched torch code (its couplings are one ``bmm``) is the faster."""

NEWTON_KERNEL = Kernel("softops_newton", Path(__file__).with_name("_newton_kernel.cpp"))
"""The CPU row kernels of the Newton-first solve and of the sorted top-k plan's backward
(``torch.ops.softops_newton``)."""


def use_kernel(t: Tensor, n: int, m: int) -> bool:
    """Whether the row kernels (``_newton_kernel.cpp``) may take a problem of rows of n entries
    and m targets held by ``t``: a plain CPU tensor (not traced, not batched or wrapped by
    ``torch.func``), at most ``KERNEL_MAX_WORK`` entries ``n m^2``, the kernel back end on
    (:mod:`softops._kernels`; where the kernel is not built the operators run their torch
    reference)."""
    return (
        t.device.type == "cpu"
        and n * m * m <= KERNEL_MAX_WORK
        and kernels_enabled()
        and not torch.compiler.is_compiling()
        and not _functorch.is_functorch_wrapped_tensor(t)
    )


def _newton_first_outputs(res: SinkhornResult, clean: bool) -> tuple[Tensor, ...]:
    """A :class:`SinkhornResult` and its ``clean`` as the outputs of ``softops::newton_first``."""
    device = res.plan.device
    return (
        res.plan,
        res.f,
        res.g,
        res.converged,
        res.residual,
        torch.tensor(res.iterations, dtype=torch.int64, device=device),
        torch.tensor(clean, device=device),
    )


def _newton_first_reference(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    potentials: bool,
) -> tuple[Tensor, ...]:
    return _newton_first_outputs(
        *_newton_first_torch(cost, log_a, log_b, epsilon, max_iter, tol, potentials)
    )


def _newton_first_cpu(
    ops: Any,
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    potentials: bool,
) -> tuple[Tensor, ...]:
    """:func:`_newton_first_torch` by the row kernel, the same arithmetic each row on its own;
    rows it leaves above ``tol`` (or does not solve: a zero mass, a NaN) are solved by
    :func:`_newton_first_torch`, as a sub-batch."""
    f64 = torch.float64
    bsz = cost.shape[0]
    eps = epsilon.to(f64).reshape(-1, 1, 1)
    s = torch.div(cost.transpose(1, 2).to(f64), eps).contiguous()  # (B, m, n) cost / epsilon
    la = log_a.to(f64)
    plan, v, ratio, err, steps = ops.newton_first_rows(
        s, la, log_b.to(f64), float(tol), min(NEWTON_FIRST_STEPS, max_iter)
    )
    converged = err <= tol
    clean = bool(converged.all())
    iterations = int(steps.max()) if bsz else 0
    if not clean:
        left = ~converged
        sub, _ = _newton_first_torch(
            cost[left], log_a[left], log_b[left], epsilon[left], max_iter, tol, potentials
        )
        plan[left] = sub.plan.transpose(1, 2).to(f64)
        err[left] = sub.residual.to(f64)
        converged = err <= tol
        iterations = max(iterations, sub.iterations)
    if potentials:
        ev = epsilon.to(f64).unsqueeze(-1)
        f = (la - torch.logsumexp(v.unsqueeze(-1) - s, 1)) * ev
        g = (v + torch.log1p(ratio)) * ev
        if not clean:
            f[left] = sub.f.to(f64)
            g[left] = sub.g.to(f64)
    else:
        f, g = plan.new_empty((bsz, 0)), plan.new_empty((bsz, 0))
    res = SinkhornResult(f, g, plan.transpose(1, 2), converged, iterations, err)
    return _newton_first_outputs(res, clean)


def _newton_first_fake(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    potentials: bool,
) -> tuple[Tensor, ...]:
    bsz, n, m = cost.shape
    f64 = torch.float64
    return (
        cost.new_empty((bsz, m, n), dtype=f64).transpose(1, 2),  # (the solver's layout)
        cost.new_empty((bsz, n if potentials else 0), dtype=f64),
        cost.new_empty((bsz, m if potentials else 0), dtype=f64),
        cost.new_empty((bsz,), dtype=torch.bool),
        cost.new_empty((bsz,), dtype=f64),
        cost.new_empty((), dtype=torch.int64),
        cost.new_empty((), dtype=torch.bool),
    )


NEWTON_FIRST_OP = define(
    "softops::newton_first",
    "(Tensor cost, Tensor log_a, Tensor log_b, Tensor eps, int max_iter, float tol,"
    " bool potentials) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    reference=_newton_first_reference,
    fake=_newton_first_fake,
    cpu=_newton_first_cpu,
    kernel=NEWTON_KERNEL,
)
""":func:`_newton_first_torch` as an operator: (cost (B, n, m), log_a (B, n), log_b (B, m), eps
(B,), max_iter, tol, potentials) -> (plan (B, n, m), f, g, converged, residual, iterations (),
clean ()), float64; not differentiable (no vmap rule: its callers run it on plain tensors)."""


def _newton_first_torch(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    potentials: bool = True,
) -> tuple[SinkhornResult, bool]:
    """Semi-dual Newton from one Sinkhorn update of v = 0, in float64, all rows in lock-step,
    at most ``NEWTON_FIRST_STEPS`` steps (and ``max_iter``); the rows it leaves above ``tol``
    are solved from the start by :func:`_hybrid` within the rest of ``max_iter``.

    A row takes full Newton steps while the bound ``sum_j |b_j - c_j| / sum_i a_i`` on its
    residual is above ``tol`` and each step lowers it; a row whose step does not (or is not
    finite) keeps its state and stops. Rows whose residual ends above ``tol`` are solved again
    from the start, so the result is always a plan certified by its residual, whichever path
    found it. A stopped row's state is never touched again, so a row's result depends on its
    own data only. One host read per step (two counts: the rows kept, the rows that go on) and
    one at the end. Also returns whether every row converged without the fallback (False does
    not say that some row did not).

    The start: for the sorted top-k's centred cost (column constants at the midpoints of the
    sorted scores) v = 0 is the hard assignment, the solution as epsilon -> 0; one Sinkhorn
    update of it, ``v = log b - log c(0)``, is also the solution as epsilon -> infinity (where P
    no longer depends on the cost). On standard normal scores and log-probabilities, n = 18 to
    1000, k = 1 to 32, epsilon 1e-3 to 10, ties included, full steps from there were accepted
    throughout and every row reached a residual of 1e-7 within 4 steps.
    """
    sd, v = _semidual(cost, log_a, log_b, epsilon, tol)
    state = _newton_state(sd, v)
    live = state.l1 > sd.tol_mass  # (B, 1, 1)
    steps = 0
    n_live = int(live.sum())
    while n_live and steps < min(NEWTON_FIRST_STEPS, max_iter):
        v_new = torch.where(live, v + _newton_direction(sd, state), v)
        new = _newton_state(sd, v_new)
        # A stopped row's state is recomputed at the same v by the same ops (the same value),
        # so its bound does not drop: ``keep`` (False where the step is not finite) holds live
        # rows only, and some step was rejected exactly when fewer rows are kept than were live.
        keep = new.l1 < state.l1
        more = keep & (new.l1 > sd.tol_mass)
        n_keep, n_more = torch.stack((keep, more)).sum((1, 2, 3)).tolist()
        steps += 1
        if n_keep < n_live:  # rare: some step did not lower its row's bound; it keeps its state
            v = torch.where(keep, v_new, v)
            state = _newton_state(sd, v)
        else:
            v, state = v_new, new
        live, n_live = more, n_more
    ratio, err = _residual(sd, state)
    converged = err <= tol
    clean = bool(converged.all())
    if not clean:
        left = (err > tol).flatten()  # not the NaN rows
        if max_iter > steps and bool(left.any()):
            sub = _make_problem(cost[left], log_a[left], log_b[left], epsilon[left])
            start = torch.zeros_like(sub.log_b)
            _, w, it = _hybrid(sub, start, max_iter - steps, tol, True)
            v = v.masked_scatter(left[:, None, None], w.to(v.dtype))
            steps += it
            state = _newton_state(sd, v)
            ratio, err = _residual(sd, state)
            converged = err <= tol
    res = _finalize_state(sd, v, state, ratio, err, converged, clean, epsilon, steps, potentials)
    return res, clean


def _finalize_state(
    sd: _Semidual,
    v: Tensor,
    state: _NewtonState,
    ratio: Tensor,
    err: Tensor,
    converged: Tensor,
    clean: bool,
    epsilon: Tensor,
    iterations: int,
    potentials: bool,
) -> SinkhornResult:
    """:func:`_finalize` from a :class:`_NewtonState` at ``v`` and its :func:`_residual`: the
    column-exact plan ``diag(a) P diag(b / c)``, with ``b / c = 1 + (b - c) / c``. ``clean``:
    every row converged (none is NaN or infinite, so none needs masking). Without
    ``potentials``, f and g are empty (B, 0)."""
    plan = state.p.mul_(sd.a_row).mul_(ratio + 1.0)
    err, converged = err.flatten(), converged.flatten()
    if potentials:
        eps = epsilon.to(v.dtype).unsqueeze(-1)
        f = (sd.log_a - torch.logsumexp(v - sd.s, 1)) * eps
        g = (v + torch.log1p(ratio)).squeeze(-1) * eps  # -inf in the columns of zero mass
    else:
        f, g = plan.new_empty((plan.shape[0], 0)), plan.new_empty((plan.shape[0], 0))
    if not clean:
        fine = err < math.inf  # False for NaN
        plan = torch.where(fine[:, None, None], plan, math.nan)
        f = torch.where(fine[:, None], f, math.nan)
        g = torch.where(fine[:, None], g, math.nan)
    return SinkhornResult(f, g, plan.transpose(1, 2), converged, iterations, err)


def _solve_reference(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    newton: bool,
    newton_first: bool,
    potentials: bool,
    caller: str,
) -> tuple[Tensor, ...]:
    """The torch solve (:func:`_log_sinkhorn`) as the outputs of ``softops::sinkhorn``, after the
    non-convergence warning naming ``caller`` (none when ``caller`` is empty)."""
    res, clean = _log_sinkhorn(
        cost, log_a, log_b, epsilon, max_iter, tol, newton, newton_first, potentials
    )
    _warn(caller, res, clean, max_iter, tol)
    f, g = (res.f, res.g) if potentials else (res.f[:, :0], res.g[:, :0])
    device = res.plan.device
    return (
        res.plan.transpose(1, 2).contiguous().transpose(1, 2),  # the (B, m, n) buffer, as faked
        f,
        g,
        res.converged,
        res.residual,
        torch.tensor(res.iterations, dtype=torch.int64, device=device),
        torch.tensor(clean, device=device),
    )


def _warn(caller: str, res: SinkhornResult, clean: bool, max_iter: int, tol: float) -> None:
    """The non-convergence warning naming ``caller`` (none when it is empty, or every row is
    known to have converged)."""
    if caller and not clean:
        warn_not_converged(caller, res.converged, max_iter, residual=res.residual, tol=tol)


def _solve_fake(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    newton: bool,
    newton_first: bool,
    potentials: bool,
    caller: str,
) -> tuple[Tensor, ...]:
    bsz, n, m = cost.shape
    return (
        cost.new_empty((bsz, m, n)).transpose(1, 2),  # (the solver's layout)
        cost.new_empty((bsz, n if potentials else 0)),
        cost.new_empty((bsz, m if potentials else 0)),
        cost.new_empty((bsz,), dtype=torch.bool),
        cost.new_empty((bsz,)),
        cost.new_empty((), dtype=torch.int64),
        cost.new_empty((), dtype=torch.bool),
    )


SINKHORN_OP = define(
    "softops::sinkhorn",
    "(Tensor cost, Tensor log_a, Tensor log_b, Tensor eps, int max_iter, float tol, bool newton,"
    " bool newton_first, bool potentials, str caller)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    reference=_solve_reference,
    fake=_solve_fake,
)
"""The whole solve (:func:`log_sinkhorn`, its convergence loop and its warning) as one operator,
for traced code (``torch.compile``, ``torch.export``), to which it is opaque: (cost (B, n, m),
log_a (B, n), log_b (B, m), eps (B,), max_iter, tol, newton, newton_first, potentials, caller:
the op named by the non-convergence warning, none if empty) -> (plan (B, n, m), f, g,
converged, residual, iterations (), clean ()), in cost's dtype. Not differentiable:
:class:`SinkhornPlanFunction` carries the gradient. Eager calls run the same torch code
directly (no dispatch)."""


class SinkhornPlanFunction(torch.autograd.Function):
    """cost (B, n, m) -> plan (B, n, m) with the implicit (Schur complement) backward.

    Inputs after ``cost`` (log marginals, epsilon, solver settings, the op named by the
    non-convergence warning, none if empty) get no gradient. Outputs:
    ``(plan, f, g, converged, residual, iterations, clean)``; only ``plan`` is differentiable;
    ``clean`` (bool) is True where the solver already read on the host that every row
    converged (False says nothing). While tracing, the solve is the operator
    ``softops::sinkhorn`` (:data:`SINKHORN_OP`) and ``iterations`` and ``clean`` are 0-dim
    tensors.

    ``torch.func``: ``vmap`` folds the vmapped dimension into the rows (every row is solved on its
    own, so this is exact); forward mode (``jvp``, ``jacfwd``) applies the same linear map as the
    backward, because the Jacobian of the plan in the cost is symmetric (docs/math.md §6).
    """

    @staticmethod
    def forward(
        cost: Tensor,
        log_a: Tensor,
        log_b: Tensor,
        epsilon: Tensor,
        max_iter: int,
        tol: float,
        newton: bool,
        newton_first: bool = False,
        potentials: bool = True,
        caller: str = "",
    ) -> tuple[Any, ...]:
        if torch.compiler.is_compiling():
            return SINKHORN_OP(
                cost, log_a, log_b, epsilon, max_iter, tol, newton, newton_first, potentials, caller
            )
        res, clean = _log_sinkhorn(
            cost, log_a, log_b, epsilon, max_iter, tol, newton, newton_first, potentials
        )
        _warn(caller, res, clean, max_iter, tol)
        return res.plan, res.f, res.g, res.converged, res.residual, res.iterations, clean

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        epsilon = inputs[3]
        plan, f, g, converged, residual = output[:5]
        ctx.closed_form = bool(inputs[7])
        ctx.set_materialize_grads(False)  # only the plan's gradient is used
        ctx.save_for_backward(plan, epsilon.detach())
        ctx.save_for_forward(plan, epsilon.detach())
        ctx.mark_non_differentiable(f, g, converged, residual)

    @staticmethod
    def backward(ctx: Any, grad_plan: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        nones: tuple[None, ...] = (None,) * 9
        if not ctx.needs_input_grad[0] or grad_plan is None:
            return (None, *nones)
        plan, epsilon = ctx.saved_tensors
        return (implicit_cost_vjp(plan, grad_plan, epsilon, ctx.closed_form), *nones)

    @staticmethod
    def jvp(ctx: Any, cost_t: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        """Tangent of the plan for a cost tangent; the other inputs are constants (no tangent).

        ``dGamma = J dC`` with ``J = dGamma/dC`` symmetric, so ``J dC = J^T dC`` is the VJP of
        ``dC``: one Schur-complement solve, the same cost as the backward.
        """
        nones: tuple[None, ...] = (None,) * 6
        if cost_t is None:
            return (None, *nones)
        plan, epsilon = ctx.saved_tensors
        return (implicit_cost_vjp(plan, cost_t, epsilon, ctx.closed_form), *nones)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_rows(SinkhornPlanFunction, info, in_dims, *args)


class _SinkhornPlanTraced(SinkhornPlanFunction):
    """The same Function for traced code: torch 2.13's dynamo rejects a custom ``jvp``."""

    jvp = torch.autograd.Function.jvp  # type: ignore[assignment]

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_rows(_SinkhornPlanTraced, info, in_dims, *args)


def implicit_cost_vjp(
    plan: Tensor, grad_plan: Tensor, epsilon: Tensor, closed_form: bool = False
) -> Tensor:
    """Vector-Jacobian product of the converged plan map ``C -> Gamma`` (docs/math.md §2.3).

    Args:
        plan: (B, n, m) converged plan.
        grad_plan: (B, n, m) incoming gradient.
        epsilon: (B,) regularisation in cost units.
        closed_form: for m <= 3, solve the (m-1) x (m-1) system in closed form
            (:func:`_closed_form_vjp`); rows where it is not safe (and larger m) take the
            equilibrated Cholesky path.

    Returns:
        (B, n, m) gradient with respect to the cost, in ``plan``'s dtype.
    """
    if plan.shape[2] == 1:
        return torch.zeros_like(plan)
    if closed_form and plan.shape[2] <= 3:
        return _closed_form_vjp(plan, grad_plan, epsilon)
    return _cholesky_vjp(plan, grad_plan, epsilon)


def _closed_form_vjp(plan: Tensor, grad_plan: Tensor, epsilon: Tensor) -> Tensor:
    """:func:`implicit_cost_vjp` for m = 2, 3 with K solved by :func:`_laplacian_solve`.

    K is the grounded Laplacian of the couplings ``w_jl = sum_i Gamma_ij P_il``, each a sum of
    products, and its adjugate and determinant are sums of products of them: the solve is
    exact up to rounding whatever K's conditioning, without jitter or refinement (the
    Cholesky path needs both). It is used where ``det K`` is a normal number well above
    underflow (``DET_MIN``); other rows (a column with no coupling left, couplings near
    underflow) take :func:`_cholesky_vjp`, row by row, so a row's gradient depends on its own
    data only.
    """
    dtype = plan.dtype
    m = plan.shape[2]
    gam = plan.transpose(1, 2).to(torch.float64)  # (B, m, n)
    gbar = grad_plan.transpose(1, 2).to(torch.float64)
    mu = gam.sum(1, keepdim=True)  # (B, 1, n) row sums of the plan
    # Rows of zero mass (a_i = 0) carry no plan and no gradient: their P is 0.
    p = gam / mu.clamp_min(torch.finfo(torch.float64).tiny)
    home = p.detach().max(1, keepdim=True).indices  # (B, 1, n); argmax is far slower
    # K beta = sum_i Gamma_ij centred(Gbar)_ij (first m-1 columns), beta_m = 0; then
    # Cbar = -Gamma * centred(Gbar - beta) / epsilon
    rhs = (gam * _centered_at(p, gbar, home)).sum(-1, keepdim=True)[:, : m - 1]
    beta, det = _laplacian_solve(_cyclic_couplings(p, mu.transpose(1, 2)), rhs)
    d = _centered_at(p, torch.nn.functional.pad(beta, (0, 0, 0, 1)) - gbar, home)
    cbar = (gam * d / epsilon.to(torch.float64).reshape(-1, 1, 1)).transpose(1, 2).to(dtype)
    if not _all_above(det, DET_MIN):
        unsafe = ~(det.detach() > DET_MIN)  # (B, 1, 1), also NaN
        cbar = torch.where(unsafe, _cholesky_vjp(plan, grad_plan, epsilon), cbar)
    return cbar


def _all_above(t: Tensor, level: float) -> bool:
    """Whether every entry of ``t`` is above ``level`` (False for NaN), read through
    ``torch.func`` wrappers; False on meta tensors and while tracing (no values: take the
    fallback too)."""
    if torch.compiler.is_compiling():
        return False
    t = plain(t.detach())
    if t.device.type == "meta":
        return False
    return t.numel() == 0 or bool(t.amin() > level)


def _centered_at(p: Tensor, u: Tensor, home: Tensor) -> Tensor:
    """``u_ij - sum_l P_il u_il`` (layout (B, m, n), centring over m) without cancellation:
    each row is first shifted by its value at ``home`` (B, 1, n), the index of its largest P,
    so that the weighted mean is a sum of small products when the row is nearly one-hot (see
    :func:`_centered`)."""
    h = u - u.gather(1, home)
    return h - (p * h).sum(1, keepdim=True)


def _cholesky_vjp(plan: Tensor, grad_plan: Tensor, epsilon: Tensor) -> Tensor:
    """:func:`implicit_cost_vjp` through the equilibrated, jittered Cholesky of K with one
    step of iterative refinement (the module docstring's Backward)."""
    dtype = plan.dtype
    bsz, _, m = plan.shape
    # contiguous (B, m, n) (``to`` keeps a transposed layout when the dtype is already float64)
    gam = plan.transpose(1, 2).to(torch.float64).contiguous()
    gbar = grad_plan.transpose(1, 2).to(torch.float64).contiguous()
    mu = gam.sum(1)  # (B, n) row sums of the plan
    # Rows of zero mass (a_i = 0) carry no plan and no gradient: give them a harmless P.
    p = gam / torch.where(mu > 0, mu, 1.0).unsqueeze(1)
    top = (p.detach() > 0.5).to(p.dtype)
    gs = gam[:, : m - 1]
    factor = _factor(_reduced_schur(p, mu))
    # Solve K beta = sum_i Gamma_ij centred(Gbar - beta)_ij ... = 0 for the first m-1 columns,
    # i.e. the column sums of Cbar vanish; each pass refines beta with the exactly formed residual.
    beta = torch.zeros((bsz, m), dtype=gam.dtype, device=gam.device)
    for _ in range(_REFINE_STEPS + 1):
        d = _centered(p, gbar - beta.unsqueeze(-1), top)
        resid = (gs * d[:, : m - 1]).sum(-1)  # (B, m-1)
        beta = beta + torch.nn.functional.pad(_solve(factor, resid), (0, 1))
    d = _centered(p, gbar - beta.unsqueeze(-1), top)
    cbar = -(gam * d) / epsilon.double().reshape(bsz, 1, 1)
    return cbar.to(dtype).transpose(1, 2)


def attach_epsilon(scaled: Tensor, epsilon: Tensor) -> Tensor:
    r"""A cost in units of epsilon, ``scaled = C / eps`` formed with ``eps`` detached, made a
    function of ``epsilon`` (broadcastable to ``scaled``) too: the same value, with derivatives
    of every order those of ``C / eps`` in ``C`` (whatever ``scaled`` is differentiable in) and
    ``epsilon``.

    Autograd through ``C / eps`` forms ``(C / eps) / eps`` (or ``C / eps**2``), which overflows
    at an epsilon below 1e-154, or on a wide row, although ``<grad, scaled> / eps`` is finite: the
    zero cost gradient of an entry the plan does not use then became ``0 * inf = NaN``, and where
    ``C`` and epsilon are both tiny ``<grad, C>`` (the chain through ``1 / eps``) is subnormal.
    Here ``C / eps = scaled * exp(u - u0)`` with ``u = -log(eps)`` and ``u0`` its detached value
    (the factor is exactly 1): the gradient in epsilon is ``<grad, scaled>`` (of the size of the
    output) and then ``/ eps``. The factor multiplies the differentiable ``scaled``, not a
    detached copy of it, so the gradient in epsilon is itself differentiable in ``C`` and
    ``epsilon`` (double backward: a constant copy dropped ``d/dC`` and ``d/deps`` of that
    gradient). Infinite costs (no mass) are constants.
    """
    u = -torch.log(epsilon)
    factor = torch.exp(u - u.detach())  # 1, with d factor / du = factor
    inf = torch.isinf(scaled.detach())
    return torch.where(inf, scaled, torch.where(inf, 0, scaled) * factor)


def sinkhorn_plan(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    newton: bool = False,
    newton_first: bool = False,
    potentials: bool = True,
    caller: str = "",
) -> tuple[Tensor, SinkhornResult]:
    """Differentiable (in ``cost``) Sinkhorn plan with the implicit backward.

    Args:
        cost: (B, n, m) cost; may require grad.
        log_a: (B, n) log row marginals (constant).
        log_b: (B, m) log column marginals (constant).
        epsilon: (B,) regularisation in cost units (constant).
        max_iter: iteration cap.
        tol: relative L1 marginal tolerance (0: exactly ``max_iter`` iterations).
        newton: semi-dual Newton polish (see the module docstring).
        newton_first: with ``newton``, start with Newton at g = 0 (see :func:`log_sinkhorn`).
        potentials: form ``result.f`` and ``result.g`` (else empty (B, 0) tensors).
        caller: the public op named by the non-convergence warning
            (:func:`~softops._core.convergence.warn_not_converged`, raised by the solve, also
            while traced); empty: no warning.

    Returns:
        ``(plan, result)`` with ``plan`` (B, n, m) differentiable in ``cost`` and ``result`` the
        diagnostics (``result.plan is plan``). While tracing (``torch.compile``,
        ``torch.export``) the solve is one operator and ``result.iterations`` a 0-dim tensor.
    """
    return sinkhorn_plan_checked(
        cost, log_a, log_b, epsilon, max_iter, tol, newton, newton_first, potentials, caller
    )[:2]


def sinkhorn_plan_checked(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    newton: bool = False,
    newton_first: bool = False,
    potentials: bool = True,
    caller: str = "",
) -> tuple[Tensor, SinkhornResult, bool]:
    """:func:`sinkhorn_plan` and whether every row is known to have converged: True only where
    the solver already read that on the host (then a convergence warning has nothing to
    report); False says nothing (check ``result.converged``).

    While tracing, the Function without its custom ``jvp`` (which dynamo rejects) runs the
    operator ``softops::sinkhorn`` (the operator alone where nothing is differentiated); the
    iteration count stays a tensor and ``clean`` is False (nothing is read on the host)."""
    args = (cost, log_a, log_b, epsilon, max_iter, tol, newton, newton_first, potentials, caller)
    if torch.compiler.is_compiling():
        grads = torch.is_grad_enabled() and cost.requires_grad
        out = _SinkhornPlanTraced.apply(*args) if grads else SINKHORN_OP(*args)
        plan, f, g, converged, residual, iterations = out[:6]
        return plan, SinkhornResult(f, g, plan, converged, iterations, residual), False
    plan, f, g, converged, residual, iterations, clean = apply_function(SinkhornPlanFunction, *args)
    return plan, SinkhornResult(f, g, plan, converged, int(iterations), residual), bool(clean)
