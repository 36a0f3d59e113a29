"""softops.nn: every wrapper Module equals its function, reprs, pickles, has no state, checks
early. The layers with parameters are tested in tests/nn/test_attention.py, test_router.py and
test_moe.py, the loss Modules in test_loss_modules.py."""

from __future__ import annotations

import copy
import io
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import softops
from softops import nn
from tests._helpers import seeded

F64 = torch.float64
#: the thin wrappers of the functional ops (the layers and their functional forms are not)
WRAPPERS = set(nn.__all__) - {
    "TopKAttention",
    "topk_attention",
    "topk_attention_weights",
    "TopKRouter",
    "RouterOutput",
    "TopKMoE",
    "MoEOutput",
    # the loss Modules take two inputs: tests/nn/test_loss_modules.py
    "AccuracyLoss",
    "F1Loss",
    "NDCGLoss",
    "SpearmanLoss",
    "TopKAccuracyLoss",
    "TopKCrossEntropy",
}


@dataclass(frozen=True)
class Case:
    """A Module built from ``args``/``kwargs``, and the function it must equal.

    ``fn(x)`` is the function called with the same arguments; ``make`` builds a fresh Module
    (a factory, so that a generator is fresh for every build).
    """

    id: str
    make: Callable[[], torch.nn.Module]
    fn: Callable[[torch.Tensor], Any]
    repr: str
    shape: tuple[int, ...] = (3, 6)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, F64)
    tags: frozenset[str] = field(default_factory=frozenset)


def _gen() -> torch.Generator:
    return seeded(5)


CASES = [
    Case(
        "SmoothMax",
        lambda: nn.SmoothMax(dim=0, keepdim=True, epsilon=0.3),
        lambda x: softops.smooth_max(x, dim=0, keepdim=True, epsilon=0.3),
        "SmoothMax(dim=0, keepdim=True, epsilon=0.3)",
        dtypes=(torch.float16, torch.bfloat16, torch.float32, F64),
    ),
    Case(
        "SmoothMin",
        lambda: nn.SmoothMin(epsilon=0.5),
        lambda x: softops.smooth_min(x, epsilon=0.5),
        "SmoothMin(dim=-1, keepdim=False, epsilon=0.5)",
    ),
    Case(
        "SoftArgmax",
        lambda: nn.SoftArgmax(dim=1, epsilon=0.2),
        lambda x: softops.soft_argmax(x, dim=1, epsilon=0.2),
        "SoftArgmax(dim=1, keepdim=False, epsilon=0.2)",
    ),
    Case(
        "SoftArgmin",
        lambda: nn.SoftArgmin(dim=-2, keepdim=True),
        lambda x: softops.soft_argmin(x, dim=-2, keepdim=True),
        "SoftArgmin(dim=-2, keepdim=True, epsilon=1.0)",
    ),
    Case(
        "SoftArgmaxOneHot",
        lambda: nn.SoftArgmaxOneHot(dim=0, epsilon=0.3, hard=True),
        lambda x: softops.soft_argmax_onehot(x, dim=0, epsilon=0.3, hard=True),
        "SoftArgmaxOneHot(dim=0, epsilon=0.3, hard=True)",
    ),
    Case(
        "SoftKMax",
        lambda: nn.SoftKMax(2, epsilon=0.4),
        lambda x: softops.soft_kmax(x, 2, epsilon=0.4),
        "SoftKMax(k=2, dim=-1, epsilon=0.4)",
    ),
    Case(
        "SoftTopKMask",
        lambda: nn.SoftTopKMask(2.5, dim=0, epsilon=0.3),
        lambda x: softops.soft_topk_mask(x, 2.5, dim=0, epsilon=0.3),
        "SoftTopKMask(k=2.5, dim=0, largest=True, epsilon=0.3, method='ot', hard=False)",
        dtypes=(torch.float16, torch.bfloat16, torch.float32, F64),
    ),
    Case(
        "SoftTopKMask-sinkhorn",
        lambda: nn.SoftTopKMask(2, largest=False, method="sinkhorn", max_iter=500, tol=1e-7),
        lambda x: softops.soft_topk_mask(
            x, 2, largest=False, method="sinkhorn", max_iter=500, tol=1e-7
        ),
        "SoftTopKMask(k=2, dim=-1, largest=False, epsilon=0.1, method='sinkhorn', hard=False, "
        "max_iter=500, tol=1e-07)",
    ),
    Case(
        "SoftTopKMask-perturbed",
        lambda: nn.SoftTopKMask(
            3, epsilon=0.4, method="perturbed", n_samples=16, generator=_gen(), hard=True
        ),
        lambda x: softops.soft_topk_mask(
            x, 3, epsilon=0.4, method="perturbed", n_samples=16, generator=_gen(), hard=True
        ),
        "SoftTopKMask(k=3, dim=-1, largest=True, epsilon=0.4, method='perturbed', hard=True, "
        "n_samples=16, generator=torch.Generator(device='cpu'))",
        tags=frozenset({"generator"}),
    ),
    Case(
        "SoftTopK",
        lambda: nn.SoftTopK(2, epsilon=0.2, largest=False),
        lambda x: softops.soft_topk(x, 2, epsilon=0.2, largest=False),
        "SoftTopK(k=2, dim=-1, largest=False, epsilon=0.2)",
    ),
    Case(
        "SoftSort",
        lambda: nn.SoftSort(dim=0, method="softsort", distance="l2", epsilon=0.5),
        lambda x: softops.soft_sort(x, dim=0, method="softsort", distance="l2", epsilon=0.5),
        "SoftSort(dim=0, descending=False, epsilon=0.5, method='softsort', distance='l2')",
    ),
    Case(
        "SoftSort-ot",
        lambda: nn.SoftSort(descending=True, method="ot", max_iter=300),
        lambda x: softops.soft_sort(x, descending=True, method="ot", max_iter=300),
        "SoftSort(dim=-1, descending=True, epsilon=1.0, method='ot', max_iter=300)",
    ),
    Case(
        "SoftRank",
        lambda: nn.SoftRank(descending=True, regularization="kl", epsilon=0.3),
        lambda x: softops.soft_rank(x, descending=True, regularization="kl", epsilon=0.3),
        "SoftRank(dim=-1, descending=True, epsilon=0.3, method='pav', regularization='kl')",
    ),
    Case(
        "SoftArgsort",
        lambda: nn.SoftArgsort(method="neuralsort", hard=True, epsilon=0.5),
        lambda x: softops.soft_argsort(x, method="neuralsort", hard=True, epsilon=0.5),
        "SoftArgsort(dim=-1, descending=False, epsilon=0.5, method='neuralsort', hard=True)",
    ),
    Case(
        "SoftQuantile",
        lambda: nn.SoftQuantile(torch.tensor([0.25, 0.5]), keepdim=True, epsilon=0.2),
        lambda x: softops.soft_quantile(x, torch.tensor([0.25, 0.5]), keepdim=True, epsilon=0.2),
        "SoftQuantile(q=tensor([0.2500, 0.5000]), dim=-1, epsilon=0.2, method='pav', keepdim=True)",
    ),
    Case(
        "SoftQuantile-ot",
        lambda: nn.SoftQuantile(0.3, dim=0, method="ot"),
        lambda x: softops.soft_quantile(x, 0.3, dim=0, method="ot"),
        "SoftQuantile(q=0.3, dim=0, epsilon=1.0, method='ot')",
    ),
]
IDS = [c.id for c in CASES]


