r"""The timing loop of the benchmark harness: :func:`run_suite`, and :func:`run_and_write`.

A suite (:class:`~benchmarks.model.Suite`) gives configurations and, for each, cases; one case
is the *floor*, the hard operator. For a case :math:`c` with median forward time :math:`t_c` and
median forward+backward time :math:`T_c`, the report gives :math:`t_c / t_{\mathrm{floor}}` and
:math:`T_c / t_{\mathrm{floor}}`: the headline numbers, because absolute times on a shared
machine drift from run to run while ratios taken in one run do not.

How a configuration is measured (:func:`run_suite`):

* **Threads.** With ``threads=N`` (1 by default) ``torch.set_num_threads(N)`` is set explicitly,
  and the cases that run numba kernels pin numba's pool to the same count (a fair comparison).
  With ``threads=None``, the *out-of-the-box* configuration, nothing is set: no
  ``torch.set_num_threads``, no numba pinning, no environment variable; the library and torch
  choose, as in a user's process. The records say which (``threads_setting``) and what the
  process actually ran with (``torch_threads``, ``numba_threads``).
* **Isolation.** With ``isolate``, each configuration runs in a fresh subprocess
  (:func:`benchmarks.probes.run_config_subprocess`), so it inherits no state from another
  (a thread count set before, a warm allocator, a launched thread pool); a configuration whose
  subprocess runs out of memory, is killed, or outlives ``probe_timeout_s`` gets records with the
  status ``"oom"``, ``"error"`` or ``"timeout"`` instead of stopping the run.
* The input ``x`` is created once per configuration, from a seeded generator; it is not timed.
* **Forward** is one call of the case on ``x.detach()`` (no graph is built). **Forward+backward**
  is one call on ``x`` (``requires_grad=True``) followed by ``(out * g).sum().backward()`` for a
  fixed random ``g`` drawn once per case: a fixed random linear functional of the output.
* Each case gets one warm-up call per mode. The timed repeats are then interleaved: every repeat
  runs each case once, round-robin (the order alternates between repeats), so slow drifts of the
  machine hit all cases alike. The reported time is the median over repeats.
* Clocks are ``time.perf_counter``; on CUDA the device is synchronised before each reading.
* A case whose single warm-up call exceeds the per-case time budget gets the status
  ``"timeout"`` (and so do its larger configurations in the same group; a case flagged
  ``compiled`` gets a second call first, since its first call compiles); otherwise the number of
  repeats is cut to fit the budget, but never below ``min_repeats``. A case that raises gets the
  status ``"oom"`` for an out-of-memory failure and ``"error"`` otherwise; the others go on.
* **Saved-for-backward memory** is counted in process, with
  ``torch.autograd.graph.saved_tensors_hooks``: the bytes of the distinct storages the forward
  saves for backward, leaving out the input's own storage. It is exact and deterministic.
* **Peak memory** is measured in a fresh subprocess per configuration and case
  (:mod:`benchmarks.probes`, which runs :mod:`benchmarks._probe`): after a warm-up call,
  the peak extra memory of one forward+backward over the post-set-up baseline. On CPU that is
  the ``ru_maxrss`` high-water mark (reset through ``/proc/self/clear_refs`` where Linux allows
  it) minus the resident set before the call, with glibc's dynamic mmap threshold pinned so that
  freed buffers go back to the OS (a measuring instrument, set in the memory probe only: never
  where anything is timed); on CUDA it is ``torch.cuda.max_memory_allocated`` minus
  ``memory_allocated``.
* Cases flagged ``first_call`` also get their **first call** timed in fresh subprocesses: once with
  an empty ``torch.compile`` cache directory (cold) and once reusing it (warm on-disk cache).
* Every record holds the machine's load average when its configuration started
  (``os.getloadavg``), which the report's header gives: on a shared machine it says how much
  the neighbours ran.

Results are plain dicts (one per configuration and case), written as JSONL, a Markdown table and a
PNG plot by :func:`~benchmarks.report.write_results`.

:func:`run_and_write` is one command-line run of a suite: :func:`make_options` turns the
command's arguments into :class:`~benchmarks.model.RunOptions` (``quick`` takes the suite's
small defaults, a :class:`QuickDefaults`, and turns the subprocess probes off; arguments left at
``None`` take the defaults of the mode), then the suite runs, once per thread setting, and its
files are written under ``out`` (:data:`DEFAULT_OUT` by default).
"""

