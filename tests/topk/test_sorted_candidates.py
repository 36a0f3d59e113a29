"""The candidate set of the sorted SOFT top-k (docs/math.md §2.4): the bound it rests on, the
candidate-set solve against the full solve (``_soft_topk(..., reduce=False)``) across shapes,
epsilons, ties and near-hard rows, its gradients, and the paths that share it (the C++ kernel,
the torch solve, the rows the kernel hands back)."""

from __future__ import annotations

import math

import pytest
import torch

from softops.topk import _sorted
from softops.topk._sorted import _soft_topk
from tests._helpers import seeded

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")

TIGHT = {"tol": 1e-13, "max_iter": 100_000}


def _gaps(x: torch.Tensor, k: int, eps: float, largest: bool = True) -> torch.Tensor:
    """g_i = (y_[k+1] - y_i) / eps, y the scores in the selection's orientation."""
    y = x if largest else -x
    yk = torch.topk(y, k + 1, dim=-1).values[..., k:]
    return (yk - y) / eps


def _support(weights: torch.Tensor) -> torch.Tensor:
    """The entries with a nonzero weight on some target (the candidates), per row."""
    return (weights.abs().sum(-2) > 0).sum(-1)


@pytest.fixture
def loose_tau(monkeypatch):
    """A large float64 tolerance, so that the candidate set drops many entries and its own error
    (not the solver's) is what the comparison sees."""

    def set_tau(tau: float) -> float:
        monkeypatch.setattr(_sorted, "_TAU_64", tau)
        return tau

    return set_tau


# --------------------------------------------------------------------------- the bound


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize(
    ("n", "k", "eps", "kind"),
    [
        (40, 1, 0.1, "normal"),
        (60, 3, 0.05, "normal"),
        (80, 8, 0.2, "normal"),
        (50, 5, 1.0, "normal"),
        (30, 4, 0.3, "ties"),
        (100, 8, 0.02, "logprob"),
        (25, 12, 0.5, "normal"),
    ],
)
def test_lemma_2_bounds_the_weights_of_the_full_solve(n, k, eps, kind, largest) -> None:
    g = seeded(n + k)
    x = torch.randn(6, n, generator=g, dtype=F64)
    if kind == "ties":
        x = (x * 2).round() / 2
    elif kind == "logprob":
        x = torch.log_softmax(3 * x, -1)
    w = _soft_topk(x, k, epsilon=eps, largest=largest, reduce=False, **TIGHT).weights
    gap = _gaps(x, k, eps, largest)
    below = gap > 0
    total = w.sum(-2)  # sum over the first k targets
    # sum_j e^{-(k-j) g} = -expm1(-k g) / expm1(g) <= 1 / expm1(g): no factor k (each column's
    # mass bounds its ratio)
    g_pos = gap.clamp(min=1e-300)
    bound = -torch.expm1(-k * g_pos) / torch.expm1(g_pos)
    assert bool((total[below] <= bound[below] * (1 + 1e-9) + 1e-15).all())
    for j in range(k):
        per = torch.exp(-(k - j) * gap)
        assert bool((w[:, j][below] <= per[below] * (1 + 1e-9) + 1e-15).all())


def test_lemma_2_is_nearly_attained_at_a_tie() -> None:
    # k + 1 tied scores share the first k targets: the tied entries' ratio to the rest is 1, so
    # an entry g below them carries close to e^{-g} on the k-th target (the bound is sharp)
    k, eps = 4, 0.1
    x = torch.full((1, 40), -5.0, dtype=F64)
    x[0, : k + 1] = 1.0
    x[0, k + 1] = 1.0 - 0.5  # g = 5
    w = _soft_topk(x, k, epsilon=eps, reduce=False, **TIGHT).weights
    g = 0.5 / eps
    assert 0.5 * math.exp(-g) <= float(w[0, k - 1, k + 1]) <= math.exp(-g) * (1 + 1e-9)


