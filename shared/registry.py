"""Fleet registry: which workers are alive, what they serve, what they are running.

Liveness is a registration key with a millisecond TTL (``worker:{name}``) refreshed by a
heartbeat thread, so Redis's own clock decides who is dead (no clock skew between hosts).
The ``workers`` sorted set lists every registered name (score: its last heartbeat, Redis
server time) and outlives a dead worker: a name in the set whose registration key has
expired has *lapsed*, and removing it from the set (``ZREM``) is how one monitor claims its
recovery. ``worker:{name}:inflight`` lists the jobs a worker holds and also outlives it.

A lapse is not always a death. A Redis that stalls (``DEBUG SLEEP``, a fork on a huge
dataset), restarts, refuses writes (out of memory) or cannot be reached by anyone lets every
registration run out though every worker is alive, and the first monitor to get through
would declare all the others lost. So every heartbeat and every sweep also stamps the fleet
clock (``Keys.fleet_clock``) with Redis server time: a gap of half a TTL between two stamps
means Redis served nobody meanwhile, and contact is taken to have *resumed* at the stamp
after it. A sweep declares lapsed names lost only when contact has held for one full TTL
since (every live worker has re-registered by then), when the fleet's last stamp is recent
(the sweep is not the first to get through after a gap) and when the sweeping worker's own
last heartbeat is (it has not itself just been cut off). The decision and the claim are one
script, so a sweeper that stalls between reading and claiming cannot claim a worker that has
re-registered meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from redis import Redis

from shared.keys import Keys
from shared.logs import get_logger
from shared.protocol import WorkerInfo
from shared.replies import text
from shared.starting import loaded

log = get_logger("registry")

#: Redis server time in ms, and the fleet clock stamped with it (``now`` is left in ``now``):
#: a gap of ARGV[gap] ms since the last stamp means contact resumes now.
_CLOCK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local clock = redis.call('HMGET', KEYS[1], 'beat', 'resumed')
local beat = tonumber(clock[1] or '0')
local resumed = tonumber(clock[2] or '0')
local gap = now - beat
if gap >= tonumber(ARGV[1]) then
  resumed = now
  redis.call('HSET', KEYS[1], 'beat', now, 'resumed', now)
else
  redis.call('HSET', KEYS[1], 'beat', now)
end
"""
#: KEYS: fleet clock, registration, fleet set, models, worker models; ARGV: gap ms, info JSON,
#: TTL ms, name, model. Replies {1 when the name was not in the set (declared lost), now}.
_HEARTBEAT_LUA = _CLOCK_LUA + """
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
local added = redis.call('ZADD', KEYS[3], now / 1000, ARGV[4])
redis.call('SADD', KEYS[4], ARGV[5])
redis.call('HSET', KEYS[5], ARGV[4], ARGV[5])
return {added, now}
"""
#: KEYS: fleet clock, fleet set, worker models; ARGV: gap ms, registration key prefix, settle
#: ms, the sweeper's own last heartbeat (server ms, '' for a sweeper that does not beat).
#: Replies {state, ms, lapsed count | name, model, name, model ...}: state 'lost' (each
#: lapsed name claimed, with its model) or why nobody was: 'gap' (this sweep ends a gap of
#: ms), 'settling' (contact resumed ms ago), 'self' (the sweeper's own beat is ms old).
#: Only names whose score (last beat) is at least a gap old are looked at: a heartbeat sets
#: the registration (PX TTL) and the score in one script, so a name beaten since cannot
#: have lapsed, and every worker sweeps every beat: reading every name would cost the fleet
#: N x N lookups a heartbeat interval (``forget`` zeroes the score of what it drops).
_SWEEP_LUA = _CLOCK_LUA + """
local names = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf',
                         string.format('%.3f', (now - tonumber(ARGV[1])) / 1000))
local lapsed = {}
for _, name in ipairs(names) do
  if redis.call('EXISTS', ARGV[2] .. name) == 0 then lapsed[#lapsed + 1] = name end
end
if gap >= tonumber(ARGV[1]) then return {'gap', gap, #lapsed} end
if now - resumed < tonumber(ARGV[3]) then return {'settling', now - resumed, #lapsed} end
if ARGV[4] ~= '' and now - tonumber(ARGV[4]) >= tonumber(ARGV[1]) then
  return {'self', now - tonumber(ARGV[4]), #lapsed}
end
local reply = {'lost', 0}
for _, name in ipairs(lapsed) do
  redis.call('ZREM', KEYS[2], name)
  reply[#reply + 1] = name
  reply[#reply + 1] = redis.call('HGET', KEYS[3], name) or ''
  redis.call('HDEL', KEYS[3], name)
end
return reply
"""


