#!/usr/bin/env bash
# Builds Turnstile's container images on a Docker engine without a registry (nothing is
# pulled), from what this machine can reach:
#   turnstile-base:bookworm   Debian bookworm made by debootstrap --variant=minbase, with tmux
#                             and ca-certificates, and `docker import`ed (kept between runs)
#   turnstile:local           deploy/Dockerfile, its builder stage given the release binaries
#                             built here on the host (BUILDER_IMAGE) and its runtime stage the
#                             base above (RUNTIME_IMAGE)
#   turnstile-nats:local      FROM scratch with the pinned nats-server binary
#                             (scripts/install-nats-server.sh)
# Users with a registry build deploy/Dockerfile as it is (rust and debian images pulled).
#
# Environment: TURNSTILE_IMAGE, NATS_IMAGE (the names above), DEBIAN_MIRROR, and
# TURNSTILE_PROFILE (release; scripts/test.sh uses the debug binaries it has just built).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TURNSTILE_IMAGE="${TURNSTILE_IMAGE:-turnstile:local}"
NATS_IMAGE="${NATS_IMAGE:-turnstile-nats:local}"
BASE_IMAGE="turnstile-base:bookworm"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PROFILE="${TURNSTILE_PROFILE:-release}"

if ! docker info >/dev/null 2>&1; then
  echo "build-images: no Docker engine answers (docker info failed)" >&2
  exit 2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# 1. The Debian base, once.
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  if ! command -v debootstrap >/dev/null; then
    echo "build-images: installing debootstrap" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  echo "build-images: debootstrap bookworm (minbase) from $DEBIAN_MIRROR" >&2
  debootstrap --variant=minbase --include=tmux,ca-certificates bookworm "$work/rootfs" \
    "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
  tar -C "$work/rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    - "$BASE_IMAGE" >/dev/null
  rm -rf "$work/rootfs"
fi

# 2. The binaries, built on the host, as the Dockerfile's builder stage.
if [ "$PROFILE" = release ]; then
  cargo build --release --locked --bins
else
  cargo build --locked --bins
fi
mkdir -p "$work/prebuilt/out"
for b in turnstile turnstile-session-lane turnstile-transport-agent \
         turnstile-notification-broker turnstile-scheduler; do
  cp "target/$PROFILE/$b" "$work/prebuilt/out/"
done
printf 'FROM %s\nCOPY out/ /out/\n' "$BASE_IMAGE" > "$work/prebuilt/Dockerfile"
docker build -q -t turnstile-prebuilt:local "$work/prebuilt" >/dev/null

# 3. The image users build, from the same Dockerfile.
docker build -q -f deploy/Dockerfile \
  --build-arg BUILDER_IMAGE=turnstile-prebuilt:local \
  --build-arg RUNTIME_IMAGE="$BASE_IMAGE" \
  -t "$TURNSTILE_IMAGE" . >/dev/null

# 4. nats-server alone, FROM scratch.
scripts/install-nats-server.sh >/dev/null
mkdir -p "$work/nats"
cp .tools/bin/nats-server "$work/nats/nats-server"
cp deploy/nats.Dockerfile "$work/nats/Dockerfile"
docker build -q -t "$NATS_IMAGE" "$work/nats" >/dev/null

echo "build-images: $TURNSTILE_IMAGE, $NATS_IMAGE (base $BASE_IMAGE)"
