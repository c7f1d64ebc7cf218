"""Where a worker's memory comes from: a CUDA device (NVML), the host (psutil), an RPC device
(what its server reports) or a budget; and which fitted device each llama.cpp buffer is on.

The fitter only needs two numbers per device, total and free bytes. An explicit budget
overrides both sources: tests use it to make fits deterministic, and operators use it when
they share a device with other processes. A device group has both per device, in the
model's device order (docs/fitter.md, "Device groups").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from worker.fitter.buffers import HOST, DeviceMap
from worker.fitter.errors import FitError
from worker.launch import DeviceGroup, DeviceRef
from worker.llm.devices import has_local_gpu, no_gpu_backend
from worker.llm.placement import Placement

MIB = 1024 * 1024

@dataclass(frozen=True)
class DeviceMemory:
    """Total and free bytes of one device, and where the figures came from."""

    device: str
    total_bytes: int
    free_bytes: int
    source: str  # "nvml", "host", "rpc" or "budget"


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


def require_device(device: DeviceRef | DeviceGroup) -> None:
    """Refuse a CUDA device this process cannot really serve on, before anything is measured.

    Without this a llama.cpp built for the CPU silently keeps every layer on the host while
    the worker registers (and is scheduled) as a GPU worker; a budget (``--budget-mib``)
    would hide a missing device from the memory query, so presence is checked on its own.
    A build with only the RPC backend "offloads" too (``llama_supports_gpu_offload``), so
    what counts is a GPU of llama.cpp's own.
    """
    group = device if isinstance(device, DeviceGroup) else DeviceGroup.of(device)
    for ref in group.devices:
        if not ref.is_cuda:
            continue
        if not has_local_gpu():
            raise FitError(no_gpu_backend(ref.name))
        cuda_memory(ref.index)  # "no CUDA device cuda:N ..." when NVML does not see it


def device_memory(device: DeviceRef, budget_mib: float | None = None) -> DeviceMemory:
    """The memory the fit may use on ``device``; ``budget_mib`` overrides what is measured.

    The CLI takes fractional MiB, and the report's byte fields are integers: a budget is
    rounded to whole bytes here, where it becomes bytes.
    """
    if budget_mib is not None:
        return budget_memory(device.name, budget_mib)
    return cuda_memory(device.index) if device.is_cuda else host_memory()


def budget_memory(device: str, budget_mib: float) -> DeviceMemory:
    """``--budget-mib`` for ``device``: total = free = the budget, in whole bytes."""
    if budget_mib <= 0:
        raise FitError(f"--budget-mib must be positive, got {budget_mib}")
    budget = round(budget_mib * MIB)
    return DeviceMemory(device, budget, budget, "budget")


def device_map(group: DeviceGroup, placement: Placement | None) -> DeviceMap:
    """The fitted devices of ``group`` in the model's order (the host first on a CPU
    worker), and which of llama.cpp's buffer types and device names each one is."""
    placed = placement.devices if placement is not None else ()
    names = (("cpu",) if group.host_is_device else ()) + tuple(p.name for p in placed)
    return DeviceMap(names, "cpu" if group.host_is_device else HOST,
                     {p.device.buffer_type: p.name for p in placed},
                     {p.device.name: p.name for p in placed})


def group_memory(group: DeviceGroup, placement: Placement | None,
                 budgets_mib: Sequence[float | None]) -> list[DeviceMemory]:
    """Each fitted device's memory, in :func:`device_map`'s order: its budget where one is
    given, else what it reports (an RPC device: its server's figures for its host)."""
    placed = iter(placement.devices if placement is not None else ())
    found: list[DeviceMemory] = []
    for ref, budget in zip(group.devices, budgets_mib, strict=True):
        if not ref.is_rpc:
            memory = device_memory(ref, budget)
            name = memory.device if ref.kind == "cpu" else next(placed).name
            found.append(DeviceMemory(name, memory.total_bytes, memory.free_bytes,
                                      memory.source))
            continue
        device = next(placed)
        if budget is not None:
            found.append(budget_memory(device.name, budget))
            continue
        free, total = device.device.memory()
        found.append(DeviceMemory(device.name, total, free, "rpc"))
    return found
