"""The generic harness: the data model, the timing loop, the probes and the reports (tiny sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

import benchmarks
from benchmarks import (
    Case,
    Config,
    RunOptions,
    harness,
    model,
    probes,
    report,
    run_suite,
    write_results,
)
from benchmarks.harness import make_options, run_and_write, run_probe
from benchmarks.topk import SUITE
from softops.testing import count_saved_bytes


class TinySuite:
    """A suite of cheap cases that records the order of its calls."""

    # the tests below run it with the subprocess probes off
    ref = "tests.benchmarks.test_harness:TINY"
    name = "tiny"
    floor_label = "torch.topk(x, 2).values"
    plot_group = "grid"
    plot_x = "n"

    def __init__(self, slow_s: float = 0.0) -> None:
        self.calls: list[str] = []
        self.slow_s = slow_s

    def make_input(
        self,
        config: Config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        generator: torch.Generator,
    ) -> torch.Tensor:
        p = config.params
        return torch.randn(p["B"], p["n"], generator=generator, device=device, dtype=dtype)

    def _traced(self, name: str, fn: Any) -> Any:
        def call(x: torch.Tensor) -> torch.Tensor:
            self.calls.append(name)
            return fn(x)

        return call

    def make_cases(self, config: Config) -> list[Case]:
        def slow(x: torch.Tensor) -> torch.Tensor:
            time.sleep(self.slow_s)
            return x * 2

        def broken(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

        return [
            Case("floor", self._traced("floor", lambda x: torch.topk(x, 2).values), floor=True),
            Case("exp", self._traced("exp", lambda x: (2 * x).exp())),
            Case("slow", self._traced("slow", slow)),
            Case("broken", broken),
            Case("absent", lambda x: x, skip="not installed"),
        ]

    def compare(self, config: Config, outputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {"n_outputs": len(outputs)}

    def summary(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        return ["### Targets", "", "- tiny summary line"]


TINY = TinySuite()


def _configs() -> list[Config]:
    return [Config("grid", {"B": 2, "n": n}) for n in (16, 32)]


def _options(**kwargs: Any) -> RunOptions:
    # Keep this process's thread count: an explicit torch.set_num_threads slows tiny ops in the
    # tests that run after these on a busy machine. The CLI sets 1 thread in its own process.
    kwargs = {"min_repeats": 1, "memory": False, "first_call": False, **kwargs}
    return RunOptions(threads=torch.get_num_threads(), **kwargs)


def _quiet(line: str) -> None:
    pass


# ----------------------------------------------------------------------------------------------
# The timing loop


def test_run_suite_records_and_files(tmp_path: Any) -> None:
    suite = TinySuite()
    records = run_suite(suite, _configs(), _options(repeats=3), log=_quiet)
    assert len(records) == 10
    by = {(r["n"], r["case"]): r for r in records}
    floor = by[(16, "floor")]
    assert floor["fwd_ratio"] == pytest.approx(1.0)
    exp = by[(16, "exp")]
    assert exp["repeats"] == 3 and len(exp["fwdbwd_ms_samples"]) == 3
    assert exp["fwd_ratio"] == pytest.approx(exp["fwd_ms"] / floor["fwd_ms"])
    assert exp["fwdbwd_ratio"] == pytest.approx(exp["fwdbwd_ms"] / floor["fwd_ms"])
    assert exp["saved_mb"] == pytest.approx(2 * 16 * 4 / 2**20)  # exp saves its output
    assert exp["threads"] == torch.get_num_threads()
    assert exp["torch"] == torch.__version__ and exp["device"] == "cpu"
    assert exp["n_outputs"] == 3
    assert by[(16, "broken")]["skip"].startswith("error: RuntimeError: boom")
    assert by[(32, "absent")]["skip"] == "not installed"

    paths = write_results(records, suite, tmp_path, "tiny", command="python -m benchmarks tiny")
    lines = paths["jsonl"].read_text().splitlines()
    assert len(lines) == 10 and json.loads(lines[0])["case"] == "floor"
    md = paths["md"].read_text()
    assert "| method | fwd × floor | fwd+bwd × floor |" in md
    assert "- broken: error: RuntimeError: boom" in md and "tiny summary line" in md
    assert "`python -m benchmarks tiny`" in md
    pytest.importorskip("matplotlib")
    assert paths["png"].stat().st_size > 0


def test_repeats_are_interleaved_round_robin() -> None:
    suite = TinySuite()
    run_suite(suite, _configs()[:1], _options(repeats=4), log=_quiet)
    calls = list(suite.calls)
    # warm-up: forward, forward+backward (draws g), per case; then each repeat: fwd, fwd+bwd.
    timed = calls[6:]
    per_repeat = [timed[i : i + 6] for i in range(0, len(timed), 6)]
    assert len(per_repeat) == 4
    assert per_repeat[0] == ["floor", "floor", "exp", "exp", "slow", "slow"]
    assert per_repeat[1] == ["slow", "slow", "exp", "exp", "floor", "floor"]  # order alternates


def test_too_slow_case_is_skipped_here_and_at_larger_sizes() -> None:
    suite = TinySuite(slow_s=0.05)
    records = run_suite(suite, _configs(), _options(repeats=2, time_budget_s=0.02), log=_quiet)
    slow = [r for r in records if r["case"] == "slow"]
    assert slow[0]["skip"].startswith("too slow: one forward took")
    assert slow[1]["skip"] == slow[0]["skip"]
    assert "slow" not in suite.calls[suite.calls.index("floor", 3) :]  # never called again


def test_run_and_write_returns_the_report_and_logs_the_paths(tmp_path: Any) -> None:
    lines: list[str] = []
    text, paths = run_and_write(
        TinySuite(), _configs()[:1], _options(repeats=1), tmp_path, "tiny", "cmd", lines.append
    )
    assert text == paths["md"].read_text(encoding="utf-8") and "`cmd`" in text
    assert lines[-1].startswith("done in ") and str(paths["jsonl"]) in lines[-1]


# ----------------------------------------------------------------------------------------------
# Options and the data model


def test_make_options_quick_and_full() -> None:
    quick = {"sizes": (100,), "batch": 2, "repeats": 3, "time_budget": 2.0}
    common = {"device": "cpu", "dtype": "float32", "threads": 2, "seed": 5, "command": "c"}
    full = make_options(
        quick, quick=False, repeats=None, time_budget=None, memory=True, first_call=True, **common
    )
    assert (full.repeats, full.time_budget_s) == (harness.FULL_REPEATS, harness.FULL_TIME_BUDGET_S)
    assert full.memory and full.first_call and full.extra == {"command": "c"}
    fast = make_options(
        quick, quick=True, repeats=None, time_budget=None, memory=True, first_call=True, **common
    )
    assert (fast.repeats, fast.time_budget_s, fast.memory, fast.first_call) == (
        3,
        2.0,
        False,
        False,
    )
    one = make_options(
        quick, quick=True, repeats=1, time_budget=0.5, memory=False, first_call=False, **common
    )
    assert (one.repeats, one.min_repeats, one.time_budget_s) == (1, 1, 0.5)  # min never above


def test_run_options_rejects_a_bad_dtype() -> None:
    assert RunOptions(dtype="float64").torch_dtype() is torch.float64
    for name in ("int64", "nonsense"):
        with pytest.raises(ValueError, match=f"got dtype='{name}'"):
            RunOptions(dtype=name).torch_dtype()


def test_config_round_trips_through_json() -> None:
    config = Config("grid", {"B": 2, "n": 8}, first_call=True)
    assert Config.from_json(config.to_json()) == config
    assert config.label == "grid B=2 n=8"


def test_functional_weights_depend_on_seed_and_name_only() -> None:
    like = torch.zeros(2, 3)
    a = model.functional_weights(like.shape, like, 0, "case")
    assert torch.equal(a, model.functional_weights(like.shape, like, 0, "case"))
    assert not torch.equal(a, model.functional_weights(like.shape, like, 1, "case"))
    assert not torch.equal(a, model.functional_weights(like.shape, like, 0, "other"))


def test_names_stay_importable_where_they_were() -> None:
    # The harness was one module; its names are re-exported where tests and users import them.
    for name in ("Case", "Config", "RunOptions", "Suite", "sync"):
        assert getattr(harness, name) is getattr(model, name)
    assert harness.count_saved_bytes is benchmarks.count_saved_bytes is count_saved_bytes
    for name in ("PROBE_MARKER", "make_generator", "functional_weights"):
        assert getattr(harness, name) is getattr(model, name)
    for name in ("probe_command", "run_probe"):
        assert getattr(harness, name) is getattr(probes, name)
    for name in ("markdown_report", "plot_results", "write_results"):
        assert getattr(harness, name) is getattr(report, name)
    for name in benchmarks.__all__:
        assert hasattr(harness, name), name


# ----------------------------------------------------------------------------------------------
# Probes


def test_probe_command_names_the_suite_config_and_case() -> None:
    config = Config("grid", {"B": 2, "n": 8})
    cmd = probes.probe_command("memory", TINY, config, "exp", RunOptions(threads=3, seed=7))
    assert cmd[1:4] == ["-m", "benchmarks._probe", "memory"]
    assert cmd[cmd.index("--suite") + 1] == TINY.ref
    assert Config.from_json(cmd[cmd.index("--config") + 1]) == config
    assert cmd[cmd.index("--threads") + 1] == "3" and cmd[cmd.index("--seed") + 1] == "7"


def test_memory_probe_and_lean_core_import() -> None:
    # Two fresh interpreters, run side by side: `import softops` pulls in neither the harness
    # nor its optional dependencies, and the memory probe works in a subprocess.
    code = (
        "import sys, softops; "
        "bad = [m for m in sys.modules if m.startswith(('benchmarks', 'softops.cli', "
        "'softops.plot', 'softops.testing', 'softops.apps', 'matplotlib', 'rich'))]; "
        "assert not bad, bad"
    )
    lean = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    config = Config("grid", {"B": 2, "n": 1000, "k": 10, "epsilon": 0.1})
    result = run_probe("memory", SUITE, config, "torch.topk", RunOptions())
    _, lean_err = lean.communicate(timeout=120)
    assert lean.returncode == 0, lean_err
    assert "error" not in result, result
    assert result["peak_mb"] >= 0.0
    assert result["saved_mb"] == pytest.approx(2 * 10 * 8 / 2**20)  # the int64 indices


def test_probe_failure_is_reported_not_raised() -> None:
    config = Config("grid", {"B": 2, "n": 8, "k": 1, "epsilon": 0.1})
    result = run_probe("memory", SUITE, config, "no such case", RunOptions())
    assert "error" in result and result["error"].startswith("exit 2")


# ----------------------------------------------------------------------------------------------
# Reports


def test_markdown_report_without_records_and_with_a_skipped_backward() -> None:
    assert "No records" in report.markdown_report([], TINY)
    records = run_suite(TinySuite(), _configs()[:1], _options(repeats=1), log=_quiet)
    records[1] = {**records[1], "fwdbwd_skip": "too slow", "fwdbwd_ms": None}
    text = report.markdown_report(records, TINY)
    assert "- exp (fwd+bwd): too slow" in text and "peak memory was not measured" in text
    assert "| exp |" in text and "| – |" in text


def test_reports_without_matplotlib(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    records = run_suite(TinySuite(), _configs()[:1], _options(repeats=1), log=_quiet)
    paths = write_results(records, TINY, tmp_path, "tiny")
    assert set(paths) == {"jsonl", "md"}
    assert report.new_figure((1, 1)) is None


def test_plain_console_output_without_rich(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("rich", "rich.console", "rich.table"):
        monkeypatch.setitem(sys.modules, name, None)
    report.make_logger()("a progress line")
    out, err = capsys.readouterr()
    assert out == "" and err == "a progress line\n"


def test_report_helpers(tmp_path) -> None:
    from benchmarks.report import (
        log_log_axes,
        new_figure,
        reproduce_lines,
        save_figure,
        write_report,
    )

    assert reproduce_lines(None) == []
    assert reproduce_lines("python -m benchmarks topk") == [
        "",
        "Reproduce with `python -m benchmarks topk`.",
    ]

    def plot(path) -> bool:
        fig = new_figure((3.0, 2.0))
        if fig is None:  # without matplotlib
            return False
        ax = fig.add_subplot(1, 1, 1)
        ax.plot([1, 10, 100], [1, 3, 9])
        log_log_axes(ax, "n", "a title")
        assert ax.get_xscale() == ax.get_yscale() == "log" and ax.get_title() == "a title"
        save_figure(fig, path)
        return True

    records = [{"a": 1}, {"a": 2}]
    paths = write_report(records, tmp_path / "out", "stem", "# report\n", plot)
    assert paths["md"].read_text() == "# report\n"
    assert [json.loads(line) for line in paths["jsonl"].read_text().splitlines()] == records
    if "png" in paths:
        assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_report([], tmp_path / "out2", "s", "", lambda p: False).keys() == {"jsonl", "md"}
