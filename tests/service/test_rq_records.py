"""The rq records a specfleet worker writes read back through rq's public API as rq's own
worker's would: ``rq info``, rq-dashboard and a client's ``Job.fetch`` keep telling the truth.

``worker/service/rq_state.py`` writes them with rq's public writers only; these tests pin what
rq's public readers make of them, so an rq upgrade that changes either side fails here."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from redis import Redis
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from shared.protocol import JOB_FUNCTION
from shared.settings import Settings
from worker.service.rq_state import (
    end_execution,
    is_waiting,
    load_job,
    mark_failed,
    mark_finished,
    mark_started,
)


@pytest.fixture(autouse=True)
def _forget_jobs(settings: Settings) -> Iterator[None]:
    """rq keys its jobs and results by job id alone: these tests' ids carry their prefix."""
    yield
    connection = Redis.from_url(settings.redis_url)
    keys = list(connection.scan_iter(f"rq:*{settings.prefix}-*"))
    if keys:
        connection.delete(*keys)


def _queued(settings: Settings) -> tuple[Redis, Queue, str]:
    connection = Redis.from_url(settings.redis_url)
    queue = Queue(f"{settings.prefix}:records", connection=connection,
                  serializer=JSONSerializer)
    job_id = f"{settings.prefix}-{uuid.uuid4().hex[:8]}"
    return connection, queue, queue.enqueue(JOB_FUNCTION, {"prompt": "x"}, result_ttl=60,
                                            job_id=job_id).id


def test_a_finished_run_reads_back_as_finished_with_its_result(settings: Settings) -> None:
    connection, queue, job_id = _queued(settings)
    job, request = load_job(connection, job_id)
    assert request == {"prompt": "x"} and is_waiting(job)
    execution = mark_started(connection, job, "w-records", ttl=60)
    assert job_id in StartedJobRegistry(queue=queue).get_job_ids()
    assert Job.fetch(job_id, connection, serializer=JSONSerializer).get_status() is (
        JobStatus.STARTED)
    with connection.pipeline() as pipe:
        mark_finished(pipe, job, execution, {"text": "done"}, 60, "w-records")
        pipe.execute()
    again = Job.fetch(job_id, connection, serializer=JSONSerializer)
    assert again.get_status() is JobStatus.FINISHED
    assert again.return_value() == {"text": "done"}
    latest = again.latest_result()
    assert latest is not None and latest.type is Result.Type.SUCCESSFUL
    assert job_id in FinishedJobRegistry(queue=queue).get_job_ids()
    assert job_id not in StartedJobRegistry(queue=queue).get_job_ids()
    assert not is_waiting(again)


def test_a_failed_run_reads_back_as_failed_with_its_error(settings: Settings) -> None:
    connection, queue, job_id = _queued(settings)
    job, _ = load_job(connection, job_id)
    execution = mark_started(connection, job, "w-records", ttl=60)
    with connection.pipeline() as pipe:
        mark_failed(pipe, job, execution, "refused: the prompt is too long", "w-records")
        pipe.execute()
    again = Job.fetch(job_id, connection, serializer=JSONSerializer)
    assert again.get_status() is JobStatus.FAILED
    latest = again.latest_result()
    assert latest is not None and latest.type is Result.Type.FAILED
    assert latest.exc_string == "refused: the prompt is too long"
    assert job_id in FailedJobRegistry(queue=queue).get_job_ids()
    assert job_id not in StartedJobRegistry(queue=queue).get_job_ids()


def test_an_interrupted_run_leaves_the_job_for_its_next_run(settings: Settings) -> None:
    connection, queue, job_id = _queued(settings)
    job, _ = load_job(connection, job_id)
    execution = mark_started(connection, job, "w-records", ttl=60)
    with connection.pipeline() as pipe:
        end_execution(pipe, job, execution)
        pipe.execute()
    assert job_id not in StartedJobRegistry(queue=queue).get_job_ids()
    assert job_id not in FinishedJobRegistry(queue=queue).get_job_ids()
    assert job_id not in FailedJobRegistry(queue=queue).get_job_ids()
    assert Job.fetch(job_id, connection, serializer=JSONSerializer).latest_result() is None
