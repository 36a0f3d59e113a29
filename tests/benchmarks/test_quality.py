"""The quality sweep: distances to the hard op and gradient cosines against references (tiny)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import softops
from benchmarks import quality
from benchmarks.quality import (
    MASK_L1,
    QualitySpec,
    finite_differences,
    grad_cosine,
    measure_distance,
    quality_markdown,
    run_quality,
    unrolled,
)
from benchmarks.suites import SUITES, expand, quality_spec, run_suite_quality
from benchmarks.topk import quality_methods as topk_methods
from softops.testing import unrolled_sinkhorn_topk_mask


def _x(B: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cos(method: quality.QualityMethod, x: torch.Tensor, eps: float) -> tuple[float, str]:
    g = torch.randn(method.fn(x, eps).shape, generator=torch.Generator().manual_seed(3)).double()
    xr = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((method.fn(xr, eps) * g).sum(), xr)
    assert method.reference is not None
    ref, label = method.reference.grad(x, eps, g)
    cos, zero = grad_cosine(grad, ref)
    assert zero == 0
    return float(cos.min()), label


def test_ot_mask_l1_goes_to_zero_with_epsilon() -> None:
    x = _x(8, 60).float()
    k = 5
    hard = torch.zeros_like(x).scatter(-1, x.topk(k, -1).indices, 1.0)
    (ot,) = [m for m in topk_methods({"k": k}) if m.name == "ot"]
    l1 = [measure_distance(ot.fn, MASK_L1, x, hard, eps)["distance"] for eps in (1, 0.1, 1e-3)]
    assert l1[0] > l1[1] > l1[2] and l1[2] < 0.02 and l1[0] <= 2 * k
    assert measure_distance(ot.fn, MASK_L1, x, hard, 1e-3)["max_entry"] <= 1 + 1e-6


def test_implicit_gradients_match_the_unrolled_reference_when_converged() -> None:
    x = _x(3, 8)
    methods = {m.name: m for m in topk_methods({"k": 3})}
    for name in ("ot", "soft_topk (sorted) weights"):
        cos, label = _cos(methods[name], x, 0.5)
        assert cos > 1 - 1e-8, (name, cos)
        assert label.startswith("unrolled Sinkhorn") and "autograd" in label, label
    sort = {m.name: m for m in quality_spec("sort").methods({})}  # type: ignore[union-attr]
    cos, label = _cos(sort["ot rank"], _x(2, 6), 1.0)
    assert cos > 1 - 1e-8 and "autograd" in label


def test_unrolled_reference_falls_back_to_finite_differences() -> None:
    x, k = _x(2, 6), 2

    def exact(t: torch.Tensor, eps: float) -> torch.Tensor:
        return softops.soft_topk_mask(t, k, epsilon=eps, max_iter=100, tol=0)

    ref = unrolled(
        lambda t, eps, n: unrolled_sinkhorn_topk_mask(t, k, eps, n), exact, "unrolled", cap=256
    )
    g = torch.randn(2, 6, dtype=torch.float64)
    r, label = ref.grad(x, 0.3, g)
    assert "not converged in 256" in label
    fd, _ = finite_differences(exact).grad(x, 0.3, g)
    torch.testing.assert_close(r, fd)
    xr = x.clone().requires_grad_(True)
    (a,) = torch.autograd.grad((exact(xr, 0.3) * g).sum(), xr)
    torch.testing.assert_close(a, r, atol=1e-7, rtol=1e-6)  # FD agrees with the implicit grad


def test_finite_differences_catch_a_wrong_gradient() -> None:
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g  # should be g * cos(x)

    def wrong(x: torch.Tensor, eps: float) -> torch.Tensor:
        return Wrong.apply(x * 3)

    method = quality.QualityMethod(
        "wrong", wrong, lambda x: x, MASK_L1, finite_differences(lambda x, e: (3 * x).sin())
    )
    cos, _ = _cos(method, _x(4, 5), 1.0)
    assert cos < 0.99


def test_run_quality_records_markdown_and_files(tmp_path: Any) -> None:
    def methods(params: Any) -> list[quality.QualityMethod]:
        return [m for m in topk_methods(params) if m.name in ("ot", "softkmax")]

    spec = QualitySpec(
        "top-k", methods, {"B": 3, "n": 30, "k": 3}, {"B": 2, "n": 8, "k": 2}, (1, 0.1)
    )
    records = run_quality(spec)
    assert [(r["method"], r["epsilon"]) for r in records] == [
        ("ot", 1),
        ("ot", 0.1),
        ("softkmax", 1),
        ("softkmax", 0.1),
    ]
    for r in records:
        assert r["status"] == "ok" and 0 <= r["distance"] <= 2 * 3
        assert r["grad_status"] == "ok" and r["grad_cos_mean"] > 1 - 1e-6
    assert records[0]["grad_reference_kind"] == "unrolled"
    assert records[2]["grad_reference"] == "central finite differences (float64)"
    md = quality_markdown(records, title="tiny")
    assert "| ot | mask L1 (of 2k) | units of x |" in md
    assert "### Gradient: cosine to the reference" in md and "| softkmax | central" in md
    text, paths = run_suite_quality("smooth", quick=True, out=tmp_path, threads=None)  # type: ignore[misc]
    assert paths["md"] == tmp_path / "smooth-quick-quality.md" and paths["md"].read_text() == text
    rows = [json.loads(line) for line in paths["jsonl"].read_text().splitlines()]
    assert {r["method"] for r in rows} >= {"smooth_max", "soft_argmax_onehot", "soft_kmax"}
    assert all(r["grad_cos_mean"] > 1 - 1e-6 for r in rows if r.get("grad_cos_mean") is not None)
    if "png" in paths:
        assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_quality_registry() -> None:
    assert SUITES == ("topk", "sort", "smooth", "layers") and expand("all") == SUITES
    with pytest.raises(ValueError, match="expected a suite"):
        expand("nope")
    assert quality_spec("layers") is None
    assert run_suite_quality("layers", out="unused") is None
    for name in ("topk", "sort", "smooth"):
        spec = quality_spec(name, quick=True)
        assert spec is not None and spec.epsilons
