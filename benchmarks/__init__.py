"""The benchmarks of softops: a development package beside the library, not installed.

Run from the repository root (``pip install -e ".[bench]"`` first)::

    python -m benchmarks topk --quick        # a suite: topk, sort, smooth, layers, topk-l1
    python -m benchmarks --suite all         # every suite, 1 thread and out of the box
    python -m benchmarks.attention --quick   # an experiment that uses the harness
    python benchmarks/grid.py --help         # a standalone script (see benchmarks/README.md)

It imports the public API of softops (and :mod:`softops.testing`, the references the tests
share); the library never imports it. The harness is generic:

* :mod:`benchmarks.model`: what a suite is (:class:`Case`, :class:`Config`, :class:`Suite`), how
  to run it (:class:`RunOptions`), the statuses of a record and the measurement primitives;
* :mod:`benchmarks.harness`: the timing loop, interleaved median timings of forward and
  forward+backward (:func:`run_suite`), and one command-line run of a suite;
* :mod:`benchmarks.probes`: whole configurations, peak memory and first calls, in fresh
  subprocesses (:mod:`benchmarks._probe` is their entry point);
* :mod:`benchmarks.quality`: the quality sweep, each method's distance to the hard operator
  against epsilon and the cosine of its gradient to a reference gradient;
* :mod:`benchmarks.report`: JSONL, Markdown and PNG reports (:func:`write_results`) and the
  console output.

The suites, one module each, own their configurations, their quality sweep and their run:
:mod:`benchmarks.topk`, :mod:`benchmarks.sort`, :mod:`benchmarks.smooth`,
:mod:`benchmarks.layers` and :mod:`benchmarks.topk_l1`; :mod:`benchmarks.suites` is their
registry, :mod:`benchmarks.__main__` their command line. The other modules are experiments, each
with its own command line.

Example (the same as ``python -m benchmarks topk --sizes 1000 --no-speedup --no-sorted``)::

    from benchmarks import RunOptions, run_suite, write_results
    from benchmarks.topk import SUITE, build_configs

    configs = build_configs(sizes=[1000], speedup=False, sorted_memory=False)
    records = run_suite(SUITE, configs, RunOptions(threads=1))
    write_results(records, SUITE, "benchmarks/results", "topk-1000")
"""

from benchmarks.harness import run_suite
from benchmarks.model import Case, Config, RunOptions, Suite
from benchmarks.report import markdown_report, plot_results, write_results
from softops.testing import count_saved_bytes

__all__ = [
    "Case",
    "Config",
    "RunOptions",
    "Suite",
    "count_saved_bytes",
    "markdown_report",
    "plot_results",
    "run_suite",
    "write_results",
]
