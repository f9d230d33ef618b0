#!/usr/bin/env bash
# Install the headless browser the report tests open pages in: Debian's chromium and chromium-driver (selenium comes
# with the test extra). Idempotent; needs root and apt-get. Without them it says what to install and exits 1, and
# the browser tests skip with that reason.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "the report's browser tests need chromium and chromium-driver: install them as root" \
       "(apt-get install chromium chromium-driver) or they skip" >&2
  exit 1
fi
echo "installing chromium and chromium-driver for the report's browser tests (about a minute)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
