"""rq's own records of a job's run, kept by specfleet's worker loop so ``rq info`` tells the truth.

The worker owns its loop (atomic intake, several failure modes rq does not know), but a job
is still an rq job: its hash says queued/started/finished/failed, a run is an rq
``Execution`` in the queue's started registry, and its outcome lands in rq's finished or
failed registry with a result. These functions write exactly those records, each outcome in
one transaction together with the release from the worker's in-flight list.

Only rq's public API is used (``Job.set_status``/``save``, ``Result.create`` /
``create_failure``, the job's registries, ``Execution``): rq's own worker writes the same
records through private ``Job._handle_success`` / ``_handle_failure``, which an rq upgrade may
change without notice. tests/service/test_rq_records.py reads every record back through rq's
public readers, so an upgrade that changes what they mean fails there, not in a fleet.

Loading is defensive: a job hash that rq cannot parse (bad dates, a bad timeout, a key of the
wrong type, a payload that is not JSON) raises :class:`PoisonedJob` with the reason, never a
bare exception out of the loop.
"""

from __future__ import annotations

import traceback
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now

from shared.protocol import EMBEDDING_FUNCTION, JOB_FUNCTION, TOKENIZER_FUNCTION
from shared.redis_faults import classify

#: The job functions a worker runs (``job.func_name`` tells the serving loop which).
FUNCTIONS = (JOB_FUNCTION, EMBEDDING_FUNCTION, TOKENIZER_FUNCTION)


class PoisonedJob(Exception):
    """A queue entry this worker will not run; the message says why. ``job`` is set when
    the hash itself could be read (so rq can record the job failed)."""

    def __init__(self, reason: str, job: Job | None = None) -> None:
        super().__init__(reason)
        self.job = job


def load_job(connection: Redis, job_id: str) -> tuple[Job, Any]:
    """Fetch ``job_id`` and its one request argument; :class:`PoisonedJob` says why not."""
    try:
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        raise PoisonedJob("no such job (its hash expired or was deleted)") from None
    except Exception as exc:  # rq raises many types on a corrupt hash: each is a refusal
        if classify(exc) is not None:  # ... but a refusing Redis is no verdict on the job
            raise
        raise PoisonedJob(f"unreadable job hash ({type(exc).__name__}: {exc})") from None
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except Exception as exc:
        if classify(exc) is not None:
            raise
        raise PoisonedJob("payload is not a JSON job (pickled, corrupt or malformed)",
                          job) from None
    if func_name not in FUNCTIONS:
        raise PoisonedJob(f"function {func_name!r} is none of {', '.join(FUNCTIONS)}", job)
    if not isinstance(args, list | tuple) or len(args) != 1 or kwargs:
        raise PoisonedJob("the job must carry exactly one argument, the request", job)
    return job, args[0]


def is_waiting(job: Job) -> bool:
    """Whether the job still wants a run: a job cancelled (or finished) while its id was
    being taken is skipped, not run and not quarantined."""
    return job.get_status(refresh=False) is JobStatus.QUEUED


def mark_started(connection: Redis, job: Job, worker_name: str, ttl: int) -> Execution:
    """The job is running here: status started, an Execution in the started registry."""
    with connection.pipeline() as pipe:
        job.prepare_for_execution(worker_name, pipeline=pipe)
        execution = Execution.create(job, ttl, pipeline=pipe, worker_name=worker_name)
        pipe.execute()
    return execution


def mark_finished(pipe: Pipeline, job: Job, execution: Execution, result: dict[str, Any],
                  result_ttl: int, worker_name: str) -> None:
    """Queue (on ``pipe``) the records of a successful run: status, result, registry."""
    job.ended_at = now()
    job.set_status(JobStatus.FINISHED, pipeline=pipe)
    job.save(pipeline=pipe, include_meta=False, include_result=False)
    Result.create(job, Result.Type.SUCCESSFUL, ttl=result_ttl, return_value=result,
                  worker_name=worker_name, pipeline=pipe, execution_id=execution.id,
                  execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
    if result_ttl != 0:
        job.finished_job_registry.add(job, result_ttl, pipe)
    execution.delete(job=job, pipeline=pipe)
    job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)


def mark_failed(pipe: Pipeline, job: Job, execution: Execution | None, error: BaseException | str,
                worker_name: str) -> None:
    """Queue (on ``pipe``) the records of a failed (or refused) run."""
    job.ended_at = now()
    exc_string = error if isinstance(error, str) else "".join(
        traceback.format_exception(type(error), error, error.__traceback__))
    job.set_status(JobStatus.FAILED, pipeline=pipe)
    job.failed_job_registry.add(job, ttl=job.failure_ttl, exc_string=exc_string, pipeline=pipe)
    Result.create_failure(job, job.failure_ttl, exc_string=exc_string, worker_name=worker_name,
                          pipeline=pipe, execution_id=execution.id if execution else None,
                          execution_started_at=execution.created_at if execution else None,
                          execution_ended_at=job.ended_at)
    if execution is not None:
        execution.delete(job=job, pipeline=pipe)


def end_execution(pipe: Pipeline, job: Job, execution: Execution) -> None:
    """Queue (on ``pipe``) the end of a run that is neither success nor failure (the job was
    interrupted and runs again): only the Execution goes, the job's state is its next run's."""
    execution.delete(job=job, pipeline=pipe)