from __future__ import annotations

import functools
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch

import softops
from benchmarks.model import (
    PROBE_MARKER,
    Case,
    Config,
    RunOptions,
    Suite,
    failure_status,
    functional_weights,
    make_generator,
    pinning,
    sync,
    thread_facts,
    threads_label,
)
from benchmarks.probes import probe_command, run_config_subprocess, run_probe, run_probes
from benchmarks.report import markdown_report, plot_results, progress_bar, write_results
from softops.testing import count_saved_bytes

__all__ = [
    "DEFAULT_OUT",
    "FULL_REPEATS",
    "FULL_TIME_BUDGET_S",
    "PROBE_MARKER",
    "Case",
    "Config",
    "QuickDefaults",
    "RunExtras",
    "RunOptions",
    "Suite",
    "count_saved_bytes",
    "environment",
    "failure_records",
    "functional_weights",
    "make_generator",
    "make_options",
    "markdown_report",
    "plot_results",
    "probe_command",
    "run_and_write",
    "run_config",
    "run_probe",
    "run_suite",
    "sync",
    "thread_runs",
    "write_results",
]
# Case, Config, RunOptions, Suite, PROBE_MARKER and the primitives live in benchmarks.model,
# the probes in benchmarks.probes and the reports in benchmarks.report; they are
# re-exported here, where they were first defined.

_MB = 2.0**20

DEFAULT_OUT = "benchmarks/results"
"""Where ``python -m benchmarks`` writes its files unless ``--out`` says otherwise."""
FULL_REPEATS = 10
"""Timed repeats per case of a full run."""
FULL_TIME_BUDGET_S = 30.0
"""Seconds of timed repeats per case and configuration of a full run."""


class QuickDefaults(TypedDict):
    """The defaults a suite's ``--quick`` run takes (a plain dict at run time)."""

    sizes: tuple[int, ...]
    batch: int
    repeats: int
    time_budget: float


class RunExtras(TypedDict, total=False):
    """The options every suite's run function passes on to :func:`make_options` unchanged."""

    isolate: bool
    timeout: float | None
    memory_limit_mb: float | None
    progress: bool


# ----------------------------------------------------------------------------------------------
# Timing primitives


def _timed(call: Callable[[], Any], device: torch.device) -> float:
    """Seconds taken by ``call()``, with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - start


def _forward(case: Case, x: torch.Tensor) -> torch.Tensor:
    with case.context():
        return case.fn(x)


def _forward_backward(case: Case, x: torch.Tensor, g: torch.Tensor) -> None:
    x.grad = None
    with case.context():
        out = case.fn(x)
        (out * g).sum().backward()


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch threads, then restore the previous count; ``None``: leave it alone.

    Nothing is called when the count is already ``n``: on a busy machine, any explicit
    ``torch.set_num_threads`` (even to the current count) can make tiny ops in the rest of the
    process much slower (observed with torch 2.13 on CPU), so the process state is left alone.
    """
    previous = torch.get_num_threads()
    if n is None or previous == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def _gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ----------------------------------------------------------------------------------------------
# The run


@dataclass
class _CaseState:
    case: Case
    g: torch.Tensor | None = None
    repeats: int = 0
    fwd: list[float] = field(default_factory=list)
    fwdbwd: list[float] = field(default_factory=list)
    fwd_skip: str | None = None
    fwdbwd_skip: str | None = None
    fwd_status: str = "ok"
    fwdbwd_status: str = "ok"
    saved_bytes: int | None = None
    output: torch.Tensor | None = None

    def fail(self, status: str, reason: str, *, forward: bool) -> None:
        """Record why a mode stops (a failed forward stops both)."""
        if forward:
            self.fwd_status, self.fwd_skip = status, reason
        self.fwdbwd_status, self.fwdbwd_skip = status, reason


def _load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def environment(options: RunOptions) -> dict[str, Any]:
    """The facts about the machine, the libraries and the threads stored with every record.

    ``threads`` is the run's torch thread count (the count set, or, out of the box, the count
    the process has), ``threads_setting`` is ``"1"``, ``"2"``, ... or ``"default"``, and
    ``threads_label`` names it for the reports; ``load_avg`` is the 1-, 5- and 15-minute load
    average of the machine now.
    """
    device = torch.device(options.device)
    facts = thread_facts()
    threads = options.threads if options.threads is not None else facts["torch_threads"]
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "threads": threads,
        "threads_setting": "default" if options.threads is None else str(options.threads),
        "threads_label": threads_label(options.threads, facts["torch_threads"]),
        **facts,
        "dtype": options.dtype,
        "cpu_count": os.cpu_count(),
        "load_avg": _load_average(),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    info["softops"] = softops.__version__
    return info


