"""ChannelListener on a real Redis: messages arrive, a close is prompt and never closes the
listener's connection under it, and a restarted Redis is listened to again."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis._parsers.resp3 import _RESP3Parser
from redis.connection import Connection

from shared import redis_faults
from shared.redis_client import connect
from shared.settings import Settings
from worker.service.channels import ChannelListener, Message

from .private_redis import RedisServer

#: How long the restart test keeps Redis down.
OUTAGE_SECONDS = 6.0


def _channel() -> str:
    return f"t{uuid.uuid4().hex[:12]}:listener"


def test_channel_and_pattern_messages_arrive_and_a_failing_handler_does_not_end_it(
        settings: Settings) -> None:
    conn = connect(settings.redis_url)
    channel = _channel()
    heard: queue.Queue[Message] = queue.Queue()

    def on_message(message: Message) -> None:
        if message["data"] == b"boom":
            raise ValueError("a payload the handler refuses")
        heard.put(message)

    listener = ChannelListener(conn, "test", on_message, channels=[channel],
                               patterns=[f"{channel}:*"])
    try:
        # subscribed before the constructor returned: nothing published now is missed
        assert conn.publish(channel, b"boom") == 1
        conn.publish(channel, b"one")
        conn.publish(f"{channel}:x", b"two")
        got = [heard.get(timeout=5), heard.get(timeout=5)]
        assert [(m["type"], m["data"]) for m in got] == [("message", b"one"), ("pmessage", b"two")]
    finally:
        assert listener.close() is True
    assert conn.pubsub_numsub(channel) == [(channel.encode(), 0)]


def test_a_close_is_prompt_even_while_the_listener_waits(settings: Settings) -> None:
    conn = connect(settings.redis_url)
    listener = ChannelListener(conn, "test", lambda message: None, channels=[_channel()],
                               poll_seconds=0.5)
    time.sleep(0.2)  # inside a read
    started = time.monotonic()
    assert listener.close(timeout=10) is True
    # a stop is seen at the end of the current poll, not a 60 s one (rq's listener)
    assert time.monotonic() - started < 5


def test_a_close_that_times_out_leaves_the_connection_to_the_listener(
        settings: Settings) -> None:
    """A close that gives up waiting must not close the connection under a listener still
    inside its read (rq did: it closed the PubSub from the caller after a 1 s join of a
    60 s read, so the pool could get back a connection that thread still used). The
    subscription lives until the listener itself ends its read and closes it."""
    conn = connect(settings.redis_url)
    channel = _channel()
    listener = ChannelListener(conn, "test", lambda message: None, channels=[channel],
                               poll_seconds=2.0)
    time.sleep(0.2)  # inside a 2 s read
    assert listener.close(timeout=0.01) is False
    assert conn.pubsub_numsub(channel) == [(channel.encode(), 1)]  # still the listener's
    assert listener.close(timeout=5) is True
    assert conn.pubsub_numsub(channel) == [(channel.encode(), 0)]


def test_the_listener_hears_again_after_redis_restarts(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", "--save", "", "--appendonly", "no").start()
    channel = _channel()
    heard: queue.Queue[Message] = queue.Queue()
    listener = ChannelListener(connect(server.url), "test", heard.put, channels=[channel],
                               poll_seconds=0.2, error_pause_seconds=0.2)
    try:
        server.stop()
        # longer than redis-py's own reconnect retries (``connect``: 6, backoff capped at
        # 1 s), so the refusal reaches the listener, which must wait it out and go on
        time.sleep(OUTAGE_SECONDS)
        server.start()
        client: Redis = server.client()
        deadline = time.monotonic() + 20
        while client.publish(channel, b"back") == 0:  # resubscribed on reconnect
            assert time.monotonic() < deadline, "the listener never subscribed again"
            time.sleep(0.1)
        assert heard.get(timeout=5)["data"] == b"back"
    finally:
        assert listener.close() is True
        server.kill()


def test_a_read_of_a_connection_redis_py_dropped_is_told_from_a_bug() -> None:
    """redis-py's parser reading after its buffer was dropped raises AttributeError on None
    from inside redis-py: a dropped connection (for its holder to mend, not a refusal to
    retry as it is). The same error from anywhere else is a bug."""
    parser = _RESP3Parser(socket_read_size=65536)  # never connected: no buffer
    with pytest.raises(AttributeError) as dropped:
        parser.read_response()
    assert redis_faults.dropped_connection(dropped.value)
    assert redis_faults.classify(dropped.value) is None
    buffer: Any = None
    with pytest.raises(AttributeError) as ours:
        buffer.readline()
    assert not redis_faults.dropped_connection(ours.value)


def test_the_listener_hears_again_after_redis_py_reads_a_connection_it_dropped(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """What redis-py did once in about six Redis restarts, made to happen: the listener's
    read finds the connection's parser dropped (``'NoneType' object has no attribute
    'readline'``). The listener ended there; now it disconnects the connection, and the next
    read connects, subscribes again and hears."""
    channel = _channel()
    heard: queue.Queue[Message] = queue.Queue()
    dropped = threading.Event()
    can_read = Connection.can_read

    def drop_once(self: Connection, timeout: float = 0) -> bool:
        if threading.current_thread().name == "listener-test" and not dropped.is_set():
            dropped.set()
            self._parser.on_disconnect()  # as redis-py left it: the socket kept, no buffer
            return True
        return can_read(self, timeout)

    monkeypatch.setattr(Connection, "can_read", drop_once)
    conn = connect(settings.redis_url)
    listener = ChannelListener(conn, "test", heard.put, channels=[channel],
                               poll_seconds=0.2, error_pause_seconds=0.1)
    try:
        assert dropped.wait(5)
        deadline = time.monotonic() + 10
        while conn.publish(channel, b"again") == 0:
            assert time.monotonic() < deadline, "the listener never subscribed again"
            time.sleep(0.05)
        assert heard.get(timeout=5)["data"] == b"again"
    finally:
        assert listener.close() is True
