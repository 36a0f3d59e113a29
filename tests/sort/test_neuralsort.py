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
    # differently (here by 1e-13), which a small epsilon turned into ranks 9 and 0 for a tie;
    # the logits are now sums over the gaps of the sorted row, 0 between tied entries
    x = torch.tensor(
        [[-3398.638933730085, 0.019635717790193706, 0.019635717790193706, 0.009516044557229415,
          -31684.72927424533, 1684.6055209838173]],
        dtype=F64,
    )  # fmt: skip
    e = torch.tensor([1e-14], dtype=F64)
    p = _neuralsort.argsort(x, e, False, OPTS)
    assert torch.equal(p[..., 1], p[..., 2])  # identical columns of P
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


# ------------------------------------- KD23: small gaps beside a wide span (tests/test_adversarial)


def _far_reference(x: torch.Tensor, far: torch.Tensor, eps: float, op: str) -> torch.Tensor:
    """The naive float64 P (or ranks) of x with its ``far`` entries moved to 300 epsilons beyond
    the rest (the far entries' logits in the near rows, and the near ones' in the far rows, are
    then below -300: e**-300 is 0 to float64's rounding, as at any larger distance), where the
    naive formula's rounding, n * span * 2**-53 / eps, is far below the tolerance."""
    xd = x.double().clone()
    near = xd[~far]
    lo, hi = near.min(), near.max()
    up, dn = far & (xd > hi), far & (xd < lo)
    # (in their own order, ties kept)
    xd[up] = hi + 300 * eps * (1 + torch.unique(xd[up], return_inverse=True)[1].to(F64))
    xd[dn] = lo - 300 * eps * (1 + torch.unique(-xd[dn], return_inverse=True)[1].to(F64))
    p = naive_neuralsort(xd[None], torch.tensor([eps], dtype=F64), False)
    if op == "rank":
        return (torch.arange(1, x.shape[-1] + 1, dtype=F64) @ p)[0]
    return p[0]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_kd23_small_gaps_beside_a_wide_span(dtype):
    """Gaps of about epsilon beside entries far away (span / eps up to 1e30): the logits were
    c_i x_j - (A 1)_j, of the size n * span, whose rounding lost the gaps (soft_rank([[0, 0, 0,
    0, 2**-14, 512]], epsilon=1e-6) in float32 was [[3.5, 3.5, 3.5, 3.5, 1, 6]]). Ranks and P
    against the naive float64 formula on the same gaps with the far entries near, for the
    reproducer, long rows with ties, and far entries on both sides."""
    import softops

    g = torch.Generator().manual_seed(23)
    x0 = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0**-14, 512.0])
    r = softops.soft_rank(x0[None].to(dtype), method="neuralsort", epsilon=1e-6)
    assert r.tolist() == [[2.5, 2.5, 2.5, 2.5, 5.0, 6.0]], r.tolist()
    cases = [(x0, x0 > 1, 1e-6)]
    for n, span in ((40, 1e8), (300, 1e30 if dtype == F64 else 1e20)):
        eps = 2.0**-10
        near = torch.randint(0, 12, (n,), generator=g).to(F64) * eps / 2  # ties, gaps of eps/2
        far = torch.rand(n, generator=g) < 0.2
        far[0] = far[1] = True
        sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).to(F64)
        x = torch.where(far, sign * span * (1 + torch.rand(n, generator=g, dtype=F64)), near)
        cases.append((x.to(dtype).double(), far, eps))  # (x as the dtype holds it)
    tol = 2e-4 if dtype == torch.float32 else 1e-9
    for x, far, eps in cases:
        xt = x.to(dtype)[None]
        rank = softops.soft_rank(xt, method="neuralsort", epsilon=eps)[0].double()
        want = _far_reference(x, far, eps, "rank")
        torch.testing.assert_close(rank[~far], want[~far], rtol=0, atol=tol * len(x))
        p = softops.soft_argsort(xt, method="neuralsort", epsilon=eps)[0].double()
        pw = _far_reference(x, far, eps, "p")
        torch.testing.assert_close(p, pw, rtol=0, atol=tol * 10)
        # and the masked path (a -inf in the row: the finite entries' P, one position up, so
        # their ranks gain P's column sums)
        xi = torch.cat((xt, torch.tensor([[-torch.inf]], dtype=dtype)), -1)
        ri = softops.soft_rank(xi, method="neuralsort", epsilon=eps)[0, :-1].double()
        torch.testing.assert_close(ri, rank + pw.sum(0), rtol=0, atol=tol * len(x))


