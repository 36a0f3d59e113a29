"""softops.losses.topk_cross_entropy: the formula written out, cross-entropy at p_k = [1], the
hard limit, the pre-selection of the m best classes, gradients and errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck

from softops import soft_topk_mask
from softops.losses import topk_cross_entropy
from tests._helpers import seeded

F64 = torch.float64


def _data(n=7, c=6, seed=0):
    g = seeded(seed)
    return torch.randn(n, c, generator=g, dtype=F64) * 2, torch.randint(0, c, (n,), generator=g)


def _written_out(s, t, p_k, epsilon, method="ot"):
    total = p_k[0] * torch.softmax(s, -1)[torch.arange(len(t)), t]
    for k in range(2, len(p_k) + 1):
        if p_k[k - 1] > 0:
            A = soft_topk_mask(s, k, epsilon=epsilon, method=method)
            total = total + p_k[k - 1] * A[torch.arange(len(t)), t]
    return -total.log()


@pytest.mark.parametrize(
    "p_k", [[0.5, 0.0, 0.0, 0.5], [0.2, 0.3, 0.5], [0.0, 1.0], [0.0, 0.0, 1.0]]
)
@pytest.mark.parametrize("method", ["ot", "sinkhorn"])
def test_equals_the_formula(p_k, method):
    s, t = _data()
    got = topk_cross_entropy(s, t, p_k, epsilon=0.7, method=method, reduction="none")
    torch.testing.assert_close(got, _written_out(s, t, p_k, 0.7, method))


def test_p1_is_cross_entropy():
    s, t = _data(seed=1)
    for red in ("mean", "sum", "none"):
        want = F.cross_entropy(s, t, reduction=red)
        torch.testing.assert_close(topk_cross_entropy(s, t, [1.0], reduction=red), want)
        torch.testing.assert_close(topk_cross_entropy(s, t, [1.0, 0.0, 0.0], reduction=red), want)


def test_small_epsilon_is_the_hard_membership():
    s, t = _data(seed=2)
    p_k = [0.25, 0.25, 0.5]
    got = topk_cross_entropy(s, t, p_k, epsilon=1e-6, reduction="none")
    rank = (s > s[torch.arange(7), t][:, None]).sum(-1) + 1  # 1 = the best
    member = [(rank <= k).to(F64) for k in (2, 3)]
    want = -(
        0.25 * torch.softmax(s, -1)[torch.arange(7), t] + 0.25 * member[0] + 0.5 * member[1]
    ).log()
    torch.testing.assert_close(got, want)


def test_outside_the_top_k_without_a_softmax_term_is_infinite_with_a_zero_gradient():
    s = torch.tensor([[5.0, 4.0, -30.0]], dtype=F64, requires_grad=True)
    loss = topk_cross_entropy(s, torch.tensor([2]), [0.0, 1.0], epsilon=0.01)
    assert loss.item() == math.inf
    (g,) = torch.autograd.grad(loss, s)
    assert not g.isnan().any()


def test_m_preselection():
    s, t = _data(n=9, c=12, seed=3)
    p_k = [0.5, 0.2, 0.3]
    full = topk_cross_entropy(s, t, p_k, epsilon=0.5, reduction="none")
    torch.testing.assert_close(
        topk_cross_entropy(s, t, p_k, epsilon=0.5, m=12, reduction="none"), full
    )
    got = topk_cross_entropy(s, t, p_k, epsilon=0.5, m=5, reduction="none")
    for i in range(9):
        top = s[i].topk(5).indices.tolist()
        if t[i].item() not in top:
            top[-1] = t[i].item()
        cols = s[i, top][None]
        pos = torch.tensor([top.index(t[i].item())])
        mix = 0.5 * torch.softmax(s[i], -1)[t[i]]
        for k, w in ((2, 0.2), (3, 0.3)):
            mix = mix + w * soft_topk_mask(cols, k, epsilon=0.5)[0, pos[0]]
        torch.testing.assert_close(got[i], -mix.log())


def test_gradients():
    s, t = _data(n=4, c=5, seed=4)
    s.requires_grad_(True)
    eps = torch.tensor(0.6, dtype=F64, requires_grad=True)
    fn = lambda s, e: topk_cross_entropy(s, t, [0.3, 0.3, 0.4], epsilon=e, reduction="none")  # noqa: E731
    assert gradcheck(fn, (s, eps))
    assert gradgradcheck(fn, (s, eps))
    fn_m = lambda s: topk_cross_entropy(s, t, [0.3, 0.7], epsilon=0.6, m=3)  # noqa: E731
    assert gradcheck(fn_m, (s,))


def test_dtype_and_per_row_epsilon():
    s, t = _data(seed=5)
    out = topk_cross_entropy(s.float(), t, [0.5, 0.5])
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), topk_cross_entropy(s, t, [0.5, 0.5]), rtol=1e-5, atol=1e-6
    )
    eps = torch.linspace(0.2, 2.0, 7, dtype=F64)
    got = topk_cross_entropy(s, t, [0.5, 0.5], epsilon=eps, reduction="none")
    for i in range(7):
        one = topk_cross_entropy(s[i : i + 1], t[i : i + 1], [0.5, 0.5], epsilon=float(eps[i]))
        torch.testing.assert_close(got[i], one)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"p_k": [0.5, 0.6]}, ValueError, r"expected `p_k` of non-negative weights summing to 1"),
        ({"p_k": [-0.5, 1.5]}, ValueError, r"non-negative weights summing to 1"),
        ({"p_k": []}, TypeError, r"expected `p_k` to be a non-empty sequence"),
        ({"p_k": "ab"}, TypeError, r"expected `p_k` to be a non-empty sequence"),
        ({"p_k": [0.0] * 6 + [1.0]}, ValueError, r"expected 1 <= `k` <= C \(= 6\)"),
        (
            {"m": 2, "p_k": [0.5, 0.0, 0.5]},
            ValueError,
            r"len\(p_k\) \(= 3\) <= `m` <= C \(= 6\); got m=2",
        ),
        ({"m": 2.5}, TypeError, r"expected `m` to be an int or None"),
        ({"epsilon": 0.0}, ValueError, r"topk_cross_entropy: expected `epsilon` > 0"),
        ({"method": "softkmax"}, ValueError, r"`method` to be one of"),
        ({"reduction": "max"}, ValueError, r"`reduction` to be one of"),
    ],
)
def test_errors(kw, error, match):
    s, t = _data()
    args = {"p_k": [0.5, 0.5], **kw}
    with pytest.raises(error, match=match):
        topk_cross_entropy(s, t, args.pop("p_k"), **args)
    with pytest.raises(ValueError, match=r"topk_cross_entropy: expected `target`"):
        topk_cross_entropy(s, t + 10, [1.0])
