"""Forward+backward of every op over a (B, n) grid, as a ratio to its floor, on the CPU.

Usage::

    python benchmarks/grid.py [--threads 1|auto [...]] [--quick] [--out benchmarks/results]

The grid is B in {1, 8, 32, 33, 64, 1024, 4096, 16384} x n in {8, 32, 128, 1e3, 1e4, 1e5, 1e6}
with B*n <= 2e7 (45 shapes), float32, x ~ N(0, 1), for each op of ``_grid_common.OPS`` out of the
box (default epsilons, no softops setting changed), at 1 thread (``torch.set_num_threads(1)``)
and at torch's default thread count ("auto"). Every configuration (op x shape x threads) runs in
a fresh subprocess (``_grid_worker.py``: one warm-up call, which is the first call of the process
and is recorded, then interleaved rounds of the op and its two floors for about ``--budget``
seconds, each short call timed after an untimed call of the same callable; medians). The floor
is the larger of the hard op's forward+backward through autograd and that of a sigmoid
``torch.autograd.Function``, measured in the same subprocess.

A configuration is skipped, with its reason recorded, where it makes no sense (soft_f1 at B=1,
and over a million classes), where a smaller configuration of the same op and threads (B' <= B,
n' <= n) timed out or was skipped for time or memory, or where the largest such configuration,
scaled by B*n, predicts more than ``--max-config-s`` seconds (1 + 3 rounds) or ``--max-mem-gb``
of peak memory. A worker is killed after ``--timeout`` seconds (status ``timeout``); its address
space is capped at its size after set-up plus 6 GB, so that a runaway allocation is an ``oom``.

Writes ``grid.json`` (every record, and the summary), ``grid.md`` (per op a B x n table of ratios
per thread setting, the targets, the worst cell and the largest jump between neighbouring cells,
the first-call table of ``first_call.py``) and ``grid.png`` (heat maps of the ratios) under
``--out``; ``--quick`` (B in {1, 33}, n in {32, 1e3}, 0.2 s per configuration) writes
``grid-quick.*`` instead. The JSON is rewritten after every configuration, so an interrupted run
keeps what it measured; ``--report-only`` rebuilds the Markdown and PNG from it. ``--append``
adds a run (other threads, ops or shapes) to the existing JSON: the configurations it measures
again replace the old records, which are kept under ``replaced``, and its first calls replace
those of its ops (the other ops' are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import first_call
from _grid_common import (
    BATCHES,
    MAX_NUMEL,
    OPS,
    QUICK_BATCHES,
    QUICK_SIZES,
    SIZES,
    THREADS,
    Limits,
    describe,
    grid_shapes,
    heatmap,
    loadavg_text,
    log,
    machine_info,
    not_measured_table,
    predicted_skip,
    ratio_tables,
    run_worker,
    skip_record,
    static_skip,
    summary_rows,
    summary_table,
    worker_command,
    write_json,
)

TARGETS_NOTE = (
    "Targets: ot ≤ 3x, soft_rank and soft_sort ≤ 2x, soft_topk ≤ 10x the floor; the other ops "
    "are reported without one."
)


def run_grid(
    ops: list[str],
    shapes: list[tuple[int, int]],
    settings: list[str],
    limits: Limits,
    budget_s: float,
    on_record: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every configuration in its own worker; returns the records in grid order."""
    records: list[dict[str, Any]] = []
    total = len(ops) * len(shapes) * len(settings)
    for threads in settings:
        for op in ops:
            done: list[dict[str, Any]] = []
            for b, n in shapes:
                reason = static_skip(op, b, n)
                skip = ("static", reason) if reason else predicted_skip(op, b, n, done, limits)
                if skip is not None:
                    record = skip_record(op, b, n, threads, "cpu", *skip)
                else:
                    command = worker_command(
                        [(op, b, n)],
                        threads,
                        "cpu",
                        budget_s,
                        limits.min_rounds,
                        400,
                        limits.max_config_s,
                        extra=["--address-space-gb", "6"],
                    )
                    stub = {"op": op, "B": b, "n": n, "threads": threads, "device": "cpu"}
                    (record,) = run_worker(command, [stub], limits.timeout_s)
                done.append(record)
                records.append(record)
                log(f"[{len(records)}/{total}] {describe(record)}")
                if on_record is not None:
                    on_record(records)
    return records


