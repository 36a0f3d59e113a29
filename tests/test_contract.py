"""The registry-driven contract of every public op and method.

Every entry of ``CASES`` (an op, a method and its options) goes through the same checks: shapes
for every ``dim``, dtype and device, a batch equals a loop over its rows, the hard limit against
the one-line torch expression its docstring names, the epsilon scaling law, permutation
equivariance, a float64 gradcheck, NaN and ±inf, every common error, and the nn Module equals the
function. Checks that only make sense for one family (sorted output is monotone, ranks sum to
n(n+1)/2, masks sum to k, ...) select their cases with ``by_op``.

``test_registry_covers_every_public_op`` fails when a public op or method has no entry, so a new
op cannot be added without joining the contract. Monte-Carlo methods (``stochastic``) skip the
deterministic checks (gradcheck, batch equals loop); their estimators are tested statistically in
``tests/topk/test_perturbed.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pickle
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import softops
from softops import soft_argsort, soft_quantile, soft_rank, soft_sort
from softops._kernels import backend, kernels_enabled
from softops.sort import ARGSORT_METHODS, QUANTILE_METHODS, SORT_METHODS
from softops.topk import MASK_METHODS

F64 = torch.float64
Q = (0.0, 0.3, 0.5, 0.85, 1.0)  # quantile levels: on and off the grid q (n - 1)
K = 2  # k of the top-k ops (every dim of the (2, 3, 4) shape test holds it)

# How each op's output relates to x along `dim`:
#   "same": x.shape; "reduce": dim removed; "quantile": a leading axis of len(q);
#   "square": x.shape + (n,); "k": dim replaced by k.
LAYOUT = {
    "soft_sort": "same",
    "soft_rank": "same",
    "soft_argsort": "square",
    "soft_quantile": "quantile",
    "soft_topk_mask": "same",
    "soft_topk": "k",
    "soft_kmax": "same",
    "smooth_max": "reduce",
    "smooth_min": "reduce",
    "soft_argmax": "reduce",
    "soft_argmin": "reduce",
    "soft_argmax_onehot": "same",
}
FLAG = {  # the orientation flag of each op, with its default
    "soft_sort": ("descending", False),
    "soft_rank": ("descending", False),
    "soft_argsort": ("descending", False),
    "soft_topk_mask": ("largest", True),
    "soft_topk": ("largest", True),
}
MODULE = {  # the nn Module of each op
    "soft_sort": "SoftSort",
    "soft_rank": "SoftRank",
    "soft_argsort": "SoftArgsort",
    "soft_quantile": "SoftQuantile",
    "soft_topk_mask": "SoftTopKMask",
    "soft_topk": "SoftTopK",
    "soft_kmax": "SoftKMax",
    "smooth_max": "SmoothMax",
    "smooth_min": "SmoothMin",
    "soft_argmax": "SoftArgmax",
    "soft_argmin": "SoftArgmin",
    "soft_argmax_onehot": "SoftArgmaxOneHot",
}
TAKES_K = {"soft_topk_mask", "soft_topk", "soft_kmax"}
# Public callables of `softops` that are not ops on a tensor x, and why.
EXEMPT = {
    "set_compile": "a switch, not an op",
    "topk_selection_matrix": "takes indices, not scores: tested in tests/topk",
}


def _hard_mask(x: torch.Tensor, k: int, dim: int, largest: bool) -> torch.Tensor:
    return torch.zeros_like(x).scatter(dim, x.topk(k, dim, largest).indices, 1)


def _one_hot_along(index: torch.Tensor, n: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.functional.one_hot(index, n).to(dtype).movedim(-1, dim)


HARD: dict[str, Callable[..., torch.Tensor]] = {  # the one-line torch expression of each op
    "soft_sort": lambda x, dim, d: torch.sort(x, dim, d).values,
    "soft_rank": lambda x, dim, d: (x.argsort(dim, descending=d).argsort(dim) + 1).to(x.dtype),
    "soft_argsort": lambda x, dim, d: torch.nn.functional.one_hot(
        torch.argsort(x, dim, descending=d), x.shape[dim]
    ).to(x.dtype),
    "soft_quantile": lambda x, dim, d: torch.quantile(x, torch.tensor(Q, dtype=x.dtype), dim),
    "soft_topk_mask": lambda x, dim, d: _hard_mask(x, K, dim, d),
    "soft_topk": lambda x, dim, d: torch.topk(x, K, dim, d, sorted=True).values,
    "soft_kmax": lambda x, dim, d: _hard_mask(x, K, dim, True),
    "smooth_max": lambda x, dim, d: x.amax(dim),
    "smooth_min": lambda x, dim, d: x.amin(dim),
    "soft_argmax": lambda x, dim, d: x.argmax(dim).to(x.dtype),
    "soft_argmin": lambda x, dim, d: x.argmin(dim).to(x.dtype),
    "soft_argmax_onehot": lambda x, dim, d: _one_hot_along(
        x.argmax(dim), x.shape[dim], dim, x.dtype
    ),
}


@dataclass(frozen=True)
class Case:
    op: str  # the public function's name
    method: str | None = None  # None: the op has no `method`
    kw: dict[str, Any] = field(default_factory=dict)  # method options (regularization, ...)
    hard_eps: float = 1e-2  # small enough for the hard limit on unit gaps
    law: float | None = None  # epsilon -> c**law * epsilon under x -> c * x (None: no exact law)
    precise: dict[str, Any] = field(default_factory=dict)  # solver settings for gradcheck
    stochastic: bool = False  # Monte-Carlo: no gradcheck, no batch-equals-loop
    grad_eps: bool = True  # epsilon receives a gradient
    perm: str | None = "follow"  # "follow" (equivariant), "invariant", or None (index-valued)
    inf_limit: bool = True  # ±inf equal their large finite surrogates
    back_end: str = "kernel"  # softops._kernels.backend the entry runs on (the _back_end fixture)

    @property
    def id(self) -> str:
        extra = "-".join(str(v) for v in self.kw.values())
        parts = (self.op.removeprefix("soft_"), self.method, extra)
        return "-".join(filter(None, (*parts, "reference" if self.back_end == "reference" else "")))

    @property
    def layout(self) -> str:
        return LAYOUT[self.op]

    @property
    def flag(self) -> tuple[str, bool] | None:
        return FLAG.get(self.op)

    @property
    def units_of_x(self) -> bool:
        """The output is in the units of x (it scales with x)."""
        return self.op in ("soft_sort", "soft_quantile", "soft_topk", "smooth_max", "smooth_min")

    def _kwargs(self, kw: dict[str, Any]) -> dict[str, Any]:
        base = dict(self.kw)
        if self.method is not None:
            base["method"] = self.method
        if self.stochastic and "generator" not in kw:  # (none made where the caller gives one)
            base["generator"] = torch.Generator().manual_seed(7)
        base.update(kw)
        if self.flag is None or self.op == "soft_quantile":
            base.pop("descending", None)
        flag = base.pop("orient", None)
        if flag is not None and self.flag is not None:
            base[self.flag[0]] = flag
        return base

    def __call__(self, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        """The op on x; ``orient=`` sets the orientation flag (descending or largest)."""
        kw = self._kwargs(kw)
        fn = getattr(softops, self.op)
        if self.op == "soft_quantile":
            q = kw.pop("q", torch.tensor(Q, dtype=getattr(x, "dtype", F64)))
            return fn(x, q, **kw)
        if self.op in TAKES_K:
            out = fn(x, kw.pop("k", K), **kw)
            return out.values if self.op == "soft_topk" else out
        return fn(x, **kw)

    def hard(self, x: torch.Tensor, dim: int = -1, orient: bool | None = None) -> torch.Tensor:
        """The one-line torch expression the op's docstring names."""
        d = self.flag[1] if orient is None and self.flag else orient
        return HARD[self.op](x, dim, d)

    def row(self, out: torch.Tensor, i: int, j: int) -> torch.Tensor:
        """The output of row (i, :, j) of an x of shape (B, n, C) reduced along dim 1."""
        if self.layout == "quantile":
            return out[:, i, j]
        if self.layout == "reduce":
            return out[i, j]
        return out[i, :, j]

    def module(self, **kw: Any) -> torch.nn.Module:
        kw = self._kwargs(kw)
        cls = getattr(softops.nn, MODULE[self.op])
        if self.op == "soft_quantile":
            return cls(kw.pop("q", 0.3), **kw)
        if self.op in TAKES_K:
            return cls(kw.pop("k", K), **kw)
        return cls(**kw)


