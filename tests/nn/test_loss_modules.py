"""The loss Modules: each equals its function of softops.losses (value and gradient), covers
every loss there, reprs, pickles, learns a Parameter epsilon, and checks its arguments at
construction under its own name (what needs the data, on the forward call under the
function's)."""

from __future__ import annotations

import copy
import pickle
import re
from collections.abc import Callable

import pytest
import torch

from softops import losses, nn
from tests._helpers import seeded

F64 = torch.float64


def _classes() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(6, 4, generator=seeded(1), dtype=F64)
    return x, torch.tensor([0, 1, 2, 3, 1, 0])


def _ranking() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 7, generator=seeded(2), dtype=F64)
    return x, torch.randint(0, 4, (3, 7), generator=seeded(3)).to(F64)


# (Module, its function, the data, the arguments)
CASES: list[tuple[type, Callable, Callable, dict]] = [
    (nn.AccuracyLoss, losses.accuracy_loss, _classes, {"from_logits": True, "epsilon": 0.5}),
    (nn.AccuracyLoss, losses.accuracy_loss, _classes, {"reduction": "none"}),
    (nn.TopKAccuracyLoss, losses.topk_accuracy_loss, _classes, {"k": 2, "epsilon": 0.3}),
    (nn.TopKAccuracyLoss, losses.topk_accuracy_loss, _classes, {"k": 3, "reduction": "sum"}),
    (nn.TopKCrossEntropy, losses.topk_cross_entropy, _classes, {"p_k": [0.5, 0.5]}),
    (
        nn.TopKCrossEntropy,
        losses.topk_cross_entropy,
        _classes,
        {"p_k": (0.2, 0.0, 0.8), "m": 3, "reduction": "none"},
    ),
    (nn.F1Loss, losses.f1_loss, _classes, {"from_logits": True, "average": "micro"}),
    (nn.F1Loss, losses.f1_loss, _classes, {"from_logits": True}),
    (nn.SpearmanLoss, losses.spearman_loss, _ranking, {}),
    (nn.SpearmanLoss, losses.spearman_loss, _ranking, {"dim": 0, "epsilon": 0.2}),
    (nn.NDCGLoss, losses.ndcg_loss, _ranking, {}),
    (nn.NDCGLoss, losses.ndcg_loss, _ranking, {"k": 3, "gain": "exp", "reduction": "none"}),
]
IDS = [f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)]
_POSITIONAL = {"k", "p_k"}


def _call(fn: Callable, data: tuple, kwargs: dict) -> torch.Tensor:
    pos = [kwargs[k] for k in ("k", "p_k") if k in kwargs and fn.__name__ != "ndcg_loss"]
    rest = {k: v for k, v in kwargs.items() if k not in _POSITIONAL or fn.__name__ == "ndcg_loss"}
    return fn(*data, *pos, **rest)


def _build(cls: type, kwargs: dict) -> torch.nn.Module:
    pos = [kwargs[k] for k in ("k", "p_k") if k in kwargs]
    return cls(*pos, **{k: v for k, v in kwargs.items() if k not in _POSITIONAL})


def test_every_loss_has_a_module():
    assert {c[1].__name__ for c in CASES} == set(losses.__all__)
    covered = {c[0].__name__ for c in CASES}
    assert covered == {n for n in nn.__all__ if n.endswith(("Loss", "CrossEntropy"))}


