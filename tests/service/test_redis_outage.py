"""A Redis outage: workers, the coordinator and stream readers ride through it.

A private ``redis-server`` with AOF (``appendfsync always``) is stopped for 10 s in the middle
of a 24-job batch with a streaming client attached, then restarted on the same port and data
directory. Nothing may die and nothing may be lost or delivered twice. A worker whose Redis
stays away past ``SPECFLEET_REDIS_OUTAGE_SECONDS`` gives up with ``worker.redis_gave_up`` and a
non-zero exit, leaving its jobs for recovery.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.client import Coordinator
from shared.protocol import FinalEvent, JobStatus, TokenEvent
from shared.results import JobResult
from shared.settings import Settings

from .private_redis import RedisServer
from .workers import MODEL_NAME, Fleet

JOBS = 24
OUTAGE_SECONDS = 10.0
REQUEST = {"model": MODEL_NAME, "prompt_tokens": [4, 2, 4, 2], "max_tokens": 48,
           "speculative": {"method": "none"}}


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", "--save", "", "--appendonly", "yes",
                         "--appendfsync", "always")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def outage_settings(aof_redis: RedisServer) -> Settings:
    return Settings(redis_url=aof_redis.url, prefix=f"t{uuid.uuid4().hex[:12]}",
                    heartbeat_seconds=0.25, worker_ttl_seconds=3.0, token_chunk=4,
                    token_flush_seconds=0.0, redis_outage_seconds=60)


def test_a_ten_second_outage_mid_batch_loses_and_duplicates_nothing(
        aof_redis: RedisServer, outage_settings: Settings, dense_model: Path,
        tmp_path: Path) -> None:
    fleet = Fleet(outage_settings, dense_model, tmp_path)
    try:
        fleet.start("w1", step_delay=0.01, wait=False)
        fleet.start("w2", step_delay=0.01)
        fleet.wait_registered("w1")
        coordinator = Coordinator(outage_settings)
        reference = coordinator.submit(REQUEST).result(timeout=60)
        handles = [coordinator.submit(REQUEST) for _ in range(JOBS)]
        streamed: list[str] = []
        streamer = threading.Thread(
            target=lambda: streamed.extend(handles[-1].text_stream(timeout=180)))
        streamer.start()
        results: dict[str, JobResult] = {}

        def collect() -> None:
            for h in handles:
                results[h.job_id] = h.result(timeout=180)
        collector = threading.Thread(target=collect)
        collector.start()
        _wait_until(lambda: len(results) >= 2, "the batch never got going")

        aof_redis.stop()
        time.sleep(OUTAGE_SECONDS)
        assert fleet.alive("w1") and fleet.alive("w2")
        restarted = time.monotonic()
        aof_redis.start()
        collector.join(timeout=180)
        streamer.join(timeout=30)
        assert not collector.is_alive() and not streamer.is_alive()

        assert len(results) == JOBS
        assert all(r.status is JobStatus.FINISHED for r in results.values())
        assert all(r.tokens == reference.tokens for r in results.values())
        assert "".join(streamed) == reference.text
        assert fleet.alive("w1") and fleet.alive("w2")
        for h in handles:  # each job ended exactly once, on one attempt
            events = list(h.stream(timeout=10))
            finals = [e for e in events if isinstance(e, FinalEvent)]
            assert [f.status for f in finals] == [JobStatus.FINISHED]
            # What a reader rebuilds from the token events (a chunk appended twice by a retried
            # write lands on the same indexes) is the whole generation, once.
            rebuilt: dict[int, int] = {}
            for e in events:
                if isinstance(e, TokenEvent) and e.attempt == finals[0].attempt:
                    rebuilt.update({e.index + i: t for i, t in enumerate(e.tokens)})
            assert [rebuilt[i] for i in range(len(rebuilt))] == reference.tokens
        print(f"outage {OUTAGE_SECONDS:.0f} s: {JOBS} jobs finished, 0 lost, 0 duplicated; "
              f"batch done {time.monotonic() - restarted:.1f} s after Redis came back")
        logs = fleet.log("w1") + fleet.log("w2")
        assert "worker.redis_gave_up" not in logs
        assert "redis.recovered" in logs
        # Every registration expired while Redis was down (10 s > the 3 s TTL), yet nobody was
        # declared lost: recovery waits one TTL after a Redis restart for re-registrations.
        assert "worker.declared_lost" not in logs and '"event": "worker.lost"' not in logs
        assert all(r.attempts == 1 for r in results.values())
    finally:
        fleet.stop_all()


def test_a_worker_gives_up_after_its_outage_deadline_and_exits_non_zero(
        aof_redis: RedisServer, outage_settings: Settings, dense_model: Path,
        tmp_path: Path) -> None:
    fleet = Fleet(outage_settings, dense_model, tmp_path)
    try:
        fleet.start("w1", extra_env={"SPECFLEET_REDIS_OUTAGE_SECONDS": "2"})
        aof_redis.stop()
        started = time.monotonic()
        fleet.procs["w1"].wait(timeout=60)
        gave_up_after = time.monotonic() - started
        assert fleet.procs["w1"].returncode == 3
        log = fleet.log("w1")
        assert '"event": "worker.redis_gave_up"' in log
        assert "Redis unreachable" in log and "Traceback" not in log
        print(f"worker gave up {gave_up_after:.1f} s after Redis went away (deadline 2 s)")
    finally:
        fleet.stop_all()


def _wait_until(check: object, message: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, message
        time.sleep(0.05)
