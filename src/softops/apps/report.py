"""Running ``softops knn`` end to end: the runs, the progress bar, the tables and the plots.

:func:`knn_main` is the ``softops knn`` command once its arguments are parsed. :func:`run_knn`
trains each method for each seed on one budget and writes ``<stem>.json`` (configuration,
machine, runs), ``<stem>.md`` (the table), ``<stem>-curves.png`` and ``<stem>-embedding.png``,
``stem = knn-<dataset>-<method or "all">-<budget>``. Without rich (or a terminal) progress is a
plain line every few seconds; without matplotlib, no PNG.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from softops.apps.data import ImageDataset, load_dataset
from softops.apps.train import ALL_ROWS, KNNConfig, Progress, RunResult, check_device, train_rows

__all__ = ["LABELS", "PAPER_MNIST", "knn_main", "markdown_table", "run_knn"]

#: Xie et al. 2020, Table 1 (MNIST test accuracy, %); NeuralSort's own paper for "neuralsort".
PAPER_MNIST = {"pretrained": 98.4, "ce": 99.0, "softkmax": 99.3, "neuralsort": 99.5, "soft": 99.4}
#: How each method's row is named in the tables.
LABELS = {
    "pretrained": "kNN + pretrained CNN (CE features)",
    "ce": "CE + CNN",
    "softkmax": "kNN + softmax k times (softkmax)",
    "neuralsort": "kNN + NeuralSort",
    "soft": "kNN + SOFT top-k (ot)",
    "sinkhorn": "kNN + SOFT top-k (sinkhorn)",
    "perturbed": "kNN + perturbed top-k",
}


def _is_mnist(dataset: str) -> bool:
    return dataset in ("mnist", "mnist-idx")


def _plan(methods: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(objective method, rows) pairs: "ce" and "pretrained" share one CE training."""
    ce_rows = tuple(m for m in methods if m in ("ce", "pretrained"))
    # the CE training where its first row stands
    first_ce = methods.index(ce_rows[0]) if ce_rows else -1
    return [
        (ce_rows[0], ce_rows) if i == first_ce else (m, (m,))
        for i, m in enumerate(methods)
        if m not in ce_rows or i == first_ce
    ]


