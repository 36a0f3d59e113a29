#!/usr/bin/env bash
# Screenshots of the built documentation site in headless Chromium: the home page and a family
# page (top-k), after MathJax has typeset them, to look at what a reader sees.
#
#   bash scripts/screenshot_docs.sh [OUT_DIR]      (default: site-screenshots/)
#
# It builds the site first (`mkdocs build --strict`; SKIP_BUILD=1 reuses site/), serves it on a
# free port of 127.0.0.1 and writes OUT_DIR/home.png and OUT_DIR/topk.png (the first screen of
# each), and the whole top-k page as OUT_DIR/topk-full-01.png, -02.png, ... (its API reference
# last). Needs Chromium: Debian's `apt-get install -y chromium` (or set CHROMIUM to another
# binary).
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
    "$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
        --window-size="1280,$3" --virtual-time-budget=10000 \
        --screenshot="$OUT/$1.png" "http://127.0.0.1:$PORT/$2" >/dev/null 2>&1
    echo "$OUT/$1.png"
}
shoot home "" 1600
shoot topk "topk/" 1600
# The whole top-k page, cut into pages of 1600 pixels (topk-full-01.png, ...), the blank end
# dropped: the API reference at its end is what the docstrings render to.
shoot topk-full "topk/" 24000 >/dev/null
.venv/bin/python - "$OUT" <<'PYEOF'
import sys
from pathlib import Path

import matplotlib.image as mpimg

out = Path(sys.argv[1])
image = mpimg.imread(out / "topk-full.png")
rows = (image[:, :, :3] < 0.97).any(axis=(1, 2)).nonzero()[0]
end = min(int(rows[-1]) + 40, image.shape[0]) if len(rows) else image.shape[0]
tiles = [image[top : min(top + 1600, end)] for top in range(0, end, 1600)]
tiles = [tile for tile in tiles if (tile[:, :, :3] < 0.97).any()]  # the blank below the page
for i, tile in enumerate(tiles, start=1):
    path = out / f"topk-full-{i:02d}.png"
    mpimg.imsave(path, tile)
    print(path)
(out / "topk-full.png").unlink()
PYEOF
