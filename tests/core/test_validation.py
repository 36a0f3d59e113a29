"""Argument checks shared by every op (softops._core.validation): messages name the value."""

from __future__ import annotations

import math
import re

import pytest
import torch

from softops._core.validation import (
    SMALLEST_K,
    check_bool,
    check_choice,
    check_dim,
    check_epsilon,
    check_floating,
    check_k,
    check_max_iter,
    check_nonempty,
    check_positive_int,
    check_q,
    check_tol,
    check_unused,
    compute_dtype,
    describe,
    is_integral,
    smallest_epsilon,
)

F64 = torch.float64


def test_validation_messages_name_the_value():
    x = torch.zeros(2, 3)
    assert check_floating(x, "op") is x
    assert compute_dtype(torch.bfloat16) == torch.float32 and compute_dtype(F64) == F64
    assert check_dim(x, -1, "op") == 1 and check_nonempty(x, 1, "op") == 3
    assert check_epsilon(2, "op") == 2.0 and check_k(1.5, 3, "op") == 1.5
    assert check_k(2, 3, "op", low=1, integer=True) == 2
    assert check_choice("a", ("a", "b"), "op", "m") == "a"
    assert check_max_iter(None, 7, "op") == 7 and check_tol(None, 0.5, "op") == 0.5
    check_unused("op", "m", a=None)
    with pytest.raises(TypeError, match=r"op: expected `k` to be an int; got k=1.5"):
        check_k(1.5, 3, "op", integer=True)
    with pytest.raises(
        ValueError, match=r"op: expected 1 <= `k` <= x.shape\[dim\] \(= 3\); got k=0"
    ):
        check_k(0, 3, "op", low=1)
    with pytest.raises(ValueError, match=r"op: expected `epsilon` > 0 and finite; got epsilon=inf"):
        check_epsilon(math.inf, "op")
    with pytest.raises(
        ValueError,
        match=r"op: expected `b` to be left at its default None \(method='m' does not use it\); "
        r"got b=3",
    ):
        check_unused("op", "m", b=3)
    check_unused("op", "m", {"d": "l1"}, d="l1")  # a non-None default left as it is
    with pytest.raises(ValueError, match=r"left at its default 'l1' .*; got d='l2'"):
        check_unused("op", "m", {"d": "l1"}, d="l2")
    with pytest.raises(ValueError, match=r"op: expected `m` to be one of \('a',\); got m='c'"):
        check_choice("c", ("a",), "op", "m")
    with pytest.raises(ValueError, match=r"op: expected `dim` in \[-2, 1\]"):
        check_dim(x, 5, "op")
    with pytest.raises(ValueError, match=r"op: expected `max_iter` >= 1; got max_iter=-2"):
        check_max_iter(-2, 7, "op")
    for bad in ("a", 2.0, True):
        with pytest.raises(TypeError, match=r"op: expected `max_iter` to be a positive int or No"):
            check_max_iter(bad, 7, "op")
    with pytest.raises(TypeError, match=r"op: expected `n` to be a positive int; got n=None"):
        check_positive_int(None, "op", "n")
    with pytest.raises(TypeError, match=r"op: expected `tol` to be a float >= 0 or None; got"):
        check_tol("a", 0.5, "op")
    with pytest.raises(ValueError, match=r"op: expected `tol` >= 0 or None; got tol=-1"):
        check_tol(-1, 0.5, "op")


def test_check_bool() -> None:
    assert check_bool(True, "op", "flag") is True and check_bool(False, "op", "flag") is False
    for bad in (1, 0, "yes", None, torch.tensor(True)):
        with pytest.raises(TypeError, match=r"^op: expected `flag` to be a bool; got "):
            check_bool(bad, "op", "flag")


