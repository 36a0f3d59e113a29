"""Measurements in fresh subprocesses: whole configurations, peak memory and first calls.

A subprocess runs one configuration (all its cases, timed and interleaved), or one case of one
configuration, in a new interpreter (``python -m benchmarks._probe KIND ...``, see
:mod:`benchmarks._probe`), so that what it measures is not blurred by the state of the
harness process:

* ``config`` (:func:`run_config_subprocess`): the timing loop of one configuration, with the
  run's thread setting applied at the start of the process (or none, out of the box);
* ``memory``: the peak extra memory of one forward+backward after a warm-up call;
* ``first-call``: the first call of a compiled path (once with an empty ``torch.compile`` cache
  directory, once reusing it).

The subprocess rebuilds the suite from its ``ref`` and prints one JSON line prefixed with
:data:`~benchmarks.model.PROBE_MARKER`. How a subprocess ends becomes a status
(:data:`~benchmarks.model.STATUSES`): a result line is ``"ok"`` (or the status the child
reports, ``"oom"`` when it caught an out-of-memory error); past ``probe_timeout_s`` it is killed
and the status is ``"timeout"``; killed by SIGKILL (what the kernel's OOM killer sends) it is
``"oom"``; any other exit without a result is ``"error"``, with the last lines of its stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from benchmarks.model import PROBE_MARKER, Config, RunOptions, Suite

__all__ = [
    "probe_command",
    "run_config_subprocess",
    "run_probe",
    "run_probes",
    "run_subprocess",
]

_ROOT = str(Path(__file__).resolve().parent.parent)
"""The folder that holds the ``benchmarks`` package, put first on the child's ``PYTHONPATH``
so that ``python -m benchmarks._probe`` runs from any working directory."""


class _Bar(Protocol):
    """The part of :func:`benchmarks.report.progress_bar` the probes use."""

    def log(self, line: str) -> None: ...
    def describe(self, text: str) -> None: ...
    def add(self, steps: int) -> None: ...
    def advance(self) -> None: ...


def _threads_arg(options: RunOptions) -> str:
    return "default" if options.threads is None else str(options.threads)


def probe_command(
    kind: str, suite: Suite, config: Config, case: str, options: RunOptions
) -> list[str]:
    """The command line of one probe subprocess (``case`` is ignored by ``kind="config"``)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks._probe",
        kind,
        "--suite",
        suite.ref,
        "--config",
        config.to_json(),
        "--case",
        case,
        "--device",
        options.device,
        "--dtype",
        options.dtype,
        "--threads",
        _threads_arg(options),
        "--seed",
        str(options.seed),
    ]
    if options.memory_limit_mb is not None:
        command += ["--memory-limit-mb", f"{options.memory_limit_mb:g}"]
    return command


def run_subprocess(
    command: list[str], timeout: float, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run one subprocess; return its JSON result line with a ``status``, or a failure.

    Returns:
        The child's result (``status`` defaulting to ``"ok"``), or ``{"status": "timeout" |
        "oom" | "error", "error": reason}``; ``"stderr"`` holds the child's stderr lines.
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    path = full_env.get("PYTHONPATH")
    full_env["PYTHONPATH"] = _ROOT + (os.pathsep + path if path else "")
    try:
        proc = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else ""
        return {
            "status": "timeout",
            "error": f"timed out after {timeout:g} s",
            "stderr": (stderr or "").splitlines(),
        }
    lines = (proc.stderr or "").splitlines()
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(PROBE_MARKER):
            result = json.loads(line[len(PROBE_MARKER) :])
            result.setdefault("status", "ok")
            result["stderr"] = lines
            return result
    tail = " | ".join((lines or proc.stdout.strip().splitlines())[-3:])
    if proc.returncode == -signal.SIGKILL:
        return {
            "status": "oom",
            "error": "killed by SIGKILL (the kernel's OOM killer sends it: out of memory?)"
            + (f": {tail}" if tail else ""),
            "stderr": lines,
        }
    return {"status": "error", "error": f"exit {proc.returncode}: {tail}", "stderr": lines}


