"""The sorted top-k's forward solve: semi-dual Newton from the centred start (docs/math.md §2.2).

From the centred start (v = 0, exact as epsilon -> 0; one column update of it, exact as epsilon
-> infinity), full Newton steps in float64 that must lower the bound ``sum_j |b_j - c_j| / sum_i
a_i`` on each row's residual; rows left above ``tol`` are solved again by the generic solver
(:func:`softops._core.sinkhorn.log_sinkhorn`), so every result is certified by its residual. On
the CPU, small problems run row by row in the C++ kernel (the operator ``softops::newton_first``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._C import _functorch

from softops._core.sinkhorn import (
    SinkhornResult,
    cyclic_couplings,
    fake_outputs,
    laplacian_solve,
    log_sinkhorn,
    nan_failed_rows,
    op_outputs,
    spd_factor,
    spd_solve,
    warn_unless_clean,
)
from softops._kernels import Kernel, define, kernels_enabled

__all__ = ["NEWTON_FIRST_OP", "NEWTON_FIRST_STEPS", "NEWTON_KERNEL", "newton_first", "use_kernel"]

NEWTON_FIRST_STEPS = 12
"""Cap on the Newton steps from the centred start (three reach 1e-6 on normal scores)."""
KERNEL_MAX_WORK = 1 << 17
"""Largest ``n m^2`` per row that the kernel solves (above it the batched torch code is faster)."""
NEWTON_KERNEL = Kernel("softops_newton", Path(__file__).with_name("_newton_kernel.cpp"))
"""The CPU row kernels of the Newton-first solve and of the sorted top-k plan's backward."""


def use_kernel(t: Tensor, n: int, m: int) -> bool:
    """Whether the row kernels may take rows of n entries and m targets held by ``t`` (a plain
    CPU tensor, ``n m^2 <= KERNEL_MAX_WORK``, the kernel back end on)."""
    return (
        t.device.type == "cpu"
        and n * m * m <= KERNEL_MAX_WORK
        and kernels_enabled()
        and not torch.compiler.is_compiling()
        and not _functorch.is_functorch_wrapped_tensor(t)
    )


class _Semidual(NamedTuple):
    """The problem in float64, layout (B, m, n); column vectors (B, m, 1), scalars (B, 1, 1)."""

    s: Tensor  # (B, m, n) cost / epsilon
    log_a: Tensor  # (B, n)
    a_row: Tensor  # (B, 1, n) row masses a_i
    a_col: Tensor  # (B, n, 1) the same, as a column
    a_sum: Tensor  # (B, 1, 1)
    b: Tensor  # (B, m, 1) column masses
    ref: Tensor  # (B, m, n) 1 at each row's reference (cheapest) column r(i), else 0
    off_ref: Tensor  # (B, m, n) 1 - ref
    b_ref: Tensor  # (B, m, 1) b_j - sum_{r(i) = j} a_i, exact (0 where the masses match)
    tol_mass: Tensor  # (B, 1, 1) tol * sum_i a_i: the stopping level of ``l1``


class _NewtonState(NamedTuple):
    """The semi-dual at the states v (B, m, 1)."""

    p: Tensor  # (B, m, n) P_ij = softmax_j(v_j - s_ij)
    gap: Tensor  # (B, m, 1) b - c with c_j = sum_i a_i P_ij: the gradient of the semi-dual
    l1: Tensor  # (B, 1, 1) sum_j |b_j - c_j|, which bounds sum_i a_i times the residual


def _semidual(
    cost: Tensor, log_a: Tensor, log_b: Tensor, epsilon: Tensor, tol: float
) -> tuple[_Semidual, Tensor]:
    """The problem and the start ``v = log b - log c(0)`` (B, m, 1): one column update of 0."""
    f64 = torch.float64
    # (B, m, n) in that memory order: every reduction over m runs over contiguous rows
    s = cost.new_empty(cost.transpose(1, 2).shape, dtype=f64)
    torch.div(cost.transpose(1, 2), epsilon.to(f64).reshape(-1, 1, 1), out=s)
    # both marginals from their logarithms in float64 (else the totals' gap floors the residual)
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
    """The state at ``v``: ``b - c`` relative to each row's reference column r(i), as sums of
    small products (exact where the rows are nearly one-hot)."""
    p = torch.softmax(v - sd.s, 1)
    off = p * sd.off_ref
    flow = off.addcmul_(sd.ref, off.sum(1, keepdim=True), value=-1.0)  # P - [j = r(i)]
    gap = torch.baddbmm(sd.b_ref, flow, sd.a_col, alpha=-1.0)
    return _NewtonState(p, gap, gap.abs().sum((1, 2), keepdim=True))


