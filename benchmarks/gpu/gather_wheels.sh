#!/usr/bin/env bash
# Gather, here (where the package registry is reachable), the wheels benchmarks/gpu/run.sh installs on the GPU
# machine (Python 3.12, x86-64, no network) into .whl/ (git-ignored), and check they stay under 60 MB in all.
#
#     bash benchmarks/gpu/gather_wheels.sh [NAME==VERSION ...]   # extra wheels, e.g. pyarrow==26.0.1 (55 MB)
#
# pyarrow is not gathered by default: the image holds one, and its 55 MB wheel and the repository's tokenizer files
# (trajlab/models/tokenizer_files, 9 MB) do not both fit in the 64 MiB a call carries. run.sh says when it is needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
{ grep -v '^#' benchmarks/gpu/wheels.txt | grep .; printf '%s\n' "$@"; } | grep . | while read -r spec; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d .whl "$spec"
done
size_mb=$(du -sm .whl | cut -f1)
echo "$(ls .whl | wc -l) wheels in .whl/, ${size_mb} MB"
if [ "$size_mb" -gt 60 ]; then
  echo "over the 60 MB budget a GPU call can carry next to the repository" >&2
  exit 1
fi
