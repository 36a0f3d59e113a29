"""MkDocs hooks of the softops site (``hooks:`` in ``mkdocs.yml``).

* **MathJax, served by the site.** When the ``sphinx-mathjax-offline`` wheel is installed
  (``scripts/setup.sh`` installs it, without its Sphinx dependency: only its copy of MathJax
  3.2.2 is used), MathJax's SVG build (``tex-svg.js``, its fonts inside) and the TeX extensions
  it loads on demand are added to the site under ``assets/mathjax/``, so the math renders with
  no network (a headless browser in CI, a laptop on a train). Without the wheel, the pages load
  the same build from the jsDelivr CDN.
* **The figures of** ``softops plot``, drawn when the site builds (so they cannot go stale; cached
  per state of ``src/softops``, see ``_figures``) and added as ``figures/<name>.png``.
* **The committed benchmark plots**, ``benchmarks/results/*.png``, added at the same paths.
* **Markdown files of the repository included in a page** (the benchmark reports, the
  benchmarks' README): a line ``<!-- include: benchmarks/results/topk.md -->`` is replaced by that
  file, its headings moved down one level (``shift=0`` to ``3``: as many); a missing file fails
  the build. ``<!-- include: the other results -->`` stands for every report of
  ``benchmarks/results/`` that no page names, so a new report is on the site before it has a
  place of its own.
* **The API index** (``<!-- api-index -->`` in ``api.md``): a table of every public name of the
  public modules (their ``__all__``) with its summary line, each linked to its entry: a public
  name that no page documents is an unresolved cross-reference, which fails the strict build.
* **The gallery** (``<!-- gallery -->`` in ``gallery.md``): every script of ``examples/``, its
  docstring as the text and its source in a fold, so a new example is on the site at once.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SRC = ROOT / "src" / "softops"
MATHJAX_CDN = "https://cdn.jsdelivr.net/npm/mathjax@3.2.2/es5/tex-svg.js"
MATHJAX_LOCAL = "assets/mathjax/tex-svg.js"
_INCLUDE = re.compile(
    r"^<!-- include: (?P<path>[\w./-]+\.md)(?: shift=(?P<shift>[0-3]))? -->$", re.MULTILINE
)
_REST = "<!-- include: the other results -->"
_API_INDEX = "<!-- api-index -->"
_GALLERY = "<!-- gallery -->"
EXAMPLES = ROOT / "examples"
# The public modules whose names the API index lists, in the order of the navigation.
API_MODULES = (
    "softops",
    "softops.nn",
    "softops.metrics",
    "softops.losses",
    "softops.solvers",
    "softops.distributed",
    "softops.apps",
    "softops.testing",
    "softops.plot",
)
_state: dict[str, Any] = {}


def _mathjax_dir() -> Path | None:
    """The ``mathjax`` folder of the sphinx-mathjax-offline wheel, if it is installed."""
    try:
        files = importlib.metadata.files("sphinx-mathjax-offline") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "tex-svg.js":
            return Path(str(file.locate())).parent
    return None


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    mathjax = _mathjax_dir()
    _state["mathjax"] = mathjax
    config.extra_javascript.append(MATHJAX_LOCAL if mathjax else MATHJAX_CDN)
    return config


def _add(files: Files, config: MkDocsConfig, uri: str, path: Path) -> None:
    files.append(File.generated(config, uri, abs_src_path=str(path)))


def on_files(files: Files, config: MkDocsConfig) -> Files:
    mathjax: Path | None = _state.get("mathjax")
    if mathjax is not None:
        _add(files, config, MATHJAX_LOCAL, mathjax / "tex-svg.js")
        # \require, \boldsymbol, ... load their extensions from here on first use.
        for ext in sorted((mathjax / "input" / "tex" / "extensions").glob("*.js")):
            _add(files, config, f"assets/mathjax/input/tex/extensions/{ext.name}", ext)
    for png in sorted(RESULTS.glob("*.png")):
        _add(files, config, f"benchmarks/results/{png.name}", png)
    for png in _figures():
        _add(files, config, f"figures/{png.name}", png)
    docs = Path(config.docs_dir)
    pages = [path.read_text(encoding="utf-8") for path in docs.rglob("*.md")]
    _state["included"] = {m["path"] for text in pages for m in _INCLUDE.finditer(text)}
    return files


def _figures() -> list[Path]:
    """The figures of ``softops plot``, drawn once per state of the package's source.

    They take most of a build (about 20 s of 30 on a loaded 2-core machine), and they change only
    with the code that draws or computes them, so they are cached under
    ``~/.cache/softops/docs-figures/<key>`` (``$XDG_CACHE_HOME`` if set), the key a hash of every
    file of ``src/softops``, torch's and matplotlib's versions: an edit of the package redraws
    them, and a cache that is not there is drawn again.
    """
    import matplotlib
    import torch

    from softops.plot import FIGURES, write_figures

    digest = hashlib.sha256(f"{torch.__version__} {matplotlib.__version__}".encode())
    for path in sorted(SRC.rglob("*.py")):
        digest.update(path.relative_to(SRC).as_posix().encode() + b"\0" + path.read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache / "softops" / "docs-figures" / digest.hexdigest()[:16]
    paths = [folder / f"{name}.png" for name in FIGURES]
    if all(path.is_file() for path in paths):
        return paths
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="drawing-", dir=folder.parent))
    try:
        write_figures(scratch, dpi=110)
        shutil.rmtree(folder, ignore_errors=True)
        scratch.rename(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return paths


def _demoted(text: str, shift: int) -> str:
    """``text`` with every Markdown heading ``shift`` levels down (fenced code left alone)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,5} ", line):
            line = "#" * shift + line
        lines.append(line)
    return "\n".join(lines) + "\n"


