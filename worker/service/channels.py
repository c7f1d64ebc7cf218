"""A pub/sub listener whose connection only its own thread ever touches.

redis-py's ``run_in_thread`` leaves closing to the caller: rq's ``Worker.unsubscribe`` stops
the thread, joins it for one second and closes the PubSub from the main thread, although the
listener may still be inside its 60 s read; that connection then goes back to the pool while
another thread uses it. Under a loaded test suite (redis-py 8) worker shutdowns hung right
there, after rq's "unsubscribing" line; how the two threads met was not caught (a bare
reproduction closed cleanly), so the whole pattern is gone rather than one interleaving.

Here a listener's connection is read, and closed, by its own thread alone: it polls in
short waits so a stop is seen within ``poll_seconds``, and a close that times out leaves the
connection with the thread (a daemon) instead of closing it under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from redis import Redis

from shared import redis_faults
from shared.logs import get_logger

log = get_logger("channels")

Message = dict[str, Any]


class ChannelListener:
    """Calls ``on_message`` with each message on ``channels`` and ``patterns``, from one
    daemon thread, until :meth:`close`.

    The subscription is made before the constructor returns, so a message published after
    it is heard. A Redis that refuses is waited out (redis-py reconnects the connection and
    subscribes it again); an error in ``on_message`` is logged and the listener goes on.
    """

    def __init__(self, connection: Redis, name: str, on_message: Callable[[Message], None],
                 *, channels: Iterable[str] = (), patterns: Iterable[str] = (),
                 poll_seconds: float = 0.5, error_pause_seconds: float = 1.0) -> None:
        self.name = name
        self._on_message = on_message
        self._poll = poll_seconds
        self._error_pause = error_pause_seconds
        self._stop = threading.Event()
        pubsub = connection.pubsub(ignore_subscribe_messages=True)
        channel_list, pattern_list = list(channels), list(patterns)
        if channel_list:
            pubsub.subscribe(*channel_list)
        if pattern_list:
            pubsub.psubscribe(*pattern_list)
        # Handed over before start(): from here on only the thread touches it.
        self._thread = threading.Thread(target=self._run, args=(pubsub,), daemon=True,
                                        name=f"listener-{name}")
        self._thread.start()

    def close(self, timeout: float = 5.0) -> bool:
        """Stop listening; True once the thread has closed its connection. False when it
        is still inside a read after ``timeout`` (a Redis that hangs): the thread keeps the
        connection and closes it when the read ends, or the process exits with it."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("listener.close_timed_out", listener=self.name, timeout=timeout)
            return False
        return True

    def _run(self, pubsub: Any) -> None:
        try:
            while not self._stop.is_set():
                message = self._read(pubsub)
                if message is not None:
                    self._dispatch(message)
        except Exception as exc:
            log.error("listener.failed", listener=self.name, error=repr(exc))
        finally:
            pubsub.close()

    def _read(self, pubsub: Any) -> Message | None:
        """The next message within one poll, or None; a Redis fault is logged and waited
        out (anything else is a bug and ends the listener). A connection redis-py read after
        dropping it is disconnected here, so the next read connects and subscribes again
        (left as it was, the listener ended: ``redis_faults.dropped_connection``)."""
        try:
            message: Message | None = pubsub.get_message(timeout=self._poll)
        except Exception as exc:
            dropped = redis_faults.dropped_connection(exc)
            if redis_faults.classify(exc) is None and not dropped:
                raise
            log.warning("listener.redis_error", listener=self.name, error=repr(exc))
            if dropped and pubsub.connection is not None:
                pubsub.connection.disconnect()
            self._stop.wait(self._error_pause)
            return None
        return message

    def _dispatch(self, message: Message) -> None:
        try:
            self._on_message(message)
        except Exception as exc:  # a bad payload must not end the listener
            log.warning("listener.handler_failed", listener=self.name, error=repr(exc))
