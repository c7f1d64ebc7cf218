"""A private ``redis-server`` that a fault test stops and starts again on the same port and
data directory (so an AOF replays what the first life wrote)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .private_redis import free_port


class RestartableRedis:
    """One Redis identity (port, directory, config) that can die and come back."""

    def __init__(self, workdir: Path, *config: str) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.config = config
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> None:
        """Start (again) and wait until it accepts connections and has loaded its data."""
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--dir", str(self.workdir), *self.config], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, (self.workdir / "redis.log").read_text()[-2000:]
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        """A clean shutdown (SIGTERM: Redis flushes its AOF before exiting)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=15)
        self.proc = None
