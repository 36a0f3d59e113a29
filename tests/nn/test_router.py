"""TopKRouter: exactly k experts forward, gradients to every expert's logit, the statistics and
the load-balancing loss written out, hard limit, round trips and checks."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from softops import soft_topk_mask
from softops.nn import RouterOutput, TopKRouter
from tests._helpers import seeded

F64 = torch.float64


def _router(**kw) -> TopKRouter:
    torch.manual_seed(0)
    return TopKRouter(6, 8, **{"k": 2, **kw}).double()


def _tokens(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, 6, generator=seeded(1), dtype=F64)


@pytest.mark.parametrize("mode", ["softmax", "mean"])
def test_hard_selects_exactly_k_experts_with_the_usual_weights(mode):
    router = _router(mode=mode)
    x = _tokens(3, 5)
    out = router(x)
    assert isinstance(out, RouterOutput)
    logits = router.gate(x)
    top = logits.topk(2, -1)
    assert torch.equal(out.indices, top.indices)
    assert ((out.weights > 0).sum(-1) == 2).all()
    if mode == "softmax":  # the renormalised softmax of the selected logits
        want = torch.zeros_like(logits).scatter(-1, top.indices, torch.softmax(top.values, -1))
    else:
        want = torch.zeros_like(logits).scatter(-1, top.indices, 0.5)
    torch.testing.assert_close(out.weights, want)
    assert torch.equal(out.mask, (want > 0).to(F64))


def test_hard_gradient_reaches_every_experts_logit_and_is_the_soft_one():
    router = _router()
    x = _tokens(4)
    ct = torch.randn(4, 8, generator=seeded(2), dtype=F64)
    logits = router.gate(x).detach().requires_grad_(True)
    from softops.nn.router import route

    hard = route(logits, 2, 0.1, "softmax", "ot", True).weights
    (g_hard,) = torch.autograd.grad((hard * ct).sum(), logits)
    soft = route(logits, 2, 0.1, "softmax", "ot", False).weights
    (g_soft,) = torch.autograd.grad((soft * ct).sum(), logits)
    torch.testing.assert_close(g_hard, g_soft)
    assert (g_hard != 0).all()  # the unselected experts too
    # a plain torch.topk router gives the unselected experts nothing
    top = logits.topk(2, -1)
    plain = torch.zeros_like(logits).scatter(-1, top.indices, torch.softmax(top.values, -1))
    (g_plain,) = torch.autograd.grad((plain * ct).sum(), logits)
    unselected = plain.detach() == 0
    assert (g_plain[unselected] == 0).all()


def test_soft_weights_are_the_masked_softmax_and_reach_hard_as_epsilon_shrinks():
    router = _router(hard=False)
    x = _tokens(5)
    out = router(x)
    logits = router.gate(x)
    A = soft_topk_mask(logits, 2, epsilon=0.1)
    want = A * logits.exp() / (A * logits.exp()).sum(-1, keepdim=True)
    torch.testing.assert_close(out.weights, want)
    torch.testing.assert_close(out.mask, A)
    sharp = _router(hard=False, epsilon=1e-7)(x)
    torch.testing.assert_close(sharp.weights, _router()(x).weights, rtol=1e-6, atol=1e-6)


def test_load_importance_and_the_switch_loss_written_out():
    router = _router()
    x = _tokens(10)
    out = router(x)
    logits = router.gate(x)
    chosen = torch.zeros(10, 8, dtype=F64).scatter(-1, logits.topk(2, -1).indices, 1.0)
    load = chosen.sum(0) / 20
    importance = torch.softmax(logits, -1).mean(0)
    torch.testing.assert_close(out.load, load)
    torch.testing.assert_close(out.importance, importance)
    torch.testing.assert_close(out.aux_loss, 8 * (load * importance).sum())
    torch.testing.assert_close(out.load.sum(), torch.tensor(1.0, dtype=F64))
    # uniform logits: every expert equally loaded gives aux loss 1
    uniform = torch.zeros(8, 8, dtype=F64)
    from softops.nn.router import route

    stats = route(
        uniform + torch.eye(8, dtype=F64) * 1e-3 + torch.eye(8, dtype=F64).roll(1, 1) * 1e-3,
        2,
        0.1,
        "softmax",
        "ot",
        True,
    )
    torch.testing.assert_close(stats.aux_loss, torch.tensor(1.0, dtype=F64), rtol=1e-3, atol=1e-3)


def test_gradcheck_soft():
    from softops.nn.router import route

    logits = torch.randn(3, 8, generator=seeded(3), dtype=F64, requires_grad=True)
    for mode in ("softmax", "mean"):  # (hard=True is straight-through: the test above)
        assert torch.autograd.gradcheck(
            lambda s, mode=mode: route(s, 2, 0.3, mode, "ot", False).weights, (logits,)
        )
        assert torch.autograd.gradgradcheck(
            lambda s, mode=mode: route(s, 2, 0.3, mode, "ot", False).weights, (logits,)
        )


def test_gradients_reach_the_gate_and_noise_only_in_training():
    router = _router(noise_std=1.0)
    x = _tokens(6)
    router.train()
    a, b = router(x), router(x)
    assert not torch.equal(a.weights, b.weights)
    router.eval()
    c, d = router(x), router(x)
    assert torch.equal(c.weights, d.weights)
    (c.weights.square().sum() + c.aux_loss).backward()
    assert router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("method", ["sinkhorn", "softkmax", "perturbed"])
def test_other_methods(method):
    out = _router(method=method)(_tokens(4))
    assert ((out.weights > 0).sum(-1) == 2).all()
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(4, dtype=F64))


def test_round_trips_and_repr():
    router = _router(epsilon=0.2, noise_std=0.5).eval()
    x = _tokens(3)
    want = router(x).weights
    for other in (copy.deepcopy(router), pickle.loads(pickle.dumps(router))):
        torch.testing.assert_close(other(x).weights, want)
    fresh = _router(epsilon=0.2, noise_std=0.5).eval()
    with torch.no_grad():
        fresh.gate.weight.zero_()
    fresh.load_state_dict(router.state_dict())
    torch.testing.assert_close(fresh(x).weights, want)
    assert repr(router).startswith(
        "TopKRouter(\n  d_model=6, num_experts=8, k=2, epsilon=0.2, mode='softmax', method='ot', "
        "hard=True, noise_std=0.5\n"
    )


ERRORS = [
    (
        lambda: TopKRouter(4, 8, 9),
        ValueError,
        r"TopKRouter: expected 1 <= `k` <= num_experts \(= 8\); got k=9",
    ),
    (lambda: TopKRouter(4, 8, 0), ValueError, r"TopKRouter: expected `k` to be an int >= 1"),
    (lambda: TopKRouter(4, 0, 1), ValueError, r"`num_experts` to be an int >= 1"),
    (lambda: TopKRouter(4, 8, 2, epsilon=0.0), ValueError, r"TopKRouter: expected `epsilon` > 0"),
    (lambda: TopKRouter(4, 8, 2, mode="x"), ValueError, r"`mode` to be one of"),
    (lambda: TopKRouter(4, 8, 2, method="pav"), ValueError, r"`method` to be one of"),
    (lambda: TopKRouter(4, 8, 2, hard=1), TypeError, r"`hard` to be a bool"),
    (lambda: TopKRouter(4, 8, 2, noise_std=-1.0), ValueError, r"`noise_std` >= 0"),
]


@pytest.mark.parametrize(("build", "error", "match"), ERRORS)
def test_checks_at_construction(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_forward_errors():
    router = TopKRouter(4, 8, 2)
    with pytest.raises(
        ValueError, match=r"TopKRouter: expected tokens of shape \(\*, d_model = 4\)"
    ):
        router(torch.randn(3, 5))
    with pytest.raises(TypeError, match=r"TopKRouter: expected a floating tensor of tokens"):
        router(torch.ones(3, 4, dtype=torch.int64))


def test_sparse_method_routes_with_exact_zeros():
    from softops.nn.router import route

    logits = torch.randn(16, 8, generator=seeded(5), dtype=F64, requires_grad=True)
    out = route(logits, 2, 0.05, "softmax", "sparse", False)
    # soft routing, yet most experts get exactly nothing
    assert ((out.weights == 0).sum(-1) >= 5).all()
    torch.testing.assert_close(out.mask.sum(-1), torch.full((16,), 2.0, dtype=F64))
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(16, dtype=F64))
    (g,) = torch.autograd.grad((out.weights * torch.randn(16, 8, dtype=F64)).sum(), logits)
    assert torch.isfinite(g).all()
    hard = _router(method="sparse")(_tokens(4))
    assert ((hard.weights > 0).sum(-1) == 2).all()


def test_combine_weights_are_the_masked_softmax_also_where_probabilities_underflow():
    # A p / sum(A p) (one softmax for the weights and the importance) is softmax(s + log A);
    # where every selected p underflows (a mask not ordered as the logits) the log-domain form
    from softops.nn.attention import mask_weights, masked_softmax

    logits = torch.tensor([[3.0, 1.0, 0.5, -2.0], [200.0, 0.0, -1.0, -3.0]])
    A = torch.tensor([[0.9, 0.8, 0.2, 0.1], [0.0, 1.0, 1.0, 0.0]])
    got = mask_weights(logits, A, 2, "softmax", torch.softmax(logits, -1))
    torch.testing.assert_close(got, masked_softmax(logits, A))
    assert torch.isfinite(got).all() and torch.allclose(got.sum(-1), torch.ones(2))


def test_logits_and_the_z_loss_written_out():
    router = _router(noise_std=1.0)
    x = _tokens(3, 5)
    clean = router.gate(x)
    for training in (False, True):  # the logits are the gate's, before the training noise
        out = router.train(training)(x)
        torch.testing.assert_close(out.logits, clean)
        lse = torch.log(torch.exp(clean).sum(-1))
        torch.testing.assert_close(out.z_loss, (lse**2).mean())
    torch.manual_seed(3)
    noisy = router.train(True)(x)
    assert not torch.equal(noisy.indices, clean.topk(2, -1).indices)  # the noise did act
    (g,) = torch.autograd.grad(noisy.z_loss, router.gate.weight)
    assert torch.isfinite(g).all() and (g != 0).any()


def test_z_loss_gradcheck():
    logits = torch.randn(4, 8, generator=seeded(4), dtype=F64, requires_grad=True)
    from softops.nn.router import route

    assert torch.autograd.gradcheck(
        lambda s: route(s, 2, 0.1, "softmax", "ot", True).z_loss, (logits,)
    )


def test_input_dtype_must_be_the_routers():
    router = TopKRouter(4, 8, 2)  # float32 parameters
    with pytest.raises(
        TypeError,
        match=r"TopKRouter: expected tokens in the dtype of the router's parameters "
        r"\(torch.float32.*got dtype=torch.float64\.",
    ):
        router(torch.randn(3, 4, dtype=F64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast chooses the gate's dtype
        out = router(torch.randn(3, 4, dtype=torch.bfloat16))
    assert out.weights.shape == (3, 8)


def test_every_field_and_forward_are_documented():
    # The API docs render a field's docstring: the string that follows its annotation.
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(RouterOutput))).body[0].body
    documented = {
        a.target.id
        for a, b in itertools.pairwise(body)
        if isinstance(a, ast.AnnAssign)
        and isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant)
        and isinstance(b.value.value, str)
    }
    assert documented == set(RouterOutput._fields)
    assert RouterOutput._fields[-2:] == ("logits", "z_loss")  # appended: old unpacking holds
    assert "Returns:" in (TopKRouter.forward.__doc__ or "")
