"""Epsilon at the bottom of the compute dtype's range, and k at the ends of its range.

The rule (``softops._core.validation.check_epsilon``, applied to every op by ``prepare_rows``):
an epsilon below the smallest normal number ``finfo.tiny`` of x's compute dtype (a subnormal, or
a value that rounds to 0 there) raises ``ValueError`` naming the op, that dtype and the smallest
allowed epsilon; from ``finfo.tiny`` on, every op gives its value, also on rows of subnormal
entries (where the clamp that this rule replaced gave masks off by 0.24, a smooth maximum beyond
its bound and ranks at the wrong limit). A k below the smallest normal float32 is its limit
k -> 0 (``check_k``): method "sinkhorn" gave NaN there.

Every entry of the contract registry (``tests.test_contract.CASES``: every op and method) and
every nn layer runs through the same checks.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import softops
from softops._core.validation import smallest_epsilon
from tests.test_contract import CASES, TAKES_K, Case

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DTYPES = [F16, BF16, F32, F64]
DETERMINISTIC = [c for c in CASES if not c.stochastic]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny problems: keep off the busy intra-op pool."""


def _ids(case: Case) -> str:
    return case.id


def _cd(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, F32)


def _refused_pattern(op: str, dtype: torch.dtype, got: str) -> str:
    cd = _cd(dtype)
    return (
        rf"^{op}: expected `epsilon` >= {torch.finfo(cd).tiny:.8g} \(the smallest normal "
        rf"{str(cd).removeprefix('torch.')}.*\); got epsilon={re.escape(got)}\.$"
    )


def _too_small(dtype: torch.dtype) -> list[float]:
    """Positive epsilons the compute dtype of x cannot hold as normal numbers: subnormals, and
    (float32) values that round to 0."""
    tiny = torch.finfo(_cd(dtype)).tiny
    small = [tiny / 2, tiny * (1 - 2**-20), math.nextafter(0.0, 1.0)]
    if _cd(dtype) == F32:
        small += [1e-46, 2e-62]  # 0 in float32 (2e-62: issue 23's soft_rank epsilon)
    return small


def _rows(dtype: torch.dtype) -> torch.Tensor:
    """Two rows of distinct entries, unit gaps (exact in every dtype)."""
    return torch.tensor([[3.0, 0.0, 4.0, 1.0, 2.0], [1.0, 4.0, 0.0, 2.0, 3.0]], dtype=dtype)


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all, a ConvergenceWarning included
        return fn(*args, **kw)


# ------------------------------------------------------------------ below finfo.tiny: refused


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_epsilon_below_the_smallest_normal_is_refused(case, dtype):
    x = _rows(dtype)
    for eps in _too_small(dtype):
        with pytest.raises(ValueError, match=_refused_pattern(case.op, dtype, repr(eps))):
            case(x, epsilon=eps)
    # a tensor epsilon: one row's entry is subnormal in the compute dtype (its own dtype is
    # float64, where 1e-40 is normal); the other row's is fine
    bad = 1e-40 if _cd(dtype) == F32 else 1e-310
    e = torch.tensor([0.5, bad], dtype=F64, requires_grad=case.grad_eps)
    with pytest.raises(ValueError, match=_refused_pattern(case.op, dtype, repr(bad))):
        case(x, epsilon=e)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_layers_refuse_it_on_their_forward_call(case):
    layer = case.module(epsilon=1e-40)  # the dtype of x is unknown at construction
    x = _rows(F32)
    with pytest.raises(ValueError, match=_refused_pattern(case.op, F32, "1e-40")):
        layer(x)
    float64_layer = case.module(epsilon=1e-40)
    out = _quiet(float64_layer, x.double())  # 1e-40 is a normal float64
    out = out.values if case.op == "soft_topk" else out
    assert torch.isfinite(out).all()


def test_the_message_names_the_compute_dtype_of_half_precision_x():
    with pytest.raises(ValueError) as info:
        softops.smooth_max(_rows(F16), epsilon=1e-39)
    assert str(info.value) == (
        "smooth_max: expected `epsilon` >= 1.1754944e-38 (the smallest normal float32, the "
        "compute dtype of x of dtype float16; a smaller epsilon is subnormal or 0 there); got "
        "epsilon=1e-39."
    )
    assert smallest_epsilon(F16) == smallest_epsilon(F32) == torch.finfo(F32).tiny
    assert smallest_epsilon(F64) == torch.finfo(F64).tiny