def run_probe(
    kind: str,
    suite: Suite,
    config: Config,
    case: str,
    options: RunOptions,
    *,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run one probe in a fresh subprocess; return its JSON result with a ``status``.

    A failure is ``{"status": ..., "error": reason}`` (see :func:`run_subprocess`).
    """
    full_env: dict[str, str] = {}
    if kind == "memory" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # A fixed mmap threshold turns off glibc's dynamic one, so large freed buffers go back to
        # the OS at once and the resident set tracks live memory: a measuring instrument of the
        # memory probe alone. Not for timing: mapping every large buffer afresh slows
        # allocation-heavy code down, and a user's process does not set it.
        full_env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    full_env.update(env or {})
    command = probe_command(kind, suite, config, case, options)
    return run_subprocess(command, options.probe_timeout_s, full_env)


def run_config_subprocess(
    suite: Suite,
    config: Config,
    options: RunOptions,
    too_slow: Mapping[tuple[str, str], str],
    stamp: str,
) -> tuple[dict[str, Any], list[str]]:
    """Time one configuration in a fresh subprocess.

    Args:
        suite: the suite (rebuilt in the child from ``suite.ref``).
        config: the configuration.
        options: the run's options (threads applied at the start of the child).
        too_slow: the (group, case) pairs already over the time budget, with their reasons.
        stamp: the run's time stamp, stored in the records.

    Returns:
        The child's result and its non-empty log lines. A child that ran returns its
        ``records`` and the ``too_slow`` entries it found; one that ran out of memory, crashed
        or timed out returns no ``records``, and its ``status`` and ``error`` say why (the
        harness turns them into records, :func:`benchmarks.harness.failure_records`).
    """
    command = probe_command("config", suite, config, "", options)
    command += [
        "--options",
        options.to_json(),
        "--too-slow",
        json.dumps([[g, c, reason] for (g, c), reason in too_slow.items()]),
        "--stamp",
        stamp,
    ]
    result = run_subprocess(command, options.probe_timeout_s)
    return result, [line for line in result.get("stderr", []) if line.strip()]


def run_probes(
    suite: Suite,
    config: Config,
    options: RunOptions,
    records: list[dict[str, Any]],
    bar: _Bar,
) -> None:
    """Run the probes ``options`` asks for on one configuration; fill them into its records.

    ``peak_status`` says how the memory probe ended (``"ok"``, ``"oom"``, ``"timeout"``,
    ``"error"``), with ``peak_error`` the reason when it failed.
    """
    by_name = {record["case"]: record for record in records}
    todo: list[tuple[str, dict[str, Any]]] = []
    for case in suite.make_cases(config):
        record = by_name.get(case.name)
        if record is None or record["fwd_ms"] is None:
            continue
        if options.memory and record["fwdbwd_ms"] is not None:
            todo.append(("memory", record))
        if options.first_call and config.first_call and case.first_call:
            todo.append(("first-call", record))
    bar.add(len(todo))
    for kind, record in todo:
        text = f"{kind} probe: {config.label} / {record['case']}"
        bar.describe(f"{suite.name} · {text}")
        bar.log(f"  {text}" + (" (cold, then warm cache)" if kind == "first-call" else ""))
        if kind == "memory":
            _memory_probe(suite, config, options, record)
        else:
            _first_call_probe(suite, config, options, record)
        bar.advance()


def _memory_probe(
    suite: Suite, config: Config, options: RunOptions, record: dict[str, Any]
) -> None:
    result = run_probe("memory", suite, config, record["case"], options)
    record["peak_status"] = result["status"]
    if result["status"] != "ok":
        record["peak_error"] = result.get("error")
        return
    record["peak_mb"] = result["peak_mb"]
    record["peak_kind"] = result["peak_kind"]
    record["probe_saved_mb"] = result["saved_mb"]


def _first_call_probe(
    suite: Suite, config: Config, options: RunOptions, record: dict[str, Any]
) -> None:
    name = record["case"]
    with tempfile.TemporaryDirectory(prefix="softops-inductor-") as cache:
        cache_env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        cold = run_probe("first-call", suite, config, name, options, env=cache_env)
        warm = run_probe("first-call", suite, config, name, options, env=cache_env)
    for tag, result in (("cold", cold), ("warm_cache", warm)):
        if result["status"] != "ok":
            record[f"first_call_{tag}_error"] = f"{result['status']}: {result.get('error')}"
        else:
            record[f"first_call_{tag}_s"] = result["first_s"]
            record[f"second_call_{tag}_s"] = result["second_s"]
