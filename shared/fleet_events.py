"""The fleet's event stream (``Keys.fleet_events``): what happened anywhere in the fleet, whoever
saw it, in one bounded Redis Stream.

A worker's log is on its own host, and a worker that died cannot log its death, so the views
that look at the whole fleet from outside (``specfleet top``, ``specfleet monitor
--fleet-events``, the gateway's console) read this stream instead. Each entry is one JSON
record shaped like a log line (``event``, ``timestamp``, ``level`` and the event's fields,
``worker`` and ``model`` among them) under ``STREAM_FIELD``. Its events, written here only:

- ``worker.lost``: a worker declared lost, the jobs it held and those requeued (by whichever
  process swept it, ``shared.recovery``);
- ``worker.host_fallback``: device checkpoints moved to the host (at start-up, ``phase``
  ``reserve``, or during a generation), with the ``devices`` they moved from;
- ``worker.replays``: a generation that restored checkpoints and replayed tokens;
- ``worker.requeued``: jobs a worker put back on their queues itself (its shutdown);
- ``worker.refusal``: a job a worker refused (poisoned, foreign) or rejected at admission;
- ``worker.redis_fault``: an outage of Redis a worker rode out (or gave up on), once over.

A record is written after the happening it reports and never holds the caller up: a write that
fails (Redis away) is dropped with a log line, since the worker's log keeps the event anyway.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from shared.keys import STREAM_FIELD, Keys
from shared.logs import get_logger

#: Entries the stream keeps (about: trimmed approximately).
FLEET_EVENTS_MAXLEN = 10_000
#: Every event name the stream carries.
EVENTS = ("worker.lost", "worker.host_fallback", "worker.replays", "worker.requeued",
          "worker.refusal", "worker.redis_fault")

log = get_logger("fleet")


def fleet_record(event: str, level: str = "warning", **fields: Any) -> dict[str, Any]:
    """A record of ``event`` (one of :data:`EVENTS`) as a log line has it, stamped now."""
    if event not in EVENTS:
        raise ValueError(f"unknown fleet event {event!r} (one of: {', '.join(EVENTS)})")
    return {"event": event, **fields, "level": level,
            "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z")}


def append(connection: Redis, keys: Keys, record: dict[str, Any]) -> None:
    """Add ``record`` to the stream (raises what Redis raises: a caller that must not lose
    it rides an outage out around this)."""
    connection.xadd(keys.fleet_events(), {STREAM_FIELD: json.dumps(record)},
                    maxlen=FLEET_EVENTS_MAXLEN, approximate=True)


def decode(fields: dict[Any, Any] | None) -> dict[str, Any] | None:
    """The record of one stream entry's fields (None: not a record)."""
    raw = (fields or {}).get(STREAM_FIELD.encode()) or (fields or {}).get(STREAM_FIELD)
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("event"), str) else None


class FleetReporter:
    """One worker's writer of the stream: every record carries its name and model, and a
    write that fails is dropped (logged), never raised into the code that reported it."""

    def __init__(self, connection: Redis, keys: Keys, worker: str, model: str) -> None:
        self._conn = connection
        self._keys = keys
        self.worker = worker
        self.model = model

    def report(self, event: str, level: str = "warning", **fields: Any) -> None:
        record = fleet_record(event, level, worker=self.worker, model=self.model, **fields)
        try:
            append(self._conn, self._keys, record)
        except RedisError as exc:
            log.warning("fleet.event_dropped", fleet_event=event, error_type=type(exc).__name__,
                        error=str(exc))