def test_issue_23_reproducers_now_raise():
    x = torch.full((8,), 1e-40)
    x[:5] = 2e-40
    for method in ("ot", "sinkhorn"):
        with pytest.raises(ValueError, match=r"^soft_topk_mask: expected `epsilon` >= 1\.17"):
            softops.soft_topk_mask(x, 5, epsilon=2.8e-40, method=method)
    with pytest.raises(ValueError, match=r"^smooth_max: expected `epsilon` >= 1\.17"):
        softops.smooth_max(x, epsilon=2.8e-40)
    with pytest.raises(ValueError, match=r"^soft_argmax: expected `epsilon` >= 1\.17"):
        softops.soft_argmax(x, epsilon=2.8e-40)
    r = torch.tensor([[-7.08e-31, 7.15e-31]])
    for kw in ({"method": "ot"}, {"method": "softsort", "distance": "l2"}):
        with pytest.raises(ValueError, match=r"^soft_rank: expected `epsilon` >= 1\.17"):
            softops.soft_rank(r, epsilon=2.0e-62, **kw)


# -------------------------------------------------------- at finfo.tiny: the value, exactly


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_smallest_normal_epsilon_gives_the_hard_limit(case, dtype):
    # unit gaps, epsilon = finfo.tiny: every gap is 1e38 (float32) epsilons wide, in any units
    x = _rows(dtype)
    tiny = torch.finfo(dtype).tiny
    for eps in (tiny, torch.tensor([tiny, 2 * tiny], dtype=dtype)):
        out = _quiet(case, x, epsilon=eps)
        assert torch.isfinite(out).all(), out
        torch.testing.assert_close(out, case.hard(x), rtol=1e-6, atol=1e-6)


def _subnormal_rows(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of entries from 2**-10 to 2**10 times the smallest normal number of ``dtype``: many
    of them subnormal, their gaps too."""
    g = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(dtype).tiny
    mant = torch.rand(3, 6, generator=g, dtype=F64) * 2 - 1
    expo = torch.randint(-10, 11, (3, 6), generator=g).to(F64)
    return (mant * 2.0**expo * tiny).to(dtype)


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("case", DETERMINISTIC, ids=_ids)
def test_subnormal_rows_at_the_smallest_normal_epsilon_are_exact(case, dtype):
    """float32: against float64 on the same x and epsilon (float64 holds every entry and every
    gap as normal numbers). float64: against the scaling law, on ``2**200 x`` (exact)."""
    tiny = torch.finfo(dtype).tiny
    if dtype == F64 and (case.law is None or case.law < 0):
        pytest.skip("no exact scaling law, or one that makes epsilon smaller still")
    for seed in range(2):
        x = _subnormal_rows(dtype, seed)
        for mult in (1.0, 64.0):
            eps = tiny * mult
            out = _quiet(case, x, epsilon=eps).double()
            if dtype == F32:
                ref = case(x.double(), epsilon=eps)
            else:
                c = 2.0**200
                ref = case(x * c, epsilon=eps * c**case.law)
                ref = ref / c if case.units_of_x else ref
            size = ref.abs().max().clamp(min=torch.finfo(dtype).smallest_normal)
            rtol = 5e-5 if dtype == F32 else 1e-12
            assert (out - ref).abs().max() <= rtol * size, (seed, mult, out, ref)


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_smooth_max_keeps_its_bounds_on_subnormal_rows(dtype):
    # [max, max + eps log n], computed in float64 (exact for these float32 numbers)
    tiny = torch.finfo(dtype).tiny
    x = _subnormal_rows(dtype, 7)
    n = x.shape[-1]
    for mult in (1.0, 2.0, 1e3):
        eps = tiny * mult
        top = x.double().amax(-1)
        for sign, op in ((1.0, softops.smooth_max), (-1.0, softops.smooth_min)):
            v = sign * op(sign * x, epsilon=eps).double()
            assert (v >= top).all(), (v, top)
            rounding = torch.finfo(dtype).eps * (top.abs() + eps * math.log(n))
            assert (v <= top + eps * math.log(n) + rounding).all(), (v, top)


# ------------------------------------------------------------------------ k at its range's ends

K_CASES = [c for c in CASES if c.op in TAKES_K and c.op != "soft_topk" and not c.stochastic]
REAL_K = [c for c in K_CASES if c.op == "soft_topk_mask" and c.method != "softkmax"]


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("case", REAL_K, ids=_ids)
def test_a_k_below_the_smallest_normal_of_the_dtype_is_the_limit_k_to_0(case, dtype):
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0), dtype=dtype)
    tiny = torch.finfo(dtype).tiny
    zero = _quiet(case, x, k=0, epsilon=0.3)
    assert torch.equal(zero, torch.zeros_like(x))
    for k in (tiny / 4, tiny * (1 - 2**-20), 5e-324):
        out = _quiet(case, x, k=k, epsilon=0.3)
        assert torch.equal(out, zero), (k, out)
    far = 1e-30  # far from the limit's rule: solved ("sparse" at k near tiny: KD16)
    out = _quiet(case, x, k=far, epsilon=0.3)
    assert (out >= 0).all()  # ("sparse" has exact zeros)
    torch.testing.assert_close(
        out.double().sum(-1) / far, torch.ones(3, dtype=F64), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("case", REAL_K, ids=_ids)
def test_a_k_that_rounds_to_n_is_n(case, dtype):
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(1), dtype=dtype)
    k = 6 - 1e-9 if dtype == F32 else 6.0  # 6 - 1e-9 is 6 in float32
    out = _quiet(case, x, k=k, epsilon=0.3)
    if dtype == F32:
        assert torch.equal(out, torch.ones_like(x))
    else:
        assert torch.equal(out, _quiet(case, x, k=6, epsilon=0.3))


@pytest.mark.parametrize("method", ["ot", "sparse"])
def test_a_tensor_k_below_the_smallest_normal_of_the_dtype_is_0_with_the_gradient_of_k(method):
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    k = torch.tensor([1e-310, 2.0], dtype=F64, requires_grad=True)  # a subnormal float64
    k0 = torch.tensor([0.0, 2.0], dtype=F64, requires_grad=True)
    w = torch.randn(2, 5, generator=torch.Generator().manual_seed(3), dtype=F64)
    out = softops.soft_topk_mask(x, k, epsilon=0.4, method=method)
    ref = softops.soft_topk_mask(x, k0, epsilon=0.4, method=method)
    assert torch.equal(out, ref) and torch.equal(out[0], torch.zeros(5, dtype=F64))
    (g,) = torch.autograd.grad((out * w).sum(), k)
    (g0,) = torch.autograd.grad((ref * w).sum(), k0)
    assert torch.equal(g, g0) and torch.isfinite(g).all()


def _other_public_ops(dtype: torch.dtype, eps: float) -> list[tuple[str, object]]:
    """(op name, a call with ``epsilon=eps`` on inputs of ``dtype``) for the public ops outside
    the contract registry that take an epsilon: the solvers, the metrics and losses, the sharded
    ops (in a world of one), attention and the beam step."""
    from softops import distributed, losses, metrics, solvers
    from softops.apps.beam import beam_step
    from softops.nn import topk_attention

    x = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, 0.25]], dtype=dtype)
    y = torch.tensor([2, 0])
    q = x.unsqueeze(0)
    half = torch.full((2,), 0.5, dtype=dtype)
    return [
        (
            "sinkhorn",
            lambda: solvers.sinkhorn(x[:, :2].reshape(1, 2, 2), half[None], half[None], eps),
        ),
        ("topk_threshold", lambda: solvers.topk_threshold(x, 1, eps)),
        ("soft_accuracy", lambda: metrics.soft_accuracy(x, y, from_logits=True, epsilon=eps)),
        ("soft_f1", lambda: metrics.soft_f1(x, y, average="macro", from_logits=True, epsilon=eps)),
        ("soft_topk_accuracy", lambda: metrics.soft_topk_accuracy(x, y, 2, epsilon=eps)),
        ("accuracy_loss", lambda: losses.accuracy_loss(x, y, from_logits=True, epsilon=eps)),
        ("topk_accuracy_loss", lambda: losses.topk_accuracy_loss(x, y, 2, epsilon=eps)),
        ("spearman_loss", lambda: losses.spearman_loss(x, x.flip(-1), epsilon=eps)),
        ("distributed.soft_topk_mask", lambda: distributed.soft_topk_mask(x, 1, epsilon=eps)),
        ("topk_attention", lambda: topk_attention(q, q, q, 1, epsilon=eps)),
        ("beam_step", lambda: beam_step(x[:, :1], x.unsqueeze(1).log_softmax(-1), epsilon=eps)),
    ]


@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_every_public_op_refuses_an_epsilon_below_the_smallest_normal_of_its_dtype(dtype):
    """The solvers, metrics, losses, sharded ops, attention and the beam step validate epsilon
    against the compute dtype of their input as the registry's ops do (``check_epsilon(dtype=)``):
    the same ValueError, naming the op; and they take the smallest normal number itself."""
    tiny = torch.finfo(_cd(dtype)).tiny
    for eps in _too_small(dtype):
        for op, call in _other_public_ops(dtype, eps):
            with pytest.raises(ValueError, match=_refused_pattern(op, dtype, repr(eps))):
                call()
    for _op, call in _other_public_ops(dtype, tiny):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()  # no error
