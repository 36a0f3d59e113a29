"""numba kernel for ``sinkhorn.py``: the semi-dual Newton solve of ``_newton_first``, row by row.

Imported lazily by ``sinkhorn.py`` (numba is optional and slow to import); ``cache=True`` keeps the
machine code on disk, so only the first call in a fresh environment compiles (a few seconds). The
arithmetic is that of the torch code it replaces (``_semidual``, ``_newton_state``,
``_newton_direction``, ``_residual``, ``_finalize_state``), in float64, each row on its own: one
row's solve costs O(n m) per state, against a few hundred tensor operations of a few microseconds
each for the batched torch code, which is what a small problem (the sorted top-k of a beam step)
pays.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["newton_first_rows", "sorted_vjp_rows"]

_TINY = np.finfo(np.float64).tiny


@numba.njit(cache=True, nogil=True)
def _state(s, a, b_ref, ref, v, p, gap):  # pragma: no cover - compiled
    """P = softmax_j(v_j - s_ij) into p (m, n); the gap b - c relative to each row's reference
    column into gap (m,); returns its L1 norm (``_newton_state``)."""
    m, n = s.shape
    for j in range(m):
        gap[j] = b_ref[j]
    for i in range(n):
        top = -math.inf
        for j in range(m):
            z = v[j] - s[j, i]
            p[j, i] = z
            if z > top:
                top = z
        total = 0.0
        for j in range(m):
            e = math.exp(p[j, i] - top) if top > -math.inf else math.nan
            p[j, i] = e
            total += e
        off = 0.0
        r = ref[i]
        for j in range(m):
            p[j, i] /= total
            if j != r:
                off += p[j, i]
                gap[j] -= a[i] * p[j, i]
        gap[r] += a[i] * off
    l1 = 0.0
    for j in range(m):
        l1 += abs(gap[j])
    return l1


@numba.njit(cache=True, nogil=True)
def _direction(a, p, gap, kmat, delta):  # pragma: no cover - compiled
    """``K^-1 gap`` into delta (m,), its last entry 0, for the grounded Laplacian K of the
    couplings ``w_jl = sum_i a_i P_ij P_il`` (the reduced Newton step of ``_newton_direction``;
    with ``a = mu`` the system of the implicit backward): in closed form (Cramer) for m <= 3,
    else by the equilibrated, jittered Cholesky. Returns det K for m <= 3 (delta NaN where it is
    not positive); for m > 3, 1 where the factorisation succeeded, else 0 (delta NaN)."""
    m, n = p.shape
    m1 = m - 1
    for j in range(m):
        delta[j] = 0.0
    if m == 2:
        w01 = 0.0
        for i in range(n):
            w01 += a[i] * p[0, i] * p[1, i]
        delta[0] = gap[0] / w01 if w01 > 0 else math.nan
        return w01
    if m == 3:
        w01 = w12 = w20 = 0.0
        for i in range(n):
            w01 += a[i] * p[0, i] * p[1, i]
            w12 += a[i] * p[1, i] * p[2, i]
            w20 += a[i] * p[2, i] * p[0, i]
        det = w01 * (w12 + w20) + w12 * w20
        if not det > 0:
            delta[0] = delta[1] = math.nan
            return det
        r0, r1 = gap[0], gap[1]
        delta[0] = (w01 * (r0 + r1) + w12 * r0) / det
        delta[1] = (w01 * (r0 + r1) + w20 * r1) / det
        return det
    for j in range(m1):
        for c in range(m1):
            kmat[j, c] = 0.0
    for j in range(m):
        for c in range(j + 1, m):
            w = 0.0
            for i in range(n):
                w += a[i] * p[j, i] * p[c, i]
            if j < m1:
                kmat[j, j] += w
            if c < m1:
                kmat[c, c] += w
                if j < m1:
                    kmat[j, c] -= w
                    kmat[c, j] -= w
    # Jacobi equilibration, then Cholesky with a relative jitter (retried once, larger)
    scale = np.empty(m1)
    for j in range(m1):
        d = kmat[j, j]
        scale[j] = 1.0 / math.sqrt(d) if d > 0 else 1.0
    chol = np.empty((m1, m1))
    eps64 = np.finfo(np.float64).eps
    for tau in (16.0 * max(m1, 4) * eps64, 1e-10):
        ok = True
        for j in range(m1):
            for c in range(j + 1):
                acc = kmat[j, c] * scale[j] * scale[c] + (tau if j == c else 0.0)
                for q in range(c):
                    acc -= chol[j, q] * chol[c, q]
                if j == c:
                    if not acc > 0:
                        ok = False
                        break
                    chol[j, j] = math.sqrt(acc)
                else:
                    chol[j, c] = acc / chol[c, c]
            if not ok:
                break
        if ok:
            y = np.empty(m1)
            for j in range(m1):
                acc = gap[j] * scale[j]
                for q in range(j):
                    acc -= chol[j, q] * y[q]
                y[j] = acc / chol[j, j]
            for j in range(m1 - 1, -1, -1):
                acc = y[j]
                for q in range(j + 1, m1):
                    acc -= chol[q, j] * delta[q]
                delta[j] = acc / chol[j, j]
            for j in range(m1):
                delta[j] *= scale[j]
            return 1.0
    for j in range(m1):
        delta[j] = math.nan
    return 0.0


@numba.njit(cache=True, nogil=True)
def newton_first_rows(
    s, log_a, log_b, tol, max_steps, plan, v_out, ratio_out, err_out, steps_out
):  # pragma: no cover - compiled
    """Semi-dual Newton from one Sinkhorn update of v = 0 for every row of s (B, m, n) (cost /
    epsilon), with row and column log-masses log_a (B, n) and log_b (B, m).

    Writes the column-exact plan ``a_i P_ij (1 + ratio_j)`` into plan (B, m, n), the states v and
    ``ratio = (b - c) / c`` into v_out and ratio_out (B, m), the relative L1 row error into err_out
    (B,) and the steps taken into steps_out (B,). A row takes full steps while its bound
    ``sum_j |b_j - c_j| / sum_i a_i`` is above ``tol`` and each step lowers it; a row with a zero
    (or non-finite) mass is not solved (err_out NaN: the caller solves it another way).
    """
    B, m, n = s.shape
    p = np.empty((m, n))
    p_new = np.empty((m, n))
    a = np.empty(n)
    b = np.empty(m)
    b_ref = np.empty(m)
    gap = np.empty(m)
    gap_new = np.empty(m)
    v = np.empty(m)
    v_new = np.empty(m)
    delta = np.empty(m)
    kmat = np.empty((max(m - 1, 1), max(m - 1, 1)))
    ref = np.empty(n, dtype=np.int64)
    for row in range(B):
        sr = s[row]
        regular = True
        a_sum = 0.0
        for i in range(n):
            a[i] = math.exp(log_a[row, i])
            a_sum += a[i]
            if not a[i] > 0 or not math.isfinite(a[i]):
                regular = False
        for j in range(m):
            b[j] = math.exp(log_b[row, j])
            if not b[j] > 0 or not math.isfinite(b[j]):
                regular = False
        if not regular:
            err_out[row] = math.nan
            steps_out[row] = 0
            continue
        # the start: one column update of v = 0; each row's reference column is its cheapest
        for j in range(m):
            gap[j] = 0.0  # c(0)_j = sum_i a_i softmax_j(-s_ij)
            b_ref[j] = b[j]
        for i in range(n):
            top = -math.inf
            for j in range(m):
                top = max(top, -sr[j, i])
            total = 0.0
            for j in range(m):
                total += math.exp(-sr[j, i] - top)
            for j in range(m):
                gap[j] += a[i] * math.exp(-sr[j, i] - top) / total
        for j in range(m):
            v[j] = math.log(b[j]) - math.log(max(gap[j], _TINY))
        for i in range(n):
            best = 0
            for j in range(1, m):
                if sr[j, i] < sr[best, i]:
                    best = j
            ref[i] = best
            b_ref[best] -= a[i]
        l1 = _state(sr, a, b_ref, ref, v, p, gap)
        tol_mass = tol * a_sum
        steps = 0
        while l1 > tol_mass and steps < max_steps:
            _direction(a, p, gap, kmat, delta)
            for j in range(m):
                v_new[j] = v[j] + delta[j]
            l1_new = _state(sr, a, b_ref, ref, v_new, p_new, gap_new)
            steps += 1
            if not l1_new < l1:  # the step did not lower the bound (or is not finite): stop
                break
            p, p_new = p_new, p
            gap, gap_new = gap_new, gap
            v, v_new = v_new, v
            l1 = l1_new
        # the residual of the column-exact plan, and the plan
        for j in range(m):
            ratio_out[row, j] = gap[j] / max(b[j] - gap[j], _TINY)
            v_out[row, j] = v[j]
        err = 0.0
        for i in range(n):
            dev = 0.0
            for j in range(m):
                dev += ratio_out[row, j] * p[j, i]
                plan[row, j, i] = a[i] * p[j, i] * (ratio_out[row, j] + 1.0)
            err += a[i] * abs(dev)
        err_out[row] = err / a_sum
        steps_out[row] = steps


@numba.njit(cache=True, nogil=True, inline="always")
def _centred_at(p, u, home, out):  # pragma: no cover - compiled
    """``u_ji - sum_l P_li u_li`` into out (m, n), each entry first shifted by its value at the
    row's home column (its largest P): ``_centered_at``, without cancellation."""
    m, n = p.shape
    for i in range(n):
        ref = u[home[i], i]
        mean = 0.0
        for j in range(m):
            out[j, i] = u[j, i] - ref
            mean += p[j, i] * out[j, i]
        for j in range(m):
            out[j, i] -= mean


