# syntax=docker/dockerfile:1
#
# agentq container image: one binary, `agentq`, whose subcommand picks the role
# (migrate | worker | scheduler | dev | …). See docker-compose.yml.
#
#   docker build -t agentq .
#   docker run --rm agentq --help

# ---------------------------------------------------------------------------
# Build stage
# ---------------------------------------------------------------------------
FROM rust:1.95-bookworm AS build

# cmake: fallback build path for aws-lc-sys (TLS via rustls/aws-lc-rs).
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src

# sqlx: never try to reach a database while compiling; query macros (if any)
# use the checked-in .sqlx/ metadata.
ENV SQLX_OFFLINE=true \
    CARGO_TERM_COLOR=never

COPY . .

# BuildKit cache mounts keep the crates.io registry and target/ between builds;
# the binary is copied out of the cached target/ so the next stage can use it.
# Profile `dist` (Cargo.toml): release, without debug info and with symbols stripped.
# The SQL migrations are embedded in the binary (sqlx::migrate!), so nothing else is copied.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked --bin agentq \
    && install -D -m 0755 target/dist/agentq /out/agentq

# ---------------------------------------------------------------------------
# Runtime stage
# ---------------------------------------------------------------------------
# distroless "cc": glibc, libgcc_s (which the binary links), CA certificates and tzdata; no
# shell, no package manager. Debian 12, like the build stage, so glibc matches.
FROM gcr.io/distroless/cc-debian12 AS runtime

COPY --from=build /out/agentq /usr/local/bin/agentq

# An unprivileged numeric user (the image has no useradd; no file here needs an owner).
USER 10001:10001
WORKDIR /app

ENV RUST_LOG=info

# 8080: `agentq serve`; 9464: AGENTQ_METRICS_ADDR (GET /metrics, GET /healthz) of every role.
EXPOSE 8080 9464

# Exec form: agentq itself is PID 1 and receives the stop signal; worker, scheduler and serve
# handle SIGTERM (drain, hand back, exit). Health: `agentq probe URL` (see docker-compose.yml).
STOPSIGNAL SIGTERM
ENTRYPOINT ["agentq"]
