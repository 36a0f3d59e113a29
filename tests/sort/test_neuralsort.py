"""The "neuralsort" backend (Grover et al. 2019): against the naive n x n formula, hard limits and
memory."""

from __future__ import annotations

import pytest
import torch

from softops.sort import _chunked, _neuralsort
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
OPTS = MethodOptions()  # NeuralSort has no options


def naive_neuralsort(x, eps, descending):
    n = x.shape[-1]
    a1 = (x.unsqueeze(-1) - x.unsqueeze(1)).abs().sum(-1)
    i = torch.arange(1, n + 1, dtype=x.dtype)
    c = n + 1 - 2 * i if descending else 2 * i - n - 1
    logits = (c.view(1, -1, 1) * x.unsqueeze(1) - a1.unsqueeze(1)) / eps.view(-1, 1, 1)
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("eps", [0.3, 1.0, 5.0])
def test_equals_naive_forward_and_gradients(descending, eps, monkeypatch):
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", 7 * 3 * 40)  # several blocks, a remainder
    x = tie_free(3, 40).requires_grad_()
    e = torch.tensor([eps, 0.5 * eps, 2 * eps], dtype=F64, requires_grad=True)
    p_ref = naive_neuralsort(x, e, descending)
    v_ref, r_ref = reductions(p_ref, x)
    v = _neuralsort.sort(x, e, descending, OPTS)
    r = _neuralsort.rank(x, e, descending, OPTS)
    p = _neuralsort.argsort(x, e, descending, OPTS)
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


@pytest.mark.parametrize("descending", [False, True])
def test_hard_limit(descending):
    x = spaced(3, 30)
    e = row_eps(3, 1e-2)
    p = _neuralsort.argsort(x, e, descending, OPTS)
    hard = torch.sort(x, -1, descending=descending)
    one_hot = torch.nn.functional.one_hot(hard.indices, 30).to(F64)
    torch.testing.assert_close(p, one_hot, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        _neuralsort.sort(x, e, descending, OPTS), hard.values, atol=1e-10, rtol=0
    )
    torch.testing.assert_close(
        _neuralsort.rank(x, e, descending, OPTS), hard_ranks(x, descending), atol=1e-10, rtol=0
    )


def test_saved_memory_is_linear(monkeypatch):
    n = 3000
    monkeypatch.setattr(_chunked, "BLOCK_ELEMENTS", 64 * n)  # 64 rows per block
    x = torch.randn(1, n, requires_grad=True)
    e = row_eps(1, 0.5, dtype=torch.float32)
    saved = saved_storage_bytes(lambda x, e: _neuralsort.sort(x, e, False, OPTS), x, e)
    assert saved < 64 * n * 8, saved  # far below one n x n float32 matrix (36 MB)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_tied_entries_get_identical_sums_logits_and_ranks():
    # found by tests/test_adversarial.py: the prefix-sum formula of (A 1) rounded tied entries
    # differently (here by 1e-13), which a small epsilon turned into ranks 9 and 0 for a tie
    x = torch.tensor(
        [[-3398.638933730085, 0.019635717790193706, 0.019635717790193706, 0.009516044557229415,
          -31684.72927424533, 1684.6055209838173]],
        dtype=F64,
    )  # fmt: skip
    a1 = _neuralsort._abs_row_sums(x)
    assert a1[0, 1] == a1[0, 2]
    torch.testing.assert_close(a1, (x.unsqueeze(-1) - x.unsqueeze(1)).abs().sum(-1))
    e = torch.tensor([1e-14], dtype=F64)
    r = _neuralsort.rank(x, e, False, OPTS)
    assert r[0, 1] == r[0, 2]
    torch.testing.assert_close(r, torch.tensor([[2.0, 4.5, 4.5, 3.0, 1.0, 6.0]], dtype=F64))


@pytest.mark.parametrize(
    ("row", "eps", "dtype"),
    [
        ([1e300, 0.0, -1e300, 1.0], 1e-10, F64),  # the logits overflowed: NaN rows
        ([3e37, 0.0, -3e37, 1.0], 1.0, torch.float32),
        ([0.0, 1.0, 2.0, 3.0], 1e-300, F64),  # eps**2 underflows: NaN gradient in eps
        ([0.0, 1.0, 2.0, 3.0], 1e-30, torch.float32),
        # the frame's bound on the backward, |x| s / eps, once overflowed as it was computed
        ([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1e13, -1e300], 24999.999999999993, F64),
    ],
)
def test_extreme_spans_and_epsilon_stay_finite(row, eps, dtype):
    import softops

    x = torch.tensor([row], dtype=F64).to(dtype).requires_grad_()
    e = torch.tensor([eps], dtype=F64, requires_grad=True)
    for op in (softops.soft_sort, softops.soft_rank, softops.soft_argsort):
        out = op(x, epsilon=e, method="neuralsort")
        assert not torch.isnan(out).any(), (op.__name__, out)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
        gx, ge = torch.autograd.grad(out, (x, e), g.to(out.dtype))
        assert not torch.isnan(gx).any() and not torch.isnan(ge).any(), (op.__name__, gx, ge)
    if eps > 1.0:
        return
    v = softops.soft_sort(x.detach(), epsilon=e.detach(), method="neuralsort")
    hard = torch.sort(x.detach()).values
    torch.testing.assert_close(v[:, [0, -1]], hard[:, [0, -1]])  # the far ends are hard
    # (gaps of 1 beside a span of 1e300 are below the logits' rounding: the middle is a mean)
    assert ((v[:, 1:-1] >= hard[:, 1:2]) & (v[:, 1:-1] <= hard[:, 2:3])).all()
