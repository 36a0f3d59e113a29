"""Adversarial property-based tests (hypothesis) over the contract registry.

Every entry of ``tests.test_contract.CASES`` runs through five properties, on inputs built to
break it: ties, ±1e30 and the dtype's extremes, denormals, rows of ±inf and NaN beside clean
rows, every dtype (float16, bfloat16, float32, float64), epsilon from 1e-8 to 1e8 relative to
the row's gaps (in the units its scaling law gives it), and, for the ops that take k, k in
{0, 1, n - 1, n} and real k next to them where the method accepts a real k.

- ``test_forward_backward``: every call returns within ``CALL_SECONDS`` and raises nothing (a
  ``ConvergenceWarning`` is the one warning allowed); the output has the documented shape and
  dtype; the rows the docstrings make NaN (a NaN input, a row that cannot hold its k entries, a
  row with nothing to select, the l2 PAV sort of a row holding both infinities) are entirely
  NaN and no other entry is; the invariants of each family hold to the rounding of the dtype;
  and the backward is NaN-free outside those rows (for x, and for epsilon, k and q when they
  are tensors).
- ``test_invalid_arguments``: one argument at a time is made invalid, on hostile x: the op
  raises ``ValueError`` or ``TypeError`` with a message ``"<op>: expected ...; got ..."``
  (an epsilon below the smallest normal number of x's compute dtype among them).
- ``test_gradient_matches_finite_differences``: float64, well-conditioned draws (gaps of at
  least 0.4 of the scale, epsilon within a decade of the gaps): the directional derivative from
  autograd (in x, epsilon, k and q) equals a central difference of step 1e-5 of the smoothing
  scale, to 1e-5 of the derivative's terms (``soft_quantile(method="ot")``, whose Sinkhorn
  takes no ``tol``, with a step of 1e-3 and 1e-4). PAV and "sparse" are piecewise smooth:
  where their one-sided differences disagree the draw is within a step of a kink and the
  comparison is skipped.
- ``test_tiny_rows``: rows of subnormal and tiny entries (every dtype) with an epsilon in
  proportion to their gaps, or a few binades either side of the smallest normal number of the
  compute dtype: below it the op raises the documented ``ValueError`` (it names the op, the
  dtype and the smallest allowed epsilon); from it on the call passes every check of
  ``test_forward_backward`` and its value equals the op's value where nothing is subnormal
  (float64 on the same x and epsilon; for float64 x, the scaling law on ``2**p x``).
- ``test_second_derivatives_match_finite_differences``: float64, well-conditioned draws as for
  the first derivatives: ``v' H u`` by double backward, in x and in epsilon, k and q as
  tensors at once, equals a central difference of the first derivative ``<grad, u>`` along v
  (kinks of PAV and "sparse" skipped as above); ``test_sinkhorn_second_derivatives`` does the
  same for ``softops.solvers.sinkhorn`` in the cost and a per-row epsilon.
  Every property draws k, where the op takes one, in {0, 1, n - 1, n}, near them, and (a real
  k) values that round to 0 or to n in the dtype. Monte-Carlo methods (``perturbed``) get
  neither derivative property, and no reference value, with a fixed generator.

Where the library does not claim a property, it is not checked, and ``known_defects`` says why,
row by row: rows within 2**16 of the largest finite value of the compute dtype get the NaN
pattern only; a backward whose true derivative is beyond the dtype (about n * scale / epsilon)
may overflow; so may the soft-k-max recursion's near ties (its module docstring). Defects found
by this suite in code its author does not own are skipped there too, on exactly the rows they
apply to, and each is pinned by a strict-xfail reproducer (``test_known_defect``), which fails
once the defect is fixed, so that its entry is then removed.

Two hypothesis profiles (registered in ``tests._adversarial_strategies``, ``PROFILES``): the
default (the CI run: ``pytest tests/test_adversarial.py``) runs 80, 15, 40, 12 and 4 examples
per registry entry for the five properties (15 for the solver), about 75 s on two busy cores;
the ``slow`` one (``pytest -m slow tests/test_adversarial.py``) runs 6000, 1000, 3000, 7000 and
3000 (2 * 10**4 per registry entry, 10**4 for the solver; ``perturbed`` runs its
finite-difference and second-derivative examples as forward_backward and tiny_rows ones). Both
are derandomized and use no example database, so a run is reproducible and prints nothing but
pytest's summary. ``SOFTOPS_ADVERSARIAL_COUNTS=<file>`` adds the number of examples
each (property, case) completed to that JSON file; ``SOFTOPS_ADVERSARIAL_SCALE=<f>`` multiplies
the slow profile's counts (a run on a time budget: 10**4 per op needs f = 0.5 for an op with one
registry entry, less where an op has several).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given as _given
from hypothesis import note
from hypothesis import strategies as st

import softops
from tests import _adversarial_strategies as adv
from tests.test_contract import CASES, DETERMINISTIC, TAKES_K, Case

F64 = torch.float64
INF = math.inf
CALL_SECONDS = 30.0  # a bound on one call (n <= 8): far above any honest call, even on 2 busy cores

# examples per (property, case): (default profile, slow profile; adv.PROFILES). In the slow
# profile every registry entry runs 10**4 examples across forward_backward, invalid_arguments and
# finite_differences (perturbed, which has no finite-difference property, runs those in
# forward_backward instead), and 10**4 more across tiny_rows and second_derivatives.
EXAMPLES = {
    "forward_backward": (80, 6000),
    "invalid_arguments": (15, 1000),
    "finite_differences": (40, 3000),
    "tiny_rows": (12, 7000),
    "second_derivatives": (4, 3000),
    "sinkhorn_second_derivatives": (15, 10**4),
}
SLOW_SCALE = float(os.environ.get("SOFTOPS_ADVERSARIAL_SCALE", "1"))
"""The slow profile's counts times this (``SOFTOPS_ADVERSARIAL_SCALE``, default 1): a run that
must fit a time budget can take, say, 0.5 for the registry entries that are an op's only one
(10**4 examples for that op) and 0.25 where an op has four or more (at least 2 * 10**4)."""
COUNTS: Counter[tuple[str, str]] = Counter()


@pytest.fixture(autouse=True, scope="module")
def _counts_and_threads():
    """One intra-op thread (tiny problems); write the example counts when asked to."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    path = os.environ.get("SOFTOPS_ADVERSARIAL_COUNTS")
    if path:
        old = {}
        if os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
        for (prop, cid), n in COUNTS.items():
            old[f"{prop}/{cid}"] = old.get(f"{prop}/{cid}", 0) + n
        with open(path, "w") as f:
            json.dump(old, f, indent=1, sort_keys=True)


# ------------------------------------------------------------------------------- helpers


class Hang(AssertionError):
    """A call ran past CALL_SECONDS."""