@pytest.mark.parametrize("descending", [False, True])
def test_kd23_gradients_beside_a_wide_span(descending):
    """The derivatives of the gap-formed logits: gradcheck and gradgradcheck in float64 in x and
    epsilon with gaps of about epsilon beside an entry 1e12 epsilons away (the hard regime for
    the naive formula), and the gradient in x against the naive formula's with that entry
    300 epsilons away (the same derivatives, to e**-300)."""
    from torch.autograd import gradcheck, gradgradcheck

    near = torch.tensor([0.0, 0.3, 0.35, -0.2, 0.9, 0.31], dtype=F64)
    x = torch.cat((near, torch.tensor([1e12], dtype=F64))).requires_grad_()
    e = torch.tensor([0.25], dtype=F64, requires_grad=True)
    w = torch.randn(7, 7, generator=torch.Generator().manual_seed(3), dtype=F64)

    def f(x, e):
        return (_neuralsort.argsort(x[None], e, descending, OPTS)[0] * w).sum(0)

    assert gradcheck(f, (x, e)) and gradgradcheck(f, (x, e))
    gx = torch.autograd.grad(f(x, e).sum(), x)[0]
    xn = torch.cat((near, torch.tensor([0.9 + 300 * 0.25], dtype=F64))).requires_grad_()
    p = naive_neuralsort(xn[None], e.detach(), descending)[0]
    gn = torch.autograd.grad((p * w).sum(), xn)[0]
    torch.testing.assert_close(gx[:6], gn[:6], rtol=1e-9, atol=1e-12)


# ------------------------------ KD28: s / eps beyond the dtype at a tiny epsilon (test_adversarial)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_kd28_gaps_not_scaled_short_at_the_smallest_normal_epsilon(dtype):
    """At epsilon = finfo.tiny beside a span near max / (12 n), the row's power-of-two scale s
    over epsilon exceeds the dtype's largest value: the factor s / eps saturated there, and every
    gap came out 0.1% short (soft_rank(float32 [[-4.25e37, 0, 0, 0, 1.18e-38]], epsilon=tiny)
    was [[1, 3.7112, 3.7112, 3.7112, 2.8665]], not [[1, 3.7109, 3.7109, 3.7109, 2.8672]]; found by
    the slow profile's tiny_rows). Ranks, P and values (and the masked path) against the naive
    float64 formula with the far entry near, and the gradients in x finite."""
    import softops

    fi = torch.finfo(dtype)
    tiny = fi.tiny
    x0 = torch.tensor([[-4.253529586511731e37, 0.0, 0.0, 0.0, 1.1754943508222875e-38]])
    r0 = softops.soft_rank(x0, epsilon=torch.finfo(torch.float32).tiny, method="neuralsort")
    want0 = [1.0, 3.7109375, 3.7109375, 3.7109375, 2.8671875]  # the float64 reference's, to 2e-5
    torch.testing.assert_close(r0[0].double(), torch.tensor(want0, dtype=F64), rtol=2e-5, atol=0)
    n = 7
    big = fi.max / (12 * n)  # (s / eps saturated: s >= 4 here, 1 / tiny = max / 4)
    near = [0.0, 0.0, 0.0, tiny, 2 * tiny, 0.5 * tiny, 3.5 * tiny]
    for far_x in (-big, big, -4 * big):
        x = torch.tensor([*near, far_x], dtype=dtype)
        far = torch.arange(len(x)) == len(x) - 1
        xd = x.double()
        rank = softops.soft_rank(x[None], method="neuralsort", epsilon=tiny)[0].double()
        want = _far_reference(xd, far, tiny, "rank")
        tol = 2e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(rank, want, rtol=tol, atol=0)
        p = softops.soft_argsort(x[None], method="neuralsort", epsilon=tiny)[0].double()
        pw = _far_reference(xd, far, tiny, "p")
        torch.testing.assert_close(p, pw, rtol=0, atol=tol)
        v = softops.soft_sort(x[None], method="neuralsort", epsilon=tiny)[0].double()
        # (the reference's far-near weights, e**-300, are 0 at the true distance)
        torch.testing.assert_close(v, pw.masked_fill(pw < 1e-100, 0.0) @ xd, rtol=tol, atol=0)
        xi = torch.cat((x[None], torch.tensor([[-torch.inf]], dtype=dtype)), -1)
        ri = softops.soft_rank(xi, method="neuralsort", epsilon=tiny)[0, :-1].double()
        torch.testing.assert_close(ri, rank + pw.sum(0), rtol=tol, atol=0)
        xg = x[None].clone().requires_grad_()
        w = torch.randn(len(x), generator=torch.Generator().manual_seed(28)).to(dtype)
        # (the values': the ranks' derivative, about n / eps, is itself beyond the dtype here)
        out = softops.soft_sort(xg, method="neuralsort", epsilon=tiny)
        (g,) = torch.autograd.grad((out * w).sum(), xg)
        assert torch.isfinite(g).all(), g.tolist()


def test_a_nan_row_of_one_entry_is_nan():
    """The gap-formed logits of a row of one entry have no gap to carry its NaN (found by the
    slow profile's forward_backward on rank-neuralsort): the first gap is 0 * u_0."""
    for dtype in (torch.float32, F64):
        x = torch.tensor([[float("nan")], [1.0]], dtype=dtype)
        e = torch.tensor([1.0, 1.0], dtype=dtype)
        for fn in (_neuralsort.sort, _neuralsort.rank, _neuralsort.argsort):
            out = fn(x, e, False, OPTS)
            assert torch.isnan(out[0]).all() and not torch.isnan(out[1]).any(), (fn, out)
