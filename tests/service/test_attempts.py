"""A job's attempt counter counts each start once: a write that an outage cut after Redis ran
it is retried with the same token and gets the same number back (a 10 s outage mid-batch
once said ``attempts: 2`` for a job that ran once)."""

from __future__ import annotations

from redis import Redis

from shared.settings import Settings
from worker.service.jobs import _ATTEMPT_LUA


def test_a_retried_count_keeps_its_number_and_a_new_start_gets_the_next(
        settings: Settings) -> None:
    conn = Redis.from_url(settings.redis_url)
    keys = settings.keys
    count = conn.register_script(_ATTEMPT_LUA)
    job_keys = [keys.attempts("j1"), keys.attempt_tokens("j1")]
    first = count(keys=job_keys, args=["start-a", 60])
    assert count(keys=job_keys, args=["start-a", 60]) == first == 1  # the retry
    assert count(keys=job_keys, args=["start-b", 60]) == 2           # another start
    assert int(conn.get(keys.attempts("j1")) or 0) == 2              # what recovery reads
    assert 0 < conn.ttl(keys.attempt_tokens("j1")) <= 60
