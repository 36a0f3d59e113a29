"""Direct tests of internal helpers: the numba PAV kernels, the blockwise VJP helpers, the bench's
numba thread context, the sort bench entry point, the OT default tolerance and the row-chunked
SoftSort/NeuralSort reductions."""

from __future__ import annotations

import itertools
import json
import math
import sys
from typing import Any

import numpy as np
import pytest
import torch

from softops._core import isotonic
from softops.sort import _ot, _softsort
from tests._helpers import seeded

F64 = torch.float64


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


def _numba_l2(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel on C-contiguous y; outputs and work arrays start full of garbage."""
    from softops._core import _isotonic_numba as kernels

    B, n = y.shape
    v = np.full_like(y, np.nan)
    block = np.full((B, n), -7, dtype=np.int64)
    acc = np.full((B, n), 1e30)
    cnt = np.full((B, n), 123, dtype=np.int64)
    kernels.pav_l2(y, v, block, acc, cnt)
    return v, block


def _numba_kl(s: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from softops._core import _isotonic_numba as kernels

    B, n = s.shape
    v = np.full_like(s, np.nan)
    block = np.full((B, n), -7, dtype=np.int64)
    work = (np.full((B, n), 1e30), np.full((B, n), -1e30), np.full((B, n), 99, dtype=np.int64))
    kernels.pav_kl(s, w, v, block, *work)
    return v, block


# ------------------------------------------------------------------- numba PAV kernels


@pytest.fixture(scope="module")
def numba_mod():
    return pytest.importorskip("numba")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_pav_l2_kernel_matches_references(numba_mod, dtype):
    g = seeded(3)
    y = torch.randint(-3, 4, (6, 11), generator=g).to(F64)
    y[1:3] += 0.1 * torch.randn(2, 11, generator=g, dtype=F64)
    y[3] = 2.0  # all tied: one block
    y[4] = torch.arange(11, dtype=F64)  # increasing: one block, the mean
    y[5] = -torch.arange(11, dtype=F64)  # strictly decreasing: n singleton blocks
    yn = np.ascontiguousarray(y.numpy().astype(dtype))
    v, block = _numba_l2(yn)  # work arrays full of garbage: the kernel must not read them
    assert v.dtype == dtype and block.dtype == np.int64
    y64 = yn.astype(np.float64)
    for row, vr in zip(y64.tolist(), v, strict=True):
        np.testing.assert_allclose(vr, _pav_l2_reference(row), rtol=1e-6, atol=1e-6)
    assert (np.diff(v, axis=-1) <= 0).all()
    assert (block[3] == 0).all() and (block[4] == 0).all()
    np.testing.assert_allclose(v[4], 5.0)
    assert (block[5] == np.arange(11)).all() and (v[5] == yn[5]).all()
    _check_blocks(v, block, lambda b, idx: y64[b, idx].mean())
    # the torch fallback gives the same solution and the same blocks
    ref_v, ref_block = isotonic._torch_pav(torch.from_numpy(yn), None)
    np.testing.assert_allclose(v, ref_v.numpy(), rtol=1e-6, atol=1e-6)
    assert (block == ref_block.numpy()).all()


def test_pav_l2_kernel_matches_sklearn_and_pools_ties(numba_mod):
    sk = pytest.importorskip("sklearn.isotonic")
    g = seeded(4)
    y = torch.randn(5, 50, generator=g, dtype=F64).cumsum(-1) * 0.3
    y += torch.randn(5, 50, generator=g, dtype=F64)
    v, block = _numba_l2(np.ascontiguousarray(y.numpy()))
    for row, vr in zip(y.numpy(), v, strict=True):
        ref = sk.IsotonicRegression(increasing=False).fit_transform(np.arange(50), row)
        np.testing.assert_allclose(vr, ref, rtol=0, atol=1e-12)
    _check_blocks(v, block, lambda b, idx: y.numpy()[b, idx].mean())
    # equal neighbours are pooled (the test is `<=`), exact block ids
    ties = np.array([[3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 2.0, 0.0, 5.0, 5.0, 5.0]])
    v, block = _numba_l2(ties)
    assert block.tolist() == [[0, 1, 1, 2, 2, 2, 3], [0, 0, 0, 0, 0, 0, 0]]
    np.testing.assert_allclose(v[0], ties[0])
    np.testing.assert_allclose(v[1], np.full(7, 19.0 / 7))
    # one column: the identity
    col = np.array([[2.5], [-1.0]])
    v, block = _numba_l2(col)
    assert (v == col).all() and (block == 0).all()


def test_pav_l2_kernel_rows_are_independent(numba_mod):
    """prange over rows: each row's answer is the same alone as in a batch."""
    y = torch.randn(9, 30, generator=seeded(5), dtype=F64).numpy()
    v, block = _numba_l2(y)
    for b in range(9):
        vb, bb = _numba_l2(np.ascontiguousarray(y[b : b + 1]))
        assert (vb[0] == v[b]).all() and (bb[0] == block[b]).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_pav_kl_kernel_matches_references(numba_mod, dtype):
    g = seeded(6)
    s = torch.randn(6, 10, generator=g, dtype=F64)
    w = torch.randn(6, 10, generator=g, dtype=F64).sort(-1, descending=True).values
    s[1] = torch.randint(0, 3, (10,), generator=g).to(F64)  # ties in s
    w[1] = 0.0  # and s - w tied too
    s[2, 4] = -math.inf  # exp(s) = 0 at one position
    s[3] = 1.0  # s - w increasing: one block
    w[3] = -torch.arange(10, dtype=F64)
    s[4] = -torch.arange(10, dtype=F64) * 2  # s - w strictly decreasing: singletons
    w[4] = 0.0
    sn = np.ascontiguousarray(s.numpy().astype(dtype))
    wn = np.ascontiguousarray(w.numpy().astype(dtype))
    v, block = _numba_kl(sn, wn)
    assert v.dtype == dtype
    s64, w64 = sn.astype(np.float64), wn.astype(np.float64)
    for sr, wr, vr in zip(s64.tolist(), w64.tolist(), v, strict=True):
        np.testing.assert_allclose(vr, _pav_kl_reference(sr, wr), rtol=1e-5, atol=1e-5)
    assert (np.diff(v, axis=-1) <= 0).all()
    assert (block[3] == 0).all() and (block[4] == np.arange(10)).all()
    np.testing.assert_allclose(v[4], sn[4] - wn[4])

    def kl_value(b, idx):
        return _lse(s64[b, idx].tolist()) - _lse(w64[b, idx].tolist())

    _check_blocks(v, block, kl_value)
    ref_v, ref_block = isotonic._torch_pav(torch.from_numpy(sn), torch.from_numpy(wn))
    np.testing.assert_allclose(v, ref_v.numpy(), rtol=1e-5, atol=1e-5)
    assert (block == ref_block.numpy()).all()


def test_pav_kl_kernel_weighted_isotonic_and_ties(numba_mod):
    """v_KL(s, w) = log of the weighted decreasing isotonic regression of e^(s-w), weights e^w."""
    sk = pytest.importorskip("sklearn.isotonic")
    g = seeded(7)
    s = torch.randn(4, 40, generator=g, dtype=F64).numpy()
    w = (torch.randn(4, 40, generator=g, dtype=F64) * 0.5).numpy()
    v, _ = _numba_kl(s, w)
    for sr, wr, vr in zip(s, w, v, strict=True):
        iso = sk.IsotonicRegression(increasing=False)
        ref = iso.fit_transform(np.arange(40), np.exp(sr - wr), sample_weight=np.exp(wr))
        np.testing.assert_allclose(vr, np.log(ref), rtol=0, atol=1e-10)
    # equal values s - w are pooled: one block, value log(sum e^s) - log(sum e^w)
    s = np.array([[0.0, 1.0, 2.0], [-math.inf, -math.inf, 0.0]])
    w = np.array([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]])
    v, block = _numba_kl(s, w)
    assert block.tolist() == [[0, 0, 0], [0, 0, 0]]
    np.testing.assert_allclose(v[0], 0.0, atol=1e-12)
    np.testing.assert_allclose(v[1], -math.log(3.0))


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


