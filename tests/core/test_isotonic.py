"""softops._core.isotonic: the PAV solvers (the C++ kernels of ``_isotonic_kernel.cpp`` and their
torch reference, chosen by the kernel layer's switch) and the blockwise VJP helpers, against
brute-force min-max formulas, a plain PAV and scikit-learn. The projection ``P(s, w)`` of sorted
rows is taken as the sort ops take it, ``isotonic.permutahedron`` at z = s / 1 with no sort
(``tests._helpers.project``; ``project_op`` calls its operator).

The kernel is built ahead of time (``python -m softops._kernels``). Where it is not built the tests
of the kernel skip, unless ``SOFTOPS_REQUIRE_KERNELS=1`` (CI sets it), where they fail."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from softops._core import isotonic
from softops._kernels import backend, set_default_backend
from tests._helpers import built_ops, pav_decreasing, project, project_op, seeded

F64 = torch.float64
BACK_ENDS = ["kernel", "reference"]


def require_kernel():
    """The kernel's operators (``torch.ops.softops_isotonic``); skips (fails under
    ``SOFTOPS_REQUIRE_KERNELS=1``) where the kernel is not built."""
    return built_ops(isotonic.KERNEL)


@pytest.fixture(scope="module")
def ops():
    return require_kernel()


def _both(fn, *args):
    """fn(*args) on the kernel and on the reference back end."""
    with backend("kernel"):
        a = fn(*args)
    with backend("reference"):
        b = fn(*args)
    return a, b


# ----------------------------------------------------------------------------- helpers


def _pav_l2_reference(y: list[float]) -> list[float]:
    """Decreasing L2 isotonic regression by the min-max formula (brute force)."""
    n = len(y)
    return [
        min(max(sum(y[i : j + 1]) / (j + 1 - i) for j in range(k, n)) for i in range(k + 1))
        for k in range(n)
    ]


def _lse(values: list[float]) -> float:
    m = max(values)
    if m == -math.inf:
        return -math.inf
    return m + math.log(sum(math.exp(v - m) for v in values))


def _pav_kl_reference(s: list[float], w: list[float]) -> list[float]:
    """Decreasing KL isotonic regression by the min-max formula over block values
    ``logsumexp(s[i:j]) - logsumexp(w[i:j])`` (a log of weighted means, so the formula holds)."""
    n = len(s)
    return [
        min(max(_lse(s[i : j + 1]) - _lse(w[i : j + 1]) for j in range(k, n)) for i in range(k + 1))
        for k in range(n)
    ]


def _check_blocks(v: np.ndarray, block: np.ndarray, value_of) -> None:
    """Blocks are contiguous, numbered 0, 1, ...; v is the block's value on each block, and the
    values of adjacent blocks strictly decrease (ties are pooled)."""
    for row_v, row_b, b in zip(v, block, range(len(v)), strict=True):
        assert row_b[0] == 0
        steps = np.diff(row_b)
        assert ((steps == 0) | (steps == 1)).all()
        values = []
        for k in range(int(row_b[-1]) + 1):
            idx = np.flatnonzero(row_b == k)
            assert len(idx) > 0 and (np.diff(idx) == 1).all()
            expected = value_of(b, idx)
            np.testing.assert_allclose(row_v[idx], expected, rtol=1e-6, atol=1e-9)
            values.append(float(row_v[idx[0]]))
        assert all(p > q for p, q in itertools.pairwise(values)), values


def _fits(kl: bool, s: torch.Tensor, w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The fit ``v = s - P(s, w)`` (float64) and the blocks of a projection of sorted rows."""
    res = project(s, w, kl)
    return (s.double() - res.p.double()).numpy(), res.block.numpy()


