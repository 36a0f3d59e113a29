"""The documentation site's sources: citations of docs/math.md, the docstring conversion, and the
API directives of the pages. (CI builds the site itself: `mkdocs build --strict` in .ci/run.)"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_CITATION = re.compile(r"docs/math\.md\s+§(\d+(?:\.\d+)?)")
_HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.MULTILINE)


def _math_sections() -> set[str]:
    return set(_HEADING.findall((DOCS / "math.md").read_text(encoding="utf-8")))


def test_every_citation_of_the_math_page_names_one_of_its_sections() -> None:
    sections = _math_sections()
    assert {"1", "1.2", "1.4", "2.3", "3", "5"} <= sections
    cited: dict[str, set[str]] = {}
    for folder in ("src", "tests", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".md"} and path.is_file():
                for number in _CITATION.findall(path.read_text(encoding="utf-8")):
                    cited.setdefault(number, set()).add(str(path.relative_to(ROOT)))
    assert cited, "no citation found: the pattern is stale"
    missing = {number: files for number, files in cited.items() if number not in sections}
    assert not missing, f"citations of sections docs/math.md does not have: {missing}"


def test_every_api_directive_names_an_importable_object() -> None:
    names = []
    for page in DOCS.rglob("*.md"):
        names += re.findall(r"^::: (\S+)$", page.read_text(encoding="utf-8"), re.MULTILINE)
    assert "softops.soft_topk_mask" in names and "softops.nn" in names
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            assert hasattr(importlib.import_module(module), attr), name


@pytest.fixture(scope="module")
def rst() -> ModuleType:
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("griffe_rst", DOCS / "hooks" / "griffe_rst.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rst_math_roles_and_blocks_become_arithmatex(rst: ModuleType) -> None:
    text = "A sum :math:`\\sum_i A_i = k`, then\n\n.. math::\n\n    A = \\sigma(z),\n\nend."
    out = rst.rst_to_markdown(text, "softops.topk")
    assert "A sum $\\sum_i A_i = k$, then" in out
    assert "$$\nA = \\sigma(z),\n$$" in out and out.rstrip().endswith("end.")


def test_rst_roles_become_optional_cross_references(rst: ModuleType) -> None:
    out = rst.rst_to_markdown(":func:`soft_topk` and :class:`~softops.nn.TopKRouter`", "softops.x")
    assert '<autoref identifier="softops.x.soft_topk" optional><code>soft_topk</code>' in out
    assert '<autoref identifier="softops.nn.TopKRouter" optional><code>TopKRouter</code>' in out


def test_math_citations_link_to_the_section_anchor(rst: ModuleType) -> None:
    out = rst.rst_to_markdown("(the lemma of docs/math.md\n    §1.3) and docs/math.md", "m")
    assert "[docs/math.md §1.3][math-1.3]" in out
    assert out.endswith("[docs/math.md][the-math-behind-softops]")


def test_literal_blocks_and_doctests_are_fenced(rst: ModuleType) -> None:
    text = (
        "The hard operator is::\n\n    torch.topk(x, k)\n\nExample:\n"
        "    >>> 1 + 1\n    2\n\nUsage::\n\n    softops plot --out DIR\n"
    )
    out = rst.rst_to_markdown(text, "m")
    assert "The hard operator is:\n\n```python\ntorch.topk(x, k)\n```" in out
    assert "Example:\n    ```pycon\n    >>> 1 + 1\n    2\n    ```" in out  # no blank line
    assert "Usage:\n\n```text\nsoftops plot --out DIR\n```" in out


def test_references_become_a_list_and_lone_stars_are_escaped(rst: ModuleType) -> None:
    text = (
        "Shape (*, n, m).\n\nReferences:\n    Xie, Dai and Chen. Differentiable Top-k. NeurIPS\n"
        "    2020. arXiv:2002.06504.\n    Xie et al. Another. 2021.\n"
        "    Su Jianlin. A post. 2019.\n"
    )
    out = rst.rst_to_markdown(text, "m")
    assert "Shape (\\*, n, m)." in out
    assert (
        "References:\n    - Xie, Dai and Chen. Differentiable Top-k. NeurIPS\n      2020. "
        "arXiv:2002.06504.\n    - Xie et al. Another. 2021.\n    - Su Jianlin. A post. 2019."
    ) in out
    assert rst.rst_to_markdown("**bold**, ``a * b``, $x^*$", "m") == "**bold**, ``a * b``, $x^*$"
    assert rst.rst_to_markdown("* one (*, n)\n  * two", "m") == "* one (\\*, n)\n  * two"


def test_stars_literal_in_rest_are_escaped_across_lines_and_inside_words(rst: ModuleType) -> None:
    text = "Law: ``f(c * x) = c *\n    f(x)`` for ``c > 0``; tokens (B*K,) and log_probs (B*K, V)."
    out = rst.rst_to_markdown(text, "m")
    assert "``f(c * x) = c *\n    f(x)``" in out  # inline code across a line break: untouched
    assert "(B\\*K,) and log_probs (B\\*K, V)" in out


def test_a_prose_returns_line_gets_the_annotation_as_its_type(rst: ModuleType) -> None:
    text = "Returns:\n    A :class:`Weights` ``(w, m)``, each of shape ``(L, S)``: the\n    rest."
    out = rst.rst_to_markdown(text, "softops.nn.attention", "Weights")
    assert out.startswith("Returns:\n    Weights: A <autoref") and "``(L, S)``: the" in out
    assert "&#58;" in rst.rst_to_markdown("Returns:\n    A pair, each (n,): the rest.", "m")
    typed = "Returns:\n    TopK: the values."
    assert rst.rst_to_markdown(typed, "m", "TopK") == typed


def test_the_module_docstring_links_to_the_module(rst: ModuleType) -> None:
    out = rst.rst_to_markdown("the soft counts of the module docstring (module docstring).", "a.b")
    assert out == "the soft counts of [the module docstring][a.b] ([module docstring][a.b])."


def test_an_entry_naming_several_parameters_becomes_one_per_name(rst: ModuleType) -> None:
    text = (
        "Args:\n    x: the input.\n    epsilon, mode: the router's\n        (see there).\n\n"
        "Raises:\n    TypeError, ValueError: as forward.\n\nShape, a, b: prose."
    )
    out = rst.rst_to_markdown(text, "m")
    assert "    epsilon: the router's\n        (see there).\n    mode: the router's\n" in out
    assert "    TypeError: as forward.\n    ValueError: as forward." in out
    assert out.endswith("Shape, a, b: prose.")  # not in a section: left alone
