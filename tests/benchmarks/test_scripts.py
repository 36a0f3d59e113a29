"""Smoke tests of the experiments under benchmarks/ (tiny runs) and of the command lines of the
suites (their ``--help``)."""

from __future__ import annotations

import importlib.util
import math
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("suite", ["topk", "sort", "smooth", "layers", "topk-l1"])
def test_every_suite_runs_as_python_m_benchmarks(
    suite: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["benchmarks", suite, "--help"])
    monkeypatch.delitem(sys.modules, "benchmarks.__main__", raising=False)  # run afresh
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0
    assert f"usage: python -m benchmarks {suite} [-h]" in capsys.readouterr().out


def test_python_m_benchmarks_runs_from_the_repository_root(tmp_path: Path) -> None:
    import os
    import subprocess

    import softops

    command = [sys.executable, "-m", "benchmarks", "topk-l1", "--batch", "2", "--n", "20"]
    command += ["--k", "2", "--epsilons", "0.5", "--samples", "4", "--out", str(tmp_path)]
    # the softops this process imports (the checkout's src/ or the installed one)
    env = {**os.environ, "PYTHONPATH": str(Path(softops.__file__).parents[1])}
    done = subprocess.run(
        command, cwd=BENCHMARKS.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "Reproduce with `python -m benchmarks topk-l1 --batch 2" in done.stdout
    assert (tmp_path / "topk-l1.md").exists()


def test_topk_beam_runs_as_a_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["benchmarks.topk_beam", "--help"])
    monkeypatch.delitem(sys.modules, "benchmarks.topk_beam", raising=False)  # run afresh
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("benchmarks.topk_beam", run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0


@pytest.fixture(scope="module")
def f1_example():
    pytest.importorskip("sklearn")
    return _load("f1_finetune")


@pytest.fixture(scope="module")
def quick_run(f1_example, tmp_path_factory):
    out = tmp_path_factory.mktemp("f1") / "f1_finetune.md"
    return f1_example.main(["--quick", "--out", str(out)]), out


def test_f1_finetune_default_output_is_the_committed_table(f1_example):
    assert f1_example.DEFAULT_OUT == BENCHMARKS / "results" / "f1_finetune.md"
    assert f1_example.DEFAULT_OUT.exists()


def test_f1_finetune_quick_reports_every_arm(f1_example, quick_run):
    result, _ = quick_run
    seeds = f1_example.QUICK["seeds"]
    assert set(result["f1"]) == {*f1_example.ARMS, "constant"}
    for arm, values in result["f1"].items():
        assert len(values) == seeds, arm
        assert all(0.0 <= v <= 1.0 and math.isfinite(v) for v in values), arm
    # Digit 8 is 9.7 % of the data: always predicting "positive" scores F1 = 2p / (1 + p) ~ 0.18.
    assert result["mean_f1"]["constant"] == pytest.approx(0.177, abs=0.01)
    # Even the tiny run learns something: cross-entropy beats the constant predictor on every seed.
    assert all(
        ce > const for ce, const in zip(result["f1"]["ce"], result["f1"]["constant"], strict=True)
    )
    for d in result["paired"].values():
        assert d["better"] + d["equal"] + d["worse"] == seeds
    f1 = result["f1"]
    diffs = [b - a for a, b in zip(f1["ce"], f1["ce+f1"], strict=True)]
    assert result["paired"]["(b) - (a)"]["per_seed"] == pytest.approx(diffs)


def test_f1_finetune_writes_the_table(f1_example, quick_run):
    result, out = quick_run
    assert result["out"] == out
    text = out.read_text()
    assert text == text.split("### ")[0] + result["markdown"] + "\n"
    assert "Written by `benchmarks/f1_finetune.py`" in text
    for label in f1_example.ARM_LABELS.values():
        assert f"| {label} |" in text
    assert "python benchmarks/f1_finetune.py --quick --out" in text
    assert "torch " in text


def test_f1_finetune_without_finetuning_is_the_ce_arm(f1_example):
    # The arms share init, data order and epoch budget: with no fine-tune epochs, (b) is (a).
    result = f1_example.main(["--quick", "--seeds", "1", "--finetune-frac", "0"])
    assert result["out"] is None
    assert result["f1"]["ce+f1"] == result["f1"]["ce"]


def test_spearman_epsilon_experiment_runs(tmp_path):
    experiment = _load("spearman_epsilon")
    out = tmp_path / "spearman_epsilon.md"
    text = experiment.main(["--seeds", "1", "--steps", "3", "--sizes", "10", "--out", str(out)])
    assert out.read_text() == text
    row = next(line for line in text.splitlines() if line.startswith("| 10 |"))
    assert row.count("±") == len(experiment.MODES)


# ----------------------------------------------------------------- benchmarks/attention.py


@pytest.fixture(scope="module")
def attention_bench():
    return _load("attention")


def test_attention_problems_target_is_the_mean_of_the_top4_values(attention_bench):
    import torch

    q, x, v, target = attention_bench.problems(3, 10, torch.Generator().manual_seed(0))
    for b in range(3):
        scores = x[b] @ q[b, 0]
        best = sorted(range(10), key=lambda i: -float(scores[i]))[:4]
        torch.testing.assert_close(target[b], v[b, best].mean(0))


def test_attention_hard_topk_arm_gives_no_gradient_to_the_selection(attention_bench):
    import torch

    layer = attention_bench.Layer("hard-topk", 0.1)
    q, x, v, target = attention_bench.problems(4, 12, torch.Generator().manual_seed(1))
    (layer(q, x, v) - target).square().sum().backward()
    assert layer.wq.weight.grad is None or not layer.wq.weight.grad.any()
    assert layer.wv.weight.grad.abs().sum() > 0
    soft = attention_bench.Layer("topk-mean", 0.1)
    (soft(q, x, v) - target).square().sum().backward()
    assert soft.wq.weight.grad.abs().sum() > 0


def test_attention_quick_run_reports_every_arm_and_n(attention_bench, tmp_path):
    arms = ["topk-mean", "softmax", "hard-topk"]
    result = attention_bench.main(["--quick", "--arms", *arms, "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # --quick writes no files
    rows = result["rows"]
    assert [(r["arm"], r["seed"]) for r in rows] == [
        (a, s) for a in arms for s in range(attention_bench.QUICK["seeds"])
    ]
    for r in rows:
        assert set(r["relative_mse"]) == set(attention_bench.TEST_NS)
        assert all(math.isfinite(m) and m > 0 for m in r["relative_mse"].values())


# ----------------------------------------------------------------------- benchmarks/moe.py


@pytest.fixture(scope="module")
def moe_bench():
    return _load("moe")


def test_moe_task_is_each_clusters_linear_map(moe_bench):
    import torch

    task = moe_bench.Task(0)
    x, y = task.sample(4000, torch.Generator().manual_seed(0))
    nearest = torch.cdist(x, task.centres).argmin(-1)
    clean = (task.w[nearest] * x).sum(-1) + task.b[nearest]
    # most samples are nearest their own centre; there the residual is the 0.1 noise
    assert (y - clean).abs().lt(0.5).float().mean() > 0.9


def test_moe_quick_run_reports_every_arm(moe_bench, tmp_path):
    result = moe_bench.main(["--quick", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())
    rows = result["rows"]
    assert [(r["arm"], r["seed"]) for r in rows] == [
        (a, s) for a in moe_bench.ARMS for s in range(moe_bench.QUICK["seeds"])
    ]
    for r in rows:
        assert math.isfinite(r["test_mse"]) and 0 <= r["load_entropy"] <= math.log(8) + 1e-6
        assert abs(sum(r["load"]) - 1) < 1e-5


@pytest.fixture(scope="module")
def beam_bench():
    return _load("beam")


@pytest.mark.parametrize("delay", [1, 2])
def test_beam_task_reveals_each_high_bit_late(beam_bench, delay):
    import torch

    obs, target = beam_bench.make_batch(torch.Generator().manual_seed(0), 256, delay)
    t_len = beam_bench.T
    assert obs.shape == target.shape == (256, t_len + 1)
    y = target[:, :t_len]
    assert bool((target[:, t_len] == beam_bench.EOS).all()) and int(y.max()) < 8
    low, h1, h2 = obs // 9, (obs // 3) % 3, obs % 3
    assert torch.equal(low[:, :t_len], y % 4) and bool((low[:, t_len] == 4).all())
    assert bool((h1[:, :delay] == 2).all())  # nothing revealed yet
    assert torch.equal(h1[:, delay:], (y // 4)[:, : t_len + 1 - delay])
    assert torch.equal(h2[:, t_len], y[:, -1] // 4 if delay == 2 else torch.full((256,), 2))
    assert bool((h2[:, :t_len] == 2).all())


def test_beam_quick_run_reports_every_arm_and_merges(beam_bench, tmp_path):
    import json

    result = beam_bench.main(["--quick", "--arms", "tf", "soft_topk", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # --quick writes nothing
    assert [r["arm"] for r in result["runs"]] == ["tf", "soft_topk"]
    for r in result["runs"]:
        assert 0.0 <= r["test_exact_match"] <= 1.0 and r["steps"] > 0 and r["curve"]
    parts = []
    for seed in (0, 1):
        part = dict(result, runs=[dict(r, seed=seed) for r in result["runs"]])
        path = tmp_path / f"part{seed}.json"
        path.write_text(json.dumps(part))
        parts.append(str(path))
    merged = beam_bench.main(["--merge", *parts, "--out", str(tmp_path / "merged")])
    assert [(r["arm"], r["seed"]) for r in merged["runs"]] == [
        ("tf", 0),
        ("tf", 1),
        ("soft_topk", 0),
        ("soft_topk", 1),
    ]
    assert (tmp_path / "merged" / "beam-k2-d1.md").exists()


def test_layers_suite_quick_run(tmp_path):
    from benchmarks.layers import build_configs, run

    assert [c.group for c in build_configs(quick=True)] == ["attention", "router", "beam"]
    assert [c.group for c in build_configs(groups=["beam"])] == ["beam"] * 3
    with pytest.raises(ValueError, match="unknown groups"):
        build_configs(groups=["mlp"])
    report, paths = run(quick=True, out=tmp_path, sizes=[16], log=lambda _: None)
    assert set(paths) >= {"jsonl", "md"}
    for row in (
        "nn.MultiheadAttention",
        "TopKAttention mean",
        "torch.topk router",
        "TopKRouter hard",
        "torch.topk beam step",
        "beam_step soft_topk",
        "beam_step softmax",
    ):
        assert f"| {row} |" in report


def test_layers_beam_cases_select_what_the_hard_step_selects():
    import torch

    from benchmarks.layers import SUITE, _beam_scores, build_configs

    (config,) = [c for c in build_configs(quick=True) if c.group == "beam"]
    x = SUITE.make_input(
        config, device=torch.device("cpu"), dtype=torch.float32, generator=torch.Generator()
    )
    assert x.shape == (64, 2, 9)
    torch.testing.assert_close(x.exp().sum(-1), torch.ones(64, 2))  # log-probabilities
    hard, soft, softmax = SUITE.make_cases(config)
    assert hard.floor and not soft.floor and not softmax.floor
    cand = (_beam_scores(config).unsqueeze(-1) + x).flatten(-2)
    torch.testing.assert_close(hard.fn(x), cand.topk(2, -1).values, rtol=0, atol=0)
    for case in (soft, softmax):
        w = case.fn(x)
        assert w.shape == (64, 2, 18)
        torch.testing.assert_close(w.sum(-1), torch.ones(64, 2))
    w = softmax.fn(x)
    torch.testing.assert_close(w[:, 0], w[:, 1], rtol=0, atol=0)  # rank-blind


def test_write_experiment_writes_the_record_and_the_table(tmp_path):
    import json

    import torch

    from benchmarks.report import write_experiment

    paths = write_experiment(tmp_path / "out", "demo", {"rows": [1, 2]}, ["# t", "", "| a |"])
    assert set(paths) == {"json", "md"}
    record = json.loads(paths["json"].read_text())
    assert record["rows"] == [1, 2] and record["torch"] == torch.__version__ and record["machine"]
    assert paths["md"].read_text() == "# t\n\n| a |"


# ---------------------------------------------------------------- benchmarks/distributed.py


def test_distributed_benchmark_tiny_run(tmp_path):
    import json
    import subprocess

    command = [sys.executable, str(BENCHMARKS / "distributed.py"), "--B", "2", "--n", "64"]
    command += ["--k", "3", "--worlds", "1", "2", "--repeats", "1", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "distributed.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["world"], r["case"]) for r in records] == [
        (1, "sharded"),
        (1, "all-gather"),
        (2, "sharded"),
        (2, "all-gather"),
    ]
    for r in records:
        assert r["max_abs_diff"] < 1e-5 and r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0
    one, _, two, gather = records
    assert one["fwd_collectives"] == 0 and one["fwdbwd_collectives"] == 0  # a world of one
    # the header, the start and one all-reduce per evaluation; one in the backward
    assert two["fwd_collectives"] == 2 + two["iterations"]
    assert two["fwdbwd_collectives"] - two["fwd_collectives"] == 1
    assert gather["fwd_collectives"] == 1 and gather["fwd_bytes"] == 2 * 32 * 4
    assert "| 2 | sharded |" in (tmp_path / "distributed.md").read_text()


def test_distributed_benchmark_results_are_committed():
    text = (BENCHMARKS / "results" / "distributed.md").read_text()
    assert "python benchmarks/distributed.py" in text
    for world in (1, 2, 4):
        assert f"| {world} | sharded |" in text and f"| {world} | all-gather |" in text


def test_overhead_measures_and_reports_each_case():
    overhead = _load("overhead")
    records = overhead.measure(1, 2, ot_shapes=[(2, 30)], sort_shapes=[(1, 20)])
    ot = records[0]
    assert ot["case"] == "ot" and (ot["B"], ot["n"]) == (2, 30)
    assert all(ot[key] > 0 for key in ("floor", "forward", "forward+backward"))
    report = overhead._report({"1": records}, "python benchmarks/overhead.py --rounds 1")
    assert "| 1 | 2 | 30 |" in report
    assert "`python benchmarks/overhead.py --rounds 1`" in report
    sort_rows = [r for r in records if r["case"] in ("soft_rank", "soft_sort")]
    try:
        import torchsort  # noqa: F401
    except ImportError:
        assert sort_rows == [] and "torchsort" not in report
    else:
        assert [r["case"] for r in sort_rows] == ["soft_rank", "soft_sort"]
        assert "| 1 | soft_rank | 1 | 20 |" in report


# ----------------------------------------------------------------- benchmarks/layer_targets.py


def test_layer_targets_writes_its_table(tmp_path: Path) -> None:
    import torch

    out = tmp_path / "layer_targets.md"
    threads = torch.get_num_threads()
    try:
        assert _load("layer_targets").main(["--out", str(out), "--calls", "2"]) == 0
    finally:
        torch.set_num_threads(threads)  # (the script runs at one thread)
    text = out.read_text()
    for row in ("causal TopKAttention / nn.MultiheadAttention", "TopKRouter / softmax top-2"):
        line = next(x for x in text.splitlines() if x.startswith(f"| {row}"))
        ratio = float(line.split("|")[4].strip().rstrip("x"))
        assert math.isfinite(ratio) and ratio > 0
    assert "| `beam_step` (B=64, K=2, V=9) |" in text


@pytest.fixture(scope="module")
def lm_study():
    return _load("lm_study")


def test_lm_study_corpus_holds_out_every_tenth_file(lm_study):
    train, test, info = lm_study.corpus()
    files = info["files"]["train"] + info["files"]["test"]
    assert info["files"]["test"] == -(-files // 10)  # indices 0, 10, 20, ...
    assert (len(train), len(test)) == (info["bytes"]["train"], info["bytes"]["test"])
    assert "__future__.py" in info["test_files"]  # the first file in name order is held out
    assert int(train.min()) >= 0 and int(train.max()) < 256
    again = lm_study.corpus()[2]
    assert again["sha256"] == info["sha256"]  # rebuilt identically


@pytest.mark.parametrize("router", ["plain", "router"])
def test_lm_study_moe_equals_the_dense_mixture(lm_study, router):
    import torch

    torch.manual_seed(0)
    moe = lm_study.MoE(16, router)
    x = torch.randn(3, 5, 16)
    out = moe(x)
    flat = x.reshape(-1, 16)
    if router == "router":
        weights = moe.router(flat).weights
    else:
        weights = moe.router(flat)[0]
    assert int((weights > 0).sum(-1).max()) <= lm_study.ROUTE_K
    dense = sum(weights[:, e, None] * expert(flat) for e, expert in enumerate(moe.experts))
    torch.testing.assert_close(out, dense.reshape(3, 5, 16))
    assert float(moe.slots.sum()) == 15 * lm_study.ROUTE_K


def test_lm_study_quick_run(lm_study, capsys):
    assert lm_study.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for row in ("| mha |", "| soft-k8 |", "| plain |", "| router |"):
        assert row in out


def test_ranking_epsilon_quick_run(capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("scipy")
    assert _load("ranking_epsilon").main(["--quick"]) == 0
    out = capsys.readouterr().out
    for section in ("## diabetes", "## breast_cancer", "## digits", "| c=3 |"):
        assert section in out


# ------------------------------------------------- benchmarks/moe_dispatch.py, soft_vs_hard.py


def test_moe_dispatch_times_both_arms_of_the_same_block() -> None:
    import torch

    threads = torch.get_num_threads()
    try:
        sparse, dense = _load("moe_dispatch").measure(64, 8, 4, 2, calls=1)
    finally:
        torch.set_num_threads(threads)
    assert sparse > 0 and dense > 0


def test_soft_vs_hard_data_is_the_stated_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _load("soft_vs_hard")
    monkeypatch.setattr(module, "ROWS", 50)
    x, y, grades = module._data(20, seed=0)
    assert x.shape == y.shape == grades.shape == (50, 20)
    assert set(grades.unique().tolist()) <= {0.0, 1.0, 2.0, 3.0, 4.0}
    # the grades cut y at its row's quantiles: half the entries are 0, a twentieth 4
    assert (grades == 0).float().mean() == pytest.approx(0.5, abs=0.02)
    assert (grades == 4).float().mean() == pytest.approx(0.05, abs=0.02)


def test_grid_report_names_the_largest_neighbour_jump_and_its_cause() -> None:
    from benchmarks._grid_common import neighbour_jump, ratio_tables

    def record(b: int, n: int, op_s: float, floor_s: float, kind: str) -> dict:
        return {
            "op": "ot", "B": b, "n": n, "threads": "1", "status": "ok", "ratio": op_s / floor_s,
            "median_s": op_s, "floor_s": floor_s, "floor_kind": kind, "rounds": 5,
        }  # fmt: skip

    # the op's time grows smoothly; the floor's jumps 5x between (4, 8) and (4, 32)
    records = [
        record(1, 8, 1.0, 1.0, "sigmoid"),
        record(4, 8, 2.0, 1.0, "hard"),
        record(1, 32, 1.5, 1.0, "sigmoid"),
        record(4, 32, 3.0, 5.0, "hard"),
    ]
    jump, where, pair = neighbour_jump({(r["B"], r["n"]): r["ratio"] for r in records})
    assert jump == pytest.approx(2.0 / 0.6)
    assert pair == ((4, 8), (4, 32)) and where.startswith("B=4, n=8: 2.00 vs B=4, n=32: 0.60")
    text = "\n".join(ratio_tables(records))
    assert "the op's time changed 1.50x and the floor's 5.00x (hard to hard)" in text


def test_grid_round_times_a_short_call_after_an_untimed_one_of_the_same_callable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # (the worker runs as a script beside them)
    worker = _load("_grid_worker")
    settle_s, settle_calls = worker.SETTLE_S, worker.SETTLE_CALLS
    calls: list[str] = []
    readings = {  # a long call, one that settles in 2 calls, and a very short one
        "long": 2 * worker.SETTLE_BELOW_S,
        "mid": settle_s / 2,
        "short": settle_s / (10 * settle_calls),
    }

    def clock(fn):  # a reading per call, the callable's own length
        fn()
        return readings[calls[-1]]

    fns = {name: (lambda name=name: calls.append(name)) for name in readings}
    times: dict[str, list[float]] = {name: [] for name in fns}
    first = {"long": settle_s, "mid": settle_s / 2, "short": settle_s}  # (first: all short)
    worker.timed_round(fns, ["long", "mid", "short"], times, first, clock)
    assert calls == ["long", "long", "mid", "mid", "mid", "short", "short"]
    calls.clear()
    worker.timed_round(fns, ["short", "long", "mid"], times, first, clock)
    assert calls == ["short"] * (settle_calls + 1) + ["long"] + ["mid"] * 3
    assert times == {name: [reading] * 2 for name, reading in readings.items()}


def test_grid_append_replaces_the_first_calls_of_its_ops_and_keeps_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # (grid.py imports its siblings by name)
    grid = _load("grid")

    def record(subject: str, n: int, first_s: float) -> dict:
        return {"subject": subject, "B": 8, "n": n, "threads": "1", "first_s": first_s}

    old = [record("ot", 128, 1.0), record("sparse", 128, 2.0), record("ot", 1000, 3.0)]
    fresh = [record("ot", 128, 0.5), record("ot", 1000, 0.7)]
    merged = grid.merge_first_calls(old, fresh)
    assert sorted((r["subject"], r["n"], r["first_s"]) for r in merged) == [
        ("ot", 128, 0.5), ("ot", 1000, 0.7), ("sparse", 128, 2.0)
    ]  # fmt: skip