def _l2_pair(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows s and w sorted descending with ``s - w = y`` exactly (y of small integers and
    fractions), so that the L2 fit of any y is ``s - P_Q(s, w)``."""
    step = float(y.diff(dim=-1).abs().max()) + 1.0 if y.shape[-1] > 1 else 1.0
    w = -step * torch.arange(y.shape[-1], dtype=y.dtype).expand_as(y)
    return y + w, w


# --------------------------------------------------------------- blockwise VJP helpers


def _random_blocks(n: int, B: int, g: torch.Generator) -> torch.Tensor:
    """Contiguous block ids for B rows: random cuts; row 0 one block, row 1 all singletons."""
    rows = [torch.zeros(n, dtype=torch.int64), torch.arange(n)]
    for _ in range(B - 2):
        cuts = torch.rand(n - 1, generator=g) < 0.35
        rows.append(torch.cat([torch.zeros(1, dtype=torch.int64), cuts.long().cumsum(0)]))
    return torch.stack(rows)


def _loop_block(fn, x: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Apply ``fn`` to each block of each row by explicit loops (any block labelling)."""
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for k in block[b].unique().tolist():
            idx = (block[b] == k).nonzero().squeeze(-1)
            out[b, idx] = fn(x[b, idx])
    return out


@pytest.fixture(params=["contiguous", "scattered"])
def blocks(request) -> torch.Tensor:
    g = seeded(11)
    block = _random_blocks(13, 6, g)
    if request.param == "scattered":  # any labels in [0, n): relabel and permute positions
        relabel = torch.randperm(13, generator=g)
        block = relabel[block][:, torch.randperm(13, generator=g)]
    return block


def test_block_sum_and_mean_match_loops(blocks):
    g = torch.randn(blocks.shape, generator=seeded(12), dtype=F64, requires_grad=True)
    s = isotonic.block_sum(g, blocks)
    m = isotonic.block_mean(g, blocks)
    torch.testing.assert_close(s, _loop_block(lambda t: t.sum().expand_as(t), g.detach(), blocks))
    torch.testing.assert_close(m, _loop_block(lambda t: t.mean().expand_as(t), g.detach(), blocks))
    torch.testing.assert_close(s[0], g[0].sum().expand(13).detach())  # one block: the row sum
    torch.testing.assert_close(m[1], g[1].detach())  # singletons: the identity
    # both are linear, self-adjoint maps: <c, A g> = <A c, g>, and the gradients agree
    c = torch.randn(blocks.shape, generator=seeded(13), dtype=F64)
    (gs,) = torch.autograd.grad((c * s).sum(), g)
    (gm,) = torch.autograd.grad((c * m).sum(), g)
    torch.testing.assert_close(gs, isotonic.block_sum(c, blocks))
    torch.testing.assert_close(gm, isotonic.block_mean(c, blocks))


def test_block_softmax_matches_loops(blocks):
    s = torch.randn(blocks.shape, generator=seeded(14), dtype=F64) * 3
    s[2, 0] += 800.0  # large logits: no overflow
    shared = [i for i in range(13) if (blocks[3] == blocks[3, i]).sum() > 1]
    s[3, shared[0]] = -math.inf  # a -inf inside a block of several gets weight 0
    out = isotonic.block_softmax(s, blocks)
    ref = _loop_block(lambda t: torch.softmax(t, 0), s, blocks)
    torch.testing.assert_close(out, ref)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(isotonic.block_sum(out, blocks), torch.ones_like(out))
    torch.testing.assert_close(out[0], torch.softmax(s[0], 0))  # one block: plain softmax
    assert (out[1] == 1).all()  # singletons
    # differentiable in s: the gradient equals the loop's
    sg = s.clone().requires_grad_(True)
    c = torch.randn(blocks.shape, generator=seeded(15), dtype=F64)
    (ga,) = torch.autograd.grad((c * isotonic.block_softmax(sg, blocks)).sum(), sg)
    sr = s.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(
        (c * _loop_block(lambda t: torch.softmax(t, 0), sr, blocks)).sum(), sr
    )
    torch.testing.assert_close(ga, gr)
    assert torch.isfinite(ga).all()


def test_block_helpers_float32_and_gradcheck():
    block = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    g = torch.randn(2, 6, generator=seeded(16))
    for fn in (isotonic.block_sum, isotonic.block_mean, isotonic.block_softmax):
        assert fn(g, block).dtype == torch.float32
    x = torch.randn(2, 6, generator=seeded(17), dtype=F64, requires_grad=True)
    for fn in (isotonic.block_sum, isotonic.block_mean, isotonic.block_softmax):
        assert torch.autograd.gradcheck(lambda t, fn=fn: fn(t, block), (x,))


# ------------------------------------------------- the PAV core, through the projections


@pytest.mark.parametrize("back_end", BACK_ENDS)
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_l2_fits_match_min_max_formula_and_plain_pav(dtype, back_end):
    if back_end == "kernel":
        require_kernel()
    g = seeded(3)
    y = torch.randint(-3, 4, (6, 11), generator=g).to(F64)
    y[1:3] += torch.randint(-4, 5, (2, 11), generator=g) / 8
    y[3] = 2.0  # all tied: one block
    y[4] = torch.arange(11, dtype=F64)  # increasing: one block, the mean
    y[5] = -torch.arange(11, dtype=F64)  # strictly decreasing: n singleton blocks
    s, w = (t.to(dtype) for t in _l2_pair(y))
    with backend(back_end):
        v, block = _fits(False, s, w)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for row, vr, br in zip(y.tolist(), v, block, strict=True):
        np.testing.assert_allclose(vr, _pav_l2_reference(row), rtol=tol, atol=tol)
        fit, ids = pav_decreasing(row)
        np.testing.assert_allclose(vr, fit, rtol=tol, atol=tol)
        assert br.tolist() == ids
    assert (block[3] == 0).all() and (block[4] == 0).all()
    np.testing.assert_allclose(v[4], 5.0)
    assert (block[5] == np.arange(11)).all() and (v[5] == y[5].numpy()).all()
    _check_blocks(v, block, lambda b, idx: y.numpy()[b, idx].mean())


@pytest.mark.parametrize("back_end", BACK_ENDS)
def test_l2_fits_match_sklearn_and_pool_ties(back_end):
    sk = pytest.importorskip("sklearn.isotonic")
    if back_end == "kernel":
        require_kernel()
    g = seeded(4)
    y = torch.randn(5, 50, generator=g, dtype=F64).cumsum(-1) * 0.3
    y += torch.randn(5, 50, generator=g, dtype=F64)
    s, w = _l2_pair(y)
    with backend(back_end):
        v, block = _fits(False, s, w)
        for row, vr in zip((s - w).numpy(), v, strict=True):
            ref = sk.IsotonicRegression(increasing=False).fit_transform(np.arange(50), row)
            np.testing.assert_allclose(vr, ref, rtol=0, atol=1e-12)
        _check_blocks(v, block, lambda b, idx: (s - w).numpy()[b, idx].mean())
        # equal neighbours are pooled (the test is `<=`), exact block ids
        ties = torch.tensor([[3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 2.0, 0.0, 5, 5, 5]])
        v, block = _fits(False, *_l2_pair(ties.to(F64)))
        assert block.tolist() == [[0, 1, 1, 2, 2, 2, 3], [0, 0, 0, 0, 0, 0, 0]]
        np.testing.assert_allclose(v[0], ties[0].numpy())
        np.testing.assert_allclose(v[1], np.full(7, 19.0 / 7))
        # one column: the identity
        col = torch.tensor([[2.5], [-1.0]], dtype=F64)
        v, block = _fits(False, col, torch.zeros(1, 1, dtype=F64))
        assert (v == col.numpy()).all() and (block == 0).all()


@pytest.mark.parametrize("back_end", BACK_ENDS)
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_kl_fits_match_min_max_formula(dtype, back_end):
    if back_end == "kernel":
        require_kernel()
    g = seeded(6)
    s = torch.randn(6, 10, generator=g, dtype=F64).sort(-1, descending=True).values
    w = torch.randn(6, 10, generator=g, dtype=F64).sort(-1, descending=True).values
    s[1] = torch.randint(0, 3, (10,), generator=g).to(F64).sort(descending=True).values  # ties
    w[1] = 0.0  # and s - w tied too
    s[2, -1] = -math.inf  # exp(s) = 0 at one position
    s[3] = 1.0  # s - w increasing: one block
    w[3] = -torch.arange(10, dtype=F64)
    s[4] = -torch.arange(10, dtype=F64) * 2  # s - w strictly decreasing: singletons
    w[4] = 0.0
    s, w = s.to(dtype), w.to(dtype)
    with backend(back_end):
        res = project(s, w, True)
    s64, w64 = s.double().numpy(), w.double().numpy()
    v, block = s64 - res.p.double().numpy(), res.block.numpy()
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for sr, wr, vr in zip(s64.tolist(), w64.tolist(), v, strict=True):
        np.testing.assert_allclose(vr, _pav_kl_reference(sr, wr), rtol=tol, atol=tol)
    assert (block[3] == 0).all() and (block[4] == np.arange(10)).all()
    np.testing.assert_allclose(v[4], s64[4] - w64[4])

    def kl_value(b, idx):
        return _lse(s64[b, idx].tolist()) - _lse(w64[b, idx].tolist())

    _check_blocks(v, block, kl_value)


@pytest.mark.parametrize("back_end", BACK_ENDS)
def test_kl_fits_are_a_weighted_isotonic_regression(back_end):
    """v_KL(s, w) = log of the weighted decreasing isotonic regression of e^(s-w), weights e^w."""
    sk = pytest.importorskip("sklearn.isotonic")
    if back_end == "kernel":
        require_kernel()
    g = seeded(7)
    s = torch.randn(4, 40, generator=g, dtype=F64).sort(-1, descending=True).values
    w = (torch.randn(4, 40, generator=g, dtype=F64) * 0.5).sort(-1, descending=True).values
    with backend(back_end):
        v, _ = _fits(True, s, w)
        for sr, wr, vr in zip(s.numpy(), w.numpy(), v, strict=True):
            iso = sk.IsotonicRegression(increasing=False)
            ref = iso.fit_transform(np.arange(40), np.exp(sr - wr), sample_weight=np.exp(wr))
            np.testing.assert_allclose(vr, np.log(ref), rtol=0, atol=1e-10)
        # equal values s - w are pooled: one block, value log(sum e^s) - log(sum e^w)
        s = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
        w = torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.0, -1.0]], dtype=F64)
        v, block = _fits(True, s, w)
    assert block.tolist() == [[0, 0, 0], [0, 0, 0]]
    np.testing.assert_allclose(v[0], 0.0, atol=1e-12)
    np.testing.assert_allclose(v[1], math.log(3.0) - float(torch.logsumexp(w[1], -1)))


