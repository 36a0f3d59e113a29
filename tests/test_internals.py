"""Direct tests of internal helpers: the bench's numba thread context and the sort bench entry
point. (The PAV kernels and block helpers are tested in tests/core/test_isotonic.py; the sort
family's internals in tests/sort/.)"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch

F64 = torch.float64


@pytest.fixture(scope="module")
def numba_mod():
    return pytest.importorskip("numba")


# ------------------------------------------------------------ bench: numba thread context


def test_numba_threads_follows_torch_and_restores(numba_mod, monkeypatch):
    from softops.bench.sort import numba_threads

    most = numba_mod.config.NUMBA_NUM_THREADS
    before = numba_mod.get_num_threads()
    try:
        numba_mod.set_num_threads(most)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
        with numba_threads():
            assert numba_mod.get_num_threads() == 1
        assert numba_mod.get_num_threads() == most
        monkeypatch.setattr(torch, "get_num_threads", lambda: most + 50)  # capped
        numba_mod.set_num_threads(1)
        with numba_threads():
            assert numba_mod.get_num_threads() == most
        assert numba_mod.get_num_threads() == 1
        with pytest.raises(RuntimeError, match="inside"), numba_threads():
            raise RuntimeError("inside")
        assert numba_mod.get_num_threads() == 1  # restored on an exception too
    finally:
        numba_mod.set_num_threads(before)


def test_numba_threads_without_numba(monkeypatch):
    from softops.bench.sort import numba_threads

    monkeypatch.setitem(sys.modules, "numba", None)  # import numba -> ImportError
    ran = []
    with numba_threads():
        ran.append(True)
    assert ran == [True]


# ------------------------------------------------------------------- cli: run_sort_bench


def test_run_sort_bench_tiny(tmp_path):
    from softops.cli import run_sort_bench

    lines: list[str] = []
    report, paths = run_sort_bench(
        quick=True,
        threads=torch.get_num_threads(),
        sizes=[16],
        batch=1,
        repeats=1,
        time_budget=1.0,
        vs=False,
        dense=False,
        memory_config=False,
        out=str(tmp_path),
        command="softops bench sort --tiny",
        log=lines.append,
    )
    assert paths["jsonl"] == tmp_path / "sort-quick.jsonl"
    assert paths["md"] == tmp_path / "sort-quick.md"
    for path in paths.values():
        assert path.exists() and path.stat().st_size > 0
    assert paths["md"].read_text(encoding="utf-8") == report
    assert "| torch.sort | 1.00× |" in report and "`softops bench sort --tiny`" in report
    records = [json.loads(line) for line in paths["jsonl"].read_text().splitlines()]
    assert {r["group"] for r in records} == {"grid"}
    assert {(r["B"], r["n"]) for r in records} == {(1, 16)}
    by: dict[str, Any] = {r["case"]: r for r in records}
    for name in ("torch.sort", "pav sort", "pav rank", "softsort sort", "softsort rank"):
        assert by[name].get("skip") is None, by[name]
        assert by[name]["repeats"] == 1 and by[name]["fwd_ms"] > 0
    assert by["SoftTorch"]["skip"]
    assert lines and str(paths["md"]) in lines[-1]
