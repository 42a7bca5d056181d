#!/usr/bin/env bash
# Makes Debian's headless Chromium available (idempotent) for the dashboard test, which loads
# `turnstile dashboard` in it (`--headless --no-sandbox`) while a run goes and takes a
# screenshot. Prints the binary's path on stdout; point the tests at it with
# TURNSTILE_CHROMIUM="$(scripts/install-chromium.sh)".
set -euo pipefail

find_chromium() {
  for c in chromium chromium-browser; do
    if command -v "$c" >/dev/null 2>&1; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}

if ! find_chromium >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-chromium: Debian's chromium is missing and this is not root; install it with: apt-get install chromium" >&2
    exit 1
  fi
  echo "install-chromium: installing Debian's chromium" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi

bin="$(find_chromium)" || { echo "install-chromium: chromium did not install" >&2; exit 1; }
echo "chromium: $("$bin" --version 2>/dev/null | head -1) ($bin)" >&2
echo "$bin"
