"""Reading jobs' Redis Streams asynchronously, and turning them into OpenAI's SSE.

The reading logic is the coordinator's own (:class:`coordinator.events.StreamCursor` for ids,
attempts and the end; :class:`coordinator.events.TextDeltas` for text handed out once), only
the I/O is async here. A request of several choices reads its jobs side by side and
interleaves their chunks. A one-choice stream numbers its events: each SSE ``id`` is the
number of characters sent so far, and a client that lost its connection (or its gateway)
reconnects to ``GET /v1/specfleet/streams/{completion id}`` with ``Last-Event-ID`` and receives
exactly the rest, because the stream is replayed from Redis and the text already seen is
skipped.

Keep-alives are a bare comment line (``: ping`` and one newline; ``: waiting for redis``
while the stream hub waits out an outage), never followed by the blank line that ends an
event: SSE decoders that keep the last ``id`` (the OpenAI SDKs', and so langchain's and
litellm's) dispatch an empty event at every blank line, and parsing its empty data as JSON
killed their streams behind busy slots.

Every read goes through the gateway's :class:`coordinator.gateway.hub.StreamHub` (one
connection for all streams), and a stream that cannot go on (Redis gone past
``redis_outage_seconds``, or anything unexpected) ends with an OpenAI-shaped error event, never
with a body that just stops.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive

from coordinator.events import StreamCursor, TextDeltas
from coordinator.gateway.errors import from_job
from coordinator.gateway.hub import GatewayClosing, StreamHub
from coordinator.openai_api import replies
from coordinator.openai_api.requests import Parsed
from coordinator.openai_api.responses import EventSequence
from shared import redis_faults
from shared.keys import Keys
from shared.logs import get_logger
from shared.outage import RedisOutage
from shared.protocol import (
    AnyEvent,
    ErrorEvent,
    FinalEvent,
    JobStatus,
    ProgressEvent,
    TokenEvent,
    TokenLogprob,
)

#: A keep-alive: a comment line that no decoder turns into an event (see the module doc).
KEEPALIVE = b": ping\n"
#: The keep-alive while Redis is unreachable: the client sees that the stream waits.
WAITING = b": waiting for redis\n"
log = get_logger("gateway")


async def job_events(hub: StreamHub, keys: Keys,
                     cursor: StreamCursor) -> AsyncGenerator[AnyEvent, None]:
    """Every event of ``cursor``'s job from its position on, until the job's final event
    (``RedisOutage`` once Redis has been away past the hub's deadline). A reader that stops
    early closes it (``aclosing``), which ends its subscription."""
    async with hub.follow(keys.events(cursor.job_id), cursor.last_id) as subscription:
        while not cursor.done:
            for event in cursor.feed(await subscription.next()):
                yield event


@dataclass(frozen=True)
class Ending:
    """How a job ended: its final event, and the type of the error that failed it (the
    worker's refusal reason, ``context`` for a prompt too long for its context)."""

    final: FinalEvent
    error_type: str | None = None
    #: The request field the error names (a worker's rejection of it), where it names one.
    param: str | None = None


class Endings:
    """Reads a job's events for its endings: an error event comes before the final event it
    explains, so the final's :class:`Ending` carries the last error's type."""

    def __init__(self) -> None:
        self._error: ErrorEvent | None = None

    def see(self, event: AnyEvent) -> Ending | None:
        """The ending ``event`` is (a final event), else None."""
        if isinstance(event, ErrorEvent):
            self._error = event
        elif isinstance(event, FinalEvent):
            error = self._error
            return Ending(event, error.error_type if error else None,
                          error.param if error else None)
        return None


async def job_ending(hub: StreamHub, keys: Keys, job_id: str) -> Ending:
    """The job's final event (of its newest attempt) and its error's type."""
    ending, endings = None, Endings()
    async with aclosing(job_events(hub, keys, StreamCursor(job_id))) as events:
        async for event in events:
            ending = endings.see(event) or ending
    assert ending is not None  # the cursor is done only at a final event
    return ending


async def refusal(hub: StreamHub, keys: Keys, job_id: str,
                  seconds: float) -> Ending | None:
    """The ending of a job refused when a worker took it (a prompt too long for its context,
    which only the worker can count), if that happens within ``seconds``; None once the job
    generates, or still waits. A stream waits this long before its headers, so a refused
    request is answered with its status instead of a 200 whose stream ends in an error."""
    async def watch() -> Ending | None:
        endings = Endings()
        async with aclosing(job_events(hub, keys, StreamCursor(job_id))) as events:
            async for event in events:
                if (ending := endings.see(event)) is not None:
                    return ending
                if isinstance(event, TokenEvent) or (isinstance(event, ProgressEvent)
                                                     and event.stage == "generating"):
                    return None
        return None

    try:
        return await asyncio.wait_for(watch(), seconds)
    except TimeoutError:
        return None


async def until_disconnected(receive: Receive) -> None:
    """Return when the client hangs up (ASGI ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def endings_or_disconnect(hub: StreamHub, keys: Keys, job_ids: Sequence[str],
                                receive: Receive) -> list[Ending] | None:
    """Every job's ending, in order, or None when the client hung up first."""
    async def all_endings() -> list[Ending]:
        return list(await asyncio.gather(*(job_ending(hub, keys, j) for j in job_ids)))

    waiting = asyncio.create_task(all_endings())
    hangup = asyncio.create_task(until_disconnected(receive))
    done, _ = await asyncio.wait({waiting, hangup}, return_when=asyncio.FIRST_COMPLETED)
    for task in (waiting, hangup):
        if task not in done:
            task.cancel()
    return waiting.result() if waiting in done else None


@dataclass(frozen=True)
class Piece:
    """What one job's stream brings a client: new text of choice ``index`` (with its tokens'
    logprobs; ``offset`` characters came before it, ``shown`` after it), or its ending."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None
    offset: int
    shown: int
    ending: Ending | None = None


async def choice_pieces(hub: StreamHub, keys: Keys, job_id: str, index: int,
                        shown: int = 0) -> AsyncGenerator[Piece, None]:
    """The pieces of one job from character ``shown`` on, the last one its ending."""
    cursor = StreamCursor(job_id)
    deltas = TextDeltas(cursor, shown)
    offset = shown  # completions' text_offset: the characters of the tokens before
    endings = Endings()
    async with aclosing(job_events(hub, keys, cursor)) as events:
        async for ev in events:
            ending = endings.see(ev)
            delta = deltas.feed(ev)
            if delta or deltas.logprobs:  # a token may hold part of a character: no text yet
                yield Piece(index, delta, deltas.logprobs or None, offset, deltas.shown)
                offset += sum(len(lp.text) for lp in deltas.logprobs)
            if ending is not None and cursor.done:
                yield Piece(index, "", None, offset, deltas.shown, ending)


async def merged(streams: Sequence[AsyncGenerator[Piece, None]]
                 ) -> AsyncGenerator[Piece, None]:
    """The pieces of several jobs as they come (each job's in its own order)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for piece in only:
                yield piece
        return
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[Piece, None]) -> None:
        try:
            async for piece in stream:
                await queue.put(piece)
            await queue.put(None)
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def with_keepalive(events: AsyncIterator[dict[str, str] | bytes], seconds: float,
                         hub: StreamHub) -> AsyncIterator[dict[str, str] | bytes]:
    """``events`` (SSE events, or comment lines already encoded), with a :data:`KEEPALIVE`
    line whenever none came for ``seconds`` (:data:`WAITING` while ``hub`` waits out a
    Redis outage)."""
    iterator = events.__aiter__()
    pending: asyncio.Future[dict[str, str] | bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=seconds)
            if not done:
                yield KEEPALIVE if hub.outage_since is None else WAITING
                continue
            pending = None
            try:
                event = done.pop().result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:  # a hang-up while the next event is awaited
            pending.cancel()
            # The generator runs until that cancel lands; closing it before is a RuntimeError
            # ("asynchronous generator is already running") and leaves it unclosed.
            await asyncio.wait({pending})
            if not pending.cancelled() and pending.exception() is not None:
                log.debug("gateway.stream_closed_with", error=repr(pending.exception()))
        await iterator.aclose()  # type: ignore[attr-defined]


def interrupted(exc: Exception, job_ids: Sequence[str]) -> dict[str, Any]:
    """The error body of a stream the gateway cannot go on with (in a stream, after which it
    ends): the gateway shutting down past its drain (``gateway_shutdown``), Redis away past
    the outage deadline (``redis_unavailable``); in both the jobs go on, and a one-choice
    stream can be resumed from its last ``id``. Or anything unexpected (``stream_failed``)."""
    if isinstance(exc, GatewayClosing):
        log.info("gateway.stream_interrupted", job_ids=list(job_ids), reason="shutdown")
        message, code = ("the gateway is shutting down; the job goes on: resume the stream "
                         "from another gateway (GET /v1/specfleet/streams/{id} with "
                         "Last-Event-ID)"), "gateway_shutdown"
    elif isinstance(exc, RedisOutage) or redis_faults.classify(exc) is not None:
        log.warning("gateway.stream_interrupted", job_ids=list(job_ids), reason="redis",
                    error=str(exc))
        message, code = (f"the gateway lost Redis and gave up waiting: {exc}",
                         "redis_unavailable")
    else:
        log.error("gateway.stream_interrupted", job_ids=list(job_ids),
                  error_type=type(exc).__name__, error=str(exc))
        message, code = f"the stream failed ({type(exc).__name__})", "stream_failed"
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": code}}


def failure(ending: Ending) -> dict[str, Any]:
    """The error body of a failed job (in a stream, after which it ends): the one a
    non-streamed request gets (``errors.from_job``)."""
    return from_job(ending.final.error, ending.error_type, ending.param).body()


async def completion_sse(hub: StreamHub, keys: Keys, parsed: Parsed,
                         job_ids: Sequence[str], created: int,
                         shown: int = 0) -> AsyncIterator[dict[str, str]]:
    """SSE events (``id``/``data``) of a request's jobs in OpenAI's chunk shape, ending
    ``[DONE]`` (after an error event when a job failed or the stream could not go on); ids
    (characters sent) only when there is one choice."""
    endpoint = parsed.endpoint
    completion = replies.completion_id(endpoint, job_ids[0])
    single = len(job_ids) == 1

    def event(body: dict[str, Any], sent: int) -> dict[str, str]:
        data = {"data": json.dumps(body, separators=(",", ":"))}
        return {"id": str(sent), **data} if single else data

    # each choice's chunks (text, or tool calls read from it) are shaped by openai_api
    choices = [replies.ChoiceStream(parsed, i, completion, created, job_id, shown)
               for i, job_id in enumerate(job_ids)]
    for choice in choices:
        if (opening := choice.opening()) is not None:
            yield event(opening, 0)
    finals: dict[int, FinalEvent] = {}
    sent = shown
    streams = [choice_pieces(hub, keys, job_id, i, choices[i].read_from)
               for i, job_id in enumerate(job_ids)]
    try:
        async with aclosing(merged(streams)) as pieces:
            async for piece in pieces:
                sent = piece.shown
                if piece.ending is None:
                    body = choices[piece.index].text(piece.text, piece.logprobs, piece.offset,
                                                     piece.shown)
                    if body is not None:
                        yield event(body, piece.shown)
                    continue
                if piece.ending.final.status is JobStatus.FAILED:
                    yield event(failure(piece.ending), piece.shown)
                    break
                finals[piece.index] = piece.ending.final
                yield event(choices[piece.index].closing(piece.ending.final), piece.shown)
            else:
                if parsed.include_usage:
                    ordered = [finals[i] for i in range(len(job_ids))]
                    yield event(replies.usage_chunk(parsed, completion, created, ordered), sent)
    except Exception as exc:  # noqa: BLE001  the client hears why its stream ends
        yield event(interrupted(exc, job_ids), sent)
    yield {"data": "[DONE]"}


async def responses_sse(hub: StreamHub, keys: Keys, sequence: EventSequence,
                        ) -> AsyncIterator[dict[str, str]]:
    """The Responses API's typed events of one job (``event:`` names the type); a stream
    that cannot go on ends with an ``error`` event."""
    def event(body: dict[str, Any]) -> dict[str, str]:
        return {"event": body["type"], "data": json.dumps(body, separators=(",", ":"))}

    for body in sequence.opening():
        yield event(body)
    try:
        async with aclosing(choice_pieces(hub, keys, sequence.job_id, 0)) as pieces:
            async for piece in pieces:
                if piece.ending is None:
                    for body in sequence.delta(piece.text):
                        yield event(body)
                else:
                    for body in sequence.closing(piece.ending.final):
                        yield event(body)
    except Exception as exc:  # noqa: BLE001  the client hears why its stream ends
        error = interrupted(exc, [sequence.job_id])["error"]
        yield event({"type": "error", "sequence_number": sequence.number,
                     "code": error["code"], "message": error["message"], "param": None})
