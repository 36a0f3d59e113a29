"""softops.testing: the unrolled Sinkhorn references, the saved-bytes count and the back ends."""

from __future__ import annotations

import math

import pytest
import torch

import softops
from softops.testing import (
    UnrolledSinkhorn,
    backend,
    count_saved_bytes,
    kernels_enabled,
    paper_sinkhorn_topk_mask,
    unrolled_ot_sort,
    unrolled_sinkhorn,
    unrolled_sinkhorn_topk_mask,
    unrolled_sorted_topk,
)
from tests._helpers import seeded

F64 = torch.float64


def _problem(batch: int, n: int, m: int, seed: int = 0):
    g = seeded(seed)
    cost = torch.rand(batch, n, m, generator=g, dtype=F64)
    log_a = torch.log_softmax(torch.randn(batch, n, generator=g, dtype=F64), -1)
    log_b = torch.log_softmax(torch.randn(batch, m, generator=g, dtype=F64), -1)
    eps = 0.2 + torch.rand(batch, generator=g, dtype=F64)
    return cost, log_a, log_b, eps


def test_unrolled_sinkhorn_converges_to_the_marginals() -> None:
    cost, log_a, log_b, eps = _problem(3, 9, 4)
    res = unrolled_sinkhorn(cost, log_a, log_b, eps, 2000)
    assert isinstance(res, UnrolledSinkhorn)
    plan, f, g = res  # unpacks as a tuple
    assert plan.shape == (3, 9, 4) and f.shape == (3, 9) and g.shape == (3, 4)
    torch.testing.assert_close(plan.sum(-1), log_a.exp(), atol=1e-12, rtol=0)
    torch.testing.assert_close(plan.sum(-2), log_b.exp(), atol=1e-14, rtol=0)
    expected = torch.exp((f[..., None] + g[..., None, :] - cost) / eps[:, None, None])
    torch.testing.assert_close(plan, expected, atol=0, rtol=0)


def test_unrolled_sinkhorn_columns_are_exact_after_any_iteration() -> None:
    cost, log_a, log_b, eps = _problem(2, 7, 3, seed=1)
    for n_iter in (1, 2, 5):
        plan = unrolled_sinkhorn(cost, log_a, log_b, eps, n_iter).plan
        torch.testing.assert_close(plan.sum(-2), log_b.exp(), atol=1e-14, rtol=0)
    plan0 = unrolled_sinkhorn(cost, log_a, log_b, eps, 0).plan  # zero potentials
    torch.testing.assert_close(plan0, torch.exp(-cost / eps[:, None, None]))


def test_unrolled_sinkhorn_per_row_epsilon_and_broadcast_masses() -> None:
    cost, _, _, eps = _problem(3, 6, 2, seed=2)
    log_a = torch.full((6,), -math.log(6), dtype=F64)
    log_b = torch.tensor([math.log(0.25), math.log(0.75)], dtype=F64)
    batched = unrolled_sinkhorn(cost, log_a, log_b, eps, 50).plan
    for row in range(3):
        alone = unrolled_sinkhorn(cost[row], -math.log(6), log_b, float(eps[row]), 50).plan
        torch.testing.assert_close(batched[row], alone, atol=1e-15, rtol=0)


def test_unrolled_sinkhorn_gradients_are_those_of_the_iterations() -> None:
    cost, log_a, log_b, eps = _problem(2, 5, 3, seed=3)
    inputs = (cost.requires_grad_(True), eps.requires_grad_(True))
    assert torch.autograd.gradcheck(
        lambda c, e: unrolled_sinkhorn(c, log_a, log_b, e, 7).plan, inputs
    )


def test_unrolled_memory_grows_with_the_iterations() -> None:
    cost, log_a, log_b, eps = _problem(2, 50, 3, seed=4)
    cost.requires_grad_(True)

    def saved(n_iter: int) -> int:
        return count_saved_bytes(lambda c: unrolled_sinkhorn(c, log_a, log_b, eps, n_iter), cost)[1]

    assert saved(40) > 3 * saved(10) > 0


def test_unrolled_topk_mask_is_the_sinkhorn_method() -> None:
    # The library solves the same problem on a scale-free gauge of the cost (in units of
    # epsilon, centred per row), so its iterates equal the paper's once they have converged.
    x = torch.randn(3, 30, generator=seeded(5), dtype=F64)
    ref = unrolled_sinkhorn_topk_mask(x, 5, 0.5, 200)
    lib = softops.soft_topk_mask(x, 5, epsilon=0.5, method="sinkhorn", max_iter=200, tol=0)
    torch.testing.assert_close(ref, lib, atol=1e-12, rtol=0)
    torch.testing.assert_close(ref.sum(-1), torch.full((3,), 5.0, dtype=F64))
    ref = unrolled_sinkhorn_topk_mask(x, 5, 0.05, 3000)
    lib = softops.soft_topk_mask(x, 5, epsilon=0.05, method="sinkhorn", tol=1e-13)
    torch.testing.assert_close(ref, lib, atol=1e-10, rtol=0)


