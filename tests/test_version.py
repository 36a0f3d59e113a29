"""The package version is the newest release of the CHANGELOG (Keep a Changelog headings)."""

from __future__ import annotations

import re
from pathlib import Path

import softops

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


def test_the_version_is_the_newest_release_of_the_changelog() -> None:
    releases = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$",
        CHANGELOG.read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    assert releases, "no released version in CHANGELOG.md"
    assert softops.__version__ == releases[0]
    assert re.fullmatch(r"\d+\.\d+\.\d+", softops.__version__)
