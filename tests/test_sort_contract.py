"""The registry-driven contract of the sort family (STYLE.md rule 10).

Every (op, method[, regularization or distance]) of ``soft_sort``, ``soft_rank``,
``soft_argsort`` and ``soft_quantile`` goes through the same checks: shapes for every ``dim``,
dtype and device, a batch equals a loop over its rows, the hard limit against the one-line torch
expression, the invariants, a float64 gradcheck, non-finite input, and the errors.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import softops
from softops import soft_argsort, soft_quantile, soft_rank, soft_sort

F64 = torch.float64
Q = (0.0, 0.3, 0.5, 0.85, 1.0)  # quantile levels: on and off the grid q (n - 1)


@dataclass(frozen=True)
class Case:
    op: str  # "sort", "rank", "argsort" or "quantile"
    method: str
    kw: dict[str, Any] = field(default_factory=dict)  # regularization / distance
    hard_eps: float = 1e-2  # small enough for the hard limit on unit gaps
    law: float | None = None  # epsilon -> c**law * epsilon under x -> c * x (None: no exact law)
    precise: dict[str, Any] = field(default_factory=dict)  # solver settings for gradcheck

    @property
    def id(self) -> str:
        extra = "-".join(str(v) for v in self.kw.values())
        return "-".join(filter(None, (self.op, self.method, extra)))

    def __call__(self, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        kw = {"method": self.method, **self.kw, **kw}
        if self.op == "quantile":
            q = kw.pop("q", torch.tensor(Q, dtype=x.dtype))
            kw.pop("descending", None)
            return soft_quantile(x, q, **kw)
        return {"sort": soft_sort, "rank": soft_rank, "argsort": soft_argsort}[self.op](x, **kw)

    def hard(self, x: torch.Tensor, dim: int = -1, descending: bool = False) -> torch.Tensor:
        """The one-line torch expression each docstring names."""
        if self.op == "sort":
            return torch.sort(x, dim, descending).values
        if self.op == "rank":
            return (x.argsort(dim, descending=descending).argsort(dim) + 1).to(x.dtype)
        if self.op == "argsort":
            n = x.shape[dim]
            order = torch.argsort(x, dim, descending=descending)
            return torch.nn.functional.one_hot(order, n).to(x.dtype)
        return torch.quantile(x, torch.tensor(Q, dtype=x.dtype), dim)


OT = {"precise": {"tol": 1e-12}}
CASES = [
    *(
        c
        for op in ("sort", "rank")
        for c in (
            Case(op, "pav", {"regularization": "l2"}, 1e-3, -1.0 if op == "sort" else 1.0),
            Case(op, "pav", {"regularization": "kl"}, 1e-3),
            Case(op, "softsort", {"distance": "l1"}, law=1.0),
            Case(op, "softsort", {"distance": "l2"}, law=2.0),
            Case(op, "neuralsort", law=1.0),
            Case(op, "ot", law=2.0, **OT),
        )
    ),
    Case("argsort", "softsort", {"distance": "l1"}, law=1.0),
    Case("argsort", "softsort", {"distance": "l2"}, law=2.0),
    Case("argsort", "neuralsort", law=1.0),
    Case("argsort", "ot", law=2.0, **OT),
    Case("quantile", "pav", hard_eps=1e-3, law=-1.0),
    Case("quantile", "ot", law=2.0),
]
IDS = [c.id for c in CASES]
ORIENTED = [c for c in CASES if c.op != "quantile"]


def by_op(*ops: str) -> list[Case]:
    return [c for c in CASES if c.op in ops]


def _distinct(*shape: int, dtype=F64) -> torch.Tensor:
    """Random values with gaps of at least 1/20 between any two entries of the tensor."""
    numel = math.prod(shape)
    return (torch.randperm(numel).to(dtype) / 20 + 0.01 * torch.rand(numel, dtype=dtype)).reshape(
        shape
    ) - numel / 40


def _spaced(B: int, n: int) -> torch.Tensor:
    """Rows that are permutations of 0..n-1: unit gaps, for the hard limit."""
    return torch.stack([torch.randperm(n) for _ in range(B)]).to(F64)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny problems: keep off the busy intra-op pool."""


