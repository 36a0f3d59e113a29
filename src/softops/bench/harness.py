r"""The timing loop of the benchmark harness: :func:`run_suite`, and :func:`run_and_write`.

A suite (:class:`~softops.bench.model.Suite`) gives configurations and, for each, cases; one case
is the *floor*, the hard operator. For a case :math:`c` with median forward time :math:`t_c` and
median forward+backward time :math:`T_c`, the report gives :math:`t_c / t_{\mathrm{floor}}` and
:math:`T_c / t_{\mathrm{floor}}`: the headline numbers, because absolute times on a shared
machine drift from run to run while ratios taken in one run do not.

How a configuration is measured (:func:`run_suite`):

* ``torch.set_num_threads(threads)`` is set explicitly (1 by default) and restored afterwards.
* The input ``x`` is created once per configuration, from a seeded generator; it is not timed.
* **Forward** is one call of the case on ``x.detach()`` (no graph is built). **Forward+backward**
  is one call on ``x`` (``requires_grad=True``) followed by ``(out * g).sum().backward()`` for a
  fixed random ``g`` drawn once per case: a fixed random linear functional of the output.
* Each case gets one warm-up call per mode. The timed repeats are then interleaved: every repeat
  runs each case once, round-robin (the order alternates between repeats), so slow drifts of the
  machine hit all cases alike. The reported time is the median over repeats.
* Clocks are ``time.perf_counter``; on CUDA the device is synchronised before each reading.
* A case whose single warm-up call exceeds the per-case time budget is skipped (and so are its
  larger configurations in the same group; a case flagged ``compiled`` gets a second call first,
  since its first call compiles); otherwise the number of repeats is cut to fit the budget, but
  never below ``min_repeats``.
* **Saved-for-backward memory** is counted in process, with
  ``torch.autograd.graph.saved_tensors_hooks``: the bytes of the distinct storages the forward
  saves for backward, leaving out the input's own storage. It is exact and deterministic.
* **Peak memory** is measured in a fresh subprocess per configuration and case
  (:mod:`softops.bench.probes`, which runs :mod:`softops.bench._probe`): after a warm-up call,
  the peak extra memory of one forward+backward over the post-set-up baseline. On CPU that is
  the ``ru_maxrss`` high-water mark (reset through ``/proc/self/clear_refs`` where Linux allows
  it) minus the resident set before the call, with glibc's dynamic mmap threshold pinned so that
  freed buffers go back to the OS; on CUDA it is ``torch.cuda.max_memory_allocated`` minus
  ``memory_allocated``.
* Cases flagged ``first_call`` also get their **first call** timed in fresh subprocesses: once with
  an empty ``torch.compile`` cache directory (cold) and once reusing it (warm on-disk cache).

Results are plain dicts (one per configuration and case), written as JSONL, a Markdown table and a
PNG plot by :func:`~softops.bench.report.write_results`.

:func:`run_and_write` is one command-line run of a suite: :func:`make_options` turns the
command's arguments into :class:`~softops.bench.model.RunOptions` (``quick`` takes the suite's
small defaults, a :class:`QuickDefaults`, and turns the subprocess probes off; arguments left at
``None`` take the defaults of the mode), then the suite runs and its files are written under
``out`` (:data:`DEFAULT_OUT` by default).
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict

import torch

import softops
from softops.bench.model import (
    PROBE_MARKER,
    Case,
    Config,
    RunOptions,
    Suite,
    count_saved_bytes,
    functional_weights,
    make_generator,
    sync,
)
from softops.bench.probes import _run_probes, probe_command, run_probe
from softops.bench.report import markdown_report, plot_results, write_results

__all__ = [
    "DEFAULT_OUT",
    "FULL_REPEATS",
    "FULL_TIME_BUDGET_S",
    "PROBE_MARKER",
    "Case",
    "Config",
    "QuickDefaults",
    "RunOptions",
    "Suite",
    "count_saved_bytes",
    "environment",
    "functional_weights",
    "make_generator",
    "make_options",
    "markdown_report",
    "plot_results",
    "probe_command",
    "run_and_write",
    "run_probe",
    "run_suite",
    "sync",
    "write_results",
]
# Case, Config, RunOptions, Suite, PROBE_MARKER and the primitives live in softops.bench.model,
# the probes in softops.bench.probes and the reports in softops.bench.report; they are
# re-exported here, where they were first defined.

_MB = 2.0**20

DEFAULT_OUT = "benchmarks/results"
"""Where ``softops bench`` writes its files unless ``--out`` says otherwise."""
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
def _threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch threads, then restore the previous count.

    Nothing is called when the count is already ``n``: on a busy machine, any explicit
    ``torch.set_num_threads`` (even to the current count) can make tiny ops in the rest of the
    process much slower (observed with torch 2.13 on CPU), so the process state is left alone.
    """
    previous = torch.get_num_threads()
    if previous == n:
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
    saved_bytes: int | None = None
    output: torch.Tensor | None = None