OT = {"precise": {"tol": 1e-12}}
SORT_CASES = [
    *(
        c
        for op, perm in (("soft_sort", "invariant"), ("soft_rank", "follow"))
        for c in (
            Case(
                op,
                "pav",
                {"regularization": "l2"},
                1e-3,
                -1.0 if op == "soft_sort" else 1.0,
                perm=perm,
                inf_limit=False,  # its own limits: test_infinities_pav
            ),
            Case(op, "pav", {"regularization": "kl"}, 1e-3, perm=perm, inf_limit=False),
            Case(op, "softsort", {"distance": "l1"}, law=1.0, perm=perm),
            Case(op, "softsort", {"distance": "l2"}, law=2.0, perm=perm),
            Case(op, "neuralsort", law=1.0, perm=perm),
            Case(op, "ot", law=2.0, perm=perm, **OT),
        )
    ),
    Case("soft_argsort", "softsort", {"distance": "l1"}, law=1.0),
    Case("soft_argsort", "softsort", {"distance": "l2"}, law=2.0),
    Case("soft_argsort", "neuralsort", law=1.0),
    Case("soft_argsort", "ot", law=2.0, **OT),
    Case("soft_quantile", "pav", hard_eps=1e-3, law=-1.0, perm="invariant"),
    Case("soft_quantile", "ot", law=2.0, perm="invariant"),
]
TOPK_CASES = [
    Case("soft_topk_mask", "ot", law=1.0),
    Case("soft_topk_mask", "sinkhorn", law=1.0, grad_eps=False, precise={"tol": 1e-12}),
    Case("soft_topk_mask", "softkmax", law=1.0, inf_limit=False),
    Case("soft_topk_mask", "sparse", law=1.0),
    Case(
        "soft_topk_mask",
        "perturbed",
        hard_eps=1e-3,
        law=1.0,
        stochastic=True,
        grad_eps=False,
        perm=None,  # permuting x permutes which draw each entry gets
    ),
    Case("soft_topk", hard_eps=0.02, law=1.0, perm="invariant", precise={"tol": 1e-12}),
    Case("soft_kmax", law=1.0, inf_limit=False),
]
SMOOTH_CASES = [
    Case("smooth_max", law=1.0, perm="invariant"),
    Case("smooth_min", law=1.0, perm="invariant"),
    Case("soft_argmax", law=1.0, perm=None),
    Case("soft_argmin", law=1.0, perm=None),
    Case("soft_argmax_onehot", law=1.0),
]
# The back-end axis: the methods with a compiled CPU kernel (PAV, the threshold of "ot", the
# sorted top-k and the Newton solve of the OT sorts) go through the whole contract a second time
# on their torch reference, the implementation of every other device.
_KERNEL_BACKED = [
    c for c in SORT_CASES + TOPK_CASES if c.method in ("pav", "ot") or c.op == "soft_topk"
]
CASES = (
    SORT_CASES
    + TOPK_CASES
    + SMOOTH_CASES
    + [dataclasses.replace(c, back_end="reference") for c in _KERNEL_BACKED]
)
IDS = [c.id for c in CASES]
DETERMINISTIC = [c for c in CASES if not c.stochastic]


