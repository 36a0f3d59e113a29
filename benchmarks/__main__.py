"""``python -m benchmarks``: the command line of the benchmark suites.

Usage (from the repository root)::

    python -m benchmarks --suite topk|sort|smooth|layers|all [--quick] [--threads 1 [default]]
                         [--device cpu] [--out DIR] [--repeats N] [--sizes N [N ...]]
                         [--no-quality] [--timeout S] [--memory-limit MB] [--isolate] ...
    python -m benchmarks topk|sort [--quick] [--threads 1] [--device cpu] [--out DIR]
                         [--repeats N] [--sizes N [N ...]] [--batch B] [--time-budget S] ...
    python -m benchmarks smooth|layers [the options of --suite] (layers: [--groups G ...])
    python -m benchmarks topk-l1 [--batch 64] [--n 1000] [--k 1 10] [--epsilons EPS ...]

``--suite NAME`` runs a suite (:mod:`benchmarks.suites`: topk, sort, smooth, layers, or all
four), prints its Markdown tables and writes ``NAME.jsonl``, ``NAME.md`` and ``NAME.png``
(``NAME-quick.*`` with ``--quick``) under ``--out`` (default ``benchmarks/results``), then its
quality sweep (:mod:`benchmarks.quality`) into ``NAME-quality.*``. ``--threads`` takes one or more
settings, a count or ``default`` (out of the box: the harness sets no thread count);
``--suite all`` runs ``1 default``. The sub-commands ``topk``, ``sort``, ``smooth`` and ``layers``
are the same as ``--suite NAME``, with the suites' own switches; ``topk-l1`` measures the L1
distance of each top-k relaxation to the hard mask against epsilon
(:mod:`benchmarks.topk_l1`). rich (progress and tables) and matplotlib (the plots) come with the
``bench`` extra and are optional.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import sort as sort_suite
from benchmarks import topk as topk_suite
from benchmarks.harness import DEFAULT_OUT, FULL_REPEATS, FULL_TIME_BUDGET_S, QuickDefaults
from benchmarks.layers import GROUPS as LAYER_GROUPS
from benchmarks.layers import run as run_layers_bench
from benchmarks.model import parse_threads
from benchmarks.report import make_logger
from benchmarks.smooth import run_smooth_bench
from benchmarks.sort import SORT_QUICK, run_sort_bench
from benchmarks.suites import SUITES, expand, run_suite_quality
from benchmarks.topk import QUICK, run_topk_bench
from benchmarks.topk_l1 import L1_EPSILONS, run_l1_bench

__all__ = ["build_parser", "main"]

PROG = "python -m benchmarks"


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


@dataclass(frozen=True)
class _RunDefaults:
    """What the options of a timed suite (``topk``, ``sort``) default to."""

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

    ``defaults=None`` is ``--suite`` (and ``smooth``, ``layers``): each suite takes its own
    defaults.
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
    """The argument parser of ``python -m benchmarks``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        # No abbreviations: the sub-commands' options (topk-l1's --n) must not be read as
        # prefixes of this parser's own (--no-memory, ...).
        allow_abbrev=False,
        description="Run benchmark suites: --suite topk|sort|smooth|layers|all (timings, "
        "memory, and each suite's quality sweep), or one of the sub-commands below (the same as "
        "--suite NAME, with the suites' own switches; options go after the sub-command).",
    )
    parser.add_argument(
        "--suite",
        choices=(*SUITES, "all"),
        default=None,
        help="the suite to run, or all four (topk, sort, smooth, layers)",
    )
    _add_run_options(parser, None)
    parser.set_defaults(func=_bench_suites)
    suites = parser.add_subparsers(dest="suite_command", required=False, metavar="SUITE")
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
    smooth = suites.add_parser(
        "smooth",
        help="smooth max/argmax/kmax vs torch.amax and the torch expressions they equal",
        description="The same as --suite smooth: smooth_max/min, soft_argmax/argmin, "
        "soft_argmax_onehot and soft_kmax against the hard maximum (the floor) and the plain "
        "torch expressions (logsumexp, softmax), forward and forward+backward, and their "
        "quality sweep.",
    )
    _add_run_options(smooth, None)
    smooth.set_defaults(func=_bench_named)
    layers = suites.add_parser(
        "layers",
        help="TopKAttention and TopKRouter vs their dense counterparts",
        description="The same as --suite layers: TopKAttention against nn.MultiheadAttention, "
        "TopKRouter against the hard torch.topk router, and one beam-search step.",
    )
    _add_run_options(layers, None)
    layers.add_argument(
        "--groups",
        nargs="+",
        choices=LAYER_GROUPS,
        default=None,
        help=f"which layers, among {', '.join(LAYER_GROUPS)} (default: all)",
    )
    layers.set_defaults(func=_bench_named)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m benchmarks ARGV``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    error = _check_device(args.device)
    if args.suite and args.suite_command:
        error = (
            f"{PROG}: expected --suite or a sub-command, not both; got --suite "
            f"{args.suite} and {args.suite_command}."
        )
    if error:
        print(error, file=sys.stderr)
        return 2
    return int(args.func(args))


def _check_device(device: str) -> str | None:
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        return f"{PROG}: expected a torch device such as cpu or cuda; got {device!r} ({err})."
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"{PROG}: expected an available device; got {device!r}, but CUDA is not."
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
        "command": f"{PROG} {shlex.join(args.argv)}",
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
            f"{PROG}: expected --suite NAME (topk, sort, smooth, layers or all) or a "
            "sub-command (topk, sort, smooth, layers, topk-l1); see {PROG} --help.",
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
        print(f"{PROG} topk-l1: expected every k <= n (= {args.n}); got {args.k}.", file=sys.stderr)
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
        command=f"{PROG} {shlex.join(args.argv)}",
    )
    print(report)
    return 0


def _bench_named(args: argparse.Namespace) -> int:
    """``smooth`` and ``layers``: the same as ``--suite smooth`` / ``--suite layers``."""
    groups = getattr(args, "groups", None)
    switches = {"groups": groups} if groups is not None else {}
    print(_run_named(args, args.suite_command, False, **switches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
