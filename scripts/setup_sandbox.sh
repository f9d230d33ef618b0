#!/usr/bin/env bash
# Install bubblewrap (Debian's `bubblewrap`, the `bwrap` command), which isolates the sandbox's commands in their own
# namespaces. Idempotent; needs root and apt-get. Without them it says what to install and exits 1: the tests of the
# bubblewrap mode then skip, and the ctf env refuses to start unless TRAJLAB_SANDBOX_ALLOW_WEAK=1.
set -euo pipefail
if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "the sandbox isolates commands with bubblewrap: install it as root (apt-get install bubblewrap)," \
       "or its tests skip and the ctf env refuses to start" >&2
  exit 1
fi
echo "installing bubblewrap for the sandbox"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1 || {
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
}
