r"""``softops plot``: figures of the operators, after Figures 1 and 2 of Xie et al. (2020).

Four figures (:data:`FIGURES`), each a function that returns a matplotlib ``Figure`` drawn on
the Agg canvas (never through ``pyplot``, so nothing global changes); :func:`write_figures`
writes them as PNGs. Hard curves are dashed black. matplotlib comes with the ``plot`` extra and
is imported when a figure is drawn. The inputs are fixed or seeded: a figure is the same on
every run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import softops
from softops.topk import MASK_METHODS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "DEFAULT_OUT",
    "FIGURES",
    "SORT_FIGURE_METHODS",
    "indicator_figure",
    "methods_figure",
    "sort_figure",
    "sorted_topk_figure",
    "write_figures",
]

DEFAULT_OUT = "softops-plots"  # in the working directory
FIGURES = ("indicator", "methods", "sort", "sorted-topk")
# The methods of soft_sort and soft_rank (a test holds them to the sort family's table).
SORT_FIGURE_METHODS = ("pav", "softsort", "neuralsort", "ot")
# Per method, the epsilon of soft_sort and soft_rank in the "sort" figure, chosen in its units
# (pav's soft_sort: 1/x, ot: x^2, the others: x) to smooth a unit gap without flattening the row.
SORT_EPSILONS: dict[str, tuple[float, float]] = {
    "pav": (1.2, 0.5),
    "softsort": (0.3, 0.3),
    "neuralsort": (0.3, 0.3),
    "ot": (0.3, 0.3),
}

_HARD: dict[str, Any] = {"color": "black", "linestyle": "--", "linewidth": 1.2}


def _new_figure(figsize: tuple[float, float]) -> Figure:
    """A bare ``Figure`` on the Agg canvas; a clear error without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ModuleNotFoundError(
            "softops plot: expected matplotlib (pip install 'softops[plot]'); got "
            f"ImportError: {err}."
        ) from err
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _colors(count: int) -> list[tuple[float, float, float, float]]:
    """``count`` colours of the viridis map, dark to light (light ones kept readable)."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.85 * i / max(count - 1, 1)) for i in range(count)]


def _np(tensor: torch.Tensor) -> Any:
    """A tensor as a numpy array for matplotlib (which warns on tensors)."""
    return tensor.detach().cpu().numpy()


def _grid(fig: Figure, rows: int, cols: int) -> list[list[Axes]]:
    axes = fig.subplots(rows, cols, squeeze=False)
    return [list(row) for row in axes]


def _style(ax: Axes, title: str, xlabel: str = "$x_1$") -> None:
    """The title, x label and light grid every line panel has."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)


# --------------------------------------------------- Figure 1: the indicator of x1 as x1 crosses x2


def indicator_figure(
    *,
    epsilons: Sequence[float] = (0.05, 0.1, 0.2, 0.5),
    k: int = 2,
    others: Sequence[float] = (0.0, 1.0, -1.0, -2.0),
    method: str = "ot",
    points: int = 401,
) -> Figure:
    r"""The top-k indicator of :math:`x_1` as :math:`x_1` crosses :math:`x_2` (left) and its
    derivative in :math:`x_1` (right), hard and soft.

    The row is ``(x1, *others)``; ``others[0]`` is :math:`x_2`, which must be the k-th largest
    of ``others``, so that the hard indicator steps from 0 to 1 at :math:`x_1 = x_2`.

    The paper's Figure 1: one soft curve of ``soft_topk_mask(method=method)`` per epsilon;
    ``points`` values of :math:`x_1`. Returns two axes of ``1 + len(epsilons)`` lines each.
    """
    rest = torch.tensor(others, dtype=torch.float64)
    x2 = float(rest[0])
    if float(rest.sort(descending=True).values[k - 1]) != x2:
        raise ValueError(
            f"indicator_figure: expected others[0] to be the k-th largest of others (k={k}); "
            f"got others={list(others)}."
        )
    span = 4.0 * max(max(epsilons), 0.25)
    x1 = torch.linspace(x2 - span, x2 + span, points, dtype=torch.float64)
    fig = _new_figure((9.0, 3.6))
    value_ax, grad_ax = _grid(fig, 1, 2)[0]
    value_ax.plot(_np(x1), _np((x1 > x2).double()), label="hard (torch.topk)", **_HARD)
    grad_ax.plot(_np(x1), _np(torch.zeros_like(x1)), label="hard (torch.topk)", **_HARD)
    for eps, color in zip(epsilons, _colors(len(epsilons)), strict=True):
        row = torch.cat([x1[:, None], rest.expand(points, -1)], dim=1).requires_grad_(True)
        mask = softops.soft_topk_mask(row, k, epsilon=eps, method=method)
        (grad,) = torch.autograd.grad(mask[:, 0].sum(), row)
        label = f"soft, ε = {eps:g}"
        value_ax.plot(_np(x1), _np(mask[:, 0]), color=color, label=label)
        grad_ax.plot(_np(x1), _np(grad[:, 0]), color=color, label=label)
    others_text = ", ".join(f"{v:g}" for v in others)
    _style(value_ax, f"top-{k} indicator of $x_1$ in $(x_1, {others_text})$")
    _style(grad_ax, r"its derivative $\partial A_1 / \partial x_1$")
    value_ax.set_ylabel("$A_1$")
    for ax in (value_ax, grad_ax):
        ax.axvline(x2, color="grey", linewidth=0.6)
    value_ax.legend(loc="upper left", fontsize=8)
    return fig


