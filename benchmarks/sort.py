"""Run the sort benchmark suite; a thin wrapper of ``softops bench sort``.

The harness lives in the installed package (:mod:`softops.bench`), so this script and the console
script run the same code. Arguments are those of ``softops bench sort --help``; for example::

    python benchmarks/sort.py                # the full suite, 1 thread, into benchmarks/results/
    python benchmarks/sort.py --sizes 1000 10000 --no-memory  # the short run committed there
    python benchmarks/sort.py --threads 2    # torch's default thread count on a 2-core machine
    python benchmarks/sort.py --quick        # small sizes, under a minute
    python benchmarks/sort.py --device cuda  # the same suite on a GPU

Outside ``--quick`` the suite also times the small per-call configurations (B <= 64, n <= 1000:
the fixed costs of a call) of pav against torchsort, side by side in microseconds.

The peers (torchsort, torchpsort, diffsort, difftopk) are optional: ``scripts/install_peers.sh``.
"""

from __future__ import annotations

import sys

from softops.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sort", *sys.argv[1:]]))
