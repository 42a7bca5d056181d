#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole stack locally with a demo session.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/install-nats-server.sh
cargo build --bins
exec target/debug/turnstile dev "$@"
