"""Time the sorted top-k at one beam-search step against ``torch.topk``, in one process.

``softops.soft_topk(x, 2, epsilon=0.5).values`` on x of shape (64, 18) (K=2 beams of V=9 tokens
over 64 sequences), forward and forward+backward, interleaved with ``torch.topk(x, 2)`` (the
floor), median over the repeats; writes ``benchmarks/results/topk-beam.{jsonl,md,png}``. The same
configuration is the ``beam`` group of ``python -m benchmarks topk``. Usage::

    python -m benchmarks.topk_beam [--repeats 300] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.topk import run_beam_bench


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark and print its Markdown report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.topk_beam " + " ".join(argv or sys.argv[1:])
    report, _ = run_beam_bench(
        repeats=args.repeats,
        threads=args.threads,
        device=args.device,
        out=args.out,
        command=command.strip(),
    )
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
