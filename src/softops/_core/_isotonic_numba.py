"""numba kernels for ``isotonic.py``: stack PAV, one row per ``prange`` iteration.

Imported lazily by ``isotonic.py`` (numba is optional and slow to import). ``cache=True`` keeps
the compiled machine code on disk, so only the first call in a fresh environment compiles (a few
seconds per dtype). Block statistics are accumulated in the float64 work arrays.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = [
    "l2_vjp",
    "pav_kl",
    "pav_l2",
    "proj_kl_parallel",
    "proj_kl_serial",
    "proj_l2_parallel",
    "proj_l2_serial",
]


@numba.njit(parallel=True, cache=True, nogil=True)
def pav_l2(y, v, block, acc, cnt):  # pragma: no cover - compiled
    """Decreasing L2 isotonic regression of each row of y (B, n) into v; block ids into block."""
    B, n = y.shape
    for b in numba.prange(B):
        top = -1
        for i in range(n):
            top += 1
            acc[b, top] = y[b, i]
            cnt[b, top] = 1
            # pool while mean(prev) <= mean(top); counts are positive, so cross-multiply
            while top > 0 and acc[b, top - 1] * cnt[b, top] <= acc[b, top] * cnt[b, top - 1]:
                acc[b, top - 1] += acc[b, top]
                cnt[b, top - 1] += cnt[b, top]
                top -= 1
        pos = 0
        for k in range(top + 1):
            value = acc[b, k] / cnt[b, k]
            for j in range(pos, pos + cnt[b, k]):
                v[b, j] = value
                block[b, j] = k
            pos += cnt[b, k]


@numba.njit(cache=True, nogil=True, inline="always")
def _logaddexp(p, q):  # pragma: no cover - compiled
    if p == q:  # also +-inf
        return p + math.log(2.0)
    m = max(p, q)
    return m + math.log1p(math.exp(-abs(p - q)))


@numba.njit(parallel=True, cache=True, nogil=True)
def pav_kl(s, w, v, block, ls, lw, cnt):  # pragma: no cover - compiled
    """Decreasing KL isotonic regression: block value logsumexp(s_B) - logsumexp(w_B)."""
    B, n = s.shape
    for b in numba.prange(B):
        top = -1
        for i in range(n):
            top += 1
            ls[b, top] = s[b, i]
            lw[b, top] = w[b, i]
            cnt[b, top] = 1
            while top > 0 and (ls[b, top - 1] - lw[b, top - 1]) <= (ls[b, top] - lw[b, top]):
                ls[b, top - 1] = _logaddexp(ls[b, top - 1], ls[b, top])
                lw[b, top - 1] = _logaddexp(lw[b, top - 1], lw[b, top])
                cnt[b, top - 1] += cnt[b, top]
                top -= 1
        pos = 0
        for k in range(top + 1):
            value = ls[b, k] - lw[b, k]
            for j in range(pos, pos + cnt[b, k]):
                v[b, j] = value
                block[b, j] = k
            pos += cnt[b, k]


# ------------------------------------------------------------------ projections P(s, w) = s - v
#
# The kernels below return the projection P = s - v directly, never v: at |s| >> |w| (a rank at
# small epsilon) or |w| >> |s| (a sort at large epsilon) v = s - w is far larger than P, and
# s - (s - w) cancels. Each block k keeps a reference position ref[k] (its first, where s and w are
# largest), and its statistics relative to that reference, so every sum is over small numbers:
# L2: acc[k] = sum_j (y_j - y_ref) with y = s - w; KL: acc[k] = log sum_j e^(s_j - s_ref) and
# aux[k] = log sum_j e^(w_j - w_ref). Adjacent blocks are compared through the gap
# (s_p - s_t) - (w_p - w_t), differences of the sorted inputs themselves. A singleton's output is
# (s_i - s_i) + w_i = w_i exactly, and tied inputs give gaps of exactly 0. A row with a non-finite
# entry (an infinity, a NaN) takes the plain formulas (v, then s - v), whose infinity arithmetic
# gives the projection's limits.


@numba.njit(cache=True, nogil=True)
def _all_finite(s, w):  # pragma: no cover - compiled
    """Whether every entry of the rows s and w is finite (the finite path may run)."""
    for i in range(s.shape[0]):
        if not (math.isfinite(s[i]) and math.isfinite(w[i])):
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _proj_l2_row(s, w, out, block, ref, cnt, acc):  # pragma: no cover - compiled
    """One row of P_Q(s, w) into out and block; returns whether the row was finite."""
    n = s.shape[0]
    finite = _all_finite(s, w)
    top = -1
    if finite:
        for i in range(n):
            top += 1
            ref[top] = i
            cnt[top] = 1
            acc[top] = 0.0
            while top > 0:
                p, t = ref[top - 1], ref[top]
                cp, ct = cnt[top - 1], cnt[top]
                gap = (float(s[p]) - float(s[t])) - (float(w[p]) - float(w[t]))  # y_p - y_t
                # pool while mean(prev) <= mean(top), i.e. gap + acc_P/cP - acc_T/cT <= 0
                if gap * cp * ct + acc[top - 1] * ct - acc[top] * cp > 0.0:
                    break
                acc[top - 1] += acc[top] - ct * gap
                cnt[top - 1] = cp + ct
                top -= 1
        pos = 0
        for k in range(top + 1):
            r = ref[k]
            shift = w[r] - acc[k] / cnt[k]  # mean(w_B) - mean(s_B) + s_ref
            sr = float(s[r])
            for j in range(pos, pos + cnt[k]):
                out[j] = (float(s[j]) - sr) + shift
                block[j] = k
            pos += cnt[k]
    else:  # the plain formulas: acc holds block sums of y = s - w
        for i in range(n):
            top += 1
            acc[top] = float(s[i]) - float(w[i])
            cnt[top] = 1
            while top > 0 and acc[top - 1] * cnt[top] <= acc[top] * cnt[top - 1]:
                acc[top - 1] += acc[top]
                cnt[top - 1] += cnt[top]
                top -= 1
        pos = 0
        for k in range(top + 1):
            value = acc[k] / cnt[k]
            for j in range(pos, pos + cnt[k]):
                out[j] = s[j] - value
                block[j] = k
            pos += cnt[k]
    return finite


@numba.njit(cache=True, nogil=True)
def _proj_kl_row(s, w, out, block, ref, cnt, acc, aux):  # pragma: no cover - compiled
    """One row of P_E(s, w) into out and block; returns whether the row was finite."""
    n = s.shape[0]
    finite = _all_finite(s, w)
    top = -1
    if finite:
        for i in range(n):
            top += 1
            ref[top] = i
            cnt[top] = 1
            acc[top] = 0.0
            aux[top] = 0.0
            while top > 0:
                p, t = ref[top - 1], ref[top]
                ds = float(s[t]) - float(s[p])  # <= 0: the inputs are sorted
                dw = float(w[t]) - float(w[p])
                # value(B) = s_ref + acc - w_ref - aux; pool while value(prev) <= value(top)
                if (aux[top] - aux[top - 1]) - (acc[top] - acc[top - 1]) + dw - ds > 0.0:
                    break
                acc[top - 1] = _logaddexp(acc[top - 1], acc[top] + ds)
                aux[top - 1] = _logaddexp(aux[top - 1], aux[top] + dw)
                cnt[top - 1] += cnt[top]
                top -= 1
        pos = 0
        for k in range(top + 1):
            r = ref[k]
            shift = (aux[k] - acc[k]) + w[r]
            sr = float(s[r])
            for j in range(pos, pos + cnt[k]):
                out[j] = (float(s[j]) - sr) + shift
                block[j] = k
            pos += cnt[k]
    else:  # the plain formulas: acc = logsumexp(s_B), aux = logsumexp(w_B)
        for i in range(n):
            top += 1
            acc[top] = s[i]
            aux[top] = w[i]
            cnt[top] = 1
            while top > 0 and (acc[top - 1] - aux[top - 1]) <= (acc[top] - aux[top]):
                acc[top - 1] = _logaddexp(acc[top - 1], acc[top])
                aux[top - 1] = _logaddexp(aux[top - 1], aux[top])
                cnt[top - 1] += cnt[top]
                top -= 1
        pos = 0
        for k in range(top + 1):
            value = acc[k] - aux[k]
            for j in range(pos, pos + cnt[k]):
                out[j] = s[j] - value
                block[j] = k
            pos += cnt[k]
    return finite


@numba.njit(cache=True, nogil=True)
def proj_l2_serial(s, w, out, block):  # pragma: no cover - compiled
    """P(s, w) = s - v_Q(s, w) row by row (s, w sorted descending; one row of s or w broadcasts).

    The work arrays are one row long and reused, so they stay in cache. Returns the number of
    rows that held a non-finite entry (and took the plain formulas)."""
    B, n = out.shape
    ds, dw = min(s.shape[0] - 1, 1), min(w.shape[0] - 1, 1)  # 0: one row for all
    ref, cnt, acc = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n)
    bad = 0
    for b in range(B):
        if not _proj_l2_row(s[b * ds], w[b * dw], out[b], block[b], ref, cnt, acc):
            bad += 1
    return bad


@numba.njit(parallel=True, cache=True, nogil=True)
def proj_l2_parallel(s, w, out, block):  # pragma: no cover - compiled
    """``proj_l2_serial`` with ``prange`` over the rows (work arrays per row)."""
    B, n = out.shape
    ds, dw = min(s.shape[0] - 1, 1), min(w.shape[0] - 1, 1)
    bad = 0
    for b in numba.prange(B):
        ref, cnt, acc = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n)
        if not _proj_l2_row(s[b * ds], w[b * dw], out[b], block[b], ref, cnt, acc):
            bad += 1
    return bad


@numba.njit(cache=True, nogil=True)
def proj_kl_serial(s, w, out, block):  # pragma: no cover - compiled
    """P_E(s, w) = s - v_E(s, w) row by row (inputs and result as for ``proj_l2_serial``)."""
    B, n = out.shape
    ds, dw = min(s.shape[0] - 1, 1), min(w.shape[0] - 1, 1)
    ref, cnt, acc, aux = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n), np.empty(n)
    bad = 0
    for b in range(B):
        if not _proj_kl_row(s[b * ds], w[b * dw], out[b], block[b], ref, cnt, acc, aux):
            bad += 1
    return bad


@numba.njit(parallel=True, cache=True, nogil=True)
def proj_kl_parallel(s, w, out, block):  # pragma: no cover - compiled
    """``proj_kl_serial`` with ``prange`` over the rows (work arrays per row)."""
    B, n = out.shape
    ds, dw = min(s.shape[0] - 1, 1), min(w.shape[0] - 1, 1)
    bad = 0
    for b in numba.prange(B):
        ref, cnt = np.empty(n, np.int64), np.empty(n, np.int64)
        acc, aux = np.empty(n), np.empty(n)
        if not _proj_kl_row(s[b * ds], w[b * dw], out[b], block[b], ref, cnt, acc, aux):
            bad += 1
    return bad


# ------------------------------------------------------------------ the l2 VJP, fused on the host


@numba.njit(cache=True, nogil=True)
def l2_vjp(g, pz, pw, block, gz, gw):  # pragma: no cover - compiled
    """The VJP of P_Q(z, w) = z - v(z_sorted, w_sorted) for a cotangent g in z's order (B, n).

    ``pz`` / ``pw`` (B, n) sort z / w descending; a (B, 0) array means "already sorted". With m
    the block mean of the sorted cotangent gs = g[pz]: gz[pz] = gs - m and gw[pw] = m, each
    written only when that output has n columns. One pass over each row, no temporaries.
    """
    B, n = g.shape
    acc, cnt = np.empty(n), np.empty(n, np.int64)
    sort_z, sort_w = pz.shape[1] == n, pw.shape[1] == n
    want_z, want_w = gz.shape[1] == n, gw.shape[1] == n
    for b in range(B):
        for k in range(block[b, n - 1] + 1):
            acc[k] = 0.0
            cnt[k] = 0
        for j in range(n):
            k = block[b, j]
            acc[k] += g[b, pz[b, j] if sort_z else j]
            cnt[k] += 1
        for j in range(n):
            k = block[b, j]
            mean = acc[k] / cnt[k]
            if want_z:
                i = pz[b, j] if sort_z else j
                gz[b, i] = g[b, i] - mean
            if want_w:
                gw[b, pw[b, j] if sort_w else j] = mean