# --------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_shape_for_every_dim(case):
    x = _distinct(2, 3, 4)
    for dim in range(-3, 3):
        out = case(x, dim=dim, epsilon=0.5)
        assert out.shape == case.hard(x, dim).shape, dim
        if case.op == "quantile":
            kept = soft_quantile(x, 0.5, dim=dim, keepdim=True, method=case.method)
            assert kept.shape == torch.quantile(x, 0.5, dim, keepdim=True).shape


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
def test_dtype_and_device(case, dtype):
    x = _distinct(3, 6, dtype=torch.float32) / 4
    ref = case(x.to(dtype).double(), epsilon=0.5)
    out = case(x.to(dtype), epsilon=0.5)
    assert out.dtype == dtype and out.device == x.device
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4, F64: 0.0}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol * max(1.0, ref.abs().max()), rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cuda_device(case):  # pragma: no cover - CPU-only machines
    x = _distinct(3, 6)
    out = case(x.cuda(), epsilon=0.5)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), case(x, epsilon=0.5))


# ---------------------------------------------------------------------- batch equals loop


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_batch_equals_loop_over_rows(case):
    x = _distinct(3, 5, 2)
    eps = torch.tensor([[0.3], [1.0], [2.0]], dtype=F64)  # per row, broadcast to (3, 2)
    out = case(x, dim=1, epsilon=eps, descending=True)
    for i in range(3):
        for j in range(2):
            row = case(x[i, :, j], epsilon=float(eps[i, 0]), descending=True)
            got = out[:, i, j] if case.op == "quantile" else out[i, :, j]
            torch.testing.assert_close(got, row)


