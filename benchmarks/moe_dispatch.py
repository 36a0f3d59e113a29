"""``softops.nn.TopKMoE`` (sparse dispatch) against the dense computation of the same block.

    python benchmarks/moe_dispatch.py        # writes benchmarks/results/moe_dispatch.md

The dense computation runs every expert on every token and weighs the outputs by the router's
weights (zero for the unselected experts): the same output, E/k times the experts' work. Both
arms share one ``TopKRouter`` and one set of experts (the default feed-forward,
``d -> 4d -> d``, GELU), so the difference is the dispatch alone. Timed: forward+backward of
``(out * g).sum() + 0.01 * aux_loss``, one torch thread, interleaved: three rounds of ``--calls``
timed calls of each arm after a warm-up, the best round's median of each. One process; absolute
times vary with the machine's load, the ratios less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from softops.nn import TopKMoE

#: (tokens, d_model, experts, k)
SHAPES = [(4096, 64, 8, 2), (4096, 64, 32, 2), (1024, 128, 8, 1)]


def _median_ms(fn: Callable[[], None], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(T: int, d: int, E: int, k: int, calls: int) -> tuple[float, float]:
    """(sparse ms, dense ms) of one forward+backward."""
    torch.manual_seed(0)
    moe = TopKMoE(d, E, k)
    x = torch.randn(T, d, requires_grad=True)
    g = torch.randn(T, d)

    def sparse() -> None:
        out = moe(x)
        ((out.output * g).sum() + 0.01 * out.aux_loss).backward()

    def dense() -> None:
        r = moe.router(x)
        y = torch.stack([f(x) for f in moe.experts], 1)  # (T, E, d)
        out = (r.weights.unsqueeze(-1) * y).sum(1)
        ((out * g).sum() + 0.01 * r.aux_loss).backward()

    for _ in range(3):
        sparse()
        dense()
    rounds = [(_median_ms(sparse, calls), _median_ms(dense, calls)) for _ in range(3)]
    return min(r[0] for r in rounds), min(r[1] for r in rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/moe_dispatch.py", description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/moe_dispatch.md")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per round and arm")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows = []
    for T, d, E, k in SHAPES:
        sparse, dense = measure(T, d, E, k, args.calls)
        rows.append(
            f"| {T} | {d} | {E} | {k} | {sparse:.2f} | {dense:.2f} | {sparse / dense:.2f}x |"
        )
    lines = [
        "# TopKMoE: sparse dispatch against the dense computation",
        "",
        f"`python benchmarks/moe_dispatch.py`: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch "
        f"{torch.__version__}, 1 thread, 1-min load average {load:.2f} at the start.",
        "",
        "| tokens | d_model | experts | k | TopKMoE ms | dense ms | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        (__doc__ or "").split("\n\n", 2)[2].strip(),
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines[4 : 6 + len(rows)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
