"""softops.distributed in real gloo groups of 2 and 4 CPU processes, against the single-process
op on the concatenated rows. Each world size is spawned once; every case of ``_cases.py`` runs
inside it, and each is reported here as its own test."""

from __future__ import annotations

import functools

import pytest

from tests.distributed._cases import CASES, WORLDS
from tests.distributed._harness import run_group

PARAMS = [(world, name) for world in (2, 4) for name in CASES if world in WORLDS[name]]


@functools.cache
def _results(world: int) -> dict[str, list[dict]]:
    return run_group(world, [name for w, name in PARAMS if w == world])


@pytest.mark.parametrize(("world", "name"), PARAMS, ids=[f"{w}-{n}" for w, n in PARAMS])
def test_case(world: int, name: str) -> None:
    per_rank = _results(world)[name]
    failed = [(r, res["message"]) for r, res in enumerate(per_rank) if not res["ok"]]
    assert not failed, "\n".join(f"rank {r}:\n{m}" for r, m in failed)
