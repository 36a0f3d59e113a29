r"""Quality of each method: its distance to the hard operator, and how right its gradient is.

Every suite with a hard operator (top-k, sort, smooth) has a quality section: for each method
:math:`f_\varepsilon` and each epsilon of a sweep, on rows ``x ~ N(0, 1)``,

**Distance to the hard op**, the mean over rows of a per-row distance :math:`D` between the
method's output and the hard operator's :math:`h(x)` (a :class:`Metric`; float32, as benched):

* top-k masks: :math:`\|A - \mathbb{1}[\mathrm{topk}]\|_1`, out of 2k (``"mask L1"``); the sorted
  top-k's weights against the one-hots of ``torch.topk``'s indices, out of 2k (``"weights L1"``);
* sort: the mean absolute error per entry of the soft-sorted values against ``torch.sort``
  (``"sort MAE"``, units of x) and of the soft ranks against the hard 1-based ranks (``"rank
  MAE"``, in ranks);
* smooth: :math:`|f - \max x|` (``"abs error"``, units of x) for smooth max/min, the distance
  to the hard index for soft argmax/argmin (``"index error"``), the L1 distance to the one-hot
  for ``soft_argmax_onehot`` (out of 2) and the mask L1 for ``soft_kmax``.

The largest entry of each output is kept too (a mask entry above 1 is a defect of "softkmax").

**Gradient cosine.** For a fixed random ``g`` of the output's shape and each row ``b``, the
method's backward gives :math:`a_b = \nabla_{x_b} \langle g_b, f_\varepsilon(x_b)\rangle`, and a
*reference* gives :math:`r_b`; the record holds the mean and the minimum over rows of
:math:`\cos(a_b, r_b) = \langle a_b, r_b\rangle / (\|a_b\| \|r_b\|)`, on a small float64 problem
(rows where both are zero, the hard limit, are left out and counted). The reference is
the exact gradient of *the operator the method computes*, obtained independently of the
library's backward (a :class:`Reference`):

* **unrolled** (the OT methods: the "ot" and "sinkhorn" masks, the sorted top-k, the OT sort):
  plain autograd through log-domain Sinkhorn iterations of the same entropic OT problem
  (:mod:`softops.testing`), run until it has converged: the number of iterations is
  doubled from 256 until two runs agree to 1e-11, up to a cap; where it does not converge
  there, the reference falls back to central finite differences of the method's exact solve.
  For "sinkhorn-200" (the paper's fixed 200 iterations) the reference is the converged problem,
  so its cosine also measures the truncated solve;
* **finite differences**: central differences in float64, :math:`(F(x + h e_i) - F(x - h e_i))
  / 2h` of :math:`F = \langle g, f_\varepsilon\rangle`, with :math:`h = 10^{-6} \min(1,
  \varepsilon)` (at least 1e-9), all 2n shifted rows in one batched call (every method here
  treats rows independently), and iterative solvers run to machine precision; used for the
  closed-form relaxations (softkmax, sparse, pav, softsort, neuralsort, torchsort, entmax);
* **analytic**: the closed-form gradient, where one exists (the softmax family:
  :math:`\nabla \varepsilon \log\sum e^{x/\varepsilon} = \mathrm{softmax}(x/\varepsilon)`, and
  so on);
* **Monte Carlo** ("perturbed", whose gradient is itself an estimate): the same estimator with
  20,000 draws from another seed, the gradient of the smoothed expectation to about 1 %.

:func:`run_quality` sweeps a suite's :class:`QualitySpec` and returns one record per method and
epsilon; :func:`quality_markdown` and :func:`plot_quality` render them, and
:func:`write_quality` writes ``<stem>-quality.{jsonl,md,png}``.
"""

from __future__ import annotations

import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.model import failure_status, functional_weights
from benchmarks.report import (
    log_log_axes,
    new_figure,
    reproduce_lines,
    save_figure,
    write_report,
)

__all__ = [
    "Metric",
    "QualityMethod",
    "QualitySpec",
    "Reference",
    "analytic",
    "finite_differences",
    "grad_cosine",
    "measure_distance",
    "monte_carlo",
    "plot_quality",
    "quality_markdown",
    "run_quality",
    "unrolled",
    "write_quality",
]

UNROLLED_START = 256
"""The first iteration count of the unrolled references' convergence search."""
UNROLLED_CAP = 8192
"""The most iterations an unrolled reference is differentiated through."""
UNROLLED_TOL = 1e-11
"""Two unrolled runs (N and 2N iterations) closer than this, relative to the output's scale,
count as converged."""
MC_SAMPLES = 20_000
"""The draws of the Monte-Carlo reference of the perturbed method."""

