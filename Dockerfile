# syntax=docker/dockerfile:1
# tpserve image: `tpserve` is the entrypoint; the same image runs the coordinator and the ranks.
#   docker build -t tpserve .                                # CPU
#   docker build -t tpserve:cuda --build-arg FEATURES=cuda \
#       --build-arg BUILD_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu24.04 \
#       --build-arg RUNTIME_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 .
ARG BUILD_IMAGE=rust:1.95-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
ARG FEATURES=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The CUDA devel images carry nvcc but no Rust: install the pinned toolchain there.
# hadolint ignore=DL3008
RUN if ! command -v cargo >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends curl ca-certificates build-essential \
        && rm -rf /var/lib/apt/lists/* \
        && curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95.0; \
    fi
ENV PATH=/root/.cargo/bin:/usr/local/cargo/bin:$PATH
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
COPY crates crates
COPY benches benches
COPY tests/fixtures/qwen3_a tests/fixtures/qwen3_a
RUN cargo build --release --locked ${FEATURES:+--features ${FEATURES}} \
    && install -m 0755 target/release/tpserve /usr/local/bin/tpserve

FROM ${RUNTIME_IMAGE}
RUN groupadd --system --gid 10001 tpserve \
    && useradd --system --uid 10001 --gid tpserve --home-dir /var/lib/tpserve --create-home tpserve \
    && mkdir -p /run/tpserve && chown tpserve:tpserve /run/tpserve
COPY --from=build /usr/local/bin/tpserve /usr/local/bin/tpserve
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["tpserve"]
CMD ["--help"]
