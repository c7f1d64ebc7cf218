"""What the Files and the Batch APIs share: who is asking (:class:`Tenant`, its
:class:`Quota`), the error both answer with (:class:`StoreError`, carrying its HTTP status),
and how both list a sorted index of their objects (:func:`listing`).

Every file and batch is owned by the tenant that created it, stored as its key id (never the
key). A tenant sees and acts on its own objects only (another's are "no such" 404s), an admin
on everyone's, and the operator (:data:`OPERATOR`: ``specfleet batch``, the pumps) too. What
an open gateway or the operator creates, and what was stored before owners were recorded, is
:data:`ANONYMOUS`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis

from shared.replies import text

#: The owner of what is created without an API key (an open gateway, the operator), and of
#: what was stored before owners were recorded.
ANONYMOUS = "anonymous"


class StoreError(ValueError):
    """A files or batches request that cannot be served; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Quota:
    """What one tenant may hold at once: bytes of live uploads, batches not ended
    (``SPECFLEET_MAX_STORED_BYTES_PER_KEY``, ``SPECFLEET_MAX_OPEN_BATCHES_PER_KEY``)."""

    stored_bytes: int
    open_batches: int


@dataclass(frozen=True)
class Tenant:
    """Who is asking, decided once per request (``coordinator.gateway.auth.ApiKeys``).

    ``owner`` is the id what it creates is stored under (an API key's key id, never the key);
    ``admin`` sees and acts on every owner's objects; ``quota`` bounds what it creates (None:
    unbounded)."""

    owner: str
    admin: bool = False
    quota: Quota | None = None

    def sees(self, owner: str) -> bool:
        """Whether this tenant may read and act on an object of ``owner``."""
        return self.admin or owner == self.owner


#: The operator (``specfleet batch``, which talks to Redis directly, and the pumps): sees and
#: acts on everything, unbounded; what it creates is :data:`ANONYMOUS`'s.
OPERATOR = Tenant(ANONYMOUS, admin=True)


def listing(conn: Redis, index: str, fetch: Callable[[str], dict[str, Any]], limit: int,
            after: str | None, forget: Callable[[str], object]) -> list[dict[str, Any]]:
    """Up to ``limit`` objects of the sorted set ``index``, newest first, from after
    ``after``; an id whose object has expired (``fetch`` raises :class:`StoreError`) is
    dropped from the set (``forget``)."""
    ids = [text(i) for i in conn.zrevrange(index, 0, -1)]
    if after is not None and after in ids:
        ids = ids[ids.index(after) + 1:]
    found: list[dict[str, Any]] = []
    for object_id in ids:
        if len(found) >= limit:
            break
        try:
            found.append(fetch(object_id))
        except StoreError:  # expired: forget it
            forget(object_id)
    return found