# ------------------------------------------------------------------------------ hard limit


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("descending", [False, True])
def test_hard_limit(case, descending):
    if case.op == "quantile" and descending:
        pytest.skip("soft_quantile has no `descending`")
    x = _spaced(2, 7).T  # along dim 0, then along the last dim
    for y, dim in ((x, 0), (x.T.contiguous(), -1)):
        out = case(y, dim=dim, epsilon=case.hard_eps, descending=descending)
        torch.testing.assert_close(out, case.hard(y, dim, descending), atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", by_op("argsort"), ids=lambda c: c.id)
def test_argsort_hard_is_straight_through(case):
    x = _distinct(2, 5).requires_grad_()
    h = case(x, epsilon=0.5, hard=True, descending=True)
    torch.testing.assert_close(h.detach(), case.hard(x.detach(), -1, True))
    g = torch.randn_like(h)
    (gh,) = torch.autograd.grad(h, x, g)
    (gs,) = torch.autograd.grad(case(x, epsilon=0.5, descending=True), x, g)
    torch.testing.assert_close(gh, gs)


# ------------------------------------------------------------------------------ invariants


@pytest.mark.parametrize("case", by_op("sort", "quantile"), ids=lambda c: c.id)
def test_sort_is_monotone(case):
    x = torch.randn(4, 12, dtype=F64)
    for eps in (0.1, 1.0, 10.0):
        if case.op == "sort":
            up = case(x, epsilon=eps)
            down = case(x, epsilon=eps, descending=True)
            assert (up.diff(dim=-1) >= -1e-12).all() and (down.diff(dim=-1) <= 1e-12).all()
        else:
            q = torch.linspace(0, 1, 11, dtype=F64)
            assert (case(x, q=q, epsilon=eps, dim=-1).diff(dim=0) >= -1e-12).all()


@pytest.mark.parametrize(
    "case", [c for c in by_op("rank") if c.method in ("pav", "ot")], ids=lambda c: c.id
)
def test_ranks_in_1_n_and_sum(case):
    n = 9
    x = torch.randn(4, n, dtype=F64)
    x[0, :3] = 0.25  # ties
    for eps in (0.05, 1.0, 20.0):
        r = case(x, epsilon=eps, **case.precise)
        assert ((r >= 1 - 1e-9) & (r <= n + 1e-9)).all()
        torch.testing.assert_close(r.sum(-1), torch.full((4,), n * (n + 1) / 2, dtype=F64))


@pytest.mark.parametrize("case", by_op("argsort"), ids=lambda c: c.id)
def test_rows_of_p_are_stochastic(case):
    x = torch.randn(3, 8, dtype=F64)
    for eps in (0.05, 1.0, 20.0):
        p = case(x, epsilon=eps, descending=True)
        assert (p >= 0).all()
        torch.testing.assert_close(p.sum(-1), torch.ones(3, 8, dtype=F64), atol=1e-12, rtol=0)
        values = soft_sort(x, epsilon=eps, descending=True, method=case.method, **case.kw)
        torch.testing.assert_close((p @ x.unsqueeze(-1)).squeeze(-1), values)  # P @ x = sort


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("descending", [False, True])
def test_permutation_equivariance_and_invariance(case, descending):
    x = torch.randn(2, 10, dtype=F64)
    perm = torch.randperm(10)
    kw = {"epsilon": 0.7, "descending": descending}
    out, outp = case(x, **kw), case(x[:, perm], **kw)
    if case.op == "rank":
        torch.testing.assert_close(outp, out[:, perm])  # equivariant
    elif case.op == "argsort":
        torch.testing.assert_close(outp, out[..., perm])  # columns follow the entries
    else:
        torch.testing.assert_close(outp, out)  # sort and quantile: invariant


@pytest.mark.parametrize("case", [c for c in CASES if c.law is not None], ids=lambda c: c.id)
@pytest.mark.parametrize("c", [0.25, 3.0])
def test_epsilon_scaling_law(case, c):
    # pav-l2: soft_sort(c x, e / c) = c soft_sort(x, e), soft_rank(c x, c e) = soft_rank(x, e);
    # the others: epsilon in units of x (law 1) or x² (law 2).
    x = torch.randn(3, 8, dtype=F64)
    scaled = case(c * x, epsilon=0.6 * c**case.law, **case.precise)
    out = case(x, epsilon=0.6, **case.precise)
    factor = c if case.op in ("sort", "quantile") else 1.0
    torch.testing.assert_close(scaled, factor * out)


# ---------------------------------------------------------------------- gradcheck (float64)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradcheck_float64(case):
    n = 4 if case.op == "argsort" else 5
    x = (torch.randn(2, n, dtype=F64) * 1.5).requires_grad_()
    eps = torch.tensor([0.7, 0.4], dtype=F64, requires_grad=True)  # one per row
    if case.op == "quantile":
        q = torch.tensor([0.1, 0.55, 0.77], dtype=F64, requires_grad=True)  # off the grid
        assert gradcheck(lambda x, e, q: case(x, q=q, epsilon=e, **case.precise), (x, eps, q))
        return
    for descending in (False, True):
        assert gradcheck(
            lambda x, e, d=descending: case(x, epsilon=e, descending=d, **case.precise), (x, eps)
        )


# ----------------------------------------------------------------------- non-finite input


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nan_stays_in_its_row(case):
    x = torch.randn(3, 6, dtype=F64)
    x[1, 2] = math.nan
    x.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN row is not a convergence failure ("ot")
        out = case(x, epsilon=0.5)
    row = (slice(None), 1) if case.op == "quantile" else 1
    keep = [0, 2]
    assert torch.isnan(out[row]).all()
    ref = case(x.detach()[keep], epsilon=0.5)
    torch.testing.assert_close(out[:, keep] if case.op == "quantile" else out[keep], ref)
    (g,) = torch.autograd.grad(out.nan_to_num().sum(), x)
    assert torch.isfinite(g[keep]).all()


def _inf_rows() -> torch.Tensor:
    inf = math.inf
    return torch.tensor(
        [
            [0.3, inf, -1.0, -inf, inf, 2.0, 0.7],  # both signs, tied +inf
            [0.3, 1.1, -1.0, 0.8, 4.0, 2.0, 0.7],  # finite row, unchanged
            [inf, 0.1, 0.9, -0.5, 1.2, 0.3, 0.6],  # one +inf
            [-inf, -inf, -inf, 1.0, -inf, -inf, -inf],  # one finite entry
            [inf, inf, -inf, inf, -inf, inf, inf],  # no finite entry
        ],
        dtype=F64,
    )


@pytest.mark.parametrize("case", [c for c in ORIENTED if c.method != "pav"], ids=lambda c: c.id)
@pytest.mark.parametrize("descending", [False, True])
def test_infinities_are_limits(case, descending):
    # The limit x_j = ±M, M -> inf: equal to a large finite surrogate (where the coupling has
    # underflowed), with +inf last (ascending) and finite entries as if the infinities were gone.
    x = _inf_rows().requires_grad_()
    eps = 0.3
    kw = {"epsilon": eps, "descending": descending, **case.precise}
    out = case(x, **kw)
    assert not torch.isnan(out).any()
    big = 30.0 if case.method == "ot" else 100.0  # squared cost 900 / eps: underflows
    xs = torch.nan_to_num(x.detach(), posinf=big, neginf=-big).requires_grad_()
    ref = case(xs, **kw)
    if case.op == "sort":
        ref = torch.where(ref.abs() > big / 2, ref.sign() * math.inf, ref)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g.where(torch.isfinite(out), 0.0))
    (gs,) = torch.autograd.grad(ref, xs, g.where(torch.isfinite(out), 0.0))
    finite = torch.isfinite(x.detach())
    torch.testing.assert_close(gx[finite], gs[finite], atol=1e-9, rtol=1e-9)
    assert (gx[~finite] == 0).all()
    # finite entries relaxed among themselves; a single +inf sorts last with rank n
    row = x.detach()[2]
    if case.op == "sort":
        alone = case(row[1:], **kw)
        want = torch.cat((alone, row[:1])) if not descending else torch.cat((row[:1], alone))
        torch.testing.assert_close(out[2], want)
    if case.op == "rank":
        assert out[2, 0] == (1.0 if descending else 7.0)


