#!/usr/bin/env bash
# Install the benchmark peers of `python -m benchmarks sort` into a virtual environment (default: .venv).
# Not called by scripts/setup.sh or CI: the peers are optional, and torchsort compiles a C++
# extension (about 2.5 min). Every peer goes in with --no-deps so that it reuses the pinned torch.
# Each install may fail on its own (reported at the end); the others still go in.
#
#   scripts/install_peers.sh              # into .venv
#   VENV=/path/to/venv scripts/install_peers.sh
#
# SoftTorch is not installed: it needs Python >= 3.12 and a torch for it (a CUDA build of ~4 GB).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PIP=("$VENV/bin/python" -m pip install -q)
if [ ! -x "$VENV/bin/python" ]; then
    echo "install_peers: no Python at $VENV/bin/python; run scripts/setup.sh first" >&2
    exit 2
fi
failed=()

# torchsort: a C++ extension built against the installed torch. With nvcc on PATH (and no GPU)
# its build tries CUDA and fails, so nvcc's folder is taken off PATH for this one command.
path_without_nvcc=$PATH
if command -v nvcc >/dev/null 2>&1; then
    nvcc_dir=$(dirname "$(command -v nvcc)")
    path_without_nvcc=$(echo "$PATH" | tr ':' '\n' | grep -vx "$nvcc_dir" | paste -sd:)
fi
echo "install_peers: torchsort 0.1.10 (builds a C++ extension, ~2.5 min)"
PATH=$path_without_nvcc "${PIP[@]}" --no-build-isolation --no-deps "torchsort==0.1.10" \
    || failed+=(torchsort)

# torchpsort: numba-based; it declares Python >= 3.12 but runs on 3.11.
echo "install_peers: torchpsort 0.1.8"
"${PIP[@]}" --no-deps --ignore-requires-python "torchpsort==0.1.8" || failed+=(torchpsort)

# diffsort and difftopk: dense (B, n, n) relaxations (difftopk imports diffsort).
echo "install_peers: diffsort 0.2.0, difftopk 0.2.0"
"${PIP[@]}" --no-deps "diffsort==0.2.0" "difftopk==0.2.0" || failed+=(diffsort/difftopk)

if [ ${#failed[@]} -gt 0 ]; then
    echo "install_peers: failed: ${failed[*]} (their benchmark rows will be skipped)" >&2
    exit 1
fi
echo "install_peers: done"
