"""How far the soft ranking losses sit from the hard metrics at their default epsilon.

    python benchmarks/soft_vs_hard.py        # prints a Markdown table (seconds, 1 thread)

The figures quoted in the docstrings of ``softops.losses.spearman_loss``, ``ndcg_loss`` and
``topk_accuracy_loss``.
The distribution: 2000 rows of n scores x ~ N(0, 1), and a target y = x + N(0, 1) noise (a
Spearman correlation near 0.68); for NDCG the relevance is y cut into the grades 0..4 at its
row's 50/70/85/95 % quantiles. Reported over the rows: the mean and the 99th percentile of
|soft loss - (1 - hard metric)|, and the mean of the signed difference, with the hard
metrics of ``softops.metrics`` (equal to scipy's ``spearmanr`` and scikit-learn's
``ndcg_score``). For ``topk_accuracy_loss``: 2000 samples of C scores N(0, 1) with a uniform
label, against ``1 - (label in scores.topk(k).indices)``.
"""

from __future__ import annotations

import sys

import torch

from softops.losses import ndcg_loss, spearman_loss, topk_accuracy_loss
from softops.metrics import ndcg, spearman

ROWS = 2000


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, n, generator=g, dtype=torch.float64)
    y = x + torch.randn(ROWS, n, generator=g, dtype=torch.float64)
    cuts = torch.quantile(y, torch.tensor([0.5, 0.7, 0.85, 0.95], dtype=y.dtype), dim=-1).T
    grades = (y[:, :, None] > cuts[:, None, :]).sum(-1).to(y.dtype)
    return x, y, grades


def _gap(soft: torch.Tensor, hard: torch.Tensor) -> str:
    d = soft - hard
    a = d.abs()
    return f"{float(a.mean()):.4f} | {float(a.quantile(0.99)):.4f} | {float(d.mean()):+.4f}"


def main() -> int:
    torch.set_num_threads(1)
    lines = [
        "| loss | n | mean gap | 99th pct gap | mean signed gap | mean hard value |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for n in (10, 30, 100, 1000):
        x, y, grades = _data(n, seed=n)
        hard = 1 - spearman(x, y)
        soft = spearman_loss(x, y, reduction="none")
        gap = _gap(soft, hard)
        lines.append(f"| spearman_loss | {n} | {gap} | {float(hard.mean()):.3f} |")
        for k in (None, 10):
            if k is not None and k >= n:
                continue
            hard = 1 - ndcg(x, grades, k=k)
            soft = ndcg_loss(x, grades, k=k, reduction="none")
            gap = _gap(soft, hard)
            name = "ndcg_loss" if k is None else f"ndcg_loss, k={k}"
            lines.append(f"| {name} | {n} | {gap} | {float(hard.mean()):.3f} |")
    lines += [
        "",
        "| loss | C | k | mean gap | 99th pct gap | mean signed gap |",
        "|---|" + "---:|" * 5,
    ]
    g = torch.Generator().manual_seed(0)
    for C in (10, 100, 1000):
        for k in (1, 5):
            scores = torch.randn(ROWS, C, generator=g, dtype=torch.float64)
            label = torch.randint(0, C, (ROWS,), generator=g)
            soft = topk_accuracy_loss(scores, label, k, reduction="none")
            hard = 1 - (scores.topk(k, -1).indices == label[:, None]).any(-1).to(soft.dtype)
            lines.append(f"| topk_accuracy_loss | {C} | {k} | {_gap(soft, hard)} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
