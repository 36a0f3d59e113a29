"""soft_topk_mask(method="perturbed"): Berthet et al.'s perturbed optimizer on the top-k mask."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from softops import soft_topk_mask
from softops.topk import _perturbed as perturbed_mod
from tests._helpers import hard_topk_mask, saved_bytes, seeded

F64 = torch.float64


def _mask(x, k, *, seed=0, n_samples=64, epsilon=0.5, **kw):
    """The perturbed mask with a fresh generator seeded with ``seed``."""
    return soft_topk_mask(
        x, k, method="perturbed", epsilon=epsilon, n_samples=n_samples, generator=seeded(seed), **kw
    )


def _value_and_grad(x, k, g, **kw):
    x = x.detach().clone().requires_grad_()
    A = _mask(x, k, **kw)
    (gx,) = torch.autograd.grad(A, x, g)
    return A.detach(), gx


def _distinct(B: int, n: int, dtype=F64) -> torch.Tensor:
    """Rows with well-separated entries (a gap of 4/n between any two)."""
    return torch.stack([torch.randperm(n).to(dtype) / n * 4 for _ in range(B)])


# ------------------------------------------------------------ exact probabilities (k = 1, n - 1)


def _argmax_probs(x: torch.Tensor, eps: float, deg: int = 80) -> torch.Tensor:
    """P(i = argmax of x + eps Z) = E_z[prod_{j != i} Phi((x_i - x_j)/eps + z)], by Gauss-Hermite.

    Written in torch float64, so that autograd gives the exact Jacobian of the probabilities.
    """
    t, w = np.polynomial.hermite.hermgauss(deg)
    z = torch.tensor(math.sqrt(2) * t, dtype=F64)
    w = torch.tensor(w / math.sqrt(math.pi), dtype=F64)
    d = (x[:, None] - x[None, :]) / eps  # d[i, j] = (x_i - x_j)/eps
    cdf = torch.special.ndtr(d + z[:, None, None])  # (deg, n, n)
    eye = torch.eye(x.shape[0], dtype=torch.bool)
    return w @ torch.where(eye, 1.0, cdf).prod(-1)


def _exact_mask(x: torch.Tensor, k: int, eps: float) -> torch.Tensor:
    """E[topk_mask(x + eps Z)] for k = 1, or k = n - 1 (1 - P(argmin), argmin(x) = argmax(-x))."""
    if k == 1:
        return _argmax_probs(x, eps)
    assert k == x.shape[0] - 1
    return 1 - _argmax_probs(-x, eps)


X6 = torch.tensor([0.3, -0.2, 0.5, 0.1, -0.4, 0.0], dtype=F64)


def test_quadrature_is_exact():
    # the test's own reference: probabilities sum to 1 and match adaptive quadrature (scipy)
    from scipy import integrate, special

    p = _argmax_probs(X6, 0.4)
    assert abs(float(p.sum()) - 1) < 1e-12
    xs = X6.numpy()
    for i in (0, 4):
        others = np.delete(xs, i)

        def f(z, i=i, others=others):
            pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
            return pdf * np.prod(special.ndtr((xs[i] - others) / 0.4 + z))

        ref, _ = integrate.quad(f, -12, 12, epsabs=1e-13)
        assert abs(float(p[i]) - ref) < 1e-10


@pytest.mark.parametrize("k", [1, 5])
def test_forward_is_unbiased(k):
    # 4000 rows of the same x, 10 draws each: 40000 independent Bernoulli draws per entry.
    rows, N, eps = 4000, 10, 0.4
    x = X6.expand(rows, 6)
    A = _mask(x, k, seed=11, n_samples=N, epsilon=eps)
    mean = A.mean(0)
    p = _exact_mask(X6, k, eps)
    se = torch.sqrt(p * (1 - p) / (rows * N))
    assert float(p.min()) > 0.01 and float(p.max()) < 0.99  # a non-trivial check
    z = (mean - p) / se
    assert float(z.abs().max()) < 5, z


@pytest.mark.parametrize("k", [1, 5])
def test_backward_estimates_the_exact_jacobian(k):
    eps = 0.4
    J = torch.autograd.functional.jacobian(lambda v: _exact_mask(v, k, eps), X6)  # J[i, j]
    g = torch.tensor([1.0, -0.5, 2.0, 0.0, 0.7, -1.2], dtype=F64)
    exact = g @ J
    # Each of the M rows is an independent replication of the estimator (its own draws).
    M = 2000
    x = X6.expand(M, 6)
    stds = {}
    for N in (8, 128):
        _, est = _value_and_grad(x, k, g.expand(M, 6), seed=N, n_samples=N, epsilon=eps)
        mean, std = est.mean(0), est.std(0)
        z = (mean - exact) / (std / math.sqrt(M))
        assert float(z.abs().max()) < 5, (N, z)
        stds[N] = std
    assert float(exact.abs().max()) > 0.3  # the Jacobian is not trivially zero
    ratio = stds[8] / stds[128]  # 1/sqrt(N): sqrt(16) = 4
    assert bool(((ratio > 3.3) & (ratio < 4.8)).all()), ratio


# ------------------------------------------------------------------- reference backward (exact)


def test_gradient_of_the_mask_sum_is_exactly_zero():
    # sum(mask) = k for every draw, so d sum / dx = 0; the centred cotangent gives exactly 0
    # (uncentred, Berthet's estimator has noise of size k / (eps sqrt N) here).
    x = torch.randn(3, 9, dtype=F64, requires_grad=True)
    A = soft_topk_mask(x, 2, epsilon=0.5, method="perturbed", n_samples=16)
    A.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def _reference(x, k, eps, N, seed, g):
    """The estimator written out: a loop over N draws of (B, n) from one generator, with the
    cotangent centred per row (the control variate; every draw's mask sums to k)."""
    gen = seeded(seed)
    g = g - g.mean(-1, keepdim=True)
    e = eps.reshape(-1, 1)
    total = torch.zeros_like(x)
    grad = torch.zeros_like(x)
    for _ in range(N):
        z = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        y = hard_topk_mask(x + e * z, k)
        total += y
        grad += (g * y).sum(-1, keepdim=True) * z
    return total / N, grad / (e * N)


@pytest.mark.parametrize("budget", [None, 1, 3 * 5 * 7, 10**9])
def test_backward_equals_the_written_out_estimator(monkeypatch, budget):
    # budget: the work-buffer size; 1 gives one sample per chunk, 105 three (ragged last chunk)
    if budget is not None:
        monkeypatch.setattr(perturbed_mod, "_CHUNK_ELEMENTS", budget)
    B, n, k, N = 5, 7, 2, 37
    x = torch.randn(B, n, dtype=F64)
    eps = torch.tensor([0.3, 1.0, 0.05, 2.0, 0.5], dtype=F64)
    g = torch.randn(B, n, dtype=F64)
    A, gx = _value_and_grad(x, k, g, seed=3, n_samples=N, epsilon=eps)
    A_ref, g_ref = _reference(x, k, eps, N, 3, g)
    assert torch.equal(A, A_ref)
    torch.testing.assert_close(gx, g_ref, atol=1e-12, rtol=0)


def test_torch_func_grad():
    x = torch.randn(2, 6, dtype=F64)
    w = torch.randn(2, 6, dtype=F64)
    fn = lambda v: (_mask(v, 2, seed=4, n_samples=16) * w).sum()  # noqa: E731
    _, ref = _value_and_grad(x, 2, w, seed=4, n_samples=16)
    torch.testing.assert_close(torch.func.grad(fn)(x), ref, atol=0, rtol=0)


# ---------------------------------------------------------------------------------- hard limit


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("k", [1, 7, 29])
def test_reaches_the_hard_mask_as_epsilon_goes_to_zero(dtype, k):
    x = _distinct(4, 30, dtype)
    for largest in (True, False):
        A = _mask(x, k, epsilon=1e-6, n_samples=50, largest=largest)
        assert torch.equal(A, hard_topk_mask(x, k, largest=largest))
    # and it is smooth away from that limit
    assert not torch.equal(_mask(x, k, epsilon=0.3), hard_topk_mask(x, k))


# ---------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize(("n", "k"), [(9, 1), (9, 4), (9, 8), (300, 30)])
@pytest.mark.parametrize("N", [1, 37, 64])
def test_values_are_counts_and_rows_sum_to_k(n, k, N):
    x = torch.randn(6, n, dtype=F64)
    A = _mask(x, k, n_samples=N, epsilon=0.7)
    assert bool(((A >= 0) & (A <= 1)).all())
    counts = A * N
    torch.testing.assert_close(counts, counts.round(), atol=1e-9, rtol=0)
    if N & (N - 1) == 0:  # count / N is exact for a power of two
        assert torch.equal(A.sum(-1), torch.full((6,), float(k), dtype=F64))
    else:
        torch.testing.assert_close(A.sum(-1), torch.full((6,), float(k), dtype=F64))


def test_k_edges_draw_nothing():
    x = torch.randn(3, 8, dtype=F64, requires_grad=True)
    gen = seeded(5)
    state = gen.get_state()
    A0 = soft_topk_mask(x, 0, method="perturbed", generator=gen)
    A8 = soft_topk_mask(x, 8, method="perturbed", generator=gen)
    assert torch.equal(A0, torch.zeros_like(x)) and torch.equal(A8, torch.ones_like(x))
    assert torch.equal(gen.get_state(), state)  # the generator was not advanced
    (gx,) = torch.autograd.grad((A0 + A8).sum(), x)
    assert torch.equal(gx, torch.zeros_like(x))


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_any_dim_equals_moving_it_last(dim):
    # Rows are the slices along dim in row-major order of the other dims; each row draws its own
    # noise, so a loop over slices with a reset generator would give other (equally valid) draws.
    x = torch.randn(4, 6, 5, dtype=F64)
    g = torch.randn_like(x)
    A, gx = _value_and_grad(x, 2, g, dim=dim, seed=9, n_samples=16)
    xm, gm = x.movedim(dim, -1), g.movedim(dim, -1)
    rows = xm.reshape(-1, xm.shape[-1])
    A_r, g_r = _value_and_grad(rows, 2, gm.reshape(rows.shape), seed=9, n_samples=16)
    assert torch.equal(A, A_r.reshape(xm.shape).movedim(-1, dim))
    assert torch.equal(gx, g_r.reshape(xm.shape).movedim(-1, dim))
    assert torch.equal(A.sum(dim), torch.full_like(A.sum(dim), 2.0))


def test_largest_false_is_largest_of_negated():
    x = torch.randn(3, 20, dtype=F64)
    g = torch.randn_like(x)
    A, gx = _value_and_grad(x, 4, g, seed=2, largest=False)
    B, gy = _value_and_grad(-x, 4, g, seed=2)
    assert torch.equal(A, B)
    assert torch.equal(gx, -gy)


def test_scaling_and_shift():
    # mask(c x, eps = c e) with the same draws is the same mask; the gradient is divided by c
    x = torch.randn(3, 15, dtype=F64)
    g = torch.randn_like(x)
    A, gx = _value_and_grad(x, 5, g, seed=6, epsilon=0.3)
    A4, g4 = _value_and_grad(4 * x, 5, g, seed=6, epsilon=1.2)
    assert torch.equal(A, A4)
    torch.testing.assert_close(g4, gx / 4, atol=1e-14, rtol=1e-12)
    A_s, g_s = _value_and_grad(x + 0.5, 5, g, seed=6, epsilon=0.3)
    assert torch.equal(A, A_s)  # no near-ties: the shift moves no entry across another
    torch.testing.assert_close(g_s, gx, atol=1e-14, rtol=0)


def test_hard_is_straight_through():
    x = torch.randn(4, 10, dtype=F64)
    g = torch.randn_like(x)
    H, gh = _value_and_grad(x, 3, g, seed=8, hard=True)
    assert torch.equal(H, hard_topk_mask(x, 3))
    _, gs = _value_and_grad(x, 3, g, seed=8)
    assert torch.equal(gh, gs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
def test_dtype_and_half_precision(dtype):
    x = torch.randn(4, 50).to(dtype)
    A, gx = _value_and_grad(x, 5, torch.ones_like(x), seed=1, n_samples=20)
    assert A.dtype == dtype and gx.dtype == dtype and A.device == x.device
    # half precision is computed in float32 (the same draws) and cast back; counts are exact
    A32, _ = _value_and_grad(x.float(), 5, torch.ones(4, 50), seed=1, n_samples=20)
    if dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(A, A32.to(dtype))
    assert bool(torch.isfinite(gx).all())


# ------------------------------------------------------------------------------ reproducibility


def test_same_seed_same_values_and_gradients():
    x = torch.randn(3, 12, dtype=F64)
    g = torch.randn_like(x)
    A1, g1 = _value_and_grad(x, 4, g, seed=21)
    A2, g2 = _value_and_grad(x, 4, g, seed=21)
    assert torch.equal(A1, A2) and torch.equal(g1, g2)
    A3, _ = _value_and_grad(x, 4, g, seed=22)
    assert not torch.equal(A1, A3)


def test_global_seed_makes_generator_none_reproducible():
    x = torch.randn(3, 12, dtype=F64, requires_grad=True)
    g = torch.randn_like(x)
    out = []
    for _ in range(2):
        torch.manual_seed(123)
        A = soft_topk_mask(x, 4, method="perturbed", n_samples=16)
        out.append((A.detach(), torch.autograd.grad(A, x, g)[0]))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    again = soft_topk_mask(x, 4, method="perturbed", n_samples=16)  # global generator moved on
    assert not torch.equal(again.detach(), out[1][0])


def test_consecutive_calls_advance_the_users_generator():
    x = torch.randn(3, 12, dtype=F64)
    gen = seeded(7)
    A1 = soft_topk_mask(x, 4, method="perturbed", n_samples=16, generator=gen)
    A2 = soft_topk_mask(x, 4, method="perturbed", n_samples=16, generator=gen)
    assert not torch.equal(A1, A2)
    # and it advanced exactly as if the draws had been taken from it directly, one (B, n) each
    ref = seeded(7)
    for _ in range(32):
        torch.randn(3, 12, generator=ref, dtype=F64)
    assert torch.equal(gen.get_state(), ref.get_state())


def test_gradient_uses_the_forwards_draws():
    x = torch.randn(3, 12, dtype=F64, requires_grad=True)
    g = torch.randn_like(x)
    gen = seeded(31)
    A = soft_topk_mask(x, 4, method="perturbed", epsilon=0.5, n_samples=16, generator=gen)
    torch.randn(1000, generator=gen)  # the user's generator moves on before backward
    gen.manual_seed(999)
    (gx,) = torch.autograd.grad(A, x, g)
    _, ref = _value_and_grad(x, 4, g, seed=31, n_samples=16)
    assert torch.equal(gx, ref)


def test_saved_memory_does_not_grow_with_n_samples():
    x = torch.randn(4, 50, requires_grad=True)

    def run(N):
        return saved_bytes(lambda: _mask(x, 5, n_samples=N).sum().backward())

    small, large = run(10), run(1000)
    assert small == large
    assert small <= x.numel() * 4 + 1024  # x and epsilon (the generator state is on ctx)


def test_no_grad_saves_nothing():
    x = torch.randn(4, 50)
    assert saved_bytes(lambda: _mask(x, 5)) == 0


# ------------------------------------------------------------------------------ special values


def test_infinities_behave_as_their_limits_and_bad_rows_stay_in_their_row():
    inf, nan = math.inf, math.nan
    rows = [
        [1.0, -inf, 3.0, 2.0, -inf, 0.5],  # -inf never selected
        [inf, 1.0, 2.0, 0.0, -1.0, 3.0],  # +inf always selected
        [-inf, -inf, -inf, 1.0, 2.0, 3.0],  # exactly k finite: all of them
        [inf, inf, inf, inf, 1.0, 2.0],  # more +inf than k: cannot hold
        [-inf, -inf, -inf, -inf, -inf, 2.0],  # fewer than k above -inf: cannot hold
        [inf, inf, inf, 1.0, 2.0, -inf],  # exactly k at +inf
        [0.5, nan, 1.0, 2.0, 3.0, 4.0],  # NaN
    ]
    x = torch.tensor(rows, dtype=F64)
    g = torch.randn_like(x)
    A, gx = _value_and_grad(x, 3, g, seed=4, epsilon=0.5)
    assert A[0, 1] == 0 and A[0, 4] == 0 and A[1, 0] == 1
    assert A[2].tolist() == [0, 0, 0, 1, 1, 1]
    assert A[5].tolist() == [1, 1, 1, 0, 0, 0]
    good, bad = [0, 1, 2, 5], [3, 4, 6]
    assert bool(torch.isnan(A[bad]).all()) and bool(torch.isnan(gx[bad]).all())
    assert bool(torch.isfinite(gx[good]).all())
    assert bool((gx[good][torch.isinf(x[good])] == 0).all())
    # the finite entries of row 0 still receive a gradient
    assert bool((gx[0, [0, 2, 3, 5]] != 0).any())
    # other rows are unaffected: replace the bad rows by finite ones, same draws
    x_ok = x.clone()
    x_ok[bad] = torch.randn(3, 6, dtype=F64)
    A_ok, g_ok = _value_and_grad(x_ok, 3, g, seed=4, epsilon=0.5)
    assert torch.equal(A[good], A_ok[good]) and torch.equal(gx[good], g_ok[good])


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 12),
    data=st.data(),
    scale=st.sampled_from([1e-20, 1.0, 1e20]),
    eps_rel=st.sampled_from([1e-6, 1.0, 100.0]),
)
def test_property_ties_and_magnitudes(n, data, scale, eps_rel):
    vals = data.draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n))
    k = data.draw(st.integers(0, n))
    x = torch.tensor(vals, dtype=F64) * scale
    A, gx = _value_and_grad(x, k, torch.ones_like(x), n_samples=8, epsilon=eps_rel * scale)
    assert bool(torch.isfinite(A).all()) and bool(torch.isfinite(gx).all())
    assert bool(((A >= 0) & (A <= 1)).all())
    assert float(A.sum()) == k  # N = 8: exact


