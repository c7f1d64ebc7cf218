"""Token events: the first delivery is streamed at once (time to first token), later ones are
grouped so a fast engine does not pay one Redis round trip per token."""

from __future__ import annotations

from redis import Redis

from shared.event_stream import EventWriter
from shared.settings import Settings
from worker.service.events import TokenChunker


def test_the_first_token_is_sent_at_once_then_tokens_are_grouped(settings: Settings) -> None:
    connection = Redis.from_url(settings.redis_url)
    events = settings.keys.events("chunk-job")
    chunker = TokenChunker(EventWriter.for_job(connection, settings, "chunk-job", 1),
                           chunk=4, flush_seconds=60)
    chunker.add([1], "a")
    assert connection.xlen(events) == 1, "the first token waited for company"
    for t in range(2, 5):
        chunker.add([t], "b")
    assert connection.xlen(events) == 1, "later tokens were not grouped"
    chunker.add([5], "c")
    assert connection.xlen(events) == 2


def test_a_deferred_chunker_sends_a_due_chunk_only_when_asked(settings: Settings) -> None:
    """Where the engine overlaps host work with the device's decode, a due chunk waits for
    ``flush_due`` (called while the next step decodes); the first delivery still goes out at
    once, nothing that is not due is sent early, and ``flush`` sends everything."""
    connection = Redis.from_url(settings.redis_url)
    events = settings.keys.events("deferred-job")
    chunker = TokenChunker(EventWriter.for_job(connection, settings, "deferred-job", 1),
                           chunk=2, flush_seconds=60, deferred=True)
    chunker.add([1], "a")
    assert connection.xlen(events) == 1, "the first token waited"
    chunker.add([2], "b")
    chunker.flush_due()
    assert connection.xlen(events) == 1, "a chunk that was not due went out"
    chunker.add([3], "c")
    assert connection.xlen(events) == 1, "a due chunk went out from add"
    chunker.flush_due()
    assert connection.xlen(events) == 2
    chunker.flush_due()
    assert connection.xlen(events) == 2, "flush_due sent a chunk twice"
    chunker.add([4], "d")
    chunker.flush()
    assert connection.xlen(events) == 3
