"""The kernel layer: compiled kernels as operators of torch's own registry, with the torch
reference beside them.

A method declares its operator here once (:func:`define`): a schema, the torch reference, a fake
implementation, a vmap rule, and optionally a CPU implementation that runs a compiled kernel;
torch's dispatcher picks by device, and traced code sees one opaque operator.

Compiled kernels (C++ sources beside their methods) are built ahead of time by ``python -m
softops._kernels`` into a per-user cache (``SOFTOPS_CACHE_DIR``, else ``$XDG_CACHE_HOME/softops``,
else ``~/.cache/softops``), keyed by source, flags, CPU capability, torch and Python ABI. An eager
call never compiles: where no kernel is built it uses the torch reference, after one warning.

:func:`backend` picks the back end for a block of code (tests run every operator through both);
``SOFTOPS_KERNELS=0`` in the environment makes the reference the default.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Kernel",
    "backend",
    "cache_dir",
    "define",
    "kernels_enabled",
    "plain_eager",
    "set_compile",
    "set_default_backend",
]

_BACKENDS = ("kernel", "reference")
_OFF = os.environ.get("SOFTOPS_KERNELS", "1").strip().lower() in {"0", "false", "no"}
_state: dict[str, Any] = {"backend": "reference" if _OFF else "kernel"}


def kernels_enabled() -> bool:
    """Whether the compiled kernels may run (the back end is ``"kernel"``, the default)."""
    return _state["backend"] == "kernel"


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run the enclosed code on the back end ``name``: ``"kernel"`` (the compiled kernels where
    they are built, the default) or ``"reference"`` (the torch code of every method)."""
    previous = _state["backend"]
    _state["backend"] = _check_backend(name, "backend")
    try:
        yield
    finally:
        _state["backend"] = previous


def set_default_backend(name: str) -> None:
    """Make ``name`` the back end of this process (see :func:`backend`)."""
    _state["backend"] = _check_backend(name, "set_default_backend")


def _check_backend(name: str, op: str) -> str:
    if name not in _BACKENDS:
        raise ValueError(f"{op}: expected one of {_BACKENDS}; got {name!r}.")
    return name


