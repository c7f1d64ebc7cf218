"""A private Redis primary, its replica and one sentinel on loopback free ports.

Nothing here touches the Redis on 6379: every node is a child ``redis-server`` with its own
data directory under the test's ``tmp_path``, stopped (and its directory dropped with
``tmp_path``) when the test ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from helpers import free_port  # noqa: F401  (the deploy tests import it from here)
from redis import Redis
from redis.exceptions import RedisError
from service.private_redis import RedisServer

SERVICE = "specfleet-primary"
#: Sentinel declares the primary down after this long without an answer (its floor is ~100 ms).
DOWN_AFTER_MS = 1000
#: A node of a group: a private redis-server (tests/service/private_redis.py).
Node = RedisServer


def wait_until(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except (RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class SentinelGroup:
    """Two data nodes and a sentinel monitoring them as :data:`SERVICE`."""

    nodes: list[Node] = field(default_factory=list)
    sentinel: Node | None = None

    password: str | None = None

    @property
    def url(self) -> str:
        assert self.sentinel is not None
        credentials = f":{self.password}@" if self.password else ""
        return f"redis+sentinel://{credentials}127.0.0.1:{self.sentinel.port}/{SERVICE}/0"

    def primary_port(self) -> int:
        assert self.sentinel is not None
        _, port = self.sentinel.client().sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)


def _promotable(sentinel: Redis) -> bool:
    """The sentinel has a connected replica with a fresh INFO (else FAILOVER is NOGOODSLAVE)."""
    replicas = sentinel.sentinel_slaves(SERVICE)
    return any(r["flags"] == "slave" and r.get("master-link-status") == "ok"
               and int(r.get("info-refresh", 10**9)) < 5000 for r in replicas)


@contextmanager
def redis_server(workdir: Path, *args: str, ready: bool = True) -> Iterator[Node]:
    """One private ``redis-server ARGS`` on a free loopback port, files in ``workdir``.

    ``ready=False`` when an unauthenticated PING cannot answer (default user off)."""
    node = RedisServer(workdir, *args).start(10, ping=ready)
    try:
        yield node
    finally:
        node.kill()


@contextmanager
def sentinel_group(workdir: Path, password: str | None = None) -> Iterator[SentinelGroup]:
    """Start a primary, a replica of it and a sentinel; yield once the sentinel knows both.

    With ``password`` every node, the sentinel included, requires it (``requirepass``)."""
    group = SentinelGroup(password=password)
    auth = ["--requirepass", password, "--masterauth", password] if password else []
    try:
        persist = ["--save", "", "--appendonly", "yes", "--appendfsync", "always", *auth]
        primary = RedisServer(workdir / "redis-primary", *persist, password=password)
        group.nodes.append(primary.start(10))
        replica = RedisServer(workdir / "redis-replica", *persist, "--replicaof", "127.0.0.1",
                              str(primary.port), password=password)
        group.nodes.append(replica.start(10))
        link = replica.client()
        wait_until(lambda: link.info("replication")["master_link_status"] == "up", 20,
                   "the replica to sync")
        conf = workdir / "sentinel.conf"  # sentinel rewrites its own config file
        conf.write_text(
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
            + (f"sentinel auth-pass {SERVICE} {password}\nrequirepass {password}\n"
               if password else ""))
        group.sentinel = RedisServer(workdir, str(conf), "--sentinel",
                                     password=password).start(10)
        watcher = group.sentinel.client()
        wait_until(lambda: _promotable(watcher), 30, "the sentinel to see a promotable replica")
        yield group
    finally:
        for node in [*group.nodes, *([group.sentinel] if group.sentinel else [])]:
            node.kill()
