r"""Batched log-domain Sinkhorn for n x m problems with a small m, and its implicit backward.

One problem per batch row, rows independent (docs/math.md §2.5 for the solver, §2.3 and §6 for
the backward):

.. math::

    \Gamma^\star = \arg\min_{\Gamma \ge 0,\ \Gamma 1 = a,\ \Gamma^\top 1 = b}
    \langle C, \Gamma\rangle + \varepsilon \sum_{ij} \Gamma_{ij}(\log \Gamma_{ij} - 1),
    \qquad \Gamma_{ij} = \exp((f_i + g_j - C_{ij})/\varepsilon).

:func:`log_sinkhorn` is the one entry point: the plan (differentiable in the cost, implicit
backward :func:`implicit_cost_vjp`) with its diagnostics. Contract:

* One iteration is a row update of f then a column update of g, as in the SOFT paper's code: the
  plan's **columns are exact** and ``residual`` is the relative L1 error of its row sums.
  ``tol=0`` runs exactly ``max_iter`` iterations.
* ``tol > 0``: converged rows leave the working set (a row never depends on the others); rows
  that crawl are re-solved by epsilon scaling; ``newton=True`` polishes with semi-dual Newton. A
  row with a NaN or infinite residual stops at once and its outputs are NaN.
* Only the plan and epsilon are saved for the backward (differentiable: double backward).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from softops._core.convergence import warn_not_converged
from softops._core.transforms import apply_function, plain, vmap_rows, without_jvp
from softops._kernels import define

__all__ = [
    "CHECK_EVERY",
    "DET_MIN",
    "NEWTON_MAX_STEPS",
    "NEWTON_SWITCH",
    "SINKHORN_OP",
    "SinkhornPlanFunction",
    "SinkhornResult",
    "attach_epsilon",
    "cyclic_couplings",
    "implicit_cost_vjp",
    "laplacian_solve",
    "log_sinkhorn",
    "nan_failed_rows",
    "spd_factor",
    "spd_solve",
]

CHECK_EVERY = 10
"""Iterations between two batched convergence checks."""
NEWTON_SWITCH = 1e-3
"""Residual below which Sinkhorn hands over to Newton."""
NEWTON_MAX_STEPS = 30
"""Cap on Newton steps per polish phase."""
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
        return _Problem._make(None if t is None else t[keep] for t in self)


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
    """``(S - M, M)`` for ``S_ji = v_j - s_ji`` and ``M_i = max_j S_ji`` (M of shape (B, 1, n))."""
    shifted = v.unsqueeze(-1) - prob.s
    mx = shifted.amax(1, keepdim=True)
    return shifted.sub_(mx), mx


def _exp_and_sum(prob: _Problem, v: Tensor, floor: float | None = None) -> tuple[Tensor, Tensor]:
    """``(E, Z)`` with ``E = exp(S - M)`` (B, m, n) and ``Z = sum_j E`` (B, n); ``floor`` clamps
    ``S - M`` first, keeping the hot loop out of subnormal numbers."""
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
    """Whether a column sum of some row can fall to ``_safe_level`` in the loop (docs/math.md
    §2.5)."""
    log_b = torch.where(prob.empty, math.inf, prob.log_b).amin(-1)
    log_a = torch.where(torch.isneginf(prob.log_a), math.inf, prob.log_a).amin(-1)
    bound = log_b + log_a - prob.a_sum.log()
    return _any_set(bound <= math.log(_safe_level(prob.s.dtype)))


def _safe_log_col_sums(
    prob: _Problem, v: Tensor, c: Tensor, exact_log_c: Tensor | None = None
) -> Tensor:
    """``log c`` of the linear column sums ``c`` (B, m) at ``v``, with the log-space sums
    (``exact_log_c``, or computed here) wherever ``c`` is at or below the safe level."""
    log_c = c.log()
    low = c <= _safe_level(c.dtype)
    if exact_log_c is None:
        if not _any_set(low):
            return log_c
        exact_log_c = _log_col_sums_exact(prob, v)
    return torch.where(low, exact_log_c, log_c)


def _fast_log_col_sums(prob: _Problem, v: Tensor, buf: Tensor, fragile: bool = False) -> Tensor:
    """log column sums for the hot loop (one sigmoid pass when m = 2); ``fragile``
    (:func:`_fragile`): the sums at or below the safe level from the log-space ones."""
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


def _check(
    prob: _Problem, v: Tensor, exact_log_c: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(P, log_c, err)`` at ``v``, ``err`` the relative L1 row error of the column-exact plan."""
    p = _probs(prob, v)
    c = torch.linalg.vecdot(p, prob.a.unsqueeze(1))
    log_c = _safe_log_col_sums(prob, v, c, exact_log_c)
    r = _log_ratio(prob, log_c).exp()
    row = torch.linalg.vecdot(p, r.unsqueeze(-1), dim=1)  # (B, n): sum_j P_ij r_j
    err = torch.linalg.vecdot((row - 1).abs(), prob.a) / prob.a_sum
    return p, log_c, err


