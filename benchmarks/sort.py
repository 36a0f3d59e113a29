r"""The sort benchmark suite: ``python -m benchmarks sort``.

Inputs ``x ~ N(0, 1)`` of shape (B, n), float32 by default, epsilon = 1.0 everywhere (pav's
epsilon is torchsort's ``regularization_strength`` and torchpsort's ``tau``; SoftSort's and
NeuralSort's temperature is the peers' ``tau``). Every case returns ascending values or
1-based ascending ranks, so the outputs of methods solving the same problem are compared
(``max_abs_diff_*``). Four groups of configurations:

``grid``
    B=64, n in {1e3, 1e4, 1e5}. Cases: the floor ``torch.sort(x).values``; **pav sort** and
    **pav rank** (``method="pav"``, l2); **torchsort sort/rank** and **torchpsort sort/rank**
    when installed; **softsort sort/rank** (``method="softsort"``, l1: the exact O(n log n)
    scans); **neuralsort sort** where B·n² <= ``NEURALSORT_MAX_ENTRIES`` (its softmax is
    O(n²) time) and within the time budget; difftopk's dense ``SoftSort`` and ``NeuralSort``
    (see ``dense``) where B·n² <= ``DENSE_MAX_ENTRIES`` (n=1e3 only).
``vs``
    n=4000, B in {1, 8}: SoftSort against NeuralSort, **values and ranks**: one case calls
    ``soft_sort`` and then ``soft_rank`` of the method and stacks the two (B, n) outputs, so its
    time is the sum of both calls (forward, or forward+backward of a functional of both).
    Cases: floor; softsort values+ranks (l1, the default); softsort values+ranks (l2, the
    row-chunked O(n²) path, only where B·n² <= ``L2_MAX_ENTRIES``: B=1); neuralsort
    values+ranks.
``dense``
    B=8, n=1e3: difftopk's dense ``SoftSort`` (``(P @ x)`` flipped to ascending; ``pow=1``, the
    l1 distance) and ``NeuralSort`` (``P^T @ x``, ascending) against ours.
``overhead``
    B in {1, 8, 64} x n in {100, 300, 1000}: the per-call cost of small problems, where fixed
    costs (argument checks, reshapes, the operator dispatch, the autograd nodes) dominate the
    O(n log n) work. Cases: the floor; **pav sort** and **pav rank** out of the box; **torchsort
    sort/rank** when installed. The summary gives the
    microseconds of one forward+backward side by side, with the ratios to torchsort. Run by the
    full suite (not by ``--quick``, unless asked for).
``memory``
    B=8, n=1e5: softsort values+ranks, forward+backward; its peak extra memory is the target.
    The measured path is **l1** (the default distance): exact semiseparable scans, O(B n)
    memory, no blocks and nothing recomputed. The l2 path is row-chunked with checkpointing
    (blocks recomputed in the backward) at :data:`BLOCK_ELEMENTS` = 2**20
    entries per block, i.e. ``max(1, 2**20 // (B n))`` = 1 row per block here; its O(B n²) time
    (about 8e10 kernel entries per call) keeps it out of this run, so its row is skipped unless
    B·n² <= ``L2_MAX_ENTRIES``.

The targets of the suite, checked in the report's summary: pav within 1.5× of torchsort at n=1e5
(forward+backward), and at every size of the ``overhead`` group (forward+backward, out of the box,
at the run's thread setting; ``--threads default`` sets nothing at all); softsort values+ranks at
least 3× faster than NeuralSort at n=4000 (forward+backward); softsort values+ranks at B=8, n=1e5,
forward+backward, under 256 MB of peak extra memory. pav's isotonic step is a C++ kernel on
torch's own threads (``at::parallel_for``), so its rows "pav sort"/"pav rank" and "pav sort (out of
the box)"/"pav rank (out of the box)" run the same code (the latter kept for the ``overhead``
group's table). torchpsort's numba kernels run on as many threads as torch
(:func:`numba_threads`), so a 1-thread run is 1 thread for every method. SoftTorch is not run
(it needs Python >= 3.12 and a CUDA torch build).

:func:`run_sort_bench` is ``python -m benchmarks sort``: it builds the configurations from the
command's arguments (:data:`SORT_QUICK` for ``--quick``), runs them and writes the files.

The memory target's summary reports the l2 path's block size, :data:`BLOCK_ELEMENTS`, a copy of
the library's (``tests/benchmarks`` checks that the two agree).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Unpack

import torch

import softops
from benchmarks.harness import (
    DEFAULT_OUT,
    QuickDefaults,
    RunExtras,
    make_options,
    run_and_write,
    thread_runs,
)
from benchmarks.model import Case, Config, threads_pinned
from benchmarks.quality import (
    RANK_MAE,
    SORT_MAE,
    QualityMethod,
    QualitySpec,
    finite_differences,
    unrolled,
)
from benchmarks.report import make_logger
from softops.testing import unrolled_ot_sort

__all__ = [
    "BLOCK_ELEMENTS",
    "OVERHEAD_SHAPES",
    "QUALITY",
    "QUICK_QUALITY",
    "SORT_QUICK",
    "SUITE",
    "SortSuite",
    "build_configs",
    "numba_threads",
    "quality_methods",
    "run_sort_bench",
]

GRID_SIZES = (1_000, 10_000, 100_000)
QUICK_SIZES = (1_000, 10_000)
GRID_BATCH = 64
SORT_QUICK: QuickDefaults = {"sizes": QUICK_SIZES, "batch": 4, "repeats": 3, "time_budget": 2.0}
"""The defaults of ``python -m benchmarks sort --quick`` (and the probes are off)."""
EPSILON = 1.0
NEURALSORT_MAX_ENTRIES = 100_000_000
"""Largest B·n² at which NeuralSort (O(n²) softmax) is run in the grid: B=64, n=1e3."""
L2_MAX_ENTRIES = 20_000_000
"""Largest B·n² at which the O(n²) l2 SoftSort path is run: B=1, n=4000 (1.6e7), not B=8."""
DENSE_MAX_ENTRIES = 64_000_000
"""Largest B·n² at which the dense difftopk peers (B×n×n matrices) are run: B=64, n=1e3."""
OVERHEAD_SHAPES = tuple((b, n) for b in (1, 8, 64) for n in (100, 300, 1000))
"""The (B, n) of the ``overhead`` group, in increasing size within each B."""
PAV_VS_TORCHSORT = 1.5
SOFTSORT_VS_NEURALSORT = 3.0
MEMORY_LIMIT_MB = 256.0
BLOCK_ELEMENTS = 1 << 20
"""Entries per block of the row-chunked l2 SoftSort path: a copy of the library's private
constant, for the memory target's summary (``tests/benchmarks`` checks that they agree)."""
SOFTTORCH_SKIP = (
    "SoftTorch 0.1.1 is not installed: it needs Python >= 3.12 and a torch build for it (a "
    "~4 GB CUDA download); measured apart, its softsort took 89 s and 15 GB at B=8, n=1e4"
)

