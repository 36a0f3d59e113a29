"""The ``softops`` console script.

Usage::

    softops bench topk [--quick] [--threads 1] [--device cpu] [--out DIR] [--repeats N]
                       [--sizes N [N ...]] [--batch B] [--time-budget S] [--no-memory] ...
    softops bench topk-l1 [--batch 64] [--n 1000] [--k 1 10] [--epsilons EPS ...] [--samples 100]
    softops bench sort [--quick] [--threads 1] [--device cpu] [--out DIR] [--repeats N]
                       [--sizes N [N ...]] [--batch B] [--time-budget S] [--no-memory] ...
    softops demo [--out DIR] [--threads N] [--no-bench]

``softops bench topk`` runs the top-k benchmark suite (:mod:`softops.bench.topk`), prints its
Markdown table and writes ``topk.jsonl``, ``topk.md`` and ``topk.png`` (``topk-quick.*`` with
``--quick``) under ``--out`` (default ``benchmarks/results``). ``softops demo`` shows the soft
top-k mask on a small vector, its gradient, and runs the quick top-k benchmark.
``softops bench topk-l1`` measures the L1 distance of each top-k relaxation to the hard mask
against epsilon (:mod:`softops.bench.topk_l1`), into ``topk-l1.{jsonl,md,png}``.
``softops bench sort`` runs the sort suite (:mod:`softops.bench.sort`) the same way, into
``sort.jsonl``, ``sort.md`` and ``sort.png`` (``sort-quick.*`` with ``--quick``).

rich (pretty progress and tables) and matplotlib (the plot) come with the ``bench`` extra and are
optional: without them the output is plain text and no PNG is written.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["build_parser", "main"]

DEFAULT_OUT = "benchmarks/results"
QUICK = {"sizes": (1_000, 10_000), "batch": 16, "repeats": 3, "time_budget": 3.0}
SORT_QUICK = {"sizes": (1_000, 10_000), "batch": 4, "repeats": 3, "time_budget": 2.0}


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``softops`` command."""
    parser = argparse.ArgumentParser(
        prog="softops", description="softops: differentiable top-k and sorting for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser("bench", help="run a benchmark suite")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    topk = suites.add_parser(
        "topk",
        help="soft top-k mask vs torch.topk, 200-iteration Sinkhorn and entmax",
        description="Time soft_topk_mask(method='ot') against torch.topk (the floor), the "
        "paper's 200-iteration Sinkhorn and entmax.budget_bisect, forward and forward+backward; "
        "and the memory of the sorted top-k's implicit backward against an unrolled one.",
    )
    topk.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, 3 repeats, no subprocess probes (well under a minute)",
    )
    topk.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch.set_num_threads for the run (default: 1)",
    )
    topk.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    topk.add_argument("--dtype", default="float32", help="input dtype (default: float32)")
    topk.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    topk.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="timed repeats per case (default: 10, or 3 with --quick)",
    )
    topk.add_argument(
        "--sizes",
        type=_size,
        nargs="+",
        default=None,
        metavar="N",
        help="the grid's n values (default: 1e3 1e4 1e5, or 1e3 1e4 with --quick)",
    )
    topk.add_argument(
        "--batch",
        type=_positive_int,
        default=None,
        help="the grid's B (default: 64, or 16 with --quick)",
    )
    topk.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds of timed repeats per case and configuration; a case whose "
        "single call exceeds it is skipped (default: 30, or 3 with --quick)",
    )
    topk.add_argument(
        "--no-memory",
        action="store_true",
        help="skip the peak-memory subprocesses (always off with --quick)",
    )
    topk.add_argument(
        "--no-first-call",
        action="store_true",
        help="skip the first-call (compile time) subprocesses (off with --quick)",
    )
    topk.add_argument(
        "--no-speedup", action="store_true", help="skip the B=8, n=1e4 ot-vs-sinkhorn configuration"
    )
    topk.add_argument(
        "--no-sorted", action="store_true", help="skip the sorted top-k memory configuration"
    )
    topk.add_argument(
        "--no-smooth",
        action="store_true",
        help="skip the k=1 configuration of the smooth max/argmax family",
    )
    topk.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    topk.set_defaults(func=_bench_topk)
    _add_l1_parser(suites)
    _add_sort_parser(suites)

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``softops`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return int(args.func(args))


# ----------------------------------------------------------------------------------------------
# Output helpers: rich when installed, plain text otherwise


def _logger() -> Callable[[str], None]:
    """Progress lines to stderr (styled by rich when it is installed)."""
    try:
        from rich.console import Console
    except ImportError:
        return lambda line: print(line, file=sys.stderr, flush=True)
    console = Console(stderr=True, highlight=False)
    return lambda line: console.print(line, markup=False, soft_wrap=True)


def _print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
        for row in (header, *rows):
            print("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))
        return
    table = Table(title=title, title_justify="left")
    for name in header:
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(*map(str, row))
    Console().print(table)


# ----------------------------------------------------------------------------------------------
# softops bench topk


def _check_device(device: str) -> str | None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as err:
        return (
            f"softops bench: expected a torch device such as cpu or cuda; got {device!r} ({err})."
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"softops bench: expected an available device; got {device!r}, but CUDA is not."
    return None


def _run_options(
    quick_defaults: dict[str, Any],
    quick: bool,
    device: str,
    dtype: str,
    threads: int,
    repeats: int | None,
    time_budget: float | None,
    memory: bool,
    first_call: bool,
    seed: int,
    command: str | None,
) -> Any:
    """The harness options of a bench run; ``quick`` takes ``quick_defaults`` and no probes."""
    from softops.bench import RunOptions

    options = RunOptions(
        device=device,
        dtype=dtype,
        threads=threads,
        repeats=repeats or (quick_defaults["repeats"] if quick else 10),
        time_budget_s=time_budget or (quick_defaults["time_budget"] if quick else 30.0),
        memory=memory and not quick,
        first_call=first_call and not quick,
        seed=seed,
        extra={"command": command} if command else {},
    )
    options.min_repeats = min(options.min_repeats, options.repeats)
    return options


def _run_and_write(
    suite: Any, configs: Any, options: Any, out: Any, name: str, command: str | None, log: Any
) -> tuple[str, dict[str, Any]]:
    """Run ``configs`` of ``suite``, write the JSONL/Markdown/PNG files, return the report."""
    from softops.bench import run_suite, write_results

    start = time.perf_counter()
    records = run_suite(suite, configs, options, log=log)
    paths = write_results(records, suite, out, name, command=command)
    log(
        f"done in {time.perf_counter() - start:.0f} s; wrote "
        + ", ".join(str(p) for p in paths.values())
    )
    return paths["md"].read_text(encoding="utf-8"), paths


def run_topk_bench(
    *,
    quick: bool = False,
    threads: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    out: str = DEFAULT_OUT,
    repeats: int | None = None,
    sizes: Sequence[int] | None = None,
    batch: int | None = None,
    time_budget: float | None = None,
    memory: bool = True,
    first_call: bool = True,
    speedup: bool = True,
    sorted_memory: bool = True,
    smooth: bool = True,
    seed: int = 0,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Run the top-k suite and write its files; return the Markdown report and the paths.

    ``quick`` sets the defaults of the size arguments to small values and turns the subprocess
    probes off. Arguments left at ``None`` take the defaults of the mode.
    """
    from softops.bench.topk import GRID_SIZES, SUITE, build_configs

    log = log or _logger()
    options = _run_options(
        QUICK,
        quick,
        device,
        dtype,
        threads,
        repeats,
        time_budget,
        memory,
        first_call,
        seed,
        command,
    )
    configs = build_configs(
        sizes=sizes or (QUICK["sizes"] if quick else GRID_SIZES),
        batch=batch or (QUICK["batch"] if quick else 64),
        speedup=speedup,
        sorted_memory=sorted_memory,
        smooth=smooth,
        first_call=options.first_call,
        quick=quick,
    )
    name = "topk-quick" if quick else "topk"
    return _run_and_write(SUITE, configs, options, out, name, command, log)


def _bench_topk(args: argparse.Namespace) -> int:
    error = _check_device(args.device)
    if error:
        print(error, file=sys.stderr)
        return 2
    report, _ = run_topk_bench(
        quick=args.quick,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        out=args.out,
        repeats=args.repeats,
        sizes=args.sizes,
        batch=args.batch,
        time_budget=args.time_budget,
        memory=not args.no_memory,
        first_call=not args.no_first_call,
        speedup=not args.no_speedup,
        sorted_memory=not args.no_sorted,
        smooth=not args.no_smooth,
        seed=args.seed,
        command="softops " + shlex.join(args.argv),
    )
    print(report)
    return 0


# ----------------------------------------------------------------------------------------------
# softops bench topk-l1


def _epsilon(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}")
    return value


def _add_l1_parser(suites: Any) -> None:
    from softops.bench.topk_l1 import L1_EPSILONS

    l1 = suites.add_parser(
        "topk-l1",
        help="L1 distance of each top-k relaxation to the hard mask, against epsilon",
        description="The bias of soft_topk_mask's methods (ot, 200-iteration sinkhorn, "
        "softkmax, perturbed) and, at k=1, soft_argmax_onehot: the mean L1 distance to the "
        "hard top-k mask on standard normal rows, for each epsilon.",
    )
    l1.add_argument("--batch", type=_positive_int, default=64, help="rows (default: 64)")
    l1.add_argument("--n", type=_size, default=1_000, help="row length (default: 1000)")
    l1.add_argument(
        "--k", type=_positive_int, nargs="+", default=[1, 10], help="k values (default: 1 10)"
    )
    l1.add_argument(
        "--epsilons",
        type=_epsilon,
        nargs="+",
        default=list(L1_EPSILONS),
        metavar="EPS",
        help=f"epsilon values (default: {' '.join(f'{e:g}' for e in L1_EPSILONS)})",
    )
    l1.add_argument(
        "--samples", type=_positive_int, default=100, help="perturbed draws (default: 100)"
    )
    l1.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default: 1)")
    l1.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    l1.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    l1.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    l1.set_defaults(func=_bench_l1)


def _bench_l1(args: argparse.Namespace) -> int:
    import torch

    from softops.bench.topk_l1 import l1_to_hard, write_l1

    error = _check_device(args.device)
    if error:
        print(error, file=sys.stderr)
        return 2
    if any(k > args.n for k in args.k):
        print(f"softops bench topk-l1: expected every k <= n (= {args.n}); got {args.k}.")
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        records = l1_to_hard(
            batch=args.batch,
            n=args.n,
            ks=args.k,
            epsilons=args.epsilons,
            n_samples=args.samples,
            seed=args.seed,
            device=args.device,
        )
    finally:
        torch.set_num_threads(threads)
    paths = write_l1(records, args.out, command="softops " + shlex.join(args.argv))
    _logger()("wrote " + ", ".join(str(p) for p in paths.values()))
    print(paths["md"].read_text(encoding="utf-8"))
    return 0


# ----------------------------------------------------------------------------------------------
# softops bench sort


def _add_sort_parser(suites: Any) -> None:
    sort = suites.add_parser(
        "sort",
        help="soft sort and rank vs torch.sort, torchsort, torchpsort and difftopk",
        description="Time soft_sort / soft_rank (pav, softsort, neuralsort) against torch.sort "
        "(the floor) and the installed peers (torchsort, torchpsort, difftopk), forward and "
        "forward+backward; softsort against neuralsort at n=4000; and the peak memory of "
        "softsort values+ranks at B=8, n=1e5.",
    )
    sort.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, 3 repeats, no subprocess probes (under a minute)",
    )
    sort.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch (and numba) threads for the run (default: 1)",
    )
    sort.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    sort.add_argument("--dtype", default="float32", help="input dtype (default: float32)")
    sort.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    sort.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="timed repeats per case (default: 10, or 3 with --quick)",
    )
    sort.add_argument(
        "--sizes",
        type=_size,
        nargs="+",
        default=None,
        metavar="N",
        help="the grid's n values (default: 1e3 1e4 1e5, or 1e3 1e4 with --quick)",
    )
    sort.add_argument(
        "--batch",
        type=_positive_int,
        default=None,
        help="the grid's B (default: 64, or 4 with --quick)",
    )
    sort.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds of timed repeats per case and configuration; a case whose "
        "single call exceeds it is skipped (default: 30, or 2 with --quick)",
    )
    sort.add_argument(
        "--no-memory",
        action="store_true",
        help="skip the peak-memory subprocesses (always off with --quick)",
    )
    sort.add_argument(
        "--no-vs", action="store_true", help="skip the softsort-vs-neuralsort configurations"
    )
    sort.add_argument(
        "--no-dense", action="store_true", help="skip the dense difftopk configuration"
    )
    sort.add_argument(
        "--no-memory-config",
        action="store_true",
        help="skip the B=8, n=1e5 softsort memory configuration",
    )
    sort.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    sort.set_defaults(func=_bench_sort)


def run_sort_bench(
    *,
    quick: bool = False,
    threads: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    out: str = DEFAULT_OUT,
    repeats: int | None = None,
    sizes: Sequence[int] | None = None,
    batch: int | None = None,
    time_budget: float | None = None,
    memory: bool = True,
    vs: bool = True,
    dense: bool = True,
    memory_config: bool = True,
    seed: int = 0,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Run the sort suite and write its files; return the Markdown report and the paths.

    ``quick`` sets the defaults of the size arguments to small values and turns the subprocess
    probes off. Arguments left at ``None`` take the defaults of the mode.
    """
    from softops.bench.sort import GRID_SIZES, SUITE, build_configs

    log = log or _logger()
    options = _run_options(
        SORT_QUICK,
        quick,
        device,
        dtype,
        threads,
        repeats,
        time_budget,
        memory,
        False,
        seed,
        command,
    )
    configs = build_configs(
        sizes=sizes or (SORT_QUICK["sizes"] if quick else GRID_SIZES),
        batch=batch or (SORT_QUICK["batch"] if quick else 64),
        vs=vs,
        dense=dense,
        memory=memory_config,
        quick=quick,
    )
    name = "sort-quick" if quick else "sort"
    return _run_and_write(SUITE, configs, options, out, name, command, log)


def _bench_sort(args: argparse.Namespace) -> int:
    error = _check_device(args.device)
    if error:
        print(error, file=sys.stderr)
        return 2
    report, _ = run_sort_bench(
        quick=args.quick,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        out=args.out,
        repeats=args.repeats,
        sizes=args.sizes,
        batch=args.batch,
        time_budget=args.time_budget,
        memory=not args.no_memory,
        vs=not args.no_vs,
        dense=not args.no_dense,
        memory_config=not args.no_memory_config,
        seed=args.seed,
        command="softops " + shlex.join(args.argv),
    )
    print(report)
    return 0


# ----------------------------------------------------------------------------------------------
# softops demo


def _demo(args: argparse.Namespace) -> int:
    import torch

    import softops

    x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0])
    k = 3
    print("softops demo: the soft top-k mask of x = [5, 2, 3, 4, 1, 6] with k = 3\n")
    hard = torch.zeros_like(x).scatter(-1, x.topk(k).indices, 1.0)
    epsilons = (2.0, 0.5, 0.1, 0.01)
    rows = [["hard (torch.topk)", *(f"{v:.0f}" for v in hard.tolist()), f"{hard.sum():.0f}"]]
    for eps in epsilons:
        mask = softops.soft_topk_mask(x, k, epsilon=eps)
        rows.append([f"epsilon={eps:g}", *(f"{v:.3f}" for v in mask.tolist()), f"{mask.sum():.3f}"])
    header = ["", *(f"x={v:g}" for v in x.tolist()), "sum"]
    _print_table("soft_topk_mask(x, 3, epsilon=...)", header, rows)

    eps = 0.5
    xg = x.clone().requires_grad_(True)
    mask = softops.soft_topk_mask(xg, k, epsilon=eps)
    loss = mask[1:4].sum()  # the soft count of x[1], x[2], x[3] in the top 3
    (grad,) = torch.autograd.grad(loss, xg)
    print(
        f"\nGradient of soft_topk_mask(x, 3, epsilon={eps})[1:4].sum() with respect to x "
        "(the hard mask has none):"
    )
    print("  " + "  ".join(f"{v:+.4f}" for v in grad.tolist()))
    print(
        "  Raising x[1..3] raises the loss, raising the other entries lowers it, and the entries "
        "sum to 0 because the mask always sums to k.\n"
    )
    if args.no_bench:
        return 0
    out = args.out or tempfile.mkdtemp(prefix="softops-demo-")
    print(f"Running the quick top-k benchmark ({args.threads} thread(s); files in {out}) ...\n")
    report, _ = run_topk_bench(
        quick=True, threads=args.threads, out=out, command="softops bench topk --quick"
    )
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
