"""CancelWatch on a real Redis: pub/sub makes a cancel visible without a per-step read."""

from __future__ import annotations

import time

from redis import Redis

from shared.settings import Settings
from worker.service.cancel import CancelWatch, request_cancel


def _wait_true(check: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_published_cancel_reaches_the_running_job_without_polling(settings: Settings) -> None:
    conn = Redis.from_url(settings.redis_url)
    watch = CancelWatch(conn, settings.keys, poll_seconds=3600)  # polls once, at begin
    try:
        time.sleep(0.2)  # the listener has subscribed
        watch.begin("job-a")
        assert watch.cancelled() is False
        request_cancel(conn, settings.keys, "job-b", ttl_seconds=60)  # someone else's job
        time.sleep(0.2)
        assert watch.cancelled() is False
        request_cancel(conn, settings.keys, "job-a", ttl_seconds=60)
        assert _wait_true(watch.cancelled)
        watch.begin("job-c")  # the next job starts clean
        assert watch.cancelled() is False
    finally:
        watch.close()


def test_a_cancel_raised_before_the_job_began_is_read_from_the_key(settings: Settings) -> None:
    conn = Redis.from_url(settings.redis_url)
    request_cancel(conn, settings.keys, "early", ttl_seconds=60)  # no listener heard it
    watch = CancelWatch(conn, settings.keys, poll_seconds=3600)
    try:
        watch.begin("early")
        assert watch.cancelled() is True
    finally:
        watch.close()
