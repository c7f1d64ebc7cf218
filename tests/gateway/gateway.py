"""A real ``specfleet serve`` process for the gateway tests (started, killed, restarted)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from coordinator.processes import stop_processes
from shared.settings import Settings

# tests/ is on sys.path (pytest's rootdir-relative import).
from helpers import SPECFLEET, free_port  # isort: skip


class Gateway:
    """One ``specfleet serve`` subprocess on a free loopback port."""

    def __init__(self, settings: Settings, logs: Path, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = ()) -> None:
        self.settings = settings
        self.log_path = logs / f"gateway-{os.urandom(3).hex()}.log"
        self.extra_env = env or {}
        self.args = args  # more ``specfleet serve`` options
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> Gateway:
        self.port = free_port()
        env = {**os.environ, "REDIS_URL": self.settings.redis_url,
               "SPECFLEET_PREFIX": self.settings.prefix,
               "SPECFLEET_HEARTBEAT_SECONDS": str(self.settings.heartbeat_seconds),
               "SPECFLEET_WORKER_TTL_SECONDS": str(self.settings.worker_ttl_seconds),
               **self.extra_env}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([SPECFLEET, "serve", "--port", str(self.port), *self.args],
                                     env=env,
                                     stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"gateway exited: {self.log()[-2000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gateway did not answer /health"
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no clean-up, no cancel of the jobs it was serving."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
