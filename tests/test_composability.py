"""What PyTorch users do with an op, for every case of the contract registry.

``torch.func.vmap`` (equals the batched call), ``grad``/``vjp``/``jacrev`` (equal plain autograd),
forward mode (``jvp`` and ``jacfwd`` equal the Jacobian times the tangent), meta tensors (shape
inference), ``torch.autocast`` and, in the slow run, ``torch.compile``. The support table of
docs/getting-started.md states the same facts; every "no" there is an entry of ``UNSUPPORTED``
here, with its reason, and the test checks that it raises a clear error.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import func

import softops
from softops._kernels import backend
from tests.test_contract import CASES, Case, cases

F64 = torch.float64

# (case id, transform) -> the reason it is refused. Empty when everything is supported.
UNSUPPORTED: dict[tuple[str, str], str] = {}


def _refused(case: Case, what: str) -> bool:
    return (case.id, what) in UNSUPPORTED


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def _x(*shape: int) -> torch.Tensor:
    """Distinct values with gaps of at least 0.1 and a spread of a few units."""
    g = torch.Generator().manual_seed(sum(shape))
    n = shape[-1]
    rows = [
        torch.randperm(n, generator=g).to(F64) * 0.4
        for _ in range(int(torch.tensor(shape[:-1]).prod()))
    ]
    noise = 0.1 * torch.rand(*shape, generator=g, dtype=F64)
    return torch.stack(rows).reshape(shape) + noise - 0.2 * n


def _call(case: Case, eps: float = 0.7):
    def fn(t: torch.Tensor) -> torch.Tensor:
        return case(t, epsilon=eps, **case.precise)

    return fn


def _vmap(case: Case, fn, x: torch.Tensor) -> torch.Tensor:
    # The quantile op puts the levels in front: vmap's batch dimension goes after them.
    out_dims = 1 if case.layout == "quantile" else 0
    randomness = "different" if case.stochastic else "error"
    return func.vmap(fn, out_dims=out_dims, randomness=randomness)(x)


@cases(CASES)
def test_vmap_equals_the_batched_call(case):
    x = _x(3, 2, 6)
    fn = _call(case)
    if _refused(case, "vmap"):
        with pytest.raises(NotImplementedError, match=case.op):
            _vmap(case, fn, x)
        return
    out = _vmap(case, fn, x)
    ref = fn(x)
    assert out.shape == ref.shape
    if case.stochastic:  # other draws: the invariants only
        torch.testing.assert_close(out.sum(-1), torch.full_like(out.sum(-1), 2.0))
        assert ((out >= 0) & (out <= 1)).all()
        return
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    # Nested: vmap of vmap over single rows folds both dimensions into the rows.
    dims = 1 if case.layout == "quantile" else 0
    nested = func.vmap(func.vmap(fn, out_dims=dims), out_dims=dims)(x)
    torch.testing.assert_close(nested, ref, rtol=1e-9, atol=1e-9)


# The ops whose Functions fold vmapped rows into their own (softops._core.transforms.vmap_rows):
# a vmapped dimension of size 0 gives the empty batched result. (torch's own batching rule of
# view(-1) fails on an empty vmapped dimension, so the ops written in plain torch ops are not
# claimed here.)
_ROW_FUNCTIONS = [c for c in CASES if c.op == "soft_topk_mask" or c.method == "pav"]


@cases(_ROW_FUNCTIONS)
def test_vmap_over_an_empty_dimension_gives_the_empty_batched_shape(case):
    fn = _call(case)
    if _refused(case, "vmap"):
        return
    full = _vmap(case, fn, _x(3, 2, 6))
    out = _vmap(case, fn, _x(3, 2, 6)[:0])
    dim = 1 if case.layout == "quantile" else 0
    assert out.shape == (*full.shape[:dim], 0, *full.shape[dim + 1 :])


def _jacobian(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.functional.jacobian(fn, x)


@cases([c for c in CASES if not c.stochastic])
def test_grad_vjp_jacrev_equal_autograd(case):
    x = _x(6)
    fn = _call(case)
    jac = _jacobian(fn, x)
    out = fn(x)
    w = torch.linspace(-1.0, 2.0, out.numel(), dtype=F64).reshape(out.shape)
    torch.testing.assert_close(func.jacrev(fn)(x), jac, rtol=1e-8, atol=1e-10)
    grad = func.grad(lambda t: (fn(t) * w).sum())(x)
    torch.testing.assert_close(
        grad, (w.reshape(-1) @ jac.reshape(out.numel(), -1)).reshape(x.shape), rtol=1e-8, atol=1e-10
    )
    _, vjp = func.vjp(fn, x)
    torch.testing.assert_close(vjp(w)[0], grad, rtol=1e-8, atol=1e-10)


@cases(CASES)
def test_forward_mode_equals_the_jacobian(case):
    x = _x(6)
    fn = _call(case)
    v = torch.linspace(-1.0, 1.0, 6, dtype=F64) ** 3
    if _refused(case, "jvp"):
        with pytest.raises(NotImplementedError, match=case.op):
            func.jvp(fn, (x,), (v,))
        return
    out, tangent = func.jvp(fn, (x,), (v,))
    torch.testing.assert_close(out, fn(x))
    jac = func.jacrev(fn)(x)  # the Monte-Carlo methods: the estimate of the same draws
    want = (jac.reshape(out.numel(), -1) @ v).reshape(out.shape)
    torch.testing.assert_close(tangent, want, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(func.jacfwd(fn, randomness="same")(x), jac, rtol=1e-7, atol=1e-9)


@cases(CASES)
def test_meta_tensors_give_the_shape(case):
    x = _x(3, 6)
    kw = {"generator": None} if case.stochastic else {}
    want = case(x, epsilon=0.7, **kw)
    out = case(x.to("meta"), epsilon=0.7, **kw)
    assert out.device.type == "meta"
    assert out.shape == want.shape and out.dtype == want.dtype


@cases(CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_bfloat16(case, dtype):
    """Under CPU autocast the op computes as without it: its own precision rules apply."""
    x = _x(3, 6).to(dtype)
    kw = {"generator": torch.Generator().manual_seed(3)} if case.stochastic else {}
    want = case(x, epsilon=0.7, **kw)
    if case.stochastic:
        kw = {"generator": torch.Generator().manual_seed(3)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = case(x, epsilon=0.7, **kw)
    assert out.dtype == want.dtype
    torch.testing.assert_close(out, want)


# ------------------------------------------------------------------------- torch.compile

# Every case of the registry compiles to one graph, forward and backward: the ops without
# data-dependent control flow as dynamo traces them, the others because their solve is an
# operator of torch's registry, opaque to dynamo, with the gradient in the traced Function (the
# top-k masks "ot", "sparse", "sinkhorn" and "perturbed", pav, the sort family's "ot",
# soft_topk). "perturbed" is called with generator=None there (dynamo can neither make nor carry
# a torch.Generator: one breaks the graph). tests/test_contract.py::test_torch_compile (slow)
# runs the registry through inductor. Each case runs on its back end (the reference twins of the
# kernel-backed methods on the torch reference).
FULLGRAPH = list(CASES)


@cases(FULLGRAPH)
def test_one_graph_without_breaks(case):
    with backend(case.back_end):  # the compiled graph's operators on the case's back end
        _one_graph(case)


def _one_graph(case: Case) -> None:
    torch._dynamo.reset()
    x = _x(3, 6).float().requires_grad_()
    fn = _call(case)
    if case.stochastic:  # draws seeded by the global generator (dynamo cannot make a Generator)

        def fn(t: torch.Tensor) -> torch.Tensor:
            return case(t, epsilon=0.7, generator=None)

    compiled = torch.compile(fn, fullgraph=True, backend="eager")  # dynamo's tracing only
    torch.manual_seed(3)
    out = compiled(x)
    torch.manual_seed(3)
    want = fn(x)
    torch.testing.assert_close(out, want)
    w = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)
    (g,) = torch.autograd.grad((out * w).sum(), x)
    (ref,) = torch.autograd.grad((want * w).sum(), x)
    torch.testing.assert_close(g, ref)


def test_inductor_compiles_a_sort_and_a_smooth_op():
    """One real (inductor) compilation in the default run; the registry's is in the slow run."""
    torch._dynamo.reset()
    x = _x(4, 7).float().requires_grad_()

    def fn(t: torch.Tensor) -> torch.Tensor:
        ranks = softops.soft_rank(t, epsilon=0.5)  # pav: its kernel operators in the graph
        return ranks * softops.smooth_max(t, epsilon=0.3, keepdim=True)

    compiled = torch.compile(fn, fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, fn(x))
    (g,) = torch.autograd.grad(out.sum(), x)
    (ref,) = torch.autograd.grad(fn(x).sum(), x)
    torch.testing.assert_close(g, ref)