def _sinkhorn_loop(
    prob: _Problem, v: Tensor, max_iter: int, tol: float
) -> tuple[Tensor, Tensor, int]:
    """Run Sinkhorn from ``v``: (the state each row stopped at, err per row (NaN if unchecked),
    iterations)."""
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
            _, log_c, err = _check(cur, cv, _log_col_sums_exact(cur, cv) if it == 1 else None)
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
    """Warm start by epsilon scaling: (v, iterations used). Rows whose scaled cost spans more
    than ``ANNEAL_SPAN`` are solved loosely at epsilons falling geometrically to their own."""
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
    """:func:`_sinkhorn_loop` for ``tol > 0``; the rows still above ``tol`` after ``ANNEAL_AFTER``
    iterations are re-solved by :func:`_anneal` (where that helps), then Sinkhorn resumes."""
    first = min(max_iter, ANNEAL_AFTER)
    v, err, iters = _sinkhorn_loop(prob, v, first, tol)
    slow = err > tol  # NaN rows are not slow: they stop at once
    if first == max_iter or not bool(slow.any()):
        return v, err, iters
    sub = prob.select(slow)
    v_slow, err_slow = v[slow], err[slow]
    w, used = _anneal(sub, torch.zeros_like(v_slow), max_iter - iters)
    iters += used
    err_w = _check(sub, w)[2]
    better = err_w < err_slow
    v_slow = torch.where(better[:, None], w, v_slow)
    err_slow = torch.where(better, err_w, err_slow)
    if max_iter - iters > 1:
        v_slow, err_slow, it = _sinkhorn_loop(sub, v_slow, max_iter - iters, tol)
        iters += it
    v[slow], err[slow] = v_slow, err_slow
    return v, err, iters


def _newton(prob: _Problem, v: Tensor, tol: float) -> tuple[Tensor, Tensor, int]:
    """Semi-dual Newton with Armijo steps: (each row's best state, start included; its err;
    steps)."""
    bsz, m, _ = prob.s.shape
    out_v = v.clone()
    out_err = torch.full((bsz,), math.nan, dtype=v.dtype, device=v.device)
    idx = torch.arange(bsz, device=v.device)
    cur, cv = prob, v
    steps = 0
    for step in range(NEWTON_MAX_STEPS + 1):
        p, _, err = _check(cur, cv)
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
        factor = spd_factor(_reduced_schur(pd, a64))
        delta = spd_solve(factor, grad[:, : m - 1])
        slope = (grad[:, : m - 1] * delta).sum(-1)
        ok_sys = (factor[2] == 0) & torch.isfinite(slope) & (slope > 0)
        delta = torch.cat((delta, torch.zeros_like(delta[:, :1])), dim=-1)
        # Armijo on the exact dual increase, without cancellation: each row relative to its home
        # column h(i), Psi(v + D) - Psi(v) = sum_j D_j (b_j - home_j)
        #                                    - sum_i a_i log1p(sum_j P_ij expm1(D_j - D_h(i)))
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
    """``b - c`` (B, m), ``c_j = sum_i a_i P_ij``, without cancellation (docs/math.md §2.5):
    ``(b_j - home_j) + sum_{h(i) = j} a_i (1 - P_ij) - sum_{h(i) != j} a_i P_ij`` with h(i) each
    row's home column and ``1 - P_ij`` the sum of the row's other entries."""
    rest = ((1.0 - top) * p).sum(1, keepdim=True)  # (B, 1, n): mass of each row off its home
    flow = torch.where(top > 0, -rest, p)  # (B, m, n): -(1 - P_ij) at home, P_ij elsewhere
    return (b - home) - torch.linalg.vecdot(flow, a.unsqueeze(1))


