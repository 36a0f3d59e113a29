"""TopKMoE: the sparse dispatch equals the dense computation (every expert on every token,
weighted by the router's weights), runs k experts per token, the capacity rule written out,
gradients, errors, round trips."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
from torch import nn

from softops.nn import MoEOutput, RouterOutput, TopKMoE
from tests._helpers import seeded

F64 = torch.float64
D, E = 5, 6


def _moe(**kw) -> TopKMoE:
    torch.manual_seed(0)
    kw = {"k": 2, **kw}
    if "experts" not in kw and "expert_factory" not in kw:
        kw["expert_factory"] = lambda: nn.Sequential(nn.Linear(D, 7), nn.Tanh(), nn.Linear(7, D))
    return TopKMoE(D, E, **kw).double()


def _tokens(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, D, generator=seeded(1), dtype=F64)


def _dense(moe: TopKMoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Every expert on every token, weighted by the router's weights (times ``keep``, a 0/1
    mask of the (token, expert) terms, when given)."""
    r = moe.router(x)
    w = r.weights if keep is None else r.weights * keep
    ys = torch.stack([f(x) for f in moe.experts], -2)  # (*, E, d)
    return (w.unsqueeze(-1) * ys).sum(-2)


def _selected(r: RouterOutput) -> torch.Tensor:
    return torch.zeros_like(r.weights).scatter(-1, r.indices, 1.0)


def _grads(moe: TopKMoE, x: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
    ct = torch.randn(out.shape, generator=seeded(7), dtype=F64)
    return list(torch.autograd.grad((out * ct).sum(), [x, *moe.parameters()], allow_unused=True))


def _assert_grads_equal(a: list, b: list) -> None:
    for ga, gb in zip(a, b, strict=True):
        if ga is None or gb is None:
            assert (ga is None or not ga.any()) and (gb is None or not gb.any())
        else:
            torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["softmax", "mean"])
def test_hard_routing_equals_the_dense_computation(mode):
    moe = _moe(mode=mode)
    x = _tokens(3, 8).requires_grad_(True)
    out = moe(x)
    assert isinstance(out, MoEOutput) and out.output.shape == x.shape
    # the forward: every expert on every token, weighted (unselected experts weigh 0)
    torch.testing.assert_close(out.output, _dense(moe, x), rtol=1e-12, atol=1e-12)
    # the gradients: those of the dense sum over the terms that are run
    keep = _selected(moe.router(x))
    _assert_grads_equal(_grads(moe, x, out.output), _grads(moe, x, _dense(moe, x, keep)))
    torch.testing.assert_close(out.aux_loss, out.router.aux_loss)
    torch.testing.assert_close(out.z_loss, out.router.z_loss)
    assert float(out.dropped) == 0.0


@pytest.mark.parametrize("method", ["sparse", "ot"])
def test_soft_routing_runs_the_experts_with_a_weight_and_equals_dense(method):
    # hard=False: the terms left out have weight 0 and (sparse) a zero derivative, so the
    # sparse sum equals the dense one in value and in every gradient
    moe = _moe(hard=False, method=method, epsilon=0.3)
    x = _tokens(10).requires_grad_(True)
    out = moe(x)
    dense = _dense(moe, x)
    torch.testing.assert_close(out.output, dense, rtol=1e-12, atol=1e-12)
    _assert_grads_equal(_grads(moe, x, out.output), _grads(moe, x, dense))


def test_each_expert_runs_on_its_tokens_only():
    moe = _moe(k=2)
    seen: list[int] = []
    for f in moe.experts:
        f.register_forward_hook(lambda mod, inp, outp: seen.append(inp[0].shape[0]))
    x = _tokens(40)
    out = moe(x)
    assert sum(seen) == 40 * 2  # k rows per token in all, not E
    counts = torch.bincount(out.router.indices.flatten(), minlength=E)
    assert sorted(seen) == sorted(c for c in counts.tolist() if c)
    seen.clear()
    moe.router.method, moe.router.epsilon, moe.router.hard = "sparse", 0.05, False
    moe(x)
    assert sum(seen) == int((moe.router(x).weights != 0).sum()) < 40 * E


def test_capacity_written_out():
    moe = _moe(k=2, capacity_factor=0.5)
    x = _tokens(30)
    out = moe(x)
    r = moe.router(x)
    cap = math.ceil(0.5 * 2 * 30 / E)
    assert moe.capacity(30) == cap == 5
    # served by preference (first choices first), then in token order; the rest dropped
    keep = torch.zeros(30, E, dtype=F64)
    taken = [0] * E
    for j in range(2):
        for t in range(30):
            e = int(r.indices[t, j])
            if taken[e] < cap:
                keep[t, e], taken[e] = 1.0, taken[e] + 1
    assert sum(taken) < 60  # some were dropped
    torch.testing.assert_close(out.output, _dense(moe, x, keep), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.dropped, torch.tensor(1 - sum(taken) / 60, dtype=F64))
    # no renormalisation: a kept term has the router's weight; a large capacity drops nothing
    roomy = _moe(k=2, capacity_factor=float(E))
    torch.testing.assert_close(roomy(x).output, _moe(k=2)(x).output, rtol=0, atol=0)
    assert float(roomy(x).dropped) == 0.0


