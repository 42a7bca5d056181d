#!/usr/bin/env bash
# The decoders' mutation fuzzer (shared/src/fuzz.rs) for longer than the unit test's bounded
# 2,000 rounds a decoder: ROUNDS rounds (default 200,000) from SEED (default: the time), each
# decoder fed mutated lane items, commands, ends, API requests and records. Fails on a panic
# or a refusal without a reason, printing the seed to replay.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seed="${SEED:-$(date +%s)}"
echo "fuzz: seed $seed, ${ROUNDS:-200000} rounds a decoder (replay: SEED=$seed scripts/fuzz.sh)"
TURNSTILE_FUZZ_SEED="$seed" TURNSTILE_FUZZ_ROUNDS="${ROUNDS:-200000}" \
  cargo test -p turnstile-shared --lib fuzz:: -- --nocapture
