"""softops.sort._chunked: the row-chunked, checkpointed softmax reductions shared by SoftSort and
NeuralSort, against the dense formula (values, ranks with an offset, P, gradients, block bounds)."""

from __future__ import annotations

import pytest
import torch

from softops.sort import _chunked
from softops.sort._chunked import chunked_rows, positions
from tests._helpers import seeded

F64 = torch.float64


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
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", rows * B * n)
    offset = torch.tensor([0.0, 2.5, -1.0], dtype=F64)
    for off in (None, offset):
        v, r, p = chunked_rows(
            logits, rp, x, (x, eps), descending, values=True, ranks=True, matrix=True, offset=off
        )
        rv, rr, rpm = _dense(logits, rp, x, eps, descending, off)
        torch.testing.assert_close(v, rv)
        torch.testing.assert_close(r, rr)
        torch.testing.assert_close(p, rpm)
    # only what is asked for
    v, r, p = chunked_rows(logits, rp, x, (x, eps), descending, ranks=True)
    assert v is None and p is None
    torch.testing.assert_close(r, _dense(logits, rp, x, eps, descending)[1])


@pytest.mark.parametrize(
    ("block_elements", "sizes"),
    [(1, [1] * 10), (3 * 10 * 3, [3, 3, 3, 1]), (3 * 10 * 4 + 5, [4, 4, 2]), (10**9, [10])],
)
def test_chunked_rows_chunk_bounds(monkeypatch, block_elements, sizes):
    """Rows go in order, in chunks of clamp(BLOCK_ELEMENTS // (B n), 1, n), the last shorter."""
    _, rp, x, eps = _problem("l1")
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", block_elements)
    seen: list[torch.Tensor] = []

    def logits(rp_blk, xx, ee):
        seen.append(rp_blk)
        assert rp_blk.shape[:-1] == rp.shape[:-1]
        return _l1_logits(rp_blk, xx, ee)

    chunked_rows(logits, rp, x, (x, eps), False, values=True)
    assert [t.shape[-1] for t in seen] == sizes
    torch.testing.assert_close(torch.cat(seen, dim=-1), rp)


@pytest.mark.parametrize("descending", [False, True])
def test_chunked_rows_gradients_equal_dense(monkeypatch, descending):
    """Checkpointed chunks (recomputed in the backward) give the gradients of the dense graph."""
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", 3 * 10 * 3)
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
        lambda rp, x, eps: chunked_rows(
            logits, rp, x, (x, eps), descending, values=True, ranks=True, matrix=True, offset=offset
        )
    )
    dense = grads(lambda rp, x, eps: _dense(logits, rp, x, eps, descending, offset))
    for a, b in zip(chunked, dense, strict=True):
        torch.testing.assert_close(a, b)
    # no graph is built under no_grad
    rp, x, eps = (t.clone().requires_grad_(True) for t in (rp0, x0, eps0))
    with torch.no_grad():
        v, _, _ = chunked_rows(logits, rp, x, (x, eps), descending, values=True)
    assert not v.requires_grad


def test_positions():
    assert positions(4, False, F64, torch.device("cpu")).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert positions(4, True, torch.float32, torch.device("cpu")).tolist() == [4.0, 3.0, 2.0, 1.0]


def test_rows_per_block_and_graph():
    assert _chunked._rows_per_block(1, 10) == 10  # everything fits: one block
    assert _chunked._rows_per_block(10**4, 10**4) == 1  # never below one row
    x = torch.randn(2, 3, requires_grad=True)
    assert _chunked._needs_graph(torch.randn(2, 3), x)
    with torch.no_grad():
        assert not _chunked._needs_graph(x)


# ------------------------------------------------------------------ torch.func transforms

