"""Check the built documentation site (site/) and its sources (docs/, the docstrings of src/).

    .venv/bin/python scripts/check_site.py [--site site] [--browser]

Run by .ci/run after `mkdocs build --strict`, which already fails on broken links and
references. This adds what that build lets through:

* **control characters** (0x00-0x1F but tab, newline and carriage return; 0x7F) in the built
  HTML, in every file of docs/ and in every docstring of src/ (a ``\\v`` or ``\\b`` of LaTeX in a
  string that is not raw becomes 0x0B or 0x08, and MathJax shows "Math input error");
* **unrendered placeholders** in the text of a page, such as ``{args}`` (a docstring the module
  fills in at import time, read from the source);
* **raw markup** in a page, inside code too: ``<autoref`` (a cross-reference that was not
  resolved, or that landed in a type), reStructuredText roles (``:func:`...```) and
  ``.. math::`` blocks.

With ``--browser`` (or when ``SOFTOPS_DOCS_BROWSER=1``), every page is also opened in headless
Chromium at 1280 px (``CHROMIUM``, default ``chromium``; Debian's ``apt-get install -y
chromium``), after MathJax has typeset it, and the check fails on a console error (a script's
exception, ``MathJax.startup.output.clearCache is not a function``), a MathJax error (an
``merror`` node: "Math input error", an undefined control sequence) or a formula MathJax left
untypeset. It lists the tables wider than the text column, which scroll.

Exit status: 0 when every check passes, 1 with one line per finding otherwise, 2 on a usage
error (no site/, no Chromium with ``--browser``).
"""

from __future__ import annotations

import argparse
import ast
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# A placeholder of str.format left in prose: "{args}", "{common_args}".
PLACEHOLDER = re.compile(r"(?<![\w{$\\^_])\{[a-z][a-z_]*\}(?!\})")
RAW_MARKUP = re.compile(r"<autoref\b|:(?:func|class|mod|meth|attr|data|exc|math|ref):`|\.\. math::")
# Elements whose text is not prose: code (checked for raw markup only), math, scripts.
_CODE = {"code", "pre"}
_SKIP = {"script", "style", "svg", "template"}
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr"}  # fmt: skip


def _where(text: str, start: int) -> str:
    line = text.count("\n", 0, start) + 1
    return f"line {line}"


def scan_control(text: str, name: str) -> list[str]:
    """A finding per control character of ``text``."""
    return [
        f"{name}: {_where(text, m.start())}: control character {ord(m.group()):#04x} "
        f"in {text[max(0, m.start() - 30) : m.start()]!r}"
        for m in CONTROL.finditer(text)
    ]


class _Text(html.parser.HTMLParser):
    """The text of a page in runs of (text, in_code, in_math)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.runs: list[tuple[str, bool, bool]] = []
        self._stack: list[tuple[str, bool, bool, bool]] = []  # (tag, code, math, skip)

    def _state(self) -> tuple[bool, bool, bool]:
        if not self._stack:
            return False, False, False
        _, code, math, skip = self._stack[-1]
        return code, math, skip

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _VOID:
            return
        code, math, skip = self._state()
        classes = (dict(attrs).get("class") or "").split()
        self._stack.append(
            (tag, code or tag in _CODE, math or "arithmatex" in classes, skip or tag in _SKIP)
        )

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == tag:
                del self._stack[i:]
                return

    def handle_data(self, data: str) -> None:
        code, math, skip = self._state()
        if not skip:
            self.runs.append((data, code, math))


def scan_html(text: str, name: str) -> list[str]:
    """The findings in one built page: control characters, placeholders, raw markup."""
    findings = scan_control(text, name)
    parser = _Text()
    parser.feed(text)
    for data, code, math in parser.runs:
        for m in RAW_MARKUP.finditer(data):
            findings.append(f"{name}: raw markup {m.group()!r} in {data.strip()[:80]!r}")
        if not code and not math:
            for m in PLACEHOLDER.finditer(data):
                findings.append(f"{name}: unrendered placeholder {m.group()} in {data[:80]!r}")
    return findings


def docstrings(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring of a Python module's source, as Python reads it."""
    tree = ast.parse(source)
    nodes: Iterable[ast.AST] = [tree, *ast.walk(tree)]
    for node in nodes:
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield getattr(node.body[0], "lineno", 1), doc


def scan_sources(docs: Path, src: Path) -> list[str]:
    """Control characters in the files of ``docs`` and in the docstrings under ``src``."""
    findings = []
    for path in sorted(docs.rglob("*")):
        if path.is_file():
            text = path.read_bytes().decode("utf-8", errors="replace")
            findings += scan_control(text, str(path.relative_to(ROOT)))
    seen: set[int] = set()
    for path in sorted(src.rglob("*.py")):
        for line, doc in docstrings(path.read_text(encoding="utf-8")):
            key = hash((path, line))
            if key not in seen:
                seen.add(key)
                name = f"{path.relative_to(ROOT)}: the docstring at line {line}"
                findings += [f.replace(": line 1:", ":", 1) for f in scan_control(doc, name)]
    return findings


