"""Cooperative cancellation: a per-job flag in Redis that the decode loop checks every step.

rq cannot stop a running job in a non-forking worker (``send_stop_job_command`` kills a work
horse that does not exist), and SIGALRM cannot interrupt a C call; so the engine's
``should_stop`` callback reads this flag once per decode step and the job ends with a
``cancelled`` final event within one step.
"""

from __future__ import annotations

from redis import Redis

from shared.keys import Keys


def request_cancel(connection: Redis, keys: Keys, job_id: str, ttl_seconds: int) -> None:
    """Raise the job's cancel flag (idempotent; expires with the job's stream)."""
    connection.set(keys.cancel(job_id), 1, ex=ttl_seconds)


def is_cancelled(connection: Redis, keys: Keys, job_id: str) -> bool:
    """True once someone asked to cancel the job."""
    return bool(connection.exists(keys.cancel(job_id)))