def by_op(*ops: str) -> list[Case]:
    return [c for c in CASES if c.op in ops]


def cases(selected: list[Case]):
    return pytest.mark.parametrize("case", selected, ids=lambda c: c.id)


def _distinct(*shape: int, dtype=F64) -> torch.Tensor:
    """Random values with gaps of at least 1/20 between any two entries of the tensor."""
    numel = math.prod(shape)
    return (torch.randperm(numel).to(dtype) / 20 + 0.01 * torch.rand(numel, dtype=dtype)).reshape(
        shape
    ) - numel / 40


def _spaced(B: int, n: int) -> torch.Tensor:
    """Rows that are permutations of 0..n-1: unit gaps, for the hard limit."""
    return torch.stack([torch.randperm(n) for _ in range(B)]).to(F64)


def _orients(case: Case) -> list[bool | None]:
    return [None] if case.flag is None or case.op == "soft_quantile" else [False, True]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny problems: keep off the busy intra-op pool."""


@pytest.fixture(autouse=True)
def _back_end(request):
    """Run the test on its case's back end (the kernels by default)."""
    callspec = getattr(request.node, "callspec", None)
    case = callspec.params.get("case") if callspec is not None else None
    with backend(getattr(case, "back_end", "kernel")):
        yield


# ------------------------------------------------------------------------------- registry


def test_registry_covers_every_public_op():
    public = {
        name
        for name in softops.__all__
        if inspect.isfunction(getattr(softops, name)) and name not in EXEMPT
    }
    assert public == {c.op for c in CASES}, "every public op needs a registry entry"
    methods = {
        "soft_sort": SORT_METHODS,
        "soft_rank": SORT_METHODS,
        "soft_argsort": ARGSORT_METHODS,
        "soft_quantile": QUANTILE_METHODS,
        "soft_topk_mask": MASK_METHODS,
    }
    for op, names in methods.items():
        assert {c.method for c in by_op(op)} == set(names), op
    for op in public - set(methods):
        assert "method" not in inspect.signature(getattr(softops, op)).parameters, op
    assert set(MODULE) == public and all(hasattr(softops.nn, m) for m in MODULE.values())


@cases([c for c in CASES if c.back_end == "reference"])
def test_reference_entries_run_on_the_reference(case):
    # the back-end axis: each kernel-backed method's second entry runs on the torch reference
    assert not kernels_enabled()
    assert any(c.back_end == "kernel" and c.id == case.id.removesuffix("-reference") for c in CASES)


# --------------------------------------------------------------------------------- shapes


@cases(CASES)
def test_shape_for_every_dim(case):
    x = _distinct(2, 3, 4)
    for dim in range(-3, 3):
        out = case(x, dim=dim, epsilon=0.5)
        assert out.shape == case.hard(x, dim).shape, dim
    if case.layout in ("reduce", "quantile"):
        for dim in range(-3, 3):
            kept = case(x, dim=dim, epsilon=0.5, keepdim=True)
            want = x.amax(dim, keepdim=True).shape
            assert kept.shape == (want if case.layout == "reduce" else (len(Q), *want)), dim


@cases(CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
def test_dtype_and_device(case, dtype):
    x = _distinct(3, 6, dtype=torch.float32) / 4
    ref = case(x.to(dtype).double(), epsilon=0.5)
    out = case(x.to(dtype), epsilon=0.5)
    assert out.dtype == dtype and out.device == x.device
    if case.stochastic:  # the noise is drawn in the compute dtype: other draws
        torch.testing.assert_close(out.double().sum(-1), ref.sum(-1), atol=1e-2, rtol=0)
        return
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4, F64: 0.0}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol * max(1.0, ref.abs().max()), rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@cases(DETERMINISTIC)
def test_cuda_device(case):  # pragma: no cover - CPU-only machines
    x = _distinct(3, 6)
    out = case(x.cuda(), epsilon=0.5)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), case(x, epsilon=0.5))


@cases(CASES)
def test_empty_batch_stays_on_the_graph(case):
    x = torch.randn(0, 5, dtype=F64, requires_grad=True)
    out = case(x, epsilon=0.5)
    assert out.numel() == 0 and out.requires_grad


# ---------------------------------------------------------------------- batch equals loop


@cases(DETERMINISTIC)
def test_batch_equals_loop_over_rows(case):
    x = _distinct(3, 5, 2)
    eps = torch.tensor([[0.3], [1.0], [2.0]], dtype=F64)  # per row, broadcast to (3, 2)
    orient = None if case.flag is None else not case.flag[1]
    out = case(x, dim=1, epsilon=eps, orient=orient)
    for i in range(3):
        for j in range(2):
            row = case(x[i, :, j], epsilon=float(eps[i, 0]), orient=orient)
            torch.testing.assert_close(case.row(out, i, j), row)


# ------------------------------------------------------------------------------ hard limit


@cases(CASES)
def test_hard_limit(case):
    x = _spaced(2, 7).T  # along dim 0, then along the last dim
    for orient in _orients(case):
        for y, dim in ((x, 0), (x.T.contiguous(), -1)):
            out = case(y, dim=dim, epsilon=case.hard_eps, orient=orient)
            torch.testing.assert_close(out, case.hard(y, dim, orient), atol=1e-6, rtol=0)


_X_RANGE = [0.3, -1.2, 0.8, 2.0, -0.4]  # distinct entries with unit-scale gaps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("epsilon", [1e-50, 1e-320, 1e39, 1e300])
@cases(CASES)
def test_epsilon_outside_the_dtype(case, epsilon, dtype):
    """A valid positive epsilon that the compute dtype cannot hold: below its smallest normal
    number (it underflows to 0, or is a subnormal) every op refuses it with one message; above
    its largest finite value every op takes its limit (never NaN), the uniform mask for the
    top-k masks, and a finite gradient."""
    x = torch.tensor(_X_RANGE, dtype=dtype, requires_grad=True)
    tiny = torch.finfo(torch.promote_types(dtype, torch.float32)).tiny
    if epsilon < tiny:
        with pytest.raises(ValueError, match=r": expected `epsilon` >= [0-9.e+-]+ \(the smal"):
            case(x, epsilon=epsilon)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a convergence note at the limit is not the point here
        out = case(x, epsilon=epsilon)
    assert out.dtype == dtype
    if case.op in ("smooth_max", "smooth_min"):  # max + O(epsilon log n): may overflow to inf
        assert not out.isnan().any()
    else:
        assert torch.isfinite(out).all(), out
    if epsilon < 1 and not case.stochastic:  # float64 holds 1e-50: the hard limit
        hard = case.hard(x.detach().double())
        torch.testing.assert_close(out.detach().double(), hard, atol=1e-6, rtol=1e-6)
    if epsilon > 1 and case.op == "soft_topk_mask" and case.method not in ("softkmax", "perturbed"):
        tol = 1e-6 if dtype in (torch.float32, F64) else 1e-2
        uniform = torch.full((5,), K / 5, dtype=F64)
        torch.testing.assert_close(out.detach().double(), uniform, atol=tol, rtol=0)
    if dtype in (torch.float32, F64) and out.requires_grad:
        (g,) = torch.autograd.grad(out.sum(), x)
        assert not g.isnan().any()


@cases(by_op("soft_argsort", "soft_topk_mask", "soft_argmax_onehot"))
def test_hard_is_straight_through(case):
    x = _distinct(2, 5).requires_grad_()
    orient = None if case.flag is None else not case.flag[1]
    h = case(x, epsilon=0.5, hard=True, orient=orient)
    torch.testing.assert_close(h.detach(), case.hard(x.detach(), -1, orient))
    g = torch.randn_like(h)
    (gh,) = torch.autograd.grad(h, x, g)
    (gs,) = torch.autograd.grad(case(x, epsilon=0.5, orient=orient), x, g)
    torch.testing.assert_close(gh, gs)


# ------------------------------------------------------------------------------ invariants


@cases(by_op("soft_sort", "soft_quantile", "soft_topk"))
def test_sorted_output_is_monotone(case):
    x = torch.randn(4, 12, dtype=F64)
    for eps in (0.1, 1.0, 10.0):
        if case.op == "soft_quantile":
            q = torch.linspace(0, 1, 11, dtype=F64)
            assert (case(x, q=q, epsilon=eps, dim=-1).diff(dim=0) >= -1e-12).all()
            continue
        # ascending: descending=False (sort), largest=False (top-k: the smallest first)
        up, down = case(x, epsilon=eps, orient=False), case(x, epsilon=eps, orient=True)
        assert (up.diff(dim=-1) >= -1e-12).all() and (down.diff(dim=-1) <= 1e-12).all()


