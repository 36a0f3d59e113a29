"""softops.losses: accuracy, top-k accuracy, F1, Spearman and NDCG losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck, gradgradcheck

from softops import soft_rank, soft_topk_mask
from softops.losses import (
    accuracy_loss,
    f1_loss,
    ndcg_loss,
    spearman_loss,
    topk_accuracy_loss,
    topk_cross_entropy,
)
from softops.metrics import soft_accuracy, soft_f1, soft_topk_accuracy
from tests._helpers import seeded

F64 = torch.float64


def _distinct(g: torch.Generator, shape: tuple[int, ...], dim: int = -1) -> torch.Tensor:
    """Entries along ``dim`` that are a permutation of 0..n-1 scaled to [0, 4), plus a jitter
    below a tenth of the spacing: every gap is at least 0.8 * 4/n (no ties)."""
    n = shape[dim]
    keys = torch.rand(shape, generator=g, dtype=F64)
    perm = keys.argsort(dim).to(F64) * 4 / n
    return perm + 0.4 / n * torch.rand(shape, generator=g, dtype=F64)


# ----------------------------------------------------------------------------- classification


@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("binary", [False, True])
def test_accuracy_loss_is_one_minus_soft_accuracy(from_logits, binary):
    g = seeded(1)
    shape = (13,) if binary else (13, 4)
    x = torch.randn(shape, generator=g, dtype=F64)
    if not from_logits:
        x = torch.sigmoid(x) if binary else torch.softmax(x, -1)
    t = torch.randint(0, 2 if binary else 4, (13,), generator=g)
    kw = {"from_logits": True, "epsilon": 0.6} if from_logits else {}
    per = accuracy_loss(x, t, reduction="none", **kw)
    assert per.shape == (13,) and per.dtype == F64
    # per sample: 1 - p[n, t_n], written out
    p = x if not from_logits else (torch.sigmoid(x / 0.6) if binary else torch.softmax(x / 0.6, -1))
    for i in range(13):
        pi = (p[i] if int(t[i]) == 1 else 1 - p[i]) if binary else p[i, int(t[i])]
        assert float(per[i]) == pytest.approx(1 - float(pi), rel=1e-13, abs=1e-15)
    torch.testing.assert_close(accuracy_loss(x, t, **kw), 1 - soft_accuracy(x, t, **kw))
    torch.testing.assert_close(accuracy_loss(x, t, reduction="sum", **kw), per.sum())
    assert bool(((per >= 0) & (per <= 1)).all())


def test_accuracy_loss_gradcheck():
    g = seeded(2)
    z = torch.randn(6, 3, generator=g, dtype=F64, requires_grad=True)
    zb = torch.randn(6, generator=g, dtype=F64, requires_grad=True)
    e = torch.tensor(0.8, dtype=F64, requires_grad=True)
    t = torch.randint(0, 3, (6,), generator=g)
    for red in ("mean", "sum", "none"):
        assert gradcheck(
            lambda z, e, red=red: accuracy_loss(z, t, from_logits=True, epsilon=e, reduction=red),
            (z, e),
        )
        assert gradcheck(
            lambda z, e, red=red: accuracy_loss(
                z, t % 2, from_logits=True, epsilon=e, reduction=red
            ),
            (zb, e),
        )


def test_topk_accuracy_loss():
    g = seeded(3)
    s = torch.randn(9, 6, generator=g, dtype=F64, requires_grad=True)
    t = torch.randint(0, 6, (9,), generator=g)
    per = topk_accuracy_loss(s, t, 2, epsilon=0.3, reduction="none")
    mask = soft_topk_mask(s, 2, epsilon=0.3)
    expected = 1 - mask.gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(per, expected, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(
        topk_accuracy_loss(s, t, 2, epsilon=0.3), 1 - soft_topk_accuracy(s, t, 2, epsilon=0.3)
    )
    torch.testing.assert_close(topk_accuracy_loss(s, t, 2, epsilon=0.3, reduction="sum"), per.sum())
    assert torch.equal(topk_accuracy_loss(s, t, 6), torch.zeros((), dtype=F64))
    e = torch.tensor(0.3, dtype=F64, requires_grad=True)
    assert gradcheck(lambda s, e: topk_accuracy_loss(s, t, 3, epsilon=e, reduction="none"), (s, e))
    # the hard limit: 1 where the target is outside the top k, else 0
    sd = _distinct(g, (9, 6))
    hard = 1 - (sd.topk(2, -1).indices == t[:, None]).any(-1).to(F64)
    lim = topk_accuracy_loss(sd, t, 2, epsilon=1e-3, reduction="none")
    torch.testing.assert_close(lim, hard, atol=1e-12, rtol=0)


@pytest.mark.parametrize("average", [None, "binary", "micro", "macro"])
def test_f1_loss_is_one_minus_soft_f1(average):
    g = seeded(4)
    p = torch.rand(21, generator=g, dtype=F64)
    t = torch.randint(0, 2, (21,), generator=g)
    torch.testing.assert_close(f1_loss(p, t, average=average), 1 - soft_f1(p, t, average=average))
    if average != "binary":
        q = torch.softmax(torch.randn(21, 5, generator=g, dtype=F64), -1)
        t5 = torch.randint(0, 5, (21,), generator=g)
        torch.testing.assert_close(
            f1_loss(q, t5, average=average), 1 - soft_f1(q, t5, average=average)
        )


def test_f1_loss_plain_call_on_binary_probabilities():
    # The call the examples use: 1-D probabilities, default arguments, a scalar out.
    p = torch.tensor([0.9, 0.2, 0.6, 0.3], requires_grad=True)
    t = torch.tensor([1, 0, 1, 1])
    loss = f1_loss(p, t)
    assert loss.shape == () and loss.dtype == torch.float32
    # 1 - 2 TP / (P + T) = 1 - 2 * 1.8 / (2.0 + 3)
    assert loss.item() == pytest.approx(1 - 3.6 / 5.0, rel=1e-6)
    loss.backward()
    # d/dp_n of -2TP/(P+T): -(2 t_n (P + T) - 2 TP) / (P + T)^2
    expected = -(2 * t.double() * 5.0 - 3.6) / 25.0
    torch.testing.assert_close(p.grad.double(), expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError):
        f1_loss(p, t, reduction="mean")


def test_f1_loss_gradcheck_and_on_one_hot():
    g = seeded(5)
    z = torch.randn(10, 4, generator=g, dtype=F64, requires_grad=True)
    t = torch.randint(0, 4, (10,), generator=g)
    for average in ("micro", "macro"):
        assert gradcheck(lambda z, a=average: f1_loss(z, t, average=a, from_logits=True), (z,))
    zb = torch.randn(10, generator=g, dtype=F64, requires_grad=True)
    assert gradcheck(lambda z: f1_loss(torch.sigmoid(z), t % 2), (zb,))
    onehot = torch.nn.functional.one_hot(t, 4).to(F64)
    assert f1_loss(onehot, t, average="micro").item() == 0.0
    # macro averages over all C classes: a class absent from target and predictions scores 0
    absent = 4 - len(t.unique())
    assert f1_loss(onehot, t).item() == pytest.approx(absent / 4)


# ------------------------------------------------------------------------------------ spearman


def _spearmanr(a: torch.Tensor, b: torch.Tensor) -> float:
    stats = pytest.importorskip("scipy.stats")
    return float(stats.spearmanr(a.numpy(), b.numpy()).statistic)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spearman_hard_limit_equals_scipy(seed):
    g = seeded(seed)
    x = _distinct(g, (6, 15))
    t = torch.randint(0, 5, (6, 15), generator=g).to(F64)  # ties in the target
    t[0] = torch.randn(15, generator=g, dtype=F64)  # and a row without
    loss = spearman_loss(x, t, epsilon=0.1, reduction="none")  # every gap > 4/15 * 0.8
    expected = torch.tensor([1 - _spearmanr(x[i], t[i]) for i in range(6)], dtype=F64)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-13)
    # an integer target gives the same
    t_int = t[1:].long()
    torch.testing.assert_close(spearman_loss(x[1:], t_int, epsilon=0.1, reduction="none"), loss[1:])


def test_spearman_tends_to_hard_limit_and_bounds():
    g = seeded(3)
    x = torch.randn(8, 20, generator=g, dtype=F64)
    t = torch.randn(8, 20, generator=g, dtype=F64)
    expected = torch.tensor([1 - _spearmanr(x[i], t[i]) for i in range(8)], dtype=F64)
    errs = [
        float((spearman_loss(x, t, epsilon=e, reduction="none") - expected).abs().max())
        for e in (3.0, 0.3, 1e-6)
    ]
    assert errs[0] > 1e-3 and errs[-1] < 1e-12
    for e in (100.0, 1.0, 0.01):
        loss = spearman_loss(x, t, epsilon=e, reduction="none")
        assert bool(((loss >= 0) & (loss <= 2)).all())
    xd = _distinct(g, (8, 20))
    assert spearman_loss(xd, xd, epsilon=0.1).item() == pytest.approx(0, abs=1e-14)
    assert spearman_loss(xd, -xd, epsilon=0.1).item() == pytest.approx(2, abs=1e-14)
    assert spearman_loss(xd, 3 * xd + 1, epsilon=0.1).item() == pytest.approx(0, abs=1e-14)


def test_spearman_matches_plain_pearson_of_soft_ranks():
    g = seeded(4)
    x = torch.randn(5, 12, generator=g, dtype=F64)
    t = torch.randint(0, 4, (5, 12), generator=g).to(F64)
    r = soft_rank(x, epsilon=0.7)
    stats = pytest.importorskip("scipy.stats")
    for i in range(5):
        h = torch.from_numpy(stats.rankdata(t[i].numpy()))
        rc, hc = r[i] - r[i].mean(), h - h.mean()
        corr = float((rc * hc).sum() / (rc.norm() * hc.norm()))
        got = float(spearman_loss(x[i], t[i], epsilon=0.7))
        assert got == pytest.approx(1 - corr, rel=1e-13)
    for method in ("softsort", "neuralsort"):
        rm = soft_rank(x, epsilon=0.5, method=method)
        got = spearman_loss(x, t, epsilon=0.5, method=method, reduction="none")
        for i in range(5):
            h = torch.from_numpy(stats.rankdata(t[i].numpy()))
            rc, hc = rm[i] - rm[i].mean(), h - h.mean()
            corr = float((rc * hc).sum() / (rc.norm() * hc.norm()))
            assert float(got[i]) == pytest.approx(1 - corr, rel=1e-12)


def test_spearman_constant_rows_are_one_without_nan():
    x = torch.tensor([[0.1, 0.1, 0.1, 0.1], [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 0.0]], dtype=F64)
    t = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0], [0.0, 1.0, 2.0, 3.0]], dtype=F64)
    x.requires_grad_()
    loss = spearman_loss(x, t, epsilon=3.0, reduction="none")  # soft: gaps of 1 < epsilon
    assert loss[:2].tolist() == [1.0, 1.0]
    (grad,) = torch.autograd.grad(loss.sum(), x)
    assert bool(torch.isfinite(grad).all())
    assert torch.equal(grad[:2], torch.zeros(2, 4, dtype=F64))
    assert grad[2].abs().sum() > 0
    # a single entry per row
    one = torch.randn(3, 1, dtype=F64, requires_grad=True)
    out = spearman_loss(one, torch.randn(3, 1, dtype=F64), reduction="none")
    assert out.tolist() == [1.0, 1.0, 1.0]
    (g1,) = torch.autograd.grad(out.sum(), one)
    assert torch.equal(g1, torch.zeros_like(one))


def test_spearman_nan_stays_in_its_row():
    x = torch.randn(3, 6, dtype=F64)
    t = torch.randn(3, 6, dtype=F64)
    x[0, 2] = math.nan
    t[1, 4] = math.nan
    loss = spearman_loss(x, t, reduction="none")
    assert math.isnan(loss[0]) and math.isnan(loss[1]) and not math.isnan(loss[2])


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_spearman_any_dim_equals_loop_and_reductions(dim):
    g = seeded(5)
    x = torch.randn(3, 5, 4, generator=g, dtype=F64)
    t = torch.randn(3, 5, 4, generator=g, dtype=F64)
    loss = spearman_loss(x, t, dim=dim, epsilon=0.4, reduction="none")
    xm, tm = x.movedim(dim, -1), t.movedim(dim, -1)
    assert loss.shape == xm.shape[:-1]
    looped = torch.stack(
        [
            spearman_loss(a, b, epsilon=0.4)
            for a, b in zip(xm.reshape(-1, xm.shape[-1]), tm.reshape(-1, tm.shape[-1]), strict=True)
        ]
    ).reshape(loss.shape)
    torch.testing.assert_close(loss, looped, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(spearman_loss(x, t, dim=dim, epsilon=0.4), loss.mean())
    torch.testing.assert_close(
        spearman_loss(x, t, dim=dim, epsilon=0.4, reduction="sum"), loss.sum()
    )


def test_spearman_gradcheck():
    g = seeded(6)
    x = torch.randn(3, 7, generator=g, dtype=F64, requires_grad=True)
    t = torch.randint(0, 4, (3, 7), generator=g)
    e = torch.tensor(0.8, dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, e: spearman_loss(x, t, epsilon=e, reduction="none"), (x, e))
    assert gradcheck(lambda x: spearman_loss(x, t, epsilon=0.5, method="softsort"), (x,))
    per_row = torch.tensor([0.5, 1.0, 2.0], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, e: spearman_loss(x, t, epsilon=e, reduction="sum"), (x, per_row))


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 12),
    st.integers(0, 2**31 - 1),
    st.sampled_from([1e-3, 0.1, 1.0, 30.0]),
)
def test_spearman_in_range_and_symmetric_under_negation(n, seed, eps):
    g = seeded(seed)
    x = torch.randn(2, n, generator=g, dtype=F64)
    t = torch.randint(0, 3, (2, n), generator=g).to(F64)
    loss = spearman_loss(x, t, epsilon=eps, reduction="none")
    assert bool(((loss >= -1e-12) & (loss <= 2 + 1e-12)).all())
    # negating the target negates the correlation (pav ranks are antisymmetric)
    flipped = spearman_loss(x, -t, epsilon=eps, reduction="none")
    torch.testing.assert_close(loss + flipped, torch.full_like(loss, 2.0), atol=1e-10, rtol=0)


def test_spearman_low_precision():
    x = torch.randn(4, 9)
    t = torch.randn(4, 9)
    ref = spearman_loss(x, t)
    for dtype in (torch.float16, torch.bfloat16):
        out = spearman_loss(x.to(dtype), t.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(
            out.float(), spearman_loss(x.to(dtype).float(), t), atol=2e-2, rtol=0
        )
    assert ref.dtype == torch.float32


# ---------------------------------------------------------------------------------------- ndcg


def _ndcg_score(y: torch.Tensor, s: torch.Tensor, k: int | None) -> torch.Tensor:
    skm = pytest.importorskip("sklearn.metrics")
    rows = [
        float(skm.ndcg_score(y[i : i + 1].numpy(), s[i : i + 1].numpy(), k=k))
        for i in range(len(y))
    ]
    return torch.tensor(rows, dtype=F64)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k", [None, 1, 3, 10])
def test_ndcg_hard_limit_equals_sklearn(seed, k):
    g = seeded(seed)
    s = _distinct(g, (5, 10))
    y = torch.randint(0, 4, (5, 10), generator=g).to(F64)
    y[:, 0] = 2.0  # every row has a relevant entry
    loss = ndcg_loss(s, y, k=k, epsilon=1e-3, reduction="none")
    torch.testing.assert_close(loss, 1 - _ndcg_score(y, s, k), rtol=0, atol=1e-12)
    # exp gain is the linear gain of 2^y - 1
    loss_exp = ndcg_loss(s, y, k=k, epsilon=1e-3, gain="exp", reduction="none")
    torch.testing.assert_close(loss_exp, 1 - _ndcg_score(2**y - 1, s, k), rtol=0, atol=1e-12)
    # integer relevance gives the same
    torch.testing.assert_close(ndcg_loss(s, y.long(), k=k, epsilon=1e-3, reduction="none"), loss)


def test_ndcg_tends_to_hard_and_bounds():
    g = seeded(2)
    s = torch.randn(6, 12, generator=g, dtype=F64)
    y = torch.rand(6, 12, generator=g, dtype=F64) * 3
    for k in (None, 4):
        expected = 1 - _ndcg_score(y, s, k)
        errs = [
            float((ndcg_loss(s, y, k=k, epsilon=e, reduction="none") - expected).abs().max())
            for e in (1.0, 0.1, 1e-7)
        ]
        assert errs[0] > 1e-3 and errs[-1] < 1e-10
        for e in (100.0, 1.0, 0.01):
            loss = ndcg_loss(s, y, k=k, epsilon=e, reduction="none")
            assert bool(((loss >= 0) & (loss <= 1 + 1e-12)).all())
    # the ideal ordering has loss 0
    yd = _distinct(g, (6, 12))
    assert ndcg_loss(yd, yd, epsilon=0.1).item() == pytest.approx(0, abs=1e-14)
    assert ndcg_loss(yd, yd, k=3, epsilon=1e-3).item() == pytest.approx(0, abs=1e-12)


def test_ndcg_matches_plain_formula():
    g = seeded(3)
    s = torch.randn(4, 8, generator=g, dtype=F64)
    y = torch.randint(0, 3, (4, 8), generator=g).to(F64)
    y[:, 1] = 1.0
    e = 0.6
    r = soft_rank(s, descending=True, epsilon=e)
    m = soft_topk_mask(s, 3, epsilon=e)
    for k in (None, 3):
        got = ndcg_loss(s, y, k=k, epsilon=e, reduction="none")
        for i in range(4):
            top = 8 if k is None else k
            dcg = sum(
                float(y[i, j])
                * (1.0 if k is None else float(m[i, j]))
                / math.log2(1 + float(r[i, j]))
                for j in range(8)
            )
            ideal = sorted(y[i].tolist(), reverse=True)[:top]
            idcg = sum(v / math.log2(2 + j) for j, v in enumerate(ideal))
            assert float(got[i]) == pytest.approx(1 - dcg / idcg, rel=1e-13)


def test_ndcg_zero_relevance_row_is_zero_without_nan():
    s = torch.randn(2, 5, dtype=F64, requires_grad=True)
    y = torch.tensor([[0.0] * 5, [1.0, 0.0, 2.0, 0.0, 0.0]], dtype=F64)
    loss = ndcg_loss(s, y, reduction="none")
    assert loss[0].item() == 0.0 and loss[1].item() > 0
    (grad,) = torch.autograd.grad(loss.sum(), s)
    assert torch.equal(grad[0], torch.zeros(5, dtype=F64))
    assert bool(torch.isfinite(grad).all()) and grad[1].abs().sum() > 0
    y_nan = y.clone()
    y_nan[1, 0] = math.nan
    out = ndcg_loss(s.detach(), y_nan, reduction="none")
    assert out[0].item() == 0.0 and math.isnan(out[1])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_ndcg_any_dim_equals_loop_and_reductions(dim):
    g = seeded(4)
    s = torch.randn(4, 6, 3, generator=g, dtype=F64)
    y = torch.rand(4, 6, 3, generator=g, dtype=F64)
    loss = ndcg_loss(s, y, dim=dim, k=2, epsilon=0.3, reduction="none")
    sm, ym = s.movedim(dim, -1), y.movedim(dim, -1)
    assert loss.shape == sm.shape[:-1]
    looped = torch.stack(
        [
            ndcg_loss(a, b, k=2, epsilon=0.3)
            for a, b in zip(sm.reshape(-1, sm.shape[-1]), ym.reshape(-1, ym.shape[-1]), strict=True)
        ]
    ).reshape(loss.shape)
    torch.testing.assert_close(loss, looped, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(ndcg_loss(s, y, dim=dim, k=2, epsilon=0.3), loss.mean())
    torch.testing.assert_close(
        ndcg_loss(s, y, dim=dim, k=2, epsilon=0.3, reduction="sum"), loss.sum()
    )


def test_ndcg_gradcheck():
    g = seeded(5)
    s = torch.randn(3, 6, generator=g, dtype=F64, requires_grad=True)
    y = torch.randint(0, 3, (3, 6), generator=g).to(F64)
    y[:, 0] = 1.0
    e = torch.tensor(0.7, dtype=F64, requires_grad=True)
    for k in (None, 2):
        for gain in ("linear", "exp"):
            assert gradcheck(
                lambda s, e, k=k, gain=gain: ndcg_loss(
                    s, y, k=k, epsilon=e, gain=gain, reduction="none"
                ),
                (s, e),
            )


def test_ndcg_low_precision():
    s = torch.randn(4, 9)
    y = torch.rand(4, 9)
    for dtype in (torch.float16, torch.bfloat16):
        out = ndcg_loss(s.to(dtype), y.to(dtype), k=3)
        assert out.dtype == dtype
        ref = ndcg_loss(s.to(dtype).float(), y.to(dtype).float(), k=3)
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=0)


# ------------------------------------------------------------------------------------- errors


def test_classification_loss_errors():
    p = torch.softmax(torch.randn(4, 3), -1)
    t = torch.tensor([0, 1, 2, 1])
    with pytest.raises(ValueError, match=r"accuracy_loss: expected `reduction` to be one of .*"):
        accuracy_loss(p, t, reduction="avg")
    with pytest.raises(
        ValueError, match=r"topk_accuracy_loss: expected `reduction`.*got reduction='max'"
    ):
        topk_accuracy_loss(p, t, 1, reduction="max")
    with pytest.raises(ValueError, match=r"f1_loss: expected `average` to be one of"):
        f1_loss(p, t, average="samples")
    with pytest.raises(ValueError, match=r"accuracy_loss: expected `target` of shape \(4,\)"):
        accuracy_loss(p, t[:2])
    with pytest.raises(ValueError, match=r"accuracy_loss: expected `target` values in \[0, C\)"):
        accuracy_loss(p, t + 1)
    with pytest.raises(
        TypeError, match=r"accuracy_loss: expected `target` to have an integer dtype"
    ):
        accuracy_loss(p, t.double())
    with pytest.raises(TypeError, match=r"accuracy_loss: expected `input` to have a real floating"):
        accuracy_loss(t, t)
    with pytest.raises(ValueError, match=r"expected `epsilon` > 0 and finite; got epsilon=-0.5"):
        accuracy_loss(p, t, from_logits=True, epsilon=-0.5)
    with pytest.raises(ValueError, match=r"topk_accuracy_loss: expected 1 <= `k` <= C \(= 3\)"):
        topk_accuracy_loss(p, t, 4)
    with pytest.raises(ValueError, match=r"non-empty batch"):
        accuracy_loss(p[:0], t[:0])
    with pytest.raises(ValueError, match=r"non-empty batch"):
        f1_loss(torch.rand(0), t[:0])


def test_ranking_loss_errors():
    x = torch.randn(2, 5)
    y = torch.rand(2, 5)
    for fn in (spearman_loss, ndcg_loss):
        op = fn.__name__
        with pytest.raises(ValueError, match=rf"{op}: expected `reduction`.*got reduction='mean '"):
            fn(x, y, reduction="mean ")
        with pytest.raises(
            ValueError,
            match=rf"{op}: expected `target` of the shape of input \(2, 5\); got shape \(2, 4\)",
        ):
            fn(x, y[:, :4])
        with pytest.raises(TypeError, match=rf"{op}: expected `input` to have a real floating"):
            fn(x.long(), y)
        with pytest.raises(
            TypeError, match=rf"{op}: expected `target` to have a real floating or integer dtype"
        ):
            fn(x, y > 0)
        with pytest.raises(
            ValueError, match=rf"{op}: expected `epsilon` > 0 and finite; got epsilon=0"
        ):
            fn(x, y, epsilon=0.0)
        with pytest.raises(ValueError, match=rf"{op}: expected `dim` in \[-2, 1\]"):
            fn(x, y, dim=2)
        with pytest.raises(ValueError, match=rf"{op}: expected a non-empty `dim`"):
            fn(x[:, :0], y[:, :0])
        with pytest.raises(ValueError, match=rf"{op}: expected a non-empty batch"):
            fn(x[:0], y[:0])
        with pytest.raises(
            ValueError, match=rf"{op}: expected `epsilon` to be a scalar or broadcastable"
        ):
            fn(x, y, epsilon=torch.ones(3))
    with pytest.raises(
        ValueError, match=r"spearman_loss: expected `method` to be one of .*got method='x'"
    ):
        spearman_loss(x, y, method="x")
    with pytest.raises(
        ValueError,
        match=r"ndcg_loss: expected 1 <= `k` <= input.shape\[dim\] \(= 5\) or None; got k=6",
    ):
        ndcg_loss(x, y, k=6)
    with pytest.raises(ValueError, match=r"got k=0"):
        ndcg_loss(x, y, k=0)
    with pytest.raises(TypeError, match=r"ndcg_loss: expected `k` to be an int or None; got k=2.5"):
        ndcg_loss(x, y, k=2.5)
    with pytest.raises(
        ValueError, match=r"ndcg_loss: expected `gain` to be one of .*got gain='log'"
    ):
        ndcg_loss(x, y, gain="log")
    with pytest.raises(
        ValueError, match=r"ndcg_loss: expected non-negative `target` \(relevance\); got -1"
    ):
        ndcg_loss(x, y - torch.tensor([[0.0] * 4 + [1.5]] * 2))


def test_errors_name_the_loss_that_raised_them() -> None:
    with pytest.raises(ValueError, match=r"^f1_loss: expected `target` values in \{0, 1\}; got 2"):
        f1_loss(torch.rand(3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"^f1_loss: expected `average`"):
        f1_loss(torch.rand(3, 2), torch.tensor([0, 1, 1]), average="weighted")
    eps = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(ValueError, match=r"^topk_accuracy_loss: expected an `epsilon` that does"):
        topk_accuracy_loss(
            torch.randn(3, 4), torch.tensor([0, 1, 2]), 2, epsilon=eps, method="sinkhorn"
        )


def test_losses_use_no_private_name_of_another_module():
    # The losses go through the public soft_confusion / *_from_counts and the documented shared
    # checks of softops.metrics, never through a private helper of another module.
    import ast
    import inspect

    import softops.losses

    tree = ast.parse(inspect.getsource(softops.losses))
    private = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("softops")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []


# ----------------------------------------------------------- the default (relative) epsilon


@pytest.mark.parametrize("c", [1e-3, 10.0, 1e6])
def test_ranking_losses_default_is_scale_free(c):
    x = torch.randn(4, 30, dtype=F64, generator=seeded(71))
    t = torch.randn(4, 30, dtype=F64, generator=seeded(72))
    y = t.abs()
    torch.testing.assert_close(spearman_loss(c * x, t), spearman_loss(x, t))
    torch.testing.assert_close(ndcg_loss(c * x, y, k=5), ndcg_loss(x, y, k=5))


@pytest.mark.parametrize("n", [10, 100, 1000])
def test_spearman_default_stays_a_rank_loss_at_every_n(n):
    """With epsilon=1.0 on standardised scores the pav ranks are affine from n = 10 on, so the
    loss is exactly 1 - Pearson(x, rank(t)); the default keeps it between that and the hard
    (gradient-free) 1 - Spearman."""
    x = torch.randn(64, n, dtype=F64, generator=seeded(n))
    x = (x - x.mean(-1, keepdim=True)) / x.std(-1, correction=0, keepdim=True)
    t = x + torch.randn(64, n, dtype=F64, generator=seeded(n + 1))
    h = t.argsort(-1).argsort(-1).to(F64)
    hc = h - h.mean(-1, keepdim=True)
    pearson = (x * hc).sum(-1) / (x.norm(dim=-1) * hc.norm(dim=-1))
    fixed = spearman_loss(x, t, epsilon=1.0, reduction="none")
    torch.testing.assert_close(fixed, 1 - pearson)  # the defect of the old default
    default = spearman_loss(x, t, reduction="none")
    hard = spearman_loss(x, t, epsilon=1e-9, reduction="none")
    assert ((default - (1 - pearson)).abs() > 1e-6).all()
    assert ((default - hard).abs() > 1e-9).any()
    # the default c = 3 of the window: most entries receive a gradient, no row is affine
    eps = 3 * x.std(-1, correction=0) / n
    r = soft_rank(x, epsilon=eps)
    hard_ranks = x.argsort(-1).argsort(-1).to(F64) + 1
    assert 0.02 < float(((r - hard_ranks).abs() < 1e-9).to(F64).mean()) < 0.35


def test_ranking_losses_default_gradients():
    x = torch.randn(3, 8, dtype=F64, generator=seeded(75), requires_grad=True)
    t = torch.randn(3, 8, dtype=F64, generator=seeded(76))
    assert gradcheck(lambda x: spearman_loss(x, t, reduction="none"), (x,))
    assert gradcheck(lambda x: ndcg_loss(x, t.abs(), k=3, reduction="none"), (x,))
    # scale-free: the gradient is orthogonal to x (within each row, after centring)
    (g,) = torch.autograd.grad(spearman_loss(x, t, reduction="sum"), x)
    xc = x.detach() - x.detach().mean(-1, keepdim=True)
    torch.testing.assert_close((g * xc).sum(-1), torch.zeros(3, dtype=F64), atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------- topk_cross_entropy
# softops.losses.topk_cross_entropy: the formula written out, cross-entropy at p_k = [1], the
# hard limit, the pre-selection of the m best classes, gradients and errors.


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
