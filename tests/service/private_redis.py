"""A private ``redis-server`` for a test that needs its own configuration (an ACL, a password).

It listens on a loopback port the kernel has just handed out, keeps its files under the test's
``tmp_path`` and is stopped when the test ends: the Redis on 6379 is never touched.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import free_port

from coordinator.processes import stop_processes


@contextmanager
def private_redis(workdir: Path, *config: str, timeout: float = 10.0) -> Iterator[int]:
    """Run ``redis-server`` with extra ``config`` arguments; yields its port once it accepts.

    Readiness is a TCP accept, not a PING: a server that requires a password refuses PING.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
    port = free_port()
    log = (workdir / f"redis-{port}.log").open("ab")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), *config], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"redis-server exited ({proc.returncode}): "
                                     f"{(workdir / f'redis-{port}.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield port
    finally:
        stop_processes([proc])
        log.close()