@cases([c for c in by_op("soft_rank") if c.method in ("pav", "ot")])
def test_ranks_in_1_n_and_sum(case):
    n = 9
    x = torch.randn(4, n, dtype=F64)
    x[0, :3] = 0.25  # ties
    for eps in (0.05, 1.0, 20.0):
        r = case(x, epsilon=eps, **case.precise)
        assert ((r >= 1 - 1e-9) & (r <= n + 1e-9)).all()
        torch.testing.assert_close(r.sum(-1), torch.full((4,), n * (n + 1) / 2, dtype=F64))


@cases(by_op("soft_argsort", "soft_argmax_onehot"))
def test_rows_are_stochastic(case):
    x = torch.randn(3, 8, dtype=F64)
    for eps in (0.05, 1.0, 20.0):
        p = case(x, epsilon=eps, orient=True)
        assert (p >= 0).all()
        total = p.sum(-1)
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-12, rtol=0)
        if case.op == "soft_argsort":
            values = soft_sort(x, epsilon=eps, descending=True, method=case.method, **case.kw)
            torch.testing.assert_close((p @ x.unsqueeze(-1)).squeeze(-1), values)  # P @ x


@cases(by_op("soft_topk_mask", "soft_kmax"))
def test_mask_sums_to_k_in_unit_interval(case):
    x = torch.randn(4, 12, dtype=F64) * 3
    x[0, :4] = 0.5  # ties
    for eps in (1e-3, 0.3, 30.0):
        for k in (0, 1, 5, 12):
            with warnings.catch_warnings():
                # the paper's Sinkhorn crawls at epsilon far below the gaps (and says so); its
                # columns, hence the sum, are exact at every iteration
                warnings.simplefilter("ignore", softops.ConvergenceWarning)
                A = case(x, k=k, epsilon=eps)
            total = A.sum(-1)
            tol = 1e-6 if case.stochastic else 1e-9  # perturbed: counts / n_samples
            torch.testing.assert_close(total, torch.full_like(total, k), atol=tol, rtol=0)
            assert (A >= 0).all()
            if case.method != "softkmax" and case.op != "soft_kmax":  # not clipped (documented)
                # Sinkhorn's row marginals are exact to its tolerance (1e-9 in float64)
                assert (A <= 1 + (1e-8 if case.method == "sinkhorn" else 1e-12)).all()


@cases(by_op("soft_topk"))
def test_sorted_topk_weights_are_relaxed_one_hots(case):
    x = torch.randn(3, 9, dtype=F64)
    out = softops.soft_topk(x, 4, epsilon=0.3)
    assert out.weights.shape == (3, 4, 9) and (out.weights >= 0).all()
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(3, 4, dtype=F64))
    torch.testing.assert_close(out.values, (out.weights @ x.unsqueeze(-1)).squeeze(-1))
    assert torch.equal(out.indices, x.topk(4, -1).indices)


@cases(SMOOTH_CASES)
def test_smooth_bounds(case):
    x = torch.randn(4, 10, dtype=F64) * 2
    for eps in (1e-3, 0.5, 50.0):
        out = case(x, epsilon=eps)
        if case.op == "smooth_max":
            assert (out >= x.amax(-1)).all() and (out <= x.amax(-1) + eps * math.log(10)).all()
        elif case.op == "smooth_min":
            assert (out <= x.amin(-1)).all() and (out >= x.amin(-1) - eps * math.log(10)).all()
        elif case.layout == "reduce":
            assert ((out >= 0) & (out <= 9)).all()


@cases([c for c in CASES if c.perm is not None])
def test_permutation_equivariance_and_invariance(case):
    x = torch.randn(2, 10, dtype=F64)
    perm = torch.randperm(10)
    for orient in _orients(case):
        kw = {"epsilon": 0.7, "orient": orient}
        out, outp = case(x, **kw), case(x[:, perm], **kw)
        if case.perm == "invariant":
            torch.testing.assert_close(outp, out)
        elif case.layout == "square":
            torch.testing.assert_close(outp, out[..., perm])  # columns follow the entries
        else:
            torch.testing.assert_close(outp, out[:, perm])


@cases([c for c in CASES if c.law is not None])
@pytest.mark.parametrize("c", [0.25, 3.0])
def test_epsilon_scaling_law(case, c):
    # pav-l2: soft_sort(c x, e / c) = c soft_sort(x, e), soft_rank(c x, c e) = soft_rank(x, e);
    # the others: epsilon in units of x (law 1) or x² (law 2).
    x = torch.randn(3, 8, dtype=F64)
    scaled = case(c * x, epsilon=0.6 * c**case.law, **case.precise)
    out = case(x, epsilon=0.6, **case.precise)
    factor = c if case.units_of_x else 1.0
    torch.testing.assert_close(scaled, factor * out)


# ---------------------------------------------------------------------- gradcheck (float64)


