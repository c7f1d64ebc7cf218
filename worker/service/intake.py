"""Taking work: a job id moves from its rq queue into the worker's in-flight list atomically.

rq's own dequeue (``BLPOP`` over several queues) leaves a window in which a killed worker has
popped a job that nothing records; here the pop *is* the record: one Lua script ``LMOVE``s the
first id of the highest-priority non-empty queue into ``{prefix}:worker:{name}:inflight``, so
at every instant each job is either in a queue or in exactly one worker's in-flight list, and
crash recovery requeues whatever a dead worker's list holds. When every queue is empty the
intake waits on the model's doorbell (``shared/doorbell.py``: every enqueue rings it) for up to
``idle_poll`` seconds, then takes atomically again, so an idle worker starts a new job at once
whichever of its queues it landed on.

Jobs routed to this worker for the prefix it holds wait on its own queues, which lead each
priority (``Keys.queues``), and ring its own bell. When everything it serves is empty it also
takes from the other holders' own queues (``Keys.holders``: those whose context is at most its
own), but only a job it has already seen at the head of such a queue for ``idle_poll``
seconds: the holder, rung at once, takes its job first when it has room, and no job waits
behind a busy holder while this worker could run it.

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
from shared.protocol import Priority
from shared.replies import text

log = get_logger("intake")

#: KEYS[1]: the in-flight list; KEYS[2 .. ARGV[1] + 1]: this worker's queues, in order; then
#: other holders' own queues, each taken only when its head is the id in ARGV (seen waiting
#: there long enough); last, the set of own queues a routed job went to
#: (``Keys.waiting_own_queues``): only those are looked at, and one found gone (an emptied
#: list is deleted) leaves the set.
#: Replies {id, queue} when it took one, {false, queue} for a key that is not a list, else
#: {'', head of each other holder's queue ('' when empty)}.
_TAKE_LUA = """
local n = tonumber(ARGV[1])
local waiting = {}
for _, key in ipairs(redis.call('SMEMBERS', KEYS[#KEYS])) do waiting[key] = true end
local heads = {''}
for i = 2, #KEYS - 1 do
  local kind = 'none'
  if i <= n + 1 or waiting[KEYS[i]] then kind = redis.call('TYPE', KEYS[i])['ok'] end
  if kind == 'list' then
    if i <= n + 1 then
      local id = redis.call('LMOVE', KEYS[i], KEYS[1], 'LEFT', 'RIGHT')
      if id then return {id, KEYS[i]} end
    else
      local head = redis.call('LINDEX', KEYS[i], 0) or ''
      if head ~= '' and head == ARGV[i - n] then
        redis.call('LMOVE', KEYS[i], KEYS[1], 'LEFT', 'RIGHT')
        return {head, KEYS[i]}
      end
      heads[#heads + 1] = head
    end
  elseif kind ~= 'none' then
    return {false, KEYS[i]}
  elseif i > n + 1 then
    if waiting[KEYS[i]] then redis.call('SREM', KEYS[#KEYS], KEYS[i]) end
    heads[#heads + 1] = ''
  end
end
return heads
"""


@dataclass(frozen=True)
class Taken:
    """A job id now in this worker's in-flight list, and the rq queue it came from."""

    job_id: str
    queue_key: str


class JobIntake:
    """One worker's atomic take from its queues (highest priority first) and release."""

    def __init__(self, connection: Redis, keys: Keys, worker_name: str, model: str,
                 queues: list[str], n_ctx: int, idle_poll: float = 0.5) -> None:
        self._conn = connection
        self._keys = keys
        self._model = model
        self._worker = worker_name
        self._n_ctx = n_ctx
        self.inflight_key = keys.inflight(worker_name)
        self._idle_poll = idle_poll
        #: This worker's queue keys in order, and the other holders' own queue keys.
        self._lists: tuple[list[str], list[str]] = ([], [])
        #: Per other holder's queue: the id at its head and since when this worker saw it.
        self._heads: dict[str, tuple[str, float]] = {}
        self._take = connection.register_script(_TAKE_LUA)
        self.listen(queues)

    def listen(self, queues: list[str]) -> None:
        """Take from these rq queues (by name) from now on, in this order of preference, and
        when they are empty from the own queues of the model's other holders that fit this
        worker's context (read again here: the heartbeat calls it, as tiers appear)."""
        prefix = Queue.redis_queue_namespace_prefix
        others = [text(w) for w in self._conn.zrangebyscore(self._keys.holders(self._model),
                                                            0, self._n_ctx)]
        steal = [self._keys.own_queue(self._model, w, p)
                 for p in (Priority.HIGH, Priority.NORMAL)
                 for w in sorted(others) if w != self._worker]
        self._lists = ([prefix + q for q in queues], [prefix + q for q in steal])

    def take(self, block: bool = True) -> Taken | None:
        """The next job, moved into the in-flight list; None when there is none (after
        ``idle_poll`` seconds of waiting when ``block``: an idle worker waits, a busy one
        only looks, so its running slots are not held up)."""
        taken = self._take_any()
        if taken is not None or not block:
            return taken
        doorbell.wait(self._conn, self._keys, self._model, self._idle_poll, self._worker)
        return self._take_any()

    def release(self, job_id: str) -> bool:
        """The job's run is over (finished, failed, refused or requeued): forget it. False
        when it was no longer listed (a sweep that declared this worker lost took it)."""
        return bool(self._conn.lrem(self.inflight_key, 1, job_id))

    def held(self) -> list[str]:
        """The ids this worker holds right now."""
        return [text(r) for r in self._conn.lrange(self.inflight_key, 0, -1)]

    def quarantine(self, job_id: str, reason: str) -> None:
        """Move a poisoned entry out of the in-flight list into the quarantine list."""
        record = json.dumps({"job_id": job_id, "reason": reason, "worker": self._worker,
                             "at": time.time()})
        pipe = self._conn.pipeline(transaction=True)
        pipe.lrem(self.inflight_key, 1, job_id)
        pipe.rpush(self._keys.quarantine(), record)
        pipe.execute()

    def _take_any(self) -> Taken | None:
        own, steal = self._lists
        now = time.monotonic()
        ripe = [self._ripe(key, now) for key in steal]
        reply = self._take(keys=[self.inflight_key, *own, *steal,
                                 self._keys.waiting_own_queues(self._model)],
                           args=[len(own), *ripe])
        raw_id, rest = reply[0], reply[1:]
        if raw_id is None:
            self._set_aside(text(rest[0]))
            return None
        if raw_id:
            taken = Taken(text(raw_id), text(rest[0]))
            if taken.queue_key in steal:
                log.info("intake.stolen", job_id=taken.job_id, queue=taken.queue_key,
                         worker=self._worker,
                         waited_seconds=round(now - self._heads[taken.queue_key][1], 3))
            return taken
        self._saw(steal, [text(h) for h in rest], now)
        return None

    def _ripe(self, key: str, now: float) -> str:
        """The id this worker may take from another holder's queue: the one it has seen at
        the head for ``idle_poll`` seconds ('' for none)."""
        seen = self._heads.get(key)
        return seen[0] if seen is not None and now - seen[1] >= self._idle_poll else ""

    def _saw(self, keys: list[str], heads: list[str], now: float) -> None:
        for key, head in zip(keys, heads, strict=True):
            seen = self._heads.get(key)
            if not head:
                self._heads.pop(key, None)
            elif seen is None or seen[0] != head:
                self._heads[key] = (head, now)

    def _set_aside(self, key: str) -> None:
        """A queue key that is not a list: rename it into the quarantine namespace."""
        aside = f"{self._keys.quarantine()}:key:{key}:{int(time.time() * 1000)}"
        kind = text(self._conn.type(key))
        self._conn.rename(key, aside)
        self._conn.rpush(self._keys.quarantine(), json.dumps(
            {"key": key, "moved_to": aside, "reason": f"queue key holds a {kind}, not a list",
             "worker": self._worker, "at": time.time()}))
        log.error("queue.refused", queue=key, moved_to=aside,
                  reason=f"queue key holds a {kind}, not a list")
