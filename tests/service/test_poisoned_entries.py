"""Poisoned queue entries: the worker refuses and quarantines each one and keeps serving.

Every entry here once killed a worker (rq raised inside its dequeue, the process exited 0):
job hashes rq cannot parse, a job key of the wrong Redis type, a queue key of the wrong type.
Each must end with ``job.refused`` (or ``queue.refused``) in the log, a record in the
quarantine list, an ``error`` final event on the job's stream (so a follower learns at once,
not at its timeout), and a worker that goes on to serve the next good request.
"""

from __future__ import annotations

import json
import time

from rq.queue import Queue
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from shared.protocol import JOB_FUNCTION, JobStatus, Priority

from .workers import MODEL_NAME, Fleet

VALID = {"model": MODEL_NAME, "prompt_tokens": [1, 2, 3], "max_tokens": 8}


def _poison_hash(coordinator: Coordinator, job_id: str, **fields: str) -> None:
    """A real job of ours whose hash is then corrupted field by field, then queued."""
    queue = Queue(coordinator.keys.queue(MODEL_NAME), connection=coordinator.connection,
                  serializer=JSONSerializer)
    job = queue.create_job(JOB_FUNCTION, args=(VALID,), job_id=job_id)
    job.save()
    coordinator.connection.hset(job.key, mapping=fields)
    queue.push_job_id(job_id)


def test_poisoned_hashes_and_keys_are_quarantined_and_the_worker_serves_on(
        fleet: Fleet, coordinator: Coordinator) -> None:
    conn = coordinator.connection
    keys = coordinator.keys
    p = keys.prefix
    fleet.start("w1")
    normal = Queue(keys.queue(MODEL_NAME), connection=conn, serializer=JSONSerializer)

    # The issue's own example: a bare hash with junk data and a date rq cannot parse.
    conn.hset(f"rq:job:{p}-bare", mapping={"data": "x", "created_at": "yesterday"})
    normal.push_job_id(f"{p}-bare")
    _poison_hash(coordinator, f"{p}-timeout", timeout="soon")
    _poison_hash(coordinator, f"{p}-status", status="bogus")
    _poison_hash(coordinator, f"{p}-deps", dependency_ids="{not json")
    conn.rpush(f"rq:job:{p}-list", "x")  # the job key is a list, not a hash
    normal.push_job_id(f"{p}-list")
    poisoned = [f"{p}-bare", f"{p}-timeout", f"{p}-status", f"{p}-deps", f"{p}-list"]
    # The high-priority queue key itself holds a string: every take would fail on it.
    high_key = Queue(keys.queue(MODEL_NAME, Priority.HIGH), connection=conn).key
    conn.set(high_key, "not a list")

    for job_id in poisoned:  # item 5: each ends with an error final event, at once
        result = coordinator.handle(job_id).result(timeout=30)
        assert result.status is JobStatus.FAILED
        assert result.error and "refused" in result.error

    after = coordinator.submit(VALID).result(timeout=30)
    assert after.status is JobStatus.FINISHED and after.worker == "w1"
    assert fleet.alive("w1")
    log = fleet.log("w1")
    for job_id in poisoned:
        assert f'"job_id": "{job_id}"' in log
    assert log.count('"event": "job.refused"') == len(poisoned)
    assert log.count('"event": "queue.refused"') == 1
    records = [json.loads(r) for r in conn.lrange(keys.quarantine(), 0, -1)]
    assert sorted(r["job_id"] for r in records if "job_id" in r) == sorted(poisoned)
    aside = [r for r in records if r.get("key") == high_key]
    assert len(aside) == 1 and conn.get(aside[0]["moved_to"]) == b"not a list"
    high = coordinator.submit({**VALID, "priority": "high"}).result(timeout=30)
    assert high.status is JobStatus.FINISHED
    _wait_released(coordinator, "w1")  # nothing is left held


def test_a_running_job_is_held_in_the_workers_in_flight_list(
        fleet: Fleet, coordinator: Coordinator) -> None:
    """Item 15: the take *is* the record. While a job runs, its id is in the worker's
    in-flight list and in no queue; a kill -9 at any instant leaves it there for recovery."""
    fleet.start("w1", step_delay=0.05)
    handle = coordinator.submit({**VALID, "max_tokens": 40, "speculative": {"method": "none"}})
    conn, keys = coordinator.connection, coordinator.keys
    deadline = time.monotonic() + 30
    while conn.llen(keys.inflight("w1")) == 0:
        assert time.monotonic() < deadline, "the job never reached the in-flight list"
        time.sleep(0.01)
    assert [i.decode() for i in conn.lrange(keys.inflight("w1"), 0, -1)] == [handle.job_id]
    assert sum(coordinator.queue_depths(MODEL_NAME).values()) == 0
    assert handle.result(timeout=60).status is JobStatus.FINISHED
    _wait_released(coordinator, "w1")


def _wait_released(coordinator: Coordinator, worker: str, timeout: float = 10) -> None:
    """The final event is streamed first; rq's records and the release from the in-flight
    list follow in one write a moment later."""
    deadline = time.monotonic() + timeout
    while coordinator.connection.llen(coordinator.keys.inflight(worker)):
        assert time.monotonic() < deadline, f"{worker} still holds a finished job"
        time.sleep(0.01)
