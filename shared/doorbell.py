"""Waking idle workers: whoever queues a job rings its model's doorbell; idle workers wait on it.

An idle worker cannot block on all its queues at once and still take atomically (``BLMOVE``
watches one list), so it waits on the doorbell ``{prefix}:doorbell:{model}`` instead: every
enqueue pushes one ring, one waiting worker pops it and runs its atomic take over every queue
it serves. Rings are capped, so a model nobody serves keeps a bounded list; a missed ring
costs at most the waiter's timeout, after which it looks at its queues anyway. A job routed to
one worker's own queue (prefix-affinity routing) rings only that worker's bell
``{prefix}:doorbell:{model}:w:{worker}``, which it waits on beside the model's.
"""

from __future__ import annotations

from redis import Redis
from redis.client import Pipeline

from shared.keys import Keys

#: Rings kept when nobody is waiting (each wakes one worker for one look at its queues).
MAX_RINGS = 1024


def ring_in(pipe: Pipeline, keys: Keys, model: str, worker: str | None = None) -> None:
    """Queue a ring on ``pipe``, beside the enqueue it announces: one round trip, and the
    job and its ring land together. With ``worker``, only that worker's bell rings (a job
    routed to its own queue): the others must not wake to take it."""
    bell = keys.doorbell(model, worker)
    pipe.lpush(bell, 1)
    pipe.ltrim(bell, 0, MAX_RINGS - 1)


def wait(connection: Redis, keys: Keys, model: str, timeout: float,
         worker: str | None = None) -> bool:
    """Block until a ring (True) or ``timeout`` seconds (False); with ``worker``, a ring of
    its own bell wakes it too."""
    bells = [keys.doorbell(model, worker)] if worker is not None else []
    # redis-py's stub says int; BLPOP takes decimal seconds.
    return connection.blpop([*bells, keys.doorbell(model)],
                            timeout) is not None  # type: ignore[arg-type]
