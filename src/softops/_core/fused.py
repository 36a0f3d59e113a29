"""Optional fused (``torch.compile``) versions of the hot loops, with the eager code as reference.

Each hot function is written once, in plain torch, and used as is (the eager reference) or through
``torch.compile`` (the fused path), which turns one Newton evaluation of the top-k threshold into a
single pass over memory instead of about seven.

The fused path is used only when it pays: when compilation is enabled (``SOFTOPS_COMPILE=0`` in the
environment or ``softops.set_compile(False)`` turns it off), the tensor has at least
``FUSED_MIN_NUMEL`` elements, it lives on a CPU or CUDA device, and the caller is not itself being
traced by ``torch.compile`` (the eager code is then traced into the caller's graph instead).
The first call in a process compiles each function: about 20 s on a 2-core CPU (inductor caches
the result on disk, so later processes start faster). If compilation fails (for example, no C++
compiler), softops warns once and stays on the eager path.

:func:`cpp_ops` builds a C++ kernel beside the modules (the CPU threshold solve of method "ot",
``softops/topk/_ot_cpu.cpp``) with ``torch.utils.cpp_extension`` on its first use, for this CPU's
vector capability, and returns its operators; the same switch governs it.
"""

from __future__ import annotations

import importlib
import os
import sysconfig
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "FUSED_MIN_NUMEL",
    "compile_enabled",
    "cpp_ops",
    "kernel_module",
    "maybe_fused",
    "set_compile",
]

FUSED_MIN_NUMEL = 1 << 15
"""Smallest ``numel`` for which the compiled path is used; below it the compile time never pays."""

_state: dict[str, Any] = {
    "enabled": os.environ.get("SOFTOPS_COMPILE", "1").strip().lower() not in {"0", "false", "no"},
    "compiled": {},
    "failed": False,
    "modules": {},
    "cpp": {},
}


def set_compile(enabled: bool) -> None:
    """Turn the fused ``torch.compile`` paths on or off for this process.

    Args:
        enabled: ``True`` to allow the fused paths (the default unless ``SOFTOPS_COMPILE=0``),
            ``False`` to always run the eager reference code.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_compile: expected a bool; got {enabled!r}.")
    _state["enabled"] = enabled


def compile_enabled() -> bool:
    """Whether the fused paths may be used (see :func:`set_compile`)."""
    return bool(_state["enabled"]) and not _state["failed"]


def _use_fused(x: torch.Tensor) -> bool:
    return compile_enabled() and _use_fused_shape(x)


def _use_fused_shape(x: torch.Tensor) -> bool:
    # Tracing first: a traced caller must not get a guard on the size of x (torch.export with a
    # dynamic batch would turn it into a constraint it cannot express).
    return (
        not torch.compiler.is_compiling()
        and not _state["failed"]
        and x.numel() >= FUSED_MIN_NUMEL
        and x.device.type in ("cpu", "cuda")
    )


def maybe_fused(
    fn: Callable[..., Any], x: torch.Tensor, enabled: bool | None = None
) -> Callable[..., Any]:
    """Return the compiled version of ``fn`` when the fused path applies to ``x``, else ``fn``.

    ``enabled`` overrides the global switch (a backward pass uses the choice of its forward).
    """
    if not (_use_fused(x) if enabled is None else enabled and _use_fused_shape(x)):
        return fn
    compiled = _state["compiled"].get(fn)
    if compiled is None:
        compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        _state["compiled"][fn] = compiled

    def call(*args: Any) -> Any:
        try:
            return compiled(*args)
        except Exception as err:  # compilation needs a working toolchain; never fail the op
            _state["failed"] = True
            warnings.warn(
                f"softops: torch.compile failed ({type(err).__name__}: {err}); using the eager "
                "path from now on. Set SOFTOPS_COMPILE=0 to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
            return fn(*args)

    return call


def kernel_module(name: str) -> Any:
    """The numba kernel module ``name`` (imported once, lazily: numba is optional and slow to
    import), or None when it cannot be imported (numba missing, or installed but broken, e.g.
    against an incompatible numpy): the caller then takes its torch path."""
    modules = _state["modules"]
    if name not in modules:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:
            modules[name] = None
    return modules[name]


# Compiler flags per CPU capability (``torch.backends.cpu.get_cpu_capability()``): the vector
# width at::vec is built for. The names of ATen's own dispatch (CPU_CAPABILITY) select its
# implementation; DEFAULT is its portable scalar code.
_CPP_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def _scripts_on_path() -> None:
    """Put this interpreter's scripts directory on PATH, after what is there: cpp_extension
    runs ``ninja`` from PATH, and ``pip install ninja`` puts it there, which is not on PATH when
    a virtual environment's python is run without activating it."""
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    if scripts and scripts not in path.split(os.pathsep):
        os.environ["PATH"] = path + os.pathsep + scripts if path else scripts


def cpp_ops(name: str, source: str, build: bool = True) -> Any:
    """The operators of the C++ source ``source`` (a file beside this package's modules,
    registered with ``TORCH_LIBRARY(name, ...)``) as ``torch.ops.<name>``, built on first use by
    ``torch.utils.cpp_extension`` for this CPU's vector capability (about 25 s on a 2-core CPU,
    once: the build is cached in torch's extensions directory, ``TORCH_EXTENSIONS_DIR``), or None
    when it cannot be built (no C++ compiler, or no ninja: ``pip install ninja``; the caller then
    takes its torch path, and softops warns once). The callers use it only while compilation is
    enabled (:func:`set_compile`)."""
    built = _state["cpp"]
    if name not in built and not build:  # (``build=False``: only what is built already)
        return None
    if name not in built:
        built[name] = None
        try:
            from torch.utils import cpp_extension

            _scripts_on_path()
            capability = torch.backends.cpu.get_cpu_capability()
            flags = _CPP_FLAGS.get(capability)
            defines = [f"-DCPU_CAPABILITY_{capability}"]
            if flags is None:  # at::vec's portable code (e.g. on ARM)
                capability, flags, defines = "DEFAULT", [], []
            cpp_extension.load(
                name=f"{name}_{capability.lower()}",
                sources=[os.path.join(os.path.dirname(os.path.dirname(__file__)), source)],
                # OpenMP: at::parallel_for runs on torch's intra-op threads (the build links
                # libgomp.so.1, which resolves to the one torch has loaded)
                extra_cflags=[
                    "-O3",
                    "-fopenmp",
                    *flags,
                    *defines,
                    f"-DCPU_CAPABILITY={capability}",
                ],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            built[name] = getattr(torch.ops, name)
        except Exception as err:  # a toolchain problem must never fail the op
            warnings.warn(
                f"softops: building the C++ kernel {name} failed ({type(err).__name__}: "
                f"{str(err)[:200]}); using the torch path. Set SOFTOPS_COMPILE=0 to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
    return built[name]
