"""Reading a job's Redis Stream asynchronously, and turning it into OpenAI's SSE chunks.

The reading logic is the coordinator's own (:class:`coordinator.events.StreamCursor` for ids,
attempts and the end; :class:`coordinator.events.TextDeltas` for text handed out once), only
the I/O is async here. Each SSE event's ``id`` is the number of characters sent so far: a
client that lost its connection (or its gateway) reconnects to
``GET /v1/specfleet/streams/{completion id}`` with ``Last-Event-ID`` and receives exactly the
rest, because the stream is replayed from Redis and the text already seen is skipped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.types import Receive

from coordinator.events import StreamCursor, TextDeltas
from coordinator.gateway import schemas
from shared.keys import Keys
from shared.protocol import AnyEvent, FinalEvent, JobStatus
from shared.redis_client import COMMAND_RETRIES, HEALTH_CHECK_SECONDS, SOCKET_TIMEOUT
from shared.sentinel import async_sentinel_client, is_sentinel_url

#: How long one XREAD blocks; also how often a waiting reader notices it should stop.
BLOCK_MS = 500


def connect_async(url: str) -> aioredis.Redis:
    """An async client with the same retry and health-check policy as every other client
    (``shared.redis_client``), also for a ``redis+sentinel://`` URL."""
    options: dict[str, Any] = dict(
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), COMMAND_RETRIES),
        retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionResetError],
        socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT,
        socket_keepalive=True, health_check_interval=HEALTH_CHECK_SECONDS)
    if is_sentinel_url(url):
        return async_sentinel_client(url, **options)
    return aioredis.Redis.from_url(url, **options)


async def job_events(redis: aioredis.Redis, keys: Keys,
                     cursor: StreamCursor) -> AsyncIterator[AnyEvent]:
    """Every event of ``cursor``'s job from its position on, until the job's final event."""
    stream = keys.events(cursor.job_id)
    while not cursor.done:
        reply = await redis.xread({stream: cursor.last_id}, block=BLOCK_MS, count=256)
        for event in cursor.feed_reply(reply):
            yield event


async def final_event(redis: aioredis.Redis, keys: Keys, job_id: str) -> FinalEvent:
    """The job's final event (of its newest attempt)."""
    final: FinalEvent | None = None
    async for event in job_events(redis, keys, StreamCursor(job_id)):
        if isinstance(event, FinalEvent):
            final = event
    assert final is not None  # the cursor is done only at a final event
    return final


async def until_disconnected(receive: Receive) -> None:
    """Return when the client hangs up (ASGI ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def final_or_disconnect(redis: aioredis.Redis, keys: Keys, job_id: str,
                              receive: Receive,
                              ) -> FinalEvent | None:
    """The job's final event, or None when the client hung up first."""
    waiting = asyncio.create_task(final_event(redis, keys, job_id))
    hangup = asyncio.create_task(until_disconnected(receive))
    done, _ = await asyncio.wait({waiting, hangup}, return_when=asyncio.FIRST_COMPLETED)
    for task in (waiting, hangup):
        if task not in done:
            task.cancel()
    return waiting.result() if waiting in done else None


async def sse_chunks(redis: aioredis.Redis, keys: Keys, endpoint: str, job_id: str,
                     model: str, created: int, include_usage: bool,
                     shown: int = 0) -> AsyncIterator[dict[str, str]]:
    """SSE events (``id``/``data``) of one job in OpenAI's chunk shape, ending ``[DONE]``."""
    cursor = StreamCursor(job_id)
    deltas = TextDeltas(cursor, shown)

    def event(body: dict[str, Any]) -> dict[str, str]:
        return {"id": str(deltas.shown), "data": json.dumps(body, separators=(",", ":"))}

    if endpoint == schemas.CHAT and shown == 0:
        yield event(schemas.chunk(endpoint, job_id, model, created, role=True, text=""))
    offset = shown  # completions' text_offset: the characters of the tokens before
    async for ev in job_events(redis, keys, cursor):
        delta = deltas.feed(ev)
        if delta or deltas.logprobs:  # a token may hold part of a character: no text yet
            yield event(schemas.chunk(endpoint, job_id, model, created, text=delta,
                                      logprobs=deltas.logprobs or None, offset=offset))
            offset += sum(len(lp.text) for lp in deltas.logprobs)
        if isinstance(ev, FinalEvent) and cursor.done:
            if ev.status is JobStatus.FAILED:
                yield event({"error": {"message": ev.error or "the job failed",
                                       "type": "server_error", "param": None,
                                       "code": "job_failed"}})
                break
            yield event(schemas.chunk(endpoint, job_id, model, created, final=ev))
            if include_usage:
                yield event(schemas.chunk(endpoint, job_id, model, created, usage_only=ev))
    yield {"data": "[DONE]"}