@contextlib.contextmanager
def bounded(seconds: float = CALL_SECONDS) -> Iterator[None]:
    """Fail a call that runs longer than ``seconds`` (interrupted by SIGALRM where there is
    one, and checked afterwards everywhere)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"a call ran past {seconds} s")

    has_alarm = hasattr(signal, "setitimer")
    if has_alarm:
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.perf_counter()
    try:
        yield
    finally:
        if has_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    elapsed = time.perf_counter() - start
    if elapsed > seconds:
        raise Hang(f"a call took {elapsed:.1f} s (bound {seconds} s)")


@contextlib.contextmanager
def only_convergence_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Any warning but a ConvergenceWarning fails the example; yields the list of warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    others = [w for w in caught if not issubclass(w.category, softops.ConvergenceWarning)]
    assert not others, [f"{w.category.__name__}: {w.message}" for w in others]


LAST_CALL = {"converged": True}  # whether the last call of `run` raised no ConvergenceWarning


def run(case: Case, x: torch.Tensor, **kw: Any) -> Any:
    """The op of ``case`` on x (soft_topk: its full TopK), bounded in time, warnings checked."""
    kw = case._kwargs(kw)
    fn = getattr(softops, case.op)
    with bounded(), only_convergence_warnings() as caught:
        if case.op == "soft_quantile":
            out = fn(x, kw.pop("q"), **kw)
        elif case.op in TAKES_K:
            out = fn(x, kw.pop("k"), **kw)
        else:
            out = fn(x, **kw)
    LAST_CALL["converged"] = not caught
    return out


def sinkhorn_based(case: Case) -> bool:
    """Solved by Sinkhorn, to a tolerance (the sort "ot", "sinkhorn" and the sorted top-k)."""
    ot_sort = case.method == "ot" and case.op not in ("soft_topk_mask",)
    return ot_sort or case.method == "sinkhorn" or case.op == "soft_topk"


def describe(case: Case, call: dict[str, Any]) -> str:
    """The call as exact float64 literals (for a reproducer)."""

    def lit(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"torch.tensor({v.detach().double().tolist()!r}, dtype=torch.float64)"
        return repr(v)

    x = call["x"]
    kw = case._kwargs({k: v for k, v in call.items() if k != "x"})
    kw.pop("generator", None)
    args = ", ".join(f"{k}={lit(v)}" for k, v in kw.items())
    return f"softops.{case.op}({lit(x)}.to({x.dtype}), {args})"


def values_of(case: Case, out: Any) -> torch.Tensor:
    return out.values if case.op == "soft_topk" else out


def orient_of(case: Case, data: st.DataObject) -> bool | None:
    if case.flag is None or case.op == "soft_quantile":
        return None
    return data.draw(st.booleans(), label="orient")


def k_per_row(k: Any, b: int, dtype: torch.dtype = F64) -> torch.Tensor:
    """k per row, as the op holds it: below the smallest normal number of the compute dtype
    (float16/bfloat16 -> float32) its limit 0, then in the compute dtype."""
    cd = torch.promote_types(dtype, torch.float32)
    if isinstance(k, torch.Tensor):
        return adv.flushed_k(k.detach().double(), dtype).to(cd).double().expand(b)
    return adv.flushed_k(torch.full((b,), float(k), dtype=F64), dtype).to(cd).double()


def expected_shape(case: Case, b: int, n: int, k: Any, m: int) -> tuple[int, ...]:
    if case.layout == "k":
        return (b, int(k.detach()) if isinstance(k, torch.Tensor) else int(k))
    return {"same": (b, n), "reduce": (b,), "quantile": (m, b), "square": (b, n, n)}[case.layout]


def examples(prop: str, case: Case, slow: bool) -> int:
    ci, big = EXAMPLES[prop]
    if not slow:
        return ci
    if case.stochastic and prop == "forward_backward":
        big += EXAMPLES["finite_differences"][1]
    if case.stochastic and prop == "tiny_rows":
        big += EXAMPLES["second_derivatives"][1]
    return max(1, round(big * SLOW_SCALE))


def check(prop: str, case: Case, slow: bool) -> None:
    """Run property ``prop`` on ``case`` for its number of examples in the chosen profile."""

    @adv.profile(slow, examples(prop, case, slow))
    @_given(data=st.data())
    def property_(data: st.DataObject) -> None:
        PROPERTIES[prop](case, data)
        COUNTS[(prop, case.id)] += 1  # completed examples only

    property_()


# ---------------------------------------------------------------- property 1: no crash, no NaN


def _draw_call(case: Case, data: st.DataObject, dtype: torch.dtype) -> dict[str, Any]:
    """An adversarial batch and the arguments of one call."""
    x = data.draw(adv.batches(dtype), label="x")
    b, n = x.shape
    call: dict[str, Any] = {"x": x.requires_grad_()}
    log_r = data.draw(st.floats(-8.0, 8.0), label="log10(epsilon / gap**law)")
    eps = adv.epsilon_for(case, adv.typical_gap(x), log_r)
    if data.draw(st.booleans(), label="epsilon as a per-row tensor"):
        jitter = data.draw(st.lists(st.floats(-1, 1), min_size=b, max_size=b), label="jitter")
        e = torch.tensor([min(max(eps * 10.0**j, 1e-300), 1e300) for j in jitter], dtype=F64)
        call["epsilon"] = e.requires_grad_(case.grad_eps)
    else:
        call["epsilon"] = eps
    orient = orient_of(case, data)
    if orient is not None:
        call["orient"] = orient
    if case.op in TAKES_K:
        k: Any = data.draw(adv.k_values(case, n), label="k")
        if case.method in ("ot", "sparse"):
            form = data.draw(st.sampled_from(["number", "0-dim", "per-row"]), label="k form")
            if form == "0-dim":
                k = torch.tensor(float(k), dtype=F64, requires_grad=True)
            elif form == "per-row":
                ks = data.draw(st.lists(adv.k_values(case, n), min_size=b, max_size=b))
                k = torch.tensor([float(v) for v in ks], dtype=F64)
        call["k"] = k
    if case.op == "soft_quantile":
        grid = [i / max(n - 1, 1) for i in range(n)]
        qs = data.draw(
            st.lists(
                st.one_of(st.sampled_from([0.0, 1.0, *grid]), st.floats(0.0, 1.0)),
                min_size=1,
                max_size=4,
            ),
            label="q",
        )
        call["q"] = torch.tensor(sorted(qs), dtype=F64, requires_grad=True)
    return call


def _expected_nan(case: Case, xd: torch.Tensor, call: dict[str, Any], out: torch.Tensor):
    """The entries of ``out`` that the docstrings make NaN."""
    b = xd.shape[0]
    k = k_per_row(call["k"], b, call["x"].dtype) if "k" in call else None
    rows = adv.nan_rows(case, xd, k, call.get("orient", case.flag[1] if case.flag else None))
    if case.layout == "quantile":
        want = rows.expand(out.shape[0], b).clone()
        if case.method == "ot":  # the infinities sort to their hard positions
            srt = torch.sort(xd, dim=-1).values
            cd = torch.promote_types(call["x"].dtype, torch.float32)  # q as the op holds it
            want |= adv.quantile_nan(srt, call["q"].detach(), cd) & ~rows
        return rows, want
    return rows, rows.view(b, *([1] * (out.dim() - 1))).expand(out.shape)


def _check_invariants(case: Case, call: dict[str, Any], full: Any, ok: torch.Tensor) -> None:
    """The documented invariants of the family, on the rows ``ok`` (B,) that are not NaN."""
    x = call["x"].detach()
    dtype = x.dtype
    xd = x.double()
    out = values_of(case, full).detach().double()
    tol = adv.tolerance(dtype)
    if sinkhorn_based(case):  # its marginals are exact to the solver's tolerance only
        if not LAST_CALL["converged"]:
            return  # "the result and its gradient are approximate": no accuracy to check
        tol = max(tol, 10 * (1e-9 if dtype == F64 else 1e-6))
    b, n = xd.shape
    fin = torch.isfinite(xd)
    finite_row = fin.all(-1) & ok
    mag = torch.where(fin, xd.abs(), 0).amax(-1)  # (B,) largest finite |x|
    big = out.abs().where(torch.isfinite(out), 0).flatten(1).amax(-1) if out.dim() > 1 else 0
    if case.layout == "quantile":
        big = out.abs().where(torch.isfinite(out), 0).amax(0)
    mag = torch.maximum(mag, torch.as_tensor(big, dtype=F64))  # outputs can go beyond x (kl)
    # relative rounding, and the absolute rounding of a cast to the dtype's denormals
    floor = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    slack = tol * torch.where(mag > 0, mag, 1.0) + 2 * floor  # (B,)
    lo = xd.amin(-1)
    hi = xd.amax(-1)
    op = case.op
    orient = call.get("orient")
    if op == "soft_sort" or op == "soft_topk":
        descending = orient if op == "soft_sort" else (True if orient is None else orient)
        a, c = (out[:, 1:], out[:, :-1]) if descending else (out[:, :-1], out[:, 1:])
        mono = (c >= a - slack[:, None]) | (a == c)
        assert mono[ok].all(), "sorted output is not monotone"
        inside = (out >= lo[:, None] - slack[:, None]) & (out <= hi[:, None] + slack[:, None])
        assert inside[ok].all(), "sorted output leaves [min x, max x]"
        if op == "soft_sort" and case.kw.get("regularization") == "l2":  # "has the mean of x"
            drift = (out.sum(-1) - xd.sum(-1)).abs()
            assert (drift <= n * slack)[finite_row].all(), "pav soft_sort changes the sum"
        if op == "soft_topk":
            w = full.weights.detach().double()
            assert (w >= -tol)[ok].all()
            total = w.sum(-1)
            assert ((total - 1).abs() <= n * tol)[ok].all(), "soft_topk weights: rows sum != 1"
    elif op == "soft_rank":
        total = out.sum(-1)
        assert ((total - n * (n + 1) / 2).abs() <= n * n * tol)[ok].all(), "ranks: sum"
        low, high = (1.0, float(n)) if case.method in ("pav", "ot") else (0.0, float(n * n))
        assert ((out >= low - n * tol) & (out <= high + n * tol))[ok].all(), "ranks: range"
        _check_ties(xd, out, ok, n * tol, "tied entries: unequal ranks")
    elif op == "soft_argsort":
        assert (out >= 0)[ok].all(), "P has a negative entry"
        assert ((out.sum(-1) - 1).abs() <= n * tol)[ok].all(), "rows of P do not sum to 1"
    elif op == "soft_quantile":
        mono = (out[1:] >= out[:-1] - slack) | (out[1:] == out[:-1])
        mono = mono | torch.isnan(out[1:]) | torch.isnan(out[:-1])  # -inf against +inf
        assert mono[:, ok].all(), "quantile is not monotone in q"
        inside = (out >= lo - slack) & (out <= hi + slack) | torch.isnan(out)
        assert inside[:, ok].all(), "quantile leaves [min x, max x]"
    elif op in ("soft_topk_mask", "soft_kmax"):
        k = k_per_row(call["k"], b, dtype)
        assert (out >= -tol)[ok].all(), "mask entry below 0"
        clipped = op == "soft_topk_mask" and case.method != "softkmax"
        if clipped:
            assert (out <= 1 + tol)[ok].all(), "mask entry above 1"
        err = (out.sum(-1) - k).abs()
        assert (err <= tol * n * torch.clamp(k, min=1))[ok].all(), "mask does not sum to k"
        if not case.stochastic:
            _check_ties(xd, out, ok, tol, "tied entries: unequal mask")
    elif op in ("smooth_max", "smooth_min"):
        sign = 1.0 if op == "smooth_max" else -1.0
        top = (sign * xd).amax(-1)
        assert (sign * out >= top)[ok].all(), f"{op} is not beyond the {op[-3:]}"
        eps = _eps_rows(call, b, torch.promote_types(dtype, torch.float32))
        bound = top + eps * math.log(n) * (1 + tol) + slack
        bound = torch.where(bound < torch.finfo(dtype).max, bound, INF)  # it may overflow dtype
        assert (sign * out <= bound)[finite_row].all(), f"{op} beyond its eps * log(n) bound"
    elif op in ("soft_argmax", "soft_argmin"):
        assert ((out >= -tol * n) & (out <= (n - 1) * (1 + tol)))[ok].all(), "index range"
    elif op == "soft_argmax_onehot":
        assert (out >= 0)[ok].all()
        assert ((out.sum(-1) - 1).abs() <= n * tol)[ok].all(), "one-hot does not sum to 1"
        _check_ties(xd, out, ok, tol, "tied entries: unequal weights")


def _check_ties(xd: torch.Tensor, out: torch.Tensor, ok: torch.Tensor, tol: float, what: str):
    """Entries of a row that are equal get equal outputs (to ``tol`` times their size)."""
    same = xd.unsqueeze(-1) == xd.unsqueeze(-2)  # (B, n, n)
    diff = (out.unsqueeze(-1) - out.unsqueeze(-2)).abs()
    size = torch.maximum(out.abs().unsqueeze(-1), out.abs().unsqueeze(-2)).clamp(min=1)
    bad = same & ~(diff <= tol * size) & ok[:, None, None]
    assert not bad.any(), what


# ------------------------------------------------------------- known defects (reported)
#
# Defects found by this suite in code its author does not own; each is reported with the
# minimal reproducer in ``test_known_defect`` below, a strict xfail (it fails once fixed: then
# delete its entry here). The property skips exactly the check each one breaks, on exactly the
# rows where it applies, and keeps every other check on those rows.


def _eps_rows(call: dict[str, Any], b: int, cd: torch.dtype) -> torch.Tensor:
    e = call["epsilon"]
    e = e.detach().double() if isinstance(e, torch.Tensor) else torch.tensor(e, dtype=F64)
    fi = torch.finfo(cd)
    return e.expand(b).clamp(fi.tiny, fi.max)


def n_of(xd: torch.Tensor) -> int:
    return xd.shape[-1]


def known_defects(case: Case, call: dict[str, Any], xd: torch.Tensor) -> dict[str, torch.Tensor]:
    """(B,) bool per check ("row": every check, "invariants", "grad_x", "grad_eps", "grad_k") of
    the rows a reported defect (or a documented limit) applies to."""
    b = xd.shape[0]
    cd = torch.promote_types(call["x"].dtype, torch.float32)
    fi = torch.finfo(cd)
    eps = _eps_rows(call, b, cd)
    fin = torch.isfinite(xd)
    none = torch.zeros(b, dtype=torch.bool)
    out = {"row": none, "grad_x": none, "grad_eps": none, "grad_k": none, "invariants": none}
    out["value"] = none  # the value against a reference (tiny_rows)
    if case.method == "softkmax" or case.op == "soft_kmax":
        # not a defect: near a tie the recursion's gradient grows like (x'/eps)**k
        # (the module docstring of softops.topk._softkmax); beyond the dtype's range it overflows
        k = k_per_row(call["k"], b)
        span = torch.where(fin, xd, -INF).amax(-1) - torch.where(fin, xd, INF).amin(-1)
        growth = k * torch.log(span.nan_to_num(0.0) / eps + 1)
        # (times the 1/eps of a derivative in the units of x)
        growth = growth + torch.log(n_of(xd) / eps).clamp(min=0)
        out["grad_x"] = out["grad_x"] | (growth > math.log(fi.max) - 10)
        out["grad_eps"] = out["grad_eps"] | (growth > math.log(fi.max) - 10)
        # and the forward amplifies the rounding of each round's weights p in the compute dtype
        # by about that growth too (the next round's logits are x'(1 - p)/eps: an error u in p
        # moves them by u x'/eps): where it takes that rounding beyond the tolerance, the value
        # is not compared with the float64 one
        loose = math.log(adv.tolerance(call["x"].dtype) / fi.eps)
        growth_x = (k - 1).clamp(min=0) * torch.log(span.nan_to_num(0.0) / (4 * eps) + 1)
        out["value"] = out["value"] | (growth_x > loose)
    if case.method != "pav":
        # not a defect: where the derivative itself (about n * scale / epsilon, in the units of
        # x; scale: the span for values, n for ranks, 1 for P and masks) is beyond the dtype,
        # the backward overflows and can be NaN (inf - inf)
        span = torch.where(fin, xd, -INF).amax(-1) - torch.where(fin, xd, INF).amin(-1)
        span = span.nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(min=1.0)
        n = float(n_of(xd))
        scale = {"soft_rank": n, "soft_argmax": n, "soft_argmin": n}.get(case.op, 1.0)
        if case.units_of_x:
            scale = span
        if case.op in ("smooth_max", "smooth_min"):
            scale = 0.0  # their derivative is a softmax: at most 1
        eps_x = eps ** (1.0 / adv.law_of(case))
        steep = n_of(xd) * scale / eps_x > fi.max / 2**10
        out["grad_x"] = out["grad_x"] | steep
        out["grad_k"] = out["grad_k"] | steep
    return out


def _forward_backward(case: Case, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(adv.DTYPES), label="dtype")
    call = _draw_call(case, data, dtype)
    note(f"reproduce: {describe(case, call)}")
    if _refused(case, call):
        return
    _check_call(case, data, call)


def _refused(case: Case, call: dict[str, Any]) -> bool:
    """Whether epsilon is below the smallest normal number of the compute dtype of x; the op
    must then raise the documented ValueError (checked here)."""
    if not adv.epsilon_refused(call["epsilon"], call["x"].dtype):
        return False
    with pytest.raises(ValueError, match=adv.refusal(case.op, call["x"].dtype)) as info:
        run(case, **call)
    assert str(info.value).endswith("."), str(info.value)
    COUNTS[("epsilon_refused", case.id)] += 1
    return True


def _check_call(case: Case, data: st.DataObject, call: dict[str, Any]) -> Any:
    """The forward (shape, dtype, the documented NaN pattern, the family's invariants) and the
    backward (NaN-free outside the NaN rows) of one call; returns the op's output."""
    x = call["x"]
    dtype = x.dtype
    b, n = x.shape
    full = run(case, **call)
    out = values_of(case, full)
    m = call["q"].shape[0] if "q" in call else 0
    assert out.dtype == dtype and out.shape == expected_shape(case, b, n, call.get("k"), m)
    xd = x.detach().double()
    rows, want = _expected_nan(case, xd, call, out)
    known = known_defects(case, call, xd)
    skip = known["row"]
    if skip.any():
        note(f"rows {skip.nonzero().flatten().tolist()}: a reported defect, not checked")
    if case.layout == "quantile":
        look = ~skip.expand(out.shape)
    else:
        look = ~skip.view(b, *([1] * (out.dim() - 1))).expand(out.shape)
    got = torch.isnan(out)
    assert got[want & look].all(), "a row the docstring makes NaN is not NaN"
    assert not got[~want & look].any(), "NaN outside the rows the docstring makes NaN"
    # Within 2**16 of the largest finite value of the compute dtype (rows holding ±finfo.max)
    # only the forward's NaN pattern is checked: the solvers' own sums and squares overflow
    # there, and the invariants and the backward are not claimed.
    cd = torch.promote_types(dtype, torch.float32)
    near_max = torch.where(torch.isfinite(xd), xd.abs(), 0).amax(-1) > torch.finfo(cd).max / 2**16
    _check_invariants(case, call, full, ~rows & ~skip & ~near_max & ~known["invariants"])
    # backward: NaN-free outside the NaN rows
    seed = data.draw(st.integers(0, 2**16), label="seed")
    note(f"upstream gradient: torch.randn({tuple(out.shape)}, generator=seeded({seed}))")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    g = torch.where(torch.isfinite(out.detach()), g.to(dtype), 0)
    names = [name for name in ("x", "epsilon", "k", "q") if _needs_grad(call.get(name))]
    if not out.requires_grad:
        return full
    with bounded(), only_convergence_warnings():
        grads = torch.autograd.grad(out, [call[v] for v in names], g, allow_unused=True)
    clean = ~rows & ~near_max & ~skip
    for name, grad in zip(names, grads, strict=True):
        if grad is None:
            continue
        if name == "x":
            keep = (clean & ~known["grad_x"])[:, None].expand(b, n)
            if case.method == "pav":  # "the gradient at an infinite entry is undefined"
                keep = keep & torch.isfinite(xd)
            assert not torch.isnan(grad[keep]).any(), "NaN in the gradient of x"
        elif name == "epsilon" and grad.dim() == 1:
            keep = clean & ~known["grad_eps"]
            assert not torch.isnan(grad[keep]).any(), "NaN in the gradient of epsilon"
        elif name == "k" and grad.dim() == 1:
            keep = clean & ~known["grad_eps"] & ~known["grad_k"]  # k enters as (x - t)/eps
            assert not torch.isnan(grad[keep]).any(), "NaN in the gradient of k"
        elif bool((clean & ~known["grad_eps"] & ~known["grad_k"]).all()):  # a shared k or q
            assert not torch.isnan(grad).any(), f"NaN in the gradient of {name}"
    return full


def _needs_grad(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.requires_grad


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_backward(case: Case) -> None:
    check("forward_backward", case, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_backward_slow(case: Case) -> None:
    check("forward_backward", case, slow=True)


# ------------------------------------------------------- property 2: only documented errors

BAD_EPSILON = [0.0, -0.0, -1.0, -1e-300, math.nan, math.inf, -math.inf, "big", True, None, 1j]
BAD_K = [-1, -0.5, math.nan, math.inf, -math.inf, True, "two", None]
BAD_Q = [-0.1, 1.5, math.nan, -math.inf, "half"]
BAD_FLAG = [1, 0, "yes"]  # (None means "the default" to the registry's Case)


def _invalid_call(case: Case, data: st.DataObject) -> dict[str, Any]:
    """A call with exactly one invalid argument (on a hostile x)."""
    dtype = data.draw(st.sampled_from(adv.DTYPES), label="dtype")
    x = data.draw(adv.batches(dtype), label="x")
    b, n = x.shape
    call: dict[str, Any] = {"x": x, "epsilon": 0.5}
    if case.op in TAKES_K:
        call["k"] = 1
    if case.op == "soft_quantile":
        call["q"] = torch.tensor([0.5], dtype=F64)
    kinds = ["epsilon", "epsilon tensor", "epsilon below the dtype", "dtype", "x", "dim"]
    if case.op in TAKES_K:
        kinds += ["k", "k above n"]
        if case.op in adv.INT_K_OPS or case.method in adv.INT_K:
            kinds.append("fractional k")
        if case.method not in ("ot", "sparse"):
            kinds.append("per-row k")
    if case.op == "soft_quantile":
        kinds += ["q", "q tensor"]
    if case.flag is not None and case.op != "soft_quantile":
        kinds.append("flag")
    if case.method is not None:
        kinds.append("method")
    if case.layout in ("reduce", "quantile"):
        kinds.append("keepdim")
    kind = data.draw(st.sampled_from(kinds), label="invalid argument")
    if kind == "epsilon":
        call["epsilon"] = data.draw(st.sampled_from(BAD_EPSILON))
    elif kind == "epsilon below the dtype":  # subnormal in the compute dtype, or 0 there
        call["epsilon"] = data.draw(st.sampled_from(adv.too_small_epsilons(dtype)))
    elif kind == "epsilon tensor":
        small = adv.too_small_epsilons(dtype)[0]
        bad = data.draw(st.sampled_from([0.0, -1.0, math.nan, math.inf, small]))
        e = torch.full((b,), 0.5, dtype=F64)
        e[data.draw(st.integers(0, b - 1))] = bad
        call["epsilon"] = e
    elif kind == "dtype":
        call["x"] = x.to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.bool])))
    elif kind == "x":
        call["x"] = data.draw(
            st.sampled_from([x.tolist(), torch.zeros(b, 0, dtype=dtype), torch.tensor(1.0)])
        )
    elif kind == "dim":
        call["dim"] = data.draw(st.sampled_from([2, -3, 7, 1.0, "0", None]))
    elif kind == "k":
        call["k"] = data.draw(st.sampled_from(BAD_K))
    elif kind == "k above n":
        call["k"] = data.draw(st.sampled_from([n + 1, n + 0.5, n + 1e-9]))
    elif kind == "fractional k":
        call["k"] = data.draw(st.sampled_from([0.5, 1.5, n - 0.5])) if n > 1 else 0.5
    elif kind == "per-row k":
        call["k"] = torch.ones(b, 2, dtype=F64)
    elif kind == "q":
        call["q"] = data.draw(st.sampled_from(BAD_Q))
    elif kind == "q tensor":
        call["q"] = data.draw(
            st.sampled_from(
                [torch.tensor([0.5, -0.25]), torch.tensor([[0.5, 0.2]]), torch.tensor([1, 0])]
            )
        )
    elif kind == "flag":
        call["orient"] = data.draw(st.sampled_from(BAD_FLAG))
    elif kind == "method":
        call["method"] = data.draw(st.sampled_from(["bogus", None, 3, "OT"]))
    elif kind == "keepdim":
        call["keepdim"] = data.draw(st.sampled_from([1, "yes", None]))
    return call