def test_check_q_is_integral_describe():
    assert check_q(0.25, "op", F64, torch.device("cpu")).item() == 0.25
    assert check_q(torch.tensor([0.0, 1.0]), "op", F64, torch.device("cpu")).dtype == F64
    with pytest.raises(ValueError, match=r"^op: expected 0 <= `q` <= 1; got q=1.5"):
        check_q(1.5, "op", F64, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^op: expected `q` to be a float or a 0-dim or 1-D"):
        check_q(torch.zeros(2, 2), "op", F64, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"^op: expected `q` to be a float or a floating tensor"):
        check_q(torch.tensor([1]), "op", F64, torch.device("cpu"))
    assert is_integral(3) and is_integral(torch.tensor([1.0, 2.0])) and not is_integral(2.5)
    assert describe(2.5) == "2.5" and describe(torch.tensor(3.0)) == "3"
    assert describe(torch.ones(2, 3)) == "tensor of shape (2, 3)"


# ----------------------------------------------------------------- numpy scalars, bool, complex


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    from softops._core.validation import as_number

    assert check_k(np.int64(2), 5, "op", integer=True) == 2
    assert check_k(np.float64(2.5), 5, "op") == 2.5
    assert check_k(np.array(3), 5, "op", integer=True) == 3  # a 0-dim array
    assert check_epsilon(np.float32(0.5), "op") == 0.5
    assert check_epsilon(np.array(0.25), "op") == 0.25
    assert check_positive_int(np.int32(4), "op", "n") == 4
    assert check_tol(np.float64(1e-6), 0.0, "op") == 1e-6
    assert type(as_number(np.float64(1.5))) is float and type(as_number(np.int8(3))) is int
    for bad in (np.True_, np.array(True), np.complex128(1 + 0j), np.array([1.0])):
        assert as_number(bad) is bad
        with pytest.raises(TypeError, match=r"^op: expected `k` to be a number; got "):
            check_k(bad, 5, "op")
        with pytest.raises(TypeError, match=r"^op: expected `epsilon` to be a float or a tensor"):
            check_epsilon(bad, "op")


@pytest.mark.parametrize("integer", [False, True])
def test_bool_and_complex_k_are_refused(integer):
    what = "an int" if integer else "a number"
    for k in (True, 2 + 0j):
        with pytest.raises(
            TypeError, match=rf"^op: expected `k` to be {what}; got {re.escape(repr(k))}\.$"
        ):
            check_k(k, 5, "op", integer=integer)
    for k in (torch.tensor(True), torch.tensor(2 + 0j)):
        with pytest.raises(
            TypeError, match=rf"^op: expected `k` to be {what}; got a tensor of dtype={k.dtype}\.$"
        ):
            check_k(k, 5, "op", integer=integer)


@pytest.mark.parametrize("op", ["soft_kmax", "soft_topk", "soft_topk_mask"])
def test_public_ops_refuse_bool_and_complex_k_and_take_numpy(op):
    import softops

    np = pytest.importorskip("numpy")
    fn = getattr(softops, op)
    x = torch.tensor([0.3, -1.2, 0.8, 2.0], dtype=F64)
    for k in (torch.tensor(True), True, 2 + 0j, torch.tensor(2 + 0j)):
        with pytest.raises(TypeError, match=rf"^{op}: expected `k` to be"):
            fn(x, k)
    ref = fn(x, 2, epsilon=0.5)
    for k, e in ((np.int64(2), np.float64(0.5)), (np.array(2), np.float32(0.5))):
        out = fn(x, k, epsilon=e)
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        for a, b in zip(outs, refs, strict=True):
            torch.testing.assert_close(a, b)


# ------------------------------------------------ epsilon and k at the bottom of the dtype's range


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
def test_epsilon_below_the_smallest_normal_of_the_compute_dtype_is_refused(dtype):
    cd = compute_dtype(dtype)
    tiny = torch.finfo(cd).tiny
    assert smallest_epsilon(dtype) == tiny
    assert check_epsilon(tiny, "op", dtype=dtype) == tiny
    assert check_epsilon(1e-320, "op") == 1e-320  # without a dtype (a layer): positive only
    name = str(cd).removeprefix("torch.")
    if cd == torch.float32:  # a Python float that rounds to tiny in the compute dtype is tiny
        assert check_epsilon(tiny * (1 - 2**-30), "op", dtype=dtype) == tiny * (1 - 2**-30)
    for bad in (tiny / 2, tiny * (1 - 2**-20), 5e-324):
        with pytest.raises(ValueError) as info:
            check_epsilon(bad, "op", dtype=dtype)
        given = str(dtype).removeprefix("torch.")
        via = "" if cd == dtype else f", the compute dtype of x of dtype {given}"
        assert str(info.value).startswith(
            f"op: expected `epsilon` >= {tiny:.8g} (the smallest normal {name}{via}"
        ), str(info.value)
        assert str(info.value).endswith(f"; got epsilon={bad!r}."), str(info.value)
    # the printed bound is an allowed epsilon (rounded up)
    assert check_epsilon(float(f"{tiny:.8g}"), "op", dtype=dtype) >= tiny
    # 0, negative and non-finite values keep their own message
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` > 0 and finite; got "):
        check_epsilon(0.0, "op", dtype=dtype)


def test_tensor_epsilon_is_compared_in_its_own_dtype_against_the_compute_dtype_bound():
    t32 = torch.finfo(torch.float32).tiny
    # float64 entries below float32's smallest normal: refused for float32 x, fine for float64
    e = torch.tensor([0.5, 1e-40], dtype=F64)
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` >= 1.1754944e-38 .*; got "):
        check_epsilon(e, "op", dtype=torch.float32)
    assert check_epsilon(e, "op", dtype=F64) is e
    # a float32 tensor with a float32 subnormal: normal in float64 (the compute dtype of f64 x)
    sub = torch.tensor([t32 / 4], dtype=torch.float32)
    assert check_epsilon(sub, "op", dtype=F64) is sub
    with pytest.raises(ValueError, match=r"got epsilon=2\.93873"):
        check_epsilon(sub, "op", dtype=torch.bfloat16)
    # the first offending entry is named, whatever its kind
    with pytest.raises(ValueError, match=r"^op: expected `epsilon` > 0 and finite; got eps.*=-1"):
        check_epsilon(torch.tensor([-1.0, 1e-40], dtype=F64), "op", dtype=torch.float32)


def test_a_k_below_the_smallest_normal_float32_is_0():
    assert SMALLEST_K == torch.finfo(torch.float32).tiny
    for k in (SMALLEST_K / 2, 5e-324, 1e-50, SMALLEST_K * (1 - 2**-30)):
        assert check_k(k, 3, "op") == 0.0
    assert check_k(SMALLEST_K, 3, "op") == SMALLEST_K and check_k(0, 3, "op") == 0
    assert check_k(1e-30, None, "op") == 1e-30
    k = torch.tensor([1e-40, 0.0, 2.5, SMALLEST_K], dtype=F64, requires_grad=True)
    out = check_k(k, 3, "op")
    assert out.tolist() == [0.0, 0.0, 2.5, SMALLEST_K]
    (g,) = torch.autograd.grad((out * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)).sum(), k)
    assert g.tolist() == [1.0, 2.0, 3.0, 4.0]  # the gradient of k passes through unchanged
    plain = torch.tensor([1.0, 2.0])
    assert check_k(plain, 3, "op") is plain  # nothing to change: the same tensor


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
def test_an_op_takes_the_smallest_normal_of_its_compute_dtype_for_k(dtype):
    # float16/bfloat16 compute in float32; float64 resolves a k far below float32's range
    tiny = torch.finfo(F64 if dtype == F64 else torch.float32).tiny
    for k in (tiny / 2, tiny * (1 - 2**-30), 5e-324):
        assert check_k(k, 3, "op", dtype=dtype) == 0.0
    assert check_k(tiny, 3, "op", dtype=dtype) == tiny
    if dtype == F64:
        assert check_k(1e-300, 3, "op", dtype=dtype) == 1e-300  # solved, not the limit
        k = torch.tensor([1e-310, 1e-300], dtype=F64)
        assert check_k(k, 3, "op", dtype=dtype).tolist() == [0.0, 1e-300]
    with pytest.raises(ValueError, match=r"^op: expected 0 <= `k` <= x.shape\[dim\] \(= 3\)"):
        check_k(torch.tensor([1e-40, 4.0], dtype=F64), 3, "op")


def test_check_row_counts_names_the_first_short_row_and_skips_unreadable_counts():
    from softops._core.validation import check_row_counts

    check_row_counts(torch.tensor([3, 4]), 3, "op", "entries")
    with pytest.raises(
        ValueError, match=r"^op: every row needs at least 3 entries; row 1 has 2\.$"
    ):
        check_row_counts(torch.tensor([3, 2, 1]), 3, "op", "entries")
    check_row_counts(torch.tensor([1, 2], device="meta"), 3, "op", "entries")  # no values
    torch.func.vmap(lambda c: check_row_counts(c, 3, "op", "entries") or c)(torch.ones(2, 2))