def _runs_lines(meta: dict[str, Any]) -> list[str]:
    lines = []
    for run in meta["runs"]:
        lines.append(
            f"- `{run['command']}`: {run['started']}, {run.get('duration_s', 0) / 60:.1f} min, "
            f"{run['configurations']} configurations; load average (1/5/15 min) "
            f"{loadavg_text(run['loadavg_start'])} at the start, "
            f"{loadavg_text(run.get('loadavg_end'))} at the end."
            + (f" {run['note']}" if run.get("note") else "")
        )
    return lines


def report(payload: dict[str, Any]) -> str:
    meta = payload["meta"]
    records = payload["records"]
    torch_version = next((r["torch"] for r in records if "torch" in r), "?")
    budgets = sorted({run["budget_s"] for run in meta["runs"]})
    max_numel = max(run["max_numel"] for run in meta["runs"])
    lines = [
        "# Forward+backward over the floor, every op over a (B, n) grid (CPU, float32)",
        "",
        f"torch {torch_version}, Python {meta['machine']['python']}, "
        f"{meta['machine']['cpu_count']} CPUs shared with other work (see the load averages). "
        "Runs:",
        "",
        *_runs_lines(meta),
        "",
        "Each cell is the op's forward+backward over its **floor**, both medians measured in the "
        "same fresh subprocess: floor = max(the hard op's forward+backward through autograd, "
        "a sigmoid `torch.autograd.Function`'s). Forward+backward is one call on x (B, n), "
        "x ~ N(0, 1), then `(out * g).sum().backward()` for a fixed random g. Every op runs out "
        "of the box (default epsilons). One configuration (op x shape x threads) per subprocess: "
        "one warm-up call (the process's first call, recorded in grid.json), then interleaved "
        "rounds of the op and both floors for about "
        + "/".join(f"{b:g}" for b in budgets)
        + f" s (at least {meta['limits']['min_rounds']} rounds unless a round is slow), "
        "each call under 50 ms timed right after an untimed call of the same callable (a call "
        "that follows another callable pays for its freed pages and caches: the small hard op "
        "beside a large op read up to twice its own time), "
        f"medians. `·`: outside the grid (B·n > {max_numel:.0e}); `—`: in the grid, not run; "
        "a table shows the B and n where it has a record. " + TARGETS_NOTE,
        "",
        "## Summary",
        "",
        *summary_table(payload["summary"], records),
    ]
    if payload.get("replaced"):
        lines[-1:-1] = [
            f"{len(payload['replaced'])} records were measured again by a later run; the "
            "tables show the latest, grid.json keeps the earlier ones under `replaced`.",
            "",
        ]
    if payload.get("first_call"):
        lines += ["## First call", "", *first_call.report_lines(payload["first_call"], "###")]
    lines += ["## Ratios per op", "", *ratio_tables(records, "###", max_numel)]
    lines += ["## Not measured", "", *not_measured_table(records)]
    return "\n".join(lines)


def write_reports(payload: dict[str, Any], out: Path, name: str) -> None:
    payload["summary"] = summary_rows(payload["records"])
    write_json(out / f"{name}.json", payload)
    (out / f"{name}.md").write_text(report(payload))
    started = payload["meta"]["runs"][0]["started"]
    heatmap(payload["records"], out / f"{name}.png", f"forward+backward / floor, CPU, {started}")


def _key(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record["threads"], record["op"], record["B"], record["n"])


def _order(record: dict[str, Any]) -> tuple[Any, ...]:
    return (
        THREADS.index(record["threads"]),
        list(OPS).index(record["op"]),
        record["n"],
        record["B"],
    )


