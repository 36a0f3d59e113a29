"""The default epsilon of the ranking losses, chosen on scikit-learn's bundled data framed as lists.

**The datasets** (bundled with scikit-learn, read offline), each framed as lists of ``LIST``
entries drawn at random from one split (70 % of the rows train, 30 % test, per seed):

- ``diabetes`` (442 patients, 10 features): graded relevance, the disease-progression target
  binned into 5 grades (0-4) at the training split's quintiles;
- ``breast_cancer`` (569 tumours, 30 features): binary relevance, 1 for malignant;
- ``digits`` (1797 images, 64 pixels), query-dependent: each list has a query class c drawn at
  random, relevance 1 for the images of c, and the model scores an image for the query
  (``W[c] . h(x)``, one read-out per class): retrieval.

**The model**: an MLP (features -> 32 -> one score per list entry, or per class for digits),
features standardised on the training split, Adam (learning rate 1e-2), ``STEPS`` steps of
``BATCH`` lists.

**The arms**: ``spearman_loss`` and ``ndcg_loss`` with the relative epsilon
``c * std(row) / n`` (the form of the default, c in {0.3, 1, 3, 10}) and fixed epsilons
{0.1, 1.0}; a pointwise ``mse`` on the relevance is the reference.

**The measure**: held-out NDCG@10 (``sklearn.metrics.ndcg_score``) and Spearman's rho
(``scipy.stats.spearmanr``, ties averaged; lists with constant relevance are skipped), each the
mean over ``TEST_LISTS`` held-out lists, then the mean over seeds. Each epsilon's rank among
the six, averaged over the (dataset, measure) cells of each loss, is reported with the best
relative c; the docs' "Choosing epsilon" page weighs it with ``spearman_epsilon.py``'s synthetic
ranker (rows of 10 to 1000) to choose the default.

Run::

    python benchmarks/ranking_epsilon.py            # 5 seeds: about a minute on one thread
    python benchmarks/ranking_epsilon.py --quick    # the smoke test: seconds, no files

It writes ``ranking_epsilon.{md,json}`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from softops import losses

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = ("diabetes", "breast_cancer", "digits")
LOSSES = ("spearman", "ndcg")
EPSILONS = ("c=0.3", "c=1", "c=3", "c=10", "fixed 0.1", "fixed 1.0")
LIST, BATCH, STEPS, TEST_LISTS = 20, 32, 300, 400


class Data:
    """One dataset's splits for one seed: standardised features, relevance, (query classes)."""

    def __init__(self, name: str, seed: int) -> None:
        from sklearn import datasets

        loader = {
            "diabetes": datasets.load_diabetes,
            "breast_cancer": datasets.load_breast_cancer,
            "digits": datasets.load_digits,
        }[name]
        bunch = loader()
        x = torch.tensor(bunch.data, dtype=torch.float32)
        y = torch.tensor(bunch.target, dtype=torch.float32)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(x), generator=g)
        cut = int(0.7 * len(x))
        tr, te = perm[:cut], perm[cut:]
        mean, std = x[tr].mean(0), x[tr].std(0).clamp(min=1e-6)
        x = (x - mean) / std
        if name == "diabetes":
            edges = torch.quantile(y[tr], torch.tensor([0.2, 0.4, 0.6, 0.8]))
            y = torch.bucketize(y, edges).float()
        elif name == "breast_cancer":
            y = 1.0 - y  # scikit-learn's target is 1 for benign
        self.name, self.x, self.y = name, x, y
        self.split = {"train": tr, "test": te}
        self.classes = 10 if name == "digits" else 0

    def lists(self, split: str, count: int, g: torch.Generator):
        """(features (count, LIST, d), relevance (count, LIST), query class (count,) or None)."""
        rows = self.split[split]
        pick = rows[torch.randint(0, len(rows), (count, LIST), generator=g)]
        feats, target = self.x[pick], self.y[pick]
        if not self.classes:
            return feats, target, None
        query = torch.randint(0, self.classes, (count,), generator=g)
        return feats, (target == query[:, None].float()).float(), query