_FUNC_OPS = {
    "argsort": lambda x: __import__("softops").soft_argsort(x, epsilon=0.5),
    "softsort-l2": lambda x: __import__("softops").soft_sort(
        x, epsilon=0.5, method="softsort", distance="l2"
    ),
    "softsort-l1-rank": lambda x: __import__("softops").soft_rank(
        x, epsilon=0.5, method="softsort"
    ),
    "neuralsort": lambda x: __import__("softops").soft_sort(x, epsilon=0.5, method="neuralsort"),
    "neuralsort-rank": lambda x: __import__("softops").soft_rank(
        x, epsilon=0.5, method="neuralsort"
    ),
}


@pytest.mark.parametrize("name", sorted(_FUNC_OPS))
def test_torch_func_grad_vjp_jacrev_equal_autograd(name, monkeypatch):
    # several blocks, so that the eager path really checkpoints
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", 2 * 7 * 3)
    fn = _FUNC_OPS[name]
    torch.manual_seed(0)
    x = torch.randn(2, 7, dtype=F64)
    xx = x.clone().requires_grad_(True)
    y = fn(xx)
    w = torch.randn_like(y)
    (g_ref,) = torch.autograd.grad((y * w).sum(), xx)
    jac_ref = torch.stack(  # a fresh (checkpointed) graph per output entry
        [torch.autograd.grad(fn(xx).flatten()[k], xx)[0] for k in range(y.numel())]
    ).reshape(*y.shape, *x.shape)
    g = torch.func.grad(lambda t: (fn(t) * w).sum())(x)
    _, pullback = torch.func.vjp(fn, x)
    (g_vjp,) = pullback(w)
    jac = torch.func.jacrev(fn)(x)
    torch.testing.assert_close(g, g_ref, atol=1e-13, rtol=1e-12)
    torch.testing.assert_close(g_vjp, g_ref, atol=1e-13, rtol=1e-12)
    torch.testing.assert_close(jac, jac_ref, atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_rows_gives_the_exponent_of_the_subnormal_rows_only(dtype):
    fi = torch.finfo(dtype)
    x = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, 2.0], [0.0, 0.0, 0.0]], dtype=dtype)
    assert _chunked.small_rows(x) is None  # no small row: no exponents, one host read
    x[1] = x[1] * fi.tiny  # largest magnitude 3 * tiny < tiny / eps
    x[2, 0] = float("-inf")  # infinities and zeros are not small rows
    e = _chunked.small_rows(x)
    assert e.shape == (3, 1) and e.dtype == torch.int32
    big = float(x[1].abs().max())
    assert e[:, 0].tolist() == [0, torch.frexp(torch.tensor(big, dtype=dtype)).exponent.item(), 0]
    # the exponent brings the row's largest magnitude into [1/2, 1)
    assert 0.5 <= big * 2.0 ** -int(e[1, 0]) < 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_convex_combination_is_exact_on_subnormal_rows_with_the_plain_derivatives(dtype):
    g = seeded(3)
    p = torch.softmax(torch.randn(2, 4, 5, generator=g, dtype=torch.float64), -1).to(dtype)
    x = torch.randn(2, 5, generator=g, dtype=torch.float64).to(dtype)
    x[1] = 4 * torch.finfo(dtype).smallest_normal * 2.0**-20  # a constant subnormal row
    plain = torch.linalg.vecdot(p, x.unsqueeze(1))
    got = _chunked.convex_combination(p, x, _chunked.small_rows(x))
    assert torch.equal(got[0], plain[0])  # a normal row: the plain combination, bit for bit
    assert torch.equal(got[1], x[1, :4])  # the constant row comes back exactly
    assert not torch.equal(plain[1], x[1, :4])  # (the plain one rounds on the subnormal grid)
    assert _chunked.convex_combination(p, x, None).equal(plain)
    # derivatives: those of the plain combination
    pp, xx = p.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(2, 4, generator=g, dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(
        (_chunked.convex_combination(pp, xx, _chunked.small_rows(xx)) * w).sum(), (pp, xx)
    )
    want = torch.autograd.grad((torch.linalg.vecdot(pp, xx.unsqueeze(1)) * w).sum(), (pp, xx))
    for a, b in zip(grads, want, strict=True):
        assert torch.equal(a, b)