def set_compile(enabled: bool) -> None:
    """Deprecated: ``set_compile(False)`` makes the torch reference this process's back end,
    ``set_compile(True)`` the kernels (the default); nothing compiles at call time any more."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_compile: expected a bool; got {enabled!r}.")
    warnings.warn(
        "softops.set_compile is deprecated: softops compiles nothing at call time any more. "
        "Set SOFTOPS_KERNELS=0 in the environment to run the torch reference instead of the "
        "kernels.",
        DeprecationWarning,
        stacklevel=2,
    )
    set_default_backend("kernel" if enabled else "reference")


def cache_dir() -> Path:
    """The per-user folder of built kernels."""
    if root := os.environ.get("SOFTOPS_CACHE_DIR"):
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "softops" / "kernels"


# compiler flags per CPU capability (the vector width at::vec is built for; DEFAULT: portable)
_CPU_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def _cpu_flags() -> tuple[str, list[str]]:
    capability = torch.backends.cpu.get_cpu_capability()
    flags = _CPU_FLAGS.get(capability)
    if flags is None:
        return "DEFAULT", ["-O3", "-fopenmp", "-DCPU_CAPABILITY=DEFAULT"]
    # OpenMP: at::parallel_for runs on torch's intra-op threads (the libgomp torch has loaded)
    defines = [f"-DCPU_CAPABILITY_{capability}", f"-DCPU_CAPABILITY={capability}"]
    return capability, ["-O3", "-fopenmp", *flags, *defines]


_HINT = (
    "build the kernels once per machine with `python -m softops._kernels` (it needs a C++ "
    "compiler and ninja: `pip install ninja`; scripts/setup.sh runs it)"
)


class Kernel:
    """A C++ source (``TORCH_LIBRARY(<name>, ...)``) beside its method, and its built library."""

    def __init__(self, name: str, source: Path) -> None:
        self.name = name
        self.source = source
        self._ops: Any = None
        self._tried = False

    def path(self) -> Path:
        """Where the built library lies: keyed by source, flags, capability, torch and ABI."""
        capability, flags = _cpu_flags()
        key = hashlib.sha256()
        for part in (
            self.source.read_bytes(),
            " ".join(flags).encode(),
            capability.encode(),
            torch.__version__.encode(),
            str(sysconfig.get_config_var("SOABI")).encode(),
        ):
            key.update(part)
            key.update(b"\0")
        return cache_dir() / f"{self.name}-{key.hexdigest()[:16]}.so"

    def ops(self) -> Any:
        """The kernel's operators (``torch.ops.<name>``), or None unbuilt (warned once)."""
        if not self._tried:
            self._tried = True
            path = self.path()
            if path.exists():
                try:
                    torch.ops.load_library(str(path))
                    self._ops = getattr(torch.ops, self.name)
                except Exception as err:  # a stale or broken build: say so, take the reference
                    warnings.warn(
                        f"softops: loading the kernel {self.name} from {path} failed "
                        f"({type(err).__name__}: {str(err)[:200]}); using the torch reference. "
                        f"Remove the file and {_HINT}.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            else:
                warnings.warn(
                    f"softops: the CPU kernel {self.name} is not built for torch "
                    f"{torch.__version__}; using the torch reference (correct, slower). To get "
                    f"the fast CPU path, {_HINT}.",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return self._ops

    def build(self, verbose: bool = False) -> Path:
        """Build the library into the cache in a child process (no-op if it is); its path."""
        path = self.path()
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        _, flags = _cpu_flags()
        code = (
            "import os, shutil, sys, tempfile\n"
            "from torch.utils import cpp_extension\n"
            "name, source, target = sys.argv[1:4]\n"
            "flags = sys.argv[4:]\n"
            "with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:\n"
            "    cpp_extension.load(name=name, sources=[source], build_directory=tmp,\n"
            "        extra_cflags=flags, extra_ldflags=['-fopenmp'], is_python_module=False,\n"
            f"        verbose={verbose!r})\n"
            "    built = os.path.join(tmp, name + '.so')\n"
            "    shutil.copy(built, target + '.part')\n"
            "    os.replace(target + '.part', target)\n"
        )
        env = dict(os.environ)
        # cpp_extension runs ninja from PATH: add this interpreter's scripts folder (a venv's)
        scripts = sysconfig.get_path("scripts")
        env["PATH"] = os.pathsep.join(p for p in (env.get("PATH", ""), scripts) if p)
        name = f"{self.name}_{path.stem.rsplit('-', 1)[1]}"
        subprocess.run(
            [sys.executable, "-c", code, name, str(self.source), str(path), *flags],
            check=True,
            env=env,
            capture_output=not verbose,
        )
        return path


def define(
    qualname: str,
    schema: str,
    *,
    reference: Callable[..., Any],
    fake: Callable[..., Any],
    vmap: Callable[..., Any] | None = None,
    cpu: Callable[..., Any] | None = None,
    kernel: Kernel | None = None,
) -> Any:
    """Register the operator ``qualname`` (``"softops::name"``) with ``schema`` and return it
    (with a CPU kernel, as an :class:`_Operator`). ``reference`` runs on every device and
    ``cpu(ops, *args)`` on CPU tensors while the kernel is built and on; not differentiable."""
    namespace, name = qualname.split("::")
    library = torch.library.Library(namespace, "FRAGMENT")
    _LIBRARIES.append(library)
    library.define(f"{name}{schema}")
    library.impl(name, reference, "CompositeExplicitAutograd")
    if cpu is not None and kernel is not None:

        def on_cpu(*args: Any) -> Any:
            ops = kernel.ops() if kernels_enabled() else None
            return reference(*args) if ops is None else cpu(ops, *args)

        library.impl(name, on_cpu, "CPU")
    torch.library.register_fake(qualname, fake, lib=library)
    if vmap is not None:
        torch.library.register_vmap(qualname, vmap, lib=library)
    op = getattr(getattr(torch.ops, namespace), name).default
    return op if cpu is None or kernel is None else _Operator(op, cpu, kernel)


def plain_eager(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` runs eagerly on plain data (a ``torch.Tensor`` itself, no tracing,
    dispatch mode or transform): only such a call may skip the registry or reuse a cached tensor."""
    return (
        type(t) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._are_functorch_transforms_active()
    )


class _Operator:
    """A registered operator with a CPU kernel: an eager call on plain CPU tensors with the kernel
    on runs it directly (no dispatch); every other call goes through the registry."""

    __slots__ = ("_cpu", "_kernel", "overload")

    def __init__(self, op: Any, cpu: Callable[..., Any], kernel: Kernel) -> None:
        self.overload = op
        """The registered operator (``torch.ops.<namespace>.<name>.default``)."""
        self._cpu = cpu
        self._kernel = kernel

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():  # (first: dynamo reads it as a constant)
            return self.overload(*args)
        ops = self._kernel._ops
        first = args[0]
        eager_cpu = plain_eager(first) and first.is_cpu
        if ops is not None and _state["backend"] == "kernel" and eager_cpu:
            return self._cpu(ops, *args)
        return self.overload(*args)

    def __repr__(self) -> str:
        return f"_Operator({self.overload})"


_LIBRARIES: list[Any] = []  # the registrations live as long as their Library objects


def build_all(verbose: bool = False) -> list[Path]:
    """Build every kernel of the package: each C++ source in it that declares a
    ``TORCH_LIBRARY``, under that library's name (read from the source: no method is imported)."""
    package = Path(__file__).resolve().parents[1]
    paths = []
    sources = list(package.rglob("*.cpp"))
    sources.sort()  # (a stable order of builds and messages)
    for source in sources:
        declared = re.search(r"^TORCH_LIBRARY\((\w+),", source.read_text(), re.MULTILINE)
        if declared:
            paths.append(Kernel(declared[1], source).build(verbose))
    return paths
