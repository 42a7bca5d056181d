#!/usr/bin/env bash
# Makes the Python tools the tests use available in .tools/venv (idempotent): the official MCP
# Python SDK (PyPI `mcp`, pinned), which tests/mcp_client.py uses as a real MCP client of
# `turnstile mcp`. Point the tests at it with TURNSTILE_PYTHON="$PWD/.tools/venv/bin/python".
set -euo pipefail

MCP_VERSION="2.3.0"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.tools/venv"
python="$venv/bin/python"

installed() {
  [ -x "$python" ] || return 1
  [ "$("$python" -c 'import importlib.metadata as m; print(m.version("mcp"))' 2>/dev/null)" = "$MCP_VERSION" ]
}

if ! installed; then
  if [ ! -x "$python" ]; then
    mkdir -p "$root/.tools"
    python3 -m venv "$venv"
  fi
  "$python" -m pip install --quiet --disable-pip-version-check "mcp==${MCP_VERSION}"
  installed || { echo "mcp ${MCP_VERSION} did not install into $venv" >&2; exit 1; }
fi

echo "python tools: mcp $MCP_VERSION ($python)" >&2
