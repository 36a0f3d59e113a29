r"""A griffe extension: the reStructuredText of softops' docstrings, as the Markdown of the site.

The docstrings are Google style (``Args:``, ``Returns:``, ``Example:``), which mkdocstrings
parses, but their inline markup is reStructuredText, which it does not. Before the sections are
parsed, each docstring is rewritten:

* ``:math:`...``` becomes ``$...$`` and a ``.. math::`` block becomes a ``$$ ... $$`` block,
  both rendered by ``pymdownx.arithmatex`` and MathJax;
* ``:func:`name```, ``:class:``, ``:mod:``, ``:data:``, ``:meth:``, ``:attr:``, ``:exc:``
  become optional cross-references: a link where the site documents ``name`` (resolved relative
  to the docstring's module when it has no dot), inline code where it does not;
* a paragraph ending in ``::`` loses one colon, and the indented literal block after it becomes
  a fenced code block; a doctest (lines from ``>>>`` to the next blank line) becomes a fenced
  ``pycon`` block, which Markdown would otherwise read as nested quotes;
* the entries of a ``References:`` section become a list (an entry starts on a line that follows
  a full stop and opens with a name: "Xie, Dai, ...", "Su Jianlin. ...");
* other roles (``:ref:`...```) keep their text as inline code;
* a citation "docs/math.md §1.3" links to that section of the math page (whose numbered headings
  get the ids ``math-<number>`` from docs/hooks/softops_docs.py): a citation of a section that
  does not exist is an unresolved cross-reference, which fails the strict build.

Loaded by ``mkdocs.yml`` (``extensions: [docs/hooks/griffe_rst.py:RstToMarkdown]``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?P<role>[a-z]+):`(?P<text>[^`]+)`")
_LINK_ROLES = {"func", "class", "mod", "data", "meth", "attr", "exc", "obj"}
_MATH_CITATION = re.compile(r"docs/math\.md(?:\s+§(?P<number>\d+(?:\.\d+)?))?")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _reference(text: str, module: str) -> str:
    """An optional autorefs cross-reference to ``text`` (``~a.b`` shows ``b``)."""
    shown = text
    if text.startswith("~"):
        text = text[1:]
        shown = text.rsplit(".", 1)[-1]
    target = text.rstrip("()")
    if "." not in target:
        target = f"{module}.{target}"
    return f'<autoref identifier="{target}" optional><code>{shown}</code></autoref>'


def _inline(line: str, module: str) -> str:
    def role(match: re.Match[str]) -> str:
        name, text = match["role"], match["text"]
        if name == "math":
            return f"${text.strip()}$"
        if name in _LINK_ROLES:
            return _reference(text, module)
        return f"`{text}`"

    return _MODULE_DOCSTRING.sub(
        rf"[\g<0>][{module}]", _MATH_CITATION.sub(_math_link, _ROLE.sub(role, line))
    )


# "the module docstring", "(module docstring)": a link to the module's entry on the site (the
# API index shows the docstring of every module that the entries cite; an entry citing one that
# is not on the site is an unresolved cross-reference, which fails the strict build).
_MODULE_DOCSTRING = re.compile(r"(?<![\w\[])(?:the )?module docstring(?:'s \w+)?(?![\w\]])")
# Fenced blocks and display math, left as they are by _escape_stars.
_BLOCK = re.compile(r"(^[ \t]*```.*?^[ \t]*```[ \t]*$|^[ \t]*\$\$$.*?^[ \t]*\$\$$)", re.M | re.S)
# Inline code (``x`` or `x`, on one line or across lines) and math ($x$).
_VERBATIM = re.compile(r"(``.+?``|`[^`]+`|\$[^$]+\$)", re.S)
# An asterisk that cannot open or close emphasis in reST: a lone one (shapes such as "(*, n)",
# "a * b") or one inside a word ("(B*K,)"), both literal in reST, emphasis in Markdown.
_LITERAL_STAR = re.compile(r"(?<![\w*\\])\*(?![\w*])|(?<=\w)\*(?=\w)")
_BULLET_STAR = re.compile(r"(^|\n)([ \t]*)\\\*(?= )")


def _escape_stars(text: str) -> str:
    """Escape the literal asterisks of prose, which Markdown would read as emphasis: lone ones
    and those inside a word, not the asterisks of a bullet (``* item``), of ``**bold**``, of
    inline code (also when it runs across lines) or of math."""
    out = []
    for i, block in enumerate(_BLOCK.split(text)):
        if i % 2:
            out.append(block)
            continue
        parts = _VERBATIM.split(block)
        prose = "".join(
            part if j % 2 else _LITERAL_STAR.sub(r"\\*", part) for j, part in enumerate(parts)
        )
        out.append(_BULLET_STAR.sub(r"\1\2*", prose))
    return "".join(out)


# A type before the colon of the first line of Returns ("TopK: the values, ..."); anything else
# there is prose, whose colon griffe would take as the end of a type.
_TYPE = re.compile(r"^\(?[A-Za-z_][\w.]*(?:\[[\w.,| \[\]]*\])?(?: \| [\w.\[\], ]+)*\)?$")
_RETURNS = re.compile(r"^(?P<pad>[ \t]*)Returns:\n(?P<first>[ \t]*\S[^\n]*)", re.M)


def _returns_without_type(text: str, returns: str | None) -> str:
    """Give a Returns section whose first line holds a colon of prose ("A :class:`X`, each of
    shape ...: the ...") the return annotation as its type, so that griffe does not show the
    prose up to the colon as a type: ``returns`` (the function's annotation) before a colon, or,
    without an annotation, the line's colons written as ``&#58;``."""

    def fix(match: re.Match[str]) -> str:
        first = match["first"]
        if ":" not in first or _TYPE.match(first.split(":", 1)[0].strip()):
            return match.group()
        pad = first[: len(first) - len(first.lstrip())]
        line = f"{pad}{returns}: {first.lstrip()}" if returns else first.replace(":", "&#58;")
        return f"{match['pad']}Returns:\n{line}"

    return _RETURNS.sub(fix, text)


def _math_link(match: re.Match[str]) -> str:
    number = match["number"]
    if number is None:
        return "[docs/math.md][the-math-behind-softops]"
    return f"[docs/math.md §{number}][math-{number}]"


def _block(lines: list[str], start: int, base: int) -> int:
    """The end (exclusive) of the indented block that starts after line ``start``."""
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return end


def _dedented(lines: list[str]) -> list[str]:
    depth = min(_indent(line) for line in lines if line.strip())
    return [line[depth:] for line in lines]


def rst_to_markdown(text: str, module: str, returns: str | None = None) -> str:
    """Rewrite the reStructuredText markup of one docstring as Markdown (see the module);
    ``returns``: the return annotation of the function it documents, if any."""
    lines = re.sub(r"docs/math\.md\n\s*§", "docs/math.md §", text).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        base = _indent(line)
        pad = " " * base
        if stripped.startswith(">>>"):
            end = i
            while end < len(lines) and lines[end].strip() and _indent(lines[end]) >= base:
                end += 1
            body = [row[base:] for row in lines[i:end]]
            out += [*_gap(out), f"{pad}```pycon", *[f"{pad}{row}" for row in body], f"{pad}```"]
            out.append("")
            i = end
            continue
        if stripped == "References:":
            end = _block(lines, i, base)
            out.append(line)
            out += [_inline(row, module) for row in _references(lines[i + 1 : end])]
            i = end
            continue
        if stripped.startswith(".. math::"):
            end = _block(lines, i, base)
            body = [row for row in _dedented(lines[i + 1 : end]) if row.strip()]
            first = stripped[len(".. math::") :].strip()
            out += ["", f"{pad}$$", *([f"{pad}{first}"] if first else [])]
            out += [f"{pad}{row}" for row in body] + [f"{pad}$$", ""]
            i = end
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            end = _block(lines, i, base)
            body = _dedented(lines[i + 1 : end]) if end > i + 1 else []
            while body and not body[0].strip():
                body.pop(0)
            head = _inline(line[:-1], module)
            if not body or body[0].lstrip().startswith(">>>"):
                out.append(head)
                i += 1
                continue
            language = "python" if _looks_like_python(body) else "text"
            out += [head.rstrip(":").rstrip() + ":", "", f"{pad}```{language}"]
            out += [f"{pad}{row}" if row.strip() else "" for row in body] + [f"{pad}```", ""]
            i = end
            continue
        out.append(_inline(line, module))
        i += 1
    return _escape_stars(_returns_without_type(_one_name_per_entry(out), returns))


_NAMED_SECTION = re.compile(r"^\s*(?:Args|Arguments|Parameters|Raises):\s*$")
_SHARED_ENTRY = re.compile(r"^(?P<pad>\s+)(?P<names>\w+(?:, \w+)+):(?P<rest>.*)$")


def _one_name_per_entry(lines: list[str]) -> str:
    """Split an entry of Args or Raises that names several parameters or exceptions ("epsilon,
    method: as for the function", "TypeError, ValueError: ..."), which griffe would read as one
    parameter of that name, into one entry per name, each with the whole description."""
    out: list[str] = []
    section, i = None, 0
    while i < len(lines):
        line = lines[i]
        if _NAMED_SECTION.match(line):
            section = _indent(line)
        elif line.strip() and section is not None and _indent(line) <= section:
            section = None
        match = _SHARED_ENTRY.match(line) if section is not None else None
        if match is None or _indent(line) <= (section or 0):
            out.append(line)
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() and _indent(lines[end]) > _indent(line):
            end += 1
        for name in match["names"].split(", "):
            out += [f"{match['pad']}{name}:{match['rest']}", *lines[i + 1 : end]]
        i = end
    return "\n".join(out)


_ENTRY_START = re.compile(r"^[A-Z][\w'-]*(?:,| and | et al\.| [A-Z][\w-]*\.|\.)")


def _references(block: list[str]) -> list[str]:
    """The lines of a References section as a Markdown list, one item per entry."""
    rows = [row for row in block if row.strip()]
    if not rows:
        return block
    depth = _indent(rows[0])
    out: list[str] = []
    previous = ""
    for row in rows:
        text = row.strip()
        starts = not out or (previous.endswith((".", ")", ".)")) and _ENTRY_START.match(text))
        out.append(f"{' ' * depth}- {text}" if starts else f"{' ' * (depth + 2)}{text}")
        previous = text
    return [*out, ""]


def _gap(out: list[str]) -> list[str]:
    """A blank line before a block, except right after a section title ("Example:"), where
    griffe would end the section."""
    if not out or not out[-1].strip() or out[-1].rstrip().endswith(":"):
        return []
    return [""]


def _looks_like_python(body: list[str]) -> bool:
    try:
        ast.parse("\n".join(body))
    except SyntaxError:
        return False
    return True


class RstToMarkdown(griffe.Extension):
    """Rewrite each docstring's reStructuredText markup before mkdocstrings parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        module = obj.path if obj.is_module else obj.module.path
        if _PLACEHOLDER.search(docstring.value):
            docstring.value = _runtime_docstring(obj) or docstring.value
        returns = getattr(obj, "returns", None) if obj.is_function else None
        docstring.value = rst_to_markdown(
            docstring.value, module, str(returns) if returns else None
        )


# A line that is only a placeholder ("    {args}"), which the module fills in at import time.
_PLACEHOLDER = re.compile(r"^\s*\{\w+\}\s*$", re.M)


def _runtime_docstring(obj: griffe.Object) -> str | None:
    """The docstring of ``obj`` as Python has it once its module is imported (the source holds a
    placeholder that the module fills in, as softops.metrics does for its common Args)."""
    try:
        value: Any = importlib.import_module(obj.module.path)
        for name in obj.path[len(obj.module.path) + 1 :].split("."):
            value = getattr(value, name)
    except (ImportError, AttributeError):
        return None
    doc = getattr(value, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else None
