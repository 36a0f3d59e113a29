"""The suites: the top-k, sort and top-k L1 configurations, cases and runs (tiny sizes)."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch

from benchmarks import Config
from benchmarks import sort as sort_suite
from benchmarks import topk as topk_suite
from benchmarks.sort import numba_threads, run_sort_bench
from benchmarks.topk import SUITE, build_configs, run_topk_bench
from benchmarks.topk_l1 import l1_markdown, l1_methods, l1_to_hard, plot_l1, run_l1_bench
from softops._kernels import backend

# ----------------------------------------------------------------------------------------------
# The top-k suite


def test_topk_configs() -> None:
    configs = build_configs(sizes=[10_000, 1_000])
    grid = [c for c in configs if c.group == "grid"]
    assert [c.params["n"] for c in grid] == [1_000, 10_000]
    assert [c.params["k"] for c in grid] == [10, 100]
    assert [c.first_call for c in grid] == [False, True]
    assert {c.group for c in configs} == {"grid", "speedup", "sorted", "max"}
    names = [case.name for case in SUITE.make_cases(grid[0])]
    assert names[0] == "torch.topk" and "sinkhorn-200" in names
    assert "softkmax" in names and "perturbed-100" in names
    (smooth,) = [c for c in configs if c.group == "max"]
    assert smooth.params["k"] == 1 and smooth.params["n"] == 10_000
    assert {c.group for c in build_configs(sizes=[1_000], smooth=False)} == {
        "grid",
        "speedup",
        "sorted",
    }


def test_softkmax_case_skipped_when_its_backward_would_not_fit() -> None:
    big = Config("grid", {"B": 64, "n": 100_000, "k": 1_000, "epsilon": 0.1})
    cases = {case.name: case for case in SUITE.make_cases(big)}
    assert cases["softkmax"].skip is not None and "k·B·n = 6.4e+09" in cases["softkmax"].skip
    assert cases["perturbed-100"].skip is None


def test_kernel_case_runs_at_every_size_and_is_skipped_on_the_reference() -> None:
    small = Config("grid", {"B": 2, "n": 100, "k": 1, "epsilon": 0.1})
    assert {case.name: case for case in SUITE.make_cases(small)}["ot (kernel)"].skip is None
    with backend("reference"):
        kernel = {case.name: case for case in SUITE.make_cases(small)}["ot (kernel)"]
    assert kernel.skip is not None and "SOFTOPS_KERNELS=0" in kernel.skip


def test_max_group_cases_agree_with_the_hard_ops() -> None:
    config = Config("max", {"B": 3, "n": 40, "k": 1, "epsilon": 1e-3})
    cases = {case.name: case for case in SUITE.make_cases(config)}
    assert cases["torch.amax"].floor
    x = torch.stack([torch.randperm(40) for _ in range(3)]).double() / 10  # gaps of 100 eps
    assert torch.allclose(cases["smooth_max"].fn(x), x.amax(-1), atol=1e-2)
    assert torch.equal(cases["soft_argmax"].fn(x).round(), x.argmax(-1).double())
    onehot = torch.nn.functional.one_hot(x.argmax(-1), 40).double()
    for name in ("soft_argmax_onehot", "ot (reference)", "softkmax", "perturbed-100"):
        assert torch.allclose(cases[name].fn(x), onehot, atol=1e-3), name


def test_run_topk_bench_tiny(tmp_path: Any) -> None:
    lines: list[str] = []
    report, paths = run_topk_bench(
        quick=True,
        threads=torch.get_num_threads(),
        sizes=[64],
        batch=2,
        repeats=1,
        speedup=False,
        sorted_memory=False,
        smooth=False,
        out=str(tmp_path),
        command="python -m benchmarks topk --tiny",
        log=lines.append,
    )
    assert paths["md"] == tmp_path / "topk-quick.md"
    assert paths["md"].read_text(encoding="utf-8") == report
    assert "| torch.topk | 1.00× |" in report and "`python -m benchmarks topk --tiny`" in report
    records = [json.loads(line) for line in paths["jsonl"].read_text().splitlines()]
    assert {(r["group"], r["B"], r["n"], r["k"]) for r in records} == {("grid", 2, 64, 1)}
    assert all(r["repeats"] <= 1 for r in records)
    assert lines and str(paths["md"]) in lines[-1]


def test_topk_quick_defaults() -> None:
    assert topk_suite.QUICK == {
        "sizes": (1_000, 10_000),
        "batch": 16,
        "repeats": 3,
        "time_budget": 3.0,
    }


# ----------------------------------------------------------------------------------------------
# The top-k L1 sweep


def test_topk_l1_sweep_records_and_files(tmp_path: Any) -> None:
    records = l1_to_hard(batch=4, n=30, ks=(1, 3), epsilons=(1.0, 1e-3), n_samples=10)
    methods = {"ot", "sinkhorn-200", "softkmax", "perturbed-10"}
    assert {r["method"] for r in records if r["k"] == 3} == methods
    assert {r["method"] for r in records if r["k"] == 1} == methods | {"soft_argmax_onehot"}
    assert len(records) == 2 * (4 + 5)
    for r in records:
        assert 0 <= r["l1"] <= 2 * r["k"] + 1e-4 and r["nan_rows"] == 0
        assert r["l1_rel"] == pytest.approx(r["l1"] / (2 * r["k"]))
    ot = {r["epsilon"]: r["l1"] for r in records if r["method"] == "ot" and r["k"] == 3}
    assert ot[1e-3] < 1e-2 < ot[1.0]


def test_run_l1_bench_writes_the_files_and_restores_threads(tmp_path: Any) -> None:
    threads = torch.get_num_threads()
    lines: list[str] = []
    text, paths = run_l1_bench(
        batch=2,
        n=20,
        ks=(1, 2),
        epsilons=(0.5,),
        n_samples=4,
        threads=threads,
        out=tmp_path,
        command="python -m benchmarks topk-l1",
        log=lines.append,
    )
    assert torch.get_num_threads() == threads
    assert paths["md"] == tmp_path / "topk-l1.md" and paths["md"].read_text() == text
    assert "### k = 1" in text and "### k = 2" in text and "| soft_argmax_onehot |" in text
    assert "`python -m benchmarks topk-l1`" in text
    assert len(paths["jsonl"].read_text(encoding="utf-8").splitlines()) == 2 * 4 + 1
    assert lines == ["wrote " + ", ".join(str(p) for p in paths.values())]
    pytest.importorskip("matplotlib")
    assert paths["png"].stat().st_size > 0


def test_l1_methods_markdown_and_plot_directly(tmp_path: Any) -> None:
    assert list(l1_methods(3, n_samples=7)) == ["ot", "sinkhorn-200", "softkmax", "perturbed-7"]
    assert "soft_argmax_onehot" in l1_methods(1)
    x = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    for name, fn in l1_methods(2).items():
        mask = fn(x, 0.05)  # gaps of 20 epsilon (sinkhorn-200 would stall far below)
        assert torch.allclose(mask, torch.tensor([[1.0, 0.0, 1.0, 0.0]]), atol=1e-2), name
    base = {"B": 1, "n": 4, "dtype": "float32", "device": "cpu", "torch": "2", "nan_rows": 0}
    records = [
        {**base, "k": 2, "method": "softkmax", "epsilon": 0.1, "l1": 0.5, "max_entry": 1.25},
        {**base, "k": 2, "method": "ot", "epsilon": 0.1, "l1": 0.25, "max_entry": 0.9},
    ]
    text = l1_markdown(records)
    assert "| softkmax | 0.5 (max 1.25) |" in text and "| ot | 0.25 |" in text
    assert "No records" in l1_markdown([])
    assert not plot_l1([], tmp_path / "none.png")
    pytest.importorskip("matplotlib")
    assert plot_l1(records, tmp_path / "l1.png") and (tmp_path / "l1.png").stat().st_size > 0


# ----------------------------------------------------------------------------------------------
# The sort suite


def test_sort_configs_and_cases() -> None:
    configs = sort_suite.build_configs(sizes=[100_000, 1_000])
    grid = [c for c in configs if c.group == "grid"]
    assert [c.params["n"] for c in grid] == [1_000, 100_000]
    assert {c.group for c in configs} == {"grid", "vs", "dense", "memory"}
    assert [(c.params["B"], c.params["n"]) for c in configs if c.group == "vs"] == [
        (1, 4_000),
        (8, 4_000),
    ]
    memory = next(c for c in configs if c.group == "memory")
    assert (memory.params["B"], memory.params["n"]) == (8, 100_000)
    names = {case.name: case for case in sort_suite.SUITE.make_cases(grid[0])}
    assert next(iter(names)) == "torch.sort" and names["torch.sort"].floor
    for name in ("pav sort", "pav rank", "torchsort sort", "torchpsort rank", "softsort rank"):
        assert name in names
    for name in ("pav sort (out of the box)", "pav rank (out of the box)"):
        assert names[name].mode is None  # numba's threads as the library sets them, unpinned
    assert names["neuralsort sort"].skip is None  # B=64, n=1e3 fits
    big = {case.name: case for case in sort_suite.SUITE.make_cases(grid[1])}
    assert big["neuralsort sort"].skip is not None  # O(n²) at n=1e5: skipped
    assert big["SoftTorch"].skip is not None
    mem = {case.name: case for case in sort_suite.SUITE.make_cases(memory)}
    assert mem["softsort values+ranks"].skip is None


def test_sort_cases_agree_on_a_tiny_input() -> None:
    x = torch.randn(2, 40, generator=torch.Generator().manual_seed(0))  # float32, as benched
    outputs = {}
    for group in ("grid", "dense", "vs"):
        config = Config(group, {"B": 2, "n": 40, "epsilon": 1.0})
        for case in sort_suite.SUITE.make_cases(config):
            if case.skip is None:
                with case.context():
                    outputs[case.name] = case.fn(x)
    assert outputs["softsort values+ranks"].shape == (2, 2, 40)  # values and ranks, stacked
    facts = sort_suite.SUITE.compare(Config("grid", {"B": 2, "n": 40, "epsilon": 1.0}), outputs)
    for key, value in facts.items():  # the peers present solve the same problems
        if "vs_floor" not in key:
            assert value < 1e-3, (key, value)
    if "torchsort sort" in outputs:
        assert "max_abs_diff_pav_vs_torchsort_sort" in facts
    if "difftopk.SoftSort (dense)" in outputs:
        assert facts["max_abs_diff_softsort_vs_difftopk"] < 1e-3


def test_sort_peers_skipped_when_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("torchsort", "torchpsort", "difftopk"):
        monkeypatch.setitem(sys.modules, name, None)
    rows = {}
    for group in ("grid", "dense"):
        config = Config(group, {"B": 2, "n": 50, "epsilon": 1.0})
        rows.update({case.name: case for case in sort_suite.SUITE.make_cases(config)})
    for name in ("torchsort sort", "torchpsort rank", "difftopk.NeuralSort (dense)"):
        assert rows[name].skip is not None and "not installed" in rows[name].skip
    assert rows["pav sort"].skip is None


def test_run_sort_bench_tiny(tmp_path: Any) -> None:
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
        command="python -m benchmarks sort --tiny",
        log=lines.append,
    )
    assert paths["jsonl"] == tmp_path / "sort-quick.jsonl"
    assert paths["md"] == tmp_path / "sort-quick.md"
    for path in paths.values():
        assert path.exists() and path.stat().st_size > 0
    assert paths["md"].read_text(encoding="utf-8") == report
    assert "| torch.sort | 1.00× |" in report and "`python -m benchmarks sort --tiny`" in report
    records = [json.loads(line) for line in paths["jsonl"].read_text().splitlines()]
    assert {r["group"] for r in records} == {"grid"}
    assert {(r["B"], r["n"]) for r in records} == {(1, 16)}
    by: dict[str, Any] = {r["case"]: r for r in records}
    for name in ("torch.sort", "pav sort", "pav rank", "softsort sort", "softsort rank"):
        assert by[name].get("skip") is None, by[name]
        assert by[name]["repeats"] == 1 and by[name]["fwd_ms"] > 0
    assert by["SoftTorch"]["skip"]
    assert lines and str(paths["md"]) in lines[-1]


def test_sort_memory_summary_reports_the_block_size() -> None:
    record = {
        "group": "memory",
        "config": "memory B=2 n=10000",
        "case": "softsort values+ranks",
        "B": 2,
        "n": 10_000,
        "fwd_ms": 1.0,
        "saved_mb": 1.0,
        "peak_mb": 10.0,
    }
    (line,) = sort_suite._memory_lines([record])
    assert "target < 256 MB (met)" in line and "BLOCK_ELEMENTS = 1048576 entries" in line
    assert "52 row(s)" in line  # 2**20 // (2 * 10**4)


@pytest.fixture
def numba_mod():
    return pytest.importorskip("numba")


def test_numba_threads_follows_torch_and_restores(numba_mod, monkeypatch) -> None:
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


def test_numba_threads_without_numba(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba -> ImportError
    ran = []
    with numba_threads():
        ran.append(True)
    assert ran == [True]


def test_topk_beam_config_and_cases() -> None:
    (beam,) = [c for c in build_configs(sizes=[1_000], beam=True) if c.group == "beam"]
    assert dict(beam.params) == {"B": 64, "n": 18, "k": 2, "epsilon": 0.5}
    names = [case.name for case in SUITE.make_cases(beam)]
    assert names == ["torch.topk", "soft_topk (sorted)"]
    x = torch.randn(64, 18)
    cases = SUITE.make_cases(beam)
    assert cases[1].fn(x).shape == (64, 2)


def test_run_beam_bench_writes_the_beam_point_alone(tmp_path: Any) -> None:
    report, paths = topk_suite.run_beam_bench(out=str(tmp_path), repeats=3, log=lambda _: None)
    assert set(paths) >= {"jsonl", "md"}
    assert "### beam B=64 n=18 k=2" in report
    assert "| torch.topk |" in report and "| soft_topk (sorted) |" in report
    assert "target ≤ 1 ms" in report
    rows = [json.loads(line) for line in paths["jsonl"].read_text().splitlines() if line]
    assert rows and all(r.get("group", "beam") == "beam" for r in rows if "group" in r)
