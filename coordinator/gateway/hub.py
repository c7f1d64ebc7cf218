"""One reader for every job stream a gateway follows (:class:`StreamHub`).

A blocking ``XREAD`` per open stream holds a Redis connection per stream: past the client
pool's bound, requests failed with ``MaxConnectionsError`` after their 200 had been sent (an
empty body), and a connection per stream does not scale to thousands anyway. The hub issues one
``XREAD BLOCK`` over every stream its subscribers follow, on one connection of its own, and
hands each subscriber the entries past its own position (two subscribers of one job, a
refusal watch and the stream itself, share the read). A subscriber that arrives while the
read is blocked rings the hub's wake stream (one ``XADD`` to a key only this hub reads), so
its stream is read at once, not when the block times out.

While Redis refuses for a passing reason (:func:`shared.redis_faults.classify`: down,
loading, stalled ...) the hub waits it out with capped backoff (``redis.unavailable`` /
``redis.recovered``, as :func:`shared.outage.ride_out` logs them) and its subscribers wait with
it, so a Redis restart costs a stream a pause, not its end; a subscriber that has waited
``outage_seconds`` gets :class:`shared.outage.RedisOutage` and its request ends with an error
the client can see.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import redis_faults
from shared.logs import get_logger
from shared.outage import RedisOutage

log = get_logger("gateway")

#: How long one XREAD blocks when no stream has news.
BLOCK_MS = 500
#: Entries read per stream per XREAD (a stream behind by more is read on the next one).
COUNT = 256
#: Seconds the wake stream outlives its last ring (it is this hub's alone).
WAKE_TTL_SECONDS = 60
_FIRST_WAIT = 0.1
_MAX_WAIT = 2.0

Entry = tuple[Any, dict[Any, Any]]


class GatewayClosing(RuntimeError):
    """The gateway is shutting down past its drain: the stream ends here (its job goes on)."""


def stream_id(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id (``ms-seq``) as a comparable pair."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    """One reader's position in one stream, and the entries the hub read for it."""

    def __init__(self, key: str, from_id: str) -> None:
        self.key = key
        self.last_id = from_id
        self.position = stream_id(from_id)
        self.since = time.monotonic()
        self.failed = False
        self._queue: asyncio.Queue[list[Entry] | BaseException] = asyncio.Queue()

    def offer(self, entries: Sequence[Entry]) -> None:
        """Take those of ``entries`` past this subscriber's position."""
        new = [e for e in entries if stream_id(e[0]) > self.position]
        if new:
            self.position = stream_id(new[-1][0])
            last = new[-1][0]
            self.last_id = last.decode() if isinstance(last, bytes) else last
            self._queue.put_nowait(new)

    def fail(self, exc: BaseException) -> None:
        self.failed = True
        self._queue.put_nowait(exc)

    async def next(self) -> list[Entry]:
        """The next entries of the stream (waits for them); raises what ended the read."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class StreamHub:
    """Every stream this process follows, read by one task over one connection."""

    def __init__(self, reader: aioredis.Redis, commands: aioredis.Redis, wake_key: str,
                 outage_seconds: float, block_ms: int = BLOCK_MS) -> None:
        self._reader = reader  # holds the blocking XREAD: never shared with other commands
        self._commands = commands
        self._wake_key = wake_key
        self._wake_id = "0-0"
        self.outage_seconds = outage_seconds
        self._block_ms = block_ms
        self._subs: dict[str, set[Subscription]] = {}
        self._changed = asyncio.Event()
        self._reading = False
        self._rung = False
        self._task: asyncio.Task[None] | None = None
        self._rings: set[asyncio.Task[None]] = set()
        self._closing = False
        #: When the current outage began (monotonic), None while Redis answers.
        self.outage_since: float | None = None
        self._fault: redis_faults.Fault | None = None

    @property
    def followed(self) -> int:
        """Streams followed now."""
        return len(self._subs)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stream-hub")

    def end_all(self) -> None:
        """End every stream followed now and later (the gateway is going away): each reader
        gets :class:`GatewayClosing`."""
        self._closing = True
        self._fail_all(GatewayClosing("the gateway is shutting down"))

    async def close(self) -> None:
        for task in (self._task, *self._rings):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._reader.aclose()

    @asynccontextmanager
    async def follow(self, key: str, from_id: str = "0-0") -> AsyncIterator[Subscription]:
        """A subscription to stream ``key`` from entry ``from_id`` on, while the block runs."""
        sub = Subscription(key, from_id)
        if self._closing:
            sub.fail(GatewayClosing("the gateway is shutting down"))
        self._subs.setdefault(key, set()).add(sub)
        self._changed.set()
        if self._reading and not self._rung:
            self._rung = True
            ring = asyncio.create_task(self._ring())
            self._rings.add(ring)
            ring.add_done_callback(self._rings.discard)
        try:
            yield sub
        finally:
            subs = self._subs.get(key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[key]

    async def _ring(self) -> None:
        """Wake the blocked read (an entry on the wake stream it reads too)."""
        try:
            async with self._commands.pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.expire(self._wake_key, WAKE_TTL_SECONDS)
                await pipe.execute()
        except RedisError:  # unreachable or out of memory: the block times out instead
            pass

    async def _run(self) -> None:
        wait = _FIRST_WAIT
        while True:
            if not self._subs:
                self._changed.clear()
                await self._changed.wait()
                continue
            self._reading, self._rung = True, False
            streams = self._positions()
            try:
                reply = await self._reader.xread(streams, block=self._block_ms, count=COUNT)
            except Exception as exc:  # the hub never dies: its readers hear what happened
                self._reading = False
                fault = redis_faults.classify(exc)
                if fault is not None:
                    self._outage(fault, exc)
                    await asyncio.sleep(wait)
                    wait = min(wait * 2, _MAX_WAIT)
                    continue
                log.error("stream.read_failed", error_type=type(exc).__name__, error=str(exc),
                          streams=len(self._subs))
                self._fail_all(exc)
                await asyncio.sleep(wait)
                continue
            self._reading, wait = False, _FIRST_WAIT
            if self.outage_since is not None and self._fault is not None:
                down = time.monotonic() - self.outage_since
                log.info("redis.recovered", operation="stream.read", fault=str(self._fault),
                         down_seconds=round(down, 2))
                redis_faults.ended(self._fault, "stream.read", down)
                self.outage_since, self._fault = None, None
            self._deliver(reply, streams)

    def _positions(self) -> dict[Any, Any]:
        """Each followed stream from its furthest-behind subscriber, plus the wake stream."""
        streams: dict[Any, Any] = {}
        for key, subs in self._subs.items():
            live = [s for s in subs if not s.failed]
            if live:
                streams[key] = min(live, key=lambda s: s.position).last_id
        streams[self._wake_key] = self._wake_id
        return streams

    def _deliver(self, reply: object, streams: dict[Any, Any]) -> None:
        """Hand each subscriber the entries of its stream past its position; one that
        joined behind the position the read started from (while it was blocked) is left
        for the next read, which starts from it: these entries do not follow on from its."""
        if not isinstance(reply, list):
            return
        for raw_key, entries in reply:
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            if key == self._wake_key:
                last = entries[-1][0]
                self._wake_id = last.decode() if isinstance(last, bytes) else last
                continue
            read_from = stream_id(streams[key])
            for sub in list(self._subs.get(key, ())):
                if sub.position >= read_from:
                    sub.offer(entries)

    def _outage(self, fault: redis_faults.Fault, exc: BaseException) -> None:
        """Note the outage; fail the subscribers that have waited it out past the deadline."""
        now = time.monotonic()
        if self.outage_since is None:
            self.outage_since = now
        if fault is not self._fault:
            self._fault = fault
            log.warning("redis.unavailable", operation="stream.read", fault=str(fault),
                        error=str(exc), deadline_seconds=self.outage_seconds,
                        streams=len(self._subs))
            redis_faults.started(fault, "stream.read")
        for subs in self._subs.values():
            for sub in subs:
                waited = now - max(self.outage_since, sub.since)
                if not sub.failed and waited >= self.outage_seconds:
                    sub.fail(RedisOutage(
                        f"Redis unreachable for {waited:.0f} s while reading the stream "
                        f"(deadline {self.outage_seconds:g} s): {exc}"))

    def _fail_all(self, exc: BaseException) -> None:
        for subs in self._subs.values():
            for sub in subs:
                if not sub.failed:
                    sub.fail(exc)
