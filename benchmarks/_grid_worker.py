"""The measuring side of grid.py and gpu.py: the ops, their floors and the timing loop.

Run by the drivers (:mod:`_grid_common`) in a fresh interpreter::

    python benchmarks/_grid_worker.py --configs '[["ot", 8, 1000]]' --threads 1 --device cpu

``--threads 1`` calls ``torch.set_num_threads(1)`` before anything else is built (softops pins
numba's pool to torch's count); ``--threads auto`` sets nothing: torch's default, what a user
gets. Each configuration prints one JSON line prefixed with ``_grid_common.MARKER``.

Per configuration (op, B, n), on ``x ~ N(0, 1)`` of shape (B, n), float32, out of the box (each
op's default epsilon, no softops setting changed), three forward+backward callables are timed,
each followed by ``(out * g).sum().backward()`` for a fixed random ``g`` of the output's shape
(the backward of a random linear functional) and ``x.grad = None``:

* ``op``: the soft op (:data:`OPS`);
* ``hard``: its hard op through autograd (``torch.topk(x, k).values``, ``torch.sort(x).values``
  or ``torch.amax(x, -1)``);
* ``sigmoid``: the cheapest possible soft op, :class:`Sigmoid`, a ``torch.autograd.Function``
  that applies ``torch.sigmoid`` in forward and ``g * y * (1 - y)`` in backward.

The floor is the larger of the hard op's and the sigmoid's median; the ratio is the op's median
over it. Order: the first call of the op (the very first softops call of the process: its time is
``first_call_s``), then the first calls of the hard op and the sigmoid (their warm-ups); then
rounds, each running the three in turn (the order reversed every other round, so that the drift of
a shared machine hits them alike), until the rounds have taken ``--budget`` seconds and at least
``--min-rounds`` rounds have run, at most ``--max-rounds``; a configuration whose next round
would take it past ``--max-config-s`` stops early (at least one round). Medians over the rounds.
In a round, a callable whose last reading was under :data:`SETTLE_BELOW_S` is first called
untimed, for about :data:`SETTLE_S` (1 to :data:`SETTLE_CALLS` calls): each reading is then of a
call in a run of calls of the same callable, as in a user's loop. (A call that follows another
callable pays for what that one left, the allocator's freed pages faulted in again and caches
refilled, and it takes a few calls to settle: torch.topk at (1024, 8) beside soft_topk read 188,
141, 131, 115, 111 us on its first five calls and 105 us from the seventh. Timed right after the
op, the hard op of such a cell read up to twice its own loop's time, and the ratio half of what a
user sees: soft_topk at (1024, 8), 7x against 12x.)
The garbage collector is paused while timing. On CUDA every reading is bracketed by
``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import softops
from _grid_common import MARKER, Limits, predicted_skip, skip_record, static_skip

Fn = Callable[[torch.Tensor], torch.Tensor]


class Sigmoid(torch.autograd.Function):
    """The floor: a sigmoid with its hand-written backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return g * y * (1 - y)


