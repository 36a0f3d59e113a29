"""softops.distributed in real gloo groups of 4 CPU processes (the default group) and of 2 (a
subgroup of them, passed as ``group=``), against the single-process op on the concatenated rows.
The processes are spawned once; every case of ``_cases.py`` runs inside them, and each is
reported here as its own test."""

from __future__ import annotations

import functools

import pytest

from tests.distributed._cases import CASES, WORLDS
from tests.distributed._harness import run_groups

PARAMS = [(world, name) for world in (2, 4) for name in CASES if world in WORLDS[name]]


@functools.cache
def _results() -> dict[str, list[dict]]:
    plan: dict[int, list[str]] = {}
    for world, name in PARAMS:
        plan.setdefault(world, []).append(name)
    return run_groups(plan)


@pytest.mark.parametrize(("world", "name"), PARAMS, ids=[f"{w}-{n}" for w, n in PARAMS])
def test_case(world: int, name: str) -> None:
    per_rank = _results()[f"{world}-{name}"]
    failed = [(r, res["message"]) for r, res in enumerate(per_rank) if not res["ok"]]
    assert not failed, "\n".join(f"rank {r}:\n{m}" for r, m in failed)