def test_unrolled_sorted_topk_reference() -> None:
    x = torch.randn(3, 12, generator=seeded(0), dtype=F64)
    values, weights = unrolled_sorted_topk(x, 3, epsilon=0.3, n_iter=200)
    assert values.shape == (3, 3) and weights.shape == (3, 3, 12)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 3, dtype=F64))
    assert (values - torch.topk(x, 3).values).abs().max() < 0.2
    ref = softops.soft_topk(x, 3, epsilon=0.3)  # converged, it solves the same problem
    torch.testing.assert_close(values, ref.values, atol=1e-8, rtol=0)
    torch.testing.assert_close(weights, ref.weights, atol=1e-8, rtol=0)


@pytest.mark.parametrize(("n", "k", "largest"), [(10, 3, False), (7, 7, True), (7, 7, False)])
def test_unrolled_sorted_topk_smallest_and_all(n: int, k: int, largest: bool) -> None:
    x = torch.randn(2, n, generator=seeded(n + k), dtype=F64)
    values, weights = unrolled_sorted_topk(x, k, epsilon=0.4, n_iter=500, largest=largest)
    ref = softops.soft_topk(x, k, epsilon=0.4, largest=largest, tol=1e-14, max_iter=100_000)
    torch.testing.assert_close(values, ref.values, atol=1e-10, rtol=0)
    torch.testing.assert_close(weights, ref.weights, atol=1e-10, rtol=0)


def test_paper_sinkhorn_reference_equals_library_ops() -> None:
    x = torch.randn(3, 40, generator=seeded(6), dtype=F64, requires_grad=True)
    g = torch.randn(3, 40, generator=seeded(7), dtype=F64)
    paper = paper_sinkhorn_topk_mask(x, 6, epsilon=0.3, n_iter=200)
    lib = softops.soft_topk_mask(x, 6, epsilon=0.3, method="sinkhorn", max_iter=200, tol=0)
    torch.testing.assert_close(paper, lib, atol=1e-12, rtol=0)
    torch.testing.assert_close(paper, unrolled_sinkhorn_topk_mask(x, 6, 0.3, 200), atol=0, rtol=0)
    converged = paper_sinkhorn_topk_mask(x, 6, epsilon=0.3, n_iter=3000)
    ot = softops.soft_topk_mask(x, 6, epsilon=0.3)
    torch.testing.assert_close(converged, ot, atol=1e-12, rtol=0)
    (gp,) = torch.autograd.grad(converged, x, g)
    (go,) = torch.autograd.grad(ot, x, g)
    torch.testing.assert_close(gp, go, atol=1e-10, rtol=0)
    # the implicit backward saves the plan alone, whatever the number of iterations
    _, short = count_saved_bytes(lambda t: paper_sinkhorn_topk_mask(t, 6, epsilon=0.3, n_iter=5), x)
    _, long = count_saved_bytes(lambda t: paper_sinkhorn_topk_mask(t, 6, epsilon=0.3), x)
    assert short == long


def test_count_saved_bytes_excludes_the_input() -> None:
    x = torch.randn(3, 5, requires_grad=True)
    _, saved = count_saved_bytes(torch.sin, x)  # sin saves only its input
    assert saved == 0
    out, saved = count_saved_bytes(lambda t: (t * 3).exp(), x)
    assert saved == out.numel() * out.element_size()
    _, saved = count_saved_bytes(lambda t: (t * 3).exp() * (t * 3).exp(), x)  # two storages
    assert saved == 2 * out.numel() * out.element_size()


def test_backend_switches_and_restores() -> None:
    before = kernels_enabled()
    with backend("reference"):
        assert not kernels_enabled()
        with backend("kernel"):
            assert kernels_enabled()
        assert not kernels_enabled()
    assert kernels_enabled() == before
    with pytest.raises(ValueError, match="expected one of"):
        with backend("fast"):
            pass


def test_unrolled_ot_sort_is_the_ot_sort_and_its_gradient() -> None:
    # autograd through the unrolled iterations against the library's implicit backward
    g = seeded(5)
    x = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(3, 6, generator=g, dtype=torch.float64)
    values, ranks = unrolled_ot_sort(x, 1.0, 1000)  # (converged: slow at a small epsilon)
    assert torch.allclose(ranks.sum(-1), torch.full((3,), 21.0, dtype=torch.float64))
    lib_v = softops.soft_sort(x, epsilon=1.0, method="ot", tol=1e-13)
    lib_r = softops.soft_rank(x, epsilon=1.0, method="ot", tol=1e-13)
    torch.testing.assert_close(values, lib_v, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ranks, lib_r, rtol=1e-9, atol=1e-10)
    for ours, lib in ((values, lib_v), (ranks, lib_r)):
        (want,) = torch.autograd.grad((ours * cot).sum(), x, retain_graph=True)
        (got,) = torch.autograd.grad((lib * cot).sum(), x, retain_graph=True)
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
