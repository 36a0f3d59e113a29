"""Hypothesis strategies and oracles for the adversarial suite (``tests/test_adversarial.py``).

Rows are drawn in float64 from pools of hostile values (ties, ±1e30, the dtype's extremes and
denormals, ±inf, NaN) and then cast to the dtype under test, so what the op sees is what the dtype
can hold (1e30 is ``inf`` in float16, a float32 denormal is 0 there). Everything an oracle needs is
read off the cast tensor. Epsilon is drawn relative to the row's gaps, in the units the registry's
scaling law gives it: ``epsilon = r * gap**law`` with ``r`` from 1e-8 to 1e8.

Rows of subnormal and tiny magnitude (``tiny_batches``) come with a proportionally tiny epsilon
(``tiny_epsilon``): below the smallest normal number of the compute dtype the op must refuse it
(``epsilon_refused``, ``refusal``), from it on give the value. k includes values that round to 0
or n in the dtype (``TINY_K``, ``BELOW_N``). The suite's hypothesis profiles, default and slow,
are registered here (``PROFILES``).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from softops._core.validation import SMALLEST_K, smallest_epsilon

F64 = torch.float64
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Per output dtype: the relative rounding of one cast (float16/bfloat16 are computed in float32
# and cast back), with a margin for the few operations between the solver and the cast.
ROUNDING = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5, F64: 1e-10}

INF = math.inf
# Integer-valued k (the methods and ops that take only an int k).
INT_K = {"softkmax", "perturbed"}
INT_K_OPS = {"soft_topk", "soft_kmax"}

# k that rounds to 0 (below the smallest normal float32, or 0 in float32: the limit k -> 0 by
# contract) or is just above that bound; n minus these rounds to n in float32 (not in float64).
TINY_K = (5e-324, 1e-45, 1e-40, SMALLEST_K / 2, SMALLEST_K * (1 - 2**-30), SMALLEST_K, 1e-30)
BELOW_N = (1e-9, 1e-12, 2.0**-30)

# -------------------------------------------------------------------------------- profiles

PROFILES = {"default": "softops-adversarial", "slow": "softops-adversarial-slow"}
"""The suite's hypothesis profiles: the same settings (derandomized, no database, no deadline:
time is bounded per call), the slow one with 10**4 examples per property and registry entry
unless a property asks for fewer (``tests.test_adversarial.EXAMPLES``)."""
_SETTINGS: dict[str, Any] = {
    "derandomize": True,
    "database": None,
    "deadline": None,
    "print_blob": False,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile(PROFILES["default"], max_examples=100, **_SETTINGS)
settings.register_profile(PROFILES["slow"], max_examples=10**4, **_SETTINGS)


def profile(slow: bool, max_examples: int | None = None) -> settings:
    """The settings of the default or the slow profile (with ``max_examples`` when given)."""
    base = settings.get_profile(PROFILES["slow" if slow else "default"])
    return base if max_examples is None else settings(base, max_examples=max_examples)


def hostile_values(dtype: torch.dtype) -> list[float]:
    """The dtype's extremes, denormals and friends, as float64 numbers."""
    fi = torch.finfo(dtype)
    sub = fi.smallest_normal / 4  # a denormal of the dtype
    return [
        0.0,
        -0.0,
        1e30,
        -1e30,
        1e-30,
        fi.max,
        -fi.max,
        fi.max / 4,
        fi.smallest_normal,
        -fi.smallest_normal,
        sub,
        -sub,
        5e-324,  # float64's smallest denormal (0 in every other dtype)
        1e-310,
        1e-40,  # a float32/bfloat16 denormal
        6e-8,  # a float16 denormal
        1.0,
        1.0 + fi.eps,  # a tie after a cast to a coarser dtype
        -1.0,
        3.0,
    ]