# -------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"n_samples": 0}, ValueError, r"expected `n_samples` >= 1; got n_samples=0\."),
        ({"n_samples": -1}, ValueError, r"got n_samples=-1\."),
        ({"n_samples": 2.5}, TypeError, r"positive int or None; got n_samples=2\.5\."),
        ({"n_samples": True}, TypeError, r"got n_samples=True\."),
        ({"generator": 3}, TypeError, r"torch\.Generator or None; got 3\."),
        ({"k": 2.5}, ValueError, r"expected an integer `k` with method='perturbed'; got k=2\.5"),
        (
            {"k": torch.tensor([1.0, 2.0])},
            ValueError,
            r"expected a scalar `k` with method=.*method='ot'",
        ),
        (
            {"k": torch.tensor(2.0, requires_grad=True)},
            ValueError,
            r"expected a `k` that does not require grad with method='perturbed'",
        ),
        (
            {"epsilon": torch.tensor(0.5, requires_grad=True)},
            ValueError,
            r"expected an? `epsilon` that does not require grad with method='perturbed'",
        ),
        ({"max_iter": 10}, ValueError, r"max_iter"),
        ({"tol": 1e-3}, ValueError, r"tol"),
        ({"epsilon": 0.0}, ValueError, r"expected `epsilon` > 0 and finite; got epsilon=0\.0"),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, exc, match):
    x = torch.randn(2, 5)
    kwargs = {"k": 2, **kwargs}
    with pytest.raises(exc, match=match):
        soft_topk_mask(x, method="perturbed", **kwargs)


