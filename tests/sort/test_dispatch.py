"""softops.sort._dispatch: the static METHODS table and the one backend signature, check_options
(the unused-argument rule and the option checks) and interpolate."""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch

from softops.sort import (
    ARGSORT_METHODS,
    METHODS,
    QUANTILE_METHODS,
    SORT_METHODS,
    _neuralsort,
    _ot,
    _pav,
    _softsort,
    check_options,
)
from softops.sort._dispatch import MethodOptions, interpolate

F64 = torch.float64
KINDS = {"sort": SORT_METHODS, "rank": SORT_METHODS, "argsort": ARGSORT_METHODS}


def test_table_is_static_and_complete():
    assert METHODS == {"pav": _pav, "softsort": _softsort, "neuralsort": _neuralsort, "ot": _ot}
    assert tuple(METHODS) == SORT_METHODS
    for kind, methods in KINDS.items():
        for name, backend in METHODS.items():
            assert hasattr(backend, kind) == (name in methods), (name, kind)
    assert set(QUANTILE_METHODS) <= set(SORT_METHODS)
    assert not any(hasattr(b, "quantile") for b in METHODS.values())  # one interpolation


@pytest.mark.parametrize("method", SORT_METHODS)
def test_one_backend_signature(method):
    for kind in KINDS:
        fn = getattr(METHODS[method], kind, None)
        if fn is None:
            continue
        params = inspect.signature(fn).parameters
        assert list(params) == ["x2", "eps", "descending", "opts", "offset"], (method, kind)
        assert params["offset"].default is None
        assert all(p.default is inspect.Parameter.empty for p in list(params.values())[:4])


def test_check_options_returns_the_used_options():
    assert check_options("soft_sort", "pav", "sort", regularization="kl") == MethodOptions(
        regularization="kl", op="soft_sort"
    )
    opts = check_options("soft_rank", "ot", "rank", max_iter=7, tol=0)
    assert opts.max_iter == 7 and opts.tol == 0.0 and isinstance(opts.tol, float)
    assert opts.op == "soft_rank"
    assert check_options("SoftArgsort", "softsort", "argsort", distance="l2").distance == "l2"
    assert check_options("soft_quantile", "pav", "quantile").regularization == "l2"


