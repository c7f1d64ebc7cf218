"""Riding out a Redis outage: retry one Redis operation until it works or a deadline passes.

redis-py's own retry (``shared.redis_client``) covers blips of a few seconds inside a single
command. A restart, a failover, a stall or a spell out of memory takes longer; every loop that
must survive one (the worker's intake and event writes, a client submitting or following a
stream, the CLIs) wraps its Redis call in :func:`ride_out`, which waits with capped
exponential backoff while :func:`shared.redis_faults.classify` calls the error a passing
refusal, and gives up only after ``deadline`` seconds of continuous failure, raising
:class:`RedisOutage`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from shared import redis_faults
from shared.logs import get_logger

log = get_logger("redis")

T = TypeVar("T")

_FIRST_WAIT = 0.1
_MAX_WAIT = 2.0


class RedisOutage(RuntimeError):
    """Redis stayed unreachable for longer than the caller's deadline."""


def ride_out(operation: Callable[[], T], deadline: float, what: str) -> T:
    """Run ``operation``; while Redis refuses it for a passing reason (down, loading, out of
    memory, read-only, busy ...), retry it for up to ``deadline`` seconds.

    ``what`` names the operation in the ``redis.unavailable`` (one per kind of refusal met) /
    ``redis.recovered`` events. Errors no retry mends (a WRONGTYPE reply, a script error)
    pass through.
    """
    started: float | None = None
    kind: redis_faults.Fault | None = None
    kind_since = 0.0
    wait = _FIRST_WAIT
    while True:
        try:
            result = operation()
        except Exception as exc:
            fault = redis_faults.classify(exc)
            if fault is None:
                raise
            now = time.monotonic()
            if started is None:
                started = now
            if fault is not kind:
                if kind is not None:
                    redis_faults.ended(kind, what, now - kind_since)
                kind, kind_since = fault, now
                log.warning("redis.unavailable", operation=what, fault=str(fault),
                            error=str(exc), deadline_seconds=deadline)
                redis_faults.started(fault, what)
            if now - started >= deadline:
                redis_faults.ended(fault, what, now - kind_since)
                state = ("unreachable" if fault in (redis_faults.Fault.CONNECTION,
                                                    redis_faults.Fault.TIMEOUT)
                         else f"refusing ({fault})")
                raise RedisOutage(f"Redis {state} for {now - started:.0f} s during {what} "
                                  f"(deadline {deadline:g} s): {exc}") from exc
            time.sleep(min(wait, max(0.0, deadline - (now - started))))
            wait = min(wait * 2, _MAX_WAIT)
            continue
        if started is not None and kind is not None:
            down = time.monotonic() - started
            log.info("redis.recovered", operation=what, fault=str(kind),
                     down_seconds=round(down, 2))
            redis_faults.ended(kind, what, time.monotonic() - kind_since)
        return result