@numba.njit(cache=True, nogil=True)
def sorted_vjp_rows(
    plan, grad, scaled, slopes, eps, det_min, grad_s, grad_eps, safe
):  # pragma: no cover - compiled
    """The implicit VJP of the converged plan (B, m, n) for the cotangent grad (B, m, n), in units
    of epsilon (``implicit_cost_vjp`` with epsilon 1), contracted as the sorted top-k's backward
    needs it: ``grad_s`` (B, n) gets ``sum_j slopes_j G_ji / eps``, and where ``scaled`` (B, m, n)
    is given (not empty) ``grad_eps`` (B,) gets ``-<G, scaled> / eps`` over its finite entries.

    K is the grounded Laplacian of ``w_jl = sum_i mu_i P_ij P_il`` (``P = Gamma / mu``), solved
    as ``_closed_form_vjp`` does for m <= 3 (rows whose det K is not above ``det_min`` are not
    safe) and by the jittered Cholesky with one step of refinement against the exactly formed
    residual for larger m (rows where it fails are not safe). ``safe[b]`` False: the row is left
    for the torch code.
    """
    B, m, n = plan.shape
    mu = np.empty(n)
    p = np.empty((m, n))
    cen = np.empty((m, n))
    u = np.empty((m, n))
    home = np.empty(n, dtype=np.int64)
    rhs = np.empty(m)
    beta = np.empty(m)
    step = np.empty(m)
    kmat = np.empty((max(m - 1, 1), max(m - 1, 1)))
    with_eps = scaled.shape[0] == B
    for row in range(B):
        gam = plan[row]
        gb = grad[row]
        for i in range(n):
            total = 0.0
            for j in range(m):
                total += gam[j, i]
            mu[i] = total
            best = 0
            for j in range(m):
                p[j, i] = gam[j, i] / max(total, _TINY)
                if p[j, i] > p[best, i]:
                    best = j
            home[i] = best
        _centred_at(p, gb, home, cen)
        for j in range(m):
            acc = 0.0
            for i in range(n):
                acc += gam[j, i] * cen[j, i]
            rhs[j] = acc
        det = _direction(mu, p, rhs, kmat, beta)
        if m > 3 and det > 0:  # one refinement: beta += K^-1 (rhs - K beta), formed exactly
            for j in range(m):
                for i in range(n):
                    u[j, i] = gb[j, i] - beta[j]
            _centred_at(p, u, home, cen)
            for j in range(m):
                acc = 0.0
                for i in range(n):
                    acc += gam[j, i] * cen[j, i]
                rhs[j] = acc
            _direction(mu, p, rhs, kmat, step)
            for j in range(m):
                beta[j] += step[j]
        ok = det > det_min if m <= 3 else det > 0
        for j in range(m):
            ok = ok and math.isfinite(beta[j])
        safe[row] = ok
        if not ok:
            continue
        for j in range(m):
            for i in range(n):
                u[j, i] = beta[j] - gb[j, i]
        _centred_at(p, u, home, cen)
        e = eps[row]
        g_e = 0.0
        for i in range(n):
            acc = 0.0
            for j in range(m):
                g = gam[j, i] * cen[j, i]
                acc += slopes[j] * g
                if with_eps:
                    c = scaled[row, j, i]
                    if math.isfinite(c):
                        g_e += g * c
            grad_s[row, i] = acc / e
        if with_eps:
            grad_eps[row] = -g_e / e
