#!/usr/bin/env bash
# The GPU measurements in one command, on a machine with no network: install the wheels that
# benchmarks/gpu/gather_wheels.sh gathered into .whl/ (carried with the repository), then run benchmarks/gpu/run.py.
#
#     bash benchmarks/gpu/run.sh [run.py options]      # e.g. --out "$OUT/gpu" --arch qwen3-0.6b
#
# Refuses, before any measurement, when a wheel listed in benchmarks/gpu/wheels.txt is missing from .whl/
# (TRAJLAB_GPU_WHEELS names another folder).
set -euo pipefail
cd "$(dirname "$0")/../.."
wheels=${TRAJLAB_GPU_WHEELS:-.whl}
missing=()
while read -r spec; do
  name=${spec%%==*}
  version=${spec##*==}
  pattern="$(echo "$name" | tr '-' '_')-${version}-"
  compgen -G "$wheels/${pattern}*.whl" >/dev/null || missing+=("$spec")
done < <(grep -v '^#' benchmarks/gpu/wheels.txt | grep .)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "missing wheels in $wheels/: ${missing[*]}" >&2
  echo "gather them where a package registry is reachable: bash benchmarks/gpu/gather_wheels.sh" >&2
  exit 2
fi
# datasets 5.2 needs pyarrow >= 24: the image's, unless a pyarrow wheel was gathered (gather_wheels.sh pyarrow==...)
if ! compgen -G "$wheels/pyarrow-*.whl" >/dev/null \
  && ! python3 -c 'import sys, pyarrow; sys.exit(int(pyarrow.__version__.split(".")[0]) < 24)' 2>/dev/null; then
  echo "this machine's pyarrow ($(python3 -c 'import pyarrow; print(pyarrow.__version__)' 2>&1 | tail -1)) is" \
    "missing or older than the 24 datasets needs, and $wheels/ holds no pyarrow wheel:" >&2
  echo "gather one with bash benchmarks/gpu/gather_wheels.sh pyarrow==26.0.1 (55 MB; with it the call carries more" \
    "than 64 MiB unless trajlab/models/tokenizer_files' folders other than qwen3 are moved out of the tree first)" >&2
  exit 2
fi
# a folder named site-packages: dill (datasets' fingerprints) pickles any module outside the interpreter's prefix and
# outside a "site-packages" path by value, and fails on pyarrow's (seen with --target /tmp/site, transformers 5.17)
site=${TRAJLAB_GPU_SITE:-/tmp/trajlab-gpu/site-packages}
python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec python3 benchmarks/gpu/run.py "$@"