def environment(options: RunOptions) -> dict[str, Any]:
    """The facts about the machine and libraries stored with every record."""
    device = torch.device(options.device)
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "threads": options.threads,
        "dtype": options.dtype,
        "cpu_count": os.cpu_count(),
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
        options: threads, repeats, budget, probes, ...
        log: where progress lines go.

    Returns:
        A list of JSON-serialisable dicts (see the module docstring for what each field means).
    """
    device = torch.device(options.device)
    dtype = options.torch_dtype()
    env = environment(options)
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    too_slow: dict[tuple[str, str], str] = {}
    per_config: list[list[dict[str, Any]]] = []
    with _threads(options.threads), torch.enable_grad():
        for index, config in enumerate(configs):
            log(f"[{index + 1}/{len(configs)}] {config.label}")
            per_config.append(
                _run_config(suite, config, options, device, dtype, too_slow, env, stamp, log)
            )
    if options.memory or options.first_call:
        for config, records in zip(configs, per_config, strict=True):
            _run_probes(suite, config, options, records, log)
    return [record for records in per_config for record in records]


def _run_config(
    suite: Suite,
    config: Config,
    options: RunOptions,
    device: torch.device,
    dtype: torch.dtype,
    too_slow: dict[tuple[str, str], str],
    env: Mapping[str, Any],
    stamp: str,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    gc.collect()
    gen = make_generator(device, options.seed)
    base = suite.make_input(config, device=device, dtype=dtype, generator=gen)
    x_fwd = base.detach()
    x = base.detach().clone().requires_grad_(True)

    states = [_CaseState(case) for case in suite.make_cases(config)]
    for st in states:
        reason = st.case.skip or too_slow.get((config.group, st.case.name))
        if reason:
            st.fwd_skip = st.fwdbwd_skip = reason
        else:
            _warm_up(st, x_fwd, x, config, options, device, too_slow, log)
    runnable = [st for st in states if st.fwd_skip is None]
    _timed_repeats(runnable, x_fwd, x, options, device)

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
            "suite": suite.name,
            "group": config.group,
            "config": config.label,
            **dict(config.params),
            "case": st.case.name,
            "floor": st.case.floor,
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
    backward, and skips the case (here and at larger sizes of its group) when one call exceeds
    the time budget; for a ``compiled`` case, when a second call does too (the first compiles).
    A case that raises is reported with its error instead of stopping the run.
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
        st.fwd_skip = st.fwdbwd_skip = f"error: {type(err).__name__}: {err}"
        log(f"    {name}: {st.fwd_skip}")
        return
    if t_fwd > budget:
        st.fwd_skip = st.fwdbwd_skip = too_slow[(config.group, name)] = (
            f"too slow: one forward took {t_fwd:.1f} s at {config.label}, over the "
            f"{budget:g} s budget"
        )
        log(f"    {name}: {st.fwd_skip}")
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
        st.fwdbwd_skip = f"error: {type(err).__name__}: {err}"
        log(f"    {name}: {st.fwdbwd_skip}")
        return
    if t_fb > budget:
        st.fwdbwd_skip = too_slow[(config.group, name)] = (
            f"too slow: one forward+backward took {t_fb:.1f} s at {config.label}, over the "
            f"{budget:g} s budget"
        )
        log(f"    {name}: {st.fwdbwd_skip}")


def _timed_repeats(
    runnable: Sequence[_CaseState],
    x_fwd: torch.Tensor,
    x: torch.Tensor,
    options: RunOptions,
    device: torch.device,
) -> None:
    """The timed repeats, interleaved round-robin; the order alternates between repeats.

    After the first repeat each case's number of repeats is cut to fit the time budget, never
    below ``min_repeats``.
    """
    for st in runnable:
        st.repeats = options.repeats
    with _gc_paused():
        for rep in range(options.repeats):
            for st in runnable if rep % 2 == 0 else runnable[::-1]:
                if rep >= st.repeats:
                    continue
                case = st.case
                st.fwd.append(_timed(functools.partial(_forward, case, x_fwd), device))
                if st.fwdbwd_skip is None and st.g is not None:
                    st.fwdbwd.append(
                        _timed(functools.partial(_forward_backward, case, x, st.g), device)
                    )
            if rep == 0:
                for st in runnable:
                    per_repeat = st.fwd[0] + (st.fwdbwd[0] if st.fwdbwd else 0.0)
                    fit = int(options.time_budget_s // per_repeat) if per_repeat > 0 else 0
                    st.repeats = max(options.min_repeats, min(options.repeats, fit or 1))


# ----------------------------------------------------------------------------------------------
# One command-line run of a suite


def make_options(
    quick_defaults: QuickDefaults,
    *,
    quick: bool,
    device: str,
    dtype: str,
    threads: int,
    repeats: int | None,
    time_budget: float | None,
    memory: bool,
    first_call: bool,
    seed: int,
    command: str | None,
) -> RunOptions:
    """The harness options of a bench run; ``quick`` takes ``quick_defaults`` and no probes.

    Example:
        >>> from softops.bench.harness import make_options
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
        extra={"command": command} if command else {},
    )
    options.min_repeats = min(options.min_repeats, options.repeats)
    return options


def run_and_write(
    suite: Suite,
    configs: Sequence[Config],
    options: RunOptions,
    out: str | os.PathLike[str],
    name: str,
    command: str | None,
    log: Callable[[str], None],
) -> tuple[str, dict[str, Path]]:
    """Run ``configs`` of ``suite``, write the JSONL/Markdown/PNG files, return the report.

    Args:
        suite: the suite.
        configs: its configurations.
        options: how to run them.
        out: the output folder.
        name: the file stem (``"topk"``, ``"topk-quick"``, ...).
        command: the command line stored in the records and the report.
        log: where progress lines go.

    Returns:
        The Markdown report and the paths written (keyed by ``"jsonl"``, ``"md"``, ``"png"``).
    """
    start = time.perf_counter()
    records = run_suite(suite, configs, options, log=log)
    paths = write_results(records, suite, out, name, command=command)
    log(
        f"done in {time.perf_counter() - start:.0f} s; wrote "
        + ", ".join(str(p) for p in paths.values())
    )
    return paths["md"].read_text(encoding="utf-8"), paths
