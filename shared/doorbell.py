"""Waking idle workers: whoever queues a job rings its model's doorbell; idle workers wait on it.

An idle worker cannot block on all its queues at once and still take atomically (``BLMOVE``
watches one list), so it waits on the doorbell ``{prefix}:doorbell:{model}`` instead: every
enqueue pushes one ring, one waiting worker pops it and runs its atomic take over every queue
it serves. Rings are capped, so a model nobody serves keeps a bounded list; a missed ring
costs at most the waiter's timeout, after which it looks at its queues anyway.
"""

from __future__ import annotations

from redis import Redis
from redis.client import Pipeline

from shared.keys import Keys

#: Rings kept when nobody is waiting (each wakes one worker for one look at its queues).
MAX_RINGS = 1024


def ring(connection: Redis, keys: Keys, model: str) -> None:
    """A job of ``model`` is waiting: wake one idle worker."""
    with connection.pipeline(transaction=False) as pipe:
        ring_in(pipe, keys, model)
        pipe.execute()


def ring_in(pipe: Pipeline, keys: Keys, model: str) -> None:
    """Queue a ring on ``pipe``, beside the enqueue it announces: one round trip, and the
    job and its ring land together."""
    pipe.lpush(keys.doorbell(model), 1)
    pipe.ltrim(keys.doorbell(model), 0, MAX_RINGS - 1)


def wait(connection: Redis, keys: Keys, model: str, timeout: float) -> bool:
    """Block until a ring (True) or ``timeout`` seconds (False)."""
    # redis-py's stub says int; BLPOP takes decimal seconds.
    return connection.blpop([keys.doorbell(model)], timeout) is not None  # type: ignore[arg-type]
