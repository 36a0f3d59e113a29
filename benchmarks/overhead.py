"""Per-call cost at the small sizes where fixed costs dominate, at 1 thread and out of the box.

Forward+backward (``backward`` of the summed output, what a loss does), interleaved in rounds
with the reference it is compared to, median over the rounds of each round's median:

* ``soft_topk_mask(x, 10, epsilon=0.1)`` ("ot") over the ``torch.topk(x, 10)`` forward (the
  floor), at B=64 and B=1, n=1e3, float32; its forward alone as well;
* pav ``soft_rank`` and ``soft_sort`` (epsilon 1) over torchsort's (regularization_strength 1),
  B in {1, 8, 64} x n in {100, 300, 1000}, when torchsort is installed.

Each thread setting runs in a fresh process: ``1`` calls ``torch.set_num_threads(1)`` (numba is
pinned alike by softops); ``default`` sets nothing, which is what a user gets. Writes
``overhead.json`` and ``overhead.md`` under ``--out``. Usage::

    python benchmarks/overhead.py [--threads 1 default] [--rounds 9] [--repeats 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import softops

SORT_SHAPES = [(b, n) for b in (1, 8, 64) for n in (100, 300, 1000)]
OT_SHAPES = [(64, 1000), (1, 1000)]


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved(fns: dict[str, Callable[[], Any]], rounds: int, repeats: int) -> dict[str, float]:
    """Seconds per call of each function: the median over rounds of each round's median."""
    for fn in fns.values():
        for _ in range(max(repeats // 4, 2)):
            fn()
    seen: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            seen[name].append(_median_time(fn, repeats))
    return {name: statistics.median(values) for name, values in seen.items()}


def _fwd_bwd(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        op(x).sum().backward()
        x.grad = None

    return run


def measure(
    rounds: int,
    repeats: int,
    ot_shapes: list[tuple[int, int]] = OT_SHAPES,
    sort_shapes: list[tuple[int, int]] = SORT_SHAPES,
) -> list[dict[str, Any]]:
    """The records of one process (its thread setting is the caller's)."""
    gen = torch.Generator().manual_seed(0)
    records = []
    for b, n in ot_shapes:
        x = torch.randn(b, n, generator=gen)
        xg = x.clone().requires_grad_()
        mask = lambda t: softops.soft_topk_mask(t, 10, epsilon=0.1)  # noqa: E731
        times = _interleaved(
            {
                "floor": lambda x=x: torch.topk(x, 10),
                "forward": lambda x=x: softops.soft_topk_mask(x, 10, epsilon=0.1),
                "forward+backward": _fwd_bwd(mask, xg),
            },
            rounds,
            repeats,
        )
        records.append({"case": "ot", "B": b, "n": n, **times})
    try:
        import torchsort
    except ImportError:
        torchsort = None
    for b, n in sort_shapes if torchsort is not None else []:
        xg = torch.randn(b, n, generator=gen).requires_grad_()
        for name in ("soft_rank", "soft_sort"):
            ours, theirs = getattr(softops, name), getattr(torchsort, name)
            times = _interleaved(
                {
                    "softops": _fwd_bwd(lambda t, ours=ours: ours(t, epsilon=1.0), xg),
                    "torchsort": _fwd_bwd(
                        lambda t, theirs=theirs: theirs(t, regularization_strength=1.0), xg
                    ),
                },
                rounds,
                repeats,
            )
            records.append({"case": name, "B": b, "n": n, **times})
    return records


def _report(by_setting: dict[str, list[dict[str, Any]]], command: str) -> str:
    lines = [
        "# Per-call cost at small sizes, 1 thread and out of the box",
        "",
        f"`{command}`; torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        + " ".join(f"{v:.1f}" for v in os.getloadavg())
        + " at the end. Forward+backward unless marked; median of the rounds' medians.",
        "",
        '## "ot" over the `torch.topk` forward (k=10, epsilon 0.1, float32)',
        "",
        "| threads | B | n | floor | forward | forward+backward |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for setting, records in by_setting.items():
        for r in records:
            if r["case"] == "ot":
                lines.append(
                    f"| {setting} | {r['B']} | {r['n']} | {r['floor'] * 1e6:.0f} us "
                    f"| {r['forward'] / r['floor']:.1f}x ({r['forward'] * 1e6:.0f} us) "
                    f"| {r['forward+backward'] / r['floor']:.1f}x "
                    f"({r['forward+backward'] * 1e6:.0f} us) |"
                )
    sort_rows = [
        (setting, r) for setting, records in by_setting.items() for r in records if "torchsort" in r
    ]
    if sort_rows:
        lines += [
            "",
            "## pav over torchsort (epsilon = regularization_strength = 1)",
            "",
            "| threads | op | B | n | softops | torchsort | ratio |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for setting, r in sort_rows:
            lines.append(
                f"| {setting} | {r['case']} | {r['B']} | {r['n']} | {r['softops'] * 1e6:.0f} us "
                f"| {r['torchsort'] * 1e6:.0f} us | {r['softops'] / r['torchsort']:.2f}x |"
            )
        lines += ["", "| threads | op | worst | median |", "|---|---|---:|---:|"]
        for setting in by_setting:
            for name in ("soft_rank", "soft_sort"):
                ratios = [
                    r["softops"] / r["torchsort"]
                    for s, r in sort_rows
                    if s == setting and r["case"] == name
                ]
                if ratios:
                    lines.append(
                        f"| {setting} | {name} | {max(ratios):.2f}x "
                        f"| {statistics.median(ratios):.2f}x |"
                    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run each thread setting in a fresh process (``--one`` is that process) and report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", default=["1", "default"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        if args.one != "default":
            torch.set_num_threads(int(args.one))
        print(json.dumps(measure(args.rounds, args.repeats)))
        return 0
    by_setting = {}
    for setting in args.threads:
        one = [sys.executable, __file__, "--one", setting]
        one += ["--rounds", str(args.rounds), "--repeats", str(args.repeats)]
        done = subprocess.run(one, check=True, capture_output=True, text=True)
        by_setting[setting] = json.loads(done.stdout.strip().splitlines()[-1])
    given = argv if argv is not None else sys.argv[1:]
    command = "python benchmarks/overhead.py " + " ".join(given)
    report = _report(by_setting, command.strip())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(by_setting, indent=1) + "\n")
    (out / "overhead.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
