"""Fleet registry: which workers are alive, what they serve, what they are running.

Liveness is a registration key with a millisecond TTL (``worker:{name}``) refreshed by a
heartbeat thread, so Redis's own clock decides who is dead (no clock skew between hosts).
The ``workers`` sorted set lists every registered name (score: last heartbeat) and outlives a
dead worker: a name in the set whose registration key has expired is a lost worker, and
removing it from the set (``ZREM`` returns 1 exactly once) is how one monitor claims its
recovery. ``worker:{name}:inflight`` lists the jobs a worker holds and also outlives it.
"""

from __future__ import annotations

import time

from redis import Redis

from shared.keys import Keys
from shared.logs import get_logger
from shared.protocol import WorkerInfo
from shared.replies import text

log = get_logger("registry")


class FleetRegistry:
    """Register, heartbeat, list and deregister workers."""

    def __init__(self, connection: Redis, keys: Keys, ttl_seconds: float) -> None:
        self._conn = connection
        self._keys = keys
        self._ttl_ms = max(1, int(ttl_seconds * 1000))

    def heartbeat(self, info: WorkerInfo) -> bool:
        """Write ``info`` with a fresh TTL; False when the name had been declared lost."""
        info.heartbeat_at = time.time()
        pipe = self._conn.pipeline(transaction=True)
        pipe.set(self._keys.worker(info.name), info.model_dump_json(), px=self._ttl_ms)
        pipe.zadd(self._keys.workers(), {info.name: info.heartbeat_at})
        pipe.sadd(self._keys.models(), info.model_name)
        _, added, _ = pipe.execute()
        return not added

    def register(self, info: WorkerInfo) -> None:
        """First heartbeat of a worker."""
        self.heartbeat(info)

    def is_alive(self, name: str) -> bool:
        return bool(self._conn.exists(self._keys.worker(name)))

    def registration(self, name: str) -> WorkerInfo | None:
        """The live registration of ``name``, or None when it has expired."""
        raw = self._conn.get(self._keys.worker(name))
        return WorkerInfo.model_validate_json(raw) if raw else None

    def forget(self, name: str) -> None:
        """Drop a registration whose process is known to be gone (same host, pid dead), so
        the name can be taken over at once instead of after the TTL."""
        self._conn.delete(self._keys.worker(name))

    def deregister(self, name: str) -> None:
        """Clean exit: the worker leaves the fleet (its in-flight list is already empty)."""
        pipe = self._conn.pipeline(transaction=True)
        pipe.delete(self._keys.worker(name))
        pipe.zrem(self._keys.workers(), name)
        pipe.execute()

    def live_workers(self, model_name: str | None = None) -> list[WorkerInfo]:
        """Workers whose registration has not expired, optionally only those of one model."""
        names = self.registered_names()
        if not names:
            return []
        raw = self._conn.mget([self._keys.worker(n) for n in names])
        workers = [WorkerInfo.model_validate_json(r) for r in raw if r]
        return [w for w in workers if model_name is None or w.model_name == model_name]

    def registered_names(self) -> list[str]:
        """Every name in the fleet set, alive or not yet recovered."""
        return [text(n) for n in self._conn.zrange(self._keys.workers(), 0, -1)]

    def lost_names(self) -> list[str]:
        """Registered names whose registration has expired (one round trip for the fleet)."""
        names = self.registered_names()
        pipe = self._conn.pipeline(transaction=False)
        for name in names:
            pipe.exists(self._keys.worker(name))
        return [name for name, alive in zip(names, pipe.execute(), strict=True) if not alive]

    def claim_lost(self, name: str) -> bool:
        """Atomically take responsibility for a lost worker; True for exactly one caller."""
        return bool(self._conn.zrem(self._keys.workers(), name))

    def take_jobs(self, name: str) -> list[str]:
        """Remove and return every job a (lost) worker held, in the order it took them."""
        pipe = self._conn.pipeline(transaction=True)
        pipe.lrange(self._keys.inflight(name), 0, -1)
        pipe.delete(self._keys.inflight(name))
        raw, _ = pipe.execute()
        return [text(r) for r in raw]