def k_mask(n: int) -> int:
    """k of the top-k masks and their hard top-k."""
    return max(1, min(10, n // 2))


def k_sorted(n: int) -> int:
    """k of the sorted soft top-k and its hard top-k."""
    return min(8, n)


@dataclass(frozen=True)
class Op:
    """A soft op and its hard op; ``make`` builds the callables for one x (the F1 needs its
    labels), ``*_shape`` give their outputs' shapes, for g."""

    make: Callable[[torch.Tensor, torch.Generator], Fn]
    hard: Fn
    shape: Callable[[int, int], tuple[int, ...]]
    hard_shape: Callable[[int, int], tuple[int, ...]]


def _topk_hard(k: Callable[[int], int]) -> Fn:
    return lambda x: torch.topk(x, k(x.shape[-1])).values


def _sort_hard(x: torch.Tensor) -> torch.Tensor:
    return torch.sort(x).values


def _amax_hard(x: torch.Tensor) -> torch.Tensor:
    return torch.amax(x, -1)


def _f1(x: torch.Tensor, gen: torch.Generator) -> Fn:
    target = torch.randint(0, x.shape[-1], (x.shape[0],), generator=gen).to(x.device)
    return lambda t: softops.metrics.soft_f1(t, target, from_logits=True)


def _full(b: int, n: int) -> tuple[int, ...]:
    return (b, n)


OPS: dict[str, Op] = {
    "ot": Op(
        lambda x, gen: lambda t: softops.soft_topk_mask(t, k_mask(t.shape[-1]), method="ot"),
        _topk_hard(k_mask),
        _full,
        lambda b, n: (b, k_mask(n)),
    ),
    "soft_rank": Op(lambda x, gen: softops.soft_rank, _sort_hard, _full, _full),
    "soft_sort": Op(lambda x, gen: softops.soft_sort, _sort_hard, _full, _full),
    "soft_topk": Op(
        lambda x, gen: lambda t: softops.soft_topk(t, k_sorted(t.shape[-1])).values,
        _topk_hard(k_sorted),
        lambda b, n: (b, k_sorted(n)),
        lambda b, n: (b, k_sorted(n)),
    ),
    "sparse": Op(
        lambda x, gen: lambda t: softops.soft_topk_mask(t, k_mask(t.shape[-1]), method="sparse"),
        _topk_hard(k_mask),
        _full,
        lambda b, n: (b, k_mask(n)),
    ),
    "smooth_max": Op(
        lambda x, gen: softops.smooth_max, _amax_hard, lambda b, n: (b,), lambda b, n: (b,)
    ),
    "soft_f1": Op(_f1, _amax_hard, lambda b, n: (), lambda b, n: (b,)),
}


def make_input(
    b: int, n: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, generator=gen).to(device).requires_grad_()
    return x, gen


def fwd_bwd(fn: Fn, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    """One forward+backward of ``fn`` at ``x``: the backward of ``<g, fn(x)>``."""

    def run() -> None:
        (fn(x) * g).sum().backward()
        x.grad = None

    return run


def callables(op: str, x: torch.Tensor, gen: torch.Generator) -> dict[str, Callable[[], None]]:
    """The op, its hard op and the sigmoid floor, as forward+backward callables at x."""
    spec = OPS[op]
    b, n = x.shape
    soft = spec.make(x, gen)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(x.device)

    return {
        "op": fwd_bwd(soft, x, draw(spec.shape(b, n))),
        "hard": fwd_bwd(spec.hard, x, draw(spec.hard_shape(b, n))),
        "sigmoid": fwd_bwd(Sigmoid.apply, x, draw((b, n))),
    }


SETTLE_BELOW_S = 0.05
"""A callable whose last reading was shorter is called untimed before each timed call (module
docstring); longer calls hardly notice what the call before them left."""
SETTLE_S = 0.005
"""About how long the untimed calls before a timed one take ..."""
SETTLE_CALLS = 8
"""... and at most how many they are."""


def _clock(device: torch.device) -> Callable[[Callable[[], None]], float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def clock(fn: Callable[[], None]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    return clock


def timed_round(
    fns: dict[str, Callable[[], None]],
    order: list[str],
    times: dict[str, list[float]],
    first: dict[str, float],
    clock: Callable[[Callable[[], None]], float],
) -> None:
    """One round: each callable in ``order`` timed once into ``times``, after untimed calls
    (about :data:`SETTLE_S` of them, 1 to :data:`SETTLE_CALLS`) where its last reading (``first``
    before any) was under :data:`SETTLE_BELOW_S`."""
    for name in order:
        last = times[name][-1] if times[name] else first[name]
        if last < SETTLE_BELOW_S:
            for _ in range(min(SETTLE_CALLS, max(1, math.ceil(SETTLE_S / max(last, 1e-9))))):
                fns[name]()  # (untimed: the run settles after another callable)
        times[name].append(clock(fns[name]))


def _proc_status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _rss_mb() -> float:
    rss = _proc_status_mb("VmRSS")
    return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_mb() -> float:
    peak = _proc_status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak(device: torch.device) -> tuple[float, float | None]:
    """The memory high-water mark so far (MB), then reset it to what is in use now and return
    that too: the base of ``peak_rounds_mb``, the peak of a call once its one-off costs (imports,
    compilation, caches) are paid. The base is None where the mark cannot be reset (no /proc)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return peak, torch.cuda.memory_allocated(device) / 2**20
    peak = _peak_mb()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return peak, None
    return peak, _rss_mb()


def _sig(seconds: float) -> float:
    return float(f"{seconds:.4g}")


def _spread(values: list[float]) -> list[float]:
    """min, first quartile, third quartile, max."""
    ordered = sorted(values)
    last = len(ordered) - 1
    return [_sig(ordered[round(q * last)]) for q in (0, 0.25, 0.75, 1)]


def _is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError | torch.OutOfMemoryError) or (
        "can't allocate memory" in text or "out of memory" in text
    )


def measure(
    op: str,
    b: int,
    n: int,
    device: torch.device,
    budget_s: float,
    min_rounds: int,
    max_rounds: int,
    max_config_s: float,
) -> dict[str, Any]:
    """Time one configuration in this process (see the module docstring)."""
    record: dict[str, Any] = {"op": op, "B": b, "n": n, "loadavg": os.getloadavg()[0]}
    x, gen = make_input(b, n, device)
    fns = callables(op, x, gen)
    clock = _clock(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_mb = torch.cuda.memory_allocated(device) / 2**20
    else:
        base_mb = _rss_mb()
    gc.collect()
    gc.disable()
    caught: list[str] = []
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            first = {name: clock(fn) for name, fn in fns.items()}
            peak_first_mb, rounds_base_mb = _reset_peak(device)
            times: dict[str, list[float]] = {name: [] for name in fns}
            names = list(fns)
            rounds_start = time.perf_counter()
            while len(times["op"]) < max_rounds:
                timed_round(
                    fns, names if len(times["op"]) % 2 == 0 else names[::-1], times, first, clock
                )
                done = len(times["op"])
                spent = time.perf_counter() - rounds_start
                if done >= min_rounds and spent >= budget_s:
                    break
                if time.perf_counter() - start + spent / done > max_config_s:
                    break
            caught = sorted({f"{w.category.__name__}: {w.message}"[:200] for w in seen})
    except Exception as exc:
        gc.enable()
        record.update(status="oom" if _is_oom(exc) else "error", reason=repr(exc)[:600])
        return record
    gc.enable()
    now_peak = (
        torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else _peak_mb()
    )
    peak_extra = max(now_peak, peak_first_mb) - base_mb
    peak_rounds = None if rounds_base_mb is None else now_peak - rounds_base_mb
    medians = {name: statistics.median(values) for name, values in times.items()}
    floor_kind = "hard" if medians["hard"] >= medians["sigmoid"] else "sigmoid"
    floor = medians[floor_kind]
    record.update(
        status="ok",
        first_call_s=_sig(first["op"]),
        first_call_hard_s=_sig(first["hard"]),
        first_call_sigmoid_s=_sig(first["sigmoid"]),
        median_s=_sig(medians["op"]),
        hard_s=_sig(medians["hard"]),
        sigmoid_s=_sig(medians["sigmoid"]),
        floor_s=_sig(floor),
        floor_kind=floor_kind,
        ratio=round(medians["op"] / floor, 4),
        rounds=len(times["op"]),
        spread_s={name: _spread(values) for name, values in times.items()},
        peak_extra_mb=round(max(peak_extra, 0.0), 1),
        peak_rounds_mb=None if peak_rounds is None else round(max(peak_rounds, 0.0), 1),
        config_wall_s=round(time.perf_counter() - start, 3),
        warnings=caught[:5],
    )
    return record


def thread_info(device: torch.device) -> dict[str, Any]:
    """What the process ran with: torch's version and threads, numba's threads, the GPU."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    numba = sys.modules.get("numba")
    if numba is not None:
        try:
            info["numba_threads"] = numba.get_num_threads()
        except Exception:  # numba's pool may not be launched: nothing to report
            pass
    return info


def _cap_address_space(extra_gb: float) -> None:
    """Cap the address space at its size now plus extra_gb, so that a runaway allocation fails
    at once (recorded as oom) instead of swapping or waking the OOM killer. CPU only."""
    size = _proc_status_mb("VmSize")
    if size is None:
        return
    limit = int((size + extra_gb * 1024) * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", required=True, help="JSON list of [op, B, n]")
    parser.add_argument("--threads", choices=["1", "auto"], default="1")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--min-rounds", type=int, default=3)
    parser.add_argument("--max-rounds", type=int, default=400)
    parser.add_argument("--max-config-s", type=float, default=20.0)
    parser.add_argument("--max-mem-gb", type=float, default=4.0)
    parser.add_argument(
        "--deadline-at", type=float, help="a time.time(): the configurations left are skipped"
    )
    parser.add_argument("--address-space-gb", type=float, default=None)
    args = parser.parse_args(argv)
    if args.threads == "1":
        torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()
    elif args.address_space_gb:
        _cap_address_space(args.address_space_gb)
    limits = Limits(
        max_config_s=args.max_config_s, max_mem_gb=args.max_mem_gb, min_rounds=args.min_rounds
    )
    started = time.time()
    done: list[dict[str, Any]] = []
    for op, b, n in json.loads(args.configs):
        common = {"threads": args.threads, "device": device.type}
        reason = static_skip(op, b, n)
        skip = ("static", reason) if reason else predicted_skip(op, b, n, done, limits)
        if skip is None and args.deadline_at is not None and time.time() > args.deadline_at:
            spent = time.time() - started
            skip = ("budget", f"the op's share of the time was spent ({spent:.0f} s)")
        if skip is not None:
            record = skip_record(op, b, n, args.threads, device.type, *skip)
        else:
            record = {
                **measure(
                    op,
                    b,
                    n,
                    device,
                    args.budget,
                    args.min_rounds,
                    args.max_rounds,
                    args.max_config_s,
                ),
                **common,
                **thread_info(device),
            }
        done.append(record)
        print(MARKER + json.dumps(record), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