@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_kernel_equals_the_reference_with_ties_and_infinities(kl, dtype, ops):
    proj = partial(project, kl=kl)
    g = seeded(8)
    s = torch.randn(7, 60, generator=g, dtype=dtype).sort(-1, descending=True).values
    w = torch.randn(7, 60, generator=g, dtype=dtype).sort(-1, descending=True).values
    s[1] = torch.randint(0, 3, (60,), generator=g).to(dtype).sort(descending=True).values
    s[2, :3] = math.inf
    s[3, -2:] = -math.inf
    s[4, 0] = math.nan
    a, b = _both(proj, s, w)
    torch.testing.assert_close(a.p, b.p, equal_nan=True)
    assert torch.equal(a.block, b.block) and a.finite is b.finite is False


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(-3, 3), min_size=1, max_size=12),
    st.sampled_from([1e-3, 1.0, 1e6]),
    st.booleans(),
)
@example([0, 1, 1, 3], 1.0, False)  # (s - w tied: pooled)
@example([0, 1, 1, 3], 1.0, True)
def test_kernel_equals_the_reference_with_ties_and_magnitudes(values, scale, kl):
    require_kernel()
    proj = partial(project, kl=kl)
    s = torch.tensor([sorted(values, reverse=True)], dtype=F64) * scale
    w = torch.arange(len(values), 0, -1, dtype=F64)[None]
    a, b = _both(proj, s, w)
    torch.testing.assert_close(a.p, b.p)
    assert torch.equal(a.block, b.block)


