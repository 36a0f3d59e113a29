"""Measurements in fresh subprocesses: the peak-memory and first-call probes.

A probe runs one case of one configuration in a new interpreter
(``python -m softops.bench._probe KIND ...``, see :mod:`softops.bench._probe`), so that what it
measures is not blurred by the state of the harness process: the peak extra memory of one
forward+backward after a warm-up call, or the first call of a compiled path (once with an empty
``torch.compile`` cache directory, once reusing it). The subprocess rebuilds the suite from its
``ref`` and prints one JSON line prefixed with :data:`~softops.bench.model.PROBE_MARKER`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from softops.bench.model import PROBE_MARKER, Config, RunOptions, Suite

__all__ = ["probe_command", "run_probe"]


def probe_command(
    kind: str, suite: Suite, config: Config, case: str, options: RunOptions
) -> list[str]:
    """The command line of one probe subprocess."""
    return [
        sys.executable,
        "-m",
        "softops.bench._probe",
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
        str(options.threads),
        "--seed",
        str(options.seed),
    ]


def run_probe(
    kind: str,
    suite: Suite,
    config: Config,
    case: str,
    options: RunOptions,
    *,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run one probe in a fresh subprocess and return its JSON result (or ``{"error": ...}``)."""
    full_env = dict(os.environ)
    if kind == "memory":
        # A fixed mmap threshold turns off glibc's dynamic one, so large freed buffers go back to
        # the OS at once and the resident set tracks live memory. Not for timing probes: mapping
        # every large buffer afresh slows allocation-heavy code down.
        full_env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    full_env.update(env or {})
    try:
        proc = subprocess.run(
            probe_command(kind, suite, config, case, options),
            capture_output=True,
            text=True,
            env=full_env,
            timeout=options.probe_timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {options.probe_timeout_s:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(PROBE_MARKER):
            return json.loads(line[len(PROBE_MARKER) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _run_probes(
    suite: Suite,
    config: Config,
    options: RunOptions,
    records: list[dict[str, Any]],
    log: Callable[[str], None],
) -> None:
    """Run the probes ``options`` asks for on one configuration; fill them into its records."""
    by_name = {record["case"]: record for record in records}
    for case in suite.make_cases(config):
        name = case.name
        record = by_name.get(name)
        if record is None or record["fwd_ms"] is None:
            continue
        if options.memory and record["fwdbwd_ms"] is not None:
            log(f"  memory probe: {config.label} / {name}")
            result = run_probe("memory", suite, config, name, options)
            if "error" in result:
                record["peak_error"] = result["error"]
                log(f"    failed: {result['error']}")
            else:
                record["peak_mb"] = result["peak_mb"]
                record["peak_kind"] = result["peak_kind"]
                record["probe_saved_mb"] = result["saved_mb"]
        if options.first_call and config.first_call and case.first_call:
            log(f"  first-call probe: {config.label} / {name} (cold, then warm cache)")
            with tempfile.TemporaryDirectory(prefix="softops-inductor-") as cache:
                cache_env = {"TORCHINDUCTOR_CACHE_DIR": cache}
                cold = run_probe("first-call", suite, config, name, options, env=cache_env)
                warm = run_probe("first-call", suite, config, name, options, env=cache_env)
            for tag, result in (("cold", cold), ("warm_cache", warm)):
                if "error" in result:
                    record[f"first_call_{tag}_error"] = result["error"]
                    log(f"    {tag} failed: {result['error']}")
                else:
                    record[f"first_call_{tag}_s"] = result["first_s"]
                    record[f"second_call_{tag}_s"] = result["second_s"]