# ------------------------------------------------------------ bench: numba thread context


def test_numba_threads_follows_torch_and_restores(numba_mod, monkeypatch):
    from softops.bench.sort import numba_threads

    most = numba_mod.config.NUMBA_NUM_THREADS
    before = numba_mod.get_num_threads()
    try:
        numba_mod.set_num_threads(most)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
        with numba_threads():
            assert numba_mod.get_num_threads() == 1
        assert numba_mod.get_num_threads() == most
        monkeypatch.setattr(torch, "get_num_threads", lambda: most + 50)  # capped
        numba_mod.set_num_threads(1)
        with numba_threads():
            assert numba_mod.get_num_threads() == most
        assert numba_mod.get_num_threads() == 1
        with pytest.raises(RuntimeError, match="inside"), numba_threads():
            raise RuntimeError("inside")
        assert numba_mod.get_num_threads() == 1  # restored on an exception too
    finally:
        numba_mod.set_num_threads(before)


def test_numba_threads_without_numba(monkeypatch):
    from softops.bench.sort import numba_threads

    monkeypatch.setitem(sys.modules, "numba", None)  # import numba -> ImportError
    ran = []
    with numba_threads():
        ran.append(True)
    assert ran == [True]


# ------------------------------------------------------------------- cli: run_sort_bench


