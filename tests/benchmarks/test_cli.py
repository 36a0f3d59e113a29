"""``python -m benchmarks``: parsing and dispatch to the suites."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import benchmarks.__main__ as cli
from benchmarks import harness
from benchmarks.__main__ import build_parser, main


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The ``--help`` text of a sub-command, with its line breaks undone."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_cli_bench_topk_l1(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["topk-l1", "--batch", "2", "--n", "20", "--k", "2", "--epsilons", "0.5"]
    assert main([*argv, "--samples", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| ot |" in out and "| perturbed-4 |" in out and "ε=0.5" in out
    assert "Reproduce with `python -m benchmarks topk-l1 --batch 2" in out
    assert main([*argv[:-4], "--k", "30", "--out", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["topk-l1", "--epsilons", "0"])


def test_cli_bench_topk_quick(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["topk", "--quick", "--sizes", "300", "--batch", "2", "--repeats", "1"]
    argv += ["--threads", str(torch.get_num_threads()), "--no-speedup", "--no-sorted"]
    argv += ["--no-quality", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| torch.topk | 1.00× |" in out
    assert (tmp_path / "topk-quick.jsonl").exists() and (tmp_path / "topk-quick.md").exists()


def test_cli_bench_sort_quick(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sort", "--quick", "--sizes", "200", "--batch", "2", "--repeats", "1"]
    argv += ["--threads", str(torch.get_num_threads()), "--no-vs", "--no-dense", "--no-quality"]
    argv += ["--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| torch.sort | 1.00× |" in out and "### Targets" in out
    assert "softsort values+ranks fwd+bwd at B=2, n=10000" in out  # the quick memory config
    lines = (tmp_path / "sort-quick.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert {r["group"] for r in records} == {"grid", "memory"}
    assert {r["command"] for r in records} == {"python -m benchmarks " + " ".join(argv)}
    assert (tmp_path / "sort-quick.md").exists()


@pytest.mark.parametrize("suite", ["topk", "sort", "topk-l1"])
def test_cli_rejects_an_unavailable_device(
    suite: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([suite, "--device", "nonsense", "--out", str(tmp_path)]) == 2
    assert "expected a torch device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([suite, "--device", "cuda", "--out", str(tmp_path)]) == 2
        assert "but CUDA is not" in capsys.readouterr().err


def _fake_runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Replace every suite's run function and the quality sweep; return what they were given."""
    seen: dict[str, dict[str, Any]] = {}

    def fake(name: str) -> Any:
        def run(**kwargs: Any) -> tuple[str, dict[str, Any]]:
            seen[name] = kwargs
            return f"report {name}", {}

        return run

    for name in ("topk", "sort", "smooth", "layers"):
        runner = "run_layers_bench" if name == "layers" else f"run_{name}_bench"
        monkeypatch.setattr(cli, runner, fake(name))

    def quality(name: str, **kwargs: Any) -> tuple[str, dict[str, Any]] | None:
        seen[f"quality {name}"] = kwargs
        return None if name == "layers" else (f"quality {name}", {})

    monkeypatch.setattr(cli, "run_suite_quality", quality)
    return seen


def test_cli_dispatches_every_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fake_runs(monkeypatch)
    assert main(["topk", "--no-first-call", "--no-smooth", "--sizes", "1e3"]) == 0
    assert main(["sort", "--quick", "--no-memory", "--no-memory-config"]) == 0
    topk, sort = seen["topk"], seen["sort"]
    assert topk["sizes"] == [1000] and not topk["first_call"] and not topk["smooth"]
    assert topk["speedup"] and topk["sorted_memory"] and topk["memory"] and not topk["quick"]
    assert topk["command"] == "python -m benchmarks topk --no-first-call --no-smooth --sizes 1e3"
    assert topk["threads"] == [1] and topk["isolate"] and topk["progress"]
    assert sort["quick"] and not sort["memory"] and not sort["memory_config"]
    assert sort["vs"] and sort["dense"] and sort["out"] == harness.DEFAULT_OUT
    assert not sort["isolate"]  # --quick runs in process unless asked
    shared = {"threads", "device", "dtype", "repeats", "batch", "time_budget", "seed"}
    assert shared <= set(topk) and shared <= set(sort)
    assert seen["quality topk"]["threads"] == 1 and seen["quality sort"]["quick"]


