"""An op's forward+backward over its grid floor in thread CPU time, for a few cells, one thread.

The grid (``grid.py``) times wall clock in a fresh process per configuration; on a shared,
loaded machine its ratios move by 10-30 %. This script measures the same callables (those of
``_grid_worker.py``: the op, its hard op and the one-line sigmoid Function, each followed by
the backward of a random linear functional) in thread CPU time (``time.thread_time``), which
another process's load does not add to, all cells in one process, at
``torch.set_num_threads(1)``. Per cell: rounds of ``--repeats`` calls of each callable,
interleaved (the order reversed every other round), until ``--budget`` seconds; the median over
rounds of the time per call. The floor is the larger of the hard op and the sigmoid::

    python benchmarks/thread_ratio.py --op soft_topk --cells 4096x8 16384x8 1024x1000
    python benchmarks/thread_ratio.py --op soft_topk --over 10   # the whole grid, flag > 10x
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch

from _grid_worker import callables, make_input

GRID_B = (1, 8, 32, 33, 64, 1024, 4096, 16384)
GRID_N = (8, 32, 128, 1000, 10_000, 100_000, 1_000_000)


def _cell(text: str) -> tuple[int, int]:
    b, n = text.lower().split("x")
    return int(b), int(float(n))


def _per_call(fn: Callable[[], None], repeats: int) -> float:
    start = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - start) / repeats


def measure(op: str, b: int, n: int, budget: float) -> dict[str, float]:
    """Seconds per forward+backward (thread time) of the op, the hard op and the sigmoid."""
    x, gen = make_input(b, n, torch.device("cpu"))
    fns = callables(op, x, gen)
    start = time.thread_time()
    for fn in fns.values():
        fn()
    once = time.thread_time() - start
    repeats = max(1, min(200, int(0.02 / max(once, 1e-7))))
    names = list(fns)
    seen: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        begin = time.perf_counter()
        rounds = 0
        while rounds < 5 or (time.perf_counter() - begin < budget and rounds < 400):
            for name in names if rounds % 2 == 0 else names[::-1]:
                seen[name].append(_per_call(fns[name], repeats))
            rounds += 1
    finally:
        gc.enable()
    return {name: statistics.median(values) for name, values in seen.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="soft_topk")
    parser.add_argument("--cells", nargs="*", default=None, help="BxN, e.g. 4096x8 (default: grid)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per cell")
    parser.add_argument("--max-elements", type=float, default=2e7)
    parser.add_argument("--over", type=float, default=None, help="mark ratios above this")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cells = (
        [_cell(c) for c in args.cells]
        if args.cells
        else [(b, n) for b in GRID_B for n in GRID_N if b * n <= args.max_elements]
    )
    print(f"{'B':>6} {'n':>8} {'op ms':>9} {'hard ms':>9} {'sigm ms':>9} {'ratio':>7}")
    for b, n in cells:
        t = measure(args.op, b, n, args.budget)
        floor = max(t["hard"], t["sigmoid"])
        ratio = t["op"] / floor
        mark = " *" if args.over is not None and ratio > args.over else ""
        print(
            f"{b:>6} {n:>8} {t['op'] * 1e3:>9.4f} {t['hard'] * 1e3:>9.4f} "
            f"{t['sigmoid'] * 1e3:>9.4f} {ratio:>7.2f}{mark}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
