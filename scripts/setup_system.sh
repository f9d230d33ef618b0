#!/usr/bin/env bash
# Install the Debian packages the tests use besides Python's: chromium and chromium-driver (the report's browser
# tests; selenium comes with the test extra) and bubblewrap (`bwrap`, which isolates the sandbox's commands in their
# own namespaces). Idempotent; needs root and apt-get. Without them it says what to install and exits 1: the tests
# of what is missing then skip, saying why, and the ctf env refuses to start unless TRAJLAB_SANDBOX_ALLOW_WEAK=1.
set -euo pipefail
missing=()
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  missing+=(chromium chromium-driver)
fi
if ! command -v bwrap >/dev/null 2>&1; then
  missing+=(bubblewrap)
fi
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "the report's browser tests and the sandbox need ${missing[*]}: install them as root" \
       "(apt-get install ${missing[*]}), or their tests skip and the ctf env refuses to start" >&2
  exit 1
fi
echo "installing ${missing[*]} for the tests (about a minute)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
