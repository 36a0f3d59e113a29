"""The "softsort" backend (Prillo & Eisenschlos 2020): the l1 scans and the l2 chunked path against
the naive n x n formula, hard limits and memory.

Backends take canonical (B, n) input, a (B,) epsilon and MethodOptions; the public API is tested
in test_api.py and tests/test_sort_contract.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import softops
from softops.sort import _chunked, _softsort
from softops.sort._options import MethodOptions
from tests.sort._helpers import (
    hard_ranks,
    reductions,
    row_eps,
    saved_storage_bytes,
    spaced,
    tie_free,
)

F64 = torch.float64
L1, L2 = MethodOptions(distance="l1"), MethodOptions(distance="l2")


def naive_softsort(x, eps, descending, distance):
    u = torch.sort(x, -1, descending=descending).values
    diff = u.unsqueeze(-1) - x.unsqueeze(1)
    d = diff.abs() if distance == "l1" else diff.square()
    p = torch.softmax(-d / eps.view(-1, 1, 1), dim=-1)
    return p


@pytest.fixture
def small_blocks(monkeypatch):
    """Force several row blocks (with a remainder) in the chunked path."""
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", 7 * 3 * 40)


# ------------------------------------------------------------------ equal to the naive n x n


@pytest.mark.parametrize("distance", ["l1", "l2"])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("eps", [0.3, 1.0, 5.0])
def test_equals_naive_forward_and_gradients(distance, descending, eps, small_blocks):
    opts = MethodOptions(distance=distance)
    x = tie_free(3, 40).requires_grad_()
    e = torch.tensor([eps, 0.5 * eps, 2 * eps], dtype=F64, requires_grad=True)
    p_ref = naive_softsort(x, e, descending, distance)
    v_ref, r_ref = reductions(p_ref, x)
    v = _softsort.sort(x, e, descending, opts)
    r = _softsort.rank(x, e, descending, opts)
    p = _softsort.argsort(x, e, descending, opts)
    torch.testing.assert_close(v, v_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(r, r_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(p, p_ref, atol=1e-10, rtol=0)
    gv, gr, gp = torch.randn_like(v), torch.randn_like(r), torch.randn_like(p)
    for out, ref, g in ((v, v_ref, gv), (r, r_ref, gr), (p, p_ref, gp)):
        got = torch.autograd.grad(out, (x, e), g, retain_graph=True)
        want = torch.autograd.grad(ref, (x, e), g, retain_graph=True)
        for a, b in zip(got, want, strict=True):
            scale = max(1.0, b.abs().max().item())
            torch.testing.assert_close(a / scale, b / scale, atol=1e-9, rtol=0)


def test_softsort_l1_scan_large_magnitudes():
    # offset and small epsilon: the float64 scans stay accurate
    x = tie_free(2, 300) + 1000.0
    e = row_eps(2, 0.05)
    v_ref, r_ref = reductions(naive_softsort(x, e, False, "l1"), x)
    torch.testing.assert_close(_softsort.sort(x, e, False, L1), v_ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(_softsort.rank(x, e, False, L1), r_ref, atol=1e-8, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, 1e3]), min_size=1, max_size=25),
    eps=st.sampled_from([0.05, 0.5, 4.0]),
    descending=st.booleans(),
)
def test_softsort_l1_scan_forward_with_ties(values, eps, descending):
    # the forward is continuous at ties: the scans equal the dense formula there too
    x = torch.tensor([values], dtype=F64)
    e = row_eps(1, eps)
    v_ref, r_ref = reductions(naive_softsort(x, e, descending, "l1"), x)
    v, r = _softsort.sort(x, e, descending, L1), _softsort.rank(x, e, descending, L1)
    torch.testing.assert_close(v, v_ref, atol=1e-9, rtol=1e-12)
    torch.testing.assert_close(r, r_ref, atol=1e-9, rtol=1e-12)


def test_softsort_l1_float32_uses_float64_scans():
    # float32 in, float32 out; as accurate as the naive float32 n x n (the scans run in float64)
    x32 = (tie_free(2, 500) + 100.0).float()
    e = row_eps(2, 1e-2)
    v_ref, r_ref = reductions(naive_softsort(x32.double(), e, False, "l1"), x32.double())
    v_naive, r_naive = reductions(naive_softsort(x32, e.float(), False, "l1"), x32)
    v32 = _softsort.sort(x32, e.float(), False, L1)
    r32 = _softsort.rank(x32, e.float(), False, L1)
    assert v32.dtype == r32.dtype == torch.float32
    assert (r32.double() - r_ref).abs().max() <= (r_naive.double() - r_ref).abs().max() + 1e-5
    assert (v32.double() - v_ref).abs().max() <= (v_naive.double() - v_ref).abs().max() + 1e-5
    assert (r32.double() - r_ref).abs().max() < 1e-3


def test_rank_offset_shifts_the_positions():
    # ranks with an offset o are sum_i (o + i) P_ij, on the l1 scans and the l2 chunked path
    x = tie_free(2, 9)
    e = row_eps(2, 0.7)
    off = torch.tensor([2.0, 0.5], dtype=F64)
    for opts in (L1, L2):
        p = naive_softsort(x, e, False, opts.distance)
        want = reductions(p, x)[1] + off.unsqueeze(-1) * p.sum(-2)
        torch.testing.assert_close(_softsort.rank(x, e, False, opts, off), want)


# ------------------------------------------------------------------ hard limit


@pytest.mark.parametrize("opts", [L1, L2], ids=["l1", "l2"])
@pytest.mark.parametrize("descending", [False, True])
def test_hard_limit(opts, descending):
    x = spaced(3, 30)
    e = row_eps(3, 1e-2)
    p = _softsort.argsort(x, e, descending, opts)
    hard = torch.sort(x, -1, descending=descending)
    one_hot = torch.nn.functional.one_hot(hard.indices, 30).to(F64)
    torch.testing.assert_close(p, one_hot, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        _softsort.sort(x, e, descending, opts), hard.values, atol=1e-10, rtol=0
    )
    torch.testing.assert_close(
        _softsort.rank(x, e, descending, opts), hard_ranks(x, descending), atol=1e-10, rtol=0
    )


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        (
            "softsort-l1",
            lambda x, e: _softsort.sort(x, e, False, L1) + _softsort.rank(x, e, False, L1),
        ),
        ("softsort-l2 rank", lambda x, e: _softsort.rank(x, e, False, L2)),
    ],
)
def test_saved_memory_is_linear(name, fn, monkeypatch):
    n = 3000
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", 64 * n)  # 64 rows per block
    x = torch.randn(1, n, requires_grad=True)
    e = row_eps(1, 0.5, dtype=torch.float32)
    saved = saved_storage_bytes(fn, x, e)
    # far below one n x n float32 matrix (36 MB): a few dozen length-n float64 vectors at most
    assert saved < 64 * n * 8, (name, saved)
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.xfail(
    strict=True,
    reason="known defect (precision at large span/epsilon, the hardening issue): the l1 scans "
    "work in one global log frame, so their values err by ~1e-16 (span/eps) span absolute; "
    "tied entries 1e6 away from an outlier come out 3e-5 apart and out of order",
)
def test_l1_values_of_ties_beside_a_far_outlier_are_equal():
    x = torch.tensor([[-1e6, -2.0, -2.0, -2.0, 0.0]], dtype=torch.float64)
    v = softops.soft_sort(x, epsilon=1.0, method="softsort")
    assert (v.diff(dim=-1) >= 0).all()
    torch.testing.assert_close(v[0, 1:4], v[0, 1:2].expand(3), atol=1e-9, rtol=0)
