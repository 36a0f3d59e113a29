"""The kernel layer (softops._kernels): operators of torch's registry with the reference beside
the kernel, the back-end switch, the per-user build cache and the fallback without a build."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import softops
from softops import _kernels
from softops._kernels import Kernel, backend
from softops.topk import _ot, _sparse
from tests._helpers import built_ops

F64 = torch.float64


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_backend_switches_and_restores_and_refuses_unknown_names():
    assert _kernels.kernels_enabled()  # out of the box
    with backend("reference"):
        assert not _kernels.kernels_enabled()
        with backend("kernel"):
            assert _kernels.kernels_enabled()
        assert not _kernels.kernels_enabled()
    assert _kernels.kernels_enabled()
    with pytest.raises(ValueError, match=r"backend: expected one of .*; got 'numba'"):
        with backend("numba"):
            pass


def test_set_compile_is_deprecated_and_chooses_the_back_end():
    with pytest.warns(DeprecationWarning, match="SOFTOPS_KERNELS=0"):
        softops.set_compile(False)
    try:
        assert not _kernels.kernels_enabled()
    finally:
        with pytest.warns(DeprecationWarning):
            softops.set_compile(True)
    assert _kernels.kernels_enabled()
    with pytest.raises(TypeError, match="set_compile: expected a bool; got 1"):
        softops.set_compile(1)  # type: ignore[arg-type]


def test_the_cache_is_per_user_and_keyed_by_source_flags_and_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("SOFTOPS_CACHE_DIR", str(tmp_path))
    source = tmp_path / "probe.cpp"
    source.write_text("// one\n")
    probe = Kernel("softops_probe", source)
    first = probe.path()
    assert first.parent == tmp_path / "kernels" and first.name.startswith("softops_probe-")
    assert probe.path() == first  # deterministic
    source.write_text("// two\n")
    assert probe.path() != first  # the source
    second = probe.path()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert probe.path() != second  # the torch version
    monkeypatch.undo()
    monkeypatch.setenv("SOFTOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "Z VECTOR")
    assert probe.path() != second  # the flags: an unknown capability builds portable code
    capability, flags = _kernels._cpu_flags()
    assert capability == "DEFAULT" and not any(f.startswith("-m") for f in flags)
    monkeypatch.delenv("SOFTOPS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _kernels.cache_dir() == tmp_path / "xdg" / "softops" / "kernels"


def test_a_built_kernel_is_not_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SOFTOPS_CACHE_DIR", str(tmp_path))
    source = tmp_path / "probe.cpp"
    source.write_text("// probe\n")
    probe = Kernel("softops_probe2", source)
    probe.path().parent.mkdir(parents=True)
    probe.path().write_bytes(b"built")

    def no_build(*args, **kwargs):
        raise AssertionError("a build was started")

    monkeypatch.setattr(subprocess, "run", no_build)
    assert probe.build() == probe.path()


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("SOFTOPS_CACHE_DIR", str(tmp_path))
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    with pytest.raises(subprocess.CalledProcessError) as err:
        Kernel("softops_broken", source).build()
    assert "broken.cpp" in err.value.stderr.decode(errors="replace")
    assert not any(p.suffix == ".so" for p in (tmp_path / "kernels").iterdir())


def test_without_a_build_the_reference_runs_after_one_warning(tmp_path):
    # A fresh process with an empty cache: one RuntimeWarning naming the build command, then
    # the torch reference, whose values are the same as the kernel's.
    out = _run(
        """
        import warnings, torch, softops
        from softops._kernels import backend
        x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            a = softops.soft_topk_mask(x, 10, epsilon=0.1)
            b = softops.soft_topk_mask(x, 10, epsilon=0.1)
        messages = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1, messages
        assert "python -m softops._kernels" in messages[0] and "reference" in messages[0]
        with backend("reference"):
            c = softops.soft_topk_mask(x, 10, epsilon=0.1)
        assert torch.equal(a, c) and torch.equal(a, b)
        print("ok")
        """,
        SOFTOPS_CACHE_DIR=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_second_process_loads_the_built_kernel_without_building(ops):
    path = _ot.KERNEL.path()
    before = path.stat().st_mtime_ns
    out = _run(
        """
        import time, warnings
        warnings.simplefilter("error")
        import torch
        t0 = time.perf_counter()
        import softops
        t1 = time.perf_counter()
        x = torch.randn(8, 100, requires_grad=True)
        softops.soft_topk_mask(x, 3).sum().backward()
        t2 = time.perf_counter()
        from softops.topk._ot import KERNEL
        assert KERNEL.ops() is not None
        print(t1 - t0, t2 - t1)
        """
    )
    assert out.returncode == 0, out.stderr
    import_s, first_call_s = map(float, out.stdout.split())
    assert path.stat().st_mtime_ns == before  # not rebuilt
    # generous bounds (a busy 2-core machine); the benchmark measures them properly
    assert import_s < 2.0 and first_call_s < 2.0


@pytest.fixture
def ops():
    return built_ops(_ot.KERNEL)


def _threshold_args(dtype):
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(2), dtype=dtype)
    x[1, 3] = math.inf  # a row the kernel leaves to the reference
    k = torch.full((5,), 6.0, dtype=dtype)
    eps = torch.full((5,), 0.3, dtype=dtype)
    return x, k, eps


@pytest.mark.parametrize("name", ["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_the_operators_pass_opcheck_on_either_back_end(name, dtype):
    x, k, eps = _threshold_args(dtype)
    with backend(name):
        torch.library.opcheck(_ot.THRESHOLD_OP.overload, (x, k, eps, 100, 0.0, None, "t"))
        torch.library.opcheck(_ot.THRESHOLD_OP.overload, (x, k, eps, 100, 0.0, 6.0, "t"))
        _, s, aux, edge, scale = _ot.THRESHOLD_OP(x, k, eps, 100, 0.0, None, "t")
        g = torch.randn_like(x)
        torch.library.opcheck(_ot.VJP_OP.overload, (s, aux, g))
        torch.library.opcheck(_sparse.SOLVE_OP, (x, k, eps, 100, "t"))
    assert edge.dtype == torch.int8 and scale.shape == (5,)


def test_the_operators_vmap_as_more_rows():
    x, k, eps = _threshold_args(F64)
    batched = torch.func.vmap(_ot.THRESHOLD_OP, in_dims=(0, None, None, None, None, None, None))
    out = batched(x[None].expand(3, 5, 40), k, eps, 100, 0.0, None, "t")
    want = _ot.THRESHOLD_OP(x, k, eps, 100, 0.0, None, "t")
    for o, w in zip(out, want, strict=True):
        torch.testing.assert_close(o, w.expand(3, *w.shape), equal_nan=True)


class _Built(Kernel):
    """A kernel whose operators are given (no build): the CPU path of `define` without C++."""

    def __init__(self, ops) -> None:
        self._given = self._ops = ops  # (loaded: eager calls take the kernel directly)

    def ops(self):
        return self._given


def test_define_registers_reference_cpu_kernel_fake_and_vmap():
    seen = []

    class Ops:
        @staticmethod
        def twice(x):
            seen.append("kernel")
            return x * 2

    def reference(x):
        seen.append("reference")
        return x + x

    op = _kernels.define(
        "softops_test::twice",
        "(Tensor x) -> Tensor",
        reference=reference,
        fake=lambda x: torch.empty_like(x),
        vmap=lambda info, in_dims, x: (op(x), in_dims[0]),
        cpu=lambda ops, x: ops.twice(x),
        kernel=_Built(Ops),
    )
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(op(x), 2 * x) and seen == ["kernel"]
    with backend("reference"):
        assert torch.equal(op(x), 2 * x) and seen == ["kernel", "reference"]
    assert torch.equal(torch.func.vmap(op)(x), 2 * x)
    assert op(torch.empty(2, 3, device="meta")).shape == (2, 3)  # the fake
    torch.library.opcheck(op.overload, (x,))
    # an eager CPU call takes the kernel without the dispatcher; a traced one the registry
    seen.clear()
    graph = torch.fx.experimental.proxy_tensor.make_fx(op)(x)
    assert "softops_test.twice" in str(graph.graph) and torch.equal(graph(x), 2 * x)


def test_the_build_command_reports_each_kernel(ops, capsys):
    from softops._kernels.__main__ import main

    assert main([]) == 0  # built already: nothing to compile
    out = capsys.readouterr().out
    from softops._core import isotonic
    from softops.topk import _newton, _sorted

    package = (_ot.KERNEL, isotonic.KERNEL, _newton.NEWTON_KERNEL, _sorted.KERNEL)
    for kernel in package:  # every kernel of the package, probes not
        assert f"kernel ready: {kernel.path()}" in out
    assert "softops_probe" not in out
    assert sorted(_kernels.build_all()) == sorted(kernel.path() for kernel in package)
