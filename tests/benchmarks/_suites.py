"""Fake suites for the subprocess tests of the harness (imported by the probe subprocesses too,
as ``tests.benchmarks._suites:FAULTY``: no pytest here, so the children start quickly).

Each configuration's ``group`` picks what its ``"faulty"`` case does: ``"ok"`` a cheap op,
``"memory-error"`` raises ``MemoryError``, ``"alloc"`` allocates ``params["mb"]`` MiB (an
allocator failure under a memory cap), ``"hang"`` sleeps for a minute, ``"kill"`` kills its own
process with SIGKILL (as the kernel's OOM killer does).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from benchmarks import Case, Config
from benchmarks.model import threads_pinned


class FaultySuite:
    ref = "tests.benchmarks._suites:FAULTY"
    name = "faulty"
    floor_label = "x * 1"
    plot_group = "ok"
    plot_x = "n"

    def make_input(
        self,
        config: Config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        generator: torch.Generator,
    ) -> torch.Tensor:
        p = config.params
        return torch.randn(p["B"], p["n"], generator=generator, device=device, dtype=dtype)

    def make_cases(self, config: Config) -> list[Case]:
        group, mb = config.group, int(config.params.get("mb", 0))

        def faulty(x: torch.Tensor) -> torch.Tensor:
            if group == "memory-error":
                raise MemoryError("simulated")
            if group == "alloc":
                big = torch.ones(mb * 2**18)  # mb MiB of float32
                return x * big[: x.numel()].reshape(x.shape)
            if group == "hang":
                time.sleep(60)
            if group == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            return x.exp()

        return [
            Case("floor", lambda x: x * 1, floor=True),
            Case("faulty", faulty),
            Case("absent", lambda x: x, skip="not installed"),
        ]

    def compare(self, config: Config, outputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        # what the process ran with, seen from inside a configuration
        return {"seen_pinned": threads_pinned(), "seen_torch_threads": torch.get_num_threads()}

    def summary(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        return []


FAULTY = FaultySuite()