@cases(DETERMINISTIC)
def test_gradcheck_float64(case):
    n = 4 if case.layout == "square" else 5
    x = (torch.randn(2, n, dtype=F64) * 1.5).requires_grad_()
    eps = torch.tensor([0.7, 0.4], dtype=F64, requires_grad=case.grad_eps)  # one per row
    if case.op == "soft_quantile":
        q = torch.tensor([0.1, 0.55, 0.77], dtype=F64, requires_grad=True)  # off the grid
        assert gradcheck(lambda x, e, q: case(x, q=q, epsilon=e, **case.precise), (x, eps, q))
        return
    inputs = (x, eps) if case.grad_eps else (x,)
    for orient in _orients(case):

        def fn(x, e=eps, o=orient):
            return case(x, epsilon=e, orient=o, **case.precise)

        assert gradcheck(fn, inputs)


# ----------------------------------------------------------------------- non-finite input


@cases(CASES)
def test_nan_stays_in_its_row(case):
    x = torch.randn(3, 6, dtype=F64)
    x[1, 2] = math.nan
    x.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN row is not a convergence failure
        out = case(x, epsilon=0.5)
    row = (slice(None), 1) if case.layout == "quantile" else 1
    keep = [0, 2]
    assert torch.isnan(out[row]).all()
    kept = out[:, keep] if case.layout == "quantile" else out[keep]
    if case.stochastic:
        assert torch.isfinite(kept).all()
    else:
        torch.testing.assert_close(kept, case(x.detach()[keep], epsilon=0.5))
    (g,) = torch.autograd.grad(out.nan_to_num().sum(), x)
    assert torch.isfinite(g[keep]).all()


def _inf_rows() -> torch.Tensor:
    inf = math.inf
    return torch.tensor(
        [
            [0.3, inf, -1.0, -inf, inf, 2.0, 0.7],  # both signs, tied +inf
            [0.3, 1.1, -1.0, 0.8, 4.0, 2.0, 0.7],  # finite row, unchanged
            [inf, 0.1, 0.9, -0.5, 1.2, 0.3, 0.6],  # one +inf
            [-inf, 0.2, -inf, 1.0, 5.0, 3.0, 0.1],  # tied -inf
        ],
        dtype=F64,
    )


@cases([c for c in CASES if c.inf_limit and c.layout != "quantile"])
def test_infinities_are_limits(case):
    # The limit x_j = ±M, M -> inf equals a large finite surrogate (where every coupling with it
    # has underflowed); the gradient of an infinite entry is 0 and the others match the surrogate.
    x = _inf_rows().requires_grad_()
    for orient in _orients(case):
        kw = {"epsilon": 0.3, "orient": orient, **case.precise}
        out = case(x, **kw)
        assert not torch.isnan(out).any()
        big = 30.0 if case.method == "ot" and case.op != "soft_topk_mask" else 1000.0
        xs = torch.nan_to_num(x.detach(), posinf=big, neginf=-big).requires_grad_()
        ref = case(xs, **kw)
        if case.units_of_x:
            ref = torch.where(ref.abs() > big / 2, ref.sign() * math.inf, ref)
        torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
        if case.stochastic:
            continue
        g = torch.randn_like(out).where(torch.isfinite(out), 0.0)
        (gx,) = torch.autograd.grad(out, x, g)
        (gs,) = torch.autograd.grad(ref, xs, g)
        finite = torch.isfinite(x.detach())
        torch.testing.assert_close(gx[finite], gs[finite], atol=1e-9, rtol=1e-9)
        assert (gx[~finite] == 0).all()


@cases([c for c in by_op("soft_sort", "soft_rank", "soft_argsort") if c.method != "pav"])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_infinities_decouple(case, descending):
    # finite entries are relaxed among themselves; a single +inf sorts last with rank n
    inf = math.inf
    x = torch.tensor([[inf, 0.1, 0.9, -0.5, 1.2, 0.3, 0.6]], dtype=F64)
    kw = {"epsilon": 0.3, "orient": descending, **case.precise}
    out = case(x, **kw)
    if case.op == "soft_sort":
        alone = case(x[:, 1:], **kw)
        want = (
            torch.cat((alone, x[:, :1]), 1) if not descending else torch.cat((x[:, :1], alone), 1)
        )
        torch.testing.assert_close(out, want)
    if case.op == "soft_rank":
        assert out[0, 0] == (1.0 if descending else 7.0)
    rows = torch.tensor([[inf, inf, -inf, inf, -inf, inf, inf]], dtype=F64)  # no finite entry
    assert not torch.isnan(case(rows, **kw)).any()


@cases([c for c in by_op("soft_sort", "soft_rank") if c.method == "pav"])
def test_infinities_pav(case):
    inf = math.inf
    x = torch.tensor([[0.0, inf, 1.0, -inf, inf], [0.5, 1.0, inf, -1.0, 2.0]], dtype=F64)
    out = case(x, epsilon=0.5)
    if case.op == "soft_rank":
        ref = case(torch.nan_to_num(x, posinf=1e9, neginf=-1e9), epsilon=0.5)
        torch.testing.assert_close(out, ref)
        assert out[0, 1] == out[0, 4] == 4.5 and out[0, 3] == 1.0
    elif case.kw["regularization"] == "l2":
        assert torch.isnan(out[0]).all()  # +inf and -inf: the limit depends on their rates
        assert (out[1] == inf).all()  # the l2 soft sort keeps the (infinite) mean
    else:
        ref = case(torch.nan_to_num(x[1:], posinf=1e9), epsilon=0.5)
        torch.testing.assert_close(out[1:], ref)  # kl saturates: finite


