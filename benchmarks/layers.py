"""TopKAttention and TopKRouter against their dense counterparts (softops.bench.layers).

    python benchmarks/layers.py            # attention S = 128, 512, 1024; router T = 1e3..6.5e4
    python benchmarks/layers.py --quick    # tiny sizes, no memory probes, layers-quick.*
    python benchmarks/layers.py --groups beam   # one beam-search step only: layers-beam.*

Writes ``layers.{jsonl,md,png}`` under ``--out`` (default ``benchmarks/results``): forward and
forward+backward medians, interleaved, as ratios to ``nn.MultiheadAttention`` and to the hard
``torch.topk`` router (see the module docstring of ``softops.bench.layers``).
"""

from __future__ import annotations

import argparse
import sys

from softops.bench.layers import GROUPS, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/layers.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, no memory probes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per case")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="attention S values")
    parser.add_argument(
        "--groups", nargs="+", default=list(GROUPS), choices=GROUPS, help="which layers"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    parser.add_argument("--out", default="benchmarks/results", help="output folder")
    args = parser.parse_args(argv)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    report, _ = run(
        quick=args.quick,
        out=args.out,
        threads=args.threads,
        device=args.device,
        repeats=args.repeats,
        sizes=args.sizes,
        groups=args.groups,
        memory=not args.no_memory,
        command=f"python benchmarks/layers.py {argv_text}".strip(),
        log=lambda line: print(line, file=sys.stderr),
    )
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
