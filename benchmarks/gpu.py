"""The grid of grid.py on a CUDA device, in one command of under 5 minutes.

Usage::

    python benchmarks/gpu.py [--out benchmarks/results] [--total 210] [--quick]

The same ops, floors, shapes (B*n <= 2e7) and timing loop as grid.py (``_grid_worker.py``),
float32 on ``cuda:0``, with ``torch.cuda.synchronize()`` before and after every timed call, at
torch's default thread count (the CPU threads matter only to pav's host round trip). To fit the
time, each op runs in ONE fresh subprocess over all its shapes, in increasing B*n (not one
process per configuration as on the CPU): its ``first_call_s`` is the first call at that shape
in that process, the process's very first CUDA work only at the smallest shape. Each op gets an
equal share of what is left of ``--total`` seconds; the shapes its share does not reach (the
largest B*n) are recorded as skipped. Repeats are capped: about ``--budget`` seconds of rounds
(0.1), at least 3 and at most ``--max-rounds`` (50) rounds per configuration; a configuration
predicted over ``--max-config-s`` (10) seconds or 4 GB of GPU memory from the smaller ones is
skipped, and a worker is killed 45 s past its share (status ``timeout``).

Writes ``gpu.json`` and ``gpu.md`` (and ``gpu.png``) under ``--out``. Without a CUDA device it
prints why and exits with status 0, writing nothing. ``--device cpu`` runs the same code on
the CPU (a dry run of the script, written as ``gpu-dryrun-cpu.*``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _grid_common import (
    BATCHES,
    MAX_NUMEL,
    OPS,
    QUICK_BATCHES,
    QUICK_SIZES,
    SIZES,
    Limits,
    describe,
    grid_shapes,
    heatmap,
    loadavg_text,
    log,
    machine_info,
    not_measured_table,
    ratio_tables,
    run_worker,
    skip_record,
    summary_rows,
    summary_table,
    worker_command,
    write_json,
)

MIN_LEFT_S = 10.0  # with less of --total left, the ops left are not started
GRACE_S = 45.0  # past its share, a worker is killed


def cuda_problem() -> str | None:
    """Why CUDA cannot be used here, or None."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return None


def run_ops(
    ops: list[str],
    shapes: list[tuple[int, int]],
    device: str,
    total_s: float,
    budget_s: float,
    max_rounds: int,
    limits: Limits,
) -> list[dict[str, Any]]:
    """One worker per op over all its shapes, each within its share of ``total_s``."""
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    for i, op in enumerate(ops):
        left = total_s - (time.perf_counter() - start)
        share = left / (len(ops) - i)
        stubs = [{"op": op, "B": b, "n": n, "threads": "auto", "device": device} for b, n in shapes]
        if left < MIN_LEFT_S:
            reason = f"the {total_s:.0f} s of --total were spent"
            got = [skip_record(op, b, n, "auto", device, "budget", reason) for b, n in shapes]
        else:
            command = worker_command(
                [(op, b, n) for b, n in shapes],
                "auto",
                device,
                budget_s,
                limits.min_rounds,
                max_rounds,
                limits.max_config_s,
                extra=[
                    "--deadline-at",
                    str(time.time() + share),
                    "--max-mem-gb",
                    str(limits.max_mem_gb),
                ],
            )
            got = run_worker(command, stubs, share + GRACE_S)
        for record in got:
            log(f"[{op}] {describe(record)}")
        records += got
    return records


def report(payload: dict[str, Any]) -> str:
    meta = payload["meta"]
    records = payload["records"]
    first = next((r for r in records if "torch" in r), {})
    device = first.get("device_name", meta["device"])
    lines = [
        f"# Forward+backward over the floor on {device} (float32)",
        "",
        f"`{meta['command']}`: {meta['started']}, {meta['duration_s'] / 60:.1f} min; torch "
        f"{first.get('torch', '?')}, {meta['machine']['cpu_count']} CPUs, load average "
        f"{loadavg_text(meta['loadavg_start'])} at the start.",
        "",
        "As benchmarks/results/grid.md, on the device: each cell is the op's forward+backward "
        "(`(out * g).sum().backward()`, g fixed and random) over max(the hard op's, a sigmoid "
        "`torch.autograd.Function`'s), medians of interleaved rounds in the same process, "
        "`torch.cuda.synchronize()` around every timed call, torch's default CPU threads. One "
        "subprocess per op runs all its shapes in increasing B·n (so `first_call_s` in gpu.json "
        "is the first call at a shape, not in a fresh process); repeats are capped "
        f"({meta['budget_s']} s of rounds, {meta['limits']['min_rounds']} to "
        f"{meta['max_rounds']} rounds) and each op had an equal share of {meta['total_s']:.0f} s: "
        "the shapes it did not reach are listed under Not measured. `·`: outside the grid; "
        "`—`: not run.",
        "",
        "## Summary",
        "",
        *summary_table(payload["summary"], records),
        "## Ratios per op",
        "",
        *ratio_tables(records, "###", meta["max_numel"]),
        "## Not measured",
        "",
        *not_measured_table(records),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", help="output stem (gpu; gpu-dryrun-cpu with --device cpu)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="B in {1, 33}, n in {32, 1e3}")
    parser.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    parser.add_argument("--total", type=float, default=210.0, help="seconds for all the ops")
    parser.add_argument("--budget", type=float, default=0.1, help="seconds of rounds per config")
    parser.add_argument("--max-rounds", type=int, default=50)
    parser.add_argument("--max-config-s", type=float, default=10.0)
    parser.add_argument("--max-mem-gb", type=float, default=4.0)
    parser.add_argument("--max-numel", type=float, default=MAX_NUMEL)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        problem = cuda_problem()
        if problem is not None:
            print(f"gpu.py: no CUDA device to measure: {problem}. Nothing was run or written.")
            return 0
    name = args.name or ("gpu" if args.device == "cuda" else "gpu-dryrun-cpu")
    batches = QUICK_BATCHES if args.quick else BATCHES
    sizes = QUICK_SIZES if args.quick else SIZES
    shapes = sorted(
        grid_shapes(batches, sizes, int(args.max_numel)), key=lambda s: (s[0] * s[1], s[1])
    )
    limits = Limits(max_config_s=args.max_config_s, max_mem_gb=args.max_mem_gb)
    given = sys.argv[1:] if argv is None else argv
    meta: dict[str, Any] = {
        "command": " ".join(["python benchmarks/gpu.py", *given]).strip(),
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_start": [round(v, 2) for v in os.getloadavg()],
        "machine": machine_info(),
        "device": args.device,
        "total_s": args.total,
        "budget_s": args.budget,
        "max_rounds": args.max_rounds,
        "limits": vars(limits),
        "batches": list(batches),
        "sizes": list(sizes),
        "max_numel": int(args.max_numel),
        "ops": {op: {"call": c, "hard": h, "target": t} for op, (c, h, t) in OPS.items()},
    }
    start = time.perf_counter()
    records = run_ops(
        args.ops, shapes, args.device, args.total, args.budget, args.max_rounds, limits
    )
    meta["duration_s"] = round(time.perf_counter() - start, 1)
    payload = {"meta": meta, "records": records, "summary": summary_rows(records)}
    out = Path(args.out)
    write_json(out / f"{name}.json", payload)
    (out / f"{name}.md").write_text(report(payload))
    heatmap(records, out / f"{name}.png", f"forward+backward / floor, {args.device}")
    log(f"wrote {out / name}.json, .md, .png in {meta['duration_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
