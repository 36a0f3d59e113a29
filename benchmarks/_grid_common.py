"""The driver side shared by grid.py, gpu.py and first_call.py.

The grid, the subprocesses, the skip rules and the reports. Standard library only (matplotlib
for the PNG, imported late), so that a driver never imports torch or softops itself: every
measurement runs in a fresh interpreter (:mod:`_grid_worker`, or first_call.py's own worker).

A worker prints one JSON line per configuration, prefixed with :data:`MARKER`, as soon as that
configuration is done, so that the lines of a worker killed at its timeout are kept; the
configurations it did not reach get the status ``timeout``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_grid_worker.py"
MARKER = "GRID_RECORD "

BATCHES = (1, 8, 32, 33, 64, 1024, 4096, 16384)
SIZES = (8, 32, 128, 1000, 10_000, 100_000, 1_000_000)
MAX_NUMEL = 20_000_000
QUICK_BATCHES = (1, 33)
QUICK_SIZES = (32, 1000)

# name -> (the call, the hard op, the target ratio or None). The calls themselves are in
# _grid_worker.OPS; this is what the reports print.
OPS: dict[str, tuple[str, str, float | None]] = {
    "ot": (
        'soft_topk_mask(x, k, method="ot")',
        "torch.topk(x, k).values, k = min(10, n // 2)",
        3.0,
    ),
    "soft_rank": ("soft_rank(x)  (pav)", "torch.sort(x).values", 2.0),
    "soft_sort": ("soft_sort(x)  (pav)", "torch.sort(x).values", 2.0),
    "soft_topk": (
        "soft_topk(x, k).values, k = min(8, n)",
        "torch.topk(x, k).values, k = min(8, n)",
        10.0,
    ),
    "sparse": (
        'soft_topk_mask(x, k, method="sparse")',
        "torch.topk(x, k).values, k = min(10, n // 2)",
        None,
    ),
    "smooth_max": ("smooth_max(x)", "torch.amax(x, -1)", None),
    "soft_f1": (
        "metrics.soft_f1(x, target, from_logits=True)  (B samples, n classes)",
        "torch.amax(x, -1): the hard prediction's max (the hard F1 has no gradient)",
        None,
    ),
}
THREADS = ("1", "auto")
FAILED = ("timeout", "oom", "error")


@dataclass(frozen=True)
class Limits:
    """When a configuration is skipped before it runs, and how long its worker may take."""

    max_config_s: float = 20.0  # predicted wall time of one configuration's measurements
    max_mem_gb: float = 4.0  # predicted peak extra memory of one configuration
    timeout_s: float = 60.0  # the worker is killed past this (status "timeout")
    min_rounds: int = 3


def grid_shapes(
    batches: Sequence[int] = BATCHES, sizes: Sequence[int] = SIZES, max_numel: int = MAX_NUMEL
) -> list[tuple[int, int]]:
    """The (B, n) of the grid with B*n <= max_numel, in increasing n, then B."""
    return [(b, n) for n in sorted(sizes) for b in sorted(batches) if b * n <= max_numel]


def static_skip(op: str, b: int, n: int) -> str | None:
    """Shapes where an op does not make sense (they are recorded, never run)."""
    if op == "soft_f1" and b == 1:
        return "F1 is a batch metric: one sample"
    if op == "soft_f1" and n > 100_000:
        return "a macro F1 over a million classes"
    return None


def predicted_skip(
    op: str, b: int, n: int, done: Iterable[dict[str, Any]], limits: Limits
) -> tuple[str, str] | None:
    """Skip from what smaller configurations of the same op and threads gave.

    A configuration (B', n') with B' <= B and n' <= n that failed (timeout, oom) or was skipped
    for its time or memory skips this one. Otherwise the largest such configuration measured
    is scaled by B*n / (B'*n'): its time per round (the op and both floors) times 1 + min_rounds
    rounds, and its peak extra memory once warm (plus what its first call added once).
    """
    below = [
        r
        for r in done
        if r["op"] == op and r["B"] <= b and r["n"] <= n and (r["B"], r["n"]) != (b, n)
    ]
    for r in below:
        if r["status"] in ("timeout", "oom") or (
            r["status"] == "skipped" and r.get("skip_kind") in ("time", "memory")
        ):
            kind = "memory" if r["status"] == "oom" else r.get("skip_kind", "time")
            return kind, f"B={r['B']}, n={r['n']} was {r['status']}"
    measured = [r for r in below if r["status"] == "ok"]
    if not measured:
        return None
    ref = max(measured, key=lambda r: r["B"] * r["n"])
    scale = b * n / (ref["B"] * ref["n"])
    round_s = ref["median_s"] + ref["hard_s"] + ref["sigmoid_s"]
    seconds = round_s * scale * (1 + limits.min_rounds)
    if seconds > limits.max_config_s:
        return "time", (
            f"predicted {seconds:.0f} s > {limits.max_config_s:.0f} s "
            f"(B={ref['B']}, n={ref['n']} took {round_s:.3g} s per round, x{scale:.3g})"
        )
    # the peak of a warm call scales; the rest of the first call's peak (imports, compiled
    # kernels, caches) is paid once
    total, warm = ref.get("peak_extra_mb", 0.0), ref.get("peak_rounds_mb")
    warm = total if warm is None else min(warm, total)
    mem_gb = (total - warm + warm * scale) / 1024
    if mem_gb > limits.max_mem_gb:
        return "memory", (
            f"predicted {mem_gb:.1f} GB > {limits.max_mem_gb:.0f} GB (B={ref['B']}, "
            f"n={ref['n']} peaked at {total:.0f} MB, {warm:.0f} MB once warm, x{scale:.3g})"
        )
    return None


def skip_record(
    op: str, b: int, n: int, threads: str, device: str, kind: str, reason: str
) -> dict[str, Any]:
    """The record of a configuration not run: kind is "static", "time", "memory" or "budget"."""
    return {
        "op": op,
        "B": b,
        "n": n,
        "threads": threads,
        "device": device,
        "status": "skipped",
        "skip_kind": kind,
        "reason": reason,
    }


def run_worker(
    command: list[str],
    expected: list[dict[str, Any]],
    timeout_s: float,
) -> list[dict[str, Any]]:
    """Run one worker command in a fresh process; its records, in the order of ``expected``.

    ``expected`` holds one stub per configuration (op, B, n, threads, device): a configuration
    without a record gets ``timeout`` when the worker was killed at ``timeout_s``, else
    ``error`` with the last lines of its stderr.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            command, stdout=out, stderr=err, text=True, start_new_session=True, cwd=HERE.parent
        )
        try:
            proc.wait(timeout=timeout_s)
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed = True
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        lines = out.read().splitlines()
        stderr_tail = "\n".join(err.read().splitlines()[-8:])
    got = [json.loads(line[len(MARKER) :]) for line in lines if line.startswith(MARKER)]
    by_key = {(r["op"], r["B"], r["n"]): r for r in got}
    records = []
    for stub in expected:
        record = by_key.get((stub["op"], stub["B"], stub["n"]))
        if record is None:
            record = dict(stub)
            if killed:
                record.update(status="timeout", reason=f"worker killed after {timeout_s:.0f} s")
            elif proc.returncode == -signal.SIGKILL:
                record.update(status="oom", reason="worker killed by SIGKILL (OOM killer?)")
            else:
                record.update(
                    status="error", reason=f"exit {proc.returncode}: {stderr_tail[-600:]}"
                )
        record["process_wall_s"] = round(wall, 3)
        records.append(record)
    return records