def pages(site: Path) -> list[Path]:
    """The pages of the built site (not the 404 page's copies of assets)."""
    return sorted(p for p in site.rglob("*.html") if "assets" not in p.parts)


# The page that loads one page of the site in a 1280-px frame, waits for MathJax, and writes
# what it found into its own DOM (read back with --dump-dom).
_HARNESS = """<!doctype html><html><body>
<iframe id="f" style="width:1280px;height:1600px;border:0"></iframe><pre id="out"></pre>
<script>
const frame = document.getElementById("f");
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
frame.onload = async () => {
  const w = frame.contentWindow, d = frame.contentDocument;
  for (let i = 0; i < 100 && !(w.MathJax && w.MathJax.startup && w.MathJax.startup.promise); i++)
    await sleep(100);
  if (w.MathJax && w.MathJax.startup) await w.MathJax.startup.promise;
  await sleep(500);
  const column = d.querySelector(".md-content__inner");
  const right = column ? column.getBoundingClientRect().right : 1280;
  const errors = [...d.querySelectorAll("[data-mjx-error], mjx-merror, [data-mml-node=merror]")]
    .map((e) => e.getAttribute("data-mjx-error") || e.textContent);
  const untypeset = [...d.querySelectorAll(".arithmatex")]
    .filter((e) => !e.querySelector("mjx-container")).map((e) => e.textContent.slice(0, 60));
  const wide = [...d.querySelectorAll(".md-typeset table")]
    .filter((t) => t.scrollWidth > t.parentElement.clientWidth + 1
      || t.getBoundingClientRect().right > right + 1).length;
  document.getElementById("out").textContent = JSON.stringify(
    {errors, untypeset, wide, tables: d.querySelectorAll(".md-typeset table").length});
};
frame.src = decodeURIComponent(location.hash.slice(1));
</script></body></html>"""


class _Handler(SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.split("#")[0] == "/__check__.html":
            body = _HARNESS.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass


_CONSOLE = re.compile(r'INFO:CONSOLE[^\]]*\] "(?P<message>.*)", source: (?P<source>\S+)')


def browse(site: Path, chromium: str) -> list[str]:
    """Open every page in headless Chromium (see the module docstring); the findings."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    findings, wide = [], []
    profile = tempfile.mkdtemp(prefix="softops-check-site-")
    try:
        for page in pages(site):
            url = "/" + page.relative_to(site).as_posix().removesuffix("index.html")
            if url == "/404.html":
                continue
            run = subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 f"--user-data-dir={profile}", "--window-size=1400,1700",
                 "--enable-logging=stderr", "--v=0", "--virtual-time-budget=20000",
                 "--dump-dom", f"{base}/__check__.html#{url}"],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            for m in _CONSOLE.finditer(run.stderr):
                if m["source"].startswith(base) and "__check__" not in m["source"]:
                    findings.append(f"{url}: console: {m['message']} ({m['source']})")
            out = re.search(r'<pre id="out">(.*?)</pre>', run.stdout, re.S)
            if out is None or not out.group(1).strip():
                findings.append(f"{url}: the page did not finish loading in the browser")
                continue
            result = json.loads(html.unescape(out.group(1)))
            findings += [f"{url}: MathJax error: {e}" for e in result["errors"]]
            findings += [f"{url}: formula not typeset: {t!r}" for t in result["untypeset"]]
            if result["wide"]:
                wide.append(f"{url} ({result['wide']} of {result['tables']})")
    finally:
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    if wide:
        print("check_site: tables wider than the text column (they scroll):", ", ".join(wide))
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="the built site")
    parser.add_argument(
        "--browser",
        action="store_true",
        default=os.environ.get("SOFTOPS_DOCS_BROWSER") == "1",
        help="also open every page in headless Chromium",
    )
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"check_site: expected a built site in {args.site}; build it first.", file=sys.stderr)
        return 2
    findings = scan_sources(ROOT / "docs", ROOT / "src")
    built = pages(args.site)
    for page in built:
        findings += scan_html(page.read_text(encoding="utf-8"), str(page.relative_to(args.site)))
    if args.browser:
        chromium = os.environ.get("CHROMIUM", "chromium")
        if shutil.which(chromium) is None:
            print(f"check_site: expected Chromium ({chromium}) for --browser.", file=sys.stderr)
            return 2
        findings += browse(args.site, chromium)
    for finding in findings:
        print(finding)
    checked = f"{len(built)} pages" + (" (and in Chromium)" if args.browser else "")
    print(f"check_site: {len(findings)} problems in {checked}, docs/ and the docstrings of src/.")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
