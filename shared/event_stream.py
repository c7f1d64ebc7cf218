"""Writing a job's events: a bounded, expiring Redis Stream plus a pub/sub channel.

Part of the wire contract: workers write a job's events here, and so does the coordinator
when it ends a job that never ran (a cancel of a queued job), so both live in ``shared``.

The Stream is the durable record (a reader that arrives late or reconnects replays it with
``XREAD`` from its last id); pub/sub is only live fan-out for dashboards, because pub/sub is
at-most-once. Every event carries the job id, the attempt and a sequence number shared by all
attempts of the job, so a reader can order and de-duplicate across a crash and a re-run.
"""

from __future__ import annotations

from typing import Any

from redis import Redis

from shared.keys import STREAM_FIELD, Keys
from shared.logs import get_logger
from shared.outage import ride_out
from shared.protocol import (
    AnyEvent,
    ErrorEvent,
    FinalEvent,
    ProgressEvent,
    TelemetryEvent,
    TokenEvent,
)
from shared.settings import Settings

log = get_logger("events")

_EVENT_TYPES: dict[str, type[AnyEvent]] = {
    "token": TokenEvent,
    "telemetry": TelemetryEvent,
    "progress": ProgressEvent,
    "error": ErrorEvent,
    "final": FinalEvent,
}

#: The sequence number is assigned inside Redis (INCR), so the event is serialised with a
#: placeholder that the script replaces: one round trip per event, numbers gap-free and
#: shared by every attempt of the job.
_SEQ_PLACEHOLDER = 987654321987
_SEQ_TEXT = f'"seq":{_SEQ_PLACEHOLDER}'
#: A final event of a batch job (KEYS[4] holds its line reference, see ``Keys.job_batch``) is
#: accounted to its batch in the same script, so every writer of a final event (the worker, a
#: cancel of a queued job, crash recovery) counts it exactly once and the same way: the line's
#: newest attempt is stored, ``completed``/``failed``/``generated_tokens`` move with it, and
#: the last line to arrive ends the batch (``completed``, or ``cancelled`` when cancelling).
_BATCH_LUA = """
local function outcome(e)
  if e.status == 'finished' then return 'completed' end
  return 'failed'
end
local function account(payload)
  local raw = redis.call('GET', KEYS[4])
  if not raw then return end
  local ref = cjson.decode(raw)
  local event = cjson.decode(payload)
  local line = tostring(ref.line)
  local prev = redis.call('HGET', ref.results, line)
  local old = nil
  if prev then old = cjson.decode(prev) end
  if old and (old.attempt or 0) > event.attempt then return end
  redis.call('HSET', ref.results, line, payload)
  local now = outcome(event)
  local tokens = #event.tokens
  if old then
    if outcome(old) ~= now then
      redis.call('HINCRBY', ref.batch, outcome(old), -1)
      redis.call('HINCRBY', ref.batch, now, 1)
    end
    tokens = tokens - #old.tokens
  else
    redis.call('HINCRBY', ref.batch, now, 1)
  end
  redis.call('HINCRBY', ref.batch, 'generated_tokens', tokens)
  local counts = redis.call('HMGET', ref.batch, 'completed', 'failed', 'total', 'status')
  local done = tonumber(counts[1] or '0') + tonumber(counts[2] or '0')
  if done >= tonumber(counts[3] or '-1') then
    local t = redis.call('TIME')[1]
    if counts[4] == 'cancelling' then
      redis.call('HSET', ref.batch, 'status', 'cancelled', 'cancelled_at', t)
    elseif counts[4] == 'in_progress' then
      redis.call('HSET', ref.batch, 'status', 'completed', 'finalizing_at', t,
                 'completed_at', t)
    end
  end
  for _, key in ipairs(ref.keep) do redis.call('EXPIRE', key, ref.ttl) end
end
"""
#: A final or error event of an attempt recovery has taken away (KEYS[5] holds the newest
#: such attempt, set in the requeue's own transaction) is dropped: 0 is returned, no number
#: is spent. The check and the append are one script, so no stale final slips in between.
_APPEND_LUA = _BATCH_LUA + """
if ARGV[6] == 'final' or ARGV[6] == 'error' then
  local gone = tonumber(redis.call('GET', KEYS[5]) or '0')
  if tonumber(ARGV[7]) <= gone then return 0 end
end
local seq = redis.call('INCR', KEYS[2])
local payload = ARGV[1] .. seq .. ARGV[2]
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', ARGV[3], payload)
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('PUBLISH', KEYS[3], payload)
if ARGV[6] == 'final' then account(payload) end
return seq
"""


class EventWriter:
    """Writes one attempt's events of one job (XADD MAXLEN ~N + EXPIRE, then PUBLISH)."""

    def __init__(
        self,
        connection: Redis,
        keys: Keys,
        job_id: str,
        attempt: int,
        *,
        maxlen: int = 10000,
        ttl_seconds: int = 86400,
        outage_seconds: float = 300.0,
    ) -> None:
        self._conn = connection
        self._keys = keys
        self.job_id = job_id
        self.attempt = attempt
        self._maxlen = maxlen
        self._ttl = ttl_seconds
        self._outage = outage_seconds
        self._append = connection.register_script(_APPEND_LUA)

    @classmethod
    def for_job(cls, connection: Redis, settings: Settings, job_id: str,
                attempt: int) -> EventWriter:
        """The writer of one attempt of one job with the deployment's bounds (stream length
        and TTL, how long to wait out an outage): every writer is built here."""
        return cls(connection, settings.keys, job_id, attempt, maxlen=settings.stream_maxlen,
                   ttl_seconds=settings.stream_ttl_seconds,
                   outage_seconds=settings.redis_outage_seconds)

    def emit(self, event_type: str, **fields: Any) -> AnyEvent:
        """Build, number and write one event in one round trip; returns it as sent.

        While Redis is unreachable the write is retried (the generation waits) for up to
        ``outage_seconds``. A retry after a reply was lost can append an event twice; readers
        de-duplicate token events by ``(attempt, index)``. A final or error event of an
        attempt recovery took away is not written (returned with ``seq`` 0).
        """
        event = _EVENT_TYPES[event_type](job_id=self.job_id, attempt=self.attempt,
                                         seq=_SEQ_PLACEHOLDER, **fields)
        head, tail = event.model_dump_json().split(_SEQ_TEXT, 1)
        keys = [self._keys.events(self.job_id), self._keys.seq(self.job_id),
                self._keys.channel(self.job_id), self._keys.job_batch(self.job_id),
                self._keys.superseded(self.job_id)]
        args: list[str | int] = [head + '"seq":', tail, STREAM_FIELD, self._maxlen, self._ttl,
                                 event_type, self.attempt]
        seq = int(ride_out(lambda: self._append(keys=keys, args=args), self._outage,
                           "event.append"))
        if seq == 0:
            log.warning("event.superseded", job_id=self.job_id, attempt=self.attempt,
                        type=event_type)
        return event.model_copy(update={"seq": seq})

    def progress(self, stage: str, **fields: Any) -> AnyEvent:
        return self.emit("progress", stage=stage, **fields)

    def error(self, message: str, error_type: str, param: str | None = None) -> AnyEvent:
        return self.emit("error", message=message, error_type=error_type, param=param)

    def final(self, **fields: Any) -> AnyEvent:
        return self.emit("final", **fields)