def test_gradcheck_soft():
    moe = _moe(hard=False, epsilon=0.5)
    x = _tokens(4).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: moe(x).output, (x,))
    sparse = _moe(hard=False, method="sparse", epsilon=0.5)
    assert torch.autograd.gradcheck(lambda x: sparse(x).output, (x,))


def test_given_experts_default_experts_and_a_training_step():
    lin = [nn.Linear(D, D, dtype=F64) for _ in range(E)]
    moe = TopKMoE(D, E, 2, experts=lin, dtype=F64)
    assert all(a is b for a, b in zip(moe.experts, lin, strict=True))
    default = TopKMoE(8, 4, 1)
    assert isinstance(default.experts[0], nn.Sequential)
    assert default.experts[0][0].out_features == 32
    x = torch.randn(16, 8)
    out = default(x)
    (out.output.square().mean() + 0.01 * out.aux_loss + 0.001 * out.z_loss).backward()
    grads = [p.grad for p in default.router.parameters()]
    assert all(g is not None and (g != 0).any() for g in grads)


def test_round_trips_and_repr():
    moe = _moe(capacity_factor=1.5)  # built with a lambda factory: nothing of it is kept
    assert repr(moe).startswith("TopKMoE(\n  d_model=5, num_experts=6, k=2, capacity_factor=1.5")
    x = _tokens(2, 7)
    want = moe(x).output
    for clone in (pickle.loads(pickle.dumps(moe)), copy.deepcopy(moe)):
        torch.testing.assert_close(clone(x).output, want, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(moe.state_dict(), buffer)
    buffer.seek(0)
    other = _moe(capacity_factor=1.5)
    for p in other.parameters():
        nn.init.normal_(p)
    other.load_state_dict(torch.load(buffer))
    torch.testing.assert_close(other(x).output, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: TopKMoE(4, 3, 4), ValueError, r"TopKMoE: expected 1 <= `k` <= num_experts"),
        (lambda: TopKMoE(4, 3, 2, method="x"), ValueError, r"TopKMoE: expected `method`"),
        (
            lambda: TopKMoE(4, 3, 2, capacity_factor=0),
            ValueError,
            r"TopKMoE: expected `capacity_factor` > 0 and finite; got capacity_factor=0\.",
        ),
        (
            lambda: TopKMoE(4, 3, 2, capacity_factor="1"),
            TypeError,
            r"TopKMoE: expected `capacity_factor` .*got capacity_factor='1'\.",
        ),
        (
            lambda: TopKMoE(4, 3, 2, experts=[nn.Identity()] * 2),
            ValueError,
            r"TopKMoE: expected `experts` to hold num_experts \(= 3\) Modules; got 2\.",
        ),
        (
            lambda: TopKMoE(4, 2, 2, experts=[nn.Identity(), "f"]),
            TypeError,
            r"TopKMoE: expected every expert to be a torch.nn.Module; got str at index 1\.",
        ),
        (
            lambda: TopKMoE(4, 2, 2, experts=nn.Identity()),
            TypeError,
            r"TopKMoE: expected `experts` to be a sequence of Modules; got one Module\.",
        ),
        (
            lambda: TopKMoE(4, 2, 2, expert_factory=nn.Identity, experts=[nn.Identity()] * 2),
            ValueError,
            r"TopKMoE: expected `expert_factory` or `experts`, not both\.",
        ),
        (
            lambda: TopKMoE(4, 2, 2, expert_factory=3),
            TypeError,
            r"TopKMoE: expected `expert_factory` to be a callable .*got 3\.",
        ),
    ],
)
def test_checks_at_construction(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_forward_errors():
    moe = TopKMoE(4, 3, 2, expert_factory=lambda: nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"TopKMoE: expected expert \d to return shape \(\d+, 4\)"):
        moe(torch.randn(5, 4))
    ok = TopKMoE(4, 3, 2)
    with pytest.raises(TypeError, match=r"TopKRouter: expected tokens in the dtype"):
        ok(torch.randn(5, 4, dtype=F64))
    with pytest.raises(ValueError, match=r"TopKRouter: expected tokens of shape \(\*, d_model"):
        ok(torch.randn(5, 3))
    assert ok(torch.randn(0, 4)).output.shape == (0, 4)
