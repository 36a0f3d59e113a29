"""soft_topk_mask(method="sinkhorn") with infinities: solved on the finite entries with k less
the count of +inf (formerly with stand-ins span + 2000 epsilon beyond the row, which rounded onto
it at a small epsilon: the known defect KD12 of the adversarial suite)."""

from __future__ import annotations

import math

import pytest
import torch

import softops

F64 = torch.float64
INF = math.inf


def test_kd12_the_stand_in_of_an_infinity_no_longer_rounds_onto_the_row():
    x = torch.tensor([[INF, 1.0, 1.0, 1.0]], dtype=F64)
    mask = softops.soft_topk_mask(x, 1, epsilon=1e-20, largest=False, method="sinkhorn")
    torch.testing.assert_close(mask, torch.tensor([[0.0, 1 / 3, 1 / 3, 1 / 3]], dtype=F64))


@pytest.mark.parametrize("eps", [1e-20, 0.5, 1e300])
@pytest.mark.parametrize("k", [1, 1.5, 2, 3, 4])
def test_rows_with_infinities_equal_method_ot(eps, k):
    x = torch.tensor([[INF, 0.0, 1.0, -INF, 2.0], [0.5, -INF, -INF, 0.1, 3.0]], dtype=F64)
    got = softops.soft_topk_mask(x, k, epsilon=eps, method="sinkhorn", tol=1e-12)
    want = softops.soft_topk_mask(x, k, epsilon=eps, method="ot")
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0, equal_nan=True)


def test_gradients_with_infinities_match_central_differences():
    x = torch.tensor([[INF, 0.3, -INF, 1.2, -0.4, 2.0]], dtype=F64)
    w = torch.tensor([[0.0, 0.7, 0.0, -1.1, 0.5, 0.2]], dtype=F64)
    dx = torch.tensor([[0.0, 0.2, 0.0, -0.4, 0.3, 0.1]], dtype=F64) * 1e-5
    xt = x.clone().requires_grad_()
    A = softops.soft_topk_mask(xt, 3, epsilon=0.4, method="sinkhorn", tol=1e-13)
    (gx,) = torch.autograd.grad(A, xt, w)
    assert gx[0, 0] == 0 and gx[0, 2] == 0
    analytic = float((gx * dx).sum())

    def f(t):
        v = softops.soft_topk_mask(x + t * dx, 3, epsilon=0.4, method="sinkhorn", tol=1e-13)
        return float((torch.where(w != 0, v, 0) * w).sum())

    central = (f(1.0) - f(-1.0)) / 2
    assert abs(central - analytic) <= 1e-6 * abs(analytic), (central, analytic)


def test_k_fin_rows_are_the_rows_whose_finite_entries_are_all_out_or_all_in():
    from softops.topk._sinkhorn import k_fin_rows

    inf = math.inf
    x = torch.tensor(
        [[inf, 1.0, 2.0], [inf, 1.0, 2.0], [inf, 1.0, 2.0], [-inf, 1.0, 2.0], [0.0, 1.0, 2.0]]
    )
    k = torch.tensor([1.0, 3.0, 2.0, 2.0, 1.5])
    none_fin, all_fin = k_fin_rows(x, k)
    assert none_fin.tolist() == [True, False, False, False, False]  # k = #(+inf)
    assert all_fin.tolist() == [False, True, False, True, False]  # k = #(+inf) + #finite


def test_kd13_a_row_spanning_far_beyond_its_gaps():
    # the cost was centred on the row's median (-1e30 on the negated row), where 0 and -1 both
    # came to (x - c)/eps = 3.3e30, one float: the mask was [.5, 0, 0, .5]
    x = torch.tensor([[0.0, 1e30, 1e30, 1.0]], dtype=F64)
    got = softops.soft_topk_mask(x, 1, epsilon=0.3, largest=False, method="sinkhorn")
    want = softops.soft_topk_mask(x, 1, epsilon=0.3, largest=False, method="ot")
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    assert got[0, 0] > 0.84 and got[0, 3] < 0.16 and got[0, 1] == got[0, 2] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("largest", [True, False])
def test_entries_far_beyond_the_gaps_equal_method_ot(dtype, largest):
    """Rows of entries with gaps of about 1 beside up to two entries far beyond them (up to
    1e-3 of the dtype's range, either sign) and infinities, epsilon within a decade of the gaps
    and k fractional or whole: the converged plan equals method "ot" (the median centre lost
    the threshold once a far entry moved the median away from it)."""
    g = torch.Generator().manual_seed(7 + largest)
    top = math.log10(torch.finfo(dtype).max) - 3
    tol = 1e-6 if dtype == F64 else 2e-4
    for _ in range(12):
        n = int(torch.randint(3, 9, (1,), generator=g))
        x = torch.randn(4, n, generator=g, dtype=F64)
        for b in range(4):
            for _ in range(2):
                if torch.rand(1, generator=g) < 0.8:
                    far = float(torch.empty(1, dtype=F64).uniform_(4, top, generator=g))
                    sign = 1.0 if torch.rand(1, generator=g) < 0.5 else -1.0
                    x[b, int(torch.randint(0, n, (1,), generator=g))] = sign * 10.0**far
            if torch.rand(1, generator=g) < 0.2:
                x[b, int(torch.randint(0, n, (1,), generator=g))] = INF if b % 2 else -INF
        x = x.to(dtype)
        k = float(torch.randint(1, n, (1,), generator=g))
        if torch.rand(1, generator=g) < 0.5:
            k -= 0.5
        eps = 10.0 ** float(torch.empty(1, dtype=F64).uniform_(-1, 1, generator=g))
        got = softops.soft_topk_mask(x, k, epsilon=eps, largest=largest, method="sinkhorn")
        want = softops.soft_topk_mask(x, k, epsilon=eps, largest=largest, method="ot")
        torch.testing.assert_close(got, want, atol=tol, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_kd17_a_subnormal_target_mass_equals_method_ot(dtype):
    """(KD17) k from the smallest normal number up to n of it: the target mass k / n is
    subnormal, and the solver's linear column sums rounded to 0 (a NaN mask on tied rows). Now
    the mask equals method "ot" (float64), and its gradient is finite."""
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 1.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    x = x.to(dtype).requires_grad_()
    for k in (tiny, 3 * tiny, 3.99 * tiny):
        got = softops.soft_topk_mask(x, k, epsilon=1.0, method="sinkhorn")
        want = softops.soft_topk_mask(x.detach().double(), k, epsilon=1.0, method="ot")
        rtol = 2e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=0)
        (grad,) = torch.autograd.grad(got, x, torch.ones_like(got))
        assert torch.isfinite(grad).all()