@pytest.mark.parametrize(("cls", "fn", "data", "kwargs"), CASES, ids=IDS)
def test_module_equals_function_value_and_gradient(cls, fn, data, kwargs):
    x, t = data()
    x = x.requires_grad_(True)
    module = _build(cls, kwargs)
    got, want = module(x, t), _call(fn, (x, t), kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    (g1,) = torch.autograd.grad(got.sum(), x)
    (g2,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    assert "return" in cls.forward.__annotations__


@pytest.mark.parametrize(("cls", "fn", "data", "kwargs"), CASES, ids=IDS)
def test_pickle_deepcopy_and_empty_state(cls, fn, data, kwargs):
    x, t = data()
    module = _build(cls, kwargs)
    for clone in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert repr(clone) == repr(module)
        torch.testing.assert_close(clone(x, t), module(x, t), rtol=0, atol=0)
    assert module.state_dict() == {}


def test_reprs():
    assert repr(nn.SpearmanLoss()) == (
        "SpearmanLoss(dim=-1, epsilon=None, method='pav', reduction='mean')"
    )
    assert repr(nn.NDCGLoss(5, gain="exp")) == (
        "NDCGLoss(k=5, dim=-1, epsilon=None, gain='exp', reduction='mean')"
    )
    assert repr(nn.TopKCrossEntropy([0.5, 0.5], m=4)) == (
        "TopKCrossEntropy(p_k=(0.5, 0.5), epsilon=1.0, method='ot', m=4, reduction='mean')"
    )
    assert repr(nn.F1Loss()) == "F1Loss(average=None, from_logits=False, epsilon=1.0)"
    assert repr(nn.AccuracyLoss()) == (
        "AccuracyLoss(from_logits=False, epsilon=1.0, reduction='mean')"
    )
    assert repr(nn.TopKAccuracyLoss(2)) == (
        "TopKAccuracyLoss(k=2, epsilon=0.1, method='ot', reduction='mean')"
    )


def test_a_parameter_epsilon_is_learned():
    eps = torch.nn.Parameter(torch.tensor(0.4, dtype=F64))
    module = nn.SpearmanLoss(epsilon=eps)
    assert set(module.state_dict()) == {"epsilon"}
    x, t = _ranking()
    module(x, t).backward()
    assert eps.grad is not None and eps.grad != 0


ERRORS = [
    (lambda: nn.AccuracyLoss(reduction="avg"), ValueError, r"AccuracyLoss: expected `reduction`"),
    (
        lambda: nn.AccuracyLoss(epsilon=0.5),
        ValueError,
        r"AccuracyLoss: expected `epsilon` to be left at its default 1\.0 .*got epsilon=0\.5\.",
    ),
    (lambda: nn.AccuracyLoss(from_logits=1), TypeError, r"AccuracyLoss: .*`from_logits`"),
    (lambda: nn.TopKAccuracyLoss(0), ValueError, r"TopKAccuracyLoss: expected `k` >= 1; got k=0"),
    (lambda: nn.TopKAccuracyLoss(1.0), TypeError, r"TopKAccuracyLoss: .*got k=1\.0"),
    (
        lambda: nn.TopKAccuracyLoss(2, method="softkmax"),
        ValueError,
        r"TopKAccuracyLoss: expected `method`",
    ),
    (lambda: nn.TopKAccuracyLoss(2, epsilon=0), ValueError, r"TopKAccuracyLoss: .*epsilon=0"),
    (
        lambda: nn.TopKCrossEntropy([0.5, 0.6]),
        ValueError,
        r"TopKCrossEntropy: expected `p_k` of non-negative weights summing to 1",
    ),
    (
        lambda: nn.TopKCrossEntropy([0.5, 0.5], m=1),
        ValueError,
        r"TopKCrossEntropy: expected `m` >= 2 or None; got m=1\.",
    ),
    (lambda: nn.TopKCrossEntropy("ab"), TypeError, r"TopKCrossEntropy: expected `p_k`"),
    (lambda: nn.F1Loss(average="weighted"), ValueError, r"F1Loss: expected `average`"),
    (
        lambda: nn.F1Loss(from_logits=True, epsilon=-1.0),
        ValueError,
        r"F1Loss: .*epsilon=-1\.0",
    ),
    (lambda: nn.SpearmanLoss(dim=0.5), TypeError, r"SpearmanLoss: expected `dim` .*0\.5"),
    (lambda: nn.SpearmanLoss(method="sinkhorn"), ValueError, r"SpearmanLoss: expected `method`"),
    (lambda: nn.SpearmanLoss(epsilon="a"), TypeError, r"SpearmanLoss: .*`epsilon`"),
    (lambda: nn.NDCGLoss(0), ValueError, r"NDCGLoss: expected `k` >= 1 or None; got k=0\."),
    (lambda: nn.NDCGLoss(gain="log2"), ValueError, r"NDCGLoss: expected `gain`"),
    (lambda: nn.NDCGLoss(reduction=None), ValueError, r"NDCGLoss: expected `reduction`"),
]


@pytest.mark.parametrize(("build", "error", "match"), ERRORS)
def test_errors_at_construction_name_the_module(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_every_module_checks_at_construction():
    named = {re.match(r"(\w+):", m).group(1) for _, _, m in ERRORS}
    assert named == {c[0].__name__ for c in CASES}


def test_what_needs_the_data_is_checked_on_the_forward_call_under_the_function_name():
    x, t = _classes()
    with pytest.raises(ValueError, match=r"topk_accuracy_loss: expected 1 <= `k` <= C \(= 4\)"):
        nn.TopKAccuracyLoss(5)(x, t)
    with pytest.raises(ValueError, match=r"topk_cross_entropy: expected len\(p_k\) \(= 2\) <="):
        nn.TopKCrossEntropy([0.5, 0.5], m=9)(x, t)
    r, y = _ranking()
    with pytest.raises(ValueError, match=r"ndcg_loss: expected 1 <= `k` <= input.shape\[dim\]"):
        nn.NDCGLoss(8)(r, y)
