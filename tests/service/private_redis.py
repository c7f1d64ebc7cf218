"""The one launcher of private ``redis-server`` processes in the tests.

A test that needs its own Redis (an ACL, a password, an AOF that survives a restart, a
replica group with a sentinel) starts it here: a loopback port the kernel has just handed
out, files under the test's ``tmp_path``, stopped when the test ends. The Redis on 6379 is
never touched.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import free_port
from redis import Redis

from coordinator.processes import stop_processes


def redis_server_binary() -> str:
    """``redis-server`` on PATH, or the test skips with the install hint."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
    return binary


class RedisServer:
    """One Redis identity (port, directory, configuration) that can die and come back on the
    same port and data directory, so an AOF replays what its first life wrote.

    ``config`` goes first on the command line (a config file must be the first argument);
    ``password`` is what :meth:`client` and the start-up check authenticate with."""

    def __init__(self, workdir: Path, *config: str, password: str | None = None) -> None:
        self.binary = redis_server_binary()
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.config = config
        self.password = password
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = workdir / f"redis-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0, ping: bool = True) -> RedisServer:
        """Start (again) and wait until it accepts connections and, with ``ping``, answers
        PING (its data loaded). ``ping=False`` for a server whose default user cannot PING."""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, *self.config, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--dir", str(self.workdir)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._ready(ping):
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited ({self.proc.returncode}): "
                                     f"{self.log.read_text()[-2000:]}")
            assert time.monotonic() < deadline, f"redis-server on port {self.port} did not start"
            time.sleep(0.05)
        return self

    def _ready(self, ping: bool) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                if not ping:
                    return True
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """A clean shutdown (SIGTERM: Redis flushes its AOF before exiting)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=15)
        self.proc = None

    def kill(self) -> None:
        """Stopped however it can be (SIGTERM, then SIGKILL after a grace)."""
        if self.proc is not None:
            stop_processes([self.proc])
        self.proc = None

    def client(self) -> Redis:
        return Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2,
                     socket_connect_timeout=2)


@contextmanager
def private_redis(workdir: Path, *config: str, timeout: float = 10.0) -> Iterator[int]:
    """A throw-away ``redis-server`` (no persistence) with extra ``config``; yields its port
    once it accepts. Readiness is a TCP accept: a server that requires a password refuses
    PING."""
    server = RedisServer(workdir, "--save", "", "--appendonly", "no", *config)
    server.start(timeout, ping=False)
    try:
        yield server.port
    finally:
        server.kill()