def _include(match: re.Match[str]) -> str:
    relative = match["path"]
    path = (ROOT / relative).resolve()
    if ROOT not in path.parents or not path.is_file():
        raise PluginError(f"docs: expected the file {relative} of the repository; it is missing.")
    shift = match["shift"]
    return _demoted(path.read_text(encoding="utf-8"), 1 if shift is None else int(shift))


def _other_results() -> str:
    """Every ``benchmarks/results/*.md`` that no page includes by name, each with its plot."""
    named = _state.get("included", set())
    parts = []
    for report in sorted(RESULTS.glob("*.md")):
        relative = f"benchmarks/results/{report.name}"
        if relative in named:
            continue
        parts.append(_demoted(report.read_text(encoding="utf-8"), 1))
        if report.with_suffix(".png").exists():
            parts.append(f"![{report.stem}](results/{report.stem}.png){{ .figure }}\n")
    return "\n".join(parts) or "(None: every committed report is on the pages above.)\n"


_SECTION = re.compile(
    r"^(?P<hashes>#{2,3}) (?P<number>\d+(?:\.\d+)?)(?P<dot>\.?) (?P<title>.+)$", re.M
)


def _anchor_sections(markdown: str) -> str:
    """Give each numbered heading of the math page the id ``math-<number>`` (``math-1.3``).

    The docstrings cite "docs/math.md §1.3"; the API reference links those citations to these
    ids (docs/hooks/griffe_rst.py), so a citation of a section that does not exist fails the
    build, and retitling a section breaks no link.
    """
    return _SECTION.sub(r"\g<hashes> \g<number>\g<dot> \g<title> { #math-\g<number> }", markdown)


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def _summary(obj: object) -> str:
    """The first sentence of ``obj``'s docstring, as one table cell of Markdown."""
    doc = inspect.getdoc(obj) or ""
    if isinstance(obj, (str, int, float, tuple, frozenset, dict)) or not doc:
        return ""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    sentence = re.split(r"(?<=[a-z)\]`])\. ", paragraph, maxsplit=1)[0].rstrip(".") + "."
    sentence = _ROLE.sub(r"`\1`", sentence).replace("|", "\\|")
    return re.sub(r"(?<![`\w])\*|(?<=\w)\*(?=\w)", r"\\*", sentence)


def _api_index() -> str:
    """The table of every public name (see the module docstring)."""
    lines = []
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        rows = []
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or name.startswith("__"):
                continue
            if callable(obj):
                identifier = f"{obj.__module__}.{getattr(obj, '__qualname__', name)}"
            else:  # a constant: its module's entry lists it (with its docstring, if it has one)
                identifier = module_name
            rows.append(f"| [`{module_name}.{name}`][{identifier}] | {_summary(obj)} |")
        lines += [f"### `{module_name}`", "", "| name | what it is |", "|---|---|", *rows, ""]
    return "\n".join(lines)


def _gallery() -> str:
    """A section per script of ``examples/``: its docstring, the command, the source."""
    parts = []
    for script in sorted(EXAMPLES.glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
        title, _, body = doc.partition("\n")
        relative = script.relative_to(ROOT).as_posix()
        text = "\n".join(
            line for line in body.strip().splitlines() if line.strip() != f"python {relative}"
        )
        parts += [
            f"## {script.stem.replace('_', ' ').capitalize()}",
            "",
            f"**{title.strip()}**",
            "",
            text.strip(),
            "",
            f"```bash\n.venv/bin/python {relative}\n```",
            "",
            f'??? example "The source: {relative}"',
            "",
            f'    ```python\n    --8<-- "{relative}"\n    ```',
            "",
        ]
    if not parts:
        raise PluginError("docs: expected example scripts in examples/; found none.")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Page, **kwargs: Any) -> str:
    if page.file.src_uri == "math.md":
        markdown = _anchor_sections(markdown)
    if _API_INDEX in markdown:
        markdown = markdown.replace(_API_INDEX, _api_index())
    if _GALLERY in markdown:
        markdown = markdown.replace(_GALLERY, _gallery())
    if _REST in markdown:
        markdown = markdown.replace(_REST, _other_results())
    return _INCLUDE.sub(_include, markdown)
