"""Which Redis errors are a passing refusal to wait out, and of what kind: decided here only.

A Redis that is down or restarting, still loading its dataset, out of memory under
``noeviction``, demoted to a replica by a failover, busy running a script, or a replica cut
off from its primary refuses a command *without running it*: the same command sent again
later is applied exactly once. (A script refused for memory is refused at its first write,
before it changed anything, so a token event whose append was refused is appended once when
retried, under the same ``seq``.) Every loop that must survive such a refusal (workers'
intake and event writes, the heartbeat, clients following a stream, the CLIs) asks
:func:`classify`, so that workers, clients and CLIs agree on what is transient and name it
the same way; a reply that no retry mends (WRONGTYPE, a script's own error) is None here
and passes through.

Each wait is also reported to the listeners registered with :func:`listen` (the worker's
Prometheus metrics count outages and seconds waited per kind), once when a kind of refusal
starts and once when it is over.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import StrEnum
from typing import Protocol

from redis.exceptions import (
    BusyLoadingError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class Fault(StrEnum):
    """A kind of transient refusal (the ``fault`` field of ``redis.unavailable``, the
    ``kind`` label of the metrics)."""

    CONNECTION = "connection"  # refused, reset or closed: down, restarting, unreachable
    TIMEOUT = "timeout"  # no reply within the socket timeout: a stalled server
    LOADING = "loading"  # loading its AOF/RDB after a restart
    OOM = "oom"  # used memory > maxmemory under noeviction: writes refused
    READONLY = "readonly"  # a replica now (failover): writes refused until clients follow
    BUSY = "busy"  # a script (or function) has run past busy-reply-threshold
    MASTERDOWN = "masterdown"  # a replica that lost its primary, serving no stale data
    TRYAGAIN = "tryagain"  # a cluster slot moving


#: The error code a Redis reply starts with, for each kind a ``ResponseError`` can carry.
_REPLY_CODES = {"LOADING": Fault.LOADING, "OOM": Fault.OOM, "READONLY": Fault.READONLY,
                "BUSY": Fault.BUSY, "MASTERDOWN": Fault.MASTERDOWN,
                "TRYAGAIN": Fault.TRYAGAIN}
#: The classes redis-py parses some of those codes into (it strips the code off the text).
_REPLY_CLASSES: tuple[tuple[type[Exception], Fault], ...] = (
    (BusyLoadingError, Fault.LOADING), (OutOfMemoryError, Fault.OOM),
    (ReadOnlyError, Fault.READONLY), (MasterDownError, Fault.MASTERDOWN),
    (TryAgainError, Fault.TRYAGAIN))
#: A code redis-py leaves in the text (BUSY): after the command a pipeline names, or inside
#: Redis 6's "Error running script ...: -CODE".
_CODE = re.compile(r"^(?:Command # \d+ \(.*?\) of pipeline caused error: )?"
                   r"(?:Error running script .*?: -)?([A-Z]+)\b", re.DOTALL)


def dropped_connection(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py reading a connection it had itself dropped: an
    AttributeError on None raised inside redis-py (its parser's buffer is gone). redis-py 8
    does that while it reconnects a pub/sub connection after a restart (1 run in about 6 of
    ``test_the_listener_hears_again_after_redis_restarts``: ``'NoneType' object has no
    attribute 'readline'`` from its RESP3 parser). The connection is down, as for a
    ConnectionError, but redis-py does not reset it: a retry on it fails the same way. So
    :func:`classify` does not name it (a loop on pooled connections would retry a broken one);
    a holder of its own connection mends it by disconnecting it
    (:class:`~worker.service.channels.ChannelListener`)."""
    if not isinstance(exc, AttributeError) or exc.obj is not None:
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("redis.")


def classify(exc: BaseException) -> Fault | None:
    """The kind of passing refusal ``exc`` is, or None for an error no retry mends."""
    for cls, fault in _REPLY_CLASSES:  # BusyLoadingError is a ConnectionError: first
        if isinstance(exc, cls):
            return fault
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return Fault.TIMEOUT
    if isinstance(exc, RedisConnectionError | ConnectionError):
        return Fault.CONNECTION
    if isinstance(exc, ResponseError):
        code = getattr(exc, "status_code", None)
        if code is None:
            match = _CODE.match(str(exc))
            code = match.group(1) if match else None
        return _REPLY_CODES.get(code) if code else None
    return None


class FaultListener(Protocol):
    """What is told of each wait (the worker's metrics implement it)."""

    def redis_fault(self, kind: Fault, operation: str) -> None:
        """A refusal of ``kind`` started an outage of ``operation`` (or changed its kind)."""

    def redis_fault_over(self, kind: Fault, operation: str, seconds: float) -> None:
        """The outage is over after ``seconds`` (recovered, or the caller gave up)."""


_listeners: list[FaultListener] = []


def listen(listener: FaultListener) -> Callable[[], None]:
    """Tell ``listener`` of every outage this process waits out; returns the unsubscribe."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def started(kind: Fault, operation: str) -> None:
    for listener in list(_listeners):
        listener.redis_fault(kind, operation)


def ended(kind: Fault, operation: str, seconds: float) -> None:
    for listener in list(_listeners):
        listener.redis_fault_over(kind, operation, seconds)
