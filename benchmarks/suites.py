"""The registry of the benchmark suites behind ``python -m benchmarks --suite NAME``.

:data:`SUITES` names the suites in the order ``--suite all`` runs them; :func:`quality_spec`
gives a suite's quality sweep (:mod:`benchmarks.quality`; the layers suite has none: its
layers carry their own weights and have no hard operator to be measured against), and
:func:`run_suite_quality` runs it and writes ``<stem>-quality.{jsonl,md,png}``. The timing runs
themselves are the suites' own functions (:func:`benchmarks.topk.run_topk_bench`,
:func:`benchmarks.sort.run_sort_bench`, :func:`benchmarks.smooth.run_smooth_bench`,
:func:`benchmarks.layers.run`), which the console script calls.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import _threads
from benchmarks.quality import QualitySpec, run_quality, write_quality

__all__ = ["QUALITY_TITLES", "SUITES", "expand", "quality_spec", "run_suite_quality"]

SUITES = ("topk", "sort", "smooth", "layers")
"""The suites, in the order ``--suite all`` runs them."""
QUALITY_TITLES = {
    "topk": "top-k quality: distance to the hard mask, and gradients against references",
    "sort": "sort quality: distance to the hard sort and ranks, and gradients against references",
    "smooth": "smooth quality: distance to the hard max and argmax, and gradients against "
    "references",
}


def expand(name: str) -> tuple[str, ...]:
    """``"all"`` -> every suite; a suite's name -> itself; else ``ValueError``.

    Example:
        >>> from benchmarks.suites import expand
        >>> expand("all"), expand("smooth")
        (('topk', 'sort', 'smooth', 'layers'), ('smooth',))
    """
    if name == "all":
        return SUITES
    if name not in SUITES:
        raise ValueError(
            f"python -m benchmarks: expected a suite among {SUITES} or 'all'; got {name!r}."
        )
    return (name,)


def quality_spec(name: str, *, quick: bool = False) -> QualitySpec | None:
    """The quality sweep of suite ``name`` (its tiny version with ``quick``), or ``None``."""
    if name not in QUALITY_TITLES:
        return None
    module = importlib.import_module(f"benchmarks.{name}")
    spec: QualitySpec = module.QUICK_QUALITY if quick else module.QUALITY
    return spec


def run_suite_quality(
    name: str,
    *,
    quick: bool = False,
    out: str | os.PathLike[str],
    threads: int | None = 1,
    seed: int = 0,
    device: str = "cpu",
    command: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[str, dict[str, Path]] | None:
    """Run suite ``name``'s quality sweep on ``threads`` and write its files.

    The files are ``<name>-quality.*`` (``<name>-quick-quality.*`` with ``quick``) under
    ``out``. Returns the Markdown and the paths, or ``None`` for a suite without a sweep.
    """
    spec = quality_spec(name, quick=quick)
    if spec is None:
        return None
    with _threads(threads):
        records = run_quality(spec, seed=seed, device=device, log=log)
    stem = f"{name}-quick-quality" if quick else f"{name}-quality"
    paths = write_quality(
        records, out, stem, title=QUALITY_TITLES[name], notes=spec.notes, command=command
    )
    if log is not None:
        log("wrote " + ", ".join(str(p) for p in paths.values()))
    return paths["md"].read_text(encoding="utf-8"), paths
