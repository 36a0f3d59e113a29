"""Where the benchmarks sit: beside the package, importing its public names only, no circle."""

from __future__ import annotations

import ast
import doctest
import importlib
from pathlib import Path

import pytest

from softops.sort._chunked import BLOCK_ELEMENTS

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ("model", "harness", "probes", "_probe", "quality", "report", "suites", "__main__")
SUITES = ("topk", "sort", "smooth", "layers", "topk_l1", "topk_beam")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_benchmarks_import_no_circle() -> None:
    graph = {
        path.stem: {
            name.split(".")[1]
            for name in _imports(path)
            if name.startswith("benchmarks.") and name.split(".")[1] != path.stem
        }
        for path in (ROOT / "benchmarks").glob("*.py")
    }
    graph = {node: {m for m in edges if m in graph} for node, edges in graph.items()}
    done: set[str] = set()

    def visit(node: str, stack: tuple[str, ...]) -> None:
        assert node not in stack, " -> ".join((*stack, node))
        if node not in done:
            for nxt in sorted(graph[node]):
                visit(nxt, (*stack, node))
            done.add(node)

    for node in sorted(graph):
        visit(node, ())
    assert "harness" not in graph["probes"] and "probes" in graph["harness"]


@pytest.mark.parametrize("name", HARNESS + SUITES)
def test_the_harness_and_suites_import_public_softops_names_only(name: str) -> None:
    private = sorted(
        module
        for module in _imports(ROOT / "benchmarks" / f"{name}.py")
        if module.startswith("softops") and any(p.startswith("_") for p in module.split("."))
    )
    assert not private, private


def test_the_library_never_imports_the_benchmarks() -> None:
    for path in (ROOT / "src" / "softops").rglob("*.py"):
        bad = {m for m in _imports(path) if m == "benchmarks" or m.startswith("benchmarks.")}
        assert not bad, (path, bad)


def test_the_wheel_holds_the_library_only() -> None:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert config["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["src/softops"]
    assert not (ROOT / "src" / "softops" / "bench").exists()


def test_the_sort_suite_reports_the_library_block_size() -> None:
    from benchmarks import sort

    assert sort.BLOCK_ELEMENTS == BLOCK_ELEMENTS


@pytest.mark.parametrize("name", HARNESS + SUITES)
def test_doctests(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