Fn = Callable[[Tensor, float], Tensor]


# ----------------------------------------------------------------------------------------------
# Metrics


@dataclass(frozen=True)
class Metric:
    """A per-row distance between an output and the hard operator's.

    Attributes:
        name: the label in the reports (``"mask L1"``).
        unit: what it is measured in (``"of 2k"``, ``"units of x"``, ``"ranks"``).
        fn: ``(out, hard) -> (B,)`` distances.
    """

    name: str
    unit: str
    fn: Callable[[Tensor, Tensor], Tensor]


def _l1(out: Tensor, hard: Tensor) -> Tensor:
    return (out.double() - hard.double()).abs().flatten(1).sum(-1)


def _mae(out: Tensor, hard: Tensor) -> Tensor:
    return (out.double() - hard.double()).abs().flatten(1).mean(-1)


def _abs(out: Tensor, hard: Tensor) -> Tensor:
    return (out.double() - hard.double()).abs().reshape(out.shape[0], -1).sum(-1)


MASK_L1 = Metric("mask L1", "of 2k", _l1)
WEIGHTS_L1 = Metric("weights L1", "of 2k", _l1)
ONEHOT_L1 = Metric("one-hot L1", "of 2", _l1)
SORT_MAE = Metric("sort MAE", "units of x", _mae)
RANK_MAE = Metric("rank MAE", "ranks", _mae)
ABS_ERROR = Metric("abs error", "units of x", _abs)
INDEX_ERROR = Metric("index error", "indices", _abs)


# ----------------------------------------------------------------------------------------------
# References


@dataclass(frozen=True)
class Reference:
    """How a method's reference gradient is computed.

    Attributes:
        kind: ``"unrolled"``, ``"finite differences"``, ``"analytic"`` or ``"Monte Carlo"``.
        grad: ``(x, eps, g) -> (r, label)``: the reference gradient of ``<g, f(x)>`` with
            respect to the float64 ``x`` (B, n), and the label of what was used (an unrolled
            reference that falls back to finite differences says so).
    """

    kind: str
    grad: Callable[[Tensor, float, Tensor], tuple[Tensor, str]]


def _fd_step(eps: float) -> float:
    return max(1e-9, 1e-4 * min(1.0, eps))


def finite_differences(fn: Fn) -> Reference:
    """Central finite differences in float64 of ``<g, fn(x, eps)>``, every coordinate at once.

    ``fn`` must treat rows independently (the 2n shifted copies of each row are one batch).

    Example:
        >>> import torch
        >>> from benchmarks.quality import finite_differences
        >>> ref = finite_differences(lambda x, eps: (x / eps).sin())
        >>> x = torch.tensor([[0.1, 0.2]], dtype=torch.float64)
        >>> g = torch.ones(1, 2, dtype=torch.float64)
        >>> r, label = ref.grad(x, 1.0, g)
        >>> torch.allclose(r, x.cos(), atol=1e-8), label
        (True, 'central finite differences (float64)')
    """

    def grad(x: Tensor, eps: float, g: Tensor) -> tuple[Tensor, str]:
        B, n = x.shape
        h = _fd_step(eps)
        shift = h * torch.eye(n, dtype=x.dtype, device=x.device)
        rows = torch.cat(
            [(x.unsqueeze(1) + shift).reshape(B * n, n), (x.unsqueeze(1) - shift).reshape(B * n, n)]
        )
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn(rows, eps)
        plus, minus = out[: B * n], out[B * n :]
        diff = (plus - minus).reshape(B, n, *out.shape[1:]) * g.unsqueeze(1)
        return diff.reshape(B, n, -1).sum(-1) / (2 * h), "central finite differences (float64)"

    return Reference("finite differences", grad)


def analytic(fn: Callable[[Tensor, float, Tensor], Tensor], label: str) -> Reference:
    """A closed-form reference gradient ``fn(x, eps, g)``, named ``label``."""
    return Reference("analytic", lambda x, eps, g: (fn(x, eps, g), label))


def _autograd(fn: Fn, x: Tensor, eps: float, g: Tensor) -> Tensor:
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = fn(x, eps)
        (grad,) = torch.autograd.grad((out * g).sum(), x, allow_unused=True)
    return torch.zeros_like(x) if grad is None else grad


