"""soft_topk_mask(method="sinkhorn"): the paper's algorithm on the same problem as "ot"."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.autograd import gradcheck

from softops import soft_topk_mask
from softops._core.convergence import default_tol
from softops.testing import unrolled_sinkhorn, unrolled_sinkhorn_topk_mask

F64 = torch.float64


@pytest.mark.parametrize(
    ("n", "k", "eps"), [(10, 3, 0.5), (200, 20, 0.1), (200, 199, 0.3), (1000, 10, 1.0)]
)
def test_agrees_with_ot_at_convergence(n, k, eps):
    x = torch.randn(4, n, dtype=F64)
    A = soft_topk_mask(x, k, epsilon=eps, method="sinkhorn")
    torch.testing.assert_close(A, soft_topk_mask(x, k, epsilon=eps), atol=1e-6, rtol=0)
    torch.testing.assert_close(A.sum(-1), torch.full((4,), float(k), dtype=F64), atol=1e-6, rtol=0)


def test_gradient_agrees_with_ot_and_gradcheck():
    x = torch.randn(3, 12, dtype=F64, requires_grad=True)
    g = torch.randn(3, 12, dtype=F64)
    (gs,) = torch.autograd.grad(soft_topk_mask(x, 4, epsilon=0.4, method="sinkhorn"), x, g)
    (go,) = torch.autograd.grad(soft_topk_mask(x, 4, epsilon=0.4), x, g)
    torch.testing.assert_close(gs, go, atol=1e-7, rtol=0)
    assert gradcheck(lambda x: soft_topk_mask(x, 4, epsilon=0.4, method="sinkhorn"), (x,))


@pytest.mark.parametrize("eps", [0.5, 0.05, 0.005])
def test_paper_fixed_iterations_equal_unrolled_sinkhorn(eps):
    # max_iter=200, tol=0 runs exactly 200 Sinkhorn iterations (not necessarily converged) on
    # the cost in units of epsilon: C_i0 = 0, C_i1 = -(x_i - c)/epsilon, c = x_(5)/2 + x_(6)/2
    # (the 5th and 6th largest). A shift of x by c is a gauge (it changes g, not the plan), but
    # from g = 0 it is the first iterate's threshold, so the unrolled iterates follow it.
    x = torch.randn(2, 30, dtype=F64)
    A = soft_topk_mask(x, 5, epsilon=eps, method="sinkhorn", max_iter=200, tol=0)
    top = x.topk(6, -1).values
    z = (x - (top[:, 4:5] / 2 + top[:, 5:6] / 2)) / eps
    cost = torch.stack((torch.zeros_like(z), -z), -1)
    log_a = torch.full_like(x, -math.log(30))
    log_b = torch.tensor([math.log(25 / 30), math.log(5 / 30)], dtype=F64).expand(2, 2)
    ref = 30 * unrolled_sinkhorn(cost, log_a, log_b, 1.0, 200).plan[..., 1]
    torch.testing.assert_close(A, ref, atol=1e-9, rtol=0)
    if eps == 0.5:  # converged: the paper's gauge gives the same plan
        paper = unrolled_sinkhorn_topk_mask(x, 5, eps, n_iter=200)
        torch.testing.assert_close(A, paper, atol=1e-12, rtol=0)


def test_rows_independent_nan_and_infinities():
    x = torch.randn(4, 9, dtype=F64)
    A = soft_topk_mask(x, 3, epsilon=0.2, method="sinkhorn")
    x2 = x.clone()
    x2[0] *= 100
    x2[1, 2] = math.nan
    x2[2, 0], x2[2, 5] = math.inf, -math.inf
    B = soft_topk_mask(x2, 3, epsilon=0.2, method="sinkhorn")
    torch.testing.assert_close(B[3], A[3], atol=1e-12, rtol=0)
    assert bool(torch.isnan(B[1]).all())
    assert B[2, 0] == 1 and B[2, 5] == 0
    torch.testing.assert_close(B[2], soft_topk_mask(x2[2], 3, epsilon=0.2), atol=1e-6, rtol=0)


def test_float32_and_errors():
    x = torch.randn(2, 50)
    A = soft_topk_mask(x, 5, epsilon=0.1, method="sinkhorn")
    assert A.dtype == torch.float32
    torch.testing.assert_close(A, soft_topk_mask(x, 5, epsilon=0.1), atol=1e-4, rtol=0)
    k = torch.tensor(2.0, requires_grad=True)
    with pytest.raises(
        ValueError, match=r"expected a `k` that does not require grad with method='sinkhorn'"
    ):
        soft_topk_mask(x, k, method="sinkhorn")
    with pytest.raises(ValueError, match=r"expected a scalar `k` with method=.*method='ot'"):
        soft_topk_mask(x, torch.tensor([1.0, 2.0]), method="sinkhorn")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("c", [1e-30, 1e-20, 1e-10, 1e-7, 1e-3, 1.0, 1e3, 1e10, 1e20, 1e30])
def test_scaling_law_at_every_scale(dtype, c):
    # soft_topk_mask(c x, k, c e) == soft_topk_mask(x, k, e): the solver sees x / epsilon only
    # (it returned the uniform k/n mask at small scales, and drifted at |x| ~ 1e-7 in float32).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g, dtype=torch.float64)
    ref = soft_topk_mask(x, 3, epsilon=0.3, method="ot")
    xc = (c * x).to(dtype).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A = soft_topk_mask(xc, 3, epsilon=0.3 * c, method="sinkhorn")
    # The solve stops once the plan (its columns exact) has a relative L1 row error of at most
    # tol = default_tol (1e-9 in float64): its rows then sum to (1 + rho_i)/n with sum |rho_i| <=
    # n tol, and A_i = (1 + rho_i) sigmoid(z_i - tau) with one threshold tau for every row, off
    # the exact one; the sigmoids' errors share a sign and sum to -sum rho_i sigmoid_i (both
    # masks sum to k), so each entry is within 2 n tol of the exact mask. (This draw came to
    # 3.5e-10, under 1e-10 with the median as the centre: the gauge moves where the iteration
    # stops within the tolerance, not the limit.)
    tol = 2 * x.shape[-1] * default_tol(dtype)
    torch.testing.assert_close(A.double(), ref, atol=tol, rtol=0)
    # the gradient scales as 1/c
    w = torch.arange(7, dtype=dtype)
    (gx,) = torch.autograd.grad((A * w).sum(), xc)
    x64 = x.clone().requires_grad_()
    (gref,) = torch.autograd.grad((soft_topk_mask(x64, 3, epsilon=0.3) * w.double()).sum(), x64)
    torch.testing.assert_close(gx.double() * c, gref, atol=10 * tol, rtol=10 * tol)


def _mostly_infinite_rows() -> torch.Tensor:
    """Rows whose finite entries are a minority: 0 to 4 entries at +inf and at -inf."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for n_pos in range(5):
        for n_neg in range(5):
            finite = torch.randn(2, generator=g, dtype=F64)
            inf = torch.tensor([math.inf] * n_pos + [-math.inf] * n_neg, dtype=F64)
            rows.append(torch.cat((inf, finite))[torch.randperm(n_pos + n_neg + 2, generator=g)])
    return rows