def worker_command(
    configs: list[tuple[str, int, int]],
    threads: str,
    device: str,
    budget_s: float,
    min_rounds: int,
    max_rounds: int,
    max_config_s: float,
    extra: Sequence[str] = (),
) -> list[str]:
    return [
        sys.executable,
        str(WORKER),
        "--configs",
        json.dumps(configs),
        "--threads",
        threads,
        "--device",
        device,
        "--budget",
        str(budget_s),
        "--min-rounds",
        str(min_rounds),
        "--max-rounds",
        str(max_rounds),
        "--max-config-s",
        str(max_config_s),
        *extra,
    ]


def machine_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "thread_env": {
            k: v
            for k, v in os.environ.items()
            if k.endswith("_NUM_THREADS") or k.startswith(("NUMBA_", "SOFTOPS_"))
        },
    }


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def describe(record: dict[str, Any]) -> str:
    head = f"{record['op']} B={record['B']} n={record['n']} threads={record['threads']}"
    if record["status"] != "ok":
        return f"{head}: {record['status']} ({record.get('reason', '')[:120]})"
    return (
        f"{head}: {record['ratio']:.2f}x ({record['median_s'] * 1e3:.3g} ms, floor "
        f"{record['floor_s'] * 1e3:.3g} ms {record['floor_kind']}), first call "
        f"{record['first_call_s'] * 1e3:.3g} ms"
    )


