"""Spawn one gloo group of CPU processes and run many cases inside it, in two world sizes.

``run_groups(plan)`` starts ``max(plan)`` processes (``torch.multiprocessing``, spawn) that join
a gloo group on a free localhost port. For each world size in ``plan``, largest first, the
first ``world`` processes run its cases: on the default group when it holds them all, else on
a subgroup of them (``torch.distributed.new_group``, passed to every call as ``group=``), so
that one start-up (most of the time on a small machine) serves both sizes, and both the
default group and an explicit one are exercised. Each rank records per case whether it
passed (with the traceback when it did not) and its wall time, in a JSON file. A case makes
every collective call before it asserts anything, so a failed assertion cannot leave the
other ranks waiting in a collective; the group's timeout and a deadline on the whole run bound
a hang all the same.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

DEADLINE_S = 150.0
"""The longest the processes may run before they are killed (a hang)."""


def free_port() -> int:
    """A TCP port that is free on localhost now (bound and released: the usual race is small)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, out: str, plan: dict[int, list[str]]) -> None:
    import torch.distributed as dist

    from tests.distributed import _cases

    torch.set_num_threads(1)
    os.environ.pop("WORLD_SIZE", None)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=60),
    )
    results: dict[str, dict] = {}
    for world in sorted(plan, reverse=True):
        group = None if world == size else dist.new_group(list(range(world)))
        if rank >= world:
            continue
        _cases.GROUP = group
        for name in plan[world]:
            torch.manual_seed(0)
            start = time.perf_counter()
            try:
                _cases.CASES[name](rank, world)
                ok, message = True, ""
            except Exception:
                ok, message = False, traceback.format_exc()
            seconds = time.perf_counter() - start
            results[f"{world}-{name}"] = {"ok": ok, "message": message, "seconds": seconds}
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    # Leave without the interpreter's teardown: gloo's threads sometimes abort the process there
    # ("terminate called without an active exception", SIGABRT), after every case has run and
    # the results are written, about one run in four on this 2-core machine.
    os._exit(0)


def run_groups(plan: dict[int, list[str]], attempts: int = 2) -> dict[str, list[dict]]:
    """Run the cases ``plan[world]`` for each world size: for each ``"{world}-{name}"``, the
    list of every participating rank's result (``ok``, ``message``, ``seconds``).

    A start that fails (the free port taken by another process before rank 0 binds it: a
    process then raises in ``init_process_group``) is retried on a new port."""
    size = max(plan)
    for attempt in range(attempts):
        out = tempfile.mkdtemp(prefix="softops-dist-")
        context = mp.start_processes(
            _worker,
            args=(size, free_port(), out, plan),
            nprocs=size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + DEADLINE_S
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {size} processes ran past {DEADLINE_S} s (a hang)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException, TimeoutError):
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            if attempt + 1 == attempts or any(Path(out).iterdir()):
                raise
            continue
        break
    per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(size)]
    return {
        f"{world}-{name}": [res[f"{world}-{name}"] for res in per_rank[:world]]
        for world, names in plan.items()
        for name in names
    }