@cases(by_op("soft_quantile"))
def test_quantile_infinities(case):
    inf = math.inf
    x = torch.tensor([[inf, 0.0, 1.0, 2.0, 3.0], [-inf, 0.0, 1.0, 2.0, inf]], dtype=F64)
    out = case(x, q=torch.tensor([0.0, 0.5, 1.0], dtype=F64), epsilon=1e-2)
    if case.method == "ot":  # the infinities sort to the ends, the rest is the hard quantile
        want = torch.tensor([[0.0, -inf], [2.0, 1.0], [inf, inf]], dtype=F64)
        torch.testing.assert_close(out, want)
    else:  # pav: the l2 soft sort of a row with +inf is all +inf; both signs: NaN
        assert (out[:, 0] == inf).all() and torch.isnan(out[:, 1]).all()


@cases(by_op("soft_topk_mask", "soft_topk", "soft_kmax"))
def test_rows_that_cannot_hold_k_are_nan_alone(case):
    inf = math.inf
    x = torch.tensor(
        [[inf, inf, inf, 0.0, 1.0], [0.5, -inf, -inf, -inf, -inf], [0.3, 1.0, -1.0, 2.0, 0.0]],
        dtype=F64,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", softops.ConvergenceWarning)  # NaN by contract: no failure
        out = case(x, k=2, epsilon=0.3)
    assert torch.isnan(out[0]).all() == (case.op != "soft_topk")  # soft_topk: +inf are the top
    assert torch.isnan(out[1]).all()
    if case.stochastic:  # other draws in a batch of one
        assert torch.isfinite(out[2]).all()
    else:
        torch.testing.assert_close(out[2], case(x[2], k=2, epsilon=0.3))


# --------------------------------------------------------------------------------- errors

SORT_UNUSED = {"regularization": "kl", "distance": "l2", "max_iter": 5, "tol": 0.5}
SORT_USES = {
    "pav": {"regularization"},
    "softsort": {"distance"},
    "neuralsort": set(),
    "ot": {"max_iter", "tol"},
}
MASK_UNUSED = {"max_iter": 5, "tol": 0.5, "n_samples": 8, "generator": torch.Generator()}
MASK_USES = {
    "ot": {"max_iter", "tol"},
    "sinkhorn": {"max_iter", "tol"},
    "softkmax": set(),
    "perturbed": {"n_samples", "generator"},
    "sparse": {"max_iter"},
}


@cases(CASES)
def test_common_errors(case):
    x = torch.randn(2, 5)
    op = case.op
    if case.method is not None:
        with pytest.raises(ValueError, match=rf"^{op}: expected .*got method='bogus'\.$"):
            case(x, method="bogus")
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=rf"^{op}: expected .*got epsilon={bad}\.$"):
            case(x, epsilon=bad)
    with pytest.raises(ValueError, match=re.escape("got epsilon=-2.0.")):
        case(x, epsilon=torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match=re.escape("got epsilon=nan.")):
        case(x, epsilon=math.nan)
    with pytest.raises(TypeError, match=rf"^{op}: expected `epsilon` to be a float"):
        case(x, epsilon="big")
    for dtype in (torch.int64, torch.int32, torch.bool):
        with pytest.raises(TypeError, match=rf"^{op}: expected .*got dtype={dtype}\.$"):
            case(torch.zeros(2, 5, dtype=dtype))
    with pytest.raises(TypeError, match=rf"^{op}: expected `x` to be a torch.Tensor; got list\.$"):
        case([1.0, 2.0])
    with pytest.raises(ValueError, match=re.escape("got dim=2.")):
        case(x, dim=2)
    with pytest.raises(TypeError, match=re.escape("got 1.0.")):
        case(x, dim=1.0)
    with pytest.raises(ValueError, match=re.escape("got x.shape[1] = 0")):
        case(torch.randn(2, 0))
    with pytest.raises(ValueError, match=rf"^{op}: expected `x` with at least 1 dimension"):
        case(torch.tensor(1.0))
    if case.flag is not None and case.op != "soft_quantile":
        name = case.flag[0]
        with pytest.raises(
            TypeError, match=rf"^{op}: expected `{name}` to be a bool; got {name}=1"
        ):
            case(x, orient=1)
    if case.layout in ("reduce", "quantile"):
        with pytest.raises(TypeError, match=re.escape("got keepdim=1.")):
            case(x, keepdim=1)
    if op in TAKES_K:
        low = 1 if op == "soft_topk" else 0
        with pytest.raises(ValueError, match=rf"^{op}: expected {low} <= `k` <= .*= 5\); got k=6"):
            case(x, k=6)
        with pytest.raises(ValueError, match=rf"^{op}: expected {low} <= `k` <= .*got k=-1"):
            case(x, k=-1)
        with pytest.raises(TypeError, match=rf"^{op}: expected `k` to be "):
            case(x, k="two")


