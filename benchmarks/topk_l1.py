r"""Bias of the top-k relaxations: ``python -m benchmarks topk-l1``.

For each method and epsilon, the mean over rows of the L1 distance between the soft mask and the
hard one,

.. math::

    \frac{1}{B} \sum_b \big\| A_b - \mathbb{1}[x_b \in \mathrm{topk}(x_b, k)] \big\|_1
    \quad\in [0, 2k],

on rows ``x ~ N(0, 1)`` of shape (B, n). The methods share one epsilon in the units of x, but it
plays a different part in each: the sigmoid temperature of "ot" (and of "sinkhorn", the same
problem, here with the paper's fixed 200 iterations, which have not converged at small epsilon),
the softmax temperature of each step of "softkmax", the Gaussian noise scale of "perturbed"
(whose L1 also holds Monte-Carlo noise, about ``sqrt(n p (1 - p) / n_samples)``), and, at k = 1,
the temperature of ``soft_argmax_onehot``. The largest entry of each mask is reported too:
"softkmax" exceeds 1 where its recursion double-counts an entry.

This is an accuracy sweep, not a timing: it runs no backward and one call per point. It is the
distance half of the top-k suite's quality sweep (:mod:`benchmarks.quality`, whose metric
``MASK_L1`` and :func:`~benchmarks.quality.measure_distance` it uses), at k = 1 as well, in
the layout the README and the documentation quote; ``python -m benchmarks --suite topk`` adds the
gradient cosines.
:func:`run_l1_bench` is ``python -m benchmarks topk-l1``: the sweep on a given number of
threads, then the files ``topk-l1.{jsonl,md,png}``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import softops
from benchmarks.harness import DEFAULT_OUT
from benchmarks.quality import MASK_L1, measure_distance
from benchmarks.report import (
    log_log_axes,
    make_logger,
    new_figure,
    reproduce_lines,
    save_figure,
    write_report,
)
from softops.testing import SINKHORN_ITERS

__all__ = [
    "L1_EPSILONS",
    "l1_markdown",
    "l1_methods",
    "l1_to_hard",
    "plot_l1",
    "run_l1_bench",
    "write_l1",
]

L1_EPSILONS = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001)


def l1_methods(k: int, n_samples: int = 100) -> dict[str, Callable[[torch.Tensor, float], Any]]:
    """The relaxations compared at top-k ``k``: name -> ``fn(x, epsilon)`` returning a mask."""

    def ot(x: torch.Tensor, eps: float) -> torch.Tensor:
        return softops.soft_topk_mask(x, k, epsilon=eps, method="ot")

    def sinkhorn(x: torch.Tensor, eps: float) -> torch.Tensor:
        return softops.soft_topk_mask(
            x, k, epsilon=eps, method="sinkhorn", max_iter=SINKHORN_ITERS, tol=0
        )

    def softkmax(x: torch.Tensor, eps: float) -> torch.Tensor:
        return softops.soft_topk_mask(x, k, epsilon=eps, method="softkmax")

    def perturbed(x: torch.Tensor, eps: float) -> torch.Tensor:
        generator = torch.Generator(device=x.device).manual_seed(0)
        return softops.soft_topk_mask(
            x, k, epsilon=eps, method="perturbed", n_samples=n_samples, generator=generator
        )

    methods: dict[str, Callable[[torch.Tensor, float], Any]] = {
        "ot": ot,
        f"sinkhorn-{SINKHORN_ITERS}": sinkhorn,
        "softkmax": softkmax,
        f"perturbed-{n_samples}": perturbed,
    }
    if k == 1:
        methods["soft_argmax_onehot"] = lambda x, eps: softops.soft_argmax_onehot(x, epsilon=eps)
    return methods


def l1_to_hard(
    *,
    batch: int = 64,
    n: int = 1_000,
    ks: Sequence[int] = (1, 10),
    epsilons: Sequence[float] = L1_EPSILONS,
    n_samples: int = 100,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, Any]]:
    """Measure the L1 distance to the hard mask of every method, k and epsilon.

    Args:
        batch: rows per point (B).
        n: row length.
        ks: the k values.
        epsilons: the epsilon values (units of x; x is standard normal).
        n_samples: the draws of "perturbed".
        seed: the seed of the input.
        device: where to run.
        dtype: the input dtype.

    Returns:
        One record per (k, method, epsilon): ``l1`` (mean over the rows where it is finite;
        ``nan_rows`` counts the others), ``l1_rel`` (``l1 / 2k``,
        the fraction of the mask's mass misplaced), ``max_entry`` and the settings.
    """
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    x = torch.randn(batch, n, generator=gen, device=device, dtype=dtype)
    records = []
    for k in ks:
        hard = torch.zeros_like(x).scatter_(-1, x.topk(k, dim=-1).indices, 1.0)
        for name, fn in l1_methods(k, n_samples).items():
            for eps in epsilons:
                # sinkhorn-200 may not converge at small epsilon: that is what is measured.
                d = measure_distance(fn, MASK_L1, x, hard, float(eps))
                if "error" in d:
                    raise RuntimeError(f"topk-l1: {name} at epsilon={eps:g}: {d['error']}")
                records.append(
                    {
                        "B": batch,
                        "n": n,
                        "k": k,
                        "method": name,
                        "epsilon": float(eps),
                        "l1": d["distance"],
                        "l1_rel": d["distance"] / (2 * k),
                        "max_entry": d["max_entry"],
                        "nan_rows": d["nan_rows"],
                        "dtype": str(dtype).removeprefix("torch."),
                        "device": str(device),
                        "torch": torch.__version__,
                    }
                )
    return records


def l1_markdown(records: Sequence[Mapping[str, Any]], *, command: str | None = None) -> str:
    """One table per k: methods as rows, epsilons as columns, cells ``l1`` (max entry if > 1)."""
    if not records:
        return "# top-k relaxations: L1 distance to the hard mask\n\nNo records.\n"
    head = records[0]
    lines = [
        "# top-k relaxations: L1 distance to the hard mask",
        "",
        f"x ~ N(0, 1), B={head['B']}, n={head['n']}, {head['dtype']}, {head['device']}, "
        f"torch {head['torch']}. Cells: mean over rows of ‖A − hard‖₁ (out of 2k); "
        "a mask entry above 1 is flagged as (max …).",
        *reproduce_lines(command),
    ]
    for k in dict.fromkeys(r["k"] for r in records):
        rows = [r for r in records if r["k"] == k]
        epsilons = list(dict.fromkeys(r["epsilon"] for r in rows))
        lines += ["", f"### k = {k}", ""]
        lines += ["| method | " + " | ".join(f"ε={e:g}" for e in epsilons) + " |"]
        lines += ["|---" + "|---:" * len(epsilons) + "|"]
        for method in dict.fromkeys(r["method"] for r in rows):
            cells = []
            for e in epsilons:
                r = next(r for r in rows if r["method"] == method and r["epsilon"] == e)
                cell = f"{r['l1']:.3g}"
                if r["max_entry"] > 1 + 1e-6:
                    cell += f" (max {r['max_entry']:.2f})"
                if r["nan_rows"]:
                    cell += f" ({r['nan_rows']} NaN rows)"
                cells.append(cell)
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_l1(records: Sequence[Mapping[str, Any]], path: Path) -> bool:
    """L1 against epsilon, log-log, one panel per k. Needs matplotlib; False without it."""
    ks = list(dict.fromkeys(r["k"] for r in records))
    fig = new_figure((5.5 * len(ks), 4.2)) if ks else None
    if fig is None:
        return False
    axes = fig.subplots(1, len(ks), squeeze=False)[0]
    for ax, k in zip(axes, ks, strict=True):
        rows = [r for r in records if r["k"] == k]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["epsilon"], max(r["l1"], 1e-12)) for r in rows if r["method"] == method)
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        log_log_axes(ax, "epsilon (units of x)", f"k = {k}, n = {rows[0]['n']}")
        ax.set_ylabel("mean ‖A − hard‖₁")
        ax.legend(fontsize=8)
    save_figure(fig, path)
    return True


def write_l1(
    records: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    stem: str = "topk-l1",
    *,
    command: str | None = None,
) -> dict[str, Path]:
    """Write ``<stem>.jsonl``, ``<stem>.md`` and (with matplotlib) ``<stem>.png``."""
    markdown = l1_markdown(records, command=command)
    return write_report(records, out_dir, stem, markdown, lambda png: plot_l1(records, png))


def run_l1_bench(
    *,
    batch: int = 64,
    n: int = 1_000,
    ks: Sequence[int] = (1, 10),
    epsilons: Sequence[float] = L1_EPSILONS,
    n_samples: int = 100,
    threads: int = 1,
    device: str = "cpu",
    out: str | os.PathLike[str] = DEFAULT_OUT,
    seed: int = 0,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[str, dict[str, Path]]:
    """Run :func:`l1_to_hard` on ``threads`` torch threads and write its files.

    The arguments are those of :func:`l1_to_hard`, plus ``threads`` (restored afterwards),
    ``out`` (the folder of ``topk-l1.{jsonl,md,png}``), ``command`` (stored in the report) and
    ``log`` (where the progress line goes; stderr by default).

    Returns:
        The Markdown report and the paths written.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        records = l1_to_hard(
            batch=batch,
            n=n,
            ks=ks,
            epsilons=epsilons,
            n_samples=n_samples,
            seed=seed,
            device=device,
        )
    finally:
        torch.set_num_threads(previous)
    paths = write_l1(records, out, command=command)
    (log or make_logger())("wrote " + ", ".join(str(p) for p in paths.values()))
    return paths["md"].read_text(encoding="utf-8"), paths
