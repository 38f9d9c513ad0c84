# shellcheck shell=bash
# Sourced (not run) by scripts/check-cuda.sh and scripts/build-cuda.sh: prepares a CUDA 13.4
# toolchain for building tpserve's `cuda` feature on a machine with no GPU and no CUDA install.
#
# PyPI carries nvcc for CUDA 13 (the cu12 wheels have none). The wheels go into a virtual
# environment (once; a stamp file records the pinned set), and the variables candle's and
# cudarc's build scripts read are exported: PATH (nvcc), CUDA_HOME / CUDA_ROOT / CUDA_PATH, and
# CUDA_COMPUTE_CAP, which candle-kernels needs when there is no GPU to ask (default 90: H100 and
# H200). cudarc 0.19.10 knows CUDA up to 13.4, so the nvcc family is pinned to 13.4.x; the other
# wheels are pinned to a set known to work with it.
#
# Reads: TPSERVE_CUDA_VENV (default <repo>/cu13), CUDA_COMPUTE_CAP, PYTHON (default python3).
# Sets: TPSERVE_CUDA_SITE (the venv's site-packages), TPSERVE_CUDA_ROOT (nvidia/cu13 in it).

_tpserve_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TPSERVE_CUDA_VENV="${TPSERVE_CUDA_VENV:-$_tpserve_repo/cu13}"
_tpserve_wheels=(
    nvidia-cuda-nvcc==13.4.92
    nvidia-nvvm==13.4.92
    nvidia-cuda-crt==13.4.92
    nvidia-cuda-runtime==13.4.92
    nvidia-cuda-nvrtc==13.4.92
    nvidia-cuda-cccl==13.3.5.0.6
    nvidia-cublas==13.10.0.20
    nvidia-curand==10.4.5.25
    nvidia-nccl-cu13==2.32.3
)
_tpserve_stamp="$TPSERVE_CUDA_VENV/.tpserve-wheels"

if [[ ! -x "$TPSERVE_CUDA_VENV/bin/python" ]]; then
    echo "cuda-env: creating the virtual environment $TPSERVE_CUDA_VENV" >&2
    "${PYTHON:-python3}" -m venv "$TPSERVE_CUDA_VENV" || {
        echo "cuda-env: cannot create a virtual environment (is python3-venv installed?)" >&2
        return 1
    }
fi
if [[ "$(cat "$_tpserve_stamp" 2>/dev/null)" != "${_tpserve_wheels[*]}" ]]; then
    echo "cuda-env: installing the CUDA 13.4 toolchain wheels from PyPI" >&2
    "$TPSERVE_CUDA_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${_tpserve_wheels[@]}" || {
        echo "cuda-env: pip could not install the CUDA wheels (network? PyPI mirror?)" >&2
        return 1
    }
    echo "${_tpserve_wheels[*]}" >"$_tpserve_stamp"
fi

TPSERVE_CUDA_SITE="$("$TPSERVE_CUDA_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
TPSERVE_CUDA_ROOT="$TPSERVE_CUDA_SITE/nvidia/cu13"
if [[ ! -x "$TPSERVE_CUDA_ROOT/bin/nvcc" ]]; then
    echo "cuda-env: no nvcc at $TPSERVE_CUDA_ROOT/bin/nvcc after installing the wheels" >&2
    return 1
fi
export PATH="$TPSERVE_CUDA_ROOT/bin:$PATH"
export CUDA_HOME="$TPSERVE_CUDA_ROOT" CUDA_ROOT="$TPSERVE_CUDA_ROOT" CUDA_PATH="$TPSERVE_CUDA_ROOT"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export TPSERVE_CUDA_SITE TPSERVE_CUDA_ROOT
unset _tpserve_repo _tpserve_wheels _tpserve_stamp
