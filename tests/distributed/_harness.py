"""Spawn a gloo group of P CPU processes once and run many cases inside it.

``run_group(world, names)`` starts ``world`` processes (``torch.multiprocessing``, spawn), each
of which joins a gloo group on a free localhost port, runs the named cases of
:mod:`tests.distributed._cases` in order, records per case whether it passed (with the
traceback when it did not) and its wall time, and writes them to a JSON file per rank. A case
makes every collective call before it asserts anything, so a failed assertion cannot leave the
other ranks waiting in a collective; the group's timeout and a deadline on the whole run bound a
hang all the same.
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

DEADLINE_S = 120.0
"""The longest a whole group may run before its processes are killed (a hang)."""


def free_port() -> int:
    """A TCP port that is free on localhost now (bound and released: the usual race is small)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, names: list[str]) -> None:
    import torch.distributed as dist

    import softops
    from tests.distributed._cases import CASES

    torch.set_num_threads(1)
    softops.set_compile(False)
    os.environ.pop("WORLD_SIZE", None)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    results = {}
    for name in names:
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            CASES[name](rank, world)
            ok, message = True, ""
        except Exception:
            ok, message = False, traceback.format_exc()
        results[name] = {"ok": ok, "message": message, "seconds": time.perf_counter() - start}
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def run_group(world: int, names: list[str]) -> dict[str, list[dict]]:
    """Run the cases ``names`` in one spawned group of ``world`` processes: for each case, the
    list of every rank's result (``ok``, ``message``, ``seconds``)."""
    out = tempfile.mkdtemp(prefix=f"softops-dist{world}-")
    context = mp.start_processes(
        _worker,
        args=(world, free_port(), out, names),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"the group of {world} processes ran past {DEADLINE_S} s (a hang)")
    per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return {name: [res[name] for res in per_rank] for name in names}
