#!/usr/bin/env bash
# Makes the Python tools the tests use available in .tools/venv (idempotent): the official MCP
# Python SDK (PyPI `mcp`, pinned), which tests/mcp_client.py uses as a real MCP client of
# `turnstile mcp`, and the NATS project's Python client (PyPI `nats-py`, pinned), which
# tests/srv_discovery.py uses to find the services as a client other than async-nats. Point
# the tests at it with TURNSTILE_PYTHON="$PWD/.tools/venv/bin/python".
set -euo pipefail

MCP_VERSION="2.3.0"
NATS_PY_VERSION="2.16.0"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.tools/venv"
python="$venv/bin/python"

installed() {
  [ -x "$python" ] || return 1
  [ "$("$python" -c 'import importlib.metadata as m; print(m.version("mcp"), m.version("nats-py"))' 2>/dev/null)" = "$MCP_VERSION $NATS_PY_VERSION" ]
}

if ! installed; then
  if [ ! -x "$python" ]; then
    mkdir -p "$root/.tools"
    python3 -m venv "$venv"
  fi
  "$python" -m pip install --quiet --disable-pip-version-check "mcp==${MCP_VERSION}" "nats-py==${NATS_PY_VERSION}"
  installed || { echo "mcp ${MCP_VERSION} and nats-py ${NATS_PY_VERSION} did not install into $venv" >&2; exit 1; }
fi

echo "python tools: mcp $MCP_VERSION, nats-py $NATS_PY_VERSION ($python)" >&2
