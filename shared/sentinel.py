"""Redis Sentinel in a ``REDIS_URL``: the fleet follows its Redis primary through a failover.

A URL of the form::

    redis+sentinel://[user:password@]host1:26379,host2:26379/mymaster/0
    rediss+sentinel://...                      (TLS to the sentinels and to the primary)
    ...?sentinel_auth=same                     (send the URL's credentials to the sentinels too)

names the sentinels, the monitored service and the database. The client redis-py's
``Sentinel.master_for`` builds asks a sentinel for the current primary before every new
connection, and treats a demoted primary's ``READONLY`` reply as a connection error, so the
retries :func:`shared.redis_client.connect` configures carry a command over to the new primary.
The credentials are the data nodes' (the ACL user of a worker or a client); sentinels are asked
without credentials unless ``sentinel_auth=same``, because they usually sit on a private network
with their own (or no) password.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelManagedConnection
from redis.asyncio.sentinel import (
    SentinelManagedSSLConnection as AsyncSentinelManagedSSLConnection,
)
from redis.sentinel import Sentinel

#: URL schemes that name sentinels instead of one Redis server.
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379
#: Options a sentinel connection shares with the data connections (timeouts, keepalive).
_SHARED_WITH_SENTINELS = ("socket_timeout", "socket_connect_timeout", "socket_keepalive")


@dataclass(frozen=True)
class SentinelURL:
    """What a ``redis+sentinel://`` URL says (the password is never part of ``repr``)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_auth: bool = False

    def __repr__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"SentinelURL({hosts}/{self.service}/{self.db}, user={self.username!r})"


def is_sentinel_url(url: str) -> bool:
    """True for ``redis+sentinel://`` and ``rediss+sentinel://`` URLs."""
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse a sentinel URL; a malformed one is a ``ValueError`` that never echoes the URL
    (it may hold a password)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a sentinel URL (scheme {scheme!r}): expected redis+sentinel://")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, password = _credentials(userinfo)
    sentinels = tuple(_host_port(h) for h in hostlist.split(","))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("sentinel URL: the path must be /SERVICE or /SERVICE/DB "
                         "(e.g. redis+sentinel://host:26379/mymaster/0)")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"sentinel URL: database {path[1]!r} is not a number")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - {"sentinel_auth"}
    if unknown:
        raise ValueError(f"sentinel URL: unknown option(s) {', '.join(sorted(unknown))} "
                         "(only sentinel_auth=same)")
    auth = query.get("sentinel_auth", ["none"])[-1]
    if auth not in ("same", "none"):
        raise ValueError(f"sentinel URL: sentinel_auth must be 'same' or 'none', not {auth!r}")
    return SentinelURL(sentinels=sentinels, service=unquote(path[0]),
                       db=int(path[1]) if len(path) == 2 else 0, username=username,
                       password=password, tls=SENTINEL_SCHEMES[scheme],
                       sentinel_auth=auth == "same")


def sentinel_client(url: str, **options: Any) -> Redis:
    """A client of the primary that ``url``'s sentinels name, built with ``options`` (the
    retry, timeout and health-check options every specfleet client uses)."""
    target, sentinel_options, primary_options = _split_options(url, options)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)
    return sentinel.master_for(target.service, **primary_options)


class _AsksSentinelOnReconnect:
    """redis-py's asyncio connection reconnects a dropped socket through
    ``connect_check_health``, which skips the sentinel lookup ``connect`` does (redis-py issue
    #3874, open in 8.1): every retry after a failover went back to the demoted primary. Ask the
    sentinels there too."""

    connection_pool: Any
    host: str
    port: int
    is_connected: bool

    async def connect_check_health(self, check_health: bool = True,
                                   retry_socket_connect: bool = True) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(  # type: ignore[misc]
            check_health=check_health, retry_socket_connect=retry_socket_connect)


class _AsyncPrimaryConnection(_AsksSentinelOnReconnect, AsyncSentinelManagedConnection):
    pass


class _AsyncPrimaryTLSConnection(_AsksSentinelOnReconnect, AsyncSentinelManagedSSLConnection):
    pass


def async_sentinel_client(url: str, **options: Any) -> AsyncRedis:
    """:func:`sentinel_client` for ``redis.asyncio`` (the HTTP gateway); ``options`` carry an
    asyncio ``Retry``."""
    target, sentinel_options, primary_options = _split_options(url, options)
    tls = primary_options.pop("ssl", False)
    sentinel = AsyncSentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)
    return sentinel.master_for(
        target.service, **primary_options,
        connection_class=_AsyncPrimaryTLSConnection if tls else _AsyncPrimaryConnection)


def _split_options(url: str, options: dict[str, Any]
                   ) -> tuple[SentinelURL, dict[str, Any], dict[str, Any]]:
    """The parsed URL, the sentinels' connection options and the primary's."""
    target = parse_sentinel_url(url)
    credentials = {"username": target.username, "password": target.password}
    tls = {"ssl": True} if target.tls else {}
    sentinel_options = {k: options[k] for k in _SHARED_WITH_SENTINELS if k in options}
    sentinel_options.update(tls)
    if target.sentinel_auth:
        sentinel_options.update(credentials)
    return target, sentinel_options, {"db": target.db, **credentials, **tls, **options}


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, sep, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if sep else None)


def _host_port(item: str) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` of one sentinel."""
    item = item.strip()
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise ValueError("sentinel URL: every sentinel needs a host (host:port,host:port)")
    if port and not port.isdigit():
        raise ValueError(f"sentinel URL: port {port!r} of sentinel {host!r} is not a number")
    return host, int(port) if port else DEFAULT_SENTINEL_PORT
