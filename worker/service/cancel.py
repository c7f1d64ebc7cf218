"""Cooperative cancellation: a per-job flag the decode loop checks every step, for free.

rq cannot stop a running job in a non-forking worker (``send_stop_job_command`` kills a work
horse that does not exist), and SIGALRM cannot interrupt a C call; so the engine's
``should_stop`` callback asks ``CancelWatch.cancelled()`` once per decode step, and a
cancelled job ends with a ``cancelled`` final event within one step.

A Redis round trip per step would cost several percent of a fast GPU's decode, so the watch
keeps a local flag: a cancel raises the durable key ``{prefix}:job:{id}:cancel`` *and*
publishes on the channel of the same name, which the watch's listener thread turns into the
flag at once. Pub/sub is at-most-once, so the watch also reads the key when a job begins and
every ``poll_seconds`` after: a lost message delays a cancel, never loses it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from redis import Redis

from shared.keys import Keys
from shared.logs import get_logger

log = get_logger("cancel")


def request_cancel(connection: Redis, keys: Keys, job_id: str, ttl_seconds: int) -> None:
    """Raise the job's cancel flag (idempotent; expires with the job's stream) and say so."""
    pipe = connection.pipeline(transaction=False)
    pipe.set(keys.cancel(job_id), 1, ex=ttl_seconds)
    pipe.publish(keys.cancel(job_id), 1)
    pipe.execute()


def is_cancelled(connection: Redis, keys: Keys, job_id: str) -> bool:
    """True once someone asked to cancel the job (one round trip)."""
    return bool(connection.exists(keys.cancel(job_id)))


class CancelWatch:
    """Answers "was the running job cancelled?" from memory, kept current by pub/sub."""

    def __init__(self, connection: Redis, keys: Keys, poll_seconds: float = 0.25) -> None:
        self._conn = connection
        self._keys = keys
        self._poll = poll_seconds
        self._channel: str | None = None
        self._job_id = ""
        self._hit = threading.Event()
        self._polled = 0.0
        self._pubsub = connection.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(**{keys.cancel("*"): self._on_message})
        self._thread = self._pubsub.run_in_thread(sleep_time=1.0, daemon=True,
                                                  exception_handler=self._on_error)

    def begin(self, job_id: str) -> None:
        """Watch ``job_id`` from now on (its first check reads the key)."""
        self._hit.clear()
        self._job_id = job_id
        self._channel = self._keys.cancel(job_id)
        self._polled = 0.0

    def cancelled(self) -> bool:
        """Checked once per decode step: a memory read, and a Redis read every poll period."""
        if not self._hit.is_set():
            now = time.monotonic()
            if now - self._polled >= self._poll:
                self._polled = now
                if is_cancelled(self._conn, self._keys, self._job_id):
                    self._hit.set()
        return self._hit.is_set()

    def close(self) -> None:
        self._thread.stop()
        self._thread.join(timeout=2)
        self._pubsub.close()

    def _on_message(self, message: dict[str, Any]) -> None:
        channel = message["channel"]
        if isinstance(channel, bytes):
            channel = channel.decode()
        if channel == self._channel:
            self._hit.set()

    def _on_error(self, exc: BaseException, pubsub: Any, thread: Any) -> None:
        """Keep listening through a Redis hiccup (the key poll covers the gap)."""
        log.warning("cancel.listener_error", error=repr(exc))
        time.sleep(1.0)
