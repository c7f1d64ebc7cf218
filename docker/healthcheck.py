"""Container health checks that ask the process, not the port (the images' ``HEALTHCHECK``).

``healthcheck.py worker [--pid N]``
    Healthy while the fleet registry holds a live registration written by process ``N``
    (default 1, the container's main process) on this host. The registration expires unless
    the worker's heartbeat thread refreshes it, so this fails for a worker that is still
    fitting or loading, wedged, declared lost or cut off from Redis, exactly when the
    coordinator would stop routing to it. Reads ``REDIS_URL`` and ``SPECFLEET_*`` like the
    worker does (the health check runs with the container's environment).

``healthcheck.py http URL``
    Healthy when ``GET URL`` answers 2xx within the timeout (the gateway's ``/health``, which
    itself checks Redis and the fleet).

Exit status 0 healthy, 1 unhealthy (what Docker expects); one line on stdout says why, with
any Redis URL redacted.
"""

from __future__ import annotations

import argparse
import socket
import sys
import urllib.error
import urllib.request

from redis import RedisError

from shared.redact import redact
from shared.redis_client import connect
from shared.registry import FleetRegistry
from shared.settings import Settings

HTTP_TIMEOUT_SECONDS = 5.0


def check_worker(pid: int) -> tuple[bool, str]:
    """Is a live registration in Redis owned by ``pid`` on this host?"""
    settings = Settings()
    registry = FleetRegistry(connect(settings.redis_url), settings.keys,
                             settings.worker_ttl_seconds)
    host = socket.gethostname()
    try:
        workers = registry.live_workers()
    except RedisError as exc:
        return False, redact(f"Redis at {settings.redis_url}: {exc}")
    mine = [w for w in workers if w.host == host and w.pid == pid]
    if not mine:
        return False, (f"no live registration for pid {pid} on {host} under prefix "
                       f"{settings.prefix!r} (starting, stalled or cut off from Redis)")
    worker = mine[0]
    return True, f"worker {worker.name} serves {worker.model_name} on {worker.device}"


def check_http(url: str) -> tuple[bool, str]:
    """Does ``GET url`` answer 2xx?"""
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_SECONDS) as reply:
            return 200 <= reply.status < 300, f"GET {url}: {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"GET {url}: {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"GET {url}: {exc}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.splitlines()[0])
    checks = parser.add_subparsers(dest="check", required=True)
    worker = checks.add_parser("worker", help="the worker's registration is alive in Redis")
    worker.add_argument("--pid", type=int, default=1, help="the worker's pid (default 1)")
    http = checks.add_parser("http", help="GET URL answers 2xx")
    http.add_argument("url")
    args = parser.parse_args(argv)
    healthy, why = check_worker(args.pid) if args.check == "worker" else check_http(args.url)
    print(f"{'healthy' if healthy else 'unhealthy'}: {why}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