# ---------------------------------------- Figure 2: one vector, every top-k method, several epsilon


def _default_vector() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(12, generator=generator, dtype=torch.float64).sort(descending=True).values


def methods_figure(
    *,
    x: torch.Tensor | Sequence[float] | None = None,
    k: int = 4,
    epsilons: Sequence[float] = (0.05, 0.2, 0.5, 1.0),
    methods: Sequence[str] = MASK_METHODS,
    n_samples: int = 2000,
    seed: int = 0,
) -> Figure:
    """The soft top-k mask of one vector for several epsilon, one panel per method (the
    paper's Figure 2).

    ``x`` defaults to 12 standard normal draws of seed 0, sorted descending; ``n_samples`` and
    ``seed`` are those of "perturbed". The first axis shows the scores as bars, each further
    one a method with ``1 + len(epsilons)`` lines.
    """
    scores = _default_vector() if x is None else torch.as_tensor(x, dtype=torch.float64)
    n = scores.numel()
    index = torch.arange(n)
    hard = torch.zeros(n, dtype=torch.float64).scatter(0, scores.topk(k).indices, 1.0)
    cols = min(len(methods) + 1, 3)
    rows = math.ceil((len(methods) + 1) / cols)
    fig = _new_figure((3.6 * cols, 2.9 * rows))
    flat = [ax for row in _grid(fig, rows, cols) for ax in row]
    flat[0].bar(_np(index), _np(scores), color=["black" if h else "0.7" for h in hard.tolist()])
    _style(flat[0], f"the scores x (the top {k} in black)", "entry (by decreasing score)")
    for ax, method in zip(flat[1:], methods, strict=False):
        ax.plot(_np(index), _np(hard), marker="s", markersize=4, label="hard", **_HARD)
        for eps, color in zip(epsilons, _colors(len(epsilons)), strict=True):
            draws: dict[str, Any] = {}
            if method == "perturbed":
                draws = {"n_samples": n_samples, "generator": torch.Generator().manual_seed(seed)}
            mask = softops.soft_topk_mask(scores, k, epsilon=eps, method=method, **draws)
            ax.plot(_np(index), _np(mask), marker="o", ms=3, color=color, label=f"ε = {eps:g}")
        _style(ax, f'method="{method}"', "entry (by decreasing score)")
        ax.set_ylim(-0.05, 1.1)
    for ax in flat[len(methods) + 1 :]:
        ax.set_axis_off()
    flat[1].set_ylabel(f"soft top-{k} mask")
    flat[1].legend(loc="upper right", fontsize=8)
    return fig


# ----------------------------------------------------------------------------- sort and rank curves


