"""Service fixtures: a real Redis under a unique key prefix per test, real worker processes.

Every test gets its own ``SPECFLEET_PREFIX`` (queues, streams, registry, all namespaced), so
tests never see each other's keys; the keys are deleted afterwards. Workers are real
``specfleet worker`` processes on the tiny dense model, with short heartbeats so that crash
recovery takes seconds, and (where a test needs to land mid-generation) the documented
test-only ``SPECFLEET_STEP_DELAY_SECONDS`` slowing each decode step.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from coordinator.client import Coordinator
from coordinator.redis_local import DEFAULT_URL, answers
from shared.redact import redact
from shared.settings import Settings

from .workers import Fleet


@pytest.fixture
def settings() -> Iterator[Settings]:
    """Settings of one test: its own prefix, fast heartbeats, small token chunks."""
    url = os.environ.get("REDIS_URL", DEFAULT_URL)
    if not answers(url):
        pytest.skip(f"no Redis at {redact(url)} (make test starts one)")
    s = Settings(redis_url=url, prefix=f"t{uuid.uuid4().hex[:12]}", heartbeat_seconds=0.25,
                 worker_ttl_seconds=1.5, token_chunk=4, token_flush_seconds=0.0)
    yield s
    _delete_namespace(Redis.from_url(url), s.prefix)


def _delete_namespace(conn: Redis, prefix: str) -> None:
    """Remove the test's keys, and rq's keys for its queues and jobs."""
    job_ids = {k.decode().split(":")[2] for k in conn.scan_iter(f"{prefix}:job:*:seq")}
    keys = set(conn.scan_iter(f"{prefix}:*")) | set(conn.scan_iter(f"rq:*{prefix}:*"))
    for job_id in job_ids:
        keys |= set(conn.scan_iter(f"rq:*{job_id}*"))
    if keys:
        conn.delete(*keys)
    for queue_key in list(conn.smembers("rq:queues")):
        if prefix in queue_key.decode():
            conn.srem("rq:queues", queue_key)


@pytest.fixture
def coordinator(settings: Settings) -> Coordinator:
    return Coordinator(settings)


@pytest.fixture
def fleet(settings: Settings, dense_model: Path, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(settings, dense_model, tmp_path)
    yield f
    f.stop_all()