def merge_first_calls(
    old: list[dict[str, Any]], fresh: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The first-call records of an appending run: ``fresh`` in place of the old records of the
    same subject, shape and threads; the other old ones (the ops this run did not take) kept."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["subject"], r["B"], r["n"], r["threads"]

    taken = {key(r) for r in fresh}
    return [*(r for r in old if key(r) not in taken), *fresh]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", choices=THREADS, default=list(THREADS))
    parser.add_argument("--quick", action="store_true", help="B in {1, 33}, n in {32, 1e3}")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", help="output stem (grid, or grid-quick with --quick)")
    parser.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    parser.add_argument("--batches", nargs="+", type=int, help="B values (default: the grid's)")
    parser.add_argument("--sizes", nargs="+", type=float, help="n values (default: the grid's)")
    parser.add_argument("--max-numel", type=float, default=MAX_NUMEL)
    parser.add_argument("--budget", type=float, help="seconds of rounds per configuration")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per worker")
    parser.add_argument("--max-config-s", type=float, default=20.0)
    parser.add_argument("--max-mem-gb", type=float, default=4.0)
    parser.add_argument("--no-first-call", action="store_true")
    parser.add_argument(
        "--append",
        action="store_true",
        help="add to the existing JSON (a run over other threads, ops or shapes); "
        "configurations measured again replace the old ones",
    )
    parser.add_argument("--note", help="a line about this run, printed with it in the report")
    parser.add_argument("--report-only", action="store_true", help="rebuild .md/.png from .json")
    args = parser.parse_args(argv)
    name = args.name or ("grid-quick" if args.quick else "grid")
    out = Path(args.out)
    if args.report_only:
        write_reports(json.loads((out / f"{name}.json").read_text()), out, name)
        return 0
    batches = args.batches or (QUICK_BATCHES if args.quick else BATCHES)
    sizes = [int(s) for s in args.sizes] if args.sizes else (QUICK_SIZES if args.quick else SIZES)
    shapes = grid_shapes(batches, sizes, int(args.max_numel))
    budget = args.budget if args.budget is not None else (0.2 if args.quick else 0.5)
    limits = Limits(args.max_config_s, args.max_mem_gb, args.timeout)
    given = sys.argv[1:] if argv is None else argv
    run = {
        "command": " ".join(["python benchmarks/grid.py", *given]).strip(),
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_start": [round(v, 2) for v in os.getloadavg()],
        "budget_s": budget,
        "threads": args.threads,
        "ops": args.ops,
        "batches": list(batches),
        "sizes": list(sizes),
        "max_numel": int(args.max_numel),
        "configurations": len(shapes) * len(args.ops) * len(args.threads),
    }
    if args.note:
        run["note"] = args.note
    old: dict[str, Any] = {"meta": {"runs": []}, "records": []}
    if args.append and (out / f"{name}.json").exists():
        old = json.loads((out / f"{name}.json").read_text())
    payload: dict[str, Any] = {
        "meta": {
            "machine": machine_info(),
            "limits": vars(limits),
            "ops": {op: {"call": c, "hard": h, "target": t} for op, (c, h, t) in OPS.items()},
            "runs": [*old["meta"]["runs"], run],
        },
        "records": [],
    }
    if old.get("first_call"):
        payload["first_call"] = old["first_call"]
    planned = {(t, op, b, n) for t in args.threads for op in args.ops for b, n in shapes}
    kept = [r for r in old["records"] if _key(r) not in planned]
    # what this run measures again, kept with the run that replaced it
    replaced = [
        {**r, "replaced_by_run": len(payload["meta"]["runs"]) - 1}
        for r in old["records"]
        if _key(r) in planned
    ]
    if old.get("replaced") or replaced:
        payload["replaced"] = [*old.get("replaced", []), *replaced]
    start = time.perf_counter()

    def save(records: list[dict[str, Any]]) -> None:
        payload["records"] = sorted([*kept, *records], key=_order)
        payload["summary"] = summary_rows(payload["records"])
        write_json(out / f"{name}.json", payload)

    save(run_grid(args.ops, shapes, args.threads, limits, budget, save))
    if not args.no_first_call:
        fc_shapes = first_call.QUICK_SHAPES if args.quick else first_call.SHAPES
        fresh = first_call.run_all(args.ops, fc_shapes, "1", args.timeout)
        payload["first_call"] = merge_first_calls(payload.get("first_call", []), fresh)
    run["duration_s"] = round(time.perf_counter() - start, 1)
    run["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    write_reports(payload, out, name)
    log(f"wrote {out / name}.json, .md, .png in {run['duration_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