def _residual(sd: _Semidual, state: _NewtonState) -> tuple[Tensor, Tensor]:
    """``(ratio, err)``: ``ratio = (b - c) / c`` (B, m, 1) and the relative L1 row error (B, 1, 1)
    of the column-exact plan, without a difference of O(1) numbers."""
    gap = state.gap
    ratio = gap / (sd.b - gap).clamp_min_(torch.finfo(gap.dtype).tiny)
    dev = torch.bmm(ratio.transpose(1, 2), state.p)  # (B, 1, n): row sums of the plan / a, - 1
    return ratio, torch.bmm(dev.abs_(), sd.a_col).div_(sd.a_sum)


def _newton_direction(sd: _Semidual, state: _NewtonState) -> Tensor:
    """The Newton step (B, m, 1), ``v_m`` fixed: K, the grounded Laplacian of the couplings,
    solved in closed form for m <= 3, else by Cholesky; a step that fails is not finite."""
    p = state.p
    m = p.shape[1]
    grad = state.gap[:, : m - 1]
    if m <= 3:
        delta = laplacian_solve(cyclic_couplings(p, sd.a_col), grad)[0]
    else:
        w = torch.bmm(p * sd.a_row, p.transpose(1, 2))  # (B, m, m)
        eye = torch.eye(m, dtype=torch.bool, device=p.device)
        w_off = w.masked_fill(eye, 0.0)
        kmat = (torch.diag_embed(w_off.sum(-1)) - w_off)[:, : m - 1, : m - 1]
        factor = spd_factor(kmat)
        ok = (factor[2] == 0)[:, None, None]
        delta = torch.where(ok, spd_solve(factor, grad.squeeze(-1)).unsqueeze(-1), math.nan)
    return torch.nn.functional.pad(delta, (0, 0, 0, 1))


def newton_first(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    potentials: bool = True,
) -> tuple[SinkhornResult, bool]:
    """Solve the centred problem (no autograd): ``(result, clean)``, ``clean`` whether every row
    converged without the fallback (arguments as :func:`~softops._core.sinkhorn.log_sinkhorn`'s)."""
    bsz, n, m = cost.shape
    if tol <= 0 or m == 1 or bsz == 0 or n == 0 or cost.device.type == "meta":
        res = log_sinkhorn(
            cost,
            log_a,
            log_b,
            epsilon,
            max_iter=max_iter,
            tol=tol,
            newton=True,
            potentials=potentials,
        )
        return res, False
    if use_kernel(cost, cost.shape[1], cost.shape[2]):
        plan, f, g, converged, residual, iterations, clean = NEWTON_FIRST_OP(
            cost, log_a, log_b, epsilon, max_iter, tol, potentials, ""
        )
        return SinkhornResult(f, g, plan, converged, int(iterations), residual), bool(clean)
    return _newton_first_torch(cost, log_a, log_b, epsilon, max_iter, tol, potentials)


def _newton_first_torch(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    potentials: bool = True,
) -> tuple[SinkhornResult, bool]:
    """:func:`newton_first` in torch: at most ``NEWTON_FIRST_STEPS`` full steps; a stopped
    row's state is never touched again."""
    sd, v = _semidual(cost, log_a, log_b, epsilon, tol)
    state = _newton_state(sd, v)
    live = state.l1 > sd.tol_mass  # (B, 1, 1)
    steps = 0
    n_live = int(live.sum())
    while n_live and steps < min(NEWTON_FIRST_STEPS, max_iter):
        v_new = torch.where(live, v + _newton_direction(sd, state), v)
        new = _newton_state(sd, v_new)
        # ``keep`` holds live rows only (a stopped row's bound does not drop)
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
    res = _finalize(sd, v, state, ratio, err, converged, clean, epsilon, steps, potentials)
    if clean:
        return res, clean
    left = (err > tol).flatten()  # not the NaN rows
    if max_iter > steps and bool(left.any()):
        res = _merge(res, left, _fallback(cost, log_a, log_b, epsilon, left, max_iter - steps, tol))
    return res, clean


def _fallback(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    rows: Tensor,
    max_iter: int,
    tol: float,
) -> SinkhornResult:
    """The rows ``rows`` solved from the start by the generic solver (Sinkhorn, then Newton)."""
    return log_sinkhorn(
        cost[rows], log_a[rows], log_b[rows], epsilon[rows], max_iter=max_iter, tol=tol, newton=True
    )