def run_suite(
    suite: Suite,
    configs: Sequence[Config],
    options: RunOptions,
    *,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Measure every case of every configuration; return one record per configuration and case.

    Args:
        suite: the suite that builds inputs and cases.
        configs: the configurations, each group in increasing size.
        options: threads, repeats, budget, probes, isolation, ...
        log: where progress lines go (through the progress bar when ``options.progress``).

    Returns:
        A list of JSON-serialisable dicts (see the module docstring for what each field means).
    """
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    too_slow: dict[tuple[str, str], str] = {}
    per_config: list[list[dict[str, Any]]] = []
    label = threads_label(options.threads, torch.get_num_threads())
    with progress_bar(options.progress, log, total=len(configs)) as bar:
        if options.isolate:
            for index, config in enumerate(configs):
                bar.describe(f"{suite.name} · {label} · {config.label}")
                bar.log(f"[{index + 1}/{len(configs)}] {config.label} ({label}, fresh process)")
                records, slow, lines = _run_config_isolated(suite, config, options, too_slow, stamp)
                for line in lines:
                    bar.log(line)
                too_slow.update(slow)
                per_config.append(records)
                bar.advance()
        else:
            with (
                _threads(options.threads),
                pinning(options.threads is not None),
                torch.enable_grad(),
            ):
                for index, config in enumerate(configs):
                    bar.describe(f"{suite.name} · {label} · {config.label}")
                    bar.log(f"[{index + 1}/{len(configs)}] {config.label} ({label})")
                    per_config.append(run_config(suite, config, options, too_slow, bar.log, stamp))
                    bar.advance()
        if options.memory or options.first_call:
            for config, records in zip(configs, per_config, strict=True):
                run_probes(suite, config, options, records, bar)
    return [record for records in per_config for record in records]


def _base_record(suite: Suite, config: Config, case: Case) -> dict[str, Any]:
    return {
        "suite": suite.name,
        "group": config.group,
        "config": config.label,
        **dict(config.params),
        "case": case.name,
        "floor": case.floor,
    }


def failure_records(
    suite: Suite,
    config: Config,
    options: RunOptions,
    status: str,
    reason: str,
    stamp: str,
) -> list[dict[str, Any]]:
    """The records of a configuration that could not be measured at all (its subprocess ran out
    of memory, crashed or timed out): every case gets ``status`` and ``reason``; the cases the
    suite skips anyway keep their own reason."""
    env = environment(options)
    records = []
    for case in suite.make_cases(config):
        own = case.skip
        records.append(
            {
                **_base_record(suite, config, case),
                "status": "skipped" if own else status,
                "fwdbwd_status": None,
                "fwd_ms": None,
                "fwdbwd_ms": None,
                "floor_fwd_ms": None,
                "fwd_ratio": None,
                "fwdbwd_ratio": None,
                "repeats": 0,
                "fwd_ms_samples": [],
                "fwdbwd_ms_samples": [],
                "saved_mb": None,
                "peak_mb": None,
                "peak_kind": None,
                "skip": own or reason,
                "fwdbwd_skip": None,
                **env,
                **options.extra,
                "time": stamp,
            }
        )
    return records


def _run_config_isolated(
    suite: Suite,
    config: Config,
    options: RunOptions,
    too_slow: Mapping[tuple[str, str], str],
    stamp: str,
) -> tuple[list[dict[str, Any]], dict[tuple[str, str], str], list[str]]:
    """:func:`run_config` in a fresh subprocess: its records, the (group, case) pairs it found
    too slow, and its log lines; a subprocess that failed gives :func:`failure_records`."""
    result, lines = run_config_subprocess(suite, config, options, too_slow, stamp)
    if "records" not in result:
        reason = f"the configuration's subprocess failed: {result.get('error')}"
        if result["status"] == "timeout":
            reason = (
                f"timeout: the configuration's subprocess ran over {options.probe_timeout_s:g} s"
            )
        records = failure_records(suite, config, options, result["status"], reason, stamp)
        return records, {}, [*lines[-5:], f"    {config.label}: {reason}"]
    slow = {(g, c): reason for g, c, reason in result.get("too_slow", [])}
    return result["records"], slow, lines


def run_config(
    suite: Suite,
    config: Config,
    options: RunOptions,
    too_slow: dict[tuple[str, str], str],
    log: Callable[[str], None],
    stamp: str,
) -> list[dict[str, Any]]:
    """Time every case of one configuration in this process (threads as the caller set them).

    ``too_slow`` maps (group, case) to the reason a case is no longer run in its group; the
    cases found too slow here are added to it.
    """
    device = torch.device(options.device)
    dtype = options.torch_dtype()
    env = environment(options)
    gc.collect()
    gen = make_generator(device, options.seed)
    base = suite.make_input(config, device=device, dtype=dtype, generator=gen)
    x_fwd = base.detach()
    x = base.detach().clone().requires_grad_(True)

    states = [_CaseState(case) for case in suite.make_cases(config)]
    for st in states:
        if st.case.skip:
            st.fail("skipped", st.case.skip, forward=True)
        elif (config.group, st.case.name) in too_slow:
            st.fail("timeout", too_slow[(config.group, st.case.name)], forward=True)
        else:
            _warm_up(st, x_fwd, x, config, options, device, too_slow, log)
    runnable = [st for st in states if st.fwd_skip is None]
    _timed_repeats(runnable, x_fwd, x, options, device, log)

    outputs = {st.case.name: st.output for st in runnable if st.output is not None}
    facts = suite.compare(config, outputs) if outputs else {}
    for st in states:
        st.output = None
    x.grad = None

    floor_fwd = next((statistics.median(st.fwd) for st in states if st.case.floor and st.fwd), None)
    records = []
    for st in states:
        fwd_ms = statistics.median(st.fwd) * 1e3 if st.fwd else None
        fb_ms = statistics.median(st.fwdbwd) * 1e3 if st.fwdbwd else None
        floor_ms = floor_fwd * 1e3 if floor_fwd else None
        record: dict[str, Any] = {
            **_base_record(suite, config, st.case),
            "status": st.fwd_status,
            "fwdbwd_status": st.fwdbwd_status if st.fwd_skip is None else None,
            "fwd_ms": fwd_ms,
            "fwdbwd_ms": fb_ms,
            "floor_fwd_ms": floor_ms,
            "fwd_ratio": fwd_ms / floor_ms if fwd_ms and floor_ms else None,
            "fwdbwd_ratio": fb_ms / floor_ms if fb_ms and floor_ms else None,
            "repeats": len(st.fwd),
            "fwd_ms_samples": [round(t * 1e3, 4) for t in st.fwd],
            "fwdbwd_ms_samples": [round(t * 1e3, 4) for t in st.fwdbwd],
            "saved_mb": st.saved_bytes / _MB if st.saved_bytes is not None else None,
            "peak_mb": None,
            "peak_kind": None,
            "skip": st.fwd_skip,
            "fwdbwd_skip": st.fwdbwd_skip if st.fwd_skip is None else None,
            **facts,
            **env,
            **options.extra,
            "time": stamp,
        }
        records.append(record)
        if fwd_ms is not None:
            ratio = record["fwdbwd_ratio"]
            fb = f"{fb_ms:10.2f} ms fwd+bwd" if fb_ms is not None else " " * 18
            rtxt = f" ({ratio:.1f}x floor)" if ratio is not None else ""
            log(f"    {st.case.name:<28} {fwd_ms:10.2f} ms fwd {fb}{rtxt}")
    return records


def _failure(err: Exception, what: str) -> tuple[str, str]:
    status = failure_status(err)
    text = f"{type(err).__name__}: {err}".strip()
    if len(text) > 300:
        text = text[:297] + "..."
    prefix = "out of memory" if status == "oom" else "error"
    return status, f"{prefix}{what}: {text}"


def _warm_up(
    st: _CaseState,
    x_fwd: torch.Tensor,
    x: torch.Tensor,
    config: Config,
    options: RunOptions,
    device: torch.device,
    too_slow: dict[tuple[str, str], str],
    log: Callable[[str], None],
) -> None:
    """One untimed call per mode of one case.

    Keeps the forward output (for ``compare``), draws ``g``, counts the bytes saved for
    backward, and gives the case the status ``"timeout"`` (here and at larger sizes of its
    group) when one call exceeds the time budget; for a ``compiled`` case, when a second call
    does too (the first compiles). A case that raises gets ``"oom"`` or ``"error"`` with the
    error, and the run goes on.
    """
    budget = options.time_budget_s
    name = st.case.name
    try:
        for _ in range(2 if st.case.compiled else 1):
            start = time.perf_counter()
            out = _forward(st.case, x_fwd)
            sync(device)
            t_fwd = time.perf_counter() - start
            if t_fwd <= budget:
                break
    except Exception as err:
        st.fail(*_failure(err, ""), forward=True)
        log(f"    {name}: {st.fwd_skip}")
        return
    if t_fwd > budget:
        reason = too_slow[(config.group, name)] = (
            f"too slow: one forward took {t_fwd:.1f} s at {config.label}, over the "
            f"{budget:g} s budget"
        )
        st.fail("timeout", reason, forward=True)
        log(f"    {name}: {reason}")
        return
    st.output = out.detach()
    g = st.g = functional_weights(out.shape, out, options.seed, name)
    try:
        for _ in range(2 if st.case.compiled else 1):
            start = time.perf_counter()
            x.grad = None
            with st.case.context():
                out, st.saved_bytes = count_saved_bytes(st.case.fn, x)
                (out * g).sum().backward()
            sync(device)
            t_fb = time.perf_counter() - start
            if t_fb <= budget:
                break
    except Exception as err:
        st.fail(*_failure(err, " (fwd+bwd)"), forward=False)
        log(f"    {name}: {st.fwdbwd_skip}")
        return
    if t_fb > budget:
        reason = too_slow[(config.group, name)] = (
            f"too slow: one forward+backward took {t_fb:.1f} s at {config.label}, over the "
            f"{budget:g} s budget"
        )
        st.fail("timeout", reason, forward=False)
        log(f"    {name}: {reason}")


def _timed_repeats(
    runnable: Sequence[_CaseState],
    x_fwd: torch.Tensor,
    x: torch.Tensor,
    options: RunOptions,
    device: torch.device,
    log: Callable[[str], None],
) -> None:
    """The timed repeats, interleaved round-robin; the order alternates between repeats.

    After the first repeat each case's number of repeats is cut to fit the time budget, never
    below ``min_repeats``. A case that raises in a timed call (memory can run out on a later
    call too) keeps the repeats it has and is not called again.
    """
    for st in runnable:
        st.repeats = options.repeats
    with _gc_paused():
        for rep in range(options.repeats):
            for st in runnable if rep % 2 == 0 else runnable[::-1]:
                if rep >= st.repeats:
                    continue
                _timed_repeat(st, rep, x_fwd, x, device, log)
            if rep == 0:
                for st in runnable:
                    if st.repeats == 0:  # failed in its first timed call
                        continue
                    per_repeat = st.fwd[0] + (st.fwdbwd[0] if st.fwdbwd else 0.0)
                    fit = int(options.time_budget_s // per_repeat) if per_repeat > 0 else 0
                    st.repeats = max(options.min_repeats, min(options.repeats, fit or 1))


def _timed_repeat(
    st: _CaseState,
    rep: int,
    x_fwd: torch.Tensor,
    x: torch.Tensor,
    device: torch.device,
    log: Callable[[str], None],
) -> None:
    """One timed forward, then one timed forward+backward, of one case.

    A mode that raises (memory can run out on a later call too) is reported as failed, without
    its samples, and the case is not called again.
    """
    case = st.case
    try:
        st.fwd.append(_timed(functools.partial(_forward, case, x_fwd), device))
    except Exception as err:
        st.fail(*_failure(err, f" in timed repeat {rep + 1}"), forward=True)
        st.fwd, st.fwdbwd, st.repeats = [], [], 0
        log(f"    {case.name}: {st.fwd_skip}")
        return
    if st.fwdbwd_skip is not None or st.g is None:
        return
    try:
        st.fwdbwd.append(_timed(functools.partial(_forward_backward, case, x, st.g), device))
    except Exception as err:
        st.fail(*_failure(err, f" (fwd+bwd) in timed repeat {rep + 1}"), forward=False)
        st.fwdbwd = []
        log(f"    {case.name}: {st.fwdbwd_skip}")


# ----------------------------------------------------------------------------------------------
# One command-line run of a suite


def make_options(
    quick_defaults: QuickDefaults,
    *,
    quick: bool,
    device: str,
    dtype: str,
    threads: int | None,
    repeats: int | None,
    time_budget: float | None,
    memory: bool,
    first_call: bool,
    seed: int,
    command: str | None,
    **extras: Unpack[RunExtras],
) -> RunOptions:
    """The harness options of a bench run; ``quick`` takes ``quick_defaults`` and no probes.

    ``extras`` (:class:`RunExtras`): ``isolate`` (each configuration in a fresh subprocess),
    ``timeout`` (seconds before a subprocess is killed), ``memory_limit_mb`` (the subprocesses'
    address-space cap) and ``progress`` (a progress bar).

    Example:
        >>> from benchmarks.harness import make_options
        >>> quick = {"sizes": (1000,), "batch": 4, "repeats": 3, "time_budget": 2.0}
        >>> options = make_options(
        ...     quick, quick=True, device="cpu", dtype="float32", threads=1, repeats=None,
        ...     time_budget=None, memory=True, first_call=True, seed=0, command=None,
        ... )
        >>> options.repeats, options.time_budget_s, options.memory, options.first_call
        (3, 2.0, False, False)
    """
    full = not quick
    options = RunOptions(
        device=device,
        dtype=dtype,
        threads=threads,
        repeats=repeats or (FULL_REPEATS if full else quick_defaults["repeats"]),
        time_budget_s=time_budget
        or (FULL_TIME_BUDGET_S if full else quick_defaults["time_budget"]),
        memory=memory and full,
        first_call=first_call and full,
        seed=seed,
        isolate=bool(extras.get("isolate", False)),
        memory_limit_mb=extras.get("memory_limit_mb"),
        progress=bool(extras.get("progress", False)),
        extra={"command": command} if command else {},
    )
    timeout = extras.get("timeout")
    if timeout is not None:
        options.probe_timeout_s = timeout
    options.min_repeats = min(options.min_repeats, options.repeats)
    return options


def thread_runs(
    options: RunOptions, threads: Sequence[int | None] | int | None
) -> list[RunOptions]:
    """One copy of ``options`` per thread setting (``None``: out of the box), in order.

    With more than one setting every copy runs its configurations in fresh subprocesses
    (``isolate``): the out-of-the-box run must not inherit a thread count another one set.
    The subprocess probes (peak memory, first calls) run in the first setting only: what a
    forward+backward allocates does not depend on the thread count (beyond per-thread
    scratch), and each probe is a process start per configuration and case.

    Example:
        >>> from benchmarks.harness import RunOptions, thread_runs
        >>> runs = thread_runs(RunOptions(), [1, None])
        >>> [(r.threads, r.isolate, r.memory) for r in runs]
        [(1, True, True), (None, True, False)]
    """
    settings = list(threads) if isinstance(threads, Sequence) else [threads]
    settings = list(dict.fromkeys(settings)) or [options.threads]
    isolate = options.isolate or len(settings) > 1
    return [
        replace(
            options,
            threads=t,
            isolate=isolate,
            memory=options.memory and i == 0,
            first_call=options.first_call and i == 0,
        )
        for i, t in enumerate(settings)
    ]


def run_and_write(
    suite: Suite,
    configs: Sequence[Config],
    options: RunOptions | Sequence[RunOptions],
    out: str | os.PathLike[str],
    name: str,
    command: str | None,
    log: Callable[[str], None],
) -> tuple[str, dict[str, Path]]:
    """Run ``configs`` of ``suite``, write the JSONL/Markdown/PNG files, return the report.

    Args:
        suite: the suite.
        configs: its configurations.
        options: how to run them; a sequence runs them once per element (for example one per
            thread setting, :func:`thread_runs`) into the same files.
        out: the output folder.
        name: the file stem (``"topk"``, ``"topk-quick"``, ...).
        command: the command line stored in the records and the report.
        log: where progress lines go.

    Returns:
        The Markdown report and the paths written (keyed by ``"jsonl"``, ``"md"``, ``"png"``).
    """
    start = time.perf_counter()
    runs = [options] if isinstance(options, RunOptions) else list(options)
    records = [r for run in runs for r in run_suite(suite, configs, run, log=log)]
    paths = write_results(records, suite, out, name, command=command)
    log(
        f"done in {time.perf_counter() - start:.0f} s; wrote "
        + ", ".join(str(p) for p in paths.values())
    )
    return paths["md"].read_text(encoding="utf-8"), paths
