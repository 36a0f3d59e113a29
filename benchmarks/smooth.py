r"""The smooth suite: ``python -m benchmarks smooth``, the softmax family of :mod:`softops.smooth`.

Inputs ``x ~ N(0, 1)`` of shape (B, n), float32 by default, epsilon = 0.1 (units of x).

``grid``
    B=64, n in {1e3, 1e4, 1e5}. The floor is the hard maximum ``torch.amax(x, -1)``. Cases:
    the plain torch expressions of the same math, ``epsilon * torch.logsumexp(x / epsilon,
    -1)`` and ``torch.softmax(x / epsilon, -1)`` (what the library's checks, reshapes and
    stable kernels cost over them); ``smooth_max``, ``smooth_min``, ``soft_argmax``,
    ``soft_argmin``, ``soft_argmax_onehot``; and ``soft_kmax`` with k = 10 (the recursion:
    k softmax rounds, the relaxed top-k mask of the smoothing note).

The summary gives, at the largest n, each op's forward+backward over the floor and over the torch
expression it equals. The quality sweep (:data:`QUALITY`, :mod:`benchmarks.quality`) gives the
distance of each op to its hard counterpart against epsilon (|smooth_max − max|, the index error
of soft_argmax, the L1 distance of soft_argmax_onehot to the one-hot, the mask L1 of soft_kmax)
and the cosine of its gradient to the closed form (finite differences for soft_kmax).

:func:`run_smooth_bench` builds the configurations, runs them and writes ``smooth.*``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import torch

import softops
from benchmarks.harness import (
    DEFAULT_OUT,
    QuickDefaults,
    RunExtras,
    make_options,
    run_and_write,
    thread_runs,
)
from benchmarks.model import Case, Config
from benchmarks.quality import (
    ABS_ERROR,
    INDEX_ERROR,
    MASK_L1,
    ONEHOT_L1,
    QualityMethod,
    QualitySpec,
    analytic,
    finite_differences,
)
from benchmarks.report import make_logger
from benchmarks.topk_l1 import L1_EPSILONS

__all__ = [
    "GRID_SIZES",
    "QUALITY",
    "QUICK",
    "QUICK_QUALITY",
    "SUITE",
    "SmoothSuite",
    "build_configs",
    "quality_methods",
    "run_smooth_bench",
]

GRID_SIZES = (1_000, 10_000, 100_000)
GRID_BATCH = 64
EPSILON = 0.1
KMAX_K = 10
QUICK: QuickDefaults = {"sizes": (1_000, 10_000), "batch": 8, "repeats": 3, "time_budget": 2.0}
"""The defaults of ``python -m benchmarks --suite smooth --quick`` (and the probes are off)."""

_LSE, _SOFTMAX = "torch.logsumexp (ε·lse(x/ε))", "torch.softmax(x/ε)"
_PAIRS = (("smooth_max", _LSE), ("soft_argmax_onehot", _SOFTMAX))


def build_configs(
    *, sizes: Sequence[int] = GRID_SIZES, batch: int = GRID_BATCH, epsilon: float = EPSILON
) -> list[Config]:
    """The ``grid`` configurations, in increasing n.

    Example:
        >>> from benchmarks.smooth import build_configs
        >>> [c.label for c in build_configs(sizes=[1000], batch=4)]
        ['grid B=4 n=1000 k=10 epsilon=0.1']
    """
    return [
        Config("grid", {"B": batch, "n": int(n), "k": min(KMAX_K, int(n)), "epsilon": epsilon})
        for n in sorted({int(n) for n in sizes})
    ]


class SmoothSuite:
    """The smooth suite (see the module docstring); ``SUITE`` is its instance."""

    ref = "benchmarks.smooth:SUITE"
    name = "smooth"
    floor_label = "torch.amax(x, -1)"
    plot_group = "grid"
    plot_x = "n"

    def make_input(
        self,
        config: Config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Standard normal rows of shape (B, n)."""
        p = config.params
        return torch.randn(p["B"], p["n"], generator=generator, device=device, dtype=dtype)

    def make_cases(self, config: Config) -> list[Case]:
        """The floor, the two torch expressions and the ops of :mod:`softops.smooth`."""
        eps, k = float(config.params["epsilon"]), int(config.params["k"])
        return [
            Case("torch.amax", lambda x: torch.amax(x, dim=-1), floor=True),
            Case(_LSE, lambda x: eps * torch.logsumexp(x / eps, dim=-1)),
            Case("smooth_max", lambda x: softops.smooth_max(x, epsilon=eps)),
            Case("smooth_min", lambda x: softops.smooth_min(x, epsilon=eps)),
            Case("soft_argmax", lambda x: softops.soft_argmax(x, epsilon=eps)),
            Case("soft_argmin", lambda x: softops.soft_argmin(x, epsilon=eps)),
            Case(_SOFTMAX, lambda x: torch.softmax(x / eps, dim=-1)),
            Case("soft_argmax_onehot", lambda x: softops.soft_argmax_onehot(x, epsilon=eps)),
            Case(f"soft_kmax (k={k})", lambda x: softops.soft_kmax(x, k, epsilon=eps)),
        ]

    def compare(self, config: Config, outputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The largest difference of each op from the torch expression it equals."""
        facts: dict[str, Any] = {}
        for ours, theirs in _PAIRS:
            if ours in outputs and theirs in outputs:
                diff = (outputs[ours].double() - outputs[theirs].double()).abs().max().item()
                facts[f"max_abs_diff_{ours}_vs_torch"] = diff
        return facts

    def summary(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """Each op at the largest n: fwd+bwd over the floor and over its torch expression."""
        grid = [r for r in records if r["group"] == "grid"]
        if not grid:
            return []
        n_max = max(r["n"] for r in grid)
        rows = {r["case"]: r for r in grid if r["n"] == n_max}
        lines = ["### Summary", ""]
        parts = []
        for name, r in rows.items():
            if r.get("floor") or not r.get("fwdbwd_ratio"):
                continue
            parts.append(f"{name} {r['fwdbwd_ratio']:.1f}×")
        if parts:
            head = next(iter(rows.values()))
            lines.append(
                f"- fwd+bwd over the torch.amax forward at B={head['B']}, n={n_max}: "
                + ", ".join(parts)
            )
        for ours, theirs in _PAIRS:
            a, b = rows.get(ours), rows.get(theirs)
            if a and b and a.get("fwdbwd_ms") and b.get("fwdbwd_ms"):
                diff = a.get(f"max_abs_diff_{ours}_vs_torch")
                lines.append(
                    f"- {ours} / {theirs} at n={n_max}: {a['fwdbwd_ms'] / b['fwdbwd_ms']:.2f}× "
                    f"fwd+bwd, {a['fwd_ms'] / b['fwd_ms']:.2f}× fwd"
                    + (f" (max |difference| {diff:.1e})" if diff is not None else "")
                )
        return lines if len(lines) > 2 else []


SUITE = SmoothSuite()


# ----------------------------------------------------------------------------------------------
# Quality


def _softmax_grad(sign: float) -> Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor]:
    """d/dx of <g, eps·lse(sign·x/eps)·sign> = g · softmax(sign·x/eps)."""

    def grad(x: torch.Tensor, eps: float, g: torch.Tensor) -> torch.Tensor:
        return g.unsqueeze(-1) * torch.softmax(sign * x / eps, dim=-1)

    return grad


def _argmax_grad(sign: float) -> Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor]:
    """d/dx_j of <g, sum_i i p_i> with p = softmax(sign·x/eps): g · sign · p_j (j − f) / eps."""

    def grad(x: torch.Tensor, eps: float, g: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(sign * x / eps, dim=-1)
        idx = torch.arange(x.shape[-1], dtype=x.dtype, device=x.device)
        f = (p * idx).sum(-1, keepdim=True)
        return g.unsqueeze(-1) * sign * p * (idx - f) / eps

    return grad


def _onehot_grad(x: torch.Tensor, eps: float, g: torch.Tensor) -> torch.Tensor:
    """The VJP of softmax(x/eps): p ⊙ (g − <g, p>) / eps."""
    p = torch.softmax(x / eps, dim=-1)
    return p * (g - (g * p).sum(-1, keepdim=True)) / eps


def quality_methods(params: Mapping[str, Any]) -> list[QualityMethod]:
    """The smooth ops of the quality sweep at ``params`` (``B``, ``n``, ``k`` for soft_kmax)."""
    k = int(params["k"])

    def kmax(x: torch.Tensor, eps: float) -> torch.Tensor:
        return softops.soft_kmax(x, k, epsilon=eps)

    def hard_mask(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x).scatter(-1, x.topk(k, dim=-1).indices, 1.0)

    def onehot(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)

    return [
        QualityMethod(
            "smooth_max",
            lambda x, eps: softops.smooth_max(x, epsilon=eps),
            lambda x: x.amax(-1),
            ABS_ERROR,
            analytic(_softmax_grad(1.0), "closed form: g · softmax(x/ε)"),
        ),
        QualityMethod(
            "smooth_min",
            lambda x, eps: softops.smooth_min(x, epsilon=eps),
            lambda x: x.amin(-1),
            ABS_ERROR,
            analytic(_softmax_grad(-1.0), "closed form: g · softmax(−x/ε)"),
        ),
        QualityMethod(
            "soft_argmax",
            lambda x, eps: softops.soft_argmax(x, epsilon=eps),
            lambda x: x.argmax(-1).to(x.dtype),
            INDEX_ERROR,
            analytic(_argmax_grad(1.0), "closed form: g · p_j (j − f)/ε"),
        ),
        QualityMethod(
            "soft_argmin",
            lambda x, eps: softops.soft_argmin(x, epsilon=eps),
            lambda x: x.argmin(-1).to(x.dtype),
            INDEX_ERROR,
            analytic(_argmax_grad(-1.0), "closed form: −g · p_j (j − f)/ε"),
        ),
        QualityMethod(
            "soft_argmax_onehot",
            lambda x, eps: softops.soft_argmax_onehot(x, epsilon=eps),
            onehot,
            ONEHOT_L1,
            analytic(_onehot_grad, "closed form: p ⊙ (g − ⟨g, p⟩)/ε"),
        ),
        QualityMethod("soft_kmax", kmax, hard_mask, MASK_L1, finite_differences(kmax)),
    ]


QUALITY = QualitySpec(
    suite="smooth",
    methods=quality_methods,
    distance={"B": 64, "n": 1_000, "k": 10},
    gradient={"B": 4, "n": 32, "k": 4},
    epsilons=L1_EPSILONS,
    notes=(
        "abs error is |smooth_max − max| (in [0, ε log n]) and |smooth_min − min|; index error "
        "|soft_argmax − argmax| (0-based indices; a soft index averages over near-ties, so it "
        "can be far from the hard one while the one-hot is close); one-hot L1 is "
        "‖soft_argmax_onehot − one_hot(argmax)‖₁ (of 2); soft_kmax's row is the mask L1 (of 2k, "
        "k = 10 for the distances, 4 for the gradients).",
    ),
)
"""The smooth suite's quality sweep (``python -m benchmarks --suite smooth``)."""
QUICK_QUALITY = QualitySpec(
    suite="smooth",
    methods=quality_methods,
    distance={"B": 4, "n": 100, "k": 3},
    gradient={"B": 2, "n": 12, "k": 2},
    epsilons=(1.0, 0.1, 0.01),
)
"""The same at tiny sizes (``--quick``)."""


def run_smooth_bench(
    *,
    quick: bool = False,
    threads: int | Sequence[int | None] | None = 1,
    device: str = "cpu",
    dtype: str = "float32",
    out: str = DEFAULT_OUT,
    repeats: int | None = None,
    sizes: Sequence[int] | None = None,
    batch: int | None = None,
    time_budget: float | None = None,
    memory: bool = True,
    seed: int = 0,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
    **extras: Unpack[RunExtras],
) -> tuple[str, dict[str, Path]]:
    """Run the smooth suite and write ``smooth.{jsonl,md,png}`` (``smooth-quick.*``) under out.

    ``threads`` is a count, ``None`` (out of the box) or a sequence of them (one run each,
    every configuration in a fresh process, into the same files); ``extras`` go to
    :func:`~benchmarks.harness.make_options`.
    """
    log = log or make_logger()
    options = make_options(
        QUICK,
        quick=quick,
        device=device,
        dtype=dtype,
        threads=1,
        repeats=repeats,
        time_budget=time_budget,
        memory=memory,
        first_call=False,
        seed=seed,
        command=command,
        **extras,
    )
    configs = build_configs(
        sizes=sizes or (QUICK["sizes"] if quick else GRID_SIZES),
        batch=batch or (QUICK["batch"] if quick else GRID_BATCH),
    )
    name = "smooth-quick" if quick else "smooth"
    return run_and_write(SUITE, configs, thread_runs(options, threads), out, name, command, log)
