#!/usr/bin/env bash
# README command (a): set up, build the tiny offline model, collect demonstrations with the reference policy and
# rollouts of the untrained model on held-out tasks, printing a summary of each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
RUN=${RUN:-runs/quickstart}
mkdir -p "$RUN"
[ -f "$RUN/model/config.json" ] || trajlab model init "$RUN/model"
trajlab collect --env arithmetic --policy oracle --tokenizer "$RUN/model" --episodes 64 --split train \
  --out "$RUN/demos.jsonl"
trajlab collect --env arithmetic --policy "$RUN/model" --episodes 32 --split test --max-turns 4 \
  --out "$RUN/untrained-test.jsonl"
