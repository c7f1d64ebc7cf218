"""A private Redis primary, its replica and one sentinel on loopback free ports.

Nothing here touches the Redis on 6379: every node is a child ``redis-server`` with its own
data directory under the test's ``tmp_path``, stopped (and its directory dropped with
``tmp_path``) when the test ends.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import free_port
from redis import Redis
from redis.exceptions import RedisError

from coordinator.processes import stop_processes

SERVICE = "specfleet-primary"
#: Sentinel declares the primary down after this long without an answer (its floor is ~100 ms).
DOWN_AFTER_MS = 1000


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
    return binary


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
class Node:
    port: int
    proc: subprocess.Popen[bytes]
    password: str | None = None

    def client(self) -> Redis:
        return Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2,
                     socket_connect_timeout=2)


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


def _start(binary: str, args: list[str], log: Path, password: str | None = None) -> Node:
    port = int(args[args.index("--port") + 1])
    proc = subprocess.Popen([binary, *args], stdout=log.open("ab"), stderr=subprocess.STDOUT)
    node = Node(port, proc, password)
    wait_until(lambda: node.client().ping(), 10, f"redis-server on port {port}")
    return node


def _stop(nodes: list[Node]) -> None:
    stop_processes(node.proc for node in nodes)


@contextmanager
def redis_server(workdir: Path, *args: str, ready: bool = True) -> Iterator[Node]:
    """One private ``redis-server ARGS --port P --dir WORKDIR`` on a free loopback port.

    ``ready=False`` when an unauthenticated PING cannot answer (default user off)."""
    port = free_port()
    argv = [*args, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
    if ready:
        node = _start(redis_server_binary(), argv, workdir / "redis.log")
    else:
        proc = subprocess.Popen([redis_server_binary(), *argv],
                                stdout=(workdir / "redis.log").open("ab"),
                                stderr=subprocess.STDOUT)
        node = Node(port, proc)
        wait_until(lambda: _listening(port), 10, f"redis-server on port {port}")
    try:
        yield node
    finally:
        _stop([node])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def sentinel_group(workdir: Path, password: str | None = None) -> Iterator[SentinelGroup]:
    """Start a primary, a replica of it and a sentinel; yield once the sentinel knows both.

    With ``password`` every node, the sentinel included, requires it (``requirepass``)."""
    binary = redis_server_binary()
    group = SentinelGroup(password=password)
    auth = ["--requirepass", password, "--masterauth", password] if password else []
    try:
        primary_port = free_port()
        for role in ("primary", "replica"):
            port = primary_port if role == "primary" else free_port()
            data = workdir / f"redis-{role}"
            data.mkdir()
            args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                    "--save", "", "--appendonly", "yes", "--appendfsync", "always", *auth]
            if role == "replica":
                args += ["--replicaof", "127.0.0.1", str(primary_port)]
            group.nodes.append(_start(binary, args, workdir / f"redis-{role}.log", password))
        replica = group.nodes[1].client()
        wait_until(lambda: replica.info("replication")["master_link_status"] == "up", 20,
                   "the replica to sync")
        conf = workdir / "sentinel.conf"  # sentinel rewrites its own config file
        conf.write_text(
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
            + (f"sentinel auth-pass {SERVICE} {password}\nrequirepass {password}\n"
               if password else ""))
        sentinel_port = free_port()
        group.sentinel = _start(binary, [str(conf), "--sentinel", "--port", str(sentinel_port),
                                         "--bind", "127.0.0.1", "--dir", str(workdir)],
                                workdir / "sentinel.log", password)
        watcher = group.sentinel.client()
        wait_until(lambda: _promotable(watcher), 30, "the sentinel to see a promotable replica")
        yield group
    finally:
        _stop([*group.nodes, *([group.sentinel] if group.sentinel else [])])