def _x(case: Case, dtype: torch.dtype = F64, device: str = "cpu") -> torch.Tensor:
    return torch.randn(case.shape, generator=seeded(1), dtype=F64).to(dtype=dtype, device=device)


def _assert_same(got: Any, want: Any) -> None:
    if isinstance(want, tuple):
        assert type(got) is type(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_every_module_has_a_case():
    covered = {c.id.split("-")[0] for c in CASES}
    assert covered == WRAPPERS


# ----------------------------------------------------------------------------- parity and repr


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_module_equals_function(case):
    x = _x(case)
    _assert_same(case.make()(x), case.fn(x))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_repr(case):
    assert repr(case.make()) == case.repr


def test_forward_return_annotations():
    for name in sorted(WRAPPERS):
        assert "return" in getattr(nn, name).forward.__annotations__, name
    topk = nn.SoftTopK(2)(torch.randn(2, 5))
    assert isinstance(topk, softops.TopK)


# ---------------------------------------------------------------------- pickle and state_dict


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_pickle_round_trip(case):
    x = _x(case)
    layer = case.make()
    for clone in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert type(clone) is type(layer) and repr(clone) == repr(layer)
        fresh = case.make()  # a generator in the state the pickle saw
        _assert_same(clone(x), fresh(x))
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _assert_same(loaded(x), case.make()(x))


def test_pickled_generator_is_a_copy_in_the_same_state():
    x = torch.randn(2, 7, dtype=F64)
    layer = nn.SoftTopKMask(3, method="perturbed", n_samples=8, generator=seeded(3))
    clone = pickle.loads(pickle.dumps(layer))
    assert clone.generator is not layer.generator
    _assert_same(clone(x), layer(x))  # the same draws, from separate generators
    assert torch.equal(clone.generator.get_state(), layer.generator.get_state())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_dict_is_empty_and_loads(case):
    # The arguments are configuration, not state: nothing is learned or saved.
    layer = case.make()
    assert layer.state_dict() == {}
    assert list(layer.parameters()) == [] and list(layer.buffers()) == []
    layer.load_state_dict({})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        layer.load_state_dict({"epsilon": torch.tensor(1.0)})


def test_a_parameter_epsilon_is_learned_state():
    eps = torch.nn.Parameter(torch.tensor(0.5, dtype=F64))
    layer = nn.SoftTopKMask(2, epsilon=eps)
    assert set(layer.state_dict()) == {"epsilon"}
    x = torch.randn(3, 6, dtype=F64)
    layer(x)[:, 0].sum().backward()
    assert eps.grad is not None and torch.isfinite(eps.grad)
    other = nn.SoftTopKMask(2, epsilon=torch.nn.Parameter(torch.tensor(1.0, dtype=F64)))
    other.load_state_dict(layer.state_dict())
    _assert_same(other(x), layer(x))


# ---------------------------------------------------------------------- device and dtype


def _devices() -> list[Any]:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return ["cpu", pytest.param("cuda", marks=cuda)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_output_follows_the_input_dtype_and_device(case, device):
    if "generator" in case.tags and device != "cpu":
        pytest.skip("the stored generator lives on the CPU")
    layer = case.make()
    for dtype in case.dtypes:
        out = layer(_x(case, dtype, device))
        for t in out if isinstance(out, tuple) else (out,):
            if t.dtype.is_floating_point:
                assert t.dtype == dtype, case.id
            assert t.device.type == device


# ----------------------------------------------------------------------- errors at construction


ERRORS = [
    # the example of the layout issue: a bad method (checked before k)
    (lambda: nn.SoftTopKMask(-3, method="bogus"), ValueError, "SoftTopKMask: expected `method`"),
    (lambda: nn.SoftTopKMask(-3), ValueError, r"SoftTopKMask: expected `k` >= 0; got k=-3\."),
    (lambda: nn.SoftTopKMask("2"), TypeError, r"SoftTopKMask: expected `k` to be a number"),
    (
        lambda: nn.SoftTopKMask(torch.tensor([1.0, -2.0])),
        ValueError,
        r"SoftTopKMask: expected `k` >= 0; got k=-2\.",
    ),
    (lambda: nn.SoftTopKMask(2, epsilon=0.0), ValueError, r"SoftTopKMask: .*got epsilon=0\.0"),
    (
        lambda: nn.SoftTopKMask(2, hard=1),
        TypeError,
        r"SoftTopKMask: expected `hard` .*got hard=1\.",
    ),
    (lambda: nn.SoftTopKMask(2, largest=None), TypeError, r"SoftTopKMask: .*`largest`"),
    (lambda: nn.SoftTopKMask(2, n_samples=8), ValueError, r"SoftTopKMask: .*`n_samples`"),
    (
        lambda: nn.SoftTopKMask(2, method="softkmax", max_iter=10),
        ValueError,
        r"SoftTopKMask: .*`max_iter`",
    ),
    (lambda: nn.SoftTopKMask(2, max_iter="a"), TypeError, r"SoftTopKMask: .*max_iter='a'"),
    (lambda: nn.SoftTopKMask(2, tol=-1.0), ValueError, r"SoftTopKMask: .*tol=-1\.0"),
    (
        lambda: nn.SoftTopKMask(2, method="perturbed", generator=3),
        TypeError,
        r"SoftTopKMask: expected `generator` .*got 3",
    ),
    (lambda: nn.SoftTopKMask(2, dim=1.0), TypeError, r"SoftTopKMask: expected `dim` .*got 1\.0"),
    # the rules that tie k to the method are checked at construction too
    (
        lambda: nn.SoftTopKMask(2.5, method="softkmax"),
        ValueError,
        r"SoftTopKMask: expected an integer `k` with method='softkmax'; got k=2\.5",
    ),
    (lambda: nn.SoftTopKMask(1.5, hard=True), ValueError, r"SoftTopKMask: hard=True needs an"),
    (
        lambda: nn.SoftTopKMask(torch.tensor([1.0, 2.0]), method="sinkhorn"),
        ValueError,
        r"SoftTopKMask: expected a scalar `k` with method='sinkhorn'",
    ),
    (
        lambda: nn.SoftTopKMask(torch.tensor(2.0, requires_grad=True), method="perturbed"),
        ValueError,
        r"SoftTopKMask: expected a `k` that does not require grad with method='perturbed'",
    ),
    (lambda: nn.SoftTopK(0), ValueError, r"SoftTopK: expected `k` >= 1; got k=0\."),
    (lambda: nn.SoftTopK(2.5), TypeError, r"SoftTopK: expected `k` to be an int; got k=2\.5"),
    (lambda: nn.SoftTopK(2, max_iter=0), ValueError, r"SoftTopK: .*max_iter=0"),
    (lambda: nn.SoftTopK(2, tol="x"), TypeError, r"SoftTopK: .*tol='x'"),
    (lambda: nn.SoftTopK(2, largest="yes"), TypeError, r"SoftTopK: .*`largest`.*'yes'"),
    (lambda: nn.SoftTopK(2, epsilon=-1.0), ValueError, r"SoftTopK: .*got epsilon=-1\.0"),
    (lambda: nn.SoftKMax(-1), ValueError, r"SoftKMax: expected `k` >= 0; got k=-1\."),
    (lambda: nn.SoftKMax(1.5), TypeError, r"SoftKMax: expected `k` to be an int; got k=1\.5"),
    (lambda: nn.SoftKMax(2, epsilon="a"), TypeError, r"SoftKMax: .*`epsilon`.*'a'"),
    (
        lambda: nn.SmoothMax(keepdim=1),
        TypeError,
        r"SmoothMax: expected `keepdim` .*got keepdim=1\.",
    ),
    (lambda: nn.SmoothMin(epsilon=float("inf")), ValueError, r"SmoothMin: .*got epsilon=inf"),
    (lambda: nn.SoftArgmax(dim="0"), TypeError, r"SoftArgmax: expected `dim` .*got '0'"),
    (lambda: nn.SoftArgmin(epsilon=0), ValueError, r"SoftArgmin: .*got epsilon=0"),
    (lambda: nn.SoftArgmaxOneHot(hard=0), TypeError, r"SoftArgmaxOneHot: .*`hard` .*got hard=0\."),
    (lambda: nn.SoftSort(method="bogus"), ValueError, r"SoftSort: expected `method`"),
    (
        lambda: nn.SoftSort(method="softsort", regularization="kl"),
        ValueError,
        r"SoftSort: .*`regularization`.*got regularization='kl'",
    ),
    (lambda: nn.SoftSort(regularization="l1"), ValueError, r"SoftSort: .*regularization='l1'"),
    (lambda: nn.SoftSort(method="ot", max_iter="a"), TypeError, r"SoftSort: .*max_iter='a'"),
    (
        lambda: nn.SoftSort(descending=1),
        TypeError,
        r"SoftSort: expected `descending` .*got descending=1\.",
    ),
    (lambda: nn.SoftSort(epsilon=-0.5), ValueError, r"SoftSort: .*got epsilon=-0\.5"),
    (lambda: nn.SoftRank(method="pav", tol=1e-3), ValueError, r"SoftRank: .*`tol`"),
    (lambda: nn.SoftRank(distance="l3"), ValueError, r"SoftRank: .*`distance`"),
    (lambda: nn.SoftArgsort(method="pav"), ValueError, r"SoftArgsort: expected `method`"),
    (lambda: nn.SoftArgsort(distance="l3"), ValueError, r"SoftArgsort: .*distance='l3'"),
    (lambda: nn.SoftArgsort(hard="no"), TypeError, r"SoftArgsort: expected `hard` .*got hard='no'"),
    (lambda: nn.SoftQuantile(1.5), ValueError, r"SoftQuantile: expected 0 <= `q` <= 1; got q=1\.5"),
    (
        lambda: nn.SoftQuantile(torch.tensor([[0.5]])),
        ValueError,
        r"SoftQuantile: .*got q of shape \(1, 1\)",
    ),
    (lambda: nn.SoftQuantile(0.5, method="softsort"), ValueError, r"SoftQuantile: .*`method`"),
    (lambda: nn.SoftQuantile(0.5, keepdim=None), TypeError, r"SoftQuantile: .*`keepdim`"),
]


@pytest.mark.parametrize(("build", "error", "match"), ERRORS)
def test_errors_at_construction_name_the_module(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_every_module_checks_something_at_construction():
    named = {re.match(r"(\w+):", m).group(1) for _, _, m in ERRORS}
    assert named == WRAPPERS


def test_what_needs_x_is_checked_on_the_forward_call_under_the_function_name():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"soft_topk_mask: expected 0 <= `k` <= x.shape\[dim\]"):
        nn.SoftTopKMask(5)(x)
    with pytest.raises(ValueError, match=r"soft_kmax: .*got k=9"):
        nn.SoftKMax(9)(x)
    with pytest.raises(ValueError, match=r"soft_sort: expected `dim` in \[-2, 1\]"):
        nn.SoftSort(dim=2)(x)
