# syntax=docker/dockerfile:1.7
# Fenceline's production image: every service binary in one image, the service chosen
# by the command (`fenceline-intake`, `fenceline-scheduler`, `fenceline-executor`,
# `fenceline-reconciler`, `fenceline-admin ensure-topics`). docs/deploy.md says what
# runs where; deploy/k8s/ and deploy/compose.yaml run it.
#
#   docker build -t fenceline:0.1.0 .                    # the production image
#   docker build --target staging -t fenceline:staging . # plus the fake provider

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

# --- build ------------------------------------------------------------------------
FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
# rdkafka-sys compiles librdkafka from source (./configure and make) and links it
# statically; librdkafka itself links the system's OpenSSL and zlib, so the runtime
# stage needs libssl3 and zlib1g, nothing else (ldd on the binaries shows libz,
# libssl, libcrypto, libgcc_s, libm and libc).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libssl-dev zlib1g-dev pkg-config make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The workspace is built as one: its members' manifests must all be present.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
      -p fenceline-intake -p fenceline-scheduler -p fenceline-executor \
      -p fenceline-reconciler -p fenceline-admin -p fenceline-fake-provider \
 && mkdir -p /out \
 && cp target/release/fenceline-intake target/release/fenceline-scheduler \
       target/release/fenceline-executor target/release/fenceline-reconciler \
       target/release/fenceline-admin target/release/fenceline-fake-provider /out/

# --- what every image stands on ----------------------------------------------------
FROM debian:${DEBIAN_RELEASE}-slim AS base
# libssl3 and zlib1g for librdkafka, ca-certificates for TLS to the brokers and the
# providers, curl for the health check.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3 zlib1g curl \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 fenceline \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin fenceline
# Every service listens here (health, readiness, its API); the port is the same in
# every container, so the health check and the manifests need no per-service port.
ENV FENCELINE_HTTP_ADDR=0.0.0.0:8080 \
    RUST_LOG=info
EXPOSE 8080
# /healthz answers while the process lives (shared/runtime); the port follows
# FENCELINE_HTTP_ADDR. One-shot commands (fenceline-admin) exit before it matters.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD curl -fsS "http://127.0.0.1:${FENCELINE_HTTP_ADDR##*:}/healthz" >/dev/null || exit 1
# A numeric user, so Kubernetes' runAsNonRoot can check it.
USER 10001:10001

# --- staging: the services and the fake provider ------------------------------------
FROM base AS staging
COPY --from=build /out/ /usr/local/bin/
CMD ["fenceline-intake", "--help"]

# --- production (the default target): the services and fenceline-admin -------------
FROM base AS runtime
COPY --from=build /out/fenceline-intake /out/fenceline-scheduler /out/fenceline-executor \
     /out/fenceline-reconciler /out/fenceline-admin /usr/local/bin/
# No service is the default: the command names it.
CMD ["fenceline-intake", "--help"]
