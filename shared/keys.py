"""Redis key and channel naming, in one place so coordinator and workers always agree.

Everything lives under one prefix (``SPECFLEET_PREFIX``, default ``specfleet``) so that several
deployments, or parallel test runs, can share one Redis without seeing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import Priority


@dataclass(frozen=True)
class Keys:
    """Key builder bound to one namespace prefix."""

    prefix: str = "specfleet"

    def queue(self, model: str, priority: Priority = Priority.NORMAL) -> str:
        """rq queue name for a served model (rq adds its own ``rq:queue:`` prefix)."""
        base = f"{self.prefix}:{model}"
        return f"{base}:high" if priority is Priority.HIGH else base

    def queues(self, model: str) -> list[str]:
        """Queues a worker listens on, highest priority first."""
        return [self.queue(model, Priority.HIGH), self.queue(model, Priority.NORMAL)]

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

    def seq(self, job_id: str) -> str:
        """Monotonic event sequence counter of a job, shared by all its attempts."""
        return f"{self.prefix}:job:{job_id}:seq"

    def workers(self) -> str:
        """Sorted set of live worker names scored by last heartbeat (unix seconds)."""
        return f"{self.prefix}:workers"

    def worker(self, name: str) -> str:
        """A worker's registration (JSON ``WorkerInfo``), expiring without heartbeats."""
        return f"{self.prefix}:worker:{name}"

    def worker_job(self, name: str) -> str:
        """The job a worker is running; outlives the worker so crash recovery can requeue it."""
        return f"{self.prefix}:worker:{name}:job"

    def models(self) -> str:
        """Set of model names that have (had) workers."""
        return f"{self.prefix}:models"

    def batch(self, batch_id: str) -> str:
        """Hash describing a submitted batch (status, counts, job ids)."""
        return f"{self.prefix}:batch:{batch_id}"
