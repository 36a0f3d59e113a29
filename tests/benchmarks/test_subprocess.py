"""Configurations in fresh subprocesses, and how failures are recorded: out of memory, time-outs
and kills become records with a status, shown in the report, never a crash; the out-of-the-box
thread setting sets nothing. Each subprocess costs a few seconds (it imports torch), so every
test here runs one or two."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import Config, RunOptions, run_suite
from benchmarks.harness import thread_runs
from benchmarks.model import failure_status, parse_threads, threads_label
from benchmarks.report import markdown_report
from tests.benchmarks._suites import FAULTY

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The children import ``tests.benchmarks._suites`` from the repository root."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + (os.pathsep + path if path else ""))


def _options(**kwargs: Any) -> RunOptions:
    base = {"repeats": 1, "min_repeats": 1, "memory": False, "first_call": False}
    return RunOptions(**{**base, **kwargs})


def _quiet(line: str) -> None:
    pass


def _by_case(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["case"]: r for r in records}


def test_memory_error_in_process_is_an_oom_record() -> None:
    config = Config("memory-error", {"B": 2, "n": 8})
    records = run_suite(FAULTY, [config], _options(threads=torch.get_num_threads()), log=_quiet)
    by = _by_case(records)
    assert by["faulty"]["status"] == "oom" and by["faulty"]["fwd_ms"] is None
    assert by["faulty"]["skip"].startswith("out of memory: MemoryError: simulated")
    assert by["floor"]["status"] == "ok" and by["floor"]["fwdbwd_status"] == "ok"
    assert by["absent"]["status"] == "skipped"
    md = markdown_report(records, FAULTY)
    assert "| faulty | oom |" in md and "| absent | skipped |" in md


def test_failure_status_classifies_allocator_errors() -> None:
    assert failure_status(MemoryError()) == "oom"
    assert failure_status(RuntimeError("DefaultCPUAllocator: can't allocate memory")) == "oom"
    assert failure_status(torch.OutOfMemoryError("CUDA out of memory")) == "oom"
    assert failure_status(RuntimeError("shape mismatch")) == "error"


def test_a_hanging_configuration_times_out(importable: None) -> None:
    configs = [Config("hang", {"B": 2, "n": 8})]
    options = _options(threads=1, isolate=True, probe_timeout_s=2.0)
    records = run_suite(FAULTY, configs, options, log=_quiet)
    by = _by_case(records)
    assert by["faulty"]["status"] == by["floor"]["status"] == "timeout"
    assert "ran over 2 s" in by["faulty"]["skip"]
    assert by["absent"]["status"] == "skipped"  # its own reason stays
    assert "| faulty | timeout |" in markdown_report(records, FAULTY)


def test_killed_and_capped_subprocesses_are_oom_records(importable: None) -> None:
    configs = [Config("kill", {"B": 2, "n": 8}), Config("alloc", {"B": 2, "n": 8, "mb": 400})]
    options = _options(threads=1, isolate=True, memory_limit_mb=200.0, probe_timeout_s=120.0)
    records = run_suite(FAULTY, configs, options, log=_quiet)
    killed = [r for r in records if r["group"] == "kill"]
    assert {r["status"] for r in killed if r["case"] != "absent"} == {"oom"}
    assert "killed by SIGKILL" in killed[0]["skip"]
    capped = _by_case([r for r in records if r["group"] == "alloc"])
    # the allocation over the cap fails inside the child, which records it and goes on
    assert capped["faulty"]["status"] == "oom" and "allocate" in capped["faulty"]["skip"]
    assert capped["floor"]["status"] == "ok" and capped["floor"]["fwd_ms"] > 0


def test_out_of_the_box_sets_no_threads_and_one_thread_pins(importable: None) -> None:
    config = Config("ok", {"B": 2, "n": 8})
    runs = thread_runs(_options(probe_timeout_s=120.0), [1, None])
    assert [r.threads for r in runs] == [1, None] and all(r.isolate for r in runs)
    records = [r for run in runs for r in run_suite(FAULTY, [config], run, log=_quiet)]
    one, default = (
        _by_case([r for r in records if r["threads_setting"] == s]) for s in ("1", "default")
    )
    assert one["floor"]["seen_pinned"] is True and one["floor"]["seen_torch_threads"] == 1
    assert one["floor"]["threads_label"] == "1 thread"
    assert default["floor"]["seen_pinned"] is False
    fresh = default["floor"]["seen_torch_threads"]  # what a fresh process gets: torch's choice
    assert default["floor"]["torch_threads"] == fresh == default["floor"]["threads"]
    assert default["floor"]["threads_label"] == f"default threads ({fresh})"
    md = markdown_report(records, FAULTY)
    assert f"## 1 thread against default threads ({fresh})" in md
    assert "| ok B=2 n=8 | faulty |" in md  # a row of the comparison table
    assert "nothing set by the harness" in md and "load average" in md


def test_parse_threads_and_labels() -> None:
    assert parse_threads("default") is None and parse_threads("3") == 3
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="expected a thread count"):
            parse_threads(bad)
    assert threads_label(None, 4) == "default threads (4)" and threads_label(2) == "2 threads"


def _record(**kwargs: Any) -> dict[str, Any]:
    base = {
        "suite": "faulty",
        "group": "ok",
        "config": "ok B=2 n=8",
        "B": 2,
        "n": 8,
        "case": "faulty",
        "floor": False,
        "status": "ok",
        "fwdbwd_status": "ok",
        "fwd_ms": 1.0,
        "fwdbwd_ms": 2.0,
        "floor_fwd_ms": 0.5,
        "fwd_ratio": 2.0,
        "fwdbwd_ratio": 4.0,
        "repeats": 3,
        "saved_mb": 0.1,
        "peak_mb": None,
        "peak_kind": None,
        "skip": None,
        "fwdbwd_skip": None,
        "torch": "2",
        "device": "cpu",
        "dtype": "float32",
        "threads": 1,
        "threads_setting": "1",
        "threads_label": "1 thread",
        "torch_threads": 1,
        "load_avg": [1.5, 1.0, 0.5],
        "cpu_count": 2,
        "time": "now",
    }
    return {**base, **kwargs}


def test_report_shows_probe_and_backward_statuses(tmp_path: Any) -> None:
    records = [
        _record(case="floor", floor=True, peak_mb=1.0, peak_status="ok", peak_kind="rss"),
        _record(peak_status="oom", peak_error="killed by SIGKILL"),
        _record(case="slow", fwdbwd_status="timeout", fwdbwd_ms=None, fwdbwd_skip="too slow"),
    ]
    md = markdown_report(records, FAULTY)
    assert "| faulty | 2.00× | 4.00× | 1.00 | 2.00 | 0.1 | oom | 3 |" in md
    assert "- faulty: memory probe oom: killed by SIGKILL" in md
    assert (
        "| slow | 2.00× | timeout | 1.00 | timeout |" in md and "- slow (fwd+bwd): too slow" in md
    )
    assert "load average 1.5 at the start of the configurations (2 cores)" in md
    pytest.importorskip("matplotlib")
    from benchmarks.report import plot_results

    assert plot_results(records, tmp_path / "p.png", FAULTY)  # with a peak-memory panel
    assert (tmp_path / "p.png").stat().st_size > 0