@pytest.mark.parametrize(
    ("method", "name", "value"),
    [
        ("softsort", "regularization", "kl"),
        ("neuralsort", "distance", "l2"),
        ("pav", "max_iter", 5),
        ("pav", "tol", 0.5),
        ("ot", "distance", "l2"),
    ],
)
def test_unused_arguments_must_stay_at_their_default(method, name, value):
    default = {"regularization": "l2", "distance": "l1", "max_iter": None, "tol": None}[name]
    message = (
        f"SoftRank: expected `{name}` to be left at its default {default!r} (method={method!r} "
        f"does not use it); got {name}={value!r}."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_options("SoftRank", method, "rank", **{name: value})
    check_options("SoftRank", method, "rank", **{name: default})  # the default always passes


def test_option_checks():
    with pytest.raises(ValueError, match=re.escape("soft_sort: expected `method` to be one of")):
        check_options("soft_sort", "bogus", "sort")
    with pytest.raises(ValueError, match=r"^soft_argsort: .*\(method='pav' has no permutation"):
        check_options("soft_argsort", "pav", "argsort")
    with pytest.raises(ValueError, match=r"got method='softsort'\.$"):
        check_options("soft_quantile", "softsort", "quantile")
    with pytest.raises(ValueError, match=r"got regularization='l3'\.$"):
        check_options("soft_sort", "pav", "sort", regularization="l3")
    with pytest.raises(ValueError, match=r"got distance='l7'\.$"):
        check_options("soft_sort", "softsort", "sort", distance="l7")
    # the one max_iter check: TypeError for a non-int, ValueError below 1
    for bad in ("a", 2.5, True):
        with pytest.raises(TypeError, match=rf"positive int or None; got max_iter={bad!r}\.$"):
            check_options("soft_sort", "ot", "sort", max_iter=bad)
    with pytest.raises(ValueError, match=r"^soft_sort: expected `max_iter` >= 1; got max_iter=0"):
        check_options("soft_sort", "ot", "sort", max_iter=0)
    with pytest.raises(ValueError, match=r"got tol=-1\.$"):
        check_options("soft_sort", "ot", "sort", tol=-1)
    with pytest.raises(TypeError, match=r"got tol='x'\.$"):
        check_options("soft_sort", "ot", "sort", tol="x")
    with pytest.raises(ValueError, match=r"expected `kind` to be one of"):
        check_options("soft_sort", "pav", "topk")


def test_accepted_options_are_remembered_by_value_and_type_and_refused_ones_raise_every_time():
    # accepted first, the look-alike of another type (True == 1, 1.0 == 1) is still refused
    assert check_options("soft_sort", "ot", "sort", max_iter=1).max_iter == 1
    for _ in range(2):
        with pytest.raises(TypeError, match=r"got max_iter=True\.$"):
            check_options("soft_sort", "ot", "sort", max_iter=True)
        with pytest.raises(TypeError, match=r"got max_iter=1\.0\.$"):
            check_options("soft_sort", "ot", "sort", max_iter=1.0)
        with pytest.raises(ValueError, match=r"got regularization='l3'\.$"):
            check_options("soft_sort", "pav", "sort", regularization="l3")
    # the same options twice: the same answer; an unhashable argument is checked as it is
    first = check_options("soft_rank", "ot", "rank", tol=0.25)
    assert check_options("soft_rank", "ot", "rank", tol=0.25) == first and first.tol == 0.25
    with pytest.raises(TypeError, match=r"got tol=\[0\.25\]\.$"):
        check_options("soft_rank", "ot", "rank", tol=[0.25])
    with pytest.raises(ValueError, match=r"expected `method` to be one of"):
        check_options("soft_rank", ["pav"], "rank")


# ------------------------------------------------------------------ interpolate


def test_interpolate_is_torch_quantile_on_sorted_rows():
    x = torch.randn(3, 7, dtype=F64).sort(-1).values
    q = torch.tensor([0.0, 0.1, 0.5, 0.77, 1.0], dtype=F64)
    torch.testing.assert_close(interpolate(x, q), torch.quantile(x, q, dim=-1).T)
    qg = q.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(interpolate(x, qg).sum(), qg)
    lo = (q * 6).floor().long()
    hi = (lo + 1).clamp(max=6)  # q = 1 sits on the last value: no slope
    torch.testing.assert_close(g, 6 * (x[:, hi] - x[:, lo]).sum(0))


def test_interpolate_takes_infinite_neighbours_as_limits():
    v = torch.tensor([[-math.inf, 0.0, 1.0, math.inf], [-math.inf, math.inf, math.inf, math.inf]])
    q = torch.tensor([0.0, 0.5, 1.0, 0.2])
    out = interpolate(v.requires_grad_(), q)
    (g,) = torch.autograd.grad(out[0, 1], v, retain_graph=True)
    assert torch.isfinite(g).all()
    out = out.detach()
    assert out[0].tolist() == [-math.inf, 0.5, math.inf, -math.inf]
    assert out[1, 0] == -math.inf and out[1, 2] == math.inf
    assert math.isnan(out[1, 3])  # -inf against +inf with weight 0.6


def test_interpolate_across_a_span_beyond_the_dtype():
    # v_hi - v_lo overflows float32 (a bf16 row of +-3.39e38): the convex combination instead
    values = torch.tensor([[-3.39e38, 3.39e38]], requires_grad=True)
    q = torch.tensor([0.0, 0.3, 0.5, 1.0], requires_grad=True)
    out = interpolate(values, q)
    want = torch.tensor([[-3.39e38, -3.39e38 * 0.7 + 3.39e38 * 0.3, 0.0, 3.39e38]])
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e32)
    gv, gq = torch.autograd.grad(out.sum(), (values, q))
    torch.testing.assert_close(gv, torch.tensor([[2.2, 1.8]]))
    assert not gq.isnan().any()  # the true derivative, 6.78e38, is beyond float32: inf
