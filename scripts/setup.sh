#!/usr/bin/env bash
# Create .venv and install trajlab with its test tools. Idempotent: re-running only checks what is there.
# CPU machines get the CPU build of torch (pinned first, so nothing pulls the multi-GB CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install --quiet torch
  else
    pip install --quiet "torch==2.13.0"
  fi
fi
pip install --quiet -e ".[test]"
# bfcl-eval (the BFCL env's data, backends and checker) declares ~150 dependencies it does not need for those;
# installed without them, it runs on what trajlab already has (mpmath, filelock).
pip install --quiet --no-deps "bfcl-eval==2026.3.23"
