"""Taking work: a job id moves from its rq queue into the worker's in-flight list atomically.

rq's own dequeue (``BLPOP`` over several queues) leaves a window in which a killed worker has
popped a job that nothing records; here the pop *is* the record: one Lua script ``LMOVE``s the
first id of the highest-priority non-empty queue into ``{prefix}:worker:{name}:inflight``, so
at every instant each job is either in a queue or in exactly one worker's in-flight list, and
crash recovery requeues whatever a dead worker's list holds. When every queue is empty the
intake waits on the model's doorbell (``shared/doorbell.py``: every enqueue rings it) for up to
``idle_poll`` seconds, then takes atomically again, so an idle worker starts a new job at once
whichever of its queues it landed on.

A queue key of the wrong Redis type (a poisoned deployment) would make every take fail: it
is renamed aside into the quarantine namespace and reported, and the worker keeps serving.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from redis import Redis
from rq.queue import Queue

from shared import doorbell
from shared.keys import Keys
from shared.logs import get_logger

log = get_logger("intake")

_TAKE_LUA = """
for i = 2, #KEYS do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind == 'list' then
    local id = redis.call('LMOVE', KEYS[i], KEYS[1], 'LEFT', 'RIGHT')
    if id then return {id, KEYS[i]} end
  elseif kind ~= 'none' then
    return {false, KEYS[i]}
  end
end
return false
"""


@dataclass(frozen=True)
class Taken:
    """A job id now in this worker's in-flight list, and the rq queue it came from."""

    job_id: str
    queue_key: str


class JobIntake:
    """One worker's atomic take from its queues (highest priority first) and release."""

    def __init__(self, connection: Redis, keys: Keys, worker_name: str, model: str,
                 queues: list[str], idle_poll: float = 0.5) -> None:
        self._conn = connection
        self._keys = keys
        self._model = model
        self._worker = worker_name
        self.inflight_key = keys.inflight(worker_name)
        self._queue_keys: list[str] = []
        self.listen(queues)
        self._idle_poll = idle_poll
        self._take = connection.register_script(_TAKE_LUA)

    def listen(self, queues: list[str]) -> None:
        """Take from these rq queues (by name) from now on, in this order of preference (the
        heartbeat refreshes it as context tiers appear)."""
        self._queue_keys = [Queue.redis_queue_namespace_prefix + q for q in queues]

    def take(self, block: bool = True) -> Taken | None:
        """The next job, moved into the in-flight list; None when there is none (after
        ``idle_poll`` seconds of waiting when ``block``: an idle worker waits, a busy one
        only looks, so its running slots are not held up)."""
        taken = self._take_any(self._queue_keys)
        if taken is not None or not block:
            return taken
        doorbell.wait(self._conn, self._keys, self._model, self._idle_poll)
        return self._take_any(self._queue_keys)

    def release(self, job_id: str) -> None:
        """The job's run is over (finished, failed, refused or requeued): forget it."""
        self._conn.lrem(self.inflight_key, 1, job_id)

    def held(self) -> list[str]:
        """The ids this worker holds right now."""
        return [_text(r) for r in self._conn.lrange(self.inflight_key, 0, -1)]

    def quarantine(self, job_id: str, reason: str) -> None:
        """Move a poisoned entry out of the in-flight list into the quarantine list."""
        record = json.dumps({"job_id": job_id, "reason": reason, "worker": self._worker,
                             "at": time.time()})
        pipe = self._conn.pipeline(transaction=True)
        pipe.lrem(self.inflight_key, 1, job_id)
        pipe.rpush(self._keys.quarantine(), record)
        pipe.execute()

    def _take_any(self, queue_keys: list[str]) -> Taken | None:
        reply = self._take(keys=[self.inflight_key, *queue_keys])
        if not reply:
            return None
        raw_id, queue_key = reply
        if not raw_id:
            self._set_aside(_text(queue_key))
            return None
        return Taken(_text(raw_id), _text(queue_key))

    def _set_aside(self, key: str) -> None:
        """A queue key that is not a list: rename it into the quarantine namespace."""
        aside = f"{self._keys.quarantine()}:key:{key}:{int(time.time() * 1000)}"
        kind = _text(self._conn.type(key))
        self._conn.rename(key, aside)
        self._conn.rpush(self._keys.quarantine(), json.dumps(
            {"key": key, "moved_to": aside, "reason": f"queue key holds a {kind}, not a list",
             "worker": self._worker, "at": time.time()}))
        log.error("queue.refused", queue=key, moved_to=aside,
                  reason=f"queue key holds a {kind}, not a list")


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw
