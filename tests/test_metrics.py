"""softops.metrics: soft accuracy, precision, recall, F1 and top-k accuracy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from softops.metrics import (
    SoftConfusion,
    check_logits_epsilon,
    check_optional_int,
    check_relevance,
    f1_from_counts,
    gain_of,
    ndcg,
    pearson_terms,
    precision_from_counts,
    recall_from_counts,
    soft_accuracy,
    soft_confusion,
    soft_f1,
    soft_precision,
    soft_recall,
    soft_topk_accuracy,
    spearman,
)
from tests._helpers import seeded

F64 = torch.float64
METRICS = {"precision": soft_precision, "recall": soft_recall, "f1": soft_f1}
FROM_COUNTS = {
    "precision": precision_from_counts,
    "recall": recall_from_counts,
    "f1": f1_from_counts,
}


def _skm():
    return pytest.importorskip("sklearn.metrics")


def _sk_score(kind: str, target, pred, n_classes: int, average: str) -> float:
    skm = _skm()
    fn = {"precision": skm.precision_score, "recall": skm.recall_score, "f1": skm.f1_score}[kind]
    kw = {"pos_label": 1} if average == "binary" else {"labels": list(range(n_classes))}
    return float(fn(target.numpy(), pred.numpy(), average=average, zero_division=0, **kw))


def _labels(g: torch.Generator, n: int, weights: list[float]) -> torch.Tensor:
    """Imbalanced labels: class c drawn with probability proportional to weights[c]."""
    w = torch.tensor(weights, dtype=F64)
    return torch.multinomial(w, n, replacement=True, generator=g)


# The classes present in the target and in the predictions differ: class 4 is never a label,
# class 3 never predicted, class 5 neither (C = 6).
TARGET_WEIGHTS = [0.6, 0.25, 0.1, 0.05, 0.0, 0.0]
PRED_WEIGHTS = [0.3, 0.3, 0.2, 0.0, 0.2, 0.0]


# --------------------------------------------------------------------- exact on one-hot inputs


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("average", ["micro", "macro"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_one_hot_equals_sklearn_multiclass(seed, average, kind):
    g = seeded(seed)
    n, c = 40, len(TARGET_WEIGHTS)
    target = _labels(g, n, TARGET_WEIGHTS)
    pred = _labels(g, n, PRED_WEIGHTS)
    onehot = torch.nn.functional.one_hot(pred, c).to(F64)
    got = METRICS[kind](onehot, target, average=average)
    assert got.dtype == F64 and got.dim() == 0
    expected = _sk_score(kind, target, pred, c, average)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_hot_accuracy_equals_sklearn(seed):
    g = seeded(seed)
    target = _labels(g, 37, TARGET_WEIGHTS)
    pred = _labels(g, 37, PRED_WEIGHTS)
    onehot = torch.nn.functional.one_hot(pred, 6).to(F64)
    expected = _skm().accuracy_score(target.numpy(), pred.numpy())
    assert float(soft_accuracy(onehot, target)) == pytest.approx(expected, rel=1e-15)
    # binary: (N,) probabilities of class 1
    tb, pb = (target > 0).long(), (pred > 1).long()
    expected_b = _skm().accuracy_score(tb.numpy(), pb.numpy())
    assert float(soft_accuracy(pb.to(F64), tb)) == pytest.approx(expected_b, rel=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("average", ["binary", "micro", "macro"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_one_hot_equals_sklearn_binary(seed, average, kind):
    g = seeded(seed)
    target = _labels(g, 30, [0.8, 0.2])
    pred = _labels(g, 30, [0.6, 0.4])
    expected = _sk_score(kind, target, pred, 2, average)
    got_1d = METRICS[kind](pred.to(F64), target, average=average)
    got_2d = METRICS[kind](torch.nn.functional.one_hot(pred, 2).to(F64), target, average=average)
    for got in (got_1d, got_2d):
        torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_zero_division_scores_zero(kind):
    # No positive predicted and no positive true: every binary denominator is 0.
    zeros = torch.zeros(5, dtype=F64, requires_grad=True)
    target = torch.zeros(5, dtype=torch.long)
    assert METRICS[kind](zeros, target).item() == 0.0
    expected = _sk_score(kind, target, target, 2, "binary")
    assert expected == 0.0
    (grad,) = torch.autograd.grad(METRICS[kind](zeros, target), zeros)
    assert bool(torch.isfinite(grad).all())


def test_average_default_is_binary_for_1d_and_macro_otherwise():
    g = seeded(3)
    p = torch.rand(20, generator=g, dtype=F64)
    t = _labels(g, 20, [0.5, 0.5])
    assert torch.equal(soft_f1(p, t), soft_f1(p, t, average="binary"))
    q = torch.softmax(torch.randn(20, 4, generator=g, dtype=F64), -1)
    t4 = _labels(g, 20, [0.4, 0.3, 0.2, 0.1])
    assert torch.equal(soft_f1(q, t4), soft_f1(q, t4, average="macro"))
    q2 = torch.stack([1 - p, p], -1)
    torch.testing.assert_close(soft_f1(q2, t), soft_f1(q2, t, average="macro"))
    torch.testing.assert_close(soft_f1(q2, t, average="binary"), soft_f1(p, t))


# ------------------------------------------------------------------------ plain-formula reference


def _reference(kind: str, p: torch.Tensor, t: torch.Tensor, average: str) -> float:
    """The soft counts written out per class, in Python loops (float64)."""
    n, c = p.shape
    tp = [sum(float(p[i, j]) for i in range(n) if int(t[i]) == j) for j in range(c)]
    pred = [sum(float(p[i, j]) for i in range(n)) for j in range(c)]
    true = [sum(1.0 for i in range(n) if int(t[i]) == j) for j in range(c)]
    if average == "binary":
        tp, pred, true = [tp[1]], [pred[1]], [true[1]]
    if average == "micro":
        tp, pred, true = [sum(tp)], [sum(pred)], [sum(true)]

    def div(a, b):
        return a / b if b != 0 else 0.0

    if kind == "precision":
        scores = [div(a, b) for a, b in zip(tp, pred, strict=True)]
    elif kind == "recall":
        scores = [div(a, b) for a, b in zip(tp, true, strict=True)]
    else:
        scores = [div(2 * a, b + d) for a, b, d in zip(tp, pred, true, strict=True)]
    return sum(scores) / len(scores)


@pytest.mark.parametrize("average", ["binary", "micro", "macro"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_matches_plain_formula(kind, average):
    g = seeded(7)
    c = 2 if average == "binary" else 5
    p = torch.softmax(2 * torch.randn(23, c, generator=g, dtype=F64), -1)
    t = _labels(g, 23, [0.5, 0.3, 0.1, 0.1, 0.0][:c])
    got = METRICS[kind](p, t, average=average)
    assert float(got) == pytest.approx(_reference(kind, p, t, average), rel=1e-13, abs=1e-15)
    if average == "binary":
        got_1d = METRICS[kind](p[:, 1].contiguous(), t)
        assert float(got_1d) == pytest.approx(float(got), rel=1e-13)


def test_accuracy_matches_plain_formula_and_logits():
    g = seeded(8)
    z = torch.randn(17, 4, generator=g, dtype=F64)
    t = _labels(g, 17, [0.1, 0.2, 0.3, 0.4])
    p = torch.softmax(z / 0.7, -1)
    expected = sum(float(p[i, int(t[i])]) for i in range(17)) / 17
    assert float(soft_accuracy(p, t)) == pytest.approx(expected, rel=1e-14)
    got = soft_accuracy(z, t, from_logits=True, epsilon=0.7)
    assert float(got) == pytest.approx(expected, rel=1e-14)
    zb = torch.randn(17, generator=g, dtype=F64)
    tb = (t > 1).long()
    pb = torch.sigmoid(zb / 0.7)
    expected_b = float(torch.where(tb == 1, pb, 1 - pb).mean())
    got_b = soft_accuracy(zb, tb, from_logits=True, epsilon=0.7)
    assert float(got_b) == pytest.approx(expected_b, rel=1e-14)


# ------------------------------------------------------------------------- hard limit from logits


def _separated_logits(g: torch.Generator, n: int, c: int, margin: float) -> torch.Tensor:
    """Logits whose argmax leads the runner-up by at least ``margin``."""
    z = torch.randn(n, c, generator=g, dtype=F64)
    top = z.argmax(-1, keepdim=True)
    return z.scatter_add(1, top, torch.full((n, 1), margin, dtype=F64))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("average", ["micro", "macro"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_from_logits_tends_to_sklearn_on_argmax(seed, average, kind):
    g = seeded(seed)
    z = _separated_logits(g, 50, 5, margin=0.05)
    t = _labels(g, 50, [0.5, 0.2, 0.2, 0.1, 0.0])
    expected = _sk_score(kind, t, z.argmax(-1), 5, average)
    errs = [
        abs(float(METRICS[kind](z, t, average=average, from_logits=True, epsilon=e)) - expected)
        for e in (1.0, 0.1, 1e-2, 1e-4)
    ]
    assert errs[-1] < 1e-12
    assert errs[0] > 1e-3  # the soft value really differs at epsilon = 1


def test_binary_from_logits_tends_to_sklearn():
    g = seeded(4)
    z = torch.randn(40, generator=g, dtype=F64)
    z = z + 0.05 * torch.sign(z)  # away from the 0.5 threshold
    t = _labels(g, 40, [0.7, 0.3])
    pred = (z > 0).long()
    for kind, fn in METRICS.items():
        expected = _sk_score(kind, t, pred, 2, "binary")
        got = fn(z, t, from_logits=True, epsilon=1e-4)
        assert float(got) == pytest.approx(expected, abs=1e-12)
    acc = _skm().accuracy_score(t.numpy(), pred.numpy())
    assert float(soft_accuracy(z, t, from_logits=True, epsilon=1e-4)) == pytest.approx(acc)


# ----------------------------------------------------------------------------- properties


@st.composite
def _prob_batches(draw):
    n = draw(st.integers(1, 12))
    c = draw(st.integers(2, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0, 100.0]))
    g = seeded(seed)
    p = torch.softmax(scale * torch.randn(n, c, generator=g, dtype=F64), -1)
    t = torch.randint(0, c, (n,), generator=g)
    return p, t


@settings(max_examples=40, deadline=None)
@given(_prob_batches())
def test_scores_in_unit_interval_and_micro_is_accuracy(batch):
    p, t = batch
    acc = soft_accuracy(p, t)
    for average in ("micro", "macro"):
        for fn in METRICS.values():
            v = float(fn(p, t, average=average))
            assert -1e-15 <= v <= 1 + 1e-15
    for fn in METRICS.values():
        torch.testing.assert_close(fn(p, t, average="micro"), acc, rtol=1e-12, atol=1e-15)
    # F1 lies between min and max of precision and recall (harmonic mean), for every class
    for c in range(p.shape[1]):
        t_c, p_c = (t == c).long(), p[:, c].contiguous()
        pr, rc, f1 = (float(fn(p_c, t_c)) for fn in METRICS.values())
        assert min(pr, rc) - 1e-12 <= f1 <= max(pr, rc) + 1e-12


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 15), st.integers(0, 2**31 - 1))
def test_binary_1d_equals_two_columns(n, seed):
    g = seeded(seed)
    p = torch.rand(n, generator=g, dtype=F64)
    t = torch.randint(0, 2, (n,), generator=g)
    p2 = torch.stack([1 - p, p], -1)
    for average in ("binary", "micro", "macro"):
        for fn in METRICS.values():
            torch.testing.assert_close(
                fn(p, t, average=average), fn(p2, t, average=average), rtol=1e-12, atol=1e-15
            )
    torch.testing.assert_close(soft_accuracy(p, t), soft_accuracy(p2, t))


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("average", ["binary", "micro", "macro"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_gradcheck_probabilities_and_logits(kind, average):
    g = seeded(11)
    fn = METRICS[kind]
    c = 2 if average == "binary" else 4
    p = torch.softmax(torch.randn(9, c, generator=g, dtype=F64), -1).requires_grad_()
    t = torch.randint(0, c, (9,), generator=g)
    assert gradcheck(lambda p: fn(p, t, average=average), (p,))
    z = torch.randn(9, c, generator=g, dtype=F64, requires_grad=True)
    e = torch.tensor(0.7, dtype=F64, requires_grad=True)
    assert gradcheck(lambda z, e: fn(z, t, average=average, from_logits=True, epsilon=e), (z, e))
    zb = torch.randn(9, generator=g, dtype=F64, requires_grad=True)
    assert gradcheck(
        lambda z, e: fn(z, t % 2, average=average, from_logits=True, epsilon=e), (zb, e)
    )


def test_gradcheck_accuracy():
    g = seeded(12)
    z = torch.randn(7, 3, generator=g, dtype=F64, requires_grad=True)
    zb = torch.randn(7, generator=g, dtype=F64, requires_grad=True)
    e = torch.tensor(0.5, dtype=F64, requires_grad=True)
    t = torch.randint(0, 3, (7,), generator=g)
    assert gradcheck(lambda z, e: soft_accuracy(z, t, from_logits=True, epsilon=e), (z, e))
    assert gradcheck(lambda z, e: soft_accuracy(z, t % 2, from_logits=True, epsilon=e), (zb, e))
    p = torch.rand(7, generator=g, dtype=F64, requires_grad=True)
    assert gradcheck(lambda p: soft_accuracy(p, t % 2), (p,))


def test_gradient_of_accuracy_is_the_true_class_indicator():
    p = torch.full((4, 3), 1 / 3, dtype=F64, requires_grad=True)
    t = torch.tensor([0, 2, 2, 1])
    (grad,) = torch.autograd.grad(soft_accuracy(p, t), p)
    assert torch.equal(grad, torch.nn.functional.one_hot(t, 3).to(F64) / 4)


def _tiny_mass_logits(g: torch.Generator, n: int, c: int, dtype: torch.dtype) -> torch.Tensor:
    """Logits whose columns span ordinary, subnormal (in float32) and underflowing predicted
    masses at epsilon 13.1: each column is pushed down by 0, ~1200 or ~1500 (p ~ 1e-40, 1e-50)."""
    z = 3 * torch.randn(n, c, generator=g, dtype=dtype)
    shift = torch.tensor([0.0, 1200.0, 1500.0], dtype=dtype)
    return z - shift[torch.randint(0, 3, (c,), generator=g)]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("average", ["binary", "micro", "macro"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_gradient_is_finite_wherever_the_value_is(kind, average, dtype):
    """Logits with classes absent from the batch (T = 0: TP is identically 0) and classes of
    subnormal or zero predicted mass P: the gradient of TP / P in the counts, 1 / P, overflowed
    and met 0 (inf * 0 = NaN) or its own negative (inf - inf), and the NaN spread to every logit
    through the softmax (issue 23: an all-NaN gradient)."""
    g = seeded(2300 + len(kind) + 10 * len(average))
    fn = METRICS[kind]
    seen_tiny = 0
    n = 8
    for case in range(12):
        c = 2 if average == "binary" else 5
        z = _tiny_mass_logits(g, n, c, dtype)
        mass = torch.softmax(z / 13.1, -1).sum(0)
        seen_tiny += int(((mass > 0) & (mass < torch.finfo(dtype).tiny)).sum())
        if case % 3 == 2:  # a 1-D (binary) input
            z = z[:, 1] - z[:, 0]
        # labels from the first classes only: the last class is absent from the batch
        t = torch.randint(0, 2 if z.dim() == 1 or average == "binary" else c - 1, (n,), generator=g)
        z.requires_grad_(True)
        e = torch.tensor(13.1, dtype=dtype, requires_grad=True)
        value = fn(z, t, average=average, from_logits=True, epsilon=e)
        assert bool(torch.isfinite(value)), case
        for grad in torch.autograd.grad(value, (z, e)):
            assert bool(torch.isfinite(grad).all()), (case, grad)
    assert dtype == F64 or seen_tiny > 0  # the subnormal masses are in the sweep


@pytest.mark.parametrize("average", ["binary", "macro"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_probabilities_of_a_class_absent_from_the_batch_give_a_finite_gradient(kind, average):
    # The class without a true member has a subnormal predicted mass P: its score is 0 whatever
    # the predictions, its gradient 0 (it was 1 / P = inf times the zero one-hot: NaN).
    for dtype, tiny in ((torch.float32, 1e-40), (F64, 1e-310)):
        p = torch.tensor([[0.7, 0.3 - tiny, tiny], [0.2, 0.8 - tiny, tiny], [0.5, 0.5, 0.0]])
        p = p.to(dtype)
        t = torch.tensor([0, 1, 0])
        if average == "binary":
            p = torch.stack([1 - p[:, 2], p[:, 2]], -1)  # class 1 predicted at a subnormal mass
        p.requires_grad_(True)
        value = METRICS[kind](p, t if average == "macro" else 0 * t, average=average)
        (grad,) = torch.autograd.grad(value, p)
        assert bool(torch.isfinite(grad).all()), (dtype, grad)
        # the reference: the same score over the classes with a true member (or 0 for binary)
        if average == "macro":
            ref = METRICS[kind](p.detach()[:, :2].double(), t, average="macro") * 2 / 3
            torch.testing.assert_close(value.double(), ref, rtol=1e-6, atol=1e-7)
        else:
            assert value.item() == 0.0 and bool((grad == 0).all())


@pytest.mark.parametrize("average", ["binary", "macro"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_float32_gradient_at_subnormal_masses_equals_the_float64_one(kind, average):
    """Where float32 holds a predicted mass only as a subnormal, float64 holds it as a normal
    number: the float32 gradient agrees with the float64 gradient of the plain formula."""
    g = seeded(2310)
    c = 2 if average == "binary" else 5
    z64 = 3 * torch.randn(8, c, generator=g, dtype=F64)
    z64[:, 1] -= 1200.0  # P_1 ~ 1e-40: subnormal in float32
    t = torch.tensor([0, 1, 0, 1, 0, 0, 1, 0]) if c == 2 else torch.tensor([0, 1, 2, 1, 0, 2, 1, 0])
    fn = METRICS[kind]
    grads = {}
    for dtype in (torch.float32, F64):
        z = z64.to(dtype).requires_grad_(True)
        e = torch.tensor(13.1, dtype=dtype, requires_grad=True)
        value = fn(z, t, average=average, from_logits=True, epsilon=e)
        grads[dtype] = (value, *torch.autograd.grad(value, (z, e)))
    mass32 = torch.softmax(z64.float() / 13.1, -1).sum(0)[1]
    assert 0 < mass32 < torch.finfo(torch.float32).tiny
    for got, want in zip(grads[torch.float32], grads[F64], strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["precision", "f1"])
def test_from_counts_class_without_true_member_has_zero_gradient(kind):
    # TP of a class without a true member is identically 0: it scores 0 with no gradient, also
    # where its predicted mass P is subnormal (1 / P overflows: inf * 0 was NaN)
    for dtype in (torch.float32, F64):
        tp = torch.tensor([0.5, 0.0], dtype=dtype, requires_grad=True)
        predicted = torch.tensor([1.0, 1e-320 if dtype == F64 else 1e-42], dtype=dtype)
        predicted.requires_grad_(True)
        true = torch.tensor([1.0, 0.0], dtype=dtype)
        score = FROM_COUNTS[kind](SoftConfusion(tp, predicted, true))
        assert score.item() == pytest.approx(0.25)  # (0.5 / 1 or 2 * 0.5 / 2, and 0) / 2
        g_tp, g_p = torch.autograd.grad(score, (tp, predicted))
        assert g_tp[1] == 0 and g_p[1] == 0 and bool(torch.isfinite(g_tp).all())


@pytest.mark.parametrize("average", ["binary", "macro"])
def test_precision_from_logits_equals_the_counts_ratio_and_gradchecks(average):
    g = seeded(2311)
    c = 2 if average == "binary" else 4
    for dim in (1, 2):
        z = torch.randn(9, c, generator=g, dtype=F64)
        z = (z[:, 1] - z[:, 0] if dim == 1 else z).requires_grad_(True)
        t = torch.randint(0, c if dim == 2 else 2, (9,), generator=g)
        t[0] = 1 if average == "binary" else t[0]
        e = torch.tensor(0.7, dtype=F64, requires_grad=True)
        got = soft_precision(z, t, average=average, from_logits=True, epsilon=e)
        counts = soft_confusion(z, t, average=average, from_logits=True, epsilon=e)
        torch.testing.assert_close(got, precision_from_counts(counts), rtol=1e-14, atol=1e-15)
        (g1,) = torch.autograd.grad(got, z)
        (g2,) = torch.autograd.grad(precision_from_counts(counts), z)
        torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)

        def fn(z, e, t=t):
            return soft_precision(z, t, average=average, from_logits=True, epsilon=e)

        assert torch.autograd.gradgradcheck(fn, (z, e))
    # a column with no mass at all (-inf logits) scores 0, as the counts' zero denominator
    z = torch.zeros(4, 3, dtype=F64)
    z[:, 2] = -math.inf
    z.requires_grad_(True)
    t = torch.tensor([0, 1, 2, 0])
    got = soft_precision(z, t, from_logits=True)
    torch.testing.assert_close(got, precision_from_counts(soft_confusion(z, t, from_logits=True)))
    (grad,) = torch.autograd.grad(got, z)
    assert bool(torch.isfinite(grad).all())


# ------------------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_is_computed_in_float32(dtype):
    g = seeded(5)
    p = torch.softmax(torch.randn(64, 5, generator=g), -1)
    t = torch.randint(0, 5, (64,), generator=g)
    for fn in (soft_accuracy, soft_precision, soft_recall, soft_f1):
        out = fn(p.to(dtype), t)
        assert out.dtype == dtype and out.dim() == 0
        ref = fn(p.to(dtype).float(), t)
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=0)
    out = soft_topk_accuracy(p.to(dtype), t, 2)
    assert out.dtype == dtype


def test_any_integer_target_dtype():
    p = torch.tensor([[0.2, 0.8], [0.6, 0.4]])
    for dt in (torch.int64, torch.int32, torch.int16, torch.uint8):
        t = torch.tensor([1, 0], dtype=dt)
        assert soft_f1(p, t).item() == pytest.approx(soft_f1(p, t.long()).item())
        assert soft_topk_accuracy(p, t, 1, hard=True).item() == 1.0


# -------------------------------------------------------------------------- top-k accuracy


def _distinct_scores(g: torch.Generator, n: int, c: int) -> torch.Tensor:
    """Rows with entries at least 4/c apart (no ties)."""
    return torch.stack([torch.randperm(c, generator=g).to(F64) * 4 / c for _ in range(n)])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.filterwarnings("ignore:.*will result in a perfect score")
def test_topk_accuracy_hard_equals_sklearn(seed, k):
    g = seeded(seed)
    s = _distinct_scores(g, 30, 7) + 0.01 * torch.randn(30, 7, generator=g, dtype=F64)
    t = _labels(g, 30, [0.4, 0.3, 0.1, 0.1, 0.1, 0.0, 0.0])
    expected = _skm().top_k_accuracy_score(t.numpy(), s.numpy(), k=k, labels=list(range(7)))
    got = soft_topk_accuracy(s, t, k, hard=True)
    assert float(got) == pytest.approx(expected, rel=1e-15)
    errs = [abs(float(soft_topk_accuracy(s, t, k, epsilon=e)) - expected) for e in (1, 0.1, 1e-3)]
    assert errs[-1] < 1e-10
    if k < 7:
        assert errs[0] > 1e-3


def test_topk_accuracy_k1_is_soft_argmax_accuracy_limit_and_bounds():
    g = seeded(9)
    s = torch.randn(25, 6, generator=g, dtype=F64)
    t = torch.randint(0, 6, (25,), generator=g)
    for k in range(1, 7):
        v = float(soft_topk_accuracy(s, t, k, epsilon=0.3))
        assert 0 <= v <= 1
    assert soft_topk_accuracy(s, t, 6).item() == 1.0
    # a larger k never lowers the soft accuracy (the mask is monotone in k)
    vals = [float(soft_topk_accuracy(s, t, k, epsilon=0.3)) for k in range(1, 7)]
    assert vals == sorted(vals)
    # the plain formula: sigmoid((s - tau)/eps) read at the target
    from softops import soft_topk_mask

    mask = soft_topk_mask(s, 3, epsilon=0.3)
    expected = sum(float(mask[i, int(t[i])]) for i in range(25)) / 25
    assert float(soft_topk_accuracy(s, t, 3, epsilon=0.3)) == pytest.approx(expected, rel=1e-14)


def test_topk_accuracy_gradcheck_and_straight_through():
    g = seeded(10)
    s = torch.randn(5, 6, generator=g, dtype=F64, requires_grad=True)
    t = torch.randint(0, 6, (5,), generator=g)
    e = torch.tensor(0.4, dtype=F64, requires_grad=True)
    assert gradcheck(lambda s, e: soft_topk_accuracy(s, t, 2, epsilon=e), (s, e))
    (gs,) = torch.autograd.grad(soft_topk_accuracy(s, t, 2, epsilon=0.4), s)
    (gh,) = torch.autograd.grad(soft_topk_accuracy(s, t, 2, epsilon=0.4, hard=True), s)
    torch.testing.assert_close(gh, gs)


@pytest.mark.parametrize("method", ["sinkhorn", "perturbed"])
def test_topk_accuracy_other_methods(method):
    g = seeded(13)
    s = _distinct_scores(g, 8, 5)
    t = torch.randint(0, 5, (8,), generator=g)
    hard = float(soft_topk_accuracy(s, t, 2, hard=True))
    assert float(soft_topk_accuracy(s, t, 2, epsilon=0.01, method=method)) == pytest.approx(
        hard, abs=1e-6
    )


# ------------------------------------------------------------------------------ errors


def test_errors():
    p = torch.softmax(torch.randn(4, 3), -1)
    t = torch.tensor([0, 1, 2, 1])
    with pytest.raises(
        ValueError,
        match=r"soft_f1: expected `average` to be one of .*"
        r"got average='weighted'",
    ):
        soft_f1(p, t, average="weighted")
    with pytest.raises(ValueError, match=r"average='binary'.*got shape \(4, 3\)"):
        soft_precision(p, t, average="binary")
    with pytest.raises(ValueError, match=r"expected `target` of shape \(4,\).*got shape \(3,\)"):
        soft_recall(p, t[:3])
    with pytest.raises(ValueError, match=r"expected `target` values in \[0, C\) = \[0, 3\); got 3"):
        soft_f1(p, torch.tensor([0, 1, 3, 1]))
    with pytest.raises(ValueError, match=r"got -1"):
        soft_accuracy(p, torch.tensor([0, -1, 2, 1]))
    with pytest.raises(ValueError, match=r"expected `target` values in \{0, 1\}; got 2"):
        soft_f1(torch.rand(3), torch.tensor([0, 2, 1]))
    with pytest.raises(TypeError, match=r"expected `target` to have an integer dtype.*float32"):
        soft_f1(p, t.float())
    with pytest.raises(TypeError, match=r"integer dtype.*torch.bool"):
        soft_f1(torch.rand(4), t > 0)
    with pytest.raises(TypeError, match=r"soft_accuracy: expected `input` to have a real floating"):
        soft_accuracy(t, t)
    with pytest.raises(TypeError, match=r"expected `target` to be a torch.Tensor; got list"):
        soft_f1(p, [0, 1, 2, 1])
    with pytest.raises(
        ValueError, match=r"expected `input` of shape \(N,\) .*got shape \(2, 2, 3\)"
    ):
        soft_f1(torch.rand(2, 2, 3), t[:2])
    with pytest.raises(
        ValueError, match=r"expected a non-empty batch; got `input` of shape \(0, 3\)"
    ):
        soft_f1(torch.rand(0, 3), t[:0])
    with pytest.raises(ValueError, match=r"expected a non-empty batch"):
        soft_accuracy(torch.rand(0), t[:0])
    with pytest.raises(ValueError, match=r"expected `epsilon` > 0 and finite; got epsilon=0.0"):
        soft_f1(p, t, from_logits=True, epsilon=0.0)
    with pytest.raises(ValueError, match=r"got epsilon=-1"):
        soft_accuracy(p, t, from_logits=True, epsilon=torch.tensor(-1.0))
    with pytest.raises(ValueError, match=r"used only with from_logits=True\); got epsilon=0.5"):
        soft_f1(p, t, epsilon=0.5)
    with pytest.raises(ValueError, match=r"0-dim tensor; got a tensor of shape \(4,\)"):
        soft_f1(p, t, from_logits=True, epsilon=torch.ones(4))
    with pytest.raises(
        TypeError, match=r"expected `from_logits` to be a bool; got from_logits=1\."
    ):
        soft_f1(p, t, from_logits=1)


def test_topk_errors():
    s = torch.randn(4, 5)
    t = torch.tensor([0, 1, 4, 2])
    op = "soft_topk_accuracy"
    with pytest.raises(ValueError, match=rf"{op}: expected 1 <= `k` <= C \(= 5\).*got k=6"):
        soft_topk_accuracy(s, t, 6)
    with pytest.raises(ValueError, match=r"got k=0"):
        soft_topk_accuracy(s, t, 0)
    with pytest.raises(TypeError, match=r"expected `k` to be an int; got k=2.0"):
        soft_topk_accuracy(s, t, 2.0)
    with pytest.raises(ValueError, match=r"expected `scores` of shape \(N, C\); got shape \(4,\)"):
        soft_topk_accuracy(s[:, 0], t, 1)
    with pytest.raises(ValueError, match=r"got 5"):
        soft_topk_accuracy(s, torch.tensor([0, 1, 5, 2]), 2)
    with pytest.raises(ValueError, match=r"expected `epsilon` > 0 and finite; got epsilon=0"):
        soft_topk_accuracy(s, t, 2, epsilon=0)
    with pytest.raises(ValueError, match=r"expected `method` to be one of .*got method='pav'"):
        soft_topk_accuracy(s, t, 2, method="pav")
    with pytest.raises(TypeError, match=r"expected `hard` to be a bool"):
        soft_topk_accuracy(s, t, 2, hard=None)
    with pytest.raises(TypeError, match=r"expected `scores` to have a real floating"):
        soft_topk_accuracy(s.long(), t, 2)
    with pytest.raises(ValueError, match=r"non-empty batch"):
        soft_topk_accuracy(s[:0], t[:0], 2)


def test_topk_accuracy_rejects_the_unclipped_softkmax_and_untracked_epsilon_grads() -> None:
    # softkmax masks can exceed 1 (k = C here gives a "hit probability" of 1.33).
    scores = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    target = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"soft_topk_accuracy: expected `method` to be one of"):
        soft_topk_accuracy(scores, target, 3, method="softkmax")
    eps = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(
        ValueError,
        match=r"soft_topk_accuracy: expected an `epsilon` that does not require grad with "
        r"method='perturbed'",
    ):
        soft_topk_accuracy(scores, target, 2, epsilon=eps, method="perturbed")


# ------------------------------------------------------------- soft_confusion: update/compute


def _batches(n: int, sizes: list[int]) -> list[slice]:
    edges = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    assert edges[-1] == n
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize(
    ("c", "average"), [(1, "binary"), (2, "binary"), (5, "micro"), (5, "macro")]
)
def test_counts_summed_over_batches_equal_counts_of_the_concatenation(c, average, from_logits):
    g = seeded(20)
    n = 41
    z = torch.randn(n, c, generator=g, dtype=F64).squeeze(-1)
    x = z if from_logits else (torch.sigmoid(z) if c == 1 else torch.softmax(z, -1))
    t = _labels(g, n, [0.5, 0.3, 0.1, 0.1, 0.0][: max(c, 2)])
    kw = {"average": average, "from_logits": from_logits}
    if from_logits:
        kw["epsilon"] = 0.7
    whole = soft_confusion(x, t, **kw)
    parts = [soft_confusion(x[b], t[b], **kw) for b in _batches(n, [1, 13, 20, 7])]
    total = sum(parts)
    assert isinstance(total, SoftConfusion)
    for got, want in zip(total, whole, strict=True):
        assert got.shape == want.shape == ((5,) if average == "macro" else ())
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    # a + b adds field by field (a plain tuple would concatenate)
    pairwise = parts[0] + parts[1] + parts[2] + parts[3]
    assert isinstance(pairwise, SoftConfusion) and len(pairwise) == 3
    for kind, fn in FROM_COUNTS.items():
        torch.testing.assert_close(fn(total), METRICS[kind](x, t, **kw), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("average", ["binary", "micro", "macro"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_scores_of_accumulated_one_hot_counts_equal_sklearn(seed, average, kind):
    g = seeded(seed)
    c = 2 if average == "binary" else len(TARGET_WEIGHTS)
    n = 97
    target = _labels(g, n, TARGET_WEIGHTS[:c] if c > 2 else [0.8, 0.2])
    pred = _labels(g, n, PRED_WEIGHTS[:c] if c > 2 else [0.6, 0.4])
    onehot = torch.nn.functional.one_hot(pred, c).to(F64)
    counts = sum(
        soft_confusion(onehot[b], target[b], average=average) for b in _batches(n, [10, 30, 25, 32])
    )
    expected = _sk_score(kind, target, pred, c, average)
    got = FROM_COUNTS[kind](counts)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-15, atol=1e-15)
    # the mean of the per-batch scores is the biased estimate the counts avoid
    if kind == "f1" and average == "macro":
        per_batch = [float(soft_f1(onehot[b], target[b])) for b in _batches(n, [10, 30, 25, 32])]
        assert abs(sum(per_batch) / len(per_batch) - expected) > 1e-3


def test_metrics_are_compute_of_update_exactly():
    g = seeded(21)
    p = torch.softmax(torch.randn(30, 4, generator=g), -1)
    t = torch.randint(0, 4, (30,), generator=g)
    for average in ("micro", "macro"):
        counts = soft_confusion(p, t, average=average)
        for kind, fn in FROM_COUNTS.items():
            assert torch.equal(METRICS[kind](p, t, average=average), fn(counts))
    pb = p[:, 0].contiguous()
    tb = (t == 0).long()
    assert torch.equal(soft_f1(pb, tb), f1_from_counts(soft_confusion(pb, tb)))


def test_counts_plain_values_dtype_and_gradient():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]], dtype=F64)
    t = torch.tensor([0, 1, 0])
    tp, predicted, true = soft_confusion(p, t)
    torch.testing.assert_close(tp, torch.tensor([1.0, 0.8, 0.0], dtype=F64))
    torch.testing.assert_close(predicted, torch.tensor([1.1, 1.3, 0.6], dtype=F64))
    assert torch.equal(true, torch.tensor([2.0, 1.0, 0.0], dtype=F64))
    micro = soft_confusion(p, t, average="micro")
    torch.testing.assert_close(micro.tp, tp.sum())
    torch.testing.assert_close(micro.tp / micro.true, soft_accuracy(p, t))
    binary = soft_confusion(torch.tensor([0.9, 0.2, 0.6]), torch.tensor([1, 0, 1]))
    torch.testing.assert_close(binary.tp, torch.tensor(1.5))
    torch.testing.assert_close(binary.predicted, torch.tensor(1.7))
    assert binary.true.item() == 2.0
    # low precision is counted in float32, so that sums over a dataset keep their precision
    for dtype in (torch.float16, torch.bfloat16):
        counts = soft_confusion(p.to(dtype), t)
        assert all(c.dtype == torch.float32 for c in counts)
        assert soft_f1(p.to(dtype), t).dtype == dtype
    # differentiable in the input
    z = torch.randn(6, 3, dtype=F64, requires_grad=True)
    t6 = torch.tensor([0, 1, 2, 2, 1, 0])
    assert gradcheck(
        lambda z: f1_from_counts(soft_confusion(z, t6, from_logits=True, epsilon=0.5)), (z,)
    )


def test_soft_confusion_and_from_counts_errors():
    p = torch.softmax(torch.randn(4, 3), -1)
    t = torch.tensor([0, 1, 2, 1])
    with pytest.raises(ValueError, match=r"^soft_confusion: expected `average` to be one of"):
        soft_confusion(p, t, average="weighted")
    with pytest.raises(ValueError, match=r"^soft_confusion: .*average='binary'.*\(4, 3\)"):
        soft_confusion(p, t, average="binary")
    with pytest.raises(ValueError, match=r"^soft_confusion: expected `target` values .*got 3"):
        soft_confusion(p, torch.tensor([0, 1, 3, 1]))
    with pytest.raises(TypeError, match=r"^soft_confusion: expected `input` to have a real"):
        soft_confusion(t, t)
    with pytest.raises(ValueError, match=r"^soft_confusion: .*got epsilon=0\.5"):
        soft_confusion(p, t, epsilon=0.5)
    with pytest.raises(TypeError, match=r"^soft_confusion: expected `from_logits` .*got"):
        soft_confusion(p, t, from_logits="yes")
    with pytest.raises(TypeError, match=r"^f1_from_counts: expected `counts` to be a "):
        f1_from_counts(p)
    with pytest.raises(TypeError, match=r"^precision_from_counts: .*got tuple"):
        precision_from_counts((1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match=r"^recall_from_counts: .*got shapes \[\(3,\), \(\)"):
        recall_from_counts((torch.ones(3), torch.tensor(1.0), torch.ones(3)))
    with pytest.raises(ValueError, match=r"^f1_from_counts: .*got shapes \[\(2, 2\)"):
        f1_from_counts(SoftConfusion(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2)))
    macro = soft_confusion(p, t)
    micro = soft_confusion(p, t, average="micro")
    with pytest.raises(ValueError, match=r"^SoftConfusion: .*got shapes \(3,\) and \(\)\."):
        macro + micro
    with pytest.raises(TypeError):
        1 + macro
    # a plain tuple of tensors is accepted by the compute functions
    assert torch.equal(f1_from_counts(tuple(macro)), f1_from_counts(macro))


# ------------------------------------------------------- the checks and hits shared with losses


def test_shared_checks_and_hits_named_after_the_caller():
    from softops import metrics

    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    t = torch.tensor([0, 1, 0])
    assert metrics.check_classification(p, t, False, 1.0, "my_loss") == 1.0
    with pytest.raises(ValueError, match=r"^my_loss: expected `target` .*got"):
        metrics.check_classification(p, torch.tensor([0, 3, 0]), False, 1.0, "my_loss")
    assert metrics.check_average(None, p, "op") == "macro"
    assert metrics.check_average(None, p[:, 0], "op") == "binary"
    with pytest.raises(ValueError, match=r"^op: expected `average` to be one of"):
        metrics.check_average("weighted", p, "op")
    torch.testing.assert_close(
        metrics.true_class_probability(p, t, False, 1.0), torch.tensor([0.7, 0.8, 0.3])
    )
    logits = p.log()
    torch.testing.assert_close(
        metrics.true_class_probability(logits, t, True, 1.0), torch.tensor([0.7, 0.8, 0.3])
    )
    binary = torch.tensor([0.9, 0.2])
    torch.testing.assert_close(
        metrics.true_class_probability(binary, torch.tensor([1, 0]), False, 1.0),
        torch.tensor([0.9, 0.8]),
    )
    assert metrics.check_topk_classification(p, t, 2, 0.1, "ot", "op") == (2, 0.1)
    with pytest.raises(ValueError, match=r"^op: expected .*`k`.*got k=4"):
        metrics.check_topk_classification(p, t, 4, 0.1, "ot", "op")
    hit = metrics.true_class_topk_membership(p, t, 2, 1e-3, "ot", False)
    torch.testing.assert_close(hit, torch.tensor([1.0, 1.0, 0.5]), atol=1e-4, rtol=0)
    hard = metrics.true_class_topk_membership(p, t, 1, 0.1, "ot", True)
    assert hard.tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("average", ["macro", "micro", "binary"])
@pytest.mark.parametrize("kind", ["precision", "recall", "f1"])
def test_probability_inputs_with_a_tiny_predicted_mass_have_the_exact_gradient(
    kind, average, dtype
):
    """(issue 23) Probability inputs where a class with a true member is predicted with a mass P
    whose square underflows (P below sqrt(finfo.tiny), down to the smallest normal number): the
    backward of TP / P formed TP / P**2 = inf and the gradient was NaN, where the derivative
    (TP / P) / P is finite. The ratio is now formed on both terms scaled by a power of two: the
    gradient is finite, and in float32 equals the float64 one of the same probabilities."""
    tiny = torch.finfo(dtype).tiny
    masses = [1e-20, 1e-30, tiny] if dtype == torch.float32 else [1e-160, 1e-300, tiny]
    fn = METRICS[kind]
    for s in masses:
        p = torch.tensor([[1 - 2 * s, s, s], [0.5, 0.5 - s, s], [0.25, 0.75, 0.0]], dtype=F64)
        t = torch.tensor([0, 2, 1])
        if average == "binary":
            p, t = torch.stack([1 - p[:, 2], p[:, 2]], -1)[:, 1], torch.tensor([0, 1, 0])
        got_p = p.to(dtype).requires_grad_(True)
        value = fn(got_p, t, average=average)
        (grad,) = torch.autograd.grad(value, got_p)
        assert bool(torch.isfinite(grad).all()), (s, grad)
        if dtype == torch.float32:  # float64 holds the same probabilities' squares
            want_p = got_p.detach().double().requires_grad_(True)
            (want,) = torch.autograd.grad(fn(want_p, t, average=average), want_p)
            torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=0)


# ------------------------------------------------------- the hard ranking metrics: ndcg, spearman
# The hard ranking metrics: ndcg equals scikit-learn's ndcg_score (ties averaged) and spearman
# equals scipy's spearmanr (ties averaged), row by row along any dim; their invariants as
# hypothesis properties; errors.


def _scipy_stats():
    return pytest.importorskip("scipy.stats")


def _sk_ndcg(y: np.ndarray, s: np.ndarray, k: int | None) -> float:
    return float(_skm().ndcg_score(y[None], s[None], k=k))


def _tied_rows(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = seeded(seed)
    scores = torch.randint(0, 4, (rows, n), generator=g).to(F64)  # many ties
    scores[::2] += torch.rand(rows // 2 + rows % 2, n, generator=g, dtype=F64)  # some without
    relevance = torch.randint(0, 4, (rows, n), generator=g).to(F64)
    return scores, relevance


@pytest.mark.parametrize("k", [None, 1, 3, 7, 50])
@pytest.mark.parametrize("n", [2, 7, 12])
def test_ndcg_equals_sklearn_row_by_row_and_on_average(n, k):
    scores, relevance = _tied_rows(30, n, seed=n)
    got = ndcg(scores, relevance, k=k)
    assert got.shape == (30,) and got.dtype == F64
    want = [_sk_ndcg(y.numpy(), s.numpy(), k) for s, y in zip(scores, relevance, strict=True)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)
    batch = _skm().ndcg_score(relevance.numpy(), scores.numpy(), k=k)
    assert got.mean().item() == pytest.approx(batch, rel=1e-12)


def test_ndcg_ties_average_the_gains_not_the_order():
    # all tied: every place gets the mean gain, whatever the order of the entries
    relevance = torch.tensor([3.0, 0.0, 1.0, 2.0])
    tied = ndcg(torch.zeros(4), relevance)
    d = 1 / torch.log2(torch.arange(2.0, 6.0))
    want = relevance.mean() * d.sum() / (relevance.sort(descending=True).values * d).sum()
    torch.testing.assert_close(tied, want)
    torch.testing.assert_close(ndcg(torch.zeros(4), relevance.flip(0)), tied)


def test_ndcg_float32_integer_inputs_and_the_exp_gain():
    scores, relevance = _tied_rows(8, 6, seed=3)
    want = ndcg(scores, relevance)
    torch.testing.assert_close(ndcg(scores.float(), relevance.float()), want.float())
    as_int = ndcg(scores.floor().long(), relevance.long())
    assert as_int.dtype == torch.get_default_dtype()
    torch.testing.assert_close(as_int, ndcg(scores.floor(), relevance).float())
    exp = ndcg(scores, relevance, gain="exp")
    torch.testing.assert_close(exp, ndcg(scores, 2**relevance - 1))


def test_ndcg_along_any_dim_equals_the_loop_over_rows():
    g = seeded(4)
    scores = torch.randint(0, 3, (3, 5, 4), generator=g).to(F64)
    relevance = torch.randint(0, 3, (3, 5, 4), generator=g).to(F64)
    for dim in (0, 1, -1):
        got = ndcg(scores, relevance, k=2, dim=dim)
        s, y = scores.movedim(dim, -1), relevance.movedim(dim, -1)
        want = torch.stack(
            [
                ndcg(a, b, k=2)
                for a, b in zip(s.reshape(-1, s.shape[-1]), y.reshape(-1, s.shape[-1]), strict=True)
            ]
        )
        torch.testing.assert_close(got, want.reshape(got.shape))


def test_ndcg_irrelevant_and_nan_rows():
    scores = torch.tensor([[0.3, 0.1, 0.2], [0.3, math.nan, 0.2], [0.1, 0.2, 0.3]])
    relevance = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 2.0], [1.0, 0.0, 2.0]])
    got = ndcg(scores, relevance)
    assert got[0] == 0  # no relevant entry: 0, as scikit-learn
    assert math.isnan(got[1]) and not math.isnan(got[2])  # a NaN stays in its row
    assert _sk_ndcg(relevance[0].numpy(), scores[0].numpy(), None) == 0
    assert ndcg(torch.tensor([0.5]), torch.tensor([2.0])) == 1  # one entry: ideal


@pytest.mark.parametrize("n", [2, 5, 11])
def test_spearman_equals_scipy_with_ties(n):
    g = seeded(n)
    pred = torch.randint(0, 4, (25, n), generator=g).to(F64)
    target = torch.randint(0, 5, (25, n), generator=g).to(F64)
    pred[::3] = torch.randn(9, n, generator=g, dtype=F64)
    got = spearman(pred, target)
    for p, t, r in zip(pred.numpy(), target.numpy(), got, strict=True):
        if np.ptp(p) == 0 or np.ptp(t) == 0:  # scipy: NaN (and a warning)
            assert math.isnan(r)
            continue
        assert r.item() == pytest.approx(_scipy_stats().spearmanr(p, t).statistic, abs=1e-12)


def test_spearman_dims_dtypes_and_nan_rows():
    g = seeded(8)
    pred = torch.randn(4, 6, 3, generator=g, dtype=F64)
    target = torch.randn(4, 6, 3, generator=g, dtype=F64)
    got = spearman(pred, target, dim=1)
    assert got.shape == (4, 3)
    want = torch.stack(
        [spearman(pred[i, :, j], target[i, :, j]) for i in range(4) for j in range(3)]
    )
    torch.testing.assert_close(got, want.reshape(4, 3))
    torch.testing.assert_close(spearman(pred.float(), target.float(), dim=1), got.float())
    ints = spearman(torch.tensor([3, 1, 2]), torch.tensor([30, 10, 20]))
    assert ints.dtype == torch.get_default_dtype() and ints == 1
    pred[0, 2, 0] = math.nan
    nan = spearman(pred, target, dim=1)
    assert math.isnan(nan[0, 0]) and not torch.isnan(nan.flatten()[1:]).any()
    assert math.isnan(spearman(torch.ones(4), torch.arange(4.0)))  # constant: undefined


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: ndcg(torch.ones(3), torch.tensor([1.0, -2.0, 0.0])),
            ValueError,
            r"ndcg: expected non-negative `relevance`; got -2\.0",
        ),
        (
            lambda: ndcg(torch.ones(3), torch.ones(4)),
            ValueError,
            r"ndcg: expected `relevance` of the shape of scores \(3,\); got shape \(4,\)",
        ),
        (
            lambda: ndcg(torch.ones(3), torch.ones(3), k=0),
            ValueError,
            r"ndcg: expected `k` >= 1 or None; got k=0\.",
        ),
        (lambda: ndcg(torch.ones(3), torch.ones(3), k=1.5), TypeError, r"got k=1\.5"),
        (
            lambda: ndcg(torch.ones(3), torch.ones(3), gain="log"),
            ValueError,
            r"ndcg: expected `gain`",
        ),
        (
            lambda: ndcg(torch.ones(3, 0), torch.ones(3, 0)),
            ValueError,
            r"ndcg: expected a non-empty `dim`",
        ),
        (lambda: ndcg(torch.ones(3), torch.ones(3), dim=1), ValueError, r"ndcg: expected `dim`"),
        (
            lambda: spearman(torch.ones(3, dtype=torch.bool), torch.ones(3)),
            TypeError,
            r"spearman: expected `pred` to have a real floating or integer dtype; got "
            r"dtype=torch\.bool",
        ),
        (
            lambda: spearman(torch.ones(3), [1, 2, 3]),
            TypeError,
            r"spearman: expected `target` to be a torch.Tensor; got list",
        ),
    ],
)
def test_ranking_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -------------------------------------------------------------------------------- properties

_values = st.lists(st.integers(0, 4), min_size=2, max_size=9)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_ndcg_is_sklearns_and_ideal_on_the_relevance(data):
    scores = data.draw(_values)
    relevance = data.draw(st.lists(st.integers(0, 3), min_size=len(scores), max_size=len(scores)))
    k = data.draw(st.none() | st.integers(1, len(scores) + 1))
    s, y = torch.tensor(scores, dtype=F64), torch.tensor(relevance, dtype=F64)
    got = ndcg(s, y, k=k).item()
    assert 0 <= got <= 1 + 1e-12
    assert got == pytest.approx(_sk_ndcg(y.numpy(), s.numpy(), k), abs=1e-12)
    ideal = ndcg(y + torch.arange(len(scores), 0, -1, dtype=F64) * 1e-3, y, k=k).item()
    assert ideal == pytest.approx(1.0 if y.any() else 0.0, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_spearman_invariants(data):
    pred = data.draw(st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=12))
    n = len(pred)
    target = data.draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))
    p, t = torch.tensor(pred, dtype=F64), torch.tensor(target, dtype=F64)
    rho = spearman(p, t)
    if len(set(pred)) == 1 or len(set(target)) == 1:
        assert math.isnan(rho)
        return
    assert -1 <= rho <= 1
    assert rho.item() == pytest.approx(_scipy_stats().spearmanr(pred, target).statistic, abs=1e-9)
    torch.testing.assert_close(spearman(t, p), rho)  # symmetric
    increasing = torch.where(p > 0, 8 * p, p / 4)  # exact in floating point: ties kept
    torch.testing.assert_close(spearman(increasing, t), rho)  # the ranks only
    torch.testing.assert_close(spearman(-p, t), -rho)
    torch.testing.assert_close(spearman(p, p), torch.tensor(1.0, dtype=F64))


# ------------------------------------------------------------ the checks shared with losses and nn


def test_check_logits_epsilon():
    assert check_logits_epsilon(False, 1.0, "op") == 1.0
    assert check_logits_epsilon(True, 0.25, "op") == 0.25
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` to be left at its default 1\.0"):
        check_logits_epsilon(False, 0.5, "op")
    with pytest.raises(ValueError, match=r"^op: "):
        check_logits_epsilon(False, torch.tensor(1.0), "op")  # a tensor is never the default
    with pytest.raises(TypeError, match=r"^op: expected `from_logits`"):
        check_logits_epsilon(1, 1.0, "op")
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` > 0"):
        check_logits_epsilon(True, -1.0, "op")


def test_check_optional_int():
    check_optional_int(None, "op", "k")
    check_optional_int(3, "op", "k", low=3)
    with pytest.raises(TypeError, match=r"^op: expected `k` to be an int or None; got k=True\.$"):
        check_optional_int(True, "op", "k")
    with pytest.raises(TypeError, match=r"got k=2\.0\.$"):
        check_optional_int(2.0, "op", "k")
    with pytest.raises(ValueError, match=r"^op: expected `k` >= 1 or None; got k=0\.$"):
        check_optional_int(0, "op", "k", low=1)


def test_gain_of_and_check_relevance():
    y = torch.tensor([0.0, 1.0, 3.0], dtype=F64)
    assert gain_of(y, "linear") is y
    want = torch.tensor([0.0, 1.0, 7.0], dtype=F64)  # 2**y - 1
    torch.testing.assert_close(gain_of(y, "exp"), want, rtol=4 * torch.finfo(F64).eps, atol=0)
    check_relevance(y, "op", "relevance")
    with pytest.raises(ValueError, match=r"^op: expected non-negative relevance; got -2\.0\.$"):
        check_relevance(torch.tensor([1.0, -2.0, -3.0]), "op", "relevance")


def test_pearson_terms_give_numpy_corrcoef():
    g = seeded(11)
    a, b = torch.randn(4, 9, generator=g, dtype=F64), torch.randn(4, 9, generator=g, dtype=F64)
    cov, var = pearson_terms(a, b)
    want = [np.corrcoef(a[i].numpy(), b[i].numpy())[0, 1] for i in range(4)]
    torch.testing.assert_close(cov / var.sqrt(), torch.tensor(want, dtype=F64))


def test_checked_confusion_is_the_checked_update_step_named_after_its_caller():
    from softops.metrics import checked_confusion

    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]])
    t = torch.tensor([0, 2, 2, 1])
    for average in ("macro", "micro", None):
        got = checked_confusion(p, t, average, False, 1.0, "f1_loss")
        want = soft_confusion(p, t, average=average)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # the caller's name in every error, with the checks of soft_confusion
    with pytest.raises(ValueError, match=r"^f1_loss: .*`target`"):
        checked_confusion(p, torch.tensor([0, 3, 1, 1]), "macro", False, 1.0, "f1_loss")
    with pytest.raises(ValueError, match=r"^f1_loss: .*`average`"):
        checked_confusion(p, t, "weighted-ish", False, 1.0, "f1_loss")
