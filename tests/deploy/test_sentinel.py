"""Redis Sentinel in REDIS_URL: clients and a working fleet follow the primary through a failover.

Real nodes on loopback (``redis_nodes.sentinel_group``: a primary, its replica, one sentinel),
real ``specfleet worker`` processes, the real coordinator.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from redis import Redis, RedisError

from coordinator.client import Coordinator
from coordinator.processes import stop_processes
from shared.protocol import JobStatus
from shared.redis_client import connect, connect_async
from shared.sentinel import parse_sentinel_url
from shared.settings import Settings

# tests/ is on sys.path (pytest's rootdir-relative import); Fleet starts real worker processes.
from helpers import SPECFLEET  # isort: skip
from service.workers import MODEL_NAME, Fleet  # isort: skip

from .files import ROOT
from .redis_nodes import SERVICE, SentinelGroup, free_port, sentinel_group, wait_until

JOBS = 12
MAX_TOKENS = 24
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture
def group(tmp_path: Path) -> SentinelGroup:
    with sentinel_group(tmp_path) as g:
        yield g


def _failed_over(group: SentinelGroup, old_port: int) -> bool:
    return group.primary_port() != old_port


def test_the_url_names_sentinels_service_database_and_credentials() -> None:
    url = parse_sentinel_url("rediss+sentinel://worker:p%40ss@h1:26380,[::1],h3/mymaster/2"
                             "?sentinel_auth=same")
    assert url.sentinels == (("h1", 26380), ("::1", 26379), ("h3", 26379))
    assert (url.service, url.db, url.username, url.password) == ("mymaster", 2, "worker", "p@ss")
    assert url.tls and url.sentinel_auth
    assert "p@ss" not in repr(url)


@pytest.mark.parametrize("bad", [
    "redis+sentinel://u:SECRET@h1:26379",                      # no service
    "redis+sentinel://u:SECRET@h1:26379/svc/zero",             # db not a number
    "redis+sentinel://u:SECRET@h1:port/svc",                   # port not a number
    "redis+sentinel://u:SECRET@h1:26379/svc?password=x",       # unknown option
])
def test_a_malformed_sentinel_url_is_a_clear_error_without_the_password(bad: str) -> None:
    with pytest.raises(ValueError, match="sentinel URL") as caught:
        connect(bad)
    assert "SECRET" not in str(caught.value)


def test_password_protected_sentinels_are_asked_with_the_urls_credentials_when_told(
        tmp_path: Path) -> None:
    with sentinel_group(tmp_path, password="s3cret") as group:
        conn = connect(f"{group.url}?sentinel_auth=same")
        conn.set("k", "v")
        assert group.node(group.primary_port()).client().get("k") == b"v"
        with pytest.raises(RedisError):  # the sentinel refuses to name the primary
            connect(group.url).get("k")


@pytest.mark.parametrize("how", ["switchover", "primary killed"])
def test_a_client_follows_the_primary_to_the_promoted_replica(group: SentinelGroup,
                                                              how: str) -> None:
    conn = connect(group.url)
    conn.set("before", "1")
    # Replication is asynchronous: a write the primary acknowledged but had not yet sent is
    # lost when it dies (one clean-clone CI run killed it first). The test is about the
    # client following the promotion, so the write is on the replica before the kill.
    assert conn.wait(1, 10_000) >= 1
    old = group.primary_port()
    if how == "switchover":  # the old primary stays up, demoted: it answers READONLY
        group.sentinel.client().execute_command("SENTINEL", "FAILOVER", SERVICE)
    else:
        group.node(old).proc.send_signal(signal.SIGKILL)
    wait_until(lambda: _failed_over(group, old), 30, "the sentinel to promote the replica")
    if how == "switchover":  # until the sentinel demotes it, the old primary still takes writes
        demoted = group.node(old).client()
        wait_until(lambda: demoted.info("replication")["role"] == "slave", 30,
                   "the old primary to be demoted")

    conn.set("after", "2")  # the same client, its pooled connection pointing at the old one

    new = group.node(group.primary_port()).client()
    assert new.get("before") == b"1" and new.get("after") == b"2"
    assert conn.connection_pool.get_master_address()[1] == group.primary_port()


def test_the_gateways_async_client_follows_a_switchover(group: SentinelGroup) -> None:
    old = group.primary_port()

    async def scenario() -> bytes | None:
        conn = connect_async(group.url, 4)
        try:
            await conn.set("before", "1")
            group.sentinel.client().execute_command("SENTINEL", "FAILOVER", SERVICE)
            wait_until(lambda: _failed_over(group, old), 30, "the promotion")
            demoted = group.node(old).client()
            wait_until(lambda: demoted.info("replication")["role"] == "slave", 30, "demotion")
            await conn.set("after", "2")
            return await conn.get("before")
        finally:
            await conn.aclose()

    assert asyncio.run(scenario()) == b"1"
    assert group.node(group.primary_port()).client().get("after") == b"2"


def test_the_gateway_stays_healthy_across_a_killed_primary(group: SentinelGroup,
                                                           tmp_path: Path) -> None:
    """The gateway image's health check (GET /health: Redis ping + fleet read) through the
    real ``specfleet serve`` on a sentinel URL, before and after the primary is lost."""
    port = free_port()
    env = {**os.environ, "REDIS_URL": group.url, "SPECFLEET_PREFIX": f"t{uuid.uuid4().hex[:8]}"}
    log = (tmp_path / "gateway.log").open("wb")
    gateway = subprocess.Popen([SPECFLEET, "serve",
                                "--host", "127.0.0.1", "--port", str(port)],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    check = [sys.executable, str(ROOT / "docker/healthcheck.py"), "http",
             f"http://127.0.0.1:{port}/health"]

    def healthy() -> bool:
        assert gateway.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
        return subprocess.run(check, capture_output=True, timeout=30).returncode == 0

    try:
        wait_until(healthy, 60, "the gateway to answer /health")
        old = group.primary_port()
        group.node(old).proc.send_signal(signal.SIGKILL)
        wait_until(lambda: _failed_over(group, old), 30, "the sentinel to promote the replica")
        wait_until(healthy, 30, "the gateway to be healthy on the new primary")
    finally:
        stop_processes([gateway], timeout=20)


def test_a_batch_loses_nothing_when_the_primary_is_killed_mid_batch(
        group: SentinelGroup, dense_model: Path, tmp_path: Path) -> None:
    settings = Settings(redis_url=group.url, prefix=f"t{uuid.uuid4().hex[:12]}",
                        heartbeat_seconds=0.5, worker_ttl_seconds=8.0, token_chunk=4,
                        token_flush_seconds=0.0)
    coordinator = Coordinator(settings, connection=connect(group.url))
    fleet = Fleet(settings, dense_model, tmp_path)
    try:
        fleet.start("sentinel-w1", step_delay=0.02, wait=False)
        wait_until(lambda: coordinator.registry.is_alive("sentinel-w1")
                   or not fleet.alive("sentinel-w1"), 120, "the worker to register")
        assert fleet.alive("sentinel-w1"), fleet.log("sentinel-w1")[-3000:]
        handles = [coordinator.submit({"model": MODEL_NAME, "prompt_tokens": PROMPT,
                                       "max_tokens": MAX_TOKENS}) for _ in range(JOBS)]
        first = handles[0].result(timeout=120)  # the batch is under way
        old = group.primary_port()
        group.node(old).proc.send_signal(signal.SIGKILL)
        wait_until(lambda: _failed_over(group, old), 30, "the sentinel to promote the replica")

        results = [h.result(timeout=180) for h in handles]
        assert fleet.alive("sentinel-w1"), fleet.log("sentinel-w1")[-3000:]
    finally:
        fleet.stop_all()

    assert [r.status for r in results] == [JobStatus.FINISHED] * JOBS
    assert all(r.tokens == first.tokens and len(r.tokens) == MAX_TOKENS for r in results)
    assert len({r.job_id for r in results}) == JOBS
    survivor: Redis = group.node(group.primary_port()).client()
    assert survivor.llen(f"rq:queue:{settings.keys.queue(MODEL_NAME)}") == 0
