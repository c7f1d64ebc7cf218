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

from shared import redis_faults
from shared.cancel import is_cancelled
from shared.keys import Keys
from worker.service.channels import ChannelListener


class JobCancel:
    """One running job's cancel flag: set by the watch's listener, or read from the key."""

    def __init__(self, watch: CancelWatch, job_id: str) -> None:
        self._watch = watch
        self.job_id = job_id
        self.hit = threading.Event()
        #: When the key was last read; None = never, so the first check always reads it
        #: (a cancel raised before the job began had no listener to hear it).
        self._polled: float | None = None

    def cancelled(self) -> bool:
        """Checked once per decode step: a memory read, and a Redis read every poll period."""
        if not self.hit.is_set():
            now = time.monotonic()
            if self._polled is None or now - self._polled >= self._watch.poll_seconds:
                self._polled = now
                try:
                    if self._watch.read_key(self.job_id):
                        self.hit.set()
                except Exception as exc:  # a refusing Redis: the next poll reads it again
                    if redis_faults.classify(exc) is None:
                        raise
        return self.hit.is_set()


class CancelWatch:
    """Answers "was this running job cancelled?" from memory, kept current by pub/sub.

    One watch per worker serves every job it runs at once (one listener thread, one
    pattern subscription); each job gets its own :class:`JobCancel` from :meth:`begin`.
    """

    def __init__(self, connection: Redis, keys: Keys, poll_seconds: float = 0.25) -> None:
        self._conn = connection
        self._keys = keys
        self.poll_seconds = poll_seconds
        self._jobs: dict[str, JobCancel] = {}
        # a Redis hiccup is waited out by the listener; the key poll covers the gap
        self._listener = ChannelListener(connection, "cancel", self._on_message,
                                         patterns=[keys.cancel("*")])

    def begin(self, job_id: str) -> JobCancel:
        """Watch ``job_id`` from now on (its first check reads the key)."""
        flag = JobCancel(self, job_id)
        self._jobs[job_id] = flag
        return flag

    def end(self, job_id: str) -> None:
        """Stop watching a job that has ended."""
        self._jobs.pop(job_id, None)

    def read_key(self, job_id: str) -> bool:
        """The durable flag, for the first check and the poll that covers lost messages."""
        return is_cancelled(self._conn, self._keys, job_id)

    def close(self) -> None:
        self._listener.close()

    def _on_message(self, message: dict[str, Any]) -> None:
        channel = message["channel"]
        if isinstance(channel, bytes):
            channel = channel.decode()
        for flag in list(self._jobs.values()):
            if self._keys.cancel(flag.job_id) == channel:
                flag.hit.set()
