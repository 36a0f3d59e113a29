r"""The data model of the benchmark harness, and the primitives every measurement shares.

A *suite* (see :class:`Suite`) describes what to measure: a list of :class:`Config` (one input
shape and its parameters) and, for each, a list of :class:`Case` (one method: a function of the
input tensor). One case per configuration is the *floor*, the hard operator that every time is
divided by. :class:`RunOptions` says how to run a suite.

The primitives are shared by the in-process timing loop (:mod:`benchmarks.harness`) and the
probe subprocesses (:mod:`benchmarks._probe`), so that both measure the same thing:

* :func:`sync` waits for queued device work, so that a clock reading covers it;
* :func:`softops.testing.count_saved_bytes` (which the tests use too) counts the bytes a
  forward saves for backward, each storage once, leaving out the input's own;
* :func:`make_generator` and :func:`functional_weights` make the seeded input and the fixed
  random ``g`` of the linear functional ``(out * g).sum()`` whose backward is timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "PROBE_MARKER",
    "STATUSES",
    "Case",
    "Config",
    "RunOptions",
    "Suite",
    "failure_status",
    "functional_weights",
    "make_generator",
    "parse_threads",
    "pinning",
    "sync",
    "thread_facts",
    "threads_label",
    "threads_pinned",
]

PROBE_MARKER = "SOFTOPS_PROBE_RESULT "
"""The prefix of the JSON result line a probe subprocess prints."""

STATUSES = ("ok", "skipped", "error", "oom", "timeout")
"""What a record's ``status`` (and ``fwdbwd_status``, ``peak_status``) can be: measured; not run
(a peer not installed, a size over the suite's limit); raised; ran out of memory (``MemoryError``,
``torch.OutOfMemoryError``, an allocator failure, or a subprocess killed by SIGKILL, which is what
the kernel's OOM killer sends); over its time budget or the subprocess time-out."""


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

    Example:
        >>> from benchmarks.model import Config
        >>> config = Config("grid", {"B": 64, "n": 1000, "k": 10})
        >>> config.label
        'grid B=64 n=1000 k=10'
        >>> Config.from_json(config.to_json()) == config
        True
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
        threads: ``torch.set_num_threads`` for the run (and the probes), or ``None`` for the
            out-of-the-box configuration: the harness then sets no thread count (torch's or
            numba's) and no environment variable, and measures what a user's process gets.
        repeats: timed repeats per case and mode (the median is reported).
        min_repeats: the fewest repeats a case gets when its time budget is short.
        time_budget_s: seconds of timed repeats allowed per case and configuration; a case whose
            single warm-up call exceeds it is skipped there and at larger sizes of its group.
        memory: run the peak-memory probes (one subprocess per configuration and case).
        first_call: run the first-call probes of the cases flagged ``first_call``.
        seed: seed of the inputs and of the linear functionals.
        probe_timeout_s: a subprocess (a probe, or a configuration with ``isolate``) is killed
            after this long, and its records get the status ``"timeout"``.
        isolate: time each configuration in a fresh subprocess (all its cases interleaved
            there), so that no configuration inherits the state of another (thread pools,
            allocator caches, a thread count set earlier); a configuration that crashes, runs out
            of memory or times out is recorded as such. Off: in this process.
        memory_limit_mb: cap the address space of every subprocess at its size before the
            measured calls plus this many MiB (``RLIMIT_AS``, Linux), so that an allocation over
            it fails (status ``"oom"``) instead of swapping or waking the OOM killer.
        progress: show a progress bar on stderr (rich; the log lines are printed above it).
        extra: JSON-serialisable fields stored in every record (for example the command line).
    """

    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 1
    repeats: int = 10
    min_repeats: int = 3
    time_budget_s: float = 30.0
    memory: bool = True
    first_call: bool = True
    seed: int = 0
    probe_timeout_s: float = 900.0
    isolate: bool = False
    memory_limit_mb: float | None = None
    progress: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """Serialise for a subprocess (every field is JSON-serialisable)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunOptions:
        """Inverse of :meth:`to_json`; unknown fields are ignored."""
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})

    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``; raises ``ValueError`` for an unknown name."""
        value = getattr(torch, self.dtype, None)
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise ValueError(f"bench: expected a floating dtype name; got dtype={self.dtype!r}.")
        return value


def parse_threads(text: str | int | None) -> int | None:
    """``"default"`` (or ``None``) -> ``None``, the out-of-the-box configuration; else a count >= 1.

    Example:
        >>> from benchmarks.model import parse_threads
        >>> parse_threads("default"), parse_threads("2"), parse_threads(1)
        (None, 2, 1)
    """
    if text is None or (isinstance(text, str) and text.strip().lower() == "default"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f'bench: expected a thread count >= 1 or "default"; got {text!r}.')
    return value


def threads_label(threads: int | None, actual: int | None = None) -> str:
    """How a thread setting is named in reports: ``"1 thread"``, ``"default threads (2)"``.

    Example:
        >>> from benchmarks.model import threads_label
        >>> threads_label(1), threads_label(4), threads_label(None, 2)
        ('1 thread', '4 threads', 'default threads (2)')
    """
    if threads is None:
        return "default threads" + (f" ({actual})" if actual is not None else "")
    return f"{threads} thread" + ("s" if threads != 1 else "")


_PINNED = [True]


def threads_pinned() -> bool:
    """Whether the run pins thread counts (``False`` in the out-of-the-box configuration).

    A case's ``mode`` that pins a thread pool of its own (numba's, in the sort suite) reads this
    at call time, since cases never depend on run options.
    """
    return _PINNED[-1]


@contextmanager
def pinning(pinned: bool) -> Iterator[None]:
    """Set :func:`threads_pinned` for the enclosed run, then restore it."""
    _PINNED.append(pinned)
    try:
        yield
    finally:
        _PINNED.pop()


def failure_status(err: BaseException) -> str:
    """``"oom"`` for an out-of-memory failure (``MemoryError``, ``torch.OutOfMemoryError``, the
    CPU allocator's "can't allocate memory"), else ``"error"``.

    Example:
        >>> from benchmarks.model import failure_status
        >>> failure_status(MemoryError()), failure_status(ValueError("bad"))
        ('oom', 'error')
    """
    if isinstance(err, MemoryError | torch.OutOfMemoryError):
        return "oom"
    text = str(err).lower()
    if isinstance(err, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text
    ):
        return "oom"
    return "error"


def thread_facts() -> dict[str, Any]:
    """The thread counts this process runs with: torch's intra-op count, numba's and its threading
    layer (once numba's pool has been launched; nothing is launched here) and the thread
    variables set in the environment."""
    facts: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    # numba.get_num_threads() would launch numba's thread pool (and fix its threading layer)
    # if nothing has yet: read it only once something else has.
    if parallel is not None and getattr(parallel, "_is_initialized", False):
        try:
            facts["numba_threads"] = int(parallel.get_num_threads())
            facts["numba_threading_layer"] = str(parallel.threading_layer())
        except Exception:  # a broken install: the facts are optional
            pass
    env = {
        key: os.environ[key]
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
        if key in os.environ
    }
    if env:
        facts["thread_env"] = env
    return facts


# ----------------------------------------------------------------------------------------------
# Primitives shared by the timing loop and the probe subprocesses


def sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