def sort_figure(
    *,
    others: Sequence[float] = (-1.0, 0.0, 1.0),
    methods: Sequence[str] = SORT_FIGURE_METHODS,
    epsilons: dict[str, tuple[float, float]] | None = None,
    points: int = 241,
) -> Figure:
    r"""Soft sorted values (top row) and soft ranks (bottom row) of ``(x1, *others)`` as
    :math:`x_1` sweeps across the others, one column per method, hard curves dashed.

    ``epsilons`` maps a method to the epsilon of ``soft_sort`` and of ``soft_rank`` (default
    :data:`SORT_EPSILONS`). Returns ``2 * len(methods)`` axes of ``2 * n`` lines each.
    """
    table = SORT_EPSILONS if epsilons is None else epsilons
    rest = torch.tensor(others, dtype=torch.float64)
    lo, hi = float(rest.min()) - 1.5, float(rest.max()) + 1.5
    x1 = torch.linspace(lo, hi, points, dtype=torch.float64)
    rows = torch.cat([x1[:, None], rest.expand(points, -1)], dim=1)
    n = rows.shape[1]
    hard_sorted = rows.sort(dim=-1).values
    hard_ranks = rows.argsort(dim=-1).argsort(dim=-1).double() + 1
    colors = _colors(n)
    fig = _new_figure((3.3 * len(methods), 6.0))
    grid = _grid(fig, 2, len(methods))
    for col, method in enumerate(methods):
        sort_eps, rank_eps = table[method]
        values = softops.soft_sort(rows, epsilon=sort_eps, method=method)
        ranks = softops.soft_rank(rows, epsilon=rank_eps, method=method)
        sort_ax, rank_ax = grid[0][col], grid[1][col]
        for i in range(n):
            sort_ax.plot(_np(x1), _np(hard_sorted[:, i]), alpha=0.6, **_HARD)
            sort_ax.plot(_np(x1), _np(values[:, i]), color=colors[i], label=f"sorted value {i + 1}")
            rank_ax.plot(_np(x1), _np(hard_ranks[:, i]), alpha=0.6, **_HARD)
            name = "$x_1$" if i == 0 else f"$x_{i + 1} = {others[i - 1]:g}$"
            rank_ax.plot(_np(x1), _np(ranks[:, i]), color=colors[i], label=f"rank of {name}")
        _style(sort_ax, f'soft_sort, "{method}", ε = {sort_eps:g}')
        _style(rank_ax, f'soft_rank, "{method}", ε = {rank_eps:g}')
    grid[0][0].set_ylabel("sorted values (ascending)")
    grid[1][0].set_ylabel("ranks (1 = smallest)")
    grid[1][0].legend(loc="upper left", fontsize=7)
    return fig


# ----------------------------------------------------------------------- the sorted top-k's weights


def sorted_topk_figure(
    *,
    x: torch.Tensor | Sequence[float] | None = None,
    k: int = 4,
    epsilons: Sequence[float] = (0.05, 0.2, 0.5),
) -> Figure:
    """The weights of ``soft_topk(x, k)`` (k x n) as heat maps, one per epsilon, beside the hard
    selection matrix ``topk_selection_matrix``.

    ``x`` defaults to that of :func:`methods_figure`. Returns ``1 + len(epsilons)`` heat maps
    and one colour bar.
    """
    scores = _default_vector() if x is None else torch.as_tensor(x, dtype=torch.float64)
    n = scores.numel()
    panels: list[tuple[str, float | None]] = [("hard: topk_selection_matrix", None)]
    panels += [(f"soft_topk, ε = {eps:g}", eps) for eps in epsilons]
    fig = _new_figure((3.1 * len(panels) + 0.8, 2.6))
    axes = _grid(fig, 1, len(panels))[0]
    images = []
    for ax, (title, eps) in zip(axes, panels, strict=True):
        if eps is None:
            weights = softops.topk_selection_matrix(scores.topk(k).indices, n).double()
        else:
            weights = softops.soft_topk(scores, k, epsilon=eps).weights
        images.append(ax.imshow(_np(weights), cmap="magma", vmin=0.0, vmax=1.0, aspect="auto"))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("entry (by decreasing score)")
        ax.set_yticks(range(k), [str(j + 1) for j in range(k)])
    axes[0].set_ylabel("rank j")
    fig.colorbar(images[0], ax=axes, label="weight", shrink=0.9)
    return fig


# ------------------------------------------------------------------------------------- writing them


_MAKERS: dict[str, Callable[[], Figure]] = {
    "indicator": indicator_figure,
    "methods": methods_figure,
    "sort": sort_figure,
    "sorted-topk": sorted_topk_figure,
}


def write_figures(
    out: str | os.PathLike[str] = DEFAULT_OUT,
    names: Sequence[str] = FIGURES,
    *,
    dpi: int = 120,
) -> list[Path]:
    """Draw the figures ``names`` (among :data:`FIGURES`) and write each as
    ``<out>/<name>.png`` at ``dpi`` (the folder created if missing); return the paths."""
    unknown = [name for name in names if name not in _MAKERS]
    if unknown:
        raise ValueError(
            f"write_figures: expected figures among {', '.join(FIGURES)}; got {unknown}."
        )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        fig = _MAKERS[name]()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths
