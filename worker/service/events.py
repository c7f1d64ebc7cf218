"""Per-job event streaming: a bounded, expiring Redis Stream plus a pub/sub channel.

The Stream is the durable record (a reader that arrives late or reconnects replays it with
``XREAD`` from its last id); pub/sub is only live fan-out for dashboards, because pub/sub is
at-most-once. Every event carries the job id, the attempt and a sequence number shared by all
attempts of the job, so a reader can order and de-duplicate across a crash and a re-run.
"""

from __future__ import annotations

import time
from typing import Any

from redis import Redis

from shared.keys import Keys
from shared.protocol import (
    AnyEvent,
    ErrorEvent,
    FinalEvent,
    ProgressEvent,
    TelemetryEvent,
    TokenEvent,
)

_EVENT_TYPES: dict[str, type[AnyEvent]] = {
    "token": TokenEvent,
    "telemetry": TelemetryEvent,
    "progress": ProgressEvent,
    "error": ErrorEvent,
    "final": FinalEvent,
}

#: Field name of the JSON payload inside each Stream entry.
STREAM_FIELD = "event"


class EventWriter:
    """Writes one attempt's events of one job (XADD MAXLEN ~N + EXPIRE, then PUBLISH)."""

    def __init__(
        self,
        connection: Redis,
        keys: Keys,
        job_id: str,
        attempt: int,
        *,
        maxlen: int = 10000,
        ttl_seconds: int = 86400,
    ) -> None:
        self._conn = connection
        self._keys = keys
        self.job_id = job_id
        self.attempt = attempt
        self._maxlen = maxlen
        self._ttl = ttl_seconds

    def emit(self, event_type: str, **fields: Any) -> AnyEvent:
        """Build, number and write one event; returns it as sent."""
        seq = int(self._conn.incr(self._keys.seq(self.job_id)))
        event = _EVENT_TYPES[event_type](job_id=self.job_id, attempt=self.attempt, seq=seq,
                                         **fields)
        payload = event.model_dump_json()
        stream = self._keys.events(self.job_id)
        pipe = self._conn.pipeline(transaction=False)
        pipe.xadd(stream, {STREAM_FIELD: payload}, maxlen=self._maxlen, approximate=True)
        pipe.expire(stream, self._ttl)
        pipe.expire(self._keys.seq(self.job_id), self._ttl)
        pipe.publish(self._keys.channel(self.job_id), payload)
        pipe.execute()
        return event

    def progress(self, stage: str, **fields: Any) -> AnyEvent:
        return self.emit("progress", stage=stage, **fields)

    def error(self, message: str, error_type: str, retryable: bool = False) -> AnyEvent:
        return self.emit("error", message=message, error_type=error_type, retryable=retryable)

    def final(self, **fields: Any) -> AnyEvent:
        return self.emit("final", **fields)


class TokenChunker:
    """Groups the engine's committed tokens into small token events.

    A chunk is sent once it holds ``chunk`` tokens or has waited ``flush_seconds``, so a fast
    engine does not pay one Redis round trip per token and a slow one still streams live.
    Text deltas are never split: a chunk carries whole ``on_tokens`` deliveries.
    """

    def __init__(self, writer: EventWriter, chunk: int = 8, flush_seconds: float = 0.05) -> None:
        self._writer = writer
        self._chunk = chunk
        self._flush_seconds = flush_seconds
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._index = 0
        self._since = time.monotonic()

    def add(self, tokens: list[int], text: str) -> None:
        """The engine's ``on_tokens`` callback."""
        if not self._tokens:
            self._since = time.monotonic()
        self._tokens.extend(tokens)
        self._text.append(text)
        if (len(self._tokens) >= self._chunk
                or time.monotonic() - self._since >= self._flush_seconds):
            self.flush()

    def flush(self) -> None:
        """Send whatever is buffered (called at the end of a generation too)."""
        if not self._tokens:
            return
        self._writer.emit("token", tokens=self._tokens, text="".join(self._text),
                          index=self._index)
        self._index += len(self._tokens)
        self._tokens = []
        self._text = []
