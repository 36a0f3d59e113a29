"""Smoke tests of the benchmark harness, the top-k suite and the CLI, at tiny sizes (< 15 s)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

import softops
from softops.bench import Case, Config, RunOptions, count_saved_bytes, run_suite, write_results
from softops.bench.harness import run_probe
from softops.bench.topk import SUITE, build_configs, unrolled_sorted_topk
from softops.cli import build_parser, main


class TinySuite:
    """A suite of cheap cases that records the order of its calls."""

    ref = "tests.test_bench:TINY"  # the tests below run it with the subprocess probes off
    name = "tiny"
    floor_label = "torch.topk(x, 2).values"
    plot_group = "grid"
    plot_x = "n"

    def __init__(self, slow_s: float = 0.0) -> None:
        self.calls: list[str] = []
        self.slow_s = slow_s

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

    def _traced(self, name: str, fn: Any) -> Any:
        def call(x: torch.Tensor) -> torch.Tensor:
            self.calls.append(name)
            return fn(x)

        return call

    def make_cases(self, config: Config) -> list[Case]:
        def slow(x: torch.Tensor) -> torch.Tensor:
            time.sleep(self.slow_s)
            return x * 2

        def broken(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

        return [
            Case("floor", self._traced("floor", lambda x: torch.topk(x, 2).values), floor=True),
            Case("exp", self._traced("exp", lambda x: (2 * x).exp())),
            Case("slow", self._traced("slow", slow)),
            Case("broken", broken),
            Case("absent", lambda x: x, skip="not installed"),
        ]

    def compare(self, config: Config, outputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {"n_outputs": len(outputs)}

    def summary(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        return ["### Targets", "", "- tiny summary line"]


TINY = TinySuite()


def _configs() -> list[Config]:
    return [Config("grid", {"B": 2, "n": n}) for n in (16, 32)]


def _options(**kwargs: Any) -> RunOptions:
    # Keep this process's thread count: an explicit torch.set_num_threads slows tiny ops in the
    # tests that run after these on a busy machine. The CLI sets 1 thread in its own process.
    kwargs = {"min_repeats": 1, "memory": False, "first_call": False, **kwargs}
    return RunOptions(threads=torch.get_num_threads(), **kwargs)


def test_run_suite_records_and_files(tmp_path: Any) -> None:
    suite = TinySuite()
    records = run_suite(suite, _configs(), _options(repeats=3), log=lambda line: None)
    assert len(records) == 10
    by = {(r["n"], r["case"]): r for r in records}
    floor = by[(16, "floor")]
    assert floor["fwd_ratio"] == pytest.approx(1.0)
    exp = by[(16, "exp")]
    assert exp["repeats"] == 3 and len(exp["fwdbwd_ms_samples"]) == 3
    assert exp["fwd_ratio"] == pytest.approx(exp["fwd_ms"] / floor["fwd_ms"])
    assert exp["fwdbwd_ratio"] == pytest.approx(exp["fwdbwd_ms"] / floor["fwd_ms"])
    assert exp["saved_mb"] == pytest.approx(2 * 16 * 4 / 2**20)  # exp saves its output
    assert exp["threads"] == torch.get_num_threads()
    assert exp["torch"] == torch.__version__ and exp["device"] == "cpu"
    assert exp["n_outputs"] == 3
    assert by[(16, "broken")]["skip"].startswith("error: RuntimeError: boom")
    assert by[(32, "absent")]["skip"] == "not installed"

    paths = write_results(records, suite, tmp_path, "tiny", command="softops bench tiny")
    lines = paths["jsonl"].read_text().splitlines()
    assert len(lines) == 10 and json.loads(lines[0])["case"] == "floor"
    md = paths["md"].read_text()
    assert "| method | fwd × floor | fwd+bwd × floor |" in md
    assert "- broken: error: RuntimeError: boom" in md and "tiny summary line" in md
    assert "`softops bench tiny`" in md
    pytest.importorskip("matplotlib")
    assert paths["png"].stat().st_size > 0


def test_repeats_are_interleaved_round_robin() -> None:
    suite = TinySuite()
    run_suite(suite, _configs()[:1], _options(repeats=4), log=lambda line: None)
    calls = list(suite.calls)
    # warm-up: forward, forward+backward (draws g), per case; then each repeat: fwd, fwd+bwd.
    timed = calls[6:]
    per_repeat = [timed[i : i + 6] for i in range(0, len(timed), 6)]
    assert len(per_repeat) == 4
    assert per_repeat[0] == ["floor", "floor", "exp", "exp", "slow", "slow"]
    assert per_repeat[1] == ["slow", "slow", "exp", "exp", "floor", "floor"]  # order alternates


def test_too_slow_case_is_skipped_here_and_at_larger_sizes() -> None:
    suite = TinySuite(slow_s=0.05)
    records = run_suite(
        suite, _configs(), _options(repeats=2, time_budget_s=0.02), log=lambda line: None
    )
    slow = [r for r in records if r["case"] == "slow"]
    assert slow[0]["skip"].startswith("too slow: one forward took")
    assert slow[1]["skip"] == slow[0]["skip"]
    assert "slow" not in suite.calls[suite.calls.index("floor", 3) :]  # never called again


def test_count_saved_bytes_excludes_the_input() -> None:
    x = torch.randn(3, 5, requires_grad=True)
    _, saved = count_saved_bytes(torch.sin, x)  # sin saves only its input
    assert saved == 0
    out, saved = count_saved_bytes(lambda t: (t * 3).exp(), x)
    assert saved == out.numel() * out.element_size()


def test_unrolled_sorted_topk_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 12, generator=gen, dtype=torch.float64)
    values, weights = unrolled_sorted_topk(x, 3, epsilon=0.3, n_iter=200)
    assert values.shape == (3, 3) and weights.shape == (3, 3, 12)
    assert torch.allclose(weights.sum(-1), torch.ones(3, 3, dtype=torch.float64))
    assert (values - torch.topk(x, 3).values).abs().max() < 0.2
    if hasattr(softops, "soft_topk"):  # converged, the reference solves the same problem
        ref = softops.soft_topk(x, 3, epsilon=0.3)
        assert (values - ref.values).abs().max() < 1e-8
        assert (weights - ref.weights).abs().max() < 1e-8


def test_memory_probe_and_lean_core_import() -> None:
    # Two fresh interpreters, run side by side: `import softops` pulls in neither the harness
    # nor its optional dependencies, and the memory probe works in a subprocess.
    code = (
        "import sys, softops; "
        "bad = [m for m in sys.modules if m.startswith(('softops.bench', 'softops.cli', "
        "'matplotlib', 'rich'))]; "
        "assert not bad, bad"
    )
    lean = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    config = Config("grid", {"B": 2, "n": 1000, "k": 10, "epsilon": 0.1})
    result = run_probe("memory", SUITE, config, "torch.topk", RunOptions())
    _, lean_err = lean.communicate(timeout=120)
    assert lean.returncode == 0, lean_err
    assert "error" not in result, result
    assert result["peak_mb"] >= 0.0
    assert result["saved_mb"] == pytest.approx(2 * 10 * 8 / 2**20)  # the int64 indices


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


def test_max_group_cases_agree_with_the_hard_ops() -> None:
    config = Config("max", {"B": 3, "n": 40, "k": 1, "epsilon": 1e-3})
    cases = {case.name: case for case in SUITE.make_cases(config)}
    assert cases["torch.amax"].floor
    x = torch.stack([torch.randperm(40) for _ in range(3)]).double() / 10  # gaps of 100 eps
    assert torch.allclose(cases["smooth_max"].fn(x), x.amax(-1), atol=1e-2)
    assert torch.equal(cases["soft_argmax"].fn(x).round(), x.argmax(-1).double())
    onehot = torch.nn.functional.one_hot(x.argmax(-1), 40).double()
    for name in ("soft_argmax_onehot", "ot (eager)", "softkmax", "perturbed-100"):
        assert torch.allclose(cases[name].fn(x), onehot, atol=1e-3), name


def test_topk_l1_sweep_records_and_files(tmp_path: Any) -> None:
    from softops.bench.topk_l1 import l1_to_hard, write_l1

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
    paths = write_l1(records, tmp_path, command="softops bench topk-l1")
    text = paths["md"].read_text(encoding="utf-8")
    assert "### k = 1" in text and "### k = 3" in text and "| soft_argmax_onehot |" in text
    assert "`softops bench topk-l1`" in text
    assert len(paths["jsonl"].read_text(encoding="utf-8").splitlines()) == len(records)
    assert paths["png"].stat().st_size > 0


def test_cli_bench_topk_l1(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "topk-l1", "--batch", "2", "--n", "20", "--k", "2", "--epsilons", "0.5"]
    assert main([*argv, "--samples", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| ot |" in out and "| perturbed-4 |" in out and "ε=0.5" in out
    assert main([*argv[:-4], "--k", "30", "--out", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "topk-l1", "--epsilons", "0"])


def test_cli_bench_topk_quick(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "topk", "--quick", "--sizes", "300", "--batch", "2", "--repeats", "1"]
    argv += ["--threads", str(torch.get_num_threads()), "--no-speedup", "--no-sorted"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| torch.topk | 1.00× |" in out
    assert (tmp_path / "topk-quick.jsonl").exists() and (tmp_path / "topk-quick.md").exists()


def test_cli_demo_without_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert "epsilon=0.01" in out and "Gradient" in out


@pytest.mark.parametrize(
    "argv",
    [["bench", "topk", "--sizes", "0"], ["bench", "topk", "--threads", "0"], ["bench"], []],
)
def test_cli_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def test_optional_dependencies_missing(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without rich the demo prints a plain table; without matplotlib no PNG is written.
    for name in ("rich", "rich.console", "rich.table", "matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["demo", "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert "hard (torch.topk)" in out and "┃" not in out
    records = run_suite(TinySuite(), _configs()[:1], _options(repeats=1), log=lambda line: None)
    paths = write_results(records, TINY, tmp_path, "tiny")
    assert set(paths) == {"jsonl", "md"}


def test_paper_sinkhorn_reference_equals_library_ops() -> None:
    from softops.bench.topk import paper_sinkhorn_topk_mask

    x = torch.randn(3, 40, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 40, dtype=torch.float64)
    paper = paper_sinkhorn_topk_mask(x, 6, epsilon=0.3, n_iter=200)
    lib = softops.soft_topk_mask(x, 6, epsilon=0.3, method="sinkhorn", max_iter=200, tol=0)
    torch.testing.assert_close(paper, lib, atol=1e-12, rtol=0)
    converged = paper_sinkhorn_topk_mask(x, 6, epsilon=0.3, n_iter=3000)
    ot = softops.soft_topk_mask(x, 6, epsilon=0.3)
    torch.testing.assert_close(converged, ot, atol=1e-12, rtol=0)
    (gp,) = torch.autograd.grad(converged, x, g)
    (go,) = torch.autograd.grad(ot, x, g)
    torch.testing.assert_close(gp, go, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------------------------
# The sort suite (softops bench sort)


def test_sort_configs_and_cases() -> None:
    from softops.bench.sort import SUITE as SORT
    from softops.bench.sort import build_configs as sort_configs

    configs = sort_configs(sizes=[100_000, 1_000])
    grid = [c for c in configs if c.group == "grid"]
    assert [c.params["n"] for c in grid] == [1_000, 100_000]
    assert {c.group for c in configs} == {"grid", "vs", "dense", "memory"}
    assert [(c.params["B"], c.params["n"]) for c in configs if c.group == "vs"] == [
        (1, 4_000),
        (8, 4_000),
    ]
    memory = next(c for c in configs if c.group == "memory")
    assert (memory.params["B"], memory.params["n"]) == (8, 100_000)
    names = {case.name: case for case in SORT.make_cases(grid[0])}
    assert next(iter(names)) == "torch.sort" and names["torch.sort"].floor
    for name in ("pav sort", "pav rank", "torchsort sort", "torchpsort rank", "softsort rank"):
        assert name in names
    assert names["neuralsort sort"].skip is None  # B=64, n=1e3 fits
    big = {case.name: case for case in SORT.make_cases(grid[1])}
    assert big["neuralsort sort"].skip is not None  # O(n²) at n=1e5: skipped
    assert big["SoftTorch"].skip is not None
    mem = {case.name: case for case in SORT.make_cases(memory)}
    assert mem["softsort values+ranks"].skip is None


def test_sort_cases_agree_on_a_tiny_input() -> None:
    from softops.bench.sort import SUITE as SORT

    x = torch.randn(2, 40, generator=torch.Generator().manual_seed(0))  # float32, as benched
    outputs = {}
    for group in ("grid", "dense", "vs"):
        config = Config(group, {"B": 2, "n": 40, "epsilon": 1.0})
        for case in SORT.make_cases(config):
            if case.skip is None:
                with case.context():
                    outputs[case.name] = case.fn(x)
    assert outputs["softsort values+ranks"].shape == (2, 2, 40)  # values and ranks, stacked
    facts = SORT.compare(Config("grid", {"B": 2, "n": 40, "epsilon": 1.0}), outputs)
    for key, value in facts.items():  # the peers present solve the same problems
        if "vs_floor" not in key:
            assert value < 1e-3, (key, value)
    if "torchsort sort" in outputs:
        assert "max_abs_diff_pav_vs_torchsort_sort" in facts
    if "difftopk.SoftSort (dense)" in outputs:
        assert facts["max_abs_diff_softsort_vs_difftopk"] < 1e-3


def test_sort_peers_skipped_when_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    from softops.bench.sort import SUITE as SORT

    for name in ("torchsort", "torchpsort", "difftopk"):
        monkeypatch.setitem(sys.modules, name, None)
    rows = {}
    for group in ("grid", "dense"):
        config = Config(group, {"B": 2, "n": 50, "epsilon": 1.0})
        rows.update({case.name: case for case in SORT.make_cases(config)})
    for name in ("torchsort sort", "torchpsort rank", "difftopk.NeuralSort (dense)"):
        assert rows[name].skip is not None and "not installed" in rows[name].skip
    assert rows["pav sort"].skip is None


def test_cli_bench_sort_quick(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "sort", "--quick", "--sizes", "200", "--batch", "2", "--repeats", "1"]
    argv += ["--threads", str(torch.get_num_threads()), "--no-vs", "--no-dense"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| torch.sort | 1.00× |" in out and "### Targets" in out
    assert "softsort values+ranks fwd+bwd at B=2, n=10000" in out  # the quick memory config
    lines = (tmp_path / "sort-quick.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert {r["group"] for r in records} == {"grid", "memory"}
    assert (tmp_path / "sort-quick.md").exists()


def test_l1_methods_markdown_and_plot_directly(tmp_path: Any) -> None:
    from softops.bench.topk_l1 import l1_markdown, l1_methods, plot_l1

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
    assert plot_l1(records, tmp_path / "l1.png") and (tmp_path / "l1.png").stat().st_size > 0
    assert not plot_l1([], tmp_path / "none.png")