class Scorer(nn.Module):
    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 32), nn.ReLU())
        self.out = nn.Linear(32, max(classes, 1))

    def forward(self, feats: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        s = self.out(self.body(feats))  # (B, LIST, classes or 1)
        if query is None:
            return s[..., 0]
        return s.gather(-1, query[:, None, None].expand(-1, s.shape[1], 1))[..., 0]


def epsilon_of(arm: str, scores: torch.Tensor) -> float | torch.Tensor:
    if arm.startswith("fixed"):
        return float(arm.split()[1])
    c = float(arm[2:])
    eps = c * scores.std(-1, correction=0) / scores.shape[-1]
    # a constant row (a dead scorer) gets 1, as the losses' own default does
    return torch.where(torch.isfinite(eps) & (eps > 0), eps, torch.ones_like(eps))


def train(
    data: Data, loss: str, arm: str, seed: int, steps: int, test_lists: int = TEST_LISTS
) -> dict[str, float]:
    from scipy.stats import spearmanr
    from sklearn.metrics import ndcg_score

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model = Scorer(data.x.shape[1], data.classes)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        feats, rel, query = data.lists("train", BATCH, g)
        s = model(feats, query)
        if arm == "mse":
            value = ((s - rel) ** 2).mean()
        elif loss == "spearman":
            value = losses.spearman_loss(s, rel, epsilon=epsilon_of(arm, s))
        else:
            value = losses.ndcg_loss(s, rel, epsilon=epsilon_of(arm, s))
        opt.zero_grad()
        value.backward()
        opt.step()
    with torch.no_grad():
        feats, rel, query = data.lists("test", test_lists, torch.Generator().manual_seed(99))
        s = model(feats, query)
    keep = rel.std(-1) > 0
    s, rel = s[keep].numpy(), rel[keep].numpy()
    # a constant prediction (a dead scorer) ranks nothing: rho 0, as the loss defines it
    rho = statistics.fmean(
        float(spearmanr(a, b).statistic) if a.max() > a.min() else 0.0
        for a, b in zip(s, rel, strict=True)
    )
    return {"ndcg@10": float(ndcg_score(rel, s, k=10)), "spearman": rho}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a smoke test: seconds, no files")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds, steps, test_lists = (1, 5, 20) if args.quick else (args.seeds, STEPS, TEST_LISTS)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    epsilons = ("c=3", "fixed 1.0") if args.quick else EPSILONS
    arms = ("mse", *epsilons)
    results: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {}
    for name in DATASETS:
        results[name] = {}
        for seed in range(seeds):
            data = Data(name, seed)
            for loss in LOSSES:
                for arm in arms:
                    if arm == "mse" and loss != LOSSES[0]:
                        continue
                    key = "mse" if arm == "mse" else f"{loss} {arm}"
                    run = train(data, loss, arm, seed, steps, test_lists)
                    results[name].setdefault(key, []).append(run)
    # each (dataset, loss, measure): rank the epsilon arms (1 = best) by their mean over seeds
    ranks: dict[str, dict[str, list[float]]] = {loss: {a: [] for a in epsilons} for loss in LOSSES}
    for name in DATASETS:
        for loss in LOSSES:
            for measure in ("ndcg@10", "spearman"):
                means = {
                    arm: statistics.fmean(r[measure] for r in results[name][f"{loss} {arm}"])
                    for arm in epsilons
                }
                for i, arm in enumerate(sorted(epsilons, key=lambda a: -means[a])):
                    ranks[loss][arm].append(i + 1)
    mean_rank = {
        loss: {arm: statistics.fmean(v) for arm, v in by_arm.items()}
        for loss, by_arm in ranks.items()
    }
    best = {
        loss: min((a for a in epsilons if a.startswith("c=")), key=lambda a: mean_rank[loss][a])
        for loss in LOSSES
    }
    command = "python benchmarks/ranking_epsilon.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    lines = [
        "# The ranking losses' epsilon on scikit-learn's bundled data, framed as lists",
        "",
        f"`{command.strip()}`: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch "
        f"{torch.__version__}, one thread, {seeds} seeds, {steps} steps of {BATCH} lists of "
        f"{LIST}, {time.perf_counter() - t0:.0f} s; 1-min load average {load0:.2f} at the "
        "start. Held-out NDCG@10 / Spearman's rho, the mean over seeds (min-max); c: the "
        "relative epsilon c * std(row) / n (the default's form; the default is c = 3).",
        "",
    ]
    for name in DATASETS:
        lines += [f"## {name}", "", "| arm | NDCG@10 | Spearman |", "|---|---|---|"]
        for key, runs in results[name].items():
            cells = []
            for measure in ("ndcg@10", "spearman"):
                vals = [r[measure] for r in runs]
                cells.append(f"{statistics.fmean(vals):.4f} ({min(vals):.4f}-{max(vals):.4f})")
            lines.append(f"| {key} | {cells[0]} | {cells[1]} |")
        lines.append("")
    lines += [
        "## Mean rank of each epsilon",
        "",
        "Per loss, over its 6 (dataset, measure) cells, each epsilon's rank among the others "
        "(1 = best mean over seeds):",
        "",
        "| epsilon | " + " | ".join(f"{loss}_loss" for loss in LOSSES) + " |",
        "|---|" + "---:|" * len(LOSSES),
        *(
            f"| {arm} | " + " | ".join(f"{mean_rank[loss][arm]:.2f}" for loss in LOSSES) + " |"
            for arm in epsilons
        ),
        "",
        "Best relative setting: "
        + ", ".join(f"**{best[loss]}** for {loss}_loss" for loss in LOSSES)
        + ".",
        "",
    ]
    print("\n".join(lines))
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {
            "command": command.strip(),
            "torch": torch.__version__,
            "seeds": seeds,
            "steps": steps,
            "results": results,
            "mean_rank": mean_rank,
            "best": best,
        }
        (args.out / "ranking_epsilon.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / "ranking_epsilon.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
