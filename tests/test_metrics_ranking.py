"""The hard ranking metrics: ndcg equals scikit-learn's ndcg_score (ties averaged) and spearman
equals scipy's spearmanr (ties averaged), row by row along any dim; their invariants as
hypothesis properties; errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from softops.metrics import ndcg, spearman
from tests._helpers import seeded

sklearn_metrics = pytest.importorskip("sklearn.metrics")
scipy_stats = pytest.importorskip("scipy.stats")

F64 = torch.float64


def _sk_ndcg(y: np.ndarray, s: np.ndarray, k: int | None) -> float:
    return float(sklearn_metrics.ndcg_score(y[None], s[None], k=k))


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
    batch = sklearn_metrics.ndcg_score(relevance.numpy(), scores.numpy(), k=k)
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
        assert r.item() == pytest.approx(scipy_stats.spearmanr(p, t).statistic, abs=1e-12)


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
def test_errors(call, error, match):
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
    assert rho.item() == pytest.approx(scipy_stats.spearmanr(pred, target).statistic, abs=1e-9)
    torch.testing.assert_close(spearman(t, p), rho)  # symmetric
    increasing = torch.where(p > 0, 8 * p, p / 4)  # exact in floating point: ties kept
    torch.testing.assert_close(spearman(increasing, t), rho)  # the ranks only
    torch.testing.assert_close(spearman(-p, t), -rho)
    torch.testing.assert_close(spearman(p, p), torch.tensor(1.0, dtype=F64))
