"""The worker's SIGTERM/SIGINT handler never waits on the log stream.

A Python signal handler runs between two bytecodes of the main thread, which may be inside a
log write holding the stream's lock (a plain, non-reentrant ``threading.Lock`` in structlog's
PrintLogger). A handler that logs then waits on that lock forever: a worker that never drained
on SIGTERM (tests/service/test_slots.py, under load). Here the stream's write is held shut
from outside, as the main thread's own write held it; the handler must return regardless,
and the serving loop logs the signal once the stream is free.
"""

from __future__ import annotations

import io
import signal
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from shared.logs import configure_logging
from worker.service.loop import ServingLoop


class HeldStream(io.StringIO):
    """A log stream whose writes wait until ``free`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.free = threading.Event()

    def write(self, text: str) -> int:
        self.free.wait()
        return super().write(text)


@pytest.fixture
def stream() -> Iterator[HeldStream]:
    held = HeldStream()
    configure_logging("info", "json", stream=held)
    try:
        yield held
    finally:
        held.free.set()
        configure_logging()  # back to the default (stderr) for whatever runs next


def _loop() -> ServingLoop:
    runtime: Any = SimpleNamespace(worker_name="w1", interrupt=threading.Event())
    return ServingLoop(runtime, intake=None, prefixes=None)  # type: ignore[arg-type]


def _handled(loop: ServingLoop, signum: int) -> bool:
    """Run the handler in a thread; whether it returned within two seconds."""
    handler = threading.Thread(target=loop.request_stop, args=(signum, None), daemon=True)
    handler.start()
    handler.join(timeout=2)
    return not handler.is_alive()


def test_the_stop_handler_returns_while_the_log_stream_is_busy(stream: HeldStream) -> None:
    loop = _loop()
    assert _handled(loop, signal.SIGTERM)
    assert loop.stopping.is_set() and not loop.runtime.interrupt.is_set()
    loop._running[0] = SimpleNamespace(job=SimpleNamespace(id="j1"))  # type: ignore[assignment]
    assert _handled(loop, signal.SIGTERM)
    assert loop.runtime.interrupt.is_set()
    assert stream.getvalue() == ""
    stream.free.set()
    loop._log_signals()
    events = stream.getvalue()
    assert '"event": "worker.stopping"' in events
    assert '"event": "worker.interrupting"' in events and '"jobs": ["j1"]' in events
