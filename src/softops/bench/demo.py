r"""``softops demo``: the soft top-k mask on a small vector, its gradient, and the quick benchmark.

The mask relaxes :math:`\mathbb{1}[x_i \in \mathrm{topk}(x, k)]`; the demo prints it for a few
epsilons next to the hard mask (every row sums to k), then the gradient of
:math:`\sum_{i=1}^{3} A_i(x)`, which the hard mask does not have, and, unless told not to, runs
``softops bench topk --quick`` (:func:`softops.bench.topk.run_topk_bench`).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

import softops
from softops.bench.report import print_table
from softops.bench.topk import run_topk_bench

__all__ = ["run_demo"]


def _say(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def run_demo(
    *, out: str | os.PathLike[str] | None = None, threads: int = 1, bench: bool = True
) -> int:
    """Print the demo to stdout; return the exit status (0).

    Args:
        out: where the quick benchmark's files go (a temporary folder when ``None``).
        threads: torch threads for the benchmark.
        bench: run the quick benchmark after the mask and its gradient.
    """
    x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0])
    k = 3
    _say("softops demo: the soft top-k mask of x = [5, 2, 3, 4, 1, 6] with k = 3\n")
    hard = torch.zeros_like(x).scatter(-1, x.topk(k).indices, 1.0)
    rows = [["hard (torch.topk)", *(f"{v:.0f}" for v in hard.tolist()), f"{hard.sum():.0f}"]]
    for eps in (2.0, 0.5, 0.1, 0.01):
        mask = softops.soft_topk_mask(x, k, epsilon=eps)
        rows.append([f"epsilon={eps:g}", *(f"{v:.3f}" for v in mask.tolist()), f"{mask.sum():.3f}"])
    header = ["", *(f"x={v:g}" for v in x.tolist()), "sum"]
    print_table("soft_topk_mask(x, 3, epsilon=...)", header, rows)

    eps = 0.5
    xg = x.clone().requires_grad_(True)
    mask = softops.soft_topk_mask(xg, k, epsilon=eps)
    loss = mask[1:4].sum()  # the soft count of x[1], x[2], x[3] in the top 3
    (grad,) = torch.autograd.grad(loss, xg)
    _say(
        f"\nGradient of soft_topk_mask(x, 3, epsilon={eps})[1:4].sum() with respect to x "
        "(the hard mask has none):"
    )
    _say("  " + "  ".join(f"{v:+.4f}" for v in grad.tolist()))
    _say(
        "  Raising x[1..3] raises the loss, raising the other entries lowers it, and the entries "
        "sum to 0 because the mask always sums to k.\n"
    )
    if not bench:
        return 0
    folder = out or tempfile.mkdtemp(prefix="softops-demo-")
    _say(f"Running the quick top-k benchmark ({threads} thread(s); files in {folder}) ...\n")
    report, _ = run_topk_bench(
        quick=True, threads=threads, out=str(folder), command="softops bench topk --quick"
    )
    _say(report)
    return 0