@pytest.mark.parametrize("case", [c for c in ORIENTED if c.method == "pav"], ids=lambda c: c.id)
def test_infinities_pav(case):
    inf = math.inf
    x = torch.tensor([[0.0, inf, 1.0, -inf, inf], [0.5, 1.0, inf, -1.0, 2.0]], dtype=F64)
    out = case(x, epsilon=0.5)
    if case.op == "rank":
        ref = case(torch.nan_to_num(x, posinf=1e9, neginf=-1e9), epsilon=0.5)
        torch.testing.assert_close(out, ref)
        assert out[0, 1] == out[0, 4] == 4.5 and out[0, 3] == 1.0
    elif case.kw["regularization"] == "l2":
        assert torch.isnan(out[0]).all()  # +inf and -inf: the limit depends on their rates
        assert (out[1] == inf).all()  # the l2 soft sort keeps the (infinite) mean
    else:
        ref = case(torch.nan_to_num(x[1:], posinf=1e9), epsilon=0.5)
        torch.testing.assert_close(out[1:], ref)  # kl saturates: finite


@pytest.mark.parametrize("case", by_op("quantile"), ids=lambda c: c.id)
def test_quantile_infinities(case):
    inf = math.inf
    x = torch.tensor([[inf, 0.0, 1.0, 2.0, 3.0], [-inf, 0.0, 1.0, 2.0, inf]], dtype=F64)
    out = case(x, q=torch.tensor([0.0, 0.5, 1.0], dtype=F64), epsilon=1e-2)
    if case.method == "ot":  # the infinities sort to the ends, the rest is the hard quantile
        want = torch.tensor([[0.0, -inf], [2.0, 1.0], [inf, inf]], dtype=F64)
        torch.testing.assert_close(out, want)
    else:  # pav: the l2 soft sort of a row with +inf is all +inf; both signs: NaN
        assert (out[:, 0] == inf).all() and torch.isnan(out[:, 1]).all()


# --------------------------------------------------------------------------------- errors

UNUSED = {"regularization": "kl", "distance": "l2", "max_iter": 5, "tol": 0.5}
USES = {
    "pav": {"regularization"},
    "softsort": {"distance"},
    "neuralsort": set(),
    "ot": {"max_iter", "tol"},
}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_errors(case):
    x = torch.randn(2, 5)
    op = f"soft_{case.op}"
    with pytest.raises(ValueError, match=rf"^{op}: expected .*got method='bogus'\.$"):
        case(x, method="bogus")
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=rf"^{op}: expected .*got epsilon={bad}\.$"):
            case(x, epsilon=bad)
    with pytest.raises(ValueError, match=re.escape("got epsilon=-2.0.")):
        case(x, epsilon=torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match=re.escape("got epsilon=nan.")):
        case(x, epsilon=math.nan)
    for dtype in (torch.int64, torch.int32, torch.bool):
        with pytest.raises(TypeError, match=rf"^{op}: expected .*got dtype={dtype}\.$"):
            case(torch.zeros(2, 5, dtype=dtype))
    with pytest.raises(ValueError, match=re.escape("got dim=2.")):
        case(x, dim=2)
    with pytest.raises(TypeError, match=re.escape("got 1.0.")):
        case(x, dim=1.0)
    with pytest.raises(ValueError, match=re.escape("got x.shape[1] = 0")):
        case(torch.randn(2, 0))
    if case.op != "quantile":
        with pytest.raises(TypeError, match=re.escape("got descending=1.")):
            case(x, descending=1)
    if case.op == "quantile":
        return
    used = USES[case.method]
    for name, value in UNUSED.items():
        if name in used or (case.op == "argsort" and name == "regularization"):
            continue
        message = f"expected `{name}` to be left at its default"
        with pytest.raises(ValueError, match=rf"^{op}: {message}.*got {name}={value!r}\.$"):
            case(x, **{name: value})
    case(x, distance="l1", max_iter=None, tol=None)  # defaults always pass
    if case.op != "argsort":
        case(x, regularization="l2")
    if "regularization" in used:
        with pytest.raises(ValueError, match=re.escape("got regularization='l3'.")):
            case(x, regularization="l3")
    if "distance" in used:
        with pytest.raises(ValueError, match=re.escape("got distance='l7'.")):
            case(x, distance="l7")
    if case.method == "ot":
        with pytest.raises(ValueError, match=re.escape("got max_iter=0.")):
            case(x, max_iter=0)
        with pytest.raises(TypeError, match=re.escape("got max_iter=2.5.")):
            case(x, max_iter=2.5)
        with pytest.raises(ValueError, match=re.escape("got tol=-1.")):
            case(x, tol=-1)