# ---------------------------------------------------------------- reports


def _fmt_n(n: int) -> str:
    return f"1e{round(math.log10(n))}" if n >= 1000 and 10 ** round(math.log10(n)) == n else str(n)


def _cell(record: dict[str, Any] | None, target: float | None) -> str:
    if record is None:
        return "—"
    if record["status"] != "ok":
        return record["status"]
    mark = "" if target is None else (" ✓" if record["ratio"] <= target else " ✗")
    return f"{record['ratio']:.2f}{mark}"


def neighbour_jump(
    cells: dict[tuple[int, int], float],
) -> tuple[float, str, tuple[tuple[int, int], tuple[int, int]]] | None:
    """The largest ratio between two measured cells next to each other in B or in n, with the
    pair's keys."""
    batches = sorted({b for b, _ in cells})
    sizes = sorted({n for _, n in cells})
    best: tuple[float, str, tuple[tuple[int, int], tuple[int, int]]] | None = None
    for i, b in enumerate(batches):
        for j, n in enumerate(sizes):
            if (b, n) not in cells:
                continue
            for other in (
                (batches[i + 1], n) if i + 1 < len(batches) else None,
                (b, sizes[j + 1]) if j + 1 < len(sizes) else None,
            ):
                if other is None or other not in cells:
                    continue
                a, c = cells[(b, n)], cells[other]
                jump = max(a / c, c / a)
                if best is None or jump > best[0]:
                    where = (
                        f"B={b}, n={_fmt_n(n)}: {a:.2f} vs "
                        f"B={other[0]}, n={_fmt_n(other[1])}: {c:.2f}"
                    )
                    best = (jump, where, ((b, n), other))
    return best


def _by_table(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[tuple[int, int], Any]]:
    tables: dict[tuple[str, str], dict[tuple[int, int], Any]] = {}
    for r in records:
        tables.setdefault((r["op"], r["threads"]), {})[(r["B"], r["n"])] = r
    return tables


def threads_label(threads: str, records: list[dict[str, Any]]) -> str:
    if threads == "1":
        return "1 thread"
    counts = sorted({r["torch_threads"] for r in records if "torch_threads" in r})
    if not counts:
        return "out of the box"
    return f"out of the box (torch's default: {'/'.join(str(c) for c in counts)} threads)"


