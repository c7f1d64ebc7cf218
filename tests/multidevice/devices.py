"""Real RPC device processes for the device-group tests (``python -m worker.service.rpc_device``).

Each device is a separate process on a free loopback port, serving this host's CPU as
llama.cpp's RPC backend does for a remote GPU: a worker over them splits its model across
separate buffers in separate processes. A device serves one client at a time and a client
keeps its connection for its whole life, so a test process that loads models over devices
itself (in-process) needs devices of its own, apart from those its subprocesses use.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from coordinator.processes import stop_processes
from coordinator.redis_local import free_port
from worker.llm.devices import rpc_supported

#: Every test of a device group needs the RPC backend in the installed llama.cpp.
needs_rpc = pytest.mark.skipif(
    not rpc_supported(),
    reason="this llama-cpp-python was built without the RPC backend (make install builds it "
           "with CMAKE_ARGS=-DGGML_RPC=ON)")

_START_TIMEOUT_S = 30.0


@contextmanager
def rpc_devices(count: int, logs: Path) -> Iterator[list[str]]:
    """``count`` RPC devices, listening; yields their ``HOST:PORT`` endpoints in order."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield [_start(procs, logs / f"rpc-device-{i}.log") for i in range(count)]
    finally:
        stop_processes(procs)


def _start(procs: list[subprocess.Popen[bytes]], log: Path) -> str:
    """Start one device on a free port (another on a new port if that one was taken
    meanwhile) and wait until it accepts connections."""
    for _ in range(3):
        port = free_port()
        with log.open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "worker.service.rpc_device", "--port",
                                     str(port), "--threads", "1"],
                                    stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                # The device takes the probe as a client that leaves at once, and serves on.
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return f"127.0.0.1:{port}"
            except OSError:
                time.sleep(0.05)
    raise AssertionError(f"no RPC device started: {log.read_text()[-2000:]}")