_FLOOR = "torch.sort"
_PAV_SORT, _PAV_RANK = "pav sort", "pav rank"
_PAV_SORT_OOB, _PAV_RANK_OOB = "pav sort (out of the box)", "pav rank (out of the box)"
_TS_SORT, _TS_RANK = "torchsort sort", "torchsort rank"
_TPS_SORT, _TPS_RANK = "torchpsort sort", "torchpsort rank"
_SS_SORT, _SS_RANK = "softsort sort", "softsort rank"
_NS_SORT = "neuralsort sort"
_SS_VR = "softsort values+ranks"
_SS_VR_L2 = "softsort values+ranks (l2, chunked)"
_NS_VR = "neuralsort values+ranks"
_DT_SS = "difftopk.SoftSort (dense)"
_DT_NS = "difftopk.NeuralSort (dense)"
_SOFTTORCH = "SoftTorch"

Fn = Callable[[torch.Tensor], torch.Tensor]


def build_configs(
    *,
    sizes: Sequence[int] = GRID_SIZES,
    batch: int = GRID_BATCH,
    vs: bool = True,
    dense: bool = True,
    memory: bool = True,
    quick: bool = False,
    overhead: bool = False,
) -> list[Config]:
    """The configurations of the sort suite.

    Args:
        sizes: the grid's n values (sorted increasingly here).
        batch: the grid's B.
        vs: include the softsort-vs-neuralsort configurations (n=4000, B=1 and B=8).
        dense: include the dense difftopk configuration (B=8, n=1e3).
        memory: include the memory configuration (B=8, n=1e5).
        quick: shrink the extra configurations for ``--quick`` (vs: B=1, n=1000; dense: B=2,
            n=300; memory: B=2, n=1e4).
        overhead: include the small per-call configurations (:data:`OVERHEAD_SHAPES`).

    Returns:
        The configurations, each group in increasing size.

    Example:
        >>> configs = build_configs(sizes=[1000], vs=False, dense=False, memory=False,
        ...                         overhead=True)
        >>> [c.label for c in configs][:2]
        ['grid B=64 n=1000 epsilon=1.0', 'overhead B=1 n=100 epsilon=1.0']
        >>> sorted({(c.params["B"], c.params["n"]) for c in configs[1:]}) == sorted(OVERHEAD_SHAPES)
        True
    """
    ns = sorted({int(n) for n in sizes})
    configs = [Config("grid", {"B": batch, "n": n, "epsilon": EPSILON}) for n in ns]
    if vs:
        shapes = ((1, 1_000),) if quick else ((1, 4_000), (8, 4_000))
        configs += [Config("vs", {"B": b, "n": n, "epsilon": EPSILON}) for b, n in shapes]
    if dense:
        b, n = (2, 300) if quick else (8, 1_000)
        configs.append(Config("dense", {"B": b, "n": n, "epsilon": EPSILON}))
    if memory:
        b, n = (2, 10_000) if quick else (8, 100_000)
        configs.append(Config("memory", {"B": b, "n": n, "epsilon": EPSILON}))
    if overhead:
        configs += [
            Config("overhead", {"B": b, "n": n, "epsilon": EPSILON}) for b, n in OVERHEAD_SHAPES
        ]
    return configs


