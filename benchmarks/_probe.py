"""Measurements that need a fresh process: the entry point of the probe subprocesses.

``python -m benchmarks._probe config --suite MOD:ATTR --config JSON --options JSON [...]``
    The timing loop of one configuration (:func:`benchmarks.harness.run_config`: every case,
    warm-ups, interleaved repeats) in this fresh process; prints its records, the cases found
    over the time budget, and sends its log lines to stderr.

``python -m benchmarks._probe memory --suite MOD:ATTR --config JSON --case NAME [...]``
    Peak extra memory of one forward+backward of one case, after a warm-up call (so a compiled
    path is compiled before measuring). On CPU: the peak resident set after the call minus the
    resident set before it, with the high-water mark first reset to the current resident set
    through ``/proc/self/clear_refs`` (Linux). The peak is ``VmHWM`` from /proc where available,
    else ``resource.getrusage(...).ru_maxrss``; without the reset the baseline is the
    high-water mark before the call, which can only under-estimate. On CUDA:
    ``torch.cuda.max_memory_allocated`` minus ``memory_allocated``, after resetting the peak.
    Also reports the bytes saved for backward (see :func:`benchmarks.model.count_saved_bytes`).

``python -m benchmarks._probe first-call ...``
    Seconds of the first forward+backward of one case in this fresh process (which includes any
    ``torch.compile`` compilation), and of the second.

Every kind takes ``--threads N`` (``torch.set_num_threads(N)`` first thing, before any case is
built) or ``--threads default`` (nothing set: the out-of-the-box configuration, numba unpinned),
and ``--memory-limit-mb M``: the address space is capped at its size after set-up plus M MiB
(``RLIMIT_AS``), so that an allocation over it fails at once. An out-of-memory error in the
measured calls is reported as ``{"status": "oom", ...}`` rather than a crash.

The result is printed as one JSON line prefixed with ``SOFTOPS_PROBE_RESULT``. The harness side
(the command line, the subprocess, reading the result) is :mod:`benchmarks.probes`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.harness import run_config
from benchmarks.model import (
    PROBE_MARKER,
    Case,
    Config,
    RunOptions,
    Suite,
    failure_status,
    functional_weights,
    make_generator,
    parse_threads,
    pinning,
    sync,
)
from softops.testing import count_saved_bytes

_MB = 2.0**20


def resolve_suite(ref: str) -> Suite:
    """Import ``"module:attribute"`` and return the suite object."""
    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _peak_rss_bytes() -> int:
    """The process's peak resident set: ``VmHWM`` where /proc has it, else ``ru_maxrss``.

    On Linux ``ru_maxrss`` is the larger of the memory map's high-water mark (``VmHWM``, which
    ``clear_refs`` resets) and the marks recorded when threads exit (which nothing resets), so
    ``VmHWM`` is read first.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def _current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _reset_high_water_mark() -> bool:
    """Reset the peak RSS to the current RSS (Linux >= 4.0); return whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def _memory(case: Case, x: torch.Tensor, seed: int) -> dict[str, Any]:
    device = x.device
    with case.context():
        out = case.fn(x)
        g = functional_weights(out.shape, out, seed, case.name)
        (out * g).sum().backward()  # warm-up (compiles a compiled path)
    del out
    x.grad = None
    gc.collect()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        kind = "cuda max_memory_allocated"
    else:
        current = _current_rss_bytes()
        if current is not None and _reset_high_water_mark():
            baseline, kind = current, "rss"
        else:
            baseline, kind = _peak_rss_bytes(), "rss (high-water mark not reset: a lower bound)"
    with case.context():
        out, saved = count_saved_bytes(case.fn, x)
        (out * g).sum().backward()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _peak_rss_bytes()
    return {
        "peak_mb": max(0, peak - baseline) / _MB,
        "peak_kind": kind,
        "baseline_mb": baseline / _MB,
        "saved_mb": saved / _MB,
    }


def _first_call(case: Case, x: torch.Tensor, seed: int) -> dict[str, Any]:
    device = x.device
    result: dict[str, Any] = {}
    for tag in ("first_s", "second_s"):
        x.grad = None
        with case.context():
            sync(device)
            start = time.perf_counter()
            out = case.fn(x)
            sync(device)
            forward = time.perf_counter() - start
            g = functional_weights(out.shape, out, seed, case.name)  # not timed
            start = time.perf_counter()
            (out * g).sum().backward()
            sync(device)
        result[tag] = forward + time.perf_counter() - start
    return result


def _limit_memory(extra_mb: float | None) -> None:
    """Cap the address space at its current size plus ``extra_mb`` MiB (Linux; else a no-op)."""
    if extra_mb is None:
        return
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            size = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return
    limit = size + int(extra_mb * _MB)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _config(
    suite: Suite, config: Config, options: RunOptions, too_slow_json: str, stamp: str
) -> dict[str, Any]:
    too_slow = {(g, c): reason for g, c, reason in json.loads(too_slow_json)}
    known = set(too_slow)

    def log(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    records = run_config(suite, config, options, too_slow, log, stamp)
    found = [[g, c, reason] for (g, c), reason in too_slow.items() if (g, c) not in known]
    return {"records": records, "too_slow": found}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one probe and print its JSON result line; the exit status is 0 on success."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._probe")
    parser.add_argument("kind", choices=["memory", "first-call", "config"])
    parser.add_argument("--suite", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--case", default="")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-limit-mb", type=float, default=None)
    parser.add_argument("--options", default=None, help="config: the RunOptions as JSON")
    parser.add_argument("--too-slow", default="[]", help="config: [[group, case, reason], ...]")
    parser.add_argument("--stamp", default="", help="config: the run's time stamp")
    args = parser.parse_args(argv)

    threads = parse_threads(args.threads)
    if threads is not None:
        torch.set_num_threads(threads)
    suite = resolve_suite(args.suite)
    config = Config.from_json(args.config)
    with pinning(threads is not None):
        if args.kind == "config":
            options = RunOptions.from_json(args.options or "{}")
            options.threads, options.isolate, options.progress = threads, False, False
            _limit_memory(args.memory_limit_mb)
            with torch.enable_grad():
                result = _config(suite, config, options, args.too_slow, args.stamp)
            print(PROBE_MARKER + json.dumps(result), flush=True)
            return 0
        cases = {case.name: case for case in suite.make_cases(config)}
        if args.case not in cases:
            parser.error(f"expected a case of {config.label}: {sorted(cases)}; got {args.case!r}.")
        case = cases[args.case]
        device = torch.device(args.device)
        dtype = getattr(torch, args.dtype)
        gen = make_generator(device, args.seed)
        x = suite.make_input(config, device=device, dtype=dtype, generator=gen)
        x = x.detach().clone().requires_grad_(True)
        _limit_memory(args.memory_limit_mb)
        try:
            with torch.enable_grad():
                if args.kind == "memory":
                    result = _memory(case, x, args.seed)
                else:
                    result = _first_call(case, x, args.seed)
        except Exception as err:
            status = failure_status(err)
            if status != "oom":
                raise
            result = {"status": "oom", "error": f"{type(err).__name__}: {err}"[:300]}
    print(PROBE_MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
