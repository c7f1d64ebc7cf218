"""A generation request whose model is coming waits in the gateway for a worker of it.

The wait is the client's (:class:`coordinator.waiting.WorkerWait`: the same deadline,
record and messages), run without holding a thread: each look runs in one, the sleeps
between them are asynchronous, so a burst of requests waiting for a fleet to scale from zero
holds no thread of the pool that serves submits. A non-streamed request answers once its
jobs are done, or with the 503 of a wait past ``SPECFLEET_WAIT_FOR_WORKER_SECONDS``; one
whose client hangs up stops waiting. A streamed one gets its headers at once, a comment
line saying what it waits for (then the usual keep-alives), and its events once a worker
came; a wait that ends without one ends the stream with the error event of that 503.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive

from coordinator.client import Coordinator
from coordinator.gateway.errors import APIError, from_redis, from_submit
from coordinator.gateway.streaming import until_disconnected
from coordinator.validation import SubmitError

T = TypeVar("T")


def waiting_line(model: str) -> bytes:
    """The comment a stream opens with while it waits (SSE decoders skip comments; a model
    name holds no line break)."""
    return f": waiting for a worker of model '{model}'\n".encode()


async def await_worker(coordinator: Coordinator, model: str) -> None:
    """Return once a worker of ``model`` is live (or it is no longer coming: the submit
    that follows says why); ``SubmitError`` (``wait_timeout``) past the deadline."""
    wait = coordinator.worker_wait(model, f"gateway-{uuid.uuid4().hex}")
    try:
        while await asyncio.to_thread(wait.coming):
            await asyncio.sleep(wait.interval)
    finally:
        await asyncio.to_thread(wait.close)


async def or_disconnect(work: Awaitable[T], receive: Receive) -> tuple[T] | None:
    """``(work's result,)``, or None when the client hung up first (``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(until_disconnected(receive))
    done, _ = await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    for pending in (task, hangup):
        if pending not in done:
            pending.cancel()
    if task not in done:
        await asyncio.wait({task})
        return None
    return (task.result(),)


async def stream_after_worker(
        coordinator: Coordinator, model: str, submit: Callable[[], list[str]],
        job_ids: list[str], events: Callable[[list[str]], AsyncIterator[dict[str, str]]],
        refused: Callable[[APIError], list[dict[str, str]]],
) -> AsyncIterator[dict[str, str] | bytes]:
    """A stream whose model is coming: :func:`waiting_line`, the wait, then ``submit``
    (its job ids go into ``job_ids``, which a hang-up cancels) and the ``events`` of its
    jobs; the events ``refused`` makes of the error when the wait or the submit fails."""
    yield waiting_line(model)
    try:
        await await_worker(coordinator, model)
        job_ids.extend(await asyncio.to_thread(submit))
    except SubmitError as exc:
        for event in refused(from_submit(exc)):
            yield event
        return
    except Exception as exc:  # noqa: BLE001  Redis away past its deadline: the client hears it
        for event in refused(from_redis(exc)):
            yield event
        return
    async for event in events(job_ids):
        yield event
