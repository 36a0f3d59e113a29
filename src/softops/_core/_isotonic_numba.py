"""numba kernels for ``isotonic.py``: stack PAV, one row per ``prange`` iteration.

Imported lazily by ``isotonic.py`` (numba is optional and slow to import). ``cache=True`` keeps
the compiled machine code on disk, so only the first call in a fresh environment compiles (a few
seconds per dtype). Block statistics are accumulated in the float64 work arrays.
"""

from __future__ import annotations

import math

import numba

__all__ = ["pav_kl", "pav_l2"]


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
