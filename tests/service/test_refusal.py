"""A worker refuses what is not its own job, and survives every malformed request."""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer, PickleSerializer

from coordinator.client import Coordinator
from shared.protocol import JOB_FUNCTION, FinalEvent
from shared.protocol import JobStatus as SpecJobStatus

from .strategies import malformed_requests
from .workers import MODEL_NAME, Fleet

VALID = {"model": MODEL_NAME, "prompt_tokens": [1, 2, 3], "max_tokens": 8}


def _wait_failed(job: Job, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while job.get_status(refresh=True) != JobStatus.FAILED:
        assert time.monotonic() < deadline, f"job {job.id} is {job.get_status()}"
        time.sleep(0.05)


def test_pickled_payload_and_foreign_function_are_refused(fleet: Fleet, coordinator: Coordinator,
                                                          tmp_path: Path) -> None:
    fleet.start("w1")
    queue_name = coordinator.keys.queue(MODEL_NAME)
    conn = coordinator.connection
    marker = tmp_path / "pwned"
    pickled = Queue(queue_name, connection=conn, serializer=PickleSerializer).enqueue(
        JOB_FUNCTION, VALID)
    foreign = Queue(queue_name, connection=conn, serializer=JSONSerializer).enqueue(
        "os.system", f"touch {marker}")
    json_queue = Queue(queue_name, connection=conn, serializer=JSONSerializer)
    malformed = []
    for data in (b'{"not": "a job"}', b'["worker.service.jobs.run_generation", null, 5, {}]',
                 b'["worker.service.jobs.run_generation", null, [1, 2], {}]'):
        job = json_queue.create_job(JOB_FUNCTION, args=(VALID,))
        job.save()
        conn.hset(job.key, "data", data)  # a payload of the wrong shape, then queued
        json_queue.push_job_id(job.id)
        malformed.append(job)
    _wait_failed(Job.fetch(pickled.id, connection=conn, serializer=PickleSerializer))
    _wait_failed(Job.fetch(foreign.id, connection=conn, serializer=JSONSerializer))
    for job in malformed:
        _wait_failed(job)
    assert not marker.exists()
    assert fleet.alive("w1")
    log = fleet.log("w1")
    assert log.count('"event": "job.refused"') == 5
    assert "payload is not a JSON job" in log and "'os.system'" in log
    assert coordinator.submit(VALID).result(timeout=30).status is SpecJobStatus.FINISHED


@hsettings(max_examples=25, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(request=malformed_requests(VALID))
def test_malformed_requests_sent_straight_to_a_worker_fail_cleanly(
        fleet: Fleet, coordinator: Coordinator, request: object) -> None:
    """Bypassing the coordinator's checks: the worker validates again and keeps serving."""
    if "w1" not in fleet.procs:
        fleet.start("w1")
    queue = Queue(coordinator.keys.queue(MODEL_NAME), connection=coordinator.connection,
                  serializer=JSONSerializer)
    job = queue.enqueue(JOB_FUNCTION, request)
    final = list(coordinator.handle(job.id).stream(timeout=30))[-1]
    assert isinstance(final, FinalEvent)
    if final.status is SpecJobStatus.FAILED:
        assert final.error and "Traceback" not in final.error
    assert fleet.alive("w1")


def test_constraint_the_workers_vocabulary_cannot_spell_fails_the_job(
        fleet: Fleet, coordinator: Coordinator) -> None:
    """A JSON Schema compiles at submit (no vocabulary needed), but the tiny model's hex-piece
    vocabulary has no ``{``: the worker refuses it at admission with an error naming the
    constraint, and goes on serving."""
    if "w1" not in fleet.procs:
        fleet.start("w1")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    handle = coordinator.submit({**VALID, "constraint": {"kind": "json_schema",
                                                         "json_schema": schema}})
    final = list(handle.stream(timeout=30))[-1]
    assert isinstance(final, FinalEvent) and final.status is SpecJobStatus.FAILED
    assert final.error and "json_schema constraint: this model's vocabulary cannot spell" in (
        final.error) and "Traceback" not in final.error
    after = list(coordinator.submit(VALID).stream(timeout=30))[-1]
    assert isinstance(after, FinalEvent) and after.status is SpecJobStatus.FINISHED
    assert fleet.alive("w1")