@cases(by_op("soft_sort", "soft_rank", "soft_argsort"))
def test_sort_unused_and_method_arguments(case):
    x = torch.randn(2, 5)
    op = case.op
    used = SORT_USES[case.method]
    for name, value in SORT_UNUSED.items():
        if name in used or (op == "soft_argsort" and name == "regularization"):
            continue
        message = f"expected `{name}` to be left at its default"
        with pytest.raises(ValueError, match=rf"^{op}: {message}.*got {name}={value!r}\.$"):
            case(x, **{name: value})
    case(x, distance="l1", max_iter=None, tol=None)  # defaults always pass
    if op != "soft_argsort":
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


@cases(by_op("soft_topk_mask"))
def test_mask_unused_and_method_arguments(case):
    x = torch.randn(2, 5)
    op = case.op
    for name, value in MASK_UNUSED.items():
        if name in MASK_USES[case.method]:
            continue
        message = f"expected `{name}` to be left at its default None"
        with pytest.raises(ValueError, match=rf"^{op}: {message} \(method='{case.method}'"):
            case(x, **{name: value})
    if "max_iter" in MASK_USES[case.method]:
        with pytest.raises(ValueError, match=re.escape("got max_iter=0.")):
            case(x, max_iter=0)
        with pytest.raises(TypeError, match=re.escape("got max_iter=2.5.")):
            case(x, max_iter=2.5)
    if "tol" in MASK_USES[case.method]:
        with pytest.raises(ValueError, match=re.escape("got tol=-1.")):
            case(x, tol=-1)
    if case.method not in ("ot", "sparse"):
        with pytest.raises(ValueError, match=rf"^{op}: expected a scalar `k` with method="):
            case(x, k=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=rf"^{op}: hard=True needs an integer k; got k=1.5"):
        case(x, k=1.5, hard=True)


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
    with pytest.raises(ValueError, match=re.escape("got shape (4,).")):
        soft_rank(torch.randn(2, 3, 6), epsilon=torch.ones(4))


# --------------------------------------------------------------------------------- Modules


@cases(CASES)
def test_module_equals_function(case):
    x = torch.randn(2, 5, dtype=F64)
    kw = {"epsilon": 0.4}
    if case.flag is not None and case.op != "soft_quantile":
        kw["orient"] = not case.flag[1]
    if case.op == "soft_quantile":
        kw["q"] = 0.3
    layer = case.module(**kw)
    clone = pickle.loads(pickle.dumps(layer))  # before the first call (a generator advances)
    for module in (layer, clone):
        out = module(x)
        out = out.values if case.op == "soft_topk" else out
        torch.testing.assert_close(out, case(x, **kw))
    assert "epsilon=0.4" in repr(layer)


# ------------------------------------------------------------------- properties (hypothesis)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        st.sampled_from([-math.inf, -1e6, -2.0, 0.0, 0.0, 0.5, 3.0, 1e6, math.inf]),
        min_size=3,
        max_size=9,
    ),
    eps=st.sampled_from([1e-2, 1.0, 1e2]),
    orient=st.booleans(),
    case=st.sampled_from([c for c in CASES if c.inf_limit and c.layout != "quantile"]),
)
def test_ties_magnitudes_and_infinities(values, eps, orient, case):
    """Never NaN without a NaN input (where the row can hold k); tied entries get equal
    outputs (ranks, columns of P, mask entries); rows of P sum to 1."""
    x = torch.tensor([values], dtype=F64)
    n = len(values)
    if case.op in TAKES_K:
        largest = orient if case.flag is not None else True
        sure = (x == (math.inf if largest else -math.inf)).sum()
        possible = (x != (-math.inf if largest else math.inf)).sum()
        if not sure <= K <= possible:
            return  # a row that cannot hold its k entries is NaN by contract
    dead = {"soft_argmax": -math.inf, "soft_argmax_onehot": -math.inf, "soft_argmin": math.inf}
    if case.op in dead and all(v == dead[case.op] for v in values):
        return  # no entry can be the arg max: NaN by contract
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", softops.ConvergenceWarning)  # far-apart values, small eps
        out = case(x, epsilon=eps, orient=orient)
    assert not torch.isnan(out).any()
    if case.op == "soft_sort":
        a, b = (out[0, 1:], out[0, :-1]) if orient else (out[0, :-1], out[0, 1:])
        assert ((b >= a) | (b - a >= -1e-6 * (1 + a.abs()))).all()
    if case.layout == "square":
        torch.testing.assert_close(out.sum(-1), torch.ones(1, n, dtype=F64))
    if case.op == "soft_rank" or (case.op == "soft_topk_mask" and not case.stochastic):
        for i in range(n):
            for j in range(i):
                if values[i] == values[j]:
                    torch.testing.assert_close(out[0, i], out[0, j])


# ------------------------------------------------------------------------- torch.compile


@pytest.mark.slow
@cases(DETERMINISTIC)
def test_torch_compile(case):
    x = torch.randn(3, 6, requires_grad=True)
    compiled = torch.compile(lambda t: case(t, epsilon=0.5))
    out = compiled(x)
    torch.testing.assert_close(out, case(x, epsilon=0.5))
    (g,) = torch.autograd.grad(out.sum(), x)
    (ref,) = torch.autograd.grad(case(x, epsilon=0.5).sum(), x)
    torch.testing.assert_close(g, ref)
