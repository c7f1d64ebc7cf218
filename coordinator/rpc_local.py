"""Start llama.cpp RPC devices on this host, for the tests and the GPU check.

Each device is a separate ``python -m worker.service.rpc_device`` process on a free loopback
port, serving this host's CPU as llama.cpp's RPC backend does for a remote GPU: a worker over
them splits its model across separate buffers in separate processes (docs/fitter.md, "Device
groups"). A device serves one client at a time and a client keeps its connection for its
whole life, so a process that loads models over devices itself needs devices of its own,
apart from those its children use.

The devices are started as processes, not imported: this module loads no llama.cpp, as
``coordinator.redis_local`` starts a ``redis-server`` without being one.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from coordinator.processes import stop_processes
from coordinator.redis_local import free_port

#: Seconds a device may take to accept its first connection.
START_TIMEOUT_S = 30.0
#: Ports tried per device (another process may take a free port before the device binds it).
_TRIES = 3


class RpcDeviceUnavailable(RuntimeError):
    """An RPC device process did not start; the message has the tail of its log."""


@contextmanager
def local_rpc_devices(count: int, logs: Path, threads: int = 1) -> Iterator[list[str]]:
    """``count`` RPC devices, listening; yields their ``HOST:PORT`` endpoints in order and
    stops them on exit. Each device writes its log to ``logs/rpc-device-<i>.log``."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield [_start(procs, logs / f"rpc-device-{i}.log", threads) for i in range(count)]
    finally:
        stop_processes(procs)


def _start(procs: list[subprocess.Popen[bytes]], log: Path, threads: int) -> str:
    """Start one device on a free port (another on a new port if that one was taken
    meanwhile) and wait until it accepts connections."""
    for _ in range(_TRIES):
        port = free_port()
        with log.open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "worker.service.rpc_device",
                                     "--port", str(port), "--threads", str(threads)],
                                    stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                # The device takes the probe as a client that leaves at once, and serves on.
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return f"127.0.0.1:{port}"
            except OSError:
                time.sleep(0.05)
    raise RpcDeviceUnavailable(f"no RPC device started: {log.read_text()[-2000:]}")