def test_default_backend_follows_the_kernel_layer_switch(monkeypatch):
    calls = []
    torch_code = isotonic._torch_project_gaps  # (the torch reference's PAV)
    monkeypatch.setattr(
        isotonic, "_torch_project_gaps", lambda *a: calls.append("torch") or torch_code(*a)
    )
    s = torch.randn(2, 3).sort(-1, descending=True).values
    with backend("reference"):
        project(s, s)
    assert calls == ["torch"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        built = isotonic.KERNEL.ops() is not None
    project(s, s)  # out of the box: the kernel's where built
    assert calls == (["torch"] if built else ["torch", "torch"])


# ------------------------------------------------------- projections P(s, w) = s - v, any scale


def _proj_reference(s: list[float], w: list[float], kl: bool) -> list[float]:
    """s - v by the brute-force min-max formulas (float64; accurate at moderate scales)."""
    if kl:
        v = _pav_kl_reference(s, w)
    else:
        v = _pav_l2_reference([a - b for a, b in zip(s, w, strict=True)])
    return [a - b for a, b in zip(s, v, strict=True)]


def _sorted_pair(B: int, n: int, scale: float, dtype, g: torch.Generator):
    s = (torch.randn(B, n, generator=g, dtype=F64) * scale).sort(-1, descending=True).values
    w = (torch.randn(B, n, generator=g, dtype=F64)).sort(-1, descending=True).values
    s[1, 2:6] = s[1, 2]  # ties in s
    w[2] = w[2, 0]  # w constant
    s[3] = s[3] * 1e-3  # s - w increasing: pooled
    return s.to(dtype), w.to(dtype)


@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_projection_matches_reference_and_backends_agree(kl, dtype, ops):
    proj = partial(project, kl=kl)
    g = seeded(21)
    for scale in [0.3, 3.0, 30.0]:
        s, w = _sorted_pair(5, 9, scale, dtype, g)
        a, b = _both(proj, s, w)
        assert a.p.dtype == dtype and (a.block == b.block).all()
        tol = 1e-5 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(a.p, b.p, rtol=tol, atol=tol)
        for sr, wr, pr in zip(s.double().tolist(), w.double().tolist(), a.p, strict=True):
            ref = torch.tensor(_proj_reference(sr, wr, kl), dtype=F64)
            torch.testing.assert_close(pr.double(), ref, rtol=10 * tol, atol=10 * tol)
        # one row of w for every row gives the same as the expanded w
        one, one_ref = _both(proj, s, w[:1])
        with backend("kernel"):
            assert torch.equal(one.p, proj(s, w[:1].expand_as(s)).p)
        torch.testing.assert_close(one.p, one_ref.p, rtol=tol, atol=tol)
        # and one row of s for every row (the sort's rho / epsilon)
        row, row_ref = _both(proj, s[:1], w)
        assert row.p.shape == (5, 9)
        torch.testing.assert_close(row.p, row_ref.p, rtol=tol, atol=tol)


@pytest.mark.parametrize("back_end", BACK_ENDS)
@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("scale", [1e-12, 1e12])
def test_projection_singletons_are_exact_at_any_scale(scale, kl, back_end):
    """Singleton blocks give w itself, bit for bit, however far s is from w (no cancellation)."""
    if back_end == "kernel":
        require_kernel()
    proj = partial(project, kl=kl)
    n = 7
    w = torch.arange(n, 0, -1, dtype=F64)[None].log() if kl else torch.arange(n, 0, -1.0)[None]
    w = w.to(F64)
    s = (torch.arange(n, 0, -1, dtype=F64) * 10.0 * scale + 1e3 * scale)[None]
    with backend(back_end):
        res = proj(s.expand(2, n), w)
    if scale > 1:  # s gaps far above w's: all singletons, p = w exactly
        assert (res.block == torch.arange(n)).all()
        assert torch.equal(res.p, w.expand(2, n))
    else:  # s gaps far below w's: one block, p = s - mean(s) + mean(w)
        assert (res.block == 0).all()
        expected = torch.logsumexp(w, -1) - math.log(n) if kl else w.mean()
        torch.testing.assert_close(res.p, torch.full((2, n), float(expected), dtype=F64))


def test_projection_on_one_thread_and_on_several_agree(ops):
    """The rows spread over torch's threads (at::parallel_for): the same bits on one thread, on
    several, and row by row."""
    g = seeded(22)
    s, w = _sorted_pair(2000, 50, 2.0, torch.float64, g)  # several tasks of rows
    s[[3, 1500], 0] = math.inf
    threads = torch.get_num_threads()

    def kernel(s, w, kl):  # (p, block, bad) of the kernel's permutahedron at z = s / 1
        mode = isotonic.MODE_KL if kl else 0
        p, _, _, block, bad = ops.permutahedron(s, w, s.new_ones(s.shape[0]), mode)
        return p, block, bad

    for kl in (False, True):
        outs = []
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            try:
                outs.append(kernel(s, w, kl))
            finally:
                torch.set_num_threads(threads)
        (p1, b1, bad1), (p2, b2, bad2) = outs
        assert torch.equal(p1, p2) and torch.equal(b1, b2) and int(bad1) == int(bad2) == 2
        for b in (0, 3, 1999):
            pb, bb, _ = kernel(s[b : b + 1], w[b : b + 1], kl)
            assert torch.equal(pb[0], p1[b]) and torch.equal(bb[0], b1[b])


@pytest.mark.parametrize("back_end", [*BACK_ENDS, None])
def test_meta_tensors_give_shapes_only(back_end, monkeypatch):
    """Meta tensors have no data: ``permutahedron`` returns meta outputs of the right shapes and
    dtypes without reaching a kernel (which would need the values), and no rows to mark."""
    if back_end is not None:
        set_default_backend(back_end)

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran on meta tensors")

    for name in ("PERMUTAHEDRON_OP", "_torch_project_gaps"):
        monkeypatch.setattr(isotonic, name, no_kernel)
    for dtype in (torch.float32, F64):
        s = torch.empty(4, 6, dtype=dtype, device="meta")
        for w in (torch.empty(1, 6, dtype=dtype, device="meta"), torch.empty(4, 6, device="cpu")):
            for kl in (False, True):
                p, block, finite = project(s, w, kl)
                assert p.is_meta and block.is_meta and finite is True  # (no limits to mark)
                assert p.shape == block.shape == (4, 6)
                assert p.dtype == dtype and block.dtype == torch.int64


@pytest.mark.parametrize("back_end", BACK_ENDS)
@pytest.mark.parametrize("kl", [False, True])
def test_projection_reports_whether_every_row_was_finite(kl, back_end):
    """The kernels count the rows that took the plain formulas (a non-finite entry in s or w),
    so that the caller applies its limits only then, without a pass of its own."""
    if back_end == "kernel":
        require_kernel()
    set_default_backend(back_end)
    proj = partial(project, kl=kl)
    g = seeded(4)
    s, w = _sorted_pair(5, 9, 1.0, torch.float64, g)
    assert proj(s, w).finite is True
    for bad in (math.inf, -math.inf, math.nan):
        s2 = s.clone()
        s2[3, 0 if bad != -math.inf else -1] = bad
        res = proj(s2, w)
        assert res.finite is False
        fine = [0, 1, 2, 4]  # the other rows are unchanged
        assert torch.equal(res.p[fine], proj(s, w).p[fine])
    w2 = w.clone()
    w2[1, 0] = math.inf
    assert proj(s, w2).finite is False
    # the operator counts the rows
    s2 = s.clone()
    s2[[0, 3], 0] = math.inf
    _, _, count = project_op(s2, w, kl)
    assert count.shape == () and count.dtype == torch.int64 and int(count) == 2


def _vjp_host(g, pz, pw, block, want_z, want_w):
    """``l2_vjp_host_scaled`` without a scaling of z: ``(gz, gw, None)``, or None off the kernel."""
    return isotonic.l2_vjp_host_scaled(g, pz, pw, block, want_z, want_w, None, None, 0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_l2_vjp_host_matches_the_block_mean_formula(dtype, ops, monkeypatch):
    set_default_backend("kernel")
    g = seeded(9)
    s, w = _sorted_pair(5, 12, 1.0, dtype, g)
    block = project(s, w).block
    cot = torch.randn(5, 12, generator=g, dtype=F64).to(dtype)
    pz = torch.stack([torch.randperm(12, generator=g) for _ in range(5)])
    pw = torch.stack([torch.randperm(12, generator=g) for _ in range(5)])
    for perm_z, perm_w in ((pz, None), (None, pw), (pz, pw), (None, None)):
        gs = cot if perm_z is None else cot.gather(1, perm_z)
        mean = isotonic.block_mean(gs, block)
        want_z = gs - mean
        if perm_z is not None:
            want_z = torch.empty_like(gs).scatter(1, perm_z, want_z)
        want_w = mean if perm_w is None else torch.empty_like(mean).scatter(1, perm_w, mean)
        gz, gw, _ = _vjp_host(cot, perm_z, perm_w, block, True, True)
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        torch.testing.assert_close(gz, want_z, rtol=tol, atol=tol)
        torch.testing.assert_close(gw, want_w, rtol=tol, atol=tol)
        assert gz.dtype == dtype and gw.dtype == dtype
    assert _vjp_host(cot, pz, None, block, True, False)[1] is None
    assert _vjp_host(cot[:, ::2], None, None, block[:, :6], True, True) is not None
    set_default_backend("reference")
    assert _vjp_host(cot, pz, None, block, True, False) is None  # torch form then


# ------------------------------------------------- the fused l2 VJP operator and block_max


@pytest.mark.parametrize("back_end", BACK_ENDS)
def test_l2_vjp_operator_is_the_block_mean_written_out(back_end):
    if back_end == "kernel":
        require_kernel()
    rng = np.random.default_rng(0)
    B, n = 3, 6
    g = rng.standard_normal((B, n))
    pz = np.stack([rng.permutation(n) for _ in range(B)]).astype(np.int64)
    pw = np.stack([rng.permutation(n) for _ in range(B)]).astype(np.int64)
    block = np.array([[0, 0, 1, 2, 2, 2], [0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0]], np.int64)
    gs = np.take_along_axis(g, pz, 1)
    mean = np.stack([[gs[b, block[b] == block[b, j]].mean() for j in range(n)] for b in range(B)])
    want_z, want_w = np.empty((B, n)), np.empty((B, n))
    np.put_along_axis(want_z, pz, gs - mean, 1)
    np.put_along_axis(want_w, pw, mean, 1)
    t = torch.from_numpy
    with backend(back_end):
        gz, gw, r = isotonic.L2_VJP_OP(t(g), t(pz), t(pw), t(block), True, True, None, None, 0)
        assert r.shape == (0,)
        np.testing.assert_allclose(gz.numpy(), want_z, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gw.numpy(), want_w, rtol=1e-12, atol=1e-12)
        gz0, gw0, _ = isotonic.L2_VJP_OP(t(g), t(pz), None, t(block), True, False, None, None, 0)
        assert gz0.shape == (B, n) and gw0.shape == (B, 0)
        # with z = u / eps: gz / eps, and the gradient in eps,
        # -sum_j (gs_j - m_j)(u_j - u_ref(j)) / eps**2, u in z's order
        u = rng.standard_normal((B, n))
        eps = np.array([2.0, 0.5, 4.0])
        us = np.take_along_axis(u, pz, 1)
        first = np.stack(
            [[us[b, np.argmax(block[b] == block[b, j])] for j in range(n)] for b in range(B)]
        )
        rel = ((gs - mean) * (us - first)).sum(1)
        gz2, _, ge = isotonic.L2_VJP_OP(t(g), t(pz), t(pw), t(block), True, True, t(u), t(eps), 0)
        np.testing.assert_allclose(ge.numpy(), -rel / eps**2, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gz2.numpy(), want_z / eps[:, None], rtol=1e-12, atol=1e-12)
        # the descending rank (z = u / -eps: dz/deps = u / eps**2) and the ascending sort
        # (-P(z, -w) with z = u * (1 / eps): gz negated, ge = <J^T g, z - z_ref> / eps)
        flip, inv, neg = isotonic.MODE_FLIP, isotonic.MODE_INV, isotonic.MODE_NEGATE
        gz3, _, ge3 = isotonic.L2_VJP_OP(
            t(g), t(pz), None, t(block), True, False, t(u), t(eps), flip
        )
        np.testing.assert_allclose(ge3.numpy(), rel / eps**2, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gz3.numpy(), -want_z / eps[:, None], rtol=1e-12, atol=1e-12)
        gz4, _, ge4 = isotonic.L2_VJP_OP(
            t(g), t(pz), None, t(block), True, False, t(u), t(eps), inv | neg
        )
        np.testing.assert_allclose(ge4.numpy(), rel / eps**2, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gz4.numpy(), -want_z / eps[:, None], rtol=1e-12, atol=1e-12)
        # the sort's z = u * (1 / eps) at a tiny epsilon: no cap on 1 / eps, the same -rel / eps**2
        tiny = np.array([2.3e-154, 0.5, 4.0])
        _, _, ge5 = isotonic.L2_VJP_OP(t(g), t(pz), None, t(block), True, False, t(u), t(tiny), inv)
        np.testing.assert_allclose(ge5.numpy(), -rel / tiny**2, rtol=1e-12, atol=1e-12)
        # one row of u for every row
        _, _, ge1 = isotonic.L2_VJP_OP(
            t(g), t(pz), None, t(block), True, False, t(u[:1]), t(eps), 0
        )
        us1 = np.take_along_axis(np.repeat(u[:1], B, 0), pz, 1)
        first1 = np.stack(
            [[us1[b, np.argmax(block[b] == block[b, j])] for j in range(n)] for b in range(B)]
        )
        np.testing.assert_allclose(
            ge1.numpy(), -((gs - mean) * (us1 - first1)).sum(1) / eps**2, rtol=1e-12, atol=1e-12
        )


def _op_args(dtype):
    g = seeded(31)
    s, w = _sorted_pair(5, 9, 2.0, dtype, g)
    s[2, 0] = math.inf
    block = project(s, w).block
    cot = torch.randn(5, 9, generator=g, dtype=dtype)
    pz = torch.stack([torch.randperm(9, generator=g) for _ in range(5)])
    u = torch.randn(5, 9, generator=g, dtype=dtype)
    eps = torch.rand(5, generator=g, dtype=dtype) + 0.1
    rho = torch.arange(9, 0, -1, dtype=dtype)[None]
    ones = torch.ones(5, dtype=dtype)
    rank, kl_rank = (
        isotonic.MODE_SORT_Z,
        isotonic.MODE_SORT_Z | isotonic.MODE_KL | isotonic.MODE_EXP,
    )
    sort = isotonic.MODE_SORT_W | isotonic.MODE_NEGATE | isotonic.MODE_INV
    return [
        (isotonic.PERMUTAHEDRON_OP, (s, w, ones, 0)),  # (z = s / 1, no sort)
        (isotonic.PERMUTAHEDRON_OP, (s, w[:1], ones, isotonic.MODE_KL)),
        (isotonic.PERMUTAHEDRON_OP, (u, rho, eps, rank | isotonic.MODE_FLIP)),
        (isotonic.PERMUTAHEDRON_OP, (u, rho, eps, kl_rank)),
        (isotonic.PERMUTAHEDRON_OP, (rho, u, eps, sort)),
        (isotonic.PERMUTAHEDRON_OP, (rho, u[:1], eps, sort | isotonic.MODE_KL)),
        (isotonic.L2_VJP_OP, (cot, pz, None, block, True, False, None, None, 0)),
        (isotonic.L2_VJP_OP, (cot, None, pz, block, True, True, u, eps, isotonic.MODE_INV)),
    ]


@pytest.mark.parametrize("back_end", BACK_ENDS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_the_operators_pass_opcheck_on_either_back_end(back_end, dtype):
    """Schema, fake (meta) implementation and dispatch of the two operators."""
    if back_end == "kernel":
        require_kernel()
    with backend(back_end):
        for op, args in _op_args(dtype):
            torch.library.opcheck(op.overload, args)


@pytest.mark.parametrize("back_end", BACK_ENDS)
def test_the_operator_under_vmap_is_the_merged_call(back_end):
    """(PERMUTAHEDRON_OP has no vmap rule of its own, the sort ops fold vmapped rows before it:
    torch's batching fallback, row by row, gives the merged call's blocks, and its values: the
    kernel's bits, the torch code's within an ulp, since torch's elementwise kernels take an
    entry through their vector body or their scalar tail by its place in the call, and the two
    exponentials differ in the last bit on an AVX2 build.)"""
    if back_end == "kernel":
        require_kernel()
    g = seeded(32)
    s = torch.randn(3, 4, 9, generator=g, dtype=F64).sort(-1, descending=True).values
    w = torch.randn(1, 9, generator=g, dtype=F64).sort(-1, descending=True).values
    with backend(back_end):
        for kl in (False, True):
            p, block, _ = torch.func.vmap(lambda t, kl=kl: project_op(t, w, kl))(s)
            ref = project_op(s.reshape(12, 9), w, kl)
            assert torch.equal(block.reshape(12, 9), ref[1])
            if back_end == "kernel":
                assert torch.equal(p.reshape(12, 9), ref[0])
            else:
                torch.testing.assert_close(p.reshape(12, 9), ref[0], rtol=4e-16, atol=4e-16)


def test_the_kernel_refuses_malformed_arguments(ops):
    s, ones = torch.zeros(3, 10), torch.ones(3)
    with pytest.raises(RuntimeError, match="must be \\(B, n\\) or \\(1, n\\), eps \\(B,\\)"):
        ops.permutahedron(s, torch.zeros(2, 10), ones, 0)
    with pytest.raises(RuntimeError, match="must be \\(B, n\\) or \\(1, n\\), eps \\(B,\\)"):
        ops.permutahedron(s, torch.zeros(1, 10), torch.ones(2), 0)
    with pytest.raises(RuntimeError, match="u, w and eps must have one dtype"):
        ops.permutahedron(s, torch.zeros(3, 10, dtype=F64), ones, 0)
    with pytest.raises(RuntimeError, match="expected \\(B, n\\) tensors"):
        ops.permutahedron(torch.zeros(10), torch.zeros(1, 10), torch.ones(1), 0)
    g, block = torch.zeros(2, 4), torch.tensor([[0, 1, 1, 2], [0, 0, 5, 5]])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.l2_vjp(g, None, None, block, True, True, None, None, False)
    bad_perm = torch.tensor([[0, 1, 2, 9], [0, 1, 2, 3]])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.l2_vjp(
            g, bad_perm, None, torch.zeros(2, 4, dtype=torch.int64), True, True, None, None, False
        )
    # an index in range that repeats, in pz or pw, on rows of 4 (the vector lanes' length) and 12
    for n in (4, 12):
        g, block, good = torch.zeros(2, n), torch.zeros(2, n, dtype=torch.int64), torch.arange(n)
        repeated = good.clone()
        repeated[1] = 0
        for pz, pw in ((repeated, good), (good, repeated)):
            with pytest.raises(RuntimeError, match="must be permutations"):
                ops.l2_vjp(g, torch.stack([good, pz]), torch.stack([good, pw]), block, True, True,
                           None, None, False)  # fmt: skip
    p, _, _, block, bad = ops.permutahedron(
        torch.zeros(0, 10), torch.zeros(1, 10), ones[:0], isotonic.MODE_KL
    )
    assert p.shape == block.shape == (0, 10) and bad == 0


def test_block_max_is_the_largest_entry_of_each_block_and_detached():
    s = torch.tensor([[3.0, 1.0, 5.0, -math.inf, 2.0], [0.0, 0.0, 7.0, 1.0, math.inf]])
    s.requires_grad_(True)
    block = torch.tensor([[0, 0, 1, 1, 2], [0, 1, 1, 2, 2]])
    got = isotonic.block_max(s, block)
    want = torch.tensor([[3.0, 3.0, 5.0, 5.0, 2.0], [0.0, 7.0, 7.0, math.inf, math.inf]])
    assert torch.equal(got, want) and not got.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(
    "n", [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 49, 63, 64, 65, 256, 257, 3000, 20000]
)
def test_the_kernels_sort_is_torch_sort_stable_descending(dtype, n):
    # the permutation the projection's kernel sorts z by (a sorting network, a bitonic sort in
    # AVX-512 registers, insertion, std::sort or a radix sort, by n and the dtype) is
    # torch.sort(stable=True, descending=True)'s: ties in index order,
    # NaN first, -0 as +0, infinities at the ends
    require_kernel()
    g = seeded(40 + n)
    x = torch.randint(-5, 5, (3, n), generator=g).to(dtype) / 4  # many ties
    x[1] = torch.randn(n, generator=g, dtype=dtype) * 1e30
    x[2, ::5] = -0.0
    x[2, 1::7] = math.nan
    x[2, 2::11] = math.inf
    x[2, 3::13] = -math.inf
    eps = torch.ones(3, dtype=dtype)
    rho = torch.arange(n, 0, -1, dtype=dtype)[None]
    with backend("kernel"):
        _, pz, _, _, _ = isotonic.PERMUTAHEDRON_OP(x, rho, eps, isotonic.MODE_SORT_Z)
    assert torch.equal(pz, torch.sort(x, descending=True, stable=True).indices)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n", range(2, 9))
def test_the_kernels_network_sort_of_short_rows_on_every_zero_one_row_and_permutation(dtype, n):
    # rows of up to 8 entries take a sorting network: by the 0-1 principle it sorts every row iff
    # it sorts every row of zeros and ones, here all 2**n of them (ties: the index order must
    # survive), and every permutation of n distinct values (n <= 7: all n! of them)
    require_kernel()
    bits = torch.arange(2**n)[:, None] >> torch.arange(n) & 1
    perms = torch.tensor(list(itertools.permutations(range(n))) if n <= 7 else [], dtype=dtype)
    x = torch.cat([bits.to(dtype), perms.reshape(-1, n) - 3.5])
    eps = torch.ones(x.shape[0], dtype=dtype)
    rho = torch.arange(n, 0, -1, dtype=dtype)[None]
    with backend("kernel"):
        _, pz, _, _, _ = isotonic.PERMUTAHEDRON_OP(x, rho, eps, isotonic.MODE_SORT_Z)
    assert torch.equal(pz, torch.sort(x, descending=True, stable=True).indices)


@pytest.mark.parametrize("n", [16, 32, 64, 128, 256])
def test_the_kernels_bitonic_sort_of_float32_rows_on_zero_one_rows(n):
    # float32 rows of 9 to 256 entries take a bitonic network in AVX-512 registers (where the
    # kernel was built with it): for n = 16 every row of zeros and ones (the 0-1 principle: the
    # network sorts every row; the index order of ties must survive), for 32 to 256 random ones,
    # their permutations and rows of a few distinct values, each padded past n by the network
    require_kernel()
    g = seeded(50 + n)
    if n == 16:
        bits = torch.arange(2**n)[:, None] >> torch.arange(n) & 1
    else:
        bits = torch.randint(0, 2, (4000, n), generator=g)
    perms = torch.argsort(torch.rand(500, n, generator=g), -1)
    few = torch.randint(-2, 3, (500, n), generator=g)
    x = torch.cat([bits, perms, few]).to(torch.float32)
    for m in (n, n - 3):  # (a row that does not fill its last vector)
        xm = x[:, :m].contiguous()
        eps = torch.ones(xm.shape[0])
        rho = torch.arange(m, 0, -1, dtype=torch.float32)[None]
        with backend("kernel"):
            _, pz, _, _, _ = isotonic.PERMUTAHEDRON_OP(xm, rho, eps, isotonic.MODE_SORT_Z)
        assert torch.equal(pz, torch.sort(xm, descending=True, stable=True).indices)


def _bits(t):
    """t's bit pattern (floats as integers: -0 and NaN payloads count), for equality tests."""
    return t.view({torch.float32: torch.int32, F64: torch.int64}.get(t.dtype, t.dtype))


def _short_rows(n, dtype, g):
    """19 rows of n (two groups of 8 and 3 more) of every kind the short-row path meets or hands
    back: random, ties, zeros of both signs, infinities, NaN, near the dtype's largest (the scaled
    frame), subnormal, each kind spread over the lanes of both groups."""
    info = torch.finfo(dtype)
    x = torch.randn(19, n, generator=g, dtype=F64)
    x[1::6] = torch.randint(-1, 2, (len(range(1, 19, 6)), n), generator=g).double()
    x[2::6] = x[2::6].round() * 0.0 * x[2::6].sign()
    x[3::6] *= info.max / 4
    x[4::6] *= info.tiny / 8
    x = x.to(dtype)
    x[5, 0], x[11, -1], x[17, n // 2] = math.inf, -math.nan, -math.inf
    return x


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n", range(1, 10))
def test_the_short_row_lanes_equal_the_row_path_bit_for_bit(dtype, n, ops):
    # rows of n <= 8 are solved eight at a time, a row per vector lane, where the kernel is built
    # for AVX-512 or AVX2 (the AVX2 build: the test below)
    # (the rows they cannot take, and the rest, on the row path): every output of a batch, L2
    # projection and VJP, is that of its rows called one at a time (the row path), bit for bit,
    # in every L2 mode, the sort's (one row of rho, rows of w) and the rank's (rows of u)
    g = seeded(70 + n)
    x = _short_rows(n, dtype, g)
    B = x.shape[0]
    eps = torch.rand(B, generator=g, dtype=F64).to(dtype) + 0.25
    rho = torch.arange(n, 0, -1, dtype=dtype)[None]
    cot = torch.randn(B, n + 2, generator=g, dtype=F64).to(dtype)[:, 1 : n + 1]  # (row stride)
    M = isotonic
    for mode in range(0, 128, 2):  # (even: L2)
        if mode & M.MODE_EXP:
            continue
        for u, w in ((rho, x), (x, rho), (x, x.flip(0))):
            batch = ops.permutahedron(u, w, eps, mode)
            rows = [
                ops.permutahedron(
                    u[b : b + 1] if u.shape[0] > 1 else u,
                    w[b : b + 1] if w.shape[0] > 1 else w,
                    eps[b : b + 1],
                    mode,
                )
                for b in range(B)
            ]
            for k in range(4):
                got = batch[k]
                if got.shape[0] == B:
                    want = torch.cat([r[k] for r in rows])
                    assert torch.equal(_bits(got), _bits(want)), (mode, k)
            assert batch[4] == sum(r[4] for r in rows)
            pz = batch[1] if mode & M.MODE_SORT_Z else None
            pw = batch[2] if mode & M.MODE_SORT_W and batch[2].shape[0] == B else None
            for want_z, want_w, e in ((True, True, None), (False, True, eps), (True, False, eps)):
                vjp = ops.l2_vjp(cot, pz, pw, batch[3], want_z, want_w, None, e, mode)
                for k in range(2):
                    want = torch.cat(
                        [
                            ops.l2_vjp(
                                cot[b : b + 1],
                                None if pz is None else pz[b : b + 1],
                                None if pw is None else pw[b : b + 1],
                                batch[3][b : b + 1],
                                want_z,
                                want_w,
                                None,
                                None if e is None else e[b : b + 1],
                                mode,
                            )[k]
                            for b in range(B)
                        ]
                    )
                    assert torch.equal(_bits(vjp[k]), _bits(want)), (mode, want_z, want_w, k)


@pytest.mark.slow
def test_the_short_row_lanes_equal_the_row_path_on_an_avx2_build_too():
    # the lanes are compiled per CPU capability (AVX-512: a vector of eight; AVX2: two halves of
    # four, masks as vectors), and a run meets only its machine's: the lane test again in a process
    # that torch, and so softops' build, takes for an AVX2 machine (a kernel build, then cached)
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    check = "import torch; assert torch.backends.cpu.get_cpu_capability() == 'AVX2'"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    args = [
        "-m",
        "pytest",
        "-q",
        "-pno:cacheprovider",
        __file__,
        "-k",
        "lanes_equal_the_row_path_bit",
    ]
    done = subprocess.run(
        [sys.executable, *args], env=env, cwd=root, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert "18 passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-4000:]