def test_cli_suite_option_runs_each_suite(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _fake_runs(monkeypatch)
    argv = ["--suite", "all", "--timeout", "60", "--memory-limit", "512"]
    assert main([*argv, "--no-progress", "--no-isolate"]) == 0
    out = capsys.readouterr().out
    for name in ("topk", "sort", "smooth", "layers"):
        assert seen[name]["threads"] == [1, None], name  # 1 thread, then out of the box
        assert seen[name]["timeout"] == 60 and seen[name]["memory_limit_mb"] == 512
        assert not seen[name]["progress"] and not seen[name]["isolate"]
        assert f"report {name}" in out
    assert "dtype" not in seen["layers"] and seen["smooth"]["dtype"] == "float32"
    assert "quality topk" in out and "quality smooth" in out and "quality layers" not in out
    seen.clear()
    assert main(["--suite", "smooth", "--threads", "default", "--no-quality"]) == 0
    assert seen["smooth"]["threads"] == [None] and "quality smooth" not in seen
    assert main(["--suite", "sort", "--threads", "2", "1"]) == 0
    assert seen["sort"]["threads"] == [2, 1] and seen["quality sort"]["threads"] == 2


def test_smooth_and_layers_sub_commands_are_their_suites(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _fake_runs(monkeypatch)
    assert main(["layers", "--quick", "--groups", "beam", "router"]) == 0
    assert seen["layers"]["groups"] == ["beam", "router"] and seen["layers"]["quick"]
    assert main(["smooth", "--sizes", "1e3", "--no-quality"]) == 0
    assert seen["smooth"]["sizes"] == [1000] and "groups" not in seen["smooth"]
    assert "quality smooth" not in seen
    assert main(["layers"]) == 0
    assert "groups" not in seen["layers"]  # the suite's own default: every group
    out = capsys.readouterr().out
    assert "report layers" in out and "report smooth" in out


def test_cli_bench_needs_one_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "expected --suite NAME" in capsys.readouterr().err
    assert main(["--suite", "sort", "topk"]) == 2
    assert "not both" in capsys.readouterr().err
    args = build_parser().parse_args(["--suite", "smooth", "--threads", "1", "default"])
    assert args.suite == "smooth" and args.threads == ["1", "default"]
    args = build_parser().parse_args(["topk", "--threads", "default"])
    assert args.suite_command == "topk" and args.threads == ["default"]


def test_shared_options_take_each_suite_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    topk, sort = _help(capsys, "topk"), _help(capsys, "sort")
    for text in (topk, sort):
        assert "the grid's n values (default: 1e3 1e4 1e5, or 1e3 1e4 with --quick)" in text
        assert "timed repeats per case (default: 10, or 3 with --quick)" in text
        assert "--seed SEED seed of the inputs (default: 0)" in text  # last, after the switches
        assert text.index("--no-memory ") < text.index("--seed SEED seed")
    assert "the grid's B (default: 64, or 16 with --quick)" in topk
    assert "the grid's B (default: 64, or 4 with --quick)" in sort
    assert "(default: 30, or 3 with --quick)" in topk and "(well under a minute)" in topk
    assert "(default: 30, or 2 with --quick)" in sort and "(under a minute)" in sort
    for flag in ("--no-first-call", "--no-speedup", "--no-sorted", "--no-smooth"):
        assert flag in topk and flag not in sort
    for flag in ("--no-vs", "--no-dense", "--no-memory-config"):
        assert flag in sort and flag not in topk


@pytest.mark.parametrize(
    "argv",
    [
        ["topk", "--sizes", "0"],
        ["topk", "--threads", "0"],
        ["--suite", "smooth", "--threads", "some"],
        ["--suite", "nope"],
        ["layers", "--groups", "nope"],
        ["smooth", "--no-vs"],
    ],
)
def test_cli_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