@contextmanager
def numba_threads() -> Iterator[None]:
    """Run numba's parallel kernels on as many threads as torch (restored afterwards).

    torchpsort's kernels are numba ``prange`` loops, which otherwise use every core whatever
    ``torch.set_num_threads`` says; held through the backward too. A no-op in the out-of-the-box
    configuration (:func:`benchmarks.model.threads_pinned` is ``False``), where numba's
    threads are what numba chooses.
    """
    if not threads_pinned():
        yield
        return
    try:
        import numba
    except ImportError:
        yield
        return
    previous = numba.get_num_threads()
    config: Any = numba.config  # (typed where numba is installed, Any where it is not)
    wanted = max(1, min(torch.get_num_threads(), config.NUMBA_NUM_THREADS))
    numba.set_num_threads(wanted)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def _unavailable(name: str, reason: str) -> Case:
    def fn(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(reason)

    return Case(name, fn, skip=reason)


def _peer_cases(module: str, eps: float) -> list[Case]:
    """``soft_sort`` and ``soft_rank`` of torchsort or torchpsort, or skipped rows without it."""
    names = (_TS_SORT, _TS_RANK) if module == "torchsort" else (_TPS_SORT, _TPS_RANK)
    try:
        peer = __import__(module)
    except ImportError:
        reason = f"{module} is not installed (scripts/install_peers.sh)"
        return [_unavailable(name, reason) for name in names]
    if module == "torchsort":

        def p_sort(x: torch.Tensor) -> torch.Tensor:
            return peer.soft_sort(x, regularization_strength=eps)

        def p_rank(x: torch.Tensor) -> torch.Tensor:
            return peer.soft_rank(x, regularization_strength=eps)
    else:

        def p_sort(x: torch.Tensor) -> torch.Tensor:
            return peer.soft_sort(x, tau=eps)

        def p_rank(x: torch.Tensor) -> torch.Tensor:
            return peer.soft_rank(x, tau=eps)

    mode = numba_threads if module == "torchpsort" else None
    return [Case(names[0], p_sort, mode=mode), Case(names[1], p_rank, mode=mode)]


def _difftopk_cases(eps: float, entries: int) -> list[Case]:
    """difftopk's dense SoftSort and NeuralSort as ascending values, or skipped rows (when it
    is not installed, or when B·n² = ``entries`` is over ``DENSE_MAX_ENTRIES``)."""
    reason = _too_big(entries, DENSE_MAX_ENTRIES, "dense B×n×n")
    try:
        import difftopk
    except ImportError:
        reason = "difftopk is not installed (scripts/install_peers.sh)"
    if reason is not None:
        return [_unavailable(_DT_SS, reason), _unavailable(_DT_NS, reason)]
    softsort = difftopk.SoftSort(tau=eps)
    neuralsort = difftopk.NeuralSort(tau=eps)

    def dt_softsort(x: torch.Tensor) -> torch.Tensor:
        # P @ x is descending for difftopk's SoftSort
        return (softsort(x) @ x.unsqueeze(-1)).squeeze(-1).flip(-1)

    def dt_neuralsort(x: torch.Tensor) -> torch.Tensor:
        # P^T @ x is ascending for difftopk's NeuralSort
        return (neuralsort(x).transpose(-2, -1) @ x.unsqueeze(-1)).squeeze(-1)

    return [Case(_DT_SS, dt_softsort), Case(_DT_NS, dt_neuralsort)]


def _values_and_ranks(method: str, eps: float, **kwargs: Any) -> Fn:
    """One call of ``soft_sort`` and one of ``soft_rank``, stacked: (2, B, n)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        values = softops.soft_sort(x, epsilon=eps, method=method, **kwargs)
        ranks = softops.soft_rank(x, epsilon=eps, method=method, **kwargs)
        return torch.stack((values, ranks))

    return fn


def _too_big(entries: int, limit: int, what: str) -> str | None:
    if entries <= limit:
        return None
    return f"{what}: B·n² = {entries:.2g} is over this suite's limit of {limit:.2g}"


class SortSuite:
    """The sort suite (see the module docstring); ``SUITE`` is its instance."""

    ref = "benchmarks.sort:SUITE"
    name = "sort"
    floor_label = "torch.sort(x).values"
    plot_group = "grid"
    plot_x = "n"

    def make_input(
        self,
        config: Config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Standard normal inputs of shape (B, n)."""
        p = config.params
        return torch.randn(p["B"], p["n"], generator=generator, device=device, dtype=dtype)

    def make_cases(self, config: Config) -> list[Case]:
        """The floor and the methods of one configuration (see the module docstring)."""
        p = config.params
        eps = float(p["epsilon"])
        entries = int(p["B"]) * int(p["n"]) ** 2
        cases = [Case(_FLOOR, lambda x: torch.sort(x, dim=-1).values, floor=True)]
        if config.group == "grid":
            cases += [
                Case(_PAV_SORT, lambda x: softops.soft_sort(x, epsilon=eps, method="pav")),
                Case(_PAV_RANK, lambda x: softops.soft_rank(x, epsilon=eps, method="pav")),
                # (the same code since pav's kernel runs on torch's threads; kept for the table)
                Case(_PAV_SORT_OOB, lambda x: softops.soft_sort(x, epsilon=eps, method="pav")),
                Case(_PAV_RANK_OOB, lambda x: softops.soft_rank(x, epsilon=eps, method="pav")),
                *_peer_cases("torchsort", eps),
                *_peer_cases("torchpsort", eps),
                Case(_SS_SORT, lambda x: softops.soft_sort(x, epsilon=eps, method="softsort")),
                Case(_SS_RANK, lambda x: softops.soft_rank(x, epsilon=eps, method="softsort")),
                Case(
                    _NS_SORT,
                    lambda x: softops.soft_sort(x, epsilon=eps, method="neuralsort"),
                    skip=_too_big(entries, NEURALSORT_MAX_ENTRIES, "O(n²) softmax"),
                ),
                *_difftopk_cases(eps, entries),
                _unavailable(_SOFTTORCH, SOFTTORCH_SKIP),
            ]
        elif config.group == "vs":
            cases += [
                Case(_SS_VR, _values_and_ranks("softsort", eps)),
                Case(
                    _SS_VR_L2,
                    _values_and_ranks("softsort", eps, distance="l2"),
                    skip=_too_big(entries, L2_MAX_ENTRIES, "O(n²) time"),
                ),
                Case(_NS_VR, _values_and_ranks("neuralsort", eps)),
            ]
        elif config.group == "dense":
            cases += [
                Case(_SS_SORT, lambda x: softops.soft_sort(x, epsilon=eps, method="softsort")),
                Case(_NS_SORT, lambda x: softops.soft_sort(x, epsilon=eps, method="neuralsort")),
                *_difftopk_cases(eps, entries),
            ]
        elif config.group == "overhead":
            cases += [
                Case(_PAV_SORT_OOB, lambda x: softops.soft_sort(x, epsilon=eps, method="pav")),
                Case(_PAV_RANK_OOB, lambda x: softops.soft_rank(x, epsilon=eps, method="pav")),
                *_peer_cases("torchsort", eps),
            ]
        elif config.group == "memory":
            cases += [
                Case(_SS_VR, _values_and_ranks("softsort", eps)),
                Case(
                    _SS_VR_L2,
                    _values_and_ranks("softsort", eps, distance="l2"),
                    skip=_too_big(entries, L2_MAX_ENTRIES, "O(n²) time"),
                ),
            ]
        return cases

    def compare(self, config: Config, outputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Max abs differences between methods that solve the same problem."""
        facts: dict[str, Any] = {}
        pairs: tuple[tuple[str, str, str], ...] = (
            ("max_abs_diff_pav_vs_torchsort_sort", _PAV_SORT, _TS_SORT),
            ("max_abs_diff_pav_vs_torchsort_rank", _PAV_RANK, _TS_RANK),
            ("max_abs_diff_pav_vs_torchpsort_sort", _PAV_SORT, _TPS_SORT),
            ("max_abs_diff_pav_vs_torchpsort_rank", _PAV_RANK, _TPS_RANK),
            ("max_abs_diff_softsort_vs_difftopk", _SS_SORT, _DT_SS),
            ("max_abs_diff_neuralsort_vs_difftopk", _NS_SORT, _DT_NS),
            ("max_abs_diff_sort_l1_vs_floor", _SS_SORT, _FLOOR),
        )
        pairs += (  # the overhead group has the out-of-the-box rows only
            ("max_abs_diff_pav_vs_torchsort_sort", _PAV_SORT_OOB, _TS_SORT),
            ("max_abs_diff_pav_vs_torchsort_rank", _PAV_RANK_OOB, _TS_RANK),
        )
        for key, a, b in pairs:
            if key not in facts and a in outputs and b in outputs:
                facts[key] = (outputs[a].double() - outputs[b].double()).abs().max().item()
        return facts

    def summary(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """The suite's targets, with the measured numbers and whether each holds."""
        lines = ["### Targets", ""]
        lines += _pav_lines(records)
        lines += _overhead_target_lines(records)
        lines += _vs_lines(records)
        lines += _memory_lines(records)
        if len(lines) == 2:
            return []
        lines += _agreement_lines(records)
        lines += [
            "",
            f"- SoftTorch: not run. {SOFTTORCH_SKIP}.",
        ]
        return lines + _overhead_table(records)


def _met(ok: bool) -> str:
    return "(met)" if ok else "(not met)"


def _find(rows: Sequence[Mapping[str, Any]], case: str) -> Mapping[str, Any] | None:
    return next((r for r in rows if r["case"] == case), None)


def _pav_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    grid = [r for r in records if r["group"] == "grid"]
    if not grid:
        return []
    n_max = max(r["n"] for r in grid)
    rows = [r for r in grid if r["n"] == n_max]
    where = "" if n_max == 100_000 else " — the target is stated at n=1e5"
    lines = []
    for ours, theirs in ((_PAV_SORT, _TS_SORT), (_PAV_RANK, _TS_RANK)):
        a, b = _find(rows, ours), _find(rows, theirs)
        if a is None or b is None or not a.get("fwdbwd_ms") or not b.get("fwdbwd_ms"):
            reason = (b or {}).get("skip") or "not measured"
            lines.append(f"- {ours} vs {theirs} at n={n_max}: not measured ({reason})")
            continue
        ratio = a["fwdbwd_ms"] / b["fwdbwd_ms"]
        fwd = a["fwd_ms"] / b["fwd_ms"]
        lines.append(
            f"- {ours} / {theirs} at B={a['B']}, n={n_max}: {ratio:.2f}× fwd+bwd "
            f"({a['fwdbwd_ms']:.1f} vs {b['fwdbwd_ms']:.1f} ms), {fwd:.2f}× fwd; "
            f"target ≤ {PAV_VS_TORCHSORT:g}× {_met(ratio <= PAV_VS_TORCHSORT)}{where}. "
            "pav is torch plus a C++ isotonic kernel (softops._kernels)."
        )
    return lines


def _overhead_pairs(
    records: Sequence[Mapping[str, Any]],
) -> list[tuple[Mapping[str, Any], dict[str, Mapping[str, Any] | None]]]:
    """Per ``overhead`` configuration: its floor row and the rows of pav (out of the box) and
    torchsort, by name."""
    out = []
    for config in dict.fromkeys(r["config"] for r in records if r["group"] == "overhead"):
        rows = [r for r in records if r["config"] == config]
        floor = next((r for r in rows if r.get("floor")), rows[0])
        names = (_PAV_SORT_OOB, _PAV_RANK_OOB, _TS_SORT, _TS_RANK)
        out.append((floor, {name: _find(rows, name) for name in names}))
    return out


def _fb(row: Mapping[str, Any] | None) -> float | None:
    return row.get("fwdbwd_ms") if row is not None and not row.get("skip") else None


def _overhead_target_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    pairs = _overhead_pairs(records)
    if not pairs:
        return []
    lines = []
    for ours, theirs in ((_PAV_RANK_OOB, _TS_RANK), (_PAV_SORT_OOB, _TS_SORT)):
        ratios = []
        for floor, rows in pairs:
            a, b = _fb(rows[ours]), _fb(rows[theirs])
            if a and b:
                ratios.append((a / b, floor["B"], floor["n"]))
        if not ratios:
            reason = next((row["skip"] for _, r in pairs if (row := r[theirs]) is not None), None)
            lines.append(
                f"- {ours} vs {theirs} per call at small sizes: not measured "
                f"({reason or 'not measured'})"
            )
            continue
        worst, b, n = max(ratios)
        middle = statistics.median(r for r, _, _ in ratios)
        lines.append(
            f"- {ours} / {theirs} per call, fwd+bwd, over the {len(ratios)} small shapes "
            f"(B ≤ 64, n ≤ 1000): worst {worst:.2f}× (B={b}, n={n}), median {middle:.2f}×; "
            f"target ≤ {PAV_VS_TORCHSORT:g}× {_met(worst <= PAV_VS_TORCHSORT)} (the table below)."
        )
    return lines


def _us(ms: float | None) -> str:
    return "" if ms is None else f"{ms * 1e3:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else ""


def _overhead_table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The per-call costs of the ``overhead`` group, microseconds side by side."""
    pairs = _overhead_pairs(records)
    if not pairs:
        return []
    head = pairs[0][0]
    threads = head.get("threads_label") or f"{head.get('threads')} thread(s)"
    lines = [
        "",
        "### Per-call cost at small sizes (forward+backward, µs)",
        "",
        "Medians of single calls at "
        f"{threads}, out of the box. At these sizes the fixed costs of a call dominate: the "
        "argument checks and reshapes, the operator dispatch and the autograd nodes.",
        "",
        "| B | n | torch.sort | pav rank | torchsort rank | ratio | pav sort | torchsort sort "
        "| ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for floor, rows in pairs:
        rank, ts_rank = _fb(rows[_PAV_RANK_OOB]), _fb(rows[_TS_RANK])
        sort, ts_sort = _fb(rows[_PAV_SORT_OOB]), _fb(rows[_TS_SORT])
        lines.append(
            f"| {floor['B']} | {floor['n']} | {_us(_fb(floor))} | {_us(rank)} | {_us(ts_rank)} "
            f"| {_ratio(rank, ts_rank)} | {_us(sort)} | {_us(ts_sort)} | {_ratio(sort, ts_sort)} |"
        )
    return lines


def _vs_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = []
    for config in dict.fromkeys(r["config"] for r in records if r["group"] == "vs"):
        rows = [r for r in records if r["config"] == config]
        ss, ns = _find(rows, _SS_VR), _find(rows, _NS_VR)
        if ss is None or ns is None or not ss.get("fwdbwd_ms") or not ns.get("fwdbwd_ms"):
            continue
        speed = ns["fwdbwd_ms"] / ss["fwdbwd_ms"]
        fwd = ns["fwd_ms"] / ss["fwd_ms"]
        where = "" if ss["n"] == 4_000 else " — the target is stated at n=4000"
        text = (
            f"- softsort values+ranks (l1) vs neuralsort values+ranks at B={ss['B']}, "
            f"n={ss['n']}: {speed:.1f}× faster fwd+bwd ({ss['fwdbwd_ms']:.1f} vs "
            f"{ns['fwdbwd_ms']:.1f} ms), {fwd:.1f}× fwd; target ≥ {SOFTSORT_VS_NEURALSORT:g}× "
            f"{_met(speed >= SOFTSORT_VS_NEURALSORT)}{where}"
        )
        l2 = _find(rows, _SS_VR_L2)
        if l2 is not None and l2.get("fwdbwd_ms"):
            text += (
                f"; the O(n²) l2 path: {ns['fwdbwd_ms'] / l2['fwdbwd_ms']:.1f}× faster fwd+bwd "
                "than neuralsort"
            )
        lines.append(text)
    return lines


def _agreement_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The largest disagreement between methods that solve the same problem, per fact."""
    worst: dict[str, tuple[float, str]] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith("max_abs_diff_") and "vs_floor" not in key and value is not None:
                if key not in worst or value > worst[key][0]:
                    worst[key] = (value, r["config"])
    if not worst:
        return []
    parts = [
        f"{key.removeprefix('max_abs_diff_').replace('_', ' ')}: {value:.2g} ({config})"
        for key, (value, config) in worst.items()
    ]
    return [
        "- Agreement, max |difference| of the outputs (ranks go up to n; float32): "
        + "; ".join(parts)
    ]


def _memory_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = [r for r in records if r["group"] == "memory"]
    ss = _find(rows, _SS_VR)
    if ss is None or ss.get("fwd_ms") is None:
        return []
    head = f"- softsort values+ranks fwd+bwd at B={ss['B']}, n={ss['n']} (l1, exact scans)"
    where = "" if (ss["B"], ss["n"]) == (8, 100_000) else " — the target is stated at B=8, n=1e5"
    if ss.get("peak_mb") is None:
        reason = ss.get("peak_error") or "the memory probe was off in this run"
        text = f"{head}: peak not measured ({reason})"
        if ss.get("saved_mb") is not None:
            text += f"; saved for backward {ss['saved_mb']:.3g} MB"
        return [text + where]
    ok = ss["peak_mb"] < MEMORY_LIMIT_MB
    rows_per_block = max(1, min(ss["n"], BLOCK_ELEMENTS // (ss["B"] * ss["n"])))
    block = (
        "no blocks: the l1 path is exact O(B n) scans, nothing recomputed; the l2/P path's "
        f"block is BLOCK_ELEMENTS = {BLOCK_ELEMENTS} entries = {rows_per_block} row(s) at "
        "this shape"
    )
    return [
        f"{head}: peak Δ {ss['peak_mb']:.1f} MB (x.grad included; saved for backward "
        f"{ss['saved_mb']:.3g} MB); target < {MEMORY_LIMIT_MB:g} MB {_met(ok)}{where}. "
        f"Path: {block}."
    ]


SUITE = SortSuite()


# ----------------------------------------------------------------------------------------------
# Quality


def _hard_sort(x: torch.Tensor) -> torch.Tensor:
    return torch.sort(x, dim=-1).values


def _hard_rank(x: torch.Tensor) -> torch.Tensor:
    return (x.argsort(-1).argsort(-1) + 1).to(x.dtype)


_EPS_UNITS = {
    "pav": "regularization strength (torchsort's)",
    "softsort": "units of x",
    "neuralsort": "units of x",
    "ot": "units of x²",
}


def quality_methods(params: Mapping[str, Any]) -> list[QualityMethod]:
    """The sort methods of the quality sweep: soft sort (sort MAE) and soft rank (rank MAE) of
    pav, softsort (l1), neuralsort and ot, and torchsort's when it is installed.

    References: unrolled Sinkhorn of the same OT problem for "ot"
    (:func:`softops.testing.unrolled_ot_sort`, falling back to finite differences of the
    solve run to 1e-12); central finite differences for the others.
    """
    methods = []
    for method in ("pav", "softsort", "neuralsort", "ot"):
        for op, hard, metric in (
            (softops.soft_sort, _hard_sort, SORT_MAE),
            (softops.soft_rank, _hard_rank, RANK_MAE),
        ):

            def fn(
                x: torch.Tensor, eps: float, op: Callable[..., torch.Tensor] = op, m: str = method
            ) -> torch.Tensor:
                return op(x, epsilon=eps, method=m)

            kind = "sort" if op is softops.soft_sort else "rank"
            if method == "ot":

                def exact(
                    x: torch.Tensor, eps: float, op: Callable[..., torch.Tensor] = op
                ) -> torch.Tensor:
                    return op(x, epsilon=eps, method="ot", max_iter=20_000, tol=1e-12)

                index = 0 if kind == "sort" else 1

                def solve(x: torch.Tensor, eps: float, n_iter: int, index: int = index) -> Any:
                    return unrolled_ot_sort(x, eps, n_iter)[index]

                reference = unrolled(solve, exact, "unrolled Sinkhorn")
            else:
                reference = finite_differences(fn)
            methods.append(
                QualityMethod(
                    f"{method} {kind}", fn, hard, metric, reference, eps_unit=_EPS_UNITS[method]
                )
            )
    try:
        import torchsort
    except ImportError:
        return methods

    def ts_sort(x: torch.Tensor, eps: float) -> torch.Tensor:
        return torchsort.soft_sort(x, regularization_strength=eps)

    def ts_rank(x: torch.Tensor, eps: float) -> torch.Tensor:
        return torchsort.soft_rank(x, regularization_strength=eps)

    unit = _EPS_UNITS["pav"]
    methods += [
        QualityMethod(_TS_SORT, ts_sort, _hard_sort, SORT_MAE, finite_differences(ts_sort), unit),
        QualityMethod(_TS_RANK, ts_rank, _hard_rank, RANK_MAE, finite_differences(ts_rank), unit),
    ]
    return methods


QUALITY = QualitySpec(
    suite="sort",
    methods=quality_methods,
    distance={"B": 16, "n": 200},
    gradient={"B": 3, "n": 12},
    epsilons=(10.0, 1.0, 0.1, 0.01, 0.001),
    notes=(
        "sort MAE is the mean over entries of |soft_sort − torch.sort| (units of x); rank MAE "
        "that of |soft_rank − the hard 1-based rank|. The epsilons are each method's own: "
        "pav's is torchsort's regularization strength (hard once the gaps exceed it, for the "
        "ranks), softsort's and neuralsort's a temperature in units of x, ot's an entropy "
        "weight in units of x².",
    ),
)
"""The sort suite's quality sweep (``python -m benchmarks --suite sort``)."""
QUICK_QUALITY = QualitySpec(
    suite="sort",
    methods=quality_methods,
    distance={"B": 4, "n": 40},
    gradient={"B": 2, "n": 8},
    epsilons=(1.0, 0.1),
)
"""The same at tiny sizes (``--quick``)."""


def run_sort_bench(
    *,
    quick: bool = False,
    threads: int | Sequence[int | None] | None = 1,
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
    overhead: bool | None = None,
    seed: int = 0,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
    **extras: Unpack[RunExtras],
) -> tuple[str, dict[str, Path]]:
    """Run the sort suite and write its files; return the Markdown report and the paths.

    ``quick`` sets the defaults of the size arguments to small values (:data:`SORT_QUICK`) and
    turns the subprocess probes off. Arguments left at ``None`` take the defaults of the mode.
    The files are ``sort.{jsonl,md,png}`` (``sort-quick.*`` with ``quick``) under ``out``. The
    suite has no first-call probe (nothing in it compiles). ``overhead`` (None: on unless
    ``quick``) adds the small per-call configurations. ``threads`` is a count, ``None`` (out of
    the box: nothing set, numba unpinned) or a sequence of them, one run each into the same
    files (every configuration then runs in a fresh process); ``extras`` go to
    :func:`~benchmarks.harness.make_options`.
    """
    log = log or make_logger()
    options = make_options(
        SORT_QUICK,
        quick=quick,
        device=device,
        dtype=dtype,
        threads=1,
        repeats=repeats,
        time_budget=time_budget,
        memory=memory,
        first_call=False,
        seed=seed,
        command=command,
        **extras,
    )
    configs = build_configs(
        sizes=sizes or (SORT_QUICK["sizes"] if quick else GRID_SIZES),
        batch=batch or (SORT_QUICK["batch"] if quick else GRID_BATCH),
        vs=vs,
        dense=dense,
        memory=memory_config,
        quick=quick,
        overhead=not quick if overhead is None else overhead,
    )
    name = "sort-quick" if quick else "sort"
    return run_and_write(SUITE, configs, thread_runs(options, threads), out, name, command, log)
