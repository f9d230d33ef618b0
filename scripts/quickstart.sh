#!/usr/bin/env bash
# README command (a): set up, then run the whole pipeline on the tiny offline model (configs/quickstart.yaml):
# evaluate the untrained model, collect demonstrations, SFT, evaluate, RL, evaluate, print the table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
trajlab run configs/quickstart.yaml "$@"