def summary_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per op and thread setting: cells, median and worst ratio, over target, neighbour jump."""
    rows = []
    tables = _by_table(records)
    for op, (_, _, target) in OPS.items():
        for threads in ("1", "auto"):
            table = tables.get((op, threads))
            if not table:
                continue
            ok = {k: r["ratio"] for k, r in table.items() if r["status"] == "ok"}
            if not ok:
                rows.append({"op": op, "threads": threads, "cells": 0, "of": len(table)})
                continue
            worst = max(ok, key=lambda k: ok[k])
            ratios = sorted(ok.values())
            median = ratios[len(ratios) // 2]
            if len(ratios) % 2 == 0:
                median = (ratios[len(ratios) // 2 - 1] + median) / 2
            jump = neighbour_jump(ok)
            rows.append(
                {
                    "op": op,
                    "threads": threads,
                    "target": target,
                    "cells": len(ok),
                    "of": len(table),
                    "median_ratio": round(median, 3),
                    "worst_ratio": round(ok[worst], 3),
                    "worst_cell": {"B": worst[0], "n": worst[1]},
                    "over_target": None
                    if target is None
                    else sum(1 for v in ok.values() if v > target),
                    "neighbour_jump": None if jump is None else round(jump[0], 3),
                    "neighbour_cells": None if jump is None else jump[1],
                }
            )
    return rows


def ratio_tables(
    records: list[dict[str, Any]], heading: str = "##", max_numel: int = MAX_NUMEL
) -> list[str]:
    """Per op a B x n table of ratios per thread setting, with targets and neighbour jumps.

    A table spans the B and n that its records hold: ``·`` marks a cell outside the grid
    (B*n > max_numel), ``—`` one in the grid without a record."""
    lines: list[str] = []
    tables = _by_table(records)
    for op, (call, hard, target) in OPS.items():
        settings = [t for t in ("1", "auto") if (op, t) in tables]
        if not settings:
            continue
        goal = "no target" if target is None else f"target ≤ {target:g}x (✓ met, ✗ missed)"
        lines += [f"{heading} {op}", "", f"`{call}` over max(`{hard}`, sigmoid); {goal}.", ""]
        for threads in settings:
            table = tables[(op, threads)]
            # the grid's rows and columns that hold at least one record of this table
            rows = sorted({b for b, _ in table})
            cols = sorted({n for _, n in table})
            lines += [f"**{threads_label(threads, list(table.values()))}**", ""]
            lines.append("| B \\ n | " + " | ".join(_fmt_n(n) for n in cols) + " |")
            lines.append("|---:|" + "---:|" * len(cols))
            for b in rows:
                cells = [
                    _cell(table.get((b, n)), target) if b * n <= max_numel else "·" for n in cols
                ]
                lines.append(f"| {b} | " + " | ".join(cells) + " |")
            ok = {k: r for k, r in table.items() if r["status"] == "ok"}
            lines.append("")
            if ok:
                worst = max(ok.values(), key=lambda r: r["ratio"])
                jump = neighbour_jump({k: r["ratio"] for k, r in ok.items()})
                by_sigmoid = sum(1 for r in ok.values() if r["floor_kind"] == "sigmoid")
                few = sum(1 for r in ok.values() if r["rounds"] < 3)
                note = (
                    f"Worst: {worst['ratio']:.2f}x at B={worst['B']}, n={_fmt_n(worst['n'])} "
                    f"({worst['median_s'] * 1e3:.3g} ms over {worst['floor_s'] * 1e3:.3g} ms)."
                )
                if jump is not None:
                    first, second = (ok[key] for key in jump[2])
                    note += (
                        f" Largest jump between neighbours: {jump[0]:.2f}x ({jump[1]}); between"
                        f" them the op's time changed {second['median_s'] / first['median_s']:.2f}x"
                        f" and the floor's {second['floor_s'] / first['floor_s']:.2f}x"
                        f" ({first['floor_kind']} to {second['floor_kind']})."
                    )
                note += f" The floor was the sigmoid in {by_sigmoid} of {len(ok)} cells."
                loads = [r["loadavg"] for r in ok.values() if "loadavg" in r]
                if loads:
                    note += (
                        f" 1-min load average while measuring: {min(loads):.1f} to "
                        f"{max(loads):.1f} ({ok_cpus(ok.values())} CPUs)."
                    )
                if few:
                    cells = "1 cell" if few == 1 else f"{few} cells"
                    note += f" {cells} had fewer than 3 timed rounds (slow)."
                lines += [note, ""]
    return lines


def ok_cpus(records: Iterable[dict[str, Any]]) -> str:
    counts = sorted({r["cpus"] for r in records if "cpus" in r})
    return "/".join(str(c) for c in counts) or "?"


def not_measured_table(records: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in records if r["status"] != "ok"]
    if not rows:
        return ["Every configuration ran.", ""]
    lines = ["| op | threads | B | n | status | reason |", "|---|---|---:|---:|---|---|"]
    for r in rows:
        reason = " ".join(str(r.get("reason", "")).split())[:200].replace("|", "\\|")
        lines.append(
            f"| {r['op']} | {r['threads']} | {r['B']} | {_fmt_n(r['n'])} | {r['status']} "
            f"| {reason} |"
        )
    return [*lines, ""]


def summary_table(rows: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| op | target | threads | cells | median | worst (B, n) | over target | "
        "largest neighbour jump |",
        "|---|---:|---|---:|---:|---|---:|---|",
    ]
    for row in rows:
        label = "1" if row["threads"] == "1" else "auto"
        if row["cells"] == 0:
            lines.append(f"| {row['op']} | | {label} | 0/{row['of']} | | | | |")
            continue
        target = "—" if row["target"] is None else f"≤ {row['target']:g}x"
        over = "—" if row["over_target"] is None else f"{row['over_target']}"
        cell = row["worst_cell"]
        jump = row["neighbour_jump"]
        lines.append(
            f"| {row['op']} | {target} | {label} | {row['cells']}/{row['of']} "
            f"| {row['median_ratio']:.2f}x | {row['worst_ratio']:.2f}x "
            f"({cell['B']}, {_fmt_n(cell['n'])}) | {over} | "
            + ("—" if jump is None else f"{jump:.2f}x ({row['neighbour_cells']})")
            + " |"
        )
    auto = [r for r in records if r["threads"] == "auto" and "torch_threads" in r]
    if auto:
        lines += ["", f"auto: {threads_label('auto', auto)}."]
    return [*lines, ""]


def heatmap(records: list[dict[str, Any]], path: Path, title: str) -> bool:
    """One panel per op and thread setting: log10 of the ratio over B x n. False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
        from matplotlib.patches import Rectangle
    except ImportError:
        log("matplotlib is not installed: no PNG")
        return False
    tables = _by_table(records)
    ops = [op for op in OPS if any((op, t) in tables for t in THREADS)]
    settings = [t for t in THREADS if any((op, t) in tables for op in ops)]
    if not ops:
        return False
    ratios = [r["ratio"] for r in records if r["status"] == "ok"]
    norm = LogNorm(vmin=min([*ratios, 1.0]), vmax=max([*ratios, 2.0]))
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(
        len(ops),
        len(settings),
        figsize=(4.6 * len(settings) + 1.2, 2.6 * len(ops)),
        squeeze=False,
        constrained_layout=True,
    )
    image = None
    for i, op in enumerate(ops):
        target = OPS[op][2]
        for j, threads in enumerate(settings):
            ax = axes[i][j]
            table = tables.get((op, threads), {})
            batches = sorted({b for b, _ in table}) or [1]
            sizes = sorted({n for _, n in table}) or [1]
            grid = [[math.nan] * len(sizes) for _ in batches]
            for (b, n), r in table.items():
                if r["status"] == "ok":
                    grid[batches.index(b)][sizes.index(n)] = r["ratio"]
            image = ax.imshow(grid, norm=norm, cmap=cmap, aspect="auto", origin="lower")
            ax.set_facecolor("0.85")
            for (b, n), r in table.items():
                y, x = batches.index(b), sizes.index(n)
                ok = r["status"] == "ok"
                text = f"{r['ratio']:.1f}" if ok else r["status"][:4]
                dark = ok and sum(cmap(norm(r["ratio"]))[:3]) < 1.5
                ax.text(
                    x, y, text, ha="center", va="center", fontsize=6, color="w" if dark else "k"
                )
                if r["status"] == "ok" and target is not None and r["ratio"] > target:
                    ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, ec="red", lw=1.5))
            ax.set_xticks(range(len(sizes)), [_fmt_n(n) for n in sizes], fontsize=7)
            ax.set_yticks(range(len(batches)), [str(b) for b in batches], fontsize=7)
            goal = "" if target is None else f", target ≤ {target:g}x (red: missed)"
            where = "1 thread" if threads == "1" else "out of the box"
            ax.set_title(f"{op}, {where}{goal}", fontsize=8)
            ax.set_xlabel("n", fontsize=7)
            ax.set_ylabel("B", fontsize=7)
    if image is not None:
        ticks = [
            t
            for t in (0.5, 1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)
            if norm.vmin <= t <= norm.vmax
        ]
        bar = fig.colorbar(image, ax=axes, shrink=0.6, ticks=ticks)
        bar.ax.set_yticklabels([f"{t:g}x" for t in ticks])
        bar.ax.minorticks_off()
        bar.set_label("forward+backward / floor (log scale)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def loadavg_text(values: Sequence[float] | None) -> str:
    return "?" if not values else "/".join(f"{v:.2f}" for v in values)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)
