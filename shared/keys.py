"""Redis key and channel naming, in one place so coordinator and workers always agree.

Everything lives under one prefix (``SPECFLEET_PREFIX``, default ``specfleet``) so that several
deployments, or parallel test runs, can share one Redis without seeing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.protocol import Priority

#: Field name of the JSON event payload inside each entry of a job's event Stream.
STREAM_FIELD = "event"


@dataclass(frozen=True)
class Keys:
    """Key builder bound to one namespace prefix."""

    prefix: str = "specfleet"

    def queue(self, model: str, priority: Priority = Priority.NORMAL,
              ctx: int | None = None) -> str:
        """rq queue name for a served model (rq adds its own ``rq:queue:`` prefix).

        ``ctx`` names a context tier: jobs that need up to ``ctx`` tokens, taken only by
        workers whose per-slot context holds that many. Without it, the model's untiered
        queue, which every worker of the model takes from (and checks each job itself)."""
        base = f"{self.prefix}:{model}" + (f":ctx{ctx}" if ctx is not None else "")
        return f"{base}:high" if priority is Priority.HIGH else base

    def queues(self, model: str, ctx_tiers: Sequence[int] = (),
               worker: str | None = None) -> list[str]:
        """Queues a worker of ``model`` listens on, in the order it takes from them: high
        priority first; within a priority the worker's own queue first (``worker``: the
        jobs routed to it for the prefix it holds), then the largest context tier (a big
        worker serves first what only it can), the untiered queue last."""
        tiers = sorted(set(ctx_tiers), reverse=True)
        own = [worker] if worker is not None else []
        return [name for p in (Priority.HIGH, Priority.NORMAL)
                for name in ([self.own_queue(model, w, p) for w in own]
                             + [self.queue(model, p, t) for t in (*tiers, None)])]

    def own_queue(self, model: str, worker: str, priority: Priority = Priority.NORMAL) -> str:
        """rq queue of the jobs routed to one worker because it holds their prefix
        (``docs/service.md``, prefix-affinity routing); other workers of the model take from
        it only once it has waited, and crash recovery moves it to the shared queues."""
        base = f"{self.prefix}:{model}:w:{worker}"
        return f"{base}:high" if priority is Priority.HIGH else base

    def waiting_own_queues(self, model: str) -> str:
        """Set of the own-queue list keys of ``model`` a routed job was pushed to and no take
        has yet found empty: an idle worker looks for jobs to take over only in these, not in
        every holder's queues (which cost the fleet N x N lookups a poll)."""
        return f"{self.prefix}:holders:{model}:waiting"

    def holders(self, model: str) -> str:
        """Sorted set of the workers of ``model`` that jobs were routed to (score: their
        per-slot context), so every worker finds the own queues it may take from when idle,
        also those of a worker that has since died or left."""
        return f"{self.prefix}:holders:{model}"

    def prefix_blocks(self, model: str, worker: str) -> str:
        """Hash of the prefix block digests a worker's slots hold (``shared/prefix_digest``:
        a field per digest) and its busy slots (field ``busy``), rewritten as each job starts
        and ends, expiring with the worker's registration."""
        return f"{self.prefix}:prefix:{model}:{worker}"

    def routing(self, model: str) -> str:
        """Hash counting submits of ``model`` by where they were queued (``holder``: a
        worker's own queue, ``shared``: the model's queues), for the fleet metrics."""
        return f"{self.prefix}:routing:{model}"

    def doorbell(self, model: str, worker: str | None = None) -> str:
        """List an idle worker of ``model`` blocks on; every enqueue pushes one ring. With
        ``worker``, that worker's own bell, rung for a job routed to it alone."""
        own = f":w:{worker}" if worker is not None else ""
        return f"{self.prefix}:doorbell:{model}{own}"

    def tiers(self, model: str) -> str:
        """Sorted set of the context tiers of a model (every per-slot context a worker of it
        has served with): kept when workers leave, so jobs queued for a tier stay served."""
        return f"{self.prefix}:tiers:{model}"

    def events(self, job_id: str) -> str:
        """Per-job Redis Stream: the durable, replayable record of every event."""
        return f"{self.prefix}:job:{job_id}:events"

    def channel(self, job_id: str) -> str:
        """Per-job pub/sub channel: live fan-out of the same events."""
        return f"{self.prefix}:job:{job_id}:live"

    def cancel(self, job_id: str) -> str:
        """Cooperative cancel flag checked by the decode loop."""
        return f"{self.prefix}:job:{job_id}:cancel"

    def attempts(self, job_id: str) -> str:
        """Counter of started attempts of a job (crash recovery increments it)."""
        return f"{self.prefix}:job:{job_id}:attempts"

    def attempt_tokens(self, job_id: str) -> str:
        """Which number each start of a job was given (a retried count keeps its number)."""
        return f"{self.prefix}:job:{job_id}:attempt-tokens"

    def superseded(self, job_id: str) -> str:
        """The newest attempt of a job that recovery took away from a lost worker: a final or
        error event of that attempt or an older one is dropped (a stalled worker that wakes
        to finish it cannot end the job a second time)."""
        return f"{self.prefix}:job:{job_id}:superseded"

    def seq(self, job_id: str) -> str:
        """Monotonic event sequence counter of a job, shared by all its attempts."""
        return f"{self.prefix}:job:{job_id}:seq"

    def workers(self) -> str:
        """Sorted set of live worker names scored by last heartbeat (unix seconds)."""
        return f"{self.prefix}:workers"

    def worker(self, name: str) -> str:
        """A worker's registration (JSON ``WorkerInfo``), expiring without heartbeats."""
        return f"{self.prefix}:worker:{name}"

    def rq_worker(self, name: str) -> str:
        """The name a worker has in rq's own records (``rq:worker:<it>``, its command channel
        ``rq:pubsub:<it>``, the jobs and executions it ran): rq's keys carry no deployment
        prefix, so a bare name would be one record and one channel for the same worker name
        of every deployment on the Redis (an rq ``shutdown`` sent to one stopped both, and
        each start retired the other's record as stale)."""
        return f"{self.prefix}:{name}"

    def inflight(self, name: str) -> str:
        """List of the jobs a worker has taken: a job id moves here from its queue atomically
        (``LMOVE``) and leaves when its run ends, so a worker killed at any instant leaves
        every job it held where crash recovery finds it."""
        return f"{self.prefix}:worker:{name}:inflight"

    def quarantine(self) -> str:
        """List of refused queue entries (JSON: job id, reason, worker, time), kept for
        operators to inspect; a poisoned entry never reaches a queue again."""
        return f"{self.prefix}:quarantine"

    def models(self) -> str:
        """Set of model names that have (had) workers."""
        return f"{self.prefix}:models"

    def catalog(self) -> str:
        """Hash of the declared models: name -> JSON ``ModelEntry`` (``shared/catalog.py``),
        known whether or not a worker of them runs."""
        return f"{self.prefix}:catalog"

    def catalog_aliases(self) -> str:
        """Hash of the declared models' aliases: alias -> the declared name it stands for."""
        return f"{self.prefix}:catalog:aliases"

    def starting(self) -> str:
        """Sorted set of the workers loading a model and not yet registered, member
        ``MODEL:WORKER`` scored by when the record lapses (Redis server ms): a model with
        one is coming (``shared/starting.py``)."""
        return f"{self.prefix}:starting"

    def waiting(self, model: str) -> str:
        """Sorted set of the requests (and batch lines) waiting for a worker of ``model``
        before they can be queued, scored by their waiter's last look (Redis server ms):
        the demand an autoscaler reads (``coordinator/waiting.py``)."""
        return f"{self.prefix}:waiting:{model}"

    def waiting_since(self, model: str) -> str:
        """Hash of the waiters of :meth:`waiting`: waiter -> when it began waiting (ms)."""
        return f"{self.prefix}:waiting:{model}:since"

    def worker_models(self) -> str:
        """Hash of each name in the fleet set -> the model it serves, kept while the name is
        listed, so a worker declared lost is reported with its model."""
        return f"{self.prefix}:workers:models"

    def fleet_clock(self) -> str:
        """Hash of the fleet's contact with Redis, in Redis server time (ms): ``beat``, the
        last heartbeat or recovery sweep Redis served; ``resumed``, when contact last resumed
        after a gap (a stall, an outage, a restart). Nobody is declared lost until contact
        has held for one registration TTL (``shared/registry.py``)."""
        return f"{self.prefix}:fleet:clock"

    def fleet_events(self) -> str:
        """Stream of fleet-wide events (``worker.lost`` whoever swept it, host fallbacks,
        replays, requeues, refusals, Redis faults: ``shared.fleet_events``), bounded, read by
        ``specfleet top``, ``specfleet monitor --fleet-events`` and the gateway's console."""
        return f"{self.prefix}:fleet:events"

    def batch(self, batch_id: str) -> str:
        """Hash describing a submitted batch (status, counts, job ids)."""
        return f"{self.prefix}:batch:{batch_id}"

    def batch_results(self, batch_id: str) -> str:
        """Hash of a batch's accounted lines: line number -> final event (or error) JSON."""
        return f"{self.prefix}:batch:{batch_id}:results"

    def batch_jobs(self, batch_id: str) -> str:
        """Hash of a batch's lines that became jobs: line number -> job id."""
        return f"{self.prefix}:batch:{batch_id}:jobs"

    def batch_creator(self, batch_id: str) -> str:
        """Lease of the process queueing a batch's lines (expires when it dies: another
        process then queues the rest)."""
        return f"{self.prefix}:batch:{batch_id}:creator"

    def batches(self) -> str:
        """Sorted set of batch ids scored by creation time (the listing)."""
        return f"{self.prefix}:batches"

    def open_batches(self) -> str:
        """Sorted set of the batches not yet ended, scored by when their window closes: what
        every gateway's batch pump looks after (lines left to queue, a window past)."""
        return f"{self.prefix}:batches:open"

    def gateway_wake(self, gateway_id: str) -> str:
        """Stream one gateway's stream hub reads beside the job streams: an entry wakes its
        blocked read when a new stream is to be followed."""
        return f"{self.prefix}:gateway:{gateway_id}:wake"

    def job_batch(self, job_id: str) -> str:
        """A batch job's line reference (JSON), read by the final-event script to account
        the job's outcome to its batch in the same atomic step."""
        return f"{self.prefix}:job:{job_id}:batch"

    def owner_batches(self, owner: str) -> str:
        """Sorted set of one owner's batches scored by creation time: the listing an API key
        sees (``owner`` is its key id, never the key)."""
        return f"{self.prefix}:owner:{owner}:batches"

    def owner_open_batches(self, owner: str) -> str:
        """Sorted set of one owner's batches that may still be open, scored by when their
        window closes: what its open-batches quota counts (ended ones leave it as it counts)."""
        return f"{self.prefix}:owner:{owner}:batches:open"

    def owner_files(self, owner: str) -> str:
        """Sorted set of one owner's uploads scored by when they expire: the listing an API
        key sees, and what its stored-bytes quota counts (expired ones leave it as it counts)."""
        return f"{self.prefix}:owner:{owner}:files"

    def owner_file_bytes(self, owner: str) -> str:
        """Hash of one owner's uploads in :meth:`owner_files`: file id -> bytes, and their sum
        in field ``total`` (the stored-bytes quota reads it, not every upload)."""
        return f"{self.prefix}:owner:{owner}:files:bytes"

    def file(self, file_id: str) -> str:
        """Hash of an uploaded file (``meta`` JSON and ``content`` bytes)."""
        return f"{self.prefix}:file:{file_id}"

    def files(self) -> str:
        """Sorted set of uploaded file ids scored by upload time (the listing)."""
        return f"{self.prefix}:files"
