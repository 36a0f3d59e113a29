"""pyproject.toml: the torch range it declares holds the torch the suite runs on, the README and
the getting-started page state the same range, and the extras are the names they document
(issue 23: the declared torch range and the extras' names)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def test_the_declared_torch_range_holds_the_torch_in_use_and_is_the_documented_one() -> None:
    (dep,) = [d for d in PROJECT["dependencies"] if d.startswith("torch")]
    low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", dep).groups()  # type: ignore[union-attr]
    assert _version(low) <= _version(torch.__version__) < _version(high), (dep, torch.__version__)
    assert f"`{dep}`" in (ROOT / "README.md").read_text()


def test_the_extras_are_the_documented_names() -> None:
    extras = PROJECT["optional-dependencies"]
    assert {"test", "kernels", "bench", "apps", "docs", "lint", "dev"} <= set(extras)
    assert extras["pav"] == ["softops[kernels]"]  # the former name, an alias
    assert any(d.startswith("ninja") for d in extras["kernels"])
    for page in ("README.md", "docs/getting-started.md"):
        for name in re.findall(r'"(?:softops|\.)\[(\w+)\]"', (ROOT / page).read_text()):
            assert name in extras, (page, name)
