#!/usr/bin/env bash
# Screenshots of the built documentation site in headless Chromium at 1280 px, after MathJax has
# typeset each page, to look at what a reader sees: every page of the site.
#
#   bash scripts/screenshot_docs.sh [OUT_DIR]      (default: site-screenshots/)
#
# It builds the site first (`mkdocs build --strict`; SKIP_BUILD=1 reuses site/), serves it on a
# free port of 127.0.0.1 and writes, for every page, its first screen as OUT_DIR/<page>.png
# (`home`, `topk`, `benchmarks-sort`, ...) and the page's first 16000 pixels cut into screens of
# 1600 as OUT_DIR/<page>-full-01.png, -02.png, ... (PAGES="topk math" limits both to those
# pages; FULL=0 skips the long ones). Needs Chromium: Debian's `apt-get install -y chromium` (or set
# CHROMIUM to another binary). scripts/check_site.py --browser checks the same pages for
# console and MathJax errors.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-site-screenshots}
CHROMIUM=${CHROMIUM:-chromium}
if ! command -v "$CHROMIUM" >/dev/null 2>&1; then
    echo "screenshot_docs: expected Chromium ($CHROMIUM); install it with apt-get install -y chromium" >&2
    exit 2
fi
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
fi
mkdir -p "$OUT"
PORT=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
.venv/bin/python -m http.server --bind 127.0.0.1 --directory site "$PORT" >/dev/null 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 50); do
    if .venv/bin/python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/')" 2>/dev/null; then
        break
    fi
    sleep 0.1
done

shoot() {  # shoot NAME URL_PATH HEIGHT
    # --virtual-time-budget lets MathJax typeset before the picture is taken.
    timeout 180 "$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
        --window-size="1280,$3" --virtual-time-budget=10000 \
        --screenshot="$OUT/$1.png" "http://127.0.0.1:$PORT/$2" >/dev/null 2>&1 ||
        echo "screenshot_docs: no screenshot of /$2 at height $3" >&2
    echo "$OUT/$1.png"
}
# Every page of the site (its URL path and a file name: benchmarks/sort/ -> benchmarks-sort).
if [ -z "${PAGES:-}" ]; then
    PAGES=$(cd site && find . -name index.html -not -path './assets/*' | sed 's|^\./||; s|^index.html$|.|; s|/index.html$||' | sort)
fi
for page in $PAGES; do
    if [ "$page" = . ]; then name=home url=""; else name=${page//\//-} url="$page/"; fi
    shoot "$name" "$url" 1600
    if [ "${FULL:-1}" = 1 ]; then
        # The whole page (its first 16000 pixels: Chromium hangs on taller windows), cut below
        # into screens of 1600.
        shoot "$name-full" "$url" 16000 >/dev/null
    fi
done
[ "${FULL:-1}" = 1 ] || exit 0
.venv/bin/python - "$OUT" <<'PYEOF'
import sys
from pathlib import Path

import matplotlib.image as mpimg

out = Path(sys.argv[1])
for full in sorted(out.glob("*-full.png")):
    image = mpimg.imread(full)
    rows = (image[:, :, :3] < 0.97).any(axis=(1, 2)).nonzero()[0]
    end = min(int(rows[-1]) + 40, image.shape[0]) if len(rows) else image.shape[0]
    tiles = [image[top : min(top + 1600, end)] for top in range(0, end, 1600)]
    tiles = [tile for tile in tiles if (tile[:, :, :3] < 0.97).any()]  # the blank below the page
    for i, tile in enumerate(tiles, start=1):
        mpimg.imsave(out / f"{full.stem}-{i:02d}.png", tile)
    print(f"{out / full.stem}-01..{len(tiles):02d}.png")
    full.unlink()
PYEOF
