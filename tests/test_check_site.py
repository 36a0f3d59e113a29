"""scripts/check_site.py, the check of the built documentation site, on small pages and sources:
it flags each kind of defect it exists for and passes clean pages."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

GOOD = """<html><body><article>
<p>The mask sums to k: <span class="arithmatex">\\(\\sum_i A_i = k\\), \\(x_{i}\\)</span>.</p>
<p>Shape <code>(*, n)</code>; <code>"{:.3g}".format(x)</code> and <code>{args}</code> in code.</p>
<pre><code>d = {"a": 1}  # {key}</code></pre>
<script>const x = {args};</script>
</article></body></html>"""


@pytest.fixture(scope="module")
def check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_site", ROOT / "scripts" / "check_site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_clean_page_passes(check: ModuleType) -> None:
    assert check.scan_html(GOOD, "good.html") == []


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ('<span class="arithmatex">\\(e^{-t/\x0barepsilon}\\)</span>', "control character 0x0b"),
        ("<p>\x08egin{cases}</p>", "control character 0x08"),
        ("<p>The counts.\n{args}\nExample:</p>", "unrendered placeholder {args}"),
        (
            '<li><code>A &lt;autoref identifier="softops.X" optional&gt;X&lt;/autoref&gt;</code>'
            "</li>",
            "raw markup '<autoref'",
        ),
        ("<p>See :func:`soft_topk`.</p>", "raw markup ':func:`'"),
        ("<p>.. math::</p>", "raw markup '.. math::'"),
    ],
)
def test_each_defect_is_flagged_with_the_page(check: ModuleType, bad: str, expected: str) -> None:
    findings = check.scan_html(GOOD.replace("</article>", bad + "</article>"), "bad.html")
    assert len(findings) == 1, findings
    assert findings[0].startswith("bad.html: ") and expected in findings[0]


def test_sources_control_characters_in_docs_and_in_docstrings(
    check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check, "ROOT", tmp_path)
    docs, src = tmp_path / "docs", tmp_path / "src"
    docs.mkdir()
    src.mkdir()
    (docs / "math.md").write_text("$\\varepsilon$ and $$\\begin{cases} a \\\\ b \\end{cases}$$\n")
    (src / "ok.py").write_text('def f():\n    r"""Raw: :math:`\\varepsilon`."""\n')
    assert check.scan_sources(docs, src) == []
    (docs / "bad.md").write_text("one\n$\x0barepsilon$\n")
    # Not raw: Python reads "\v" as 0x0B, though the file holds a backslash and a "v".
    (src / "bad.py").write_text('def f():\n    """Not raw: :math:`\\varepsilon`."""\n')
    findings = check.scan_sources(docs, src)
    assert len(findings) == 2, findings
    assert findings[0].startswith("docs/bad.md: line 2: control character 0x0b")
    assert findings[1].startswith("src/bad.py: the docstring at line 2")
    assert "control character 0x0b" in findings[1]


def test_main_fails_on_a_bad_site_and_passes_a_good_one(
    check: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(check, "scan_sources", lambda docs, src: [])
    site = tmp_path / "site"
    (site / "topk").mkdir(parents=True)
    (site / "index.html").write_text(GOOD)
    (site / "topk" / "index.html").write_text(GOOD)
    assert check.main(["--site", str(site)]) == 0
    (site / "topk" / "index.html").write_text(GOOD.replace("</p>", "{args}</p>", 1))
    assert check.main(["--site", str(site)]) == 1
    assert "topk/index.html: unrendered placeholder {args}" in capsys.readouterr().out
    assert check.main(["--site", str(tmp_path / "missing")]) == 2
