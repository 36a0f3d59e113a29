"""The short scripts under examples/ run as a user runs them, and do what they print."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(name: str) -> str:
    # a hang guard, not a speed test: sharded_knn.py (two processes) takes 30 s here and took
    # over 120 s on this 2-core machine with other jobs on it
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    return done.stdout


def test_every_example_is_short_and_tested():
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == ["learn_to_rank.py", "learn_to_select.py", "sharded_knn.py"]
    for name in scripts:
        assert len((EXAMPLES / name).read_text().splitlines()) <= 70, name


def test_learn_to_select_trains_through_the_soft_topk():
    out = _run("learn_to_select.py")
    before, after = (int(v) for v in re.findall(r"(\d+)% of the top 5", out))
    assert before < 40 and after >= 90


def test_learn_to_rank_trains_through_the_soft_rank():
    out = _run("learn_to_rank.py")
    before, after = (float(v) for v in re.findall(r"training:\s+(-?\d\.\d+)", out))
    assert before < 0.3 and after > 0.9


def test_sharded_knn_trains_the_encoder_through_the_sharded_topk():
    out = _run("sharded_knn.py")
    before, after = (float(v) for v in re.findall(r"(\d+\.\d)% (?:before|after)", out))
    assert before < 85 and after > 90, out
