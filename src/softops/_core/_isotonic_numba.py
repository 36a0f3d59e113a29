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
    "l2_vjp_scaled",
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
# (s_i - s_i) + w_i = w_i exactly, and tied inputs give gaps of exactly 0.
#
# The same frame takes the infinities, with differences formed by ``_diff`` (0 between equal
# infinities): an infinite s_t is an infinite gap to every finite neighbour, so it never pools with
# one; equal infinities pool among themselves, and their block's output (s_j - s_ref) + shift is
# the projection's limit there, mean(w_B) (L2) or log mean exp(w_B) (KL), with no s - (s - w) to
# cancel beside them (a rank of 0 or beyond n, at |s| ~ 1e16, before). For KL an infinite w is
# taken too: a +inf w_ref puts +inf on its block, and a -inf w_t a zero weight in its block's
# log sum. For L2 an infinite w pulls the whole row to it (the block holding it has the mean
# +-inf, and every entry pools into it: y = s - w is -inf first or +inf last), +inf against -inf
# is NaN, and so is any row holding a NaN: such rows are filled without a pass of PAV.
#
# L2 rows whose finite magnitudes exceed ``_l2_limit(n)`` (where a gap, or a cross-multiplied
# comparison, could overflow: w spanning -1.7e308 .. 1.7e308 gave inf - inf) are solved for
# c s, c w with c a power of two, and the output divided by c: the projection is positively
# homogeneous, and the scaling is exact (down to the subnormals).


@numba.njit(cache=True, nogil=True, inline="always")
def _diff(a, b):  # pragma: no cover - compiled
    """a - b, and 0 where a == b (equal infinities too)."""
    return 0.0 if a == b else a - b


@numba.njit(cache=True, nogil=True)
def _l2_limit(n):  # pragma: no cover - compiled
    """The largest magnitude that the L2 frame takes unscaled in a row of n: its gaps (at most 4
    times it) times two counts (at most n**2 / 4) and its sums stay below float64's largest."""
    return 1.7976931348623157e308 / (8.0 * max(n, 1) * max(n, 1))


@numba.njit(cache=True, nogil=True)
def _all_finite(s, w):  # pragma: no cover - compiled
    """Whether every entry of the rows s and w is finite."""
    for i in range(s.shape[0]):
        if not (math.isfinite(s[i]) and math.isfinite(w[i])):
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _scan(s, w, limit):  # pragma: no cover - compiled
    """What the sorted rows s, w hold: returns (kind, c) with kind 0 (every entry finite), 1
    (infinities only where the frame takes them: in s, and in w when ``limit`` is inf, as for
    KL), 2 (a NaN, or +inf and -inf in w), 3 (+inf in w) or 4 (-inf in w); c is 1, or the power
    of two that brings the largest finite magnitude below ``limit``. A finite row costs one plain
    pass, its magnitude is read off its ends."""
    n = s.shape[0]
    if _all_finite(s, w):
        big = max(abs(float(s[0])), abs(float(s[n - 1])), abs(float(w[0])), abs(float(w[n - 1])))
        kind = 0
    else:
        big = 0.0
        s_inf, w_pos, w_neg = False, False, False
        for i in range(n):
            a, b = float(s[i]), float(w[i])
            if a != a or b != b:
                return 2, 1.0
            if math.isinf(a):
                s_inf = True
            elif abs(a) > big:
                big = abs(a)
            if b == math.inf:
                w_pos = True
            elif b == -math.inf:
                w_neg = True
            elif abs(b) > big:
                big = abs(b)
        if limit == math.inf:  # KL: the frame takes infinite w too
            kind = 1
        elif w_pos or w_neg:
            kind = 2 if w_pos and w_neg else (3 if w_pos else 4)
        else:
            kind = 1 if s_inf else 0
    c = 1.0
    if big > limit:
        c = math.ldexp(1.0, math.frexp(limit)[1] - math.frexp(big)[1] - 1)
    return kind, c


@numba.njit(cache=True, nogil=True)
def _fill(out, block, value):  # pragma: no cover - compiled
    """A row that is ``value`` throughout, in one block."""
    for j in range(out.shape[0]):
        out[j] = value
        block[j] = 0


@numba.njit(cache=True, nogil=True)
def _l2_frame(s, w, out, block, ref, cnt, acc, inf):  # pragma: no cover - compiled
    """PAV in the relative frame on one row of s and finite w; the differences of s are formed
    by ``_diff`` where ``inf`` (s holds infinities; else a plain subtraction, which is cheaper)."""
    n = s.shape[0]
    top = -1
    for i in range(n):
        top += 1
        ref[top] = i
        cnt[top] = 1
        acc[top] = 0.0
        while top > 0:
            p, t = ref[top - 1], ref[top]
            cp, ct = cnt[top - 1], cnt[top]
            sp, st = float(s[p]), float(s[t])
            gap = (_diff(sp, st) if inf else sp - st) - (float(w[p]) - float(w[t]))  # y_p - y_t
            # pool while mean(prev) <= mean(top), i.e. gap + acc_P/cP - acc_T/cT <= 0
            if gap * cp * ct + acc[top - 1] * ct - acc[top] * cp > 0.0:
                break
            acc[top - 1] += acc[top] - ct * gap
            cnt[top - 1] = cp + ct
            top -= 1
    pos = 0
    for k in range(top + 1):
        r = ref[k]
        shift = float(w[r]) - acc[k] / cnt[k]  # mean(w_B) - mean(s_B) + s_ref
        sr = float(s[r])
        for j in range(pos, pos + cnt[k]):
            sj = float(s[j])
            out[j] = (_diff(sj, sr) if inf else sj - sr) + shift
            block[j] = k
        pos += cnt[k]


