"""Crash recovery: requeue, at the front of its queue, the job of a worker that stopped beating.

rq's own abandoned-job cleanup runs every 10 minutes and then fails the job; this monitor runs
in every worker's heartbeat thread (and in ``Coordinator.recover()``, which ``specfleet
fleet`` calls), so a dead worker's jobs are running again within ``worker_ttl + heartbeat``
seconds. Exactly one monitor recovers a given worker: the claim is an atomic ``ZREM`` of its
name from the fleet set. The jobs are the worker's in-flight list, which its intake filled
atomically as it took each job, and the jobs routed to it that still wait in its own queues
(:func:`hand_back`, also run when a worker leaves): every one goes back to the front of the
shared queue it would have waited on.

A Redis that has just restarted, stalled or refused writes lets every registration lapse,
though the workers are alive: the sweep claims a lapsed name only when contact with Redis has
held for one registration TTL since the last gap, measured in Redis server time
(``FleetRegistry.claim_lapsed``), so a stall cannot make the fleet declare itself lost. Every
worker declared lost is also written to the fleet's event stream (``Keys.fleet_events``), so
``specfleet top`` and ``specfleet monitor --fleet-events`` see it whichever process swept it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TypeVar

from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer

from shared import doorbell
from shared.event_stream import EventWriter
from shared.fleet_events import append, fleet_record
from shared.keys import Keys
from shared.logs import get_logger
from shared.outage import ride_out
from shared.protocol import Priority
from shared.registry import FleetRegistry
from shared.replies import text
from shared.settings import Settings

log = get_logger("recovery")

T = TypeVar("T")

#: States in which a job of a dead worker still needs running (queued: popped, not started).
_UNFINISHED = {JobStatus.QUEUED, JobStatus.STARTED}


def requeue_front(connection: Redis, keys: Keys, job_id: str) -> Job | None:
    """Put a job back at the front of its shared queue and ring its model's doorbell; None
    when it no longer exists."""
    job = _fetch(connection, job_id)
    if job is not None:
        _requeue_front(connection, keys, job)
    return job


def hand_back(connection: Redis, keys: Keys, name: str) -> list[str]:
    """The jobs waiting in a worker's own queues (routed to it for its prefixes), requeued
    at the front of their shared queues in their order, and what it published as held
    dropped: the worker died or is leaving. Each id moves atomically into the worker's
    in-flight list first, so a thief taking from the same queue never gets it twice and a
    crash here leaves it where recovery looks. Returns the ids requeued."""
    handed: list[str] = []
    inflight = keys.inflight(name)
    for model in sorted(text(m) for m in connection.smembers(keys.models())):
        # First out of the holders, so a job routed from now on re-adds it (thieves find it).
        with connection.pipeline(transaction=True) as pipe:
            pipe.zrem(keys.holders(model), name)
            pipe.delete(keys.prefix_blocks(model, name))
            pipe.execute()
        for priority in (Priority.HIGH, Priority.NORMAL):
            own = Queue(keys.own_queue(model, name, priority), connection=connection).key
            # From the tail, each to the front: the shared queue keeps their order.
            while (raw := connection.lmove(own, inflight, "RIGHT", "LEFT")) is not None:
                job = _fetch(connection, text(raw))
                if job is None or job.get_status(refresh=False) is not JobStatus.QUEUED:
                    connection.lrem(inflight, 1, text(raw))  # expired, or cancelled meanwhile
                    continue
                _requeue_front(connection, keys, job, release=inflight)
                handed.append(job.id)
                log.info("job.handed_back", job_id=job.id, worker=name, model=model,
                         queue=job.origin)
    return handed


def _fetch(connection: Redis, job_id: str) -> Job | None:
    try:
        return Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        return None


def _requeue_front(connection: Redis, keys: Keys, job: Job, release: str | None = None,
                   supersede: tuple[int, int] | None = None) -> None:
    """Remove ``job`` from the started registry (its executions) and the failed registry,
    so rq's own cleanup can never later mark the re-run as abandoned, enqueue it at the
    front of its shared queue (a job routed to a worker's own queue goes back to the one it
    would have waited on, ``meta["shared_queue"]``: that worker is gone or leaving), leave
    the in-flight list ``release`` and ring its model's doorbell: one transaction, so the
    job is never requeued without leaving the registries, nor left waiting without a ring.
    ``supersede`` is the attempt a lost worker was running and how long to remember it (the
    job's streams' TTL): from this transaction on, that attempt's final event is refused
    (``Keys.superseded``), so the job cannot finish twice."""
    origin = Queue(job.origin, connection=connection, serializer=JSONSerializer)
    meta = job.meta or {}
    queue = Queue(meta.get("shared_queue", job.origin), connection=connection,
                  serializer=JSONSerializer)
    job.started_at = None
    job.ended_at = None
    with connection.pipeline() as pipe:
        pipe.multi()  # explicit, so rq's enqueue adds to this transaction instead of opening one
        origin.started_job_registry.remove_executions(job, pipeline=pipe)
        origin.failed_job_registry.remove(job, pipeline=pipe)
        queue.enqueue_job(job, pipeline=pipe, at_front=True)
        if release is not None:
            pipe.lrem(release, 1, job.id)
        if supersede is not None:
            attempt, ttl = supersede
            pipe.set(keys.superseded(job.id), attempt, ex=ttl)
        doorbell.ring_in(pipe, keys, meta.get("model", ""))
        pipe.execute()


class RecoveryMonitor:
    """Finds lost workers and requeues the job each was running.

    ``sweeper`` names who sweeps (a worker's name; None: a client) in the fleet events."""

    def __init__(self, connection: Redis, registry: FleetRegistry, settings: Settings,
                 sweeper: str | None = None) -> None:
        self._conn = connection
        self._registry = registry
        self._settings = settings
        self._keys = settings.keys
        self._sweeper = sweeper

    def sweep(self) -> list[str]:
        """Recover every lost worker; returns the ids of the jobs requeued."""
        found = self._registry.claim_lapsed()
        if found.deferred is not None and found.waiting:
            log.info("recovery.deferred", reason=found.deferred, seconds=found.seconds,
                     lapsed=found.waiting)
        requeued: list[str] = []
        for name, model in found.lost.items():
            requeued += self.recover(name, model or None, swept=True)
        return requeued

    def recover(self, name: str, model: str | None = None, swept: bool = False) -> list[str]:
        """Requeue every job a dead worker called ``name`` held or had waiting in its own
        queues (after a crash, at the start of its successor under the same name, or once
        claimed by a sweep: ``swept``). A worker that left anything, or was swept, is
        reported lost: in the log and on the fleet's event stream."""
        # Once claimed, nobody else will recover this name: each step rides out a Redis that
        # refuses for a while (out of memory, say), so no job is left behind in between.
        requeued = self._ride(lambda: hand_back(self._conn, self._keys, name),
                              "recovery.hand_back")
        held = self._ride(lambda: self._registry.take_jobs(name), "recovery.take")
        for job_id in held:
            job = self._ride(partial(_fetch, self._conn, job_id), "recovery.requeue")
            model = model or ((job.meta or {}).get("model") if job else None)
            if job is not None and self._ride(partial(self._requeue, job, lost_worker=name),
                                              "recovery.requeue"):
                requeued.append(job.id)
        if swept or held or requeued:
            self._report_lost(name, model, held, requeued)
        return requeued

    def _ride(self, operation: Callable[[], T], what: str) -> T:
        return ride_out(operation, self._settings.redis_outage_seconds, what)

    def _report_lost(self, name: str, model: str | None, held: list[str],
                     requeued: list[str]) -> None:
        """``worker.lost``, in this process's log and on the fleet's event stream (one
        record a lost worker: the jobs it held, those requeued, who found it)."""
        record = fleet_record("worker.lost", worker=name, model=model, jobs=held,
                              requeued=requeued, by=self._sweeper)
        log.warning("worker.lost", worker=name, model=model, jobs=held, requeued=requeued,
                    by=self._sweeper)
        self._ride(lambda: append(self._conn, self._keys, record), "recovery.report")

    def requeue(self, job_id: str, lost_worker: str) -> bool:
        """Requeue one unfinished job and say so on its stream."""
        job = _fetch(self._conn, job_id)
        return job is not None and self._requeue(job, lost_worker)

    def _requeue(self, job: Job, lost_worker: str) -> bool:
        # The status was read with the job; a job still waiting in its queue needs nothing.
        if (job.get_status(refresh=False) not in _UNFINISHED
                or self._conn.lpos(Queue(job.origin, connection=self._conn).key, job.id)
                is not None):
            return False
        # The attempt the lost worker runs; only the next run counts another one.
        attempt = int(self._conn.get(self._keys.attempts(job.id)) or 1)
        _requeue_front(self._conn, self._keys, job,
                       supersede=(attempt, self._settings.stream_ttl_seconds))
        EventWriter.for_job(self._conn, self._settings, job.id, attempt).progress(
            "requeued", worker=lost_worker)
        log.warning("job.requeued", job_id=job.id, worker=lost_worker,
                    model=(job.meta or {}).get("model"), attempt=attempt,
                    next_attempt=attempt + 1)
        return True
