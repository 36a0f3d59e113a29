"""A small, generic benchmark harness: interleaved timings, subprocess memory probes, reports.

A *suite* (see :class:`Suite`) describes what to measure: a list of :class:`Config` (one input
shape and its parameters) and, for each, a list of :class:`Case` (one method: a function of the
input tensor). One case per configuration is the *floor*, the hard operator; every time is also
reported as a ratio to the floor's forward time, which is the headline number because absolute
times on a shared machine drift from run to run while ratios taken in one run do not.

How a configuration is measured (:func:`run_suite`):

* ``torch.set_num_threads(threads)`` is set explicitly (1 by default) and restored afterwards.
* The input ``x`` is created once per configuration, from a seeded generator; it is not timed.
* **Forward** is one call of the case on ``x.detach()`` (no graph is built). **Forward+backward**
  is one call on ``x`` (``requires_grad=True``) followed by ``(out * g).sum().backward()`` for a
  fixed random ``g`` drawn once per case: a fixed random linear functional of the output.
* Each case gets one warm-up call per mode. The timed repeats are then interleaved: every repeat
  runs each case once, round-robin (the order alternates between repeats), so slow drifts of the
  machine hit all cases alike. The reported time is the median over repeats.
* Clocks are ``time.perf_counter``; on CUDA the device is synchronised before each reading.
* A case whose single warm-up call exceeds the per-case time budget is skipped (and so are its
  larger configurations in the same group; a case flagged ``compiled`` gets a second call first,
  since its first call compiles); otherwise the number of repeats is cut to fit the budget, but
  never below ``min_repeats``.
* **Saved-for-backward memory** is counted in process, with
  ``torch.autograd.graph.saved_tensors_hooks``: the bytes of the distinct storages the forward
  saves for backward, leaving out the input's own storage. It is exact and deterministic.
* **Peak memory** is measured in a fresh subprocess per configuration and case
  (:mod:`softops.bench._probe`): after a warm-up call, the peak extra memory of one
  forward+backward over the post-set-up baseline. On CPU that is the ``ru_maxrss`` high-water
  mark (reset through ``/proc/self/clear_refs`` where Linux allows it) minus the resident set
  before the call, with glibc's dynamic mmap threshold pinned so that freed buffers go back to the
  OS; on CUDA it is ``torch.cuda.max_memory_allocated`` minus ``memory_allocated``.
* Cases flagged ``first_call`` also get their **first call** timed in fresh subprocesses: once with
  an empty ``torch.compile`` cache directory (cold) and once reusing it (warm on-disk cache).

Results are plain dicts (one per configuration and case), written as JSONL, a Markdown table and a
PNG plot by :func:`write_results`.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "Case",
    "Config",
    "RunOptions",
    "Suite",
    "count_saved_bytes",
    "markdown_report",
    "plot_results",
    "run_suite",
    "write_results",
]

PROBE_MARKER = "SOFTOPS_PROBE_RESULT "
_MB = 2.0**20


@dataclass(frozen=True)
class Case:
    """One method to measure in one configuration.

    Attributes:
        name: the row label, unique within the configuration.
        fn: a function of the (B, n) input tensor returning one tensor (the output whose
            random linear functional is back-propagated).
        floor: ``True`` for the hard operator that every ratio is taken against.
        skip: a reason not to run the case (for example a peer that is not installed); the case
            is still reported, with this reason.
        first_call: time the first call in fresh subprocesses (for compiled paths).
        compiled: the first call of each mode compiles, so a warm-up call over the time budget
            is repeated once before the case is judged too slow.
        mode: a context-manager factory entered around every call, forward *and* backward
            (for example a global switch that the backward also reads).
    """

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    floor: bool = False
    skip: str | None = None
    first_call: bool = False
    compiled: bool = False
    mode: Callable[[], AbstractContextManager[Any]] | None = None

    def context(self) -> AbstractContextManager[Any]:
        """The context to run a call of this case in (``mode()``, or a no-op)."""
        return self.mode() if self.mode is not None else nullcontext()


@dataclass(frozen=True)
class Config:
    """One configuration: a group label plus JSON-serialisable parameters (``B``, ``n``, ...).

    Configurations of one group are expected in increasing size: a case too slow for one is
    skipped for the following ones of the same group. ``first_call`` marks the configurations
    where the cases flagged ``first_call`` get their first call timed in fresh processes.
    """

    group: str
    params: Mapping[str, Any]
    first_call: bool = False

    @property
    def label(self) -> str:
        """A short human-readable label, e.g. ``"grid B=64 n=1000 k=10"``."""
        return " ".join([self.group, *(f"{key}={value}" for key, value in self.params.items())])

    def to_json(self) -> str:
        """Serialise for the probe subprocess."""
        return json.dumps(
            {"group": self.group, "params": dict(self.params), "first_call": self.first_call}
        )

    @classmethod
    def from_json(cls, text: str) -> Config:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        return cls(data["group"], data["params"], bool(data.get("first_call", False)))


class Suite(Protocol):
    """What a benchmark suite provides to the harness.

    ``ref`` is the ``"module:attribute"`` path of the suite object, so that a probe subprocess can
    rebuild the same cases. ``make_cases`` must depend only on the configuration and the
    environment, never on run options.
    """

    ref: str
    name: str
    floor_label: str
    plot_group: str
    plot_x: str

    def make_input(
        self,
        config: Config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Return the (B, n) input of a configuration (without ``requires_grad``)."""
        ...

    def make_cases(self, config: Config) -> list[Case]:
        """Return the cases of a configuration, floor included."""
        ...

    def compare(self, config: Config, outputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Return configuration-level facts from the cases' forward outputs (e.g. agreement)."""
        ...

    def summary(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """Return Markdown lines appended to the report (e.g. the targets and whether they hold)."""
        ...


@dataclass
class RunOptions:
    """How to run a suite.

    Attributes:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        dtype: the input dtype, by name (``"float32"``, ``"float64"``, ...).
        threads: ``torch.set_num_threads`` for the run (and the probes).
        repeats: timed repeats per case and mode (the median is reported).
        min_repeats: the fewest repeats a case gets when its time budget is short.
        time_budget_s: seconds of timed repeats allowed per case and configuration; a case whose
            single warm-up call exceeds it is skipped there and at larger sizes of its group.
        memory: run the peak-memory probes (one subprocess per configuration and case).
        first_call: run the first-call probes of the cases flagged ``first_call``.
        seed: seed of the inputs and of the linear functionals.
        probe_timeout_s: a probe subprocess is abandoned after this long.
        extra: JSON-serialisable fields stored in every record (for example the command line).
    """

    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    repeats: int = 10
    min_repeats: int = 3
    time_budget_s: float = 30.0
    memory: bool = True
    first_call: bool = True
    seed: int = 0
    probe_timeout_s: float = 900.0
    extra: dict[str, Any] = field(default_factory=dict)

    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``; raises ``ValueError`` for an unknown name."""
        value = getattr(torch, self.dtype, None)
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise ValueError(f"bench: expected a floating dtype name; got dtype={self.dtype!r}.")
        return value


# ----------------------------------------------------------------------------------------------
# Timing and counting primitives


def sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(call: Callable[[], Any], device: torch.device) -> float:
    """Seconds taken by ``call()``, with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - start


def _forward(case: Case, x: torch.Tensor) -> torch.Tensor:
    with case.context():
        return case.fn(x)


def _forward_backward(case: Case, x: torch.Tensor, g: torch.Tensor) -> None:
    x.grad = None
    with case.context():
        out = case.fn(x)
        (out * g).sum().backward()


def count_saved_bytes(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Run ``fn(x)`` and count the bytes it saves for backward.

    Counts each distinct storage once (a tensor saved by several nodes, or views of one buffer,
    are counted once, at the size of the whole storage, since that is what stays alive) and
    leaves out the storage of ``x`` itself, which exists anyway.

    Args:
        fn: the function to run.
        x: its input (usually with ``requires_grad=True``).

    Returns:
        The output of ``fn(x)`` and the number of bytes saved for its backward.
    """
    excluded = {_storage_key(x)}
    seen: dict[Any, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in excluded:
            try:
                nbytes = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                nbytes = t.numel() * t.element_size()
            seen[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, sum(seen.values())


def _storage_key(t: torch.Tensor) -> Any:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return ("id", id(t))
    if ptr == 0:  # empty storages all have address 0
        return ("id", id(t))
    return (str(t.device), ptr)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch threads, then restore the previous count.

    Nothing is called when the count is already ``n``: on a busy machine, any explicit
    ``torch.set_num_threads`` (even to the current count) can make tiny ops in the rest of the
    process much slower (observed with torch 2.13 on CPU), so the process state is left alone.
    """
    previous = torch.get_num_threads()
    if previous == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def _gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def functional_weights(shape: torch.Size, like: torch.Tensor, seed: int, name: str) -> torch.Tensor:
    """The fixed random ``g`` of the linear functional ``(out * g).sum()`` of one case.

    Derived from ``seed`` and the case name (not from Python's randomised ``hash``), so the
    harness and the probe subprocesses use the same ``g``.
    """
    offset = sum((i + 1) * ord(c) for i, c in enumerate(name)) % 100_003
    gen = make_generator(like.device, seed * 100_019 + offset + 1)
    return torch.randn(shape, generator=gen, device=like.device, dtype=like.dtype)


# ----------------------------------------------------------------------------------------------
# The run


@dataclass
class _CaseState:
    case: Case
    g: torch.Tensor | None = None
    repeats: int = 0
    fwd: list[float] = field(default_factory=list)
    fwdbwd: list[float] = field(default_factory=list)
    fwd_skip: str | None = None
    fwdbwd_skip: str | None = None
    saved_bytes: int | None = None
    output: torch.Tensor | None = None


def environment(options: RunOptions) -> dict[str, Any]:
    """The facts about the machine and libraries stored with every record."""
    device = torch.device(options.device)
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "threads": options.threads,
        "dtype": options.dtype,
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    try:
        import softops

        info["softops"] = softops.__version__
    except ImportError:  # pragma: no cover - the harness lives inside softops
        pass
    return info


def run_suite(
    suite: Suite,
    configs: Sequence[Config],
    options: RunOptions,
    *,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Measure every case of every configuration; return one record per configuration and case.

    Args:
        suite: the suite that builds inputs and cases.
        configs: the configurations, each group in increasing size.
        options: threads, repeats, budget, probes, ...
        log: where progress lines go.

    Returns:
        A list of JSON-serialisable dicts (see the module docstring for what each field means).
    """
    device = torch.device(options.device)
    dtype = options.torch_dtype()
    env = environment(options)
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    too_slow: dict[tuple[str, str], str] = {}
    per_config: list[list[dict[str, Any]]] = []
    with _threads(options.threads), torch.enable_grad():
        for index, config in enumerate(configs):
            log(f"[{index + 1}/{len(configs)}] {config.label}")
            per_config.append(
                _run_config(suite, config, options, device, dtype, too_slow, env, stamp, log)
            )
    if options.memory or options.first_call:
        for config, records in zip(configs, per_config, strict=True):
            _run_probes(suite, config, options, records, log)
    return [record for records in per_config for record in records]


def _run_config(
    suite: Suite,
    config: Config,
    options: RunOptions,
    device: torch.device,
    dtype: torch.dtype,
    too_slow: dict[tuple[str, str], str],
    env: Mapping[str, Any],
    stamp: str,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    gc.collect()
    gen = make_generator(device, options.seed)
    base = suite.make_input(config, device=device, dtype=dtype, generator=gen)
    x_fwd = base.detach()
    x = base.detach().clone().requires_grad_(True)

    states = [_CaseState(case) for case in suite.make_cases(config)]
    for st in states:
        reason = st.case.skip or too_slow.get((config.group, st.case.name))
        if reason:
            st.fwd_skip = st.fwdbwd_skip = reason
        else:
            _warm_up(st, x_fwd, x, config, options, device, too_slow, log)
    runnable = [st for st in states if st.fwd_skip is None]
    _timed_repeats(runnable, x_fwd, x, options, device)

    outputs = {st.case.name: st.output for st in runnable if st.output is not None}
    facts = suite.compare(config, outputs) if outputs else {}
    for st in states:
        st.output = None
    x.grad = None

    floor_fwd = next((statistics.median(st.fwd) for st in states if st.case.floor and st.fwd), None)
    records = []
    for st in states:
        fwd_ms = statistics.median(st.fwd) * 1e3 if st.fwd else None
        fb_ms = statistics.median(st.fwdbwd) * 1e3 if st.fwdbwd else None
        floor_ms = floor_fwd * 1e3 if floor_fwd else None
        record: dict[str, Any] = {
            "suite": suite.name,
            "group": config.group,
            "config": config.label,
            **dict(config.params),
            "case": st.case.name,
            "floor": st.case.floor,
            "fwd_ms": fwd_ms,
            "fwdbwd_ms": fb_ms,
            "floor_fwd_ms": floor_ms,
            "fwd_ratio": fwd_ms / floor_ms if fwd_ms and floor_ms else None,
            "fwdbwd_ratio": fb_ms / floor_ms if fb_ms and floor_ms else None,
            "repeats": len(st.fwd),
            "fwd_ms_samples": [round(t * 1e3, 4) for t in st.fwd],
            "fwdbwd_ms_samples": [round(t * 1e3, 4) for t in st.fwdbwd],
            "saved_mb": st.saved_bytes / _MB if st.saved_bytes is not None else None,
            "peak_mb": None,
            "peak_kind": None,
            "skip": st.fwd_skip,
            "fwdbwd_skip": st.fwdbwd_skip if st.fwd_skip is None else None,
            **facts,
            **env,
            **options.extra,
            "time": stamp,
        }
        records.append(record)
        if fwd_ms is not None:
            ratio = record["fwdbwd_ratio"]
            fb = f"{fb_ms:10.2f} ms fwd+bwd" if fb_ms is not None else " " * 18
            rtxt = f" ({ratio:.1f}x floor)" if ratio is not None else ""
            log(f"    {st.case.name:<28} {fwd_ms:10.2f} ms fwd {fb}{rtxt}")
    return records


def _warm_up(
    st: _CaseState,
    x_fwd: torch.Tensor,
    x: torch.Tensor,
    config: Config,
    options: RunOptions,
    device: torch.device,
    too_slow: dict[tuple[str, str], str],
    log: Callable[[str], None],
) -> None:
    """One untimed call per mode of one case.

    Keeps the forward output (for ``compare``), draws ``g``, counts the bytes saved for
    backward, and skips the case (here and at larger sizes of its group) when one call exceeds
    the time budget; for a ``compiled`` case, when a second call does too (the first compiles).
    A case that raises is reported with its error instead of stopping the run.
    """
    budget = options.time_budget_s
    name = st.case.name
    try:
        for _ in range(2 if st.case.compiled else 1):
            start = time.perf_counter()
            out = _forward(st.case, x_fwd)
            sync(device)
            t_fwd = time.perf_counter() - start
            if t_fwd <= budget:
                break
    except Exception as err:
        st.fwd_skip = st.fwdbwd_skip = f"error: {type(err).__name__}: {err}"
        log(f"    {name}: {st.fwd_skip}")
        return
    if t_fwd > budget:
        st.fwd_skip = st.fwdbwd_skip = too_slow[(config.group, name)] = (
            f"too slow: one forward took {t_fwd:.1f} s at {config.label}, over the "
            f"{budget:g} s budget"
        )
        log(f"    {name}: {st.fwd_skip}")
        return
    st.output = out.detach()
    g = st.g = functional_weights(out.shape, out, options.seed, name)
    try:
        for _ in range(2 if st.case.compiled else 1):
            start = time.perf_counter()
            x.grad = None
            with st.case.context():
                out, st.saved_bytes = count_saved_bytes(st.case.fn, x)
                (out * g).sum().backward()
            sync(device)
            t_fb = time.perf_counter() - start
            if t_fb <= budget:
                break
    except Exception as err:
        st.fwdbwd_skip = f"error: {type(err).__name__}: {err}"
        log(f"    {name}: {st.fwdbwd_skip}")
        return
    if t_fb > budget:
        st.fwdbwd_skip = too_slow[(config.group, name)] = (
            f"too slow: one forward+backward took {t_fb:.1f} s at {config.label}, over the "
            f"{budget:g} s budget"
        )
        log(f"    {name}: {st.fwdbwd_skip}")


def _timed_repeats(
    runnable: Sequence[_CaseState],
    x_fwd: torch.Tensor,
    x: torch.Tensor,
    options: RunOptions,
    device: torch.device,
) -> None:
    """The timed repeats, interleaved round-robin; the order alternates between repeats.

    After the first repeat each case's number of repeats is cut to fit the time budget, never
    below ``min_repeats``.
    """
    for st in runnable:
        st.repeats = options.repeats
    with _gc_paused():
        for rep in range(options.repeats):
            for st in runnable if rep % 2 == 0 else runnable[::-1]:
                if rep >= st.repeats:
                    continue
                case = st.case
                st.fwd.append(_timed(lambda case=case: _forward(case, x_fwd), device))
                if st.fwdbwd_skip is None and st.g is not None:
                    g = st.g
                    st.fwdbwd.append(
                        _timed(lambda case=case, g=g: _forward_backward(case, x, g), device)
                    )
            if rep == 0:
                for st in runnable:
                    per_repeat = st.fwd[0] + (st.fwdbwd[0] if st.fwdbwd else 0.0)
                    fit = int(options.time_budget_s // per_repeat) if per_repeat > 0 else 0
                    st.repeats = max(options.min_repeats, min(options.repeats, fit or 1))


# ----------------------------------------------------------------------------------------------
# Probes (subprocesses)


def probe_command(
    kind: str, suite: Suite, config: Config, case: str, options: RunOptions
) -> list[str]:
    """The command line of one probe subprocess."""
    return [
        sys.executable,
        "-m",
        "softops.bench._probe",
        kind,
        "--suite",
        suite.ref,
        "--config",
        config.to_json(),
        "--case",
        case,
        "--device",
        options.device,
        "--dtype",
        options.dtype,
        "--threads",
        str(options.threads),
        "--seed",
        str(options.seed),
    ]


def run_probe(
    kind: str,
    suite: Suite,
    config: Config,
    case: str,
    options: RunOptions,
    *,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run one probe in a fresh subprocess and return its JSON result (or ``{"error": ...}``)."""
    full_env = dict(os.environ)
    if kind == "memory":
        # A fixed mmap threshold turns off glibc's dynamic one, so large freed buffers go back to
        # the OS at once and the resident set tracks live memory. Not for timing probes: mapping
        # every large buffer afresh slows allocation-heavy code down.
        full_env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    full_env.update(env or {})
    try:
        proc = subprocess.run(
            probe_command(kind, suite, config, case, options),
            capture_output=True,
            text=True,
            env=full_env,
            timeout=options.probe_timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {options.probe_timeout_s:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(PROBE_MARKER):
            return json.loads(line[len(PROBE_MARKER) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _run_probes(
    suite: Suite,
    config: Config,
    options: RunOptions,
    records: list[dict[str, Any]],
    log: Callable[[str], None],
) -> None:
    by_name = {record["case"]: record for record in records}
    for case in suite.make_cases(config):
        name = case.name
        record = by_name.get(name)
        if record is None or record["fwd_ms"] is None:
            continue
        if options.memory and record["fwdbwd_ms"] is not None:
            log(f"  memory probe: {config.label} / {name}")
            result = run_probe("memory", suite, config, name, options)
            if "error" in result:
                record["peak_error"] = result["error"]
                log(f"    failed: {result['error']}")
            else:
                record["peak_mb"] = result["peak_mb"]
                record["peak_kind"] = result["peak_kind"]
                record["probe_saved_mb"] = result["saved_mb"]
        if options.first_call and config.first_call and case.first_call:
            log(f"  first-call probe: {config.label} / {name} (cold, then warm cache)")
            with tempfile.TemporaryDirectory(prefix="softops-inductor-") as cache:
                cache_env = {"TORCHINDUCTOR_CACHE_DIR": cache}
                cold = run_probe("first-call", suite, config, name, options, env=cache_env)
                warm = run_probe("first-call", suite, config, name, options, env=cache_env)
            for tag, result in (("cold", cold), ("warm_cache", warm)):
                if "error" in result:
                    record[f"first_call_{tag}_error"] = result["error"]
                    log(f"    {tag} failed: {result['error']}")
                else:
                    record[f"first_call_{tag}_s"] = result["first_s"]
                    record[f"second_call_{tag}_s"] = result["second_s"]


# ----------------------------------------------------------------------------------------------
# Reports


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def _group_configs(records: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        groups.setdefault(record["config"], []).append(record)
    return list(groups.values())


def markdown_report(
    records: Sequence[Mapping[str, Any]],
    suite: Suite,
    *,
    command: str | None = None,
) -> str:
    """Render the records as Markdown: one table per configuration, then the suite's summary.

    The ratio columns (time over the floor's forward time) come first: they are the headline.
    """
    if not records:
        return f"# {suite.name} benchmark\n\nNo records.\n"
    first = records[0]
    lines = [
        f"# {suite.name} benchmark",
        "",
        f"torch {first['torch']} · {first['device']} · {first['threads']} thread(s) · "
        f"{first['dtype']} · {first['time']}",
    ]
    if command:
        lines += ["", f"Reproduce with `{command}`."]
    peak = any(r.get("peak_mb") is not None for r in records)
    kinds = sorted({r["peak_kind"] for r in records if r.get("peak_kind")})
    lines += [
        "",
        f"Ratios are times over the floor's forward time ({suite.floor_label}); "
        "medians over interleaved repeats. fwd+bwd is the forward plus `.backward()` of "
        "`(out * g).sum()` for a fixed random g. *saved* is the memory the forward keeps for "
        "backward (saved-tensor hooks, the input excluded)"
        + (
            "; *peak Δ* is the peak extra memory of one forward+backward in a fresh process "
            f"({', '.join(kinds)}), x.grad included."
            if peak
            else "; peak memory was not measured in this run."
        ),
    ]
    head = ["method", "fwd × floor", "fwd+bwd × floor", "fwd ms", "fwd+bwd ms", "saved MB"]
    head += ["peak Δ MB"] * peak + ["repeats"]
    for rows in _group_configs(records):
        lines += ["", f"### {rows[0]['config']}", ""]
        lines += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
        notes = []
        for r in rows:
            if r["skip"]:
                lines.append(f"| {r['case']} | skipped" + " |" * (len(head) - 1))
                notes.append(f"- {r['case']}: {r['skip']}")
                continue
            if r.get("fwdbwd_skip"):
                notes.append(f"- {r['case']} (fwd+bwd): {r['fwdbwd_skip']}")
            cells = [
                r["case"],
                _fmt(r["fwd_ratio"], ".2f", "×"),
                _fmt(r["fwdbwd_ratio"], ".2f", "×"),
                _fmt(r["fwd_ms"], ".2f"),
                _fmt(r["fwdbwd_ms"], ".2f"),
                _fmt(r["saved_mb"], ".3g"),
            ]
            cells += [_fmt(r["peak_mb"], ".3g")] * peak + [str(r["repeats"])]
            lines.append("| " + " | ".join(cells) + " |")
            if r.get("peak_error"):
                notes.append(f"- {r['case']}: memory probe failed: {r['peak_error']}")
        if notes:
            lines += ["", *notes]
    first_calls = [r for r in records if "first_call_cold_s" in r or "first_call_cold_error" in r]
    if first_calls:
        lines += [
            "",
            "### First call in a fresh process (forward+backward, includes any compilation)",
            "",
            "| configuration | method | first call, empty compile cache | first call, warm "
            "on-disk cache | second call |",
            "|---|---|---:|---:|---:|",
        ]
        for r in first_calls:
            lines.append(
                f"| {r['config']} | {r['case']} | {_fmt(r.get('first_call_cold_s'), '.2f', ' s')} "
                f"| {_fmt(r.get('first_call_warm_cache_s'), '.2f', ' s')} "
                f"| {_fmt(_ms(r.get('second_call_warm_cache_s')), '.1f', ' ms')} |"
            )
    summary = suite.summary(records)
    if summary:
        lines += ["", *summary]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def plot_results(records: Sequence[Mapping[str, Any]], path: Path, suite: Suite) -> bool:
    """Plot median time against ``suite.plot_x`` per method (forward and forward+backward).

    Needs matplotlib (the ``bench`` extra); returns ``False`` without it or without data. Draws
    on a bare ``Figure`` (saved through the Agg canvas), so pyplot's global backend is untouched.
    """
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    rows = [r for r in records if r["group"] == suite.plot_group and r["fwd_ms"] is not None]
    if not rows:
        return False
    cases = list(dict.fromkeys(r["case"] for r in rows))
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color", [None])
    colors = {case: palette[i % len(palette)] for i, case in enumerate(cases)}
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, key, title in (
        (axes[0], "fwd_ms", "forward"),
        (axes[1], "fwdbwd_ms", "forward + backward"),
    ):
        for case in cases:
            pts = sorted(
                (r[suite.plot_x], r[key]) for r in rows if r["case"] == case and r[key] is not None
            )
            if not pts:
                continue
            floor = any(r["floor"] for r in rows if r["case"] == case)
            ax.plot(
                *zip(*pts, strict=True),
                marker="o",
                label=case,
                color=colors[case],
                linestyle="--" if floor else "-",
            )
        floor_pts = sorted(
            (r[suite.plot_x], r["floor_fwd_ms"]) for r in rows if r["floor"] and r["floor_fwd_ms"]
        )
        if floor_pts and key == "fwdbwd_ms":
            ax.plot(
                *zip(*floor_pts, strict=True),
                color="grey",
                linestyle=":",
                label=f"{suite.floor_label} (floor)",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(suite.plot_x)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median time (ms)")
    axes[1].legend(fontsize=8)
    head = rows[0]
    fig.suptitle(
        f"{suite.name}: B={head.get('B')}, {head['threads']} thread(s), {head['device']}, "
        f"torch {head['torch']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def write_results(
    records: Sequence[Mapping[str, Any]],
    suite: Suite,
    out_dir: str | os.PathLike[str],
    stem: str,
    *,
    command: str | None = None,
) -> dict[str, Path]:
    """Write ``<stem>.jsonl``, ``<stem>.md`` and (with matplotlib) ``<stem>.png`` to ``out_dir``.

    Returns:
        The paths written, keyed by ``"jsonl"``, ``"md"`` and ``"png"``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": out / f"{stem}.jsonl", "md": out / f"{stem}.md"}
    with paths["jsonl"].open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(dict(record), sort_keys=False) + "\n")
    paths["md"].write_text(markdown_report(records, suite, command=command), encoding="utf-8")
    png = out / f"{stem}.png"
    if plot_results(records, png, suite):
        paths["png"] = png
    return paths
