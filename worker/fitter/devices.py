"""Where a worker's memory comes from: a CUDA device (NVML), the host (psutil) or a budget.

The fitter only needs two numbers per device, total and free bytes. An explicit budget
overrides both sources: tests use it to make fits deterministic, and operators use it when
they share a device with other processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp
import psutil

from worker.fitter.errors import FitError
from worker.launch import DeviceRef

MIB = 1024 * 1024

@dataclass(frozen=True)
class DeviceMemory:
    """Total and free bytes of one device, and where the figures came from."""

    device: str
    total_bytes: int
    free_bytes: int
    source: str  # "nvml", "host" or "budget"


def host_memory() -> DeviceMemory:
    """The host's memory: what a CPU worker may still allocate without swapping."""
    vm = psutil.virtual_memory()
    return DeviceMemory("cpu", int(vm.total), int(vm.available), "host")


def cuda_memory(index: int) -> DeviceMemory:
    """Free/total bytes of CUDA device ``index`` through NVML.

    Every NVML failure (library missing, no driver, no such index) becomes one
    ``FitError`` starting with "no CUDA device", so a worker on a GPU-less host stops with a
    message an operator understands instead of an NVML traceback.
    """
    try:
        import pynvml
    except ImportError as exc:
        raise FitError(
            f"no CUDA device: nvidia-ml-py is not installed (pip install 'specfleet[cuda]'): {exc}"
        ) from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise FitError(f"no CUDA device: NVML could not start ({exc})") from exc
    try:
        count = pynvml.nvmlDeviceGetCount()
        if not 0 <= index < count:
            raise FitError(f"no CUDA device cuda:{index}: NVML sees {count} device(s)")
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        return DeviceMemory(f"cuda:{index}", int(info.total), int(info.free), "nvml")
    except pynvml.NVMLError as exc:
        raise FitError(f"no CUDA device cuda:{index}: NVML failed ({exc})") from exc
    finally:
        pynvml.nvmlShutdown()


def require_device(device: DeviceRef) -> None:
    """Refuse a CUDA device this process cannot really serve on, before anything is measured.

    Without this a llama.cpp built for the CPU silently keeps every layer on the host while
    the worker registers (and is scheduled) as a GPU worker; a budget (``--budget-mib``)
    would hide a missing device from the memory query, so presence is checked on its own.
    """
    if not device.is_cuda:
        return
    if not llama_cpp.llama_supports_gpu_offload():
        raise FitError(f"cannot serve on {device.name}: this llama.cpp build has no GPU offload "
                       "(llama_supports_gpu_offload is false); install a CUDA build of "
                       "llama-cpp-python or use --device cpu")
    cuda_memory(device.index)  # "no CUDA device cuda:N ..." when NVML does not see it


def device_memory(device: DeviceRef, budget_mib: float | None = None) -> DeviceMemory:
    """The memory the fit may use on ``device``; ``budget_mib`` overrides what is measured.

    The CLI takes fractional MiB, and the report's byte fields are integers: a budget is
    rounded to whole bytes here, where it becomes bytes.
    """
    if budget_mib is not None:
        if budget_mib <= 0:
            raise FitError(f"--budget-mib must be positive, got {budget_mib}")
        budget = round(budget_mib * MIB)
        return DeviceMemory(device.name, budget, budget, "budget")
    return cuda_memory(device.index) if device.is_cuda else host_memory()
