"""The differentiable kNN's measured runs on MNIST, into benchmarks/results/knn-*.

Three commands, each one run of this script (1 torch thread unless ``--threads``):

    python benchmarks/knn.py timing                     # s/step and s/evaluation: ~2 min
    python benchmarks/knn.py train --minutes 10         # SOFT top-k, seeds 0 1 2: ~40 min
    python benchmarks/knn.py train --minutes 30         # the same for 30 minutes: ~100 min
    python benchmarks/knn.py all --minutes 10           # the Table 1 rows, seeds 0 1 2: ~2.5 h

``timing`` measures, for each training method, the median seconds per training step (100
queries + 100 candidates through the ConvNet, the loss, the backward pass and Adam) and the
seconds of one full evaluation (embedding the 50k training and 10k test images, and the hard
kNN of the 10k against the 50k), and writes ``knn-timing.{json,md}``. ``train`` and ``all`` are
``softops knn --dataset mnist`` with ``--out benchmarks/results`` (``--method soft`` or
``--all``), so they write ``knn-mnist-<soft|all>-<budget>.{json,md}`` and the two plots. Other
arguments go through to ``softops knn`` (for example ``--seed 0``, ``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from softops.apps.data import load_dataset
from softops.apps.train import KNNConfig, measure_step
from softops.cli import main as cli_main

RESULTS = Path(__file__).resolve().parent / "results"
TIMED = ("soft", "sinkhorn", "perturbed", "softkmax", "neuralsort", "ce")


def timing(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/knn.py timing")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per method")
    parser.add_argument("--methods", nargs="+", default=list(TIMED), choices=TIMED)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_dataset("mnist")
    load_before = os.getloadavg()[0]
    rows = []
    for method in args.methods:
        config = KNNConfig(dataset="mnist", method=method, device=args.device)
        measured = measure_step(config, data, steps=args.steps)
        rows.append({"method": method, **measured})
        step_s, step_min = measured["step_seconds"], measured["step_seconds_min"]
        print(
            f"{method:>10}: {step_s:.4f} s/step (min {step_min:.4f}), full evaluation "
            f"{measured['eval_seconds']:.1f} s",
            file=sys.stderr,
        )
    load_after = os.getloadavg()[0]
    command = "python benchmarks/knn.py timing " + " ".join(argv)
    lines = [
        "## softops knn on MNIST: time per training step and per full evaluation",
        "",
        f"ConvNet (500-d embedding), 100 queries + 100 candidates per step, k = 9, epsilon = 1; "
        f"{args.threads} torch thread(s), device {args.device}, torch {torch.__version__}. A step "
        "is the sampling, a random shift, the forward and backward passes and Adam (median of "
        f"{args.steps}, after 5 warm-up steps); the evaluation embeds the 50 000 training and "
        "10 000 test images and classifies the test images by the hard 9-NN. The machine's "
        f"1-minute load average was {load_before:.1f} before and {load_after:.1f} after (on a "
        "shared machine, a load above the core count slows every row alike).",
        "",
        "| method | s/step (median) | s/step (min) | full evaluation (s) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['step_seconds']:.4f} | {r['step_seconds_min']:.4f} | "
            f"{r['eval_seconds']:.1f} |"
        )
    lines += ["", "Targets: <= 0.07 s per step, <= 30 s per full evaluation.", ""]
    lines += [f"Reproduce with `{command.strip()}`.", ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": command.strip(),
        "threads": args.threads,
        "device": args.device,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": [load_before, load_after],
        "rows": rows,
    }
    (out / "knn-timing.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "knn-timing.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("timing", "train", "all"):
        print(__doc__)
        return 2
    mode, rest = argv[0], argv[1:]
    if mode == "timing":
        return timing(rest)
    base = ["knn", "--dataset", "mnist", "--out", os.path.relpath(RESULTS)]
    if "--seed" not in rest:
        base += ["--seed", "0", "1", "2"]
    base += ["--all"] if mode == "all" else ["--method", "soft"]
    return cli_main(base + rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
