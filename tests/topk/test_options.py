"""softops.topk._options: the checks and row predicates every top-k method shares, and the two
method backends called directly through softops.topk.METHODS."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from softops._core.convergence import SINKHORN_MAX_ITER, default_tol
from softops.topk import METHODS, THRESHOLD_MAX_ITER, check_mask_k, check_mask_options
from softops.topk._options import (
    PERTURBED_DEFAULT_SAMPLES,
    MaskOptions,
    check_generator,
    solver_defaults,
    unreachable_rows,
)

F64 = torch.float64
inf, nan = math.inf, math.nan


def test_check_mask_options_returns_the_method_options():
    assert check_mask_options("op", "ot", max_iter=7, tol=0.5) == (7, 0.5, None)
    assert check_mask_options("op", "sinkhorn") == (None, None, None)
    assert check_mask_options("op", "perturbed") == (None, None, PERTURBED_DEFAULT_SAMPLES)
    assert check_mask_options("op", "perturbed", n_samples=8)[2] == 8
    with pytest.raises(ValueError, match=r"^op: expected `method` to be one of .*got method='x'"):
        check_mask_options("op", "x")
    with pytest.raises(ValueError, match=r"^op: expected `tol` to be left at its default None"):
        check_mask_options("op", "softkmax", tol=0.1)
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` > 0 and finite; got epsilon=0"):
        check_mask_options("op", "ot", epsilon=0.0)
    with pytest.raises(TypeError, match=r"^op: expected `generator` to be a torch.Generator"):
        check_mask_options("op", "perturbed", generator=3)
    with pytest.raises(TypeError, match=r"^op: expected `largest` to be a bool; got largest=1"):
        check_mask_options("op", "ot", largest=1)


def test_check_mask_k_rules_per_method():
    assert check_mask_k("op", 2, 5, "ot") == (2, 2)
    k = torch.tensor([1.0, 2.0])
    out, scalar = check_mask_k("op", k, 5, "ot")
    assert out is k and scalar is None
    with pytest.raises(ValueError, match=r"^op: expected `k` >= 0; got k=-1"):
        check_mask_k("op", -1, None, "ot")  # n unknown (a layer): the sign only
    with pytest.raises(ValueError, match=r"^op: expected a scalar `k` with method='sinkhorn'"):
        check_mask_k("op", k, 5, "sinkhorn")
    with pytest.raises(ValueError, match=r"^op: hard=True needs an integer k; got k=1.5"):
        check_mask_k("op", 1.5, 5, "ot", hard=True)
    with pytest.raises(ValueError, match=r"^op: expected an integer `k` with method='perturbed'"):
        check_mask_k("op", 1.5, 5, "perturbed")
    eps = torch.tensor(0.3, requires_grad=True)
    check_mask_k("op", 2, 5, "softkmax", epsilon=eps)  # softkmax differentiates in epsilon
    with pytest.raises(ValueError, match=r"`epsilon` that does not require grad with method='si"):
        check_mask_k("op", 2, 5, "sinkhorn", epsilon=eps)


def test_solver_defaults():
    assert solver_defaults("ot", None, None, F64) == (THRESHOLD_MAX_ITER, 0.0)
    assert solver_defaults("ot", 5, 1e-3, F64) == (5, 1e-3)
    assert solver_defaults("sinkhorn", None, None, torch.float32) == (
        SINKHORN_MAX_ITER,
        default_tol(torch.float32),
    )
    assert solver_defaults("sinkhorn", 9, 0.0, F64) == (9, 0.0)


def test_check_generator_device():
    check_generator(None, torch.device("cpu"), "op")
    check_generator(None, torch.device("meta"), "op")  # shape inference: no generator needed
    check_generator(torch.Generator(), torch.device("cpu"), "op")
    with pytest.raises(ValueError, match=r"^op: expected `generator` on the device of x \(meta\)"):
        check_generator(torch.Generator(), torch.device("meta"), "op")


def test_unreachable_rows():
    x = torch.tensor(
        [[inf, inf, 0.0], [1.0, -inf, -inf], [nan, 1.0, 2.0], [inf, -inf, 0.0]], dtype=F64
    )
    assert unreachable_rows(x, 1).tolist() == [True, False, True, False]
    assert unreachable_rows(x, 2).tolist() == [False, True, True, False]
    meta = unreachable_rows(torch.empty(4, 3, device="meta"), 1)  # no data read
    assert meta.is_meta and meta.shape == (4,) and meta.dtype == torch.bool
    assert unreachable_rows(x, torch.tensor([2.0, 1.0, 1.0, 3.0], dtype=F64)).tolist() == [
        False,
        False,
        True,
        True,
    ]


def test_ot_and_sinkhorn_kernels_on_canonical_rows():
    x = torch.randn(3, 12, dtype=F64, generator=torch.Generator().manual_seed(2))
    k = torch.full((3,), 4.0, dtype=F64)
    eps = torch.tensor([0.2, 0.5, 1.0], dtype=F64)
    A = METHODS["ot"].mask(x, k, eps, MaskOptions("op", THRESHOLD_MAX_ITER, 0.0, 4.0))
    torch.testing.assert_close(A.sum(-1), k)
    S = METHODS["sinkhorn"].mask(x, k, eps, MaskOptions("op", SINKHORN_MAX_ITER, 1e-12))
    torch.testing.assert_close(S, A, atol=1e-9, rtol=0)
    with pytest.warns(UserWarning, match=r"^op: 3 of 3 rows did not converge within max_iter=1"):
        METHODS["ot"].mask(x, k, eps, MaskOptions("op", 1, 0.0, 4.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        METHODS["sinkhorn"].mask(
            x, k, eps, MaskOptions("op", 3, 0.0)
        )  # tol=0: exactly max_iter iterations, no warning


def test_checks_of_plain_values_are_kept_apart_by_type():
    # the checks of plain options and of a number k are made once per combination: a value equal
    # (and hashing alike) to one already checked, of another type, is checked on its own
    assert check_mask_options("op", "ot", largest=True, hard=False, max_iter=3) == (3, None, None)
    for bad in (dict(largest=1), dict(hard=0), dict(max_iter=3.0)):
        with pytest.raises(TypeError, match=r"expected `(largest|hard|max_iter)` to be a"):
            check_mask_options("op", "ot", **bad)
    assert check_mask_options("op", "sinkhorn", tol=0.5) == (None, 0.5, None)
    with pytest.raises(ValueError, match="tol"):
        check_mask_options("op", "sparse", tol=0.5)  # (the same values, another method)
    k, k_scalar = check_mask_k("op", 1, 4, "softkmax")
    assert (k, k_scalar) == (1, 1) and type(k) is int and type(k_scalar) is int
    k, k_scalar = check_mask_k("op", 1.0, 4, "softkmax")
    assert type(k) is float and type(k_scalar) is float
    with pytest.raises(TypeError, match="expected `k` to be a number; got True"):
        check_mask_k("op", True, 4, "softkmax")
    with pytest.raises(ValueError, match="k"):
        check_mask_k("op", 5, 4, "ot")  # refused each time, not remembered as passed
    with pytest.raises(ValueError, match="k"):
        check_mask_k("op", 5, 4, "ot")
