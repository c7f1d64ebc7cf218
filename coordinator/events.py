"""Reading a job's event stream: replay from the Stream, then follow it live.

``XREAD`` from the last seen id means a reader that starts late, or reconnects after a Redis
outage, misses nothing that is still in the stream; the per-job pub/sub channel is only for
live dashboards. :class:`StreamCursor` is the reading logic without I/O (ids, attempts, the
end of the stream, gaps), so the synchronous :func:`follow` here and an asynchronous reader
(the HTTP gateway) share it.

Every event carries ``seq``, gap-free across attempts from 1. A stream trimmed by
``SPECFLEET_STREAM_MAXLEN`` before a reader got to it shows as a jump in ``seq``: the cursor
records it in ``gaps`` (and logs ``stream.gap``) instead of pretending nothing was lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

from redis import Redis

from shared.keys import STREAM_FIELD, Keys
from shared.logs import get_logger
from shared.outage import ride_out
from shared.protocol import AnyEvent, FinalEvent, TokenEvent, TokenLogprob, parse_event

_FIELD = STREAM_FIELD.encode()

log = get_logger("stream")


class StreamCursor:
    """Position in one job's stream and what has been learnt from reading it."""

    def __init__(self, job_id: str, from_id: str = "0-0") -> None:
        self.job_id = job_id
        self.last_id = from_id
        self.newest_attempt = 0
        #: Inclusive ``(first, last)`` ranges of ``seq`` that were never read.
        self.gaps: list[tuple[int, int]] = []
        self.done = False
        self._next_seq: int | None = 1 if from_id == "0-0" else None

    def feed(self, entries: Sequence[tuple[Any, dict[Any, Any]]]) -> list[AnyEvent]:
        """Events of raw ``XREAD`` entries, up to and including the job's last final event.

        A final event ends the stream only if no later attempt has started meanwhile (a
        stalled worker's stale final is passed on but does not end it).
        """
        events: list[AnyEvent] = []
        for entry_id, fields in entries:
            self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            event = parse_event(fields.get(_FIELD, b"") or fields.get(STREAM_FIELD, ""))
            self._check_seq(event.seq)
            self.newest_attempt = max(self.newest_attempt, event.attempt)
            events.append(event)
            if isinstance(event, FinalEvent) and event.attempt >= self.newest_attempt:
                self.done = True
                break
        return events

    def feed_reply(self, reply: object) -> list[AnyEvent]:
        """:meth:`feed` over a whole ``XREAD`` reply (a list of ``[stream, entries]``; None
        or an empty list when the read timed out)."""
        if not isinstance(reply, list):
            return []
        return [event for _, entries in reply for event in self.feed(entries)]

    def _check_seq(self, seq: int) -> None:
        if self._next_seq is not None and seq > self._next_seq:
            self.gaps.append((self._next_seq, seq - 1))
            log.warning("stream.gap", job_id=self.job_id, missing_from=self._next_seq,
                        missing_to=seq - 1)
        self._next_seq = max(self._next_seq or 0, seq + 1)


def follow(connection: Redis, keys: Keys, job_id: str, *, from_id: str = "0-0",
           timeout: float | None = None, block_ms: int = 500, outage_seconds: float = 300.0,
           cursor: StreamCursor | None = None) -> Iterator[AnyEvent]:
    """Yield every event of a job, across attempts, until its final event.

    Raises ``TimeoutError`` after ``timeout`` seconds without reaching the end; rides out a
    Redis outage of up to ``outage_seconds`` (then ``RedisOutage``), resuming from the last
    entry it read. Pass a ``cursor`` to inspect ``gaps`` afterwards.
    """
    stream = keys.events(job_id)
    cursor = cursor or StreamCursor(job_id, from_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not cursor.done:
        wait_ms = block_ms
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
            wait_ms = max(1, min(block_ms, int(left * 1000)))
        reply = ride_out(partial(connection.xread, {stream: cursor.last_id}, block=wait_ms,
                                 count=256), outage_seconds, "stream.read")
        yield from cursor.feed_reply(reply)


class TextDeltas:
    """A job's generated text from its events, each character handed out once.

    A re-run after a crash repeats the same tokens, so only text beyond what was already
    handed out is new; a token event appended twice (a write retried through a Redis outage)
    is recognised by its ``index`` and skipped; once the cursor has seen a gap (a trimmed
    stream) token events are no longer trusted and the newest attempt's final event, which
    carries the whole text, completes it. ``shown`` may start above 0: a reader resuming a
    stream that its client had already read that far (the HTTP gateway's ``Last-Event-ID``).
    """

    def __init__(self, cursor: StreamCursor, shown: int = 0) -> None:
        self.cursor = cursor
        self.shown = shown
        #: The logprobs of the tokens the last :meth:`feed` brought (a request that asked
        #: for them): each token's handed out once too, by its position.
        self.logprobs: list[TokenLogprob] = []
        self._resumed_at = shown
        self._chars: dict[int, int] = {}  # characters of each attempt's text so far
        self._tokens: dict[int, int] = {}
        self._logprobs_shown = 0  # tokens whose logprobs were handed out (same seed: same)
        self._newest = 0

    def feed(self, event: AnyEvent) -> str:
        """The new text ``event`` brings (often ``""``); its new logprobs in ``logprobs``."""
        self._newest = max(self._newest, event.attempt)
        self.logprobs = []
        if isinstance(event, TokenEvent) and not self.cursor.gaps:
            if event.index < self._tokens.get(event.attempt, 0):
                return ""
            self._tokens[event.attempt] = event.index + len(event.tokens)
            end = self._chars.get(event.attempt, 0) + len(event.text)
            self._chars[event.attempt] = end
            if self._resumed_at and end <= self._resumed_at:  # the client has had these
                self._logprobs_shown = max(self._logprobs_shown,
                                           event.index + len(event.tokens))
            else:
                self._take_logprobs(event.logprobs, event.index)
            return self._beyond(event.text, end)
        if isinstance(event, FinalEvent) and event.attempt >= self._newest:
            self._take_logprobs(event.logprobs, 0)
            return self._beyond(event.text, len(event.text))
        return ""

    def _take_logprobs(self, logprobs: list[TokenLogprob] | None, index: int) -> None:
        """Those of ``logprobs`` (the tokens from ``index`` on) not handed out yet."""
        if not logprobs:
            return
        self.logprobs = logprobs[max(0, self._logprobs_shown - index):]
        self._logprobs_shown = max(self._logprobs_shown, index + len(logprobs))

    def _beyond(self, piece: str, end: int) -> str:
        """The part of ``piece`` (which ends at character ``end``) not handed out yet; only
        lengths are kept, so a long stream costs no memory."""
        if end <= self.shown:
            return ""
        delta = piece[max(0, len(piece) - (end - self.shown)):]
        self.shown = end
        return delta
