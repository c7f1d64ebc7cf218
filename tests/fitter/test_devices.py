"""Device memory sources: parsing, the budget override, the host, and NVML's error paths."""

from __future__ import annotations

import llama_cpp
import pytest

from worker.fitter.devices import MIB, device_memory, host_memory, require_device
from worker.fitter.errors import FitError
from worker.launch import DeviceRef, parse_device, pin_device
from worker.llm.devices import has_local_gpu


def _nvml_works() -> bool:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.parametrize(("text", "ref"), [
    ("cpu", DeviceRef("cpu")), ("CUDA:1", DeviceRef("cuda", 1)), (" cuda:0 ", DeviceRef("cuda", 0)),
])
def test_parse_device(text: str, ref: DeviceRef) -> None:
    assert parse_device(text) == ref


@pytest.mark.parametrize("text", ["gpu", "cuda", "cuda:-1", "cuda:x", "rocm:0", ""])
def test_unknown_device_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="unknown device"):
        parse_device(text)


def test_budget_overrides_the_device() -> None:
    mem = device_memory(parse_device("cuda:3"), budget_mib=512)
    assert (mem.device, mem.total_bytes, mem.free_bytes, mem.source) == (
        "cuda:3", 512 * MIB, 512 * MIB, "budget")
    with pytest.raises(FitError, match="budget-mib must be positive"):
        device_memory(parse_device("cpu"), budget_mib=0)


def test_a_fractional_budget_is_whole_bytes() -> None:
    """--budget-mib is a float; the FitReport's byte fields reject fractional bytes."""
    mem = device_memory(parse_device("cpu"), budget_mib=2.3)
    assert mem.free_bytes == mem.total_bytes == round(2.3 * MIB)
    assert isinstance(mem.free_bytes, int)


def test_host_memory_comes_from_the_host() -> None:
    mem = host_memory()
    assert mem.source == "host" and 0 < mem.free_bytes <= mem.total_bytes


def test_missing_cuda_device_is_a_clean_error() -> None:
    """NVML's own failure (no library here; no such index on a GPU host) becomes FitError."""
    with pytest.raises(FitError, match="^no CUDA device"):
        device_memory(parse_device("cuda:4096"))


def test_cuda_device_reports_memory_when_nvml_works() -> None:
    if not _nvml_works():
        with pytest.raises(FitError, match="^no CUDA device: NVML could not start"):
            device_memory(parse_device("cuda:0"))
        return
    mem = device_memory(parse_device("cuda:0"))
    assert mem.source == "nvml" and 0 < mem.free_bytes <= mem.total_bytes


@pytest.mark.skipif(has_local_gpu(), reason="this llama.cpp has a GPU backend")
def test_a_cuda_device_without_gpu_offload_is_refused() -> None:
    """A CPU build of llama.cpp would keep every layer on the host while the worker claims
    the GPU: refused whatever the memory source says (a budget hides a missing device)."""
    require_device(parse_device("cpu"))
    with pytest.raises(FitError, match="^cannot serve on cuda:0: this llama.cpp build has "
                                       "no GPU offload"):
        require_device(parse_device("cuda:0"))


def test_pinning_after_llama_cpp_loaded_with_another_device_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has loaded llama.cpp: pinning to what it saw passes, to another device
    is refused rather than served on the wrong one."""
    assert llama_cpp is not None  # loaded, as in any process past the pin
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # pin_device sets it: restored after
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert pin_device(DeviceRef("cpu")) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match="loaded before the device was pinned to cpu"):
        pin_device(DeviceRef("cpu"))
    with pytest.raises(RuntimeError, match="pinned to cuda:1"):
        pin_device(DeviceRef("cuda", 1))