def _reduced_schur(p: Tensor, w: Tensor) -> Tensor:
    """``K = sum_i w_i (diag(P_i) - P_i P_i^T)`` on the first m-1 columns, ``p`` (B, m, n), ``w``
    (B, n), without cancellation when P is nearly one-hot."""
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


def spd_factor(kmat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Cholesky factor of the Jacobi-equilibrated ``D^-1/2 K D^-1/2 + tau I``: ``(chol, scale,
    info)``, ``scale = D^-1/2`` (1 where ``K_jj = 0``); the jitter acts on each column in
    proportion to its own diagonal."""
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
    """Whether any flag is set (all vmapped slices at once; True where nothing can be read): it
    only decides whether a per-row fallback, taken through ``torch.where``, is computed."""
    if torch.compiler.is_compiling():  # no value to read: compute the fallback (as on meta)
        return True
    flags = plain(flags)
    return flags.device.type == "meta" or bool(flags.any())


def spd_solve(factor: tuple[Tensor, Tensor, Tensor], rhs: Tensor) -> Tensor:
    """``K^-1 rhs`` (B, m-1) with a factor from :func:`spd_factor`."""
    chol, scale, _ = factor
    return scale * torch.cholesky_solve((scale * rhs).unsqueeze(-1), chol).squeeze(-1)


def _centered(p: Tensor, u: Tensor, top: Tensor) -> Tensor:
    """``u_ij - sum_l P_il u_il`` (B, m, n) without cancellation: a row is first shifted by its
    value at its entry of P above 1/2 (``top``), if any."""
    h = u - (top * u).sum(1, keepdim=True)
    return h - (p * h).sum(1, keepdim=True)


def _finalize(
    prob: _Problem, v: Tensor, epsilon: Tensor, tol: float, iterations: int
) -> SinkhornResult:
    """Column-exact plan, potentials and diagnostics at the states ``v``."""
    log_p = _log_probs(prob, v)
    exact = _log_col_sums_exact(prob, v, log_p)
    p, log_c, err = _check(prob, v, exact)
    log_r = _log_ratio(prob, log_c)
    plan = p * ((prob.a.unsqueeze(1)) * log_r.exp().unsqueeze(-1))  # (B, m, n)
    # subnormal entries of P are formed in log space
    low = p < torch.finfo(p.dtype).tiny
    if _any_set(low):
        log_plan = log_p + prob.log_a.unsqueeze(1) + log_r.unsqueeze(-1)
        plan = torch.where(low, log_plan.exp(), plan)
    eps = epsilon.to(v.dtype)
    f = (prob.log_a - _row_lse(prob, v)) * eps[:, None]
    g = (v + _log_ratio(prob, log_c)) * eps[:, None]
    plan, f, g = nan_failed_rows(err, plan, f, g)
    return SinkhornResult(f, g, plan.transpose(1, 2), err <= tol, iterations, err)


def nan_failed_rows(err: Tensor, *rows: Tensor) -> list[Tensor]:
    """Each tensor of ``rows`` (leading dim B) NaN in the rows whose residual ``err`` (B,) is
    NaN or infinite."""
    bad = ~torch.isfinite(err)
    return [torch.where(bad.view(-1, *[1] * (t.dim() - 1)), math.nan, t) for t in rows]


def _log_sinkhorn(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    newton: bool,
    potentials: bool,
) -> SinkhornResult:
    """The solve without autograd, in ``cost``'s dtype."""
    with torch.no_grad():
        cost = cost.detach()
        bsz, n, m = cost.shape
        prob = _make_problem(cost, log_a.detach(), log_b.detach(), epsilon.detach())
        v = torch.zeros((bsz, m), dtype=cost.dtype, device=cost.device)
        if bsz == 0 or n == 0 or cost.device.type == "meta":  # nothing to iterate
            return _finalize(prob, v, epsilon, tol, 0)
        prob, v, iters = _hybrid(prob, v, max_iter, tol, newton and tol > 0 and m > 1)
        res = _finalize(prob, v, epsilon, tol, iters)
        if not potentials:
            res = res._replace(f=res.f[:, :0], g=res.g[:, :0])
        dt = cost.dtype
        if res.plan.dtype != dt:
            res = res._replace(
                f=res.f.to(dt), g=res.g.to(dt), plan=res.plan.to(dt), residual=res.residual.to(dt)
            )
        return res


def _hybrid(
    prob: _Problem, v: Tensor, max_iter: int, tol: float, use_newton: bool
) -> tuple[_Problem, Tensor, int]:
    """Sinkhorn from ``v``, then, with ``use_newton``, the Newton polish (in float64) and its
    Sinkhorn fallback: (the problem, the final states, iterations)."""
    m = prob.s.shape[1]
    tol1 = max(tol, NEWTON_SWITCH) if use_newton else tol
    if tol > 0 and m > 1:  # a converging solve (tol = 0 runs the plain fixed iterations)
        v, err, iters = _sinkhorn_or_anneal(prob, v, max_iter, tol1)
    else:
        v, err, iters = _sinkhorn_loop(prob, v, max_iter, tol1)
    if not use_newton:
        return prob, v, iters
    # in float64: in float32 the error of a plan with many targets floors near the tolerance
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


def cyclic_couplings(p: Tensor, weight: Tensor) -> Tensor:
    """``W_j = sum_i weight_i P_ij P_i(j+1 mod m)`` (B, m, 1) for P (B, m, n), weight (B, n, 1):
    for m = 3 the couplings ``(w01, w12, w20)`` of all pairs, for m = 2 ``(w01, w01)``."""
    return torch.bmm(p * p.roll(-1, 1), weight)


def laplacian_solve(cyc: Tensor, rhs: Tensor) -> tuple[Tensor, Tensor]:
    """``(K^-1 rhs, det K)`` ((B, m-1, 1), (B, 1, 1)) for the grounded Laplacian K of the
    couplings ``cyc`` (B, m, 1), m = 2 or 3, by Cramer's rule: for m = 3 ``det = w01 (w12 + w20)
    + w12 w20`` and ``K^-1 rhs = (w01 (r0 + r1) + (w12 r0, w20 r1)) / det``, no cancellation.
    """
    w01 = cyc[:, :1]
    if cyc.shape[1] == 2:
        return rhs / w01, w01
    other = cyc[:, 1:]  # (w12, w20): in the order of rhs, the coupling of the other column
    det = torch.addcmul(other.prod(1, keepdim=True), w01, other.sum(1, keepdim=True))
    num = torch.addcmul(w01 * rhs.sum(1, keepdim=True), other, rhs)
    return num / det, det


def _solve_reference(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    newton: bool,
    potentials: bool,
    caller: str,
) -> tuple[Tensor, ...]:
    """The torch solve as the outputs of ``softops::sinkhorn``, after its warning."""
    res = _log_sinkhorn(cost, log_a, log_b, epsilon, max_iter, tol, newton, potentials)
    warn_unless_clean(caller, res, False, max_iter, tol)
    return op_outputs(res, False, potentials)


def op_outputs(res: SinkhornResult, clean: bool, potentials: bool) -> tuple[Tensor, ...]:
    """A result and its ``clean`` as the outputs of a Sinkhorn-type operator (as
    :func:`fake_outputs` declares them)."""
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


def fake_outputs(
    cost: Tensor, potentials: bool, dtype: torch.dtype | None = None
) -> tuple[Tensor, ...]:
    """The outputs' shapes, dtypes and layout for a cost (B, n, m): the fake implementation of
    a Sinkhorn-type operator (``dtype``: of the floating outputs, the cost's by default)."""
    bsz, n, m = cost.shape
    dtype = cost.dtype if dtype is None else dtype
    return (
        cost.new_empty((bsz, m, n), dtype=dtype).transpose(1, 2),  # (the solver's layout)
        cost.new_empty((bsz, n if potentials else 0), dtype=dtype),
        cost.new_empty((bsz, m if potentials else 0), dtype=dtype),
        cost.new_empty((bsz,), dtype=torch.bool),
        cost.new_empty((bsz,), dtype=dtype),
        cost.new_empty((), dtype=torch.int64),
        cost.new_empty((), dtype=torch.bool),
    )


def warn_unless_clean(
    caller: str, res: SinkhornResult, clean: bool, max_iter: int, tol: float
) -> None:
    """The non-convergence warning naming ``caller`` (none when it is empty, or every row is
    known to have converged)."""
    if caller and not clean:
        warn_not_converged(caller, res.converged, max_iter, residual=res.residual, tol=tol)


def _solve_fake(cost: Tensor, *args: Any) -> tuple[Tensor, ...]:
    return fake_outputs(cost, args[6])  # (args[6]: potentials)


SINKHORN_OP = define(
    "softops::sinkhorn",
    "(Tensor cost, Tensor log_a, Tensor log_b, Tensor eps, int max_iter, float tol, bool newton,"
    " bool potentials, str caller)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    reference=_solve_reference,
    fake=_solve_fake,
)
"""The whole solve and its warning as one operator, opaque to traced code: (cost, log_a, log_b,
eps, max_iter, tol, newton, potentials, caller) -> (plan, f, g, converged, residual, iterations,
clean). Not differentiable: :class:`SinkhornPlanFunction` carries the gradient."""


class SinkhornPlanFunction(torch.autograd.Function):
    """cost (B, n, m) -> ``(plan, f, g, converged, residual, iterations, clean)`` with the
    implicit backward in the cost (only ``plan`` is differentiable); forward mode applies the
    same map (the Jacobian is symmetric, docs/math.md §6).
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
        potentials: bool,
        caller: str,
    ) -> tuple[Any, ...]:
        if torch.compiler.is_compiling():
            return SINKHORN_OP(
                cost, log_a, log_b, epsilon, max_iter, tol, newton, potentials, caller
            )
        res = _log_sinkhorn(cost, log_a, log_b, epsilon, max_iter, tol, newton, potentials)
        warn_unless_clean(caller, res, False, max_iter, tol)
        return res.plan, res.f, res.g, res.converged, res.residual, res.iterations, False

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        epsilon = inputs[3]
        plan, f, g, converged, residual = output[:5]
        ctx.set_materialize_grads(False)  # only the plan's gradient is used
        ctx.save_for_backward(plan, epsilon.detach())
        ctx.save_for_forward(plan, epsilon.detach())
        ctx.mark_non_differentiable(f, g, converged, residual)

    @staticmethod
    def backward(ctx: Any, grad_plan: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        nones: tuple[None, ...] = (None,) * 8
        if not ctx.needs_input_grad[0] or grad_plan is None:
            return (None, *nones)
        plan, epsilon = ctx.saved_tensors
        return (implicit_cost_vjp(plan, grad_plan, epsilon), *nones)

    @staticmethod
    def jvp(ctx: Any, cost_t: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        """Tangent of the plan for a cost tangent: ``J dC = J^T dC``, the VJP of ``dC``."""
        nones: tuple[None, ...] = (None,) * 6
        if cost_t is None:
            return (None, *nones)
        plan, epsilon = ctx.saved_tensors
        return (implicit_cost_vjp(plan, cost_t, epsilon), *nones)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_rows(SinkhornPlanFunction, info, in_dims, *args)


_SinkhornPlanTraced = without_jvp(SinkhornPlanFunction)


def implicit_cost_vjp(
    plan: Tensor, grad_plan: Tensor, epsilon: Tensor, closed_form: bool = False
) -> Tensor:
    """Vector-Jacobian product of the converged plan map ``C -> Gamma`` (docs/math.md §2.3):
    ``plan``, ``grad_plan`` (B, n, m), ``epsilon`` (B,) -> the cost's gradient (B, n, m);
    ``closed_form``: Cramer's rule for m <= 3, else an equilibrated Cholesky."""
    if plan.shape[2] == 1:
        return torch.zeros_like(plan)
    if closed_form and plan.shape[2] <= 3:
        return _closed_form_vjp(plan, grad_plan, epsilon)
    return _cholesky_vjp(plan, grad_plan, epsilon)


def _closed_form_vjp(plan: Tensor, grad_plan: Tensor, epsilon: Tensor) -> Tensor:
    """:func:`implicit_cost_vjp` for m = 2, 3 by :func:`laplacian_solve` where ``det K`` is
    above ``DET_MIN``; other rows take :func:`_cholesky_vjp`."""
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
    beta, det = laplacian_solve(cyclic_couplings(p, mu.transpose(1, 2)), rhs)
    d = _centered_at(p, torch.nn.functional.pad(beta, (0, 0, 0, 1)) - gbar, home)
    cbar = (gam * d / epsilon.to(torch.float64).reshape(-1, 1, 1)).transpose(1, 2).to(dtype)
    unsafe = ~(det.detach() > DET_MIN)  # (B, 1, 1), also NaN
    if _any_set(unsafe):
        cbar = torch.where(unsafe, _cholesky_vjp(plan, grad_plan, epsilon), cbar)
    return cbar


def _centered_at(p: Tensor, u: Tensor, home: Tensor) -> Tensor:
    """:func:`_centered` with each row shifted by its value at ``home`` (B, 1, n), the index of
    its largest P."""
    h = u - u.gather(1, home)
    return h - (p * h).sum(1, keepdim=True)


def _cholesky_vjp(plan: Tensor, grad_plan: Tensor, epsilon: Tensor) -> Tensor:
    """:func:`implicit_cost_vjp` through the equilibrated, jittered Cholesky of K with one
    step of iterative refinement."""
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
    factor = spd_factor(_reduced_schur(p, mu))
    # Solve K beta = sum_i Gamma_ij centred(Gbar - beta)_ij ... = 0 for the first m-1 columns,
    # i.e. the column sums of Cbar vanish; each pass refines beta with the exactly formed residual.
    beta = torch.zeros((bsz, m), dtype=gam.dtype, device=gam.device)
    for _ in range(_REFINE_STEPS + 1):
        d = _centered(p, gbar - beta.unsqueeze(-1), top)
        resid = (gs * d[:, : m - 1]).sum(-1)  # (B, m-1)
        beta = beta + torch.nn.functional.pad(spd_solve(factor, resid), (0, 1))
    d = _centered(p, gbar - beta.unsqueeze(-1), top)
    cbar = -(gam * d) / epsilon.double().reshape(bsz, 1, 1)
    return cbar.to(dtype).transpose(1, 2)


def attach_epsilon(scaled: Tensor, epsilon: Tensor) -> Tensor:
    r"""``scaled = C / eps`` (``eps`` detached) made a function of ``epsilon``, as ``scaled *
    exp(u - u0)``, ``u = -log(eps)``: autograd through ``C / eps`` squares epsilon, which
    overflows below 1e-154 (docs/math.md §4). Infinite costs are constants."""
    u = -torch.log(epsilon)
    factor = torch.exp(u - u.detach())  # 1, with d factor / du = factor
    inf = torch.isinf(scaled.detach())
    return torch.where(inf, scaled, torch.where(inf, 0, scaled) * factor)


def log_sinkhorn(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    *,
    max_iter: int,
    tol: float,
    newton: bool = False,
    potentials: bool = True,
    caller: str = "",
) -> SinkhornResult:
    """Solve a batch of entropic OT problems; the plan is differentiable in ``cost``.

    ``cost`` (B, n, m) is computed in its dtype; ``log_a``, ``log_b`` (B, n), (B, m) and
    ``epsilon`` (B,) are constants (for a gradient in epsilon pass ``cost / epsilon`` with
    ``epsilon = 1``, :func:`attach_epsilon`); ``potentials=False`` gives empty ``f`` and ``g``;
    ``caller`` is the op the non-convergence warning names (empty: none). While tracing,
    ``iterations`` is a 0-dim tensor.
    """
    args = (cost, log_a, log_b, epsilon, max_iter, tol, newton, potentials, caller)
    if torch.compiler.is_compiling():
        grads = torch.is_grad_enabled() and cost.requires_grad
        out = _SinkhornPlanTraced.apply(*args) if grads else SINKHORN_OP(*args)
        plan, f, g, converged, residual, iterations = out[:6]
        return SinkhornResult(f, g, plan, converged, iterations, residual)
    plan, f, g, converged, residual, iterations, _ = apply_function(SinkhornPlanFunction, *args)
    return SinkhornResult(f, g, plan, converged, int(iterations), residual)
