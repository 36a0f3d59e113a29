"""Reports of benchmark records: JSONL, Markdown tables, PNG plots and the console output.

A record is a plain dict, one per configuration and case (see
:func:`softops.bench.harness.run_suite`). :func:`write_results` writes a run as three files,
``<stem>.jsonl`` (every record, the raw data), ``<stem>.md`` (:func:`markdown_report`: one table
per configuration, the ratio columns first, since a ratio to the floor taken in one run is what
stays stable on a shared machine) and ``<stem>.png`` (:func:`plot_results`: median time against
size, log-log). :func:`write_report`, :func:`new_figure` and :func:`save_figure` are the pieces
other reports (:mod:`softops.bench.topk_l1`) share.

matplotlib (the plots) and rich (styled console output) are optional: without matplotlib no PNG
is written, without rich the console output is plain text. Both are imported lazily, and plots
are drawn on a bare ``Figure`` (saved through the Agg canvas), so pyplot's global backend is
untouched.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from softops.bench.model import Suite

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "log_log_axes",
    "make_logger",
    "markdown_report",
    "new_figure",
    "plot_results",
    "print_table",
    "reproduce_lines",
    "save_figure",
    "write_experiment",
    "write_report",
    "write_results",
]


# ----------------------------------------------------------------------------------------------
# Console output: rich when installed, plain text otherwise


def make_logger() -> Callable[[str], None]:
    """A function that writes one progress line to stderr (styled by rich when installed)."""
    try:
        from rich.console import Console
    except ImportError:

        def plain(line: str) -> None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

        return plain
    console = Console(stderr=True, highlight=False)
    return lambda line: console.print(line, markup=False, soft_wrap=True)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a table to stdout: a rich table when rich is installed, right-aligned text else."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
        lines = [title]
        for row in (header, *rows):
            lines.append("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))
        sys.stdout.write("\n".join(lines) + "\n")
        return
    table = Table(title=title, title_justify="left")
    for name in header:
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(*map(str, row))
    Console().print(table)


# ----------------------------------------------------------------------------------------------
# Markdown


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted by ``spec`` with ``suffix``; an en dash for ``None`` or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _group_configs(records: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The records grouped by configuration label, in order of first appearance."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        groups.setdefault(record["config"], []).append(record)
    return list(groups.values())


def reproduce_lines(command: str | None) -> list[str]:
    """The report lines that give the command reproducing it (none without a command)."""
    return ["", f"Reproduce with `{command}`."] if command else []


def markdown_report(
    records: Sequence[Mapping[str, Any]],
    suite: Suite,
    *,
    command: str | None = None,
) -> str:
    """Render the records as Markdown: one table per configuration, then the suite's summary.

    The ratio columns (time over the floor's forward time) come first: they are the headline.
    """
    if not records:
        return f"# {suite.name} benchmark\n\nNo records.\n"
    first = records[0]
    lines = [
        f"# {suite.name} benchmark",
        "",
        f"torch {first['torch']} · {first['device']} · {first['threads']} thread(s) · "
        f"{first['dtype']} · {first['time']}",
        *reproduce_lines(command),
    ]
    peak = any(r.get("peak_mb") is not None for r in records)
    kinds = sorted({r["peak_kind"] for r in records if r.get("peak_kind")})
    lines += [
        "",
        f"Ratios are times over the floor's forward time ({suite.floor_label}); "
        "medians over interleaved repeats. fwd+bwd is the forward plus `.backward()` of "
        "`(out * g).sum()` for a fixed random g. *saved* is the memory the forward keeps for "
        "backward (saved-tensor hooks, the input excluded)"
        + (
            "; *peak Δ* is the peak extra memory of one forward+backward in a fresh process "
            f"({', '.join(kinds)}), x.grad included."
            if peak
            else "; peak memory was not measured in this run."
        ),
    ]
    head = ["method", "fwd × floor", "fwd+bwd × floor", "fwd ms", "fwd+bwd ms", "saved MB"]
    head += ["peak Δ MB"] * peak + ["repeats"]
    for rows in _group_configs(records):
        lines += ["", f"### {rows[0]['config']}", ""]
        lines += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
        notes = []
        for r in rows:
            if r["skip"]:
                lines.append(f"| {r['case']} | skipped" + " |" * (len(head) - 1))
                notes.append(f"- {r['case']}: {r['skip']}")
                continue
            if r.get("fwdbwd_skip"):
                notes.append(f"- {r['case']} (fwd+bwd): {r['fwdbwd_skip']}")
            cells = [
                r["case"],
                _fmt(r["fwd_ratio"], ".2f", "×"),
                _fmt(r["fwdbwd_ratio"], ".2f", "×"),
                _fmt(r["fwd_ms"], ".2f"),
                _fmt(r["fwdbwd_ms"], ".2f"),
                _fmt(r["saved_mb"], ".3g"),
            ]
            cells += [_fmt(r["peak_mb"], ".3g")] * peak + [str(r["repeats"])]
            lines.append("| " + " | ".join(cells) + " |")
            if r.get("peak_error"):
                notes.append(f"- {r['case']}: memory probe failed: {r['peak_error']}")
        if notes:
            lines += ["", *notes]
    first_calls = [r for r in records if "first_call_cold_s" in r or "first_call_cold_error" in r]
    if first_calls:
        lines += [
            "",
            "### First call in a fresh process (forward+backward, includes any compilation)",
            "",
            "| configuration | method | first call, empty compile cache | first call, warm "
            "on-disk cache | second call |",
            "|---|---|---:|---:|---:|",
        ]
        for r in first_calls:
            lines.append(
                f"| {r['config']} | {r['case']} | {_fmt(r.get('first_call_cold_s'), '.2f', ' s')} "
                f"| {_fmt(r.get('first_call_warm_cache_s'), '.2f', ' s')} "
                f"| {_fmt(_ms(r.get('second_call_warm_cache_s')), '.1f', ' ms')} |"
            )
    summary = suite.summary(records)
    if summary:
        lines += ["", *summary]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Plots (matplotlib, optional)


def new_figure(figsize: tuple[float, float]) -> Figure | None:
    """A bare matplotlib ``Figure`` on the Agg canvas, or ``None`` without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def log_log_axes(ax: Axes, xlabel: str, title: str) -> None:
    """Log scales on both axes, a label, a title and a light grid."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)


def save_figure(fig: Figure, path: Path) -> None:
    """Lay out ``fig`` and save it as a PNG at ``path`` (creating its folder)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def plot_results(records: Sequence[Mapping[str, Any]], path: Path, suite: Suite) -> bool:
    """Plot median time against ``suite.plot_x`` per method (forward and forward+backward).

    Needs matplotlib (the ``bench`` extra); returns ``False`` without it or without data.
    """
    rows = [r for r in records if r["group"] == suite.plot_group and r["fwd_ms"] is not None]
    fig = new_figure((11, 4.2)) if rows else None
    if fig is None:
        return False
    import matplotlib  # present: new_figure returned a figure

    cases = list(dict.fromkeys(r["case"] for r in rows))
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color", [None])
    colors = {case: palette[i % len(palette)] for i, case in enumerate(cases)}
    axes = fig.subplots(1, 2, sharey=True)
    for ax, key, title in (
        (axes[0], "fwd_ms", "forward"),
        (axes[1], "fwdbwd_ms", "forward + backward"),
    ):
        for case in cases:
            pts = sorted(
                (r[suite.plot_x], r[key]) for r in rows if r["case"] == case and r[key] is not None
            )
            if not pts:
                continue
            floor = any(r["floor"] for r in rows if r["case"] == case)
            ax.plot(
                *zip(*pts, strict=True),
                marker="o",
                label=case,
                color=colors[case],
                linestyle="--" if floor else "-",
            )
        floor_pts = sorted(
            (r[suite.plot_x], r["floor_fwd_ms"]) for r in rows if r["floor"] and r["floor_fwd_ms"]
        )
        if floor_pts and key == "fwdbwd_ms":
            ax.plot(
                *zip(*floor_pts, strict=True),
                color="grey",
                linestyle=":",
                label=f"{suite.floor_label} (floor)",
            )
        log_log_axes(ax, suite.plot_x, title)
    axes[0].set_ylabel("median time (ms)")
    axes[1].legend(fontsize=8)
    head = rows[0]
    fig.suptitle(
        f"{suite.name}: B={head.get('B')}, {head['threads']} thread(s), {head['device']}, "
        f"torch {head['torch']}",
        fontsize=10,
    )
    save_figure(fig, path)
    return True


# ----------------------------------------------------------------------------------------------
# Files


def write_report(
    records: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    stem: str,
    markdown: str,
    plot: Callable[[Path], bool],
) -> dict[str, Path]:
    """Write ``<stem>.jsonl`` (the records), ``<stem>.md`` (``markdown``) and the plot.

    Args:
        records: the records, one JSON line each.
        out_dir: the folder (created if missing).
        stem: the file name without suffix.
        markdown: the text of the Markdown file.
        plot: draws the plot into the path it is given; returns whether it did.

    Returns:
        The paths written, keyed by ``"jsonl"``, ``"md"`` and (when ``plot`` drew) ``"png"``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": out / f"{stem}.jsonl", "md": out / f"{stem}.md"}
    with paths["jsonl"].open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(dict(record)) + "\n")
    paths["md"].write_text(markdown, encoding="utf-8")
    png = out / f"{stem}.png"
    if plot(png):
        paths["png"] = png
    return paths


def write_results(
    records: Sequence[Mapping[str, Any]],
    suite: Suite,
    out_dir: str | os.PathLike[str],
    stem: str,
    *,
    command: str | None = None,
) -> dict[str, Path]:
    """Write ``<stem>.jsonl``, ``<stem>.md`` and (with matplotlib) ``<stem>.png`` to ``out_dir``.

    Returns:
        The paths written, keyed by ``"jsonl"``, ``"md"`` and ``"png"``.
    """
    markdown = markdown_report(records, suite, command=command)
    return write_report(
        records, out_dir, stem, markdown, lambda png: plot_results(records, png, suite)
    )


def write_experiment(
    out_dir: str | os.PathLike[str],
    stem: str,
    record: Mapping[str, Any],
    lines: Sequence[str],
) -> dict[str, Path]:
    """Write ``<stem>.json`` (``record``, with the machine and the torch
    version added) and ``<stem>.md`` (``lines``): the files of a training experiment under
    ``benchmarks/``. Returns the paths, keyed by ``"json"`` and ``"md"``."""
    import platform

    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    full = {**record, "torch": torch.__version__, "machine": platform.machine()}
    paths["json"].write_text(json.dumps(full, indent=1) + "\n", encoding="utf-8")
    paths["md"].write_text("\n".join(lines), encoding="utf-8")
    return paths
