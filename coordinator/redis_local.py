"""Find a reachable Redis, or start a private one, for the demo and the test suite.

Order: ``REDIS_URL`` if set (it must answer), else 127.0.0.1:6379, else a throw-away
``redis-server`` on a free loopback port (no persistence) that is stopped on exit. With none
of these it says exactly how to get one.

``python -m coordinator.redis_local -- CMD ...`` runs CMD with ``REDIS_URL`` exported.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from coordinator.processes import stop_processes
from shared.redact import redact
from shared.sentinel import is_sentinel_url, sentinel_client

DEFAULT_URL = "redis://127.0.0.1:6379/0"
HOW_TO_GET_REDIS = (
    "no Redis is reachable: set REDIS_URL to a running server, start one on 127.0.0.1:6379, "
    "or install redis-server (Debian/Ubuntu: 'apt-get install redis-server'; macOS: "
    "'brew install redis'; or 'docker run -p 6379:6379 redis:7')"
)


class RedisUnavailable(RuntimeError):
    """No Redis could be found or started."""


def answers(url: str, timeout: float = 1.0) -> bool:
    """True when a Redis at ``url`` (for a sentinel URL: its current primary) answers PING."""
    build = sentinel_client if is_sentinel_url(url) else redis.Redis.from_url
    try:
        return bool(build(url, socket_timeout=timeout, socket_connect_timeout=timeout).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def free_port() -> int:
    """A loopback port the kernel has just handed out as free (redis-server has no port 0):
    the one way the demo, the benches and the tests pick a port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_redis() -> Iterator[str]:
    """Yield the URL of a reachable Redis, starting a private one when needed."""
    env_url = os.environ.get("REDIS_URL")
    if env_url:
        if not answers(env_url):
            raise RedisUnavailable(f"REDIS_URL={redact(env_url)} does not answer PING")
        yield env_url
        return
    if answers(DEFAULT_URL):
        yield DEFAULT_URL
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisUnavailable(HOW_TO_GET_REDIS)
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="specfleet-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while not answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RedisUnavailable(f"redis-server on port {port} did not start")
            time.sleep(0.05)
        yield url
    finally:
        stop_processes([proc])
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    """Run ``argv`` (after ``--``) with REDIS_URL pointing at a reachable Redis."""
    cmd = argv[argv.index("--") + 1:] if "--" in argv else argv
    try:
        with local_redis() as url:
            if not cmd:
                print(url)
                return 0
            return subprocess.call(cmd, env={**os.environ, "REDIS_URL": url})
    except RedisUnavailable as exc:
        sys.stderr.write(f"specfleet: error: {exc}\n")
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
