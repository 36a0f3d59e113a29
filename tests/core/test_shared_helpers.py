"""The small shared helpers that several families call: each against its stated contract."""

from __future__ import annotations

import math

import pytest
import torch

from softops._core import isotonic
from softops._core.validation import check_real
from softops._kernels import backend, plain_eager
from softops.losses import check_p_k
from softops.metrics import average_ranks
from tests._helpers import built_ops

scipy_stats = pytest.importorskip("scipy.stats")


def test_check_real_accepts_real_tensors_and_names_what_it_refuses() -> None:
    for t in (torch.tensor([1, 2]), torch.tensor([0.5]), torch.tensor([1.0], dtype=torch.float16)):
        assert check_real(t, "op", "target") is t
    with pytest.raises(
        TypeError, match=r"^op: expected `target` to be a torch.Tensor; got list\.$"
    ):
        check_real([1.0], "op", "target")
    with pytest.raises(TypeError, match=r"`relevance` .* got dtype=torch.bool\.$"):
        check_real(torch.tensor([True]), "op", "relevance")
    with pytest.raises(TypeError, match=r"got dtype=torch.complex64\.$"):
        check_real(torch.tensor([1j]), "op", "target")


def test_average_ranks_is_scipys_rankdata_with_ties() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 4, (6, 9), generator=g).to(torch.float64)  # many ties
    want = torch.tensor(scipy_stats.rankdata(t.numpy(), axis=-1))
    torch.testing.assert_close(average_ranks(t), want)
    ints = average_ranks(t.long())
    assert ints.dtype == torch.get_default_dtype()
    torch.testing.assert_close(ints, want.to(ints.dtype))
    t[2, 4] = float("nan")  # a NaN poisons its row only
    r = average_ranks(t)
    assert r[2].isnan().all() and not r[[0, 1, 3, 4, 5]].isnan().any()


def test_check_p_k_returns_the_weights_or_names_the_fault() -> None:
    assert check_p_k([0.25, 0.75], "op") == [0.25, 0.75]
    assert check_p_k(torch.tensor([1.0]), "op") == [1.0]
    with pytest.raises(TypeError, match=r"^op: expected `p_k` to be a non-empty sequence"):
        check_p_k([], "op")
    with pytest.raises(TypeError, match=r"sequence of floats; got \['a'\]"):
        check_p_k(["a"], "op")
    with pytest.raises(ValueError, match=r"summing to 1; got p_k=\[0.5, 0.6\]"):
        check_p_k([0.5, 0.6], "op")
    with pytest.raises(ValueError, match=r"got p_k=\[1.5, -0.5\]"):
        check_p_k([1.5, -0.5], "op")


def test_scale_factor_is_the_inverse_or_signed_epsilon() -> None:
    # the sort's z = rho * (1 / eps), uncapped: 1 / eps is finite for every normal epsilon (the
    # frame of the projection, not a cap, keeps z in range)
    eps = torch.tensor([0.5, 2.3e-308, 2.0], dtype=torch.float64)
    n = 10
    inv = isotonic.scale_factor(eps, n, isotonic.MODE_INV)
    assert torch.equal(inv, eps.reciprocal()) and bool(torch.isfinite(inv).all())
    assert torch.equal(isotonic.scale_factor(eps, n, 0), eps)
    assert torch.equal(isotonic.scale_factor(eps, n, isotonic.MODE_FLIP), -eps)


def test_plain_eager_is_false_under_tracing_and_transforms() -> None:
    x = torch.ones(3)
    assert plain_eager(x)
    seen: list[bool] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append(plain_eager(t))
        return t * 2

    torch.func.vmap(probe)(torch.ones(2, 3))
    torch.func.grad(lambda t: probe(t).sum())(torch.ones(3))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        probe(mode.from_tensor(x))
    assert seen == [False, False, False]


def test_eager_ops_only_for_plain_cpu_rows_on_the_kernel_back_end() -> None:
    built_ops(isotonic.KERNEL)
    x = torch.randn(2, 5, dtype=torch.float64)
    eps = torch.ones(2, dtype=torch.float64)
    with backend("kernel"):
        assert isotonic.eager_ops(x, eps) is isotonic.KERNEL.ops()
        assert isotonic.eager_ops(x.half(), eps) is None  # no kernel for float16
        assert isotonic.eager_ops(x[:, :0], eps) is None  # empty rows
        assert torch.func.vmap(lambda r: torch.tensor(isotonic.eager_ops(r[None], eps) is None))(
            x
        ).all()
    with backend("reference"):
        assert isotonic.eager_ops(x, eps) is None


def test_nan_failed_rows_marks_the_rows_with_a_non_finite_residual_only():
    from softops._core.sinkhorn import nan_failed_rows

    err = torch.tensor([0.0, math.inf, math.nan, 1e30])
    plan = torch.arange(24.0).view(4, 2, 3)
    f = torch.arange(8.0).view(4, 2)
    empty = torch.empty(4, 0)  # potentials not asked for
    p2, f2, e2 = nan_failed_rows(err, plan, f, empty)
    bad = torch.tensor([False, True, True, False])
    assert torch.isnan(p2[bad]).all() and torch.isnan(f2[bad]).all()
    assert torch.equal(p2[~bad], plan[~bad]) and torch.equal(f2[~bad], f[~bad])
    assert e2.shape == (4, 0)
