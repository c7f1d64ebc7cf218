"""Where a model's layers go: a device group resolved to llama.cpp devices and applied to the
models a process loads.

A group (:class:`worker.launch.DeviceGroup`) names devices as operators do (``cuda:1``,
``RPC[127.0.0.1:50052]``); :func:`resolve` turns it into llama.cpp's devices, connecting RPC
servers, and :class:`Placement` sets ``llama_model_params.devices``, ``split_mode`` and
``tensor_split`` from it. The list is always explicit, so a model never spreads over devices
the group does not name (llama.cpp's default: every GPU it sees).

The placement is process state while it is active (:func:`placed`), as the visible devices
are: the engine builds its model from an ``EngineConfig`` that has no room for devices, and
the fitter must measure exactly what the engine will load. Every model loaded inside the
block with layers to offload (``n_gpu_layers != 0``) gets it; one loaded with none keeps
every layer on the host, as before.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import llama_cpp

from worker.launch import DeviceGroup, DeviceRef, SplitMode
from worker.llm.backend import LlamaError
from worker.llm.devices import (
    Device,
    add_rpc_server,
    device_by_name,
    has_local_gpu,
    no_gpu_backend,
)

_SPLIT_MODES = {SplitMode.NONE: llama_cpp.LLAMA_SPLIT_MODE_NONE,
                SplitMode.LAYER: llama_cpp.LLAMA_SPLIT_MODE_LAYER,
                SplitMode.ROW: llama_cpp.LLAMA_SPLIT_MODE_ROW}


@dataclass(frozen=True)
class PlacedDevice:
    """One device that takes layers: the name a fit reports it by, and llama.cpp's device."""

    #: ``cuda:N``, or an RPC device's buffer type (``RPC0[HOST:PORT]``: llama.cpp's own name
    #: in every buffer line of that device).
    name: str
    device: Device


@dataclass(frozen=True)
class Placement:
    """A group resolved: its layer-taking devices in the model's order."""

    group: DeviceGroup
    devices: tuple[PlacedDevice, ...]

    def apply(self, params: llama_cpp.llama_model_params) -> tuple[object, ...]:
        """Set the model parameters; returns the arrays they point into, which must live
        until the model has loaded (llama.cpp copies the list while loading)."""
        devices = (ctypes.c_void_p * (len(self.devices) + 1))(
            *(d.device.handle for d in self.devices), None)
        # The binding declares the field a void pointer (its type stub: an array).
        params.devices = ctypes.addressof(devices)  # type: ignore[assignment]
        params.split_mode = _SPLIT_MODES[self.group.split_mode]
        params.main_gpu = 0  # split-mode none: the group's first device
        if self.group.tensor_split is None:
            return (devices,)
        split = (ctypes.c_float * llama_cpp.llama_max_devices())(*self.group.tensor_split)
        params.tensor_split = split
        return devices, split


_active: list[Placement] = []


def active_placement() -> Placement | None:
    """The placement models loaded now get (None: no group, every layer on the host)."""
    return _active[-1] if _active else None


@contextmanager
def placed(group: DeviceGroup) -> Iterator[Placement | None]:
    """Load models inside the block on ``group`` (nothing changes for a group with no device
    that takes layers: a CPU worker). Raises LlamaError naming a device that cannot be used."""
    if not group.offload:
        yield None
        return
    current = active_placement()
    if current is not None:
        if current.group != group:
            raise LlamaError(f"this process already places models on {current.group.name}, "
                             f"not {group.name}")
        yield current
        return
    placement = resolve(group)
    _active.append(placement)
    try:
        yield placement
    finally:
        _active.remove(placement)


def resolve(group: DeviceGroup) -> Placement:
    """llama.cpp's device for every member of ``group`` that takes layers, in order."""
    return Placement(group, tuple(_resolve(ref) for ref in group.offload))


def _resolve(ref: DeviceRef) -> PlacedDevice:
    if ref.is_rpc:
        host, _, port = ref.endpoint.rpartition(":")
        devices = add_rpc_server(host, int(port))
        if len(devices) != 1:
            raise LlamaError(f"the RPC server at {ref.endpoint} (--rpc) offers {len(devices)} "
                             "devices; run one server per device (llama.cpp's rpc-server -d)")
        return PlacedDevice(devices[0].buffer_type, devices[0])
    if not has_local_gpu():
        raise LlamaError(no_gpu_backend(ref.name))
    return PlacedDevice(ref.name, device_by_name(f"CUDA{_cuda_position(ref.index)}"))


def _cuda_position(index: int) -> int:
    """llama.cpp numbers the GPUs it sees from 0: ``cuda:N`` is CUDA<k>, k its position among
    the visible devices (all of them, numbered as NVML does, when none are pinned)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    shown = [v.strip() for v in visible.split(",") if v.strip()]
    if str(index) not in shown:
        raise LlamaError(f"cuda:{index} is not visible to this process "
                         f"(CUDA_VISIBLE_DEVICES={visible!r})")
    return shown.index(str(index))
