"""Riding out a Redis outage: retry one Redis operation until it works or a deadline passes.

redis-py's own retry (``shared.redis_client``) covers blips of a few seconds inside a single
command. A restart or a failover takes longer; every loop that must survive one (the worker's
intake and event writes, a client following a stream) wraps its Redis call in
:func:`ride_out`, which waits with capped exponential backoff and gives up only after
``deadline`` seconds of continuous failure, raising :class:`RedisOutage`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.logs import get_logger

log = get_logger("redis")

T = TypeVar("T")

#: What a Redis that is down, restarting or still loading its AOF raises.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionResetError)
_FIRST_WAIT = 0.1
_MAX_WAIT = 2.0


class RedisOutage(RuntimeError):
    """Redis stayed unreachable for longer than the caller's deadline."""


def ride_out(operation: Callable[[], T], deadline: float, what: str) -> T:
    """Run ``operation``; while Redis is unreachable, retry it for up to ``deadline`` seconds.

    ``what`` names the operation in the ``redis.unavailable`` / ``redis.recovered`` events.
    Errors other than a lost connection (a WRONGTYPE reply, a script error) pass through.
    """
    started: float | None = None
    wait = _FIRST_WAIT
    while True:
        try:
            result = operation()
        except TRANSIENT as exc:
            now = time.monotonic()
            if started is None:
                started = now
                log.warning("redis.unavailable", operation=what, error=str(exc),
                            deadline_seconds=deadline)
            if now - started >= deadline:
                raise RedisOutage(f"Redis unreachable for {now - started:.0f} s during {what} "
                                  f"(deadline {deadline:g} s): {exc}") from exc
            time.sleep(min(wait, max(0.0, deadline - (now - started))))
            wait = min(wait * 2, _MAX_WAIT)
            continue
        if started is not None:
            log.info("redis.recovered", operation=what,
                     down_seconds=round(time.monotonic() - started, 2))
        return result
