"""The one place a specfleet process opens a Redis connection, sync (:func:`connect`) or async
(:func:`connect_async`, the gateway's).

Every client (worker, coordinator, CLI, gateway, stream reader) is built here so that all of
them ride through a short Redis outage the same way: redis-py retries a failed command with
exponential backoff, health-checks idle connections before reuse, and bounds every socket
wait. A longer outage surfaces as a ``redis.ConnectionError`` that the caller's own loop
(see :func:`shared.outage.ride_out`) waits out until its deadline.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis import Redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from shared.sentinel import async_sentinel_client, is_sentinel_url, sentinel_client

#: Retries redis-py makes inside one command before the caller sees the error (~3 s in all).
COMMAND_RETRIES = 6
#: Seconds a socket waits for a reply; blocking reads pass their own, longer, timeout.
SOCKET_TIMEOUT = 10.0
#: Seconds a connection may sit idle before it is PINGed on reuse (a restarted Redis).
HEALTH_CHECK_SECONDS = 5


def _options() -> dict[str, Any]:
    """Every client's socket and health-check policy (the retry is the caller's kind)."""
    return dict(retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionResetError],
                socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT,
                socket_keepalive=True, health_check_interval=HEALTH_CHECK_SECONDS)


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=1.0, base=0.05)


def connect(url: str) -> Redis:
    """A client for ``url`` that retries with backoff and health-checks its connections.

    ``url`` is a ``redis://`` / ``rediss://`` / ``unix://`` URL, or a ``redis+sentinel://``
    one (:mod:`shared.sentinel`): then the client follows the primary its sentinels name, and
    the same retries carry a command over a failover.
    """
    options = dict(_options(), retry=Retry(_backoff(), COMMAND_RETRIES))
    if is_sentinel_url(url):
        return sentinel_client(url, **options)
    return Redis.from_url(url, **options)


def connect_async(url: str, max_connections: int) -> aioredis.Redis:
    """:func:`connect`'s async twin (the same retries and health checks, also for a
    ``redis+sentinel://`` URL), holding at most ``max_connections``."""
    options = dict(_options(), retry=AsyncRetry(_backoff(), COMMAND_RETRIES),
                   max_connections=max_connections)
    if is_sentinel_url(url):
        return async_sentinel_client(url, **options)
    return aioredis.Redis.from_url(url, **options)
