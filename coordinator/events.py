"""Reading a job's event stream: replay from the Stream, then follow it live.

``XREAD`` from the last seen id means a reader that starts late, or reconnects, misses
nothing; the per-job pub/sub channel is only for live dashboards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from redis import Redis

from shared.keys import Keys
from shared.protocol import AnyEvent, FinalEvent, parse_event
from worker.service.events import STREAM_FIELD

_FIELD = STREAM_FIELD.encode()


def follow(connection: Redis, keys: Keys, job_id: str, *, from_id: str = "0-0",
           timeout: float | None = None, block_ms: int = 500) -> Iterator[AnyEvent]:
    """Yield every event of a job, across attempts, until its final event.

    A final event ends the stream only if no later attempt has started meanwhile (a stalled
    worker's stale final is skipped). Raises ``TimeoutError`` after ``timeout`` seconds
    without reaching the end.
    """
    stream = keys.events(job_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    last_id = from_id
    newest_attempt = 0
    while True:
        wait_ms = block_ms
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
            wait_ms = max(1, min(block_ms, int(left * 1000)))
        reply = connection.xread({stream: last_id}, block=wait_ms, count=256)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                event = parse_event(fields.get(_FIELD, b"") or fields.get(STREAM_FIELD, ""))
                newest_attempt = max(newest_attempt, event.attempt)
                yield event
                if isinstance(event, FinalEvent) and event.attempt >= newest_attempt:
                    return