def test_errors_argsort_and_quantile():
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match=r"^soft_argsort: expected .*got method='pav'\.$"):
        soft_argsort(x, method="pav")
    with pytest.raises(TypeError, match=re.escape("got hard='yes'.")):
        soft_argsort(x, hard="yes")
    for method in ("softsort", "neuralsort"):
        with pytest.raises(ValueError, match=rf"^soft_quantile: .*got method='{method}'\.$"):
            soft_quantile(x, 0.5, method=method)
    for q in (1.5, -0.25, math.nan):
        with pytest.raises(ValueError, match=rf"^soft_quantile: expected 0 <= `q` <= 1; got q={q}"):
            soft_quantile(x, q)
    with pytest.raises(ValueError, match=re.escape("got q=-0.25.")):
        soft_quantile(x, torch.tensor([0.5, -0.25]))
    with pytest.raises(ValueError, match=re.escape("got q of shape (1, 2).")):
        soft_quantile(x, torch.tensor([[0.5, 0.2]]))
    with pytest.raises(TypeError, match=re.escape("got 'half'.")):
        soft_quantile(x, "half")
    with pytest.raises(TypeError, match=re.escape("got keepdim=1.")):
        soft_quantile(x, 0.5, keepdim=1)
    with pytest.raises(ValueError, match=re.escape("got shape (4,).")):
        soft_rank(torch.randn(2, 3, 6), epsilon=torch.ones(4))


# --------------------------------------------------------------------------------- Modules


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_module_equals_function(case):
    x = torch.randn(2, 5, dtype=F64)
    if case.op == "quantile":
        layer = softops.nn.SoftQuantile(0.3, dim=-1, epsilon=0.4, method=case.method)
        torch.testing.assert_close(layer(x), case(x, q=0.3, epsilon=0.4))
        return
    cls = {"sort": "SoftSort", "rank": "SoftRank", "argsort": "SoftArgsort"}[case.op]
    layer = getattr(softops.nn, cls)(epsilon=0.4, descending=True, method=case.method, **case.kw)
    torch.testing.assert_close(layer(x), case(x, epsilon=0.4, descending=True))
    assert "epsilon=0.4" in repr(layer)


# ------------------------------------------------------------------- properties (hypothesis)


@settings(max_examples=25, deadline=None)
@given(
    values=st.lists(
        st.sampled_from([-math.inf, -1e6, -2.0, 0.0, 0.0, 0.5, 3.0, 1e6, math.inf]),
        min_size=1,
        max_size=9,
    ),
    eps=st.sampled_from([1e-2, 1.0, 1e2]),
    descending=st.booleans(),
    case=st.sampled_from([c for c in ORIENTED if c.method != "pav"]),
)
def test_ties_magnitudes_and_infinities(values, eps, descending, case):
    # never NaN without a NaN input; tied entries share ranks and columns of P; rows sum to 1
    x = torch.tensor([values], dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # far-apart values at small eps: slow OT
        out = case(x, epsilon=eps, descending=descending)
    assert not torch.isnan(out).any()
    n = len(values)
    if case.op == "sort":
        a, b = (out[0, 1:], out[0, :-1]) if descending else (out[0, :-1], out[0, 1:])
        assert ((b >= a) | (b - a >= -1e-6 * (1 + a.abs()))).all()
    if case.op == "argsort":
        torch.testing.assert_close(out.sum(-1), torch.ones(1, n, dtype=F64))
    if case.op == "rank":
        for i in range(n):
            for j in range(i):
                if values[i] == values[j]:
                    torch.testing.assert_close(out[0, i], out[0, j])


# ------------------------------------------------------------------------- torch.compile


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_compile(case):
    x = torch.randn(3, 6, requires_grad=True)
    compiled = torch.compile(lambda t: case(t, epsilon=0.5))
    out = compiled(x)
    torch.testing.assert_close(out, case(x, epsilon=0.5))
    (g,) = torch.autograd.grad(out.sum(), x)
    (ref,) = torch.autograd.grad(case(x, epsilon=0.5).sum(), x)
    torch.testing.assert_close(g, ref)
