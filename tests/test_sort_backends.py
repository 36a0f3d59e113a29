"""Private sort backends: softsort (l1 scans, l2 chunked), neuralsort and ot.

Each backend takes canonical (B, n) input and a (B,) epsilon; the public API is tested elsewhere.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from softops._core import sinkhorn
from softops.sort import _neuralsort, _ot, _softsort

F64 = torch.float64


def _tie_free(B: int, n: int, scale: float = 3.0, dtype=F64) -> torch.Tensor:
    """Random rows without ties (N(0, scale²) in float64: ties have probability 0)."""
    return torch.randn(B, n, dtype=dtype) * scale


def _spaced(B: int, n: int, dtype=F64) -> torch.Tensor:
    """Rows that are random permutations of 0..n-1 (unit gaps), for hard limits."""
    return torch.stack([torch.randperm(n) for _ in range(B)]).to(dtype)


def _eps(B: int, value: float, dtype=F64) -> torch.Tensor:
    return torch.full((B,), value, dtype=dtype)


def _hard_ranks(x: torch.Tensor, descending: bool) -> torch.Tensor:
    return torch.argsort(torch.argsort(x, -1, descending=descending), -1).to(x.dtype) + 1


# ------------------------------------------------------------------ naive n x n references


def naive_softsort(x, eps, descending, distance):
    u = torch.sort(x, -1, descending=descending).values
    diff = u.unsqueeze(-1) - x.unsqueeze(1)
    d = diff.abs() if distance == "l1" else diff.square()
    p = torch.softmax(-d / eps.view(-1, 1, 1), dim=-1)
    return p


def naive_neuralsort(x, eps, descending):
    n = x.shape[-1]
    a1 = (x.unsqueeze(-1) - x.unsqueeze(1)).abs().sum(-1)
    i = torch.arange(1, n + 1, dtype=x.dtype)
    c = n + 1 - 2 * i if descending else 2 * i - n - 1
    logits = (c.view(1, -1, 1) * x.unsqueeze(1) - a1.unsqueeze(1)) / eps.view(-1, 1, 1)
    return torch.softmax(logits, dim=-1)


def _reductions(p, x):
    n = x.shape[-1]
    pos = torch.arange(1, n + 1, dtype=x.dtype)
    return (p @ x.unsqueeze(-1)).squeeze(-1), torch.matmul(pos, p)


BACKENDS = {
    "softsort-l1": (
        lambda f: lambda x, e, d: getattr(_softsort, f)(x, e, d, "l1"),
        lambda x, e, d: naive_softsort(x, e, d, "l1"),
    ),
    "softsort-l2": (
        lambda f: lambda x, e, d: getattr(_softsort, f)(x, e, d, "l2"),
        lambda x, e, d: naive_softsort(x, e, d, "l2"),
    ),
    "neuralsort": (
        lambda f: lambda x, e, d: getattr(_neuralsort, f)(x, e, d),
        naive_neuralsort,
    ),
}


def _ot_fn(name, **kw):
    return lambda x, e, d: getattr(_ot, name)(x, e, d, **kw)


ALL = {
    **{k: v[0] for k, v in BACKENDS.items()},
    "ot": lambda f: _ot_fn(f, tol=1e-12),
}


@pytest.fixture
def small_blocks(monkeypatch):
    """Force several row blocks (with a remainder) in the chunked path."""
    monkeypatch.setattr(_softsort, "BLOCK_ELEMENTS", 7 * 3 * 40)


# ------------------------------------------------------------------ equal to the naive n x n


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("eps", [0.3, 1.0, 5.0])
def test_equals_naive_forward_and_gradients(backend, descending, eps, small_blocks):
    make, naive = BACKENDS[backend]
    x = _tie_free(3, 40).requires_grad_()
    e = torch.tensor([eps, 0.5 * eps, 2 * eps], dtype=F64, requires_grad=True)
    p_ref = naive(x, e, descending)
    v_ref, r_ref = _reductions(p_ref, x)
    v, r, p = (
        make("sort")(x, e, descending),
        make("rank")(x, e, descending),
        make("argsort")(x, e, descending),
    )
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
    # offset and small epsilon: the float64 scans stay accurate (MATH.md §3.3)
    x = _tie_free(2, 300) + 1000.0
    e = _eps(2, 0.05)
    v_ref, r_ref = _reductions(naive_softsort(x, e, False, "l1"), x)
    torch.testing.assert_close(_softsort.sort(x, e), v_ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(_softsort.rank(x, e), r_ref, atol=1e-8, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, 1e3]), min_size=1, max_size=25),
    eps=st.sampled_from([0.05, 0.5, 4.0]),
    descending=st.booleans(),
)
def test_softsort_l1_scan_forward_with_ties(values, eps, descending):
    # the forward is continuous at ties: the scans equal the dense formula there too
    x = torch.tensor([values], dtype=F64)
    e = _eps(1, eps)
    v_ref, r_ref = _reductions(naive_softsort(x, e, descending, "l1"), x)
    torch.testing.assert_close(_softsort.sort(x, e, descending), v_ref, atol=1e-9, rtol=1e-12)
    torch.testing.assert_close(_softsort.rank(x, e, descending), r_ref, atol=1e-9, rtol=1e-12)


def test_softsort_l1_float32_uses_float64_scans():
    # float32 in, float32 out; as accurate as the naive float32 n x n (MATH.md §3.3)
    x32 = (_tie_free(2, 500) + 100.0).float()
    e = _eps(2, 1e-2)
    v_ref, r_ref = _reductions(naive_softsort(x32.double(), e, False, "l1"), x32.double())
    v_naive, r_naive = _reductions(naive_softsort(x32, e.float(), False, "l1"), x32)
    v32, r32 = _softsort.sort(x32, e.float()), _softsort.rank(x32, e.float())
    assert v32.dtype == r32.dtype == torch.float32
    assert (r32.double() - r_ref).abs().max() <= (r_naive.double() - r_ref).abs().max() + 1e-5
    assert (v32.double() - v_ref).abs().max() <= (v_naive.double() - v_ref).abs().max() + 1e-5
    assert (r32.double() - r_ref).abs().max() < 1e-3


# ------------------------------------------------------------------ gradcheck (float64)


def test_gradcheck_ot_quantile():
    x = _tie_free(2, 6, scale=1.0).requires_grad_()
    e = torch.tensor([0.5, 0.3], dtype=F64, requires_grad=True)
    q = torch.tensor([0.1, 0.5, 0.77], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, q, e: _ot.quantile(x, q, e, tol=1e-12), (x, q, e))


# ------------------------------------------------------------------ hard limit


HARD_EPS = {"softsort-l1": 1e-2, "softsort-l2": 1e-2, "neuralsort": 1e-2, "ot": 1e-2}


@pytest.mark.parametrize("backend", sorted(ALL))
@pytest.mark.parametrize("descending", [False, True])
def test_hard_limit(backend, descending):
    x = _spaced(3, 30)
    e = _eps(3, HARD_EPS[backend])
    make = ALL[backend]
    p = make("argsort")(x, e, descending)
    hard = torch.sort(x, -1, descending=descending)
    one_hot = torch.nn.functional.one_hot(hard.indices, 30).to(F64)
    torch.testing.assert_close(p, one_hot, atol=1e-12, rtol=0)
    torch.testing.assert_close(make("sort")(x, e, descending), hard.values, atol=1e-10, rtol=0)
    torch.testing.assert_close(
        make("rank")(x, e, descending), _hard_ranks(x, descending), atol=1e-10, rtol=0
    )


def test_ot_quantile_hard_limit_is_torch_quantile():
    x = _spaced(2, 25)
    q = torch.tensor([0.0, 0.13, 0.5, 0.9, 1.0], dtype=F64)
    got = _ot.quantile(x, q, _eps(2, 1e-2))
    torch.testing.assert_close(got, torch.quantile(x, q, dim=-1).T, atol=1e-10, rtol=0)


# ------------------------------------------------------------------ invariants


def test_ot_doubly_stochastic_and_rank_sum():
    n = 20
    x = _tie_free(3, n)
    e = _eps(3, 0.5)
    p = _ot.argsort(x, e, tol=1e-12)
    torch.testing.assert_close(p.sum(-2), torch.ones(3, n, dtype=F64), atol=1e-9, rtol=0)
    r = _ot.rank(x, e, tol=1e-12)
    torch.testing.assert_close(r.sum(-1), torch.full((3,), n * (n + 1) / 2, dtype=F64))
    assert ((r >= 1 - 1e-9) & (r <= n + 1e-9)).all()


def test_ot_scaling_law_and_shift():
    x = _tie_free(2, 20)
    e = _eps(2, 0.4)
    v = _ot.sort(x, e, tol=1e-12)
    torch.testing.assert_close(_ot.sort(2 * x, 4 * e, tol=1e-12), 2 * v)
    torch.testing.assert_close(_ot.sort(x + 5.0, e, tol=1e-12), v + 5.0)


def test_ot_warns_when_not_converged(monkeypatch):
    monkeypatch.setattr(sinkhorn, "NEWTON_MAX_STEPS", 0)  # plain Sinkhorn, too few iterations
    x = _tie_free(2, 30, scale=1.0)
    with pytest.warns(UserWarning, match=r"did not reach tol=1e-09 in max_iter=3"):
        _ot.sort(x, _eps(2, 0.1), max_iter=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ot.sort(x, _eps(2, 0.1), max_iter=3, tol=0)  # tol=0: exactly max_iter, no warning


def test_softsort_bad_distance():
    with pytest.raises(ValueError, match=r"got 'l3'"):
        _softsort.sort(_tie_free(1, 4), _eps(1, 1.0), False, "l3")


# ------------------------------------------------------------------ memory


class _SavedBytes:
    """Bytes of distinct tensors saved for backward (outside checkpointed blocks)."""

    def __init__(self):
        self.seen: dict[int, int] = {}

    def pack(self, t):
        st = t.untyped_storage()
        self.seen[st.data_ptr()] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _saved_bytes(fn, x, e) -> int:
    rec = _SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        out = fn(x, e)
    out.sum().backward()  # the checkpointed blocks recompute fine
    return rec.total


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        ("softsort-l1", lambda x, e: _softsort.sort(x, e) + _softsort.rank(x, e)),
        ("softsort-l2 rank", lambda x, e: _softsort.rank(x, e, False, "l2")),
        ("neuralsort sort", lambda x, e: _neuralsort.sort(x, e)),
    ],
)
def test_saved_memory_is_linear(name, fn, monkeypatch):
    n = 3000
    monkeypatch.setattr(_softsort, "BLOCK_ELEMENTS", 64 * n)  # 64 rows per block
    x = torch.randn(1, n, requires_grad=True)
    e = _eps(1, 0.5, dtype=torch.float32)
    saved = _saved_bytes(fn, x, e)
    # far below one n x n float32 matrix (36 MB): a few dozen length-n float64 vectors at most
    assert saved < 64 * n * 8, (name, saved)
    assert x.grad is not None and torch.isfinite(x.grad).all()