def _merge(res: SinkhornResult, rows: Tensor, sub: SinkhornResult) -> SinkhornResult:
    """``res`` with the rows ``rows`` (bool or indices) replaced by ``sub``."""
    plan, f, g, residual = res.plan.clone(), res.f.clone(), res.g.clone(), res.residual.clone()
    plan[rows] = sub.plan.to(plan.dtype)
    residual[rows] = sub.residual.to(residual.dtype)
    if f.shape[1]:
        f[rows], g[rows] = sub.f.to(f.dtype), sub.g.to(g.dtype)
    converged = res.converged.clone()
    converged[rows] = sub.converged
    iterations = res.iterations + sub.iterations
    return SinkhornResult(f, g, plan, converged, iterations, residual)


def _finalize(
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
    """The column-exact plan ``diag(a) P diag(1 + ratio)`` and the potentials at ``v``; rows
    with a NaN or infinite residual are NaN (none where ``clean``)."""
    plan = state.p.mul_(sd.a_row).mul_(ratio + 1.0)
    err, converged = err.flatten(), converged.flatten()
    if potentials:
        eps = epsilon.to(v.dtype).unsqueeze(-1)
        f = (sd.log_a - torch.logsumexp(v - sd.s, 1)) * eps
        g = (v + torch.log1p(ratio)).squeeze(-1) * eps  # -inf in the columns of zero mass
    else:
        f, g = plan.new_empty((plan.shape[0], 0)), plan.new_empty((plan.shape[0], 0))
    if not clean:
        plan, f, g = nan_failed_rows(err, plan, f, g)
    return SinkhornResult(f, g, plan.transpose(1, 2), converged, iterations, err)


def _op_reference(
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    potentials: bool,
    caller: str,
) -> tuple[Tensor, ...]:
    res, clean = _newton_first_torch(cost, log_a, log_b, epsilon, max_iter, tol, potentials)
    warn_unless_clean(caller, res, clean, max_iter, tol)
    return op_outputs(res, clean, potentials)


def _op_cpu(
    ops: Any,
    cost: Tensor,
    log_a: Tensor,
    log_b: Tensor,
    epsilon: Tensor,
    max_iter: int,
    tol: float,
    potentials: bool,
    caller: str,
) -> tuple[Tensor, ...]:
    """The solve by the row kernel; the rows it leaves by :func:`_newton_first_torch`."""
    f64 = torch.float64
    bsz = cost.shape[0]
    s = torch.div(cost.transpose(1, 2).to(f64), epsilon.to(f64).reshape(-1, 1, 1)).contiguous()
    la = log_a.to(f64)
    plan, v, ratio, err, steps = ops.newton_first_rows(
        s, la, log_b.to(f64), float(tol), min(NEWTON_FIRST_STEPS, max_iter)
    )
    if potentials:
        ev = epsilon.to(f64).unsqueeze(-1)
        f = (la - torch.logsumexp(v.unsqueeze(-1) - s, 1)) * ev
        g = (v + torch.log1p(ratio)) * ev
    else:
        f, g = plan.new_empty((bsz, 0)), plan.new_empty((bsz, 0))
    converged = err <= tol
    clean = bool(converged.all())
    res = SinkhornResult(f, g, plan.transpose(1, 2), converged, int(steps.max()) if bsz else 0, err)
    if not clean:
        left = ~converged
        sub, _ = _newton_first_torch(
            cost[left], log_a[left], log_b[left], epsilon[left], max_iter, tol, potentials
        )
        res = _merge(res, left, sub)._replace(iterations=max(res.iterations, sub.iterations))
    warn_unless_clean(caller, res, clean, max_iter, tol)
    return op_outputs(res, clean, potentials)


def _op_fake(cost: Tensor, *args: Any) -> tuple[Tensor, ...]:
    return fake_outputs(cost, args[5], torch.float64)  # (args[5]: potentials)


NEWTON_FIRST_OP = define(
    "softops::newton_first",
    "(Tensor cost, Tensor log_a, Tensor log_b, Tensor eps, int max_iter, float tol,"
    " bool potentials, str caller) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    reference=_op_reference,
    fake=_op_fake,
    cpu=_op_cpu,
    kernel=NEWTON_KERNEL,
)
""":func:`newton_first` as an operator, opaque to traced code, with the outputs of
``softops::sinkhorn`` in float64; not differentiable."""