def unrolled(
    solve: Callable[[Tensor, float, int], Tensor],
    fallback: Fn,
    label: str,
    *,
    cap: int = UNROLLED_CAP,
) -> Reference:
    """Plain autograd through ``solve(x, eps, n_iter)`` (unrolled Sinkhorn), once converged.

    The iteration count doubles from :data:`UNROLLED_START` until the outputs of N and 2N
    iterations agree to :data:`UNROLLED_TOL` (relative to the output's largest entry); the
    gradient is then taken through 2N iterations. Past ``cap``, central finite differences of
    ``fallback`` (the method's exact solve) are the reference instead.
    """
    fd = finite_differences(fallback)

    def grad(x: Tensor, eps: float, g: Tensor) -> tuple[Tensor, str]:
        n_iter = UNROLLED_START
        with torch.no_grad():
            previous = solve(x, eps, n_iter)
            while 2 * n_iter <= cap:
                current = solve(x, eps, 2 * n_iter)
                scale = 1.0 + float(current.abs().max())
                n_iter *= 2
                if float((current - previous).abs().max()) <= UNROLLED_TOL * scale:
                    ref = _autograd(functools.partial(_call_n, solve, n_iter=n_iter), x, eps, g)
                    return ref, f"{label}, {n_iter} iterations (autograd)"
                previous = current
        r, _ = fd.grad(x, eps, g)
        return r, f"central finite differences (float64): {label} not converged in {cap}"

    return Reference("unrolled", grad)


def _call_n(
    solve: Callable[[Tensor, float, int], Tensor], x: Tensor, eps: float, *, n_iter: int
) -> Tensor:
    return solve(x, eps, n_iter)


def monte_carlo(fn: Fn, label: str) -> Reference:
    """The gradient of ``fn`` (a high-sample version of a Monte-Carlo method) by its backward."""
    return Reference("Monte Carlo", lambda x, eps, g: (_autograd(fn, x, eps, g), label))


ZERO_ROW = 1e-9
"""A row's gradient counts as zero when its norm is at most this fraction of the largest
reference row norm of the batch (rounding leaves ~1e-30 where the true gradient is 0)."""
ZERO_SCALE = 1e-7
"""... or at most this fraction of the row's natural scale ``|g_b| / epsilon`` (finite
differences of an iterative solve leave ~1e-11 of it where the true gradient is 0)."""


def grad_cosine(a: Tensor, r: Tensor, scale: Tensor | None = None) -> tuple[Tensor, int]:
    """Row-wise cosine of two (B, n) gradients; rows where both are zero are left out.

    A row counts as zero when its norm is at most :data:`ZERO_ROW` times the largest row norm
    of the reference ``r``, or at most :data:`ZERO_SCALE` times its ``scale`` (B,) when given.

    Returns:
        The cosines of the rows kept (a row where only one side is zero has cosine 0) and the
        number of rows left out.

    Example:
        >>> import torch
        >>> from benchmarks.quality import grad_cosine
        >>> a = torch.tensor([[1.0, 0.0], [0.0, 1e-40], [1.0, 1.0], [0.0, 0.0]])
        >>> r = torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.0, -1.0], [1.0, 0.0]])
        >>> grad_cosine(a, r)
        (tensor([1., 0., 0.], dtype=torch.float64), 1)
    """
    a, r = a.double().flatten(1), r.double().flatten(1)
    na, nr = a.norm(dim=-1), r.norm(dim=-1)
    floor = torch.full_like(nr, ZERO_ROW * float(nr.max()) if nr.numel() else 0.0)
    if scale is not None:
        floor = torch.maximum(floor, ZERO_SCALE * scale.double())
    a_zero, r_zero = na <= floor, nr <= floor
    both_zero = a_zero & r_zero
    cos = (a * r).sum(-1) / (na * nr).clamp_min(torch.finfo(torch.float64).tiny)
    cos = torch.where(a_zero | r_zero, torch.zeros_like(cos), cos)
    return cos[~both_zero], int(both_zero.sum())


# ----------------------------------------------------------------------------------------------
# Methods and specs


@dataclass(frozen=True)
class QualityMethod:
    """One method of a quality sweep.

    Attributes:
        name: the row label (the suite's case name where there is one).
        fn: ``fn(x, eps)``, differentiable in the (B, n) ``x``.
        hard: the hard operator, ``hard(x)``, of the shape of ``fn``'s output.
        metric: the distance to the hard operator.
        reference: how the reference gradient is computed (``None``: no gradient check).
        eps_unit: what epsilon is measured in for this method (reported).
    """

    name: str
    fn: Fn
    hard: Callable[[Tensor], Tensor]
    metric: Metric
    reference: Reference | None
    eps_unit: str = "units of x"