@pytest.mark.parametrize("kwargs", [{"n_samples": 10}, {"generator": torch.Generator()}])
@pytest.mark.parametrize("method", ["ot", "sinkhorn", "softkmax"])
def test_perturbed_arguments_rejected_by_other_methods(method, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        soft_topk_mask(torch.randn(2, 5), 2, method=method, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("eps", [0.1, 1.0, 5.0])
@pytest.mark.parametrize("k", [1, 9])
def test_slow_unbiased_grid(eps, k):
    x = torch.randn(10, dtype=F64)
    rows, N = 20000, 8
    A = _mask(x.expand(rows, 10), k, seed=5, n_samples=N, epsilon=eps)
    p = _exact_mask(x, k, eps)
    se = torch.sqrt(p * (1 - p) / (rows * N)).clamp_min(1e-4)
    assert float(((A.mean(0) - p) / se).abs().max()) < 5


def test_kernel_on_canonical_rows() -> None:
    # The (B, n) kernel behind method="perturbed": k = 0 and k = n need no draws (the generator
    # does not move), and the rows sum to k.
    from softops.topk._perturbed import perturbed_topk_mask

    x = torch.randn(3, 7, dtype=F64)
    eps = torch.full((3,), 0.5, dtype=F64)
    gen = seeded(5)
    state = gen.get_state()
    assert torch.equal(perturbed_topk_mask(x, 0, eps, 10, gen), torch.zeros_like(x))
    assert torch.equal(perturbed_topk_mask(x, 7, eps, 10, gen), torch.ones_like(x))
    assert torch.equal(gen.get_state(), state)
    A = perturbed_topk_mask(x, 3, eps, 16, gen)
    assert torch.equal(A.sum(-1), torch.full((3,), 3.0, dtype=F64))
    assert torch.equal(A * 16, (A * 16).round())
    assert not torch.equal(gen.get_state(), state)


def test_generator_on_another_device_is_refused() -> None:
    x = torch.empty(2, 5, device="meta")  # validation runs before any computation
    with pytest.raises(
        ValueError,
        match=r"expected `generator` on the device of x \(meta\); got a generator on cpu",
    ):
        soft_topk_mask(x, 2, method="perturbed", generator=torch.Generator())


# -------------------------------------------- forward mode, jacrev, vmap randomness, meta tensors


def _estimated_jacobian(x, k, eps, N, seed):
    """The matrix both jvp and vjp must apply, written out from the forward's draws:
    J[b] = C_F (1 / (eps N)) sum_s y_s Z_s^T diag(f), f the finite entries of row b and
    C_F = diag(f) - f f^T / |F| (the centring over F)."""
    gen = seeded(seed)
    B, n = x.shape
    f = torch.isfinite(x).to(x.dtype)
    C = torch.diag_embed(f) - f[:, :, None] * f[:, None, :] / f.sum(-1)[:, None, None]
    J = torch.zeros(B, n, n, dtype=x.dtype)
    for _ in range(N):
        z = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        y = hard_topk_mask(x + eps[:, None] * z, k)
        J += y[:, :, None] * (z * f)[:, None, :]
    return C @ J / (eps[:, None, None] * N)


def test_jacrev_and_jvp_apply_one_estimated_matrix():
    B, n, k, N = 3, 7, 2, 23
    x = torch.randn(B, n, dtype=F64)
    x[1, 4] = math.inf  # always selected: no derivative in or out
    x[2, 0] = -math.inf
    eps = torch.tensor([0.4, 1.0, 2.5], dtype=F64)
    fn = lambda v: _mask(v, k, seed=9, n_samples=N, epsilon=eps)  # noqa: E731
    want = _estimated_jacobian(x, k, eps, N, 9)  # (B, n, n)
    rev = torch.func.jacrev(fn)(x)  # (B, n, B, n): the forward's draws for every cotangent
    fwd = torch.func.jacfwd(fn, randomness="same")(x)
    rows = torch.arange(B)
    for jac in (rev, fwd):
        torch.testing.assert_close(jac[rows, :, rows], want, rtol=1e-12, atol=1e-12)
        off = jac.clone()
        off[rows, :, rows] = 0
        assert torch.equal(off, torch.zeros_like(off))  # rows are independent
    dx = torch.randn(B, n, dtype=F64)
    out, tangent = torch.func.jvp(fn, (x,), (dx,))
    assert torch.equal(out, fn(x))
    torch.testing.assert_close(tangent, torch.einsum("bij,bj->bi", want, dx), rtol=1e-12, atol=0)
    # the centring: every row of the tangent sums to 0 (to rounding; the uncentred estimate is
    # k <Z_s, dx> / eps per draw), and infinite entries get none
    assert float(tangent.sum(-1).abs().max()) < 1e-13 * float(tangent.abs().sum())
    assert tangent[1, 4] == 0 and tangent[2, 0] == 0 and (tangent != 0).sum() > B * (n - 2)
    # torch.autograd.forward_ad gives the same tangent
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        dual = fwad.make_dual(x, dx)
        assert torch.equal(fwad.unpack_dual(fn(dual)).tangent, tangent)


def test_jvp_estimates_the_exact_jacobian():
    eps, k = 0.4, 1
    J = torch.autograd.functional.jacobian(lambda v: _exact_mask(v, k, eps), X6)
    dx = torch.tensor([0.5, -1.0, 2.0, 0.3, 0.0, -0.7], dtype=F64)
    exact = J @ dx
    M, N = 2000, 32  # M independent replications of the estimator (one per row)
    x = X6.expand(M, 6)
    _, est = torch.func.jvp(
        lambda v: _mask(v, k, seed=17, n_samples=N, epsilon=eps), (x,), (dx.expand(M, 6),)
    )
    z = (est.mean(0) - exact) / (est.std(0) / math.sqrt(M))
    assert float(exact.abs().max()) > 0.3
    assert float(z.abs().max()) < 5, z


def test_jvp_edges_and_bad_rows():
    x = torch.tensor([[1.0, 2.0, 3.0], [math.nan, 1.0, 2.0]], dtype=F64)
    dx = torch.ones_like(x)
    for k in (0, 3):  # no draws: zero tangent (NaN in the NaN row)
        _, t = torch.func.jvp(lambda v, k=k: _mask(v, k), (x,), (dx,))
        assert torch.equal(t[0], torch.zeros(3, dtype=F64)) and bool(t[1].isnan().all())
    _, t = torch.func.jvp(lambda v: _mask(v, 1), (x,), (dx,))
    assert bool(t[0].isfinite().all()) and bool(t[1].isnan().all())


def _folded(x: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """The mask of x (..., B, n) with every leading slice's rows stacked: one call, one seed."""
    return _mask(x.reshape(-1, x.shape[-1]), k, seed=seed, n_samples=16).reshape(x.shape)


def test_vmap_randomness_different_draws_per_slice():
    x = torch.randn(4, 3, 8, dtype=F64)
    f = lambda v: _mask(v, 3, seed=2, n_samples=16)  # noqa: E731
    out = torch.func.vmap(f, randomness="different")(x)
    # the vmapped dimension is folded into the rows, which draw independently
    assert torch.equal(out, _folded(x, 3, 2))
    same_x = torch.func.vmap(f, randomness="different")(x[:1].expand(4, 3, 8))
    assert not torch.equal(same_x[0], same_x[1])
    # a level that changes neither x nor epsilon still draws per slice
    c = torch.arange(1.0, 5.0, dtype=F64)
    scaled = torch.func.vmap(lambda c: f(x[0]) * c, randomness="different")(c)
    assert not torch.equal(scaled[0], scaled[1] / 2)
    # and gradients and tangents follow the same draws
    w = torch.randn(3, 8, dtype=F64)
    grads = torch.func.vmap(torch.func.grad(lambda v: (f(v) * w).sum()), randomness="different")(x)
    xr = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad((_folded(xr, 3, 2) * w).sum(), xr)
    torch.testing.assert_close(grads, ref, rtol=1e-12, atol=1e-12)
    dx = torch.randn_like(x)
    tangents = torch.func.vmap(
        lambda v, d: torch.func.jvp(f, (v,), (d,))[1], randomness="different"
    )(x, dx)
    _, ref_t = torch.func.jvp(lambda v: _folded(v, 3, 2), (x,), (dx,))
    torch.testing.assert_close(tangents, ref_t, rtol=1e-12, atol=1e-12)


def test_vmap_randomness_same_shares_the_draws():
    x = torch.randn(4, 3, 8, dtype=F64)
    f = lambda v: _mask(v, 3, seed=2, n_samples=16)  # noqa: E731
    out = torch.func.vmap(f, randomness="same")(x)
    for i in range(4):  # every slice sees the draws of a plain call on its own rows
        assert torch.equal(out[i], f(x[i]))
    c = torch.arange(1.0, 5.0, dtype=F64)  # also along a level that changes neither x nor eps
    scaled = torch.func.vmap(lambda c: f(x[0]) * c, randomness="same")(c)
    assert torch.equal(scaled[1] / 2, f(x[0])) and torch.equal(scaled[3] / 4, f(x[0]))
    w = torch.randn(3, 8, dtype=F64)
    loss = lambda v: (f(v) * w).sum()  # noqa: E731
    grads = torch.func.vmap(torch.func.grad(loss), randomness="same")(x)
    for i in range(4):
        torch.testing.assert_close(grads[i], torch.func.grad(loss)(x[i]), rtol=1e-12, atol=0)
    jac = torch.func.vmap(torch.func.jacrev(f), randomness="same")(x)
    torch.testing.assert_close(jac[2], torch.func.jacrev(f)(x[2]), rtol=1e-12, atol=0)
    # nested: the inner level shares, the outer one differs
    xx = torch.randn(2, 3, 4, 8, dtype=F64)
    nested = torch.func.vmap(
        torch.func.vmap(f, randomness="same"), in_dims=1, out_dims=1, randomness="different"
    )(xx)
    for j in range(2):  # along the inner (same) level: the outer slices stacked, one call
        assert torch.equal(nested[j], _folded(xx[j], 3, 2))


def test_vmap_randomness_error_raises_like_torch():
    x = torch.randn(4, 3, 8, dtype=F64)
    f = lambda v: _mask(v, 3, seed=2)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"perturbed.*randomness error mode"):
        torch.func.vmap(f)(x)
    with pytest.raises(RuntimeError, match=r"perturbed.*randomness error mode"):
        torch.func.vmap(lambda c: f(x[0]) * c)(torch.ones(2, dtype=F64))
    with pytest.raises(RuntimeError, match=r"perturbed.*randomness error mode"):
        torch.func.jacfwd(f)(x[0])  # jacfwd's default randomness is "error", as for torch ops
    with pytest.raises(RuntimeError, match=r"randomness error mode"):  # torch's, for reference
        torch.func.vmap(lambda v: v + torch.randn(8, generator=seeded(2), dtype=F64))(x)
    # the private Function's own rule says the same, if it is ever reached with batched x
    from softops.topk._perturbed import _fold

    info = type("Info", (), {"randomness": "error", "batch_size": 4})()
    with pytest.raises(RuntimeError, match=r"perturbed.*randomness error mode"):
        _fold(info, (), True)
    assert _fold(info, ((2, False),), False) == ((4, True), (2, False))


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize(("dim", "largest"), [(-1, True), (0, False), (1, True)])
def test_vmap_equals_the_batched_call_on_the_draws_its_flag_names(randomness, dim, largest):
    """Under vmap, "different" is the direct call on the batched tensor (the vmapped dimension
    folded into the rows, one seed), "same" the direct call on each slice (one draw per sample
    shared by the slices); for any dim, largest, and an epsilon per slice and row."""
    g = seeded(4)
    x = torch.randn(3, 5, 7, dtype=F64)  # slices (5, 7): rows along dim
    rows = 7 if dim == 0 else 5
    eps = 0.2 + torch.rand(3, rows, generator=g, dtype=F64)
    n = 5 if dim == 0 else 7

    def f(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return _mask(v, 2, seed=7, n_samples=16, epsilon=e, dim=dim, largest=largest)

    out = torch.func.vmap(f, randomness=randomness)(x, eps)
    assert out.shape == x.shape
    assert torch.equal(out.sum(dim % 2 + 1), torch.full((3, rows), 2.0, dtype=F64))
    if randomness == "same":
        for i in range(3):
            assert torch.equal(out[i], f(x[i], eps[i]))
    else:  # the slices' rows stacked (3 * rows, n): one call, one seed
        xr = (x.transpose(1, 2) if dim == 0 else x).reshape(3 * rows, n)
        ref = _mask(xr, 2, seed=7, n_samples=16, epsilon=eps.reshape(-1), largest=largest)
        ref = ref.reshape(3, rows, n)
        assert torch.equal(out, ref.transpose(1, 2) if dim == 0 else ref)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_over_an_empty_dimension_draws_nothing(randomness):
    """A vmapped dimension of size 0 (which the slices' own shape does not show) has nothing to
    draw: the empty mask, gradient and tangent, no generator advanced. It raised before
    (ZeroDivisionError under "same"; under "different" torch's own random op fails there)."""
    gen = seeded(3)
    state, global_state = gen.get_state(), torch.get_rng_state()
    for generator in (gen, None):

        def f(v: torch.Tensor, generator=generator) -> torch.Tensor:
            return soft_topk_mask(
                v, 2, method="perturbed", epsilon=0.5, n_samples=8, generator=generator
            )

        def loss(v: torch.Tensor, f=f) -> torch.Tensor:
            return (f(v) * torch.arange(8.0, dtype=F64)).sum()

        x = torch.randn(0, 3, 8, dtype=F64)
        out = torch.func.vmap(f, randomness=randomness)(x)
        assert out.shape == (0, 3, 8) and out.dtype == F64
        grads = torch.func.vmap(torch.func.grad(loss), randomness=randomness)(x)
        assert grads.shape == (0, 3, 8)
        tangents = torch.func.vmap(
            lambda v, d, f=f: torch.func.jvp(f, (v,), (d,))[1], randomness=randomness
        )(x, x)
        assert tangents.shape == (0, 3, 8)
        xr = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(torch.func.vmap(f, randomness=randomness)(xr).sum(), xr)
        assert gx.shape == (0, 3, 8)
        # an empty level inside a non-empty one, and empty rows in non-empty slices
        inner = torch.func.vmap(torch.func.vmap(f, randomness=randomness), randomness="different")
        assert inner(torch.randn(2, 0, 3, 8, dtype=F64)).shape == (2, 0, 3, 8)
        empty_rows = torch.func.vmap(f, randomness=randomness)(torch.randn(4, 0, 8, dtype=F64))
        assert empty_rows.shape == (4, 0, 8)
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(torch.get_rng_state(), global_state)
    # and a non-empty call still draws (the generator moves on)
    torch.func.vmap(lambda v: _mask(v, 2), randomness=randomness)(torch.randn(2, 3, 8))


def test_generator_none_under_vmap_and_the_global_seed():
    x = torch.randn(4, 3, 8, dtype=F64)
    f = lambda v: soft_topk_mask(v, 3, method="perturbed", n_samples=16)  # noqa: E731
    torch.manual_seed(5)
    a = torch.func.vmap(f, randomness="different")(x)
    torch.manual_seed(5)
    b = torch.func.vmap(f, randomness="different")(x)
    assert torch.equal(a, b) and not torch.equal(a[0], a[1])  # one seed, folded rows


def test_meta_tensors_give_the_shape_and_draw_nothing():
    state = torch.get_rng_state()
    for dtype in (torch.float16, torch.float32, F64):
        x = torch.empty(3, 4, 6, dtype=dtype, device="meta", requires_grad=dtype != torch.float16)
        out = soft_topk_mask(x, 2, dim=1, epsilon=0.7, method="perturbed")
        assert out.device.type == "meta" and out.shape == x.shape and out.dtype == dtype
        if x.requires_grad:
            (gx,) = torch.autograd.grad(out.sum(), x)
            assert gx.device.type == "meta" and gx.shape == x.shape
    assert torch.equal(torch.get_rng_state(), state)  # no seed was drawn


def test_rows_with_infinities_centre_over_their_finite_entries():
    # k finite entries and the rest -inf: the finite ones are always selected, so the mask is
    # constant and its estimated derivative 0 to rounding (centring over the whole row would
    # leave noise of order |g| / eps there: <g - mean(g), y_s> is a constant times Z_s).
    inf = math.inf
    x = torch.tensor([[-inf, -inf, -inf, 1.0, 2.0, 3.0], [inf, 0.5, -1.0, 2.0, -inf, 0.0]])
    x = x.to(F64)
    g = torch.randn_like(x)
    _, gx = _value_and_grad(x, 3, g, seed=6, epsilon=0.5)
    assert float(gx[0].abs().max()) < 1e-14 and torch.equal(gx[0, :3], torch.zeros(3, dtype=F64))
    _, t = torch.func.jvp(lambda v: _mask(v, 3, seed=6, epsilon=0.5), (x,), (g,))
    assert float(t[0].abs().max()) < 1e-14
    # row 1: the +inf and -inf entries take and give nothing; the finite ones do
    assert gx[1, 0] == 0 and gx[1, 4] == 0 and t[1, 0] == 0 and t[1, 4] == 0
    assert bool((gx[1, [1, 2, 3, 5]] != 0).all()) and bool((t[1, [1, 2, 3, 5]] != 0).all())