def markdown_table(
    config: KNNConfig,
    results: Sequence[RunResult],
    methods: Sequence[str],
    *,
    command: str | None = None,
    threads: int | None = None,
) -> str:
    """The Markdown report of a set of runs: one row per method, seeds side by side."""
    seeds = sorted({r.seed for r in results})
    budget = (
        f"{config.minutes:g} min of training"
        if config.minutes is not None
        else f"{config.epochs:g} epochs"
    )
    paper = _is_mnist(config.dataset)
    threads_text = f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""
    lines = [
        f"## softops knn: {config.dataset}, {budget} per method",
        "",
        f"k = {config.k}, epsilon = {config.epsilon:g} (squared-distance units), "
        f"{config.queries} queries + {config.candidates} candidates per step, Adam "
        f"{config.lr:g} with cosine decay, shifts of up to {config.resolved_shift()} px, "
        f"device {config.device}{threads_text}; the test accuracy is that of the checkpoint "
        f"with the best validation accuracy (seeds {', '.join(map(str, seeds))}).",
        "",
    ]
    seed_head = "test % (seed " + ", ".join(map(str, seeds)) + ")"
    head = ["method"]
    if paper:
        head.append("paper (MNIST)")
    head += [seed_head, "mean test %", "best val %", "steps", "s/step", "test eval (s)"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for m in methods:
        runs = sorted((r for r in results if r.method == m), key=lambda r: r.seed)
        if not runs:
            continue
        tests = [r.test for r in runs]
        row = [LABELS.get(m, m)]
        if paper:
            row.append(f"{PAPER_MNIST[m]:.1f}" if m in PAPER_MNIST else "—")
        row += [
            ", ".join(f"{t:.2f}" for t in tests),
            f"{sum(tests) / len(tests):.2f}",
            ", ".join(f"{r.best_val:.2f}" for r in runs),
            ", ".join(str(r.steps) for r in runs),
            f"{sum(r.step_seconds for r in runs) / len(runs):.3f}",
            f"{sum(r.eval_seconds for r in runs) / len(runs):.1f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    if paper:
        lines += [
            "",
            "The paper's numbers (Xie et al. 2020, Table 1; NeuralSort's from Grover et al. 2019) "
            "come from longer GPU training; the rows here share one wall-clock budget on this "
            "machine.",
        ]
    if command:
        lines += ["", f"Reproduce with `{command}`."]
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _mean_band(
    runs: Sequence[RunResult], key: str, grid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, min and max over seeds of ``key`` on ``grid``, each run interpolated in its span."""
    rows = []
    for r in runs:
        xs = torch.tensor([p["seconds"] for p in r.curve], dtype=torch.float64)
        ys = torch.tensor([p[key] for p in r.curve], dtype=torch.float64)
        ys_at = torch.full_like(grid, float("nan"))
        inside = (grid >= xs[0]) & (grid <= xs[-1])
        if len(xs) == 1:
            ys_at[inside] = ys[0]
        else:
            j = torch.searchsorted(xs, grid[inside]).clamp(1, len(xs) - 1)
            x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
            w = ((grid[inside] - x0) / (x1 - x0).clamp(min=1e-12)).clamp(0, 1)
            ys_at[inside] = y0 + w * (y1 - y0)
        rows.append(ys_at)
    stack = torch.stack(rows)
    seen = ~stack.isnan()
    low = torch.where(seen, stack, torch.inf).amin(0).masked_fill(~seen.any(0), float("nan"))
    high = torch.where(seen, stack, -torch.inf).amax(0).masked_fill(~seen.any(0), float("nan"))
    return stack.nanmean(0), low, high


def _plot_curves(path: Path, results: Sequence[RunResult], methods: Sequence[str]) -> bool:
    """Validation accuracy and training loss against training time, one colour per method: one
    seed as its line; several as thin lines, with their mean and min-max band where all reach."""
    plt = _pyplot()
    if plt is None:
        return False
    runs_of = {m: [r for r in results if r.method == m and r.curve] for m in methods}
    runs_of = {m: sorted(rs, key=lambda r: r.seed) for m, rs in runs_of.items() if rs}
    if not runs_of:
        return False
    for rs in runs_of.values():
        for r in rs:
            r.curve.sort(key=lambda p: p["seconds"])
    longest = max(p["seconds"] for rs in runs_of.values() for r in rs for p in r.curve)
    unit, scale = ("s", 1.0) if longest < 120 else ("min", 60.0)
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    colors = plt.get_cmap("tab10")
    for i, (m, rs) in enumerate(runs_of.items()):
        color = colors(i % 10)
        seeds = len(rs)
        label = LABELS.get(m, m) + (f" ({seeds} seeds: mean, min-max)" if seeds > 1 else "")
        one = {"marker": "o", "ms": 3, "label": label}  # one seed: its line, labelled
        style = one if seeds == 1 else {"alpha": 0.35, "lw": 0.8}  # several: thin lines
        for ax, key in ((acc_ax, "val"), (loss_ax, "loss")):
            for r in rs:
                xs = [p["seconds"] / scale for p in r.curve]
                ax.plot(xs, [p[key] for p in r.curve], color=color, **style)
            # the mean and band where every seed has data (a seed that ends early would make
            # the mean jump); each seed's own line shows the rest
            start = max(r.curve[0]["seconds"] for r in rs)
            end = min(r.curve[-1]["seconds"] for r in rs)
            if seeds > 1 and end > start:
                grid = torch.linspace(start, end, 100, dtype=torch.float64)
                mean, low, high = _mean_band(rs, key, grid)
                xs_g = (grid / scale).tolist()
                ax.fill_between(xs_g, low.tolist(), high.tolist(), color=color, alpha=0.15)
                ax.plot(xs_g, mean.tolist(), color=color, lw=2, label=label)
    acc_ax.set_ylabel("validation accuracy (%)")
    loss_ax.set_ylabel("training loss (last step before each validation)")
    vals = [p["val"] for rs in runs_of.values() for r in rs for p in r.curve]
    bests = [max(p["val"] for p in r.curve) for rs in runs_of.values() for r in rs]
    # every run's best in view; early points more than 5 points below may fall off
    low_y = max(min(vals) - 0.3, min(bests) - 5.0, 0.0)
    acc_ax.set_ylim(low_y, min(100.0, max(bests) + 0.3))
    for ax in (acc_ax, loss_ax):
        ax.set_xlabel(f"training wall-clock time ({unit})")
        ax.grid(alpha=0.3)
    handles, labels = acc_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(3, len(labels)), fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_embeddings(path: Path, results: Sequence[RunResult], methods: Sequence[str]) -> bool:
    panels = []
    for m in methods:
        runs = [r for r in results if r.method == m and r.projection is not None]
        if runs and m != "ce":
            panels.append(min(runs, key=lambda r: r.seed))
    plt = _pyplot()
    if not panels or plt is None:
        return False
    fig, axes = plt.subplots(
        1, len(panels), figsize=(3.6 * len(panels) + 1, 4), squeeze=False, layout="constrained"
    )
    for ax, r in zip(axes[0], panels, strict=True):
        assert r.projection is not None and r.projection_labels is not None
        xy = r.projection.numpy()
        points = ax.scatter(
            xy[:, 0],
            xy[:, 1],
            c=r.projection_labels.numpy(),
            cmap="tab10",
            s=3,
            vmin=-0.5,
            vmax=9.5,
        )
        ax.set_title(f"{LABELS.get(r.method, r.method)}\ntest {r.test:.2f} %", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(points, ax=axes[0].tolist(), ticks=range(10), shrink=0.8, label="label")
    fig.suptitle("test embeddings, 2-D PCA", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


class _Bar:
    """A progress bar (rich) or plain lines on stderr, for one run after another."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.progress: Any = None
        self.task: Any = None
        self.last_plain = 0.0
        self.label = ""
        # rich redraws one line in place: on a pipe or a log file that is unreadable, so plain
        # lines are written there instead
        if not enabled or not sys.stderr.isatty():
            return
        try:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            return
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
        )

    def __enter__(self) -> _Bar:
        if self.progress is not None:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def start(self, label: str) -> Progress | None:
        if not self.enabled:
            return None
        self.label = label
        if self.progress is not None:
            self.task = self.progress.add_task(label, total=1.0, status="")
        return self.update

    def update(self, state: dict[str, Any]) -> None:
        vals = " ".join(f"val {v:.2f}%" for v in state["val"].values()) or "val -"
        status = (
            f"step {state['step']}  loss {state['loss']:.4f}  {state['steps_per_s']:.1f} steps/s"
            f"  {vals}"
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=state["fraction"], status=status)
            return
        now = time.perf_counter()
        if state["done"] or now - self.last_plain > 5:
            self.last_plain = now
            sys.stderr.write(f"{self.label}: {100 * state['fraction']:3.0f}%  {status}\n")
            sys.stderr.flush()


def _to_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def knn_main(
    config: KNNConfig,
    *,
    all_rows: bool = False,
    seeds: Sequence[int] = (0,),
    data_dir: str | None = None,
    out: str | Path | None = None,
    command: str | None = None,
    threads: int = 1,
    progress: bool = True,
) -> int:
    """``softops knn``: check the device, run :func:`run_knn` and print its report.

    A config without a budget gets the default one: 20 epochs on digits, 3 minutes elsewhere.
    ``all_rows`` runs the rows of the paper's Table 1 (:data:`softops.apps.train.ALL_ROWS`).
    Sets torch's thread count to ``threads``. Returns the exit status: 0, or 2 after printing
    the error to stderr (an unusable device, a missing dataset or optional package).
    """
    if error := check_device(config.device):
        sys.stderr.write(error + "\n")
        return 2
    if config.minutes is None and config.epochs is None:
        digits = config.dataset == "digits"
        config = replace(config, epochs=20.0) if digits else replace(config, minutes=3.0)
    torch.set_num_threads(threads)
    try:
        report, _ = run_knn(
            config,
            methods=ALL_ROWS if all_rows else None,
            seeds=seeds,
            data_dir=data_dir,
            out=out,
            command=command,
            threads=threads,
            progress=progress,
        )
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as err:
        sys.stderr.write(f"softops knn: {err}\n")
        return 2
    sys.stdout.write(report + "\n")
    return 0


def run_knn(
    config: KNNConfig,
    *,
    methods: Sequence[str] | None = None,
    seeds: Sequence[int] = (0,),
    data_dir: str | None = None,
    out: str | Path | None = None,
    command: str | None = None,
    threads: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    data: ImageDataset | None = None,
) -> tuple[str, list[RunResult]]:
    """Train every method for every seed on ``config``'s budget; write and return the report.

    ``methods`` are the rows (None: ``config.method``); ``out`` None writes nothing;
    ``command`` and ``threads`` are recorded (the caller sets the threads); ``log`` takes the
    one-line messages (None: stderr); ``data`` is a loaded dataset (None: load
    ``config.dataset`` from ``data_dir``). Returns the Markdown report and every
    :class:`RunResult`.
    """
    say = log or _to_stderr
    methods = tuple(methods or (config.method,))
    if data is None:
        data = load_dataset(config.dataset, data_dir)
    say(data.summary())
    results: list[RunResult] = []
    t_start = time.perf_counter()
    with _Bar(progress) as bar:
        for seed in seeds:
            for method, rows in _plan(methods):
                cfg = replace(config, method=method, seed=seed)
                label = f"{'+'.join(rows)} seed {seed}"
                results += train_rows(cfg, data, rows, progress=bar.start(label))
    wall = time.perf_counter() - t_start
    report = markdown_table(config, results, methods, command=command, threads=threads)
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        tag = "all" if tuple(methods) == ALL_ROWS else "-".join(methods)
        stem = f"knn-{config.dataset}-{tag}-{config.budget_label()}"
        record = {
            "command": command,
            "config": asdict(config),
            "methods": list(methods),
            "seeds": list(seeds),
            "dataset": data.summary(),
            "torch": torch.__version__,
            "threads": threads,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "wall_seconds": wall,
            # the paper's table belongs to MNIST only
            **({"paper_mnist": PAPER_MNIST} if _is_mnist(config.dataset) else {}),
            "runs": [r.as_json() for r in results],
        }
        (folder / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
        (folder / f"{stem}.md").write_text(report)
        written = [f"{stem}.json", f"{stem}.md"]
        for name, plot in (("curves", _plot_curves), ("embedding", _plot_embeddings)):
            if plot(folder / f"{stem}-{name}.png", results, methods):
                written.append(f"{stem}-{name}.png")
        say(f"wrote {', '.join(written)} in {folder} ({wall / 60:.1f} min in all)")
    return report, results
