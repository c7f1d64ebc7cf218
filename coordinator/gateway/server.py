"""The HTTP server around the gateway app: a header deadline, a drain on SIGTERM, exit 0.

uvicorn bounds only the idle time between requests of a keep-alive connection, so a client
that trickles its headers a byte at a time held a socket for as long as it liked (200 of them
for 35 s and more); :func:`protocol` closes a connection that has not sent a request's headers
``header_seconds`` after it opened or after its previous response. (The body has its own
deadline, ``app.BodyLimit``.)

On SIGTERM or SIGINT the server stops accepting and lets open requests and streams run on for
``drain_seconds``; streams still open then end with an OpenAI-shaped error event
(``gateway_shutdown``: the job goes on, and the stream resumes from another gateway with
``Last-Event-ID``), not a cut, and the process exits 0 (uvicorn re-raised the signal after its
shutdown: exit 143). sse-starlette's own shutdown handling, which cut every stream at the
signal, is switched off.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from sse_starlette.sse import AppStatus
from uvicorn.protocols.http.h11_impl import H11Protocol

from shared.logs import get_logger

log = get_logger("gateway")

#: Seconds the server waits past the drain for the streams' last events to be sent.
CLOSE_GRACE_SECONDS = 2.0


class _HeaderDeadline(H11Protocol):
    """h11's protocol with a deadline for a request's headers (``header_seconds``)."""

    header_seconds = 10.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and not self._idle():
            self._header_timer.cancel()  # a request's headers are in
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _idle(self) -> bool:
        """No request in progress: waiting for (the rest of) a request's headers."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._idle() and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_seconds, self._expired)

    def _expired(self) -> None:
        self._header_timer = None
        if self._idle() and not self.transport.is_closing():
            log.warning("gateway.header_timeout", peer=str(self.client),
                        seconds=self.header_seconds)
            self.transport.close()


def protocol(header_seconds: float) -> type[H11Protocol]:
    """The HTTP protocol class with a header deadline of ``header_seconds``."""
    return type("HeaderDeadlineProtocol", (_HeaderDeadline,), {"header_seconds": header_seconds})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining for ``drain_seconds`` on SIGTERM/SIGINT (then calling
    ``at_deadline`` so the streams still open end with an event) and returning normally
    instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, drain_seconds: float,
                 at_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self.at_deadline = at_deadline
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self._loop is not None:  # no logging in a signal handler: in the loop
            self._loop.call_soon_threadsafe(self._draining, sig)

    def _draining(self, sig: int) -> None:
        log.info("gateway.draining", signal=signal.Signals(sig).name,
                 drain_seconds=self.drain_seconds)
        asyncio.get_running_loop().call_later(self.drain_seconds, self.at_deadline)


def run(app: FastAPI, host: str, port: int, header_seconds: float,
        drain_seconds: float) -> None:
    """Serve ``app`` until SIGTERM/SIGINT, then drain and return."""
    AppStatus.disable_automatic_graceful_drain()  # streams end by our drain, not at the signal

    def end_streams() -> None:
        hub = getattr(app.state, "hub", None)
        if hub is not None:
            log.warning("gateway.drain_deadline", streams=hub.followed)
            hub.end_all()

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            http=protocol(header_seconds),
                            timeout_graceful_shutdown=int(drain_seconds + CLOSE_GRACE_SECONDS))
    DrainingServer(config, drain_seconds, end_streams).run()
    log.info("gateway.stopped")
