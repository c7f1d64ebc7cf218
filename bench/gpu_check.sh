#!/usr/bin/env bash
# GPU check: build specfleet with CUDA in its own virtual env, then verify what only a machine
# with an NVIDIA GPU can (bench/gpu_check.py: fitter vs NVML, device pinning, the device
# checkpoint path, rows reduced on the device while sequences go idle, the service end to
# end, the multi-slot bench, decode shapes the GPU replays, sampled draws on the device, the
# default drafter's targets against plain decoding, and with two or more GPUs one
# model over a device group: per-device fit against allocation, split order, split-mode none
# and row; skipped, saying so, on one GPU) and write a markdown report.
#
#   bench/gpu_check.sh [REPORT.md]        (default: bench/gpu-check-<UTC time>.md)
#
#   GPU_CHECK_VENV=.venv-cuda   the CUDA virtual env (built or reused)
#   GPU_CHECK_SKIP=slots        checks to skip, comma-separated
#   CUDA_ARCHITECTURES=90       compile for these SM versions (default: the GPUs present)
#   GPU_CHECK_CMAKE_ARGS=...    more CMake flags for the CUDA build (-DGGML_CUDA_FA=OFF: a
#                               build minutes shorter, no flash-attention kernels)
#   GPU_CHECK_ARGS=...          more arguments for bench/gpu_check.py (--model tiny, --jobs 8)
# An air-gapped host (no package index) installs from what it is given:
#   GPU_CHECK_LLAMA_SRC=PATH    llama-cpp-python's source (its sdist, .tar.gz or unpacked) to
#                               build instead of downloading the pin
#   GPU_CHECK_WHEELS=DIR        the dependencies as wheels, installed with no index; the venv
#                               then also sees python3's packages (a GPU image's numpy, cmake,
#                               scikit-build-core: the build's own requirements)
#
# A 15-minute device slot (the CUDA build alone takes several of them: build with
# CUDA_ARCHITECTURES set to the GPU's and GPU_CHECK_CMAKE_ARGS=-DGGML_CUDA_FA=OFF) runs the
# checks of replayable shapes and the drafter's targets, and skips the rest:
#   GPU_CHECK_SKIP=fit-vs-nvml,pinning,device-checkpoint,sampling,deterministic,service,slots,device-verify,device-group
# leaving environment, greedy (~1 min), device-rows (rows reduced on the device keep their own
# results while sequences go idle, ~1 min), decode-timing (tiny and Gemma, ~1 min),
# device-draws (sampled rows, a top-p nucleus included, drawn on the GPU, ~1 min) and
# spec-targets (bench/slots.py plain vs default, K = 1, 2, 4, 8 and copy-heavy K = 1, ~3 min).
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

if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  [ -d "$GPU_CHECK_WHEELS" ] || need "GPU_CHECK_WHEELS=$GPU_CHECK_WHEELS is not a directory"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv --system-site-packages "$venv"
    # python3 may itself be a venv's (a GPU image's): its packages are not the "system" ones.
    purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
    python3 -c "$purelib" >"$("$venv/bin/python" -c "$purelib")/_host_packages.pth"
  fi
  pip_offline=(--no-index --find-links "$GPU_CHECK_WHEELS")
  # No index to fetch build requirements from: python3's own (scikit-build-core, cmake).
  build_args=(--no-build-isolation)
else
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
  pip_offline=()
  build_args=()
fi
# The one pin, read from pyproject.toml; rebuilt unless this env already offloads to the GPU.
pin="$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)"
llama_source="${GPU_CHECK_LLAMA_SRC:-$pin}"
if [ -n "${GPU_CHECK_LLAMA_SRC:-}" ] && [ ! -e "$GPU_CHECK_LLAMA_SRC" ]; then
  need "GPU_CHECK_LLAMA_SRC=$GPU_CHECK_LLAMA_SRC does not exist"
fi
if ! "$venv/bin/python" -c 'import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())' 2>/dev/null; then
  echo "gpu_check: building $pin with CUDA from $llama_source (several minutes)" >&2
  started=$SECONDS
  CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF -DGGML_RPC=ON${CUDA_ARCHITECTURES:+ -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHITECTURES} ${GPU_CHECK_CMAKE_ARGS:-}" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$venv/bin/python" -m pip install --no-cache-dir --force-reinstall --no-deps \
    "${pip_offline[@]}" "${build_args[@]}" "$llama_source"
  echo "gpu_check: CUDA build took $((SECONDS - started)) s" >&2
fi
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  # The GPU checks need the service, not the dev tools: no index means no test extras.
  "$venv/bin/python" -m pip install -q "${pip_offline[@]}" "$GPU_CHECK_WHEELS"/*.whl
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
else
  "$venv/bin/python" -m pip install -q -e '.[dev,demo,cuda]'
fi

status=0
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of arguments
"$venv/bin/python" bench/gpu_check.py --report "$report" --skip "${GPU_CHECK_SKIP:-}" \
  ${GPU_CHECK_ARGS:-} || status=$?
echo "gpu_check: report written to $report" >&2
exit "$status"
