#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what is missing, then fmt, clippy, every test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/install-nats-server.sh
export NATS_SERVER_BIN="$PWD/.tools/bin/nats-server"
# The official MCP Python SDK, the real client the `turnstile mcp` integration test drives.
scripts/install-python-tools.sh
export TURNSTILE_PYTHON="$PWD/.tools/venv/bin/python"
# The real Claude Code and Codex CLIs the adapter tests drive (against a scripted model).
scripts/install-agent-clis.sh
# Debian's Chromium, headless, loads `turnstile dashboard` in the dashboard test.
TURNSTILE_CHROMIUM="$(scripts/install-chromium.sh)"
export TURNSTILE_CHROMIUM

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# Integration tests spawn the service binaries as real processes (to SIGKILL them).
cargo build --workspace --bins
# The README's benchmark command builds one package, whose features are not the whole
# workspace's (a macro behind a feature only another crate turned on once broke it).
cargo check -p turnstile-bench --bins
# Unit tests first, the integration suite last (its summary closes the run).
cargo test --workspace --lib --bins
# The decoders' mutation fuzzer for longer than the unit test's rounds (fixed seed).
SEED=1 ROUNDS=20000 scripts/fuzz.sh
# The fault campaign (docs/reliability.md): a fixed seed, a few minutes of overlapping faults
# on every service, checked from the history it leaves; exits non-zero on any violation.
target/debug/turnstile-bench chaos --seed "${CHAOS_SEED:-1}" --minutes "${CHAOS_MINUTES:-10}" \
  --out target/chaos.json --png target/chaos.png > /dev/null
cargo test -p turnstile-tests --test integration -- --test-threads "${TEST_THREADS:-2}"
# The compose deployment on images built here from the binaries above (skips, saying why,
# without a Docker engine).
TURNSTILE_PROFILE=debug scripts/test-compose.sh