# --------------------------------------------------------------------------- against the full solve


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("tau", [1e-4, 1e-7, 1e-10])
@pytest.mark.parametrize(
    ("n", "k", "eps"),
    [(200, 1, 0.1), (300, 3, 0.05), (500, 8, 0.1), (2000, 8, 0.2), (400, 16, 0.1), (150, 2, 0.01)],
)
def test_candidate_set_is_within_tau_of_the_full_solve(loose_tau, n, k, eps, tau, largest) -> None:
    tau = loose_tau(tau)
    x = torch.randn(4, n, generator=seeded(n + k), dtype=F64)
    out = _soft_topk(x, k, epsilon=eps, largest=largest, **TIGHT)
    ref = _soft_topk(x, k, epsilon=eps, largest=largest, reduce=False, **TIGHT)
    assert bool((_support(out.weights) < n).all())  # entries were dropped
    err = (out.weights - ref.weights).abs()
    assert float(err.max()) <= tau + 1e-12
    assert float(err.sum((-2, -1)).max()) <= (2 * k + 1) * tau + 1e-10
    # each target's weights still sum to 1, and the values follow the weights
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(4, k, dtype=F64), atol=1e-12, rtol=0)
    span = float((x.max() - x.min()).abs())
    torch.testing.assert_close(
        out.values, ref.values, atol=(2 * k + 1) * tau * span + 1e-10, rtol=0
    )


@pytest.mark.parametrize(
    ("n", "k", "eps"),
    [(1000, 8, 0.1), (3000, 3, 0.05), (500, 1, 0.01), (200, 5, 0.003)],
)
@pytest.mark.parametrize("largest", [True, False])
def test_default_tolerance_float64(n, k, eps, largest) -> None:
    x = torch.randn(3, n, generator=seeded(n), dtype=F64)
    out = _soft_topk(x, k, epsilon=eps, largest=largest, **TIGHT)
    ref = _soft_topk(x, k, epsilon=eps, largest=largest, reduce=False, **TIGHT)
    # tau = 1e-14 is below the solvers' own error: the two agree to the solvers
    torch.testing.assert_close(out.weights, ref.weights, atol=1e-11, rtol=0)
    torch.testing.assert_close(out.values, ref.values, atol=1e-11, rtol=0)


@pytest.mark.parametrize("n", [100, 2000])
def test_float32_against_the_full_float64_solve(n) -> None:
    x = torch.randn(4, n, generator=seeded(n + 1))
    out = _soft_topk(x, 8, epsilon=0.1)
    ref = _soft_topk(x.double(), 8, epsilon=0.1, reduce=False, **TIGHT)
    # float32's own solve (tol 1e-6, relative L1 over the row) dominates tau = 1e-7
    torch.testing.assert_close(out.weights.double(), ref.weights, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.values.double(), ref.values, atol=2e-5, rtol=0)


@pytest.mark.parametrize("eps", [3.0, 30.0, 1e4])
def test_a_large_epsilon_keeps_the_whole_row(eps) -> None:
    x = torch.randn(3, 300, generator=seeded(4), dtype=F64)
    out = _soft_topk(x, 5, epsilon=eps, **TIGHT)
    ref = _soft_topk(x, 5, epsilon=eps, reduce=False, **TIGHT)
    assert bool((_support(out.weights) == 300).all())
    torch.testing.assert_close(out.weights, ref.weights, atol=1e-13, rtol=0)


def test_epsilon_sweep_from_far_below_to_far_above_the_gaps(loose_tau) -> None:
    tau = loose_tau(1e-8)
    x = torch.randn(2, 400, generator=seeded(5), dtype=F64)
    sizes = []
    for eps in [1e-4, 1e-3, 0.01, 0.1, 0.5, 2.0, 20.0]:
        out = _soft_topk(x, 4, epsilon=eps, **TIGHT)
        ref = _soft_topk(x, 4, epsilon=eps, reduce=False, **TIGHT)
        assert float((out.weights - ref.weights).abs().max()) <= tau + 1e-12, eps
        sizes.append(int(_support(out.weights).max()))
    assert sizes == sorted(sizes)  # the candidate set grows with epsilon
    assert sizes[-1] == 400


