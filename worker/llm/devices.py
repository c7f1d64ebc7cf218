"""llama.cpp's devices, through ggml's backend registry: local GPUs and RPC servers.

llama-cpp-python binds ``llama.h`` only; the device registry (``ggml-backend.h``) and the RPC
backend (``ggml-rpc.h``) are C functions of the ``libggml*.so`` it ships beside it, called
here through ctypes with their signatures declared once. A device is known by three names,
all llama.cpp's: its device name (``RPC0``, ``CUDA0``: the per-layer placement log lines),
its buffer type (``RPC0[127.0.0.1:50052]``, ``CUDA0``: every buffer-size line) and, for an RPC
device, the endpoint in its description.

RPC servers are connected with ``ggml_backend_rpc_add_server`` but never registered as
global devices: a model only uses them where its placement names them
(:mod:`worker.llm.placement`), so nothing else in the process offloads to them by default.
"""

from __future__ import annotations

import ctypes
import socket
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import llama_cpp

from worker.llm.backend import LlamaError, init_backend

_LIB_DIR = Path(llama_cpp.__file__).parent / "lib"
#: ggml_backend_dev_type (ggml-backend.h).
_TYPE_CPU, _TYPE_GPU, _TYPE_IGPU = 0, 1, 2
_P = ctypes.c_void_p
#: How long connecting to an RPC endpoint may take before it counts as unreachable.
_CONNECT_TIMEOUT_S = 5.0


@cache
def _ggml() -> ctypes.CDLL:
    """``libggml`` (the registry) with the signatures used here; llama.cpp loaded it already."""
    lib = ctypes.CDLL(str(_LIB_DIR / "libggml.so"))
    for name, args, result in (
        ("ggml_backend_reg_by_name", [ctypes.c_char_p], _P),
        ("ggml_backend_reg_name", [_P], ctypes.c_char_p),
        ("ggml_backend_reg_dev_count", [_P], ctypes.c_size_t),
        ("ggml_backend_reg_dev_get", [_P, ctypes.c_size_t], _P),
        ("ggml_backend_reg_get_proc_address", [_P, ctypes.c_char_p], _P),
        ("ggml_backend_dev_count", [], ctypes.c_size_t),
        ("ggml_backend_dev_get", [ctypes.c_size_t], _P),
        ("ggml_backend_dev_by_name", [ctypes.c_char_p], _P),
        ("ggml_backend_dev_by_type", [ctypes.c_int], _P),
        ("ggml_backend_dev_name", [_P], ctypes.c_char_p),
        ("ggml_backend_dev_description", [_P], ctypes.c_char_p),
        ("ggml_backend_dev_type", [_P], ctypes.c_int),
        ("ggml_backend_dev_backend_reg", [_P], _P),
        ("ggml_backend_dev_buffer_type", [_P], _P),
        ("ggml_backend_dev_memory", [_P, ctypes.POINTER(ctypes.c_size_t),
                                     ctypes.POINTER(ctypes.c_size_t)], None),
        ("ggml_backend_buft_name", [_P], ctypes.c_char_p),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


#: ``ggml_backend_rpc_add_server(endpoint)`` and ``ggml_backend_rpc_start_server(endpoint,
#: cache_dir, n_threads, n_devices, devices)`` (ggml-rpc.h, RPC protocol 7 in 0.3.36).
_AddServer = ctypes.CFUNCTYPE(_P, ctypes.c_char_p)
_StartServer = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                ctypes.c_size_t, ctypes.POINTER(_P))


def _rpc_proc(name: str) -> int:
    """A function of the RPC backend, found through its registry entry as llama.cpp's own
    ``rpc-server`` finds it; refused when this llama.cpp was built without it."""
    init_backend()
    ggml = _ggml()
    reg = ggml.ggml_backend_reg_by_name(b"RPC")
    address = ggml.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    if not address:
        raise LlamaError("this llama.cpp has no RPC backend: rebuild llama-cpp-python with "
                         "CMAKE_ARGS='-DGGML_RPC=ON' (make install does)")
    return int(address)


