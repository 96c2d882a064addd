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
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin agentq \
    && install -D -m 0755 target/release/agentq /out/agentq \
    && mkdir -p /src/migrations

# ---------------------------------------------------------------------------
# Runtime stage
# ---------------------------------------------------------------------------
FROM debian:bookworm-slim AS runtime

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 agentq \
    && useradd --system --uid 10001 --gid agentq \
        --home-dir /app --no-create-home --shell /usr/sbin/nologin agentq

WORKDIR /app

COPY --from=build /out/agentq /usr/local/bin/agentq
# Migrations are normally embedded in the binary at compile time; a copy is
# kept here so a relative ./migrations path also resolves at run time.
COPY --from=build /src/migrations /app/migrations

USER agentq:agentq

ENV RUST_LOG=info

EXPOSE 8080

ENTRYPOINT ["agentq"]