def _topk_values_and_weights(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = softops.soft_topk(x, 3, epsilon=0.2)
    return out.values, out.weights


# name -> (the exported forward, the operator its program must keep); "perturbed" draws its seed
# in the program from the global generator, so the eager call is seeded alike
EXPORTED = {
    "topk_mask-ot": (
        lambda x: softops.soft_topk_mask(x, 3, epsilon=0.2, method="ot") * x,
        "softops.ot_threshold",
    ),
    "topk_mask-sparse": (
        lambda x: softops.soft_topk_mask(x, 3, epsilon=0.2, method="sparse") * x,
        "softops.sparse_threshold",
    ),
    "rank-pav": (lambda x: softops.soft_rank(x, epsilon=0.5) * x, "softops.isotonic_permutahedron"),
    "sort-pav": (lambda x: softops.soft_sort(x, epsilon=0.5) * x, "softops.isotonic_permutahedron"),
    "rank-ot": (
        lambda x: softops.soft_rank(x, epsilon=0.5, method="ot").sum(0),
        "softops.sinkhorn",
    ),
    "quantile-ot": (
        lambda x: softops.soft_quantile(x, q=0.25, epsilon=0.5, method="ot").sum(0),
        "softops.sinkhorn",
    ),
    "topk_mask-sinkhorn": (
        lambda x: softops.soft_topk_mask(x, 3, epsilon=0.5, method="sinkhorn").sum(0),
        "softops.sinkhorn",
    ),
    "topk": (_topk_values_and_weights, "softops.newton_first"),
    "topk_mask-perturbed": (
        lambda x: softops.soft_topk_mask(x, 3, epsilon=0.2, method="perturbed") * x,
        "softops.perturbed_topk_mask",
    ),
}


@pytest.mark.parametrize("name", list(EXPORTED))
def test_exports_with_a_dynamic_batch_keeping_the_solve_as_one_operator(name):
    forward, operator = EXPORTED[name]

    class Op(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return forward(x)

    x = _x(5, 12).float()
    batch = torch.export.Dim("batch")
    with torch.no_grad():
        exported = torch.export.export(Op(), (x,), dynamic_shapes=({0: batch},))
        for inputs in (x, 4 * _x(9, 12).float()):
            torch.manual_seed(1)
            out = exported.module()(inputs)
            torch.manual_seed(1)
            torch.testing.assert_close(out, Op()(inputs))
    targets = [str(node.target) for node in exported.graph.nodes]
    assert any(operator in t for t in targets)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_the_traced_solves_pass_opcheck(dtype):
    """The operators that traced code calls (the Sinkhorn solve, the sorted top-k's Newton-first
    solve, perturbed's sampling and estimator): schema, fake implementation (shapes, dtypes,
    strides) and dynamic shapes."""
    from softops._core.sinkhorn import SINKHORN_OP
    from softops.topk._newton import NEWTON_FIRST_OP
    from softops.topk._perturbed import ESTIMATE_OP, MASK_OP

    g = torch.Generator().manual_seed(2)
    cost = torch.rand(3, 5, 4, generator=g, dtype=dtype)
    log_a, log_b = (
        torch.full((3, 5), -math.log(5), dtype=dtype),
        torch.full((3, 4), -math.log(4), dtype=dtype),
    )
    eps = torch.full((3,), 0.5, dtype=dtype)
    for newton, potentials in ((False, True), (True, False), (True, True)):
        args = (cost, log_a, log_b, eps, 200, 1e-6, newton, potentials, "")
        torch.library.opcheck(SINKHORN_OP, args)
    torch.library.opcheck(NEWTON_FIRST_OP.overload, (cost, log_a, log_b, eps, 200, 1e-6, True, ""))
    x = _x(3, 6).to(dtype)
    seed = torch.tensor(11)
    torch.library.opcheck(MASK_OP, (x, eps, 2, 8, seed))
    for transpose in (True, False):
        torch.library.opcheck(ESTIMATE_OP, (x, eps, torch.ones_like(x), 2, 8, seed, transpose))


def test_the_sinkhorn_solver_compiles_to_one_graph_with_gradients():
    """softops.solvers.sinkhorn: the solve one operator, the implicit gradient in the graph;
    the iteration count a tensor there."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    cost = torch.rand(3, 5, 4, generator=g, dtype=F64).requires_grad_()
    a, b = torch.full((5,), 0.2, dtype=F64), torch.full((4,), 0.25, dtype=F64)

    def fn(c: torch.Tensor):
        res = softops.solvers.sinkhorn(c, a, b, 0.3)
        return res.plan, res.f, res.g, res.converged, res.iterations

    out = torch.compile(fn, fullgraph=True, backend="eager")(cost)
    want = fn(cost)
    for o, w in zip(out[:4], want[:4], strict=True):
        torch.testing.assert_close(o, w)
    assert int(out[4]) == want[4]
    w = torch.linspace(-1.0, 2.0, 60, dtype=F64).reshape(3, 5, 4)
    (grad,) = torch.autograd.grad((out[0] * w).sum(), cost)
    (ref,) = torch.autograd.grad((want[0] * w).sum(), cost)
    torch.testing.assert_close(grad, ref)


# ------------------------------------------------------------------ metrics and losses

_G = torch.Generator().manual_seed(11)
_LOGITS = torch.randn(3, 8, 5, generator=_G, dtype=F64)
_LABELS = torch.randint(0, 5, (3, 8), generator=_G)
_SCORES = torch.randn(3, 10, generator=_G, dtype=F64)
_RELEVANCE = torch.rand(3, 10, generator=_G, dtype=F64) * 3

# name -> (fn(input, target), inputs (batched along dim 0), targets)
_REDUCTIONS = {
    "soft_accuracy": (lambda a, b: softops.metrics.soft_accuracy(a, b), _LOGITS, _LABELS),
    "soft_f1": (lambda a, b: softops.metrics.soft_f1(a, b), _LOGITS, _LABELS),
    "soft_precision": (lambda a, b: softops.metrics.soft_precision(a, b), _LOGITS, _LABELS),
    "soft_recall": (lambda a, b: softops.metrics.soft_recall(a, b), _LOGITS, _LABELS),
    "soft_confusion": (
        lambda a, b: softops.metrics.soft_confusion(a, b).tp,
        _LOGITS,
        _LABELS,
    ),
    "soft_topk_accuracy": (
        lambda a, b: softops.metrics.soft_topk_accuracy(a, b, 2),
        _LOGITS,
        _LABELS,
    ),
    "accuracy_loss": (lambda a, b: softops.losses.accuracy_loss(a, b), _LOGITS, _LABELS),
    "f1_loss": (lambda a, b: softops.losses.f1_loss(a, b), _LOGITS, _LABELS),
    "topk_accuracy_loss": (
        lambda a, b: softops.losses.topk_accuracy_loss(a, b, 2),
        _LOGITS,
        _LABELS,
    ),
    "topk_cross_entropy": (
        lambda a, b: softops.losses.topk_cross_entropy(a, b, [0.5, 0.2, 0.3], m=4),
        _LOGITS,
        _LABELS,
    ),
    "spearman_loss": (lambda a, b: softops.losses.spearman_loss(a, b), _SCORES, _RELEVANCE),
    "ndcg_loss": (lambda a, b: softops.losses.ndcg_loss(a, b), _SCORES, _RELEVANCE),
}


@pytest.mark.parametrize("name", sorted(_REDUCTIONS))
def test_metrics_and_losses_compose(name):
    """vmap equals the loop, grad and jvp equal the Jacobian, meta gives the shape."""
    fn, inputs, targets = _REDUCTIONS[name]
    out = func.vmap(fn)(inputs, targets)
    torch.testing.assert_close(
        out, torch.stack([fn(a, b) for a, b in zip(inputs, targets, strict=True)])
    )
    a, b = inputs[0], targets[0]
    jac = torch.autograd.functional.jacobian(lambda t: fn(t, b), a)
    w = torch.linspace(-1.0, 1.0, fn(a, b).numel(), dtype=F64).reshape(fn(a, b).shape)
    grad = func.grad(lambda t: (fn(t, b) * w).sum())(a)
    torch.testing.assert_close(grad, (w.reshape(-1) @ jac.reshape(w.numel(), -1)).reshape(a.shape))
    v = torch.linspace(-1.0, 1.0, a.numel(), dtype=F64).reshape(a.shape)
    _, tangent = func.jvp(lambda t: fn(t, b), (a,), (v,))
    torch.testing.assert_close(
        tangent, (jac.reshape(w.numel(), -1) @ v.reshape(-1)).reshape(w.shape)
    )
    meta = fn(a.to("meta"), b.to("meta"))
    assert meta.device.type == "meta" and meta.shape == fn(a, b).shape


# ------------------------------------------------------------------- second derivatives


@cases([c for c in CASES if not c.stochastic])
def test_second_derivatives_equal_central_differences_of_the_gradient(case):
    """Double backward: the Hessian-vector product of a weighted sum against central
    differences of the gradient (the backward of every deterministic op is differentiable)."""
    x0 = _x(6)
    fn = _call(case)
    w = torch.linspace(-1.0, 2.0, fn(x0).numel(), dtype=F64).reshape(fn(x0).shape) ** 3
    v = torch.linspace(1.0, -1.0, 6, dtype=F64) ** 3

    def gradient(t: torch.Tensor, create_graph: bool = False) -> torch.Tensor:
        t = t if t.requires_grad else t.clone().requires_grad_()
        out = (fn(t) * w).sum()
        return torch.autograd.grad(out, t, create_graph=create_graph)[0]

    x = x0.clone().requires_grad_()
    g = gradient(x, create_graph=True)
    h = 1e-5
    fd = (gradient(x0 + h * v).detach() - gradient(x0 - h * v).detach()) / (2 * h)
    if not g.requires_grad:  # piecewise linear in x (pav): the Hessian is 0 away from kinks
        torch.testing.assert_close(fd, torch.zeros_like(fd), atol=1e-7, rtol=0)
        return
    (hv,) = torch.autograd.grad((g * v).sum(), x)
    torch.testing.assert_close(hv, fd, rtol=1e-5, atol=1e-7 * (1 + fd.abs().max().item()))


@pytest.mark.parametrize("method", ["softkmax", "perturbed"])
def test_a_vmapped_k_of_a_counting_method_is_refused_clearly(method):
    """softkmax and perturbed read k (a number of rounds, of a top-k per draw): a k batched by
    vmap has no value to read, which they say; a plain tensor k closed over still works."""
    x = torch.randn(3, 5, 6, dtype=F64)
    k = torch.tensor([1.0, 2.0, 3.0])
    kw = {"method": method, "epsilon": 0.5}
    with pytest.raises(ValueError, match=rf"expected `k` as a number.*method='{method}'"):
        func.vmap(lambda xi, ki: softops.soft_topk_mask(xi, ki, **kw), randomness="different")(x, k)
    out = func.vmap(
        lambda xi: softops.soft_topk_mask(xi, torch.tensor(2), **kw), randomness="different"
    )(x)
    torch.testing.assert_close(out.sum(-1), torch.full((3, 5), 2.0, dtype=F64))
