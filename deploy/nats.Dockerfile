# nats-server alone, for a deployment without a registry: scripts/build-images.sh copies the
# pinned binary (scripts/install-nats-server.sh, statically linked) next to this file.
# With a registry, use the official `nats` image instead (docker-compose.yml: NATS_IMAGE).
FROM scratch
COPY nats-server /nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["/nats-server"]
