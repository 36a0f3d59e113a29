"""An independent float64 reference for the gradients in k and epsilon of method "ot" at the
exact root, for rows where the single-process solver's tolerance leaves t uncertain.

Where every ``u_i = sigmoid(-|x_i - t| / eps)`` is tiny and the count above t is k, ``F(t) =
sum sigmoid((x - t)/eps) - k`` is below its tolerance over much of the gap between the k-th and
(k+1)-th entries (all of it once ``|z|`` overflows), and the weights ``w ~ s ~ exp(-|z|)`` of
the gradients in k and epsilon depend on where in the gap t lands. Here t is found by 200
bisections on the sign of F, taken in the log domain where the count above t is k (``F = U_b -
U_a``, the signs of ``log U_b - log U_a``), and the gradients are then the implicit ones,

    w = softmax(log s),  d/dk = <w, g>,  d/deps = -sum g s (z - <w, z>).
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def _sign(x: torch.Tensor, t: float, k: float, eps: float) -> float:
    off = x - t
    above = off > 0
    count = int(above.sum())
    if count != k:
        u = torch.sigmoid(-(off.abs() / eps))
        return float((count - k) + torch.where(above, -u, u).sum())
    log_u = -(off.abs() / eps) - torch.nn.functional.softplus(-(off.abs() / eps))
    below = torch.logsumexp(torch.where(above, -math.inf, log_u), -1)
    over = torch.logsumexp(torch.where(above, log_u, -math.inf), -1)
    return float(below - over)


def root(x: torch.Tensor, k: float, eps: float) -> float:
    """The threshold of one row without NaN whose k its finite entries can meet, to the last
    bits of float64 (``+inf`` entries count as selected, ``-inf`` as not)."""
    finite = x[torch.isfinite(x)]
    kk = k - float((x == math.inf).sum())
    logit = math.log(kk) - math.log(len(finite) - kk)
    lo = float(finite.min()) - eps * logit - abs(float(finite.min())) * 1e-15 - 1.0
    hi = float(finite.max()) - eps * logit + abs(float(finite.max())) * 1e-15 + 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _sign(x, mid, k, eps) > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def row_grads(x: torch.Tensor, k: float, eps: float, g: torch.Tensor) -> tuple[float, float]:
    """``(d<g, A>/dk, d<g, A>/deps)`` of one finite row at its exact threshold."""
    x, g = x.to(F64), g.to(F64)
    t = root(x, k, eps)
    off = x - t
    a = off.abs()
    log_s = -(a / eps) - 2 * torch.nn.functional.softplus(-(a / eps)) - math.log(eps)
    w = torch.softmax(log_s, -1)
    s = torch.exp(log_s)
    live = s > 0
    mean = float((w * torch.where(w > 0, off, 0)).sum())
    cz = torch.where(live, (torch.where(live, off, 0) - mean) / eps, 0)
    return float((w * g).sum()), float(-(g * s * cz).sum())


def solvable(x: torch.Tensor, k: float) -> bool:
    """Whether a row has a finite threshold: no NaN, and 0 < k - #(+inf) < #finite."""
    if bool(torch.isnan(x).any()):
        return False
    kk = k - float((x == math.inf).sum())
    return 0 < kk < float(torch.isfinite(x).sum())