@numba.njit(cache=True, nogil=True)
def _proj_l2_row(s, w, out, block, ref, cnt, acc):  # pragma: no cover - compiled
    """One row of P_Q(s, w) into out and block; returns whether the row was finite."""
    kind, c = _scan(s, w, _l2_limit(s.shape[0]))
    if kind >= 2:
        _fill(out, block, math.nan if kind == 2 else (math.inf if kind == 3 else -math.inf))
    elif c == 1.0:
        _l2_frame(s, w, out, block, ref, cnt, acc, kind == 1)
    else:  # P(s, w) = P(c s, c w) / c, exact for a power of two c
        scaled = np.empty(s.shape[0])
        _l2_frame(s * c, w * c, scaled, block, ref, cnt, acc, kind == 1)
        for j in range(s.shape[0]):
            out[j] = scaled[j] / c
    return kind == 0


@numba.njit(cache=True, nogil=True)
def _proj_kl_row(s, w, out, block, ref, cnt, acc, aux):  # pragma: no cover - compiled
    """One row of P_E(s, w) into out and block; returns whether the row was finite."""
    n = s.shape[0]
    kind, _ = _scan(s, w, math.inf)
    if kind == 2:
        _fill(out, block, math.nan)
        return False
    inf = kind == 1  # differences by _diff (equal infinities: 0), else plain
    top = -1
    for i in range(n):
        top += 1
        ref[top] = i
        cnt[top] = 1
        acc[top] = 0.0
        aux[top] = 0.0
        while top > 0:
            p, t = ref[top - 1], ref[top]
            if inf:
                ds, dw = _diff(float(s[t]), float(s[p])), _diff(float(w[t]), float(w[p]))
            else:  # <= 0: the inputs are sorted
                ds, dw = float(s[t]) - float(s[p]), float(w[t]) - float(w[p])
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
            sj = float(s[j])
            out[j] = (_diff(sj, sr) if inf else sj - sr) + shift
            block[j] = k
        pos += cnt[k]
    return kind == 0


@numba.njit(cache=True, nogil=True)
def proj_l2_serial(s, w, out, block):  # pragma: no cover - compiled
    """P(s, w) = s - v_Q(s, w) row by row (s, w sorted descending; one row of s or w broadcasts).

    The work arrays are one row long and reused, so they stay in cache. Returns the number of
    rows that held a non-finite entry (whose limits the caller may want to mark)."""
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
def _l2_vjp_rows(g, pz, pw, block, gz, gw, u, f, inv, gr):  # pragma: no cover - compiled
    """``l2_vjp_scaled``'s loop (``l2_vjp``: with no u, f, and no gr)."""
    B, n = g.shape
    acc, cnt = np.empty(n), np.empty(n, np.int64)
    sort_z, sort_w = pz.shape[1] == n, pw.shape[1] == n
    want_z, want_w, want_r = gz.shape[1] == n, gw.shape[1] == n, gr.shape[0] == B
    du = min(u.shape[0] - 1, 1)  # 0: one row of u for all
    for b in range(B):
        for k in range(block[b, n - 1] + 1):
            acc[k] = 0.0
            cnt[k] = 0
        for j in range(n):
            k = block[b, j]
            acc[k] += g[b, pz[b, j] if sort_z else j]
            cnt[k] += 1
        total, ur, last = 0.0, 0.0, -1
        for j in range(n):
            k = block[b, j]
            mean = acc[k] / cnt[k]
            i = pz[b, j] if sort_z else j
            if want_z:
                gz[b, i] = g[b, i] - mean
            if want_w:
                gw[b, pw[b, j] if sort_w else j] = mean
            if want_r:
                uj = float(u[b * du, i])
                if k != last:  # the block's first entry
                    ur, last = uj, k
                total += (g[b, i] - mean) * (uj - ur)
        if want_r:
            gr[b] = total * f[b] if inv else total / f[b]


@numba.njit(cache=True, nogil=True)
def l2_vjp(g, pz, pw, block, gz, gw):  # pragma: no cover - compiled
    """The VJP of P_Q(z, w) = z - v(z_sorted, w_sorted) for a cotangent g in z's order (B, n).

    ``pz`` / ``pw`` (B, n) sort z / w descending; a (B, 0) array means "already sorted". With m
    the block mean of the sorted cotangent gs = g[pz]: gz[pz] = gs - m and gw[pw] = m, each
    written only when that output has n columns. One pass over each row, no temporaries.
    """
    none = np.empty(0)
    _l2_vjp_rows(g, pz, pw, block, gz, gw, np.empty((1, 0), g.dtype), none, False, none)


@numba.njit(cache=True, nogil=True)
def l2_vjp_scaled(g, pz, pw, block, gz, gw, u, f, inv, gr):  # pragma: no cover - compiled
    """``l2_vjp`` for z = u * f (``inv``) or u / f (f: B, one per row; u: B or 1 rows, finite),
    and in the same pass gr[b] = sum_j (gs_j - m) (s_j - s_ref), s = z[pz] and s_ref the first
    entry of j's block: <J_z^T g, z> on the block-relative z (the derivative along z -> c z),
    formed as sum_j (gs_j - m) (u_j - u_ref), then scaled by f.
    """
    _l2_vjp_rows(g, pz, pw, block, gz, gw, u, f, inv, gr)
