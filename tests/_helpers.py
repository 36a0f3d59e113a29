"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import pytest
import torch


def seeded(seed: int = 0) -> torch.Generator:
    """A fresh CPU generator with a fixed seed."""
    return torch.Generator().manual_seed(seed)


def saved_bytes(fn) -> int:
    """Bytes of every tensor that ``fn()`` saves for backward, each save counted.

    A tensor saved by several nodes counts each time, which is what tests of "saves the same
    buffer once per round" need; :func:`softops.testing.count_saved_bytes` counts each storage
    once, which is what stays alive.
    """
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def hard_topk_mask(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True) -> torch.Tensor:
    """The hard operator that soft_topk_mask relaxes, written as in its docstring."""
    return torch.zeros_like(x).scatter(dim, x.topk(k, dim, largest).indices, 1)


def fd_gap(fn, x: torch.Tensor, h: float, g: torch.Generator) -> float:
    """Relative gap between autograd and a central difference of a random projection of fn."""
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    ct = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((out * ct).sum(), x)
    v = torch.randn(x.shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        xp, xm = x + h * v, x - h * v
        fd = ((fn(xp) - fn(xm)) * ct).sum() / (2 * h)
    # the step actually taken: x +- h v rounds, most where |x| is far above h
    step = (xp - xm) / (2 * h)
    scale = float((grad.abs() * step.abs()).sum()) + float(ct.abs().sum())
    return abs(float((grad * step).sum() - fd)) / scale


def exact_plan_derivative(
    x: torch.Tensor, m: int, eps: float, g0: torch.Tensor, ct: torch.Tensor, v: torch.Tensor
) -> float:
    """``d/dh <plan(x + h v), ct>`` at h = 0 in 80-digit arithmetic, for the entropic OT plan of
    the cost ``(x_i - j)^2`` (j = 0..m-1) between uniform marginals at ``eps``: semi-dual Newton
    (warm-started from the float64 column potentials ``g0``, cost units) to a marginal error of
    1e-60, then a central difference of step 1e-30.

    The reference where float64 central differences cannot resolve the plan: at a cost over
    epsilon of 1e9 float64 fixes the plan's exponents only to about 1e-7, which a step small
    enough for the plan's curvature amplifies past any tolerance.
    """
    import mpmath

    ctx = mpmath.mp.clone()
    ctx.dps = 80
    n = x.numel()
    a, b, e = ctx.mpf(1) / n, ctx.mpf(1) / m, ctx.mpf(eps)
    start = [ctx.mpf(t) / e for t in g0.tolist()]

    def plan(z: list) -> list:
        s = [[(z[i] - j) ** 2 / e for j in range(m)] for i in range(n)]
        w = list(start)

        def rows(w: list) -> tuple[list, list, object]:
            p = []
            for i in range(n):
                top = max(w[j] - s[i][j] for j in range(m))
                ex = [ctx.exp(w[j] - s[i][j] - top) for j in range(m)]
                total = ctx.fsum(ex)
                p.append([q / total for q in ex])
            c = [a * ctx.fsum(p[i][j] for i in range(n)) for j in range(m)]
            return p, c, ctx.fsum(abs(b - cj) for cj in c)

        p, c, err = rows(w)
        for _ in range(200):
            if err < ctx.mpf(10) ** -60:
                break
            # grounded K (the last column fixed), with a 1e-70 ridge: columns whose coupling
            # is below the working precision (a mass-balanced block) keep their warm start
            k = ctx.matrix(m - 1, m - 1)
            for j in range(m - 1):
                for q in range(m - 1):
                    k[j, q] = a * ctx.fsum(
                        p[i][j] * ((1 if j == q else 0) - p[i][q]) for i in range(n)
                    )
                k[j, j] += ctx.mpf(10) ** -70
            step = ctx.lu_solve(k, ctx.matrix([b - cj for cj in c[: m - 1]]))
            t = ctx.mpf(1)
            for _ in range(60):  # halve the step until the marginal error drops
                trial = [w[j] + t * step[j] for j in range(m - 1)] + [w[m - 1]]
                p2, c2, err2 = rows(trial)
                if err2 < err:
                    break
                t /= 2
            w, p, c, err = trial, p2, c2, err2
        else:  # pragma: no cover - the reference itself failed
            raise RuntimeError("exact_plan_derivative: Newton did not converge")
        return [[a * p[i][j] * b / c[j] for j in range(m)] for i in range(n)]

    h = ctx.mpf(10) ** -30
    xs, vs, cs = [ctx.mpf(t) for t in x.tolist()], v.tolist(), ct.tolist()
    up = plan([xs[i] + h * vs[i] for i in range(n)])
    down = plan([xs[i] - h * vs[i] for i in range(n)])
    total = ctx.fsum((up[i][j] - down[i][j]) * cs[i][j] for i in range(n) for j in range(m))
    return float(total / (2 * h))


def exact_threshold_grads(
    x: torch.Tensor, k: float, eps: float, g: torch.Tensor
) -> tuple[list[float], float, float]:
    """The gradients ``(d/dx, d/dk, d/deps)`` of ``<g, A>`` for one finite row of the "ot" mask
    ``A = sigmoid((x - t)/eps)``, ``sum A = k``, at the exact threshold, in 60-digit arithmetic.

    t is bisected (on the sign of the residual, formed without cancellation) to 1e-50; then ``s = A
    (1 - A)/eps``, ``w = s / sum s``, ``d/dx = s (g - <w, g>)``, ``d/dk = <w, g>`` and ``d/deps =
    -sum g s (z - <w, z>)``. The reference wherever float64 cannot resolve t as finely as the
    weights ``~ exp(-|z|)`` need (a tiny epsilon beside the gaps: the hard limit).
    """
    import mpmath

    ctx = mpmath.mp.clone()
    ctx.dps = 60
    xs = [ctx.mpf(v) for v in x.tolist()]
    gs = [ctx.mpf(v) for v in g.tolist()]
    e, kk = ctx.mpf(eps), ctx.mpf(k)

    def residual(t: object) -> object:
        # sum A - k as (count above t - k) + the sums of u = sigmoid(-|z|) below less above:
        # the count is exact, so its sign is right even where every u is below the precision
        above = [v > t for v in xs]
        u = [1 / (1 + ctx.exp(abs(v - t) / e)) for v in xs]
        signed = ctx.fsum(-q if up else q for q, up in zip(u, above, strict=True))
        return (sum(above) - kk) + signed

    lo, hi = min(xs) - 200 * e - 1, max(xs) + 200 * e + 1
    for _ in range(400):
        mid = (lo + hi) / 2
        if residual(mid) > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < ctx.mpf(10) ** -50 * (1 + abs(hi)):
            break
    t = (lo + hi) / 2
    z = [(v - t) / e for v in xs]
    s = [1 / (e * (2 + ctx.exp(q) + ctx.exp(-q))) for q in z]  # A (1 - A) / eps, no cancellation
    total = ctx.fsum(s)
    w = [q / total for q in s]
    wg = ctx.fsum(wi * gi for wi, gi in zip(w, gs, strict=True))
    wz = ctx.fsum(wi * zi for wi, zi in zip(w, z, strict=True))
    dx = [float(si * (gi - wg)) for si, gi in zip(s, gs, strict=True)]
    de = -ctx.fsum(gi * si * (zi - wz) for gi, si, zi in zip(gs, s, z, strict=True))
    return dx, float(wg), float(de)


def built_ops(kernel: Any) -> Any:
    """The operators of a C++ kernel (``softops._kernels.Kernel``: ``torch.ops.<name>``).

    Skips the calling test where the kernel is not built; under ``SOFTOPS_REQUIRE_KERNELS=1`` (CI,
    where ``scripts/setup.sh`` builds them) that is a failure instead.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the not-built warning: said below)
        built = kernel.ops()
    if built is None:
        message = f"the C++ kernel {kernel.name} is not built (python -m softops._kernels)"
        if os.environ.get("SOFTOPS_REQUIRE_KERNELS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return built


def pav_decreasing(y: list[float]) -> tuple[list[float], list[int]]:
    """Decreasing L2 isotonic regression of one row by a plain stack PAV (a reference that shares
    nothing with the package): the fit and the block id of each position, from 0."""
    sums: list[float] = []
    counts: list[int] = []
    for x in y:
        sums.append(x)
        counts.append(1)
        while len(sums) > 1 and sums[-2] * counts[-1] <= sums[-1] * counts[-2]:
            total, count = sums.pop(), counts.pop()
            sums[-1] += total
            counts[-1] += count
    fit: list[float] = []
    block: list[int] = []
    for k, (total, count) in enumerate(zip(sums, counts, strict=True)):
        fit += [total / count] * count
        block += [k] * count
    return fit, block


class Projection(NamedTuple):
    """:func:`project`'s result: p (B, n), the block ids (B, n) and whether every row was finite."""

    p: torch.Tensor
    block: torch.Tensor
    finite: bool


def project(s: torch.Tensor, w: torch.Tensor, kl: bool = False) -> Projection:
    """The projection ``P(s, w) = s - v(s, w)`` (``kl``: P_E, else P_Q) of rows s and w sorted
    descending, (B, n) or (1, n), as the sort ops run it: ``isotonic.permutahedron`` with z = s / 1
    (eps = 1: the gaps of s exactly) and no sort, on the back end in use."""
    from softops._core import isotonic

    rows = w.shape[0] if s.shape[0] == 1 else s.shape[0]
    mode = isotonic.MODE_KL if kl else 0
    p, _, _, block, finite = isotonic.permutahedron(s, w.to(s.dtype), s.new_ones(rows), mode)
    return Projection(p, block, finite)


def project_op(s: torch.Tensor, w: torch.Tensor, kl: bool = False) -> Any:
    """:func:`project` as a call of the operator ``isotonic.PERMUTAHEDRON_OP`` itself (no meta or
    empty-row shortcut, no detach): ``(p, block, bad)``, bad the number of rows that held a
    non-finite entry (a 0-dim int64 tensor)."""
    from softops._core import isotonic

    rows = w.shape[0] if s.shape[0] == 1 else s.shape[0]
    mode = isotonic.MODE_KL if kl else 0
    p, _, _, block, bad = isotonic.PERMUTAHEDRON_OP(s, w, s.new_ones(rows), mode)
    return p, block, bad


def mask_at_threshold(x: torch.Tensor, state: Any, eps: torch.Tensor) -> torch.Tensor:
    """``sigmoid(((x - m) - t) / eps)`` at a threshold solve's ``state`` (``topk._ot.solve``) of
    finite rows, on ``(x c, eps c)`` where the solve was scaled by ``state.scale``."""
    c = 1.0 if state.scale is None else state.scale[:, None]
    return torch.sigmoid(((x * c - state.m[:, None]) - state.t[:, None]) / (eps[:, None] * c))
