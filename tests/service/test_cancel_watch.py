"""CancelWatch on a real Redis: pub/sub makes a cancel visible without a per-step read."""

from __future__ import annotations

import time

from shared.cancel import request_cancel
from shared.redis_client import connect
from shared.settings import Settings
from worker.service.cancel import CancelWatch


def _wait_true(check: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_published_cancel_reaches_the_running_job_without_polling(settings: Settings) -> None:
    conn = connect(settings.redis_url)
    watch = CancelWatch(conn, settings.keys, poll_seconds=1e12)  # reads once, at first
    try:
        time.sleep(0.2)  # the listener has subscribed
        job_a = watch.begin("job-a")
        assert job_a.cancelled() is False
        request_cancel(conn, settings.keys, "job-b", ttl_seconds=60)  # someone else's job
        time.sleep(0.2)
        assert job_a.cancelled() is False
        request_cancel(conn, settings.keys, "job-a", ttl_seconds=60)
        assert _wait_true(job_a.cancelled)
        watch.end("job-a")
        job_c = watch.begin("job-c")  # the next job starts clean
        assert job_c.cancelled() is False
    finally:
        watch.close()


def test_a_cancel_raised_before_the_job_began_is_read_from_the_key(settings: Settings) -> None:
    conn = connect(settings.redis_url)
    request_cancel(conn, settings.keys, "early", ttl_seconds=60)  # no listener heard it
    # A poll period longer than any machine's uptime: only the read at the first check can
    # see the flag, whatever time.monotonic() happens to be on this machine.
    watch = CancelWatch(conn, settings.keys, poll_seconds=1e12)
    try:
        assert watch.begin("early").cancelled() is True
    finally:
        watch.close()


def test_two_running_jobs_are_cancelled_independently(settings: Settings) -> None:
    conn = connect(settings.redis_url)
    watch = CancelWatch(conn, settings.keys, poll_seconds=1e12)
    try:
        time.sleep(0.2)
        first, second = watch.begin("slot-1"), watch.begin("slot-2")
        assert not first.cancelled() and not second.cancelled()
        request_cancel(conn, settings.keys, "slot-2", ttl_seconds=60)
        assert _wait_true(second.cancelled)
        assert first.cancelled() is False
    finally:
        watch.close()