def _invalid_arguments(case: Case, data: st.DataObject) -> None:
    call = _invalid_call(case, data)
    note(f"reproduce: {describe(case, call)}" if isinstance(call["x"], torch.Tensor) else "")
    with pytest.raises((ValueError, TypeError)) as info:
        run(case, **call)
    message = str(info.value)
    assert message.startswith(f"{case.op}: expected "), message
    assert "; got " in message and message.endswith("."), message


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_arguments(case: Case) -> None:
    check("invalid_arguments", case, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_arguments_slow(case: Case) -> None:
    check("invalid_arguments", case, slow=True)


# ------------------------------------------------ property 3: gradients = finite differences

FD_STEP = 1e-5  # of the smoothing scale: truncation (1e-10) far above rounding (1e-11)
FD_RTOL = 1e-5
# soft_quantile(method="ot") takes no `tol`: its Sinkhorn stops at 1e-9 (float64), which a step
# of 1e-5 cannot see past; a step of 1e-3 can (truncation 1e-6, solver noise 1e-6)
COARSE_STEP, COARSE_RTOL = 1e-3, 1e-4
KINKED = {"pav", "sparse"}  # piecewise smooth: skip draws within a step of a kink


def _smoothing_scale(case: Case, eps: float) -> float:
    """Epsilon in the units of x (law 1: eps; 2: sqrt(eps); -1: 1/eps)."""
    return eps ** (1.0 / adv.law_of(case))


def _well_conditioned(case: Case, data: st.DataObject) -> dict[str, Any]:
    """float64 rows with gaps of at least 0.4 * scale, epsilon within a decade of the gaps."""
    n = data.draw(st.integers(2, 5 if case.layout == "square" else 6), label="n")
    b = data.draw(st.integers(1, 2), label="rows")
    scale = 10.0 ** data.draw(st.integers(-3, 3), label="log10 scale")
    rows = []
    for _ in range(b):
        perm = data.draw(st.permutations(range(n)))
        jitter = data.draw(st.lists(st.floats(0.0, 0.6), min_size=n, max_size=n))
        offset = data.draw(st.floats(-5.0, 5.0))
        rows.append([scale * (p + j + offset) for p, j in zip(perm, jitter, strict=True)])
    x = torch.tensor(rows, dtype=F64)
    log_r = data.draw(st.floats(-0.7, 1.0), label="log10(epsilon / gap**law)")
    eps = adv.epsilon_for(case, scale, log_r)
    call: dict[str, Any] = {"x": x, **case.precise}
    if case.grad_eps:
        jitter = data.draw(st.lists(st.floats(-0.3, 0.3), min_size=b, max_size=b))
        call["epsilon"] = torch.tensor([eps * 10.0**j for j in jitter], dtype=F64)
    else:
        call["epsilon"] = eps
    orient = orient_of(case, data)
    if orient is not None:
        call["orient"] = orient
    if case.op in TAKES_K:
        k: Any = data.draw(adv.k_values(case, n), label="k")
        if case.method in ("ot", "sparse") and data.draw(st.booleans(), label="k as a tensor"):
            k = torch.tensor(float(k), dtype=F64)
        call["k"] = k
    if case.op == "soft_quantile":
        cells = data.draw(st.lists(st.integers(0, n - 2), min_size=1, max_size=3))
        fracs = data.draw(st.lists(st.floats(0.1, 0.9), min_size=len(cells), max_size=3))
        q = [(c + f) / (n - 1) for c, f in zip(cells, fracs, strict=False)]
        call["q"] = torch.tensor(q, dtype=F64)
    return call


def _finite_differences(case: Case, data: st.DataObject) -> None:
    call = _well_conditioned(case, data)
    note(f"reproduce: {describe(case, call)}")
    sigma = _smoothing_scale(case, float(torch.as_tensor(call["epsilon"]).min()))
    coarse = sinkhorn_based(case) and "tol" not in case.precise
    step, rtol = (COARSE_STEP, COARSE_RTOL) if coarse else (FD_STEP, FD_RTOL)
    scale = adv.typical_gap(call["x"])
    # the differentiable inputs, their directions and steps
    names = ["x"] + [v for v in ("epsilon", "k", "q") if isinstance(call.get(v), torch.Tensor)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    steps = {}
    for name in names:
        v = torch.rand(call[name].shape, generator=gen, dtype=F64) * 2 - 1
        if name == "x":
            steps[name] = v * step * min(sigma, scale)
        elif name == "epsilon":
            steps[name] = v * step * call[name]  # relative
        else:
            steps[name] = v * step / max(1, call["x"].shape[-1])
    if "k" in steps:
        k, n = float(call["k"]), call["x"].shape[-1]
        if min(k, n - k) <= 2 * float(steps["k"].abs().max()):
            steps["k"] = steps["k"] * 0  # stay inside [0, n]

    def value(t: float) -> torch.Tensor:
        kw = dict(call)
        for name in names:
            kw[name] = call[name] + t * steps[name]
        return values_of(case, run(case, **kw))

    inputs = {name: call[name].clone().requires_grad_() for name in names}
    out = values_of(case, run(case, **{**call, **inputs}))
    w = torch.rand(out.shape, generator=gen, dtype=F64) * 2 - 1
    grads = torch.autograd.grad(out, [inputs[v] for v in names], w, allow_unused=True)
    terms = [
        (g * steps[name]).sum() if g is not None else torch.zeros((), dtype=F64)
        for name, g in zip(names, grads, strict=True)
    ]
    analytic = float(sum(terms))
    size = float(sum(t.abs() for t in terms))
    with torch.no_grad():
        g_minus, g_zero, g_plus = (float((value(t) * w).sum()) for t in (-1.0, 0.0, 1.0))
    solver = 1e-9 if coarse else 1e-12  # the forward's own accuracy, relative
    rounding = 10 * solver * float((out.detach() * w).abs().sum())
    tol = rtol * size + rounding
    # one-sided differences that disagree by more than the comparison's own tolerance: a kink
    # within a step (in any row), where the central difference cannot be compared to it
    if case.method in KINKED and abs((g_plus - g_zero) - (g_zero - g_minus)) > tol:
        note("within a step of a kink: skipped")
        COUNTS[("finite_differences_at_a_kink", case.id)] += 1  # completed, not compared
        return
    central = (g_plus - g_minus) / 2
    assert abs(central - analytic) <= tol, (central, analytic, tol)


@pytest.mark.parametrize("case", DETERMINISTIC, ids=lambda c: c.id)
def test_gradient_matches_finite_differences(case: Case) -> None:
    check("finite_differences", case, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", DETERMINISTIC, ids=lambda c: c.id)
def test_gradient_matches_finite_differences_slow(case: Case) -> None:
    check("finite_differences", case, slow=True)


# ------------------------------------ property 4: subnormal and tiny rows, proportional epsilon


def _tiny_call(case: Case, data: st.DataObject, dtype: torch.dtype) -> dict[str, Any]:
    """Rows of subnormal and tiny entries with an epsilon in proportion (or near the smallest
    normal number of the compute dtype), k and q drawn as for forward_backward."""
    x = data.draw(adv.tiny_batches(dtype), label="x")
    n = x.shape[-1]
    call: dict[str, Any] = {"x": x.requires_grad_()}
    eps = data.draw(adv.tiny_epsilon(case, x), label="epsilon")
    if isinstance(eps, torch.Tensor):
        eps.requires_grad_(case.grad_eps)
    call["epsilon"] = eps
    orient = orient_of(case, data)
    if orient is not None:
        call["orient"] = orient
    if case.op in TAKES_K:
        k: Any = data.draw(adv.k_values(case, n), label="k")
        if case.method in ("ot", "sparse") and data.draw(st.booleans(), label="k as a tensor"):
            k = torch.tensor(float(k), dtype=F64, requires_grad=True)
        call["k"] = k
    if case.op == "soft_quantile":
        qs = data.draw(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3), label="q")
        call["q"] = torch.tensor(sorted(qs), dtype=F64, requires_grad=True)
    return call


def _reference(case: Case, call: dict[str, Any]) -> torch.Tensor | None:
    """The op's value computed where every entry and gap is a normal number: float64 on the same
    x and epsilon (x of a narrower dtype); for float64 x the scaling law on ``2**p x`` (exact),
    where the case has one (in positive units of x). None where there is neither."""
    x = call["x"].detach()
    kw = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in call.items()}
    if x.dtype != F64:
        # an epsilon beyond the compute dtype is clamped to its largest value (prepare_rows)
        big = torch.finfo(adv.compute_dtype(x.dtype)).max
        e = kw["epsilon"]
        kw["epsilon"] = e.clamp(max=big) if isinstance(e, torch.Tensor) else min(e, big)
        if "k" in kw and not isinstance(kw["k"], int):  # k as the narrower dtype takes it
            k = adv.flushed_k(torch.as_tensor(kw["k"], dtype=F64), x.dtype)
            kw["k"] = k if isinstance(kw["k"], torch.Tensor) else float(k)
        kw["x"] = x.double()
        return values_of(case, run(case, **kw)).detach()
    if case.law is None or case.law <= 0:
        return None
    # row by row (a row of subnormals beside one of ordinary entries would be scaled further
    # down by the batch's power): 2**p x with the largest |entry| of the row in [1, 2), all of
    # it exact (p = 0 for a row of zeros)
    big = torch.where(torch.isfinite(x), x.abs(), 0).amax(-1)
    if not bool((big > 0).any()):
        return None
    p = torch.where(big > 0, 1 - torch.frexp(big).exponent, 0).long()  # (m 2**e, m in [.5, 1))
    e = torch.as_tensor(kw["epsilon"], dtype=F64).expand(x.shape[0])
    eps = torch.ldexp(e, p * int(case.law))
    if adv.epsilon_refused(eps, F64) or not bool((eps < 1e300).all()):
        return None
    kw["x"] = torch.ldexp(x, p.view(-1, *([1] * (x.dim() - 1))))
    kw["epsilon"] = eps
    ref = values_of(case, run(case, **kw)).detach()
    if not case.units_of_x:
        return ref
    back = p.view(1, -1) if case.layout == "quantile" else p.view(-1, *([1] * (ref.dim() - 1)))
    return torch.ldexp(ref, -back)


def _tiny_rows(case: Case, data: st.DataObject) -> None:
    """Subnormal and tiny rows: a proportionally tiny epsilon is refused below the smallest
    normal number of the compute dtype; from it on the forward and backward pass the checks of
    forward_backward, and the value equals the op's value where nothing is subnormal."""
    dtype = data.draw(st.sampled_from(adv.DTYPES), label="dtype")
    call = _tiny_call(case, data, dtype)
    note(f"reproduce: {describe(case, call)}")
    if _refused(case, call):
        return
    full = _check_call(case, data, call)
    if case.stochastic or not LAST_CALL["converged"]:
        return  # Monte-Carlo draws differ by dtype; an unconverged solve promises no value
    ref = _reference(case, call)
    if ref is None:
        return
    COUNTS[("tiny_rows_against_a_reference", case.id)] += 1
    out = values_of(case, full).detach()
    ref_in_dtype = ref.to(dtype).double()  # what the op can return at best
    xd = call["x"].detach().double()
    b = xd.shape[0]
    rows, _ = _expected_nan(case, xd, call, out)
    known = known_defects(case, call, xd)
    keep = ~rows & ~known["row"] & ~known["value"]
    if case.layout == "quantile":
        keep_out = keep.expand(out.shape)
    else:
        keep_out = keep.view(b, *([1] * (out.dim() - 1))).expand(out.shape)
    both = keep_out & torch.isfinite(ref_in_dtype)
    tol = adv.tolerance(dtype)
    if sinkhorn_based(case):
        tol = max(tol, 10 * (1e-9 if dtype == F64 else 1e-6))
    size = ref_in_dtype.abs().where(torch.isfinite(ref_in_dtype), 0)
    size = size.amax(-1, keepdim=True) if out.dim() > 1 else size
    if case.units_of_x:
        # values in the units of x (weighted sums of its entries) round relative to the row's
        # magnitude: a row whose mean cancels to 0 comes back at the rounding of its terms
        xmag = torch.where(torch.isfinite(xd), xd.abs(), 0).amax(-1)
        shape = (1, b) if case.layout == "quantile" else (b, *([1] * (out.dim() - 1)))
        size = torch.maximum(size, xmag.view(shape))
    floor = 4 * torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # one subnormal ulp
    err = (out.double() - ref_in_dtype).abs()
    bad = both & ~(err <= tol * size + floor) & ~(out.double() == ref_in_dtype)
    assert not bad.any(), (out, ref_in_dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_tiny_rows(case: Case) -> None:
    check("tiny_rows", case, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_tiny_rows_slow(case: Case) -> None:
    check("tiny_rows", case, slow=True)


# ------------------------------------------ property 5: second derivatives = finite differences

FD2_STEP, FD2_RTOL = 1e-4, 1e-5


def _first_derivative(
    case: Case, call: dict[str, Any], names: list[str], w: torch.Tensor, u: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``<grad <w, op>, u>`` at ``call`` (a 0-dim tensor on the graph) and its inputs."""
    inputs = {name: call[name].detach().clone().requires_grad_() for name in names}
    out = values_of(case, run(case, **{**call, **inputs}))
    grads = torch.autograd.grad((out * w).sum(), [inputs[v] for v in names], create_graph=True)
    return sum((g * u[v]).sum() for v, g in zip(names, grads, strict=True)), inputs


def _second_derivatives(case: Case, data: st.DataObject) -> None:
    """float64, well-conditioned draws (as finite_differences): the second derivative in every
    differentiable argument at once (x, and epsilon, k and q where they are tensors),
    ``v' H u`` by double backward, equals a central difference of the first derivative
    ``<grad, u>`` along v, to 1e-5 of its terms (a coarser step for the Sinkhorn solves that
    take no ``tol``); at a kink of PAV or "sparse" (the one-sided differences disagree) the
    comparison is skipped."""
    call = _well_conditioned(case, data)
    for name in ("epsilon", "k", "q"):
        value = call.get(name)
        if name == "epsilon" and not case.grad_eps:
            continue
        if isinstance(value, (int, float)) and (name != "k" or case.method in ("ot", "sparse")):
            call[name] = torch.tensor(float(value), dtype=F64)
    note(f"reproduce: {describe(case, call)}")
    names = ["x"] + [v for v in ("epsilon", "k", "q") if isinstance(call.get(v), torch.Tensor)]
    sigma = _smoothing_scale(case, float(torch.as_tensor(call["epsilon"]).min()))
    coarse = sinkhorn_based(case) and "tol" not in case.precise
    # (the coarse step of the first derivatives: at 10 times it the central difference's
    # truncation reached 3e-3 of the second derivative of soft_quantile "ot", above its rtol;
    # the solver's noise is in `rounding` below, whatever the step)
    step, rtol = (COARSE_STEP, COARSE_RTOL) if coarse else (FD2_STEP, FD2_RTOL)
    scale = adv.typical_gap(call["x"])
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    n = call["x"].shape[-1]
    unit = {"x": min(sigma, scale), "k": 1 / n, "q": 1 / n}

    def direction(name: str, size: float) -> torch.Tensor:
        v = torch.rand(call[name].shape, generator=gen, dtype=F64) * 2 - 1
        return v * size * (call[name] if name == "epsilon" else unit[name])

    u = {name: direction(name, 1.0) for name in names}
    v = {name: direction(name, step) for name in names}
    if "k" in v:
        k = float(call["k"])
        if min(k, n - k) <= 2 * float(v["k"].abs().max()) + 2 * float(u["k"].abs().max()):
            v["k"], u["k"] = v["k"] * 0, u["k"] * 0  # stay inside [0, n]
    out = values_of(case, run(case, **call))
    w = torch.rand(out.shape, generator=gen, dtype=F64) * 2 - 1

    first, inputs = _first_derivative(case, call, names, w, u)
    if not first.requires_grad:  # the first derivative is constant (PAV's ranks in x, say)
        hv: list[torch.Tensor | None] = [None] * len(names)
    else:
        with bounded():
            hv = list(torch.autograd.grad(first, [inputs[m] for m in names], allow_unused=True))
    terms = [
        (h * v[m]).sum() if h is not None else torch.zeros((), dtype=F64)
        for m, h in zip(names, hv, strict=True)
    ]
    analytic = float(sum(terms))
    size = float(sum(t.abs() for t in terms))

    def first_at(t: float) -> float:
        shifted = {**call, **{m: call[m] + t * v[m] for m in names}}
        return float(_first_derivative(case, shifted, names, w, u)[0].detach())

    g_minus, g_zero, g_plus = (first_at(t) for t in (-1.0, 0.0, 1.0))
    solver = 1e-9 if coarse else 1e-12
    # the forward's accuracy, in units of the first derivative's terms
    rounding = 10 * solver * (abs(g_zero) + float((out.detach() * w).abs().sum()) * step)
    tol = rtol * size + rounding + 1e-13 * abs(g_zero)
    # at a kink the one-sided slopes differ by O(1) of themselves; a smooth G's by O(step)
    slope = max(abs(g_plus - g_zero), abs(g_zero - g_minus))
    if case.method in KINKED and abs((g_plus - g_zero) - (g_zero - g_minus)) > tol + 1e-2 * slope:
        note("within a step of a kink: skipped")
        COUNTS[("second_derivatives_at_a_kink", case.id)] += 1
        return
    central = (g_plus - g_minus) / 2
    assert abs(central - analytic) <= tol, (central, analytic, tol)


@pytest.mark.parametrize("case", DETERMINISTIC, ids=lambda c: c.id)
def test_second_derivatives_match_finite_differences(case: Case) -> None:
    check("second_derivatives", case, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", DETERMINISTIC, ids=lambda c: c.id)
def test_second_derivatives_match_finite_differences_slow(case: Case) -> None:
    check("second_derivatives", case, slow=True)


SINKHORN = Case("solvers.sinkhorn", law=1.0)  # a label for the counts and the solver's checks


def _sinkhorn_second_derivatives(case: Case, data: st.DataObject) -> None:
    """``softops.solvers.sinkhorn`` (float64): the second derivative of ``<w, plan>`` in the cost
    and a per-row epsilon, ``v' H u`` by double backward, equals a central difference of the
    first derivative along v, to 1e-5 of its terms."""
    from softops.solvers import sinkhorn

    b = data.draw(st.integers(1, 2), label="rows")
    n = data.draw(st.integers(2, 5), label="n")
    m = data.draw(st.integers(2, 4), label="m")
    scale = 10.0 ** data.draw(st.integers(-3, 3), label="log10 scale")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    cost = torch.rand(b, n, m, generator=gen, dtype=F64) * scale
    a = torch.rand(b, n, generator=gen, dtype=F64) + 0.2
    bm = torch.rand(b, m, generator=gen, dtype=F64) + 0.2
    bm = bm * a.sum(-1, keepdim=True) / bm.sum(-1, keepdim=True)
    eps = scale * 10.0 ** torch.empty(b, dtype=F64).uniform_(-0.7, 0.7, generator=gen)
    newton = data.draw(st.booleans(), label="newton")
    note(f"cost={cost.tolist()!r}, a={a.tolist()!r}, b={bm.tolist()!r}, eps={eps.tolist()!r}")

    def plan(c: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        with bounded(), only_convergence_warnings():
            return sinkhorn(c, a, bm, e, tol=1e-13, max_iter=10**4, newton=newton).plan

    w = torch.rand(b, n, m, generator=gen, dtype=F64) * 2 - 1
    u = (
        (torch.rand(b, n, m, generator=gen, dtype=F64) * 2 - 1) * scale,
        eps * (torch.rand(b, generator=gen, dtype=F64) * 2 - 1),
    )
    v = (
        (torch.rand(b, n, m, generator=gen, dtype=F64) * 2 - 1) * scale * FD2_STEP,
        (eps * FD2_STEP * (torch.rand(b, generator=gen, dtype=F64) * 2 - 1)),
    )

    def first(c: torch.Tensor, e: torch.Tensor, graph: bool) -> tuple[torch.Tensor, ...]:
        c, e = c.detach().clone().requires_grad_(), e.detach().clone().requires_grad_()
        gc, ge = torch.autograd.grad((plan(c, e) * w).sum(), [c, e], create_graph=graph)
        return (gc * u[0]).sum() + (ge * u[1]).sum(), c, e

    g, c, e = first(cost, eps, True)
    hc, he = torch.autograd.grad(g, [c, e])
    terms = [(hc * v[0]).sum(), (he * v[1]).sum()]
    analytic = float(sum(terms))
    size = float(sum(t.abs() for t in terms))
    g_plus = float(first(cost + v[0], eps + v[1], False)[0])
    g_minus = float(first(cost - v[0], eps - v[1], False)[0])
    central = (g_plus - g_minus) / 2
    tol = FD2_RTOL * size + 1e-10 * abs(float(g.detach()))
    assert abs(central - analytic) <= tol, (central, analytic, tol)


def test_sinkhorn_second_derivatives() -> None:
    check("sinkhorn_second_derivatives", SINKHORN, slow=False)


@pytest.mark.slow
def test_sinkhorn_second_derivatives_slow() -> None:
    check("sinkhorn_second_derivatives", SINKHORN, slow=True)


PROPERTIES = {
    "forward_backward": _forward_backward,
    "invalid_arguments": _invalid_arguments,
    "finite_differences": _finite_differences,
    "tiny_rows": _tiny_rows,
    "second_derivatives": _second_derivatives,
    "sinkhorn_second_derivatives": _sinkhorn_second_derivatives,
}


# ------------------------------------------------ the reported defects, as strict xfails


KNOWN_DEFECTS: dict[str, tuple[Any, str]] = {}
"""Open: none. Fixed: KD25 (the PAV sort's frame capped 1 / eps where double could not hold n runs G
apart: the projection now runs on the gaps of z, _core/isotonic.py and _isotonic_kernel.cpp), KD28
(NeuralSort's s / eps saturated at a tiny epsilon beside a huge span: sort/_neuralsort.py now
scales the gaps by it below max times exact powers of two), KD27 (smooth.py), KD13
(topk/_sinkhorn.py), KD14, KD15 and KD16 (topk/_sparse.py), KD17 (_core/sinkhorn.py), KD18 (PAV l2,
_core/isotonic.py and _isotonic_kernel.cpp), KD19 (sort "ot", softsort l2 and neuralsort:
sort/_chunked.py), KD20, KD21 and KD26 (topk/_softkmax.py), KD22 (the PAV rank's z = x / eps beyond
the dtype: sort/_pav.py, _core/isotonic.py and _isotonic_kernel.cpp), KD23 (NeuralSort's logits
rounded on n * span: sort/_neuralsort.py) and KD24 (the PAV sort's cap on 1 / eps, not hard where a
gap of x reaches it: the sort now takes the rank's frame, in the same files as KD22), whose
reproducers are regression tests for their classes in tests/topk/test_sinkhorn_extremes.py,
tests/topk/test_sparse.py, tests/core/test_sinkhorn.py, tests/sort/test_pav_extremes.py,
tests/sort/test_ot_extremes.py, tests/topk/test_softkmax.py and tests/sort/test_neuralsort.py."""


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)
        )
        for name, (_, reason) in KNOWN_DEFECTS.items()
    ],
)
def test_known_defect(name: str) -> None:
    KNOWN_DEFECTS[name][0]()
