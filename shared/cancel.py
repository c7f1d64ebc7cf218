"""The cooperative cancel flag of a job: the durable key plus a pub/sub notice.

Part of the wire contract: whoever cancels (the coordinator, rq's ``stop-job`` command
reaching a worker, the HTTP gateway when a client hangs up) raises it here, and a worker's
``CancelWatch`` (``worker/service/cancel.py``) turns it into a per-step check.
"""

from __future__ import annotations

from redis import Redis

from shared.keys import Keys


def request_cancel(connection: Redis, keys: Keys, job_id: str, ttl_seconds: int) -> None:
    """Raise the job's cancel flag (idempotent; expires with the job's stream) and say so."""
    pipe = connection.pipeline(transaction=False)
    pipe.set(keys.cancel(job_id), 1, ex=ttl_seconds)
    pipe.publish(keys.cancel(job_id), 1)
    pipe.execute()


def is_cancelled(connection: Redis, keys: Keys, job_id: str) -> bool:
    """True once someone asked to cancel the job (one round trip)."""
    return bool(connection.exists(keys.cancel(job_id)))
