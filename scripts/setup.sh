#!/usr/bin/env bash
# Create .venv and install trajlab with everything its tests need, at the versions in constraints.txt (the ones the
# tests passed with). Idempotent: re-running only checks what is there.
#
# torch comes first and pinned, so nothing else pulls a build of its own; constraints.txt leaves it out because the
# build differs by machine. Without an NVIDIA GPU, torch==2.13.0 is the CPU build here (from local wheels; elsewhere
# PyPI's Linux wheel is the multi-GB CUDA build: add PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu to get
# the CPU one). With a GPU it is PyPI's CUDA build of the same version, so the rest is what the tests ran with; if
# your driver needs another build, set TORCH_SPEC (e.g. "torch==2.11.0", any torch >= 2.6) or install it into .venv
# first: a torch already there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "NVIDIA GPU found: installing $TORCH_SPEC (TORCH_SPEC picks the build your driver needs)"
  fi
  pip install --quiet "$TORCH_SPEC"
fi
pip install --quiet -c constraints.txt -e ".[test]"
# bfcl-eval (the BFCL env's data, backends and checker) declares ~150 dependencies it does not need for those;
# installed without them, it runs on what trajlab already has (mpmath, filelock).
pip install --quiet --no-deps "bfcl-eval==2026.3.23"