@pytest.mark.parametrize("eps", [1e-4, 0.01, 0.3])
def test_ties_and_near_hard_rows(loose_tau, eps) -> None:
    tau = loose_tau(1e-9)
    g = seeded(6)
    x = torch.randint(-6, 7, (5, 200), generator=g).to(F64) / 2  # many ties, at the boundary too
    x[0, :10] = 3.0  # k-th and (k+1)-th tied
    out = _soft_topk(x, 6, epsilon=eps, **TIGHT)
    ref = _soft_topk(x, 6, epsilon=eps, reduce=False, **TIGHT)
    assert float((out.weights - ref.weights).abs().max()) <= tau + 1e-11
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(5, 6, dtype=F64), atol=1e-11, rtol=0)


def test_the_candidates_are_the_entries_near_the_boundary() -> None:
    x = torch.tensor([[5.0, 4.0, 3.0, 2.9, 2.5, -3.0, -8.0, -20.0, 1.0, 0.0]], dtype=F64)
    out = _soft_topk(x, 3, epsilon=0.1)
    support = (out.weights.abs().sum(-2) > 0)[0]
    gaps = _gaps(x, 3, 0.1)[0]
    # every entry within log(1 / tau) of the (k+1)-th is kept (its bin's bound alone is above
    # tau), every one beyond log(1 + 2n / tau) dropped (the last bin)
    assert bool(support[gaps <= math.log(1 / 1e-14)].all())
    assert not bool(support[gaps > math.log1p(2 * 10 / 1e-14) + 1].any())
    assert bool(support[:5].all()) and not bool(support[5:8].any())


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize(("n", "k", "eps"), [(300, 8, 0.1), (500, 2, 0.05), (200, 12, 0.3)])
def test_gradients_equal_the_full_solves(n, k, eps, largest) -> None:
    g = seeded(n + k + 1)
    x = torch.randn(3, n, generator=g, dtype=F64, requires_grad=True)
    e = torch.tensor([eps, 2 * eps, eps / 2], dtype=F64, requires_grad=True)
    gv = torch.randn(3, k, generator=g, dtype=F64)
    gw = torch.randn(3, k, n, generator=g, dtype=F64)
    grads = []
    for reduce in (True, False):
        out = _soft_topk(x, k, epsilon=e, largest=largest, reduce=reduce, **TIGHT)
        loss = (out.values * gv).sum() + (out.weights * gw).sum()
        grads.append(torch.autograd.grad(loss, (x, e)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def _far_row(dtype=F64) -> torch.Tensor:
    """Rows whose last entries lie far below the top (dropped from the candidate set)."""
    x = torch.tensor(
        [
            [2.0, 1.5, 1.2, 0.9, 0.8, -9.0, -10.0, -12.0, 0.3],
            [0.1, 0.7, -0.2, 1.1, -15.0, 0.4, -30.0, 0.0, 0.5],
        ],
        dtype=dtype,
    )
    return x


@pytest.mark.parametrize("k", [1, 2, 4])
def test_gradcheck_through_the_candidate_set(k) -> None:
    x = _far_row().requires_grad_()
    e = torch.tensor([0.3, 0.5], dtype=F64, requires_grad=True)

    def fn(t, eps):
        out = _soft_topk(t, k, epsilon=eps, tol=1e-14, max_iter=100_000)
        return out.values, out.weights

    w = fn(x, e)[1]
    assert bool((_support(w) < 9).all())  # the far entries are dropped
    assert torch.autograd.gradcheck(fn, (x, e), atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradgradcheck(fn, (x, e), atol=1e-6, rtol=1e-4)


def test_forward_mode_through_the_candidate_set() -> None:
    x = _far_row().requires_grad_()

    def fn(t):
        return _soft_topk(t, 2, epsilon=0.4, tol=1e-14, max_iter=100_000).values

    assert torch.autograd.gradcheck(fn, (x,), check_forward_ad=True, check_backward_ad=False)


def test_entries_outside_the_candidate_set_get_no_weight_and_no_gradient() -> None:
    x = _far_row().requires_grad_()
    out = _soft_topk(x, 2, epsilon=0.3)
    (grad,) = torch.autograd.grad(out.values.sum() + out.weights.pow(2).sum(), x)
    far = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    assert float(out.weights.detach().abs().sum(-2)[far].max()) == 0.0
    assert float(grad[far].abs().max()) == 0.0
    assert bool((grad[~far] != 0).any())


# --------------------------------------------------------------------------- the paths


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("largest", [True, False])
def test_the_kernel_and_the_torch_solve_agree(dtype, largest) -> None:
    g = seeded(7)
    x = torch.randn(6, 700, generator=g, dtype=dtype, requires_grad=True)
    gv = torch.randn(6, 8, generator=g, dtype=dtype)
    res = []
    for kernel in (True, False):
        out = _soft_topk(x, 8, epsilon=0.1, largest=largest, kernel=kernel)
        res.append((out.values, out.weights, *torch.autograd.grad((out.values * gv).sum(), x)))
    tol = 1e-9 if dtype == F64 else 1e-4
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_rows_the_kernel_leaves_take_the_torch_solve(monkeypatch) -> None:
    x = torch.randn(4, 300, generator=seeded(8), dtype=F64, requires_grad=True)
    ref = _soft_topk(x, 5, epsilon=0.1, kernel=False, **TIGHT)
    (g_ref,) = torch.autograd.grad(ref.values.sum(), x)
    monkeypatch.setattr(_sorted, "_KERNEL_STEPS", 0)  # no Newton step: every row is left over
    out = _soft_topk(x, 5, epsilon=0.1, **TIGHT)
    (g_out,) = torch.autograd.grad(out.values.sum(), x)
    torch.testing.assert_close(out.weights, ref.weights, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_out, g_ref, atol=1e-10, rtol=0)


def test_a_singular_row_is_redone_in_torch() -> None:
    # a column with no coupling left (epsilon far below the gaps): the kernel's VJP is not safe
    x = torch.tensor([[40.0, 20.0, 0.0, -20.0, 1.0], [0.3, -0.1, 0.8, 0.5, 0.0]], dtype=F64)
    x.requires_grad_()
    eps = torch.tensor([0.02, 0.3], dtype=F64)
    out = _soft_topk(x, 2, epsilon=eps)
    ref = _soft_topk(x, 2, epsilon=eps, reduce=False)
    (g1,) = torch.autograd.grad(out.values.sum() + out.weights[..., 0].sum(), x)
    (g2,) = torch.autograd.grad(ref.values.sum() + ref.weights[..., 0].sum(), x)
    torch.testing.assert_close(g1, g2, atol=1e-10, rtol=1e-8)
    assert bool(torch.isfinite(g1).all())


def test_rows_with_infinities_or_nan_beside_finite_rows() -> None:
    x = torch.randn(4, 50, generator=seeded(9), dtype=F64)
    mixed = x.clone()
    mixed[1, 3] = math.inf
    mixed[2, 7] = math.nan
    mixed[3, :40] = -math.inf
    out = _soft_topk(mixed, 3, epsilon=0.2)
    alone = _soft_topk(x[:1], 3, epsilon=0.2)
    torch.testing.assert_close(out.weights[:1], alone.weights, atol=0, rtol=0)
    full = _soft_topk(mixed[1:], 3, epsilon=0.2, reduce=False)
    torch.testing.assert_close(out.values[1:], full.values, atol=0, rtol=0, equal_nan=True)
    assert float(out.values[1, 0]) == math.inf and bool(out.values[2].isnan().all())


def test_double_backward_recomputes_in_torch() -> None:
    x = torch.randn(2, 60, generator=seeded(10), dtype=F64, requires_grad=True)
    w = torch.linspace(-1.0, 1.0, 4, dtype=F64)
    hv = []
    for reduce in (True, False):
        out = _soft_topk(x, 4, epsilon=0.2, reduce=reduce, **TIGHT)
        (g,) = torch.autograd.grad((out.values * w).sum(), x, create_graph=True)
        (h,) = torch.autograd.grad((g * torch.arange(60.0, dtype=F64)).sum(), x)
        hv.append(h)
    torch.testing.assert_close(hv[0], hv[1], atol=1e-8, rtol=1e-8)
