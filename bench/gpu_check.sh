#!/usr/bin/env bash
# GPU check: build specfleet with CUDA in its own virtual env, then verify what only a machine
# with an NVIDIA GPU can (bench/gpu_check.py: fitter vs NVML, device pinning, the device
# checkpoint path, the service end to end, the multi-slot bench) and write a markdown report.
#
#   bench/gpu_check.sh [REPORT.md]        (default: bench/gpu-check-<UTC time>.md)
#
#   GPU_CHECK_VENV=.venv-cuda   the CUDA virtual env (built or reused)
#   GPU_CHECK_SKIP=slots        checks to skip, comma-separated
#   CUDA_ARCHITECTURES=90       compile for these SM versions (default: the GPUs present)
#
# Needs: nvidia-smi and the driver, the CUDA toolkit (nvcc), python3 >= 3.11 with venv, a C++
# toolchain and cmake, and Redis (REDIS_URL, 127.0.0.1:6379 or a redis-server binary).
# Exit status: 0 all checks passed, 1 a check failed, 2 the machine lacks something.
set -euo pipefail
cd "$(dirname "$0")/.."

report="${1:-bench/gpu-check-$(date -u +%Y%m%dT%H%M%SZ).md}"
venv="${GPU_CHECK_VENV:-.venv-cuda}"

need() { echo "gpu_check: $1" >&2; exit 2; }
command -v nvidia-smi >/dev/null || need "nvidia-smi not found: this needs an NVIDIA GPU and driver"
nvidia-smi -L >&2 || need "nvidia-smi sees no GPU"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
command -v nvcc >/dev/null || need "nvcc not found: install the CUDA toolkit (or add it to PATH)"
command -v cmake >/dev/null || need "cmake not found"
if [ -z "${REDIS_URL:-}" ] && ! command -v redis-server >/dev/null \
   && ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
  need "no Redis: set REDIS_URL, run one on 127.0.0.1:6379 or install redis-server"
fi

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
# The one pin, read from pyproject.toml; rebuilt unless this env already offloads to the GPU.
pin="$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)"
if ! "$venv/bin/python" -c 'import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())' 2>/dev/null; then
  echo "gpu_check: building $pin with CUDA (several minutes)" >&2
  CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF${CUDA_ARCHITECTURES:+ -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHITECTURES}" \
    "$venv/bin/python" -m pip install --no-cache-dir --force-reinstall --no-deps "$pin"
fi
"$venv/bin/python" -m pip install -q -e '.[dev,demo,cuda]'

status=0
"$venv/bin/python" bench/gpu_check.py --report "$report" --skip "${GPU_CHECK_SKIP:-}" || status=$?
echo "gpu_check: report written to $report" >&2
exit "$status"
