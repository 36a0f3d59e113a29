"""numba kernel for ``_ot.py``: the threshold solve of method "ot", row by row, for small problems.

Imported lazily by ``_ot.py`` (numba is optional and slow to import); ``cache=True`` keeps the
machine code on disk, so only the first call in a fresh environment compiles (a few seconds).
The arithmetic is that of the torch code it replaces (``_prepare_exact``, ``_evaluate`` and the
update of :mod:`softops._core.rootfind`), in float64, each row on its own: a row of a thousand
entries costs a few microseconds per evaluation here, against a few hundred tensor operations
of a few microseconds each for the batched torch code, which is what a small call (one row, a
ranking loss's batch) pays. Only regular rows are solved: every entry finite, 0 < k < n,
epsilon within the scaling limit, converged within the cap and not near the hard limit; every
other row is flagged and solved by the torch code, which handles them all.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["threshold_rows"]

_EM = np.finfo(np.float64).eps
_BIG = np.finfo(np.float64).max
_NEAR_HARD = 32 * math.sqrt(np.finfo(np.float64).eps)


@numba.njit(cache=True, nogil=True)
def threshold_rows(x, k, eps, tol, limit, max_iter, A, s, out):  # pragma: no cover - compiled
    """Solve ``sum_i sigmoid((x_i - m - t)/eps_b) = k_b`` for every row b of ``x`` (B, n).

    ``k``, ``eps`` (B,) (any float dtype: the arithmetic is float64); ``tol`` the caller's extra
    tolerance on ``|F|``,
    ``limit`` the scaling limit of the caller's dtype (rows with a larger epsilon are flagged),
    ``max_iter`` the cap on evaluations. Writes, on the rows it solves, the mask into ``A`` and
    ``s = A (1 - A)/eps`` into ``s`` (B, n), and into ``out`` (B, 6): the centre m, the
    threshold t (less m), the backward's denominator ``sum s`` (``inf`` where 0), the
    residual, the evaluations, and a status, 0 where the row was solved and 1 where it is
    left to the torch code (whose other columns are 0 and whose A and s are not defined).
    """
    B, n = x.shape
    for b in range(B):
        out[b, :] = 0.0
        out[b, 5] = 1.0
        kb, e = np.float64(k[b]), np.float64(eps[b])
        if not (kb > 0.0 and kb < n and e > 0.0 and e <= limit):
            continue
        row = x[b]
        total = 0.0
        regular = True
        for i in range(n):
            v = row[i]
            if not (v - v == 0.0):  # inf or NaN
                regular = False
                break
            total += v
        if not regular:
            continue
        srt = np.sort(row)
        j_hi = max(math.ceil(kb), 1.0)
        j_lo = max(min(math.floor(kb) + 1.0, float(n)), 1.0)
        x_hi = srt[n - int(j_hi)]
        x_lo = srt[n - int(j_lo)]
        m = 0.5 * x_hi + 0.5 * x_lo
        lo = (x_lo - m) - e * (math.log(kb) - math.log(j_lo - kb))
        hi = (x_hi - m) - e * (math.log(kb - (j_hi - 1.0)) - math.log(n - kb))
        pad = 4 * _EM * (abs(lo) + abs(hi) + e)
        lo, hi = max(lo - pad, -_BIG), min(hi + pad, _BIG)
        t = 0.0
        if 8 * e >= srt[n - 1] - srt[0]:  # the large-epsilon start
            t = total / n - m - e * (math.log(kb) - math.log(n - kb))
        t = min(max(t, lo), hi)
        f_lo, f_hi, side = n - kb, -kb, 0.0
        inv = 1.0 / e
        floor = min(max(min(kb, n - kb), 0.0), 1.0)
        done = False
        evaluations = 0
        F = d_sum = 0.0
        while evaluations < max_iter:
            # the evaluation (``_evaluate``): the residual split by sign, no cancellation
            signed = u_sum = d_sum = c_signed = 0.0
            count = 0
            for i in range(n):
                z = ((row[i] - m) - t) * inv
                u = 1.0 / (1.0 + math.exp(abs(z)))
                d = u * (1.0 - u)
                c = (1.0 - 2.0 * u) * d
                if z > 0:
                    count += 1
                    signed -= u
                    c_signed -= c
                    A[b, i] = 1.0 - u
                else:
                    signed += u
                    c_signed += c
                    A[b, i] = u
                s[b, i] = d * inv
                u_sum += u
                d_sum += d
            evaluations += 1
            F = signed + (count - kb)
            slope = d_sum / e
            bound = 32 * _EM * max(u_sum, floor) + 2 * _EM * slope * abs(t) + n / _BIG + tol
            # the update (``rootfind._update``)
            done = abs(F) <= bound
            up, down = F > 0, F < 0
            if up and side > 0:
                f_hi *= 0.5
            if down and side < 0:
                f_lo *= 0.5
            if up:
                lo, f_lo = t, F
            if down:
                hi, f_hi = t, F
            side = 1.0 if up else (-1.0 if down else 0.0)
            newton = F / -slope if slope > 0 else math.nan
            if d_sum > 0:
                L = newton * (-c_signed / d_sum / e)
                if abs(L) <= 1:
                    newton = newton / (1 - 0.5 * L)
            step = t - newton
            if not (step >= lo and step <= hi):
                secant = lo + (hi - lo) * (f_lo / (f_lo - f_hi))
                step = secant if (secant > lo and secant < hi) else 0.5 * (lo + hi)
            width = hi - lo
            collapsed = width <= 4 * _EM * max(abs(lo), abs(hi)) or np.nextafter(lo, hi) >= hi
            done = done or step == t or collapsed
            if done:
                break
            t = step
        if not done or d_sum < _NEAR_HARD:  # capped, or near the hard limit: the torch code
            continue
        out[b, 0] = m
        out[b, 1] = t
        out[b, 2] = d_sum / e if d_sum > 0 else math.inf
        out[b, 3] = F
        out[b, 4] = evaluations
        out[b, 5] = 0.0
