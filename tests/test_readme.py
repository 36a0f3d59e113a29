"""The README's Python examples run, and print what the README says they print.

Each ```python block is executed statement by statement in one namespace; where a statement is an
expression followed by lines of the form ``# <output>`` at the start of a line, its value must
equal that output, read back as tensors, to the printed precision (4 decimals).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import softops

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def _expected_outputs(lines: list[str], end: int) -> str | None:
    """The ``# ...`` lines right after line ``end`` (1-based), joined, or None."""
    out = []
    for line in lines[end:]:
        if not line.startswith("# "):
            break
        out.append(line[2:].strip().split("   ")[0])  # drop a trailing note after 3 spaces
    return "".join(out) if out else None


def _assert_close(got: object, want: object, source: str) -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), source
        for g, w in zip(got, want, strict=True):
            _assert_close(g, w, source)
        return
    assert isinstance(got, torch.Tensor), source
    got = got.detach()
    assert got.shape == want.shape, source
    torch.testing.assert_close(got.double(), want.double(), atol=6e-5, rtol=1e-4, msg=source)


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_block(index: int) -> None:
    code = _blocks()[index]
    lines = code.splitlines()
    namespace: dict[str, object] = {"torch": torch, "softops": softops}  # as the first block
    checked = 0
    torch.manual_seed(0)
    for node in ast.parse(code).body:
        source = ast.get_source_segment(code, node)
        assert source is not None
        expected = _expected_outputs(lines, node.end_lineno or node.lineno)
        if isinstance(node, ast.Expr) and expected is not None:
            value = eval(compile(ast.Expression(node.value), "README", "eval"), namespace)
            want = eval(re.sub(r",\s*grad_fn=<\w+>", "", expected), {"tensor": torch.tensor})
            _assert_close(value, want, source)
            checked += 1
        else:
            exec(compile(ast.Module([node], []), "README", "exec"), namespace)
    assert checked > 0


def test_readme_has_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "bash scripts/setup.sh && .venv/bin/softops knn --dataset mnist --minutes 3" in text
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest" in text
