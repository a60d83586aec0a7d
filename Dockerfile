# The hotstart image: the `hotstart` binary (sidecar daemon, CLI, FUSE mounts) on Debian slim.
#
#   docker build -t hotstart:0.1.0 .
#   docker run --rm hotstart:0.1.0 serve --help
#
# `serve` needs a cluster token (HOTSTART_CLUSTER_TOKEN or _FILE) and, since it listens on every
# address, the TLS files of its peer links (HOTSTART_TLS_DIR; `hotstart tls init` makes them).
# The sidecar needs no privileges. `hotstart mount` and `hotstart image mount` need /dev/fuse
# and CAP_SYS_ADMIN in the container that mounts.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin hotstart \
    && cp target/release/hotstart /usr/local/bin/hotstart

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates fuse3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/hotstart /usr/local/bin/hotstart
# Peers (7070) and /livez, /readyz, /metrics (7071).
EXPOSE 7070 7071
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/hotstart"]
CMD ["serve"]