def test_run_sort_bench_tiny(tmp_path):
    from softops.cli import run_sort_bench

    lines: list[str] = []
    report, paths = run_sort_bench(
        quick=True,
        threads=torch.get_num_threads(),
        sizes=[16],
        batch=1,
        repeats=1,
        time_budget=1.0,
        vs=False,
        dense=False,
        memory_config=False,
        out=str(tmp_path),
        command="softops bench sort --tiny",
        log=lines.append,
    )
    assert paths["jsonl"] == tmp_path / "sort-quick.jsonl"
    assert paths["md"] == tmp_path / "sort-quick.md"
    for path in paths.values():
        assert path.exists() and path.stat().st_size > 0
    assert paths["md"].read_text(encoding="utf-8") == report
    assert "| torch.sort | 1.00× |" in report and "`softops bench sort --tiny`" in report
    records = [json.loads(line) for line in paths["jsonl"].read_text().splitlines()]
    assert {r["group"] for r in records} == {"grid"}
    assert {(r["B"], r["n"]) for r in records} == {(1, 16)}
    by: dict[str, Any] = {r["case"]: r for r in records}
    for name in ("torch.sort", "pav sort", "pav rank", "softsort sort", "softsort rank"):
        assert by[name].get("skip") is None, by[name]
        assert by[name]["repeats"] == 1 and by[name]["fwd_ms"] > 0
    assert by["SoftTorch"]["skip"]
    assert lines and str(paths["md"]) in lines[-1]


# ---------------------------------------------------------------------- OT: default_tol


def test_default_tol_per_dtype():
    assert _ot.default_tol(torch.float64) == 1e-9
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert _ot.default_tol(dtype) == 1e-6


# ---------------------------------------------------------------- SoftSort: chunked_rows


