"""``softops plot`` (softops.plot): the figures, their files and the command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from softops import plot as plots
from softops.cli import build_parser, main
from softops.sort import SORT_METHODS
from softops.topk import MASK_METHODS


def _lines(fig: object) -> list[int]:
    return [len(ax.get_lines()) for ax in fig.axes]  # type: ignore[attr-defined]


def test_indicator_figure_has_hard_and_one_curve_per_epsilon() -> None:
    fig = plots.indicator_figure(epsilons=(0.1, 0.5), points=21)
    # two axes (the indicator and its derivative), each: hard + 2 soft + the line at x1 = x2
    assert _lines(fig) == [4, 4]
    hard = fig.axes[0].get_lines()[0].get_ydata()
    assert set(hard.tolist()) == {0.0, 1.0}  # a step
    soft = fig.axes[0].get_lines()[1].get_ydata()
    assert 0.0 < soft.min() < soft.max() < 1.0  # epsilon = 0.1 on [-2, 2]: never saturated


def test_indicator_figure_checks_the_crossing() -> None:
    with pytest.raises(ValueError, match=r"others\[0\] to be the k-th largest"):
        plots.indicator_figure(k=1, others=(0.0, 1.0))


def test_methods_figure_has_a_panel_per_method() -> None:
    fig = plots.methods_figure(epsilons=(0.1, 1.0), n_samples=20)
    # the scores, then one panel per method with hard + 2 epsilons; one panel left empty
    assert _lines(fig) == [0] + [3] * len(MASK_METHODS)
    assert len(fig.axes) == 1 + len(MASK_METHODS) + (3 - (1 + len(MASK_METHODS)) % 3) % 3
    titles = [ax.get_title() for ax in fig.axes[1 : 1 + len(MASK_METHODS)]]
    assert titles == [f'method="{m}"' for m in MASK_METHODS]


def test_sort_figure_covers_every_sort_method() -> None:
    assert plots.SORT_FIGURE_METHODS == SORT_METHODS
    assert set(plots.SORT_EPSILONS) == set(SORT_METHODS)
    fig = plots.sort_figure(others=(-1.0, 1.0), points=11)
    n = 3
    assert _lines(fig) == [2 * n] * (2 * len(SORT_METHODS))  # soft and hard, per entry


def test_sorted_topk_figure_is_a_heat_map_per_epsilon() -> None:
    fig = plots.sorted_topk_figure(k=2, epsilons=(0.1, 0.5))
    maps = [ax for ax in fig.axes if ax.get_images()]
    assert len(maps) == 3  # hard + 2 epsilons (the fourth axis is the colour bar)
    assert [m.get_images()[0].get_array().shape for m in maps] == [(2, 12)] * 3
    hard = maps[0].get_images()[0].get_array()
    assert hard.sum() == 2 and (hard.sum(axis=1) == 1).all()


def test_write_figures_writes_pngs(tmp_path: Path) -> None:
    paths = plots.write_figures(tmp_path / "new", ["indicator", "sorted-topk"], dpi=30)
    assert [p.name for p in paths] == ["indicator.png", "sorted-topk.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"expected figures among .*; got \['nope'\]"):
        plots.write_figures(tmp_path, ["nope"])


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["plot"])
    assert args.figures == list(plots.FIGURES) and args.out == plots.DEFAULT_OUT
    assert main(["plot", "--out", str(tmp_path), "--figures", "methods", "--dpi", "30"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "methods.png")]
    assert (tmp_path / "methods.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plot", "--figures", "nope"])


def test_cli_plot_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert main(["plot", "--out", str(tmp_path), "--figures", "indicator"]) == 2
    assert "expected matplotlib (pip install 'softops[plot]')" in capsys.readouterr().err
    assert not (tmp_path / "indicator.png").exists()