@pytest.mark.parametrize("eps", [0.3, 0.01])
def test_mostly_infinite_rows_converge_and_equal_ot(eps):
    """The cost is centred on the median of the finite entries: centred on the stand-ins (the
    median of a mostly infinite row), such a row sat 2000 epsilon from its threshold and did not
    converge within max_iter (33 of these 500 cases warned or missed "ot" by more than 1e-8)."""
    for row in _mostly_infinite_rows():
        n = row.numel()
        for k in range(1, n):
            for largest in (True, False):
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    A = soft_topk_mask(
                        row, k, epsilon=eps, method="sinkhorn", tol=1e-12, largest=largest
                    )
                ref = soft_topk_mask(row, k, epsilon=eps, largest=largest)
                torch.testing.assert_close(A, ref, atol=1e-8, rtol=0, equal_nan=True)


@pytest.mark.parametrize("largest", [True, False])
def test_vmap_equals_the_loop_with_infinities_and_nan(largest):
    """Under vmap every row takes the path of rows with non-finite entries: the same masks."""
    inf, nan = math.inf, math.nan
    x = torch.tensor(
        [
            [0.3, inf, -1.0, -inf, inf, 2.0, 0.7],
            [0.3, 1.0, -1.0, 0.5, 4.0, 2.0, 0.7],
            [inf, inf, inf, 0.5, -inf, 2.0, 0.7],  # more +inf than k: NaN
            [0.3, nan, -1.0, 0.5, inf, 2.0, 0.7],  # NaN
            [-inf, -inf, -inf, -inf, 0.1, -inf, 0.7],  # mostly -inf
        ],
        dtype=F64,
    )
    x = x if largest else -x

    def fn(z):
        return soft_topk_mask(z, 2, epsilon=0.3, method="sinkhorn", tol=1e-12, largest=largest)

    got = torch.func.vmap(fn)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(x.shape[0]):
            torch.testing.assert_close(got[i], fn(x[i]), atol=0, rtol=0, equal_nan=True)
    assert bool(got[2:4].isnan().all()) and bool(torch.isfinite(got[[0, 1, 4]]).all())
    assert float(got[0, 1]) == 1.0 and float(got[0, 3]) == 0.0


def test_forward_mode_gradcheck_and_vmap_of_grad():
    x = torch.randn(3, 8, dtype=F64, generator=torch.Generator().manual_seed(6))

    def fn(z):
        return soft_topk_mask(z, 3, epsilon=0.4, method="sinkhorn", tol=1e-13, max_iter=100_000)

    assert gradcheck(fn, (x.clone().requires_grad_(True),), check_forward_ad=True)
    w = torch.linspace(-1.0, 1.0, 8, dtype=F64)
    grads = torch.func.vmap(torch.func.grad(lambda z: (fn(z) * w).sum()))(x)
    z = x.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad((fn(z) * w).sum(), z)
    torch.testing.assert_close(grads, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_meta_tensors_give_the_shape(dtype):
    x = torch.empty(2, 6, 3, dtype=dtype, device="meta")
    A = soft_topk_mask(x, 2, dim=1, epsilon=0.3, method="sinkhorn")
    assert A.device.type == "meta" and A.shape == x.shape and A.dtype == dtype


def test_threshold_across_a_wide_gap_converges():
    """Large sweep case: epsilon 2e-5, the threshold 4e4 epsilon from the median it starts at.
    Plain Sinkhorn crossed that gap by O(1) per iteration (residual 0.17 after 1e5 iterations);
    epsilon scaling converges within the default budget and equals "ot"."""
    x = torch.tensor(
        [
            4.703849789974669,
            3.1001539197032346,
            2.534350569680383,
            2.9573248687293723,
            3.9119581392961362,
            7.453335151962489,
            1.9707114931084202,
            8.955132346674954,
            9.043977368790996,
            2.9483975893955225,
            7.470352550557619,
            9.381276947381352,
        ],
        dtype=F64,
    )
    eps = 1.975588561065755e-05
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A = soft_topk_mask(x, 8, epsilon=eps, method="sinkhorn", tol=1e-12)
    torch.testing.assert_close(A, soft_topk_mask(x, 8, epsilon=eps), atol=1e-12, rtol=0)
    assert float(A.sum()) == pytest.approx(8.0, abs=1e-12)