@dataclass(frozen=True)
class Sweep:
    """What one sweep of the fleet set found: the lapsed names it claimed (name -> model,
    '' when unknown), or, when it claimed none because contact with Redis is not proven
    long enough, why (``deferred``: ``gap``, ``settling`` or ``self``), for how long
    (``seconds``) and how many lapsed names it left alone (``waiting``)."""

    lost: dict[str, str] = field(default_factory=dict)
    deferred: str | None = None
    seconds: float = 0.0
    waiting: int = 0


class FleetRegistry:
    """Register, heartbeat, list, sweep and deregister workers."""

    def __init__(self, connection: Redis, keys: Keys, ttl_seconds: float) -> None:
        self._conn = connection
        self._keys = keys
        self._ttl_ms = max(1, int(ttl_seconds * 1000))
        #: Half a TTL without a stamp on the fleet clock is a gap in contact: shorter, and
        #: no live worker (beating several times a TTL) can have lapsed through it.
        self._gap_ms = max(1, self._ttl_ms // 2)
        #: Server time (ms) of this process's last successful heartbeat (None: it beats
        #: none, a client's registry).
        self.last_beat_ms: int | None = None
        self._heartbeat = connection.register_script(_HEARTBEAT_LUA)
        self._sweep = connection.register_script(_SWEEP_LUA)

    def heartbeat(self, info: WorkerInfo) -> bool:
        """Write ``info`` with a fresh TTL; False when the name had been declared lost."""
        info.heartbeat_at = time.time()
        k = self._keys
        added, now = self._heartbeat(
            keys=[k.fleet_clock(), k.worker(info.name), k.workers(), k.models(),
                  k.worker_models()],
            args=[self._gap_ms, info.model_dump_json(), self._ttl_ms, info.name,
                  info.model_name])
        self.last_beat_ms = int(now)
        return not added

    def register(self, info: WorkerInfo) -> None:
        """First heartbeat of a worker; its loading record (``shared/starting.py``) goes
        once the registration is written."""
        self.heartbeat(info)
        loaded(self._conn, self._keys, info.model_name, info.name)

    def is_alive(self, name: str) -> bool:
        return bool(self._conn.exists(self._keys.worker(name)))

    def registration(self, name: str) -> WorkerInfo | None:
        """The live registration of ``name``, or None when it has expired."""
        raw = self._conn.get(self._keys.worker(name))
        return WorkerInfo.model_validate_json(raw) if raw else None

    def forget(self, name: str) -> None:
        """Drop a registration whose process is known to be gone (same host, pid dead), so
        the name can be taken over at once instead of after the TTL. Its score goes to 0,
        so the next sweep looks at it (a sweep skips names beaten recently)."""
        pipe = self._conn.pipeline(transaction=True)
        pipe.delete(self._keys.worker(name))
        pipe.zadd(self._keys.workers(), {name: 0}, xx=True)
        pipe.execute()

    def deregister(self, name: str) -> None:
        """Clean exit: the worker leaves the fleet (its in-flight list is already empty)."""
        pipe = self._conn.pipeline(transaction=True)
        pipe.delete(self._keys.worker(name))
        pipe.zrem(self._keys.workers(), name)
        pipe.hdel(self._keys.worker_models(), name)
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

    def lapsed(self, model_name: str) -> list[str]:
        """Workers of ``model_name`` still in the fleet set whose registration has expired:
        dead and awaiting recovery, or alive and about to re-register (Redis restarted or
        stalled under them)."""
        served = self._conn.hgetall(self._keys.worker_models())
        names = [text(n) for n, m in served.items() if text(m) == model_name]
        if not names:
            return []
        pipe = self._conn.pipeline(transaction=False)
        for name in names:
            pipe.exists(self._keys.worker(name))
        return [n for n, alive in zip(names, pipe.execute(), strict=True) if not alive]

    def claim_lapsed(self) -> Sweep:
        """Claim every lapsed name, atomically, if contact with Redis has held long enough
        to tell a death from a stall (the module's docstring); each is claimed by exactly
        one caller. A sweeper that heartbeats itself must be in contact too."""
        k = self._keys
        own = "" if self.last_beat_ms is None else str(self.last_beat_ms)
        reply = self._sweep(keys=[k.fleet_clock(), k.workers(), k.worker_models()],
                            args=[self._gap_ms, k.worker(""), self._ttl_ms, own])
        state = text(reply[0])
        if state != "lost":
            return Sweep(deferred=state, seconds=int(reply[1]) / 1000, waiting=int(reply[2]))
        rest = [text(r) for r in reply[2:]]
        return Sweep(lost=dict(zip(rest[::2], rest[1::2], strict=True)))

    def take_jobs(self, name: str) -> list[str]:
        """Remove and return every job a (lost) worker held, in the order it took them."""
        pipe = self._conn.pipeline(transaction=True)
        pipe.lrange(self._keys.inflight(name), 0, -1)
        pipe.delete(self._keys.inflight(name))
        raw, _ = pipe.execute()
        return [text(r) for r in raw]
