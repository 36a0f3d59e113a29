"""Benchmark harness behind ``softops bench``; never imported by ``import softops``.

:mod:`softops.bench.harness` is generic: interleaved median timings of forward and
forward+backward, saved-for-backward bytes, peak memory in fresh subprocesses, and JSONL, Markdown
and PNG reports (numpy, matplotlib and rich, the ``bench`` extra, are imported lazily and are
optional). :mod:`softops.bench.topk` is the top-k suite.

Example:
    >>> from softops.bench import RunOptions, run_suite, write_results  # doctest: +SKIP
    >>> from softops.bench.topk import SUITE, build_configs  # doctest: +SKIP
    >>> records = run_suite(SUITE, build_configs(sizes=[1000]), RunOptions())  # doctest: +SKIP
    >>> write_results(records, SUITE, "benchmarks/results", "topk")  # doctest: +SKIP
"""

from softops.bench.harness import (
    Case,
    Config,
    RunOptions,
    Suite,
    count_saved_bytes,
    markdown_report,
    plot_results,
    run_suite,
    write_results,
)

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