def rpc_supported() -> bool:
    """Whether this llama.cpp was built with the RPC backend (``-DGGML_RPC=ON``)."""
    return bool(llama_cpp.llama_supports_rpc())


@dataclass(frozen=True)
class Device:
    """One llama.cpp device, as its logs and buffers name it."""

    handle: int
    #: The device name (``CPU``, ``CUDA0``, ``RPC0``): llama.cpp's per-layer placement lines.
    name: str
    #: Its buffer type (``CUDA0``, ``RPC0[HOST:PORT]``): every buffer-size line.
    buffer_type: str
    #: The endpoint of an RPC device, a GPU's model for CUDA.
    description: str

    def memory(self) -> tuple[int, int]:
        """Free and total bytes, as the device reports them (an RPC server: its own)."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _ggml().ggml_backend_dev_memory(_P(self.handle), ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)


def _device(handle: int) -> Device:
    ggml = _ggml()
    ptr = _P(handle)
    buft = ggml.ggml_backend_dev_buffer_type(ptr)
    return Device(handle, ggml.ggml_backend_dev_name(ptr).decode(),
                  ggml.ggml_backend_buft_name(buft).decode(),
                  (ggml.ggml_backend_dev_description(ptr) or b"").decode())


def device_by_name(name: str) -> Device:
    """A registered device by llama.cpp's name (``CUDA1``); a LlamaError naming it if absent."""
    init_backend()
    handle = _ggml().ggml_backend_dev_by_name(name.encode())
    if not handle:
        raise LlamaError(f"llama.cpp has no device {name}")
    return _device(handle)


def cpu_device() -> Device:
    """The host CPU device: what an RPC device process serves."""
    init_backend()
    handle = _ggml().ggml_backend_dev_by_type(_TYPE_CPU)
    if not handle:
        raise LlamaError("llama.cpp has no CPU device")
    return _device(handle)


def no_gpu_backend(device: str) -> str:
    """Why ``device`` (``cuda:N``) cannot be served by this llama.cpp: one message for the
    fitter's check and the placement's."""
    return (f"cannot serve on {device}: this llama.cpp build has no GPU offload (no CUDA "
            "backend); install a CUDA build of llama-cpp-python or use --device cpu")


def has_local_gpu() -> bool:
    """Whether this llama.cpp has a GPU of its own (CUDA, ...) to put layers on. RPC devices
    are not counted: they are never registered globally, and where one sits beside the
    host its kernels are the remote backend's."""
    init_backend()
    ggml = _ggml()
    return any(ggml.ggml_backend_dev_type(ggml.ggml_backend_dev_get(i)) in (_TYPE_GPU, _TYPE_IGPU)
               for i in range(ggml.ggml_backend_dev_count()))


def _reachable(host: str, port: int) -> None:
    """Connect once before llama.cpp does: its RPC client aborts the process on a refused
    connection, so an unreachable endpoint is refused here, by name."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise LlamaError(f"cannot reach the RPC device at {host}:{port} (--rpc): {exc}") from exc


def add_rpc_server(host: str, port: int) -> list[Device]:
    """Connect to an RPC server and return its devices in the server's order.

    The server serves one client at a time: a worker holds its connection for life, so two
    workers cannot share a device process (the second would wait for the first)."""
    _reachable(host, port)
    endpoint = f"{host}:{port}"
    reg = _AddServer(_rpc_proc("ggml_backend_rpc_add_server"))(endpoint.encode())
    if not reg:
        raise LlamaError(f"the RPC server at {endpoint} (--rpc) offers no device")
    ggml = _ggml()
    return [_device(ggml.ggml_backend_reg_dev_get(reg, i))
            for i in range(ggml.ggml_backend_reg_dev_count(reg))]


def start_rpc_server(endpoint: str, devices: list[Device], n_threads: int,
                     cache_dir: str | None = None) -> None:
    """Serve ``devices`` to RPC clients at ``endpoint``; returns only when the server fails to
    start (the port is taken, say): llama.cpp's own ``rpc-server`` main loop."""
    array = (_P * len(devices))(*(d.handle for d in devices))
    start = _StartServer(_rpc_proc("ggml_backend_rpc_start_server"))
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, n_threads,
          len(devices), array)
