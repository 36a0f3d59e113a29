"""Benchmark harness behind ``softops bench``; never imported by ``import softops``.

The harness is generic, in six modules:

* :mod:`softops.bench.model`: what a suite is (:class:`Case`, :class:`Config`, :class:`Suite`),
  how to run it (:class:`RunOptions`: threads, or ``None`` for the out-of-the-box
  configuration, isolation, time-outs, a memory cap), the statuses of a record (ok, skipped,
  error, oom, timeout) and the measurement primitives (:func:`count_saved_bytes`);
* :mod:`softops.bench.harness`: the timing loop, interleaved median timings of forward and
  forward+backward (:func:`run_suite`), each configuration in a fresh subprocess when asked, and
  one command-line run of a suite (once per thread setting);
* :mod:`softops.bench.probes`: whole configurations, peak memory and first calls, in fresh
  subprocesses, with out-of-memory errors, kills and time-outs recorded as statuses;
* :mod:`softops.bench.quality`: the quality sweep, each method's distance to the hard operator
  against epsilon and the cosine of its gradient to a reference gradient;
* :mod:`softops.bench.report`: JSONL, Markdown and PNG reports (:func:`write_results`;
  matplotlib, for the plot, is imported lazily and is optional) and the console output;
* :mod:`softops.bench.references`: the reference implementations the implicit backwards are
  checked against (log-domain Sinkhorn unrolled under plain autograd), used by the tests too.

The suites, one module each, own their configurations, their quality sweep and their run:
:mod:`softops.bench.topk` (``softops bench --suite topk``, or ``softops bench topk``),
:mod:`softops.bench.sort` (``--suite sort``), :mod:`softops.bench.smooth` (``--suite smooth``),
:mod:`softops.bench.layers` (``--suite layers``) and :mod:`softops.bench.topk_l1` (``softops bench
topk-l1``); :mod:`softops.bench.suites` is their registry (``--suite all``).
:mod:`softops.bench.plots` draws the figures of the operators (``softops plot``, and the
documentation site).

The suites measure the public API, plus a few internals that are what they measure. This is the
whole internal surface the harness reads; a change there must update the harness:

* ``softops._kernels.backend`` and ``kernels_enabled``: the kernel layer's switch (the "ot
  (kernel)" and "ot (reference)" rows of the top-k suite);
* ``softops._core.sinkhorn.implicit_cost_vjp``: the implicit backward of the paper-layout
  Sinkhorn reference (:func:`softops.bench.references.paper_sinkhorn_topk_mask`);
* ``softops.sort._chunked.BLOCK_ELEMENTS``: the block size of the row-chunked SoftSort path,
  reported by the sort suite's memory target.

Example (the same as ``softops bench topk --sizes 1000 --no-speedup --no-sorted``)::

    from softops.bench import RunOptions, run_suite, write_results
    from softops.bench.topk import SUITE, build_configs

    configs = build_configs(sizes=[1000], speedup=False, sorted_memory=False)
    records = run_suite(SUITE, configs, RunOptions(threads=1))
    write_results(records, SUITE, "benchmarks/results", "topk-1000")
"""

from softops.bench.harness import run_suite
from softops.bench.model import Case, Config, RunOptions, Suite, count_saved_bytes
from softops.bench.report import markdown_report, plot_results, write_results

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
