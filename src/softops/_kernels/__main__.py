"""``python -m softops._kernels``: build softops' CPU kernels into the per-user cache (once per
machine and torch version; ``scripts/setup.sh`` runs it)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from softops._kernels import build_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m softops._kernels", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    try:
        paths = build_all(verbose=args.verbose)
    except (subprocess.CalledProcessError, OSError) as err:
        stderr = getattr(err, "stderr", None)
        detail = stderr.decode(errors="replace")[-2000:] if stderr else str(err)
        print(f"softops: building the kernels failed:\n{detail}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"softops: kernel ready: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