@dataclass(frozen=True)
class QualitySpec:
    """A suite's quality sweep.

    Attributes:
        suite: the suite's name.
        methods: ``methods(params) -> [QualityMethod]`` for a problem's parameters (``B``,
            ``n`` and, for top-k, ``k``).
        distance: the parameters of the distance problem (float32).
        gradient: the parameters of the gradient problem (float64, small: the references cost
            O(n) calls or many unrolled iterations).
        epsilons: the sweep.
    """

    suite: str
    methods: Callable[[Mapping[str, Any]], list[QualityMethod]]
    distance: Mapping[str, Any]
    gradient: Mapping[str, Any]
    epsilons: tuple[float, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)


def _normal(params: Mapping[str, Any], dtype: torch.dtype, seed: int, device: str) -> Tensor:
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    return torch.randn(params["B"], params["n"], generator=gen, dtype=dtype, device=device)


def run_quality(
    spec: QualitySpec,
    *,
    seed: int = 0,
    device: str = "cpu",
    gradients: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run a quality sweep: one record per method and epsilon.

    Args:
        spec: the suite's sweep.
        seed: the seed of both inputs and of the functionals ``g``.
        device: where to run.
        gradients: also compare gradients with the references (the costly part).
        log: where a line per method goes.

    Returns:
        Records with ``distance`` (mean over rows), ``distance_max``, ``max_entry``,
        ``nan_rows``, ``grad_cos_mean``, ``grad_cos_min``, ``grad_rows``, ``grad_zero_rows``,
        ``grad_reference`` and the settings; ``status`` is ``"ok"``, ``"error"`` or ``"oom"``
        (with ``error``).
    """
    x_dist = _normal(spec.distance, torch.float32, seed, device)
    x_grad = _normal(spec.gradient, torch.float64, seed + 1, device)
    grad_methods = {m.name: m for m in spec.methods(spec.gradient)} if gradients else {}
    records = []
    for method in spec.methods(spec.distance):
        start = time.perf_counter()
        hard = method.hard(x_dist)
        for eps in spec.epsilons:
            record = _base(spec, method, float(eps), device)
            record.update(measure_distance(method.fn, method.metric, x_dist, hard, float(eps)))
            gm = grad_methods.get(method.name)
            if gm is not None and gm.reference is not None:
                _gradient(record, gm, x_grad, float(eps), seed)
            records.append(record)
        if log is not None:
            log(f"  quality: {spec.suite} / {method.name} ({time.perf_counter() - start:.1f} s)")
    return records


def _base(spec: QualitySpec, method: QualityMethod, eps: float, device: str) -> dict[str, Any]:
    return {
        "suite": spec.suite,
        "method": method.name,
        "metric": method.metric.name,
        "metric_unit": method.metric.unit,
        "eps_unit": method.eps_unit,
        "epsilon": eps,
        **{key: value for key, value in spec.distance.items()},
        **{f"grad_{key}": value for key, value in spec.gradient.items()},
        "dtype": "float32",
        "grad_dtype": "float64",
        "device": device,
        "torch": torch.__version__,
        "status": "ok",
    }


def _quiet_call(fn: Fn, x: Tensor, eps: float) -> tuple[Tensor, bool]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(x, eps)
    return out, any(issubclass(w.category, UserWarning) for w in caught)


def measure_distance(fn: Fn, metric: Metric, x: Tensor, hard: Tensor, eps: float) -> dict[str, Any]:
    """The distance of ``fn(x, eps)`` to ``hard`` by ``metric``, without autograd.

    Returns:
        ``distance`` (the mean over the rows where it is finite), ``distance_max``,
        ``max_entry`` (the output's largest entry), ``nan_rows`` and ``warned`` (the method
        warned, for example that it did not converge); or ``status`` ``"error"`` / ``"oom"``
        with ``error`` when it raised.
    """
    try:
        with torch.no_grad():
            out, warned = _quiet_call(fn, x, eps)
    except Exception as err:
        return {"status": failure_status(err), "error": f"{type(err).__name__}: {err}"[:300]}
    dist = metric.fn(out, hard)
    finite = dist[torch.isfinite(dist)]
    return {
        "distance": finite.mean().item() if finite.numel() else math.nan,
        "distance_max": finite.max().item() if finite.numel() else math.nan,
        "max_entry": out.max().item() if out.numel() else math.nan,
        "nan_rows": int((~torch.isfinite(dist)).sum()),
        "warned": warned,
    }


def _gradient(
    record: dict[str, Any], method: QualityMethod, x: Tensor, eps: float, seed: int
) -> None:
    assert method.reference is not None
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shape = method.fn(x, eps).shape
        g = functional_weights(shape, x, seed, method.name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = _autograd(method.fn, x, eps, g)
            r, label = method.reference.grad(x, eps, g)
    except Exception as err:
        record["grad_status"] = failure_status(err)
        record["grad_error"] = f"{type(err).__name__}: {err}"[:300]
        return
    cos, zero = grad_cosine(a, r, g.reshape(g.shape[0], -1).norm(dim=-1) / eps)
    finite = cos[torch.isfinite(cos)]
    record.update(
        grad_status="ok",
        grad_cos_mean=finite.mean().item() if finite.numel() else None,
        grad_cos_min=finite.min().item() if finite.numel() else None,
        grad_rows=int(finite.numel()),
        grad_zero_rows=zero,
        grad_nan_rows=int(cos.numel() - finite.numel()),
        grad_rel_err_max=((a - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-300)).max().item(),
        grad_reference=label,
        grad_reference_kind=method.reference.kind,
    )


# ----------------------------------------------------------------------------------------------
# Reports


def _fmt_cos(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if value > 0.99995:
        gap = 1.0 - value
        return "1" if gap < 5e-13 else f"1 − {gap:.0e}"
    return f"{value:.4f}"


def quality_markdown(
    records: Sequence[Mapping[str, Any]],
    spec_notes: Sequence[str] = (),
    *,
    title: str,
    command: str | None = None,
) -> str:
    """Two tables, methods as rows and epsilons as columns: the distance to the hard operator,
    then the gradient cosine to the reference (mean over rows, and the minimum), and the
    reference each method was checked against."""
    if not records:
        return f"# {title}\n\nNo records.\n"
    head = records[0]
    grad_n = head.get("grad_n")
    lines = [
        f"# {title}",
        "",
        f"x ~ N(0, 1). Distances: B={head.get('B')}, n={head.get('n')}"
        + (f", k={head['k']}" if "k" in head else "")
        + f", float32; gradients: B={head.get('grad_B')}, n={grad_n}"
        + (f", k={head['grad_k']}" if "grad_k" in head else "")
        + f", float64. {head['device']}, torch {head['torch']}.",
        *reproduce_lines(command),
        "",
        "Each method's epsilon is its own smoothing parameter (the units are given per row); "
        "at one epsilon the methods are not equally smooth. The gradient of the method (its "
        "own backward, of `(out * g).sum()` for a fixed random g) is compared with a reference "
        "computed independently of the library's backward: unrolled Sinkhorn under plain "
        "autograd for the OT methods (run to convergence), central finite differences in "
        "float64 for the closed-form relaxations, the closed form where one exists, and the "
        "same estimator with many more draws for the Monte-Carlo method "
        "(`benchmarks.quality`).",
        *(f"\n{note}" for note in spec_notes),
    ]
    epsilons = list(dict.fromkeys(r["epsilon"] for r in records))
    methods = list(dict.fromkeys(r["method"] for r in records))
    by = {(r["method"], r["epsilon"]): r for r in records}
    eps_head = " | ".join(f"ε={e:g}" for e in epsilons)
    lines += [
        "",
        "### Distance to the hard operator (mean over rows)",
        "",
        f"| method | metric | ε units | {eps_head} |",
        "|---|---|---" + "|---:" * len(epsilons) + "|",
    ]
    for method in methods:
        rows = [by.get((method, e)) for e in epsilons]
        first = next(r for r in rows if r is not None)
        cells = []
        for r in rows:
            if r is None:
                cells.append("")
            elif r.get("status", "ok") != "ok":
                cells.append(str(r["status"]))
            else:
                cell = _fmt_num(r.get("distance"))
                if (
                    first["metric"] in ("mask L1", "weights L1")
                    and r.get("max_entry", 0) > 1 + 1e-6
                ):
                    cell += f" (max {r['max_entry']:.2f})"
                if r.get("nan_rows"):
                    cell += f" ({r['nan_rows']} NaN rows)"
                if r.get("warned"):
                    cell += " (w)"
                cells.append(cell)
        lines.append(
            f"| {method} | {first['metric']} ({first['metric_unit']}) | {first['eps_unit']} | "
            + " | ".join(cells)
            + " |"
        )
    if any(r.get("warned") for r in records):
        lines += ["", "(w): the method warned that it did not converge at that epsilon."]
    graded = [m for m in methods if any("grad_status" in r for r in records if r["method"] == m)]
    if graded:
        lines += [
            "",
            "### Gradient: cosine to the reference (mean over rows; the minimum in brackets)",
            "",
            f"| method | reference | {eps_head} |",
            "|---|---" + "|---:" * len(epsilons) + "|",
        ]
        notes = []
        for method in graded:
            rows = [by.get((method, e)) for e in epsilons]
            cells = []
            refs = []
            for r in rows:
                if r is None or "grad_status" not in r:
                    cells.append("")
                    continue
                if r["grad_status"] != "ok":
                    cells.append(str(r["grad_status"]))
                    notes.append(f"- {method}, ε={r['epsilon']:g}: {r.get('grad_error')}")
                    continue
                cell = _fmt_cos(r.get("grad_cos_mean"))
                if (
                    r.get("grad_cos_min") is not None
                    and r["grad_cos_min"] < r["grad_cos_mean"] - 5e-5
                ):
                    cell += f" ({_fmt_cos(r['grad_cos_min'])})"
                if r.get("grad_zero_rows"):
                    cell += f" [{r['grad_zero_rows']} rows 0]"
                cells.append(cell)
                refs.append(r["grad_reference"])
            kinds = sorted({_ref_kind(ref) for ref in refs})
            lines.append(f"| {method} | {'; '.join(kinds)} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "`1 − 1e-08` means a cosine within 1e-8 of 1; [m rows 0]: m rows where both the "
            "gradient and the reference are zero (the hard limit: below 1e-9 of the largest "
            "reference row, or 1e-7 of |g|/ε), left out; a row where only one of them is zero "
            "counts as 0.",
        ]
        fallbacks = sorted(
            {
                (r["method"], r["epsilon"])
                for r in records
                if "not converged" in str(r.get("grad_reference", ""))
            }
        )
        if fallbacks:
            text = ", ".join(f"{m} at ε={e:g}" for m, e in fallbacks)
            lines += [
                "",
                f"Unrolled Sinkhorn did not converge within {UNROLLED_CAP} iterations for {text}: "
                "there the reference is central finite differences of the exact solve.",
            ]
        if notes:
            lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _ref_kind(label: str) -> str:
    """The reference's label without its per-epsilon details (iterations, fallbacks)."""
    if "not converged" in label:
        return label.split(": ", 1)[1].rsplit(" not converged", 1)[0]
    return label.split(", ")[0] if "iterations" in label else label


def _fmt_num(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.3g}"


def plot_quality(records: Sequence[Mapping[str, Any]], path: Path, title: str) -> bool:
    """Distance against epsilon (one panel per metric) and 1 − cosine against epsilon, log-log.

    Needs matplotlib; ``False`` without it or without data.
    """
    ok = [r for r in records if r.get("status", "ok") == "ok" and r.get("distance") is not None]
    metrics = list(dict.fromkeys(r["metric"] for r in ok))
    graded = [r for r in records if r.get("grad_cos_mean") is not None]
    panels = len(metrics) + bool(graded)
    fig = new_figure((5.2 * panels, 4.2)) if panels else None
    if fig is None:
        return False
    axes = fig.subplots(1, panels, squeeze=False)[0]
    for ax, metric in zip(axes, metrics, strict=False):
        rows = [r for r in ok if r["metric"] == metric]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted(
                (r["epsilon"], max(r["distance"], 1e-16)) for r in rows if r["method"] == method
            )
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        log_log_axes(ax, "epsilon", f"{metric} to the hard op ({rows[0]['metric_unit']})")
        ax.legend(fontsize=7)
    if graded:
        ax = axes[-1]
        for method in dict.fromkeys(r["method"] for r in graded):
            pts = sorted(
                (r["epsilon"], max(1.0 - r["grad_cos_mean"], 1e-16))
                for r in graded
                if r["method"] == method
            )
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        log_log_axes(ax, "epsilon", "1 − cosine(gradient, reference)")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
    return True


def write_quality(
    records: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    stem: str,
    *,
    title: str,
    notes: Sequence[str] = (),
    command: str | None = None,
) -> dict[str, Path]:
    """Write ``<stem>.jsonl``, ``<stem>.md`` and (with matplotlib) ``<stem>.png``."""
    markdown = quality_markdown(records, notes, title=title, command=command)
    return write_report(
        records, out_dir, stem, markdown, lambda png: plot_quality(records, png, title)
    )
