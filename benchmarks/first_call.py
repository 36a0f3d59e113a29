"""First calls in fresh processes: import torch, import softops, each op's first call.

Times ``import torch``, ``import softops`` and the first forward+backward of each op.

Usage::

    python benchmarks/first_call.py [--threads 1|auto] [--out benchmarks/results] [--quick]

Each (op, shape) runs in its own fresh interpreter, at 1 thread by default
(``torch.set_num_threads(1)`` right after ``import torch``; ``--threads auto`` sets nothing; on
a shared machine the default thread count mostly measures the neighbours), no softops setting
changed: it times ``import torch``, then ``import softops`` on top of it,
then builds x (B, n) and the op's callable (untimed) and times its first forward+backward (as in
grid.py: the backward of ``<g, op(x)>`` for a fixed random g) and its second. The hard ops
(``torch.topk``, ``torch.sort``, ``torch.amax``) and the sigmoid floor get their own fresh
processes too, for comparison: what torch's own first autograd call costs. Shapes: small
(B=8, n=128) and large (B=64, n=1e5). Disk caches (numba's compiled PAV kernel, the OS page
cache of the shared libraries) are as the machine has them: a first run after installation can
be slower.

Writes ``first_call.{json,md}`` under ``--out`` (``first_call-quick.*`` with ``--quick``);
grid.py runs the same measurements and puts them in ``grid.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MARKER = "FIRST_CALL "
SHAPES = ((8, 128), (64, 100_000))
QUICK_SHAPES = ((8, 128),)
# the floors, each in its own process: name -> (the op whose callables hold it, which one)
FLOORS = {
    "torch.topk": ("ot", "hard"),
    "torch.sort": ("soft_sort", "hard"),
    "torch.amax": ("smooth_max", "hard"),
    "sigmoid": ("smooth_max", "sigmoid"),
}


def _one(subject: str, b: int, n: int, threads: str) -> dict[str, Any]:
    """In a fresh interpreter: the import times and the first two calls of one subject."""
    start = time.perf_counter()
    import torch

    torch_s = time.perf_counter() - start
    if threads == "1":
        torch.set_num_threads(1)
    start = time.perf_counter()
    import softops  # noqa: F401

    softops_s = time.perf_counter() - start
    import _grid_worker

    op, which = FLOORS.get(subject, (subject, "op"))
    x, gen = _grid_worker.make_input(b, n, torch.device("cpu"))
    fn = _grid_worker.callables(op, x, gen)[which]
    calls = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        calls.append(time.perf_counter() - start)
    return {
        "subject": subject,
        "B": b,
        "n": n,
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "import_torch_s": round(torch_s, 4),
        "import_softops_s": round(softops_s, 4),
        "first_call_s": float(f"{calls[0]:.4g}"),
        "second_call_s": float(f"{calls[1]:.4g}"),
        "status": "ok",
    }


def run_all(
    ops: list[str], shapes: tuple[tuple[int, int], ...], threads: str, timeout_s: float
) -> list[dict[str, Any]]:
    """One fresh process per (subject, shape): the ops, then the floors."""
    records = []
    for subject in [*ops, *FLOORS]:
        for b, n in shapes:
            command = [sys.executable, __file__, "--one", subject, str(b), str(n)]
            command += ["--threads", threads]
            record: dict[str, Any] = {"subject": subject, "B": b, "n": n, "threads": threads}
            try:
                done = subprocess.run(
                    command, capture_output=True, text=True, timeout=timeout_s, cwd=HERE.parent
                )
            except subprocess.TimeoutExpired:
                record.update(status="timeout", reason=f"killed after {timeout_s:.0f} s")
            else:
                found = [ln for ln in done.stdout.splitlines() if ln.startswith(MARKER)]
                if found:
                    record = json.loads(found[-1][len(MARKER) :])
                else:
                    tail = " ".join(done.stderr.splitlines()[-3:])[-400:]
                    record.update(status="error", reason=f"exit {done.returncode}: {tail}")
            records.append(record)
            print(f"first call: {_describe(record)}", file=sys.stderr, flush=True)
    return records


def _describe(r: dict[str, Any]) -> str:
    head = f"{r['subject']} B={r['B']} n={r['n']}"
    if r["status"] != "ok":
        return f"{head}: {r['status']} {r.get('reason', '')}"
    return (
        f"{head}: import torch {r['import_torch_s']:.2f} s, softops "
        f"{r['import_softops_s']:.2f} s, first call {r['first_call_s'] * 1e3:.1f} ms, "
        f"second {r['second_call_s'] * 1e3:.2f} ms"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.2f} s"


def report_lines(records: list[dict[str, Any]], heading: str = "##") -> list[str]:
    """The import times over the processes, then the first and second call per subject."""
    ok = [r for r in records if r["status"] == "ok"]
    lines = []
    if ok:
        threads = sorted({str(r["torch_threads"]) for r in ok})
        lines += [
            f"Each cell is one fresh process ({len(records)} in all, torch threads: "
            f"{'/'.join(threads)}): forward+backward of the first call, then of the second.",
            "",
            "| import | median | min | max |",
            "|---|---:|---:|---:|",
        ]
        for key, label in (
            ("import_torch_s", "`import torch`"),
            ("import_softops_s", "`import softops` after it"),
        ):
            values = [r[key] for r in ok]
            lines.append(
                f"| {label} | {statistics.median(values):.2f} s | {min(values):.2f} s "
                f"| {max(values):.2f} s |"
            )
        lines.append("")
    shapes = sorted({(r["B"], r["n"]) for r in records}, key=lambda s: s[0] * s[1])
    lines += [
        f"{heading} First and second call, forward+backward",
        "",
        "| subject | " + " | ".join(f"B={b}, n={n:g}: first | second" for b, n in shapes) + " |",
        "|---|" + "---:|---:|" * len(shapes),
    ]
    by_key = {(r["subject"], r["B"], r["n"]): r for r in records}
    for subject in dict.fromkeys(r["subject"] for r in records):
        cells = []
        for b, n in shapes:
            r = by_key.get((subject, b, n))
            if r is None:
                cells += ["", ""]
            elif r["status"] != "ok":
                cells += [r["status"], ""]
            else:
                cells += [_ms(r["first_call_s"]), _ms(r["second_call_s"])]
        name = f"{subject} (floor)" if subject in FLOORS else subject
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", choices=["1", "auto"], default="1")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="the small shape only")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        subject, b, n = args.one
        print(MARKER + json.dumps(_one(subject, int(b), int(n), args.threads)), flush=True)
        return 0
    from _grid_common import OPS, write_json

    shapes = QUICK_SHAPES if args.quick else SHAPES
    records = run_all(list(OPS), shapes, args.threads, args.timeout)
    name = "first_call-quick" if args.quick else "first_call"
    out = Path(args.out)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmarks/first_call.py", *given]).strip()
    write_json(out / f"{name}.json", {"command": command, "records": records})
    text = ["# First calls in fresh processes", "", f"`{command}`", "", *report_lines(records)]
    (out / f"{name}.md").write_text("\n".join(text))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
