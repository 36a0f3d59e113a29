"""Reports of benchmark records: JSONL, Markdown tables, PNG plots and the console output.

A record is a plain dict, one per configuration and case (see
:func:`benchmarks.harness.run_suite`). :func:`write_results` writes a run as three files,
``<stem>.jsonl`` (every record, the raw data), ``<stem>.md`` (:func:`markdown_report`: one table
per configuration, the ratio columns first, since a ratio to the floor taken in one run is what
stays stable on a shared machine) and ``<stem>.png`` (:func:`plot_results`: median time against
size, log-log). :func:`write_report`, :func:`new_figure` and :func:`save_figure` are the pieces
other reports (:mod:`benchmarks.topk_l1`) share.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.model import Suite

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "log_log_axes",
    "make_logger",
    "markdown_report",
    "new_figure",
    "plot_results",
    "progress_bar",
    "reproduce_lines",
    "save_figure",
    "thread_groups",
    "threads_comparison",
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


class _Bar:
    """A progress bar on stderr (rich), or none: the log lines only."""

    def __init__(self, log: Callable[[str], None], total: int, rich_bar: Any = None) -> None:
        self._log, self._rich, self._task = log, rich_bar, None
        if rich_bar is not None:
            self._task = rich_bar.add_task("starting", total=total)

    def log(self, line: str) -> None:
        """Print one line (above the bar)."""
        if self._rich is not None:
            self._rich.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            self._log(line)

    def describe(self, text: str) -> None:
        """Say what runs now."""
        if self._rich is not None:
            self._rich.update(self._task, description=text)

    def add(self, steps: int) -> None:
        """Add ``steps`` steps to the total (probes are known once the timings are)."""
        if self._rich is not None and steps:
            total = self._rich.tasks[0].total or 0
            self._rich.update(self._task, total=total + steps)

    def advance(self) -> None:
        """One step done."""
        if self._rich is not None:
            self._rich.advance(self._task)


@contextmanager
def progress_bar(enabled: bool, log: Callable[[str], None], *, total: int) -> Iterator[_Bar]:
    """A progress bar of ``total`` steps on stderr when ``enabled`` and rich is installed.

    The bar's ``log`` prints lines above it (through its console); without a bar it is ``log``.
    """
    if not enabled:
        yield _Bar(log, total)
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
    except ImportError:
        yield _Bar(log, total)
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True, highlight=False),
        transient=False,
    )
    with bar:
        yield _Bar(log, total, bar)


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


def thread_groups(
    records: Sequence[Mapping[str, Any]],
) -> list[tuple[str, list[Mapping[str, Any]]]]:
    """The records grouped by thread setting, in order of first appearance.

    The key is ``threads_setting`` (``"1"``, ``"default"``, ...); records written before it
    existed are grouped by their ``threads``.
    """
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        key = str(record.get("threads_setting", record.get("threads")))
        groups.setdefault(key, []).append(record)
    return list(groups.items())


def _threads_name(rows: Sequence[Mapping[str, Any]]) -> str:
    head = rows[0]
    return str(head.get("threads_label") or f"{head.get('threads')} thread(s)")


def _load_text(records: Sequence[Mapping[str, Any]]) -> str:
    loads = [r["load_avg"][0] for r in records if r.get("load_avg")]
    if not loads:
        return ""
    low, high = min(loads), max(loads)
    span = f"{low:.1f}" if high - low < 0.05 else f"{low:.1f}–{high:.1f}"
    cores = records[0].get("cpu_count")
    return f" · load average {span} at the start of the configurations" + (
        f" ({cores} cores)" if cores else ""
    )


def _thread_facts_text(rows: Sequence[Mapping[str, Any]]) -> str:
    torch_threads = sorted({r["torch_threads"] for r in rows if r.get("torch_threads")})
    numba_threads = sorted({r["numba_threads"] for r in rows if r.get("numba_threads")})
    layers = sorted({r["numba_threading_layer"] for r in rows if r.get("numba_threading_layer")})
    parts = []
    if torch_threads:
        parts.append("torch threads " + "/".join(map(str, torch_threads)))
    if numba_threads:
        parts.append(
            "numba threads (last set, where its pool was launched) "
            + "/".join(map(str, numba_threads))
            + (f" on the {'/'.join(layers)} layer" if layers else "")
        )
    env = {k: v for r in rows for k, v in (r.get("thread_env") or {}).items()}
    if env:
        parts.append("environment " + ", ".join(f"{k}={v}" for k, v in sorted(env.items())))
    pinned = rows[0].get("threads_setting") != "default"
    how = (
        "set by the harness (torch.set_num_threads; cases that run numba kernels pin numba's "
        "pool to the same count)"
        if pinned
        else "nothing set by the harness: no torch.set_num_threads, no numba pinning, no "
        "environment variable (what a user's process gets)"
    )
    return f"Threads: {how}. Measured: " + "; ".join(parts) + "." if parts else how + "."


def _status(record: Mapping[str, Any]) -> str:
    status = record.get("status")
    if status:
        return str(status)
    return "skipped" if record.get("skip") else "ok"


def _config_tables(rows: Sequence[Mapping[str, Any]], peak: bool) -> list[str]:
    head = ["method", "fwd × floor", "fwd+bwd × floor", "fwd ms", "fwd+bwd ms", "saved MB"]
    head += ["peak Δ MB"] * peak + ["repeats"]
    lines: list[str] = []
    for config_rows in _group_configs(rows):
        lines += ["", f"### {config_rows[0]['config']}", ""]
        lines += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
        notes = []
        for r in config_rows:
            status = _status(r)
            if r["skip"]:
                lines.append(f"| {r['case']} | {status}" + " |" * (len(head) - 1))
                notes.append(f"- {r['case']}: {r['skip']}")
                continue
            fb_status = r.get("fwdbwd_status") or ("error" if r.get("fwdbwd_skip") else "ok")
            if r.get("fwdbwd_skip"):
                notes.append(f"- {r['case']} (fwd+bwd): {r['fwdbwd_skip']}")
            failed_fb = fb_status != "ok"
            cells = [
                r["case"],
                _fmt(r["fwd_ratio"], ".2f", "×"),
                fb_status if failed_fb else _fmt(r["fwdbwd_ratio"], ".2f", "×"),
                _fmt(r["fwd_ms"], ".2f"),
                fb_status if failed_fb else _fmt(r["fwdbwd_ms"], ".2f"),
                _fmt(r["saved_mb"], ".3g"),
            ]
            if peak:
                peak_status = r.get("peak_status", "ok")
                cells.append(
                    str(peak_status)
                    if peak_status not in (None, "ok")
                    else _fmt(r.get("peak_mb"), ".3g")
                )
            cells.append(str(r["repeats"]))
            lines.append("| " + " | ".join(cells) + " |")
            if r.get("peak_error"):
                notes.append(
                    f"- {r['case']}: memory probe {r.get('peak_status', 'failed')}: "
                    f"{r['peak_error']}"
                )
        if notes:
            lines += ["", *notes]
    return lines


def _first_call_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    first_calls = [r for r in rows if "first_call_cold_s" in r or "first_call_cold_error" in r]
    if not first_calls:
        return []
    lines = [
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
    return lines


def threads_comparison(groups: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> list[str]:
    """A table of every case measured in the first two thread settings: forward+backward
    milliseconds and ratio to the floor in each, and the time of the second over the first."""
    if len(groups) < 2:
        return []
    (_, a_rows), (_, b_rows) = groups[0], groups[1]
    a_name, b_name = _threads_name(a_rows), _threads_name(b_rows)
    b_by = {(r["config"], r["case"]): r for r in b_rows}
    lines = [
        "",
        f"## {a_name} against {b_name}",
        "",
        f"Forward+backward medians of the same cases in the two configurations; each ran in its "
        f"own fresh processes. *ratio* is the {b_name} time over the {a_name} time (below 1: "
        "faster out of the box).",
        "",
        f"| configuration | method | {a_name} ms | {b_name} ms | ratio | × floor, {a_name} "
        f"| × floor, {b_name} |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for a in a_rows:
        b = b_by.get((a["config"], a["case"]))
        if b is None or not a.get("fwdbwd_ms") or not b.get("fwdbwd_ms"):
            continue
        lines.append(
            f"| {a['config']} | {a['case']} | {a['fwdbwd_ms']:.3g} | {b['fwdbwd_ms']:.3g} "
            f"| {b['fwdbwd_ms'] / a['fwdbwd_ms']:.2f} | {_fmt(a.get('fwdbwd_ratio'), '.2f', '×')} "
            f"| {_fmt(b.get('fwdbwd_ratio'), '.2f', '×')} |"
        )
    return lines


def markdown_report(
    records: Sequence[Mapping[str, Any]],
    suite: Suite,
    *,
    command: str | None = None,
) -> str:
    """Render the records as Markdown: one table per configuration, then the suite's summary.

    The ratio columns (time over the floor's forward time) come first: they are the headline.
    With several thread settings (1 thread and out of the box), a comparison table comes
    first, then one section per setting, each with its tables and its summary.
    """
    if not records:
        return f"# {suite.name} benchmark\n\nNo records.\n"
    first = records[0]
    groups = thread_groups(records)
    names = ", ".join(_threads_name(rows) for _, rows in groups)
    lines = [
        f"# {suite.name} benchmark",
        "",
        f"torch {first['torch']} · {first['device']} · {names} · {first['dtype']} · "
        f"{first['time']}{_load_text(records)}",
        *reproduce_lines(command),
    ]
    peak = any(r.get("peak_mb") is not None or r.get("peak_status") for r in records)
    kinds = sorted({r["peak_kind"] for r in records if r.get("peak_kind")})
    lines += [
        "",
        f"Ratios are times over the floor's forward time ({suite.floor_label}); "
        "medians over interleaved repeats. fwd+bwd is the forward plus `.backward()` of "
        "`(out * g).sum()` for a fixed random g. *saved* is the memory the forward keeps for "
        "backward (saved-tensor hooks, the input excluded)"
        + (
            "; *peak Δ* is the peak extra memory of one forward+backward in a fresh process "
            f"({', '.join(kinds) or 'rss'}), x.grad included."
            if peak
            else "; peak memory was not measured in this run."
        )
        + " A method that did not run says why: *skipped* (not installed, or over the suite's "
        "size limit), *timeout* (one call over the time budget, or its subprocess over the "
        "time-out), *oom* (out of memory), *error*.",
    ]
    if len(groups) > 1 and peak:
        lines += [
            "",
            "Peak memory and first calls are measured in the first thread setting only (what "
            "a call allocates does not depend on the thread count, beyond per-thread scratch).",
        ]
    lines += threads_comparison(groups)
    for _, rows in groups:
        if len(groups) > 1:
            lines += ["", f"## {_threads_name(rows)}"]
        lines += ["", _thread_facts_text(rows)]
        lines += _config_tables(rows, peak)
        lines += _first_call_table(rows)
        summary = suite.summary(rows)
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
    """Plot median time and peak memory against ``suite.plot_x`` per method, log-log.

    One row of panels per thread setting: forward time, forward+backward time and, when the
    memory probes ran, the peak extra memory of one forward+backward (measured in the first
    thread setting only: the other rows say so instead of showing an empty panel). One legend for
    the whole figure, below the panels, so that no legend covers a curve. Needs matplotlib (the
    ``bench`` extra); returns ``False`` without it or without data.
    """
    rows = [r for r in records if r["group"] == suite.plot_group and r["fwd_ms"] is not None]
    groups = thread_groups(rows)
    memory = any(r.get("peak_mb") for r in rows)
    panels = 3 if memory else 2
    cases = list(dict.fromkeys(r["case"] for r in rows))
    columns = min(5, len(cases) + 1)
    legend_rows = math.ceil((len(cases) + 1) / max(columns, 1))
    legend_height = 0.25 * legend_rows + 0.3
    height = 4.2 * len(groups) + legend_height
    fig = new_figure((5.2 * panels, height)) if rows else None
    if fig is None:
        return False
    import matplotlib  # present: new_figure returned a figure

    # Up to 10 cases: the default cycle; more: tab20, with a marker per block of its colours.
    palette = (
        [matplotlib.colormaps["tab20"](i) for i in range(20)]
        if len(cases) > 10
        else matplotlib.rcParams["axes.prop_cycle"].by_key().get("color", [None])
    )
    markers = "osD^v"
    styles = {
        case: (palette[i % len(palette)], markers[(i // len(palette)) % len(markers)])
        for i, case in enumerate(cases)
    }
    axes = fig.subplots(len(groups), panels, squeeze=False)
    for row_axes, (_, group_rows) in zip(axes, groups, strict=True):
        name = _threads_name(group_rows)
        panels_spec = [
            ("fwd_ms", f"forward, {name}", "median time (ms)"),
            ("fwdbwd_ms", f"forward + backward, {name}", "median time (ms)"),
        ]
        if memory:
            panels_spec.append(("peak_mb", f"peak extra memory, {name}", "peak Δ (MB)"))
        for ax, (key, title, ylabel) in zip(row_axes, panels_spec, strict=True):
            drawn = False
            for case in cases:
                pts = sorted(
                    (r[suite.plot_x], r[key])
                    for r in group_rows
                    if r["case"] == case and r.get(key)
                )
                if not pts:
                    continue
                floor = any(r["floor"] for r in group_rows if r["case"] == case)
                color, marker = styles[case]
                ax.plot(
                    *zip(*pts, strict=True),
                    marker=marker,
                    markersize=4,
                    label=case,
                    color=color,
                    linestyle="--" if floor else "-",
                )
                drawn = True
            if not drawn:
                ax.axis("off")
                ax.text(
                    0.5,
                    0.5,
                    f"{title}:\nnot measured in this setting\n(peak memory is measured in the\n"
                    "first thread setting only)",
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="grey",
                    transform=ax.transAxes,
                )
                continue
            floor_pts = sorted(
                (r[suite.plot_x], r["floor_fwd_ms"])
                for r in group_rows
                if r["floor"] and r["floor_fwd_ms"]
            )
            if floor_pts and key == "fwdbwd_ms":
                ax.plot(
                    *zip(*floor_pts, strict=True),
                    color="grey",
                    linestyle=":",
                    label=f"{suite.floor_label} (floor)",
                )
            log_log_axes(ax, suite.plot_x, title)
            ax.set_ylabel(ylabel)
    labels: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labels.setdefault(label, handle)
    fig.legend(
        list(labels.values()),
        list(labels),
        loc="lower center",
        ncol=columns,
        fontsize=8,
        frameon=False,
    )
    head = rows[0]
    fig.suptitle(
        f"{suite.name}: B={head.get('B', head.get('N'))}, {head['device']}, torch {head['torch']}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, legend_height / height, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
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
