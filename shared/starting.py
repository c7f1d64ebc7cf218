"""A worker that is loading says so: its model is *coming*, not unknown, until it registers.

A worker registers only once its model is loaded, fitted and its row costs timed: seconds
for a tiny model, minutes for a large one on a busy host (Gemma 3 270M at 8 slots took 296 s
on 2 cores). Requests for its model meanwhile used to be refused. Now, from before it loads
until it registers, the worker keeps a record in ``Keys.starting`` (member
``MODEL:WORKER``, scored by when the record lapses, in Redis server time), refreshed by a
thread every heartbeat interval. Its registration removes it, just after the registration is
written (``FleetRegistry.register``: never a moment with neither); a worker that dies loading
stops being awaited one registration TTL after its last refresh. ``coordinator/models.py``
reads it.
"""

from __future__ import annotations

import threading
from types import TracebackType

from redis import Redis

from shared.keys import Keys
from shared.logs import get_logger
from shared.replies import text

log = get_logger("worker")

#: KEYS: the starting set. ARGV: member, TTL ms. Marks the member for TTL from now (Redis
#: time) and drops the records that have lapsed.
_MARK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
#: KEYS: the starting set. The members that have not lapsed (read-only).
_READ_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
"""


def member(model: str, worker: str) -> str:
    """A loading worker's member of ``Keys.starting`` (a model name holds no ``:``)."""
    return f"{model}:{worker}"


def loaded(connection: Redis, keys: Keys, model: str, worker: str) -> None:
    """The worker has registered: it is loading no longer."""
    connection.zrem(keys.starting(), member(model, worker))


def starting_workers(connection: Redis, keys: Keys) -> dict[str, list[str]]:
    """The workers loading each model now (model -> worker names), read-only."""
    found: dict[str, list[str]] = {}
    for member in connection.register_script(_READ_LUA)(keys=[keys.starting()]):
        model, _, worker = text(member).partition(":")
        found.setdefault(model, []).append(worker)
    return found


class StartingRecord:
    """``with StartingRecord(...):`` around a worker's load: the record is written before it
    and refreshed until the block ends (its registration, just after, removes it)."""

    def __init__(self, connection: Redis, keys: Keys, model: str, worker: str,
                 ttl_seconds: float, interval_seconds: float) -> None:
        self._mark = connection.register_script(_MARK_LUA)
        self._key = keys.starting()
        self._member = member(model, worker)
        self._ttl_ms = max(1, int(ttl_seconds * 1000))
        self._interval = interval_seconds
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="specfleet-starting",
                                        daemon=True)
        self.model = model
        self.worker = worker

    def _write(self) -> None:
        self._mark(keys=[self._key], args=[self._member, self._ttl_ms])

    def _refresh(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._write()
            except Exception as exc:  # noqa: BLE001  a Redis hiccup: the next refresh
                log.warning("worker.starting_record_failed", worker=self.worker,
                            error=repr(exc))

    def __enter__(self) -> StartingRecord:
        self._write()
        self._thread.start()
        log.info("worker.starting", worker=self.worker, model=self.model)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stopped.set()
        self._thread.join()
