#!/usr/bin/env bash
# Compile-checks the `cuda` feature (CUDA devices, NCCL collectives) on a machine with no GPU:
# `cargo check --features cuda --all-targets` with the CUDA 13.4 toolchain from PyPI
# (scripts/cuda-env.sh). Nothing is linked, so no driver or GPU is needed. .ci/run calls it.
#
# It builds in its own target directory (default target/cuda-check; TPSERVE_CUDA_TARGET_DIR
# overrides it) so that it never invalidates the CPU build's artifacts. About 5.5 minutes clean
# on 2 cores, most of it nvcc compiling candle-kernels; seconds when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh
export CARGO_TARGET_DIR="${TPSERVE_CUDA_TARGET_DIR:-$PWD/target/cuda-check}"

echo "check-cuda: nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), compute capability $CUDA_COMPUTE_CAP, target $CARGO_TARGET_DIR" >&2
started=$SECONDS
cargo check --features cuda --all-targets
echo "check-cuda: passed in $((SECONDS - started)) s" >&2
