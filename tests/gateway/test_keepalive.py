"""The SSE keep-alive wrapper closes the stream it wraps cleanly when the client hangs up
while the next event is still awaited (the soak's ``aclose(): asynchronous generator is
already running`` on every SSE hang-up)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from coordinator.gateway.streaming import KEEPALIVE, with_keepalive


def test_a_hang_up_while_an_event_is_awaited_closes_the_wrapped_stream() -> None:
    closed: list[str] = []

    async def events() -> AsyncIterator[dict[str, str]]:
        try:
            yield {"data": "first"}
            await asyncio.sleep(3600)  # the job's next token, far away
            yield {"data": "never"}
        finally:
            closed.append("events")

    async def client() -> list[Any]:
        hub: Any = SimpleNamespace(outage_since=None)
        stream = with_keepalive(events(), 0.01, hub)
        seen = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()  # the client hangs up during the wait
        return seen

    seen = asyncio.run(client())
    assert seen == [{"data": "first"}, KEEPALIVE]
    assert closed == ["events"]
