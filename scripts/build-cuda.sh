#!/usr/bin/env bash
# Builds a release tpserve with the `cuda` feature on a machine with no GPU and no CUDA install,
# for a GPU machine that cannot build it (no Rust toolchain, no network):
#
#     scripts/build-cuda.sh        # writes target/gpu-bin/tpserve.xz (about 12 MB)
#     # copy it over, then there: TPSERVE_BIN=target/gpu-bin/tpserve.xz scripts/gpu-smoke.sh
#
# The toolchain comes from PyPI (scripts/cuda-env.sh). Linking needs unversioned library names
# (the wheels ship libcublas.so.13 and the like) and a libcuda, which only a GPU driver
# installs: the script links against a stub libcuda made from cudarc's driver bindings, with
# the driver's soname, so the real libcuda.so.1 is the one loaded at run time. The binary then
# needs, on the GPU machine, the driver plus libcudart.so.13 (candle-kernels' static kernels),
# libnccl.so.2, libcublas(Lt).so.13, libcurand.so.10 and libnvrtc.so.13 (the nvidia-* Python
# wheels); scripts/gpu-smoke.sh finds them.
#
# CUDA_COMPUTE_CAP (default 90) picks the GPU architecture of candle's kernels. A clean build
# takes a while on a small machine (candle-kernels' nvcc plus a release build of everything);
# it has a target directory of its own (TPSERVE_CUDA_BUILD_DIR, default target/cuda-release).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh
export CARGO_TARGET_DIR="${TPSERVE_CUDA_BUILD_DIR:-$PWD/target/cuda-release}"
STUBS="$CARGO_TARGET_DIR/link-libs"
mkdir -p "$STUBS"

# cudarc's driver bindings name every libcuda function the build could reference.
CUDARC_DIR="$(cargo metadata --format-version 1 --features cuda 2>/dev/null | python3 -c '
import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc":
        print(os.path.dirname(p["manifest_path"]))
        break
')"
[[ -f "$CUDARC_DIR/src/driver/sys/mod.rs" ]] || { echo "build-cuda: cannot find cudarc's sources (cargo fetch first?)" >&2; exit 1; }
grep -ohE '\bfn cu[A-Za-z0-9_]+\(' "$CUDARC_DIR/src/driver/sys/mod.rs" | sed 's/^fn //; s/($//' | sort -u \
    | sed 's/.*/void &(void) {}/' >"$STUBS/libcuda-stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUBS/libcuda.so" "$STUBS/libcuda-stub.c"

link() { # name file
    [[ -e "$2" ]] || { echo "build-cuda: $2 is missing from the CUDA wheels" >&2; exit 1; }
    ln -sf "$2" "$STUBS/lib$1.so"
}
link cudart "$TPSERVE_CUDA_ROOT/lib/libcudart.so.13"
link nccl "$TPSERVE_CUDA_SITE/nvidia/nccl/lib/libnccl.so.2"
link cublas "$TPSERVE_CUDA_ROOT/lib/libcublas.so.13"
link cublasLt "$TPSERVE_CUDA_ROOT/lib/libcublasLt.so.13"
link curand "$TPSERVE_CUDA_ROOT/lib/libcurand.so.10"
link nvrtc "$TPSERVE_CUDA_ROOT/lib/libnvrtc.so.13"
export LIBRARY_PATH="$STUBS${LIBRARY_PATH:+:$LIBRARY_PATH}"

started=$SECONDS
cargo build --release --features cuda --bin tpserve
mkdir -p target/gpu-bin
# Line tables make the binary several times larger, and even without them it is about 75 MB
# (candle's kernels are in it): the copy to carry is stripped and compressed.
objcopy --strip-debug "$CARGO_TARGET_DIR/release/tpserve" "$STUBS/tpserve"
xz -T0 -6 -c "$STUBS/tpserve" >target/gpu-bin/tpserve.xz
echo "build-cuda: target/gpu-bin/tpserve.xz ($(du -h target/gpu-bin/tpserve.xz | cut -f1)) in $((SECONDS - started)) s" >&2
