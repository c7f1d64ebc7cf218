"""docker/healthcheck.py, the images' HEALTHCHECK, run as Docker runs it (a process with the
container's environment) against a real worker on a private Redis and a real HTTP server."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.settings import Settings

# tests/ is on sys.path (pytest's rootdir-relative import); Fleet starts real worker processes.
from service.workers import Fleet  # isort: skip

from .files import ROOT
from .redis_nodes import free_port, redis_server

HEALTHCHECK = ROOT / "docker" / "healthcheck.py"


def _check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def _until(expected: int, *args: str, env: dict[str, str], timeout: float = 20
           ) -> subprocess.CompletedProcess[str]:
    deadline = time.monotonic() + timeout
    while True:
        done = _check(*args, env=env)
        if done.returncode == expected or time.monotonic() > deadline:
            return done
        time.sleep(0.2)


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[Settings]:
    data = tmp_path / "redis"
    data.mkdir()
    with redis_server(data, "--save", "", "--appendonly", "no") as node:
        yield Settings(redis_url=f"redis://127.0.0.1:{node.port}/0",
                       prefix=f"t{uuid.uuid4().hex[:12]}", heartbeat_seconds=0.25,
                       worker_ttl_seconds=1.5, token_chunk=4, token_flush_seconds=0.0)


def test_a_worker_is_healthy_only_while_its_heartbeat_keeps_it_registered(
        settings: Settings, dense_model: Path, tmp_path: Path) -> None:
    fleet = Fleet(settings, dense_model, tmp_path)
    env = {"REDIS_URL": settings.redis_url, "SPECFLEET_PREFIX": settings.prefix,
           "SPECFLEET_WORKER_TTL_SECONDS": str(settings.worker_ttl_seconds)}
    try:
        pid = fleet.start("hc-w1")
        healthy = _check("worker", "--pid", str(pid), env=env)
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        assert healthy.stdout.startswith("healthy: worker hc-w1 serves tiny on cpu")

        other = _check("worker", "--pid", str(os.getpid()), env=env)
        assert other.returncode == 1 and other.stdout.startswith("unhealthy: no live registration")
        elsewhere = _check("worker", "--pid", str(pid),
                           env={**env, "SPECFLEET_PREFIX": f"{settings.prefix}x"})
        assert elsewhere.returncode == 1

        os.kill(pid, signal.SIGSTOP)  # a wedged worker: the process and its port are still there
        try:
            stalled = _until(1, "worker", "--pid", str(pid), env=env)
            assert stalled.returncode == 1, stalled.stdout
        finally:
            os.kill(pid, signal.SIGCONT)
        assert _until(0, "worker", "--pid", str(pid), env=env).returncode == 0
    finally:
        fleet.stop_all()


def test_a_worker_check_without_redis_is_unhealthy_and_shows_no_password() -> None:
    url = f"redis://specfleet-worker:S3cretPw@127.0.0.1:{free_port()}/0"
    done = _check("worker", env={"REDIS_URL": url})
    assert done.returncode == 1
    assert done.stdout.startswith("unhealthy: Redis at redis://specfleet-worker:***@127.0.0.1")
    assert "S3cretPw" not in done.stdout + done.stderr


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_the_http_check_wants_a_2xx_answer() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert _check("http", f"{base}/health").returncode == 0
        down = _check("http", f"{base}/unhealthy")
        assert down.returncode == 1 and down.stdout == f"unhealthy: GET {base}/unhealthy: 503\n"
    finally:
        server.shutdown()
        server.server_close()
    assert _check("http", f"{base}/health").returncode == 1  # nobody listening
