"""Cross-entropy first, then fine-tune with the soft F1: the recipe, measured on real data.

The soft F1 (``softops.losses.f1_loss``, binary: ``1 - 2 sum(t p) / (sum(p) + sum(t))``) is a
ratio of sums over the batch, so its minibatch value is a biased estimate of the dataset's F1.
The recipe that follows from it: train with cross-entropy (CE), then fine-tune with
``f1_loss`` on large batches. This script compares, with the same model, the same total number
of epochs and the same seeds:

- (a) ``ce``: cross-entropy only;
- (b) ``ce+f1``: cross-entropy, then the last ``--finetune-frac`` of the epochs with
  ``f1_loss`` (the recipe);
- (c) ``f1``: ``f1_loss`` from scratch, all epochs;
- (d) ``ce+thr``: the model of (a), with the decision threshold tuned for F1 on the validation
  split (the classical way to trade precision for recall after training).

Arms (a)-(c) predict ``p > 0.5``; test F1 is scikit-learn's ``f1_score`` of those hard
predictions. No early stopping: every arm uses its model after the last epoch, so the
validation split serves only the threshold of (d).

**Data.** ``--dataset digits`` (default): scikit-learn's bundled 8x8 digits (1797 images, 64
pixel features), one-vs-rest with ``--positive 8`` (default) as the positive class: 174 of
1797 images (9.7 %), an imbalanced task. Digit 8 is chosen because it is the hardest digit to
separate from the rest with a linear model (5 stratified splits, scikit-learn's
LogisticRegression at C=1: test F1 0.81 for 8, 0.89 for 3, 0.92-0.99 for the others), so F1 is
far from 1 and there is room for a loss to matter. ``--dataset breast_cancer`` takes the
malignant tumours (212 of 569, 37 %) as the positive class (``--positive`` is ignored there).

Each seed draws its own stratified 60/20/20 train/validation/test split and its own
initialisation; the features are standardised with statistics of the training split. The model
is a logistic regression (``--model linear``, default) or a one-hidden-layer MLP
(``--model mlp``), trained with Adam, full batch by default (``--batch-size 0``), since the
batch bias of the soft F1 argues for large batches. The learning rate (0.05) was chosen on the
cross-entropy arm alone, so that its training loss reaches its plateau within the budget (logistic
regression, 4 seeds: train CE 0.059 after 300 epochs, 0.056 after 2000); at lr 0.01 it is still
0.137 after 300 epochs, and the F1 fine-tune then starts from under-confident probabilities
(``--lr 0.01`` shows what that does). ``--epsilon`` sets the temperature of ``f1_loss``
(``sigmoid(logit / epsilon)``; the default 1 is the soft F1 of the model's probabilities).

Run::

    python benchmarks/f1_finetune.py                       # 20 seeds, ~30 s on a 2-core CPU
    python benchmarks/f1_finetune.py --model mlp --append  # another section in the results file
    python benchmarks/f1_finetune.py --quick               # the smoke test's tiny run; no file

It prints a Markdown table and writes it, with the command and the machine, to ``--out``
(default ``benchmarks/results/f1_finetune.md``; ``--append`` adds a section instead).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.metrics import f1_score, precision_recall_curve, precision_score, recall_score
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from softops.losses import f1_loss

ARMS = ("ce", "ce+f1", "f1", "ce+thr")
ARM_LABELS = {
    "ce": "(a) cross-entropy",
    "ce+f1": "(b) cross-entropy, then f1_loss fine-tune",
    "f1": "(c) f1_loss from scratch",
    "ce+thr": "(d) cross-entropy + threshold tuned on val",
}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "f1_finetune.md"
QUICK = {"seeds": 2, "epochs": 40}


# ------------------------------------------------------------------------------------------ data


def load_task(dataset: str, positive: int) -> tuple[np.ndarray, np.ndarray, str]:
    """Features, binary labels (1 = positive class) and a description of the task."""
    if dataset == "digits":
        x, y = load_digits(return_X_y=True)
        if not 0 <= positive <= 9:
            raise ValueError(f"--positive must be a digit in 0..9; got {positive}")
        t = (y == positive).astype(np.int64)
        what = f"digits, digit {positive} vs rest"
    elif dataset == "breast_cancer":
        x, y = load_breast_cancer(return_X_y=True)
        t = (y == 0).astype(np.int64)  # sklearn codes malignant as 0; make it the positive class
        what = "breast_cancer, malignant vs benign"
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    return x.astype(np.float32), t, f"{what} ({t.sum()} of {len(t)} positive, {t.mean():.1%})"


def split(x: np.ndarray, t: np.ndarray, seed: int) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    """Stratified 60/20/20 train/val/test split, standardised with the training statistics."""
    idx = np.arange(len(t))
    train, rest = train_test_split(idx, test_size=0.4, stratify=t, random_state=seed)
    val, test = train_test_split(rest, test_size=0.5, stratify=t[rest], random_state=seed)
    scaler = StandardScaler().fit(x[train])
    return {
        name: (torch.from_numpy(scaler.transform(x[i]).astype(np.float32)), t[i])
        for name, i in (("train", train), ("val", val), ("test", test))
    }


# ------------------------------------------------------------------------------------- training


def make_model(n_features: int, kind: str, hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "linear":
        return torch.nn.Linear(n_features, 1)
    return torch.nn.Sequential(
        torch.nn.Linear(n_features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    )


def ce_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, target.float())


def make_f1_loss(epsilon: float) -> Any:
    """``f1_loss`` on ``sigmoid(logits / epsilon)``; epsilon=1 is f1_loss on the probabilities."""

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return f1_loss(logits, target, from_logits=True, epsilon=epsilon)

    return loss


def train(
    model: torch.nn.Module,
    x: torch.Tensor,
    t: torch.Tensor,
    loss_fn: Any,
    epochs: int,
    args: argparse.Namespace,
    seed: int,
) -> None:
    """``epochs`` passes over (x, t) with a fresh Adam; full batch when ``batch_size`` is 0."""
    if epochs == 0:
        return
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    n = len(t)
    bs = n if args.batch_size <= 0 else min(args.batch_size, n)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen) if bs < n else torch.arange(n)
        for start in range(0, n, bs):
            i = order[start : start + bs]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[i]).squeeze(-1), t[i]).backward()
            opt.step()


@torch.no_grad()
def predict(model: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    model.eval()
    return torch.sigmoid(model(x).squeeze(-1)).numpy()


def scores(t: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    return {
        "f1": float(f1_score(t, pred, zero_division=0)),
        "precision": float(precision_score(t, pred, zero_division=0)),
        "recall": float(recall_score(t, pred, zero_division=0)),
    }


def best_threshold(t: np.ndarray, p: np.ndarray) -> float:
    """The threshold on ``p >= thr`` that maximises F1 on (t, p) (the first of ties)."""
    precision, recall, thresholds = precision_recall_curve(t, p)
    denom = precision[:-1] + recall[:-1]
    f1 = np.where(denom > 0, 2 * precision[:-1] * recall[:-1] / np.where(denom > 0, denom, 1), 0)
    return float(thresholds[int(np.argmax(f1))])


def run_seed(x: np.ndarray, t: np.ndarray, seed: int, args: argparse.Namespace) -> dict:
    data = split(x, t, seed)
    xtr, ttr_np = data["train"]
    ttr = torch.from_numpy(ttr_np)
    xva, tva = data["val"]
    xte, tte = data["test"]
    n_ft = round(args.epochs * args.finetune_frac)
    soft_f1_loss = make_f1_loss(args.epsilon)
    out: dict[str, dict[str, float]] = {}

    # (a) cross-entropy for all epochs; (d) is the same model with a tuned threshold.
    ce = make_model(x.shape[1], args.model, args.hidden, seed)
    train(ce, xtr, ttr, ce_loss, args.epochs, args, seed)
    p_te = predict(ce, xte)
    out["ce"] = scores(tte, p_te > 0.5)
    thr = best_threshold(tva, predict(ce, xva))
    out["ce+thr"] = {**scores(tte, p_te >= thr), "threshold": thr}

    # (b) the recipe: cross-entropy, then f1_loss; same init, same data order, same budget.
    rec = make_model(x.shape[1], args.model, args.hidden, seed)
    train(rec, xtr, ttr, ce_loss, args.epochs - n_ft, args, seed)
    train(rec, xtr, ttr, soft_f1_loss, n_ft, args, seed + 1)
    out["ce+f1"] = scores(tte, predict(rec, xte) > 0.5)

    # (c) f1_loss from scratch.
    f1 = make_model(x.shape[1], args.model, args.hidden, seed)
    train(f1, xtr, ttr, soft_f1_loss, args.epochs, args, seed)
    out["f1"] = scores(tte, predict(f1, xte) > 0.5)

    # Reference: predicting "positive" for every test sample (the best constant for F1).
    out["constant"] = scores(tte, np.ones_like(tte))
    return out


# ------------------------------------------------------------------------------------- reporting


def _ms(values: Sequence[float]) -> str:
    v = np.asarray(values)
    return f"{v.mean():.3f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.3f}"


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    d = np.asarray(b) - np.asarray(a)
    return {
        "mean": float(d.mean()),
        "std": float(d.std(ddof=1)) if len(d) > 1 else 0.0,
        "better": int((d > 0).sum()),
        "equal": int((d == 0).sum()),
        "worse": int((d < 0).sum()),
        "per_seed": d.tolist(),
    }


def report(
    per_seed: list[dict], args: argparse.Namespace, task: str, seconds: float, command: str
) -> tuple[str, dict]:
    col = {
        arm: {k: [r[arm][k] for r in per_seed] for k in ("f1", "precision", "recall")}
        for arm in (*ARMS, "constant")
    }
    diffs = {
        "(b) - (a)": paired(col["ce"]["f1"], col["ce+f1"]["f1"]),
        "(c) - (a)": paired(col["ce"]["f1"], col["f1"]["f1"]),
        "(b) - (d)": paired(col["ce+thr"]["f1"], col["ce+f1"]["f1"]),
    }
    n_ft = round(args.epochs * args.finetune_frac)
    batch = "full batch" if args.batch_size <= 0 else f"batch {args.batch_size}"
    model = "logistic regression" if args.model == "linear" else f"MLP (hidden {args.hidden})"
    lines = [
        f"### {task}: {model}",
        "",
        f"{len(per_seed)} seeds (each its own stratified 60/20/20 split and init) · "
        f"{args.epochs} epochs per arm, {batch}, Adam lr {args.lr}, weight decay "
        f"{args.weight_decay} · (b) = {args.epochs - n_ft} CE + {n_ft} f1_loss epochs · "
        f"f1_loss epsilon {args.epsilon} · "
        f"no early stopping · {seconds:.0f} s",
        "",
        "| arm | test F1 (mean ± std) | precision | recall |",
        "|---|---:|---:|---:|",
    ]
    for arm in (*ARMS, "constant"):
        label = ARM_LABELS.get(arm, "constant: all positive (reference)")
        c = col[arm]
        lines.append(
            f"| {label} | {_ms(c['f1'])} | {np.mean(c['precision']):.3f} | "
            f"{np.mean(c['recall']):.3f} |"
        )
    lines += [
        "",
        "| paired test-F1 difference | mean ± std | seeds better / equal / worse |",
        "|---|---:|---:|",
    ]
    for name, d in diffs.items():
        lines.append(
            f"| {name} | {d['mean']:+.3f} ± {d['std']:.3f} | "
            f"{d['better']} / {d['equal']} / {d['worse']} |"
        )
    lines += ["", f"Command: `{command}`", ""]
    summary = {
        "task": task,
        "per_seed": per_seed,
        "f1": {arm: col[arm]["f1"] for arm in (*ARMS, "constant")},
        "mean_f1": {arm: float(np.mean(col[arm]["f1"])) for arm in (*ARMS, "constant")},
        "paired": diffs,
    }
    return "\n".join(lines), summary


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    return (
        f"torch {torch.__version__} · {platform.python_implementation()} "
        f"{platform.python_version()} · {cpu} · {os.cpu_count()} CPU(s), "
        f"{torch.get_num_threads()} torch thread(s) · "
        f"{dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}"
    )


def write(path: Path, section: str, append: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# Soft-F1 fine-tuning on real imbalanced data\n\n"
        "Written by `benchmarks/f1_finetune.py` (see its docstring for the protocol). Test F1 is "
        "scikit-learn's `f1_score` of the hard predictions `p > 0.5` (arm (d): `p >= thr`, "
        "thr tuned for F1 on the validation split); std is over seeds (ddof=1); precision and "
        "recall are means over seeds.\n\n"
    )
    if append and path.exists():
        path.write_text(path.read_text().rstrip("\n") + "\n\n" + section + "\n")
    else:
        path.write_text(header + section + "\n")


# ------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Cross-entropy, then soft-F1 fine-tuning, on a bundled imbalanced dataset.",
    )
    p.add_argument("--dataset", choices=("digits", "breast_cancer"), default="digits")
    p.add_argument("--positive", type=int, default=8, help="digits: the positive digit")
    p.add_argument("--model", choices=("linear", "mlp"), default="linear")
    p.add_argument("--hidden", type=int, default=32, help="MLP hidden units")
    p.add_argument("--seeds", type=int, default=20, help="number of seeds (0, 1, ...)")
    p.add_argument("--epochs", type=int, default=300, help="total epochs of every arm")
    p.add_argument(
        "--finetune-frac",
        type=float,
        default=0.25,
        help="fraction of the epochs that (b) spends on f1_loss",
    )
    p.add_argument(
        "--epsilon", type=float, default=1.0, help="f1_loss temperature: sigmoid(logit / epsilon)"
    )
    p.add_argument("--batch-size", type=int, default=0, help="0: full batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny run for the smoke test ({QUICK}); no file without --out",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"Markdown file to write (default {DEFAULT_OUT.name} in "
        "benchmarks/results; none with --quick)",
    )
    p.add_argument("--append", action="store_true", help="add a section to --out")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.seeds, args.epochs = QUICK["seeds"], QUICK["epochs"]
    if args.seeds < 1 or args.epochs < 1 or not 0 <= args.finetune_frac <= 1:
        raise SystemExit("need --seeds >= 1, --epochs >= 1 and 0 <= --finetune-frac <= 1")
    out = args.out if args.out is not None or args.quick else DEFAULT_OUT
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        x, t, task = load_task(args.dataset, args.positive)
        print(f"{task}; {args.seeds} seeds x {len(ARMS) - 1} trainings of {args.epochs} epochs")
        start = time.perf_counter()
        per_seed = []
        for seed in range(args.seeds):
            per_seed.append(run_seed(x, t, seed, args))
            r = per_seed[-1]
            print(
                f"  seed {seed:2d}: " + "  ".join(f"{arm} {r[arm]['f1']:.3f}" for arm in ARMS),
                flush=True,
            )
        seconds = time.perf_counter() - start
        command = shlex.join(["python", "benchmarks/f1_finetune.py", *argv])
        table, summary = report(per_seed, args, task, seconds, command)
        section = table + "\n" + machine_line() + "\n"
    finally:
        torch.set_num_threads(threads)
    print()
    print(section)
    if out is not None:
        write(out, section, args.append)
        print(f"wrote {out}")
    summary.update(markdown=section, out=out, seconds=seconds)
    return summary


if __name__ == "__main__":
    main()
