"""The package's import rules, read from the source: ``_core`` and ``_kernels``
know no operator, nothing imports up the layers, no module outside a family imports the family's
private modules, and ``apps`` uses the public API and ``_core.validation`` only."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import softops

PACKAGE = Path(softops.__file__).parent
FAMILIES = ("topk", "sort")
# the layers, lowest first; a module may import its own layer and those below it
LAYERS = (
    ("_core", "_kernels"),
    ("topk", "sort", "smooth"),
    ("solvers", "metrics", "losses", "testing"),
    ("distributed",),
    ("nn",),
    ("apps",),
    ("cli", "__init__", "__main__", "bench", "plot"),
)


def _part(module: str) -> str:
    """The top-level part of ``softops.<part>...`` (``__init__`` for ``softops`` itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(part: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if part in names)


def _imports() -> list[tuple[str, str]]:
    """(importing module, imported softops module) for every import in the package, by name
    (``from softops.x import y`` counts as ``softops.x.y`` where y is a module)."""
    pairs = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        mod = ".".join(p for p in rel.parts if p != "__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] != "softops":
                    continue
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    sub = PACKAGE.parent / full.replace(".", "/")
                    is_module = sub.with_suffix(".py").exists() or sub.is_dir()
                    pairs.append((mod, full if is_module else node.module))
            elif isinstance(node, ast.Import):
                pairs += [(mod, a.name) for a in node.names if a.name.startswith("softops")]
    return pairs


IMPORTS = [(a, b) for a, b in _imports() if _part(a) != "bench"]  # (moving out of the package)


def test_the_import_table_was_read() -> None:
    assert ("softops.nn.topk", "softops.topk") in IMPORTS


@pytest.mark.parametrize("family", FAMILIES)
def test_no_module_outside_a_family_imports_its_private_modules(family: str) -> None:
    bad = [(a, b) for a, b in IMPORTS if b.startswith(f"softops.{family}._") and _part(a) != family]
    assert not bad


def test_nothing_imports_up_the_layers() -> None:
    bad = [(a, b) for a, b in IMPORTS if b != "softops" and _layer(_part(b)) > _layer(_part(a))]
    assert not bad


def test_apps_use_the_public_api_and_validation_only() -> None:
    bad = [
        (a, b)
        for a, b in IMPORTS
        if _part(a) == "apps"
        and _part(b) != "apps"
        and b != "softops._core.validation"
        and any(p.startswith("_") for p in b.split(".")[1:])
    ]
    assert not bad


def test_core_names_no_operator() -> None:
    """No identifier of ``_core`` or ``_kernels`` code names an op family or one of its ops
    (Python's builtins, such as ``sorted``, are not the code's own names)."""
    words = ("topk", "sorted", "soft_sort", "soft_rank", "newton_first", "threshold")
    builtin = set(dir(builtins))
    bad = []
    for folder in ("_core", "_kernels"):
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                name = getattr(node, "id", None) or getattr(node, "name", None)
                if (
                    isinstance(name, str)
                    and name not in builtin
                    and any(w in name.lower() for w in words)
                ):
                    bad.append((path.name, name))
    assert not bad