@st.composite
def row_values(
    draw: st.DrawFn, dtype: torch.dtype, n: int, *, nonfinite: bool = True
) -> list[float]:
    """One row of n float64 numbers: plain, tied, huge, tiny, or a mix, maybe with ±inf/NaN."""
    style = draw(st.sampled_from(["plain", "ties", "hostile", "mixed", "spread", "far"]))
    scale = 10.0 ** draw(st.integers(-6, 6))
    plain = st.floats(-1.0, 1.0, allow_nan=False).map(lambda v: v * scale)
    hostile = st.sampled_from(hostile_values(dtype))
    if style == "plain":
        vals = draw(st.lists(plain, min_size=n, max_size=n))
    elif style == "ties":
        pool = draw(st.lists(plain, min_size=1, max_size=max(1, n // 2)))
        vals = draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n))
    elif style == "hostile":
        vals = draw(st.lists(hostile, min_size=n, max_size=n))
    elif style == "spread":  # gaps over many orders of magnitude
        exps = draw(st.lists(st.integers(-300, 300), min_size=n, max_size=n))
        signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n))
        vals = [s * 10.0**e for s, e in zip(signs, exps, strict=True)]
    elif style == "far":  # one entry far from the others, and an infinity (KD26)
        vals = draw(st.lists(plain, min_size=n, max_size=n))
        top = math.frexp(torch.finfo(dtype).max)[1] - 1
        i = draw(st.integers(0, n - 1))
        vals[i] = draw(st.sampled_from([-1.0, 1.0])) * 2.0 ** draw(st.integers(top // 2, top))
        if nonfinite and n > 1:
            vals[(i + 1) % n] = draw(st.sampled_from([INF, -INF]))
    else:
        vals = draw(st.lists(st.one_of(plain, hostile), min_size=n, max_size=n))
    if nonfinite and draw(st.integers(0, 3)) == 0:  # a quarter of the rows hold ±inf or NaN
        for _ in range(draw(st.integers(1, n))):
            i = draw(st.integers(0, n - 1))
            vals[i] = draw(st.sampled_from([INF, -INF, INF, -INF, math.nan]))
    return vals


@st.composite
def batches(
    draw: st.DrawFn, dtype: torch.dtype, *, n_min: int = 1, n_max: int = 8, nonfinite: bool = True
) -> torch.Tensor:
    """A (B, n) batch in ``dtype``: 1 to 3 rows drawn independently (a NaN row beside clean ones
    checks that NaN stays in its row)."""
    n = draw(st.integers(n_min, n_max))
    b = draw(st.integers(1, 3))
    rows = [draw(row_values(dtype, n, nonfinite=nonfinite)) for _ in range(b)]
    return torch.tensor(rows, dtype=F64).to(dtype)


def typical_gap(x: torch.Tensor) -> float:
    """The median positive gap between the sorted distinct finite entries of x (any shape), in
    float64; the largest |x| (or 1) when there is no such gap."""
    v = x.detach().double().flatten()
    v = torch.unique(v[torch.isfinite(v)])  # sorted
    gaps = v.diff()
    gaps = gaps[(gaps > 0) & torch.isfinite(gaps)]
    if gaps.numel():
        return float(gaps.median())
    big = float(v.abs().max()) if v.numel() else 0.0
    return big if 0 < big < INF else 1.0


def law_of(case: Any) -> float:
    """The exponent that gives a case's epsilon its units (1: units of x, 2: x², -1: 1/x)."""
    if case.law is not None:
        return float(case.law)
    return -1.0 if case.op in ("soft_sort", "soft_quantile") else 1.0  # pav kl: as pav l2


def epsilon_for(case: Any, gap: float, log10_r: float) -> float:
    """``10**log10_r * gap**law``, kept inside float64's normal range (a valid epsilon)."""
    law = law_of(case)
    with_gap = math.log10(gap) * law if gap > 0 else 0.0
    e = log10_r + with_gap
    return 10.0 ** min(max(e, -300.0), 300.0)


@st.composite
def k_values(draw: st.DrawFn, case: Any, n: int) -> float | int:
    """k in {0, 1, n-1, n} (those the op accepts), a random k, a real k near them, or (where the
    method takes a real k) one that rounds to 0 or to n in the dtype (``TINY_K``, ``BELOW_N``)."""
    low = 1 if case.op == "soft_topk" else 0
    ints = sorted({v for v in (0, 1, n - 1, n, draw(st.integers(low, n))) if low <= v <= n})
    k = draw(st.sampled_from(ints))
    integer = case.op in INT_K_OPS or case.method in INT_K
    if integer:
        return int(k)
    kind = draw(st.sampled_from(["int", "int", "near", "near", "tiny", "rounds to n"]))
    if kind == "int":
        return int(k)
    if kind == "tiny":
        return draw(st.sampled_from(TINY_K))
    if kind == "rounds to n":
        return float(n) - draw(st.sampled_from(BELOW_N))
    delta = draw(st.sampled_from([1e-9, 1e-6, 0.25, 0.5]))
    real = k + draw(st.sampled_from([-delta, delta]))
    return float(min(max(real, 0.0), float(n)))


def flushed_k(k: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """k as an op on x of ``dtype`` takes it (``check_k``): below the smallest normal number of
    x's compute dtype (float32's where ``dtype`` is None), its limit 0."""
    tiny = SMALLEST_K if dtype is None else torch.finfo(compute_dtype(dtype)).tiny
    return torch.where((k > 0) & (k < tiny), 0.0, k)


# ------------------------------------------------------------------- tiny rows, tiny epsilon

F64_TINY = torch.finfo(F64).tiny


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def too_small_epsilons(dtype: torch.dtype) -> list[float]:
    """Positive epsilons below the smallest normal number of the compute dtype of x: subnormal
    there, or (float32) rounding to 0."""
    tiny = smallest_epsilon(dtype)
    small = [tiny / 2, tiny * (1 - 2**-20), 5e-324]  # (1 - 2**-30: rounds to tiny in float32)
    if compute_dtype(dtype) == torch.float32:
        small += [1e-40, 1e-50]
    return small


def epsilon_refused(epsilon: float | torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether an op on x of ``dtype`` refuses ``epsilon`` (positive and finite) as too small:
    a number, or any entry of a tensor (compared in its own dtype, as the op compares it)."""
    tiny = smallest_epsilon(dtype)
    if isinstance(epsilon, torch.Tensor):
        return bool((epsilon.detach() < tiny).any())
    if compute_dtype(dtype) == torch.float32 and epsilon < 1:  # as float32 holds the number
        epsilon = struct.unpack("f", struct.pack("f", epsilon))[0]
    return epsilon < tiny


def refusal(op: str, dtype: torch.dtype) -> str:
    """The start of the message of that refusal, as a regex: it names the op, the smallest
    allowed epsilon and the compute dtype."""
    name = str(compute_dtype(dtype)).removeprefix("torch.")
    bound = f"{smallest_epsilon(dtype):.8g}"
    return rf"^{op}: expected `epsilon` >= {bound} \(the smallest normal {name}"


@st.composite
def tiny_batches(draw: st.DrawFn, dtype: torch.dtype, n_max: int = 6) -> torch.Tensor:
    """A (B, n) batch of subnormal and tiny-magnitude entries of ``dtype``: ``m * 2**e * tiny``
    with |m| < 1 (a few bits or many) and e from below the subnormals to 30, one magnitude per
    row or a mix, with ties and zeros; or such a row beside entries of ordinary to huge
    magnitude ("far": |x| / epsilon beyond the dtype at a tiny epsilon, KD22, and gaps of x near
    1 / epsilon there, KD24); or a batch of
    longer rows (up to 4 n_max) of small gaps, some tied, beside far entries ("cluster": a span
    of up to 2**60 gaps, KD23)."""
    fi = torch.finfo(dtype)
    low = -round(-math.log2(fi.eps)) - 1  # 2**low * tiny: below the smallest subnormal
    top = math.frexp(fi.max)[1] - 2  # 2**top: a quarter of the largest value
    n = draw(st.integers(1, n_max))
    b = draw(st.integers(1, 3))
    cluster = draw(st.integers(0, 5)) == 0  # the whole batch (its rows have one length)
    if cluster:
        n = draw(st.integers(3, 4 * n_max))
    styles = ["one scale", "mixed scales", "ties", "few bits", "far"]
    rows = []
    for _ in range(b):
        style = "cluster" if cluster else draw(st.sampled_from(styles))
        e0 = draw(st.integers(low, 30))
        vals = []
        if style == "cluster":  # multiples of one small gap (ties among them), far entries
            gap = 2.0 ** draw(st.integers(0, 30)) * fi.tiny
            base = draw(st.integers(-4, 4)) * gap
            steps = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
            vals = [base + k * gap for k in steps]
            for _ in range(draw(st.integers(1, max(1, n // 4)))):
                i = draw(st.integers(0, n - 1))
                far = gap * 2.0 ** draw(st.integers(10, 60))
                vals[i] = draw(st.sampled_from([-1.0, 1.0])) * min(far, 2.0**top)
            rows.append(vals)
            continue
        for _ in range(n):
            e = e0 if style != "mixed scales" else draw(st.integers(low, 30))
            m = draw(st.floats(-1.0, 1.0, allow_nan=False))
            if style == "few bits":
                m = round(m * 8) / 8
            vals.append(m * 2.0**e * fi.tiny)
        if style == "ties":
            vals = [draw(st.sampled_from(vals[: max(1, n // 2)])) for _ in range(n)]
        if style == "far":  # one or two entries of ordinary to huge magnitude
            # (half of them within 2**8 of a quarter of the largest value, where a gap of x
            # reaches 1 / epsilon at the smallest epsilon: the PAV sort's rho / eps, KD24)
            edge = draw(st.booleans())
            for _ in range(draw(st.integers(1, 2))):
                i = draw(st.integers(0, n - 1))
                m = draw(st.floats(0.5, 1.0)) * draw(st.sampled_from([-1.0, 1.0]))
                vals[i] = m * 2.0 ** draw(st.integers(top - 8 if edge else -4, top))
        rows.append(vals)
    return torch.tensor(rows, dtype=F64).to(dtype)


@st.composite
def tiny_epsilon(draw: st.DrawFn, case: Any, x: torch.Tensor) -> float | torch.Tensor:
    """Epsilon proportional to the rows' gaps (``r * gap**law``, r within 1e3 of 1) or a few
    binades either side of the smallest normal number of the compute dtype; a number or a
    per-row float64 tensor (inside float64's normal range)."""
    tiny = smallest_epsilon(x.dtype)

    def one() -> float:
        if draw(st.booleans()):
            return epsilon_for(case, typical_gap(x), draw(st.floats(-3.0, 3.0)))
        return max(tiny * 2.0 ** draw(st.integers(-8, 12)), F64_TINY)

    if draw(st.booleans()):
        return one()
    return torch.tensor([one() for _ in range(x.shape[0])], dtype=F64)


# -------------------------------------------------------------------------------- oracles


def pinned(x: torch.Tensor, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x (B, n): (#entries always selected, #entries that can be selected)."""
    sure = (x == (INF if largest else -INF)).sum(-1)
    possible = (x != (-INF if largest else INF)).sum(-1)
    return sure, possible


def nan_rows(
    case: Any, x: torch.Tensor, k: torch.Tensor | None, orient: bool | None
) -> torch.Tensor:
    """(B,) bool: the rows the docstrings say are NaN (every entry of the row's output)."""
    out = torch.isnan(x).any(-1)
    fine = ~out
    op = case.op
    if op in ("soft_topk_mask", "soft_kmax", "soft_topk"):
        largest = True if orient is None else orient
        sure, possible = pinned(x, largest)
        if op == "soft_topk":  # "a row with fewer than k selectable entries"
            bad = possible < k
        else:  # more than k entries pinned, or fewer than k above the never-selected side
            bad = (sure > k) | (possible < k)
        out = out | (fine & bad)
    elif op in ("soft_argmax", "soft_argmax_onehot"):
        out = out | (x == -INF).all(-1)
    elif op == "soft_argmin":
        out = out | (x == INF).all(-1)
    elif case.method == "pav" and op in ("soft_sort", "soft_quantile"):
        both = (x == INF).any(-1) & (x == -INF).any(-1)
        if case.kw.get("regularization", "l2") == "l2":
            out = out | both  # "the limit depends on their rates and the row is NaN"
    return out


def quantile_nan(sorted_rows: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(m, B) bool: where interpolating ``sorted_rows`` (B, n) ascending at q is undefined:
    between ``-inf`` and ``+inf`` with a weight strictly inside (0, 1), the position
    ``q (n - 1)`` computed in ``dtype`` as the op computes it."""
    n = sorted_rows.shape[-1]
    pos = q.to(dtype) * (n - 1)
    lo = pos.floor().clamp(0, n - 1).long()
    hi = (lo + 1).clamp(max=n - 1)
    frac = pos - lo.to(dtype)
    a = sorted_rows[:, lo].T  # (m, B)
    b = sorted_rows[:, hi].T
    inside = ((frac > 0) & (frac < 1))[:, None]
    return inside & (a == -INF) & (b == INF)


def tolerance(dtype: torch.dtype) -> float:
    return ROUNDING[dtype]