def _l1_logits(rp: torch.Tensor, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """(B, b) row parameter: SoftSort-like logits -|u_i - x_j| / eps."""
    return -(rp.unsqueeze(-1) - x.unsqueeze(1)).abs() / eps.view(-1, 1, 1)


def _coef_logits(rp: torch.Tensor, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """(b,) row parameter shared by the batch: NeuralSort-like logits c_i x_j / eps."""
    return rp.view(1, -1, 1) * x.unsqueeze(1) / eps.view(-1, 1, 1)


def _dense(logits, rp, x, eps, descending, offset=None):
    """values, ranks and P by the unchunked formula, written out."""
    n = x.shape[-1]
    p = torch.softmax(logits(rp, x, eps), dim=-1)  # ascending rows
    if descending:
        p = p.flip(1)
    pos = torch.arange(1, n + 1, dtype=x.dtype).expand(x.shape[0], n)
    if offset is not None:
        pos = pos + offset.unsqueeze(-1)
    values = torch.einsum("bij,bj->bi", p, x)
    ranks = torch.einsum("bi,bij->bj", pos, p)
    return values, ranks, p


def _problem(kind: str, B: int = 3, n: int = 10):
    x = torch.randn(B, n, generator=seeded(21), dtype=F64)
    eps = torch.rand(B, generator=seeded(22), dtype=F64) + 0.3
    if kind == "l1":
        return _l1_logits, x.sort(-1).values, x, eps
    return _coef_logits, 2 * torch.arange(1, n + 1, dtype=F64) - n - 1, x, eps


@pytest.mark.parametrize("kind", ["l1", "coef"])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 10])
def test_chunked_rows_equals_dense(monkeypatch, kind, descending, rows):
    logits, rp, x, eps = _problem(kind)
    B, n = x.shape
    monkeypatch.setattr(_softsort, "BLOCK_ELEMENTS", rows * B * n)
    offset = torch.tensor([0.0, 2.5, -1.0], dtype=F64)
    for off in (None, offset):
        v, r, p = _softsort.chunked_rows(
            logits, rp, x, (x, eps), descending, values=True, ranks=True, matrix=True, offset=off
        )
        rv, rr, rpm = _dense(logits, rp, x, eps, descending, off)
        torch.testing.assert_close(v, rv)
        torch.testing.assert_close(r, rr)
        torch.testing.assert_close(p, rpm)
    # only what is asked for
    v, r, p = _softsort.chunked_rows(logits, rp, x, (x, eps), descending, ranks=True)
    assert v is None and p is None
    torch.testing.assert_close(r, _dense(logits, rp, x, eps, descending)[1])


@pytest.mark.parametrize(
    ("block_elements", "sizes"),
    [(1, [1] * 10), (3 * 10 * 3, [3, 3, 3, 1]), (3 * 10 * 4 + 5, [4, 4, 2]), (10**9, [10])],
)
def test_chunked_rows_chunk_bounds(monkeypatch, block_elements, sizes):
    """Rows go in order, in chunks of clamp(BLOCK_ELEMENTS // (B n), 1, n), the last shorter."""
    _, rp, x, eps = _problem("l1")
    monkeypatch.setattr(_softsort, "BLOCK_ELEMENTS", block_elements)
    seen: list[torch.Tensor] = []

    def logits(rp_blk, xx, ee):
        seen.append(rp_blk)
        assert rp_blk.shape[:-1] == rp.shape[:-1]
        return _l1_logits(rp_blk, xx, ee)

    _softsort.chunked_rows(logits, rp, x, (x, eps), False, values=True)
    assert [t.shape[-1] for t in seen] == sizes
    torch.testing.assert_close(torch.cat(seen, dim=-1), rp)


@pytest.mark.parametrize("descending", [False, True])
def test_chunked_rows_gradients_equal_dense(monkeypatch, descending):
    """Checkpointed chunks (recomputed in the backward) give the gradients of the dense graph."""
    monkeypatch.setattr(_softsort, "BLOCK_ELEMENTS", 3 * 10 * 3)
    logits, rp0, x0, eps0 = _problem("l1")
    offset = torch.tensor([1.0, 0.0, -2.0], dtype=F64)
    cv, cr, cp = (torch.randn(3, 10, generator=seeded(s), dtype=F64) for s in (31, 32, 33))
    cp = torch.randn(3, 10, 10, generator=seeded(34), dtype=F64)

    def grads(fn):
        rp, x, eps = (t.clone().requires_grad_(True) for t in (rp0, x0, eps0))
        v, r, p = fn(rp, x, eps)
        loss = (cv * v).sum() + (cr * r).sum() + (cp * p).sum()
        return torch.autograd.grad(loss, (rp, x, eps))

    chunked = grads(
        lambda rp, x, eps: _softsort.chunked_rows(
            logits, rp, x, (x, eps), descending, values=True, ranks=True, matrix=True, offset=offset
        )
    )
    dense = grads(lambda rp, x, eps: _dense(logits, rp, x, eps, descending, offset))
    for a, b in zip(chunked, dense, strict=True):
        torch.testing.assert_close(a, b)
    # no graph is built under no_grad
    rp, x, eps = (t.clone().requires_grad_(True) for t in (rp0, x0, eps0))
    with torch.no_grad():
        v, _, _ = _softsort.chunked_rows(logits, rp, x, (x, eps), descending, values=True)
    assert not v.requires_grad
