"""The sorted top-k's Newton-first solve (softops.topk._newton) against the generic Sinkhorn
solve of softops._core.sinkhorn, its fallback to it, and the independence of its rows."""

from __future__ import annotations

import math

import pytest
import torch

from softops._core.sinkhorn import log_sinkhorn
from softops.topk import _newton
from tests._helpers import seeded

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(bsz: int, n: int, m: int, seed: int = 0, dtype: torch.dtype = F64):
    g = seeded(seed)
    cost = torch.randn(bsz, n, m, generator=g, dtype=dtype)
    log_a = torch.log_softmax(torch.randn(bsz, n, generator=g, dtype=dtype), -1)
    log_b = torch.log_softmax(torch.randn(bsz, m, generator=g, dtype=dtype), -1)
    eps = 0.3 + torch.rand(bsz, generator=g, dtype=dtype)
    return cost, log_a, log_b, eps


def _solve(cost, log_a, log_b, eps, max_iter=100_000, tol=1e-12, potentials=True):
    return _newton.newton_first(cost, log_a, log_b, eps, max_iter, tol, potentials)[0]


@pytest.mark.parametrize("m", [2, 3, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_newton_first_equals_the_generic_solve(m: int, dtype: torch.dtype) -> None:
    """Both solve the same problem to tol: the plans and f_i + g_j agree."""
    cost, log_a, log_b, eps = _problem(5, 23, m, seed=10 + m, dtype=dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    ref = log_sinkhorn(cost, log_a, log_b, eps, max_iter=100_000, tol=tol, newton=True)
    res = _solve(cost, log_a, log_b, eps, tol=tol)
    assert bool(res.converged.all())
    assert res.plan.shape == ref.plan.shape
    atol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(res.plan.to(dtype), ref.plan, atol=atol, rtol=0)
    torch.testing.assert_close(
        (res.f[:, :, None] + res.g[:, None, :]).to(dtype),
        ref.f[:, :, None] + ref.g[:, None, :],
        atol=atol * 100,
        rtol=atol * 100,
    )


def test_newton_first_falls_back_to_the_generic_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows Newton leaves above tol (here: no Newton steps at all) are solved from the start by
    the generic solver, within the rest of max_iter; NaN rows stay NaN and do not fall back."""
    cost, log_a, log_b, eps = _problem(4, 15, 3, seed=3)
    cost[1, 2, 0] = math.nan
    monkeypatch.setattr(_newton, "NEWTON_FIRST_STEPS", 0)
    res = _solve(cost, log_a, log_b, eps)
    ref = log_sinkhorn(cost, log_a, log_b, eps, max_iter=100_000, tol=1e-12, newton=True)
    keep = [0, 2, 3]
    assert bool(res.converged[keep].all()) and not bool(res.converged[1])
    assert bool(res.plan[1].isnan().all())
    torch.testing.assert_close(res.plan[keep], ref.plan[keep], atol=1e-11, rtol=0)


def test_newton_first_rows_are_independent() -> None:
    """A row's result does not depend on the other rows (bit for bit), also when another row
    takes more steps or falls back."""
    cost, log_a, log_b, eps = _problem(4, 12, 3, seed=4)
    res = _solve(cost, log_a, log_b, eps)
    cost2, eps2 = cost.clone(), eps.clone()
    cost2[1] *= 40.0  # a far harder row
    eps2[3] = 1e-3
    res2 = _solve(cost2, log_a, log_b, eps2)
    torch.testing.assert_close(res2.plan[[0, 2]], res.plan[[0, 2]], atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["normal", "logprob"])
@pytest.mark.parametrize("eps", [1e-3, 0.03, 0.1, 0.3, 1.0, 10.0])
def test_sorted_topk_beam_point_needs_no_fallback(
    kind: str, eps: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the beam-search point (B=64, n=18, k=2, float32) Newton from the centred start
    finishes every row in a few steps: the slow generic solve is never taken (the speed of
    soft_topk there rests on it)."""
    from softops import soft_topk

    def no_fallback(*args: object, **kwargs: object) -> None:
        raise AssertionError("newton_first fell back to the generic solve")

    monkeypatch.setattr(_newton, "_fallback", no_fallback)
    x = torch.randn(64, 18, generator=seeded(int(eps * 1000) + len(kind)))
    if kind == "logprob":
        x = torch.log_softmax(3.0 * x, -1)
    out = soft_topk(x, 2, epsilon=eps)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(64, 2), atol=1e-5, rtol=0)


@pytest.mark.parametrize("potentials", [True, False])
def test_newton_first_without_potentials_gives_the_same_plan(potentials: bool) -> None:
    """``potentials=False`` leaves f and g empty (B, 0) and changes nothing else."""
    cost, log_a, log_b, eps = _problem(5, 13, 3, seed=21)
    ref = _solve(cost, log_a, log_b, eps, max_iter=1000)
    res = _solve(cost, log_a, log_b, eps, max_iter=1000, potentials=potentials)
    torch.testing.assert_close(res.plan, ref.plan, atol=0, rtol=0)
    assert res.f.shape == ((5, 13) if potentials else (5, 0))
    assert res.g.shape == ((5, 3) if potentials else (5, 0))


def test_newton_first_says_when_every_row_converged() -> None:
    """``clean`` is True where every row converged without the fallback (the sorted top-k's
    centred cost, where v = 0 is the hard assignment), False where a row did not."""
    g = seeded(41)
    x = torch.randn(5, 7, generator=g, dtype=F64)
    low = x.sort(-1).values[:, :3]
    beta = 0.5 * (low[:, :-1] + low[:, 1:])
    j = torch.arange(3, dtype=F64)
    kappa = torch.nn.functional.pad(beta.cumsum(-1), (1, 0))  # (5, 3)
    cost = -(j * x.unsqueeze(-1)) + kappa.unsqueeze(1)  # (5, 7, 3)
    log_a = torch.full((5, 7), -math.log(7), dtype=F64)
    log_b = torch.log(torch.tensor([[1 / 7, 1 / 7, 5 / 7]] * 5, dtype=F64))
    eps = torch.full((5,), 0.5, dtype=F64)
    res, clean = _newton.newton_first(cost, log_a, log_b, eps, 2000, 1e-9)
    assert clean is True and bool(res.converged.all())
    ref = log_sinkhorn(cost, log_a, log_b, eps, max_iter=2000, tol=1e-12, newton=True)
    torch.testing.assert_close(res.plan, ref.plan, rtol=0, atol=1e-8)
    rough = torch.randn(5, 7, 3, generator=g, dtype=F64) * 30
    res2, clean2 = _newton.newton_first(rough, log_a, log_b, eps * 0.01, 2, 1e-14)
    assert clean2 is False and not bool(res2.converged.all())
