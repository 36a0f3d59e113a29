"""Benchmark harness behind ``softops bench``; never imported by ``import softops``.

:mod:`softops.bench.harness` is generic: interleaved median timings of forward and
forward+backward, saved-for-backward bytes, peak memory in fresh subprocesses, and JSONL, Markdown
and PNG reports (matplotlib, for the plot, is imported lazily and is optional).
:mod:`softops.bench.topk` is the top-k suite.

Example (the same as ``softops bench topk --sizes 1000 --no-speedup --no-sorted``)::

    from softops.bench import RunOptions, run_suite, write_results
    from softops.bench.topk import SUITE, build_configs

    configs = build_configs(sizes=[1000], speedup=False, sorted_memory=False)
    records = run_suite(SUITE, configs, RunOptions(threads=1))
    write_results(records, SUITE, "benchmarks/results", "topk-1000")
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
