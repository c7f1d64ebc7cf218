"""Requests that wait for a worker of a coming model, and the record of them in Redis.

A request for a model that is *coming* (declared, or a worker of it loading:
``coordinator/models.py``) is not queued yet: nothing it needs from a worker (its context,
its chat template, its vocabulary, its capacity) can be checked until one is live. So its
submitter waits, looking every :data:`WAIT_POLL_SECONDS`, and submits once a worker is live;
past ``SPECFLEET_WAIT_FOR_WORKER_SECONDS`` the wait ends with a ``wait_timeout`` refusal
naming the model and the deadline (the gateway's 503). :class:`WorkerWait` is that wait,
the same for the client, the CLI and the gateway (which runs its looks in threads between
asynchronous sleeps); a batch's lines wait within the batch's window instead
(``coordinator/batch.py``), recorded the same way.

Every waiter is recorded (:class:`WaitingRequests`) so the demand is visible before anything
is queued: an autoscaler reads it as ``specfleet:model_waiting_requests`` and
``specfleet:model_oldest_wait_seconds`` (``coordinator/metrics.py``) to start the first
worker. A record is refreshed at each look and dropped at the end; one whose waiter died
stops counting :data:`STALE_SECONDS` after its last look.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis import Redis

from coordinator.models import ModelDirectory, Standing
from coordinator.validation import SubmitError
from shared.keys import Keys
from shared.logs import get_logger

log = get_logger("coordinator")

#: Seconds between two looks for a live worker while a request waits.
WAIT_POLL_SECONDS = 0.5
#: A waiter not seen for this long is gone (its process died): it no longer counts.
STALE_SECONDS = 10.0

#: KEYS: waiting set, since hash. ARGV: waiter, stale ms. Marks the waiter seen now (Redis
#: time), its start kept from its first look, and forgets waiters gone stale.
_TOUCH_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - tonumber(ARGV[2])
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)) do
  redis.call('HDEL', KEYS[2], gone)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSETNX', KEYS[2], ARGV[1], now)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
"""
#: KEYS: waiting set, since hash. ARGV: stale ms. Replies {waiters seen within it, ms the
#: oldest of them has waited} (read-only).
_SUMMARY_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. (now - tonumber(ARGV[1])), '+inf')
local oldest = 0
for _, waiter in ipairs(live) do
  local since = redis.call('HGET', KEYS[2], waiter)
  if since and now - tonumber(since) > oldest then oldest = now - tonumber(since) end
end
return {#live, oldest}
"""


@dataclass(frozen=True)
class Waiting:
    """The waiters of one model: how many, and how long the oldest has waited."""

    requests: int
    oldest_seconds: float


class WaitingRequests:
    """The record of what waits for a worker, per model."""

    def __init__(self, connection: Redis, keys: Keys) -> None:
        self._conn = connection
        self._keys = keys
        self._touch = connection.register_script(_TOUCH_LUA)
        self._summary = connection.register_script(_SUMMARY_LUA)
        self._stale_ms = int(STALE_SECONDS * 1000)

    def touch(self, model: str, waiter: str) -> None:
        """``waiter`` (a job id, a request's id) waits for a worker of ``model``, still."""
        self._touch(keys=[self._keys.waiting(model), self._keys.waiting_since(model)],
                    args=[waiter, self._stale_ms])

    def leave(self, model: str, waiter: str) -> None:
        """``waiter`` waits no more (it was queued, refused or gave up)."""
        with self._conn.pipeline(transaction=True) as pipe:
            pipe.zrem(self._keys.waiting(model), waiter)
            pipe.hdel(self._keys.waiting_since(model), waiter)
            pipe.execute()

    def of(self, models: list[str]) -> dict[str, Waiting]:
        """The waiters of each of ``models`` now (read-only: one round trip)."""
        with self._conn.pipeline(transaction=False) as pipe:
            for model in models:
                self._summary(keys=[self._keys.waiting(model), self._keys.waiting_since(model)],
                              args=[self._stale_ms], client=pipe)
            replies = pipe.execute()
        return {model: Waiting(int(count), int(oldest_ms) / 1000)
                for model, (count, oldest_ms) in zip(models, replies, strict=True)}


class WorkerWait:
    """One request's wait for a worker of its coming model, up to ``seconds``:
    ``while wait.coming(): sleep(wait.interval)``, then submit (admission is checked again
    against the worker that came); :meth:`close` it however the wait ends."""

    interval = WAIT_POLL_SECONDS

    def __init__(self, models: ModelDirectory, waiting: WaitingRequests, model: str,
                 waiter: str, seconds: float) -> None:
        self._models = models
        self._waiting = waiting
        self.model = model
        self.waiter = waiter
        self.seconds = seconds
        self._started = time.monotonic()
        log.info("model.waiting_for_worker", model=model, waiter=waiter, seconds=seconds)

    def coming(self) -> bool:
        """True while the model is still only coming (look again after :attr:`interval`);
        False once a worker of it is live, or once it is no longer awaited at all (the
        submit that follows says why). ``SubmitError`` (``wait_timeout``) past the
        deadline, naming the model and the deadline."""
        self._waiting.touch(self.model, self.waiter)
        state = self._models.state(self.model)
        waited = round(time.monotonic() - self._started, 2)
        if state.standing is not Standing.COMING:
            log.info("model.worker_found", model=self.model, waiter=self.waiter,
                     standing=str(state.standing), waited_seconds=waited)
            return False
        if waited >= self.seconds:
            log.warning("model.wait_timed_out", model=self.model, waiter=self.waiter,
                        seconds=self.seconds)
            raise SubmitError(
                f"no worker of model '{self.model}' became live within {self.seconds:g} s "
                f"(SPECFLEET_WAIT_FOR_WORKER_SECONDS); it is {state.why_coming()}: start a "
                "worker of it, or try again later", "wait_timeout", param="model",
                model=self.model)
        return True

    def close(self) -> None:
        """The wait is over: its record goes."""
        self._waiting.leave(self.model, self.waiter)
