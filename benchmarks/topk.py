"""Run the top-k benchmark suite; a thin wrapper of ``softops bench topk``.

The harness lives in the installed package (:mod:`softops.bench`), so this script and the console
script run the same code. Arguments are those of ``softops bench topk --help``; for example::

    python benchmarks/topk.py                # the full grid, 1 thread, into benchmarks/results/
    python benchmarks/topk.py --quick        # small sizes, a few seconds
    python benchmarks/topk.py --device cuda  # the same suite on a GPU
"""

from __future__ import annotations

import sys

from softops.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "topk", *sys.argv[1:]]))
